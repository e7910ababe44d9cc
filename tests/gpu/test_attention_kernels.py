"""The attention kernels behind step 7 on the GPU, at 01's shapes: which one SDPA picks by itself, the dropout each
one really applies, and what a training call of each costs.

Stages 01 to 03 turn cuDNN's attention off (torch.backends.cuda.enable_cudnn_sdp(False)): PyTorch 2.11 tries it
first on Hopper GPUs, and it may round the dropout probability to a multiple of 1/16, so the book's 0.1 would train at
another rate (PyTorch 2.12 and newer stop routing such rates to it). This file measures that premise on the GPU at
hand and reports what cuDNN's kernel would have bought; the stage runs of test_full_size_runs.py check which kernel
the stages' compiled steps really use. Every call of cuDNN's attention runs in a child process of its own: an error
it leaves behind in CUDA's context (a sticky one poisons every later CUDA call) cannot fail this process's tests.

Budget on one H100: about 10 s.
"""

import json
import statistics
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import load_stage

STAGE_01 = load_stage("01_opt_single_gpu.py")
CONFIG = STAGE_01.GPT_CONFIG_124M
BATCH, TOKENS, HEADS = STAGE_01.OTHER_SETTINGS["batch_size"], CONFIG["context_length"], CONFIG["n_heads"]
HEAD_DIM = CONFIG["emb_dim"] // HEADS  # 01 at its default batch: GPT-2 small's 12 heads of 64
DROPOUT = CONFIG["drop_rate"]  # what 01's attention passes to SDPA in training: 0.1
ALL_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.MATH]
STAGE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # cuDNN's off
LAYERS = CONFIG["n_layers"]  # one such call per layer and step
DEVICE = "cuda"


def backend_name(choice):
    return next(name for name, member in SDPBackend.__members__.items() if int(member) == choice)


def training_inputs(qkv):
    """(q, k, v, their leaf) of one training call laid out as 01's attention makes them: one (batch, tokens,
    3 x width) projection split into heads, (batch, heads, tokens, head_dim) views of it, in bf16 as under autocast."""
    qkv = qkv.to(device=DEVICE, dtype=torch.bfloat16).requires_grad_()
    heads = [part.view(BATCH, TOKENS, HEADS, HEAD_DIM).transpose(1, 2) for part in qkv.chunk(3, dim=-1)]
    return (*heads, qkv)


def random_projection():
    return torch.randn(BATCH, TOKENS, 3 * HEADS * HEAD_DIM)


def sdpa_choice(backends, dropout):
    """The backend SDPA's own dispatch takes for a training call, with only `backends` switched on."""
    q, k, v, _ = training_inputs(random_projection())
    with sdpa_kernel(backends):
        return backend_name(torch._fused_sdp_choice(q, k, v, None, dropout, True))


def applied_dropout(backend):
    """(fraction of attention weights dropped, scale of the kept ones) of one training call on `backend`.

    Queries and keys of zeros give every token the same score, so token i weighs each token j <= i by 1 / (i + 1);
    the values are one-hot in channel j mod 64, so among the first 64 tokens each weight lands in a channel of its
    own. A dropped weight is an exact 0 there, and a kept one is 1 / ((i + 1) (1 - p)) for the p the kernel uses
    to scale: 800,000 weights in all, enough to tell 0.1 from 1/16 or 2/16 by far."""
    one_hot = F.one_hot(torch.arange(TOKENS) % HEAD_DIM, HEAD_DIM).float()  # (tokens, head_dim)
    values = one_hot.repeat(1, HEADS).expand(BATCH, TOKENS, HEADS * HEAD_DIM)  # the same in every head
    q, k, v, _ = training_inputs(torch.cat([torch.zeros(BATCH, TOKENS, 2 * HEADS * HEAD_DIM), values], dim=-1))
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=DROPOUT)
    causal = torch.tril(torch.ones(HEAD_DIM, HEAD_DIM, dtype=torch.bool, device=DEVICE))
    weights = out[:, :, :HEAD_DIM, :].float()[:, :, causal]  # token i's weight of token j, for j <= i < 64
    tokens_seen = torch.arange(1, HEAD_DIM + 1, device=DEVICE).unsqueeze(1).expand(HEAD_DIM, HEAD_DIM)[causal]
    kept = weights != 0
    return 1 - kept.float().mean().item(), (weights * tokens_seen)[kept].mean().item()


def milliseconds_per_training_call(backend, dropout, repeats=10):
    """Median time of one forward and backward of SDPA on `backend`, after warm-up, read with CUDA events."""
    q, k, v, qkv = training_inputs(random_projection())
    grad = torch.randn_like(q)
    times = []
    with sdpa_kernel([backend]):
        for attempt in range(3 + repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
            torch.autograd.grad(out, qkv, grad)
            end.record()
            torch.cuda.synchronize()
            if attempt >= 3:
                times.append(start.elapsed_time(end))
    return statistics.median(times)


def cudnn_probe_in_this_process():
    """The child's work: what cuDNN's attention drops and costs, as one line of JSON ("refused: ..." where it fails)."""
    def attempt(measure):
        try:
            return measure()
        except Exception as error:  # e.g. PyTorch 2.12+: cuDNN's attention refuses a dropout of 0.1
            return f"refused: {(str(error).splitlines() or [type(error).__name__])[0][:200]}"

    print(json.dumps({"dropout": attempt(lambda: applied_dropout(SDPBackend.CUDNN_ATTENTION)),
                      **{f"ms at {dropout}": attempt(lambda: milliseconds_per_training_call(
                          SDPBackend.CUDNN_ATTENTION, dropout)) for dropout in (DROPOUT, 0.0)}}))


def run_cudnn_probe():
    """cuDNN's measurements, from a child process; {"error": ...} where the child itself failed."""
    from gpu.stage_runs import ROOT

    code = ("import sys; sys.path.insert(0, 'tests'); "
            "from gpu.test_attention_kernels import cudnn_probe_in_this_process; cudnn_probe_in_this_process()")
    child = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = child.stdout.strip().splitlines()
    if child.returncode != 0 or not lines:
        return {"error": f"the probe's process ended with {child.returncode}: {child.stderr.strip()[-300:]}"}
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def cudnn_probe():
    return run_cudnn_probe()


def test_the_stages_attention_is_flashattention_and_drops_what_dropout_p_says(report, cudnn_probe):
    # budget: ~5 s
    default = {dropout: sdpa_choice(ALL_BACKENDS, dropout) for dropout in (DROPOUT, 0.0)}
    stages = sdpa_choice(STAGE_BACKENDS, DROPOUT)
    report(f"SDPA at 01's shapes ({BATCH} x {HEADS} heads x {TOKENS} tokens x {HEAD_DIM}, bf16, training), its own "
           f"choice: {default[DROPOUT]} at dropout {DROPOUT}, {default[0.0]} at 0; with cuDNN's off, as the stages "
           f"set it: {stages}")
    measured = {"FLASH_ATTENTION": applied_dropout(SDPBackend.FLASH_ATTENTION),
                "CUDNN_ATTENTION": cudnn_probe.get("dropout", cudnn_probe.get("error"))}  # in a child process
    for name, result in measured.items():
        if isinstance(result, str):
            report(f"{name} takes no training call at dropout {DROPOUT} here: {result}")
            continue
        dropped, scale = result
        report(f"{name} at dropout_p={DROPOUT}: {dropped:.4f} of the attention weights dropped, the kept ones "
               f"scaled by {scale:.4f} (1 / (1 - {DROPOUT}) = {1 / (1 - DROPOUT):.4f})")
    assert stages == "FLASH_ATTENTION", (
        f"with cuDNN's attention off, SDPA takes {stages} for 01's training call, not FlashAttention: step 7's "
        "lesson and the roofline's attention model assume FlashAttention")
    dropped, scale = measured["FLASH_ATTENTION"]
    assert abs(dropped - DROPOUT) < 0.005, f"FlashAttention drops {dropped:.4f} of the weights, not {DROPOUT}"
    assert scale == pytest.approx(1 / (1 - DROPOUT), rel=0.01), f"kept weights scaled by {scale:.4f}"


@pytest.mark.parametrize("dropout", [DROPOUT, 0.0])
def test_what_each_attention_kernel_costs_per_training_call(dropout, report, cudnn_probe):
    """A report, not a judgement: what cuDNN's attention would save per layer and step if the dropout allowed it
    (the ladder's --option cudnn-attention measures it in the whole step)."""
    # budget: ~2 s each, and ~10 s once for the cuDNN probe's process
    try:
        flash = milliseconds_per_training_call(SDPBackend.FLASH_ATTENTION, dropout)
    except RuntimeError:
        flash = None
    costs = {"FLASH_ATTENTION": flash, "CUDNN_ATTENTION": cudnn_probe.get(f"ms at {dropout}", cudnn_probe.get("error"))}
    shown = ", ".join(f"{name} {'refused' if not isinstance(ms, float) else f'{ms:.3f} ms'}"
                      for name, ms in costs.items())
    report(f"one SDPA forward and backward at 01's shapes, dropout {dropout} ({LAYERS} of them in a step of "
           f"GPT-2 small): {shown}")
    assert costs["FLASH_ATTENTION"] is not None, "FlashAttention took no training call at 01's shapes"
