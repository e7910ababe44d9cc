"""bench/ladder.py: each rung is built from the stage scripts as documented, and a --tiny ladder runs.

The composition tests build the tiny models in this process (cheap). One --tiny ladder of every rung,
with the fewest steps, runs once per session as a user would start it; one rung is made to fail on
purpose through the LADDER_FAIL_RUNG testing hook, to check that the others still run.
"""

import argparse
import json
import math

import pytest
import torch
import torch.nn as nn

from bench import ladder, rungs
from conftest import ROOT, run_script

CPU = torch.device("cpu")
FAILING_RUNG = 3  # made to fail on purpose in the end-to-end run


def first_block(model):
    return model.trf_blocks[0]


# ---------------------------------------------------------------------------------------------
# Composition (in-process, tiny models, no training)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def composed():
    """Rungs 0 to 10 with the tiny config, composed once for all the composition tests."""
    return {number: rungs.compose(number, CPU, tiny=True) for number in rungs.SINGLE_PROCESS_RUNGS}


def test_rung_0_is_stage_00(composed):
    model = composed[0].model
    attention = first_block(model).att
    assert type(model).__module__.startswith("ladder_00_orig")
    assert "mask" in dict(attention.named_buffers())
    assert type(first_block(model).norm1).__name__ == "LayerNorm" and not isinstance(first_block(model).norm1,
                                                                                      nn.LayerNorm)
    assert not composed[0].optimizer.defaults["fused"]
    assert composed[0].precision == "fp32"


def test_rung_1_drops_the_mask_buffer_and_computes_the_same_function(composed):
    attention = first_block(composed[1].model).att
    assert "mask" not in dict(attention.named_buffers())
    assert type(attention).__name__ == "OnTheFlyMaskAttention"
    parent = type(attention).__mro__[1]  # a subclass of stage 00's own attention class
    assert parent.__name__ == "MultiHeadAttention" and parent.__module__.startswith("ladder_00_orig")
    # Same seed, same parameter order: identical weights, so the outputs must match exactly.
    model_0, model_1 = composed[0].model.eval(), composed[1].model.eval()
    tokens = torch.randint(0, 50257, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model_1(tokens), model_0(tokens), rtol=0, atol=0)
    model_0.train(), model_1.train()


def test_steps_3_and_4_pick_fused_adamw_and_01s_loader(composed):
    assert not composed[2].optimizer.defaults["fused"]
    assert composed[3].optimizer.defaults["fused"] is True
    assert composed[3].data_stage.__name__.startswith("ladder_00_orig")
    assert composed[4].data_stage.__name__.startswith("ladder_01_opt_single_gpu")
    from data import get_tokenizer, load_text
    loader = composed[4].make_train_loader(load_text("shakespeare")[:20_000], get_tokenizer(), seed=123)
    assert loader.num_workers == 0 and loader.pin_memory is False  # 01's loader: no workers; no pinning without CUDA


def test_batches_come_in_the_stage_scripts_order_across_epochs(composed):
    from data import get_tokenizer, load_text
    loader = composed[0].make_train_loader(load_text("shakespeare")[:20_000], get_tokenizer(), seed=7)
    expected = []
    for epoch in range(2):  # what the scripts' training loop does at the start of each epoch
        loader.sampler.generator.manual_seed(7 + epoch)
        expected += [inputs for inputs, _ in loader]
    batches = rungs.endless_batches(loader, seed=7)
    for want in expected:
        torch.testing.assert_close(next(batches)[0], want, rtol=0, atol=0)


def logits_dtype_in_a_training_step(rung):
    """The dtype of the logits inside the rung's own loss path (01's calc_loss_batch from rung 4 on)."""
    seen = []
    hook = rung.model.out_head.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    try:
        tokens = torch.randint(0, 50257, (1, 9))
        loss = rung.data_stage.calc_loss_batch(tokens[:, :-1], tokens[:, 1:], rung.model, CPU)
    finally:
        hook.remove()
    assert loss.dtype == torch.float32  # the loss itself stays float32 on every rung
    return seen[0]


def test_rung_5_is_bf16_autocast_around_stage_00s_layers(composed):
    block = first_block(composed[5].model)
    assert type(block.norm1).__module__.startswith("ladder_00_orig")  # still the hand-written LayerNorm
    assert type(block.ff.layers[1]).__module__.startswith("ladder_00_orig")  # and GELU
    assert composed[5].precision == "bf16"  # a CPU has bfloat16, so 01 (and rung 5) use it
    assert logits_dtype_in_a_training_step(composed[4]) == torch.float32
    assert logits_dtype_in_a_training_step(composed[5]) == torch.bfloat16
    assert next(composed[5].model.parameters()).dtype == torch.float32  # weights stay float32


def test_rung_6_has_pytorchs_layernorm_and_gelu(composed):
    block = first_block(composed[6].model)
    assert type(block.norm1) is nn.LayerNorm and type(composed[6].model.final_norm) is nn.LayerNorm
    assert type(block.ff.layers[1]) is nn.GELU and block.ff.layers[1].approximate == "tanh"
    assert hasattr(block.att, "W_query")  # attention is still rung 1's


def test_rung_7_has_01s_attention_with_fused_qkv(composed):
    attention = first_block(composed[7].model).att
    assert isinstance(attention.qkv, nn.Linear) and attention.qkv.out_features == 3 * composed[7].cfg["emb_dim"]
    assert not hasattr(attention, "W_query")
    assert type(attention).__module__.startswith("ladder_01_opt_single_gpu")


def test_rungs_8_to_10_compile_and_pad_the_vocabulary(composed):
    for number in (4, 7):  # 01's loss path, with its forward and loss left eager
        stage = composed[number].data_stage
        assert stage.training_loss is stage.evaluation_loss is stage.forward_and_loss
    for number in (8, 9, 10):  # 01's compiled training and evaluation functions, as they are
        stage = composed[number].data_stage
        assert stage.training_loss is not stage.forward_and_loss and hasattr(stage.training_loss, "__wrapped__")
        assert stage.evaluation_loss is not stage.training_loss
    assert composed[8].model.out_head.out_features == 50257
    assert composed[9].model.out_head.out_features == 50304
    assert composed[10].cfg == composed[9].cfg


def test_full_size_vocab_and_batch_come_from_the_stage_dicts():
    stage00, stage01 = rungs.load_stage(rungs.STAGE_00), rungs.load_stage(rungs.STAGE_01)
    vocab = {n: rungs.model_config(n, False, stage00, stage01)["vocab_size"] for n in (8, 9)}
    batch = {n: rungs.training_settings(n, False, stage00, stage01)["batch_size"] for n in (9, 10)}
    assert vocab == {8: 50257, 9: 50304}
    assert batch == {9: 8, 10: 32}


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------

def test_rung_selection_parsing():
    assert ladder.parse_rungs("0,8,10") == [0, 8, 10]
    assert ladder.parse_rungs("0-2, 10") == [0, 1, 2, 10]
    assert ladder.parse_rungs("all") == list(range(12))
    for wrong in ("12", "3-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            ladder.parse_rungs(wrong)


def test_script_schedule_drops_the_warm_up_intervals():
    # 30 steps in 5 windows after 10 warm-up steps: intervals of 6, the first measured one ends at step 18
    assert ladder.script_schedule(10, 30, 5) == (6, [18, 24, 30, 36, 42], 43)
    assert ladder.script_schedule(1, 2, 5) == (1, [1, 2], 3)  # step 0 alone is always the warm-up


def test_windows_leave_out_epoch_boundaries_in_scripts_and_composed_rungs():
    # 01 at batch 32 on Shakespeare: 42 steps per epoch; the interval 37..42 holds epoch 2's first step
    assert ladder.script_schedule(10, 30, 5, steps_per_epoch=42) == (6, [18, 24, 30, 36, 48], 49)
    # epochs shorter than a window (8 GPUs: 5 steps): nothing to avoid, every window crosses one
    assert ladder.script_schedule(10, 30, 5, steps_per_epoch=5) == (6, [18, 24, 30, 36, 42], 43)
    assert rungs.crosses_epoch(37, 42, 42) and not rungs.crosses_epoch(31, 36, 42)
    assert not rungs.crosses_epoch(0, 5, 6) and rungs.crosses_epoch(1, 6, 6)  # step 0 starts the run itself


def test_composed_rung_windows_skip_the_first_step_of_an_epoch(composed):
    class CountingRung:  # a stand-in rung that records which steps were timed
        number, device, batch_size, cfg = 0, CPU, 1, {"context_length": 1}

        def __init__(self):
            self.step, self.timed = 0, []

        def train_step(self, inputs, targets):
            self.step += 1
            return torch.tensor(1.0)

    pairs = [(torch.zeros(1), torch.zeros(1))] * 7  # 7 steps per epoch
    loader = torch.utils.data.DataLoader(pairs, batch_size=1, generator=torch.Generator())
    rung, timed_windows = CountingRung(), []
    original = rungs.WindowTimer.start

    def start(timer):
        timed_windows.append(rung.step)
        original(timer)

    rungs.WindowTimer.start = start
    try:
        result = rungs.measure(rung, loader, seed=0, warmup=2, steps=12, windows=4, say=lambda text: None)
    finally:
        rungs.WindowTimer.start = original
    # windows of 3 from step 2: 2-4; 5-7 would hold step 7 (epoch 2's first step): untimed steps up to 8-10;
    # 11-13; 14-16 would hold step 14: on to 15-17
    assert timed_windows == [2, 8, 11, 15] and not result["windows_cross_epochs"]


def test_window_sizes_cover_every_step():
    assert rungs.window_sizes(30, 5) == [6] * 5
    assert rungs.window_sizes(7, 3) == [3, 2, 2]
    assert rungs.window_sizes(2, 5) == [1, 1]


def synthetic_gpu_report():
    """A report as a GPU run would make it (memory figures, a failed rung), without a GPU."""
    rows = []
    for number, speed, reserved, error in ((0, 12_000.0, 26.0, None), (1, 12_100.0, 25.9, None),
                                           (2, None, None, "out of memory: OutOfMemoryError: CUDA out of memory"),
                                           (3, 27_000.0, 25.9, None)):
        row = {key: None for key in ladder.ROW_KEYS}
        row.update(rung=number, tokens_per_sec=speed, error=error, peak_reserved_gb=reserved)
        if speed:
            row.update(tokens_per_sec_min=speed * 0.99, tokens_per_sec_max=speed * 1.01, mfu=0.3, final_loss=9.5,
                       peak_allocated_gb=reserved / 2)
        rows.append(row)
    rows = [ladder.complete_row(row, 1.0, ROOT / "logs", ROOT) for row in rows]
    ladder.add_comparisons(rows)
    return {"device": "NVIDIA X (compute capability 9.0, CUDA 12.8)", "device_name": "NVIDIA X", "gpu_count": 1,
            "driver": "570.00", "cuda": "12.8", "torch": "2.9.0", "python": "3.12", "date": "2026-01-01 00:00 UTC",
            "git": "abc1234", "command": "python bench/ladder.py",
            "settings": {"tiny": False, "data": "shakespeare", "seed": 123, "warmup_steps": 10, "steps": 30,
                         "windows": 5, "device": "auto"},
            "reference_source": ladder.REFERENCE_SOURCE, "rungs": rows}


def test_comparisons_skip_a_failed_neighbour():
    rows = {row["rung"]: row for row in synthetic_gpu_report()["rungs"]}
    assert rows[1]["speedup_vs_previous"] == pytest.approx(12_100 / 12_000)
    assert rows[2]["speedup_vs_previous"] is None and rows[3]["speedup_vs_previous"] is None  # not across a gap
    assert rows[3]["speedup_vs_baseline"] == pytest.approx(27_000 / 12_000)


def test_gpu_report_renders(tmp_path):
    report = synthetic_gpu_report()
    markdown = ladder.render_markdown(report)
    assert "| 2 | TF32 tensor cores | — |" in markdown and "**failed:** out of memory" in markdown
    assert "25.90" in markdown and "570.00" in markdown and "original tutorial, 1x A100, PyTorch 2.6" in markdown
    ladder.plot_ladder(report, tmp_path / "ladder.png")
    assert (tmp_path / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_wrong_corpus_is_a_usage_error(tmp_path):
    done = run_script("bench/ladder.py", "--tiny", "--data", tmp_path / "missing.txt", "--out", tmp_path / "out")
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "missing.txt" in done.stderr
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# End to end: every rung, --tiny, the fewest steps
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_ladder(tmp_path_factory):
    from data import load_text

    folder = tmp_path_factory.mktemp("ladder")
    corpus = folder / "small.txt"
    corpus.write_text(load_text("shakespeare")[:60_000], encoding="utf-8")  # tokenizes in no time
    out = folder / "out"
    done = run_script("bench/ladder.py", "--tiny", "--warmup", "1", "--steps", "2", "--data", corpus,
                      "--out", out, env={"LADDER_FAIL_RUNG": str(FAILING_RUNG)}, timeout=900)
    report = json.loads((out / "ladder.json").read_text()) if (out / "ladder.json").exists() else None
    return done, out, report


def test_ladder_writes_the_three_files_and_the_logs(tiny_ladder):
    done, out, report = tiny_ladder
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for key in ("device", "torch", "date", "rungs"):
        assert key in report
    assert [row["rung"] for row in report["rungs"]] == list(range(12))
    for row in report["rungs"]:
        for key in ladder.ROW_KEYS:
            assert key in row, (row["rung"], key)
        assert (out / "logs" / f"rung-{row['rung']:02d}.log").exists()
    markdown = (out / "ladder.md").read_text()
    assert markdown.count("\n| ") == 14  # header, separator and one row per rung
    assert "original tutorial, 1x A100, PyTorch 2.6" in markdown and "PyTorch: " in markdown
    assert (out / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[12/12] rung 11" in done.stdout and "left" in done.stdout  # progress lines


def test_every_working_rung_is_measured(tiny_ladder):
    _, _, report = tiny_ladder
    for row in report["rungs"]:
        if row["rung"] == FAILING_RUNG:
            continue
        assert row["error"] is None, row
        assert 0 < row["tokens_per_sec_min"] <= row["tokens_per_sec"] <= row["tokens_per_sec_max"], row
        assert row["peak_reserved_gb"] is None and row["mfu"] is None  # CPU: no GPU memory, no known peak
    rows = {row["rung"]: row for row in report["rungs"]}
    assert math.isfinite(rows[0]["final_loss"]) and math.isfinite(rows[10]["final_loss"])
    assert rows[1]["final_loss"] == pytest.approx(rows[0]["final_loss"], abs=1e-5)  # step 1 changes no math
    assert rows[0]["speedup_vs_baseline"] == pytest.approx(1.0)
    assert rows[11]["world_size"] == 1  # one process on a CPU


def test_a_failing_rung_is_reported_on_its_row(tiny_ladder):
    done, _, report = tiny_ladder
    rows = {row["rung"]: row for row in report["rungs"]}
    failed = rows[FAILING_RUNG]
    assert "LADDER_FAIL_RUNG" in failed["error"] and failed["tokens_per_sec"] is None
    assert rows[FAILING_RUNG + 1]["speedup_vs_previous"] is None  # no comparison across the failure
    assert rows[FAILING_RUNG + 1]["tokens_per_sec"] > 0  # and the ladder went on
    assert f"rung {FAILING_RUNG} FAILED" in done.stdout
