"""Benchmark ladder: the original tutorial's table of speed-ups, rebuilt on the machine at hand.

Rung 0 is 00_orig.py, rungs 1 to 10 add the ten optimizations of stage 01 one at a time, numbered as in the
README's "The ten optimizations of stage 01" (rung 10 is 01_opt_single_gpu.py); rung 11 is
02_opt_multi_gpu_ddp.py (DDP) and rung 12 is 03_opt_multi_gpu_fsdp.py (FSDP2), both under torchrun on every
visible GPU (one process on a CPU) at the same settings. Each rung runs in a fresh process, on the same corpus,
seed and batch order: a few warm-up steps (not timed), then the measured steps in timing windows. Written to
--out: ladder.md (the table), ladder.json (the numbers), ladder.png (two charts) and logs/ (each rung's raw
output and result; rungs 11 and 12 also their run folder, without its checkpoint).

A ladder can be measured in parts into one --out folder: each part's rows join the table there, a rung
measured again replaces its row, and every row says when it was measured. A part measured on another device,
with another PyTorch or with other settings (--model, --tiny, --batch-size, --data, --seed, --warmup, --steps,
--windows) is refused with exit code 2, and nothing is written. The table is written again after every rung,
so a part that is stopped keeps the rungs it finished.

  python bench/ladder.py --rungs 0-5          # a part; then --rungs 6-12 into the same folder
  python bench/ladder.py --tiny               # every rung, tiny model: a few minutes on a CPU
  python bench/ladder.py --rungs 0,8,10       # a subset (ranges work too: 0-7)
  python bench/ladder.py --batch-size 8       # a GPU with less memory: every rung at batch 8
  python bench/ladder.py --model gpt2-medium  # another of the book's GPT-2 sizes
  python bench/ladder.py --check-scripts      # also run 00 and 01 as they are, beside rungs 0 and 10
  python bench/ladder.py --time-limit 540     # start no rung that would end after 9 minutes; print the rest

Where a machine stops every command after a fixed time, --time-limit keeps a part inside it: a rung (or the
--check-scripts runs) is not started when the rungs of its kind this part has run say it would end after the
limit, and the part ends by printing the command that measures what is left (with --rungs none where only the
--check-scripts runs are). A run that outlasts that judgement is stopped at the limit and starts the next part.
With --rungs missing the next part is the same command: it measures what the folder lacks.

Exit code: 0 when at least one rung was measured (failed rungs are reported on their rows), or with
--rungs none when the script checks ran; 1 when none was, 2 for a wrong command line or a part that does not
match the folder's, 130 when interrupted (143 / 129 for SIGTERM / SIGHUP; the rungs done so far are kept).

Testing hook: the environment variable LADDER_FAIL_RUNG=3 (or 3,11) makes those rungs fail on purpose,
to check that a failure is reported on its row while the other rungs still run.
"""

import argparse
import math
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the plumbing modules, data and bench, wherever the script is started from

import cli  # noqa: E402  (needs the path above; imports no torch)
import failures
import timekeeping
from bench import report, runner  # noqa: E402

FULL_DEFAULTS = {"warmup": 10, "steps": 30, "windows": 5}
TINY_DEFAULTS = {"warmup": 2, "steps": 10, "windows": 5}

# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

MISSING = "missing"  # --rungs missing: what the results folder lacks, known once the folder is


def parse_rungs(text):
    """'all', '0,8,10' or ranges like '0-7,10' -> a sorted list of rung numbers; 'none' -> [] (--check-scripts
    alone); 'missing' -> MISSING, resolved against the results folder by missing_rungs()."""
    from bench.rungs import ALL_RUNGS

    if text.strip() == "all":
        return list(ALL_RUNGS)
    if text.strip() == "none":
        return []
    if text.strip() == MISSING:
        return MISSING
    chosen = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match:
            raise argparse.ArgumentTypeError(f"'{part}' is not a rung number or range (e.g. 0,8,10 or 0-7)")
        first, last = int(match[1]), int(match[2] or match[1])
        if first > last or last not in ALL_RUNGS:
            raise argparse.ArgumentTypeError(f"rungs go from {ALL_RUNGS[0]} to {ALL_RUNGS[-1]}, got '{part.strip()}'")
        chosen.update(range(first, last + 1))
    return sorted(chosen)


def build_parser():
    from bench.rungs import OPTIONS

    parser = cli.OneLineParser(prog="bench/ladder.py", description=__doc__, allow_abbrev=False,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true",
                        help="the stages' tiny model and batch and fewer steps: every rung in a few minutes "
                             "on a CPU")
    parser.add_argument("--rungs", type=parse_rungs,
                        help="which rungs: 'all', a list like 0,8,10, ranges like 0-7, 'none' (only the "
                             "--check-scripts runs the results folder lacks), or 'missing' (the rungs the folder "
                             "holds no row for, then the --check-scripts runs it lacks: the same command again goes "
                             "on where the last one stopped) (default: all; 0-10 with --option)")
    parser.add_argument("--model", choices=tuple(cli.MODEL_SIZES), default="gpt2-small",
                        help="which of the book's GPT-2 sizes every rung trains; --tiny replaces it with the "
                             "stages' tiny model (default: gpt2-small)")
    parser.add_argument("--batch-size", type=cli.whole_number(1), metavar="N",
                        help="sequences per step (and per process in rungs 11-12) for every rung, for GPUs with "
                             "less memory; the rows it changes say so (default: each stage's own)")
    parser.add_argument("--steps", type=cli.whole_number(1),
                        help=f"measured steps per rung (default: {FULL_DEFAULTS['steps']}; "
                             f"{TINY_DEFAULTS['steps']} with --tiny)")
    parser.add_argument("--warmup", type=cli.whole_number(0),
                        help="untimed steps first, enough for torch.compile to finish (default: "
                             f"{FULL_DEFAULTS['warmup']}; {TINY_DEFAULTS['warmup']} with --tiny)")
    parser.add_argument("--windows", type=cli.whole_number(1),
                        help="timing windows the measured steps are split into; tok/s is their median "
                             f"(default: {FULL_DEFAULTS['windows']})")
    parser.add_argument("--data", default="shakespeare", metavar="NAME_OR_PATH",
                        help="the corpus, as in the stage scripts (default: shakespeare)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to train; auto: CUDA when available (default: auto)")
    parser.add_argument("--seed", type=int, default=123, help="random seed of every rung (default: 123)")
    parser.add_argument("--out", help="results folder; parts measured into one folder make one table (default: "
                                      "bench/results/<gpu or cpu name>/, with a -<model> suffix for a model other "
                                      "than gpt2-small and -tiny under --tiny)")
    parser.add_argument("--roofline", metavar="PATH",
                        help=f"bench/roofline.py's {report.ROOFLINE_NAME} for this GPU: a measured / ceiling column "
                             "(default: the one in the results folder, if it models the same GPU)")
    parser.add_argument("--check-scripts", action="store_true",
                        help="also run 00_orig.py and 01_opt_single_gpu.py as they are, with the same steps, "
                             "and set their own tok/s beside rungs 0 and 10 (a cross-check of the composition)")
    parser.add_argument("--option", action="append", default=[], choices=tuple(OPTIONS), metavar="NAME",
                        help=f"a change to try on top of the composed rungs 0-10 before it goes into 01 "
                             f"({', '.join(OPTIONS)}; repeatable; each row's notes say what it sets); the results "
                             "go to a folder of their own (-<option> appended)")
    parser.add_argument("--time-limit", type=cli.whole_number(1), metavar="SECONDS",
                        help="start no rung (nor the --check-scripts runs) that would end more than SECONDS after "
                             "the part began, judged by the rungs of its kind this part has run, and stop one that "
                             "outlasts the judgement at the limit; the part then prints the command that measures "
                             "the rest (default: no limit)")
    parser.add_argument("--rung-timeout", type=cli.whole_number(1), metavar="SECONDS",
                        help="stop a rung that runs longer than this (default: 1800; 900 with --tiny)")
    # Internal worker modes: ladder.py starts itself with these, one fresh process per rung.
    parser.add_argument("--run-rung", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--describe-device", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser


def resolve_defaults(args):
    from bench.rungs import SCRIPT_OPTIONS

    composed_only = bool(set(args.option) - SCRIPT_OPTIONS)  # an option the stage scripts (rungs 11-12) lack
    if args.rungs is None:
        args.rungs = parse_rungs("0-10" if composed_only else "all")
    named = [] if args.rungs == MISSING else args.rungs  # missing: 0-10 only with such an option (missing_rungs)
    if composed_only and any(number >= 11 for number in named) and args.run_rung is None:
        raise failures.UsageError("--option applies to the composed rungs 0-10 (rungs 11 and 12 are the stage scripts "
                                "as they are; of the options they take only grad-accum): add --rungs 0-10, or a "
                                "subset of it")
    if not args.rungs and not args.check_scripts:
        raise failures.UsageError("--rungs none measures nothing: it is for --check-scripts alone")
    if args.option and args.check_scripts:
        raise failures.UsageError("--option changes the composed rungs only: --check-scripts would compare them with "
                                "scripts that lack it")
    args.option = list(dict.fromkeys(args.option))  # each once
    defaults = TINY_DEFAULTS if args.tiny else FULL_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.rung_timeout is None:
        args.rung_timeout = 900 if args.tiny else 1800
    return args


# ---------------------------------------------------------------------------------------------
# Planning: which rungs, and whether the next one fits --time-limit
# ---------------------------------------------------------------------------------------------

def script_checks():
    """--check-scripts: (script, the rung it is set beside): 00 and 01 as they are, beside rungs 0 and 10."""
    from bench.rungs import STAGE_00, STAGE_01

    return ((STAGE_00, 0), (STAGE_01, 10))


def checked_scripts(existing):
    """The scripts whose --check-scripts run the folder's report `existing` (or None) holds."""
    return {check["script"] for check in (existing or {}).get("script_checks", [])}


def missing_rungs(args, existing):
    """--rungs missing: (the rungs, whether the --check-scripts runs are left) that `existing`, the folder's report,
    lacks. A rung is missing without a row, or with the row of a rung stopped by Ctrl-C; a failed rung (or script
    check) keeps its row (name it to measure it again). The composed rungs only with --option, as --rungs all
    would. The script checks left are those of the scripts the folder has no check of."""
    from bench.rungs import ALL_RUNGS

    existing = existing or {}
    measured = {row["rung"] for row in existing.get("rungs", []) if row.get("error") != report.INTERRUPTED}
    from bench.rungs import SCRIPT_OPTIONS

    composed_only = bool(set(args.option) - SCRIPT_OPTIONS)
    candidates = [number for number in ALL_RUNGS if not (composed_only and number >= 11)]
    checked = checked_scripts(existing)
    checks_left = args.check_scripts and any(script not in checked for script, _ in script_checks())
    return [number for number in candidates if number not in measured], checks_left


def rung_kind(number):
    """Rungs of one kind take about as long as each other: eager (0-7), compiled (8-10: compilation first), stage
    scripts under torchrun (11-12: start-up, evaluation, a sample and a checkpoint besides)."""
    return "eager" if number <= 7 else "compiled" if number <= 10 else "scripts"


def expected_seconds(kinds, seconds_by_kind):
    """How long runs of `kinds` (one entry per run) should take, judged by the rungs this part has run: the longest
    of the same kind, or twice the longest of any kind where none of that kind has run yet (compilation and
    torchrun's start-up make the later kinds the slower ones). None before the part's first rung."""
    if not seconds_by_kind:
        return None
    longest = max(max(seconds) for seconds in seconds_by_kind.values())
    return sum(max(seconds_by_kind[kind]) if kind in seconds_by_kind else 2 * longest for kind in kinds)


def past_the_limit(args, elapsed, expected):
    """Whether runs expected to take `expected` seconds, started `elapsed` seconds into the part, would end after
    --time-limit (never before the part's first rung, when nothing says how long a rung takes)."""
    return bool(args.time_limit and expected is not None and elapsed + expected > args.time_limit)


def run_timeout(args, deadline):
    """(seconds, the flag that sets them) for the next run: --rung-timeout, or what is left before --time-limit's
    deadline where that is less. A rung that outlasts the judgement is then stopped by the ladder itself, which ends
    the part in order, its rows and the command for the rest printed, rather than by whatever enforces the limit."""
    if deadline is None:
        return args.rung_timeout, "--rung-timeout"
    left = max(1, math.floor(deadline - time.monotonic()))
    return (left, "--time-limit") if left < args.rung_timeout else (args.rung_timeout, "--rung-timeout")


def cut_at_the_limit(result):
    """Whether a run (a rung's row, a script check) was stopped at --time-limit's deadline."""
    return result.pop("timed_out", None) == "--time-limit"


def rungs_named(numbers):
    return f"rung{'s' if len(numbers) > 1 else ''} {report.rung_ranges(numbers)}"


def cli_rungs(numbers):
    """Rung numbers as --rungs takes them: [0, 1, 2, 5] -> '0-2,5'; [] -> 'none'."""
    return report.rung_ranges(numbers, dash="-", separator=",") or "none"


def continuation_command(argv, rungs, check_scripts):
    """The command that measures what --time-limit left of this part: its own flags (argv, without the script's
    name), with --rungs set to the rungs left and --check-scripts kept only where those runs are left too; with
    --rungs missing, the part's own command again."""
    if any(arg == f"--rungs={MISSING}" or arg == MISSING and before == "--rungs" for before, arg in zip(
            ["", *argv], argv)):
        return shlex.join(["python", "bench/ladder.py", *argv])
    kept, skip_value = [], False
    for arg in argv:
        if skip_value:
            skip_value = False
        elif arg == "--rungs":
            skip_value = True
        elif not (arg.startswith("--rungs=") or arg == "--check-scripts" and not check_scripts):
            kept.append(arg)
    return shlex.join(["python", "bench/ladder.py", "--rungs", cli_rungs(rungs), *kept])


def format_duration(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def results_folder(args, device_info):
    if args.out:
        return Path(args.out)
    name = device_info["slug"] + (f"-{args.model}" if args.model != "gpt2-small" else "") + "".join(
        f"-{option}" for option in sorted(args.option)) + ("-tiny" if args.tiny else "")
    return ROOT / "bench" / "results" / name


def new_part(args, device_info, started_at):
    """The report of this part alone, before its first rung: what it runs on, with which settings, and since when."""
    return {
        "device": device_info["description"], "device_name": device_info["name"],
        "gpu_count": device_info["gpu_count"], "driver": runner.nvidia_driver(), "cuda": device_info["cuda"],
        "torch": device_info["torch"], "python": device_info["python"], "date": started_at,
        "settings": {"tiny": args.tiny, "model": args.model, "batch_size": args.batch_size, "data": args.data,
                     "seed": args.seed, "warmup_steps": args.warmup, "steps": args.steps,
                     "windows": min(args.windows, args.steps), "device": args.device,
                     "options": ",".join(sorted(args.option)) or None},
        "reference_source": report.REFERENCE_SOURCE,
        "parts": [{"started_at": started_at, "command": shlex.join(["python", "bench/ladder.py", *args.argv]),
                   "git": runner.git_revision(), "rungs": list(args.rungs), "seconds": 0}],
        "rungs": [],
    }


def run_ladder(args):
    from bench.rungs import CHANGES
    from data import load_corpus

    # --time-limit counts from the command's start: importing torch came before this line, and the device query
    # below starts CUDA, seconds
    clock_start = time.monotonic() - args.started_seconds_ago
    deadline = clock_start + args.time_limit if args.time_limit else None
    load_corpus(args.data)  # a wrong --data fails here, once, with exit code 2 (and a text is prepared once)
    device_info = runner.describe_device(args)
    args.device = device_info["device_type"]  # every rung and script on the device resolved once, here
    out = results_folder(args, device_info)
    existing = report.read_report(out / "ladder.json")
    missing, checks_asked = args.rungs == MISSING, args.check_scripts
    if missing:
        args.rungs, args.check_scripts = missing_rungs(args, existing)
    part = new_part(args, device_info, report.timestamp())
    # Every check that can refuse this part comes before anything in the folder is written.
    if existing:
        report.refuse_a_different_part(existing, part, out / "ladder.json")
    if missing and not args.rungs and not args.check_scripts:
        print(f"--rungs missing: nothing left to measure: {out / 'ladder.json'} holds every rung"
              + (" and every --check-scripts run" if checks_asked else ""), flush=True)
        return failures.EXIT_OK
    roofline = report.find_roofline(out, args.roofline, device_info["name"], part["settings"])
    logs = out / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise failures.UsageError(f"cannot write to --out {out} ({err.strerror}): choose a writable folder") from None
    runner.stop_on_signals()

    print(f"Ladder: rungs {report.rung_ranges(args.rungs) or 'none'} on {device_info['description']} | torch "
          f"{device_info['torch']} | {report.describe_model(part['settings'])} | {args.warmup} warm-up + "
          f"{args.steps} measured steps per rung{' | --tiny' if args.tiny else ''} | out: {out}"
          + (f" (merged with its rungs {report.rung_ranges(row['rung'] for row in existing['rungs'])})"
             if existing else ""), flush=True)

    rows, durations, stopped = part["rungs"], [], None
    seconds_by_kind, not_started, checks_left = {}, [], False  # for --time-limit
    merged = None
    for index, number in enumerate(args.rungs, start=1):
        elapsed = time.monotonic() - clock_start
        expected = expected_seconds([rung_kind(number)], seconds_by_kind)
        if past_the_limit(args, elapsed, expected):
            not_started = args.rungs[index - 1:]
            print(f"--time-limit {args.time_limit} s: rung {number} would end at about "
                  f"{format_duration(elapsed + expected)} (elapsed {format_duration(elapsed)}, a rung of its kind "
                  f"about {format_duration(expected)}): {rungs_named(not_started)} not started",
                  flush=True)
            break
        remaining = len(args.rungs) - index + 1
        estimate = (f"~{format_duration(statistics.mean(durations) * remaining)} left" if durations
                    else "time left: known after the first rung")
        print(f"[{index}/{len(args.rungs)}] rung {number}: {CHANGES[number]} | elapsed "
              f"{format_duration(elapsed)}, {estimate}", flush=True)
        rung_start = time.monotonic()
        try:
            timeout = run_timeout(args, deadline)
            row = (runner.run_multi_process_rung(number, args, device_info, logs, *timeout) if number >= 11
                   else runner.run_single_process_rung(number, args, logs, *timeout))
        except KeyboardInterrupt as err:
            row, stopped = {"rung": number, "error": report.INTERRUPTED}, err
        durations.append(time.monotonic() - rung_start)
        seconds_by_kind.setdefault(rung_kind(number), []).append(durations[-1])
        if cut_at_the_limit(row) and rows:  # the first rung of a part keeps its row: no part would hold it
            not_started = args.rungs[index - 1:]
            print(f"--time-limit {args.time_limit} s: rung {number} was stopped at the limit after "
                  f"{format_duration(durations[-1])}, longer than judged; it starts the next part, with the whole "
                  "limit to itself", flush=True)
            break
        rows.append(report.complete_row(row, durations[-1], f"logs/rung-{number:02d}.log", report.timestamp(),
                                        part["date"]))
        part["parts"][0]["seconds"] = round(time.monotonic() - clock_start, 1)
        merged = report.merge(existing, part)
        report.write_report(merged, out, roofline, chart=False)  # kept even if the part is stopped later
        remaining = len(args.rungs) - index
        print(f"[{index}/{len(args.rungs)}] rung {number} {'done' if not rows[-1]['error'] else 'FAILED'} in "
              f"{format_duration(durations[-1])}: {runner.summarize(rows[-1])} | elapsed "
              f"{format_duration(time.monotonic() - clock_start)}"
              + (f", ~{format_duration(statistics.mean(durations) * remaining)} left"
                 if remaining and not stopped else ""),
              flush=True)
        if stopped:
            break

    if args.check_scripts and not stopped:
        # --rungs missing and --rungs none (a part of checks alone, what --time-limit prints for the checks left)
        # run the checks the folder lacks; a part with rungs runs them all again, against its new rows
        checked = checked_scripts(existing) if missing or not args.rungs else set()
        checks, checks_left = [], bool(not_started)
        for script_name, rung in [] if checks_left else script_checks():
            if script_name in checked:
                continue
            elapsed = time.monotonic() - clock_start
            expected = expected_seconds([rung_kind(rung)], seconds_by_kind)
            if past_the_limit(args, elapsed, expected):
                checks_left = True
                print(f"--time-limit {args.time_limit} s: the --check-scripts run of {script_name} would end at "
                      f"about {format_duration(elapsed + expected)}: not started", flush=True)
                break
            check_start = time.monotonic()
            try:  # against the rows of the folder too (--rungs none)
                check = runner.run_script_check(script_name, rung, args, device_info, logs,
                                                report.merge(existing, part)["rungs"], run_timeout(args, deadline))
            except KeyboardInterrupt as err:
                stopped = err
                break
            if cut_at_the_limit(check) and (rows or checks):  # the first run of a part keeps its failed check
                checks_left = True
                print(f"--time-limit {args.time_limit} s: the --check-scripts run of {script_name} was stopped at "
                      f"the limit after {format_duration(time.monotonic() - check_start)}, longer than judged: not "
                      "kept; it starts the next part", flush=True)
                break
            checks.append(check)
            seconds_by_kind.setdefault(rung_kind(rung), []).append(time.monotonic() - check_start)
        if checks:
            part["script_checks"] = checks  # each finished check is kept, whatever stops the next one
    part["parts"][0]["seconds"] = round(time.monotonic() - clock_start, 1)
    merged = report.merge(existing, part)
    markdown = report.write_report(merged, out, roofline)
    measured = sum(1 for row in rows if row.get("tokens_per_sec"))
    print(f"Wrote {out}/ladder.md, ladder.json, ladder.png and logs/ | this part: {measured} of {len(rows)} rungs "
          f"measured in {format_duration(part['parts'][0]['seconds'])}; the table holds rungs "
          f"{report.rung_ranges(row['rung'] for row in merged['rungs'])}\n\n{markdown}", flush=True)
    if not_started or checks_left:
        print("--time-limit: the rest of this part is "
              + (rungs_named(not_started) if not_started else "")
              + (" and " if not_started and checks_left else "") + ("the --check-scripts runs" if checks_left else "")
              + f"; measure it with:\n  {continuation_command(args.argv, not_started, checks_left)}", flush=True)
    if stopped:
        return 128 + stopped.args[0] if isinstance(stopped, runner.Stopped) else 130
    if not args.rungs:  # --rungs none: the script checks are the part
        checks = part.get("script_checks", [])
        return failures.EXIT_OK if checks and not any(check["error"] for check in checks) else failures.EXIT_FAILED
    return failures.EXIT_OK if measured else failures.EXIT_FAILED


# ---------------------------------------------------------------------------------------------

def main(argv=None):
    try:
        args = resolve_defaults(build_parser().parse_args(argv))
        args.argv = list(sys.argv[1:] if argv is None else argv)  # as given, for the table and --time-limit's advice
        args.started_seconds_ago = timekeeping.process_age() if argv is None else 0.0  # a command: its interpreter too
        if args.run_rung is not None:
            return runner.run_rung_main(args)
        if args.describe_device:
            return runner.describe_device_main(args)
        return run_ladder(args)
    except failures.UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return failures.EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
