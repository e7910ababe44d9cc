"""The stages as a user runs them, end to end: throughput, MFU, memory, and where each run's wall clock went.

  python bench/stages.py            # on a GPU: the four runs below, into bench/results/<gpu>/stages/
  python bench/stages.py --tiny     # the same runs with the tiny model and a few steps: a smoke test on a CPU

The runs, each a fresh process with the stage's own defaults:

  00       python 00_orig.py --max-steps 200          the baseline, cut short (a whole epoch takes minutes)
  01-cold  python 01_opt_single_gpu.py                all five epochs, torch.compile with an empty cache
  01-warm  python 01_opt_single_gpu.py                the same again, with the cache the cold run filled
  02       torchrun --standalone --nproc_per_node=1 02_opt_multi_gpu_ddp.py    DDP at world size 1, empty cache

torch.compile keeps what it compiled on disk (Inductor's and Triton's caches) and a second run loads it
instead of compiling again. Each run here gets a cache folder of its own, empty, except 01-warm, which
reuses 01-cold's, so "cold" and "warm" mean the same on every machine, whatever ran there before. The caches
are deleted at the end. Each run's figures are one row file, rows/<run>.json (bench/rows.py), and the tables are
rendered from the rows present, so commands into the same folder fill one table (`--runs 00,01-cold,01-warm`, then
`--runs 02`, where one command may run for at most 10 minutes): a run measured again replaces its row, and a command
on another GPU, PyTorch or CUDA is refused. `--runs missing` runs what has no row, so the same command
again goes on where one cut off stopped.

Every stage ends its log with its wall clock split into start-up, compilation, training, evaluation,
sampling and outputs (metrics.json's wall_clock_s); this script sets those side by side with the whole
command's time (torchrun's start included), the Avg tok/sec, MFU and memory of each run. It writes
stages.md (the tables), stages.json (the numbers), rows/ and logs/<run>.log, and keeps each run's metrics.json and
loss plots under runs/<run>/ (the checkpoints are deleted: 2 GB each at full size).

With `--option NAME` (one of the ladder's options that the stage scripts take: bench/rungs.py's STAGE_OPTIONS),
the runs of 01 and 02 start through bench/script_with_options.py, which switches the option on in their process,
and go to a folder of their own (bench/results/<gpu>-<option>/stages/): what a lever does to a whole run, its
compilation included, beside the plain runs of the stages' folder. 00 compiles nothing and takes no option.

Exit code 0 when every run finished, 1 when one failed (its row says how; its log has the rest), 2 for a
wrong command line, 130 on Ctrl-C (143 and 129 on SIGTERM and SIGHUP).
"""

import argparse
import json
import shlex
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the plumbing modules and bench, wherever the script is started from

import cli  # noqa: E402  (needs the path above)
import failures
import timekeeping
from bench import rows  # noqa: E402
from bench.rows import MISSING  # noqa: E402
from bench.runner import (SINGLE_NODE_TORCHRUN, Stopped, cpu_note, describe_device, drop_checkpoints,  # noqa: E402
                          failure_from_output, git_revision, nvidia_driver, run_streaming, start_run_folder,
                          stop_on_signals)
from data import files  # noqa: E402

TORCHRUN_ONE_PROCESS = ("torchrun", "--standalone", "--nproc_per_node=1")
# name: (what the user types after python or torchrun, the flags of this run, whose compile cache it uses)
RUNS = {
    "00": (("00_orig.py",), ("--max-steps", "200"), "00"),
    "01-cold": (("01_opt_single_gpu.py",), (), "01"),
    "01-warm": (("01_opt_single_gpu.py",), (), "01"),
    "02": ((*TORCHRUN_ONE_PROCESS, "02_opt_multi_gpu_ddp.py"), (), "02"),
}
TINY_STEPS = 12  # --tiny: every run stops there (with an evaluation every 4 steps)
PHASES = timekeeping.WALL_CLOCK_PHASES
# What the rows of one table share: {context key: its name for a user}
MATCHED = {"device_name": "GPU", "torch": "PyTorch", "cuda": "CUDA", "tiny": "--tiny", "options": "--option"}


def build_parser():
    from bench.rungs import STAGE_OPTIONS  # here, not at the top: the tables (bench/readme_tables.py) need no torch

    parser = cli.OneLineParser(prog="bench/stages.py", description=__doc__, allow_abbrev=False,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true",
                        help=f"the stages' tiny model, {TINY_STEPS} steps each: a smoke test on a CPU")
    parser.add_argument("--runs",
                        help=f"which runs, comma-separated (default: all: {','.join(RUNS)}; with --option, all but "
                             f"00); 01-warm needs 01-cold; '{MISSING}': those the folder's rows/ holds no row for (the "
                             "same command again goes on where the last one stopped)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="passed to every stage (default: auto)")
    parser.add_argument("--out", help="results folder (default: bench/results/<gpu or cpu name>/stages/, "
                                      "-<option> for each --option and -tiny under --tiny appended to the "
                                      "device's folder)")
    parser.add_argument("--option", action="append", default=[], choices=STAGE_OPTIONS, metavar="NAME",
                        help="switch on one of the ladder's options in the runs of 01 and 02 (repeatable; "
                             f"{', '.join(STAGE_OPTIONS)}: bench/README.md says what each does); the runs go "
                             "to a folder of their own")
    parser.add_argument("--run-timeout", type=cli.whole_number(1), default=1200, metavar="SECONDS",
                        help="stop a run that takes longer than this (default: 1200)")
    return parser


def runs_taking(options):
    """The runs a command with --option `options` may start: all of them without options; else those that compile."""
    return [name for name in RUNS if not options or name != "00"]


def chosen_runs(text, options=()):
    if text.strip() == MISSING:
        return MISSING
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in RUNS]
    if unknown or not names:
        raise failures.UsageError(f"--runs {text}: unknown {', '.join(unknown) or 'empty list'}; the runs are "
                                f"{', '.join(RUNS)}, or {MISSING}")
    if options and "00" in names:
        raise failures.UsageError(f"--runs 00 with --option: 00 compiles nothing and takes no option; the runs with "
                                  f"options are {', '.join(runs_taking(options))}")
    if "01-warm" in names and "01-cold" not in names:
        raise failures.UsageError("--runs: 01-warm reuses the compile cache that 01-cold fills: name both")
    return [name for name in RUNS if name in names]  # in their own order: cold before warm


def command_of(name, args, run_dir):
    """(the command as a user types it, the command this script starts) for run `name`; with options, the script
    started through bench/script_with_options.py, which switches PyTorch's settings on first (an option that is an
    environment variable, expandable-segments, is set by measure(), and shown before the command)."""
    from bench.rungs import SCRIPT_SETTINGS, option_environment

    typed, flags, _ = RUNS[name]
    if args.tiny:
        flags = ("--tiny", "--max-steps", str(TINY_STEPS), "--eval-freq", "4")
    flags = (*flags, *(("--device", args.device) if args.device != "auto" else ()))
    options = tuple(part for option in args.option if option in SCRIPT_SETTINGS for part in ("--option", option))
    script = ("bench/script_with_options.py", *options, typed[-1]) if options else typed[-1:]
    shown = ("python", *script, *flags) if typed[0] != "torchrun" else (*typed[:-1], *script, *flags)
    shown = (*(f"{key}={value}" for key, value in option_environment(args.option).items()), *shown)
    launcher = ([sys.executable, *SINGLE_NODE_TORCHRUN, *typed[2:-1], "--log-dir", run_dir / "torchrun"]
                if typed[0] == "torchrun" else [sys.executable])
    return shlex.join(shown), [*launcher, ROOT / script[0], *script[1:], *flags, "--out", run_dir]


def measure(name, args, out):
    """Run one of RUNS into out/runs/<name> and read its metrics.json into a row."""
    run_dir, log_path = out / "runs" / name, out / "logs" / f"{name}.log"
    shown, command = command_of(name, args, run_dir)
    cache = out / "compile-cache" / RUNS[name][2]
    if name != "01-warm":  # cold: not even what a run of this script cut off before its cleanup left behind
        shutil.rmtree(cache, ignore_errors=True)
    from bench.rungs import option_environment

    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
           **option_environment(args.option)}
    start_run_folder(run_dir)
    print(f"[{name}] $ {shown}", flush=True)
    started = time.monotonic()
    try:
        code, tail = run_streaming(command, log_path, args.run_timeout, env=env)
    finally:
        drop_checkpoints(run_dir)
    seconds = time.monotonic() - started
    row = {"run": name, "command": shown, "command_seconds": round(seconds, 1), "error": None}
    metrics_path = run_dir / "metrics.json"
    if code != 0 or not metrics_path.exists():
        return {**row, "error": failure_from_output(code, tail, args.run_timeout, limit="--run-timeout")}
    metrics = json.loads(metrics_path.read_text(encoding="utf-8"))
    log = metrics.get("log") or [{}]
    row.update({key: metrics.get(key) for key in ("steps", "tokens_seen", "avg_tok_per_sec", "mfu", "reserved_gb",
                                                  "peak_reserved_gb", "first_interval_peak_reserved_gb",
                                                  "world_size", "precision")})
    row.update({"batch_size": (metrics.get("settings") or {}).get("batch_size"),
                "final_val_loss": log[-1].get("val_loss"), "wall_clock_s": metrics.get("wall_clock_s")})
    print(f"[{name}] done in {seconds:.0f} s: {timekeeping.wall_clock_line(row['wall_clock_s'])}", flush=True)
    return row


def cell(value, spec):
    return "n/a" if value is None else format(value, spec)


def phase_cell(split, phase):
    """A phase's seconds; start-up with its imports beside it, where the run recorded them (timekeeping)."""
    text = cell(split.get(phase), ".1f")
    if phase == "start-up" and split.get("imports") is not None:
        from_source = ", no .pyc" if split.get("imports compiled from source") else ""  # PyTorch's Python compiled
        text += f" (imports {split['imports']:.1f}{from_source})"
    return text


def tables(report):
    """The two tables of a stages report, as Markdown lines: each run's figures, then its wall clock."""
    lines = ["| run | command | steps | batch | Avg tok/sec | MFU | reserved GiB | peak reserved GiB "
             "(first interval's) | final val loss |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in report["runs"]:
        if row["error"]:
            lines.append(f"| {row['run']} | `{row['command']}` | failed: {row['error']} | | | | | | |")
            continue
        lines.append(f"| {row['run']} | `{row['command']}` | {row['steps']} | {row['batch_size']} | "
                     f"{cell(row['avg_tok_per_sec'], ',.0f')} | {cell(row['mfu'], '.1%')} | "
                     f"{cell(row['reserved_gb'], '.2f')} | {cell(row['peak_reserved_gb'], '.2f')} "
                     f"({cell(row.get('first_interval_peak_reserved_gb'), '.2f')}) | "
                     f"{cell(row['final_val_loss'], '.3f')} |")
    imports = any("imports" in (row.get("wall_clock_s") or {}) for row in report["runs"])
    from_source = any((row.get("wall_clock_s") or {}).get("imports compiled from source") for row in report["runs"])
    lines += ["", "Wall clock, in seconds: the whole command, then the run's own split from the moment its process "
                  "started (the last line of its log; torchrun's start and the process's exit are outside it)."
              + (" Start-up's imports: what came before the stage's main() began its set-up." if imports else "")
              + (" No .pyc: PyTorch's Python had no bytecode cache, so that process compiled it again (the run's log "
                 "says how to make one)." if from_source else ""), "",
              "| run | whole command | " + " | ".join(PHASES) + " |",
              "| --- | ---: | " + " | ".join("---:" for _ in PHASES) + " |"]
    for row in report["runs"]:
        split = row.get("wall_clock_s") or {}
        lines.append(f"| {row['run']} | {row['command_seconds']:.1f} | "
                     + " | ".join(phase_cell(split, phase) for phase in PHASES) + " |")
    lines += ["", cache_note([row["run"] for row in report["runs"]]) + " Avg tok/sec leaves out each run's "
                  "first log interval (warm-up and compilation); memory is in GiB, reserved at the end of the run and "
                  "its peak."]
    return lines + start_up_table(report["runs"])


def start_up_table(runs):
    """Start-up part by part (timekeeping.START_UP_PARTS), in seconds, for the runs that recorded its parts."""
    split = {row["run"]: row["wall_clock_s"] for row in runs if "start-up parts" in (row.get("wall_clock_s") or {})}
    if not split:
        return []
    parts = ["imports", *timekeeping.START_UP_PARTS]
    lines = ["", "Start-up, part by part, in seconds: the imports, then each part the stage's `main()` names "
                 "(docs/measuring.md).", "", "| run | " + " | ".join(parts) + " |",
             "| --- | " + " | ".join("---:" for _ in parts) + " |"]
    for run, wall_clock in split.items():
        seconds = {"imports": wall_clock["imports"], **wall_clock["start-up parts"]}
        lines.append(f"| {run} | " + " | ".join(cell(seconds.get(part), ".2f") for part in parts) + " |")
    return lines


def cache_note(names):
    """Which compile cache each run of the table started with, naming only the runs it holds."""
    said = []
    if "01-cold" in names:
        said.append("01-cold compiled into an empty cache")
    if "01-warm" in names:
        said.append("01-warm into the cache 01-cold filled")
    others = [name for name in names if name not in ("00", "01-cold", "01-warm")]
    if others:
        said.append(f"{' and '.join(others)} {'each ' if len(others) > 1 else ''}started with an empty cache")
    if "00" in names:
        said.append("00 compiles nothing")
    return "; ".join(said) + "."


def render_markdown(report):
    return "\n".join([f"# The stages end to end on {report['device']}", "",
                      f"PyTorch {report['torch']}, CUDA {report['cuda'] or '-'}, driver {report['driver'] or '-'}, "
                      f"Python {report['python']}; measured by " + "; then ".join(
                          f"`{part['command']}` ({part['date']}, commit {part['git'] or '-'}: "
                          f"{', '.join(part['runs'])})" for part in report["parts"]), "", *options_note(report),
                      *tables(report)]) + "\n"


def options_note(report):
    """The options every run of the table had switched on, each with what it does (bench/rungs.py's OPTIONS)."""
    if not report.get("options"):
        return []
    from bench.rungs import OPTIONS

    names = report["options"].split(",")
    return [f"With `--option {name}`: {OPTIONS[name]}." for name in names] + [""]


def missing_runs(found, options=()):
    """--runs missing: the runs without a row (a failed run keeps its row: name it to run it again), 01-cold with
    01-warm, whose cache it fills in the same command; with options, not 00."""
    names = [name for name in runs_taking(options) if name not in found]
    return [name for name in RUNS if name in names or name == "01-cold" and "01-warm" in names]


def collect(found):
    """stages.json's report from the folder's rows: the header of the newest row, the commands, the runs in order."""
    newest = max(found.values(), key=lambda row: row["context"]["command"]["started_at"])["context"]
    return {**{key: newest.get(key) for key in ("device", "device_name", "torch", "cuda", "driver", "python", "tiny",
                                                "options")},
            "parts": [{"command": command["command"], "date": command["started_at"], "git": command["git"],
                       "runs": [name for name in RUNS if name in command["rows"]]}
                      for command in rows.commands(found)],
            "runs": [{key: value for key, value in found[name].items() if key != "context"}
                     for name in RUNS if name in found]}


def render(out):
    """stages.json and stages.md again, from the rows present; returns the table."""
    report = collect(rows.read_rows(out, "stages.json"))
    files.write_json(out / "stages.json", report)
    markdown = render_markdown(report)
    files.write_atomically(out / "stages.md", markdown.encode("utf-8"))
    return markdown


def main(argv=None):
    args = build_parser().parse_args(argv)
    args.option = sorted(set(args.option))  # each once, in one order: the folder's name and the rows' context
    args.runs = args.runs or ",".join(runs_taking(args.option))
    try:
        names = chosen_runs(args.runs, args.option)
        device_info = describe_device(args)
        out = Path(args.out) if args.out else (ROOT / "bench" / "results" / (device_info["slug"] + "".join(
            f"-{option}" for option in args.option) + ("-tiny" if args.tiny else "")) / "stages")
        context = {"device": device_info["description"], "device_name": device_info["name"],
                   "torch": device_info["torch"], "cuda": device_info["cuda"], "driver": nvidia_driver(),
                   "python": device_info["python"], "tiny": args.tiny, "options": ",".join(args.option) or None,
                   "command": {"started_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                               "command": shlex.join(["python", "bench/stages.py",
                                                      *(argv if argv is not None else sys.argv[1:])]),
                               "git": git_revision()}}
        found = rows.read_rows(out, "stages.json")
        rows.refuse_a_different_part(found, context, MATCHED, out, "runs")
        if names == MISSING:
            names = missing_runs(found, args.option)
            if not names:
                print(f"--runs missing: nothing left to run: {out / rows.FOLDER} holds every run")
                return failures.EXIT_OK
        (out / "logs").mkdir(parents=True, exist_ok=True)
        note = cpu_note(device_info, args.tiny, runs="stage runs")
        if note:
            print(note, flush=True)
    except failures.UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return failures.EXIT_USAGE
    except OSError as err:
        print(f"error: cannot write into {err.filename or args.out}: {err.strerror or err}", file=sys.stderr)
        return failures.EXIT_USAGE
    stop_on_signals()  # SIGTERM and SIGHUP as Ctrl-C: the run in progress is stopped with everything it started
    failed = False
    try:
        for name in names:
            row = measure(name, args, out)
            failed = failed or bool(row["error"])
            rows.write_row(out, name, {**row, "context": context})  # a cut-off keeps the runs that finished
            markdown = render(out)
    except KeyboardInterrupt as err:
        print("interrupted: the runs that finished are in stages.md", file=sys.stderr)
        return 128 + err.args[0] if isinstance(err, Stopped) else 130
    finally:
        shutil.rmtree(out / "compile-cache", ignore_errors=True)
    print(markdown)
    print(f"Wrote {out}/stages.md, stages.json, {rows.FOLDER}/, logs/ and runs/")
    return failures.EXIT_FAILED if failed else failures.EXIT_OK


if __name__ == "__main__":
    sys.exit(failures.process_done(main()))
