"""--model: the book's four GPT-2 sizes, their parameter counts and their FLOPs per token."""

import pytest
import torch

import cli
import gpu_memory
import utilization
from conftest import load_stage, run_script

# The untied head's counts at vocabulary 50,257 (the book's counts with a tied head: 124M, 355M, 774M, 1558M)
PARAMETERS = {"gpt2-small": 163_009_536, "gpt2-medium": 406_212_608, "gpt2-large": 838_220_800,
              "gpt2-xl": 1_637_792_000}


@pytest.fixture(scope="module")
def stage00():
    return load_stage("00_orig.py")


@pytest.mark.parametrize("name", PARAMETERS)
def test_each_size_has_the_books_parameters_and_the_formulas_flops(stage00, name):
    args = type("Args", (), {"tiny": False, "model": name, "resume": None})()
    cfg = cli.model_config(args, stage00.GPT_CONFIG_124M, stage00.TINY_CONFIG)
    with torch.device("meta"):  # no memory: the XL model's 1.6 B parameters cost nothing here
        model = stage00.GPTModel(cfg)
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS[name]
    formula = utilization.flops_per_token(cfg, cfg["vocab_size"])
    counted = utilization.counted_flops_per_token(lambda: stage00.GPTModel(cfg), cfg["context_length"])
    assert counted == pytest.approx(formula, rel=1e-3), name


@pytest.mark.parametrize("name, states_gb", [("gpt2-small", "2.4"), ("gpt2-medium", "6.1"),
                                              ("gpt2-large", "12.5"), ("gpt2-xl", "24.4")])
def test_the_headers_memory_estimate_gives_16_bytes_per_parameter(stage00, name, states_gb):
    cfg = {**stage00.GPT_CONFIG_124M, **cli.MODEL_SIZES[name]}
    line = gpu_memory.memory_line(PARAMETERS[name], cfg, 32, "bf16", flash_attention=True)
    assert f"AdamW state {states_gb} GiB (16 bytes per parameter)" in line, line  # GiB, as the allocator's figures
    # activations: about 34 x width bytes per token and layer in 16-bit (80 GiB for XL at 32 x 1,024), plus logits
    activations = float(line.split("activations ")[1].split(" GiB")[0])
    blocks = 34 * cfg["emb_dim"] * cfg["n_layers"] * 32 * 1024 / gpu_memory.GIB
    assert blocks < activations < blocks + 32 * 1024 * cfg["vocab_size"] * 4 / gpu_memory.GIB + 0.1, line


def test_an_unknown_size_is_refused_in_one_line():
    result = run_script("00_orig.py", "--model", "gpt2-nano", "--max-steps", "1")
    assert result.returncode == 2 and "invalid choice: 'gpt2-nano'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["gpt2-small", "gpt2-xl"])
def test_03s_per_rank_estimate_counts_the_activations_02s_header_counts(stage00, name):
    """Sharding divides the state, not the activations: 03's header (per rank) must give the same activations,
    logits included, as the header of 00 to 02 for the same batch; recomputing the blocks leaves the logits."""
    import sharding

    cfg = {**stage00.GPT_CONFIG_124M, **cli.MODEL_SIZES[name], "vocab_size": 50304}
    ddp = gpu_memory.memory_line(PARAMETERS[name], cfg, 32, "bf16", flash_attention=True)
    ranks = type("ShardMemory", (), {"world_size": 4, "num_params": PARAMETERS[name],
                                     "formula_bytes_per_rank": 4 * PARAMETERS[name]})()

    def activations_gib(checkpointing):
        line = sharding.ShardMemory.header_line(ranks, cfg, 32, checkpointing)
        return float(line.split("activations and logits ~ ")[1].split(" GiB")[0])

    assert activations_gib(False) == pytest.approx(float(ddp.split("activations ")[1].split(" GiB")[0]), abs=0.06)
    logits = 32 * 1024 * 4 * cfg["vocab_size"] / gpu_memory.GIB
    assert logits < activations_gib(True) < logits + 0.2 * activations_gib(False)
