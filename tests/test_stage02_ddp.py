"""Stage 02 (DistributedDataParallel) on a CPU: gloo process groups of two on 127.0.0.1.

The runs use --tiny --no-compile and a few steps, so the whole file takes well under two minutes
on 2 CPU cores. torchrun is started as `python -m torch.distributed.run`, which works in any venv.
"""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, check_wall_clock, load_stage, run_script

STAGE = "02_opt_multi_gpu_ddp.py"
LOG_LINE = re.compile(r"^Ep \d+, Step \d{6}, Train: \d+\.\d{3}, Val: \d+\.\d{3}, Step tok/sec: \d+, "
                      r"Avg tok/sec: (\d+|n/a)")
SHARED_FLAGS = ("--data", "--tiny", "--epochs", "--max-steps", "--batch-size", "--eval-freq", "--eval-iter",
                "--device", "--seed", "--out", "--resume", "--save-every", "--profile", "--memory-snapshot")
TINY_BATCH, TINY_CONTEXT = 4, 64


@pytest.fixture(scope="module")
def stage02():
    return load_stage(STAGE)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *map(str, args)]


def clean_env(**extra):
    """The environment of a fresh launch: no torchrun variables inherited from whoever runs the tests."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                          "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    # one thread per process: the tests start two at once, and oversubscribed cores make gloo crawl
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


def run_all(commands, timeout, envs=None):
    """Start every command at once (each with its environment) and wait for all of them, `timeout` s in all.

    On a timeout (a hung process group) every launcher is killed with the workers it started, and the test
    fails with their output. Returns a list of (returncode, stdout, stderr).
    """
    envs = envs or [clean_env()] * len(commands)
    procs = [subprocess.Popen(list(map(str, cmd)), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, encoding="utf-8", errors="replace", start_new_session=True)
             for cmd, env in zip(commands, envs)]
    deadline = time.monotonic() + timeout
    results, timed_out = [], False
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # also on Ctrl-C: leave no launcher or worker behind
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
    if timed_out:
        details = []
        for proc in procs:
            out, err = proc.communicate()
            details.append(f"--- {' '.join(map(str, proc.args[-12:]))} rc={proc.returncode}\n{out[-2000:]}\n"
                           f"{err[-3000:]}")
        pytest.fail(f"no exit within {timeout} s (a hung process group?)\n" + "\n".join(details))
    return results


def load_corpus_train(folder):
    from data.shards import open_prepared
    return open_prepared(folder).train


def read_metrics(out):
    return json.loads((Path(out) / "metrics.json").read_text(encoding="utf-8"))


def log_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith("Ep ")]


# ---------------------------------------------------------------------------------------------
# 1. torchrun with two processes on one node
# ---------------------------------------------------------------------------------------------

def test_torchrun_two_processes_end_to_end(stage02, small_text, tmp_path):
    from data.prepare import prepare

    out, reads = tmp_path / "run", tmp_path / "reads.log"
    steps = 10
    prepare([small_text], tmp_path / "prepared", workers=1, quiet=True)  # a prepared folder, as for a large corpus
    [(rc, stdout, stderr)] = run_all([torchrun(
        "--standalone", "--nproc_per_node=2", STAGE, "--tiny", "--no-compile", "--data", tmp_path / "prepared",
        "--out", out, "--max-steps", steps, "--eval-freq", 5)], timeout=180, envs=[clean_env(DATA_READ_LOG=reads)])
    assert rc == 0, stdout + stderr
    assert "Traceback" not in stderr, stderr

    # each rank reads the training windows it trains on, and no other rank's: the token shards are read window by
    # window (a testing hook logs each read), the evaluation's windows, read in order from the first, aside
    read = {rank: set() for rank in ("0", "1")}
    for line in reads.read_text().splitlines():
        rank, split, start, stop = line.split()
        assert int(stop) - int(start) == TINY_CONTEXT + 1, line
        if split == "train":
            read[rank].add(int(start))
    # the evaluation's loop reads one batch past the eval_iter it uses before it stops (the book's loop)
    evaluated = {window * TINY_CONTEXT for window in range((stage02.TINY_SETTINGS["eval_iter"] + 1) * TINY_BATCH)}
    trained = {rank: starts - evaluated for rank, starts in read.items()}
    assert not trained["0"] & trained["1"], "two ranks read the same training window"
    for rank, starts in read.items():
        assert steps * TINY_BATCH - len(evaluated) <= len(trained[rank]) <= steps * TINY_BATCH, (rank, len(starts))
    windows = len(stage02.SlidingWindowDataset(load_corpus_train(tmp_path / "prepared"), TINY_CONTEXT, TINY_CONTEXT))
    assert len(read["0"] | read["1"]) <= 2 * steps * TINY_BATCH + len(evaluated) < windows  # not the whole split

    # the header, once: world size and the global batch
    headers = [line for line in stdout.splitlines() if line.startswith("PyTorch ")]
    assert len(headers) == 1 and "world size: 2" in headers[0], stdout
    data_lines = [line for line in stdout.splitlines() if line.startswith("Data: ")]
    assert len(data_lines) == 1, stdout
    assert (f"batch {TINY_BATCH} x 2 processes = 8 sequences ({8 * TINY_CONTEXT} tokens) per optimizer step"
            in data_lines[0]), data_lines[0]

    # only rank 0 prints: every log line, sample and summary line once
    lines = log_lines(stdout)
    assert lines and all(LOG_LINE.match(line) for line in lines), stdout
    steps_logged = [int(re.search(r"Step (\d+)", line).group(1)) for line in lines]
    assert steps_logged == [0, 5, 9], stdout  # no duplicates from rank 1
    assert sum(line.startswith("Every effort moves you") for line in stdout.splitlines()) == 1, stdout
    checksum_lines = [line for line in stdout.splitlines() if line.startswith("Weight checksums")]
    assert checksum_lines == ["Weight checksums of the 2 ranks: identical"], stdout
    assert stdout.count("Wrote ") == 1, stdout
    check_wall_clock(stdout, out, compiled=False)  # rank 0's, printed once

    # metrics.json: both replicas, all the tokens of both ranks
    metrics = read_metrics(out)
    assert metrics["script"] == STAGE
    assert metrics["world_size"] == 2
    checksums = metrics["weight_checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1], checksums
    assert metrics["steps"] == steps
    assert metrics["tokens_seen"] == steps * 2 * TINY_BATCH * TINY_CONTEXT
    assert [entry["step"] for entry in metrics["log"]] == [0, 5, 9]
    assert metrics["log"][-1]["tokens_seen"] == steps * 2 * TINY_BATCH * TINY_CONTEXT
    for line, entry in zip(lines, metrics["log"]):
        assert f"Train: {entry['train_loss']:.3f}, Val: {entry['val_loss']:.3f}" in line

    # the checkpoint: the plain model's state dict, no DDP ("module.") nor torch.compile ("_orig_mod.") prefixes
    checkpoint = torch.load(out / "model.pth", weights_only=True)
    keys = list(checkpoint["model"])
    assert not [key for key in keys if key.startswith(("module.", "_orig_mod.")) or "._orig_mod." in key], keys
    model = stage02.GPTModel(stage02.TINY_CONFIG)
    model.load_state_dict(checkpoint["model"], strict=True)
    assert checkpoint["step"] == steps
    assert checkpoint["config"] == stage02.TINY_CONFIG
    # the saved weights are the replicas' weights: their checksum is the one both ranks reported
    saved_sum = sum(tensor.double().sum().item() for tensor in model.state_dict().values()
                    if tensor.is_floating_point())
    assert saved_sum == pytest.approx(checksums[0], rel=1e-12, abs=1e-9)


# ---------------------------------------------------------------------------------------------
# 2. two ranks of a gloo group, run once for the tests below: the DistributedSampler's shards (disjoint,
#    complete, reshuffled per epoch, reproducible), and a loss that is NaN on one rank only
# ---------------------------------------------------------------------------------------------

TWO_RANK_WORKER = textwrap.dedent("""
    import json
    import sys

    import torch
    import torch.distributed as dist

    sys.path.insert(0, {tests_dir!r})
    from conftest import load_stage


    class IndexDataset(torch.utils.data.Dataset):
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __getitem__(self, index):
            return index


    def batches(stage, n, batch_size, seed):
        loader = stage.create_dataloader(IndexDataset(n), batch_size, shuffle=True, drop_last=True, seed=seed)
        epochs = []
        for epoch in (0, 1):
            loader.sampler.set_epoch(epoch)
            epochs.append([batch.tolist() for batch in loader])
        return epochs


    def stops(stage):
        # rank 1's training loss is NaN, rank 0's is not: a rank that stopped alone would leave the other
        # waiting in the next collective
        loss = torch.tensor(float("nan") if dist.get_rank() == 1 else 2.5)
        try:
            stage.check_finite(loss, 7)
        except stage.failures.TrainingError as err:
            return str(err)
        return None


    if __name__ == "__main__":
        n, batch_size, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
        stage = load_stage("02_opt_multi_gpu_ddp.py")
        dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment
        try:
            result = {{"rank": dist.get_rank(), "first": batches(stage, n, batch_size, 123),
                       "again": batches(stage, n, batch_size, 123), "other_seed": batches(stage, n, batch_size, 7),
                       "stops": {{name: stops(load_stage(name))
                                  for name in ("02_opt_multi_gpu_ddp.py", "03_opt_multi_gpu_fsdp.py")}}}}
        finally:
            dist.destroy_process_group()
        with open(path, "w") as f:
            json.dump(result, f)
""")


SHARDED_WINDOWS, SHARD_BATCH = 48, 3  # divisible by 2 ranks x the batch: the shards cover every index


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Each rank's results (a dict), rank 0 first."""
    tmp_path = tmp_path_factory.mktemp("two_ranks")
    script = tmp_path / "two_rank_worker.py"
    script.write_text(TWO_RANK_WORKER.format(tests_dir=str(Path(__file__).resolve().parent)), encoding="utf-8")
    port = free_port()
    paths = [tmp_path / f"rank{rank}.json" for rank in range(2)]
    envs = [clean_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            for rank in range(2)]
    outputs = run_all([[sys.executable, script, SHARDED_WINDOWS, SHARD_BATCH, path] for path in paths],
                      timeout=120, envs=envs)
    for rc, stdout, stderr in outputs:
        assert rc == 0, stdout + stderr
    results = [json.loads(path.read_text()) for path in paths]
    assert [result["rank"] for result in results] == [0, 1]
    return results


def test_a_loss_that_is_nan_on_one_rank_stops_every_rank(two_ranks):
    for stage in ("02_opt_multi_gpu_ddp.py", "03_opt_multi_gpu_fsdp.py"):
        messages = [result["stops"][stage] for result in two_ranks]
        assert all(messages), f"{stage}: a rank went on while another stopped ({messages})"
        assert all("not finite by step 7" in message and "nan" in message for message in messages)


def test_training_shards_are_disjoint_complete_and_reshuffled(two_ranks):
    n, batch_size, world, results = SHARDED_WINDOWS, SHARD_BATCH, 2, two_ranks
    steps_per_epoch = n // (world * batch_size)
    for epoch in (0, 1):
        shards = []
        for result in results:
            epoch_batches = result["first"][epoch]
            assert len(epoch_batches) == steps_per_epoch
            assert all(len(batch) == batch_size for batch in epoch_batches)
            shard = [index for batch in epoch_batches for index in batch]
            assert len(set(shard)) == len(shard), f"rank {result['rank']} sees an index twice in epoch {epoch}"
            shards.append(shard)
        assert not set(shards[0]) & set(shards[1]), f"the ranks share windows in epoch {epoch}"
        assert sorted(shards[0] + shards[1]) == list(range(n)), f"epoch {epoch} does not cover the data"
        assert shards[0] != sorted(shards[0]), "the training order is not shuffled"

    for result in results:
        first = result["first"]
        assert first[0] != first[1], f"rank {result['rank']}: epoch 1 repeats epoch 0's order (no set_epoch?)"
        assert set(sum(first[0], [])) != set(sum(first[1], [])), "each epoch must redeal the shards, too"
        assert result["again"] == first, "the same seed must give the same order"
        assert result["other_seed"] != first, "--seed must change the order"


# ---------------------------------------------------------------------------------------------
# 3. a group of one (plain python) trains exactly like stage 01
# ---------------------------------------------------------------------------------------------

def test_world_size_one_matches_stage01(small_text, tmp_path):
    # 4,000 characters: 16 training windows, 4 steps per epoch; two epochs check the reshuffle at the boundary
    data = tmp_path / "short.txt"
    data.write_text(small_text.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    flags = ["--tiny", "--no-compile", "--data", data, "--epochs", "2", "--max-steps", "0", "--eval-freq", "3"]
    results = run_all([[sys.executable, "01_opt_single_gpu.py", *flags, "--out", tmp_path / "s01"],
                       [sys.executable, STAGE, *flags, "--out", tmp_path / "s02"]], timeout=180)
    for rc, stdout, stderr in results:
        assert rc == 0, stdout + stderr
    stdout_02 = results[1][1]
    assert "world size: 1" in stdout_02
    assert f"batch {TINY_BATCH} x {TINY_CONTEXT} tokens" in stdout_02  # one process: the batch is the global one
    assert "Weight checksums" not in stdout_02  # one rank has nothing to compare with

    m01, m02 = read_metrics(tmp_path / "s01"), read_metrics(tmp_path / "s02")
    assert m02["world_size"] == 1 and m01["world_size"] == 1
    assert len(m02["weight_checksums"]) == 1
    assert m02["steps"] == m01["steps"] == 8
    assert m02["tokens_seen"] == m01["tokens_seen"] == 8 * TINY_BATCH * TINY_CONTEXT
    assert [(e["epoch"], e["step"]) for e in m02["log"]] == [(1, 0), (1, 3), (2, 6), (2, 7)]
    assert [(e["epoch"], e["step"]) for e in m01["log"]] == [(1, 0), (1, 3), (2, 6), (2, 7)]
    for e01, e02 in zip(m01["log"], m02["log"]):
        assert e02["train_loss"] == pytest.approx(e01["train_loss"], abs=1e-6), (e01, e02)
        assert e02["val_loss"] == pytest.approx(e01["val_loss"], abs=1e-6), (e01, e02)
    # stronger than the bf16-rounded losses: the same batches in the same order (both epochs) give the same weights
    w01 = torch.load(tmp_path / "s01" / "model.pth", weights_only=True)["model"]
    w02 = torch.load(tmp_path / "s02" / "model.pth", weights_only=True)["model"]
    assert w01.keys() == w02.keys()
    for name in w01:
        torch.testing.assert_close(w02[name], w01[name], rtol=0, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------
# 4. two torchrun "nodes" of one process each: the global rank comes from RANK, not LOCAL_RANK
# ---------------------------------------------------------------------------------------------

def test_two_nodes_of_one_process(small_text, tmp_path):
    port = free_port()
    commands = [torchrun("--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}", "--master_addr=127.0.0.1",
                         f"--master_port={port}", STAGE, "--tiny", "--no-compile", "--data", small_text,
                         "--out", tmp_path / name, "--max-steps", 4, "--eval-freq", 2)
                for node, name in ((0, "a"), (1, "b"))]
    (rc0, out0, err0), (rc1, out1, err1) = run_all(commands, timeout=120)
    assert rc0 == 0, out0 + err0
    assert rc1 == 0, out1 + err1

    assert "world size: 2" in out0 and "x 2 processes = 8 sequences" in out0, out0
    assert [int(re.search(r"Step (\d+)", line).group(1)) for line in log_lines(out0)] == [0, 2, 3], out0
    assert "Weight checksums of the 2 ranks: identical" in out0, out0
    # node 1's only process is global rank 1: it prints nothing and writes nothing
    assert not log_lines(out1) and "world size" not in out1 and "Weight checksums" not in out1, out1
    assert not (tmp_path / "b" / "metrics.json").exists() and not (tmp_path / "b" / "model.pth").exists()

    metrics = read_metrics(tmp_path / "a")
    assert metrics["world_size"] == 2
    assert len(metrics["weight_checksums"]) == 2 and len(set(metrics["weight_checksums"])) == 1
    assert metrics["tokens_seen"] == 4 * 2 * TINY_BATCH * TINY_CONTEXT


# ---------------------------------------------------------------------------------------------
# 5. more processes per node than GPUs: a usage error before any process group exists
# ---------------------------------------------------------------------------------------------

def test_more_processes_than_gpus_is_a_usage_error(stage02, monkeypatch):
    import failures
    import torch.distributed as dist

    for key, value in dict(LOCAL_WORLD_SIZE="4", RANK="0", LOCAL_RANK="0", WORLD_SIZE="4").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    created = []

    def no_group(*args, **kwargs):  # had the check been missed, fail here instead of waiting for 3 more ranks
        created.append((args, kwargs))
        raise AssertionError("a process group was created")

    monkeypatch.setattr(dist, "init_process_group", no_group)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    assert not dist.is_initialized()
    with pytest.raises(failures.UsageError) as err:
        stage02.setup_distributed("cuda")
    message = str(err.value)
    assert "--nproc_per_node=2" in message and "4" in message, message
    assert not created and not dist.is_initialized()


# ---------------------------------------------------------------------------------------------
# 6. --help, and the README's word on per-process and global batches
# ---------------------------------------------------------------------------------------------

def test_help_lists_the_flags():
    result = run_script(STAGE, "--help", timeout=120)
    assert result.returncode == 0, result.stderr
    for flag in (*SHARED_FLAGS, "--no-compile"):
        assert flag in result.stdout, flag
    assert "torchrun" in result.stdout  # the docstring says how to launch it


MULTI_GPU_HEADING = re.compile(r"multi-?gpu|(several|multiple|many) gpus|multi-?node|ddp|distributed|torchrun"
                               r"|data parallel", re.I)


def test_readme_documents_per_process_and_global_batch():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    headings = list(re.finditer(r"^(#{2,4}) (.+)$", readme, flags=re.MULTILINE))
    section = None
    for i, heading in enumerate(headings):
        if MULTI_GPU_HEADING.search(heading.group(2)):
            level = len(heading.group(1))
            end = next((h.start() for h in headings[i + 1:] if len(h.group(1)) <= level), len(readme))
            section = readme[heading.start():end]
            break
    assert section is not None, "the README needs a multi-GPU section"
    assert re.search(r"per[- ](process|rank|gpu)|each (process|rank|gpu)", section, re.I), \
        "the multi-GPU section should say that --batch-size is per process"
    assert re.search(r"global batch|effective batch|total batch", section, re.I), \
        "the multi-GPU section should give the global batch (processes x --batch-size)"


def test_a_resume_at_another_process_count_says_what_it_keeps(monkeypatch):
    """02 resumes at another number of processes when the global batch is the same: its resume line says so, and
    which ranks draw new dropout masks; 03 says it in its "Resharding" line, 00 and 01 run one process."""
    import argparse

    import checkpoints
    import cli

    args = argparse.Namespace(resume="runs/x/model.pth", tiny=False)
    of_02 = checkpoints.Checkpoint({"step": 8, "epoch": 1, "rng": [{}, {}]})  # two ranks' random states
    monkeypatch.setenv("WORLD_SIZE", "1")
    fewer = cli.resume_line(args, of_02)
    assert fewer == ("Resuming runs/x/model.pth after step 000007 (epoch 2) | written by 2 process(es), this run "
                     "has 1: the global batch is the same, so each step trains the same windows"), fewer
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert cli.resume_line(args, of_02).endswith(
        "this run has 4: the global batch is the same, so each step trains the same windows; ranks the checkpoint "
        "had no random state for draw new dropout masks")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "written by" not in cli.resume_line(args, of_02)
    monkeypatch.setenv("WORLD_SIZE", "1")
    of_03 = checkpoints.Checkpoint({"step": 8, "epoch": 1, "rng": [{}, {}], "world_size": 2})
    of_01 = checkpoints.Checkpoint({"step": 8, "epoch": 1, "rng": {}})
    assert "written by" not in cli.resume_line(args, of_03) + cli.resume_line(args, of_01)
