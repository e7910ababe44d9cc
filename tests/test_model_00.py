"""Stage 00's building blocks, imported as a module: the dataset, the layers, the model, decoding, the loss."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


def shards(ids, folder, pieces=3):
    """Token ids as the stages read them: memory-mapped uint16 shards, `pieces` of them end to end (so that windows
    cross from one shard into the next)."""
    import numpy as np

    from data.shards import TokenShards

    ids = list(ids)
    bounds = [len(ids) * k // pieces for k in range(pieces + 1)]
    paths, counts = [], []
    for k in range(pieces):
        path = folder / f"shard-{k}.bin"
        np.asarray(ids[bounds[k]:bounds[k + 1]], dtype="<u2").tofile(path)
        paths.append(path)
        counts.append(bounds[k + 1] - bounds[k])
    keep = [k for k in range(pieces) if counts[k]]
    return TokenShards([paths[k] for k in keep], [counts[k] for k in keep])


@pytest.fixture(scope="module")
def tiny_model(stage00):
    torch.manual_seed(0)
    model = stage00.GPTModel(stage00.TINY_CONFIG)
    model.eval()
    return model


# ---------------------------------------------------------------------------------------------
# SlidingWindowDataset
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, length, stride", [
    (100, 8, 8), (100, 8, 3), (100, 8, 1), (65, 64, 64), (9, 8, 8), (9, 8, 1),  # n = L + 1: one window
    (8, 8, 8), (8, 8, 1), (3, 8, 8), (0, 8, 8),                                   # n <= L: none
    (17, 8, 8), (16, 8, 8), (1000, 64, 64), (1000, 64, 100),
])
def test_sliding_windows(stage00, n, length, stride, tmp_path):
    ids = [(7 * i + 3) % 50257 for i in range(n)]  # distinct, so a shifted window cannot look right by luck
    dataset = stage00.SlidingWindowDataset(shards(ids, tmp_path), length, stride)

    expected_starts = list(range(0, n - length, stride))
    assert len(dataset) == len(expected_starts)
    for index, start in enumerate(expected_starts):
        inputs, targets = dataset[index]
        assert inputs.dtype == torch.long and targets.dtype == torch.long
        assert inputs.shape == (length,) and targets.shape == (length,)
        assert inputs.tolist() == ids[start:start + length]
        assert targets.tolist() == ids[start + 1:start + length + 1]
        assert torch.equal(inputs[1:], targets[:-1])  # the target is the input shifted by one


def test_sliding_windows_batch_through_the_dataloader(stage00, tmp_path):
    # 41 tokens, windows of 8: starts 0, 8, 16, 24, 32
    dataset = stage00.SlidingWindowDataset(shards(range(1, 42), tmp_path), 8, 8)
    loader = stage00.create_dataloader(dataset, batch_size=2, shuffle=False, drop_last=True)
    batches = list(loader)
    assert len(batches) == 2  # 5 windows, drop_last
    inputs, targets = batches[0]
    assert inputs.shape == targets.shape == (2, 8)
    assert inputs[1, 0].item() == 9 and targets[1, -1].item() == 17


def test_shuffle_is_reproducible(stage00, tmp_path):
    dataset = stage00.SlidingWindowDataset(shards(range(200), tmp_path), 4, 4)

    def order(seed):
        loader = stage00.create_dataloader(dataset, batch_size=1, shuffle=True, drop_last=True, seed=seed)
        return [inputs[0, 0].item() for inputs, _ in loader]

    assert order(5) == order(5)
    assert order(5) != order(6)
    assert sorted(order(5)) == list(range(0, 196, 4))


# ---------------------------------------------------------------------------------------------
# LayerNorm and GELU against PyTorch's own
# ---------------------------------------------------------------------------------------------

def test_layernorm_matches_torch(stage00):
    generator = torch.Generator().manual_seed(1)
    emb = 48
    ours = stage00.LayerNorm(emb).double()
    reference = nn.LayerNorm(emb, eps=1e-5, dtype=torch.float64)
    with torch.no_grad():
        ours.scale.copy_(torch.randn(emb, generator=generator, dtype=torch.float64))
        ours.shift.copy_(torch.randn(emb, generator=generator, dtype=torch.float64))
        reference.weight.copy_(ours.scale)
        reference.bias.copy_(ours.shift)
    x = torch.randn(3, 5, emb, generator=generator, dtype=torch.float64) * 4 + 2
    torch.testing.assert_close(ours(x), reference(x), rtol=0, atol=1e-12)
    # the eps matters where the variance is tiny: a constant row normalizes to the shift
    flat = torch.full((1, emb), 3.0, dtype=torch.float64)
    torch.testing.assert_close(ours(flat), reference(flat), rtol=0, atol=1e-12)


def test_layernorm_defaults_are_identity_scale_and_zero_shift(stage00):
    norm = stage00.LayerNorm(16)
    x = torch.randn(4, 16, dtype=torch.float64)
    out = norm.double()(x)
    torch.testing.assert_close(out.mean(-1), torch.zeros(4, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.var(-1, unbiased=False), x.var(-1, unbiased=False) / (x.var(-1, unbiased=False) + 1e-5),
                               rtol=0, atol=1e-12)


def test_gelu_matches_torch_tanh_approximation(stage00):
    x = torch.cat([torch.linspace(-10, 10, 2001, dtype=torch.float64),
                   torch.randn(1000, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 3])
    torch.testing.assert_close(stage00.GELU()(x), F.gelu(x, approximate="tanh"), rtol=0, atol=1e-12)
    # and it is the tanh approximation, not the exact erf form (they differ by up to ~5e-4)
    assert (stage00.GELU()(x) - F.gelu(x)).abs().max() > 1e-5


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------

def test_parameter_count_of_gpt2_small(stage00):
    with torch.device("meta"):
        model = stage00.GPTModel(stage00.GPT_CONFIG_124M)
    assert sum(p.numel() for p in model.parameters()) == 163_009_536
    # untied output head: minus the output head it is the book's 124M
    assert sum(p.numel() for p in model.parameters()) - model.out_head.weight.numel() == 124_412_160


def test_output_shape(stage00, tiny_model):
    idx = torch.randint(0, 50257, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = tiny_model(idx)
    assert logits.shape == (2, 10, stage00.TINY_CONFIG["vocab_size"])
    assert torch.isfinite(logits).all()


def test_eval_mode_is_deterministic_and_train_mode_drops_out(tiny_model):
    idx = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(tiny_model(idx), tiny_model(idx))
        tiny_model.train()
        try:
            torch.manual_seed(0)
            first = tiny_model(idx)
            second = tiny_model(idx)
        finally:
            tiny_model.eval()
    assert not torch.equal(first, second), "dropout (0.1) should make train-mode outputs differ"


@pytest.mark.parametrize("k", [0, 1, 7, 15])
def test_attention_is_causal(tiny_model, k):
    generator = torch.Generator().manual_seed(10 + k)
    idx = torch.randint(0, 50257, (2, 16), generator=generator)
    changed = idx.clone()
    changed[:, k] = (idx[:, k] + 12345) % 50257
    with torch.no_grad():
        before, after = tiny_model(idx), tiny_model(changed)
    torch.testing.assert_close(after[:, :k], before[:, :k], rtol=0, atol=1e-6)
    assert (after[:, k] - before[:, k]).abs().max() > 1e-3, "the changed position itself must change"
    if k + 1 < idx.shape[1]:
        assert (after[:, k + 1:] - before[:, k + 1:]).abs().amax(dim=-1).min() > 1e-6, \
            "every later position attends to the changed token"


def test_full_context_length_works_and_longer_fails(stage00, tiny_model):
    context = stage00.TINY_CONFIG["context_length"]
    with torch.no_grad():
        assert tiny_model(torch.zeros(1, context, dtype=torch.long)).shape[1] == context
        with pytest.raises((IndexError, RuntimeError)):
            tiny_model(torch.zeros(1, context + 1, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# Greedy generation
# ---------------------------------------------------------------------------------------------

class ShapeSpy(nn.Module):
    """Wraps the model and records the length of every input it is given."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.lengths = []

    def forward(self, idx):
        self.lengths.append(idx.shape[1])
        return self.model(idx)


def _check_greedy(model, prompt, out, context_size):
    with torch.no_grad():
        for position in range(prompt.shape[1], out.shape[1]):
            prefix = out[:, :position][:, -context_size:]
            expected = model(prefix)[:, -1, :].argmax(dim=-1)
            assert torch.equal(out[:, position], expected), f"token {position} is not the argmax"


def test_generate_is_greedy_and_deterministic(stage00, tiny_model):
    prompt = torch.tensor([[6109, 3626, 6100, 345], [464, 2068, 7586, 21831]])
    out1 = stage00.generate_text_simple(tiny_model, prompt, max_new_tokens=8, context_size=64)
    out2 = stage00.generate_text_simple(tiny_model, prompt, max_new_tokens=8, context_size=64)
    assert out1.shape == (2, 4 + 8)
    assert torch.equal(out1, out2)
    assert torch.equal(out1[:, :4], prompt)
    _check_greedy(tiny_model, prompt, out1, 64)


def test_generate_zero_new_tokens_returns_the_prompt(stage00, tiny_model):
    prompt = torch.tensor([[1, 2, 3]])
    assert torch.equal(stage00.generate_text_simple(tiny_model, prompt, max_new_tokens=0, context_size=64), prompt)


@pytest.mark.parametrize("prompt_length, context_size", [(70, 64), (20, 8)])
def test_generate_crops_the_context(stage00, tiny_model, prompt_length, context_size):
    prompt = torch.randint(0, 50257, (1, prompt_length), generator=torch.Generator().manual_seed(5))
    spy = ShapeSpy(tiny_model)
    out = stage00.generate_text_simple(spy, prompt, max_new_tokens=5, context_size=context_size)
    assert out.shape == (1, prompt_length + 5)
    assert spy.lengths == [context_size] * 5, "the model must only see the last context_size tokens"
    _check_greedy(tiny_model, prompt, out, context_size)


# ---------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------

def _batches(count, batch_size=2, length=12, seed=6):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 50257, (batch_size, length), generator=generator),
             torch.randint(0, 50257, (batch_size, length), generator=generator)) for _ in range(count)]


def test_calc_loss_batch_is_cross_entropy(stage00, tiny_model):
    inputs, targets = _batches(1)[0]
    with torch.no_grad():
        loss = stage00.calc_loss_batch(inputs, targets, tiny_model, torch.device("cpu"))
        logits = tiny_model(inputs)
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    torch.testing.assert_close(loss, expected)
    assert abs(loss.item() - math.log(50257)) < 1.0  # an untrained model is close to uniform


def test_calc_loss_loader_empty_is_nan(stage00, tiny_model):
    device = torch.device("cpu")
    empty = torch.utils.data.DataLoader([], batch_size=2)
    assert math.isnan(stage00.calc_loss_loader(empty, tiny_model, device))
    assert math.isnan(stage00.calc_loss_loader(empty, tiny_model, device, num_batches=3))
    assert math.isnan(stage00.calc_loss_loader(_batches(2), tiny_model, device, num_batches=0))


def test_calc_loss_loader_is_the_mean_of_batch_losses(stage00, tiny_model):
    device = torch.device("cpu")
    batches = _batches(4)
    with torch.no_grad():
        losses = [stage00.calc_loss_batch(x, y, tiny_model, device).item() for x, y in batches]
        assert len(set(losses)) == 4  # distinct, so a wrong mean cannot agree by chance
        everything = stage00.calc_loss_loader(batches, tiny_model, device)
        first_two = stage00.calc_loss_loader(batches, tiny_model, device, num_batches=2)
        more_than_there_are = stage00.calc_loss_loader(batches, tiny_model, device, num_batches=10)
    assert everything == pytest.approx(sum(losses) / 4, rel=1e-6)
    assert first_two == pytest.approx(sum(losses[:2]) / 2, rel=1e-6)
    assert more_than_there_are == pytest.approx(sum(losses) / 4, rel=1e-6)


def test_evaluate_model_restores_train_mode(stage00, tiny_model):
    device = torch.device("cpu")
    tiny_model.train()
    try:
        train_loss, val_loss = stage00.evaluate_model(tiny_model, _batches(2), _batches(2, seed=7), device, 2)
        assert tiny_model.training
    finally:
        tiny_model.eval()
    expected = stage00.calc_loss_loader(_batches(2), tiny_model, device)
    assert train_loss == pytest.approx(expected, rel=1e-6), "evaluation must run in eval mode (no dropout)"
    assert val_loss != train_loss
