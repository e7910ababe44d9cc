"""--resume across stages, accumulation steps and process counts: every cell of the matrix is a test id.

Each cell resumes the checkpoint that an uninterrupted run wrote on its way (--save-every; tests/recorded_run.py
keeps a copy of it while the run goes on) and trains to the uninterrupted run's end, across an epoch boundary:

- at the process count that wrote it, the run goes on exactly: in float32 (the test hook), with dropout on,
  the same losses at every step and the same final weights, to the last bit, in every stage (00 has no
  accumulation; 02 and 03 at two processes);
- stage 03 at another process count with the same global batch (2 -> 1, and that checkpoint 1 -> 2) trains at
  each step the very windows the uninterrupted run trained at that step (the first ones not yet trained on),
  and goes on learning from its weights: other ranks draw other dropout masks, so the losses agree only closely;
- a changed global batch is refused with one line for the whole launch, and exit code 2 on every rank.

All runs are --tiny, eager, with micro-batches of 2 or 4 sequences on a short text, and start in three waves of
concurrent processes: the uninterrupted runs, the resumes, then the resume of a resumed run. Also resumed
elsewhere: a checkpoint of a run stopped by SIGTERM at two processes, by one (tests/test_stage03_fsdp.py), and
the limits of a resumed run (tests/test_reliability_outputs.py).
"""

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from support.sitecustomize import FORCE_PRECISION
from test_stage02_ddp import clean_env, run_all, torchrun

TEXT_CHARS = 8_000
RECORDER = ROOT / "tests" / "recorded_run.py"


@dataclass
class Uninterrupted:
    """A run of `steps` steps that keeps a copy of its checkpoint after `kept_at` steps."""
    script: str
    processes: int
    batch_size: int
    grad_accum_steps: int
    kept_at: int
    steps: int


@dataclass
class Resume:
    """A cell: resume the checkpoint `source` kept (or, with `after`, the one another cell ended with) with
    `processes` processes and, if given, `grad_accum_steps` (else the checkpoint's), up to `until` steps (else
    `source`'s end)."""
    source: str
    processes: int
    grad_accum_steps: int = None
    until: int = None
    after: str = None

    @property
    def written_by(self):
        return CELLS[self.after].processes if self.after else UNINTERRUPTED[self.source].processes

    @property
    def exact(self):
        return self.processes == self.written_by

    @property
    def accumulation(self):
        return self.grad_accum_steps or UNINTERRUPTED[self.source].grad_accum_steps

    @property
    def steps(self):
        """range of the steps the resumed run trains."""
        first = CELLS[self.after].until if self.after else UNINTERRUPTED[self.source].kept_at
        return range(first, self.until or UNINTERRUPTED[self.source].steps)


# The text gives 33 training windows: an epoch has 8 steps of 4 sequences and 4 of 8 (two processes take 16 each).
# Each resumed part crosses an epoch boundary.
UNINTERRUPTED = {
    "00": Uninterrupted("00_orig.py", 1, 4, 1, kept_at=7, steps=9),
    "01-accum1": Uninterrupted("01_opt_single_gpu.py", 1, 4, 1, kept_at=7, steps=9),
    "01-accum2": Uninterrupted("01_opt_single_gpu.py", 1, 2, 2, kept_at=7, steps=9),
    "02-accum1": Uninterrupted("02_opt_multi_gpu_ddp.py", 2, 2, 1, kept_at=7, steps=9),
    "02-accum2": Uninterrupted("02_opt_multi_gpu_ddp.py", 2, 2, 2, kept_at=3, steps=7),
    "03-accum1": Uninterrupted("03_opt_multi_gpu_fsdp.py", 2, 2, 1, kept_at=7, steps=9),
    "03-accum2": Uninterrupted("03_opt_multi_gpu_fsdp.py", 2, 2, 2, kept_at=3, steps=9),
}
CELLS = {
    "00-1proc": Resume("00", 1),
    "01-1proc-accum1": Resume("01-accum1", 1),
    "01-1proc-accum2": Resume("01-accum2", 1),
    "02-2procs-accum1": Resume("02-accum1", 2),
    "02-2procs-accum2": Resume("02-accum2", 2),
    "03-2procs-accum1": Resume("03-accum1", 2),
    "03-2procs-accum2": Resume("03-accum2", 2),
    # another process count, the same global batch: 2 x 2 x 2 -> 1 x 2 x 4 -> 2 x 2 x 2 (the
    # micro-batch stays, so that the evaluation's batches do too)
    "03-2procs-accum2-on-1proc": Resume("03-accum2", 1, grad_accum_steps=4, until=6),
    "03-1proc-accum4-on-2procs": Resume("03-accum2", 2, grad_accum_steps=2, until=9, after="03-2procs-accum2-on-1proc"),
}
EXACT = [cell for cell, resume in CELLS.items() if resume.exact]
RESHARDED = [cell for cell, resume in CELLS.items() if not resume.exact]
REFUSED = "03-2procs-accum2-refused"  # --grad-accum-steps 1: half the global batch


def launcher(processes):
    return [sys.executable] if processes == 1 else torchrun("--standalone", f"--nproc_per_node={processes}")


def eager(script):
    return [] if script.startswith("00") else ["--no-compile"]  # not kept by a checkpoint: given to every run


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    from data import load_text

    root = tmp_path_factory.mktemp("resume_matrix")
    text = root / "short.txt"
    text.write_text(load_text("shakespeare")[:TEXT_CHARS], encoding="utf-8")
    results = {}

    def wave(launches):
        """Start every (name, processes, script, flags, env) at once; record (rc, stdout, stderr) by name."""
        commands = [[*launcher(processes), RECORDER, script, *flags] for _, processes, script, flags, _ in launches]
        envs = [clean_env(**{FORCE_PRECISION: "fp32", "TRAINED_WINDOWS": str(root / f"{name}.windows"),
                             **env}) for name, *_, env in launches]
        results.update(zip([name for name, *_ in launches], run_all(commands, timeout=600, envs=envs)))

    wave([(name, run.processes, run.script,
           ["--tiny", *eager(run.script), "--data", text, "--batch-size", run.batch_size, "--eval-freq", 1,
            "--eval-iter", 1, "--epochs", 3, "--max-steps", run.steps, "--save-every", run.kept_at,
            "--out", root / name, *(["--grad-accum-steps", run.grad_accum_steps] if run.grad_accum_steps > 1
                                    else [])],  # 00 has no such flag
           {"KEEP_CHECKPOINT_AT": str(run.kept_at), "KEEP_CHECKPOINT_IN": str(root / f"{name}.kept")})
          for name, run in UNINTERRUPTED.items()])
    for name in UNINTERRUPTED:
        assert results[name][0] == 0, f"{name}: {results[name][1][-2000:]}\n{results[name][2][-3000:]}"

    def resume(name, cell):
        script = UNINTERRUPTED[cell.source].script
        if cell.after is None:  # each cell resumes a copy of its own: a resumed run writes into the checkpoint's folder
            shutil.copytree(root / f"{cell.source}.kept", root / name)
        flags = [*(["--grad-accum-steps", cell.grad_accum_steps] if cell.grad_accum_steps else []),
                 *(["--max-steps", cell.until] if cell.until else [])]
        return name, cell.processes, script, [*eager(script), *flags, "--resume", root / name / "model.pth"], {}

    shutil.copytree(root / "03-accum2.kept", root / REFUSED)
    wave([resume(name, cell) for name, cell in CELLS.items() if cell.after is None]
         + [(REFUSED, 2, "03_opt_multi_gpu_fsdp.py", ["--no-compile", "--grad-accum-steps", 1, "--resume",
                                                      root / REFUSED / "model.pth"], {})])
    for name, cell in CELLS.items():
        if cell.after:  # goes on from the end of the cell it follows, in that cell's folder
            assert results[cell.after][0] == 0, results[cell.after][2][-3000:]
            shutil.copytree(root / cell.after, root / name)
    wave([resume(name, cell) for name, cell in CELLS.items() if cell.after])
    return root, results


# ---------------------------------------------------------------------------------------------
# What the runs left
# ---------------------------------------------------------------------------------------------

def read_metrics(out):
    return json.loads((Path(out) / "metrics.json").read_text(encoding="utf-8"))


def logged(out):
    """{step: (epoch, train loss, validation loss)}: every step is logged (--eval-freq 1)."""
    log = read_metrics(out)["log"]
    return {entry["step"]: (entry["epoch"], entry["train_loss"], entry["val_loss"]) for entry in log}


def trained_windows(path, grad_accum_steps, first_step):
    """{step: the set of windows trained at that step, by all the processes}, from a TRAINED_WINDOWS record: each
    process's forward passes in order, grad_accum_steps of them per step."""
    passes = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        rank, *windows = line.split()
        passes.setdefault(rank, []).append(windows)
    steps = {}
    for ranks_passes in passes.values():
        for index, windows in enumerate(ranks_passes):
            steps.setdefault(first_step + index // grad_accum_steps, set()).update(windows)
    return steps


def check_resumed(matrix, cell):
    """The resumed run ended well, said where it goes on from, crossed an epoch boundary, trained the steps it
    should have, each on the windows the uninterrupted run trained at that step. Returns the logs of both runs
    ({step: (epoch, train loss, validation loss)}) and the resumed run's stdout."""
    root, results = matrix
    resume = CELLS[cell]
    rc, stdout, stderr = results[cell]
    assert rc == 0, stdout[-2000:] + stderr[-3000:]
    first, end = resume.steps[0], resume.steps[-1] + 1
    assert f"Resuming {root / cell / 'model.pth'} after step {first - 1:06d}" in stdout, stdout[-3000:]
    reference, resumed = logged(root / resume.source), logged(root / cell)
    assert sorted(resumed) == list(range(end)), sorted(resumed)  # the history goes on, the new steps added
    assert resumed[first - 1][0] < resumed[end - 1][0], "the resumed part crosses no epoch boundary"
    expected = trained_windows(root / f"{resume.source}.windows", UNINTERRUPTED[resume.source].grad_accum_steps, 0)
    trained = trained_windows(root / f"{cell}.windows", resume.accumulation, first)
    assert sorted(trained) == list(resume.steps), sorted(trained)
    for step in trained:
        assert trained[step] == expected[step], f"step {step} trained other windows than the uninterrupted run"
    return reference, resumed, stdout


# ---------------------------------------------------------------------------------------------
# The cells
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cell", EXACT)
def test_a_resumed_run_goes_on_exactly(matrix, cell):
    root, _ = matrix
    reference, resumed, stdout = check_resumed(matrix, cell)
    assert "Resharding" not in stdout
    assert resumed == reference  # every step's epoch and losses, to the last bit
    source = CELLS[cell].source
    ours, theirs = read_metrics(root / cell), read_metrics(root / source)
    assert (ours["steps"], ours["tokens_seen"]) == (theirs["steps"], theirs["tokens_seen"])
    weights = torch.load(root / cell / "model.pth", weights_only=True)["model"]
    expected = torch.load(root / source / "model.pth", weights_only=True)["model"]
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    if cell.startswith("03"):
        # measured after the first step trained, not after the step DCP takes at learning rate 0 to create AdamW's
        # state; and of the shard folders only the one the final model.pth names is left
        assert stdout.index("Memory per rank, measured") > stdout.index("Resuming "), stdout
        checkpoint = torch.load(root / cell / "model.pth", weights_only=True)
        assert [path.name for path in (root / cell / "model.dcp").iterdir()] == [f"step-{ours['steps']:06d}"]
        assert checkpoint["sharded_state"] == f"model.dcp/step-{ours['steps']:06d}"


@pytest.mark.parametrize("cell", RESHARDED)
def test_a_resharded_run_trains_the_next_windows_and_goes_on_learning(matrix, cell):
    root, _ = matrix
    reference, resumed, stdout = check_resumed(matrix, cell)
    resume = CELLS[cell]
    assert (f"Resharding: the checkpoint was written by {resume.written_by} process(es), this run has "
            f"{resume.processes}: DCP reshards") in stdout, stdout[-3000:]
    first, end = resume.steps[0], resume.steps[-1] + 1
    checkpoint_loss = reference[first - 1][2]
    for step in resume.steps:
        # other dropout masks: measured up to 8e-4 apart after 6 steps (the losses fall about 0.02 a step)
        assert resumed[step][2] == pytest.approx(reference[step][2], abs=0.005), (step, resumed[step], reference[step])
    assert resumed[end - 1][2] < checkpoint_loss - 0.01  # it learned on from the checkpoint's weights
    ours, theirs = read_metrics(root / cell), read_metrics(root / resume.source)
    assert ours["tokens_seen"] == theirs["log"][end - 1]["tokens_seen"]
    final = torch.load(root / cell / "model.pth", weights_only=True)
    assert final["step"] == end and final["world_size"] == resume.processes


def test_a_changed_global_batch_is_refused_once_per_launch(matrix):
    root, results = matrix
    rc, stdout, stderr = results[REFUSED]
    before = (root / "03-accum2.kept" / "model.pth").read_bytes()
    assert rc != 0 and not [line for line in stdout.splitlines() if line.startswith("Ep ")]
    errors = [line for line in stderr.splitlines() if "error:" in line and "torch/distributed" not in line]
    assert errors == [f"error: --resume {root / REFUSED / 'model.pth'}: the checkpoint trained 512 tokens per step "
                      "(2 x 2 accumulation steps x 2 processes = 8 sequences), this run 256 (2 x 2 processes = 4 "
                      "sequences): keep the global batch, --batch-size x --grad-accum-steps x processes (how it is "
                      "split may change); with this --batch-size and these processes: --grad-accum-steps 2"], (
        stderr[-3000:])
    assert not [line for line in stderr.splitlines() if line.startswith("[rank") and "Traceback" in line]
    exit_codes = [line.split(":")[1].split()[0] for line in stderr.splitlines() if line.strip().startswith("exitcode")]
    # torchrun's report: the first rank to end exited 2, and every other rank it lists exited 2 too, or was still on
    # its way there when torchrun stopped it (-15, SIGTERM: which rank ends first is a race on a busy machine)
    assert exit_codes and exit_codes[-1] == "2" and set(exit_codes) <= {"2", "-15"}, stderr[-3000:]
    assert (root / REFUSED / "model.pth").read_bytes() == before  # nothing written


def test_a_rank_the_checkpoint_had_no_state_for_draws_its_own_dropout_masks():
    """02 and 03 resumed on more processes than wrote the checkpoint: a new rank must not take another rank's random
    state (that rank's dropout masks, drawn twice), but the one it would have started with: seed + rank."""
    import checkpoints

    saved = [checkpoints.rng_of_rank([], rank, seed=123) for rank in range(2)]  # as two ranks start
    assert checkpoints.rng_of_rank(saved, 1, seed=999) is saved[1]  # a rank the checkpoint had: its own state
    new = checkpoints.rng_of_rank(saved, 2, seed=123)
    torch.set_rng_state(new["torch"])
    masks = [torch.nn.functional.dropout(torch.ones(1000), 0.1) == 0]
    for state in saved:
        torch.set_rng_state(state["torch"])
        masks.append(torch.nn.functional.dropout(torch.ones(1000), 0.1) == 0)
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], masks[2])
    torch.manual_seed(123 + 2)
    assert torch.equal(torch.get_rng_state(), new["torch"])  # what rank 2 seeds itself with at the start
