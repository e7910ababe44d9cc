"""Benchmark ladder: the original tutorial's table of speed-ups, rebuilt on the machine at hand.

Rung 0 is 00_orig.py, rungs 1 to 10 add the ten optimizations of stage 01 one at a time, numbered as in the
README's "The ten steps" (rung 10 is 01_opt_single_gpu.py); rung 11 is
02_opt_multi_gpu_ddp.py (DDP) and rung 12 is 03_opt_multi_gpu_fsdp.py (FSDP2), both under torchrun on every
visible GPU (one process on a CPU) at the same settings. Each rung runs in a fresh process, on the same corpus,
seed and batch order: a few warm-up steps (not timed), then the measured steps in timing windows. Written to
--out: ladder.md (the table), ladder.json (the numbers), ladder.png (two charts) and logs/ (each rung's raw
output and result; rungs 11 and 12 also their run folder, without its checkpoint).

Each rung's measurement is one file of --out's rows/ folder (bench/rows.py), written as the rung ends, and the
table, numbers and chart are rendered again from the rows present. So a ladder can be measured in parts into one
folder: a part's rows join the others, a rung measured again replaces its row, a rung without a row is what
--rungs missing measures, and every row says when, where and by which command it was measured. A part measured on
another device, with another PyTorch or with other settings (--model, --tiny, --batch-size, --context-length, --data,
--seed, --warmup, --steps, --windows, --option) is refused with exit code 2, and nothing is written.

  python bench/ladder.py --rungs 0-5          # a part; then --rungs 6-12 into the same folder
  python bench/ladder.py --tiny               # every rung, tiny model: a few minutes on a CPU
  python bench/ladder.py --rungs 0,8,10       # a subset (ranges work too: 0-7)
  python bench/ladder.py --batch-size 4       # a GPU with less memory: every rung at batch 4
  python bench/ladder.py --model gpt2-medium  # another of the book's GPT-2 sizes
  python bench/ladder.py --rungs 6-7 --context-length 2048   # windows of 2,048 tokens (rungs 0-10 only)
  python bench/ladder.py --check-scripts      # also run 00 and 01 as they are, beside rungs 0 and 10
  python bench/ladder.py --time-limit 540     # start no rung that would end after 9 minutes; print the rest

Where a machine stops every command after a fixed time, --time-limit keeps a part inside it: a rung (or the
--check-scripts runs) is not started when the rungs of its kind this part has run say it would end after the
limit, and the part ends by printing the command that measures what is left (with --rungs none where only the
--check-scripts runs are). A run that outlasts that judgement is stopped at the limit and starts the next part.
With --rungs missing the next part is the same command: it measures what the folder lacks.

Exit code: 0 when at least one rung was measured (failed rungs are reported on their rows), or with --rungs none
when every script check ran without an error; 1 when none was (or a check failed), 2 for a wrong command line or a
part that does not match the folder's, 130 when interrupted (143 / 129 for SIGTERM / SIGHUP; the rungs done so far
are kept).
"""

import argparse
import re
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the plumbing modules, data and bench, wherever the script is started from

import cli  # noqa: E402  (needs the path above; imports no torch)
import failures
import timekeeping
from bench import plan, report, rows, runner  # noqa: E402
from bench.rows import MISSING  # noqa: E402

FULL_DEFAULTS = {"warmup": 10, "steps": 30, "windows": 5}
TINY_DEFAULTS = {"warmup": 2, "steps": 10, "windows": 5}
# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def parse_rungs(text):
    """'all', '0,8,10' or ranges like '0-7,10' -> a sorted list of rung numbers; 'none' -> [] (--check-scripts
    alone); 'missing' -> MISSING, resolved against the results folder's rows by plan.jobs()."""
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
        if first > last:
            raise argparse.ArgumentTypeError(f"'{part.strip()}' counts down: a range goes up ({last}-{first})")
        if last not in ALL_RUNGS:
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
                             "on where the last one stopped) (default: all; with --option, the rungs every "
                             "option named applies to: 0-10 for most, 0-12 for the settings the stage scripts take "
                             "too, 0-11 for nested-compile-region, 12 for fsdp-one-unit; 0-10 with --context-length)")
    parser.add_argument("--model", choices=tuple(cli.MODEL_SIZES), default="gpt2-small",
                        help="which of the book's GPT-2 sizes every rung trains; --tiny replaces it with the "
                             "stages' tiny model (default: gpt2-small)")
    parser.add_argument("--batch-size", type=cli.whole_number(1), metavar="N",
                        help="sequences per step (and per process in rungs 11-12) for every rung, for GPUs with "
                             "less memory; the rows it changes say so (default: each stage's own)")
    parser.add_argument("--context-length", type=cli.whole_number(1), metavar="N",
                        help="tokens per sequence for every rung 0-10 (the stage scripts of rungs 11-12 and "
                             "--check-scripts keep their own); the model's position embedding is built for it; the "
                             "rows say so (default: the stages' own, 1,024; 64 with --tiny)")
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
                                      "than gpt2-small, -batch-N under --batch-size, -context-N under "
                                      "--context-length, -<option> for each --option and -tiny under --tiny)")
    parser.add_argument("--roofline", metavar="PATH",
                        help=f"cost_model/roofline.py's {report.ROOFLINE_NAME} for this GPU: a measured / ceiling column "
                             "(default: the one in the results folder, else the one docs/roofline/ ships for this GPU, "
                             "where it models these rungs)")
    parser.add_argument("--check-scripts", action="store_true",
                        help="also run 00_orig.py and 01_opt_single_gpu.py as they are, with the same steps, "
                             "and set their own tok/s beside rungs 0 and 10 (a cross-check of the composition)")
    parser.add_argument("--option", action="append", default=[], choices=tuple(OPTIONS), metavar="NAME",
                        help=f"a change to try on top of the rungs before it goes into the stages "
                             f"({', '.join(OPTIONS)}; repeatable; each row's notes say what it sets; the composed "
                             "rungs 0-10 take them all but fsdp-one-unit, the stage scripts 11 and 12 the settings of "
                             "PyTorch, grad-accum and expandable-segments, 11 nested-compile-region, 12 alone "
                             "fsdp-one-unit); the results "
                             "go to a folder of their own (-<option> appended), whose table sets each rung "
                             "beside the same rung measured without options in a folder beside it")
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
    from bench.rungs import OPTION_RUNGS, option_rungs, stage_context_length

    if args.context_length == stage_context_length(args.tiny):
        args.context_length = None  # the stages' own: the same measurement as without the flag, and recorded alike
    allowed = option_rungs(args.option)  # all thirteen without an option; the rungs that every option applies to
    takes = "; ".join(f"{name}: rungs {report.rung_ranges(list(OPTION_RUNGS[name]), '-')}"
                      for name in dict.fromkeys(args.option))  # what each option named applies to, for a refusal
    if args.rungs is None:
        args.rungs = [number for number in allowed if not (args.context_length and number >= 11)]
        if not args.rungs:  # only rungs 11 and 12 take the options, and --context-length leaves those out
            raise failures.UsageError(f"--context-length applies to rungs 0-10, and no rung of those takes every "
                                      f"option named ({takes})")
    named = [] if args.rungs == MISSING else args.rungs  # missing: those of `allowed` without a row (plan.jobs)
    outside = [number for number in named if number not in allowed]
    if outside and args.run_rung is None:
        where = report.rung_ranges(allowed, "-")
        raise failures.UsageError(f"--option applies to rungs {where} here, not to {report.rung_ranges(outside, '-')} "
                                  f"({takes}; rungs 11 and 12 are the stage scripts as they are): add --rungs {where}, "
                                  "or a subset of it")
    if args.context_length and any(number >= 11 for number in named) and args.run_rung is None:
        raise failures.UsageError("--context-length applies to the composed rungs 0-10 (rungs 11 and 12 are the stage "
                                  "scripts as they are, at their own context): add --rungs 0-10, or a subset of it")
    if not args.rungs and not args.check_scripts:
        raise failures.UsageError("--rungs none measures nothing: it is for --check-scripts alone")
    if {"chunked-loss", "fused-loss"} <= set(args.option):
        raise failures.UsageError("--option chunked-loss and fused-loss each replace 01's loss: name one of them")
    if args.option and args.check_scripts:
        raise failures.UsageError("--option changes the rungs: --check-scripts would compare them with the scripts "
                                "as they are (measure the two in commands of their own)")
    if args.context_length and args.check_scripts:
        raise failures.UsageError("--context-length changes the composed rungs only: --check-scripts would compare "
                                  "them with scripts at their own context")
    args.option = list(dict.fromkeys(args.option))  # each once
    defaults = TINY_DEFAULTS if args.tiny else FULL_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.rung_timeout is None:
        args.rung_timeout = 900 if args.tiny else 1800
    return args


# ---------------------------------------------------------------------------------------------
# The command: plan, run each job into its row, render the table from the rows
# ---------------------------------------------------------------------------------------------

def results_folder(args, device_info):
    if args.out:
        return Path(args.out)
    name = device_info["slug"] + (f"-{args.model}" if args.model != "gpt2-small" else "") + (
        f"-batch-{args.batch_size}" if args.batch_size else "") + (
        f"-context-{args.context_length}" if args.context_length else "") + "".join(
        f"-{option}" for option in sorted(args.option)) + ("-tiny" if args.tiny else "")
    return ROOT / "bench" / "results" / name


def context_of(args, device_info):
    """What every row of this command carries: where and how it was measured, and by which command."""
    return {
        "device": device_info["description"], "device_name": device_info["name"],
        "gpu_count": device_info["gpu_count"], "driver": runner.nvidia_driver(), "cuda": device_info["cuda"],
        "torch": device_info["torch"], "python": device_info["python"],
        "settings": {"tiny": args.tiny, "model": args.model, "batch_size": args.batch_size,
                     "context_length": args.context_length, "data": args.data,
                     "seed": args.seed, "warmup_steps": args.warmup, "steps": args.steps,
                     "windows": min(args.windows, args.steps), "device": args.device,
                     "options": ",".join(sorted(args.option)) or None},
        "command": {"started_at": report.timestamp(), "command": shlex.join(["python", "bench/ladder.py", *args.argv]),
                    "git": runner.git_revision()},
    }


def measure(job, args, device_info, logs, timeout):
    """Run one job (a rung, or a --check-scripts run) and return its result, not yet a row."""
    if job.script:
        return runner.run_script_check(job.script, job.rung, args, device_info, logs, timeout)
    if job.rung >= 11:
        return runner.run_multi_process_rung(job.rung, args, device_info, logs, *timeout)
    return runner.run_single_process_rung(job.rung, args, logs, *timeout)


def run_ladder(args):
    from data import load_corpus

    # --time-limit counts from the command's start: importing torch came before this line, and the device query
    # below starts CUDA, seconds
    clock_start = time.monotonic() - args.started_seconds_ago
    deadline = clock_start + args.time_limit if args.time_limit else None
    load_corpus(args.data)  # a wrong --data fails here, once, with exit code 2 (and a text is prepared once)
    device_info = runner.describe_device(args)
    args.device = device_info["device_type"]  # every rung and script on the device resolved once, here
    out = results_folder(args, device_info)
    context = context_of(args, device_info)
    # Every check that can refuse this command comes before anything in the folder is written.
    found = rows.read_rows(out, "ladder.json")
    rows.refuse_a_different_part(found, context, report.MATCHED, out, "rungs")
    missing = args.rungs == MISSING
    planned = [job for job in plan.jobs(args, found, missing)  # rungs 11-12 cannot change their context
               if not (args.context_length and job.rung >= 11)]
    if not planned:
        held = ["every rung"] * missing + ["every --check-scripts run"] * args.check_scripts
        print(f"--rungs {MISSING if missing else 'none'}: nothing left to measure: {out / rows.FOLDER} holds "
              f"{' and '.join(held)}", flush=True)
        return failures.EXIT_OK
    roofline = report.find_roofline(out, args.roofline, device_info["name"], context["settings"])
    logs = out / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise failures.UsageError(f"cannot write to --out {out} ({err.strerror}): choose a writable folder") from None
    runner.stop_on_signals()
    rungs_there = [row["rung"] for name, row in found.items() if name.startswith("rung-")]
    print(f"Ladder: {plan.describe_left(planned)} on {device_info['description']} | torch {device_info['torch']} | "
          f"{report.describe_model(context['settings'])}"
          + (f", context {args.context_length:,} for every rung" if args.context_length else "")
          + f" | {args.warmup} warm-up + {args.steps} measured steps per "
          f"rung{' | --tiny' if args.tiny else ''} | out: {out}"
          + (f" (beside its rows of rungs {report.rung_ranges(rungs_there)})" if rungs_there else ""), flush=True)
    note = runner.cpu_note(device_info, args.tiny)
    if note:
        print(note, flush=True)

    done, durations, seconds_by_kind, left, stopped = [], [], {}, [], None
    for index, job in enumerate(planned, start=1):
        elapsed = time.monotonic() - clock_start
        expected = plan.expected_seconds(job.kind, seconds_by_kind)
        if plan.past_the_limit(args.time_limit, elapsed, expected):
            left = planned[index - 1:]
            print(f"--time-limit {args.time_limit} s: {job.label.split(':')[0]} would end at about "
                  f"{plan.format_duration(elapsed + expected)} (elapsed {plan.format_duration(elapsed)}, a run of its "
                  f"kind about {plan.format_duration(expected)}): {plan.describe_left(left)} not started", flush=True)
            break
        seconds_left = plan.seconds_left(planned[index - 1:], seconds_by_kind)
        estimate = (f"~{plan.format_duration(seconds_left)} left" if seconds_left is not None
                    else "time left: known after the first run")
        print(f"[{index}/{len(planned)}] {job.label} | elapsed {plan.format_duration(elapsed)}, {estimate}", flush=True)
        started = time.monotonic()
        try:
            result = measure(job, args, device_info, logs, plan.run_timeout(args.rung_timeout, deadline))
        except KeyboardInterrupt as err:  # a run cut off writes no row: the folder keeps the one it had, if any
            stopped = err
            break
        durations.append(time.monotonic() - started)
        seconds_by_kind.setdefault(job.kind, []).append(durations[-1])
        at_the_limit = result.pop("timed_out", None) == "--time-limit"
        if at_the_limit and not done:  # the part's first run keeps its failed row: no command would ever measure it
            print(f"--time-limit {args.time_limit} s: {job.label.split(':')[0]}, this part's first run, was stopped "
                  f"at the limit after {plan.format_duration(durations[-1])}: its row says so; where the runs of "
                  "the next part take as long, give it a longer --time-limit", flush=True)
        if at_the_limit and done:  # stopped at the limit: the next part starts with it
            left = planned[index - 1:]
            print(f"--time-limit {args.time_limit} s: {job.label.split(':')[0]} was stopped at the limit after "
                  f"{plan.format_duration(durations[-1])}, longer than judged: no row; it starts the next part, with "
                  "the whole limit to itself", flush=True)
            break
        row = report.complete_row(result, durations[-1], job.log, context)
        rows.write_row(out, job.name, row)
        report.write_report(report.collect(rows.read_rows(out, "ladder.json")), out, roofline, chart=False)
        done.append(row)
        print(f"[{index}/{len(planned)}] {job.label.split(':')[0]} {'FAILED' if row['error'] else 'done'} in "
              f"{plan.format_duration(durations[-1])}: {runner.summarize(row)} | elapsed "
              f"{plan.format_duration(time.monotonic() - clock_start)}", flush=True)

    table = report.collect(found) if (found := rows.read_rows(out, "ladder.json")) else None
    if table:
        markdown = report.write_report(table, out, roofline)
        measured = sum(1 for row in done if row.get("tokens_per_sec"))
        print(f"Wrote {out}/ladder.md, ladder.json, ladder.png, {rows.FOLDER}/ and logs/ | this command: {measured} of "
              f"{len(done)} runs measured in {plan.format_duration(time.monotonic() - clock_start)}; the table holds rungs "
              f"{report.rung_ranges(row['rung'] for row in table['rungs'])}\n\n{markdown}", flush=True)
    if left:
        print(f"--time-limit: the rest of this part is {plan.describe_left(left)}; measure it with:\n  "
              f"{plan.continuation_command(args.argv, left, missing)}", flush=True)
    if stopped:
        return 128 + stopped.args[0] if isinstance(stopped, runner.Stopped) else 130
    if all(job.script for job in planned):  # only script checks (--rungs none): they are the command's measurement
        return failures.EXIT_OK if done and not any(row["error"] for row in done) else failures.EXIT_FAILED
    return failures.EXIT_OK if any(row.get("tokens_per_sec") for row in done if "script" not in row) \
        else failures.EXIT_FAILED


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
    sys.exit(failures.process_done(main()))
