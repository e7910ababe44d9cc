"""GPU memory in one unit everywhere (the log, metrics.json's *_gb keys, the ladder, the docs): GiB, 1024^3 bytes.

The header's estimate of what training needs, and the allocator's figures, the steady state's peaks kept apart
from the first interval's.
"""

GIB = 1024**3
_first_interval_peaks = {}  # CUDA: the allocator's peaks over the first interval, once it has ended


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
    activations = tokens * (cfg["n_layers"] * per_token_and_layer * half + logits_bytes_per_token(cfg) * half)
    return (f"Memory (estimate): weights, gradients and AdamW state {gib(16 * num_params)} (16 bytes per "
            f"parameter) + activations {gib(activations)} at batch {batch_size} x {cfg['context_length']}")


def logits_bytes_per_token(cfg):
    """The 16-bit logits and their gradient, kept through the backward: 2 x 2 bytes per vocabulary entry."""
    return 4 * cfg["vocab_size"]


def gib(num_bytes, decimals=1):
    """"12.5 GiB": `decimals` places, four below a tenth of a GiB (--tiny's figures), not "0.0"."""
    return f"{num_bytes / GIB:.{decimals if num_bytes >= 0.1 * GIB else 4}f} GiB"


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


def peaks_since_start(device):
    """(allocated, reserved) GiB: the allocator's peaks since its counters were reset before the first step (by
    --memory-snapshot as it starts recording: the one caller), the first interval's included though end_of_warm_up
    resets the counters after it; CUDA only."""
    import torch

    now = (torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB)
    first = (_first_interval_peaks.get("allocated", 0.0), _first_interval_peaks.get("reserved", 0.0))
    return max(now[0], first[0]), max(now[1], first[1])


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
