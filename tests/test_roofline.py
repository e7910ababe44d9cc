"""cost_model/roofline.py: the counts of small known cases, the dtypes it gives autocast, rung 0 against the FLOPs
formula, the ceilings against the original tutorial's A100 measurements, and its command line.

The whole A100 table is built once for the module, by the command line a user runs (it must take under 60 s on
the 2-core CPU of these tests); the other tests count single ops or modules on the meta device in about a second.
"""

import json
import resource
import statistics
import time
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, aten_dtypes, load_stage, run_script

import utilization
from bench import rungs
from cost_model import gpus, prediction, roofline, step_model
from bench.report import REFERENCE

CLI_SECONDS = 60  # the bound for one whole table on this machine


def run_roofline(*flags):
    """Run the command line; also return the CPU seconds it took. The bound is checked on CPU time: the count
    is one thread, so on an idle machine the wall clock is the same, but on a shared one other processes stretch
    the wall clock by several times (measured: 12 s of CPU in 22 to 70 s)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    result = run_script("cost_model/roofline.py", *flags, timeout=10 * CLI_SECONDS)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return result, cpu_seconds, time.monotonic() - started


@pytest.fixture(scope="module")
def a100(tmp_path_factory):
    """The A100 table as `python cost_model/roofline.py --gpu A100 --predict` writes it: (roofline.json, seconds, --out)."""
    out = tmp_path_factory.mktemp("roofline-a100")
    result, cpu_seconds, wall_seconds = run_roofline("--gpu", "A100", "--predict", "--out", out)
    assert result.returncode == 0, result.stderr
    return json.loads((out / "roofline.json").read_text()), (cpu_seconds, wall_seconds), out


def counted(fn, autocast_dtype=None, model=None):
    """The ops of fn() (forward) and of the backward of what it returns, on the meta device."""
    counter = step_model.StepCounter()
    if model is not None:
        counter.watch(model)
    with counter:
        with step_model.gpu_functions(autocast_dtype):
            out = fn()
        counter.phase = "backward"
        out.float().sum().backward()
    return counter.ops


def meta(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape, device="meta", dtype=dtype, requires_grad=grad)


# ---------------------------------------------------------------------------------------------
# Small known cases
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_matmul_counts_2mnk_flops_and_its_three_matrices(dtype):
    m, k, n = 512, 768, 3072
    a, b = meta(m, k, dtype=dtype, grad=False), meta(k, n, dtype=dtype, grad=False)
    with step_model.StepCounter() as counter:
        a @ b
    (op,) = counter.ops
    size = torch.finfo(dtype).bits // 8
    assert op.name == "mm" and op.matmul_dtype == dtype
    assert op.flops == 2 * m * n * k
    assert op.bytes == (m * k + k * n + m * n) * size


@pytest.mark.parametrize("dtype, size", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_layer_norm_reads_its_input_and_writes_its_output_and_float32_statistics(dtype, size):
    rows, width = 8 * 1024, 768
    x = meta(rows, width, dtype=dtype, grad=False)
    weight, bias = meta(width, dtype=dtype, grad=False), meta(width, dtype=dtype, grad=False)
    with step_model.StepCounter() as counter:
        F.layer_norm(x, (width,), weight, bias)
    (op,) = counter.ops
    assert op.name == "native_layer_norm"
    statistics = 2 * rows * 4  # mean and 1/std per row, float32 whatever the input (as CUDA keeps them)
    assert op.bytes == 2 * rows * width * size + 2 * width * size + statistics
    assert op.matmul_dtype is None  # CUDA-core work


def test_sdpa_moves_far_fewer_bytes_than_the_hand_written_attention_for_as_many_flops():
    """Stage 00's attention (with step 1's mask) against stage 01's, forward and backward, bf16 autocast, at GPT-2
    small's width and context: only the attention class, so the projections (the same matmuls) are left out."""
    stage00, stage01 = load_stage("00_orig.py"), load_stage("01_opt_single_gpu.py")
    shape = {"d_in": 768, "d_out": 768, "context_length": 1024, "dropout": 0.1, "num_heads": 12}
    totals = {}
    for name, attention_class in (("eager", rungs.on_the_fly_mask_attention(stage00)),
                                  ("sdpa", stage01.MultiHeadAttention)):
        with torch.device("meta"):
            module = attention_class(**shape)
        x = meta(2, 1024, 768)
        ops = counted(lambda: module(x), torch.bfloat16, model=module)
        attention = [op for op in ops if op.work == "attention"]
        totals[name] = (sum(op.bytes for op in attention), sum(op.flops for op in attention if op.matmul_dtype))
        if name == "sdpa":
            assert {op.name for op in attention} & step_model.FLASH_OPS == step_model.FLASH_OPS
    (eager_bytes, eager_flops), (sdpa_bytes, sdpa_flops) = totals["eager"], totals["sdpa"]
    assert sdpa_bytes < eager_bytes / 20, totals  # no tokens x tokens matrix
    # causal halves FlashAttention's work, its backward recomputes QK^T: 7/2 matmuls' worth against 6
    assert sdpa_flops == pytest.approx(eager_flops * 3.5 / 6, rel=0.01), totals


@pytest.mark.parametrize("number", [5, 6, 7])
def test_the_autocast_rules_give_the_dtypes_pytorchs_cuda_autocast_gives(number):
    """Op by op, the forward with loss of a rung under roofline's autocast rules on the meta device, against
    PyTorch's own CUDA autocast on fake CUDA tensors (a forward pass needs no GPU there). Rung 5 is the one where
    the rules matter most: hand-written attention, LayerNorm and GELU, whose softmax and pow autocast runs in
    float32; rung 7's SDPA is FlashAttention's op on both sides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def forward(device, autocast):
        rung = rungs.compose_for_gpu(number, torch.device(device), True, "bf16")
        ids = torch.zeros(2, 64, dtype=torch.long, device=device)
        recorder = aten_dtypes()
        with recorder, autocast:
            rung.loss(ids, ids)
        return recorder.ops

    with FakeTensorMode(), mock.patch("torch.cuda.amp.common.amp_definitely_not_available", return_value=False), \
            mock.patch("torch.cuda.is_bf16_supported", return_value=True):
        cuda_autocast = torch.autocast("cuda", dtype=torch.bfloat16)
        with step_model.gpu_functions(None):  # only SDPA as FlashAttention, under PyTorch's own autocast
            expected = forward("cuda", cuda_autocast)
    emulated = forward("meta", step_model.gpu_functions(torch.bfloat16))
    assert len(emulated) == len(expected)
    assert emulated == expected
    assert any(dtypes == [torch.bfloat16] for name, dtypes in emulated if name == "aten::mm")


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------

def test_the_whole_table_is_built_in_under_a_minute(a100):
    table, (cpu_seconds, wall_seconds), out = a100
    assert cpu_seconds < CLI_SECONDS, f"cost_model/roofline.py --gpu A100 took {cpu_seconds:.0f} s of CPU"
    print(f"cost_model/roofline.py --gpu A100: {cpu_seconds:.1f} s of CPU, {wall_seconds:.1f} s on the clock")
    assert [row["rung"] for row in table["rungs"]] == list(range(11))
    assert {path.name for path in out.iterdir()} >= {"roofline.md", "roofline.png", "roofline.json"}


def test_rung_0_counts_the_flops_formula_exactly(a100):
    """The stages' MFU formula (utilization.flops_per_token at the real vocabulary, 0.854 GFLOP per token for GPT-2
    small) is 6 x matmul weights + 12 x layers x width x context: the matmuls of one forward and backward,
    attention scores included. Rung 0 counts every such multiplication op by op, so its tensor-core FLOPs per
    token must be the formula's, and they must sit in the right classes."""
    rung0 = a100[0]["rungs"][0]
    cfg = load_stage("00_orig.py").GPT_CONFIG_124M
    formula = utilization.flops_per_token(cfg, 50257)
    assert formula == pytest.approx(0.854e9, rel=1e-3)
    assert rung0["tensor_core_flops"] / rung0["tokens_per_step"] == pytest.approx(formula, rel=1e-3)
    d, layers, context = cfg["emb_dim"], cfg["n_layers"], cfg["context_length"]
    weights = layers * 12 * d * d + d * cfg["vocab_size"]
    classes = rung0["classes"]
    assert classes["matmul"]["tensor_core_flops"] == pytest.approx(6 * weights * rung0["tokens_per_step"], rel=1e-6)
    assert classes["attention"]["tensor_core_flops"] == pytest.approx(
        12 * layers * d * context * rung0["tokens_per_step"], rel=1e-6)
    # the rest is elementwise work at one FLOP per element: a small addition, never a matmul
    assert 1 < rung0["flops"] / rung0["tensor_core_flops"] < 1.01


def test_the_a100_ceiling_lies_above_every_measurement_of_the_original_tutorial(a100):
    """A ceiling below a published measurement would be wrong (rungs 8-10 were measured at the tutorial's own
    settings: its step tok/s at the end of epoch 1, batch 32 at rung 10, as here)."""
    rows = {row["rung"]: row for row in a100[0]["rungs"]}
    for number in range(11):
        measured = REFERENCE[number][0]
        assert rows[number]["ceiling_tok_per_sec"] > measured, (number, rows[number]["ceiling_tok_per_sec"], measured)
        assert rows[number]["tutorial_tok_per_sec"] == measured


def test_each_step_removes_what_it_is_for(a100):
    rows = {row["rung"]: row for row in a100[0]["rungs"]}
    removed = {number: rows[number]["removed"] for number in range(1, 11)}

    def gone(number, work, key="bytes"):
        return removed[number]["classes"][work][key]

    assert gone(2, "matmul", "floor_seconds") > 0.5 * rows[1]["floor_seconds"]  # TF32: a higher peak, same bytes
    assert gone(3, "optimizer") > 0.5 * rows[2]["classes"]["optimizer"]["bytes"]  # fused AdamW: one pass
    assert removed[4]["bytes"] == 0 and removed[4]["flops"] == 0  # pinning: host-side only
    assert gone(7, "attention") > 0.9 * rows[6]["classes"]["attention"]["bytes"]  # no tokens x tokens matrix
    for work in ("loss", "norm_activation", "elementwise"):  # compile fuses these...
        assert gone(8, work) > 0, work
    for work in ("matmul", "optimizer"):  # ...and counts these in full
        assert rows[8]["classes"][work]["bytes"] == rows[7]["classes"][work]["bytes"], work
    assert rows[9]["flops"] > rows[8]["flops"]  # padding adds columns: its gain is efficiency, not in the floor
    assert rows[10]["ceiling_tok_per_sec"] > rows[9]["ceiling_tok_per_sec"]  # the optimizer's share per token
    for row in rows.values():
        assert sum(entry["share"] for entry in row["classes"].values()) == pytest.approx(1.0)
        assert row["ceiling_tok_per_sec"] == pytest.approx(row["tokens_per_step"] / row["floor_seconds"])


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def test_the_command_line_writes_the_three_files_for_an_h100(tmp_path, a100):
    result, cpu_seconds, wall_seconds = run_roofline("--gpu", "H100", "--predict", "--out", tmp_path)
    assert result.returncode == 0, result.stderr
    assert cpu_seconds < CLI_SECONDS, f"cost_model/roofline.py --gpu H100 took {cpu_seconds:.0f} s of CPU"
    print(f"cost_model/roofline.py --gpu H100: {cpu_seconds:.1f} s of CPU, {wall_seconds:.1f} s on the clock")
    table = json.loads((tmp_path / "roofline.json").read_text())
    assert table["gpu"] == "H100" and table["gpu_peaks"]["bandwidth_gb_per_s"] == 3350
    a100_rows = a100[0]["rungs"]
    for row, slower in zip(table["rungs"], a100_rows):
        assert set(row["classes"]) == set(step_model.CLASSES)
        assert row["ceiling_tok_per_sec"] > slower["ceiling_tok_per_sec"]  # more of everything than an A100
        assert "tutorial_tok_per_sec" not in row  # the tutorial measured an A100
    text = (tmp_path / "roofline.md").read_text()
    assert "# Roofline of one training step: H100" in text and "## What each step removed" in text
    assert (tmp_path / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "rung 10" in result.stdout
    # --predict: a prediction per rung, fitted on another GPU's ladder, the one docs/roofline/H100 commits
    assert all("h100" not in source.lower() for source in table["fitted_on"]), table["fitted_on"]
    assert sum("predicted" in line for line in result.stdout.splitlines()) >= 13, result.stdout
    assert "## Predicted tok/s" in text and "rungs the fit never saw" in text
    assert_same_predictions(table, "H100")


def test_an_unknown_gpu_exits_2_with_one_line(tmp_path):
    out = tmp_path / "never"
    result = run_script("cost_model/roofline.py", "--gpu", "RTX 9999", "--out", out, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "RTX 9999" in lines[0] and "A100" in lines[0], result.stderr
    assert not out.exists()
    # the PCIe and 40 GB parts are listed by names --gpu takes, each giving that part's own bandwidth
    known = lines[0].split("known: ")[1].split(", ")
    assert {"A100 PCIe 40 GB", "A100 PCIe", "A100 40 GB", "V100 PCIE", "H100"} <= set(known), known
    assert [gpus.find_gpu(name).bandwidth_gb_per_s for name in ("A100 PCIe 40 GB", "A100 PCIe", "A100")] == [
        1555, 1935, 2039]
    assert len({utilization.peak_row(name)[0] for name in known}) == len(known)  # no two names for one row


def test_a100_means_the_80_gb_sxm_part_unless_the_name_says_otherwise():
    assert gpus.find_gpu("A100").bandwidth_gb_per_s == 2039
    assert gpus.find_gpu("NVIDIA A100-SXM4-80GB").bandwidth_gb_per_s == 2039
    assert gpus.find_gpu("A100 PCIe").bandwidth_gb_per_s == 1935
    assert gpus.find_gpu("A100 40GB").bandwidth_gb_per_s == 1555
    assert gpus.find_gpu("NVIDIA A100-PCIE-40GB").bandwidth_gb_per_s == 1555
    assert gpus.find_gpu("H200").bandwidth_gb_per_s == 4800
    assert gpus.find_gpu("NVIDIA A10").bandwidth_gb_per_s == 600  # not an A100


def test_the_old_command_path_runs_the_cost_models_roofline():
    """`python bench/roofline.py` (the command's path before cost_model/) takes the same arguments and exit codes."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "bench" / "roofline.py"), "--gpu", "Nope"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "--gpu Nope: not in the peak table" in done.stderr


def test_every_gpu_of_the_peak_table_has_a_memory_bandwidth():
    """The bandwidth lives in the cost model, by the peak table's row: a row added to one table alone is caught."""
    import utilization

    assert set(gpus.BANDWIDTH_GB_PER_S) == {pattern for pattern, _ in utilization.PEAK_TFLOPS}
    assert all(isinstance(tflops, tuple) and len(tflops) == 4 for _, tflops in utilization.PEAK_TFLOPS)


def test_no_ceiling_lies_below_a_published_measurement_and_the_roofline_page_shows_them():
    """cost_model/published.py sets others' published tok/s beside the ceiling of the rung doing the closest work: a
    ceiling below a measurement of the same work would mean the model is wrong. docs/roofline.md shows the same table
    (its ceilings to within 1%: the count of ops may move slightly between PyTorch versions)."""
    from cost_model import published

    found = published.ceilings()
    readme = (ROOT / "docs" / "roofline.md").read_text(encoding="utf-8")
    begin, end = published.BLOCK
    shown = readme.split(begin, 1)[1].split(end, 1)[0]
    rows = [line.split(" | ") for line in shown.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == len(published.PUBLISHED)
    for (who, what, gpu, batch, measured, rung, _, _), cells in zip(published.PUBLISHED, rows):
        assert cells[0] == f"| {who}" and cells[1] == what and cells[4] == f"{measured:,.0f}", cells
        if rung is None:
            assert cells[6] == "—", cells
            continue
        ceiling = found[(gpu, batch, rung)]
        assert ceiling > measured, (who, what, gpu, batch, rung, ceiling, measured)
        assert float(cells[6].replace(",", "")) == pytest.approx(ceiling, rel=0.01), (cells, ceiling)


# ---------------------------------------------------------------------------------------------
# --context-length
# ---------------------------------------------------------------------------------------------

def test_at_twice_the_context_hand_written_attention_moves_four_times_the_bytes_flash_attention_twice():
    """The exercise of the README's "Try it yourself": rungs 6 and 7 at the stages' 1,024 and at 2,048 tokens, on
    the meta device (about four seconds). Rung 6's attention writes and reads tokens x tokens matrices (x4), rung 7's
    FlashAttention moves only Q, K, V and the output (x2, as the matmuls' FLOPs); so step 7 is worth more there."""
    h100 = gpus.find_gpu("H100")
    tables = {context: step_model.build_roofline(h100, rung_numbers=(6, 7), context_length=context)
              for context in (None, 2048)}
    assert tables[None]["context_length"] == 1024 and tables[2048]["context_length"] == 2048
    rows = {context: {row["rung"]: row for row in table["rungs"]} for context, table in tables.items()}

    def grown(rung, work, key):
        return rows[2048][rung]["classes"][work][key] / rows[None][rung]["classes"][work][key]

    assert grown(6, "attention", "bytes") == pytest.approx(4, rel=0.05)
    assert grown(7, "attention", "bytes") == pytest.approx(2, rel=0.05)
    for rung in (6, 7):
        assert grown(rung, "matmul", "flops") == pytest.approx(2, rel=0.01)  # twice the tokens per step
        assert rows[2048][rung]["tokens_per_step"] == 2 * rows[None][rung]["tokens_per_step"]

    def ratio(context):
        return rows[context][7]["ceiling_tok_per_sec"] / rows[context][6]["ceiling_tok_per_sec"]

    assert ratio(2048) > 1.4 * ratio(None)
    assert "context 2,048" in roofline.render_markdown(tables[2048])


@pytest.mark.parametrize("value", ["0", "1.5"])
def test_a_context_length_that_is_not_a_whole_number_from_1_exits_2_with_one_line(value, tmp_path):
    out = tmp_path / "never"
    result = run_script("cost_model/roofline.py", "--gpu", "H100", "--context-length", value, "--out", out, timeout=120)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "--context-length" in result.stderr and not out.exists()


def test_the_reference_column_is_the_tutorials_context_only():
    a100 = gpus.find_gpu("A100")
    assert step_model.tutorial_reference(a100, "gpt2-small", None)
    assert step_model.tutorial_reference(a100, "gpt2-small", None, context_length=1024)
    assert step_model.tutorial_reference(a100, "gpt2-small", None, context_length=2048) == {}


# ---------------------------------------------------------------------------------------------
# Predictions (cost_model/prediction.py)
# ---------------------------------------------------------------------------------------------

def committed(gpu):
    return json.loads((ROOT / "docs" / "roofline" / gpu / "roofline.json").read_text(encoding="utf-8"))


def assert_same_predictions(table, gpu):
    """A table just built predicts what docs/roofline/<gpu> commits, to within 1% (the count of ops may move
    slightly between PyTorch versions): the committed predictions are the model's, not left behind by it."""
    shipped = prediction.predictions(committed(gpu))
    fresh = prediction.predictions(table)
    assert set(fresh) == set(shipped) == set(range(13))
    for rung, value in fresh.items():
        assert value == pytest.approx(shipped[rung], rel=0.01), (gpu, rung, value, shipped[rung])


def test_fitted_on_the_h200_the_h100s_measured_rungs_are_predicted_within_the_target():
    """The held-out test: the committed H100 predictions, fitted with no H100 measurement, against the committed H100
    rows (median error at most 15%, none over 30%), on every rung the model predicts: all thirteen are measured."""
    from bench.rows import read_rows

    table = committed("H100")
    assert all("h100" not in source.lower() and "nvidia-h200" in source for source in table["fitted_on"])
    rows = read_rows(ROOT / "bench" / "results" / "nvidia-h100-80gb-hbm3", "ladder.json")
    measured = {row["rung"]: row["tokens_per_sec"] for row in rows.values() if "rung" in row}
    found, median, worst = prediction.errors(table)
    assert set(found) == set(measured) and len(found) >= 7, (found, measured)
    predicted = prediction.predictions(table)
    sizes = sorted(abs(predicted[rung] / value - 1) for rung, value in measured.items())
    assert median == pytest.approx(statistics.median(sizes)) and worst == pytest.approx(sizes[-1])
    assert median <= 0.15 and worst <= 0.30, found
    assert set(predicted) == set(measured) == set(range(13))  # rungs 5-9 and 12 were forecasts until measured
    assert f"median {100 * median:.1f}%, worst {100 * worst:.1f}%" in (
        ROOT / "docs" / "roofline" / "H100" / "roofline.md").read_text(encoding="utf-8")


def test_the_a100_predictions_are_held_against_the_tutorials_rungs_0_to_4_only(a100):
    table = a100[0]
    assert_same_predictions(table, "A100")
    found, _, _ = prediction.errors(table)
    assert set(found) == set(prediction.TUTORIAL_SAME_WORK)  # from step 5 on it kept bf16 weights: another computation
    assert "an extrapolation" in table["prediction"]["how"]


def test_the_fit_finds_the_shares_and_the_gap_a_ladder_was_made_with():
    """A ladder made from known shares and gap, over rungs whose floors vary independently: the fit recovers them,
    and keeps a share at 1 where the measurements would want it above (faster than the data sheet)."""
    generator = torch.Generator().manual_seed(0)
    truth = dict(zip(prediction.SHARES, (0.8, 0.7, 0.2, 0.6, 0.5, 0.4), strict=True))
    gap = 12e-6

    def row(rung):
        seconds = (torch.rand(len(step_model.BOUNDS), generator=generator) * 0.02).tolist()
        return {"rung": rung, "tokens_per_step": 8192, "launches": int(torch.randint(200, 2000, (1,),
                                                                                      generator=generator)),
                "bound_seconds": dict(zip(step_model.BOUNDS, seconds))}

    table = {"rungs": [row(rung) for rung in range(11)]}
    fitted_truth = {"shares": truth, "gap_seconds": gap}
    measured = {entry["rung"]: entry["tokens_per_step"] / prediction.predicted_seconds(entry, fitted_truth)
                for entry in table["rungs"]}
    profile = {work: seconds for work, (seconds, _) in prediction.profile_check(
        table["rungs"][10], fitted_truth, dict.fromkeys(("matmul", "attention", "memory"), 1.0)).items()}
    fitted = prediction.fit(table, measured, profile)
    for name, share in truth.items():
        assert fitted["shares"][name] == pytest.approx(share, rel=1e-6), name
    assert fitted["gap_seconds"] == pytest.approx(gap, rel=1e-6)
    faster = {rung: 3 * value for rung, value in measured.items()}  # three times the data sheet: impossible
    assert all(share <= 1.0 for share in prediction.fit(table, faster, profile)["shares"].values())


@pytest.fixture(scope="module")
def readme_gpus():
    """The README's nine GPUs with predictions, counted once for the module (about 25 s of CPU)."""
    return prediction.readme_tables()


def test_step_9_pays_in_the_predictions_as_the_heads_matmuls_align(readme_gpus):
    """The floors of step 9 grow 0.03%, but before it the head's three matmuls (50,257 columns: rows of a width not a
    multiple of 16 bytes) are a kind of work of their own, fitted below the aligned matmuls' share; rung 9 has none
    left. So the prediction gives step 9 a gain, on the H100 too, which the fit never saw (measured there: 1.09x)."""
    for name, table in readme_gpus.items():
        rung_8, rung_9 = table["rungs"][8], table["rungs"][9]
        gpu = gpus.find_gpu(name)
        head = 3 * 2 * rung_8["tokens_per_step"] * 768 * 50257 / gpu.peak(gpu.autocast_precision)  # forward, 2 grads
        assert rung_8["bound_seconds"]["unaligned matmul"] == pytest.approx(head, rel=1e-6), name
        assert rung_9["bound_seconds"]["unaligned matmul"] == 0.0 and rung_9["vocab_size"] == 50304, name
        assert table["rungs"][1]["bound_seconds"]["unaligned matmul"] == 0.0  # float32 on CUDA cores: not this kind
    shares = readme_gpus["H100"]["prediction"]["shares"]
    assert shares["unaligned tensor-core matmuls"] < shares["tensor-core matmuls"]
    predicted = prediction.predictions(readme_gpus["H100"])
    assert 1.02 < predicted[9] / predicted[8] < 1.09


def test_the_readmes_table_of_predictions_is_the_models(readme_gpus, tmp_path, monkeypatch):
    from bench.readme_tables import block

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert block(readme, prediction.README_BLOCK) == prediction.readme_table(readme_gpus)
    for name, table in readme_gpus.items():
        found = prediction.predictions(table)
        assert all(found[rung] < table["rungs"][rung]["ceiling_tok_per_sec"] for rung in range(11)), name
    assert "Predicted, not measured" in block(readme, prediction.README_BLOCK)
    # the held-out check names the H100's measured rungs and their date, as the committed rows have them
    ladders, when = prediction.measured_ladders("H100")
    from bench.report import rung_ranges
    rungs = sorted({rung for found in ladders.values() for rung in found})
    rows = (ROOT / "bench" / "results" / "nvidia-h100-80gb-hbm3" / "rows").glob("rung-*.json")
    dates = ", ".join(sorted({json.loads(path.read_text(encoding="utf-8"))["measured_at"][:10] for path in rows}))
    assert all(date in " ".join(when.values()) for date in dates.split(", "))  # a ladder measured on several days
    named = f"On the H100 (rungs {rung_ranges(rungs, '-')} of {dates})"
    assert named in " ".join(block(readme, prediction.README_BLOCK).split())
    # a table typed over by hand, or left behind by the model, is found by --check
    monkeypatch.setattr(prediction, "readme_tables", lambda: readme_gpus)
    assert prediction.main(["--check"]) == 0
    stale = tmp_path / "README.md"
    stale.write_text(readme.replace("| H200 | ", "| H200 | 9", 1), encoding="utf-8")
    monkeypatch.setattr(prediction, "README", stale)
    assert prediction.main(["--check"]) == 1
    assert prediction.main([]) == 0 and stale.read_text(encoding="utf-8") == readme  # written back as the model has it


def test_the_ladders_report_sets_each_prediction_beside_its_measured_rung(tmp_path):
    """A shipped roofline with predictions: the ladder's table gains a column with each rung's prediction and the
    measured rung's departure from it, and says what the predictions were fitted on."""
    from bench import report
    from test_ladder import synthetic_gpu_report

    roofline = {"gpu": "H100", "model": "gpt2-small", "batch_size": None, "fitted_on": ["the X's ladder"],
                "rungs": [{"rung": 0, "ceiling_tok_per_sec": 24_000.0, "predicted_tok_per_sec": 10_000.0},
                          {"rung": 3, "ceiling_tok_per_sec": 90_000.0, "predicted_tok_per_sec": 30_000.0}]}
    (tmp_path / "roofline.json").write_text(json.dumps(roofline))
    merged = synthetic_gpu_report()
    merged["device_name"] = "NVIDIA H100 80GB HBM3"
    found = report.find_roofline(tmp_path, None, merged["device_name"], merged["settings"])
    markdown = report.write_report(merged, tmp_path, found, chart=False)
    assert "| predicted tok/s (error: predicted / measured - 1) |" in markdown  # the cost model's own measure
    assert "| 50% of 24,000 | 10,000 (-17%) |" in markdown and "| 30% of 90,000 | 30,000 (+11%) |" in markdown
    assert "fitted on the X's ladder" in markdown
    assert json.loads((tmp_path / "ladder.json").read_text())["rungs"][0]["predicted_tok_per_sec"] == 10_000.0


def test_with_a_batch_size_for_every_rung_rung_10_says_it_changes_nothing():
    """--batch-size N gives rung 10 rung 9's batch: its label must not promise a larger one."""
    row = step_model.model_rung(10, gpus.find_gpu("H100"), batch_size=8)
    assert row["batch_size"] == 8
    assert row["change"] == f"{rungs.CHANGES[10]} (none here: --batch-size 8 for every rung)"
