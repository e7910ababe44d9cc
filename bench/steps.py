"""One step of the lesson as the benchmark ladder runs it: python -m bench.steps N

  python -m bench.steps 7      # step 7: its code, how rung 7 is composed, what it measured
  python -m bench.steps 11     # stage 02's DDP lines (12: stage 03's FSDP2 lines)

Step N is rung N of bench/ladder.py. For it this prints three things:
- its code: the lines of 01_opt_single_gpu.py tagged "NEW (step N)" (or "NEW (steps 3-5, 8)" and the like), each
  with the lines of 00_orig.py it replaces and a little context, as a diff with both files' line numbers; steps 11
  and 12 are the lines tagged "NEW (DDP)" in 02_opt_multi_gpu_ddp.py and "NEW (FSDP)" in 03_opt_multi_gpu_fsdp.py,
  against the stage before;
- what rung N takes from 00 and what from 01, from the table bench/rungs.py composes by (bench/rung_table.py);
- the rung's measured row in every results folder that holds one (bench/results/*/rows/rung-NN.json).

It imports no torch, so it answers at once.

Exit code 0; 2 with one line for a step that does not exist.
"""

import argparse
import difflib
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # cli, wherever the script is started from

import cli  # noqa: E402  (imports no torch)
from bench import rung_table  # noqa: E402  (neither)

RESULTS = ROOT / "bench" / "results"
CONTEXT_LINES = 2  # lines shown around each changed block, as grep -C 2
# The tag a multi-process rung's lines carry in its stage (steps 1-10 carry their number).
STAGE_TAGS = {11: "DDP", 12: "FSDP"}
TAG = re.compile(r"#\s*NEW \(([^)]*)\)")


def rungs_tables():
    """The ladder's table of rungs (bench/rung_table.py) by name: the stages, CHANGES, RUNG_PARTS,
    MULTI_PROCESS_RUNGS."""
    return {name: getattr(rung_table, name) for name in ("STAGE_00", "STAGE_01", "STAGE_02", "STAGE_03", "CHANGES",
                                                          "RUNG_PARTS", "MULTI_PROCESS_RUNGS")}


# ---------------------------------------------------------------------------------------------
# Tagged lines
# ---------------------------------------------------------------------------------------------

def tag_steps(label):
    """The steps a tag's label names: 'step 7' -> {7}, 'steps 3-5, 8' -> {3, 4, 5, 8}, 'step 5, float16 only' -> {5},
    'DDP' -> {11}; a label that names no step ('accumulation') -> set()."""
    for number, name in STAGE_TAGS.items():
        if label.strip() == name:
            return {number}
    match = re.match(r"\s*steps?\s+(.*)", label)
    if not match:
        return set()
    steps = set()
    for part in match[1].split(","):
        numbers = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not numbers:
            break  # a qualifier ('float16 only') ends the list
        steps.update(range(int(numbers[1]), int(numbers[2] or numbers[1]) + 1))
    return steps


def code_of(line):
    """A line without its comment and string literals: what its brackets are counted on."""
    line = re.sub(r"'(?:\\.|[^'\\])*'|\"(?:\\.|[^\"\\])*\"", '""', line)
    return line.split("#", 1)[0]


def open_brackets(line):
    code = code_of(line)
    return sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")


def statement_end(lines, start, limit=12):
    """The index of the last line of the statement that begins at `start` (its brackets closed)."""
    depth, index = 0, start
    while index < len(lines) and index < start + limit:
        depth += open_brackets(lines[index])
        if depth <= 0:
            return index
        index += 1
    return min(index, len(lines) - 1)


def tagged_blocks(lines, step):
    """The indices of the lines that step `step`'s tags mark in `lines`: a tagged line of code and the rest of its
    statement; a tag on a comment line of its own marks the comment (and the comment lines under it) and the
    statement that follows it. `step` None: the lines that any tag marks, whichever step or change it names."""
    marked = set()
    for index, line in enumerate(lines):
        tags = TAG.findall(line)
        if not tags or (step is not None and not any(step in tag_steps(label) for label in tags)):
            continue
        if line.lstrip().startswith("#"):
            end = index
            while end + 1 < len(lines) and lines[end + 1].lstrip().startswith("#"):
                end += 1
            marked.update(range(index, end + 1))
            if end + 1 < len(lines) and lines[end + 1].strip():  # the code the comment explains
                marked.update(range(end + 1, statement_end(lines, end + 1) + 1))
        else:
            marked.update(range(index, statement_end(lines, index) + 1))
    return marked


def diff_view(old_lines, new_lines, step, context=CONTEXT_LINES):
    """Step `step`'s lines in the new file beside the old file's lines they replace, as groups of
    (mark, old line number, new line number, text): '-' an old line its change removes, '+' a new line of that
    change, '~' a line that another step (or another change, such as accumulation) adds or replaces, ' ' a line
    both files share. A change is a difflib hunk whose new lines hold a line the step's tags mark; inside it, a
    line no tag marks goes with the nearest tagged line above it in the hunk (below it, where none is above): an
    `if` tagged step 4 takes its body along."""
    marked = tagged_blocks(new_lines, step)
    others = tagged_blocks(new_lines, None) - marked

    def owned(j, j1, j2):
        """Whether new line j, in the hunk of new lines j1 to j2, is the step's."""
        for near in [*range(j, j1 - 1, -1), *range(j + 1, j2)]:
            if near in marked or near in others:
                return near in marked
        return True

    def replaced_by_the_step(i, j1, j2):
        """Whether old line i, removed in the hunk of new lines j1 to j2, is the step's to replace: the hunk's new
        line most like it is the step's (a hunk can hold two steps' changes side by side)."""
        if all(owned(j, j1, j2) for j in range(j1, j2)):
            return True
        likeness = {j: difflib.SequenceMatcher(None, old_lines[i].strip(), new_lines[j].strip()).ratio()
                    for j in range(j1, j2)}
        return owned(max(likeness, key=likeness.get), j1, j2)

    opcodes = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False).get_opcodes()
    chosen = [(i1, i2, j1, j2) for tag, i1, i2, j1, j2 in opcodes
              if tag != "equal" and marked.intersection(range(j1, j2))]
    core = set(marked).union(*(range(j1, j2) for _, _, j1, j2 in chosen))
    window = {near for index in core for near in range(index - context, index + context + 1)}
    items = []  # (where it stands in the new file, then the item): a removed line stands where its change begins
    for tag, i1, i2, j1, j2 in opcodes:
        if (i1, i2, j1, j2) in chosen:
            items += [(j1, ("-" if replaced_by_the_step(i, j1, j2) else "~", i + 1, None, old_lines[i]))
                      for i in range(i1, i2)]
            items += [(j, ("+" if owned(j, j1, j2) else "~", None, j + 1, new_lines[j])) for j in range(j1, j2)]
        elif tag == "equal":
            items += [(j, (" ", i1 + j - j1 + 1, j + 1, new_lines[j])) for j in range(j1, j2) if j in window]
        else:  # another change's new lines near the step's: shown, marked as not the step's
            items += [(j, ("~", None, j + 1, new_lines[j])) for j in range(j1, j2) if j in window]
    groups, last = [], None
    for where, item in items:
        if last is None or where > last + 1:  # lines left out between: a new group
            groups.append([])
        groups[-1].append(item)
        last = where
    return groups


def render_groups(groups, old_name, new_name):
    lines = []
    for group in groups:
        olds = [item[1] for item in group if item[1] is not None]
        news = [item[2] for item in group if item[2] is not None]
        where = [f"{name} {min(found)}-{max(found)}" for name, found in ((old_name, olds), (new_name, news)) if found]
        lines += ["", f"@@ {', '.join(where)} @@"]
        lines += [f"{mark} {old or '':>4} {new or '':>4}  {text}".rstrip() for mark, old, new, text in group]
    return lines


# ---------------------------------------------------------------------------------------------
# The rung: its parts, its rows
# ---------------------------------------------------------------------------------------------

def step_list(steps, changes):
    """'step 8 (torch.compile)', 'steps 5 (autocast...) and 8 (torch.compile)'."""
    named = [f"{step} ({changes[step]})" for step in steps]
    return ("step " if len(named) == 1 else "steps ") + (" and ".join([", ".join(named[:-1]), named[-1]])
                                                          if len(named) > 1 else named[0])


def composition(number, tables):
    """Lines on what rung `number` takes from 00 and from 01, from bench/rungs.py's RUNG_PARTS."""
    stage00, stage01, changes = tables["STAGE_00"], tables["STAGE_01"], tables["CHANGES"]
    if number in tables["MULTI_PROCESS_RUNGS"]:
        script = tables["MULTI_PROCESS_RUNGS"][number]
        return [f"Rung {number} is not composed: bench/ladder.py runs {script} as it is, under torchrun on every "
                "visible GPU, at the ladder's settings."]
    plus = f", rung {number - 1} plus step {number}" if number else ""
    lines = [f"How bench/rungs.py composes rung {number}{plus} (its table RUNG_PARTS):"]
    sources = {stage01: [], stage00: [], "bench/rungs.py itself": []}
    for name, part in tables["RUNG_PARTS"].items():
        first, steps = part["from_01"], part["steps"]
        taken = [step for step in steps if step <= number]
        later = [step for step in steps if step > number]
        if first is None:
            note = f"; {step_list(taken, changes)} on" if taken else ""
            note += f"; {step_list(later, changes)} not yet" if later else ""
            sources["bench/rungs.py itself"].append(f"{name}: {part['names']}{note}")
        elif number >= first:
            note = f"; without {step_list(later, changes)} until {'its rung' if len(later) == 1 else 'their rungs'}" \
                if later else ""
            sources[stage01].append(f"{name}: {part['names']} (01's from rung {first} on){note}")
        else:
            note = f"; {step_list(taken, changes)} put into it by bench/rungs.py" if taken else ""
            sources[stage00].append(f"{name}: {part['names']} (01's from rung {first} on){note}")
    for source, parts in sources.items():
        if parts:
            lines += [f"  from {source}:", *(f"    {part}" for part in parts)]
    return lines


def results_folders(path):
    """The results folders under `path` (a folder of them, such as bench/results, or one results folder)."""
    path = Path(path)
    if (path / "rows").is_dir():
        return [path]
    return sorted(folder for folder in path.iterdir() if (folder / "rows").is_dir()) if path.is_dir() else []


def read_row(folder, number):
    path = Path(folder) / "rows" / f"rung-{number:02d}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def shown_path(path):
    path = Path(path).resolve()
    return (path.relative_to(ROOT) if path.is_relative_to(ROOT) else path).as_posix()


def measured(number, results):
    """Lines on rung `number`'s row in each results folder under `results` that holds one."""
    lines = []
    for folder in results_folders(results):
        row = read_row(folder, number)
        if row is None:
            continue
        context = row.get("context") or {}
        settings = context.get("settings") or {}
        date = (row.get("measured_at") or "").split(" ")[0]
        where = f"  {shown_path(folder)}: {context.get('device_name', '?')}, {date}: "
        if not row.get("tokens_per_sec"):
            lines.append(where + f"failed ({row.get('error') or 'no figure'})")
            continue
        previous = read_row(folder, number - 1) if number > 0 else None
        ratio = (f", {row['tokens_per_sec'] / previous['tokens_per_sec']:.2f}x rung {number - 1}"
                 if previous and previous.get("tokens_per_sec") else "")
        reserved = (f", {row['peak_reserved_gb']:.2f} GiB reserved" if row.get("peak_reserved_gb") is not None
                    else "")
        how = [f"batch {row.get('batch_size')}", str(row.get("precision")), f"PyTorch {context.get('torch')}"]
        if settings.get("options"):
            how.append(f"--option {settings['options']}")
        if settings.get("context_length"):
            how.append(f"context {settings['context_length']:,}")
        if settings.get("tiny"):
            how.append("--tiny")
        lines.append(where + f"{row['tokens_per_sec']:,.0f} tok/s{ratio}{reserved} ({', '.join(how)})")
    if not lines:
        return [f"Measured: no results folder under {shown_path(results)} holds rung {number} "
                f"(python bench/ladder.py --rungs {number} measures it)."]
    return ["Measured by bench/ladder.py (tok/s: the median of its timing windows; reserved: the peak, GiB):", *lines]


# ---------------------------------------------------------------------------------------------
# The whole page
# ---------------------------------------------------------------------------------------------

def stages_of(number, tables):
    """(the stage before, the stage whose tagged lines are step `number`'s)."""
    if number == 11:
        return tables["STAGE_01"], tables["STAGE_02"]
    if number == 12:
        return tables["STAGE_02"], tables["STAGE_03"]
    return tables["STAGE_00"], tables["STAGE_01"]


def describe(number, results=RESULTS, root=ROOT):
    """Step `number`'s page, as lines."""
    tables = rungs_tables()
    label = STAGE_TAGS.get(number, f"step {number}")
    lines = [f"Step {number}: {tables['CHANGES'][number]} (rung {number} of bench/ladder.py)", ""]
    if number == 0:
        lines.append(f"The baseline: {tables['STAGE_00']} as it is; each later step adds its lines to it.")
    else:
        old_name, new_name = stages_of(number, tables)
        old_lines = (root / old_name).read_text(encoding="utf-8").splitlines()
        new_lines = (root / new_name).read_text(encoding="utf-8").splitlines()
        groups = diff_view(old_lines, new_lines, number)
        lines += [f'The lines of {new_name} tagged "NEW ({label})", beside what they replace in {old_name}.',
                  f"'-': a line of {old_name} that the step replaces, '+': the step's lines in {new_name}, '~': a "
                  f"line another step adds or replaces, ' ': a line both files share; the columns are the "
                  "line numbers in the two files."]
        lines += render_groups(groups, old_name, new_name) if groups else [f"  (no line of {new_name} is tagged)"]
    lines += ["", *composition(number, tables), "", *measured(number, results)]
    return lines


def parse_step(text):
    steps = rungs_tables()["CHANGES"]
    if not re.fullmatch(r"\s*\d+\s*", text) or int(text) not in steps:
        raise argparse.ArgumentTypeError(f"there is no step {text!r}: the steps are {min(steps)} (the baseline) to "
                                         f"{max(steps)} (1-10: stage 01's, 11: DDP, 12: FSDP2)")
    return int(text)


def build_parser():
    parser = cli.OneLineParser(prog="python -m bench.steps", description=__doc__, allow_abbrev=False,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", type=parse_step, help="the step (rung) number, 0 to 12")
    parser.add_argument("--results", default=RESULTS, metavar="PATH",
                        help="a folder of results folders, or one results folder (default: bench/results)")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if not Path(args.results).is_dir():
        parser.error(f"--results {args.results}: no such folder")
    try:
        print("\n".join(describe(args.step, args.results)), flush=True)
    except BrokenPipeError:  # the reader stopped early (| head): not an error of this command
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
