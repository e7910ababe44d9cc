"""Plumbing that no stage changes and that is not the lesson.

The command line, the device, the training clock, MFU, a heartbeat for long silent waits, atomic
file writes and the exit codes. The three stage scripts import it; everything an optimization
changes (data loaders, model, loop) stays in the stage scripts themselves.
"""

import argparse
import contextlib
import functools
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

from data import UsageError

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

    def __init__(self, signum, step):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.step = signum, step  # the last step done (0-based, as in the log)


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
    """The model config of this run: --tiny's, or the stage's config at the size --model names. A checkpoint to
    resume must hold the same config: checked here, before the corpus is read and the model built."""
    cfg = dict(tiny_config) if args.tiny else {**config, **MODEL_SIZES[args.model]}
    if args.resume:
        import checkpoints

        checkpoints.check_config(args.checkpoint, args.resume, cfg)
    return cfg


# Flags that a resumed run takes from its checkpoint unless they are given again: (flag, key in the settings).
RESUMED_FLAGS = (("epochs", "num_epochs"), ("max_steps", "max_steps"), ("eval_freq", "eval_freq"),
                 ("eval_iter", "eval_iter"), ("save_every", "save_every"), ("data", "data"),
                 ("batch_size", "batch_size"), ("seed", "seed"), ("tiny", "tiny"), ("model", "model"),
                 ("grad_accum_steps", "grad_accum_steps"))  # the last: stages 01 to 03 only
# What a flag left unset means when there is no checkpoint to take it from (the rest come from the stage's dicts).
PLAIN_DEFAULTS = {"save_every": 0, "data": "shakespeare", "seed": 123, "tiny": False, "model": "gpt2-small",
                  "grad_accum_steps": 1}
# The help of 01 to 03's --grad-accum-steps (step 10: the batch a step needs, in micro-batches that fit)
GRAD_ACCUM_HELP = ("micro-batches of --batch-size per optimizer step, each its own forward and backward pass; "
                   "the global batch is --batch-size x N x processes (default: 1)")


def build_parser(description, settings, tiny_settings):
    """The flags shared by the three stages; `settings` gives the stage's defaults.

    Flags a resumed run can take from its checkpoint default to None here, so that resolve_settings() can tell
    a flag given again from one left out.
    """
    import inspection

    parser = OneLineParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                           allow_abbrev=False)  # --max-step must be an error, not --max-steps
    script = Path(sys.argv[0]).stem
    profiled = inspection.PROFILE_WAIT + inspection.PROFILE_WARMUP  # the first step of the kept trace, from 0

    def default(key):
        return f"default: {settings[key]}; {tiny_settings[key]} with --tiny"

    parser.add_argument("--data", metavar="NAME_OR_PATH",
                        help="'shakespeare' (shipped, offline), 'middlemarch' (downloaded once and cached) or the "
                             "path of a UTF-8 text file (default: shakespeare)")
    parser.add_argument("--tiny", action="store_true", default=None,
                        help="a small model and batch for CPUs and tests: a few dozen steps take seconds")
    parser.add_argument("--epochs", type=_positive_int, help=f"epochs over the training split ({default('num_epochs')})")
    parser.add_argument("--max-steps", type=_non_negative_int,
                        help="stop after this many optimizer steps (the log counts steps from 0, so the last is "
                             f"step N-1); 0: no limit ({default('max_steps')})")
    parser.add_argument("--batch-size", type=_positive_int,
                        help=f"sequences per step and process ({default('batch_size')})")
    parser.add_argument("--eval-freq", type=_positive_int,
                        help=f"evaluate and log every N steps ({default('eval_freq')})")
    parser.add_argument("--eval-iter", type=_positive_int,
                        help=f"batches per loss estimate at each evaluation ({default('eval_iter')})")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "mps"), default="auto",
                        help="where to train; auto: CUDA when available, else Apple's MPS, else the CPU "
                             "(default: auto)")
    parser.add_argument("--model", choices=tuple(MODEL_SIZES),
                        help="which of the book's GPT-2 sizes to train; --tiny replaces it with a small model "
                             "(default: gpt2-small)")
    parser.add_argument("--seed", type=int, help="random seed (default: 123)")
    parser.add_argument("--out",
                        help=f"folder for metrics.json, loss.pdf/png and model.pth (default: runs/{script}; with "
                             "--resume, the checkpoint's folder)")
    parser.add_argument("--resume", metavar="PATH",
                        help="continue the run this checkpoint (a model.pth) came from: in its folder, with its "
                             "limits and schedule (--epochs, --max-steps, --eval-freq, --eval-iter, --save-every, "
                             "--data, --batch-size, --seed, --tiny, --model), unless given again")
    parser.add_argument("--save-every", type=_non_negative_int, metavar="N",
                        help="also write the checkpoint every N steps; 0: only at the end and on an "
                             "interrupt (default: 0)")
    parser.add_argument("--profile", action="store_true",
                        help=f"profile training steps {profiled} to {profiled + inspection.PROFILE_ACTIVE - 1} "
                             "(counted from 0, as in the log) with torch.profiler, the ones before warm up and "
                             "compile: a trace under <out>/profile/ and a table of the top operators; those steps "
                             "are left out of tok/s")
    parser.add_argument("--memory-snapshot", action="store_true",
                        help=f"CUDA only: record the caching allocator's history over the first "
                             f"{inspection.SNAPSHOT_STEPS} steps into <out>/memory_snapshot.pickle (open it on "
                             "https://pytorch.org/memory_viz); those steps are left out of tok/s")
    return parser


def resolve_settings(args, settings, tiny_settings):
    """Fill the flags left unset: from the checkpoint of --resume, else from the stage's (or --tiny's) settings.

    The cheap checks come first, before the corpus is tokenized and the model is built: a missing or unreadable
    checkpoint, one of another stage, a --data file that cannot be read.
    """
    import checkpoints
    from data.corpus import check_text_source

    args.checkpoint, args.from_checkpoint = None, []
    if args.resume:
        args.checkpoint = checkpoints.open_checkpoint(args.resume, Path(sys.argv[0]).name)
        saved = args.checkpoint["settings"]
        for flag, key in RESUMED_FLAGS:
            if getattr(args, flag, False) is None and key in saved:  # False: a flag this stage does not have
                setattr(args, flag, saved[key])
                args.from_checkpoint.append(flag)
        if args.out is None:
            args.out = str(Path(args.resume).parent)
            args.from_checkpoint.append("out")
    for flag, value in PLAIN_DEFAULTS.items():
        if getattr(args, flag, False) is None:
            setattr(args, flag, value)
    chosen = tiny_settings if args.tiny else settings
    for flag, key in (("epochs", "num_epochs"), ("batch_size", "batch_size"),
                      ("eval_freq", "eval_freq"), ("eval_iter", "eval_iter"), ("max_steps", "max_steps")):
        if getattr(args, flag) is None:
            setattr(args, flag, chosen[key])
    if args.out is None:
        args.out = f"runs/{Path(sys.argv[0]).stem}"
    check_text_source(args.data)
    global _continue_command
    _continue_command = continue_command(args)
    return args


def run_settings(args, settings, tiny_settings):
    """The settings dict a checkpoint and metrics.json keep: the stage's, with this run's flags in it."""
    return {**(tiny_settings if args.tiny else settings), "num_epochs": args.epochs, "batch_size": args.batch_size,
            "eval_freq": args.eval_freq, "eval_iter": args.eval_iter, "max_steps": args.max_steps,
            "save_every": args.save_every, "seed": args.seed, "data": args.data, "tiny": args.tiny,
            "model": args.model, **({"grad_accum_steps": args.grad_accum_steps} if hasattr(args, "grad_accum_steps")
                                    else {})}


def processes():
    """The processes of this job: torchrun's WORLD_SIZE, else 1."""
    return int(os.environ.get("WORLD_SIZE", 1))


def describe_batch(args, context):
    """The header's batch: "batch 8 x 1024 tokens", or with accumulation or several processes, e.g. "batch 8 x
    4 accumulation steps x 2 processes = 64 sequences (65,536 tokens) per optimizer step"."""
    steps, world = getattr(args, "grad_accum_steps", 1), processes()
    if steps == 1 and world == 1:
        return f"batch {args.batch_size} x {context} tokens"
    parts = [f"batch {args.batch_size}"] + ([f"{steps} accumulation steps"] if steps > 1 else []) + (
        [f"{world} processes"] if world > 1 else [])
    sequences = args.batch_size * steps * world
    return f"{' x '.join(parts)} = {sequences} sequences ({sequences * context:,} tokens) per optimizer step"


def check_splits(args, train_windows, val_windows, context):
    """Refuse (exit code 2) a corpus too short for one optimizer step (every micro-batch of every process) or for
    one validation window."""
    steps, world = getattr(args, "grad_accum_steps", 1), processes()
    needed = args.batch_size * steps * world
    if train_windows < needed:
        per_step = " x ".join([str(args.batch_size)] + ([f"{steps} accumulation steps"] if steps > 1 else [])
                              + ([f"{world} processes"] if world > 1 else []))
        raise UsageError(f"the training split of '{args.data}' holds {train_windows} windows of {context + 1} tokens, "
                         f"fewer than one optimizer step of {per_step} = {needed}: use a longer text or a smaller "
                         "--batch-size" + (" or fewer --grad-accum-steps" if steps > 1 else ""))
    if val_windows == 0:
        raise UsageError(f"the validation split (the last 10%) of '{args.data}' is shorter than one window of "
                         f"{context + 1} tokens: use a longer text")


def resume_line(args, checkpoint):
    """The header line of a resumed run: where it continues and which settings came from the checkpoint."""
    flags = ", ".join(f"--{flag.replace('_', '-')}" + ("" if flag == "tiny" else f" {getattr(args, flag)}")
                      for flag in args.from_checkpoint if flag != "tiny" or args.tiny)
    return (f"Resuming {args.resume} after step {checkpoint['step'] - 1:06d} (epoch {checkpoint['epoch'] + 1})"
            + (f" | from the checkpoint: {flags}" if flags else ""))


_continue_command = None  # the command that continues this run, for the message of an interrupt


def continue_command(args):
    """The exact command that continues this run from its checkpoint, to copy and paste after an interrupt.

    Flags kept in the checkpoint (and --out, implied by the checkpoint's path) are left out: --resume brings
    them back. Under torchrun the command is torchrun's, with the processes of this launch.
    """
    import shlex

    kept = {flag for flag, _ in RESUMED_FLAGS} | {"out", "resume", "profile", "memory_snapshot"}
    given, words = [], sys.argv[1:]
    i = 0
    while i < len(words):
        word = words[i]
        name = word.split("=", 1)[0]
        takes_value = name not in ("--tiny", "--profile", "--memory-snapshot", "--no-compile",
                                   "--activation-checkpointing") and "=" not in word
        if name.startswith("--") and name[2:].replace("-", "_") not in kept:
            given += words[i:i + 2] if takes_value else [word]
        i += 2 if takes_value and name.startswith("--") else 1
    script = ["python", sys.argv[0]]
    if "LOCAL_WORLD_SIZE" in os.environ:  # started by torchrun
        nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
        script = ["torchrun", *(["--standalone"] if nodes == 1 else [f"--nnodes={nodes}", "--node_rank=<this node>",
                                                                       f"--master_addr={os.environ['MASTER_ADDR']}",
                                                                       f"--master_port={os.environ['MASTER_PORT']}"]),
                  f"--nproc_per_node={os.environ['LOCAL_WORLD_SIZE']}", sys.argv[0]]
    return shlex.join([*script, *given, "--resume", str(Path(args.out) / "model.pth")])


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
    device = torch.device(choice)
    if device.type == "cuda" and distributed:
        per_node, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count()
        if per_node > gpus:
            raise UsageError(f"{per_node} processes per node but this node has {gpus} GPU(s): "
                             f"use torchrun --nproc_per_node={gpus} (or fewer)")
    if device.type == "cuda":
        check_cuda_build(torch.cuda.get_device_capability(), torch.cuda.get_arch_list(), torch.__version__,
                         torch.cuda.get_device_name())
    return device


def check_cuda_build(capability, arch_list, torch_version, gpu_name):
    """Refuse (exit code 2) a GPU that this PyTorch build has no kernels for, instead of failing at the first kernel.

    A build holds machine code for some architectures (sm_XY: runs on compute capability X.Y' with Y' >= Y) and
    PTX for others (compute_XY: compiled on the fly for X.Y and newer). The CUDA 13 wheels, for one, leave out
    sm_70 (V100): such a GPU needs a build for an older CUDA.
    """
    major, minor = capability
    for arch in arch_list:
        # a suffix narrows where the code runs: sm_90a only on 9.0 (architecture-specific features), sm_120f on
        # the family 12.x from 12.0 on (as plain sm_120 does)
        match = re.fullmatch(r"(sm|compute)_(\d+)(\d)([af]?)", arch)
        if not match:
            continue
        kind, arch_major, arch_minor, suffix = match[1], int(match[2]), int(match[3]), match[4]
        if kind == "sm" and arch_major == major and (arch_minor == minor if suffix == "a" else arch_minor <= minor):
            return
        exact = (arch_major, arch_minor) == (major, minor)
        if kind == "compute" and (arch_major, arch_minor) <= (major, minor) and (suffix != "a" or exact):
            return
    raise UsageError(f"PyTorch {torch_version} has no kernels for the {gpu_name} (sm_{major}{minor}; this build "
                     f"covers {' '.join(arch_list) or 'no GPU'}): install a build that includes sm_{major}{minor}, "
                     "e.g. pip install torch --index-url https://download.pytorch.org/whl/cu126")


# torchrun --standalone hands its workers this machine's fully qualified host name as MASTER_ADDR; where that name
# does not resolve (containers, small VMs) the process group never starts. One machine needs only the loopback.
SINGLE_NODE_TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--local-addr=127.0.0.1")


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def describe_device(device, matmul_precision=True):
    """The device in words; on CUDA with whether float32 matmuls use TF32 as this process set them (unless
    `matmul_precision` is false: a description that holds for processes set otherwise)."""
    import platform

    import torch

    if device.type == "mps":
        return f"Apple GPU via MPS (macOS {platform.mac_ver()[0] or 'unknown'})"
    if device.type != "cuda":
        return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    major, minor = torch.cuda.get_device_capability(device)
    # as the stage set it (step 2): "high" or "medium" lets float32 matmuls use TF32, where the GPU has it
    tf32 = "TF32 on" if torch.get_float32_matmul_precision() != "highest" and major >= 8 else "no TF32"
    return (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}, CUDA {torch.version.cuda}"
            + (f", {tf32} for float32 matmuls)" if matmul_precision else ")"))


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
        native = cpu_bf16_unit()
        if native:
            return "bf16", f"this CPU computes in bfloat16 ({native})"
        return "fp32", "this CPU has no bfloat16 arithmetic: emulated bf16 is ~10x slower"
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


def cpu_bf16_unit():
    """The unit with which this CPU computes in bfloat16 ("AVX512-BF16", "AMX", "Arm BF16"), or None: without one,
    oneDNN and ATen convert every bf16 operand to float32 and back, about 10x slower than float32 itself.

    Asks oneDNN first (it honours ONEDNN_MAX_CPU_ISA), then the CPU's own flags: oneDNN also answers yes for plain
    AVX512, which only emulates bf16."""
    import platform

    import torch

    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    if platform.machine().lower() not in ("x86_64", "amd64", "x86", "i686"):
        return "Arm BF16"  # oneDNN says yes on Arm only where the CPU has the BF16 extension
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return "AMX"
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "AVX512-BF16"
    return None


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

# One row per GPU: (name pattern, dense peak TFLOP/s as (bf16, fp16, tf32, fp32), memory bandwidth in GB/s).
# Peaks (no sparsity) from NVIDIA's data sheets and architecture whitepapers (the README's "Reading the log" lists
# them with their sources); None where the GPU has no such tensor-core format. bf16 and fp16 are with float32
# accumulation, as autocast's matmuls run (half rate on GeForce cards). Sheets that quote figures "with sparsity"
# are halved. Bandwidth (bench/roofline.py) is the HBM or GDDR figure of the same sheets: A100 data sheet (80 GB
# SXM 2,039, 80 GB PCIe 1,935, 40 GB 1,555), H100 (SXM 3.35 TB/s, PCIe 2 TB/s, NVL 3.9 TB/s), H800 (as H100),
# H200 and H200 NVL (4.8 TB/s), HGX B200 and GB200 NVL72 (8 TB/s per GPU), L40S 864, A10 600, L4 300, RTX A6000
# 768, GeForce RTX 4090 / 4080 / 3090 specifications (1,008 / 716.8 / 936), V100 900 (V100S 1,134), T4 320.
# More specific names first: "H100 NVL" before "H100", "A100" before "A10"; "A100" alone is the SXM 80 GB part.
PEAK_TFLOPS = (
    (r"GB200", (2500.0, 2500.0, 1250.0, 80.0), 8000),       # per Blackwell GPU (a superchip holds two)
    (r"B200", (2250.0, 2250.0, 1100.0, 75.0), 8000),        # HGX B200, per GPU
    (r"H200 NVL", (835.5, 835.5, 417.5, 60.3), 4800),
    (r"H200", (989.4, 989.4, 494.7, 66.9), 4800),
    (r"H100 NVL", (835.5, 835.5, 417.5, 60.3), 3900),
    (r"H100 PCIe", (756.5, 756.5, 378.0, 51.2), 2000),
    (r"H100", (989.4, 989.4, 494.7, 66.9), 3350),           # SXM
    (r"H800 PCIe", (756.5, 756.5, 378.0, 51.2), 2000),
    (r"H800", (989.4, 989.4, 494.7, 66.9), 3350),           # SXM
    (r"A100.*(PCIe.*\b40 ?GB|\b40 ?GB.*PCIe)", (312.0, 312.0, 156.0, 19.5), 1555),
    (r"A100.*PCIe", (312.0, 312.0, 156.0, 19.5), 1935),     # 80 GB PCIe
    (r"A100.*\b40 ?GB", (312.0, 312.0, 156.0, 19.5), 1555),  # 40 GB SXM4
    (r"A100", (312.0, 312.0, 156.0, 19.5), 2039),           # 80 GB SXM4
    (r"L40S", (362.05, 362.05, 183.0, 91.6), 864),
    (r"A10\b", (125.0, 125.0, 62.5, 31.2), 600),
    (r"L4\b", (121.0, 121.0, 60.0, 30.3), 300),
    (r"RTX A6000", (154.8, 154.8, 77.4, 38.7), 768),
    (r"RTX 4090", (165.2, 165.2, 82.6, 82.6), 1008),
    (r"RTX 4080", (97.5, 97.5, 48.7, 48.7), 716.8),         # the 16 GB card
    (r"RTX 3090", (71.0, 71.0, 35.6, 35.6), 936),
    (r"V100S", (None, 130.0, None, 16.4), 1134),
    (r"V100.*PCIE", (None, 112.0, None, 14.0), 900),
    (r"V100", (None, 125.0, None, 15.7), 900),             # SXM2
    (r"\bT4\b", (None, 65.0, None, 8.1), 320),
)
PRECISIONS = ("bf16", "fp16", "tf32", "fp32")


def gpu_peaks(name):
    """The first row of PEAK_TFLOPS that a GPU name matches (CUDA's name, or one typed like "A100 PCIe"), as
    (TFLOP/s in the order of PRECISIONS, memory bandwidth in GB/s); None for a GPU not in the table."""
    for pattern, peaks, bandwidth in PEAK_TFLOPS:
        if re.search(pattern, name, re.IGNORECASE):
            return peaks, bandwidth
    return None


def _peak_tflops(device, precision):
    """(TFLOP/s or None, why there is none) for one GPU like `device`."""
    import torch

    if device.type == "cpu":
        return None, "a CPU has no published dense peak in the table"
    if device.type == "mps":
        return None, "Apple does not publish a dense peak for its GPUs"
    name = torch.cuda.get_device_name(device)
    if re.search(r"\bMIG\b", name):  # e.g. "NVIDIA H100 80GB HBM3 MIG 3g.40gb": a slice, not the whole GPU
        return None, (f"the {name} is a MIG slice with a fraction of the GPU's compute, and NVIDIA publishes no "
                      "peak per slice: the whole GPU's peak would understate MFU")
    row = gpu_peaks(name)
    if row is not None:
        tflops = row[0][PRECISIONS.index(precision)]
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


def memory_line(num_params, cfg, batch_size, precision, flash_attention):
    """The header's estimate of what training needs in GPU memory, before anything is allocated.

    States: float32 weights, gradients and AdamW's two moments, 16 bytes per parameter (Rajbhandari et al.
    2019). Activations saved for backward: about 34 x width bytes per token and layer in 16-bit, plus 5 x heads x
    context bytes for the attention scores where attention is not fused (Korthikanti et al. 2022), twice that in
    float32; plus the logits and their gradient. An estimate: the allocator's own figures come after an epoch.
    """
    tokens = batch_size * cfg["context_length"]
    half = 1 if precision in ("bf16", "fp16") else 2  # activations in 16-bit, or float32
    per_token_and_layer = 34 * cfg["emb_dim"] + (0 if flash_attention else 5 * cfg["n_heads"] * cfg["context_length"])
    activations = tokens * (cfg["n_layers"] * per_token_and_layer * half + cfg["vocab_size"] * 4 * half)
    return (f"Memory (estimate): weights, gradients and AdamW state {16 * num_params / GIB:.1f} GiB (16 bytes per "
            f"parameter) + activations {activations / GIB:.1f} GiB at batch {batch_size} x {cfg['context_length']}")


# ---------------------------------------------------------------------------------------------
# Memory: one unit everywhere (the log, metrics.json's *_gb keys, the ladder, the README): GiB, 1024^3 bytes
# ---------------------------------------------------------------------------------------------

GIB = 1024**3
_first_interval_peaks = {}  # CUDA: the allocator's peaks over the first interval, once it has ended


def end_of_warm_up(device):
    """Called where the first log interval ends (off the clock). Its peaks hold one-off costs: compilation, and
    Triton's autotuning, which clones every buffer a kernel writes in place (at batch 32 the logits: 3 GiB). They
    are kept apart; the cache that only they needed is given back, and the steady state's peaks count from here."""
    import torch

    if device.type != "cuda" or _first_interval_peaks:
        return
    _first_interval_peaks.update(allocated=torch.cuda.max_memory_allocated(device) / GIB,
                                 reserved=torch.cuda.max_memory_reserved(device) / GIB)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def memory_metrics(device):
    """metrics.json's memory in GiB (None off CUDA): now, the steady state's peaks (after the first interval) and
    the first interval's. A run whose first interval never ended has no steady state: its peaks are the first's."""
    import torch

    keys = ("allocated_gb", "reserved_gb", "peak_allocated_gb", "peak_reserved_gb",
            "first_interval_peak_allocated_gb", "first_interval_peak_reserved_gb")
    if device.type != "cuda":
        return {"memory_unit": "GiB", **dict.fromkeys(keys)}
    peaks = (torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB)
    first = _first_interval_peaks or dict(zip(("allocated", "reserved"), peaks))
    steady = peaks if _first_interval_peaks else (None, None)
    values = (torch.cuda.memory_allocated(device) / GIB, torch.cuda.memory_reserved(device) / GIB, *steady,
              first["allocated"], first["reserved"])
    return {"memory_unit": "GiB", **dict(zip(keys, values))}


def peak_memory_line(metrics):
    """The log's last word on memory: the steady state's peaks beside the first interval's; None off CUDA."""
    if metrics["first_interval_peak_reserved_gb"] is None:
        return None
    steady = ("no steady state (the run ended in its first interval)" if metrics["peak_reserved_gb"] is None else
              f"{metrics['peak_allocated_gb']:.2f} GiB allocated, {metrics['peak_reserved_gb']:.2f} GiB reserved "
              "after the first interval")
    return (f"Peak memory: {steady} | first interval (warm-up, compilation, autotuning): "
            f"{metrics['first_interval_peak_allocated_gb']:.2f} GiB allocated, "
            f"{metrics['first_interval_peak_reserved_gb']:.2f} GiB reserved")


def mfu(tokens_per_sec_per_gpu, flops_per_tok, peak):
    if not peak or not tokens_per_sec_per_gpu:
        return None
    return tokens_per_sec_per_gpu * flops_per_tok / peak


class TrainClock:
    """Accumulates training time only: start() and stop() around the steps, take() at each log line.

    On CUDA it times with events in the stream, so queued kernels are counted in full: stop() waits for the GPU
    to reach its event (what follows, an evaluation or a sample, then starts on an idle GPU, and the host's wall
    clock gives training its own time), except stop(wait=False), between steps that run off the clock (profiled
    ones), where a wait would leave the GPU idle before the next step, as training never does; take() reads the
    events, after waiting for the last.
    """

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.mps = device.type == "mps"  # no timing events there: synchronize, then read the host clock
        self.torch = torch
        self.seconds = 0.0
        self._start = None
        self._spans = []  # CUDA: (start, end) events not yet read

    def start(self):
        if self.cuda:
            self._start = self.torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            if self.mps:
                self.torch.mps.synchronize()
            self._start = time.perf_counter()

    def stop(self, wait=True):
        if self._start is None:
            return
        if self.cuda:
            end = self.torch.cuda.Event(enable_timing=True)
            end.record()
            self._spans.append((self._start, end))
            if wait:
                end.synchronize()
        else:
            if self.mps:
                self.torch.mps.synchronize()
            self.seconds += time.perf_counter() - self._start
        self._start = None

    def take(self):
        """The seconds timed since the last take(); on CUDA it waits for the GPU to reach the last stop()."""
        if self._spans:
            self._spans[-1][1].synchronize()  # one stream: the earlier events have completed too
            self.seconds += sum(start.elapsed_time(end) for start, end in self._spans) / 1000
            self._spans = []
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
    """Say what the run is doing when it has printed nothing for `every_s` seconds, and keep its wall clock.

    The stages name what they do (`heartbeat.doing = "evaluating"`); each activity's host time goes to one of
    WALL_CLOCK_PHASES, and torch.compile's own callbacks carve the compilation out of whatever it interrupted
    (the first training step, the first evaluation, the lazily compiled backward pass).
    """

    current = None  # the process's heartbeat, for the file writers that have none passed to them (`busy`)

    def __init__(self, every_s=10.0):
        self._doing = "starting"
        self.every_s = every_s
        if not isinstance(sys.stdout, _TimedStdout):
            sys.stdout = _TimedStdout(sys.stdout)
        self._stdout = sys.stdout
        self._started = time.monotonic()
        self._phase_started = self._started
        self.seconds = dict.fromkeys(WALL_CLOCK_PHASES, 0.0)
        self.seconds["start-up"] = process_age()  # the interpreter and the imports came before this object
        self.compiling = False
        if "torch._dynamo" in sys.modules:  # a stage that compiles (01 on): say so while torch.compile works
            from torch._dynamo.callback import callback_handler

            callback_handler.register_start_callback(lambda *_: self._compiling(True))
            callback_handler.register_end_callback(lambda *_: self._compiling(False))
        Heartbeat.current = self
        threading.Thread(target=self._run, daemon=True).start()

    @property
    def doing(self):
        return self._doing

    @doing.setter
    def doing(self, what):
        if not self.compiling:
            self._close_phase(self._phase_of(self._doing))
        self._doing = what

    def _compiling(self, starting):
        self._close_phase("compilation" if self.compiling else self._phase_of(self._doing))
        self.compiling = starting

    def _phase_of(self, doing):
        if doing.startswith("training"):
            return "training"
        if doing.startswith("evaluating"):
            return "evaluation"
        if doing.startswith("generating"):
            return "sampling"
        if doing.startswith("writing"):
            return "checkpoints and outputs"
        return "start-up" if self.seconds["training"] == 0 else "checkpoints and outputs"

    def _close_phase(self, phase):
        now = time.monotonic()
        self.seconds[phase] += now - self._phase_started
        self._phase_started = now

    def wall_clock(self):
        """Seconds since the process started, by phase (WALL_CLOCK_PHASES) and in total; for metrics.json."""
        self._close_phase("compilation" if self.compiling else self._phase_of(self._doing))
        split = {phase: round(seconds, 2) for phase, seconds in self.seconds.items()}
        return {**split, "total": round(sum(self.seconds.values()), 2)}

    def describe(self):
        """What the run is doing now, e.g. "compiling the training graph (torch.compile): epoch 1, step 0"."""
        if not self.compiling:
            return self.doing
        graph = ("training graph" if self.doing.startswith("training") else
                 "evaluation graph" if self.doing.startswith("evaluating") else "graph")
        return f"compiling the {graph} (torch.compile): {self.doing}"

    def _run(self):
        while True:
            time.sleep(1.0)
            quiet = time.monotonic() - self._stdout.last_write
            if quiet >= self.every_s:
                elapsed = time.monotonic() - self._started
                print(f"  ... {self.describe()} ({elapsed:.0f} s since start)", flush=True)


WALL_CLOCK_PHASES = ("start-up", "compilation", "training", "evaluation", "sampling", "checkpoints and outputs")


def process_age():
    """Seconds since this process started (Linux: /proc), so that start-up includes importing PyTorch; else 0."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, counted after the command name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


@contextlib.contextmanager
def busy(what):
    """Tell the heartbeat (if any) what a long call is doing, e.g. "writing model.pth", then go back."""
    heartbeat = Heartbeat.current
    if heartbeat is None:
        yield
        return
    before = heartbeat.doing
    heartbeat.doing = what
    try:
        yield
    finally:
        heartbeat.doing = before


def wall_clock_line(split):
    """"Wall clock: 51.2 s since the process started = start-up 6.0 s + compilation 30.1 s + ..." for the log."""
    parts = " + ".join(f"{phase} {split[phase]:.1f} s" for phase in WALL_CLOCK_PHASES)
    return f"Wall clock: {split['total']:.1f} s since the process started = {parts}"


# ---------------------------------------------------------------------------------------------
# Failures
# ---------------------------------------------------------------------------------------------

def out_of_memory(device, batch_size, context_length, script=None):
    """The message for CUDA running out of memory: what failed, what was in use, and the levers that exist."""
    import torch

    in_use = ""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        in_use = (f" ({torch.cuda.memory_allocated(device) / 1024**3:.1f} GiB allocated, "
                  f"{torch.cuda.memory_reserved(device) / 1024**3:.1f} GiB reserved of {total / 1024**3:.1f} GiB)")
    script = Path(script or sys.argv[0]).name
    levers = [f"a smaller --batch-size ({batch_size // 2})"] if batch_size > 1 else []
    if script.startswith("03"):
        levers += ["--activation-checkpointing", "more GPUs (torchrun --nproc_per_node=N, more nodes)"]
    else:
        levers += ["a smaller --model", "03_opt_multi_gpu_fsdp.py with --activation-checkpointing or more GPUs "
                   "(it shards the weights, gradients and optimizer state)"]
    return TrainingError(f"out of GPU memory with a batch of {batch_size} x {context_length} tokens{in_use}; "
                         f"levers: {'; '.join(levers)}")


# ---------------------------------------------------------------------------------------------
# Files and exit codes
# ---------------------------------------------------------------------------------------------

def _lost_a_peer(err):
    """Whether `err` is a collective failing because another process of a distributed job is gone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    text = str(err)
    return isinstance(err, getattr(dist, "DistError", ())) or (
        isinstance(err, RuntimeError) and ("Connection closed by peer" in text or "Connection reset by peer" in text))


def run(main):
    """Run a stage's main() and turn its failures into the exit codes the README lists (section "Exit codes")."""
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
        if os.environ.get("RANK", "0") == "0":  # in 02 every rank stops: one message for the job
            print(f"stopped by {err} after step {err.step:06d}; the checkpoint is saved and whole. To go on:\n"
                  f"  {_continue_command}", file=sys.stderr)
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
