"""Gradient accumulation (--grad-accum-steps, stages 01 to 03): N micro-batches of B give the gradients of one batch
of N x B, through the real entry points, at one process and at two (02's all-reduce once per optimizer step, 03's
reduce-scatter after every micro-batch); the header states the global batch; bad values and resumes that change the
global batch are refused; the ladder's option and the roofline count it.

The exact checks run in float32 (the test hook) with dropout off (a wrapper sets the tiny config's rate to 0): with
dropout on, one pass over 4 sequences and four passes over 1 draw different masks, and the runs agree only
statistically (the last test states how closely). They compare the gradients themselves, as the first optimizer
step sees them (the wrapper saves them), then the weights after three AdamW steps and the losses on the way: AdamW
nearly ignores the gradients' scale, so the weights alone would hardly notice a sum of micro-batch losses left
undivided.
"""

import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, run_script
from support.sitecustomize import FORCE_PRECISION
from test_stage02_ddp import clean_env, torchrun
from test_stage03_fsdp import weights as sharded_weights

FP32 = {FORCE_PRECISION: "fp32"}
STEPS = 3  # AdamW's first step is sign(gradient) x lr; by the third the updates depend on the gradients' values
NO_DROPOUT = """import os
import sys
sys.path[:0] = [{root!r}, {tests!r}]
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from conftest import load_stage
import failures
stage = load_stage({script!r})
stage.TINY_CONFIG["drop_rate"] = 0.0


def save_first_gradients(optimizer, args, kwargs):
    # what the first optimizer step sees: the micro-batches' sum, after 02's all-reduce or 03's reduce-scatter;
    # whole tensors (03's are shards of DTensors), in the order of the model's parameters, from rank 0
    hook.remove()
    gradients = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                 for group in optimizer.param_groups for p in group["params"]]
    if os.environ.get("RANK", "0") == "0":
        torch.save(gradients, os.environ["FIRST_GRADIENTS"])


hook = register_optimizer_step_pre_hook(save_first_gradients)
sys.exit(failures.process_done(failures.run(stage.main)))
"""


def without_dropout(tmp_path, script):
    """A file that runs `script`'s main with the tiny model's dropout off, saving the first step's gradients to
    $FIRST_GRADIENTS: python or torchrun can start it."""
    path = tmp_path / f"no_dropout_{script}"
    path.write_text(NO_DROPOUT.format(root=str(ROOT), tests=str(ROOT / "tests"), script=script), encoding="utf-8")
    return path


# (stage, split): (processes, flags). Every split trains the same 4 sequences per step, in the same order: one batch of
# 4 ("whole", stage 01), 4 micro-batches of 1 (01), and 2 processes of 2 micro-batches of 1 (02 and 03).
SPLITS = {
    ("01", "whole"): (1, ["--batch-size", 4, "--eval-iter", 1]),
    ("01", "micro"): (1, ["--batch-size", 1, "--grad-accum-steps", 4, "--eval-iter", 4]),
    ("02", "micro"): (2, ["--batch-size", 1, "--grad-accum-steps", 2, "--eval-iter", 4]),
    ("03", "micro"): (2, ["--batch-size", 1, "--grad-accum-steps", 2, "--eval-iter", 4]),
}
SCRIPTS = {"01": "01_opt_single_gpu.py", "02": "02_opt_multi_gpu_ddp.py", "03": "03_opt_multi_gpu_fsdp.py"}


@pytest.fixture(scope="module")
def exact_runs(tmp_path_factory, small_text_module):
    """{(stage, split): (out folder, stdout)} of STEPS float32 steps without dropout, each of 4 sequences (SPLITS);
    each folder also holds first_gradients.pt. Evaluation runs at the micro-batch: 1 batch of 4 and 4 batches of 1 are
    the same 4 sequences. All six processes start at once."""
    root = tmp_path_factory.mktemp("grad_accum")
    flags = ["--tiny", "--no-compile", "--data", small_text_module, "--max-steps", STEPS, "--eval-freq", 1]
    launches = {}
    for (stage, split), (processes, split_flags) in SPLITS.items():
        wrapper = without_dropout(root, SCRIPTS[stage])
        out = root / f"{stage}-{split}"
        launcher = ([sys.executable, wrapper] if processes == 1
                    else torchrun("--standalone", f"--nproc_per_node={processes}", wrapper))
        launches[stage, split] = (out, subprocess.Popen(
            [*map(str, launcher), *map(str, flags + split_flags), "--out", str(out)], cwd=ROOT,
            env=clean_env(**FP32, FIRST_GRADIENTS=str(root / f"{stage}-{split}.pt")), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    results = {}
    for key, (out, proc) in launches.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{key}: {stdout[-2000:]}\n{stderr[-3000:]}"
        results[key] = out, stdout
    return results


@pytest.fixture(scope="module")
def small_text_module(tmp_path_factory):
    from data import load_text

    path = tmp_path_factory.mktemp("text") / "small.txt"
    path.write_text(load_text("shakespeare")[:60_000], encoding="utf-8")
    return path


def plain_weights(out):
    return torch.load(out / "model.pth", weights_only=True)["model"]


def first_gradients(out):
    return torch.load(out.parent / f"{out.name}.pt", weights_only=True)


@pytest.mark.parametrize("stage", ["01", "02", "03"])
def test_the_accumulated_gradients_are_those_of_the_whole_batch(exact_runs, stage):
    """The gradients of the first step, before AdamW (which nearly ignores their scale): 4 micro-batches of 1 in
    01, 2 processes x 2 micro-batches of 1 in 02 and 03, against one batch of 4 in 01. Each micro-batch's loss
    divided by the accumulation steps, the processes averaged: the mean over the 4 sequences."""
    ours, theirs = first_gradients(exact_runs[stage, "micro"][0]), first_gradients(exact_runs["01", "whole"][0])
    assert len(ours) == len(theirs) == len(list(plain_weights(exact_runs["01", "whole"][0])))
    largest = max(gradient.abs().max().item() for gradient in theirs)
    apart = max((gradient - expected).abs().max().item() for gradient, expected in zip(ours, theirs))
    print(f"{stage}: gradients at most {apart:.2e} apart, the largest {largest:.2e}")
    for index, (gradient, expected) in enumerate(zip(ours, theirs)):
        # the same sums in float32, added in another order: measured at most 1.5e-8 apart in all three, against
        # gradients up to 9.7e-2; a forgotten division by the accumulation steps makes them 4 (01) or 2 times larger
        torch.testing.assert_close(gradient, expected, rtol=1e-5, atol=1e-6 * largest,
                                   msg=lambda text, index=index: f"parameter {index}: {text}")


@pytest.mark.parametrize("stage", ["01", "02", "03"])
def test_after_three_adamw_steps_the_weights_are_those_of_the_whole_batch(exact_runs, stage):
    (whole, _), (micro, stdout) = exact_runs["01", "whole"], exact_runs[stage, "micro"]
    ours = (sharded_weights if stage == "03" else plain_weights)(micro)
    theirs = plain_weights(whole)
    assert ours.keys() == theirs.keys()
    for name in ours:  # the same sums in float32, added in another order
        # (atol: AdamW divides by the root of tiny second moments where an embedding row was seen once; a wrong
        # gradient would move a weight by the learning rate, 5e-4 a step)
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-5,
                                   msg=lambda text, name=name: f"{name}: {text}")
    metrics = json.loads((micro / "metrics.json").read_text())
    processes, _ = SPLITS[stage, "micro"]
    accumulation = 4 // processes
    assert metrics["steps"] == STEPS and metrics["settings"]["grad_accum_steps"] == accumulation
    assert metrics["tokens_seen"] == STEPS * 4 * 64  # every micro-batch's tokens, of every process
    expected = (f"batch 1 x {accumulation} accumulation steps" + (" x 2 processes" if processes > 1 else "")
                + " = 4 sequences (256 tokens) per optimizer step")
    assert expected in stdout, stdout[:3000]


def test_the_validation_losses_match_at_every_step(exact_runs):
    whole = json.loads((exact_runs["01", "whole"][0] / "metrics.json").read_text())["log"]
    for stage in ("01", "02", "03"):
        micro = json.loads((exact_runs[stage, "micro"][0] / "metrics.json").read_text())["log"]
        assert [entry["step"] for entry in whole] == [entry["step"] for entry in micro] == list(range(STEPS))
        for a, b in zip(whole, micro):
            assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-5), (stage, a, b)


def test_a_count_below_one_exits_2_with_one_line(tmp_path):
    result = run_script("01_opt_single_gpu.py", "--tiny", "--grad-accum-steps", "0", "--out", tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--grad-accum-steps" in lines[0] and "at least 1" in lines[0], result.stderr


def test_stage_00_has_no_accumulation(tmp_path):
    result = run_script("00_orig.py", "--tiny", "--grad-accum-steps", "2", "--out", tmp_path)
    assert result.returncode == 2 and "unrecognized arguments: --grad-accum-steps" in result.stderr


def test_a_resume_keeps_the_global_batch_however_it_is_split(tmp_path, small_text):
    flags = ["--tiny", "--no-compile", "--data", small_text, "--eval-freq", 1, "--eval-iter", 1]
    first = run_script("01_opt_single_gpu.py", *flags, "--out", tmp_path, "--max-steps", 2)
    assert first.returncode == 0, first.stderr[-2000:]
    checkpoint = tmp_path / "model.pth"
    doubled = run_script("01_opt_single_gpu.py", *flags, "--max-steps", 3, "--resume", checkpoint,
                         "--grad-accum-steps", 2)  # batch 4 (the checkpoint's) x 2: another global batch
    assert doubled.returncode == 2 and "tokens per step" in doubled.stderr, doubled.stderr[-2000:]
    assert len(doubled.stderr.strip().splitlines()) == 1
    resplit = run_script("01_opt_single_gpu.py", *flags, "--max-steps", 3, "--resume", checkpoint,
                         "--batch-size", 2, "--grad-accum-steps", 2)  # 2 x 2: the same 4 sequences per step
    assert resplit.returncode == 0, resplit.stderr[-2000:]
    assert "batch 2 x 2 accumulation steps = 4 sequences" in resplit.stdout
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"] == 3


def test_with_dropout_the_runs_agree_statistically(tmp_path, small_text):
    """With dropout on, one pass over 4 sequences and four passes over 1 draw other masks: the runs agree only
    statistically. Measured on the same 20 sequences: 10.394 and 10.394 at step 19; at step 29, 9.827 and 9.829."""
    finals = {}
    for name, split in (("whole", ["--batch-size", 4, "--eval-iter", 5]),
                        ("micro", ["--batch-size", 1, "--grad-accum-steps", 4, "--eval-iter", 20])):
        result = run_script("01_opt_single_gpu.py", "--tiny", "--no-compile", "--data", small_text, "--out",
                            tmp_path / name, "--max-steps", 20, "--eval-freq", 19, *split)
        assert result.returncode == 0, result.stderr[-2000:]
        log = json.loads((tmp_path / name / "metrics.json").read_text())["log"]
        finals[name] = log[-1]["val_loss"]
    assert finals["whole"] < 10.6  # learned (from 10.9)
    assert abs(finals["micro"] - finals["whole"]) < 0.02, finals  # the exact math: the dropout-free tests above


# ---------------------------------------------------------------------------------------------
# The roofline and the ladder
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rung10_a100():
    from cost_model.gpus import find_gpu
    from cost_model.step_model import model_rung

    return model_rung(10, find_gpu("A100"), batch_size=32)


def test_the_roofline_counts_adamw_once_per_optimizer_step(rung10_a100):
    from cost_model.scaling import accumulated

    four = accumulated(rung10_a100, 4)
    assert four["tokens_per_step"] == 4 * rung10_a100["tokens_per_step"]
    for work, entry in four["classes"].items():
        before = rung10_a100["classes"][work]
        if work == "optimizer":
            assert entry["bytes"] == before["bytes"]  # once per step, however many micro-batches
        elif work == "elementwise":  # x 4, plus summing the gradients of micro-batches 2 to 4: 12 bytes each
            assert entry["bytes"] == 4 * before["bytes"] + 3 * 12 * rung10_a100["parameters"]
        else:
            assert entry["flops"] == 4 * before["flops"] and entry["bytes"] == 4 * before["bytes"]
    # less AdamW per token, more gradient sums: on one A100 at batch 32 the two nearly cancel
    assert four["ceiling_tok_per_sec"] == pytest.approx(rung10_a100["ceiling_tok_per_sec"], rel=0.05)


def test_rung_11s_ceiling_on_4_a100s_lies_above_the_original_tutorials_measurement(rung10_a100):
    """The original tutorial measured 419,259 tok/s with DDP on 4 A100s at batch 32 per GPU: the model's ceiling
    for the same work must lie above it. Over NVLink the all-reduce hides in the backward; over a slow link it
    does not, and accumulation takes it out of all but one micro-batch in N."""
    from cost_model.scaling import LINKS_GB_PER_S, accumulated, data_parallel

    nvlink = data_parallel(rung10_a100, 4, LINKS_GB_PER_S["nvlink-a100"])
    assert nvlink["ceiling_tok_per_sec"] > 419_259
    assert nvlink["exposed_seconds"] == 0
    slow = data_parallel(rung10_a100, 4, LINKS_GB_PER_S["eth-25g"])
    slow_accumulated = data_parallel(accumulated(rung10_a100, 8), 4, LINKS_GB_PER_S["eth-25g"])
    assert slow["exposed_seconds"] > 0
    assert slow_accumulated["all_reduce_bytes_per_token"] == pytest.approx(slow["all_reduce_bytes_per_token"] / 8)
    assert slow_accumulated["ceiling_tok_per_sec"] > 1.5 * slow["ceiling_tok_per_sec"]


def test_the_ladders_option_splits_each_batch_into_micro_batches():
    from bench import rungs

    rung = rungs.compose(7, torch.device("cpu"), tiny=True, options=["grad-accum"])  # eager: no compile to wait for
    assert rung.accumulation == rungs.ACCUMULATION_STEPS and rung.batch_size == 4
    seen = []
    hook = rung.model.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    tokens = torch.randint(0, 50257, (4, 65))
    loss = rung.train_step(tokens[:, :-1], tokens[:, 1:])
    hook.remove()
    assert seen == [1, 1, 1, 1] and loss.dim() == 0
    with pytest.raises(ValueError, match="does not divide"):
        rungs.compose(7, torch.device("cpu"), tiny=True, batch_size=6, options=["grad-accum"])


def test_the_memory_model_keeps_the_gradients_between_micro_batches():
    from cost_model.memory_model import StepMemory

    memory = StepMemory(rung=10, model="gpt2-small", batch_size=8, context_length=1024, vocab_size=50304, budget=1.0,
                        num_params=1000, saved=[], backward_matmuls=0, logits_bytes=0)
    alone = memory.peak_bytes
    memory.grad_accum_steps = 4  # from the second micro-batch on, its backward starts with the gradients held
    assert memory.peak_bytes == alone + 4 * 1000


def test_the_ladders_option_runs_the_stage_scripts_with_accumulation():
    from argparse import Namespace

    from bench import rungs, runner

    stage = rungs.load_stage("02_opt_multi_gpu_ddp.py")
    args = Namespace(data="shakespeare", device="cpu", seed=1, model="gpt2-small", tiny=True, batch_size=None,
                     option=["grad-accum"])
    flags = runner.script_flags(args, "out", 10, 2, stage)
    assert flags[flags.index("--grad-accum-steps") + 1] == rungs.ACCUMULATION_STEPS
    assert flags[flags.index("--batch-size") + 1] == 4 // rungs.ACCUMULATION_STEPS  # the tiny batch of 4, split
    args.option = []
    assert "--grad-accum-steps" not in runner.script_flags(args, "out", 10, 2, stage)
