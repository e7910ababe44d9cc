"""A results folder as a folder of rows: what the ladder and bench/stages.py measured is the files in rows/.

Each measured item (a rung, a --check-scripts run, a stage run) is one JSON file, `rows/<name>.json`, written
atomically as the item ends, with its figures and its context: where (device, driver, CUDA, PyTorch, Python), with
which settings, and by which command (start time, command line, code revision). A part of a table is whatever rows
are there; missing is what has no file; measuring again replaces one file; a run cut off writes none; a command
measured otherwise is refused by comparing its context with each row's. ladder.md/json/png (bench/report.py) and
stages.md/json (bench/stages.py) are rendered from the rows present.
"""

import json
from pathlib import Path

from data import files
from failures import UsageError

FOLDER = "rows"
MISSING = "missing"  # --rungs / --runs missing: the items without a row file


def write_row(folder, name, row):
    """rows/<name>.json in `folder`, replacing the one an earlier command wrote (atomically: a reader sees either)."""
    files.write_json(Path(folder) / FOLDER / f"{name}.json", row)


def read_rows(folder, rendered):
    """{name: row} of every row file in `folder`, in name order; a UsageError naming a file that is not a row, or for
    a folder that holds the `rendered` file (ladder.json, stages.json) of an older version but no rows."""
    if not (Path(folder) / FOLDER).is_dir() and (Path(folder) / rendered).exists():
        raise UsageError(f"{folder} holds a {rendered} but no {FOLDER}/ (an older version's): move it away, or choose "
                         "another --out")
    found = {}
    for path in sorted((Path(folder) / FOLDER).glob("*.json")):
        try:
            row = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(row.get("context"), dict):
                raise ValueError("it has no context")
        except (OSError, ValueError, AttributeError) as err:
            raise UsageError(f"{path} is not a row of this folder ({err}): move it away") from None
        found[path.stem] = row
    return found


def differences(there, here, matched):
    """What differs between two contexts, as 'what: X there, Y here'; `matched` maps each compared key (a dotted
    path such as 'settings.steps') to the name a user knows it by."""
    def value(context, key):
        for part in key.split("."):
            context = (context or {}).get(part)
        return context

    def shown(key, item):
        own = key.endswith(("batch_size", "context_length"))  # None: the stages' own, not an absent value
        return ("the stages' own" if own else "none") if item is None else str(item)

    return [f"{name}: {shown(key, value(there, key))} there, {shown(key, value(here, key))} here"
            for key, name in matched.items() if value(there, key) != value(here, key)]


def refuse_a_different_part(found, context, matched, folder, what):
    """A UsageError when `context`, that of the command about to measure, differs from a row's already in `folder`."""
    for name, row in found.items():
        differ = differences(row["context"], context, matched)
        if differ:
            raise UsageError(f"{Path(folder) / FOLDER / name}.json holds {what} measured otherwise "
                             f"({'; '.join(differ)}): a table holds only rows measured alike; run with the same "
                             "settings or choose another --out")


def commands(found):
    """The commands that measured the rows, oldest first: {'started_at', 'command', 'git', 'rows': [names]}."""
    by_command = {}
    for name, row in found.items():
        command = row["context"]["command"]
        by_command.setdefault((command["started_at"], command["command"]), {**command, "rows": []})["rows"].append(name)
    return [by_command[key] for key in sorted(by_command)]
