"""Memory and profiling on the GPU: no float32 logits in a compiled step, --memory-snapshot, the --profile table
and its GPU time by class of work.

Budget on one H100: about 1 minute 40 s for this file.
"""

import pickle
import subprocess
import sys

import pytest
import torch

from conftest import load_stage
from test_chunked_loss import live_head_sized_buffers
from test_speed_habits import float32_logits_bytes
from gpu.stage_runs import ROOT, gpu_time_shares, profile_rows, run_stage

from inspection import PROFILE_ACTIVE, PROFILE_WAIT, PROFILE_WARMUP, SNAPSHOT_STEPS

GB = 1024**3
REGION_LABELS = ("forward with loss", "backward", "optimizer step")  # the stages' labels in the trace


def allocations_during(step):
    """(the peak of allocated memory above what was allocated before, the largest single allocation), in bytes,
    while `step()` runs; the allocator's own history gives the single allocations."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")  # no C++ stacks: fast
    try:
        step()
        torch.cuda.synchronize()
        peak_increase = torch.cuda.max_memory_allocated() - before
        history = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    largest = max((event["size"] for trace in history["device_traces"] for event in trace
                   if event["action"] == "alloc"), default=0)
    return peak_increase, largest


def set_backends_as_stage01_does():
    """What 01's main() sets before it builds the model, for the tests that call its functions in this process."""
    torch.set_float32_matmul_precision("high")  # step 2: TF32
    torch.backends.cuda.enable_cudnn_sdp(False)  # step 7: FlashAttention, not cuDNN's attention


def compiled_steps_of_stage01(stage, cfg, batch):
    """{"training": (peak increase, largest allocation), "evaluation": (...)} of one compiled step of each kind."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = stage.GPTModel(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    tokens = torch.randint(0, stage.REAL_VOCAB_SIZE, (batch, cfg["context_length"] + 1))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # as a loader's batches

    def training_step():
        optimizer.zero_grad()
        stage.calc_loss_batch(inputs, targets, model, device).backward()
        optimizer.step()

    def evaluation_step():
        model.eval()
        with torch.no_grad():
            stage.calc_loss_batch(inputs, targets, model, device)
        model.train()

    training_step(), evaluation_step()  # compile both graphs and create AdamW's state: neither is the step measured
    return {"training": allocations_during(training_step), "evaluation": allocations_during(evaluation_step)}


def test_no_compiled_step_allocates_the_float32_logits(report):
    # budget: ~30 s. Two layers at full width, vocabulary and context, batch 8 (the shapes, and so the kernels, of
    # the full-size runs): compiled in seconds. The logits, the tensor in question, do not depend on the depth.
    stage = load_stage("01_opt_single_gpu.py")
    set_backends_as_stage01_does()
    cfg = {**stage.GPT_CONFIG_124M, "n_layers": 2}
    batch, context = 8, cfg["context_length"]
    float32_logits = float32_logits_bytes(batch * context, stage.REAL_VOCAB_SIZE)  # without the padded columns
    bf16_logits = batch * context * cfg["vocab_size"] * 2  # what the step does allocate
    measured = compiled_steps_of_stage01(stage, cfg, batch)
    torch.cuda.empty_cache()  # the model is gone: leave the GPU to the runs that follow
    report(f"logits of {batch} x {context:,} x {cfg['vocab_size']:,}: bf16 {bf16_logits / GB:.2f} GiB, float32 of the "
           f"{stage.REAL_VOCAB_SIZE:,} real columns {float32_logits / GB:.2f} GiB | " + " | ".join(
               f"{name} step: peak +{peak / GB:.2f} GiB, largest allocation {largest / GB:.2f} GiB"
               for name, (peak, largest) in measured.items()))
    for name, (_, largest) in measured.items():
        assert largest >= bf16_logits, f"{name}: the allocator's history did not see the bf16 logits: {measured}"
        assert largest < float32_logits, (
            f"{name}: one allocation of {largest / GB:.2f} GiB, the size of the float32 logits: the loss widened "
            "them outside its compiled kernel (forward_and_loss and the .float() before cross_entropy)")
    # without gradients to keep, evaluation holds little besides the bf16 logits
    assert measured["evaluation"][0] < float32_logits, measured


def head_training_step(stage, batch):
    """(peak increase, largest allocation, loss, the head's weight gradient, Inductor's generated code) of a compiled
    training step of `stage`'s model with two layers and no dropout, measured on the step after the one that
    compiles."""
    from torch._inductor.utils import run_and_get_code

    device = torch.device("cuda")
    set_backends_as_stage01_does()
    cfg = {**stage.GPT_CONFIG_124M, "n_layers": 2, "drop_rate": 0.0}  # no dropout: the same math in every copy
    torch.manual_seed(0)
    model = stage.GPTModel(cfg).to(device)
    tokens = torch.randint(0, stage.REAL_VOCAB_SIZE, (batch, cfg["context_length"] + 1),
                           generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    losses = []

    def training_step():
        model.zero_grad(set_to_none=True)
        loss = stage.calc_loss_batch(inputs, targets, model, device)
        loss.backward()
        losses.append(loss.item())

    _, code = run_and_get_code(training_step)  # compiles
    peak, largest = allocations_during(training_step)
    return peak, largest, losses[-1], model.out_head.weight.grad.float().clone(), code


def test_the_chunked_loss_keeps_01s_math_and_drops_its_logits(report):
    """The ladder's --option chunked-loss (bench/chunked_loss.py) on the GPU: compiled, it gives 01's loss and head
    gradient, and a training step's peak drops: the saved logits are gone (their gradient was written over them
    anyway), and the head's two gradients and a chunk's logits take a part of their place."""
    # budget: ~40 s: two compilations of a two-layer model at full width, vocabulary and context, batch 8
    from functools import partial

    from bench import chunked_loss, rungs

    batch, chunk = 8, 1024
    plain = rungs.load_stage(rungs.STAGE_01)  # copies in sys.modules: torch.compile (2.11) imports them by name
    chunked = rungs.load_stage(rungs.STAGE_01)
    chunked.forward_and_loss = partial(chunked_loss.forward_and_loss, chunk_tokens=chunk)
    peak_01, _, loss_01, grad_01, _ = head_training_step(plain, batch)
    torch.cuda.empty_cache()
    peak, largest, loss, grad, code = head_training_step(chunked, batch)
    torch.cuda.empty_cache()
    cfg = plain.GPT_CONFIG_124M
    bf16_logits = batch * cfg["context_length"] * cfg["vocab_size"] * 2
    head_error = ((grad - grad_01).norm() / grad_01.norm()).item()
    held = ", ".join(  # what the generated wrapper keeps at once, read as tests/test_chunked_loss.py reads the CPU's
        f"{max((live_head_sized_buffers(part, shape) for part in code), default='n/a (no code captured)')} {name}"
        for name, shape in (("chunk x vocabulary", (chunk, cfg["vocab_size"])),
                            ("vocabulary x width", (cfg["vocab_size"], cfg["emb_dim"]))))
    report(f"chunked loss (chunks of {chunk:,} tokens), batch {batch}, 2 layers: training step peak +{peak / GB:.2f} "
           f"GiB against 01's +{peak_01 / GB:.2f} GiB (bf16 logits {bf16_logits / GB:.2f} GiB), largest allocation "
           f"{largest / GB:.2f} GiB; loss {loss:.5f} against {loss_01:.5f}, head gradient off by {head_error:.2%}; "
           f"buffers held at once in the generated code: {held}")
    # Inductor's generated code beside the report, to read why (on an H200, PyTorch 2.11, it held nine buffers of a
    # chunk's logits' size at once, where the CPU's code in tests/test_chunked_loss.py holds one)
    folder = report.folder / "chunked_loss_code"
    folder.mkdir(exist_ok=True)
    for number, part in enumerate(code):
        (folder / f"part{number}.py").write_text(part, encoding="utf-8")
    assert loss == pytest.approx(loss_01, rel=1e-3) and head_error < 0.02, (loss, loss_01, head_error)
    assert largest < bf16_logits / 2, "an allocation as large as half the logits: the chunks are not chunks"
    assert peak < peak_01 - bf16_logits / 4, (peak, peak_01)  # the model says three quarters of the logits less


@pytest.fixture(scope="module")
def run_00_inspected(tmp_path_factory):
    # budget: ~30 s: stage 00 (nothing to compile), the fewest steps --profile accepts (9 today) at batch 8, full
    # size, a 2 GB checkpoint. One run serves both flags: the snapshot records the first steps, the profile later ones.
    steps = PROFILE_WAIT + PROFILE_WARMUP + PROFILE_ACTIVE
    assert SNAPSHOT_STEPS < PROFILE_WAIT, "the snapshot's steps would fall into the profiled ones (or the one before)"
    out = tmp_path_factory.mktemp("00-inspected")
    return run_stage("00_orig.py", "--batch-size", 8, "--max-steps", steps, "--eval-freq", 100, "--eval-iter", 1,
                     "--memory-snapshot", "--profile", out=out, timeout=240)


def test_memory_snapshot_loads_and_its_steps_are_off_the_clock(run_00_inspected, report):
    # budget: run_00_inspected's
    run = run_00_inspected
    path = run.out / "memory_snapshot.pickle"
    assert run.returncode == 0, run.describe()
    assert path.is_file(), run.describe()
    with open(path, "rb") as f:
        snapshot = pickle.load(f)  # what pytorch.org/memory_viz reads
    events = sum(len(trace) for trace in snapshot["device_traces"])
    metrics = run.metrics()
    tokens_per_step = metrics["tokens_seen"] // metrics["steps"]
    untimed_steps = (metrics["tokens_seen"] - sum(entry["timed_tokens"] for entry in metrics["log"])) / tokens_per_step
    # recorded, then profiled: the step that switches the profiler on, the warm-up and the kept steps
    off_clock = SNAPSHOT_STEPS + 1 + PROFILE_WARMUP + PROFILE_ACTIVE
    report(f"--memory-snapshot (00, {metrics['steps']} steps, with --profile): {path.stat().st_size / 1e6:.1f} MB, "
           f"{events:,} allocator events, {len(snapshot['segments'])} segments; steps left out of tok/s: "
           f"{untimed_steps:g} (recorded {SNAPSHOT_STEPS}, profiled {1 + PROFILE_WARMUP + PROFILE_ACTIVE})")
    assert events > 0, "the snapshot holds no allocator history"
    # The tokens of the recorded and profiled steps must be left out of the timed ones: recording slows every
    # allocation, and the dump after the last recorded step synchronizes and pickles. This reads the run's own
    # bookkeeping, so it holds however fast the GPU is (a tok/s comparison would not: the first interval, where the
    # snapshot falls, is left out of the average anyway).
    assert untimed_steps == off_clock, (
        f"metrics.json log: {metrics['log']}: the steps the snapshot records and the profiler traces should be off "
        "the training clock (RunInspection.off_clock)")


def test_profile_table_ranks_kernels_and_operators_not_the_labelled_regions(run_00_inspected, report):
    # budget: run_00_inspected's
    run, steps = run_00_inspected, PROFILE_WAIT + PROFILE_WARMUP + PROFILE_ACTIVE
    tmp_path = run.out
    rows = profile_rows(run.stdout)
    labels = [row for row in rows if row in REGION_LABELS or row.startswith("ProfilerStep")]
    report(f"--profile (00, {steps} steps): {len(rows)} rows, the top three {rows[:3]}; labelled regions among "
           f"them: {labels or 'none'}")
    assert run.returncode == 0, run.describe()
    assert list((tmp_path / "profile").glob("*.pt.trace.json")), run.describe()
    assert len(rows) >= 5, "no table of top operators after 'Profile of steps ...'" + run.describe()
    assert "Self CUDA" in run.stdout, "the table has no GPU time columns" + run.describe()
    assert not labels, (f"rows that are labels, not work: {labels}; their device-side copies span whole steps and "
                        "top a table sorted by device time" + run.describe())

    # where the step's GPU time went, by class: the kernel-name rules (inspection.kernel_class) on real kernels
    shares = gpu_time_shares(run.stdout)
    [trace] = (tmp_path / "profile").glob("*.pt.trace.json")
    table = subprocess.run([sys.executable, "bench/step_time.py", str(trace)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    report(f"--profile (00): {next((line for line in run.stdout.splitlines() if line.startswith('GPU time')), None)}")
    assert table.returncode == 0, table.stdout + table.stderr
    missing = [work for work in ("matmul", "attention", "loss", "optimizer", "elementwise") if not shares.get(work)]
    assert not missing, (f"no kernel time sorted into {missing}: the kernels' names escaped the rules of "
                         f"inspection.KERNEL_NAME_CLASSES. bench/step_time.py lists the top kernels:\n{table.stdout}")
    accounted = sum(seconds for work, seconds in shares.items() if work != "step")
    assert abs(accounted / shares["step"] - 1) < 0.05, (f"one stream, so the classes and idle should add up to the "
                                                        f"step: {shares}\n{table.stdout}")
