"""Every reader's machine: step 5's precision by hardware (bf16, float16 + GradScaler, float32), Apple's MPS with
its fallbacks, the MFU peak table, and step 7's attention kernel on Hopper GPUs.

No V100, T4 or Mac is at hand: the float16 path runs on the CPU through the test hook TEST_FORCE_PRECISION
(tests/support/sitecustomize.py: autocast float16 and GradScaler("cpu") work there), and GPU capabilities, GPU names and MPS availability are faked.
"""

import sys

import pytest
import torch
import torch._dynamo  # imported before any test fakes torch.cuda functions (its import walks them)

import checkpoints
import devices
import failures
import gpu_memory
import inspection
import timekeeping
import utilization
from bench import rungs
from conftest import logged_losses, run_script, run_with_fault
from gpu import stage_runs
from support.sitecustomize import FORCE_PRECISION, forced_precision

FP16 = {FORCE_PRECISION: "fp16"}
STAGES = ("00_orig.py", "01_opt_single_gpu.py", "02_opt_multi_gpu_ddp.py")


@pytest.fixture(autouse=True)
def fresh_precision_choice(monkeypatch):
    """autocast_precision is cached per device; every test starts from a clean cache and no forced precision."""
    monkeypatch.delenv(FORCE_PRECISION, raising=False)
    devices.autocast_precision.cache_clear()
    yield
    devices.autocast_precision.cache_clear()


def fake_gpu(monkeypatch, capability=(9, 0), name="NVIDIA H100 80GB HBM3"):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return torch.device("cuda", 0)


# ---------------------------------------------------------------------------------------------
# Step 5: the precision follows the hardware
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("capability, precision, dtype, words", [
    ((9, 0), "bf16", torch.bfloat16, "9.0 has bfloat16"),
    ((8, 0), "bf16", torch.bfloat16, "8.0 has bfloat16"),
    ((7, 5), "fp16", torch.float16, "7.5 has float16 tensor cores but no bfloat16"),   # T4, RTX 20xx
    ((7, 0), "fp16", torch.float16, "gradient scaler"),                               # V100
    ((6, 1), "fp32", None, "6.1 has no tensor cores"),                                # GTX 10xx
])
def test_gpus_get_the_reduced_precision_their_tensor_cores_have(monkeypatch, capability, precision, dtype, words):
    device = fake_gpu(monkeypatch, capability)
    chosen, reason = devices.autocast_precision(device)
    assert chosen == precision and words in reason
    assert devices.autocast_dtype(device) is dtype
    assert rungs.has_tf32(device) == (capability[0] >= 8)


@pytest.mark.parametrize("capability, matmul_precision, words", [
    ((9, 0), "high", "TF32 on for float32 matmuls"),      # 01 to 03 on an H100
    ((9, 0), "highest", "no TF32 for float32 matmuls"),   # 00 (the book: full float32)
    ((7, 0), "high", "no TF32 for float32 matmuls"),      # 01 on a V100: the setting has nothing to switch on
])
def test_the_headers_device_says_whether_float32_matmuls_use_tf32(monkeypatch, capability, matmul_precision, words):
    device = fake_gpu(monkeypatch, capability)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: matmul_precision)
    described = devices.describe_device(device)
    assert described.startswith(f"NVIDIA H100 80GB HBM3 (compute capability {capability[0]}.{capability[1]}, CUDA ")
    assert described.endswith(f", {words})")
    assert devices.describe_device(device, matmul_precision=False).endswith(f"CUDA {torch.version.cuda})")  # the ladder's


@pytest.mark.parametrize("machine, onednn, amx, avx512_bf16, precision, words", [
    ("x86_64", True, False, True, "bf16", "this CPU computes in bfloat16 (AVX512-BF16)"),   # AMD Zen 4, Intel Cooper Lake
    ("x86_64", True, True, True, "bf16", "this CPU computes in bfloat16 (AMX)"),            # Intel Sapphire Rapids
    ("x86_64", True, False, False, "fp32", "no bfloat16 arithmetic: emulated bf16 is ~10x slower"),  # AVX512 only
    ("x86_64", False, False, False, "fp32", "no bfloat16 arithmetic: emulated bf16 is ~10x slower"),  # AVX2
    ("aarch64", True, False, False, "bf16", "this CPU computes in bfloat16 (Arm BF16)"),    # Graviton 3, Apple M2
    ("aarch64", False, False, False, "fp32", "no bfloat16 arithmetic"),                     # Graviton 2
])
def test_a_cpu_autocasts_to_bf16_only_where_it_computes_in_bf16(monkeypatch, machine, onednn, amx, avx512_bf16,
                                                               precision, words):
    monkeypatch.setattr("platform.machine", lambda: machine)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    chosen, reason = devices.autocast_precision(torch.device("cpu"))
    assert chosen == precision and words in reason
    assert devices.autocast_dtype(torch.device("cpu")) is (torch.bfloat16 if precision == "bf16" else None)


def test_oneDNN_limited_to_avx2_makes_this_cpu_train_in_float32():
    """The same decision from oneDNN's own answer, unmocked: ONEDNN_MAX_CPU_ISA=AVX2 hides any bf16 unit."""
    probe = run_script("-c", "import torch, devices; print(devices.autocast_precision(torch.device('cpu'))[0])",
                       env={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert probe.returncode == 0 and probe.stdout.split() == ["fp32"], probe.stderr[-2000:]


def test_mps_depends_on_macos(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: True)
    assert devices.autocast_precision(torch.device("mps")) == ("bf16", "MPS has bfloat16 from macOS 14 on")
    devices.autocast_precision.cache_clear()
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: major < 14)
    precision, reason = devices.autocast_precision(torch.device("mps"))
    assert precision == "fp32" and "before macOS 14" in reason
    assert devices.autocast_dtype(torch.device("mps")) is None


def test_the_test_hook_is_checked():
    with pytest.raises(ValueError, match="use bf16, fp16 or fp32"):
        forced_precision("fp8")


NO_BF16 = {"ONEDNN_MAX_CPU_ISA": "AVX2"}  # this CPU as a CPU without bfloat16 arithmetic


@pytest.mark.parametrize("script, env, header", [
    ("00_orig.py", {}, "precision: fp32 (the book trains in plain float32)"),
    ("01_opt_single_gpu.py", NO_BF16,
     "precision: fp32 (this CPU has no bfloat16 arithmetic: emulated bf16 is ~10x slower)"),
    ("01_opt_single_gpu.py", {FORCE_PRECISION: "fp32"},
     "precision: fp32 (forced by the test hook TEST_FORCE_PRECISION)"),
    ("02_opt_multi_gpu_ddp.py", NO_BF16,
     "precision: fp32 (this CPU has no bfloat16 arithmetic: emulated bf16 is ~10x slower) | world size: 1"),
])
def test_the_header_names_the_precision_and_why(tmp_path, small_text, script, env, header):
    result = run_script(script, "--tiny", "--data", small_text, "--out", tmp_path, "--max-steps", "2",
                        "--eval-freq", "1", "--eval-iter", "1", *(["--no-compile"] if script[1] != "0" else []),
                        env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert header in result.stdout.splitlines()[0]
    assert "MFU: n/a: a CPU has no published dense peak in the table" in result.stdout
    checkpoint = torch.load(tmp_path / "model.pth", weights_only=True)
    assert checkpoint.get("scaler", {}) == {}, "only float16 needs (and enables) the gradient scaler"


# ---------------------------------------------------------------------------------------------
# The float16 path: trains, resumes exactly, skips a step whose gradients overflowed
# ---------------------------------------------------------------------------------------------

def test_float16_with_a_gradient_scaler_trains_and_resumes_exactly(tmp_path, small_text):
    """Through the real entry point, as on a V100: 8 steps in one go == 4 steps, then --resume to 8, bit for bit.

    Eager, like the other exact-resume tests: compiled runs agree to about 1e-8 only (the overflow test below runs the
    compiled float16 path). Batches of 2: a CPU multiplies float16 slowly, and the scaler's logic is the same at any
    batch."""
    flags = ["--tiny", "--batch-size", "1", "--grad-accum-steps", "2", "--eval-freq", "3", "--eval-iter", "2",
             "--data", small_text, "--no-compile"]  # 2 micro-batches: each loss scaled, one unscale and step per step
    whole = run_script("01_opt_single_gpu.py", *flags, "--out", tmp_path / "whole", "--max-steps", "8", env=FP16)
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert "precision: fp16 (forced by the test hook" in whole.stdout
    logged = logged_losses(tmp_path / "whole")
    assert logged[7][0] < logged[0][0] - 0.05, f"the float16 run did not learn: {logged}"
    checkpoint = torch.load(tmp_path / "whole" / "model.pth", weights_only=True)
    assert {"scale", "_growth_tracker"} <= set(checkpoint["scaler"]), "the enabled scaler is in the checkpoint"

    first = run_script("01_opt_single_gpu.py", *flags, "--out", tmp_path / "split", "--max-steps", "4", env=FP16)
    assert first.returncode == 0, first.stderr[-2000:]
    half = torch.load(tmp_path / "split" / "model.pth", weights_only=True)
    assert half["scaler"]["_growth_tracker"] == 4, "four unskipped steps since the scale last changed"
    second = run_script("01_opt_single_gpu.py", *flags, "--out", tmp_path / "split", "--max-steps", "8",
                        "--resume", tmp_path / "split" / "model.pth", env=FP16)
    assert second.returncode == 0, second.stderr[-2000:]
    resumed = torch.load(tmp_path / "split" / "model.pth", weights_only=True)
    assert resumed["scaler"] == checkpoint["scaler"], "the scaler resumed where it left off"
    for name, tensor in checkpoint["model"].items():
        assert torch.equal(resumed["model"][name], tensor), name
    assert logged_losses(tmp_path / "split")[7] == logged[7]


OVERFLOW_AT_STEP_4 = """
real_step, calls = torch.amp.GradScaler.step, []
def step_with_an_overflow(self, optimizer, *args, **kwargs):
    calls.append(1)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(calls) == 4:  # as if one float16 gradient had overflowed in this step's backward
        params[0].grad.view(-1)[0] = float("inf")
    before = [p.detach().clone() for p in params]
    scale = self.get_scale()
    result = real_step(self, optimizer, *args, **kwargs)
    unchanged = all(torch.equal(b, p) for b, p in zip(before, params))
    print(f"STEP {len(calls)} scale {scale} unchanged {unchanged}", flush=True)
    return result
torch.amp.GradScaler.step = step_with_an_overflow
"""


def test_a_step_whose_gradients_overflow_is_skipped_and_the_run_goes_on(tmp_path, small_text):
    result = run_with_fault(tmp_path, small_text, OVERFLOW_AT_STEP_4, "--eval-freq", "3", "--eval-iter", "2",
                            "--max-steps", "9", "--batch-size", "1", script="01_opt_single_gpu.py", env=FP16)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "training failed" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    steps = [line.split() for line in result.stdout.splitlines() if line.startswith("STEP ")]
    assert len(steps) == 9, result.stdout[-3000:]
    unchanged = {int(fields[1]): fields[5] == "True" for fields in steps}
    assert unchanged == {step: step == 4 for step in range(1, 10)}, "only the overflowed step leaves the weights"
    scales = {int(fields[1]): float(fields[3]) for fields in steps}
    assert scales[5] == scales[4] / 2, "the scaler backs off after an overflow"
    assert all(scales[step] == scales[5] for step in range(5, 10))
    logged = logged_losses(tmp_path / "run")
    assert logged[8][0] < logged[0][0], "the run went on learning"


# ---------------------------------------------------------------------------------------------
# Apple's MPS: choosing it, refusing it, and the fallbacks (availability faked)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("script", STAGES)
def test_device_mps_without_mps_stops_with_exit_2_and_one_line(tmp_path, script):
    result = run_script(script, "--tiny", "--device", "mps", "--out", tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device mps" in lines[0] and "no Apple GPU" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def fake_mac(monkeypatch, macos_14=True):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: macos_14 or major < 14)


def test_auto_picks_mps_when_there_is_no_cuda(monkeypatch, capsys):
    fake_mac(monkeypatch)
    assert devices.pick_device("auto") == torch.device("mps")
    assert devices.pick_device("mps") == torch.device("mps")
    assert capsys.readouterr().out == ""


def test_stage_02_trains_on_the_cpu_of_a_mac_and_refuses_mps(monkeypatch, capsys):
    """torch.distributed has no backend for MPS tensors: auto takes the CPU (one line), --device mps exits 2."""
    fake_mac(monkeypatch)
    assert devices.pick_device("auto", distributed=True) == torch.device("cpu")
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and "no backend for MPS" in printed[0]
    with pytest.raises(failures.UsageError, match="neither DDP nor FSDP runs there"):
        devices.pick_device("mps", distributed=True)


@pytest.mark.parametrize("fused, macos_14, expected", [
    (True, True, ["step 4", "step 8"]),
    (False, False, ["step 4", "step 3", "step 5", "step 8"]),
])
def test_each_step_mps_cannot_take_falls_back_with_one_line(monkeypatch, capsys, fused, macos_14, expected):
    fake_mac(monkeypatch, macos_14)
    monkeypatch.setattr(devices, "has_fused", lambda device: fused)
    with torch._dynamo.config.patch(suppress_errors=False):  # restored afterwards
        devices.apply_fallbacks(torch.device("mps"))
        assert torch._dynamo.config.suppress_errors, "a graph that fails to compile on MPS runs eagerly"
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("(")[1].split(")")[0] for line in lines] == expected
    assert all(line.startswith("Fallback (step ") for line in lines)


def test_no_fallbacks_on_cuda_or_the_cpu(monkeypatch, capsys):
    with torch._dynamo.config.patch(suppress_errors=False):
        devices.apply_fallbacks(torch.device("cpu"))
        devices.apply_fallbacks(fake_gpu(monkeypatch))
        assert capsys.readouterr().out == "" and not torch._dynamo.config.suppress_errors
    assert devices.has_fused(torch.device("cpu")) and devices.has_fused(torch.device("cuda"))


def test_fused_adamw_is_found_without_pytorchs_private_list(monkeypatch):
    """has_fused asks a private module of PyTorch; a PyTorch without it must not stop a stage at its start."""
    monkeypatch.setitem(sys.modules, "torch.utils._foreach_utils", None)  # its import now fails
    assert devices.has_fused(torch.device("cpu")) and devices.has_fused(torch.device("cuda"))
    assert not devices.has_fused(torch.device("mps"))


def test_the_clock_waits_for_the_apple_gpu(monkeypatch):
    """MPS has no timing events here: the clock must synchronize before reading the host clock, at both ends."""
    calls = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append("sync"))
    clock = timekeeping.TrainClock(torch.device("mps"))
    clock.start()
    assert calls == ["sync"]
    clock.stop()
    assert calls == ["sync", "sync"] and clock.take() >= 0


def test_the_cuda_clock_lets_the_gpu_run_on_between_off_clock_steps(monkeypatch):
    """CUDA: stop(wait=False), between steps that are off the clock, records an event and waits for nothing (a wait
    there would starve the GPU before each profiled step and show up as idle time in the profile); stop() waits
    (what follows is not training); take() waits for the last event and adds up every span, queued kernels
    included."""
    waits, now = [], iter(range(0, 1000, 100))

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = next(now)  # milliseconds, as the GPU would stamp them

        def synchronize(self):
            waits.append(self.at)

        def elapsed_time(self, end):
            assert waits, "read before the GPU reached the event"
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    clock = timekeeping.TrainClock(torch.device("cuda"))
    for _ in range(3):  # 100 ms each
        clock.start()
        clock.stop(wait=False)
    clock.stop()  # stopped already: nothing
    assert waits == []
    assert clock.take() == pytest.approx(0.3) and waits == [500]
    assert clock.take() == 0.0 and waits == [500]
    clock.start()
    clock.stop()
    assert waits == [500, 700] and clock.take() == pytest.approx(0.1)


def test_the_checkpoint_keeps_the_apple_gpus_random_state(monkeypatch):
    state = torch.tensor([1, 2, 3], dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda: state)
    monkeypatch.setattr(torch.mps, "set_rng_state", restored.append)
    saved = checkpoints.rng_state(torch.device("mps"))
    assert saved["mps"] is state
    checkpoints.restore_rng(saved, torch.device("mps"))
    assert restored == [state]


# ---------------------------------------------------------------------------------------------
# MFU: the peak table and the precision it is measured against
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, precision, tflops", [
    ("Tesla T4", "fp16", 65.0),
    ("Tesla V100-SXM2-16GB", "fp16", 125.0),
    ("Tesla V100-PCIE-32GB", "fp16", 112.0),
    ("Tesla V100S-PCIE-32GB", "fp16", 130.0),
    ("NVIDIA L40S", "bf16", 362.05),           # not the L4's row
    ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA RTX A6000", "bf16", 154.8),
    ("NVIDIA GeForce RTX 4080", "bf16", 97.5),
    ("NVIDIA H800", "bf16", 989.4),
    ("NVIDIA H800 PCIe", "bf16", 756.5),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "tf32", 378.0),
    ("NVIDIA B200", "bf16", 2250.0),
    ("NVIDIA GB200", "bf16", 2500.0),          # not the B200's row
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
    ("NVIDIA A10", "bf16", 125.0),             # not the A100's row
])
def test_the_peak_table_finds_each_gpu_by_its_cuda_name(monkeypatch, name, precision, tflops):
    device = fake_gpu(monkeypatch, name=name)
    assert utilization.peak_flops(device, precision) == pytest.approx(tflops * 1e12)
    assert utilization.peak_flops(device, precision, num_gpus=4) == pytest.approx(4 * tflops * 1e12)
    assert f"dense {precision} peak: {tflops:g} TFLOP/s" in utilization.mfu_line(device, precision)


def test_gpus_without_bf16_have_no_bf16_peak(monkeypatch):
    device = fake_gpu(monkeypatch, capability=(7, 0), name="Tesla V100-SXM2-16GB")
    assert utilization.peak_flops(device, "bf16") is None and utilization.peak_flops(device, "tf32") is None
    assert utilization.mfu_line(device, devices.autocast_precision(device)[0]).startswith(
        "MFU against the Tesla V100-SXM2-16GB's dense fp16 peak: 125 TFLOP/s")


@pytest.mark.parametrize("device_kind, reason", [
    ("unknown", "the NVIDIA RTX PRO 9000 is not in the peak table"),
    ("mps", "Apple does not publish a dense peak"),
    ("cpu", "a CPU has no published dense peak"),
])
def test_mfu_is_n_a_with_the_reason_where_the_peak_is_unknown(monkeypatch, device_kind, reason):
    device = (fake_gpu(monkeypatch, name="NVIDIA RTX PRO 9000") if device_kind == "unknown"
              else torch.device(device_kind))
    assert utilization.peak_flops(device, "bf16") is None
    assert utilization.mfu(1e6, 1e9, utilization.peak_flops(device, "bf16")) is None
    line = utilization.mfu_line(device, "bf16")
    assert line.startswith("MFU: n/a: ") and reason in line


def test_a_mig_slice_gets_no_peak_and_says_why(monkeypatch):
    device = fake_gpu(monkeypatch, name="NVIDIA H100 80GB HBM3 MIG 3g.40gb")
    assert utilization.peak_flops(device, "bf16") is None  # the whole H100's 989 TFLOP/s would be a wrong MFU
    line = utilization.mfu_line(device, "bf16")
    assert line.startswith("MFU: n/a: ") and "MIG slice" in line, line


@pytest.mark.parametrize("capability, arch_list, runs", [
    ((7, 0), ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"], False),  # a V100 on a CUDA 13 wheel
    ((7, 0), ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_90"], True),      # on a CUDA 12.6 wheel
    ((8, 9), ["sm_80", "sm_86", "sm_90"], True),   # sm_86 code runs on 8.9 (same major, lower minor)
    ((9, 0), ["sm_80", "sm_86", "compute_86"], True),  # no sm_90, but PTX for 8.6 compiles for 9.0
    ((8, 0), ["sm_86", "sm_90"], False),           # code for a newer minor does not run on an older one
    ((9, 0), ["sm_80", "sm_90a"], True),           # suffixed names: architecture-specific code for 9.0
    ((10, 0), ["sm_90a", "sm_100a", "sm_120a"], True),
    ((10, 3), ["sm_90", "sm_100a"], False),        # sm_100a runs on 10.0 alone
    ((12, 1), ["sm_90", "sm_120f"], True),         # a family: 12.x from 12.0 on
])
def test_a_gpu_the_build_has_no_kernels_for_is_refused_with_one_line(capability, arch_list, runs):
    def check():
        devices.check_cuda_build(capability, arch_list, "2.11.0+cu130", "Tesla V100-SXM2-16GB")
    if runs:
        check()
        return
    with pytest.raises(failures.UsageError) as err:
        check()
    message = str(err.value)
    assert "\n" not in message and f"sm_{capability[0]}{capability[1]}" in message and "pip install" in message


def test_pick_device_checks_the_build_for_the_gpu(monkeypatch):
    fake_gpu(monkeypatch, capability=(7, 0), name="Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_75", "sm_80", "sm_90", "sm_100", "sm_120"])
    with pytest.raises(failures.UsageError, match="no kernels for the Tesla V100"):
        devices.pick_device("auto")


# ---------------------------------------------------------------------------------------------
# Step 7: the attention kernel on a Hopper GPU
# ---------------------------------------------------------------------------------------------

# A stage run in-process (runpy, as `python SCRIPT` runs it), then the SDPA setting it left behind
SDPA_SETTING_PROBE = """
import runpy, sys, torch
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as stop:
    assert not stop.code, f"the stage exited with {stop.code}"
print("cuDNN attention on:", torch.backends.cuda.cudnn_sdp_enabled())
"""


@pytest.mark.parametrize("script", ["01_opt_single_gpu.py", "02_opt_multi_gpu_ddp.py", "03_opt_multi_gpu_fsdp.py"])
def test_the_stages_train_with_cudnns_attention_off(script, small_text, tmp_path):
    """cuDNN's attention, which PyTorch 2.11 tries first on Hopper, may round dropout to a multiple of 1/16: the stages
    turn it off, so that SDPA takes FlashAttention at the book's 0.1 (the GPU tier checks the kernel itself)."""
    result = run_script("-c", SDPA_SETTING_PROBE, script, "--tiny", "--data", small_text, "--max-steps", 1,
                        "--no-compile", "--out", tmp_path / "run", timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "cuDNN attention on: False" in result.stdout, result.stdout[-2000:]


# ---------------------------------------------------------------------------------------------
# Machines with a GPU: this suite stays on the CPU there, and the GPU tier (tests/gpu) reads what the stages print
# ---------------------------------------------------------------------------------------------

def test_the_tests_and_every_process_they_start_see_no_gpu():
    """tests/conftest.py hides CUDA, so that --device auto takes the CPU in every run the tests start."""
    assert not torch.cuda.is_available()
    result = run_script("-c", "import os, torch, devices; print(repr(os.environ['CUDA_VISIBLE_DEVICES']), "
                              "torch.cuda.is_available(), devices.pick_device('auto'))", timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["''", "False", "cpu"]


# Dynamo's logs as the GPU tier meets them: a compiled module inside DDP (split at its buckets), a graph break,
# a recompile, and the attention op AOTAutograd traced. The "eager" and "aot_eager" backends log the same without
# compiling anything.
TORCH_LOG_PROBE = """
import os, torch, torch.distributed as dist
import devices
import failures
import timekeeping
import utilization
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(devices.free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
layers = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(3)])  # 1 MB each: one bucket each
ddp = torch.nn.parallel.DistributedDataParallel(torch.compile(layers, backend="eager"), bucket_cap_mb=1)
ddp(torch.randn(2, 512)).sum().backward()

@torch.compile(backend="eager")
def with_a_break(x):
    print("Dynamo cannot trace a print: a graph break")
    return x * 2

with_a_break(torch.randn(3))
with_a_break(torch.randn(3, 2))  # another number of dimensions: a recompile

@torch.compile(backend="aot_eager")
def attention(q):
    return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum()

attention(torch.randn(1, 2, 16, 8, requires_grad=True)).backward()  # on the CPU: its flash kernel, forward and backward
dist.destroy_process_group()
"""


def test_the_gpu_tiers_readers_understand_dynamos_logs():
    result = run_script("-c", TORCH_LOG_PROBE, env={"TORCH_LOGS": "recompiles,graph_breaks,dynamo,aot_graphs"},
                        timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    frames = stage_runs.traced_frames(result.stderr)
    names = {name for _, _, name in frames}
    assert "with_a_break" in names and any(name.startswith("torch_dynamo_resume_in_with_a_break") for name in names)
    assert {attempt for _, attempt, _ in frames} == {0, 1}, frames  # the recompile is attempt 1
    assert stage_runs.torch_log(result.stderr, "graph_breaks", "Graph break in user code")
    assert stage_runs.torch_log(result.stderr, "recompiles", "Recompiling function")
    assert stage_runs.ddp_bucket_splits(result.stderr) == [3]
    assert stage_runs.attention_ops(result.stderr) == ["_scaled_dot_product_flash_attention_for_cpu",
                                                      "_scaled_dot_product_flash_attention_for_cpu_backward"]


def test_the_gpu_tiers_readers_understand_a_stages_output(tmp_path, small_text):
    steps = inspection.PROFILE_WAIT + inspection.PROFILE_WARMUP + inspection.PROFILE_ACTIVE
    run = stage_runs.run_stage("00_orig.py", "--tiny", "--data", small_text, "--max-steps", steps, "--eval-freq", 4,
                               "--profile", out=tmp_path / "run", timeout=240, keep_checkpoint=True)
    assert run.returncode == 0, run.describe()
    assert (tmp_path / "run" / "model.pth").is_file()
    printed, logged = stage_runs.log_entries(run.stdout), run.metrics()["log"]
    assert [entry["step"] for entry in printed] == [entry["step"] for entry in logged] == [0, 4, steps - 1]
    for shown, entry in zip(printed, logged):
        assert shown["val_loss"] == pytest.approx(entry["val_loss"], abs=5e-4)
        assert (shown["step_tok_per_sec"] is None) == (entry["step_tok_per_sec"] is None)
        assert shown["mfu"] is None and entry["mfu"] is None  # no peak for a CPU
    rows = stage_runs.profile_rows(run.stdout)
    assert len(rows) >= 5 and "aten::mm" in rows, rows  # whole names, not parts of columns
    assert stage_runs.memory_gb(run.stdout) == {}  # CPU: no memory lines

    # what only CUDA prints, in the stages' formats
    cuda_output = ("Ep 1, Step 000010, Train: 6.201, Val: 6.152, Step tok/sec: 12545, Avg tok/sec: n/a, MFU: 38.9%\n"
                   "Allocated memory: 2.4373 GiB\nReserved memory: 22.5100 GiB\n")
    [entry] = stage_runs.log_entries(cuda_output)
    assert entry["step_tok_per_sec"] == 12545 and entry["avg_tok_per_sec"] is None
    assert entry["mfu"] == pytest.approx(0.389)
    assert stage_runs.memory_gb(cuda_output) == {"allocated": 2.4373, "reserved": 22.51}


def test_the_steady_state_peaks_are_counted_after_the_first_interval(monkeypatch):
    """gpu_memory.end_of_warm_up keeps the first interval's peaks (compilation, autotuning's one-off clones of the
    buffers a kernel writes in place), gives back the cache only they needed and counts the peaks anew; metrics.json
    then holds both, in GiB."""
    gib = gpu_memory.GIB
    state = {"allocated": 10 * gib, "reserved": 12 * gib, "max_allocated": 15 * gib, "max_reserved": 16 * gib}
    calls = []

    def reset(device=None):
        calls.append("reset")
        state["max_allocated"], state["max_reserved"] = state["allocated"], state["reserved"]

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["max_allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: state["max_reserved"])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(gpu_memory, "_first_interval_peaks", {})
    device = torch.device("cuda", 0)
    early = gpu_memory.memory_metrics(device)  # still in the first interval: no steady state yet
    assert early["peak_reserved_gb"] is None and early["first_interval_peak_reserved_gb"] == 16
    gpu_memory.end_of_warm_up(device)
    assert calls == ["empty_cache", "reset"]
    state["max_allocated"], state["max_reserved"] = 11 * gib, 12.5 * gib
    gpu_memory.end_of_warm_up(device)  # later intervals change nothing
    assert calls == ["empty_cache", "reset"]
    metrics = gpu_memory.memory_metrics(device)
    assert metrics["memory_unit"] == "GiB"
    assert (metrics["peak_allocated_gb"], metrics["peak_reserved_gb"]) == (11, 12.5)
    assert (metrics["first_interval_peak_allocated_gb"], metrics["first_interval_peak_reserved_gb"]) == (15, 16)
    line = gpu_memory.peak_memory_line(metrics)
    assert "11.00 GiB allocated, 12.50 GiB reserved after the first interval" in line and "16.00 GiB reserved" in line
    # --memory-snapshot's steps 0-2: their peak is the first interval's (step 0), whose counters were reset
    assert gpu_memory.peaks_since_start(device) == (15, 16)
    state["max_allocated"], state["max_reserved"] = 17 * gib, 12.5 * gib
    assert gpu_memory.peaks_since_start(device) == (17, 16)
    assert gpu_memory.memory_metrics(torch.device("cpu"))["peak_reserved_gb"] is None


def test_the_cpu_note_estimates_a_step_from_this_cpus_matmul_speed():
    """The note a full-size run prints on a CPU: one line whose seconds per step and hours per epoch follow from
    the FLOPs of a step and the matmul speed it measured, and which points to --tiny."""
    import re

    note = devices.cpu_speed_note(flops_per_step=3e12, steps_per_epoch=41)
    found = re.fullmatch(r"Note: this model needs at least ~(\d+) s per step on this CPU \(~([\d.]+) h per epoch of "
                         r"41 steps, at its (\d+) GFLOP/s matmul speed\); the memory estimate above \(a GPU's\) is a floor "
                         r"here, and a run that outgrows this machine's ([\d.]+) GiB of RAM is killed without a word; "
                         r"add --tiny for a small model that trains in seconds\.", note)
    assert found, note
    from pathlib import Path

    meminfo = Path("/proc/meminfo")
    if meminfo.exists():  # Linux: the kernel's own count of the RAM, MemTotal, in KiB
        total = next(int(line.split()[1]) for line in meminfo.read_text().splitlines() if line.startswith("MemTotal:"))
        assert float(found[4]) == pytest.approx(total / 2**20, abs=0.1)
    seconds, hours, rate = int(found[1]), float(found[2]), int(found[3]) * 1e9
    assert seconds == pytest.approx(3e12 / rate, rel=0.02, abs=1)
    # both printed rounded: the hours by up to 0.05, the seconds by up to 0.5 (0.006 h over 41 steps)
    assert hours == pytest.approx(seconds * 41 / 3600, rel=0.05, abs=0.05 + 0.5 * 41 / 3600 + 1e-9)
