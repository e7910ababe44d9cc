"""cost_model/memory_model.py: what the compiled step saves for its backward, counted by PyTorch's own partitioner.

The step is traced at the full width with two layers, a shorter context and a small vocabulary, at batch 32 (fake
tensors cost no memory: the time goes into the graph, about a second per layer), once with PyTorch's default budget
and once with the ladder's --option memory-budget. The budget only acts where the activations outweigh the
parameters, as at full size (the partitioner measures it between the two), so the batch stays large and the
vocabulary small, which keeps the blocks' share of the memory near the full-size model's.
"""

import dataclasses
import re
from unittest import mock

import pytest
import torch
from conftest import aten_dtypes

import devices
from bench import rungs
from cost_model import memory_model, step_model

LAYERS, CONTEXT, BATCH, VOCAB = 2, 256, 32, 2048
SMALL = {"n_layers": LAYERS, "context_length": CONTEXT, "vocab_size": VOCAB}


@pytest.fixture(scope="module")
def default_budget():
    return memory_model.trace_step(10, batch_size=BATCH, tiny_config=SMALL)


@pytest.fixture(scope="module")
def option_budget():
    return memory_model.trace_step(10, batch_size=BATCH, budget=rungs.MEMORY_BUDGET, tiny_config=SMALL)


def saved_like(memory, dtype, shape):
    return [item for item in memory.saved if item.dtype == dtype and item.shape == shape and item.nbytes]


def test_the_step_saves_bf16_logits_once_and_no_tokens_by_tokens_matrix(default_budget):
    memory = default_budget
    tokens, vocab, width = BATCH * CONTEXT, VOCAB, 768
    logits = saved_like(memory, torch.bfloat16, (tokens, vocab))
    assert [(item.module, item.made_by) for item in logits] == [("out_head", "mm")]
    assert memory.logits_bytes == tokens * vocab * 2
    assert not [item for item in memory.saved if item.dtype == torch.float32 and item.shape[-1:] == (vocab,)
                and item.shape[0] in (tokens, BATCH)]  # no float32 logits kept (SPEC: never a float32 copy)
    assert not [item for item in memory.saved if item.shape[-2:] == (CONTEXT, CONTEXT)]  # FlashAttention's backward
    log_sum_exp = saved_like(memory, torch.float32, (BATCH, 12, CONTEXT))  # needs one float per row, no scores
    assert len(log_sum_exp) == LAYERS and all(item.made_by.endswith("attention[1]") for item in log_sum_exp)
    # the float32 weights stay where they are (graph inputs are not saved again); their bf16 copies may be
    assert not [item for item in memory.saved if item.dtype == torch.float32 and item.shape == (vocab, width)]
    masks = saved_like(memory, torch.bool, (BATCH, CONTEXT, width))
    assert len(masks) == 2 * LAYERS + 1  # two dropouts per block and one after the embeddings, one byte each


def test_views_of_one_tensor_count_once(default_budget):
    """Q, K and V are views of the qkv matmul's output: three saved tensors, one block of memory each layer."""
    qkv = [item for item in default_budget.saved if item.module == "trf_blocks.*.att" and item.made_by == "mm"]
    assert len(qkv) == 3 * LAYERS
    assert sum(item.nbytes for item in qkv) == LAYERS * BATCH * CONTEXT * 3 * 768 * 2


def test_the_peak_model_adds_states_and_saved_and_the_logits_gradient_only_without_donation(default_budget):
    memory = default_budget
    assert memory.num_params == 2 * VOCAB * 768 + CONTEXT * 768 + 768 * 2 + LAYERS * 7_085_568
    assert memory.donated  # PyTorch's default, under which the next test reads the generated code
    assert memory.peak_bytes == 12 * memory.num_params + sum(item.nbytes for item in memory.saved)
    text = memory_model.report(memory)
    assert f"Saved in all: {memory.saved_bytes / 2**30:.2f} GiB" in text
    assert "the logits, for the loss's backward" in text and "activation_memory_budget 1 (PyTorch's default)" in text
    assert "(written over the saved logits: donated_buffer)" in text
    not_donated = dataclasses.replace(memory, donated=False)
    assert not_donated.peak_bytes == memory.peak_bytes + memory.logits_bytes


def test_the_backward_writes_the_logits_gradient_over_the_saved_logits():
    """What the peak model assumes, read in the code Inductor generates for 01's compiled step (tiny model, CPU):
    the backward takes the saved logits' buffer for their gradient (AOTAutograd's donated buffers) instead of
    allocating one more tensor of that size. The step is 01's --tiny training step at its own batch and at the
    precision 01 takes on this CPU, so its kernels are those the suite's compiled runs of 01 build: the compile
    cache shares them (a cold compile of its own cost this test 20-30 s of CPU)."""
    from torch._inductor.utils import run_and_get_code

    stage = rungs.load_stage(rungs.STAGE_01)
    cfg = stage.TINY_CONFIG  # its vocabulary (50,304) is a dimension no other shares
    model = stage.GPTModel(cfg)
    tokens = torch.randint(0, 50257, (stage.TINY_SETTINGS["batch_size"], cfg["context_length"]))
    dtype = devices.autocast_dtype(torch.device("cpu"))  # bf16 where the CPU computes in it, else float32
    torch._dynamo.reset()
    step = torch.compile(stage.training_loss.__wrapped__)  # 01's function, without its own compiled wrapper

    def training_step():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = step(model, tokens, tokens)
        loss.backward()

    _, (forward, backward) = run_and_get_code(training_step)
    torch._dynamo.reset()
    rows = stage.TINY_SETTINGS["batch_size"] * cfg["context_length"]
    logits = re.findall(rf"(\w+) = rand_strided\(\({rows}, {cfg['vocab_size']}\)", backward)
    assert logits, "the backward received no saved logits"
    assert any(re.search(rf"= {name}; del {name}  # reuse", backward) for name in logits), logits


def test_the_ladders_memory_budget_saves_a_third_less_without_recomputing_a_matmul(default_budget, option_budget):
    assert option_budget.saved_bytes < 0.75 * default_budget.saved_bytes, (option_budget.saved_bytes,
                                                                           default_budget.saved_bytes)
    assert option_budget.backward_matmuls == default_budget.backward_matmuls
    kept = saved_like(option_budget, torch.bfloat16, (BATCH * CONTEXT, VOCAB))
    assert len(kept) == 1  # the logits are still saved: recomputing them is the largest matmul of the step
    # what it stops saving, to recompute it: the norms' float32 normalized inputs and GELU's output

    def normalized(memory):
        return [item for item in saved_like(memory, torch.float32, (BATCH, CONTEXT, 768)) if "norm" in item.module]

    def gelu_output(memory):
        return [item for item in memory.saved if item.module.endswith("ff.layers.2") and item.shape[-1] == 4 * 768]

    assert len(normalized(default_budget)) >= 2 * LAYERS and len(gelu_output(default_budget)) == LAYERS
    assert not normalized(option_budget) and not gelu_output(option_budget)


def test_the_chunked_loss_keeps_no_logits_and_moves_the_heads_backward_into_the_forward(default_budget):
    """--option chunked-loss: nothing of tokens x vocabulary is saved; the forward keeps the head's two gradients
    instead, and the backward graph loses the head's two matmuls (the forward runs them: no FLOP is added)."""
    chunk, tokens = 1024, BATCH * CONTEXT  # 8 chunks; not the vocabulary, so no shape stands for two things
    memory = memory_model.trace_step(10, batch_size=BATCH, tiny_config=SMALL, chunk_tokens=chunk)
    assert not [item for item in memory.saved if VOCAB in item.shape and tokens in item.shape]
    assert memory.backward_matmuls == default_budget.backward_matmuls - 2
    weight_gradient = [item for item in memory.saved if item.shape == (VOCAB, 768) and item.nbytes]
    # the sum of the chunks' parts as addmm left it, in bf16: the backward's float32 / tokens is recomputed from it
    assert [(item.dtype, item.made_by) for item in weight_gradient] == [(torch.bfloat16, "addmm")]
    assert sum(item.nbytes for item in memory.saved if item.made_by == "mm" and item.module == "-") == tokens * 768 * 2
    assert memory.head_bytes == chunk * VOCAB * 2  # the last chunk's logits, then their gradient in the same buffer
    assert memory.peak_bytes == memory.states_bytes + memory.saved_bytes + memory.head_bytes
    # the saved logits are gone; the head's two gradients and a chunk's logits take a part of their place
    assert memory.peak_bytes < default_budget.peak_bytes - default_budget.logits_bytes // 2
    text = memory_model.report(memory)
    assert "head and loss in chunks of 1,024 tokens" in text and "a chunk's logits, then their gradient" in text
    assert "the head weight's gradient, made in the forward (chunked loss), in bf16" in text


def test_cpu_autocast_gives_the_dtypes_cuda_autocast_gives_for_rung_10():
    """The script traces under CPU autocast; CUDA's must pick the same dtype for every op of 01's model (SDPA and
    dropout as CUDA runs them on both sides)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def forward(device):
        rung = rungs.compose_for_gpu(10, torch.device(device), True, "bf16")
        ids = torch.zeros(2, 64, dtype=torch.long, device=device)
        recorder = aten_dtypes()
        with recorder, torch.autocast(device, dtype=torch.bfloat16), step_model.gpu_functions(None):
            rung.loss(ids, ids)
        return recorder.ops

    with FakeTensorMode(), mock.patch("torch.cuda.amp.common.amp_definitely_not_available", return_value=False), \
            mock.patch("torch.cuda.is_bf16_supported", return_value=True):
        on_cuda, on_cpu = forward("cuda"), forward("cpu")
    assert on_cpu == on_cuda
    assert ("aten::mm", [torch.bfloat16]) in on_cpu and ("aten::_log_softmax", [torch.float32]) in on_cpu


@pytest.mark.parametrize("flags, message", [
    (["--budget", "1.5"], "--budget must lie between 0 and 1"),
    (["--rung", "7"], "invalid choice: 7"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
])
def test_the_command_line_refuses_what_it_cannot_model(flags, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        memory_model.main(flags)
    assert stopped.value.code == 2 and message in capsys.readouterr().err
