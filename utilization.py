"""Model FLOPs utilization (MFU): a training step's FLOPs per token, the GPUs' dense peaks, and the share of the
peak that a run's tokens per second reach. GPU memory is gpu_memory.py's.
"""

import re


# ---------------------------------------------------------------------------------------------
# Throughput and MFU
# ---------------------------------------------------------------------------------------------

# One row per GPU: (name pattern, dense peak TFLOP/s as (bf16, fp16, tf32, fp32)).
# Peaks (no sparsity) from NVIDIA's data sheets and architecture whitepapers (docs/measuring.md, "Reading the log",
# lists them with their sources); None where the GPU has no such tensor-core format. bf16 and fp16 are with float32
# accumulation, as autocast's matmuls run (half rate on GeForce cards). Sheets that quote figures "with sparsity"
# are halved. The same rows' memory bandwidth is the cost model's (cost_model/gpus.py, BANDWIDTH_GB_PER_S).
# More specific names first: "H100 NVL" before "H100", "A100" before "A10"; "A100" alone is the SXM 80 GB part.
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
    (r"A100.*(PCIe.*\b40 ?GB|\b40 ?GB.*PCIe)", (312.0, 312.0, 156.0, 19.5)),
    (r"A100.*PCIe", (312.0, 312.0, 156.0, 19.5)),     # 80 GB PCIe
    (r"A100.*\b40 ?GB", (312.0, 312.0, 156.0, 19.5)),  # 40 GB SXM4
    (r"A100", (312.0, 312.0, 156.0, 19.5)),           # 80 GB SXM4
    (r"L40S", (362.05, 362.05, 183.0, 91.6)),
    (r"A10\b", (125.0, 125.0, 62.5, 31.2)),
    (r"L4\b", (121.0, 121.0, 60.0, 30.3)),
    (r"RTX A6000", (154.8, 154.8, 77.4, 38.7)),
    (r"RTX 4090", (165.2, 165.2, 82.6, 82.6)),
    (r"RTX 4080", (97.5, 97.5, 48.7, 48.7)),         # the 16 GB card
    (r"RTX 3090", (71.0, 71.0, 35.6, 35.6)),
    (r"V100S", (None, 130.0, None, 16.4)),
    (r"V100.*PCIE", (None, 112.0, None, 14.0)),
    (r"V100", (None, 125.0, None, 15.7)),             # SXM2
    (r"\bT4\b", (None, 65.0, None, 8.1)),
)
PRECISIONS = ("bf16", "fp16", "tf32", "fp32")


def peak_row(name):
    """The first row of PEAK_TFLOPS that a GPU name matches (CUDA's name, or one typed like "A100 PCIe"):
    (its name pattern, TFLOP/s in the order of PRECISIONS); None for a GPU not in the table."""
    return next((row for row in PEAK_TFLOPS if re.search(row[0], name, re.IGNORECASE)), None)


def readable_gpu_name(pattern):
    """A name a person can type for a row of PEAK_TFLOPS ("A100.*PCIe": "A100 PCIe"; of "(a|b)", a); None where the
    pattern has no such name or the name would pick another row."""
    name = re.sub(r"\(([^()|]*)\|[^()]*\)", r"\1", pattern)  # an alternation: its first branch
    name = name.replace(r"\b", "").replace(".*", " ").replace(" ?", " ")
    row = None if re.search(r"[.*()|?]", name) else peak_row(name)
    return name if row is not None and row[0] == pattern else None


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
    row = peak_row(name)
    if row is not None:
        tflops = row[1][PRECISIONS.index(precision)]
        return tflops, None if tflops else f"the {name} has no {precision} peak in the table"
    return None, f"the {name} is not in the peak table (utilization.PEAK_TFLOPS): add its data-sheet figures"


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


def mfu(tokens_per_sec, flops_per_tok, peak):
    """The share of `peak` that `tokens_per_sec` uses; under several processes both are the whole job's (the peak of
    all its GPUs), which gives the MFU per GPU. None where either is unknown."""
    if not peak or not tokens_per_sec:
        return None
    return tokens_per_sec * flops_per_tok / peak


def counted_flops_per_token(build_model, context_length):
    """One training step's FLOPs per token (forward and backward), counted by torch.utils.flop_counter: the check of
    flops_per_token's formula (the tests count 00 and 01, 00 at every model size and 03's recomputation; runs use
    the formula and count nothing).

    The model is built on the meta device, so nothing is allocated or computed: a CPU counts the full-size
    model in well under a second. Like the formula, the counter sees only matrix multiplications (no embedding
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

