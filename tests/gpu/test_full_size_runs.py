"""The four stages at full size on one GPU: speed, memory, compilation and fidelity, from four shared runs.

Stages 00, 01, 02 and 03 (both under torchrun, one process, NCCL) each train once on the shipped Shakespeare: STEPS
steps of BATCH sequences of 1,024 tokens from the same seed. The batch is 00's, so that the four see the same tokens
in the same order and are evaluated on the same validation batches: their losses compare directly. Every evaluation
covers the whole validation split, whose last batch is short (01 to 03 pad it). The GPU report gives the throughput
at this batch; bench/ladder.py measures each stage at its own.

Budget on one H100: about 6 minutes 15 s for this file: the four runs (their fixtures give each one's share) and a
--tiny run; the checks themselves take no time. Measured on an H100 80GB HBM3, PyTorch 2.11.0+cu130, 2026-11-25:
6 min 44 s (the runs: 00 72 s, 01 86 s, 02 83 s, 03 74 s; the float16 --tiny run 59 s).
"""

import math

import pytest
import torch

import gpu_memory
import timekeeping
import conftest as suite  # tests/conftest.py
from gpu import stage_runs
from gpu.stage_runs import ddp_bucket_splits, log_entries, memory_gb, run_stage, torch_log, traced_frames
from support.sitecustomize import FORCE_PRECISION

BATCH = 8  # 00's own batch: larger ones do not fit its float32 attention matrices
STEPS = 160  # 1.3 M tokens, within one epoch (167 steps at batch 8); 00 takes ~0.25 s a step in float32
EVAL_FREQ = 80  # log lines at steps 0, 80 and 159
# Fidelity: how far apart two stages' validation losses may be (relative), from the measured differences with a
# margin. On one H100 (2026-11-25, bench/results/nvidia-h100-80gb-hbm3/gpu_tier/measured.txt), after the run's 1.3 M
# tokens: 01 against 00 +0.366%, 02 against 01 +0.072%, 03 against 02 -0.089% (other dropout masks, and for 00 other
# initial rows): allowed 1%, 2.7 times the largest. After the first step, where 02 and 01 differ by one step's
# dropout masks: +0.024%, allowed 0.2% (8 times: a single measurement, of a difference that small).
AFTER_THE_RUN, AFTER_THE_FIRST_STEP = 0.01, 0.002
SAMPLE_PROMPT = "Every effort moves you"


@pytest.fixture(scope="module")
def shared_flags(validation_windows):
    every_validation_batch = math.ceil(validation_windows / BATCH)
    return ["--batch-size", BATCH, "--max-steps", STEPS, "--eval-freq", EVAL_FREQ, "--eval-iter",
            every_validation_batch]


@pytest.fixture(scope="module")
def run_00(shared_flags, tmp_path_factory):
    # budget: ~70 s: start-up ~15 s, 160 float32 steps at ~0.25 s, 3 evaluations of 2 x 19 batches, a 2 GB checkpoint
    return run_stage("00_orig.py", *shared_flags, out=tmp_path_factory.mktemp("run_00"), timeout=300)


@pytest.fixture(scope="module")
def run_01(shared_flags, tmp_path_factory):
    # budget: ~90 s: compiling the training and evaluation graphs ~60 s (cold caches), 160 steps at ~0.04 s
    return run_stage("01_opt_single_gpu.py", *shared_flags, out=tmp_path_factory.mktemp("run_01"),
                     env={"TORCH_LOGS": "recompiles,dynamo,aot_graphs"}, timeout=360)


@pytest.fixture(scope="module")
def run_02(shared_flags, tmp_path_factory):
    # budget: ~100 s: as 01, plus torchrun and NCCL start-up (01's one graph: one process splits it at no bucket)
    return run_stage("02_opt_multi_gpu_ddp.py", *shared_flags, out=tmp_path_factory.mktemp("run_02"), torchrun=True,
                     env={"TORCH_LOGS": "recompiles,graph_breaks,dynamo,aot_graphs"}, timeout=420)


@pytest.fixture(scope="module")
def run_03(shared_flags, tmp_path_factory):
    # budget: ~70 s: as 02, but one compiled block serves all twelve (faster to compile), and a sharded checkpoint
    return run_stage("03_opt_multi_gpu_fsdp.py", *shared_flags, out=tmp_path_factory.mktemp("run_03"), torchrun=True,
                     env={"TORCH_LOGS": "recompiles,graph_breaks,dynamo,aot_graphs"}, timeout=420)


def shown(value, spec):
    return "n/a" if value is None else format(value, spec)


def check_full_size_run(run, label, report):
    """What every stage's log must show at full size: the run finished, with tok/s, MFU, reserved memory and its
    wall clock split into phases (compilation from 01 on)."""
    entries = log_entries(run.stdout)
    metrics = run.metrics() if (run.out / "metrics.json").is_file() else {}
    memory = memory_gb(run.stdout)
    report(f"{label}: {STEPS} steps of {BATCH} x 1,024 tokens in {run.seconds:.0f} s (start-up and compilation "
           f"included) | {shown(metrics.get('avg_tok_per_sec'), ',.0f')} tok/s after the first interval | MFU "
           f"{shown(metrics.get('mfu'), '.1%')} | reserved {shown(memory.get('reserved'), '.2f')} GiB at the end, "
           f"peak {shown(metrics.get('peak_reserved_gb'), '.2f')} GiB after the first interval "
           f"({shown(metrics.get('first_interval_peak_reserved_gb'), '.2f')} GiB in it) | final validation loss "
           f"{shown(entries[-1]['val_loss'] if entries else None, '.4f')}")
    assert run.returncode == 0, run.describe()
    logged_steps = sorted({*range(0, STEPS, EVAL_FREQ), STEPS - 1})  # every EVAL_FREQ steps, and the last
    assert [entry["step"] for entry in entries] == logged_steps, f"log lines: {entries}" + run.describe()
    assert all(entry["step_tok_per_sec"] for entry in entries), "a log line without Step tok/sec" + run.describe()
    # not "truthy": the first interval of 01, 02 and 03 holds the compilation and prints "MFU: 0.0%"
    assert all(entry["mfu"] is not None for entry in entries), (
        "log lines without MFU: the header's 'MFU' line says why (is this GPU in utilization.PEAK_TFLOPS?)" + run.describe())
    assert "reserved" in memory, "no 'Reserved memory: ... GiB' line after the epoch" + run.describe()
    assert SAMPLE_PROMPT in run.stdout, "no sample after the epoch" + run.describe()
    report(f"{label}: {timekeeping.wall_clock_line(metrics['wall_clock_s'])}; {run.seconds:.1f} s for the whole command")
    suite.check_wall_clock(run.stdout, run.out, compiled=not label.startswith("00"))
    return metrics


def test_00_trains_at_full_size(run_00, report):  # budget: run_00's
    check_full_size_run(run_00, "00 (float32)", report)


def test_01_trains_at_full_size(run_01, report):  # budget: run_01's
    check_full_size_run(run_01, "01 (bf16, compiled)", report)


def test_01_peak_memory_is_what_the_partition_model_says(run_01, report):
    """cost_model/memory_model.py models 01's peak from what the compiled forward saves (PyTorch's partitioner on fake
    tensors, on the CPU) plus the weights and AdamW's moments (the logits' gradient is written over the saved logits:
    donated buffers). The GPU's own peak checks that
    model (the README quotes it for batch 32), within what the model leaves out: the allocator's workspaces, the
    gradients that the backward allocates while the saved tensors are still alive, fragmentation."""
    # budget: ~10 s of CPU for the model; the run is run_01's
    from cost_model import memory_model

    assert run_01.returncode == 0, run_01.describe()
    metrics = run_01.metrics()
    modelled = memory_model.trace_step(10, batch_size=BATCH)
    measured = metrics["peak_allocated_gb"] * 2**30
    ratio = measured / modelled.peak_bytes
    report(f"01 at batch {BATCH}: peak allocated {measured / 2**30:.2f} GiB, reserved "
           f"{metrics['peak_reserved_gb']:.2f} GiB; cost_model/memory_model.py models {modelled.peak_bytes / 2**30:.2f} "
           f"GiB (saved {modelled.saved_bytes / 2**30:.2f} GiB): measured / modelled {ratio:.2f}")
    assert 0.8 <= ratio <= 1.3, (f"the memory model is off by more than it should be: "
                                 f"{memory_model.report(modelled)}" + run_01.describe())


def test_02_trains_at_full_size_under_torchrun(run_02, report):  # budget: run_02's
    metrics = check_full_size_run(run_02, "02 (torchrun, 1 process, NCCL)", report)
    assert metrics["world_size"] == 1 and "world size: 1" in run_02.stdout, run_02.describe()
    # one rank has nothing to compare its weights with: 02 keeps its checksum and prints no comparison
    assert len(metrics["weight_checksums"]) == 1 and "Weight checksums" not in run_02.stdout, run_02.describe()


def test_03_trains_at_full_size_under_torchrun_with_fsdp2(run_03, report):  # budget: run_03's
    metrics = check_full_size_run(run_03, "03 (torchrun, 1 process, NCCL, FSDP2)", report)
    assert metrics["world_size"] == 1 and "world size: 1" in run_03.stdout, run_03.describe()
    breaks = torch_log(run_03.stderr, "graph_breaks", "Graph break in user code")
    assert not breaks, "TORCH_LOGS=graph_breaks:\n" + "\n".join(breaks[:60]) + run_03.describe()


def test_report_02s_and_03s_steady_state_peaks_beside_the_logits(run_02, run_03, report):
    """A report, no bound: 03 compiles its loss apart from the sharded model, so the logits enter that graph as an
    input and their gradient gets a buffer of its own; at world size 1 sharding saves nothing. How much of that
    buffer a peak holds depends on what else is alive then: on the H100 at batch 8 (2026-11-25) 03 peaked at
    6.17 GiB and 02 at 6.30, beside 0.77 GiB of bf16 logits; in the ladder at batch 32, rung 12 at 1.5 GiB over
    rung 11, beside 3.07."""
    # budget: none (the runs' metrics)
    assert run_02.returncode == 0 and run_03.returncode == 0, run_02.describe() + run_03.describe()
    peaks = {name: run.metrics()["peak_allocated_gb"] for name, run in (("02", run_02), ("03", run_03))}
    metrics = run_03.metrics()
    logits = BATCH * metrics["config"]["context_length"] * metrics["config"]["vocab_size"] * 2 / gpu_memory.GIB
    report(f"steady-state peak allocated at batch {BATCH}: 02 {shown(peaks['02'], '.2f')} GiB, 03 "
           f"{shown(peaks['03'], '.2f')} GiB; bf16 logits {logits:.2f} GiB, weights in bf16 "
           f"{metrics['parameters'] * 2 / gpu_memory.GIB:.2f} GiB")
    assert None not in peaks.values(), "a run without a steady state: more steps than one interval are needed"


@pytest.mark.parametrize("stage", ["01", "02", "03"])
def test_compiled_once_no_recompiles_for_evaluation_padding_or_sample(stage, request, validation_windows, report):
    # budget: none of its own (run_01's and run_02's logs)
    run = request.getfixturevalue(f"run_{stage}")
    frames = traced_frames(run.stderr)
    recompiles = torch_log(run.stderr, "recompiles", "Recompiling function")
    short_rows = validation_windows % BATCH
    report(f"{stage}: torch.compile traced {sorted({name for _, _, name in frames})}, {len(recompiles)} recompile "
           f"lines, over 3 evaluations (the last validation batch: {short_rows} rows padded to {BATCH}) and a sample")
    assert run.returncode == 0, run.describe()
    assert short_rows, f"{validation_windows} validation windows fill whole batches of {BATCH}: no padding is tested"
    assert frames, ("no 'torchdynamo start tracing' line on stderr: did TORCH_LOGS=dynamo take effect?"
                    + run.describe())
    assert not recompiles, "TORCH_LOGS=recompiles:\n" + "\n".join(recompiles[:40]) + run.describe()
    assert all(attempt in (0, None) for _, attempt, _ in frames), f"frames traced more than once: {frames}"
    assert SAMPLE_PROMPT in run.stdout, run.describe()


@pytest.mark.parametrize("stage", ["01", "02", "03"])
def test_compiled_steps_attend_with_flashattention_not_cudnn(stage, request, report):
    """Step 7 turns cuDNN's attention off (it may round the dropout of 0.1 to a multiple of 1/16; see
    test_attention_kernels.py): the graphs torch.compile traced must call FlashAttention's kernels, forward and
    backward, and no other attention kernel. SDPA picks its kernel while the graph is traced, so the graphs say
    which one every step runs."""
    # budget: none of its own (run_01's, run_02's and run_03's logs)
    run = request.getfixturevalue(f"run_{stage}")
    ops = stage_runs.attention_ops(run.stderr)
    report(f"{stage}: attention ops in the compiled graphs: {ops or 'none logged'}")
    assert run.returncode == 0, run.describe()
    assert ops, ("no SDPA op in TORCH_LOGS=aot_graphs' output: PyTorch 2.11 logs no graph it takes from the "
                 "compile cache (tests/gpu/conftest.py gives the tier an empty cache)" + run.describe())
    assert ops == ["_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"], (
        f"the compiled steps attend with {ops}, not FlashAttention alone")


def test_02_at_one_process_compiles_01s_one_graph_without_graph_breaks(run_02, report):  # budget: none (its log)
    breaks = torch_log(run_02.stderr, "graph_breaks", "Graph break in user code")
    frames = [name for _, _, name in traced_frames(run_02.stderr)]
    splits = ddp_bucket_splits(run_02.stderr)
    report(f"02: {len(breaks)} graph-break lines; frames traced: {frames}; graphs split at DDP's buckets "
           f"(DDPOptimizer), with their number of pieces: {splits} (none expected at one process)")
    assert run_02.returncode == 0, run_02.describe()
    assert "training_loss" in frames, "TORCH_LOGS=dynamo did not reach the run: no frame traced" + run_02.describe()
    assert not breaks, ("TORCH_LOGS=graph_breaks: Dynamo stopped tracing inside the training step (DDP's Python, "
                        "contextlib...); the compiled unit should be forward plus loss, called through DDP's "
                        "wrapper:\n" + "\n".join(breaks[:60]) + run_02.describe())
    resumed = [name for name in frames if name.startswith("torch_dynamo_resume_in")]
    assert not resumed, f"frames that resume after a graph break: {resumed}" + run_02.describe()
    # one process has no other rank's all-reduce to overlap with the backward: 02 keeps 01's one graph there
    # (optimize_ddp = world_size > 1); the split at two ranks is checked on the CPU (tests/test_speed_habits.py)
    assert not splits, ("'DDPOptimizer ... created N buckets' (TORCH_LOGS=dynamo): 02 at one process split its "
                        "training graph at DDP's buckets, which only several processes need" + run_02.describe())


def final_validation_loss(run):
    assert run.returncode == 0, run.describe()
    metrics = run.metrics()
    return metrics["log"][-1]["val_loss"], metrics


def compare_validation_losses(reference, candidate, names, allowed, report, why):
    """The relative difference of two runs' final validation losses after the same tokens, reported and checked."""
    loss_reference, metrics_reference = final_validation_loss(reference)
    loss_candidate, metrics_candidate = final_validation_loss(candidate)
    difference = loss_candidate / loss_reference - 1
    report(f"fidelity: validation loss after {metrics_candidate['steps']} steps x {BATCH} x 1,024 = "
           f"{metrics_candidate['tokens_seen']:,} tokens: {names[0]} {loss_reference:.4f}, {names[1]} "
           f"{loss_candidate:.4f}: {difference:+.3%} (allowed: {allowed:.1%})")
    assert metrics_reference["tokens_seen"] == metrics_candidate["tokens_seen"]
    assert abs(difference) <= allowed, (f"{why}\n{names[0]}: {metrics_reference['log']}\n"
                                        f"{names[1]}: {metrics_candidate['log']}")


def test_01_learns_like_00(run_00, run_01, report):  # budget: none (the runs' metrics)
    compare_validation_losses(run_00, run_01, ("00 (float32)", "01 (bf16 autocast)"), AFTER_THE_RUN, report,
                              "the stages draw different initial weights (01's padded vocabulary adds rows), so they "
                              "agree statistically")


def test_02_at_world_size_1_learns_like_01(run_01, run_02, report):  # budget: none (the runs' metrics)
    # The same initial weights, batches, order and learning rate. At one process 02 runs 01's one compiled graph (the
    # test above), so its dropout masks may be 01's too; split at DDP's buckets (as at two processes), each piece
    # drew its own seeds and the runs differed by +0.072% after STEPS steps. After the first step (the log line of
    # step 0) the two must agree closely; after STEPS steps at least as two runs of one stage with other masks do:
    # statistically. The CPU suite shows the exact math (tests/test_stage02_ddp.py: eager, equal weights).
    first_01, first_02 = (run.metrics()["log"][0]["val_loss"] for run in (run_01, run_02))
    report(f"fidelity: validation loss after the first step: 01 {first_01:.4f}, 02 at world size 1 {first_02:.4f}: "
           f"{first_02 / first_01 - 1:+.3%} (allowed: {AFTER_THE_FIRST_STEP:.1%})")
    assert abs(first_02 / first_01 - 1) <= AFTER_THE_FIRST_STEP, (
        "02 starts from other weights or batches than 01, or steps otherwise")
    compare_validation_losses(run_01, run_02, ("01", "02 at world size 1"), AFTER_THE_RUN, report,
                              "dropout masks that may differ make the runs agree at least statistically, as 00 "
                              "and 01 do")


def test_03_at_world_size_1_learns_like_02(run_02, run_03, report):  # budget: none (the runs' metrics)
    compare_validation_losses(run_02, run_03, ("02 at world size 1", "03 at world size 1"), AFTER_THE_RUN, report,
                              "03 gathers its weights in bf16 and compiles block by block (other dropout draws): "
                              "the runs agree statistically")


def test_float16_with_a_gradient_scaler_trains_on_cuda(tmp_path, report):
    # budget: ~35 s: --tiny, compiled for float16 on CUDA (~20 s), 60 steps
    run = run_stage("01_opt_single_gpu.py", "--tiny", "--device", "cuda", "--max-steps", 60, "--eval-freq", 20,
                    out=tmp_path, env={FORCE_PRECISION: "fp16"}, timeout=240, keep_checkpoint=True)
    entries = log_entries(run.stdout)
    checkpoint = (torch.load(tmp_path / "model.pth", map_location="cpu", weights_only=True)
                  if (tmp_path / "model.pth").is_file() else {})
    scale = (checkpoint.get("scaler") or {}).get("scale")
    report(f"float16 + GradScaler (--tiny, 60 steps): validation loss {[entry['val_loss'] for entry in entries]}, "
           f"loss scale at the end {scale} (from 65536: halved at each overflow)")
    assert run.returncode == 0, run.describe()
    assert "precision: fp16" in run.stdout, run.describe()
    assert len(entries) >= 2 and entries[-1]["val_loss"] < entries[0]["val_loss"] - 0.5, run.describe()
    assert scale is not None, "the checkpoint holds no GradScaler state: was the scaler enabled?"
