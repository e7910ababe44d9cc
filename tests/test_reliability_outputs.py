"""Runs that survive, round two: resuming at the limit, outputs that cannot be written, signals mid-save.

Every case runs through the real entry points of the three stages (02 under torchrun with two processes);
faults in the file writes come from tests/faulty_writes.py, which runs a stage with one write made to fail.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_script

STAGES = ("00_orig.py", "01_opt_single_gpu.py", "02_opt_multi_gpu_ddp.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def launch(script, *flags, fault=None):
    """The command that runs a stage as a user would (02 under torchrun), optionally with a faulty write."""
    program = ["tests/faulty_writes.py", fault, script] if fault else [script]
    launcher = TORCHRUN if script.startswith("02") else [sys.executable]
    eager = ["--no-compile"] if not script.startswith("00") else []
    return [*launcher, *program, "--tiny", *eager, *map(str, flags)]


def run(command, timeout=240):
    return subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def snapshot(folder):
    """Every file in the folder with its bytes and modification time."""
    return {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in Path(folder).iterdir()
            if path.name != ".run.lock"}  # the lock names the live run's process: not an output


def leftover_temporaries(folder):
    return [path.name for path in Path(folder).iterdir() if path.name.endswith(".tmp")]


def our_tracebacks(stderr, script):
    """Tracebacks of the stage's processes. Under torchrun their lines start with [rankN]; torchrun prints a
    traceback of its own for a failed worker, which is not the stage's."""
    if script.startswith("02"):
        return [line for line in stderr.splitlines() if line.startswith("[rank") and "Traceback" in line]
    return [line for line in stderr.splitlines() if "Traceback" in line]


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.fixture
def short_text(tmp_path, small_text):
    """16,000 characters: 17 steps per --tiny epoch (8 with two processes)."""
    path = tmp_path / "short.txt"
    path.write_text(small_text.read_text(encoding="utf-8")[:16_000], encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# 1. Resuming at or past the limit trains nothing and changes nothing
# ---------------------------------------------------------------------------------------------

# The check is progress.TrainingProgress's, the same code in every stage: every limit in 01, the edge case under torchrun
@pytest.mark.parametrize("script", STAGES[1:])
def test_resume_at_or_past_the_limit_trains_nothing(script, short_text, tmp_path):
    out = tmp_path / "run"
    common_flags = ["--data", short_text, "--out", out, "--eval-freq", 3]
    # a whole epoch: the checkpoint is written at the last step, which is also an epoch boundary
    first = run(launch(script, *common_flags, "--epochs", 1, "--max-steps", 0))
    assert first.returncode == 0, first.stderr[-3000:]
    steps_per_epoch = torch.load(out / "model.pth", weights_only=True)["step"]
    assert steps_per_epoch in (17, 8)  # one process, or two
    before = snapshot(out)
    checkpoint = out / "model.pth"

    every_limit = (["--epochs", 1, "--max-steps", 0],  # the same limit: at the end of the last epoch
                   ["--epochs", 3, "--max-steps", steps_per_epoch],  # --max-steps reached exactly
                   ["--epochs", 3, "--max-steps", 2,  # --max-steps below the checkpoint's step, and another
                    "--out", tmp_path / "elsewhere"])  # --out: a folder that must not be left behind
    # every limit in 01, the edge case (reached exactly) in 02
    for limits in every_limit if script == "01_opt_single_gpu.py" else every_limit[1:2]:
        again = run(launch(script, *common_flags, *limits, "--resume", checkpoint))
        assert again.returncode == 0, again.stderr[-3000:]
        said = [line for line in again.stdout.splitlines() if line.startswith("Nothing left to train")]
        assert len(said) == 1 and f"has done {steps_per_epoch} steps" in said[0], again.stdout
        assert not [line for line in again.stdout.splitlines() if line.startswith("Ep ")]  # no step trained
        assert not our_tracebacks(again.stderr, script)
        assert snapshot(out) == before, limits  # the earlier outputs, byte for byte and untouched
        assert not (tmp_path / "elsewhere").exists()

    if script != "01_opt_single_gpu.py":  # the loop's books are shared; torchrun's resumes: tests/test_resume_matrix.py
        return
    # a limit above the checkpoint trains up to it, and not one step further
    on = run(launch(script, *common_flags, "--epochs", 3, "--max-steps", steps_per_epoch + 2, "--resume", checkpoint))
    assert on.returncode == 0, on.stderr[-3000:]
    assert torch.load(checkpoint, weights_only=True)["step"] == steps_per_epoch + 2


# ---------------------------------------------------------------------------------------------
# 2. An output that cannot be written: exit 1, one line, the previous checkpoint whole, no temporary file
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("script", STAGES)
def test_a_full_disk_mid_run_ends_with_one_line_and_keeps_the_last_checkpoint(script, small_text, tmp_path):
    out = tmp_path / "run"
    # the first checkpoint (step 4) is written; the second (step 8) meets a full disk half-way
    started = time.monotonic()
    result = run(launch(script, "--data", small_text, "--out", out, "--max-steps", 20, "--eval-freq", 4,
                        "--save-every", 4, fault="enospc-save-2"))
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert time.monotonic() - started < 120  # every rank of 02 ended too, with no hang
    assert not our_tracebacks(result.stderr, script), result.stderr[-3000:]
    lines = error_lines(result.stderr)
    named = [line for line in lines if "model.pth" in line]
    assert len(named) == 1 and "No space left on device" in named[0] and "--resume" in named[0], lines
    others = [line for line in lines if line not in named]  # 02's rank 1: one line of its own, no traceback
    assert len(others) == (1 if script.startswith("02") else 0), lines
    assert all("another process of this job ended" in line for line in others), others
    assert torch.load(out / "model.pth", weights_only=True)["step"] == 4  # whole, and the last good one
    assert not leftover_temporaries(out)


def test_a_read_only_folder_for_the_plots_ends_with_one_line(small_text, tmp_path):
    out = tmp_path / "run"
    result = run(launch("01_opt_single_gpu.py", "--data", small_text, "--out", out, "--max-steps", 6,
                        fault="erofs-plot"))
    assert result.returncode == 1, result.stderr[-3000:]
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "loss.pdf" in lines[0] and "Read-only file system" in lines[0], result.stderr
    # training is over and its checkpoint final: a --resume would train nothing and write no plot
    assert "--resume" not in lines[0] and "holds the trained model" in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert torch.load(out / "model.pth", weights_only=True)["step"] == 6 and (out / "metrics.json").exists()
    assert not leftover_temporaries(out)


# ---------------------------------------------------------------------------------------------
# 3. Signals around the save
# ---------------------------------------------------------------------------------------------

def wait_for_line(stream, predicate, deadline):
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            return None
        if predicate(line):
            return line
    return None


@pytest.mark.parametrize("script", ("00_orig.py", "01_opt_single_gpu.py"))
def test_a_second_ctrl_c_while_saving_leaves_the_previous_checkpoint_whole(script, small_text, tmp_path):
    out = tmp_path / "run"
    # --save-every 4: the first save (step 4) is quick; the second (step 8) pauses half-written
    command = launch(script, "--data", small_text, "--out", out, "--epochs", 50, "--eval-freq", 100,
                     "--save-every", 4, fault="slow-save-2")
    proc = subprocess.Popen(command, cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert wait_for_line(proc.stderr, lambda line: line.startswith("SAVING"), time.monotonic() + 120)
        proc.send_signal(signal.SIGINT)  # the first Ctrl-C: it asks to stop after the step (being saved)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)  # the second: quit at once, in the middle of the write
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "interrupted at once" in stderr
    assert torch.load(out / "model.pth", weights_only=True)["step"] == 4  # the previous checkpoint, whole
    assert not leftover_temporaries(out)


def test_a_ctrl_c_inside_torch_save_quits_as_a_ctrl_c(tmp_path, monkeypatch):
    """Where the Ctrl-C lands among torch.save's own writes, its zip writer raises a RuntimeError over it: the run
    must still quit at once (130), not fail with that RuntimeError's traceback (exit 1)."""
    import io

    import checkpoints

    path = tmp_path / "model.pth"
    checkpoints.save_torch({"weights": torch.ones(4)}, path)
    before = path.read_bytes()

    class InterruptedWrites(io.FileIO):
        written = 0

        def write(self, data):
            InterruptedWrites.written += len(data)
            if InterruptedWrites.written > 100_000:  # inside the tensor's record
                raise KeyboardInterrupt
            return super().write(data)

    monkeypatch.setattr(checkpoints, "open", lambda name, mode: InterruptedWrites(name, mode), raising=False)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save_torch({"weights": torch.zeros(250_000)}, path)
    assert path.read_bytes() == before and not leftover_temporaries(tmp_path)


def test_a_ctrl_c_while_an_outcome_is_reported_still_quits_with_130(monkeypatch, capsys):
    import failures

    def main():
        raise failures.OutputError("cannot write metrics.json")

    real_stderr, calls = sys.stderr, []

    class CtrlCOnce:
        def write(self, text):
            calls.append(text)
            if len(calls) == 1:
                raise KeyboardInterrupt  # arrives while the first message is printed
            return real_stderr.write(text)

        def flush(self):
            real_stderr.flush()

    monkeypatch.setattr(sys, "stderr", CtrlCOnce())
    assert failures.run(main) == 130
    assert "interrupted at once" in capsys.readouterr().err


def test_a_ctrl_c_before_anything_was_saved_leaves_no_folder(tmp_path, capsys):
    import checkpoints
    import failures

    out = tmp_path / "new" / "run"

    def main():  # start-up has claimed --out (a folder and its lock file), then Ctrl-C
        checkpoints.claim_out_dir(out)
        raise KeyboardInterrupt

    assert failures.run(main) == 130
    assert not (tmp_path / "new").exists()
    assert "interrupted at once" in capsys.readouterr().err


@pytest.mark.parametrize("script", STAGES)
def test_sighup_saves_and_the_printed_command_alone_finishes_the_run(script, small_text, tmp_path):
    """A closing terminal sends SIGHUP: finish the step, save, exit 128 + 1 (torchrun forwards it to 02). The
    message ends with the command that continues the run; run as printed, it finishes at the interrupted run's
    --max-steps, in the interrupted run's folder."""
    out = tmp_path / "run"
    command = launch(script, "--data", small_text, "--out", out, "--epochs", 50, "--max-steps", 12,
                     "--eval-freq", 3)
    proc = subprocess.Popen(command, cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert wait_for_line(proc.stdout, lambda line: line.startswith("Ep 1, Step 000003"), time.monotonic() + 120)
        proc.send_signal(signal.SIGHUP)
        _, stderr = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert not our_tracebacks(stderr, script), stderr[-3000:]
    if script.startswith("02"):  # one message for the job, from rank 0; torchrun reports the signal after it
        assert proc.returncode != 0 and stderr.count("stopped by SIGHUP after step") == 1, stderr[-3000:]
    else:
        assert proc.returncode == 129, stderr[-3000:]
        assert "stopped by SIGHUP after step" in stderr
    stopped_at = torch.load(out / "model.pth", weights_only=True)["step"]
    assert 4 <= stopped_at < 12
    assert not leftover_temporaries(out)

    lines = stderr.splitlines()
    printed = shlex.split(lines[lines.index(next(line for line in lines if line.endswith("To go on:"))) + 1])
    launcher = {"python": [sys.executable], "torchrun": [sys.executable, "-m", "torch.distributed.run"]}
    assert printed[0] in launcher and script in printed and printed[-2:] == ["--resume", str(out / "model.pth")]
    if script.startswith("02"):
        assert "--nproc_per_node=2" in printed
    resumed = run([*launcher[printed[0]], *printed[1:]])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "from the checkpoint: " in resumed.stdout and "--max-steps 12" in resumed.stdout  # the header says so
    assert torch.load(out / "model.pth", weights_only=True)["step"] == 12  # the interrupted run's own limit
    metrics = json.loads((out / "metrics.json").read_text())  # written into the interrupted run's folder
    assert metrics["steps"] == 12 and metrics["log"][-1]["step"] == 11


def test_a_ctrl_c_while_a_stage_imports_exits_with_130():
    """Before failures.run(main) takes over, a Ctrl-C lands in the stage's imports; once torch._dynamo is imported
    (the stages' @torch.compile lines), Python alone would exit with 1 there, not 130."""
    result = run_script("-c", "import failures, torch._dynamo; raise KeyboardInterrupt", timeout=120)
    assert result.returncode == 130 and result.stderr.rstrip().endswith("KeyboardInterrupt"), result.stderr
