"""bench/chunked_loss.py: the head and the loss in chunks give 01's loss and gradients, eager and compiled.

The ladder's --option chunked-loss swaps it for 01's forward_and_loss, so it must be the same math: the same loss,
the same gradient for every parameter (float32: to rounding; bf16: as close to float32 as 01 itself is), with rows
the loss skips (-100, 01's padding of a short evaluation batch) and a last chunk shorter than the others.
"""

import re
import sys
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from bench import chunked_loss, rungs
from conftest import load_stage

CHUNK = 100  # tokens per chunk: 4 x 64 tokens make two whole chunks and a short one of 56


@pytest.fixture(scope="module")
def stage01():
    return rungs.load_stage(rungs.STAGE_01)


@pytest.fixture(scope="module")
def model_and_batch(stage01):
    torch.manual_seed(0)
    cfg = {**stage01.TINY_CONFIG, "drop_rate": 0.0}  # no dropout: two forward passes see the same network
    model = stage01.GPTModel(cfg)
    inputs = torch.randint(0, stage01.REAL_VOCAB_SIZE, (4, cfg["context_length"]))
    targets = torch.randint(0, stage01.REAL_VOCAB_SIZE, (4, cfg["context_length"]))
    targets[3, 5:] = -100  # rows the loss skips
    return model, inputs, targets


def chunked(model, inputs, targets):
    return chunked_loss.forward_and_loss(model, inputs, targets, chunk_tokens=CHUNK)


def loss_and_gradients(model, inputs, targets, forward_and_loss, autocast_dtype=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        loss = forward_and_loss(model, inputs, targets)
    loss.backward()
    return loss.item(), {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


def relative_errors(gradients, reference):
    return {name: ((gradients[name] - reference[name]).norm() / reference[name].norm()).item() for name in reference}


def test_float32_loss_and_every_gradient_are_01s(stage01, model_and_batch):
    expected_loss, expected = loss_and_gradients(*model_and_batch, stage01.forward_and_loss)
    loss, gradients = loss_and_gradients(*model_and_batch, chunked)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    errors = relative_errors(gradients, expected)
    assert max(errors.values()) < 1e-5, max(errors.items(), key=lambda item: item[1])


def test_under_bf16_autocast_it_is_as_close_to_float32_as_01_is(stage01, model_and_batch):
    _, exact = loss_and_gradients(*model_and_batch, stage01.forward_and_loss)
    _, ours = loss_and_gradients(*model_and_batch, chunked, torch.bfloat16)
    _, theirs = loss_and_gradients(*model_and_batch, stage01.forward_and_loss, torch.bfloat16)
    ours, theirs = relative_errors(ours, exact), relative_errors(theirs, exact)
    assert max(ours.values()) < 1.5 * max(theirs.values()) + 1e-4, (max(ours.values()), max(theirs.values()))
    assert ours["out_head.weight"] < 1.5 * theirs["out_head.weight"] + 1e-4


def test_float16_gradients_do_not_underflow():
    """Before Ampere the head runs in float16: softmax / tokens (~1e-8 here) is below float16's smallest number,
    so the division by the number of tokens must come after the matmuls, not before."""
    torch.manual_seed(0)
    tokens, width, vocab = 8192, 32, 4096
    hidden = torch.randn(tokens, width, requires_grad=True)
    weight = (0.02 * torch.randn(vocab, width)).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))
    F.cross_entropy(hidden @ weight.t(), targets).backward()
    exact = weight.grad.clone()
    weight.grad = None
    with torch.autocast("cpu", dtype=torch.float16):
        loss = chunked_loss.LinearCrossEntropy.apply(hidden, weight, targets, 2048)
    loss.backward()
    assert ((weight.grad - exact).norm() / exact.norm()).item() < 0.01


def test_evaluation_takes_the_plain_path(stage01, model_and_batch):
    """Without gradients nothing is kept for a backward anyway, so no gradient is made in the forward either."""
    model, inputs, targets = model_and_batch
    with torch.no_grad():
        expected = stage01.forward_and_loss(model, inputs, targets).item()
        with mock.patch.object(chunked_loss.LinearCrossEntropy, "apply", side_effect=AssertionError("used")):
            assert chunked(model, inputs, targets).item() == pytest.approx(expected, rel=1e-6)


def test_compiled_in_one_graph_it_gives_the_eager_gradients_without_a_float32_chunk(model_and_batch):
    """The compiled rungs (8-10) compile it with the model: one graph (fullgraph refuses a break), the same math, and
    Inductor's kernels go from a chunk's bf16 logits to their bf16 gradient without a float32 chunk in between."""
    from torch._inductor.utils import run_and_get_code

    model, inputs, targets = model_and_batch
    eager_loss, eager = loss_and_gradients(*model_and_batch, chunked, torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(chunked, fullgraph=True)
    (loss, gradients), kernels = run_and_get_code(loss_and_gradients, *model_and_batch, compiled, torch.bfloat16)
    torch._dynamo.reset()
    assert loss == pytest.approx(eager_loss, rel=1e-3)
    assert max(relative_errors(gradients, eager).values()) < 0.02
    vocab = model.out_head.weight.shape[0]
    buffers = re.findall(rf"empty_strided_cpu\(\((\d+), {vocab}\), \(\d+, \d+\), torch\.(\w+)\)", "\n".join(kernels))
    assert buffers and all(dtype == "bfloat16" for _, dtype in buffers), buffers  # chunk x vocabulary: bf16 only


def test_a_stage_copy_is_importable_by_name():
    """torch.compile 2.11 imports, by name, the module of a function it inlines from another module (the chunked
    loss calls the model's forward; checkpoint_wrapper calls a block's): the ladder's and the tests' copies of the
    stages must be in sys.modules."""
    module = rungs.load_stage(rungs.STAGE_01)
    assert sys.modules[module.__name__] is module
    assert rungs.load_stage(rungs.STAGE_01).__name__ != module.__name__  # still a fresh copy per call
    tests_copy = load_stage("03_opt_multi_gpu_fsdp.py")  # the tests' loader (tests/gpu compiles 03's blocks)
    assert sys.modules[tests_copy.__name__] is tests_copy
