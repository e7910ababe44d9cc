"""Write results folders' measurements into docs/results.md and the README, or check that they still show them.

  python bench/readme_tables.py bench/results/nvidia-h200           # fill docs/results.md and the README
  python bench/readme_tables.py bench/results/nvidia-h200 --check   # exit 1 where they differ

The folder is what bench/ladder.py wrote (its rows/) and, in its stages/ subfolder, what bench/stages.py wrote
(stages/rows/). Into docs/results.md, from the ladder: the "measured here" column of the table of the ten
optimizations (median tok/s, peak reserved GiB and the speed-up over the step above, for steps 0 to 10) and a
paragraph under it with the GPU, the versions, the dates, step 10 over step 0, the steps that did not pay and rungs
11 and 12; where the rows have ceilings (a GPU whose roofline docs/roofline/ ships), a table of each step beside its
ceiling. From the stages: a table of each run's Avg tok/sec, MFU, memory and wall clock split into phases.
Into the README: the results at a glance, from every folder under bench/results/ measured at the stages' own
settings (00, 01 and 02 of each GPU: the ladder's tok/s, MFU and memory, and the stages' whole runs).
Nothing is typed by hand, so a figure is always one of a folder's, and --check (run by the test suite on the folder
the results page names) notices a page edited by hand or a folder measured again.

Only a ladder at the stages' own settings fills the table: not --tiny, gpt2-small, each stage's own batch and
context, no --option (exit code 2 for another, naming what differs).
"""

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import cli  # noqa: E402  (needs the path above; imports no torch)
import failures
from bench import report, rows  # noqa: E402
from bench.stages import collect as stage_collect  # noqa: E402
from bench.stages import tables as stage_tables  # noqa: E402
from failures import UsageError  # noqa: E402

README = ROOT / "README.md"
PAGE = ROOT / "docs" / "results.md"  # every table; the README shows the glance table
RESULTS = ROOT / "bench" / "results"
TABLE_HEADING = "## The ten optimizations of stage 01"
STEPS = range(11)  # the table's rows: step 0 (the baseline) to step 10 (01 as it is)
PAYS = 1.02  # a step that gains less than 2% over the step above "did not pay" on this GPU
NOT_MEASURED = "no GPU run yet"
LADDER_BLOCK = ("<!-- ladder results: bench/readme_tables.py writes this paragraph -->", "<!-- /ladder results -->")
STAGES_BLOCK = ("<!-- stage results: bench/readme_tables.py writes this section -->", "<!-- /stage results -->")
GLANCE_BLOCK = ("<!-- at a glance: bench/readme_tables.py writes this table -->", "<!-- /at a glance -->")
GLANCE_PLACEHOLDER = "No GPU measured yet: `python bench/readme_tables.py bench/results/<gpu>` writes this table."
CEILINGS_BLOCK = ("<!-- measured against the ceilings: bench/readme_tables.py writes this table -->",
                  "<!-- /measured against the ceilings -->")
CEILINGS_PLACEHOLDER = ("**Measured against the ceilings:** no ladder measured on a GPU whose roofline "
                        "`docs/roofline/` ships (or with `--roofline`) yet.")
LADDER_PLACEHOLDER = ("**Measured here:** no GPU run yet. `python bench/readme_tables.py bench/results/<gpu>` writes "
                      "the ladder of a results folder into this column and its stages into [the stages end to end]"
                      "(#the-stages-end-to-end-and-on-the-cpu).")
STAGES_PLACEHOLDER = ("**The stages end to end on a GPU:** no GPU run yet (`python bench/stages.py`, then "
                      "`python bench/readme_tables.py bench/results/<gpu>`).")


def read_folder(folder):
    """(ladder report, stages report or None) of a results folder, rendered from its rows; a UsageError for a folder
    the results page cannot show (no rows, or a ladder measured at other settings than the stages' own)."""
    folder = Path(folder)
    found = rows.read_rows(folder, "ladder.json")
    if not any(name.startswith("rung-") for name in found):
        raise UsageError(f"{folder} holds no ladder rows: measure them first (python bench/ladder.py, "
                         "bench/README.md says how in parts)")
    ladder = report.collect(found)
    settings = ladder.get("settings") or {}
    report.attach_ceilings(ladder, report.find_roofline(folder, None, ladder.get("device_name"), settings,
                                                        say=lambda line: None))  # the ladder.md's own ceilings
    other = [what for what, differs in (
        ("--tiny", settings.get("tiny")), (f"--model {settings.get('model')}", settings.get("model") != "gpt2-small"),
        (f"--batch-size {settings.get('batch_size')}", settings.get("batch_size") is not None),
        (f"--context-length {settings.get('context_length')}", settings.get("context_length") is not None),
        (f"--option {settings.get('options')}", bool(settings.get("options")))) if differs]
    if other:
        raise UsageError(f"{folder} was measured with {', '.join(other)}: the results' tables show the stages at their "
                         "own settings (python bench/ladder.py with none of these)")
    stage_rows = rows.read_rows(folder / "stages", "stages.json")
    stages = stage_collect(stage_rows) if stage_rows else None
    if stages is not None and (stages.get("tiny") or stages.get("device_name") != ladder.get("device_name")):
        raise UsageError(f"{folder}/stages was measured {'with --tiny' if stages.get('tiny') else 'on another device'}"
                         ": the results page sets the stages beside the ladder of the same GPU")
    return ladder, stages


# ---------------------------------------------------------------------------------------------
# What the results page and the README show
# ---------------------------------------------------------------------------------------------

def ratio(row, name="step"):
    """The speed-up over the row above, naming that row's step (or rung) where it is not the one just before."""
    if not row.get("speedup_vs_previous"):
        return ""
    over = "" if row.get("previous_rung") == row["rung"] - 1 else f" over {name} {row['previous_rung']}"
    return f" ({row['speedup_vs_previous']:.2f}×{over})"


def measured_cell(row):
    """'143,210, 15.20 (1.12×)': median tok/s, peak reserved GiB, speed-up over the step above."""
    if row is None:
        return "not measured yet"
    if row.get("error"):
        return "failed (see the ladder)"
    reserved = "n/a" if row.get("peak_reserved_gb") is None else f"{row['peak_reserved_gb']:.2f}"
    return f"{row['tokens_per_sec']:,.0f}, {reserved}" + ratio(row)


def measured_dates(rows):
    dates = sorted(row["measured_at"][:10] for row in rows if row.get("measured_at"))
    return "" if not dates else dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"


def ladder_paragraph(ladder, folder):
    rows = {row["rung"]: row for row in ladder["rungs"]}
    measured = {number: row for number, row in rows.items() if row.get("tokens_per_sec") and not row.get("error")}
    sentences = [
        f"**Measured here:** {ladder['device_name']}"
        + (f" ({ladder['gpu_count']} visible)" if (ladder.get("gpu_count") or 1) > 1 else "") + ", PyTorch "
        f"{ladder['torch']}, CUDA {ladder.get('cuda') or 'n/a'}, driver {ladder.get('driver') or 'n/a'}, "
        f"{measured_dates(ladder['rungs'])}, by `bench/ladder.py` into `{report.repository_path(folder)}/` (its "
        "`ladder.md` gives each row's spread, MFU, ceiling and the commands). Each cell: the median tok/s of the timed "
        "steps, the peak reserved GiB after the warm-up and, in brackets, the speed-up over the step above."]
    if 0 in measured and 10 in measured:
        mfu = measured[10].get("mfu")
        sentences.append(f"All ten steps: {measured[10]['tokens_per_sec'] / measured[0]['tokens_per_sec']:.2f}× "
                         "step 0 (the original tutorial: 11.35× on its A100)"
                         + (f"; step 10 at {mfu:.1%} MFU." if mfu is not None else "."))
    idle = [f"step {number} ({report.SHORT_NAMES[number]}) {row['speedup_vs_previous']:.2f}×" for number, row
            in sorted(measured.items()) if number in STEPS and 0 < (row.get("speedup_vs_previous") or 0) < PAYS]
    if idle:
        sentences.append(f"Did not pay on this GPU (under {PAYS - 1:.0%} over the step above): {', '.join(idle)}.")
    failed = [f"{'step' if number in STEPS else 'rung'} {number}" for number, row in sorted(rows.items())
              if row.get("error")]
    if failed:
        sentences.append(f"Failed: {', '.join(failed)} (the ladder's rows say why).")
    beyond = []
    for number in (11, 12):
        if number in measured:
            gpus = measured[number].get("world_size") or 1
            beyond.append(f"rung {number} ({report.SHORT_NAMES[number]} on {gpus} GPU{'s' if gpus > 1 else ''}) "
                          f"{measured[number]['tokens_per_sec']:,.0f} tok/s"
                          + ratio(measured[number], "rung"))
    if beyond:
        sentences.append("Beyond the table: " + "; ".join(beyond) + ".")
    return " ".join(sentences)


def ceilings_table(ladder):
    """Steps 0-10 as measured beside the ceilings cost_model/roofline.py models for the same GPU, and each step's
    speed-up beside its ceiling's."""
    measured = {row["rung"]: row for row in ladder["rungs"] if row["rung"] in STEPS and not row.get("error")
                and row.get("tokens_per_sec") and row.get("ceiling_tok_per_sec")}
    if not measured:
        return CEILINGS_PLACEHOLDER
    lines = [f"**Measured against the ceilings** on the {ladder['device_name']} (the ladder above, beside the ceilings "
             f"of `{(ladder.get('roofline') or {}).get('path')}`). A step whose measured speed-up falls short of its "
             "ceiling's left the GPU idle or below its peak for part of the time it saved; one that exceeds it also "
             "removed time the model does not count (launches, Python, gaps between kernels).", "",
             "| step | change | ceiling, tok/s | measured, tok/s | measured / ceiling | ceiling × step above | "
             "measured × step above |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for number, row in sorted(measured.items()):
        above = measured.get(number - 1)
        ratios = ([f"{row['ceiling_tok_per_sec'] / above['ceiling_tok_per_sec']:.2f}×",
                   f"{row['tokens_per_sec'] / above['tokens_per_sec']:.2f}×"] if above else ["", ""])
        lines.append(f"| {number} | {report.SHORT_NAMES[number]} | {row['ceiling_tok_per_sec']:,.0f} | "
                     f"{row['tokens_per_sec']:,.0f} | {row['fraction_of_ceiling']:.0%} | "
                     + " | ".join(ratios) + " |")
    return "\n".join(lines)


def stages_section(stages, folder):
    runs = {row["run"]: row for row in stages["runs"]}
    dates = sorted(part["date"][:10] for part in stages["parts"])
    cuda = f"CUDA {stages.get('cuda') or 'n/a'}"
    cuda = "" if cuda in stages["device"] else f", {cuda}"  # the device's description may name it already
    when = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    lines = [f"**The stages end to end** on the {stages['device']}, PyTorch {stages['torch']}{cuda}, {when}, "
             f"by `bench/stages.py` into `{report.repository_path(folder)}/stages/` (its `stages.md` has the "
             "commands and the logs). Each run with the stage's own defaults.", "", *stage_tables(stages)]
    speeds = {name: row.get("avg_tok_per_sec") for name, row in runs.items() if not row.get("error")}
    against = [f"{later} over {earlier}: {speeds[later] / speeds[earlier]:.3f}× ({target})"
               for later, earlier, target in (("01-warm", "00", "target: at least 12×"),
                                              ("02", "01-warm", "target: within 2%"))
               if speeds.get(later) and speeds.get(earlier)]
    if against:
        lines += ["", "Avg tok/sec, " + "; ".join(against) + "."]
    return "\n".join(lines)


def glance_folders(results=RESULTS):
    """The results folders the README's glance table draws from: each GPU's ladder at the stages' own settings."""
    found = []
    for folder in sorted(Path(results).iterdir()) if Path(results).is_dir() else []:
        try:
            found.append((folder, *read_folder(folder)))
        except UsageError:
            continue  # an --option, --batch-size or --tiny folder: not the stages as they are
    return found


def glance_table(folders):
    """00, 01 and 02 of every GPU in one table: the ladder's steady-state tok/s, MFU and peak memory (rungs 0, 10
    and 11), and the wall clock of the stages' whole default runs where bench/stages.py measured them."""
    if not folders:
        return GLANCE_PLACEHOLDER
    lines = ["| GPU (PyTorch, date) | stage | tok/s, steady state | MFU (against the peak of) | peak reserved GiB | "
             "the whole default run |", "| --- | --- | ---: | ---: | ---: | --- |"]
    speedups = []
    for folder, ladder, stages in folders:
        runs = {row["run"]: row for row in (stages or {}).get("runs", []) if not row.get("error")}
        rungs = {row["rung"]: row for row in ladder["rungs"] if row.get("tokens_per_sec") and not row.get("error")}
        gpu = ladder["device_name"].removeprefix("NVIDIA ")
        for rung, stage, names in ((0, "00", ("00",)), (10, "01", ("01-warm", "01-cold")), (11, "02", ("02",))):
            row = rungs.get(rung)
            if row is None:
                continue
            if rung == 11:
                stage += f", {row.get('world_size') or 1} process" + ("es" if (row.get("world_size") or 1) > 1 else "")
            wall = [f"{runs[name]['command_seconds']:.1f} s" + {"01-warm": " (compile cache warm)", "01-cold":
                    " (empty)", "02": " (empty cache)"}.get(name, "") for name in names if name in runs]
            if names == ("00",) and "00" in runs and "--max-steps" in runs["00"]["command"]:
                wall = [f"{wall[0]} for its first {runs['00']['steps']} steps (`--max-steps {runs['00']['steps']}`)"]
            mfu = "n/a" if row.get("mfu") is None else f"{row['mfu']:.1%}" + (f" ({row['precision']})" if row.get("precision")
                                                                      else "")
            reserved = "n/a" if row.get("peak_reserved_gb") is None else f"{row['peak_reserved_gb']:.2f}"
            whole_runs = [{"measured_at": part["date"]} for part in (stages or {}).get("parts", [])
                          if set(part["runs"]) & {name for name in names if name in runs}]
            lines.append(f"| {gpu} ({ladder['torch']}, {measured_dates([row, *whole_runs])}) | {stage} | "
                         f"{row['tokens_per_sec']:,.0f} | {mfu} | {reserved} | {', '.join(wall) or 'not measured yet'} |")
        if 0 in rungs and 10 in rungs:
            speedups.append(f"{rungs[10]['tokens_per_sec'] / rungs[0]['tokens_per_sec']:.2f}x on the {gpu}")
    paths = ", ".join(f"`{report.repository_path(folder)}`" for folder, _, _ in folders)
    lines += ["", f"01 over 00, steady state: {'; '.join(speedups)}. From {paths} (bench/ladder.py, bench/stages.py)."
              + bytecode_note(folders)]
    return "\n".join(lines)


def listed(names):
    """'a', 'a and b', 'a, b and c'."""
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]]))


def bytecode_note(folders):
    """Which whole runs imported PyTorch from its cached bytecode and which compiled it from source (seconds more of
    start-up: docs/measuring.md), as each run recorded it; runs that did not record it are left out."""
    cached, from_source = [], []
    for _, ladder, stages in folders:
        runs = {True: [], False: []}
        for row in (stages or {}).get("runs", []):
            flag = (row.get("wall_clock_s") or {}).get("imports compiled from source")
            if flag is not None:
                runs[flag].append(row["run"])
        gpu = ladder["device_name"].removeprefix("NVIDIA ")
        cached += [f"the {gpu}'s {listed(runs[False])}"] if runs[False] else []
        from_source += [f"the {gpu}'s {listed(runs[True])}"] if runs[True] else []
    if not cached and not from_source:
        return ""
    said = [f"PyTorch's bytecode (its `.pyc` files) was cached for {'; '.join(cached)}"] if cached else []
    said += [f"{'not' if cached else 'PyTorch had no bytecode cache'} for {'; '.join(from_source)}, whose imports "
             "compiled its Python first"] if from_source else []
    return (f" Start-up: {', '.join(said)}; without that cache imports take seconds more "
            "([docs/measuring.md](docs/measuring.md#reading-the-log)). The other runs did not record it.")


# ---------------------------------------------------------------------------------------------
# The pages' text
# ---------------------------------------------------------------------------------------------

def _table_rows(text):
    """{step: (start, end) of the row's line} of the first table under TABLE_HEADING."""
    start = text.index(TABLE_HEADING)
    rows = {}
    for match in re.finditer(r"^\| (\d+) \|.*$", text[start:], flags=re.MULTILINE):
        if rows and int(match.group(1)) != max(rows) + 1:
            break
        rows[int(match.group(1))] = (start + match.start(), start + match.end())
        if len(rows) == len(STEPS):
            break
    if sorted(rows) != list(STEPS):
        raise ValueError(f"the results page: the table under '{TABLE_HEADING}' has no rows for steps 0 to 10")
    return rows


def measured_cells(text):
    """{step: the text of its "measured here" cell} as the results page has them."""
    return {step: text[start:end].rstrip(" |").rsplit(" | ", 1)[1] for step, (start, end) in _table_rows(text).items()}


def _with_cells(text, cells):
    for step, (start, end) in sorted(_table_rows(text).items(), reverse=True):
        head = text[start:end].rstrip(" |").rsplit(" | ", 1)[0]
        text = text[:start] + f"{head} | {cells[step]} |" + text[end:]
    return text


def block(text, markers):
    begin, end = markers
    first, last = text.find(begin), text.find(end)
    if first < 0 or last < first:
        raise ValueError(f"the page has no block between '{begin}' and '{end}'")
    return text[first + len(begin):last].strip("\n")


def _with_block(text, markers, body):
    begin, end = markers
    return text[:text.index(begin) + len(begin)] + "\n" + body + "\n" + text[text.index(end):]


def filled(text, ladder, stages, folder):
    """The results page's text with the folder's measurements in the table, the paragraph under it and the stages."""
    rows = {row["rung"]: row for row in ladder["rungs"]}
    text = _with_cells(text, {step: measured_cell(rows.get(step)) for step in STEPS})
    text = _with_block(text, LADDER_BLOCK, ladder_paragraph(ladder, folder))
    text = _with_block(text, CEILINGS_BLOCK, ceilings_table(ladder))
    return _with_block(text, STAGES_BLOCK, stages_section(stages, folder) if stages else STAGES_PLACEHOLDER)


def unfilled(text):
    """The results page as it reads before any GPU run (what the suite checks while no folder is named)."""
    text = _with_cells(text, {step: NOT_MEASURED for step in STEPS})
    text = _with_block(_with_block(text, LADDER_BLOCK, LADDER_PLACEHOLDER), CEILINGS_BLOCK, CEILINGS_PLACEHOLDER)
    return _with_block(text, STAGES_BLOCK, STAGES_PLACEHOLDER)


def named_folder(text):
    """The results folder the results page's ladder paragraph names, or None before any GPU run."""
    match = re.search(r"into `([^`]+)/`", block(text, LADDER_BLOCK))
    return ROOT / match.group(1) if match else None


def differences(text, expected):
    """Lines naming what differs between the results page's text and the expected one."""
    found = [f"step {step}: the page shows '{shown}', the folder gives '{measured_cells(expected)[step]}'"
             for step, shown in measured_cells(text).items() if shown != measured_cells(expected)[step]]
    for markers, what in ((LADDER_BLOCK, "the paragraph under the table"), (CEILINGS_BLOCK, "the table beside the "
                          "roofline's ceilings"), (STAGES_BLOCK, "the stages end to end")):
        if block(text, markers) != block(expected, markers):
            found.append(f"{what} differs from what the folder gives")
    return found


def main(argv=None):
    parser = cli.OneLineParser(prog="bench/readme_tables.py", description=__doc__, allow_abbrev=False,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a results folder: bench/results/<gpu> (its rows/ and stages/rows/)")
    parser.add_argument("--check", action="store_true", help="change nothing: exit 1 where a page differs")
    parser.add_argument("--page", default=str(PAGE), help="the results page to fill or check (default: docs/results.md)")
    parser.add_argument("--readme", default=str(README), help="the README whose glance table to fill or check "
                                                              "(default: README.md)")
    parser.add_argument("--results", default=str(RESULTS), help="the folder of results folders the glance table "
                                                                "draws from (default: bench/results)")
    args = parser.parse_args(argv)
    try:
        ladder, stages = read_folder(args.folder)
        text = Path(args.page).read_text(encoding="utf-8")
        expected = filled(text, ladder, stages, args.folder)
        readme = Path(args.readme).read_text(encoding="utf-8")
        glance = glance_table(glance_folders(args.results))
        expected_readme = _with_block(readme, GLANCE_BLOCK, glance)
    except (UsageError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return failures.EXIT_USAGE
    if args.check:
        found = [f"{args.page}: {line}" for line in differences(text, expected)]
        if block(readme, GLANCE_BLOCK) != glance:
            found.append(f"{args.readme}: the results at a glance differ from what {args.results} gives")
        for line in found:
            print(line, file=sys.stderr)
        shown = named_folder(text)
        if found and shown and shown.resolve() != Path(args.folder).resolve():  # another GPU's folder: no rewrite
            print(f"{args.page} shows {report.repository_path(shown)}, not {args.folder}: check that folder "
                  f"(python bench/readme_tables.py {report.repository_path(shown)} --check); writing this one's "
                  "figures would replace the page's GPU", file=sys.stderr)
        elif found:
            print(f"to write the folder's figures: python bench/readme_tables.py {args.folder}", file=sys.stderr)
        return failures.EXIT_FAILED if found else failures.EXIT_OK
    Path(args.page).write_text(expected, encoding="utf-8")
    Path(args.readme).write_text(expected_readme, encoding="utf-8")
    print(f"Wrote the measurements of {args.folder} into {args.page}: steps "
          f"{', '.join(str(row['rung']) for row in ladder['rungs'] if row['rung'] in STEPS)} of the table"
          + (f", and {len(stages['runs'])} stage run(s)" if stages else "")
          + f"; and the results at a glance of {args.results} into {args.readme}")
    return failures.EXIT_OK

if __name__ == "__main__":
    sys.exit(main())
