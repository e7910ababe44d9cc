"""The device and what it can do: --device, the CUDA build check, the header's device words, a CPU's matmul speed
(the note on the full-size model there), step 5's precision by hardware (bf16, float16 with a gradient scaler, or
float32), fused AdamW and TF32, and the fallbacks of Apple's GPUs.
"""

import functools
import os
import re
import sys
import time
from pathlib import Path

from failures import UsageError


def pick_device(choice, distributed=False):
    """The torch.device for --device. `auto` prefers CUDA, then Apple's MPS, then the CPU.

    `distributed` (stages 02 and 03): torch.distributed has no backend for MPS tensors (NCCL is CUDA only, gloo CPU
    and CUDA), so there `auto` takes the CPU instead of MPS, and an explicit `--device mps` is refused. Stages 00
    and 01 train in one process: started by torchrun with more, each would train alone into the same --out.
    """
    import torch

    processes = int(os.environ.get("WORLD_SIZE", 1))
    if processes > 1 and not distributed:
        raise UsageError(f"torchrun started {processes} processes, but {Path(sys.argv[0]).name} trains in one and "
                         "shares no work: run it with python, or 02_opt_multi_gpu_ddp.py under torchrun")

    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but PyTorch sees no CUDA GPU: use --device cpu (or auto)")
    if choice == "mps" and not torch.backends.mps.is_available():
        why = ("this PyTorch build has no MPS support" if not torch.backends.mps.is_built()
               else "not a Mac with a GPU and macOS version that MPS supports")
        raise UsageError(f"--device mps was asked for but PyTorch sees no Apple GPU ({why}): "
                         "use --device cpu (or auto)")
    if choice == "mps" and distributed:
        raise UsageError("--device mps: torch.distributed has no backend for MPS tensors (NCCL is CUDA only, gloo "
                         "CPU and CUDA), so neither DDP nor FSDP runs there: on a Mac use 01_opt_single_gpu.py, or "
                         "--device cpu")
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
        if not distributed:  # CUDA's context made now, so that its start is timed as the device's (start-up's
            torch.empty(1, device=device)  # "device" part); 02 and 03 make it on each process's own GPU
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
                     "e.g. pip install torch --index-url https://download.pytorch.org/whl/"
                     + ("cu126" if major < 10 else "cu128"))  # CUDA 12.6's wheels end at Hopper, 12.8's add Blackwell


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
        threads = torch.get_num_threads()
        return f"CPU ({os.cpu_count()} cores, {threads} thread{'' if threads == 1 else 's'})"
    major, minor = torch.cuda.get_device_capability(device)
    # as the stage set it (step 2): "high" or "medium" lets float32 matmuls use TF32, where the GPU has it
    tf32 = "TF32 on" if torch.get_float32_matmul_precision() != "highest" and major >= 8 else "no TF32"
    return (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}, CUDA {torch.version.cuda}"
            + (f", {tf32} for float32 matmuls)" if matmul_precision else ")"))


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
    try:  # the machine's RAM, beside the header's estimate: a run that outgrows it is killed without a word
        ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        ram = (f"; the memory estimate above (a GPU's) is a floor here, and a run that outgrows this machine's "
               f"{ram_gib:.1f} GiB of RAM is killed without a word")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows)
        ram = ""
    return (f"Note: this model needs at least ~{seconds_per_step:.0f} s per step on this CPU "
            f"(~{epoch_hours:.1f} h per epoch of {steps_per_epoch} steps, at its {rate / 1e9:.0f} GFLOP/s "
            f"matmul speed){ram}; add --tiny for a small model that trains in seconds.")


# ---------------------------------------------------------------------------------------------
# What the hardware supports: step 5's precision, and the fallbacks an Apple GPU (MPS) needs
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def autocast_precision(device):
    """Step 5's choice for `device`: (precision, reason). The precision is "bf16" or "fp16" (autocast to that
    dtype; fp16 with a gradient scaler) or "fp32" (no autocast: no reduced precision helps or works there)."""
    import torch

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


def has_fused(device):
    """Whether this PyTorch has a fused AdamW kernel for `device` (step 3)."""
    try:  # PyTorch's own list, from a private module
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # a PyTorch that moved it: the devices every PyTorch since 2.4 fuses for
        return device.type in ("cuda", "cpu")
    return device.type in _get_fused_kernels_supported_devices()


def apply_fallbacks(device):
    """Stages 01 to 03: one line for each optimization that cannot work on `device`, which then runs without it
    (in practice 01's: 02 and 03 run on CUDA or the CPU, where every step works).

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
