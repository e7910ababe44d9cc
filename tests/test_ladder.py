"""bench/ladder.py, bench/plan.py, bench/rows.py and bench/report.py: each rung is built from the stage scripts as
documented, a --tiny ladder runs in two parts whose row files make one table, and the report's table and chart hold.

The composition tests build the tiny models in this process (cheap), and the report's tests work on hand-made
rows. One --tiny ladder of six rungs (eager, autocast, compiled and 02 under torchrun), with the fewest steps, runs once per
module as a user would start it, in two parts into one folder; in the first, two rungs are made to fail on purpose
through the LADDER_FAIL_RUNG testing hook, to check that the others still run and that the second part's rung 11
replaces the failed row. The other rungs are composed in-process above; rung 12 runs in the same function as rung 11.
"""

import argparse
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn

import devices
import failures
from bench import ladder, plan, report, rows, rungs, runner
from conftest import ROOT, process_alive, run_script, wait_for
from support.sitecustomize import FAIL_RUNG, forced_precision

CPU = torch.device("cpu")
FAILING_RUNG = 3  # made to fail on purpose in the end-to-end run


def first_block(model):
    return model.trf_blocks[0]


# ---------------------------------------------------------------------------------------------
# Composition (in-process, tiny models, no training)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def composed():
    """Rungs 0 to 10 with the tiny config, composed once for all the composition tests, as on a CPU that computes
    in bf16 (the test hook), so that step 5's bf16 path is checked on every CPU."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(devices, "autocast_precision", forced_precision("bf16"))
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
    from data import load_corpus
    loader = composed[4].make_train_loader(load_corpus("shakespeare").train[0:4_500], seed=123)
    assert loader.num_workers == 0 and loader.pin_memory is False  # 01's loader: no workers; no pinning without CUDA


def test_batches_come_in_the_stage_scripts_order_across_epochs(composed):
    from data import load_corpus
    loader = composed[0].make_train_loader(load_corpus("shakespeare").train[0:4_500], seed=7)
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


def test_rung_5_is_bf16_autocast_around_stage_00s_layers(composed, bf16_cpu):  # the step decides at run time too
    block = first_block(composed[5].model)
    assert type(block.norm1).__module__.startswith("ladder_00_orig")  # still the hand-written LayerNorm
    assert type(block.ff.layers[1]).__module__.startswith("ladder_00_orig")  # and GELU
    assert composed[5].precision == "bf16"  # a CPU with bfloat16 arithmetic: 01 (and rung 5) use it
    assert logits_dtype_in_a_training_step(composed[4]) == torch.float32
    assert logits_dtype_in_a_training_step(composed[5]) == torch.bfloat16
    assert next(composed[5].model.parameters()).dtype == torch.float32  # weights stay float32


def test_rung_5_on_a_cpu_without_bf16_decides_as_01_does(monkeypatch):
    monkeypatch.setattr(devices, "cpu_bf16_unit", lambda: None)
    devices.autocast_precision.cache_clear()
    try:
        rung = rungs.compose(5, CPU, tiny=True)
        assert rung.precision == "fp32"
        assert "no effect here: this CPU has no bfloat16 arithmetic" in " ".join(rung.notes)
        assert logits_dtype_in_a_training_step(rung) == torch.float32
    finally:  # the choice is cached: the faked CPU's must not outlive the test
        devices.autocast_precision.cache_clear()


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
    medium = rungs.model_config(9, False, stage00, stage01, model="gpt2-medium")
    assert (medium["emb_dim"], medium["n_layers"], medium["n_heads"], medium["vocab_size"]) == (1024, 24, 16, 50304)
    assert rungs.model_config(9, True, stage00, stage01, model="gpt2-xl") == stage01.TINY_CONFIG  # --tiny wins
    assert rungs.training_settings(3, False, stage00, stage01, batch_size=4)["batch_size"] == 4


def test_batch_size_overrides_a_rung_and_its_row_says_so():
    rung = rungs.compose(10, CPU, tiny=True, batch_size=2)
    assert rung.batch_size == 2
    assert any("--batch-size 2 for every rung" in note for note in rung.notes)
    assert "batch 2 set by --batch-size (the stage's own: 4)" in rung.notes
    assert rungs.batch_size_note(4, 4) is None and rungs.batch_size_note(None, 32) is None


def test_stage_scripts_get_the_ladders_model_and_batch(tmp_path):
    args = argparse.Namespace(data="shakespeare", device="cpu", seed=1, model="gpt2-medium", tiny=False,
                              batch_size=8, warmup=1, steps=2, windows=2, option=["max-autotune"], context_length=2048)
    flags = list(map(str, runner.script_flags(args, tmp_path / "run", max_steps=4, window=1)))
    assert flags[flags.index("--model") + 1] == "gpt2-medium" and flags[flags.index("--batch-size") + 1] == "8"
    assert flags[flags.index("--out") + 1] == str(tmp_path / "run")
    tiny = list(map(str, runner.script_flags(argparse.Namespace(**{**vars(args), "tiny": True}), tmp_path, 4, 1)))
    assert "--tiny" in tiny and "--model" not in tiny  # the stages refuse --model beside --tiny
    worker = list(map(str, runner.worker_command(args, "--run-rung", 3)))
    assert worker[worker.index("--model") + 1] == "gpt2-medium" and worker[worker.index("--batch-size") + 1] == "8"
    assert worker[worker.index("--option") + 1] == "max-autotune"  # each rung's process switches it on itself
    assert worker[worker.index("--context-length") + 1] == "2048"
    assert "--context-length" not in flags  # the stage scripts keep their own context


def test_a_missing_stage_script_is_a_failed_row(tmp_path, monkeypatch):
    monkeypatch.setitem(rungs.MULTI_PROCESS_RUNGS, 12, "03_not_written_yet.py")
    args = argparse.Namespace(tiny=True, batch_size=None)
    row = runner.run_multi_process_rung(12, args, {"device_type": "cpu", "gpu_count": 0}, tmp_path, 60)
    assert row["rung"] == 12 and row["error"] == "03_not_written_yet.py does not exist (yet)"
    assert "does not exist" in (tmp_path / "rung-12.log").read_text()
    assert rungs.CHANGES[12] == "FSDP2 on every GPU: 03_opt_multi_gpu_fsdp.py" and 12 in report.SHORT_NAMES


def test_a_failed_scripts_row_quotes_its_error_not_torchruns_summary():
    torchrun_tail = ["Traceback (most recent call last):", "torch.OutOfMemoryError: CUDA out of memory.",
                     "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "=" * 60,
                     "  exitcode  : 1 (pid: 17337)", "=" * 60]
    quoted = runner.failure_from_output(1, torchrun_tail, 60)
    assert quoted == "exited with code 1: torch.OutOfMemoryError: CUDA out of memory."
    assert runner.failure_from_output(2, ["Data: ...", "error: no such file", "-" * 60], 60).endswith("no such file")
    assert runner.failure_from_output(None, [], 60) == "timed out after 60 s (--rung-timeout)"
    # a run the system killed (a full-size rung on a CPU outgrew its RAM): the signal named, not "code -9"
    killed = runner.failure_from_output(-9, ["... warming up (42 s since start)"], 60)
    assert killed.startswith("killed by SIGKILL (exit code -9") and "out-of-memory" in killed, killed
    assert runner.failure_from_output(-15, [], 60).startswith("killed by SIGTERM (exit code -15)")
    torchrun = runner.failure_from_output(1, ["traceback : Signal 9 (SIGKILL) received by PID 4311"], 60)
    assert torchrun.startswith("exited with code 1: traceback : Signal 9 (SIGKILL)") and "out-of-memory" in torchrun


def test_a_full_size_ladder_on_a_cpu_says_so_up_front():
    cpu = {"device_type": "cpu", "gpu_count": 0}
    note = runner.cpu_note(cpu, tiny=False)
    assert note.startswith("Note: full-size rungs") and "--tiny" in note and "RAM" in note
    assert runner.cpu_note(cpu, tiny=False, runs="stage runs").startswith("Note: full-size stage runs on a CPU")
    assert runner.cpu_note(cpu, tiny=True) is None
    assert runner.cpu_note({"device_type": "cuda", "gpu_count": 1}, tiny=False) is None


def test_a_rung_whose_windows_differ_twice_or_more_is_called_unsteady_in_its_table_row():
    assert report.unsteady({"tokens_per_sec_min": 450_000, "tokens_per_sec_max": 470_000}) == []
    (note,) = report.unsteady({"tokens_per_sec_min": 252, "tokens_per_sec_max": 6_582})
    assert note.startswith("unsteady: its windows differ 26.1x") and "measure it again" in note
    found = hand_made_rows({0: (300.0, 1.0), 1: (1_750.0, 1.0)})
    found["rung-00"].update(tokens_per_sec_min=204.0, tokens_per_sec_max=713.0)  # a busy machine's windows
    lines = report.render_markdown(report.collect(found)).splitlines()
    assert "unsteady: its windows differ 3.5x" in next(line for line in lines if line.startswith("| 0 |"))
    assert "unsteady" not in next(line for line in lines if line.startswith("| 1 |"))


def test_a_script_check_far_from_its_rung_says_one_of_them_is_off():
    steady = {"tokens_per_sec_min": 9_000, "tokens_per_sec_max": 9_500}
    assert report.check_notes({**steady, "script_over_rung": 1.05}) == []
    assert report.check_notes({**steady, "script_over_rung": None}) == []  # no rung to set it beside
    (note,) = report.check_notes({**steady, "script_over_rung": 10.53})
    assert note.startswith("the script and its rung differ by 953%") and "measure both again" in note
    assert "differ by 20%" in report.check_notes({**steady, "script_over_rung": 0.80})[0]


def test_a_script_run_keeps_no_checkpoint(tmp_path):
    for name in ("metrics.json", "loss.png", "model.pth", ".run.lock"):
        (tmp_path / name).write_text("x")
    (tmp_path / "model.pth.state").mkdir()  # a sharded training state beside the checkpoint
    (tmp_path / "model.pth.state" / "shard-0").write_text("x")
    runner.drop_checkpoints(tmp_path)
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["loss.png", "metrics.json"]


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------

def test_rung_selection_parsing():
    assert ladder.parse_rungs("0,8,10") == [0, 8, 10]
    assert ladder.parse_rungs("0-2, 10") == [0, 1, 2, 10]
    assert ladder.parse_rungs("all") == list(range(13))
    for wrong, says in (("13", "rungs go from 0 to 12"), ("3-1", "counts down: a range goes up (1-3)"),
                        ("x", "not a rung number or range")):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(says)):
            ladder.parse_rungs(wrong)
    assert report.rung_ranges([0, 1, 2, 5, 11, 12]) == "0–2, 5, 11–12"


def test_script_schedule_drops_the_warm_up_intervals():
    # 30 steps in 5 windows after 10 warm-up steps: intervals of 6, the first measured one ends at step 18
    assert runner.script_schedule(10, 30, 5) == (6, [18, 24, 30, 36, 42], 43)
    assert runner.script_schedule(1, 2, 5) == (1, [1, 2], 3)  # step 0 alone is always the warm-up


def test_windows_leave_out_epoch_boundaries_in_scripts_and_composed_rungs():
    # 01 at batch 32 on Shakespeare: 42 steps per epoch; the interval 37..42 holds epoch 2's first step
    assert runner.script_schedule(10, 30, 5, steps_per_epoch=42) == (6, [18, 24, 30, 36, 48], 49)
    # epochs shorter than a window (8 GPUs: 5 steps): nothing to avoid, every window crosses one
    assert runner.script_schedule(10, 30, 5, steps_per_epoch=5) == (6, [18, 24, 30, 36, 42], 43)
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


def hand_made_context(started_at="2026-01-01 00:00:00 UTC", **differences):
    """The context every row of one ladder command carries; `differences` changes its header or settings
    (torch="2.0", steps=5...)."""
    settings = {"tiny": False, "model": "gpt2-small", "batch_size": None, "context_length": None, "data": "shakespeare",
                "seed": 123, "warmup_steps": 10, "steps": 30, "windows": 5, "device": "cuda", "options": None}
    context = {"device": "NVIDIA X (compute capability 9.0, CUDA 12.8)", "device_name": "NVIDIA X", "gpu_count": 1,
               "driver": "570.00", "cuda": "12.8", "torch": "2.9.0", "python": "3.12", "settings": settings,
               "command": {"started_at": started_at, "command": "python bench/ladder.py", "git": "abc1234"}}
    for key, value in differences.items():
        (settings if key in settings else context)[key] = value
    return context


def hand_made_rows(speeds, started_at="2026-01-01 00:00:00 UTC", **differences):
    """Row files' contents, {name: row}, for {rung: (tok/s or None, peak reserved GiB or None)}, as one command on a
    GPU would write them."""
    found = {}
    for number, (speed, reserved) in speeds.items():
        row = {"rung": number, "tokens_per_sec": speed, "peak_reserved_gb": reserved, "batch_size": 8,
               "error": None if speed else "out of memory: OutOfMemoryError: CUDA out of memory"}
        if speed:
            row.update(tokens_per_sec_min=speed * 0.9, tokens_per_sec_max=speed * 1.05, mfu=0.3, final_loss=9.5,
                       peak_allocated_gb=reserved / 2)
        row = report.complete_row(row, 1.0, f"logs/rung-{number:02d}.log",
                                  hand_made_context(started_at, **differences))
        found[report.rung_row_name(number)] = {**row, "measured_at": started_at}
    return found


def write_rows(folder, found):
    for name, row in found.items():
        rows.write_row(folder, name, row)
    return folder


def synthetic_gpu_report():
    """A report as a GPU run would make it (memory figures, a failed rung), without a GPU."""
    return report.collect(hand_made_rows({0: (12_000.0, 26.0), 1: (12_100.0, 25.9), 2: (None, None),
                                          3: (27_000.0, 25.9)}))


def test_comparisons_skip_a_failed_neighbour():
    found = {row["rung"]: row for row in synthetic_gpu_report()["rungs"]}
    assert found[1]["speedup_vs_previous"] == pytest.approx(12_100 / 12_000)
    assert found[2]["speedup_vs_previous"] is None and found[3]["speedup_vs_previous"] is None  # not across a gap
    assert found[3]["speedup_vs_baseline"] == pytest.approx(27_000 / 12_000)


def test_gpu_report_renders(tmp_path):
    markdown = report.write_report(synthetic_gpu_report(), tmp_path)
    assert "| 2 | TF32 tensor cores | — |" in markdown and "**failed:** out of memory" in markdown
    assert "25.90" in markdown and "570.00" in markdown and "original tutorial, 1x A100, PyTorch 2.6" in markdown
    assert "| 2026-01-01 00:00 |" in markdown  # when each row was measured
    assert (tmp_path / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = json.loads((tmp_path / "ladder.json").read_text())
    assert written["rungs"][0]["measured_at"] == "2026-01-01 00:00:00 UTC"
    assert list(written["rungs"][0])[:len(report.ROW_KEYS)] == list(report.ROW_KEYS)  # the documented keys first
    assert "context" not in written["rungs"][0] and written["torch"] == "2.9.0"


def test_an_options_folder_sets_its_rungs_beside_the_same_rungs_measured_without_it(tmp_path):
    """--option measures into a folder of its own; its table names the same rungs from the folder beside it that
    was measured the same way without the option, and how far apart the two commands ran. A folder measured with
    another PyTorch or batch is no comparison."""
    write_rows(tmp_path / "plain", hand_made_rows({9: (90.0, 5.0), 10: (100.0, 16.0)}, "2026-01-01 08:00:00 UTC"))
    write_rows(tmp_path / "other-torch", hand_made_rows({10: (50.0, 1.0)}, "2026-01-01 09:00:00 UTC", torch="2.0.0"))
    write_rows(tmp_path / "batch64", hand_made_rows({10: (60.0, 1.0)}, "2026-01-01 09:00:00 UTC", batch_size=64))
    option = write_rows(tmp_path / "plain-cudnn-attention",
                        hand_made_rows({10: (103.0, 16.0)}, "2026-01-01 10:30:00 UTC", options="cudnn-attention"))
    markdown = report.write_report(report.collect(rows.read_rows(option, "ladder.json")), option, chart=False)
    assert f"from `{tmp_path / 'plain'}`" in markdown, markdown
    assert "| 10 | 103 | 100 | 1.030× | 16.00 / 16.00 | 2026-01-01 10:30 / 2026-01-01 08:00 |" in markdown, markdown
    assert "the two up to 2.5 h apart" in markdown
    assert json.loads((option / "ladder.json").read_text())["rungs"][0]["without_options"]["ratio"] == 1.03
    plain = report.write_report(report.collect(rows.read_rows(tmp_path / "plain", "ladder.json")), tmp_path / "plain",
                                 chart=False)
    assert "Against the same rungs without" not in plain  # a folder without options is the comparison, not compared


def test_the_table_is_the_rows_present_each_file_replaced_by_a_newer_one(tmp_path):
    """Two commands into one folder: the second's rows replace the first's for the rungs it measured again; the
    header is the newest row's; a command whose rows were all replaced leaves no trace; the speed-ups are taken
    across the commands."""
    write_rows(tmp_path, hand_made_rows({0: (100.0, 1.0), 1: (110.0, 1.0), 2: (120.0, 1.0)}, "2026-01-01 10:00:00 UTC"))
    write_rows(tmp_path, hand_made_rows({2: (150.0, 1.0), 3: (200.0, 1.0)}, "2026-01-02 10:00:00 UTC",
                                        driver="580.00"))
    table = report.collect(rows.read_rows(tmp_path, "ladder.json"))
    found = {row["rung"]: row for row in table["rungs"]}
    assert sorted(found) == [0, 1, 2, 3] and sorted(path.name for path in (tmp_path / "rows").iterdir()) == [
        "rung-00.json", "rung-01.json", "rung-02.json", "rung-03.json"]
    assert found[2]["tokens_per_sec"] == 150.0 and found[2]["measured_at"] == "2026-01-02 10:00:00 UTC"
    assert found[1]["measured_at"] == "2026-01-01 10:00:00 UTC"
    assert found[2]["speedup_vs_previous"] == pytest.approx(150 / 110) and found[2]["previous_rung"] == 1
    assert [(part["started_at"], part["rungs"]) for part in table["parts"]] == [
        ("2026-01-01 10:00:00 UTC", [0, 1]), ("2026-01-02 10:00:00 UTC", [2, 3])]
    assert table["driver"] == "580.00"  # the header is the newest row's
    write_rows(tmp_path, hand_made_rows({0: (90.0, 1.0), 1: (95.0, 1.0)}, "2026-01-03 10:00:00 UTC"))
    assert [part["started_at"] for part in report.collect(rows.read_rows(tmp_path, "ladder.json"))["parts"]] == [
        "2026-01-02 10:00:00 UTC", "2026-01-03 10:00:00 UTC"]
    (tmp_path / "rows" / "rung-04.json").write_text("{}")  # not a row: named, never silently left out
    with pytest.raises(report.UsageError, match="rung-04.json is not a row of this folder"):
        rows.read_rows(tmp_path, "ladder.json")


def test_a_command_measured_otherwise_is_refused():
    found = hand_made_rows({0: (100.0, 1.0)})
    assert rows.differences(found["rung-00"]["context"], hand_made_context(driver="580.00"), report.MATCHED) == []
    for change, named in ((dict(torch="2.11.0"), "PyTorch: 2.9.0 there, 2.11.0 here"),
                          (dict(device_name="NVIDIA Y"), "device: NVIDIA X there, NVIDIA Y here"),
                          (dict(steps=10), "--steps: 30 there, 10 here"), (dict(warmup_steps=2), "--warmup"),
                          (dict(batch_size=16), "--batch-size: the stages' own there, 16 here"),
                          (dict(model="gpt2-medium"), "--model: gpt2-small there, gpt2-medium here"),
                          (dict(tiny=True), "--tiny"), (dict(data="middlemarch"), "--data"), (dict(seed=1), "--seed"),
                          (dict(options="max-autotune"), "--option: none there, max-autotune here")):
        with pytest.raises(report.UsageError, match="holds rungs measured otherwise") as refused:
            rows.refuse_a_different_part(found, hand_made_context(**change), report.MATCHED, "out", "rungs")
        assert named in str(refused.value) and "\n" not in str(refused.value)


def test_the_ladder_refuses_a_command_measured_otherwise_and_writes_nothing(tmp_path, small_text):
    out = write_rows(tmp_path / "out", hand_made_rows({0: (100.0, 1.0)}, torch="1.0.0"))
    before = (out / "rows" / "rung-00.json").read_bytes()
    done = run_script("bench/ladder.py", "--tiny", "--rungs", "0", "--data", small_text, "--out", out)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1 and "PyTorch: 1.0.0 there" in done.stderr
    assert (out / "rows" / "rung-00.json").read_bytes() == before and sorted(path.name for path in out.iterdir()) == [
        "rows"]
    (out / "rows" / "rung-00.json").unlink()
    (out / "rows").rmdir()
    (out / "ladder.json").write_text("{}")  # a folder of an older version: refused, not overwritten
    done = run_script("bench/ladder.py", "--tiny", "--rungs", "0", "--data", small_text, "--out", out)
    assert done.returncode == 2 and "holds a ladder.json but no rows/" in done.stderr


def test_options_switch_on_what_they_name_and_nothing_else(monkeypatch):
    import torch._dynamo.config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    backends = torch.backends.cuda
    saved = (inductor_config.max_autotune, inductor_config.coordinate_descent_tuning, backends.flash_sdp_enabled(),
             backends.mem_efficient_sdp_enabled(), backends.math_sdp_enabled(), backends.cudnn_sdp_enabled())
    saved_budget, saved_graphs = functorch_config.activation_memory_budget, inductor_config.triton.cudagraphs
    saved_reuse = inductor_config.allow_buffer_reuse
    try:
        rungs.apply_options(["max-autotune", "no-dropout"])  # no-dropout: compose's (below), no setting
        assert inductor_config.max_autotune and inductor_config.coordinate_descent_tuning == saved[1]
        assert not inductor_config.triton.cudagraphs and inductor_config.allow_buffer_reuse
        rungs.apply_options(["cuda-graphs"])
        assert inductor_config.triton.cudagraphs
        rungs.apply_options(["nested-compile-region"])  # compose marks the block; the setting its gradients need
        assert not inductor_config.allow_buffer_reuse
        rungs.apply_options(["coordinate-descent", "cudnn-attention"])
        assert inductor_config.coordinate_descent_tuning
        others = (backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled(), backends.math_sdp_enabled())
        assert backends.cudnn_sdp_enabled() and not any(others)
        assert functorch_config.activation_memory_budget == saved_budget == 1.0
        rungs.apply_options(["memory-budget"])
        assert functorch_config.activation_memory_budget == rungs.MEMORY_BUDGET < 1
        with pytest.raises(ValueError, match="unknown option"):
            rungs.apply_options(["fast"])
        # the allocator reads its settings once: the ladder starts the rung's process with them, and a process
        # without them refuses the option rather than measure the default allocator under its name
        assert rungs.option_environment(["memory-budget", "expandable-segments"]) == {
            "PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # the old name alone: 2.9+ may
        with pytest.raises(ValueError, match="PYTORCH_ALLOC_CONF"):  # read the machine's setting of the new one
            rungs.apply_options(["expandable-segments"])
        monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
        rungs.apply_options(["expandable-segments"])
    finally:
        inductor_config.max_autotune, inductor_config.coordinate_descent_tuning = saved[:2]
        functorch_config.activation_memory_budget, inductor_config.triton.cudagraphs = saved_budget, saved_graphs
        inductor_config.allow_buffer_reuse = saved_reuse
        for enable, value in zip((backends.enable_flash_sdp, backends.enable_mem_efficient_sdp,
                                  backends.enable_math_sdp, backends.enable_cudnn_sdp), saved[2:]):
            enable(value)
    assert sorted(rungs.OPTIONS) == ["chunked-loss", "coordinate-descent", "cuda-graphs", "cudnn-attention",
                                     "expandable-segments", "fsdp-one-unit", "fused-loss", "grad-accum",
                                     "max-autotune", "memory-budget", "nested-compile-region", "no-dropout"]


ALLOWED = 1e-4  # compiled against eager, of each parameter's largest gradient entry (float32 reordered: ~1e-6)


def worst_gradient_error(options, device):
    """(eager loss, compiled loss, the largest relative gradient difference and its parameter) of rung 8 (01's
    compiled step) with `options` on `device`: tiny model, float32, dropout off. The options' settings of PyTorch
    stay switched on (in a rung's process they do too)."""
    rungs.apply_options(options)
    rung = rungs.compose(8, device, tiny=True, seed=11, options=("no-dropout", *options))
    torch.set_float32_matmul_precision("highest")  # exact float32 on both sides: no TF32
    stage, model = rung.data_stage, rung.model
    generator = torch.Generator().manual_seed(5)
    inputs, targets = (torch.randint(0, 50257, (2, rung.cfg["context_length"]), generator=generator).to(device)
                       for _ in range(2))
    results = []
    for loss_of in (stage.forward_and_loss, stage.training_loss):  # eager, then compiled (the same lines)
        model.zero_grad(set_to_none=True)
        loss = loss_of(model, inputs, targets)
        loss.backward()
        results.append((loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    (eager_loss, eager), (compiled_loss, compiled) = results
    error, name = max(((eager[name] - compiled[name]).abs().max().item() / eager[name].abs().max().item(), name)
                      for name in eager)
    return eager_loss, compiled_loss, error, name


def test_the_nested_compile_region_option_gives_the_eager_gradients():
    """The option as a rung's process switches it on: compiled with the block as a nested region, 01's step gives the
    eager step's gradients. Without allow_buffer_reuse = False (which the option sets) Inductor's were up to half
    their size off from two blocks on (PyTorch 2.14.1); tests/gpu/test_compile_options.py asks the same of a GPU."""
    import torch._inductor.config as inductor_config

    # restored afterwards by the config's own patch(): pytest's monkeypatch would leave the setting deleted
    with inductor_config.patch(allow_buffer_reuse=inductor_config.allow_buffer_reuse):
        eager_loss, compiled_loss, error, name = worst_gradient_error(("nested-compile-region",), CPU)
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-5)
    assert error <= ALLOWED, (error, name)


def test_the_nested_compile_region_option_marks_01s_block_from_rung_8_and_only_there():
    """--option nested-compile-region wraps the TransformerBlock.forward of the rung's own copy of 01 (torch.compile
    then compiles one block for all); before rung 8 nothing compiles, and the row says the option did nothing."""
    compiled = rungs.compose(8, CPU, tiny=True, options=("nested-compile-region",))
    block = compiled.model.trf_blocks[0]
    assert type(block).forward is not type(rungs.compose(8, CPU, tiny=True).model.trf_blocks[0]).forward
    assert "compile_region" in type(block).forward.__qualname__  # what torch.compiler.nested_compile_region returns
    eager = rungs.compose(7, CPU, tiny=True, options=("nested-compile-region",))
    assert any(note.startswith("no effect here: nested-compile-region") for note in eager.notes), eager.notes


def test_the_no_dropout_option_turns_every_dropout_off_and_nothing_else():
    """--option no-dropout: rung 7's model (01's) with every dropout at 0, so two forward passes in training mode
    agree; without it they differ (the book's 0.1). The rest of the rung is the same: config, batch, parameters."""
    outputs, configs = {}, {}
    for options in ((), ("no-dropout",)):
        rung = rungs.compose(7, CPU, tiny=True, seed=3, options=options)
        assert rung.model.training
        inputs = torch.randint(0, 1000, (2, rung.cfg["context_length"]))
        with torch.no_grad():
            outputs[options] = rung.model(inputs), rung.model(inputs)
        configs[options] = rung.cfg
    first, second = outputs[("no-dropout",)]
    assert torch.equal(first, second)
    assert not torch.equal(*outputs[()])
    assert configs[()]["drop_rate"] == 0.1 and configs[("no-dropout",)] == {**configs[()], "drop_rate": 0.0}


def test_rungs_keep_cudnns_attention_off_as_the_stages_do_unless_the_option_measures_it():
    """01's main() turns cuDNN's attention off (step 7: it may round dropout to a multiple of 1/16); the composed rungs
    must attend with the same kernel as 01, and --option cudnn-attention with cuDNN's alone."""
    backends = torch.backends.cuda
    saved = backends.cudnn_sdp_enabled()
    try:
        backends.enable_cudnn_sdp(True)
        rungs.compose(7, CPU, tiny=True)
        assert not backends.cudnn_sdp_enabled()
        rungs.compose(7, CPU, tiny=True, options=("cudnn-attention",))
        assert backends.cudnn_sdp_enabled()
    finally:
        backends.enable_cudnn_sdp(saved)


@pytest.mark.parametrize("option", ["chunked-loss", "fused-loss"])
def test_the_loss_options_replace_01s_loss_from_rung_4_and_train_the_same(option):
    """compose() swaps bench/chunked_loss.py's forward_and_loss in where the rung's loss is 01's: one training step
    then gives the same loss and the same gradients as the rung without the option. Rung 4, the first it changes, is
    the last in float32: from rung 5 on a CPU with bf16 trains in bf16, where the two losses' float32 work, rounded
    otherwise, turns a few of the logits' bf16 gradients the other way (1e-3 apart in a small gradient)."""
    from bench import chunked_loss

    replaced_by = {"chunked-loss": chunked_loss.forward_and_loss, "fused-loss": chunked_loss.fused_forward_and_loss}
    rungs.apply_options([option])  # no setting of PyTorch to switch: compose does it
    inputs = torch.randint(0, 50257, (4, 64), generator=torch.Generator().manual_seed(0))
    results = {}
    for options in ((), (option,)):
        rung = rungs.compose(4, CPU, tiny=True, seed=5, options=options)
        rung.model.eval()  # no dropout: both runs see the same network
        assert (rung.data_stage.forward_and_loss is replaced_by[option]) == bool(options)
        loss = rung.train_step(inputs, inputs.roll(-1, dims=1)).item()
        results[options] = loss, [p.grad for p in rung.model.parameters()]  # the step's, kept until the next one
    (plain_loss, plain), (chunked_loss_value, chunked) = results.values()
    assert chunked_loss_value == pytest.approx(plain_loss, rel=1e-6)
    assert max(((ours - theirs).norm() / theirs.norm()).item() for ours, theirs in zip(chunked, plain)) < 1e-5
    before_01 = rungs.compose(3, CPU, tiny=True, options=(option,))
    assert any(note.startswith(f"no effect here: {option}") for note in before_01.notes)


def assert_refused_in_one_line(flags, message, tmp_path, capsys):
    """The ladder exits 2 with one line naming `message`, and makes no results folder."""
    try:
        code = ladder.main([*flags, "--out", str(tmp_path / "out")])
    except SystemExit as exited:  # argparse's own refusal
        code = exited.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, message", [
    (("--option", "no-dropout", "--rungs", "8-11"), "--option applies to rungs 0-10 here, not to 11"),
    (("--option", "cuda-graphs", "--option", "chunked-loss", "--rungs", "10-12"),
     "--option applies to rungs 0-10 here, not to 11-12 (cuda-graphs: rungs 0-12; chunked-loss: rungs 0-10;"),
    (("--option", "max-autotune", "--check-scripts"), "--check-scripts would compare them"),
    (("--option", "chunked-loss", "--option", "fused-loss"), "each replace 01's loss: name one of them"),
    (("--option", "fastest"), "invalid choice: 'fastest'"),
])
def test_an_option_stays_on_the_rungs_that_take_it(flags, message, tmp_path, capsys):
    assert_refused_in_one_line(flags, message, tmp_path, capsys)


@pytest.mark.parametrize("options, rungs", [
    ((), range(13)),
    (("no-dropout",), range(11)),  # the model's config: the composed rungs only
    (("max-autotune", "grad-accum"), range(13)),  # a setting of PyTorch and a flag: the scripts take both
    (("cuda-graphs", "chunked-loss"), range(11)),
    (("nested-compile-region",), range(12)),  # 02 too (through the launcher), not 03, which compiles its blocks
])
def test_an_options_rungs_are_those_that_take_every_option_named(options, rungs):
    parsed = ladder.build_parser().parse_args(["--tiny", *(part for name in options for part in ("--option", name))])
    assert ladder.resolve_defaults(parsed).rungs == list(rungs)


def test_the_scripts_take_the_settings_of_pytorch_through_a_launcher_and_nothing_else():
    """Rungs 11 and 12 run the stage script as it is; a setting of PyTorch reaches its processes through
    bench/script_with_options.py, started in the script's place; a flag (grad-accum) or the environment
    (expandable-segments) need no launcher; an option of the composed rungs is refused by the launcher itself."""
    from bench import script_with_options

    assert runner.script_command("02.py", ["grad-accum", "expandable-segments"]) == ["02.py"]
    launcher = runner.ROOT / "bench" / "script_with_options.py"
    assert runner.script_command("02.py", ["grad-accum", "cuda-graphs", "max-autotune"]) == [
        launcher, "--option", "cuda-graphs", "--option", "max-autotune", "02.py"]
    assert script_with_options.split_command(["--option", "cuda-graphs", "02.py", "--option", "x"]) == (
        ["cuda-graphs"], "02.py", ["--option", "x"])  # the script's own flags stay its own
    with pytest.raises(SystemExit, match="no-dropout is no option a stage script takes"):
        script_with_options.main(["--option", "no-dropout", "02.py"])


def test_the_launcher_runs_the_script_as_main_with_its_flags_and_the_settings_on(tmp_path):
    """The settings before the script's imports; nested-compile-region, which changes the script's code, on the class
    its body defined, before its `__main__` block builds anything from it."""
    script = tmp_path / "stage.py"
    script.write_text("import sys, torch._dynamo, torch._inductor.config as inductor\n"
                      "from torch.distributed.fsdp import fully_shard\n"  # as 03 imports it
                      "class TransformerBlock:\n"
                      "    def forward(self, x):\n"
                      "        return x\n"
                      "if __name__ == '__main__':\n"
                      "    block = object()\n"  # not the whole model: fsdp-one-unit leaves it to the model's unit
                      "    print(sys.argv[1:], inductor.max_autotune, inductor.triton.cudagraphs,"
                      " sys.path[0] == sys.argv[0].rsplit('/', 1)[0], fully_shard(block) is block,"
                      " 'compile_region' in TransformerBlock.forward.__qualname__, inductor.allow_buffer_reuse,"
                      " sys.modules['__main__'].TransformerBlock is TransformerBlock)\n", encoding="utf-8")
    command = [sys.executable, str(runner.ROOT / "bench" / "script_with_options.py"), "--option", "max-autotune",
               "--option", "cuda-graphs", "--option", "fsdp-one-unit", "--option", "nested-compile-region",
               str(script), "--max-steps", "3"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "['--max-steps', '3'] True True True True True False True", done.stdout


def test_a_script_without_a_main_block_takes_no_option_that_changes_its_code(tmp_path):
    """Its code would run before the option could mark anything: refused, with the reason, and nothing run."""
    from bench import script_with_options

    script = tmp_path / "stage.py"
    script.write_text("class TransformerBlock:\n    def forward(self, x):\n        return x\nprint('ran')\n")
    with pytest.raises(SystemExit, match="does not end with an `if __name__ == \"__main__\":` block"):
        script_with_options.run_as_main(script, ["nested-compile-region"])


@pytest.mark.parametrize("stage", ["01_opt_single_gpu.py", "02_opt_multi_gpu_ddp.py"])
def test_the_stages_that_take_nested_compile_region_mark_their_block_with_it(stage):
    """What the launcher does to 01 and 02 (rung 11 and bench/stages.py's runs): their block's forward becomes the
    nested region; each ends with the `__main__` block that the launcher runs after marking it."""
    import ast
    from bench import script_with_options

    module = rungs.load_stage(stage)
    rungs.mark_code(module, ["nested-compile-region"])
    assert "compile_region" in module.TransformerBlock.forward.__qualname__
    tree = ast.parse((runner.ROOT / stage).read_text(encoding="utf-8"))
    assert script_with_options.is_main_block(tree.body[-1])


def test_an_option_reaches_the_rung_and_names_its_folder(tmp_path, small_text):
    args = ladder.resolve_defaults(ladder.build_parser().parse_args(["--tiny", "--option", "max-autotune",
                                                                     "--option", "coordinate-descent"]))
    assert args.rungs == list(range(13)) and args.option == ["max-autotune", "coordinate-descent"]
    folder = ladder.results_folder(args, {"slug": "nvidia-h100-80gb-hbm3"})
    assert folder.name == "nvidia-h100-80gb-hbm3-coordinate-descent-max-autotune-tiny"
    out = tmp_path / "out"
    done = run_script("bench/ladder.py", "--tiny", "--rungs", "6", "--warmup", "1", "--steps", "2", "--data",
                      small_text, "--option", "coordinate-descent", "--option", "chunked-loss", "--option",
                      "expandable-segments", "--out", out, timeout=300,
                      env={"PYTORCH_ALLOC_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": ""})  # set by the ladder
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    measured = json.loads((out / "ladder.json").read_text())
    assert measured["settings"]["options"] == "chunked-loss,coordinate-descent,expandable-segments"
    assert any(note.startswith("option coordinate-descent: torch._inductor.config.coordinate_descent_tuning")
               for note in measured["rungs"][0]["notes"]), measured["rungs"][0]
    assert any(note.startswith("option chunked-loss: 01's forward_and_loss replaced") for note in
               measured["rungs"][0]["notes"])
    assert "with --option chunked-loss,coordinate-descent,expandable-segments on every rung" in (
        out / "ladder.md").read_text()


def test_ratios_name_the_rung_they_compare_with():
    merged = report.collect(hand_made_rows({0: (100.0, 1.0), 5: (200.0, 1.0), 8: (300.0, 1.0)}))
    by_rung = {row["rung"]: row for row in merged["rungs"]}
    assert report.ratio_label(by_rung[5]) == "2.00× rung 0"
    assert report.ratio_label(by_rung[8]) == "1.50× rung 5 · 3.00× rung 0"
    markdown = report.render_markdown(merged)
    assert "| 1.50× rung 5 |" in markdown and "prev." not in markdown
    alone = report.collect(hand_made_rows({5: (200.0, 1.0), 8: (300.0, 1.0)}))  # no rung 0 in the table
    assert report.ratio_label(alone["rungs"][1]) == "1.50× rung 5"


def test_whiskers_reach_the_slowest_and_the_fastest_window():
    rows = synthetic_gpu_report()["rungs"]  # windows from 0.9 to 1.05 times the median; rung 2 failed
    below, above = report.whisker_extents(rows)
    assert below[0] == pytest.approx(1_200) and above[0] == pytest.approx(600)
    assert below[2] == above[2] == 0


def test_reference_cells_say_when_the_batch_is_not_theirs():
    settings = {"tiny": False}
    row = hand_made_rows({10: (100.0, 1.0)})["rung-10"]  # batch 8 against the reference's 32
    assert report.reference_cells(row, settings) == ("142,156 (at batch 32)", "22.51 (at batch 32)")
    row = hand_made_rows({3: (100.0, 1.0)})["rung-03"]
    assert report.reference_cells(row, settings) == ("28,399", "26.24")
    for other in ({"tiny": True}, {"tiny": False, "model": "gpt2-medium"}):  # full-size GPT-2 small's: not theirs
        assert report.reference_cells(row, other) == ("—", "—")


def test_a_roofline_for_the_same_gpu_adds_a_ceiling_column(tmp_path):
    roofline = {"gpu": "H100", "model": "gpt2-small", "batch_size": None,
                "rungs": [{"rung": 0, "ceiling_tok_per_sec": 24_000.0, "classes": {"matmul": {"flops": 1.0}}},
                          {"rung": 3, "ceiling_tok_per_sec": 90_000.0, "classes": {}}]}
    (tmp_path / "roofline.json").write_text(json.dumps(roofline))
    merged = synthetic_gpu_report()
    merged["device_name"] = "NVIDIA H100 80GB HBM3"
    settings = merged["settings"]
    found = report.find_roofline(tmp_path, None, merged["device_name"], settings)
    markdown = report.write_report(merged, tmp_path, found, chart=False)
    assert "| measured / ceiling |" in markdown and "| 50% of 24,000 |" in markdown and "| 30% of 90,000 |" in markdown
    assert json.loads((tmp_path / "ladder.json").read_text())["rungs"][0]["fraction_of_ceiling"] == pytest.approx(0.5)
    # another GPU's or batch's roofline: left out when it merely lies in the folder, refused when asked for
    said = []
    assert report.find_roofline(tmp_path, None, "NVIDIA H100 PCIe", settings, say=said.append) is None
    assert "models the H100, not the NVIDIA H100 PCIe" in said[0]
    assert report.find_roofline(tmp_path, None, merged["device_name"], {**settings, "batch_size": 8},
                                say=said.append) is None and "--batch-size" in said[1]
    with pytest.raises(report.UsageError, match="models the H100"):
        report.find_roofline(tmp_path, tmp_path / "roofline.json", "NVIDIA A100-SXM4-80GB", settings)
    assert "ceiling" not in report.render_markdown(report.collect(hand_made_rows({0: (1.0, 1.0)})))


def test_without_a_roofline_in_the_folder_the_one_shipped_for_the_gpu_is_used(tmp_path):
    """docs/roofline/ holds the H100's, H200's and A100's: a ladder on one of them gets its ceilings with no flag,
    and only where they model its rungs."""
    settings = {**synthetic_gpu_report()["settings"], "model": "gpt2-small", "batch_size": None}
    said = []
    found = report.find_roofline(tmp_path, None, "NVIDIA H100 80GB HBM3", settings, say=said.append)
    assert found["gpu"] == "H100" and said == [
        "Ceilings from docs/roofline/H100/roofline.json, the roofline shipped for the H100 (--roofline gives another)"]
    assert report.find_roofline(tmp_path, None, "NVIDIA H200", settings, say=said.append)["gpu"] == "H200"
    assert report.find_roofline(tmp_path, None, "NVIDIA H100 PCIe", settings, say=said.append) is None
    assert report.find_roofline(tmp_path, None, "NVIDIA H100 80GB HBM3", {**settings, "batch_size": 8},
                                say=said.append) is None
    # none shipped for it: the line says the command that writes one into the results folder; a CPU has none
    assert report.find_roofline(tmp_path, None, "NVIDIA GeForce RTX 4090", settings, say=said.append) is None
    assert report.find_roofline(tmp_path, None, "cpu", settings, say=said.append) is None
    assert len(said) == 5 and all(line.startswith("No ceiling or prediction column") for line in said[2:])
    assert f"--gpu 'NVIDIA GeForce RTX 4090' --predict --out {tmp_path}" in said[4]


def test_report_py_rebuilds_a_table_with_the_ceiling_beside_it(tmp_path, capsys):
    write_rows(tmp_path, hand_made_rows({0: (12_000.0, 26.0)}, device_name="NVIDIA H100 80GB HBM3"))
    report.write_report(report.collect(rows.read_rows(tmp_path, "ladder.json")), tmp_path, chart=False)  # no roofline given
    assert "ceiling" not in (tmp_path / "ladder.md").read_text()
    roofline = {"gpu": "H100", "rungs": [{"rung": 0, "ceiling_tok_per_sec": 48_000.0, "classes": {}}]}
    (tmp_path / "roofline.json").write_text(json.dumps(roofline))
    assert report.main([str(tmp_path)]) == 0
    assert "| 25% of 48,000 |" in (tmp_path / "ladder.md").read_text() and (tmp_path / "ladder.png").exists()
    assert report.main([str(tmp_path / "nothing here")]) == 2
    assert "holds no rows" in capsys.readouterr().err


def test_a_wrong_corpus_is_a_usage_error(tmp_path):
    done = run_script("bench/ladder.py", "--tiny", "--data", tmp_path / "missing.txt", "--out", tmp_path / "out")
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "missing.txt" in done.stderr
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# End to end: six rungs, --tiny, the fewest steps, in two parts into one folder
# ---------------------------------------------------------------------------------------------

FAILED_IN_THE_FIRST_PART = (FAILING_RUNG, 11)  # rung 11's failure is instant: the hook skips its run
MEASURED = [0, 1, 3, 5, 10, 11]


@pytest.fixture(scope="module")
def tiny_ladder(tmp_path_factory):
    """Part 1: rungs 0, 1, 3 and 11 (3 and 11 failing on purpose); part 2: rungs 5, 10 and 11 into the same folder.
    Both at --batch-size 2 (the stages' tiny batch is 4), which every row then notes."""
    from data import load_text

    folder = tmp_path_factory.mktemp("ladder")
    corpus = folder / "small.txt"
    corpus.write_text(load_text("shakespeare")[:60_000], encoding="utf-8")  # tokenizes in no time
    out = folder / "out"
    flags = ("bench/ladder.py", "--tiny", "--warmup", "1", "--steps", "2", "--batch-size", "2", "--data", corpus,
             "--out", out)
    failing = ",".join(map(str, FAILED_IN_THE_FIRST_PART))
    first = run_script(*flags, "--rungs", "0,1,3,11", env={FAIL_RUNG: failing}, timeout=900)
    after_first = json.loads((out / "ladder.json").read_text()) if (out / "ladder.json").exists() else None
    second = run_script(*flags, "--rungs", "5,10,11", timeout=900)
    merged = json.loads((out / "ladder.json").read_text()) if (out / "ladder.json").exists() else None
    return first, second, out, after_first, merged


def test_ladder_writes_the_three_files_and_the_logs(tiny_ladder):
    first, second, out, _, merged = tiny_ladder
    for done in (first, second):
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for key in ("device", "torch", "date", "settings", "parts", "rungs"):
        assert key in merged
    assert [row["rung"] for row in merged["rungs"]] == MEASURED
    for row in merged["rungs"]:
        for key in report.ROW_KEYS:
            assert key in row, (row["rung"], key)
        assert (out / "logs" / f"rung-{row['rung']:02d}.log").exists()
    markdown = (out / "ladder.md").read_text()
    assert markdown.count("\n| ") == 2 + len(MEASURED)  # header, separator and one row per rung
    assert "original tutorial, 1x A100, PyTorch 2.6" in markdown and "PyTorch: " in markdown
    assert (out / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[3/3] rung 11" in second.stdout and "left" in second.stdout  # progress lines


def test_the_parts_merge_into_one_table(tiny_ladder):
    _, _, out, after_first, merged = tiny_ladder
    assert [row["rung"] for row in after_first["rungs"]] == [0, 1, 3, 11]
    first_start, second_start = (part["started_at"] for part in merged["parts"])
    rows = {row["rung"]: row for row in merged["rungs"]}
    assert "LADDER_FAIL_RUNG" in after_first["rungs"][-1]["error"]  # rung 11 after part 1 ...
    assert rows[11]["error"] is None and rows[11]["measured_at"] > second_start  # ... replaced by part 2's
    assert all(first_start < rows[number]["measured_at"] < second_start for number in (0, 1, 3))
    assert rows[5]["previous_rung"] == 3 and rows[5]["speedup_vs_previous"] is None  # not across a failed row
    assert rows[10]["previous_rung"] == 5 and rows[10]["speedup_vs_previous"] > 0  # compared across the parts
    assert merged["settings"]["batch_size"] == 2 and merged["settings"]["model"] == "gpt2-small"
    markdown = (out / "ladder.md").read_text()
    assert "Measured in 2 part(s)" in markdown and "--rungs 0,1,3,11" in markdown and "--rungs 5,10,11" in markdown
    files = sorted(path.name for path in (out / "rows").iterdir())
    assert files == [f"rung-{number:02d}.json" for number in MEASURED]  # one file per rung, the newest kept
    row_11 = json.loads((out / "rows" / "rung-11.json").read_text())
    assert row_11["context"]["command"]["started_at"] == second_start and row_11["context"]["settings"]["tiny"]
    for line in markdown.splitlines():
        if line.startswith("| ") and line.split(" | ")[0][2:].isdigit():
            assert re.search(r"\| \d{4}-\d\d-\d\d \d\d:\d\d \|", line), line  # every row dated


def test_every_working_rung_is_measured_at_the_asked_batch(tiny_ladder):
    _, _, _, _, merged = tiny_ladder
    for row in merged["rungs"]:
        if row["rung"] == FAILING_RUNG:
            continue
        assert row["error"] is None, row
        assert 0 < row["tokens_per_sec_min"] <= row["tokens_per_sec"] <= row["tokens_per_sec_max"], row
        assert row["peak_reserved_gb"] is None and row["mfu"] is None  # CPU: no GPU memory, no known peak
        assert row["batch_size"] == 2 and "batch 2 set by --batch-size (the stage's own: 4)" in row["notes"], row
    rows = {row["rung"]: row for row in merged["rungs"]}
    assert math.isfinite(rows[0]["final_loss"]) and math.isfinite(rows[10]["final_loss"])
    assert rows[1]["final_loss"] == pytest.approx(rows[0]["final_loss"], abs=1e-5)  # step 1 changes no math
    assert rows[11]["world_size"] == 1  # one process on a CPU


def test_a_failing_rung_is_reported_on_its_row(tiny_ladder):
    first, _, _, _, merged = tiny_ladder
    rows = {row["rung"]: row for row in merged["rungs"]}
    failed = rows[FAILING_RUNG]
    assert "LADDER_FAIL_RUNG" in failed["error"] and failed["tokens_per_sec"] is None
    assert rows[0]["tokens_per_sec"] > 0 and rows[1]["tokens_per_sec"] > 0 and "[4/4] rung 11" in first.stdout
    assert f"rung {FAILING_RUNG} FAILED" in first.stdout


def test_rung_11_writes_into_the_results_folder_and_keeps_no_checkpoint(tiny_ladder):
    _, _, out, _, merged = tiny_ladder
    run_folder = out / "logs" / "rung-11-run"
    assert {row["rung"]: row for row in merged["rungs"]}[11]["run_folder"] == "logs/rung-11-run"
    assert sorted(path.name for path in run_folder.iterdir()) == sorted(runner.KEPT_FROM_SCRIPT_RUNS)
    assert json.loads((run_folder / "metrics.json").read_text())["settings"]["batch_size"] == 2


def test_time_limit_helpers():
    assert [plan.rung_kind(number) for number in (0, 7, 8, 10, 11, 12)] == ["eager", "eager", "compiled",
                                                                              "compiled", "scripts", "scripts"]
    assert plan.expected_seconds("eager", {}) is None  # before the first run: no judgement
    seen = {"eager": [50.0, 70.0]}
    assert plan.expected_seconds("eager", seen) == 70.0  # the longest of its kind
    assert plan.expected_seconds("compiled", seen) == 140.0  # none of its kind yet: twice the longest
    kinds = [plan.Job(str(n), "", kind, n, None, "") for n, kind in enumerate(["eager", "compiled", "compiled"])]
    assert plan.seconds_left(kinds, {}) is None
    assert plan.seconds_left(kinds, seen) == 70.0 + 2 * 140.0  # each job by its own kind, not by the mean run
    assert plan.seconds_left(kinds[1:], {**seen, "compiled": [100.0]}) == 200.0
    assert report.rung_ranges([0, 1, 2, 5, 8, 9], dash="-", separator=",") == "0-2,5,8-9"
    args = ladder.resolve_defaults(ladder.build_parser().parse_args(["--rungs", "8-10", "--check-scripts"]))
    left = plan.jobs(args, {}, missing=False)
    assert [job.name for job in left] == ["rung-08", "rung-09", "rung-10", "check-00_orig", "check-01_opt_single_gpu"]
    assert plan.describe_left(left) == "rungs 8–10 and the --check-scripts runs"
    assert plan.describe_left(left[-1:]) == "the --check-scripts run of 01_opt_single_gpu.py"  # 00's was measured
    argv = ["--rungs", "0-12", "--check-scripts", "--time-limit", "540", "--out", "my results"]
    assert plan.continuation_command(argv, left, missing=False) == (
        "python bench/ladder.py --rungs 8-10 --check-scripts --time-limit 540 --out 'my results'")
    assert plan.continuation_command(["--rungs=0-5", "--check-scripts"], left[:1], missing=False) == (
        "python bench/ladder.py --rungs 8")
    assert plan.continuation_command(["--rungs", "missing", "--tiny"], left[:1], missing=True) == (
        "python bench/ladder.py --rungs missing --tiny")


class FakeClock:
    """time for run_ladder: monotonic() is what the fake rungs say has passed; the rest is the real module."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


@pytest.fixture
def fake_clock(monkeypatch):
    """run_ladder on a fake clock and a fake CPU, without a chart: the rungs and checks are the test's fakes."""
    clock = FakeClock()
    monkeypatch.setattr(ladder, "time", clock)
    monkeypatch.setattr(plan, "time", clock)
    monkeypatch.setattr(runner, "describe_device", lambda args: {
        "device_type": "cpu", "description": "CPU (fake)", "name": "fake cpu", "slug": "fake-cpu", "gpu_count": 0,
        "cuda": None, "torch": torch.__version__, "python": "3.11"})
    monkeypatch.setattr(ladder.report, "plot_ladder", lambda report, path: None)
    return clock


def test_a_time_limit_starts_no_rung_that_would_end_after_it_and_prints_the_rest(tmp_path, monkeypatch, capsys,
                                                                                  fake_clock):
    """Eager rungs take 60 s, compiled ones 150 s: with 400 s, rungs 0-2 (180 s), then rung 3 would end at 240 s,
    4 at 300 s, 5 at 360 s; rung 6 at 420 s is not started, and the command for rungs 6-10 and the checks is printed.
    Then --rungs none --check-scripts runs only the checks, set beside the rows already in the folder."""
    clock = fake_clock

    def fake_rung(number, args, logs, timeout, limit):
        clock.now += 150.0 if number >= 8 else 60.0
        return {"rung": number, "error": None, "tokens_per_sec": 1000.0 + number, "tokens_per_sec_min": 990.0,
                "tokens_per_sec_max": 1010.0 + number, "batch_size": 4, "notes": []}

    checked = []

    def fake_check(script_name, rung, args, device_info, logs, timeout):
        clock.now += 105.0
        checked.append(script_name)
        return {"script": script_name, "rung": rung, "error": None, "tokens_per_sec": 990.0,
                "tokens_per_sec_min": 980.0, "tokens_per_sec_max": 1000.0, "peak_reserved_gb": None}

    monkeypatch.setattr(runner, "run_single_process_rung", fake_rung)
    monkeypatch.setattr(runner, "run_script_check", fake_check)
    out = tmp_path / "out"
    flags = ["--tiny", "--check-scripts", "--time-limit", "400", "--out", str(out)]
    assert ladder.main(["--rungs", "0-10", *flags]) == 0
    printed = capsys.readouterr().out
    measured = json.loads((out / "ladder.json").read_text())
    assert [row["rung"] for row in measured["rungs"]] == [0, 1, 2, 3, 4, 5] and not checked
    assert "[2/13] rung 1" in printed and "elapsed 1:00, ~16:00 left" in printed  # 8 eager runs at 60 s, 4 at 120
    assert "rung 6 would end at about 7:00" in printed
    assert "rungs 6–10 and the --check-scripts runs not started" in printed
    assert ("the rest of this part is rungs 6–10 and the --check-scripts runs; measure it with:\n  python "
            f"bench/ladder.py --rungs 6-10 --tiny --check-scripts --time-limit 400 --out {out}") in printed

    clock.now = 0.0
    assert ladder.main(["--rungs", "none", *flags]) == 0
    assert checked == ["00_orig.py", "01_opt_single_gpu.py"]
    checks = json.loads((out / "ladder.json").read_text())["script_checks"]  # beside the rows already there
    assert [(check["rung"], check["rung_tokens_per_sec"], check["script_over_rung"]) for check in checks] == [
        (0, 1000.0, 0.99), (10, None, None)]
    assert "--time-limit: the rest" not in capsys.readouterr().out
    assert "Note: full-size" not in printed  # --tiny on a CPU: nothing to warn of; full size: the note comes first
    assert ladder.main(["--rungs", "0", "--out", str(tmp_path / "full")]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("Note: full-size rungs on a CPU")
    with pytest.raises(failures.UsageError, match="--rungs none measures nothing"):
        ladder.resolve_defaults(ladder.build_parser().parse_args(["--rungs", "none"]))


def test_a_rung_that_outlasts_its_judgement_is_stopped_at_the_limit_and_starts_the_next_part(
        tmp_path, monkeypatch, capsys, fake_clock):
    """Rung 2 hangs (a first compilation far longer than the eager rungs before it, say): it is given what is left of
    --time-limit as its timeout, not --rung-timeout, so the part ends in order with the command for the rest, which
    starts with rung 2. A rung that alone outlasts the limit, the first of its part, keeps its failed row instead, so
    that the next command moves on."""
    timeouts = []

    def fake_rung(number, args, logs, timeout, limit):
        timeouts.append((number, timeout, limit))
        if number == 2:  # stopped by run_streaming at its timeout
            fake_clock.now += timeout
            return {"rung": number, **runner.timed_out(timeout, limit)}
        fake_clock.now += 60.0
        return {"rung": number, "error": None, "tokens_per_sec": 1000.0, "tokens_per_sec_min": 990.0,
                "tokens_per_sec_max": 1010.0, "batch_size": 4, "notes": []}

    monkeypatch.setattr(runner, "run_single_process_rung", fake_rung)
    out = tmp_path / "out"
    flags = ["--tiny", "--time-limit", "400", "--out", str(out)]
    assert ladder.main(["--rungs", "0-4", *flags]) == 0
    assert timeouts == [(0, 400, "--time-limit"), (1, 340, "--time-limit"), (2, 280, "--time-limit")]
    printed = capsys.readouterr().out
    assert "rung 2 was stopped at the limit after 4:40" in printed
    assert f"measure it with:\n  python bench/ladder.py --rungs 2-4 --tiny --time-limit 400 --out {out}" in printed
    assert [row["rung"] for row in json.loads((out / "ladder.json").read_text())["rungs"]] == [0, 1]

    fake_clock.now, timeouts[:] = 0.0, []
    assert ladder.main(["--rungs", "2-4", *flags]) == failures.EXIT_FAILED  # this part measured nothing
    assert timeouts == [(2, 400, "--time-limit")]  # then rung 3 would end at 13:20: not started
    rows = {row["rung"]: row for row in json.loads((out / "ladder.json").read_text())["rungs"]}
    assert sorted(rows) == [0, 1, 2] and rows[2]["error"] == "timed out after 400 s (--time-limit)"
    assert "timed_out" not in rows[2]
    printed = capsys.readouterr().out
    assert "--rungs 3-4 --tiny --time-limit 400" in printed
    assert "rung 2, this part's first run, was stopped at the limit after 6:40" in printed  # and a longer limit
    assert "give it a longer --time-limit" in printed

    fake_clock.now, timeouts[:] = 0.0, []  # without --time-limit, --rung-timeout as before
    assert ladder.main(["--rungs", "0", "--tiny", "--out", str(out)]) == 0
    assert timeouts == [(0, 900, "--rung-timeout")]

    def hanging_check(script_name, rung, args, device_info, logs, timeout_and_limit):  # checks can outlast it
        checks_run.append(script_name)
        if script_name == "00_orig.py" and hang == "00":
            fake_clock.now += 60.0
            return {"script": script_name, "rung": rung, "error": None, "tokens_per_sec": 990.0,
                    "tokens_per_sec_min": 980.0, "tokens_per_sec_max": 1000.0, "peak_reserved_gb": None}
        timeout, limit = timeout_and_limit
        fake_clock.now += timeout
        return {"script": script_name, "rung": rung, "tokens_per_sec": None, "tokens_per_sec_min": None,
                "tokens_per_sec_max": None, "peak_reserved_gb": None, **runner.timed_out(timeout, limit)}

    monkeypatch.setattr(runner, "run_script_check", hanging_check)
    fake_clock.now, hang, checks_run = 0.0, "00 and 01", []
    assert ladder.main(["--rungs", "0", "--check-scripts", *flags]) == 0
    printed = capsys.readouterr().out
    assert "the --check-scripts run of 00_orig.py was stopped at the limit after 5:40" in printed
    assert "measure it with:\n  python bench/ladder.py --rungs none --check-scripts --tiny --time-limit 400" in printed
    assert "script_checks" not in json.loads((out / "ladder.json").read_text())
    fake_clock.now, hang, checks_run = 0.0, "00", []  # 00 finishes, 01 is stopped at the limit: 00's is kept
    assert ladder.main(["--rungs", "0", "--check-scripts", *flags]) == 0
    printed = capsys.readouterr().out
    assert "run of 01_opt_single_gpu.py was stopped at the limit after 4:40" in printed
    checks = json.loads((out / "ladder.json").read_text())["script_checks"]
    assert [(check["script"], check["tokens_per_sec"]) for check in checks] == [("00_orig.py", 990.0)]
    continuation = printed.split("measure it with:\n  python bench/ladder.py ")[1].split()
    assert continuation[:3] == ["--rungs", "none", "--check-scripts"]
    fake_clock.now, checks_run[:] = 0.0, []  # the printed command runs the check the folder lacks, not 00 again
    assert ladder.main(continuation) == failures.EXIT_FAILED and checks_run == ["01_opt_single_gpu.py"]
    checks = json.loads((out / "ladder.json").read_text())["script_checks"]
    assert [check["script"] for check in checks] == ["00_orig.py", "01_opt_single_gpu.py"]  # 01's failed, kept


def test_rungs_missing_is_one_command_that_goes_on_until_the_folder_is_whole(tmp_path, monkeypatch, capsys,
                                                                             fake_clock):
    """The same command, again and again, as on a machine that stops every command after a fixed time: each part
    measures what the folder lacks. A rung stopped by Ctrl-C is measured again, a failed one keeps its row; the
    --check-scripts runs come last; then there is nothing left to do."""
    ran, calls = [], []

    def measured(number, error=None):
        return {"rung": number, "error": error, "tokens_per_sec": None if error else 1000.0 + number,
                "tokens_per_sec_min": None if error else 990.0, "tokens_per_sec_max": None if error else 1020.0,
                "batch_size": 4, "notes": []}

    def fake_rung(number, args, logs, timeout, limit):
        if number == 2 and len(calls) == 1:
            raise KeyboardInterrupt  # Ctrl-C during rung 2 of the first command
        ran.append(number)
        fake_clock.now += 90.0 if number >= 8 else 60.0
        return measured(number, error="boom" if number == 4 else None)

    def fake_script_rung(number, args, device_info, logs, timeout, limit):
        ran.append(number)
        fake_clock.now += 100.0
        return measured(number)

    def fake_check(script_name, rung, args, device_info, logs, timeout):
        ran.append(script_name)
        fake_clock.now += 150.0
        return {"script": script_name, "rung": rung, "error": None, "tokens_per_sec": 990.0,
                "tokens_per_sec_min": 980.0, "tokens_per_sec_max": 1000.0, "peak_reserved_gb": None}

    monkeypatch.setattr(runner, "run_single_process_rung", fake_rung)
    monkeypatch.setattr(runner, "run_multi_process_rung", fake_script_rung)
    monkeypatch.setattr(runner, "run_script_check", fake_check)
    out = tmp_path / "out"
    command = ["--rungs", "missing", "--tiny", "--check-scripts", "--time-limit", "400", "--out", str(out)]
    codes, printed = [], []
    for _ in range(7):
        fake_clock.now, ran[:] = 0.0, []
        calls.append(None)
        codes.append(ladder.main(command))
        printed.append(capsys.readouterr().out)
        calls[-1] = list(ran)
        if "nothing left to measure" in printed[-1]:
            break
    assert calls == [[0, 1], [2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, "00_orig.py"], ["01_opt_single_gpu.py"],
                     []], printed
    assert codes == [130, 0, 0, 0, 0, 0]
    for text in printed[1:4]:  # each part cut by the limit names the same command for the rest
        assert f"measure it with:\n  python bench/ladder.py {shlex.join(command)}\n" in text, text
    assert "holds every rung and every --check-scripts run" in printed[-1]
    assert ladder.main([*command, "--steps", "7"]) == 2  # measured otherwise: refused, not "nothing left"
    assert "measured otherwise" in capsys.readouterr().err
    final = json.loads((out / "ladder.json").read_text())
    by_rung = {row["rung"]: row for row in final["rungs"]}
    assert sorted(by_rung) == list(range(13)) and by_rung[4]["error"] == "boom" and by_rung[2]["error"] is None
    assert [check["script"] for check in final["script_checks"]] == ["00_orig.py", "01_opt_single_gpu.py"]

    with_option = ladder.resolve_defaults(ladder.build_parser().parse_args(["--rungs", "missing", "--option",
                                                                              "chunked-loss"]))
    assert plan.jobs(with_option, rows.read_rows(out, "ladder.json"), missing=True) == []  # rungs 11-12 are not an option's
    assert [job.rung for job in plan.jobs(with_option, {}, missing=True)] == list(range(11))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process tree is read from Linux's /proc")
def test_stopping_a_run_stops_the_workers_its_launcher_started_in_sessions_of_their_own():
    """torchrun starts each worker in a session of its own, out of reach of a signal to torchrun's group: a rung or a
    GPU-tier run stopped at its timeout must not leave a worker behind on the GPU (nor keep the pipes of its output
    open, which would hang the caller reading them). Here neither the launcher nor its worker ends on SIGTERM."""
    worker = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    launcher = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"worker = subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True); "
                "print(worker.pid, flush=True); time.sleep(120)")
    process = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    worker_pid = int(process.stdout.readline())
    try:
        assert runner.descendants(process.pid) == [worker_pid]
        started = time.monotonic()
        runner.stop_process_group(process, grace=0.5)
        assert process.poll() is not None and time.monotonic() - started < 5
        assert wait_for(lambda: not process_alive(worker_pid), 5, 0.05), "the worker outlived the stopped launcher"
    finally:
        process.kill()
        if process_alive(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_run_does_not_outlive_a_ladder_killed_outright(tmp_path):
    """A run leads its own session, so that the ladder can stop it with everything it started; a time limit that
    kills the ladder's process group (SIGKILL, no handler runs) would then miss it, and it would go on holding the
    GPU under the next command's measurements. The parent-death signal ends it with the ladder."""
    program = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from bench.runner import run_streaming; "
               f"run_streaming([sys.executable, '-c', 'import os, time; print(os.getpid(), flush=True); "
               f"time.sleep(120)'], {str(tmp_path / 'run.log')!r}, 300)")
    ladder_process = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    run_pid = int(ladder_process.stdout.readline())  # the run's line, as the ladder echoes it
    try:
        assert process_alive(run_pid)
        ladder_process.kill()
        ladder_process.wait(timeout=10)
        assert wait_for(lambda: not process_alive(run_pid), 20, 0.05), "the run outlived the ladder"
    finally:
        ladder_process.kill()
        if process_alive(run_pid):
            os.kill(run_pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# --context-length (the README's exercise: step 7 at context 2,048)
# ---------------------------------------------------------------------------------------------

def resolved(*flags):
    return ladder.resolve_defaults(ladder.build_parser().parse_args(list(flags)))


def test_a_context_length_reaches_every_composed_rungs_config_and_its_row_says_so():
    rung = rungs.compose(0, CPU, tiny=True, context_length=32)
    assert rung.cfg["context_length"] == 32 and rung.model.pos_emb.weight.shape[0] == 32
    assert rung.model.trf_blocks[0].att.mask.shape == (32, 32)  # 00's buffer, built from the same config
    assert "context 32 set by --context-length (the stages' own: 64)" in rung.notes
    assert rungs.compose(9, CPU, tiny=True, context_length=128).cfg["context_length"] == 128  # 01's config too
    assert not any("--context-length" in note for note in rungs.compose(0, CPU, tiny=True, context_length=64).notes)


def test_the_context_length_is_recorded_in_the_settings_and_a_part_at_another_is_refused():
    args = resolved("--context-length", "2048", "--rungs", "6-7")
    assert args.context_length == 2048
    with pytest.raises(failures.UsageError, match=r"no rung of those takes every option named \(fsdp-one-unit"):
        resolved("--context-length", "2048", "--option", "fsdp-one-unit")  # its rung 12 takes no other context
    device_info = {"description": "NVIDIA X", "name": "NVIDIA X", "gpu_count": 1, "cuda": "12.8", "torch": "2.9.0",
                   "python": "3.12", "slug": "nvidia-x"}
    args.argv = ["--context-length", "2048", "--rungs", "6-7"]
    assert ladder.context_of(args, device_info)["settings"]["context_length"] == 2048
    assert ladder.results_folder(args, device_info).name == "nvidia-x-context-2048"
    args.batch_size = 8  # a part at another batch goes beside the stages' own batch's folder, not into it
    assert ladder.results_folder(args, device_info).name == "nvidia-x-batch-8-context-2048"
    found = hand_made_rows({6: (100.0, 1.0)})  # measured without the flag: the stages' own context
    here = hand_made_context()
    here["settings"]["context_length"] = 2048
    with pytest.raises(report.UsageError, match="--context-length: the stages' own there, 2048 here"):
        rows.refuse_a_different_part(found, here, report.MATCHED, "out", "rungs")
    here["settings"]["context_length"] = None
    rows.refuse_a_different_part(found, here, report.MATCHED, "out", "rungs")  # rows written before the flag: alike
    assert report.STAGES_CONTEXT == rungs.stage_context_length(tiny=False)  # what a row's None stands for


def test_the_stages_own_context_is_no_change_and_rungs_11_12_keep_theirs():
    assert resolved("--context-length", "1024").context_length is None
    assert resolved("--tiny", "--context-length", "64").context_length is None
    assert resolved("--tiny", "--context-length", "1024").context_length == 1024
    assert resolved("--context-length", "2048").rungs == list(range(0, 11))  # default: the composed rungs
    assert resolved().rungs == list(rungs.ALL_RUNGS)


@pytest.mark.parametrize("flags, message", [
    (("--context-length", "0"), "--context-length: must be at least 1"),
    (("--context-length", "2k"), "'2k' is not a whole number"),
    (("--context-length", "2048", "--rungs", "6-11"), "--context-length applies to the composed rungs 0-10"),
    (("--context-length", "2048", "--check-scripts"), "--check-scripts would compare them"),
])
def test_a_wrong_context_length_exits_2_with_one_line(flags, message, tmp_path, capsys):
    assert_refused_in_one_line(flags, message, tmp_path, capsys)


def test_a_roofline_at_another_context_gives_no_ceiling_column(tmp_path):
    """report.find_roofline: a roofline.json without a context_length models the stages' own (1,024)."""
    path = tmp_path / "roofline.json"
    path.write_text(json.dumps({"gpu": "H100", "rungs": [{"rung": 7, "ceiling_tok_per_sec": 1.0}]}))  # 1,024: no key
    said, settings = [], {"model": None, "batch_size": None}
    assert report.find_roofline(tmp_path, None, "H100", settings, said.append) is not None
    assert report.find_roofline(tmp_path, None, "H100", {**settings, "context_length": 2048}, said.append) is None
    assert said == [f"No ceiling column: {path} does not fit these rungs: it models context 1,024, the rungs trained "
                    "at 2,048"]
    path.write_text(json.dumps({"gpu": "H100", "context_length": 2048, "rungs": []}))
    assert report.find_roofline(tmp_path, None, "H100", {**settings, "context_length": 2048}) is not None
    with pytest.raises(failures.UsageError, match="models context 2,048, the rungs trained at 4,096"):
        report.find_roofline(tmp_path, path, "H100", {**settings, "context_length": 4096})


