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
import contextlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the plumbing modules, data and bench, wherever the script is started from

import cli  # noqa: E402  (needs the path above; imports no torch)
import devices
import failures
import timekeeping
import utilization
from bench import report  # noqa: E402

FAIL_HOOK_VARIABLE = "LADDER_FAIL_RUNG"
REAL_VOCAB_SIZE = 50257  # GPT-2's tokenizer: MFU counts useful work, not the padded vocabulary rows

# Steps and timing windows; --steps, --warmup and --windows override them.
FULL_DEFAULTS = {"warmup": 10, "steps": 30, "windows": 5}
TINY_DEFAULTS = {"warmup": 2, "steps": 10, "windows": 5}

# What a stage script's run folder keeps once the rung is measured: its checkpoint (2 GB at full size, far more
# for the larger models) is only the price of running the script as it is.
KEPT_FROM_SCRIPT_RUNS = ("metrics.json", "loss.png", "loss.pdf")


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


def failing_rungs_for_testing():
    """Rungs named in LADDER_FAIL_RUNG (a testing hook: those rungs fail on purpose)."""
    text = os.environ.get(FAIL_HOOK_VARIABLE, "")
    return {int(part) for part in re.findall(r"\d+", text)}


# ---------------------------------------------------------------------------------------------
# Worker modes (each in its own process)
# ---------------------------------------------------------------------------------------------

def short_error(exc):
    """One line for the table: the exception's type and the first line of its message, shortened."""
    first_line = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
    if "out of memory" in text.lower() and not text.lower().startswith("out of memory"):
        text = "out of memory: " + text
    return text if len(text) <= 160 else text[:157] + "..."


def cpu_model_name():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def slug(text):
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def describe_device_main(args):
    """Worker mode: what the device is, as one line of JSON on stdout (asked in a child so that the parent never
    holds a CUDA context)."""
    import torch

    # the ladder times CUDA GPUs and CPUs: auto never picks an Apple GPU here (nothing on MPS is timed yet)
    device = devices.pick_device("cpu" if args.device == "auto" and not torch.cuda.is_available() else args.device)
    cuda = device.type == "cuda"
    if cuda:
        name = torch.cuda.get_device_name(device)
        device_slug = slug(name)
    else:
        name = cpu_model_name()
        device_slug = "cpu-" + slug(re.sub(r"\((R|TM)\)|\bCPU\b|@.*$", " ", name))
    info = {
        "device_type": device.type,
        "name": name,
        "slug": device_slug,
        "description": devices.describe_device(device, matmul_precision=False),  # each rung sets its own
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,  # the CUDA the GPU runs with; none on a CPU
        "python": platform.python_version(),
        "peak_flops": {precision: utilization.peak_flops(device, precision) for precision in utilization.PRECISIONS},
        # the precision 01 and 02 train in here (their main() decides it the same way)
        "stage01_precision": devices.autocast_precision(device)[0],
    }
    print(json.dumps(info), flush=True)
    return failures.EXIT_OK


def run_rung_main(args):
    """Worker mode: compose one single-process rung, time it and write its result as JSON."""
    import torch

    from bench import rungs
    from data import load_corpus

    number = args.run_rung
    result = {"rung": number, "error": None}
    heartbeat = timekeeping.Heartbeat()  # a line every ~10 s of silence (compilation is long and quiet)
    device = None

    def say(text):
        print(f"rung {number}: {text}", flush=True)

    try:
        device = devices.pick_device(args.device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        heartbeat.doing = "composing the rung from the stage scripts"
        rungs.apply_options(args.option)  # --option: measured options, switched on before anything compiles
        rung = rungs.compose(number, device, args.tiny, seed=args.seed, model=args.model,
                             batch_size=args.batch_size, options=args.option)
        parameters = sum(p.numel() for p in rung.model.parameters())
        result.update(precision=rung.precision, batch_size=rung.batch_size, vocab_size=rung.cfg["vocab_size"],
                      context_length=rung.cfg["context_length"], parameters=parameters, world_size=1,
                      notes=rung.notes + [f"option {name}: {rungs.OPTIONS[name]}" for name in args.option])
        say(f"{rungs.CHANGES[number]} | {parameters:,} parameters | batch {rung.batch_size} x "
            f"{rung.cfg['context_length']} tokens | precision {rung.precision} | "
            f"{devices.describe_device(device)}" + "".join(f" | {note}" for note in rung.notes))

        heartbeat.doing = "opening the corpus"
        loader = rung.make_train_loader(load_corpus(args.data).train, args.seed)

        heartbeat.doing = "warming up" + (" (the first step compiles the model)" if number >= 8 else "")
        timing = rungs.measure(rung, loader, args.seed, args.warmup, args.steps, args.windows, say=say,
                               fail_on_purpose=number in failing_rungs_for_testing())
        heartbeat.doing = "finishing"
        result.update(timing, steps=args.steps, warmup_steps=args.warmup)
        flops = utilization.flops_per_token(rung.cfg, tokenizer.n_vocab)
        result["mfu"] = utilization.mfu(timing["tokens_per_sec"], flops, utilization.peak_flops(device, rung.precision))
        if not math.isfinite(timing["final_loss"]):
            result["error"] = f"training broke: the loss is {timing['final_loss']} at the last step"
            result["final_loss"] = None  # JSON has no NaN
        say(f"median {timing['tokens_per_sec']:,.0f} tok/s (min {timing['tokens_per_sec_min']:,.0f}, "
            f"max {timing['tokens_per_sec_max']:,.0f}), final loss {timing['final_loss']:.4f}")
    except Exception as exc:  # any failure becomes the rung's row; the ladder goes on
        traceback.print_exc()
        result["error"] = short_error(exc)
    finally:
        if device is not None and device.type == "cuda":  # GiB: the timed steps' peaks and the warm-up's
            memory = utilization.memory_metrics(device)
            result.update({key: memory[key] for key in ("peak_allocated_gb", "peak_reserved_gb",
                                                        "first_interval_peak_allocated_gb",
                                                        "first_interval_peak_reserved_gb")})
            say(utilization.peak_memory_line(memory))
        report.write_json(result, args.result)
    return failures.EXIT_OK if result["error"] is None else failures.EXIT_FAILED


# ---------------------------------------------------------------------------------------------
# Running children
# ---------------------------------------------------------------------------------------------

def parent_death_signal():
    """A function for Popen's preexec_fn that has the child sent SIGTERM when the thread that started it ends,
    however it ends (Linux's PR_SET_PDEATHSIG); None where there is no such thing.

    A child leads its own session (so that it can be stopped as a whole), and so a kill of this process's group
    (a job queue's time limit, `timeout`) would not reach it: without this it would go on holding the GPU, and time
    the next command's runs against its own. On SIGTERM a stage saves its checkpoint and exits, and torchrun stops
    its workers."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def set_signal():  # in the child, between fork and exec: no imports, no allocation worth the name
        prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the call above: no signal would come
            os.kill(os.getpid(), signal.SIGTERM)

    return set_signal


def descendants(pid):
    """The pids of every process below `pid`, read from Linux's /proc (empty elsewhere). A launcher may start its
    children in sessions of their own (torchrun does), where a signal to the launcher's group does not reach them."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (command name)": state, ppid, ...
        except (OSError, IndexError):
            continue  # gone meanwhile, or not a process's
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        below = children.get(queue.pop(), [])
        found += below
        queue += below
    return found


def stop_process_group(process, grace=10):
    """End a child we started and everything it started: SIGTERM to its group first (a stage saves its checkpoint,
    torchrun passes the signal on to its workers), then, after `grace` seconds or once it has ended, SIGKILL to
    whatever is left of the group and of the processes below it, torchrun's workers included (they lead sessions of
    their own, out of reach of a signal to the group)."""
    below = set(descendants(process.pid))  # before any signal: a dead parent's children are no longer below it
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        below |= set(descendants(process.pid))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    for pid in below:  # a worker left running after its launcher would hold the GPU under the next run
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


def run_streaming(command, log_path, timeout, echo_prefix="    ", env=None):
    """Run `command` from the repository root (with `env` added to the environment); stream its output to the
    console and to log_path.

    Returns (exit code or None when it timed out, the last lines of its output).
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    tail = deque(maxlen=100)  # torchrun's report of a failed child alone is some 40 lines
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(map(str, command))}\n")
        log.flush()
        process = subprocess.Popen(list(map(str, command)), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace",
                                   start_new_session=True,  # its own group: stopped as a whole
                                   preexec_fn=parent_death_signal())  # and never outliving this process

        def pump():
            for line in process.stdout:
                log.write(line)
                log.flush()
                tail.append(line.rstrip())
                print(echo_prefix + line.rstrip(), flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_process_group(process)
            code = None
        except KeyboardInterrupt:
            stop_process_group(process)
            raise
        finally:
            reader.join(timeout=10)
    return code, list(tail)


def worker_command(args, *mode):
    command = [sys.executable, Path(__file__).resolve(), *mode, "--data", args.data, "--device", args.device,
               "--seed", args.seed, "--warmup", args.warmup, "--steps", args.steps, "--windows", args.windows,
               "--model", args.model]
    return (command + (["--tiny"] if args.tiny else []) + (["--batch-size", args.batch_size] if args.batch_size else [])
            + [flag for name in args.option for flag in ("--option", name)])


def describe_device(args):
    """Ask a child process what the device is; a wrong --device ends the ladder with exit code 2."""
    done = subprocess.run([sys.executable, Path(__file__).resolve(), "--describe-device", "--device", args.device],
                          cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        message = (done.stderr.strip().splitlines() or ["could not query the device"])[-1]
        raise failures.UsageError(message.removeprefix("error: "))
    return json.loads(lines[-1])


# A line that says what went wrong: an exception, or a stage's one-line message; torchrun's own report of a failed
# child (ChildFailedError and a framed summary) comes after the child's line and says less.
ERROR_LINE = re.compile(r"^(\w+\.)*\w*(Error|Exception)\b(?<!ChildFailedError)|^error:|^training failed:")


def failure_from_output(code, tail, timeout, limit="--rung-timeout"):
    if code is None:
        return f"timed out after {timeout} s ({limit})"
    lines = [line.strip() for line in tail if re.search(r"\w", line)]
    errors = [line for line in lines if ERROR_LINE.search(line)]
    last = (errors or lines or [""])[-1]
    return f"exited with code {code}" + (f": {last[:120]}" if last else "")


def timed_out(timeout, limit):
    """The row of a run stopped at its timeout; `limit` names the flag that set it (kept until cut_at_the_limit)."""
    return {"error": failure_from_output(None, [], timeout, limit), "timed_out": limit}


def run_single_process_rung(number, args, logs, timeout, limit="--rung-timeout"):
    result_path = logs / f"rung-{number:02d}.json"
    result_path.unlink(missing_ok=True)
    from bench.rungs import option_environment

    command = worker_command(args, "--run-rung", number, "--result", result_path)
    code, tail = run_streaming(command, logs / f"rung-{number:02d}.log", timeout, env=option_environment(args.option))
    result = json.loads(result_path.read_text()) if result_path.exists() else {"rung": number}
    if code is None:
        return {**result, **timed_out(timeout, limit)}
    return result if result_path.exists() else {**result, "error": failure_from_output(code, tail, timeout)}


def script_schedule(warmup, steps, windows, steps_per_epoch=None):
    """How to run a stage script so that its own log yields the ladder's timing windows.

    A stage script logs every --eval-freq steps (evaluation off the clock) and leaves only its first
    interval (step 0 alone) out of its average. So its log interval is made the window length, whole
    intervals covering the warm-up are run and dropped here, and so is an interval that holds the first
    step of an epoch, as rungs.measure does (unless epochs are too short to hold a whole window).
    Returns (window length, the last steps of the measured intervals, --max-steps).
    """
    from bench.rungs import crosses_epoch

    window = max(1, steps // windows)
    measured_windows = max(1, steps // window)
    skipped_windows = math.ceil(max(0, warmup - 1) / window)  # step 0 is an interval of its own
    avoid_boundaries = steps_per_epoch is not None and steps_per_epoch > window
    ends, interval = [], skipped_windows
    while len(ends) < measured_windows:
        interval += 1
        first, last = (interval - 1) * window + 1, interval * window
        if not (avoid_boundaries and crosses_epoch(first, last, steps_per_epoch)):
            ends.append(last)
    return window, ends, ends[-1] + 1


def own_batch_size(stage, tiny):
    """A stage script's own batch (its --tiny one under --tiny)."""
    return (stage.TINY_SETTINGS if tiny else stage.OTHER_SETTINGS)["batch_size"]


def script_steps_per_epoch(stage, args, processes):
    """Steps per epoch of a stage script on this corpus, from its own dataset class and batch size."""
    from bench.rungs import training_windows
    from data import load_corpus

    context = (stage.TINY_CONFIG if args.tiny else stage.GPT_CONFIG_124M)["context_length"]  # the same at any size
    dataset = training_windows(stage, load_corpus(args.data).train, context)
    batch_size = args.batch_size or own_batch_size(stage, args.tiny)
    return len(dataset) // processes // batch_size  # the shards of DistributedSampler, then whole batches


def script_flags(args, run_dir, max_steps, window, stage=None):
    """The flags a stage script runs with in the ladder: the ladder's settings, its schedule and --out; with
    --option grad-accum, the batch (the stage's own or --batch-size) as micro-batches of --grad-accum-steps."""
    from bench.rungs import ACCUMULATION_STEPS

    batch = ["--batch-size", args.batch_size] if args.batch_size else []
    if "grad-accum" in args.option and stage is not None:
        whole = args.batch_size or own_batch_size(stage, args.tiny)
        if whole % ACCUMULATION_STEPS:
            raise ValueError(f"--option grad-accum: batch {whole} does not divide into {ACCUMULATION_STEPS} "
                             "micro-batches (give --batch-size a multiple of it)")
        batch = ["--batch-size", whole // ACCUMULATION_STEPS, "--grad-accum-steps", ACCUMULATION_STEPS]
    return (["--data", args.data, "--device", args.device, "--seed", args.seed, "--model", args.model,
             "--max-steps", max_steps, "--eval-freq", window, "--eval-iter", 1, "--epochs", 1000, "--out", run_dir]
            + (["--tiny"] if args.tiny else []) + batch)


def start_run_folder(run_dir):
    """An empty run folder for a stage script (the one an earlier measurement left is this ladder's own)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)


def drop_checkpoints(run_dir):
    """Remove all but KEPT_FROM_SCRIPT_RUNS from a stage script's run folder: the checkpoint (model.pth, a sharded
    state beside it), torchrun's own files and anything else only the run itself needed."""
    if not run_dir.exists():
        return
    for entry in run_dir.iterdir():
        if entry.name in KEPT_FROM_SCRIPT_RUNS:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def run_stage_script(script_name, launcher, args, device_info, log_path, run_dir, timeout, limit, processes=1):
    """Run a stage script as it is (flags only) into `run_dir` and read its metrics.json into a ladder row.

    Its numbers come from its own clock (the per-interval `Step tok/sec` of its log, all processes
    together), not from the ladder's timing loop; see script_schedule for how the two are lined up.
    """
    from bench.rungs import load_stage

    script = ROOT / script_name
    if not script.exists():
        log_path.write_text(f"{script_name} does not exist: nothing to run\n")
        return {"error": f"{script_name} does not exist (yet)"}
    stage = load_stage(script_name)
    steps_per_epoch = script_steps_per_epoch(stage, args, processes)
    window, measured_ends, max_steps = script_schedule(args.warmup, args.steps, args.windows, steps_per_epoch)
    start_run_folder(run_dir)
    try:
        code, tail = run_streaming([*launcher, script, *script_flags(args, run_dir, max_steps, window, stage)],
                                   log_path,
                                   timeout)
    finally:
        drop_checkpoints(run_dir)  # also after a failure or an interrupt: a checkpoint is never needed here
    metrics_path = run_dir / "metrics.json"
    if code is None:
        return timed_out(timeout, limit)
    if code != 0 or not metrics_path.exists():
        return {"error": failure_from_output(code, tail, timeout)}
    metrics = json.loads(metrics_path.read_text())

    log = sorted(metrics.get("log", []), key=lambda entry: entry["step"])
    windows = [entry["step_tok_per_sec"] for previous, entry in zip(log, log[1:])
               if entry["step"] in measured_ends and previous["step"] == entry["step"] - window
               and entry.get("step_tok_per_sec")]
    if not windows:
        return {"error": f"{script_name} logged no interval after the warm-up (too few steps?)"}
    world_size = metrics.get("world_size") or 1
    precision = metrics.get("precision") or device_info["stage01_precision"]
    median = statistics.median(windows)
    mfu = None
    if metrics.get("config"):
        mfu = utilization.mfu(median / world_size, utilization.flops_per_token(metrics["config"], REAL_VOCAB_SIZE),
                         device_info["peak_flops"].get(precision))
    last = log[-1]
    final_loss = last.get("train_loss")
    return {
        "error": None, "tokens_per_sec": median, "tokens_per_sec_min": min(windows),
        "tokens_per_sec_max": max(windows), "window_tokens_per_sec": windows, "mfu": mfu, "precision": precision,
        "world_size": world_size, "batch_size": (metrics.get("settings") or {}).get("batch_size"),
        "stage_batch_size": own_batch_size(stage, args.tiny),
        "peak_allocated_gb": metrics.get("peak_allocated_gb"), "peak_reserved_gb": metrics.get("peak_reserved_gb"),
        "first_interval_peak_reserved_gb": metrics.get("first_interval_peak_reserved_gb"),
        "bf16_logits_gb": (None if not metrics.get("config") else (metrics.get("settings") or {}).get("batch_size", 0)
                           * metrics["config"]["context_length"] * metrics["config"]["vocab_size"] * 2 / utilization.GIB),
        "final_loss": final_loss if final_loss is not None and math.isfinite(final_loss) else None,
        "steps": len(windows) * window, "warmup_steps": measured_ends[0] - window + 1,
        "final_loss_step": last.get("step"), "steps_per_epoch": steps_per_epoch,
        "windows_cross_epochs": steps_per_epoch <= window,
    }


def run_multi_process_rung(number, args, device_info, logs, timeout, limit="--rung-timeout"):
    """Rung 11 (02, DDP) or 12 (03, FSDP2): the stage script itself under torchrun, one process per visible GPU
    (one on a CPU), at the same settings, so that the two rows show what sharding costs against DDP.

    These need several processes, so they cannot be composed like the others: each is its script as it is,
    measured by its own clock (see run_stage_script), with its outputs in logs/rung-NN-run/.
    """
    from bench.rungs import MULTI_PROCESS_RUNGS, batch_size_note

    script_name = MULTI_PROCESS_RUNGS[number]
    log_path = logs / f"rung-{number:02d}.log"
    if number in failing_rungs_for_testing():
        message = f"rung {number} failed on purpose ({FAIL_HOOK_VARIABLE} testing hook)"
        log_path.write_text(message + "\n")
        return {"rung": number, "error": message}
    processes = device_info["gpu_count"] if device_info["device_type"] == "cuda" else 1
    run_dir = logs / f"rung-{number:02d}-run"
    torchrun = [sys.executable, *devices.SINGLE_NODE_TORCHRUN, f"--nproc_per_node={processes}",
                "--log-dir", run_dir / "torchrun"]  # torchrun's own files: not in /tmp
    row = run_stage_script(script_name, torchrun, args, device_info, log_path, run_dir, timeout, limit, processes)
    row["rung"] = number
    if row["error"] is None:
        world_size = row["world_size"]
        row["run_folder"] = str(run_dir.relative_to(logs.parent))
        row["notes"] = [f"{world_size} process{'es' if world_size > 1 else ''}: tok/s of all together, by "
                        f"{Path(script_name).stem[:2]}'s own clock; final loss: its evaluation at step "
                        f"{row['final_loss_step']}"]
        if number == 12 and row.get("bf16_logits_gb"):  # measured beside rung 11, not fixed: say what it is
            row["notes"].append(f"03 compiles its loss apart from the sharded model, so the logits enter that graph "
                                f"as an input and their gradient takes a buffer of its own ({row['bf16_logits_gb']:.2f}"
                                " GiB in bf16), where 01 and 02 write it over the saved logits: memory that has "
                                "nothing to do with sharding")
        if "grad-accum" in args.option:
            from bench.rungs import ACCUMULATION_STEPS, OPTIONS
            row["notes"].append(f"option grad-accum: batch {row['batch_size']} x --grad-accum-steps "
                                f"{ACCUMULATION_STEPS} per process: {OPTIONS['grad-accum']}")
        override = batch_size_note(args.batch_size, row["stage_batch_size"])
        if override:
            row["notes"].append(override)
    return row


def script_checks():
    """--check-scripts: (script, the rung it is set beside): 00 and 01 as they are, beside rungs 0 and 10."""
    from bench.rungs import STAGE_00, STAGE_01

    return ((STAGE_00, 0), (STAGE_01, 10))


def run_script_check(script_name, rung, args, device_info, logs, rows, deadline):
    """Run one stage script as it is and set its own clock beside its rung's row (among `rows`)."""
    print(f"Cross-check: {script_name} as it is, for rung {rung}", flush=True)
    stem = Path(script_name).stem
    result = run_stage_script(script_name, [sys.executable], args, device_info, logs / f"script-{stem}.log",
                              logs / f"script-{stem}-run", *run_timeout(args, deadline))
    ladder_row = next((row for row in rows if row["rung"] == rung), None)
    ladder_speed = ladder_row.get("tokens_per_sec") if ladder_row else None
    check = {
        "script": script_name, "rung": rung, "error": result["error"], "timed_out": result.get("timed_out"),
        "tokens_per_sec": result.get("tokens_per_sec"), "tokens_per_sec_min": result.get("tokens_per_sec_min"),
        "tokens_per_sec_max": result.get("tokens_per_sec_max"), "rung_tokens_per_sec": ladder_speed,
        "script_over_rung": (result["tokens_per_sec"] / ladder_speed
                             if result.get("tokens_per_sec") and ladder_speed else None),
        "peak_reserved_gb": result.get("peak_reserved_gb"),
    }
    print(f"Cross-check: {script_name}: {summarize(check)}", flush=True)
    return check


# ---------------------------------------------------------------------------------------------
# The ladder
# ---------------------------------------------------------------------------------------------

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


def summarize(row):
    if row.get("tokens_per_sec") is None:
        return f"FAILED: {row['error']}"
    text = (f"{row['tokens_per_sec']:,.0f} tok/s (min {row['tokens_per_sec_min']:,.0f}, "
            f"max {row['tokens_per_sec_max']:,.0f})")
    if row.get("final_loss") is not None:
        text += f", loss {row['final_loss']:.3f}"
    if row.get("peak_reserved_gb") is not None:
        text += f", {row['peak_reserved_gb']:.2f} GiB reserved"
    return text + (f" | FAILED: {row['error']}" if row.get("error") else "")


def git_revision():
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (head + ("+uncommitted changes" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


def nvidia_driver():
    if not shutil.which("nvidia-smi"):
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        return (done.stdout.strip().splitlines() or [None])[0]
    except (OSError, subprocess.SubprocessError):
        return None


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, handled as Ctrl-C is: the running rung's processes are stopped, the rungs done are kept."""


def stop_on_signals():
    def stop(signum, frame):
        raise Stopped(signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)


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
        "gpu_count": device_info["gpu_count"], "driver": nvidia_driver(), "cuda": device_info["cuda"],
        "torch": device_info["torch"], "python": device_info["python"], "date": started_at,
        "settings": {"tiny": args.tiny, "model": args.model, "batch_size": args.batch_size, "data": args.data,
                     "seed": args.seed, "warmup_steps": args.warmup, "steps": args.steps,
                     "windows": min(args.windows, args.steps), "device": args.device,
                     "options": ",".join(sorted(args.option)) or None},
        "reference_source": report.REFERENCE_SOURCE,
        "parts": [{"started_at": started_at, "command": shlex.join(["python", "bench/ladder.py", *args.argv]),
                   "git": git_revision(), "rungs": list(args.rungs), "seconds": 0}],
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
    device_info = describe_device(args)
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
    stop_on_signals()

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
            row = (run_multi_process_rung(number, args, device_info, logs, *timeout) if number >= 11
                   else run_single_process_rung(number, args, logs, *timeout))
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
              f"{format_duration(durations[-1])}: {summarize(rows[-1])} | elapsed "
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
                check = run_script_check(script_name, rung, args, device_info, logs,
                                         report.merge(existing, part)["rungs"], deadline)
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
        return 128 + stopped.args[0] if isinstance(stopped, Stopped) else 130
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
            return run_rung_main(args)
        if args.describe_device:
            return describe_device_main(args)
        return run_ladder(args)
    except failures.UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return failures.EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
