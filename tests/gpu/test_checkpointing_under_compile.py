"""Stage 03's --activation-checkpointing under torch.compile on the GPU: the recomputed forward must draw the same
dropout as the forward it replaces.

03 wraps each block in checkpoint_wrapper, then compiles it. On CUDA the block's attention is FlashAttention with
dropout 0.1, and its MLP and residual dropouts are Inductor's own random kernels; the backward recomputes all of them.
That is right only if the recomputation replays the random state of the forward (or keeps its masks). On a CPU,
SDPA with dropout takes its math path, so only a GPU can show it.

Two compiled graphs, one with the checkpoint and one without, draw their dropout differently even from the same
seed when Inductor makes its own random numbers (one seed per graph, spread over its random kernels): on an H200
with PyTorch 2.11 their forwards differed by 9.5e-2, as much as two seeds do. The block test therefore compiles
with `fallback_random` (Inductor draws through PyTorch's own random ops, the same in both graphs), checks that the
two forwards agree, and only then compares the gradients: so a difference is the recomputation's, not the graphs'.

Budget on one H100: about 1 minute 30 s for this file: one block compiled three times (~40 s), and two --tiny runs
of 03 under torchrun (~25 s each).
"""

import pytest
import torch
import torch._inductor.config as inductor_config
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from conftest import load_stage
from gpu.stage_runs import log_entries, run_stage

STAGE_03 = load_stage("03_opt_multi_gpu_fsdp.py")
CONFIG = STAGE_03.GPT_CONFIG_124M  # one block of GPT-2 small, at 01's context: FlashAttention's real shapes
STEPS = 20


def block_gradients(checkpointed, dropout_seed):
    """The output and the gradients of one compiled block of 03 (its input's and every weight's, in one vector)
    after a forward and backward under bf16 autocast, as 03 runs it, with dropout drawn from `dropout_seed`."""
    torch.manual_seed(0)  # the same weights and input for every call
    block = STAGE_03.TransformerBlock(CONFIG).cuda()
    if checkpointed:
        block = checkpoint_wrapper(block)
    block.compile()
    inputs = torch.randn(2, CONFIG["context_length"], CONFIG["emb_dim"], device="cuda")
    for attempt in range(2):  # the first call compiles; the second is the one compared
        block.zero_grad()
        leaf = inputs.clone().requires_grad_()
        torch.manual_seed(dropout_seed)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = block(leaf)
        out.float().square().mean().backward()
    gradients = torch.cat([leaf.grad.flatten(), *(p.grad.flatten() for p in block.parameters())])
    return out.detach().float(), gradients.float()


def relative_difference(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_a_checkpointed_compiled_block_recomputes_the_same_dropout(report, monkeypatch):
    # budget: ~15 s (12 s on an H200): three compilations of one block
    monkeypatch.setattr(inductor_config, "fallback_random", True)  # the same draws in both graphs: see the top
    torch._dynamo.reset()
    out_reference, reference = block_gradients(checkpointed=False, dropout_seed=1)
    out_checkpointed, checkpointed = block_gradients(checkpointed=True, dropout_seed=1)
    out_other, other_masks = block_gradients(checkpointed=False, dropout_seed=2)
    torch._dynamo.reset()
    forward, forward_control = (relative_difference(out_checkpointed, out_reference),
                                relative_difference(out_other, out_reference))
    replayed, control = relative_difference(checkpointed, reference), relative_difference(other_masks, reference)
    report(f"03's block, compiled (fallback_random), bf16, dropout {CONFIG['drop_rate']}: with activation "
           f"checkpointing the forward differs from the one without by {forward:.2e} and the gradients by "
           f"{replayed:.2e} (relative); other dropout masks move them by {forward_control:.2e} and {control:.2e}")
    assert control > 1e-2, "dropout does not move the gradients: the check below could not fail"
    assert forward < 0.05 * forward_control, (
        "the two graphs drew other dropout masks in the forward already: the gradients below cannot be compared")
    assert replayed < 0.05 * control, (
        "the recomputed forward drew other dropout masks than the forward did: the backward of a checkpointed "
        "block computes the gradient of another network")


def test_03_learns_the_same_with_and_without_activation_checkpointing(tmp_path, report):
    # budget: ~50 s: two --tiny runs of 03 under torchrun, compiled on CUDA
    flags = ["--tiny", "--device", "cuda", "--max-steps", STEPS, "--eval-freq", 5, "--seed", 7]
    runs = {name: run_stage("03_opt_multi_gpu_fsdp.py", *flags, *extra, out=tmp_path / name, torchrun=True,
                            timeout=240)
            for name, extra in (("plain", []), ("checkpointed", ["--activation-checkpointing"]))}
    for run in runs.values():
        assert run.returncode == 0, run.describe()
    losses = {name: [entry["train_loss"] for entry in log_entries(run.stdout)] for name, run in runs.items()}
    worst = max(abs(a / b - 1) for a, b in zip(losses["checkpointed"], losses["plain"]))
    report(f"03 --tiny on CUDA, {STEPS} steps, seed 7: training losses {losses['plain']} without and "
           f"{losses['checkpointed']} with --activation-checkpointing: at most {worst:.3%} apart")
    assert len(losses["plain"]) == len(losses["checkpointed"]) >= 4
    # the two runs differ by rounding and by their graphs' own dropout draws (see the top): well under 1%
    assert worst < 0.01, "the runs drift apart: see the block test above for the cause"
    assert pytest.approx(losses["plain"][0], rel=1e-3) == losses["checkpointed"][0]
