"""Speed habits of stages 01 and 02, proven on the CPU: costs a GPU run would show and a loss curve would not.

- the loss is compiled with the model: no float32 copy of the batch x tokens x vocabulary logits;
- one compilation of the training step per run, and no recompiles for evaluation, a short last batch or
  the sample;
- no loader worker start-up when an epoch begins;
- stage 02: one compiled graph that DDP wraps, no graph break at one process or two; no blocking collective
  after every step, each rank its own dropout masks, evaluation split across the ranks, collective timeouts
  sized and stated.
"""

import inspect
import itertools
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from conftest import ROOT, load_stage

OPTIMIZED = ("01_opt_single_gpu.py", "02_opt_multi_gpu_ddp.py")
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=OPTIMIZED, ids=["01", "02"])
def stage(request):
    return load_stage(request.param)


def tiny_model(stage):
    torch.manual_seed(0)
    return stage.GPTModel(stage.TINY_CONFIG)


def tiny_batch(stage, batch_size=4):
    torch.manual_seed(1)
    tokens = torch.randint(0, stage.REAL_VOCAB_SIZE, (batch_size, stage.TINY_CONFIG["context_length"] + 1))
    return tokens[:, :-1], tokens[:, 1:]


# ---------------------------------------------------------------------------------------------
# 1. The loss inside the compiled graph: no float32 logits, and a loss that keeps its digits
# ---------------------------------------------------------------------------------------------

def float32_logits_bytes(tokens, real_vocab_size):
    """The smallest float32 copy of a batch's logits: its tokens x the tokenizer's real ids (50,257; the padded
    columns, up to 50,304, are left out, since a copy may drop them), 4 bytes each. A float32 copy of the logits in
    any form allocates at least this much at once."""
    return tokens * real_vocab_size * 4


def largest_allocation(run):
    """The largest single CPU allocation (bytes) made while `run()` executes, from the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return max(event.cpu_memory_usage for event in prof.events() if event.cpu_memory_usage > 0)


def test_no_float32_copy_of_the_logits_in_training_or_evaluation(bf16_cpu):
    """Stage 01's compiled graphs; 02's are the same code (the next test), so the finding holds for both."""
    stage = load_stage("01_opt_single_gpu.py")
    model = tiny_model(stage)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    inputs, targets = tiny_batch(stage)
    float32_logits = float32_logits_bytes(inputs.numel(), stage.REAL_VOCAB_SIZE)  # 51.5 MB: the step's largest, widened

    def training_step():
        optimizer.zero_grad()
        stage.calc_loss_batch(inputs, targets, model, CPU).backward()
        optimizer.step()

    def evaluation():
        model.eval()
        with torch.no_grad():
            stage.calc_loss_batch(inputs, targets, model, CPU)
        model.train()

    training_step(), evaluation()  # compile both graphs first: their compilation is not the step
    largest = {"training": largest_allocation(training_step), "evaluation": largest_allocation(evaluation)}
    print({name: f"{size / 1e6:.1f} MB" for name, size in largest.items()}, f"float32 logits {float32_logits / 1e6} MB")
    # measured: 34.4 MB in training, under 0.1 MB in evaluation (PyTorch 2.15, CPU); a float32 copy of the logits
    # inside the compiled graph does show here (a probe that kept one measured 51.5 MB)
    assert max(largest.values()) < float32_logits


def test_02_compiles_the_model_and_the_loss_of_01_line_for_line():
    """What stage 02 compiles is 01's code: the model's classes and the compiled functions, so that a property of
    01's graphs (above: no float32 logits) is one of 02's. 02 only routes training through the module DDP wraps."""
    stage01, stage02 = load_stage("01_opt_single_gpu.py"), load_stage("02_opt_multi_gpu_ddp.py")

    def source(stage, name):
        function = getattr(stage, name)
        return inspect.getsource(getattr(function, "_torchdynamo_orig_callable", function))  # under @torch.compile

    for name in ("GPTModel", "TransformerBlock", "MultiHeadAttention", "FeedForward", "forward_and_loss",
                 "training_loss", "evaluation_loss"):
        assert source(stage02, name) == source(stage01, name), f"02's {name} is not 01's"
    assert "return training_loss(self.model, input_batch, target_batch)" in source(stage02, "ModelWithLoss")
    assert "return model(input_batch, target_batch)" in source(stage02, "calc_loss_batch")


def test_the_loss_keeps_float32_precision(stage, bf16_cpu):
    """bf16 would round a loss near 10.9 to a multiple of 1/16 (10.875, 10.9375): the loss must not be."""
    model = tiny_model(stage).eval()
    inputs, targets = tiny_batch(stage)
    with torch.no_grad():
        loss = stage.calc_loss_batch(inputs, targets, model, CPU)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(inputs)  # the same bf16 logits, outside the compiled loss
    reference = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), targets.flatten())
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(reference.item(), abs=1e-4)  # a bf16 loss would be off by up to 0.03
    assert loss.item() != loss.bfloat16().item()


def test_a_padded_last_batch_gives_the_loss_of_the_real_rows(stage):
    """The short last validation batch is padded to full size, the padding ignored: the mean is the real one."""
    model = tiny_model(stage).eval()
    inputs, targets = tiny_batch(stage, batch_size=7)
    pairs = list(zip(inputs, targets))
    loader = torch.utils.data.DataLoader(pairs, batch_size=4)  # batches of 4 and 3
    with torch.compiler.set_stance("force_eager"), torch.no_grad():
        expected = [stage.calc_loss_batch(inputs[:4], targets[:4], model, CPU).item(),
                    stage.calc_loss_batch(inputs[4:], targets[4:], model, CPU).item()]
        rows = []  # what the model is given: full batches only, so that a compiled graph sees one shape
        model.register_forward_pre_hook(lambda module, args: rows.append(len(args[0])))
        if stage.__file__.endswith("02_opt_multi_gpu_ddp.py"):
            with single_rank():
                got = stage.calc_loss_loader(loader, model, CPU)
        else:
            got = stage.calc_loss_loader(loader, model, CPU)
    assert rows == [4, 4], rows
    assert got == pytest.approx(sum(expected) / 2, abs=1e-6)


# ---------------------------------------------------------------------------------------------
# 2. One compilation of the training step, no recompiles, through the real entry points
# ---------------------------------------------------------------------------------------------

COMPILE_ID = re.compile(r"\[(\d+)/(\d+)(?:_\d+)?\] Step 1: torchdynamo start tracing (\S+)")


def compiled_frames(stderr):
    """(frame id, attempt, function) of every frame torch.compile traced; attempt > 0 is a recompile."""
    return [(int(frame), int(attempt), name) for frame, attempt, name in COMPILE_ID.findall(stderr)]


_probes = itertools.count()


def check_the_probe_of_breaks_and_recompiles(capfd):
    """The tests that find no "Graph break" and no "Recompiling" line in a run's TORCH_LOGS output would pass as well
    if this PyTorch's logs said it otherwise: a deliberate graph break and a recompile (a new shape) must print
    those words under TORCH_LOGS' graph_breaks and recompiles, here in-process."""
    import torch._dynamo
    import torch._logging

    # a function of its own each time (Dynamo caches a function's compilation by its code object)
    namespace = {"torch": torch}
    exec(compile("def broken(x):\n    x = x + 1\n    torch._dynamo.graph_break()\n    return x * 2\n",
                 f"<graph break probe {next(_probes)}>", "exec"), namespace)
    broken = namespace["broken"]
    capfd.readouterr()
    torch._logging.set_logs(graph_breaks=True, recompiles=True)
    try:
        compiled = torch.compile(broken, backend="eager", dynamic=False)
        compiled(torch.ones(2)), compiled(torch.ones(3))
    finally:
        torch._logging.set_logs()  # back to the defaults
    logged = capfd.readouterr().err
    assert "Graph break" in logged and "Recompiling" in logged, logged[-3000:]


def half_text(small_text, folder):
    """The first half of the small text: 15 steps of 2 x 4 sequences per epoch, a validation split of 14 windows."""
    path = folder / "half.txt"
    path.write_text(small_text.read_text(encoding="utf-8")[:30_000], encoding="utf-8")
    return path


def test_stage01_compiles_its_training_step_once_and_never_recompiles(small_text, tmp_path, capfd):
    # 2 epochs (two samples, train -> eval -> train switches), every validation batch (the last one is short),
    # 2 micro-batches of 4 per step: the step runs the compiled graph twice, at the same shapes
    check_the_probe_of_breaks_and_recompiles(capfd)
    result = subprocess.run(
        [sys.executable, "01_opt_single_gpu.py", "--tiny", "--data", half_text(small_text, tmp_path), "--out",
         tmp_path / "run", "--epochs", "2", "--eval-freq", "10", "--eval-iter", "100", "--grad-accum-steps", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "TORCH_LOGS": "recompiles,dynamo", "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("Every effort moves you") == 2  # a sample after each epoch
    frames = compiled_frames(result.stderr)  # TORCH_LOGS took effect
    assert sorted(name for _, _, name in frames) == ["evaluation_loss", "training_loss"], frames
    assert "Recompiling" not in result.stderr, re.findall(r".*Recompiling.*\n.*\n.*", result.stderr)
    assert all(attempt == 0 for _, attempt, _ in frames)


def test_the_tiny_validation_split_ends_in_a_short_batch(small_text, tokenizer, stage, tmp_path):
    """The run above meets a short last validation batch (what used to trigger a recompile)."""
    from data import load_corpus
    cfg = stage.TINY_CONFIG
    val = stage.SlidingWindowDataset(load_corpus(str(half_text(small_text, tmp_path))).val, cfg["context_length"],
                                     cfg["context_length"])
    assert len(val) % stage.TINY_SETTINGS["batch_size"] != 0 and len(val) < 100 * stage.TINY_SETTINGS["batch_size"]


# ---------------------------------------------------------------------------------------------
# 3. No loader workers to start when an epoch begins
# ---------------------------------------------------------------------------------------------

def test_an_epoch_starts_without_waiting_for_loader_workers(stage, small_text, tokenizer, monkeypatch):
    if stage.__file__.endswith("02_opt_multi_gpu_ddp.py"):  # a sampler for rank 0 of 1, without a process group
        monkeypatch.setattr(stage, "DistributedSampler",
                            lambda dataset, **kwargs: DistributedSampler(dataset, num_replicas=1, rank=0, **kwargs))
    text = small_text.read_text(encoding="utf-8")
    dataset = stage.SlidingWindowDataset(torch.tensor(tokenizer.encode(text)), 64, 64)
    loader = stage.create_dataloader(dataset, 4, shuffle=True, drop_last=True, seed=1)
    assert loader.num_workers == 0 or loader.persistent_workers
    first_batch_seconds = []
    for epoch in range(3):
        started = time.perf_counter()
        batches = iter(loader)
        next(batches)
        first_batch_seconds.append(time.perf_counter() - started)
        for _ in batches:
            pass
    print("first batch of each epoch:", [f"{seconds * 1000:.1f} ms" for seconds in first_batch_seconds])
    # measured here: 0.1-0.9 ms; two workers started anew took about 50 ms (per epoch, on the training clock)
    assert max(first_batch_seconds[1:]) < 0.02


# ---------------------------------------------------------------------------------------------
# 4. Stage 02: the stop flag, dropout per rank, evaluation per rank, timeouts
# ---------------------------------------------------------------------------------------------

class single_rank:
    """Patch torch.distributed so that stage 02's evaluation runs as rank `rank` of `world_size` in-process;
    all_reduce leaves the tensor as it is (the test sums the ranks' shares itself)."""

    def __init__(self, rank=0, world_size=1):
        self.rank, self.world_size = rank, world_size

    def __enter__(self):
        self.saved = dist.get_rank, dist.get_world_size, dist.all_reduce
        dist.get_rank, dist.get_world_size = (lambda: self.rank), (lambda: self.world_size)
        dist.all_reduce = lambda tensor, *args, **kwargs: None

    def __exit__(self, *exc):
        dist.get_rank, dist.get_world_size, dist.all_reduce = self.saved


def test_stage02_ranks_split_the_evaluation_batches():
    stage = load_stage("02_opt_multi_gpu_ddp.py")
    model = tiny_model(stage).eval()
    inputs, targets = tiny_batch(stage, batch_size=20)
    loader = torch.utils.data.DataLoader(list(zip(inputs, targets)), batch_size=4)  # 5 batches
    evaluated = []
    original = stage.calc_loss_batch

    def counting(input_batch, *args):
        evaluated.append(input_batch[0, 0].item())
        return original(input_batch, *args)

    stage.calc_loss_batch = counting
    try:
        with torch.compiler.set_stance("force_eager"), torch.no_grad():
            shares = []
            for rank in range(2):
                with single_rank(rank, 2):
                    shares.append(stage.calc_loss_loader(loader, model, CPU, num_batches=5))
                    evaluated.append("|")
    finally:
        stage.calc_loss_batch = original
    firsts = [batch[0][0, 0].item() for batch in loader]
    assert evaluated == [firsts[0], firsts[2], firsts[4], "|", firsts[1], firsts[3], "|"]
    with torch.compiler.set_stance("force_eager"), torch.no_grad(), single_rank():
        alone = stage.calc_loss_loader(loader, model, CPU, num_batches=5)
    assert sum(shares) == pytest.approx(alone, abs=1e-6)  # the all-reduced sum is the one-rank mean


STOP_WORKER = textwrap.dedent("""
    import json
    import os
    import signal
    import sys
    import time

    import torch.distributed as dist

    sys.path.insert(0, {root!r})
    import checkpoints

    if __name__ == "__main__":
        path = sys.argv[1]
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        stop = checkpoints.StopSignal()
        seconds, agreed = [], []
        for step in range(8):
            if rank == 1 and step == 1:
                time.sleep(1.5)  # rank 1 is slow once: rank 0 must not wait for it at this step's check
            if rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # a signal reaches one rank only
            started = time.perf_counter()
            agreed.append(stop.requested())
            seconds.append(time.perf_counter() - started)
        dist.barrier()
        dist.destroy_process_group()
        with open(path, "w") as f:
            json.dump({{"seconds": seconds, "agreed": agreed}}, f)
""")


def test_stage02_stop_flag_never_blocks_a_step_and_the_ranks_agree(tmp_path):
    from test_stage02_ddp import clean_env, free_port, run_all

    script = tmp_path / "stop_worker.py"
    script.write_text(STOP_WORKER.format(root=str(ROOT)), encoding="utf-8")
    port = free_port()
    paths = [tmp_path / f"rank{rank}.json" for rank in range(2)]
    envs = [clean_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            for rank in range(2)]
    for rc, stdout, stderr in run_all([[sys.executable, script, path] for path in paths], timeout=120, envs=envs):
        assert rc == 0, stdout + stderr
    rank0, rank1 = (json.loads(path.read_text()) for path in paths)
    # rank 0's check at step 1 returns at once, though rank 1 reaches its own check 1.5 s later
    assert rank0["seconds"][1] < 0.5, rank0["seconds"]
    # the signal of step 3 (rank 1 only) is seen by both ranks at the same step, one step later
    assert rank0["agreed"] == rank1["agreed"] == [0, 0, 0, 0, 15, 15, 15, 15]


def test_stage02_timeouts_are_sized_for_a_checkpoint_write_and_stated(monkeypatch):
    import checkpoints

    stage = load_stage("02_opt_multi_gpu_ddp.py")
    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: seen.update(kwargs))
    monkeypatch.setattr(stage.atexit, "register", lambda fn: None)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key in ("MASTER_ADDR", "MASTER_PORT"):  # setup_distributed sets them: restored after the test
        monkeypatch.setenv(key, "unset")
    stage.setup_distributed("cpu")
    # a 2 GB checkpoint at 3.3 MB/s: 600 s; the timeout must cover such a write (it was 60 s)
    timeout = checkpoints.COLLECTIVE_TIMEOUT
    assert seen["timeout"] == timeout and timeout.total_seconds() >= 500
    source = (ROOT / "checkpoints.py").read_text(encoding="utf-8")
    assert re.search(r"new_group\(backend=\"gloo\", timeout=COLLECTIVE_TIMEOUT\)", source)  # not gloo's 30 min
    stated = (ROOT / "docs" / "multi_gpu.md").read_text(encoding="utf-8")  # where the README sends a reader of 02
    assert f"`checkpoints.COLLECTIVE_TIMEOUT`, {timeout.total_seconds() / 60:g} minutes" in stated  # the value itself


def test_stage02_compiles_without_graph_breaks_in_one_process(small_text, tmp_path, capfd):
    """Stage 02 compiles forward and loss as one graph that DDP wraps: no graph break at world size 1 either, with
    gradient accumulation too, and no split per gradient bucket there (the two-rank test below has one)."""
    # Before DDP wrapped the compiled unit, Dynamo traced into DDP's own forward and broke the graph at its
    # _pre_forward and in contextlib frames: 4 "Graph break" lines in this very run.
    from test_stage02_ddp import clean_env, run_all, torchrun

    check_the_probe_of_breaks_and_recompiles(capfd)  # the words searched for below are the ones the logs use
    [(rc, stdout, stderr)] = run_all([torchrun(
        "--standalone", "--nproc_per_node=1", "02_opt_multi_gpu_ddp.py", "--tiny", "--data", small_text,
        "--out", tmp_path / "run", "--max-steps", 4, "--eval-freq", 2, "--eval-iter", 1,
        "--batch-size", 2, "--grad-accum-steps", 2)], timeout=300,  # require_backward_grad_sync off, then on
        envs=[clean_env(TORCH_LOGS="graph_breaks,recompiles,dynamo")])
    assert rc == 0, stdout[-2000:] + stderr[-3000:]
    traced = [name for _, _, name in compiled_frames(stderr)]  # TORCH_LOGS reached the run: dynamo's lines are there
    assert "training_loss" in traced and "evaluation_loss" in traced, stderr[-3000:]
    assert "Graph break" not in stderr, re.findall(r".*Graph break.*", stderr)[:3]
    assert "Recompiling" not in stderr, re.findall(r".*Recompiling.*", stderr)[:3]
    # one process has no all-reduce to overlap: 01's graph, whole, not one per gradient bucket (two ranks: below)
    assert "DDPOptimizer" not in stderr, re.findall(r".*DDPOptimizer.*", stderr)[:3]


def test_stage02_compiled_at_two_ranks_never_recompiles_and_saves_each_ranks_dropout_state(small_text, tmp_path,
                                                                                            capfd):
    """Compiled, two gloo ranks, 2 micro-batches per step (the all-reduce switched off for the first): no
    recompiles, no graph break; the checkpoint holds each rank's own random state, and the ranks' next masks
    differ. (That a resume restores each rank's own state: tests/test_resume_matrix.py, 02 at two processes.)"""
    from test_stage02_ddp import clean_env, run_all, torchrun

    check_the_probe_of_breaks_and_recompiles(capfd)
    out = tmp_path / "run"
    [(rc, stdout, stderr)] = run_all([torchrun(
        "--standalone", "--nproc_per_node=2", "02_opt_multi_gpu_ddp.py", "--tiny", "--data", small_text,
        "--out", out, "--max-steps", 8, "--eval-freq", 4, "--eval-iter", 3, "--batch-size", 2,
        "--grad-accum-steps", 2)], timeout=400,
        envs=[clean_env(TORCH_LOGS="recompiles,dynamo,graph_breaks")])
    assert rc == 0, stdout[-2000:] + stderr[-3000:]
    frames = compiled_frames(stderr)  # TORCH_LOGS took effect: dynamo's lines are there
    assert "training_loss" in [name for _, _, name in frames] and "evaluation_loss" in [n for _, _, n in frames]
    assert "Recompiling" not in stderr
    assert "Graph break" not in stderr, re.findall(r".*Graph break.*", stderr)[:3]  # DDP wraps the compiled unit
    # two ranks: the training graph is split per gradient bucket (DDP's 25 MiB; 26 MB of tiny's weights need two),
    # so that each bucket's all-reduce overlaps the backward of the rest; one process keeps one graph (above)
    assert re.search(r"DDPOptimizer used bucket cap \d+ and created [2-9] buckets", stderr), stderr[-3000:]
    assert all(attempt == 0 for _, attempt, _ in frames), frames
    assert "Weight checksums of the 2 ranks: identical" in stdout  # identical weights despite distinct seeds

    checkpoint = torch.load(out / "model.pth", weights_only=True)
    states = checkpoint["rng"]
    assert isinstance(states, list) and len(states) == 2
    masks = []
    for state in states:  # the next dropout mask each rank would draw
        torch.set_rng_state(state["torch"])
        masks.append(torch.nn.functional.dropout(torch.ones(1000), 0.1) == 0)
    assert not torch.equal(masks[0], masks[1])

    metrics = json.loads((out / "metrics.json").read_text())
    assert "peak_allocated_gb" in metrics and metrics["peak_allocated_gb"] is None  # none on a CPU
    assert all(math.isfinite(entry["val_loss"]) for entry in metrics["log"])
