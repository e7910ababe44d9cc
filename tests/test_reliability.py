"""Runs that survive: interrupts, atomic checkpoints, bad checkpoints, out of memory, NaN, dead ranks.

That a resumed run goes on exactly is the matrix of tests/test_resume_matrix.py."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import checkpoints
import failures
from conftest import ROOT, run_script, run_with_fault, wait_for


# SIGTERM's exit code and checkpoint: the process-group test below; a resume after SIGHUP, in every stage:
# tests/test_reliability_outputs.py; exact resumes: tests/test_resume_matrix.py
@pytest.mark.parametrize("signum, exit_code", [(signal.SIGINT, 130)])
def test_interrupt_saves_then_resume_finishes(tmp_path, small_text, signum, exit_code):
    out = tmp_path / "run"
    flags = ["--tiny", "--data", small_text, "--out", out, "--epochs", "50", "--eval-freq", "5"]
    proc = subprocess.Popen([sys.executable, "00_orig.py", *map(str, flags)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        # wait until training has logged a few lines
        lines = []
        while len([line for line in lines if line.startswith("Ep ")]) < 3:
            line = proc.stdout.readline()
            assert line, "the run ended before it could be interrupted"
            lines.append(line)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == exit_code, stderr
    assert "Traceback" not in stderr and "--resume" in stderr
    checkpoint = torch.load(out / "model.pth", weights_only=True)
    assert checkpoint["step"] >= 11  # it trained on after the 3rd log line (step 10) until the signal
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]

    resumed = run_script("00_orig.py", *flags, "--max-steps", checkpoint["step"] + 6, "--resume", out / "model.pth")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert torch.load(out / "model.pth", weights_only=True)["step"] == checkpoint["step"] + 6


def test_save_every_writes_checkpoints_during_the_run(tmp_path, small_text):
    out = tmp_path / "run"
    result = run_script("00_orig.py", "--tiny", "--data", small_text, "--out", out, "--max-steps", "12",
                        "--save-every", "5", "--eval-freq", "100")
    assert result.returncode == 0, result.stderr[-2000:]
    assert torch.load(out / "model.pth", weights_only=True)["step"] == 12
    saved = [line for line in result.stdout.splitlines() if line.startswith("Saved ")]  # each save but the last
    assert saved == [f"Saved {out}/model.pth after step {step:06d} (--save-every 5)" for step in (4, 9)], saved


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "model.pth"
    torch.save({"version": 1}, target)

    def broken_save(tmp):
        with open(tmp, "wb") as f:
            f.write(b"half a checkpoint")
        raise OSError("disk full")

    with pytest.raises(failures.OutputError, match="cannot write .*model.pth: disk full"):  # exit code 1, one line
        checkpoints.save_atomically(broken_save, target)
    assert torch.load(target, weights_only=True) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["model.pth"]  # the partial file is gone

    checkpoints.save_atomically(lambda tmp: torch.save({"version": 2}, tmp), target)
    assert torch.load(target, weights_only=True) == {"version": 2}
    assert oct(target.stat().st_mode & 0o777) != oct(0o600)  # not mkstemp's private mode


def test_a_process_killed_while_saving_leaves_the_old_checkpoint(tmp_path):
    """SIGKILL in the middle of a write: the file is either the old one or the new one, never partial."""
    target = tmp_path / "model.pth"
    torch.save({"version": 1}, target)
    code = f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
import checkpoints
import failures
def slow_save(tmp):
    with open(tmp, "wb") as f:
        f.write(b"x" * 1000)
        f.flush()
        print("writing", flush=True)
        time.sleep(60)
checkpoints.save_atomically(slow_save, {str(target)!r})
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        proc.kill()
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert torch.load(target, weights_only=True) == {"version": 1}


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A real checkpoint of a 6-step 00 --tiny run, for the --resume refusals."""
    from data import load_text
    folder = tmp_path_factory.mktemp("checkpoint")
    text = folder / "small.txt"
    text.write_text(load_text("shakespeare")[:60_000], encoding="utf-8")
    result = run_script("00_orig.py", "--tiny", "--data", text, "--out", folder / "run", "--max-steps", "6")
    assert result.returncode == 0, result.stderr[-2000:]
    return folder / "run" / "model.pth", text


def corrupt(path, tmp_path, how):
    broken = tmp_path / f"{how}.pth"
    data = Path(path).read_bytes()
    broken.write_bytes(data[: len(data) // 2] if how == "truncated" else b"not a checkpoint at all\n" * 10)
    return broken


@pytest.mark.parametrize("case", ["missing", "a-folder", "truncated", "garbage", "other-stage", "other-config",
                                  "other-batch", "other-seed", "other-model", "not-a-checkpoint"])
def test_resume_refuses_bad_checkpoints(tmp_path, tiny_checkpoint, case):
    checkpoint, text = tiny_checkpoint
    script, extra = "00_orig.py", ["--tiny"]
    if case == "missing":
        path = tmp_path / "nope.pth"
    elif case == "a-folder":  # the run's folder instead of its model.pth: the message names the file
        path = checkpoint.parent
    elif case in ("truncated", "garbage"):
        path = corrupt(checkpoint, tmp_path, case)
    elif case == "not-a-checkpoint":
        path = tmp_path / "weights.pth"
        torch.save({"weights": torch.zeros(3)}, path)
    elif case == "other-config":  # --tiny and --model come from the checkpoint: its config must match them
        path = tmp_path / "other-config.pth"
        saved = torch.load(checkpoint, weights_only=True)
        torch.save({**saved, "config": {**saved["config"], "n_layers": 3}}, path)
    else:
        path = checkpoint
        script, extra = {"other-stage": ("01_opt_single_gpu.py", ["--tiny", "--no-compile"]),
                         "other-batch": ("00_orig.py", ["--tiny", "--batch-size", "2"]),
                         "other-seed": ("00_orig.py", ["--tiny", "--seed", "7"]),
                         # --tiny comes from the checkpoint; --model given again would be ignored by it
                         "other-model": ("00_orig.py", ["--model", "gpt2-xl"])}[case]
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.pth").write_bytes(b"sentinel")
    result = run_script(script, *extra, "--data", text, "--out", out, "--resume", path, "--max-steps", "8")
    assert result.returncode == 2, result.stdout[-1000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    message = result.stderr.strip()
    assert message and "\n" not in message, message
    assert "--resume" in message
    expected_word = {"missing": "no such", "a-folder": f"resume {checkpoint}", "truncated": "corrupt", "garbage": "corrupt",
                     "not-a-checkpoint": "not a checkpoint", "other-stage": "00_orig.py",
                     "other-config": "n_layers", "other-batch": "tokens per step",
                     "other-seed": "seed", "other-model": "--tiny model"}[case]
    assert expected_word in message
    assert (out / "model.pth").read_bytes() == b"sentinel"
    assert sorted(path.name for path in out.iterdir()) == ["model.pth"], "a lock file left behind"


def test_an_exit_code_that_main_returns_is_kept():
    """A stage's main() returns nothing (exit 0); a tool's may return its own code, as a --check that finds a page
    out of date returns 1: failures.run must pass it on, not turn it into 0."""
    assert failures.run(lambda: None) == failures.EXIT_OK
    assert failures.run(lambda: 1) == 1
    assert failures.run(lambda: failures.EXIT_USAGE) == failures.EXIT_USAGE


def test_under_torchrun_a_usage_error_found_alike_is_printed_by_the_first_process_of_each_node(
        monkeypatch, capsys, tmp_path):
    """Every process of a job checks the same command line, files and checkpoint: the line comes once per node,
    from LOCAL_RANK 0, and every process exits with 2 (the end-to-end case: tests/test_resume_matrix.py). A
    damaged window of a prepared corpus is found by the process that reads it, whichever that is: it says so."""
    import numpy as np

    import cli
    from data.shards import TokenShards

    def refused():
        raise failures.UsageError("--resume x: refused")

    damaged = tmp_path / "tokens.bin"
    np.array([1, 2, 60000], dtype=np.uint16).tofile(damaged)

    def reads_a_damaged_window():
        TokenShards([damaged], [3])[0:3]

    for local_rank, prints in (("0", True), ("1", False)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert failures.run(refused) == failures.EXIT_USAGE
        assert capsys.readouterr().err == ("error: --resume x: refused\n" if prints else "")
        with pytest.raises(SystemExit) as exited:
            cli.OneLineParser(prog="03_opt_multi_gpu_fsdp.py", allow_abbrev=False).parse_args(["--max-step", "3"])
        assert exited.value.code == failures.EXIT_USAGE
        assert ("unrecognized arguments: --max-step 3" in capsys.readouterr().err) == prints
        assert failures.run(reads_a_damaged_window) == failures.EXIT_USAGE
        assert "token id 60000 at or after position 0" in capsys.readouterr().err  # on either process


def test_checkpoint_holds_what_resume_needs(tiny_checkpoint, stage00):
    checkpoint = torch.load(tiny_checkpoint[0], weights_only=True)
    for key in checkpoints.CHECKPOINT_KEYS:
        assert key in checkpoint, key
    assert checkpoint["script"] == "00_orig.py" and checkpoint["step"] == 6
    assert checkpoint["config"] == stage00.TINY_CONFIG
    assert checkpoint["settings"]["seed"] == 123 and checkpoint["tokens_per_step"] == 4 * 64
    assert isinstance(checkpoint["rng"]["torch"], torch.Tensor)
    assert checkpoint["optimizer"]["state"], "AdamW's moments are saved"


def test_out_of_memory_ends_with_a_hint(tmp_path, small_text):
    fault = """
def out_of_memory(*args, **kwargs):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
stage.train_model = out_of_memory
"""
    result = run_with_fault(tmp_path, small_text, fault, "--batch-size", "8")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    message = result.stderr.strip()
    assert "out of GPU memory" in message and "8 x 64" in message and "a smaller --batch-size (4)" in message
    assert "03_opt_multi_gpu_fsdp.py" in message and "--activation-checkpointing" in message  # the other levers


def test_non_finite_loss_stops_with_exit_1_and_keeps_the_last_good_checkpoint(tmp_path, small_text):
    fault = """
real_loss, calls = stage.calc_loss_batch, []
def loss_that_explodes(input_batch, target_batch, model, device):
    loss = real_loss(input_batch, target_batch, model, device)
    if torch.is_grad_enabled():
        calls.append(1)
        if len(calls) == 8:  # the 8th training step (step 7) goes NaN
            return loss * float("nan")
    return loss
stage.calc_loss_batch = loss_that_explodes
"""
    result = run_with_fault(tmp_path, small_text, fault, "--save-every", "5", "--eval-freq", "10", "--max-steps", "30")
    assert result.returncode == 1, result.stderr[-2000:]
    assert "not finite" in result.stderr and "Traceback" not in result.stderr
    checkpoint = torch.load(tmp_path / "run" / "model.pth", weights_only=True)
    assert checkpoint["step"] == 5  # saved before the NaN; the save at step 10 was refused
    assert all(torch.isfinite(t).all() for t in checkpoint["model"].values())


def child_pids(pid):
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry.name))
    return children


def rank_of(pid):
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(int(item.split(b"=")[1]) for item in environ if item.startswith(b"RANK="))


def test_ddp_job_ends_when_a_rank_dies_and_the_checkpoint_resumes(tmp_path, small_text):
    out = tmp_path / "run"
    flags = ["02_opt_multi_gpu_ddp.py", "--tiny", "--no-compile", "--data", small_text, "--out", out,
             "--epochs", "50", "--eval-freq", "5", "--save-every", "5"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.Popen([*launcher, *map(str, flags)], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert wait_for(lambda: (out / "model.pth").exists(), timeout=120), "no checkpoint was written"
        workers = child_pids(proc.pid)
        assert len(workers) == 2
        victim = next(pid for pid in workers if rank_of(pid) == 1)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait(timeout=90)
        assert time.monotonic() - killed_at < 60
    finally:
        proc.kill()
    assert proc.returncode != 0
    step = torch.load(out / "model.pth", weights_only=True)["step"]
    resumed = subprocess.run([*launcher, *map(str, flags[:-2]), "--max-steps", str(step + 3),
                              "--resume", str(out / "model.pth")], cwd=ROOT, capture_output=True, text=True,
                             timeout=180)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert torch.load(out / "model.pth", weights_only=True)["step"] == step + 3


def start_and_wait_for_log_lines(command, lines_wanted, **popen_args):
    """Start a training command and return it once it has printed `lines_wanted` log lines."""
    proc = subprocess.Popen(command, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}, **popen_args)
    seen = 0
    while seen < lines_wanted:
        line = proc.stdout.readline()
        if not line:
            proc.kill()
            raise AssertionError("the run ended before it could be interrupted: " + proc.stderr.read()[-2000:])
        seen += line.startswith("Ep ")
    return proc


@pytest.mark.parametrize("signum, exit_code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_whole_process_group_saves_and_exits_with_its_code(tmp_path, small_text, signum, exit_code):
    """Ctrl-C in a terminal, or a scheduler's SIGTERM, goes to the whole process group: stage 01 finishes its
    step, saves and exits 128 + the signal's number, without a traceback."""
    out = tmp_path / "run"
    command = [sys.executable, "01_opt_single_gpu.py", "--tiny", "--no-compile", "--data", str(small_text),
               "--out", str(out), "--epochs", "50", "--max-steps", "0", "--eval-freq", "5"]
    proc = start_and_wait_for_log_lines(command, 3, start_new_session=True)
    try:
        os.killpg(proc.pid, signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == exit_code, stderr[-3000:]
    assert "Traceback" not in stderr
    assert torch.load(out / "model.pth", weights_only=True)["step"] >= 11


def test_sigterm_to_torchrun_stops_every_rank_after_the_same_step(tmp_path, small_text):
    """torchrun forwards SIGTERM to each worker's process group: the ranks agree on the step, rank 0 saves."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "02_opt_multi_gpu_ddp.py", "--tiny", "--no-compile", "--data", str(small_text), "--out", str(out),
               "--epochs", "50", "--max-steps", "0", "--eval-freq", "5"]
    proc = start_and_wait_for_log_lines(command, 3)
    try:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode != 0  # torchrun reports the signal it got
    assert stderr.count("stopped by SIGTERM after step") == 1, stderr[-3000:]  # one message, from rank 0
    assert "Connection closed" not in stderr and "exited unexpectedly" not in stderr
    checkpoint = torch.load(out / "model.pth", weights_only=True)  # no --save-every: written on the signal
    assert checkpoint["step"] >= 11


def test_a_changed_global_batch_names_the_accumulation_that_keeps_it(monkeypatch):
    """cli.check_continuation: 01 to 03 are told the --grad-accum-steps that gives the checkpoint's global batch at
    this run's --batch-size and processes, where one does, else a --batch-size and --grad-accum-steps that do; 00
    (no accumulation) the --batch-size; processes that cannot share the checkpoint's batch get no suggestion."""
    import argparse

    import cli

    checkpoint = {"tokens_per_step": 8 * 64, "config": {"context_length": 64}, "settings": {"batch_size": 4,
                                                                                            "grad_accum_steps": 2}}
    monkeypatch.setenv("WORLD_SIZE", "1")

    def refusal(batch_size, grad_accum_steps=None):
        args = argparse.Namespace(resume="model.pth", batch_size=batch_size, seed=123)
        if grad_accum_steps is not None:
            args.grad_accum_steps = grad_accum_steps
        tokens = batch_size * (grad_accum_steps or 1) * cli.processes() * 64
        with pytest.raises(failures.UsageError) as raised:
            cli.check_continuation(checkpoint, args, tokens)
        return str(raised.value)

    assert refusal(2, 1).endswith("; with this --batch-size and these processes: --grad-accum-steps 4")
    assert refusal(8, 2).endswith("; with this --batch-size and these processes: --grad-accum-steps 1")
    assert refusal(3, 1).endswith("; for example --batch-size 2 --grad-accum-steps 4")  # 3 does not divide 8
    assert refusal(16, 1).endswith("; for example --batch-size 8 --grad-accum-steps 1")
    assert refusal(2).endswith("keep the global batch, --batch-size; --batch-size 8")  # stage 00: no accumulation
    monkeypatch.setenv("WORLD_SIZE", "3")  # 8 sequences cannot be shared by 3 processes
    assert refusal(3, 1).endswith("(how it is split may change)")
