"""The ladder's running phase: each rung, and each stage script, measured in a process of its own.

bench/ladder.py plans a part (which rungs, within --time-limit) and hands each rung here: a composed rung (0 to 10)
runs `bench/ladder.py --run-rung N` in a fresh process that writes its result as JSON (`run_rung_main`); a stage
script (rungs 11 and 12, and the --check-scripts runs) runs as a user runs it, under torchrun where it needs it,
and its own log and metrics.json give the row. Every child starts in a process group of its own and dies with its
parent, so a part stopped at a limit leaves nothing running on the GPU. bench/stages.py and the GPU tier start
their runs the same way.
"""

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
import traceback
from collections import deque
from pathlib import Path

import devices
import failures
import gpu_memory
import timekeeping
import utilization
from bench import report
from data import files

ROOT = Path(__file__).resolve().parents[1]
LADDER = ROOT / "bench" / "ladder.py"

# torchrun --standalone hands its workers this machine's fully qualified host name as MASTER_ADDR; where that name
# does not resolve (containers, small VMs) the process group never starts. One machine needs only the loopback.
SINGLE_NODE_TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--local-addr=127.0.0.1")
REAL_VOCAB_SIZE = 50257  # GPT-2's tokenizer: MFU counts useful work, not the padded vocabulary rows

# What a stage script's run folder keeps once the rung is measured: its checkpoint (2 GB at full size, far more
# for the larger models) is only the price of running the script as it is.
KEPT_FROM_SCRIPT_RUNS = ("metrics.json", "loss.png", "loss.pdf")


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
    import torch._dynamo  # noqa: F401 (before the clock, so that it times torch.compile: rungs 8-10 compile)

    from bench import rungs
    from data import load_corpus

    number = args.run_rung
    result = {"rung": number, "error": None}
    clock = timekeeping.WallClock()  # a line every ~10 s of a long phase (compilation is long and quiet)
    device = None

    def say(text):
        print(f"rung {number}: {text}", flush=True)
        clock.said()  # the next line of a long quiet phase comes every ~10 s after this one

    try:
        clock.start_up("device")
        device = devices.pick_device(args.device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        clock.start_up("model", "composing the rung from the stage scripts")
        rungs.apply_options(args.option)  # --option: measured options, switched on before anything compiles
        rung = rungs.compose(number, device, args.tiny, seed=args.seed, model=args.model,
                             batch_size=args.batch_size, options=args.option, context_length=args.context_length)
        parameters = sum(p.numel() for p in rung.model.parameters())
        result.update(precision=rung.precision, batch_size=rung.batch_size, vocab_size=rung.cfg["vocab_size"],
                      context_length=rung.cfg["context_length"], parameters=parameters, world_size=1,
                      notes=rung.notes + [f"option {name}: {rungs.OPTIONS[name]}" for name in args.option])
        say(f"{rungs.CHANGES[number]} | {parameters:,} parameters | batch {rung.batch_size} x "
            f"{rung.cfg['context_length']} tokens | precision {rung.precision} | "
            f"{devices.describe_device(device)}" + "".join(f" | {note}" for note in rung.notes))

        clock.start_up("corpus")
        loader = rung.make_train_loader(load_corpus(args.data).train, args.seed)

        # the warm-up and timed steps are the row's "training" (what torch.compile takes, its "compilation")
        clock.enter("training", "warming up" + (" (the first step compiles the model)" if number >= 8 else ""))
        timing = rungs.measure(rung, loader, args.seed, args.warmup, args.steps, args.windows, say=say)
        clock.enter("checkpoints and outputs", "finishing")
        result.update(timing, steps=args.steps, warmup_steps=args.warmup)
        flops = utilization.flops_per_token(rung.cfg, REAL_VOCAB_SIZE)
        result["mfu"] = utilization.mfu(timing["tokens_per_sec"], flops, utilization.peak_flops(device, rung.precision))
        if not math.isfinite(timing["final_loss"]):
            result["error"] = f"training broke: the loss is {timing['final_loss']} at the last step"
            result["final_loss"] = None  # JSON has no NaN
        say(f"median {timing['tokens_per_sec']:,.0f} tok/s (min {timing['tokens_per_sec_min']:,.0f}, "
            f"max {timing['tokens_per_sec_max']:,.0f}), final loss {timing['final_loss']:.4f}"
            + "".join(f"; {note}" for note in report.unsteady(timing)))
    except Exception as exc:  # any failure becomes the rung's row; the ladder goes on
        traceback.print_exc()
        result["error"] = short_error(exc)
    finally:
        if device is not None and device.type == "cuda":  # GiB: the timed steps' peaks and the warm-up's
            memory = gpu_memory.memory_metrics(device)
            result.update({key: memory[key] for key in ("peak_allocated_gb", "peak_reserved_gb",
                                                        "first_interval_peak_allocated_gb",
                                                        "first_interval_peak_reserved_gb")})
            say(gpu_memory.peak_memory_line(memory))
        result["wall_clock_s"] = clock.stop()  # where the rung's process spent its time, start-up in parts
        files.write_json(args.result, result)
    return failures.EXIT_OK if result["error"] is None else failures.EXIT_FAILED


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
    command = [sys.executable, LADDER, *mode, "--data", args.data, "--device", args.device,
               "--seed", args.seed, "--warmup", args.warmup, "--steps", args.steps, "--windows", args.windows,
               "--model", args.model]
    return (command + (["--tiny"] if args.tiny else []) + (["--batch-size", args.batch_size] if args.batch_size else [])
            + (["--context-length", args.context_length] if args.context_length else [])
            + [flag for name in args.option for flag in ("--option", name)])


def describe_device(args):
    """Ask a child process what the device is; a wrong --device ends the ladder with exit code 2."""
    done = subprocess.run([sys.executable, LADDER, "--describe-device", "--device", args.device],
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
    killed = code > 0 and re.search(r"\bSIGKILL\b", last)  # torchrun's line for a worker the system killed
    return exit_description(code) + (f": {last[:120]}" if last else "") + (OUT_OF_MEMORY if killed else "")


OUT_OF_MEMORY = ", on Linux most often the out-of-memory killer: the run outgrew the machine's RAM"


def exit_description(code):
    """A child's exit code in words: a negative code is the signal that ended it (subprocess's convention)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"killed by {name} (exit code {code}{OUT_OF_MEMORY if name == 'SIGKILL' else ''})"


def cpu_note(device_info, tiny, runs="rungs"):
    """The line a full-size ladder or set of stage runs on a CPU prints first, as the stages do; None elsewhere."""
    if device_info["device_type"] != "cpu" or tiny:
        return None
    return (f"Note: full-size {runs} on a CPU take seconds to minutes a step and can outgrow its RAM (the system "
            f"then kills them: SIGKILL in the row); add --tiny for the stages' small model, all in a few minutes.")


def timed_out(timeout, limit):
    """The row of a run stopped at its timeout; `limit` names the flag that set it (the ladder pops it)."""
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
    return (["--data", args.data, "--device", args.device, "--seed", args.seed,
             "--max-steps", max_steps, "--eval-freq", window, "--eval-iter", 1, "--epochs", 1000, "--out", run_dir]
            + (["--tiny"] if args.tiny else ["--model", args.model]) + batch)  # --tiny is a model of its own


def script_command(script, options):
    """The script to start, with the options that are settings of PyTorch switched on in its process first
    (bench/script_with_options.py) where there are any; grad-accum is a flag (script_flags), expandable-segments the
    environment."""
    from bench.rungs import SCRIPT_SETTINGS

    settings = [name for name in options if name in SCRIPT_SETTINGS]
    if not settings:
        return [script]
    return [ROOT / "bench" / "script_with_options.py", *(part for name in settings for part in ("--option", name)),
            script]


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
    from bench.rungs import load_stage, option_environment

    script = ROOT / script_name
    if not script.exists():
        log_path.write_text(f"{script_name} does not exist: nothing to run\n")
        return {"error": f"{script_name} does not exist (yet)"}
    stage = load_stage(script_name)
    steps_per_epoch = script_steps_per_epoch(stage, args, processes)
    window, measured_ends, max_steps = script_schedule(args.warmup, args.steps, args.windows, steps_per_epoch)
    start_run_folder(run_dir)
    try:
        code, tail = run_streaming([*launcher, *script_command(script, args.option),
                                    *script_flags(args, run_dir, max_steps, window, stage)],
                                   log_path, timeout, env=option_environment(args.option))
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
                           * metrics["config"]["context_length"] * metrics["config"]["vocab_size"] * 2 / gpu_memory.GIB),
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
    processes = device_info["gpu_count"] if device_info["device_type"] == "cuda" else 1
    run_dir = logs / f"rung-{number:02d}-run"
    torchrun = [sys.executable, *SINGLE_NODE_TORCHRUN, f"--nproc_per_node={processes}",
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
        from bench.rungs import ACCUMULATION_STEPS, OPTIONS
        for name in args.option:  # what each option set; grad-accum's with the micro-batch it gave
            batch = (f"batch {row['batch_size']} x --grad-accum-steps {ACCUMULATION_STEPS} per process: "
                     if name == "grad-accum" else "")
            row["notes"].append(f"option {name}: {batch}{OPTIONS[name]}")
        override = batch_size_note(args.batch_size, row["stage_batch_size"])
        if override:
            row["notes"].append(override)
    return row


def run_script_check(script_name, rung, args, device_info, logs, timeout):
    """Run one stage script as it is (`timeout`: seconds and the flag that sets them), for its own clock to be set
    beside its rung's row."""
    stem = Path(script_name).stem
    result = run_stage_script(script_name, [sys.executable], args, device_info, logs / f"script-{stem}.log",
                              logs / f"script-{stem}-run", *timeout)
    return {"script": script_name, "rung": rung, "error": result["error"], "timed_out": result.get("timed_out"),
            **{key: result.get(key) for key in ("tokens_per_sec", "tokens_per_sec_min", "tokens_per_sec_max",
                                                "peak_reserved_gb")}}


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


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, handled as Ctrl-C is: the running rung's processes are stopped, the rungs done are kept."""


def stop_on_signals():
    def stop(signum, frame):
        raise Stopped(signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
