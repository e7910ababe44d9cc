"""Plumbing that no stage changes and that is not the lesson.

The command line, the device, the training clock, MFU, a heartbeat for long silent waits, atomic
file writes and the exit codes. The three stage scripts import it; everything an optimization
changes (data loaders, model, loop) stays in the stage scripts themselves.
"""

import argparse
import contextlib
import datetime
import errno
import functools
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from data import UsageError
from data import files

__all__ = ["UsageError", "TrainingError"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class TrainingError(Exception):
    """The run failed while training (out of memory, a non-finite loss): exit code 1."""


class OutputError(TrainingError):
    """An output could not be written mid-run (disk full, quota, a folder gone or read-only): exit code 1."""


class NothingToTrain(Exception):
    """--resume of a checkpoint that already reached --max-steps or the last epoch: exit code 0."""


class Interrupted(Exception):
    """SIGINT, SIGTERM or SIGHUP arrived; the checkpoint is saved. Exit code 128 + the signal's number."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2 instead of argparse's usage block
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def whole_number(minimum):
    """An argparse type: an int no smaller than `minimum`."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


_positive_int, _non_negative_int = whole_number(1), whole_number(0)


# The book's four GPT-2 sizes (--model): width, layers and heads; the rest of the config is the stage's own.
MODEL_SIZES = {
    "gpt2-small": {"emb_dim": 768, "n_layers": 12, "n_heads": 12},     # 124M in the book (163M, untied head)
    "gpt2-medium": {"emb_dim": 1024, "n_layers": 24, "n_heads": 16},   # 355M (406M)
    "gpt2-large": {"emb_dim": 1280, "n_layers": 36, "n_heads": 20},    # 774M (838M)
    "gpt2-xl": {"emb_dim": 1600, "n_layers": 48, "n_heads": 25},       # 1558M (1638M)
}


def model_config(args, config, tiny_config):
    """The model config of this run: --tiny's, or the stage's config at the size --model names."""
    return dict(tiny_config) if args.tiny else {**config, **MODEL_SIZES[args.model]}


def build_parser(description, settings, tiny_settings):
    """The flags shared by the three stages; `settings` gives the stage's defaults."""
    parser = OneLineParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                           allow_abbrev=False)  # --max-step must be an error, not --max-steps
    script = Path(sys.argv[0]).stem

    def default(key):
        return f"default: {settings[key]}; {tiny_settings[key]} with --tiny"

    parser.add_argument("--data", default="shakespeare", metavar="NAME_OR_PATH",
                        help="'shakespeare' (shipped, offline), 'middlemarch' (downloaded once, cached under "
                             "data/cache/) or the path of a UTF-8 text file (default: shakespeare)")
    parser.add_argument("--tiny", action="store_true",
                        help="a small model and batch for CPUs and tests: a few dozen steps take seconds")
    parser.add_argument("--epochs", type=_positive_int, help=f"epochs over the training split ({default('num_epochs')})")
    parser.add_argument("--max-steps", type=_non_negative_int,
                        help=f"stop after this many optimizer steps; 0: no limit ({default('max_steps')})")
    parser.add_argument("--batch-size", type=_positive_int,
                        help=f"sequences per step and process ({default('batch_size')})")
    parser.add_argument("--eval-freq", type=_positive_int,
                        help=f"evaluate and log every N steps ({default('eval_freq')})")
    parser.add_argument("--eval-iter", type=_positive_int,
                        help=f"batches per loss estimate at each evaluation ({default('eval_iter')})")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "mps"), default="auto",
                        help="where to train; auto: CUDA when available, else Apple's MPS, else the CPU "
                             "(default: auto)")
    parser.add_argument("--model", choices=tuple(MODEL_SIZES), default="gpt2-small",
                        help="which of the book's GPT-2 sizes to train; --tiny replaces it with a small model "
                             "(default: gpt2-small)")
    parser.add_argument("--seed", type=int, default=123, help="random seed (default: 123)")
    parser.add_argument("--out", default=f"runs/{script}",
                        help=f"folder for metrics.json, loss.pdf/png and model.pth (default: runs/{script})")
    parser.add_argument("--resume", metavar="PATH", help="continue training from this checkpoint (a model.pth)")
    parser.add_argument("--save-every", type=_non_negative_int, default=0, metavar="N",
                        help="also write the checkpoint every N steps; 0: only at the end and on an "
                             "interrupt (default: 0)")
    parser.add_argument("--profile", action="store_true",
                        help=f"profile training steps {PROFILE_WAIT + PROFILE_WARMUP + 1} to "
                             f"{PROFILE_WAIT + PROFILE_WARMUP + PROFILE_ACTIVE} with torch.profiler (the ones before "
                             "warm up and compile): a trace under <out>/profile/ and a table of the top operators; "
                             "those steps are left out of tok/s")
    parser.add_argument("--memory-snapshot", action="store_true",
                        help=f"CUDA only: record the caching allocator's history over the first {SNAPSHOT_STEPS} "
                             "steps into <out>/memory_snapshot.pickle (open it on https://pytorch.org/memory_viz)")
    return parser


def resolve_settings(args, settings, tiny_settings):
    """Fill the flags left unset from the stage's (or --tiny's) settings dict."""
    chosen = tiny_settings if args.tiny else settings
    for flag, key in (("epochs", "num_epochs"), ("batch_size", "batch_size"),
                      ("eval_freq", "eval_freq"), ("eval_iter", "eval_iter"), ("max_steps", "max_steps")):
        if getattr(args, flag) is None:
            setattr(args, flag, chosen[key])
    return args


def check_out_dir(out):
    """Fail before any training if the output folder cannot be written."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise UsageError(f"cannot write to --out {out} ({err.strerror}): choose a writable folder") from None
    return out


def pick_device(choice, distributed=False):
    """The torch.device for --device. `auto` prefers CUDA, then Apple's MPS, then the CPU.

    `distributed` (stage 02): torch.distributed has no backend for MPS tensors (NCCL is CUDA only, gloo CPU
    and CUDA), so there `auto` takes the CPU instead of MPS, and an explicit `--device mps` is refused.
    """
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but PyTorch sees no CUDA GPU: use --device cpu (or auto)")
    if choice == "mps" and not torch.backends.mps.is_available():
        why = ("this PyTorch build has no MPS support" if not torch.backends.mps.is_built()
               else "not a Mac with a GPU and macOS version that MPS supports")
        raise UsageError(f"--device mps was asked for but PyTorch sees no Apple GPU ({why}): "
                         "use --device cpu (or auto)")
    if choice == "mps" and distributed:
        raise UsageError("--device mps: torch.distributed has no backend for MPS tensors (NCCL is CUDA only, gloo "
                         "CPU and CUDA), so DDP cannot run there: on a Mac use 01_opt_single_gpu.py, or --device cpu")
    if choice == "auto":
        if torch.cuda.is_available():
            choice = "cuda"
        elif torch.backends.mps.is_available() and distributed:
            print("Device: the CPU, not the Apple GPU: torch.distributed has no backend for MPS tensors "
                  "(01_opt_single_gpu.py trains on MPS)", flush=True)
            choice = "cpu"
        else:
            choice = "mps" if torch.backends.mps.is_available() else "cpu"
    return torch.device(choice)


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def describe_device(device):
    import platform

    import torch

    if device.type == "mps":
        return f"Apple GPU via MPS (macOS {platform.mac_ver()[0] or 'unknown'})"
    if device.type != "cuda":
        return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}, CUDA {torch.version.cuda})"


# ---------------------------------------------------------------------------------------------
# What the hardware supports: step 5's precision, and the fallbacks an Apple GPU (MPS) needs
# ---------------------------------------------------------------------------------------------

# A test hook, not a user setting: TEST_FORCE_PRECISION=fp16 takes step 5's float16 + GradScaler path on any device
# (autocast float16 and GradScaler work on the CPU too), so the tests can train and resume that path without a V100.
FORCE_PRECISION_VARIABLE = "TEST_FORCE_PRECISION"


@functools.lru_cache(maxsize=None)
def autocast_precision(device):
    """Step 5's choice for `device`: (precision, reason). The precision is "bf16" or "fp16" (autocast to that
    dtype; fp16 with a gradient scaler) or "fp32" (no autocast: no reduced precision helps or works there)."""
    import torch

    forced = os.environ.get(FORCE_PRECISION_VARIABLE)
    if forced:
        if forced not in ("bf16", "fp16", "fp32"):
            raise UsageError(f"{FORCE_PRECISION_VARIABLE}={forced}: use bf16, fp16 or fp32 (or unset it)")
        return forced, f"forced by the test hook {FORCE_PRECISION_VARIABLE}"
    if device.type == "cpu":
        return "bf16", "CPUs compute in bfloat16 under autocast"
    if device.type == "mps":
        if torch.backends.mps.is_macos_or_newer(14, 0):
            return "bf16", "MPS has bfloat16 from macOS 14 on"
        return "fp32", "MPS has no bfloat16 before macOS 14: float32, step 5 falls back"
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 8:
        return "bf16", f"compute capability {major}.{minor} has bfloat16 tensor cores"
    if major == 7:
        return "fp16", (f"compute capability {major}.{minor} has float16 tensor cores but no bfloat16: float16 "
                        "autocast, with a gradient scaler against underflow")
    return "fp32", f"compute capability {major}.{minor} has no tensor cores: reduced precision would not pay"


def autocast_dtype(device):
    """The dtype that step 5's autocast computes in on `device`, or None: no autocast."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(autocast_precision(device)[0])


def has_tf32(device):
    """Whether `device` has TF32 tensor cores for float32 matmuls (step 2): GPUs of compute capability 8.0 and up."""
    import torch

    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def has_fused(device):
    """Whether this PyTorch has a fused AdamW kernel for `device` (step 3)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return device.type in _get_fused_kernels_supported_devices()


def apply_fallbacks(device):
    """Stages 01 and 02: one line for each optimization that cannot work on `device`, which then runs without it.

    On CUDA and the CPU every step works. On Apple's MPS: pinned memory is a CUDA feature (step 4), fused AdamW
    and bfloat16 depend on the PyTorch and macOS versions (steps 3 and 5), and torch.compile's MPS backend is
    young (step 8): a graph it cannot compile runs eagerly instead of failing the run.
    """
    if device.type != "mps":
        return
    import torch

    print("Fallback (step 4): pinned memory is CUDA only; on MPS batches are copied without pinning")
    if not has_fused(device):
        print(f"Fallback (step 3): PyTorch {torch.__version__} has no fused AdamW for MPS: the default AdamW")
    precision, reason = autocast_precision(device)
    if precision == "fp32":
        print(f"Fallback (step 5): {reason}")
    torch._dynamo.config.suppress_errors = True
    print("Fallback (step 8): torch.compile on MPS is young: a graph that fails to compile runs eagerly "
          "(PyTorch logs a warning for it) instead of stopping the run")


# ---------------------------------------------------------------------------------------------
# Throughput and MFU
# ---------------------------------------------------------------------------------------------

# Dense (no sparsity) peak TFLOP/s per GPU as (bf16, fp16, tf32, fp32) from NVIDIA's data sheets and architecture
# whitepapers (the README's "Reading the log" lists them with their sources); None where the GPU has no such
# tensor-core format. bf16 and fp16 are with float32 accumulation, as autocast's matmuls run (half rate on GeForce
# cards). Sheets that quote figures "with sparsity" are halved. More specific names first: "H100 NVL" before
# "H100", "A100" before "A10".
PEAK_TFLOPS = (
    (r"GB200", (2500.0, 2500.0, 1250.0, 80.0)),       # per Blackwell GPU (a superchip holds two)
    (r"B200", (2250.0, 2250.0, 1100.0, 75.0)),        # HGX B200, per GPU
    (r"H200 NVL", (835.5, 835.5, 417.5, 60.3)),
    (r"H200", (989.4, 989.4, 494.7, 66.9)),
    (r"H100 NVL", (835.5, 835.5, 417.5, 60.3)),
    (r"H100 PCIe", (756.5, 756.5, 378.0, 51.2)),
    (r"H100", (989.4, 989.4, 494.7, 66.9)),           # SXM
    (r"H800 PCIe", (756.5, 756.5, 378.0, 51.2)),
    (r"H800", (989.4, 989.4, 494.7, 66.9)),           # SXM
    (r"A100", (312.0, 312.0, 156.0, 19.5)),
    (r"L40S", (362.05, 362.05, 183.0, 91.6)),
    (r"A10\b", (125.0, 125.0, 62.5, 31.2)),
    (r"L4\b", (121.0, 121.0, 60.0, 30.3)),
    (r"RTX A6000", (154.8, 154.8, 77.4, 38.7)),
    (r"RTX 4090", (165.2, 165.2, 82.6, 82.6)),
    (r"RTX 4080", (97.5, 97.5, 48.7, 48.7)),          # the 16 GB card
    (r"RTX 3090", (71.0, 71.0, 35.6, 35.6)),
    (r"V100S", (None, 130.0, None, 16.4)),
    (r"V100.*PCIE", (None, 112.0, None, 14.0)),
    (r"V100", (None, 125.0, None, 15.7)),            # SXM2
    (r"\bT4\b", (None, 65.0, None, 8.1)),
)
PRECISIONS = ("bf16", "fp16", "tf32", "fp32")


def _peak_tflops(device, precision):
    """(TFLOP/s or None, why there is none) for one GPU like `device`."""
    import torch

    if device.type == "cpu":
        return None, "a CPU has no published dense peak in the table"
    if device.type == "mps":
        return None, "Apple does not publish a dense peak for its GPUs"
    name = torch.cuda.get_device_name(device)
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, name, re.IGNORECASE):
            tflops = peaks[PRECISIONS.index(precision)]
            return tflops, None if tflops else f"the {name} has no {precision} peak in the table"
    return None, f"the {name} is not in the peak table (common.PEAK_TFLOPS): add its data-sheet figures"


def peak_flops(device, precision, num_gpus=1):
    """Dense peak FLOP/s of `num_gpus` GPUs like `device` at this precision, or None (CPU, MPS, unknown GPU)."""
    tflops, _ = _peak_tflops(device, precision)
    return tflops * 1e12 * num_gpus if tflops else None


def mfu_line(device, precision):
    """The start-up line that says what MFU is measured against, or why it is n/a for this run."""
    tflops, why_not = _peak_tflops(device, precision)
    if tflops is None:
        return f"MFU: n/a: {why_not}"
    import torch

    return (f"MFU against the {torch.cuda.get_device_name(device)}'s dense {precision} peak: {tflops:g} TFLOP/s "
            "per GPU (NVIDIA data sheet)")


def flops_per_token(cfg, vocab_size):
    """Training FLOPs per token: 6 x matmul weights (attention, MLP, output head) + attention scores.

    `vocab_size` is the tokenizer's: columns added to the head only for speed are not useful work.
    """
    d, layers, context = cfg["emb_dim"], cfg["n_layers"], cfg["context_length"]
    matmul_weights = layers * (4 * d * d + 8 * d * d) + d * vocab_size
    return 6 * matmul_weights + 12 * layers * d * context


def mfu(tokens_per_sec_per_gpu, flops_per_tok, peak):
    if not peak or not tokens_per_sec_per_gpu:
        return None
    return tokens_per_sec_per_gpu * flops_per_tok / peak


class TrainClock:
    """Accumulates training time only: start() and stop() around the steps, take() at each log line.

    On CUDA it times with events and synchronizes at stop(), so queued kernels are counted in full.
    """

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.mps = device.type == "mps"  # no timing events there: synchronize, then read the host clock
        self.torch = torch
        self.seconds = 0.0
        self._start = None

    def start(self):
        if self.cuda:
            self._start = self.torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            if self.mps:
                self.torch.mps.synchronize()
            self._start = time.perf_counter()

    def stop(self):
        if self._start is None:
            return
        if self.cuda:
            end = self.torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            self.seconds += self._start.elapsed_time(end) / 1000
        else:
            if self.mps:
                self.torch.mps.synchronize()
            self.seconds += time.perf_counter() - self._start
        self._start = None

    def take(self):
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def counted_flops_per_token(build_model, context_length):
    """One training step's FLOPs per token (forward and backward), counted by torch.utils.flop_counter.

    The model is built on the meta device, so nothing is allocated or computed: a CPU counts the full-size
    model in about two seconds. Like the formula, the counter sees only matrix multiplications (no embedding
    lookups, norms or elementwise work); on the meta device attention runs its math path, so the scores are
    counted in full, as the formula counts them (causal FlashAttention skips about half of that work).
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = build_model()
        tokens = torch.zeros(1, context_length, dtype=torch.long)
    counter = FlopCounterMode(display=False)
    with counter:
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    return counter.get_total_flops() / context_length


def flops_line(formula, counted, cfg, real_vocab_size):
    """The start-up line that sets the counted FLOPs beside the formula's and explains the difference."""
    padded = cfg["vocab_size"] - real_vocab_size
    why = (f"; the counter includes the {padded} padded vocabulary columns (6 x {cfg['emb_dim']} x {padded} per "
           "token), which the formula leaves out as no useful work" if padded > 0 else "")
    return (f"FLOPs per token: {formula / 1e9:.4f} G by the formula (used for MFU), {counted / 1e9:.4f} G counted "
            f"by torch.utils.flop_counter in one training step ({100 * (counted / formula - 1):+.3f}%){why}")


def cpu_speed_note(flops_per_step, steps_per_epoch):
    """One line, up front, estimating how slow a full-size model will be on this CPU."""
    import torch

    a = torch.randn(1024, 1024)
    a @ a  # warm-up
    start = time.perf_counter()
    for _ in range(4):
        a @ a
    rate = 4 * 2 * 1024**3 / (time.perf_counter() - start)
    seconds_per_step = flops_per_step / rate
    epoch_hours = seconds_per_step * steps_per_epoch / 3600
    return (f"Note: the full 124M model on this CPU needs at least ~{seconds_per_step:.0f} s per step "
            f"(~{epoch_hours:.1f} h per epoch of {steps_per_epoch} steps, at its {rate / 1e9:.0f} GFLOP/s "
            "matmul speed); add --tiny for a small model that trains in seconds.")


# ---------------------------------------------------------------------------------------------
# Looking inside a run: --profile and --memory-snapshot
# ---------------------------------------------------------------------------------------------

PROFILE_WAIT, PROFILE_WARMUP, PROFILE_ACTIVE = 5, 1, 3  # steps of torch.profiler's schedule, from the run's start
SNAPSHOT_STEPS = 3  # steps of allocator history in a memory snapshot


class RunInspection:
    """--profile and --memory-snapshot, the same in every stage; both off: it does nothing.

    --profile follows torch.profiler's schedule: PROFILE_WAIT steps not recorded (the first compiles),
    PROFILE_WARMUP recorded and thrown away, then PROFILE_ACTIVE steps whose trace is kept. Those steps
    run off the training clock (profiling slows them), and the stage labels the regions of each step with
    region(). --memory-snapshot records the CUDA caching allocator's history over the first SNAPSHOT_STEPS
    steps. In a distributed run only rank 0 profiles and writes.
    """

    def __init__(self, args, device, first_step, total_steps):
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.out = Path(args.out)
        self.cuda = device.type == "cuda"
        self.first_step = first_step
        self.report = None
        if args.memory_snapshot and not self.cuda:
            raise UsageError("--memory-snapshot records the CUDA caching allocator: it needs a GPU (--device cuda)")
        profiled_last = first_step + PROFILE_WAIT + PROFILE_WARMUP + PROFILE_ACTIVE
        if args.profile and total_steps < profiled_last:
            raise UsageError(f"--profile records steps {first_step + PROFILE_WAIT + PROFILE_WARMUP + 1} to "
                             f"{profiled_last} of this run, but it ends at step {total_steps}: use --max-steps "
                             f"{profiled_last} or more (or 0)")
        is_writer = not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)
        self.profiler = self.snapshot = None
        if args.profile and is_writer:
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                                   if self.cuda else [])
            self.profiler = torch.profiler.profile(
                activities=activities, on_trace_ready=self._write_trace,
                schedule=torch.profiler.schedule(wait=PROFILE_WAIT, warmup=PROFILE_WARMUP, active=PROFILE_ACTIVE,
                                                 repeat=1))
            self.profiler.start()
            self.profiled_steps = range(first_step + PROFILE_WAIT, profiled_last)  # warm-up and active: off the clock
        if args.memory_snapshot and is_writer:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
            torch.cuda.reset_peak_memory_stats(device)
            self.snapshot = device

    def off_clock(self, step):
        """Whether step `step` (0-based) is profiled, and so left off the training clock."""
        return self.profiler is not None and step in self.profiled_steps

    def region(self, name):
        """A labelled region of a step in the trace (nothing at all when not profiling)."""
        if self.profiler is None:
            return contextlib.nullcontext()
        return self.torch.profiler.record_function(name)

    def step_done(self, step):
        """Call after each training step (`step`, 0-based, the one just done)."""
        if self.profiler is not None:
            self.profiler.step()
            if step + 1 >= self.profiled_steps.stop:
                self.profiler.stop()
                self.profiler = None
        if self.snapshot is not None and step + 1 - self.first_step >= SNAPSHOT_STEPS:
            self._write_snapshot()

    def _write_trace(self, prof):
        path = self.out / "profile" / f"{Path(sys.argv[0]).stem}.pt.trace.json"  # the name TensorBoard looks for
        save_atomically(lambda tmp: prof.export_chrome_trace(tmp), path)
        sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        steps = f"{self.profiled_steps.start + PROFILE_WARMUP + 1}-{self.profiled_steps.stop}"
        self.report = (f"Profile of steps {steps} ({'CUDA' if self.cuda else 'CPU'} time; these steps are not in "
                       f"tok/s): {path} (open it in https://ui.perfetto.dev or chrome://tracing)\n"
                       + prof.key_averages().table(sort_by=sort_by, row_limit=15))

    def _write_snapshot(self):
        torch, device = self.torch, self.snapshot
        torch.cuda.synchronize(device)
        path = self.out / "memory_snapshot.pickle"
        save_atomically(lambda tmp: torch.cuda.memory._dump_snapshot(tmp), path)
        torch.cuda.memory._record_memory_history(enabled=None)
        self.snapshot = None
        print(f"Memory snapshot of the first {SNAPSHOT_STEPS} steps: {path} (drop it on https://pytorch.org/memory_viz)"
              f" | peak over them: {torch.cuda.max_memory_allocated(device) / 1024**3:.2f} GiB allocated, "
              f"{torch.cuda.max_memory_reserved(device) / 1024**3:.2f} GiB reserved", flush=True)

    def finish(self):
        """At the end of training: print the profile's table of top operators (if one was taken)."""
        if self.report:
            print(self.report, flush=True)
        return None if self.report is None else str(self.out / "profile")


# ---------------------------------------------------------------------------------------------
# Heartbeat: a line every ~10 s while nothing else is printed (CPU steps, compilation, evaluation)
# ---------------------------------------------------------------------------------------------

class _TimedStdout:
    def __init__(self, stream):
        self._stream = stream
        self.last_write = time.monotonic()

    def write(self, text):
        self.last_write = time.monotonic()
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class Heartbeat:
    """Say what the run is doing when it has printed nothing for `every_s` seconds."""

    def __init__(self, every_s=10.0):
        self.doing = "starting"
        self.every_s = every_s
        if not isinstance(sys.stdout, _TimedStdout):
            sys.stdout = _TimedStdout(sys.stdout)
        self._stdout = sys.stdout
        self._started = time.monotonic()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            time.sleep(1.0)
            quiet = time.monotonic() - self._stdout.last_write
            if quiet >= self.every_s:
                elapsed = time.monotonic() - self._started
                print(f"  ... {self.doing} ({elapsed:.0f} s since start)", flush=True)


# ---------------------------------------------------------------------------------------------
# Checkpoints, interrupts and failures
# ---------------------------------------------------------------------------------------------

# How long a collective may wait in 02 before the job is declared broken (a lost process): NCCL's own default.
# It has to cover the longest wait of a healthy run: rank 0 writing a checkpoint (about 2 GB at full size: this
# allows a disk down to about 3.3 MB/s) while the others wait in their next gradient all-reduce, or one rank compiling
# slower than the rest. On one node a lost process ends the job at once (torchrun stops the other workers);
# across nodes, within this timeout.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


class StopSignal:
    """The first SIGINT/SIGTERM/SIGHUP asks the loop to finish its step, save and exit; a second SIGINT quits at
    once (a checkpoint being written then is left out: the previous one stays whole, see files.save_atomically).
    SIGHUP is what a closing terminal sends to a run started without nohup or tmux.

    In a distributed run every rank must stop after the same step (a rank that went on would wait forever
    in the next gradient all-reduce). The ranks agree through a small CPU (gloo) group, one step behind and
    without blocking: after each step a rank starts an all-reduce of its flag and collects the previous
    step's result, which completed while that step ran. So all ranks see a signal at the same step, one
    step after it arrived, and no rank waits here for the others to reach the same point.
    """

    def __init__(self):
        import torch.distributed as dist

        self.signum = None
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, self._handle)
        self._group = self._pending = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # every rank builds its StopSignal at the same point; the timeout is the training group's
            self._group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving the checkpoint "
              "(Ctrl-C again quits at once, without saving)", file=sys.stderr, flush=True)

    def requested(self):
        """The signal to stop for (0: none), the same on every rank; called by every rank after every step."""
        if self._group is None:
            return self.signum or 0
        import torch
        import torch.distributed as dist

        agreed = 0
        if self._pending is not None:  # the all-reduce started after the previous step: complete by now
            work, flag = self._pending
            work.wait()
            agreed = int(flag.item())
        flag = torch.tensor([self.signum or 0])
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return agreed


def rng_state(device):
    import torch

    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "mps": torch.mps.get_rng_state() if device.type == "mps" else None}


def restore_rng(state, device):
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    if device.type == "mps" and state.get("mps") is not None:
        torch.mps.set_rng_state(state["mps"])


CHECKPOINT_KEYS = ("model", "optimizer", "config", "settings", "script", "epoch", "batches_done", "step",
                   "history", "rng", "tokens_per_step")


def load_checkpoint(path, script, cfg, tokens_per_step, seed):
    """Read a checkpoint for --resume, refusing (exit code 2) one that this run cannot continue."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--resume {path}: no such checkpoint file (a run writes <out>/model.pth)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, not a torch file, unpickling refused...
        raise UsageError(f"--resume {path}: not a readable checkpoint ({type(err).__name__}); the file is "
                         "truncated or corrupt: use an intact model.pth") from None
    if not isinstance(checkpoint, dict) or any(key not in checkpoint for key in CHECKPOINT_KEYS):
        raise UsageError(f"--resume {path}: not a checkpoint of these scripts (keys missing)")
    if checkpoint["script"] != script:
        raise UsageError(f"--resume {path}: written by {checkpoint['script']}, not {script}: "
                         f"resume it with {checkpoint['script']}")
    for key, value in cfg.items():
        if checkpoint["config"].get(key) != value:
            raise UsageError(f"--resume {path}: model {key} is {checkpoint['config'].get(key)} in the checkpoint "
                             f"but {value} here (--tiny on one side only?)")
    if checkpoint["tokens_per_step"] != tokens_per_step:
        raise UsageError(f"--resume {path}: the checkpoint trained {checkpoint['tokens_per_step']} tokens per step, "
                         f"this run {tokens_per_step}: use the same --batch-size and number of processes")
    if checkpoint["settings"].get("seed") != seed:
        raise UsageError(f"--resume {path}: the checkpoint used --seed {checkpoint['settings'].get('seed')}: "
                         "pass the same seed, so the batch order continues")
    return checkpoint


def out_of_memory(device, batch_size, context_length):
    """The message for CUDA running out of memory: what failed, what was in use, what to try next."""
    import torch

    in_use = ""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        in_use = (f" ({torch.cuda.memory_allocated(device) / 1024**3:.1f} GiB allocated, "
                  f"{torch.cuda.memory_reserved(device) / 1024**3:.1f} GiB reserved of {total / 1024**3:.1f} GiB)")
    hint = (f"try --batch-size {batch_size // 2}" if batch_size > 1
            else "even one sequence does not fit: use a smaller model or a larger GPU")
    return TrainingError(f"out of GPU memory with a batch of {batch_size} x {context_length} tokens{in_use}: {hint}")


# ---------------------------------------------------------------------------------------------
# Files and exit codes
# ---------------------------------------------------------------------------------------------

# What to do when an output cannot be written, by the OS error's number.
_WRITE_FAILURE_HINTS = {
    errno.ENOSPC: "free some disk space",
    errno.EDQUOT: "free some space within your disk quota",
    errno.EROFS: "the file system is read-only: choose another --out",
    errno.EACCES: "make the folder writable again or choose another --out",
    errno.EPERM: "make the folder writable again or choose another --out",
    errno.ENOENT: "the folder was removed while the run went on: create it again or choose another --out",
}


def save_atomically(save, path):
    """files.save_atomically, with an OS error turned into an OutputError: one line naming the file and the
    error. The previous file stays whole and no temporary file is left (files.save_atomically sees to both)."""
    try:
        files.save_atomically(save, path)
    except OSError as err:
        hint = _WRITE_FAILURE_HINTS.get(err.errno, "fix the cause or choose another --out")
        checkpoint = Path(path).parent / "model.pth"
        resume = f", then go on with --resume {checkpoint}" if checkpoint.exists() else ""
        reason = err.strerror or str(err) or type(err).__name__
        raise OutputError(f"cannot write {path}: {reason} (errno {err.errno}); the previous file, if any, is "
                          f"kept: {hint}{resume}") from None


def save_torch(obj, path):
    """torch.save, atomically. Through a Python file object, so that a full disk raises a real OSError
    (torch.save to a path reports it as an unspecific RuntimeError)."""
    import torch

    def save(tmp):
        with open(tmp, "wb") as f:
            torch.save(obj, f)
    save_atomically(save, path)


def write_json(obj, path):
    def save(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, allow_nan=False, default=_json_default)
            f.write("\n")
    save_atomically(save, path)


def _json_default(value):
    raise TypeError(f"not JSON serializable: {value!r}")


def _lost_a_peer(err):
    """Whether `err` is a collective failing because another process of a distributed job is gone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    text = str(err)
    return isinstance(err, getattr(dist, "DistError", ())) or (
        isinstance(err, RuntimeError) and ("Connection closed by peer" in text or "Connection reset by peer" in text))


def run(main):
    """Run a stage's main() and turn its failures into the exit codes of SPEC.md."""
    try:
        main()
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except NothingToTrain as err:
        print(f"Nothing left to train: {err}")
        return EXIT_OK
    except OutputError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except TrainingError as err:
        print(f"training failed: {err}", file=sys.stderr)
        return EXIT_FAILED
    except Interrupted as err:
        print(f"stopped by {err}; the checkpoint is saved: add --resume <out>/model.pth to go on", file=sys.stderr)
        return 128 + err.signum
    except KeyboardInterrupt:
        print("interrupted at once: the last saved checkpoint (if any) is intact", file=sys.stderr)
        return 130
    except Exception as err:
        if not _lost_a_peer(err):
            raise
        first_line = (str(err).strip().splitlines() or [""])[0][:200]
        print(f"error: another process of this job ended (its own output says why), so this one stops too: "
              f"{first_line}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK
