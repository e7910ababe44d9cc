"""Benchmark ladder: the original tutorial's table of speed-ups, rebuilt on the machine at hand.

Rung 0 is 00_orig.py, rungs 1 to 10 add the ten optimizations of SPEC.md one at a time (rung 10 is
01_opt_single_gpu.py) and rung 11 is 02_opt_multi_gpu_ddp.py under torchrun on every visible GPU (one
process on a CPU). Each rung runs in a fresh process, on the same corpus, seed and batch order: a few
warm-up steps (not timed), then the measured steps in timing windows. Written to --out:
ladder.md (the table), ladder.json (the numbers), ladder.png (two charts) and logs/ (each rung's raw
output and result).

  python bench/ladder.py                     # every rung, full-size model (a GPU)
  python bench/ladder.py --tiny              # every rung, tiny model: a few minutes on a CPU
  python bench/ladder.py --rungs 0,8,10      # a subset (ranges work too: 0-7)
  python bench/ladder.py --check-scripts     # also run 00 and 01 as they are, beside rungs 0 and 10

Exit code: 0 when at least one rung was measured (failed rungs are reported on their rows), 1 when
none was, 2 for a wrong command line, 130 when interrupted (the rungs done so far are still written).

Testing hook: the environment variable LADDER_FAIL_RUNG=3 (or 3,11) makes those rungs fail on purpose,
to check that a failure is reported on its row while the other rungs still run.
"""

import argparse
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
import tempfile
import threading
import time
import traceback
from collections import deque
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # common, data and bench.rungs, wherever the script is started from

import common  # noqa: E402  (needs the path above; imports no torch)

FAIL_HOOK_VARIABLE = "LADDER_FAIL_RUNG"
REAL_VOCAB_SIZE = 50257  # GPT-2's tokenizer: MFU counts useful work, not the padded vocabulary rows

# The original tutorial's figures, one A100 (rung 11: four), PyTorch 2.6: its README's "Avg tok/sec"
# for steps 0 to 7 and "Step tok/sec" at the end of epoch 1 for 8 to 11 (all GPUs together for 11),
# and torch.cuda.memory_reserved() after the first epoch in GB (bytes / 1024**3, as here).
REFERENCE_SOURCE = ("original tutorial, 1x A100, PyTorch 2.6 (rung 11: 4x A100): Sebastian Raschka, "
                    "LLMs-from-scratch, ch05/10_llm-training-speed/README.md")
REFERENCE = {
    0: (12_525, 26.26), 1: (12_526, 26.24), 2: (27_648, 26.24), 3: (28_399, 26.24), 4: (28_402, 26.24),
    5: (45_486, 13.79), 6: (55_256, 11.56), 7: (91_901, 5.90), 8: (112_046, 6.19), 9: (127_345, 5.89),
    10: (142_156, 22.51), 11: (419_259, 22.80),
}

# Steps and timing windows; --steps, --warmup and --windows override them.
FULL_DEFAULTS = {"warmup": 10, "steps": 30, "windows": 5}
TINY_DEFAULTS = {"warmup": 2, "steps": 10, "windows": 5}

# Short names for the chart's axis.
SHORT_NAMES = {0: "baseline (00)", 1: "mask on the fly", 2: "TF32", 3: "fused AdamW", 4: "pinned memory",
               5: "bf16 / fp16", 6: "native LN/GELU", 7: "SDPA + fused QKV", 8: "torch.compile", 9: "vocab 50,304",
               10: "larger batch (01)", 11: "DDP (02)"}


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def parse_rungs(text):
    """'all', '0,8,10' or ranges like '0-7,10' -> a sorted list of rung numbers."""
    from bench.rungs import ALL_RUNGS

    if text.strip() == "all":
        return list(ALL_RUNGS)
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
    parser = common.OneLineParser(prog="bench/ladder.py", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true",
                        help="the stages' tiny model and batch and fewer steps: every rung in a few minutes "
                             "on a CPU")
    parser.add_argument("--rungs", type=parse_rungs, default="all",
                        help="which rungs: 'all', a list like 0,8,10 or ranges like 0-7 (default: all)")
    parser.add_argument("--steps", type=common.whole_number(1),
                        help=f"measured steps per rung (default: {FULL_DEFAULTS['steps']}; "
                             f"{TINY_DEFAULTS['steps']} with --tiny)")
    parser.add_argument("--warmup", type=common.whole_number(0),
                        help="untimed steps first, enough for torch.compile to finish (default: "
                             f"{FULL_DEFAULTS['warmup']}; {TINY_DEFAULTS['warmup']} with --tiny)")
    parser.add_argument("--windows", type=common.whole_number(1),
                        help="timing windows the measured steps are split into; tok/s is their median "
                             f"(default: {FULL_DEFAULTS['windows']})")
    parser.add_argument("--data", default="shakespeare", metavar="NAME_OR_PATH",
                        help="the corpus, as in the stage scripts (default: shakespeare)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to train; auto: CUDA when available (default: auto)")
    parser.add_argument("--seed", type=int, default=123, help="random seed of every rung (default: 123)")
    parser.add_argument("--out", help="output folder (default: bench/results/<gpu or cpu name>/, "
                                      "with a -tiny suffix under --tiny)")
    parser.add_argument("--check-scripts", action="store_true",
                        help="also run 00_orig.py and 01_opt_single_gpu.py as they are, with the same steps, "
                             "and set their own tok/s beside rungs 0 and 10 (a cross-check of the composition)")
    parser.add_argument("--rung-timeout", type=common.whole_number(1), metavar="SECONDS",
                        help="stop a rung that runs longer than this (default: 1800; 900 with --tiny)")
    # Internal worker modes: ladder.py starts itself with these, one fresh process per rung.
    parser.add_argument("--run-rung", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--describe-device", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser


def resolve_defaults(args):
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
    """Worker mode: what the device is (asked in a child so the parent never holds a CUDA context)."""
    import torch

    # the ladder times CUDA GPUs and CPUs: auto never picks an Apple GPU here (nothing on MPS is timed yet)
    device = common.pick_device("cpu" if args.device == "auto" and not torch.cuda.is_available() else args.device)
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
        "description": common.describe_device(device),
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,  # the CUDA the GPU runs with; none on a CPU
        "python": platform.python_version(),
        "peak_flops": {precision: common.peak_flops(device, precision) for precision in common.PRECISIONS},
        # the precision 01 and 02 train in here (their main() decides it the same way)
        "stage01_precision": common.autocast_precision(device)[0],
    }
    common.write_json(info, args.result)
    return common.EXIT_OK


def run_rung_main(args):
    """Worker mode: compose one single-process rung, time it and write its result as JSON."""
    import torch

    from bench import rungs
    from data import get_tokenizer, load_text

    number = args.run_rung
    result = {"rung": number, "error": None}
    heartbeat = common.Heartbeat()  # a line every ~10 s of silence (compilation is long and quiet)
    device = None

    def say(text):
        print(f"rung {number}: {text}", flush=True)

    try:
        device = common.pick_device(args.device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        heartbeat.doing = "composing the rung from the stage scripts"
        rung = rungs.compose(number, device, args.tiny, seed=args.seed)
        parameters = sum(p.numel() for p in rung.model.parameters())
        result.update(precision=rung.precision, batch_size=rung.batch_size, vocab_size=rung.cfg["vocab_size"],
                      context_length=rung.cfg["context_length"], parameters=parameters, world_size=1,
                      notes=rung.notes)
        say(f"{rungs.CHANGES[number]} | {parameters:,} parameters | batch {rung.batch_size} x "
            f"{rung.cfg['context_length']} tokens | precision {rung.precision} | "
            f"{common.describe_device(device)}" + "".join(f" | {note}" for note in rung.notes))

        heartbeat.doing = "reading and tokenizing the corpus"
        text, tokenizer = load_text(args.data), get_tokenizer()
        loader = rung.make_train_loader(text, tokenizer, args.seed)

        heartbeat.doing = "warming up" + (" (the first step compiles the model)" if number >= 8 else "")
        timing = rungs.measure(rung, loader, args.seed, args.warmup, args.steps, args.windows, say=say,
                               fail_on_purpose=number in failing_rungs_for_testing())
        heartbeat.doing = "finishing"
        result.update(timing, steps=args.steps, warmup_steps=args.warmup)
        flops = common.flops_per_token(rung.cfg, tokenizer.n_vocab)
        result["mfu"] = common.mfu(timing["tokens_per_sec"], flops, common.peak_flops(device, rung.precision))
        if not math.isfinite(timing["final_loss"]):
            result["error"] = f"training broke: the loss is {timing['final_loss']} at the last step"
            result["final_loss"] = None  # JSON has no NaN
        say(f"median {timing['tokens_per_sec']:,.0f} tok/s (min {timing['tokens_per_sec_min']:,.0f}, "
            f"max {timing['tokens_per_sec_max']:,.0f}), final loss {timing['final_loss']:.4f}")
    except Exception as exc:  # any failure becomes the rung's row; the ladder goes on
        traceback.print_exc()
        result["error"] = short_error(exc)
    finally:
        if device is not None and device.type == "cuda":
            result["peak_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 1024**3
            result["peak_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 1024**3
            say(f"peak memory: {result['peak_allocated_gb']:.2f} GiB allocated, "
                f"{result['peak_reserved_gb']:.2f} GiB reserved")
        common.write_json(result, args.result)
    return common.EXIT_OK if result["error"] is None else common.EXIT_FAILED


# ---------------------------------------------------------------------------------------------
# Running children
# ---------------------------------------------------------------------------------------------

def stop_process_group(process):
    """End a child we started and everything it started (it leads its own session)."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_streaming(command, log_path, timeout, echo_prefix="    "):
    """Run `command` from the repository root; stream its output to the console and to log_path.

    Returns (exit code or None when it timed out, the last lines of its output).
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    tail = deque(maxlen=30)
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(map(str, command))}\n")
        log.flush()
        process = subprocess.Popen(list(map(str, command)), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace",
                                   start_new_session=True)  # its own group: stopped as a whole

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
               "--seed", args.seed, "--warmup", args.warmup, "--steps", args.steps, "--windows", args.windows]
    return command + (["--tiny"] if args.tiny else [])


def describe_device(args, scratch):
    """Ask a child process what the device is; a wrong --device ends the ladder with exit code 2."""
    result = Path(scratch) / "device.json"
    done = subprocess.run([sys.executable, Path(__file__).resolve(), "--describe-device", "--device",
                           args.device, "--result", result], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0 or not result.exists():
        message = (done.stderr.strip().splitlines() or ["could not query the device"])[-1]
        raise common.UsageError(message.removeprefix("error: "))
    return json.loads(result.read_text())


def failure_from_output(code, tail, timeout):
    if code is None:
        return f"timed out after {timeout} s (--rung-timeout)"
    last = next((line.strip() for line in reversed(tail) if line.strip()), "")
    return f"exited with code {code}" + (f": {last[:120]}" if last else "")


def run_single_process_rung(number, args, logs):
    result_path = logs / f"rung-{number:02d}.json"
    result_path.unlink(missing_ok=True)
    command = worker_command(args, "--run-rung", number, "--result", result_path)
    code, tail = run_streaming(command, logs / f"rung-{number:02d}.log", args.rung_timeout)
    if result_path.exists():
        result = json.loads(result_path.read_text())
        if code is None:
            result["error"] = failure_from_output(code, tail, args.rung_timeout)
        return result
    return {"rung": number, "error": failure_from_output(code, tail, args.rung_timeout)}  # crashed hard


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


def script_steps_per_epoch(script_name, args, processes):
    """Steps per epoch of a stage script on this corpus, from its own dataset class and batch size."""
    from bench.rungs import load_stage, training_windows
    from data import get_tokenizer, load_text

    stage = load_stage(script_name)
    cfg = stage.TINY_CONFIG if args.tiny else stage.GPT_CONFIG_124M
    batch_size = (stage.TINY_SETTINGS if args.tiny else stage.OTHER_SETTINGS)["batch_size"]
    dataset = training_windows(stage, load_text(args.data), get_tokenizer(), cfg["context_length"])
    return len(dataset) // processes // batch_size  # the shards of DistributedSampler, then whole batches


def run_stage_script(script_name, launcher, args, device_info, log_path, metrics_copy, processes=1):
    """Run a stage script as it is (flags only) and read its metrics.json into a ladder row.

    Its numbers come from its own clock (the per-interval `Step tok/sec` of its log, all processes
    together), not from the ladder's timing loop; see script_schedule for how the two are lined up.
    """
    script = ROOT / script_name
    if not script.exists():
        log_path.write_text(f"{script_name} does not exist: nothing to run\n")
        return {"error": f"{script_name} does not exist (yet)"}
    steps_per_epoch = script_steps_per_epoch(script_name, args, processes)
    window, measured_ends, max_steps = script_schedule(args.warmup, args.steps, args.windows, steps_per_epoch)
    with tempfile.TemporaryDirectory(prefix="ladder-script-") as run_dir:  # its checkpoint is big: not kept
        command = [*launcher, script, "--data", args.data, "--device", args.device, "--seed", args.seed,
                   "--max-steps", max_steps, "--eval-freq", window, "--eval-iter", 1, "--epochs", 1000,
                   "--out", run_dir] + (["--tiny"] if args.tiny else [])
        code, tail = run_streaming(command, log_path, args.rung_timeout)
        metrics_path = Path(run_dir) / "metrics.json"
        if code != 0 or not metrics_path.exists():
            return {"error": failure_from_output(code, tail, args.rung_timeout)}
        shutil.copyfile(metrics_path, metrics_copy)
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
        mfu = common.mfu(median / world_size, common.flops_per_token(metrics["config"], REAL_VOCAB_SIZE),
                         device_info["peak_flops"].get(precision))
    last = log[-1]
    final_loss = last.get("train_loss")
    return {
        "error": None, "tokens_per_sec": median, "tokens_per_sec_min": min(windows),
        "tokens_per_sec_max": max(windows), "window_tokens_per_sec": windows, "mfu": mfu, "precision": precision,
        "world_size": world_size, "batch_size": (metrics.get("settings") or {}).get("batch_size"),
        "peak_allocated_gb": metrics.get("peak_allocated_gb"), "peak_reserved_gb": metrics.get("peak_reserved_gb"),
        "final_loss": final_loss if final_loss is not None and math.isfinite(final_loss) else None,
        "steps": len(windows) * window, "warmup_steps": measured_ends[0] - window + 1,
        "final_loss_step": last.get("step"), "steps_per_epoch": steps_per_epoch,
        "windows_cross_epochs": steps_per_epoch <= window,
    }


def run_ddp_rung(args, device_info, logs):
    """Rung 11: the real 02 under torchrun, one process per visible GPU (one on a CPU).

    DDP needs several processes, so this rung cannot be composed like the others: it is 02 as it is,
    measured by its own clock (see run_stage_script).
    """
    from bench.rungs import STAGE_02

    number = 11
    log_path = logs / f"rung-{number:02d}.log"
    if number in failing_rungs_for_testing():
        message = f"rung {number} failed on purpose ({FAIL_HOOK_VARIABLE} testing hook)"
        log_path.write_text(message + "\n")
        return {"rung": number, "error": message}
    processes = device_info["gpu_count"] if device_info["device_type"] == "cuda" else 1
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    row = run_stage_script(STAGE_02, torchrun, args, device_info, log_path, logs / f"rung-{number:02d}-metrics.json",
                           processes)
    row["rung"] = number
    if row["error"] is None:
        world_size = row["world_size"]
        row["notes"] = [f"{world_size} process{'es' if world_size > 1 else ''}: tok/s of all together, by "
                        f"02's own clock; final loss: its evaluation at step {row['final_loss_step']}"]
    return row


def run_script_checks(args, device_info, logs, rows):
    """--check-scripts: run 00 and 01 as they are and set their own clock beside rungs 0 and 10."""
    from bench.rungs import STAGE_00, STAGE_01

    checks = []
    for script_name, rung in ((STAGE_00, 0), (STAGE_01, 10)):
        print(f"Cross-check: {script_name} as it is, for rung {rung}", flush=True)
        stem = Path(script_name).stem
        result = run_stage_script(script_name, [sys.executable], args, device_info, logs / f"script-{stem}.log",
                                  logs / f"script-{stem}-metrics.json")
        ladder_row = next((row for row in rows if row["rung"] == rung), None)
        ladder_speed = ladder_row.get("tokens_per_sec") if ladder_row else None
        checks.append({
            "script": script_name, "rung": rung, "error": result["error"],
            "tokens_per_sec": result.get("tokens_per_sec"), "tokens_per_sec_min": result.get("tokens_per_sec_min"),
            "tokens_per_sec_max": result.get("tokens_per_sec_max"), "rung_tokens_per_sec": ladder_speed,
            "script_over_rung": (result["tokens_per_sec"] / ladder_speed
                                 if result.get("tokens_per_sec") and ladder_speed else None),
            "peak_reserved_gb": result.get("peak_reserved_gb"),
        })
        print(f"Cross-check: {script_name}: {summarize(checks[-1])}", flush=True)
    return checks


# ---------------------------------------------------------------------------------------------
# The ladder
# ---------------------------------------------------------------------------------------------

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


def add_comparisons(rows):
    """Speed-ups over the row before (when both were measured) and over rung 0 (when it was run)."""
    baseline = next((row for row in rows if row["rung"] == 0 and row.get("tokens_per_sec")), None)
    previous = None
    for row in rows:
        speed = row.get("tokens_per_sec")
        row["previous_rung"] = previous["rung"] if previous else None
        row["speedup_vs_previous"] = (speed / previous["tokens_per_sec"]
                                      if speed and previous and previous.get("tokens_per_sec") else None)
        row["speedup_vs_baseline"] = speed / baseline["tokens_per_sec"] if speed and baseline else None
        previous = row


ROW_KEYS = ("rung", "change", "tokens_per_sec", "tokens_per_sec_min", "tokens_per_sec_max", "speedup_vs_previous",
            "speedup_vs_baseline", "mfu", "peak_allocated_gb", "peak_reserved_gb", "final_loss", "error")


def complete_row(row, seconds, logs, out):
    """The documented keys first, then the details, and the reference figures."""
    from bench.rungs import CHANGES

    number = row["rung"]
    full = {key: row.get(key) for key in ROW_KEYS}
    full["change"] = CHANGES[number]
    full.update({key: value for key, value in row.items() if key not in full})
    full["seconds"] = round(seconds, 1)
    if row.get("windows_cross_epochs"):
        full["notes"] = [*(row.get("notes") or []), f"epochs of {row.get('steps_per_epoch')} steps are shorter "
                         "than a window: every window crosses an epoch boundary"]
    full["log"] = str((logs / f"rung-{number:02d}.log").relative_to(out))
    reference_speed, reference_reserved = REFERENCE[number]
    full["reference"] = {"tokens_per_sec": reference_speed, "reserved_gb": reference_reserved}
    return full


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


def run_ladder(args):
    from bench.rungs import CHANGES
    from data import load_text

    load_text(args.data)  # a wrong --data fails here, once, with exit code 2 (and middlemarch is cached once)
    with tempfile.TemporaryDirectory(prefix="ladder-") as scratch:
        device_info = describe_device(args, scratch)
    args.device = device_info["device_type"]  # every rung and script on the device resolved once, here
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / (
        device_info["slug"] + ("-tiny" if args.tiny else ""))
    logs = common.check_out_dir(out / "logs")
    started_at = datetime.now(timezone.utc)
    report = {
        "device": device_info["description"], "device_name": device_info["name"],
        "gpu_count": device_info["gpu_count"], "driver": nvidia_driver(), "cuda": device_info["cuda"],
        "torch": device_info["torch"], "python": device_info["python"],
        "date": started_at.strftime("%Y-%m-%d %H:%M UTC"), "git": git_revision(),
        "command": shlex.join(["python", "bench/ladder.py", *sys.argv[1:]]),
        "settings": {"tiny": args.tiny, "data": args.data, "seed": args.seed, "warmup_steps": args.warmup,
                     "steps": args.steps, "windows": min(args.windows, args.steps), "device": args.device},
        "reference_source": REFERENCE_SOURCE, "rungs": [],
    }
    print(f"Ladder: rungs {','.join(map(str, args.rungs))} on {device_info['description']} | torch "
          f"{device_info['torch']} | {args.warmup} warm-up + {args.steps} measured steps per rung"
          f"{' | --tiny' if args.tiny else ''} | out: {out}", flush=True)

    rows, durations, interrupted = [], [], False
    clock_start = time.monotonic()
    for index, number in enumerate(args.rungs, start=1):
        elapsed = time.monotonic() - clock_start
        remaining = len(args.rungs) - index + 1
        estimate = (f"~{format_duration(statistics.mean(durations) * remaining)} left" if durations
                    else "time left: known after the first rung")
        print(f"[{index}/{len(args.rungs)}] rung {number}: {CHANGES[number]} | elapsed "
              f"{format_duration(elapsed)}, {estimate}", flush=True)
        rung_start = time.monotonic()
        try:
            row = (run_ddp_rung(args, device_info, logs) if number == 11
                   else run_single_process_rung(number, args, logs))
        except KeyboardInterrupt:
            row, interrupted = {"rung": number, "error": "interrupted"}, True
        durations.append(time.monotonic() - rung_start)
        rows.append(complete_row(row, durations[-1], logs, out))
        remaining = len(args.rungs) - index
        print(f"[{index}/{len(args.rungs)}] rung {number} {'done' if not rows[-1]['error'] else 'FAILED'} in "
              f"{format_duration(durations[-1])}: {summarize(rows[-1])} | elapsed "
              f"{format_duration(time.monotonic() - clock_start)}"
              + (f", ~{format_duration(statistics.mean(durations) * remaining)} left"
                 if remaining and not interrupted else ""),
              flush=True)
        if interrupted:
            break

    add_comparisons(rows)
    report["rungs"] = rows
    if args.check_scripts and not interrupted:
        try:
            report["script_checks"] = run_script_checks(args, device_info, logs, rows)
        except KeyboardInterrupt:
            interrupted = True
    report["total_seconds"] = round(time.monotonic() - clock_start, 1)
    common.write_json(report, out / "ladder.json")
    markdown = render_markdown(report)
    common.save_atomically(lambda tmp: Path(tmp).write_text(markdown, encoding="utf-8"), out / "ladder.md")
    plot_ladder(report, out / "ladder.png")
    measured = sum(1 for row in rows if row.get("tokens_per_sec"))
    print(f"Wrote {out}/ladder.md, ladder.json, ladder.png and logs/ | {measured} of {len(rows)} rungs measured "
          f"in {format_duration(report['total_seconds'])}\n\n{markdown}", flush=True)
    if interrupted:
        return 130
    return common.EXIT_OK if measured else common.EXIT_FAILED


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------

def _number(value, digits=0, suffix=""):
    return "—" if value is None else f"{value:,.{digits}f}{suffix}"


def render_markdown(report):
    settings = report["settings"]
    tiny = settings["tiny"]
    lines = [
        f"# Benchmark ladder: {report['device_name']}" + (" (--tiny)" if tiny else ""),
        "",
        f"- Device: {report['device']}" + (f", {report['gpu_count']} visible" if report["gpu_count"] else ""),
        f"- Driver: {report['driver'] or 'n/a'} | CUDA: {report['cuda'] or 'n/a'} | PyTorch: {report['torch']} "
        f"| Python: {report['python']}",
        f"- Date: {report['date']} | code: {report['git'] or 'n/a'}",
        f"- Command: `{report['command']}`",
        f"- Each rung: a fresh process, corpus `{settings['data']}`, seed {settings['seed']}, "
        f"warm-up steps: {settings['warmup_steps']} (not timed), then {settings['steps']} steps timed in "
        f"{settings['windows']} window(s) that leave out the first step of each epoch where epochs are long "
        "enough; data loading on the clock, no evaluation.",
        "",
        "| rung | change | tok/s (median) | min – max | × prev. | × rung 0 | MFU | peak alloc. GiB "
        "| peak reserved GiB | final loss | reference tok/s | reference reserved GB | notes |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in report["rungs"]:
        spread = ("—" if row["tokens_per_sec"] is None else
                  f"{row['tokens_per_sec_min']:,.0f} – {row['tokens_per_sec_max']:,.0f}")
        notes = list(row.get("notes") or [])
        if row["error"]:
            notes.insert(0, f"**failed:** {row['error']}")
        reference = row["reference"]
        cells = [
            str(row["rung"]), row["change"], _number(row["tokens_per_sec"]), spread,
            _number(row["speedup_vs_previous"], 2, "×"), _number(row["speedup_vs_baseline"], 2, "×"),
            _number(None if row["mfu"] is None else 100 * row["mfu"], 1, "%"),
            _number(row["peak_allocated_gb"], 2), _number(row["peak_reserved_gb"], 2), _number(row["final_loss"], 3),
            _number(reference["tokens_per_sec"]), _number(reference["reserved_gb"], 2),
            "; ".join(notes).replace("|", "\\|"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "tok/s: median over the timing windows (min – max beside it); rung 11: all processes together, "
        "from 02's own per-interval `Step tok/sec` after the warm-up. × prev.: over the row above. "
        "MFU: per GPU, against the dense peak of the rung's precision (fp32, TF32 from rung 2 on Ampere and "
        "newer, bf16 from rung 5, fp16 on compute capability 7.x), FLOPs per token for the 50,257-token "
        "vocabulary; none on a CPU. Memory: "
        "`torch.cuda.max_memory_allocated/reserved` of the whole run (rung 11: 02's rank 0); none on a CPU. "
        "Final loss: the last measured step's training loss (rung 11: 02's evaluation at its last step).",
        "",
        f"Reference columns: the {report['reference_source']}; steps 0–7 are its `Avg tok/sec`, 8–11 its "
        "`Step tok/sec` at the end of epoch 1, reserved memory is `torch.cuda.memory_reserved()` after "
        "epoch 1. Quoted, not measured here"
        + (" — and for the full-size model, so not comparable with a --tiny run." if tiny else "."),
        "",
    ]
    if report.get("script_checks"):
        lines += [
            "Cross-check (`--check-scripts`): the stage scripts run as they are, with the same warm-up and "
            "steps, timed by their own clock (their per-interval `Step tok/sec`, evaluation left out).",
            "",
            "| script | its own tok/s (median) | min – max | rung | rung tok/s | script / rung | notes |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for check in report["script_checks"]:
            spread = ("—" if check["tokens_per_sec"] is None else
                      f"{check['tokens_per_sec_min']:,.0f} – {check['tokens_per_sec_max']:,.0f}")
            lines.append(f"| {check['script']} | {_number(check['tokens_per_sec'])} | {spread} | {check['rung']} | "
                         f"{_number(check['rung_tokens_per_sec'])} | {_number(check['script_over_rung'], 2, '×')} | "
                         + (f"**failed:** {check['error']}" if check["error"] else "") + " |")
        lines.append("")
    return "\n".join(lines)


def plot_ladder(report, path):
    """Two panels side by side: throughput per rung and peak reserved GPU memory per rung."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = report["rungs"]
    labels = [f"{row['rung']}  {SHORT_NAMES[row['rung']]}" for row in rows]
    positions = list(range(len(rows)))
    colors = ["tab:orange" if row["rung"] == 11 else "tab:blue" for row in rows]
    figure, (speed_axis, memory_axis) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 2.2), sharey=True)

    speeds = [row["tokens_per_sec"] or 0 for row in rows]
    speed_axis.barh(positions, speeds, color=colors)
    top_speed = max(speeds) or 1
    for position, row in zip(positions, rows):
        if row["tokens_per_sec"] is None:
            speed_axis.text(top_speed * 0.01, position, "failed", va="center", color="tab:red", fontsize=9)
        else:
            text = f" {row['tokens_per_sec']:,.0f}"
            if row["speedup_vs_baseline"]:
                text += f"  ({row['speedup_vs_baseline']:.2f}× rung 0)"
            speed_axis.text(row["tokens_per_sec"], position, text, va="center", fontsize=9)
    speed_axis.set_xlim(0, top_speed * 1.45)
    speed_axis.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:,.0f}"))
    speed_axis.set_xlabel("training tokens per second (median; rung 11: all GPUs)")
    speed_axis.set_title("Throughput per rung (higher is better)")
    speed_axis.set_yticks(positions, labels)
    speed_axis.invert_yaxis()  # rung 0 on top

    reserved = [row["peak_reserved_gb"] for row in rows]
    if any(value is not None for value in reserved):
        memory_axis.barh(positions, [value or 0 for value in reserved], color=colors)
        top_memory = max(value or 0 for value in reserved) or 1
        for position, value in zip(positions, reserved):
            memory_axis.text(value or 0, position, " n/a" if value is None else f" {value:.2f}", va="center",
                             fontsize=9)
        memory_axis.set_xlim(0, top_memory * 1.25)
    else:
        memory_axis.text(0.5, 0.5, "no GPU memory statistics\n(this run was on a CPU)", ha="center",
                         va="center", transform=memory_axis.transAxes, fontsize=11, color="gray")
        memory_axis.set_xticks([])
    memory_axis.set_xlabel("peak reserved GPU memory, GiB (rung 11: rank 0)")
    memory_axis.set_title("GPU memory per rung (lower is better)")

    figure.suptitle(f"Benchmark ladder on {report['device_name']}{' (--tiny)' if report['settings']['tiny'] else ''}"
                    f" | PyTorch {report['torch']} | {report['date']}", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ---------------------------------------------------------------------------------------------

def main(argv=None):
    args = resolve_defaults(build_parser().parse_args(argv))
    try:
        if args.run_rung is not None:
            return run_rung_main(args)
        if args.describe_device:
            return describe_device_main(args)
        return run_ladder(args)
    except common.UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return common.EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
