"""Stage 03 (FSDP2: fully_shard per block, DCP checkpoints) on a CPU: gloo process groups of two on 127.0.0.1.

The torchrun runs are shared between the tests through one module fixture that starts them in two waves of
concurrent processes (the second wave resumes checkpoints of the first), all --tiny with a few steps and all but
one --no-compile; the rest runs in-process. The whole file takes about 170 s of CPU time (user + system), so
about a minute and a half on 2 idle CPU cores.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from argparse import Namespace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import cli
import failures
import sharding
import utilization
from conftest import ROOT, check_wall_clock, load_stage
from support import gradient_check
from support.sitecustomize import FORCE_PRECISION
from test_speed_habits import (check_the_probe_of_breaks_and_recompiles, compiled_frames, float32_logits_bytes,
                                largest_allocation)
from test_stage02_ddp import clean_env, free_port, torchrun

STAGE = "03_opt_multi_gpu_fsdp.py"
TINY_BATCH, TINY_CONTEXT = 4, 64
FP32 = {FORCE_PRECISION: "fp32"}  # float32 everywhere: 02 and 03 must then agree to the last bit
REFERENCE_STEPS, SPLIT_AT = 12, 6


@pytest.fixture(scope="module")
def stage03():
    return load_stage(STAGE)


# ---------------------------------------------------------------------------------------------
# The runs: two waves of processes started together
# ---------------------------------------------------------------------------------------------

class Launch:
    """One command started in the background; wait() gives (returncode, stdout, stderr). Its stderr goes to a file
    (TORCH_LOGS writes a lot there), its stdout to a pipe that can be read line by line while it runs."""

    def __init__(self, command, env):
        self.stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        self.proc = subprocess.Popen(list(map(str, command)), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=self.stderr, encoding="utf-8", errors="replace", start_new_session=True)
        self.lines, self.timed_out = [], False

    def wait_for_log_lines(self, count, timeout):
        """Read stdout until `count` log lines have come (the run is then training); False if it ended first."""
        deadline = time.monotonic() + timeout
        while sum(line.startswith("Ep ") for line in self.lines) < count and time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                return False
            self.lines.append(line)
        return True

    def wait(self, timeout):
        watchdog = threading.Timer(timeout, self.kill, kwargs={"timed_out": True})
        watchdog.start()
        try:
            stdout = "".join(self.lines) + self.proc.stdout.read()  # until the process (group) closes it
            self.proc.wait()
        finally:
            watchdog.cancel()
        self.stderr.seek(0)
        stderr = self.stderr.read()
        if self.timed_out:
            pytest.fail(f"no exit within {timeout} s (a hung process group?): {self.proc.args[-16:]}\n"
                        f"{stdout[-2000:]}\n{stderr[-3000:]}")
        return self.proc.returncode, stdout, stderr

    def kill(self, timed_out=False):
        if self.proc.poll() is None:
            self.timed_out = timed_out
            os.killpg(self.proc.pid, signal.SIGKILL)


def two_processes(*args):
    return torchrun("--standalone", "--nproc_per_node=2", *args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every torchrun and python run of this file. Wave 1: the float32 reference of 03 and the same run of 02,
    6 steps with activation checkpointing on two torchrun "nodes" of one process, and a run stopped by SIGTERM.
    Wave 2: the SIGTERM checkpoint resumed by 1 process at the same global batch, a compiled run with TORCH_LOGS,
    and a --resume of a model.pth without its shards. (Resumes that go on exactly, with and without accumulation,
    and at another process count: tests/test_resume_matrix.py.)"""
    from data import load_text

    root = tmp_path_factory.mktemp("stage03")
    data = root / "small.txt"
    data.write_text(load_text("shakespeare")[:60_000], encoding="utf-8")
    flags = ["--tiny", "--data", data, "--eval-freq", 3, "--eval-iter", 3]  # 3 batches: the ranks split 2 + 1
    fp32 = clean_env(**FP32)
    port = free_port()
    results, launches = {}, {}
    try:
        launches.update({
            "reference": Launch(two_processes(STAGE, *flags, "--no-compile", "--out", root / "reference",
                                              "--max-steps", REFERENCE_STEPS), fp32),
            "stage02": Launch(two_processes("02_opt_multi_gpu_ddp.py", *flags, "--no-compile", "--out",
                                            root / "stage02", "--max-steps", REFERENCE_STEPS), fp32),
            **{f"split_node{node}": Launch(torchrun(
                "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}", "--master_addr=127.0.0.1",
                f"--master_port={port}", STAGE, *flags, "--no-compile", "--activation-checkpointing",
                "--out", root / f"split{node}", "--max-steps", SPLIT_AT), fp32) for node in (0, 1)},
            "sigterm": Launch(two_processes(STAGE, *flags, "--no-compile", "--out", root / "sigterm",
                                            "--epochs", 50, "--eval-freq", 2), clean_env()),
        })
        sigterm = launches["sigterm"]
        if sigterm.wait_for_log_lines(2, timeout=240):
            sigterm.proc.send_signal(signal.SIGTERM)  # torchrun passes it on to both ranks
        results.update({name: launch.wait(timeout=300) for name, launch in launches.items()})
        for name in ("reference", "stage02", "split_node0", "split_node1"):
            assert results[name][0] == 0, f"{name}: {results[name][1][-2000:]}\n{results[name][2][-3000:]}"

        # wave 2
        sigterm_step = torch.load(root / "sigterm" / "model.pth", weights_only=True)["step"]
        results["sigterm_step"] = sigterm_step
        shutil.copytree(root / "sigterm", root / "resharded")  # so the SIGTERM checkpoint itself stays as it was
        no_shards = root / "no_shards"
        no_shards.mkdir()
        shutil.copy(root / "reference" / "model.pth", no_shards / "model.pth")  # without its model.dcp folder
        plain = [sys.executable, STAGE, *flags, "--no-compile"]
        launches = {
            # 1 process goes on from the 2-process checkpoint with the same global batch: 8 sequences a step
            "resharded": Launch([*plain, "--out", root / "resharded", "--eval-freq", 1, "--epochs", 50,
                                 "--batch-size", 2 * TINY_BATCH, "--max-steps", sigterm_step + 2,
                                 "--resume", root / "resharded" / "model.pth"], clean_env()),
            "compiled": Launch(two_processes(STAGE, *flags, "--out", root / "compiled", "--max-steps", 4,
                                             "--eval-freq", 2), clean_env(TORCH_LOGS="recompiles,graph_breaks,dynamo")),
            "no_shards": Launch([*plain, "--out", root / "bad", "--batch-size", 2 * TINY_BATCH,  # the batch it had
                                 "--resume", no_shards / "model.pth"], clean_env()),
        }
        results.update({name: launch.wait(timeout=400) for name, launch in launches.items()})
    finally:  # also on a failure or Ctrl-C: leave no launcher or worker behind
        for launch in launches.values():
            launch.kill()
    return Namespace(root=root, results=results)


def read_metrics(out):
    return json.loads((Path(out) / "metrics.json").read_text(encoding="utf-8"))


def losses(out):
    return {entry["step"]: (entry["train_loss"], entry["val_loss"]) for entry in read_metrics(out)["log"]}


def weights(out):
    return torch.load(Path(out) / "model.pth", weights_only=True)["model"]


# ---------------------------------------------------------------------------------------------
# 1. The same training as stage 02; each rank holds half of it
# ---------------------------------------------------------------------------------------------

def test_losses_and_weights_equal_stage02_in_float32(runs):
    ours, theirs = losses(runs.root / "reference"), losses(runs.root / "stage02")
    assert sorted(ours) == sorted(theirs) == [0, 3, 6, 9, 11]
    for step in ours:  # 02 all-reduces gradients, 03 reduce-scatters them: the same sums in float32
        assert ours[step] == pytest.approx(theirs[step], abs=1e-6), step
    ours, theirs = weights(runs.root / "reference"), weights(runs.root / "stage02")
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6, msg=name)


def test_each_rank_holds_half_of_the_weights_gradients_and_adamw_state(runs, stage03):
    stdout = runs.results["reference"][1]
    assert "world size: 2" in stdout
    assert re.search(r"Memory per rank: .*16 bytes x 6,542,720 parameters / 2 ranks", stdout), stdout
    assert "Memory per rank, measured on the local shards" in stdout
    memory = read_metrics(runs.root / "reference")["memory_per_rank"]
    num_params = sum(p.numel() for p in stage03.GPTModel(stage03.TINY_CONFIG).parameters())
    assert memory["formula_bytes_per_rank"] == 16 * num_params / 2
    ranks = memory["measured"]
    assert len(ranks) == 2
    for rank in ranks:  # float32 shards: 4 bytes per parameter each for weights and gradients, 8 for AdamW
        assert rank["parameter_bytes"] == pytest.approx(4 * num_params / 2, rel=0.01), rank
        assert rank["gradient_bytes"] == rank["parameter_bytes"]
        assert rank["optimizer_state_bytes"] == pytest.approx(2 * rank["parameter_bytes"], abs=1024)  # + AdamW's steps
        assert rank["total_bytes"] == pytest.approx(memory["formula_bytes_per_rank"], rel=0.01)
    assert sum(rank["parameter_bytes"] for rank in ranks) == 4 * num_params  # the shards cover the model once


# ---------------------------------------------------------------------------------------------
# 2. Checkpoints: exact resume, another world size, SIGTERM, the export
# ---------------------------------------------------------------------------------------------

def test_two_nodes_with_activation_checkpointing_train_like_the_reference(runs):
    """Steps 0-5 on two torchrun nodes with every block recomputed: the reference's losses (float32). Node 1's
    process prints nothing and writes its shards into rank 0's folder, none into its own --out."""
    stdout = runs.results["split_node0"][1]
    assert "world size: 2" in stdout and "x 2 processes = 8 sequences" in stdout
    assert not [line for line in runs.results["split_node1"][1].splitlines() if line.startswith("Ep ")]
    assert not list((runs.root / "split1").iterdir())
    assert "activations and logits ~" in stdout and "with activation checkpointing" in stdout  # the header's estimate
    memory_lines = [line for line in stdout.splitlines() if line.startswith("Memory per rank")]
    assert len(memory_lines) == 2 and all(re.search(r"\d GiB\b", line) and "MiB" not in line for line in memory_lines)
    assert not any(re.search(r"\d (GB|MB)\b", line) for line in memory_lines), memory_lines  # one unit: GiB
    reference = losses(runs.root / "reference")
    split = losses(runs.root / "split0")
    assert sorted(split) == [0, 3, 5]
    for step in (0, 3):
        assert split[step] == pytest.approx(reference[step], abs=1e-6), step


def test_sigterm_saves_every_rank_shard_and_one_process_goes_on(runs):
    rc, stdout, stderr = runs.results["sigterm"]
    assert rc != 0, stdout[-2000:]  # torchrun reports the signal
    assert stderr.count("stopped by SIGTERM after step") == 1, stderr[-3000:]  # one message for the job, rank 0's
    step = runs.results["sigterm_step"]
    checkpoint = torch.load(runs.root / "sigterm" / "model.pth", weights_only=True)
    assert step >= 3 and checkpoint["world_size"] == 2 and checkpoint["optimizer"] is None
    shards = runs.root / "sigterm" / checkpoint["sharded_state"]
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    rc, stdout, stderr = runs.results["resharded"]
    assert rc == 0, stdout[-2000:] + stderr[-3000:]
    assert "world size: 1" in stdout and "Resharding: the checkpoint was written by 2" in stdout, stdout
    metrics = read_metrics(runs.root / "resharded")
    before = [entry for entry in metrics["log"] if entry["step"] < step]
    after = [entry for entry in metrics["log"] if entry["step"] >= step]
    assert before == checkpoint["history"]["log"]  # the history goes on
    assert [entry["step"] for entry in after] == [step, step + 1]  # the same global batch: the same step numbers
    assert metrics["tokens_seen"] == checkpoint["history"]["tokens_seen"] + 2 * 2 * TINY_BATCH * TINY_CONTEXT
    # it goes on from the checkpoint's weights: its first loss is the last one logged before, one step further
    last_before = checkpoint["history"]["log"][-1]["train_loss"]
    assert after[0]["train_loss"] == pytest.approx(last_before, abs=0.05)
    assert after[0]["train_loss"] < checkpoint["history"]["log"][0]["train_loss"] - 0.01
    final = torch.load(runs.root / "resharded" / "model.pth", weights_only=True)
    assert final["step"] == step + 2 and final["world_size"] == 1


def test_the_export_loads_into_stage01_and_matches_the_sharded_state(runs, stage03, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint = torch.load(runs.root / "reference" / "model.pth", weights_only=True)
    stage01 = load_stage("01_opt_single_gpu.py")
    theirs, ours = stage01.GPTModel(stage01.TINY_CONFIG).eval(), stage03.GPTModel(stage03.TINY_CONFIG).eval()
    theirs.load_state_dict(checkpoint["model"], strict=True)
    ours.load_state_dict(checkpoint["model"], strict=True)
    tokens = torch.randint(0, stage03.REAL_VOCAB_SIZE, (2, TINY_CONTEXT))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens), ours(tokens), rtol=0, atol=0)
    # the gathered weights are the shards that --resume reads, put together
    dcp_to_torch_save(runs.root / "reference" / checkpoint["sharded_state"], tmp_path / "shards.pt")
    shards = torch.load(tmp_path / "shards.pt", weights_only=True)["model"]
    assert shards.keys() == checkpoint["model"].keys()
    for name, tensor in checkpoint["model"].items():
        assert torch.equal(shards[name], tensor), name


def test_the_last_lines_name_the_sharded_folder_that_model_pth_needs(runs, tmp_path):
    import checkpoints

    stdout = runs.results["reference"][1]
    wrote = [line for line in stdout.splitlines() if line.startswith("Wrote ")]
    assert len(wrote) == 1 and wrote[0].endswith("model.pth with its sharded state in model.dcp/ (copy both to "
                                                 "resume elsewhere)"), wrote
    assert (runs.root / "reference" / "model.dcp").is_dir()
    assert checkpoints.outputs_line(tmp_path) == f"Wrote {tmp_path}/metrics.json, loss.pdf, loss.png and model.pth"


def test_a_checkpoint_without_its_shards_exits_2_with_one_line(runs):
    rc, stdout, stderr = runs.results["no_shards"]
    assert rc == 2, stdout[-1000:] + stderr[-2000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --resume") and "model.dcp/step-000012" in lines[0], stderr
    assert not (runs.root / "bad" / "model.pth").exists()
    assert "Model:" not in stdout  # found when the checkpoint is opened, before the corpus and the model are built


def test_a_checkpoint_of_stage02_is_refused(runs):
    import checkpoints

    with pytest.raises(failures.UsageError, match="written by 02_opt_multi_gpu_ddp.py, not " + STAGE):
        checkpoints.open_checkpoint(runs.root / "stage02" / "model.pth", STAGE)  # at the start, before any slow work


# ---------------------------------------------------------------------------------------------
# 3. torch.compile per block: one graph each, none recompiled by evaluation or generation
# ---------------------------------------------------------------------------------------------

def test_compiled_blocks_never_recompile_nor_break(runs, capfd):
    check_the_probe_of_breaks_and_recompiles(capfd)
    rc, stdout, stderr = runs.results["compiled"]
    assert rc == 0, stdout[-2000:] + stderr[-3000:]
    assert stdout.count("Every effort moves you") == 1 and "Step 000002" in stdout  # it evaluated and generated
    frames = compiled_frames(stderr)  # TORCH_LOGS took effect
    # per rank: the blocks' forward (one graph for both blocks), and the loss for training and for evaluation
    assert sorted(name for _, _, name in frames) == sorted(["forward", "training_loss", "evaluation_loss"] * 2)
    assert "Recompiling" not in stderr, re.findall(r".*Recompiling.*\n.*\n.*", stderr)[:3]
    assert "Graph break" not in stderr, re.findall(r".*Graph break.*", stderr)[:3]
    assert all(attempt == 0 for _, attempt, _ in frames), frames
    check_wall_clock(stdout, runs.root / "compiled", compiled=True)  # the blocks' and the loss's compilation


# ---------------------------------------------------------------------------------------------
# 4. In-process: activation checkpointing's memory and FLOPs, numerics, the out-of-memory hint
# ---------------------------------------------------------------------------------------------

class group_of_one:
    """A gloo process group of this process alone (fully_shard needs one), removed again on the way out."""

    def __enter__(self):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def __exit__(self, *exc):
        dist.destroy_process_group()


def peak_allocated_bytes(run):
    """The most CPU memory held at once while `run()` executes, above what was held when it began: the running sum
    of the allocations and frees the profiler records (each event's own, without its children's)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    records = sorted((event.time_range.start, event.self_cpu_memory_usage) for event in prof.events()
                     if event.self_cpu_memory_usage)
    held = peak = 0
    for _, change in records:
        held += change
        peak = max(peak, held)
    return peak


def sharded_step(stage, cfg, activation_checkpointing, batch):
    """One forward and backward of a fresh sharded model (same seed): the loss, the gradients and the peak memory."""
    torch.manual_seed(0)
    model = stage.GPTModel(cfg)
    stage.shard_model(model, torch.device("cpu"), activation_checkpointing)
    outcome = {}

    def step():
        loss = stage.calc_loss_batch(*batch, model, torch.device("cpu"))
        loss.backward()
        outcome["loss"] = loss.item()

    with torch.compiler.set_stance("force_eager"):
        step()  # the first step allocates FSDP's buffers: measure the second
        model.zero_grad(set_to_none=True)
        outcome["peak"] = peak_allocated_bytes(step)
    outcome["gradients"] = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return outcome


def test_activation_checkpointing_lowers_peak_memory_and_keeps_the_gradients(stage03):
    # more layers and a small vocabulary, so that the blocks' activations (not the logits) dominate the peak
    cfg = {**stage03.TINY_CONFIG, "n_layers": 4, "vocab_size": 512}  # dropout on: recomputation must replay it
    torch.manual_seed(1)
    tokens = torch.randint(0, 512, (4, cfg["context_length"] + 1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    with group_of_one():
        plain = sharded_step(stage03, cfg, False, batch)
        recomputed = sharded_step(stage03, cfg, True, batch)
    print(f"peak: {plain['peak'] / 1e6:.2f} MB without, {recomputed['peak'] / 1e6:.2f} MB with recomputation")
    assert recomputed["peak"] < 0.7 * plain["peak"]
    assert recomputed["loss"] == plain["loss"]
    names = [name.replace("_checkpoint_wrapped_module.", "") for name in recomputed["gradients"]]
    assert names == list(plain["gradients"])
    for name, gradient in zip(names, recomputed["gradients"].values()):
        torch.testing.assert_close(gradient, plain["gradients"][name], rtol=0, atol=0, msg=name)


def test_a_compiled_checkpointed_block_differentiates_the_dropout_its_forward_drew(stage03):
    """03 --activation-checkpointing compiles checkpointed blocks: Inductor keeps each dropout mask's seed, not the
    mask, and draws the mask again in the backward (on this CPU, Dynamo's aot_graphs log shows the draws in the
    backward graph). The backward must then be the gradient of the forward that ran: checked along a random
    direction of the weights, in float32 (support/gradient_check.py; the GPU tier runs the same check at GPT-2
    small's shapes, which checks whether pytorch/pytorch#198333 affects it on PyTorch 2.13+)."""
    torch.manual_seed(0)
    block = checkpoint_wrapper(stage03.TransformerBlock(stage03.TINY_CONFIG))  # dropout 0.1, as in 03
    block.compile()  # as shard_model does, without the sharding (one process: nothing to shard)
    inputs = torch.randn(2, TINY_CONTEXT, stage03.TINY_CONFIG["emb_dim"])
    weights_of_output = torch.randn(inputs.shape)
    try:
        error, control = gradient_check.relative_errors(lambda: (block(inputs) * weights_of_output).sum(),
                                                        list(block.parameters()), eps=0.1)
    finally:
        torch._dynamo.reset()
    print(f"g . v against the central difference: {error:.1e} with the forward's masks, {control:.2f} with others")
    # measured with PyTorch 2.14.1 (2-core CPU, 2026-11-27): error 1e-5 to 4e-4, control 0.15 to 0.88
    assert control > 0.05, "other masks do not move the derivative: the check could not fail"
    assert error < 0.01, "the backward drew other dropout masks than its forward drew"


def test_hardware_flops_count_the_recomputed_forward(stage03):
    """FlopCounterMode sees the recomputation: a training step counted with checkpointed blocks minus one counted
    without them is the formula's difference, the blocks' forward once more."""
    cfg = stage03.TINY_CONFIG

    def recomputing_model():
        model = stage03.GPTModel(cfg)
        for index, block in enumerate(model.trf_blocks):
            model.trf_blocks[index] = checkpoint_wrapper(block)
        return model

    context = cfg["context_length"]
    counted_extra = (utilization.counted_flops_per_token(recomputing_model, context)
                     - utilization.counted_flops_per_token(lambda: stage03.GPTModel(cfg), context))
    formula_extra = (sharding.hardware_flops_per_token(cfg, stage03.REAL_VOCAB_SIZE, True)
                     - sharding.hardware_flops_per_token(cfg, stage03.REAL_VOCAB_SIZE, False))
    assert counted_extra == pytest.approx(formula_extra, rel=1e-9)
    # at XL the blocks are nearly all of the model's FLOPs: HFU is about 8/6 of MFU (the head is not recomputed)
    cfg = {**stage03.GPT_CONFIG_124M, **cli.MODEL_SIZES["gpt2-xl"]}
    hardware, model = sharding.hardware_flops_per_token(cfg, 50257, True), utilization.flops_per_token(cfg, 50257)
    assert hardware / model == pytest.approx(8 / 6, rel=0.02)


def test_the_shards_live_on_the_device_the_run_was_given(stage03, monkeypatch):
    """Left to itself, fully_shard lays its mesh on the machine's accelerator: `--device cpu` on a GPU machine would
    move the weights to the GPU while the batches stay on the CPU. The stage names the mesh's device; here the
    machine claims a GPU it does not have, as a GPU machine's would."""
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda *args: torch.device("cuda"))
    with group_of_one():
        model = stage03.GPTModel(stage03.TINY_CONFIG)
        stage03.shard_model(model, torch.device("cpu"), False)
        devices = {(tensor.device_mesh.device_type, tensor.device.type) for tensor in model.parameters()}
    assert devices == {("cpu", "cpu")}


def test_one_process_keeps_each_blocks_gathered_weights_for_its_backward(stage03, monkeypatch):
    """After a block's forward, FSDP2 frees the weights it gathered and gathers them again for the backward; at one
    process the shards are the whole weights, so 03 keeps them gathered instead (bench/host_time.py: 03 against
    03-resharded). At two processes or more it frees them: that is the memory sharding saves."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(4)
    tokens = torch.randint(0, stage03.REAL_VOCAB_SIZE, (2, TINY_CONTEXT + 1))
    with group_of_one(), torch.compiler.set_stance("force_eager"):
        model = stage03.GPTModel(stage03.TINY_CONFIG)
        stage03.shard_model(model, torch.device("cpu"), False)
        loss = stage03.calc_loss_batch(tokens[:, :-1], tokens[:, 1:], model, torch.device("cpu"))
        held = {type(p).__name__ for block in model.trf_blocks for p in block.parameters()}  # forward done
        loss.backward()
        after_backward = {type(p).__name__ for p in model.parameters()}
    assert held == {"Parameter"}, f"the blocks hold {held} between forward and backward: their shards, not gathered"
    assert after_backward == {DTensor.__name__}, after_backward  # the backward frees them: AdamW steps the shards

    class Mesh:  # all shard_model asks of the mesh at two processes
        def size(self):
            return 2

    chosen = []
    monkeypatch.setattr(stage03.dist, "init_device_mesh", lambda *args, **kwargs: Mesh())
    monkeypatch.setattr(stage03, "fully_shard", lambda module, **options: chosen.append(
        options.get("reshard_after_forward", "the default")))
    with group_of_one():
        stage03.shard_model(stage03.GPTModel(stage03.TINY_CONFIG), torch.device("cpu"), False)
    blocks = stage03.TINY_CONFIG["n_layers"]
    assert chosen == [True] * blocks + ["the default"], chosen  # the blocks reshard; the root unit: FSDP2's own


def test_bf16_gathers_with_autocast_keep_the_loss_near_float32(stage03, bf16_cpu, monkeypatch):
    """The policy gathers bf16 weights and autocast stays: the loss stays float32 (not bf16-rounded) and within
    bf16's rounding of the float32 model's loss."""
    policies, fully_shard = [], stage03.fully_shard
    monkeypatch.setattr(stage03, "fully_shard", lambda module, **options: (
        policies.append(options["mp_policy"]), fully_shard(module, **options))[1])
    cfg = {**stage03.TINY_CONFIG, "drop_rate": 0.0}
    torch.manual_seed(2)
    tokens = torch.randint(0, stage03.REAL_VOCAB_SIZE, (4, cfg["context_length"] + 1))
    torch.manual_seed(0)
    reference_model = stage03.GPTModel(cfg).eval()
    with torch.no_grad():
        reference = F.cross_entropy(reference_model(tokens[:, :-1]).flatten(0, 1).double(), tokens[:, 1:].flatten())
    with group_of_one(), torch.compiler.set_stance("force_eager"):
        torch.manual_seed(0)
        model = stage03.GPTModel(cfg)
        stage03.shard_model(model, torch.device("cpu"), False)
        model.eval()
        with torch.no_grad():
            loss = stage03.calc_loss_batch(tokens[:, :-1], tokens[:, 1:], model, torch.device("cpu"))
        shard_dtypes = {tensor.to_local().dtype for tensor in model.state_dict().values()}
    print(f"bf16 gathers: {loss.item():.6f}, float32: {reference.item():.6f}")
    assert {(policy.param_dtype, policy.reduce_dtype) for policy in policies} == {(torch.bfloat16, torch.float32)}
    assert loss.dtype == torch.float32 and loss.item() != loss.bfloat16().item()
    assert loss.item() == pytest.approx(reference.item(), abs=0.02)
    assert loss.item() != pytest.approx(reference.item(), abs=1e-6)  # bf16 ran: float32 matches to 6 decimals
    assert shard_dtypes == {torch.float32}  # the master weights stay float32


def test_the_compiled_loss_keeps_no_float32_copy_of_the_logits(stage03):
    """The output head runs outside any compiled block, so the loss is compiled alone: its cast to float32 stays
    inside the kernel, in training (with the logits' gradient) and in evaluation."""
    torch.manual_seed(3)
    logits = torch.randn(4, TINY_CONTEXT, stage03.TINY_CONFIG["vocab_size"]).bfloat16().requires_grad_()
    targets = torch.randint(0, stage03.REAL_VOCAB_SIZE, (4, TINY_CONTEXT))

    def training():
        logits.grad = None
        stage03.training_loss(logits, targets).backward()

    def evaluation():
        with torch.no_grad():
            stage03.evaluation_loss(logits.detach(), targets)

    training(), evaluation()  # compile both graphs first
    float32_logits = float32_logits_bytes(logits.shape[0] * logits.shape[1], stage03.REAL_VOCAB_SIZE)  # 51.5 MB
    largest = {"training": largest_allocation(training), "evaluation": largest_allocation(evaluation)}
    print({name: f"{size / 1e6:.1f} MB" for name, size in largest.items()})
    assert max(largest.values()) < float32_logits  # measured: 25.8 MB (the bf16 gradient), and under 0.1 MB
    reference = F.cross_entropy(logits.detach().double().flatten(0, 1), targets.flatten())
    assert stage03.training_loss(logits, targets).item() == pytest.approx(reference.item(), abs=1e-4)


def test_out_of_memory_names_the_levers():
    import failures

    message = str(failures.out_of_memory(torch.device("cpu"), 32, 1024, script=STAGE))
    assert "--batch-size (16)" in message and "--activation-checkpointing" in message and "more GPUs" in message
    assert "\n" not in message
    message = str(failures.out_of_memory(torch.device("cpu"), 32, 1024, script="02_opt_multi_gpu_ddp.py"))
    assert "03_opt_multi_gpu_fsdp.py" in message  # the stages before 03 point to it
