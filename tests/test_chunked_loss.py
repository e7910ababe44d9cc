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


def live_head_sized_buffers(code, shape):
    """The most buffers of `shape` that Inductor's generated wrapper `code` holds at once: it allocates with
    `bufN = empty_strided_cpu((...), ...)` (`empty_strided_cuda` on a GPU), hands a dead buffer's memory on with
    `bufM = bufN; del bufN  # reuse` (or through reinterpret_tensor) and frees with `del bufN`. A buffer is counted
    by the shape it was made with. (tests/gpu reads the GPU's code with it too.)"""
    made = re.compile(r"(buf\d+) = empty_strided_(?:cpu|cuda)\(\(([\d, ]+)\)")
    reused = re.compile(r"(buf\d+) = (?:reinterpret_tensor\()?(buf\d+)\b.*# reuse")
    live, most = {}, 0  # name -> the shape its memory was made with
    for line in code.splitlines():
        if match := made.search(line):
            live[match[1]] = tuple(int(size) for size in match[2].replace(" ", "").split(",") if size)
        elif match := reused.search(line):
            live[match[1]] = live.pop(match[2], None)
        elif match := re.search(r"^\s*del (buf\d+)", line):
            live.pop(match[1], None)
        most = max(most, sum(1 for made_as in live.values() if made_as == shape))
    return most


def test_compiled_the_head_gradient_takes_no_more_memory_for_more_chunks(model_and_batch):
    """The forward adds each chunk's part of the head's weight gradient to the sum so far. Written as `sum += part`,
    Inductor fused all the additions into one kernel at the end and kept every chunk's part alive until then
    (measured on an H200: in chunks of 1,024 tokens the step's peak was 01's, not below it; here, in 8 chunks, 9
    buffers of the head's size at once). Summed with addmm, one part at a time, the compiled forward holds a few."""
    from torch._inductor.utils import run_and_get_code

    model, inputs, targets = model_and_batch

    def forward(model, inputs, targets):  # the forward graph holds the parts; its backward is not compiled here
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return chunked_loss.forward_and_loss(model, inputs, targets, chunk_tokens=32)  # 256 tokens: 8 chunks

    torch._dynamo.reset()
    _, codes = run_and_get_code(torch.compile(forward), model, inputs, targets)
    torch._dynamo.reset()
    held = max(live_head_sized_buffers(code, tuple(model.out_head.weight.shape)) for code in codes)
    assert held <= 3, held  # the weight cast to bf16, the sum so far, the new sum
    logits_held = max(live_head_sized_buffers(code, (32, model.out_head.weight.shape[0])) for code in codes)
    assert logits_held == 1, logits_held  # a chunk's logits, their gradient written over them (an H200 held 9)


def test_a_stage_copy_is_importable_by_name():
    """torch.compile 2.11 imports, by name, the module of a function it inlines from another module (the chunked
    loss calls the model's forward; checkpoint_wrapper calls a block's): the ladder's and the tests' copies of the
    stages must be in sys.modules."""
    module = rungs.load_stage(rungs.STAGE_01)
    assert sys.modules[module.__name__] is module
    assert rungs.load_stage(rungs.STAGE_01).__name__ != module.__name__  # still a fresh copy per call
    tests_copy = load_stage("03_opt_multi_gpu_fsdp.py")  # the tests' loader (tests/gpu compiles 03's blocks)
    assert sys.modules[tests_copy.__name__] is tests_copy
