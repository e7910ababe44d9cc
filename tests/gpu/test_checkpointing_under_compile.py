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

The tests of the gradient check compile with Inductor's own random numbers, as the stages do (in float32, not the
stages' bf16, so that rounding stays far below what other masks change), and ask of each graph alone whether its
backward is the gradient of the forward that ran (tests/support/gradient_check.py): 03's checkpointed block, whose
backward draws the masks again from their seeds, and 01's whole training graph, which keeps Inductor's masks for the
backward (on a CPU at --tiny, the ladder's --option memory-budget has them drawn again; SDPA's attention kernel draws
its own again in any case, from its own seed). pytorch/pytorch#198333 reports that since PyTorch 2.13 Inductor on CUDA
may draw a mask again with another formula than the forward's. These tests have not yet run on a GPU.

Budget on one H100: about 3 minutes for this file: one block compiled four times (~55 s), 01's graph at two layers
twice (~30 s each), and two --tiny runs of 03 under torchrun (~25 s each).
"""

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from bench.rungs import MEMORY_BUDGET
from conftest import load_stage
from gpu.stage_runs import log_entries, run_stage
from support import gradient_check

STAGE_01 = load_stage("01_opt_single_gpu.py")
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


@pytest.fixture
def float32_matmuls():
    """Float32 without TF32, for the check's central differences (rounding far below what other masks change), and
    Dynamo's caches emptied before and after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_float32_matmul_precision(before)


def check_the_gradient(report, what, error, control):
    report(f"{what}, compiled (Inductor's random numbers), float32, PyTorch {torch.__version__}: g . v {error:.1e} "
           f"from the central difference with the forward's masks, {control:.2f} with other masks")
    assert control > 0.05, "other masks do not move the derivative: the check could not fail"
    assert error < 0.01 and error < 0.05 * control, (  # on a CPU: 1e-4 (03's block), 1e-3 to 3e-3 (01's graph)
        "the backward drew other dropout masks than its forward drew: the model learns the gradient of another "
        "network (see pytorch/pytorch#198333)")


def test_03s_checkpointed_block_as_compiled_differentiates_the_dropout_its_forward_drew(report, float32_matmuls):
    # budget: ~15 s: one block compiled once, one backward and four forwards
    torch.manual_seed(0)
    block = checkpoint_wrapper(STAGE_03.TransformerBlock(CONFIG)).cuda()
    block.compile()  # as 03's shard_model does, without the sharding
    inputs = torch.randn(2, CONFIG["context_length"], CONFIG["emb_dim"]).cuda()  # drawn as on the CPU that measured
    weights_of_output = torch.randn(inputs.shape).cuda()
    error, control = gradient_check.relative_errors(lambda: (block(inputs) * weights_of_output).sum(),
                                                    list(block.parameters()), eps=0.1)
    check_the_gradient(report, f"03's checkpointed block, dropout {CONFIG['drop_rate']}", error, control)


@pytest.mark.parametrize("memory_budget", [None, MEMORY_BUDGET], ids=["01", "01-memory-budget"])
def test_01s_training_graph_differentiates_the_dropout_its_forward_drew(memory_budget, report, float32_matmuls,
                                                                         monkeypatch):
    # budget: ~30 s each: 01's graph at GPT-2 small's width and context with two layers, compiled once
    if memory_budget is not None:
        monkeypatch.setattr(functorch_config, "activation_memory_budget", memory_budget)
    cfg = {**STAGE_01.GPT_CONFIG_124M, "n_layers": 2}
    torch.manual_seed(0)
    model = STAGE_01.GPTModel(cfg).cuda()
    tokens = torch.randint(0, STAGE_01.REAL_VOCAB_SIZE, (2, cfg["context_length"] + 1)).cuda()
    error, control = gradient_check.relative_errors(
        lambda: STAGE_01.training_loss(model, tokens[:, :-1], tokens[:, 1:]), list(model.parameters()), eps=3.0)
    setting = "" if memory_budget is None else f" with activation_memory_budget {memory_budget}"
    check_the_gradient(report, f"01's training graph (2 layers of GPT-2 small){setting}", error, control)


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
