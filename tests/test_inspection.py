"""Looking inside a run: --profile, --memory-snapshot and counted FLOPs, the same in every stage."""

import json
import os
import subprocess
import sys

import pytest

import inspection
import utilization
from conftest import ROOT, load_stage, run_script

REGIONS = ("forward with loss", "backward", "optimizer step")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
PROFILED = range(inspection.PROFILE_WAIT,
                 inspection.PROFILE_WAIT + inspection.PROFILE_WARMUP + inspection.PROFILE_ACTIVE)
OFF_CLOCK = range(PROFILED.start - 1, PROFILED.stop)  # and the step that ends by switching the profiler on


@pytest.mark.parametrize("script", ("00_orig.py", "01_opt_single_gpu.py", "02_opt_multi_gpu_ddp.py"))
def test_profile_writes_a_trace_with_the_labelled_regions_and_keeps_those_steps_out_of_tok_s(
        script, small_text, tmp_path):
    out = tmp_path / "run"
    flags = ["--tiny", "--data", small_text, "--out", out, "--max-steps", 12, "--eval-freq", 4, "--profile"]
    if script.startswith("02"):  # two processes under torchrun, eager to keep the test short
        result = subprocess.run([*TORCHRUN, script, "--no-compile", *map(str, flags)], cwd=ROOT, capture_output=True,
                                text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    else:  # 01 compiled: the trace holds the compiled graphs
        result = run_script(script, *flags, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    traces = list((out / "profile").iterdir())
    assert [trace.name for trace in traces] == [f"{script[:-3]}.pt.trace.json"]  # one, even with two ranks
    events = json.loads(traces[0].read_text())["traceEvents"]  # the Chrome trace format (Perfetto, TensorBoard)
    names = [event.get("name") for event in events]
    for region in REGIONS:  # each labelled once per recorded step
        assert names.count(region) == inspection.PROFILE_ACTIVE, (region, names.count(region))
    # the trace's step labels use the log's numbers (from 0), the numbers the table's title gives
    assert sorted({name for name in names if name and name.startswith("ProfilerStep#")}) == [
        "ProfilerStep#6", "ProfilerStep#7", "ProfilerStep#8"]
    table = result.stdout[result.stdout.index("Profile of steps"):]
    labelled_rows = [line for line in table.splitlines() if line.strip().startswith((*REGIONS, "ProfilerStep#"))]
    assert not labelled_rows, labelled_rows  # the table ranks kernels and operators, not our labels

    # the table of top operators, once, by CPU time here
    assert result.stdout.count("Profile of steps 6-8 (CPU time") == 1, result.stdout[-3000:]  # numbered as the log
    assert "Self CPU time total" in result.stdout

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["profile"] == str(out / "profile")
    tokens_per_step = metrics["tokens_seen"] // metrics["steps"]
    previous_step = -1
    for entry in metrics["log"]:  # tok/s counts the steps of each interval that were not profiled
        steps = range(previous_step + 1, entry["step"] + 1)
        timed = [step for step in steps if step not in OFF_CLOCK]
        assert entry["timed_tokens"] == len(timed) * tokens_per_step, (entry["step"], entry["timed_tokens"])
        assert (entry["step_tok_per_sec"] is None) == (not timed)
        previous_step = entry["step"]
    assert [entry["step"] for entry in metrics["log"]] == [0, 4, 8, 11]
    assert metrics["log"][2]["step_tok_per_sec"] is None  # steps 5-8: all profiled (warm-up and active)
    assert "Step tok/sec: n/a" in result.stdout


@pytest.mark.parametrize("case", ["profile-too-short", "snapshot-off-cuda"])
def test_inspection_flags_that_cannot_work_stop_before_training(case, small_text, tmp_path):
    flags = {"profile-too-short": ["--profile", "--max-steps", 8],
             "snapshot-off-cuda": ["--memory-snapshot", "--device", "cpu"]}[case]
    result = run_script("00_orig.py", "--tiny", "--data", small_text, "--out", tmp_path / "run", *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    # --tiny evaluates every 5 steps: steps 5-8 would hold the evaluation after step 5, so the run to suggest is
    # the one whose window is clear of it: warm-up step 6, steps 7-9 kept (not 6-8 and --max-steps 9, whose run
    # would then warn that its evaluation falls among its profiled steps)
    expected = {"profile-too-short": "records steps 7 to 9 (after the warm-up, with no evaluation among them), but "
                                     "this run's last step is 7: use --max-steps 10 or more",
                "snapshot-off-cuda": "needs a GPU"}[case]
    assert expected in lines[0]
    assert "Ep 1" not in result.stdout and not (tmp_path / "run" / "model.pth").exists()


@pytest.mark.parametrize("script", ("00_orig.py", "01_opt_single_gpu.py"))
def test_the_flops_formula_matches_the_counted_flops_of_the_full_size_model(script):
    stage = load_stage(script)
    cfg = stage.GPT_CONFIG_124M
    counted = utilization.counted_flops_per_token(lambda: stage.GPTModel(cfg), cfg["context_length"])
    formula = utilization.flops_per_token(cfg, 50257)
    # measured: 0.8544384 G both for 00; 01 counts 6 x 768 x 47 more for its padded vocabulary columns
    padded_columns = 6 * cfg["emb_dim"] * (cfg["vocab_size"] - 50257)
    assert counted == pytest.approx(formula + padded_columns, rel=1e-9)
    assert counted == pytest.approx(formula, rel=1e-3)  # the stated tolerance: 0.1%
    assert formula == pytest.approx(0.854e9, rel=1e-3)


def test_the_measuring_page_has_a_looking_inside_a_run_section():
    page = (ROOT / "docs" / "measuring.md").read_text(encoding="utf-8")
    section = page.split("## Looking inside a run", 1)[1].split("\n## ", 1)[0]
    for text in ("--profile", "--memory-snapshot", "memory_viz", "expandable_segments", "FlopCounterMode",
                 "pytorch.org/docs"):
        assert text in section, text


# ---------------------------------------------------------------------------------------------
# The CUDA branches of RunInspection, on the CPU: torch.cuda's calls replaced by recorders
# ---------------------------------------------------------------------------------------------

class CudaCalls:
    """Stands in for the torch.cuda calls RunInspection makes, and records them in order."""

    def __init__(self, monkeypatch):
        import torch

        self.calls = []
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.calls.append("synchronize"))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 1024**3)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 4 * 1024**3)
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                            lambda enabled="all", **options: self.calls.append(("record", enabled, options)))
        monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", self.dump)

    def dump(self, path):
        self.calls.append("dump")
        with open(path, "wb") as file:
            file.write(b"snapshot")


def inspection_args(tmp_path, **flags):
    import argparse

    return argparse.Namespace(**{"out": tmp_path, "profile": False, "memory_snapshot": False, "eval_freq": 100,
                                 "save_every": 0, **flags})


def test_the_profiled_steps_move_past_an_evaluation_that_would_fall_among_them():
    """An evaluation or a checkpoint after the warm-up step or a kept step (but the last) runs inside the trace:
    the window starts later, at the first step where none does, or where it always did if none is clear."""
    start = inspection.profile_start
    assert inspection.PROFILE_WAIT == 5 and inspection.PROFILE_WARMUP + inspection.PROFILE_ACTIVE == 4
    assert start(0, 100, 20, 0) == 5  # the defaults: evaluations at 0, 20, ...
    assert start(0, 100, 5, 0) == 6  # --tiny's --eval-freq 5: not after step 5
    assert start(0, 100, 4, 0) == 5  # 8 is the last kept step: its evaluation comes after the trace
    assert start(10, 100, 4, 0) == 17  # resumed at step 10: 16 is an evaluation
    assert start(0, 100, 100, 8) == 8  # --save-every 8: a checkpoint after step 7
    assert start(0, 100, 20, 0, 7) == 7  # epochs of 7 steps: the sample after step 6
    assert start(0, 100, 1, 0) == 5 and start(0, 9, 5, 0) == 5  # nothing clear, or no room: the earliest


def test_a_window_that_cannot_move_says_so(tmp_path, capsys):
    import torch

    args = inspection_args(tmp_path, profile=True, eval_freq=5)
    inspection.RunInspection(args, torch.device("cpu"), 0, 9).profiler.stop()
    assert ("an evaluation, a checkpoint or an epoch's end falls among profiled steps 5-8, and this run ends too "
            "soon to move past it: its work is in the trace (--max-steps 10 moves the window clear of it)"
            ) in capsys.readouterr().out
    inspection.RunInspection(args, torch.device("cpu"), 0, 10).profiler.stop()
    assert capsys.readouterr().out == ""


def test_a_moved_window_is_what_the_profiler_records_and_what_the_clock_leaves_out(tmp_path):
    import torch

    inspector = inspection.RunInspection(inspection_args(tmp_path, profile=True, eval_freq=5), torch.device("cpu"),
                                         0, 20)
    off_clock = []
    for step in range(20):
        off_clock.append(inspector.off_clock(step))
        with inspector.region("forward with loss"):
            torch.ones(64, 64) @ torch.ones(64, 64)
        inspector.step_done(step)
    assert [step for step, off in enumerate(off_clock) if off] == [5, 6, 7, 8, 9]
    events = json.loads(next((tmp_path / "profile").iterdir()).read_text())["traceEvents"]
    assert sorted({event["name"] for event in events if event.get("name", "").startswith("ProfilerStep#")}) == [
        "ProfilerStep#7", "ProfilerStep#8", "ProfilerStep#9"]
    assert inspector.report.startswith("Profile of steps 7-9 ")


def test_profiled_steps_on_cuda_wait_for_the_gpu_only_where_a_step_could_leak_into_the_kept_ones(monkeypatch,
                                                                                                   tmp_path):
    import torch

    recorded = CudaCalls(monkeypatch)
    inspector = inspection.RunInspection(inspection_args(tmp_path, profile=True), torch.device("cpu"), 0, 20)
    inspector.profiler.stop()  # the real profiler (CPU) gives way to a recorder of the schedule's steps

    class Profiler:
        def step(self):
            recorded.calls.append("profiler step")

        def stop(self):
            recorded.calls.append("profiler stop")

    inspector.profiler, inspector.cuda = Profiler(), True  # the CUDA branch
    for step in range(12):
        recorded.calls.append(step)
        inspector.step_done(step)
    # steps 5 (warm-up) to 8 (the last kept) are off the clock. The warm-up step waits for its kernels (thrown away,
    # they must not run among the kept steps'), and so does the last kept step (the trace must hold all of its);
    # between kept steps the host runs ahead, as in training, so the trace's idle time is training's
    waits = {min(PROFILED) + inspection.PROFILE_WARMUP - 1, max(PROFILED)}
    assert waits == {5, 8}
    expected = [call for step in range(12) for call in (
        [step, "synchronize", "profiler step"] if step in waits else [step, "profiler step"])]
    expected.insert(expected.index(8) + 3, "profiler stop")
    assert recorded.calls[:expected.index(9)] == expected[:expected.index(9)]
    assert recorded.calls[expected.index(9):] == [9, 10, 11]  # the profiler is done: nothing more


@pytest.mark.parametrize("total_steps", (10, 2))
def test_memory_snapshot_records_python_stacks_and_is_written_even_for_a_short_run(
        total_steps, monkeypatch, tmp_path, capsys):
    import torch

    recorded = CudaCalls(monkeypatch)
    inspector = inspection.RunInspection(inspection_args(tmp_path, memory_snapshot=True), torch.device("cuda", 0),
                                         0, total_steps)
    # Python frames only: C++ frames are symbolized when the snapshot is dumped, which can take minutes
    assert recorded.calls == [("record", "all", {"max_entries": 1_000_000, "stacks": "python"})]
    for step in range(total_steps):
        assert inspector.off_clock(step) == (step < inspection.SNAPSHOT_STEPS)
        inspector.step_done(step)
    inspector.finish()
    assert recorded.calls[1:] == ["synchronize", "dump", ("record", None, {})]  # once, then recording stops
    assert (tmp_path / "memory_snapshot.pickle").read_bytes() == b"snapshot"
    steps = min(total_steps, inspection.SNAPSHOT_STEPS)
    assert f"Memory snapshot of the first {steps} steps: " in capsys.readouterr().out


def test_the_gpu_tiers_cudnn_probe_answers_from_a_process_of_its_own():
    """The tier measures cuDNN's attention in a child process (a sticky CUDA error there cannot fail the tier's
    other tests); without a GPU the child still answers its one line, every measurement refused."""
    from gpu import test_attention_kernels

    probe = test_attention_kernels.run_cudnn_probe()
    assert set(probe) == {"dropout", "ms at 0.1", "ms at 0.0"}, probe
    assert all(str(value).startswith("refused: ") for value in probe.values()), probe
