"""Write a results folder's measurements into README.md, or check that the README still shows them.

  python bench/readme_tables.py bench/results/nvidia-h100-80gb-hbm3           # fill the README from the folder
  python bench/readme_tables.py bench/results/nvidia-h100-80gb-hbm3 --check   # exit 1 where they differ

The folder is what bench/ladder.py wrote (its rows/) and, in its stages/ subfolder, what bench/stages.py wrote
(stages/rows/). From the ladder: the "measured here" column of the README's table of the ten optimizations (median
tok/s, peak reserved GiB and the speed-up over the step above, for steps 0 to 10) and a paragraph under it with the
GPU, the versions, the dates, step 10 over step 0, the steps that did not pay and rungs 11 and 12; where the rows
have ceilings (a GPU whose roofline docs/roofline/ ships), a table of each step beside its ceiling in the roofline
section. From the stages:
a table in the README's Results section, each run's Avg tok/sec, MFU, memory and wall clock split into phases.
Nothing is typed by hand, so a figure in the README is always one of the folder's, and --check (run by the test
suite on the folder the README names) notices a README edited by hand or a folder measured again.

Only a ladder at the stages' own settings fills the table: not --tiny, gpt2-small, each stage's own batch, no
--option (exit code 2 for another, naming what differs).
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
from data import UsageError  # noqa: E402

README = ROOT / "README.md"
TABLE_HEADING = "## The ten optimizations of stage 01"
STEPS = range(11)  # the table's rows: step 0 (the baseline) to step 10 (01 as it is)
PAYS = 1.02  # a step that gains less than 2% over the step above "did not pay" on this GPU
NOT_MEASURED = "no GPU run yet"
LADDER_BLOCK = ("<!-- ladder results: bench/readme_tables.py writes this paragraph -->", "<!-- /ladder results -->")
STAGES_BLOCK = ("<!-- stage results: bench/readme_tables.py writes this section -->", "<!-- /stage results -->")
CEILINGS_BLOCK = ("<!-- measured against the ceilings: bench/readme_tables.py writes this table -->",
                  "<!-- /measured against the ceilings -->")
CEILINGS_PLACEHOLDER = ("**Measured against the ceilings:** no ladder measured on a GPU whose roofline "
                        "`docs/roofline/` ships (or with `--roofline`) yet.")
LADDER_PLACEHOLDER = ("**Measured here:** no GPU run yet. `python bench/readme_tables.py bench/results/<gpu>` writes "
                      "the ladder of a results folder into this column and its stages into [Results](#results).")
STAGES_PLACEHOLDER = ("**The stages end to end on a GPU:** no GPU run yet (`python bench/stages.py`, then "
                      "`python bench/readme_tables.py bench/results/<gpu>`).")


def read_folder(folder):
    """(ladder report, stages report or None) of a results folder, rendered from its rows; a UsageError for a folder
    the README cannot show (no rows, or a ladder measured at other settings than the stages' own)."""
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
        (f"--option {settings.get('options')}", bool(settings.get("options")))) if differs]
    if other:
        raise UsageError(f"{folder} was measured with {', '.join(other)}: the README's table shows the stages at their "
                         "own settings (python bench/ladder.py with none of these)")
    stage_rows = rows.read_rows(folder / "stages", "stages.json")
    stages = stage_collect(stage_rows) if stage_rows else None
    if stages is not None and (stages.get("tiny") or stages.get("device_name") != ladder.get("device_name")):
        raise UsageError(f"{folder}/stages was measured {'with --tiny' if stages.get('tiny') else 'on another device'}"
                         ": the README sets the stages beside the ladder of the same GPU")
    return ladder, stages


# ---------------------------------------------------------------------------------------------
# What the README shows
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
        "steps, the peak reserved GiB of the run and, in brackets, the speed-up over the step above."]
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
    """Steps 0-10 as measured beside the ceilings bench/roofline.py models for the same GPU, and each step's
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
    lines = [f"**The stages end to end** on the {stages['device']}, PyTorch {stages['torch']}, CUDA "
             f"{stages.get('cuda') or 'n/a'}, {dates[0] if dates[0] == dates[-1] else f'{dates[0]} to {dates[-1]}'}, "
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


# ---------------------------------------------------------------------------------------------
# The README's text
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
        raise ValueError(f"README.md: the table under '{TABLE_HEADING}' has no rows for steps 0 to 10")
    return rows


def measured_cells(text):
    """{step: the text of its "measured here" cell} as the README has them."""
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
        raise ValueError(f"README.md has no block between '{begin}' and '{end}'")
    return text[first + len(begin):last].strip("\n")


def _with_block(text, markers, body):
    begin, end = markers
    return text[:text.index(begin) + len(begin)] + "\n" + body + "\n" + text[text.index(end):]


def filled(text, ladder, stages, folder):
    """The README's text with the folder's measurements in the table, the paragraph under it and Results."""
    rows = {row["rung"]: row for row in ladder["rungs"]}
    text = _with_cells(text, {step: measured_cell(rows.get(step)) for step in STEPS})
    text = _with_block(text, LADDER_BLOCK, ladder_paragraph(ladder, folder))
    text = _with_block(text, CEILINGS_BLOCK, ceilings_table(ladder))
    return _with_block(text, STAGES_BLOCK, stages_section(stages, folder) if stages else STAGES_PLACEHOLDER)


def unfilled(text):
    """The README as it reads before any GPU run (what the suite checks while no folder is named)."""
    text = _with_cells(text, {step: NOT_MEASURED for step in STEPS})
    text = _with_block(_with_block(text, LADDER_BLOCK, LADDER_PLACEHOLDER), CEILINGS_BLOCK, CEILINGS_PLACEHOLDER)
    return _with_block(text, STAGES_BLOCK, STAGES_PLACEHOLDER)


def named_folder(text):
    """The results folder the README's ladder paragraph names, or None before any GPU run."""
    match = re.search(r"into `([^`]+)/`", block(text, LADDER_BLOCK))
    return ROOT / match.group(1) if match else None


def differences(text, expected):
    """Lines naming what differs between the README's text and the expected one."""
    found = [f"step {step}: the README shows '{shown}', the folder gives '{measured_cells(expected)[step]}'"
             for step, shown in measured_cells(text).items() if shown != measured_cells(expected)[step]]
    for markers, what in ((LADDER_BLOCK, "the paragraph under the table"), (CEILINGS_BLOCK, "the table beside the "
                          "roofline's ceilings"), (STAGES_BLOCK, "the stages in Results")):
        if block(text, markers) != block(expected, markers):
            found.append(f"{what} differs from what the folder gives")
    return found


def main(argv=None):
    parser = cli.OneLineParser(prog="bench/readme_tables.py", description=__doc__, allow_abbrev=False,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a results folder: bench/results/<gpu> (ladder.json, stages/stages.json)")
    parser.add_argument("--check", action="store_true", help="change nothing: exit 1 where the README differs")
    parser.add_argument("--readme", default=str(README), help="the README to fill or check (default: README.md)")
    args = parser.parse_args(argv)
    try:
        ladder, stages = read_folder(args.folder)
        text = Path(args.readme).read_text(encoding="utf-8")
        expected = filled(text, ladder, stages, args.folder)
    except (UsageError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return failures.EXIT_USAGE
    if args.check:
        found = differences(text, expected)
        for line in found:
            print(f"{args.readme}: {line}", file=sys.stderr)
        if found:
            print(f"to write the folder's figures: python bench/readme_tables.py {args.folder}", file=sys.stderr)
        return failures.EXIT_FAILED if found else failures.EXIT_OK
    Path(args.readme).write_text(expected, encoding="utf-8")
    print(f"Wrote the measurements of {args.folder} into {args.readme}: steps "
          f"{', '.join(str(row['rung']) for row in ladder['rungs'] if row['rung'] in STEPS)} of the table"
          + (f", and {len(stages['runs'])} stage run(s) into Results" if stages else ""))
    return failures.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
