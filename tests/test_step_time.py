"""Where a profiled step's GPU time goes: kernels sorted into the roofline's classes by name, idle time, and
bench/step_time.py's table beside the roofline's floors. Synthetic traces in torch.profiler's format: a CPU has
no GPU kernels to profile (the GPU tier checks the same lines on real ones)."""

import json

import pytest

import inspection
from bench import step_time
from gpu.stage_runs import gpu_time_shares

ROOT_ROOFLINE = "docs/roofline/H100/roofline.json"

# Kernel names as GPU traces show them (cuBLAS, FlashAttention, cuDNN, PyTorch's eager kernels, Inductor's Triton)
KERNELS = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_"
    "cublas": "matmul",
    "nvjet_hsh_256x128_64x4_2x1_v_bz_coopB_NTN": "matmul",
    "ampere_sgemm_128x64_tn": "matmul",
    "void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_128x128_16x3_tn_align4>(Params)": "matmul",
    "triton_tem_fused_mm_0": "matmul",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t, "
    "Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, true, false, false, false, true, true, false>"
    "(Flash_fwd_params)": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_kernel0_0": "attention",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)": "attention",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
    "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)": "attention",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
    "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)": "loss",
    "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(...)": "loss",
    "triton_red_fused__log_softmax__to_copy_nll_loss_forward_12": "loss",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<5>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (ADAM_MODE)1, false>, "
    "float*, double, double, double, double, double, bool, float*, float*>(...)": "optimizer",
    "triton_per_fused_add_native_dropout_native_layer_norm_3": "norm_activation",
    "triton_poi_fused_gelu_view_5": "norm_activation",
    "void at::native::vectorized_elementwise_kernel<4, at::native::tanh_kernel_cuda(at::TensorIteratorBase&)>": (
        "norm_activation"),
    "triton_poi_fused_add_native_dropout_7": "elementwise",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >": (
        "elementwise"),
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    # FSDP2 (stage 03): the foreach copy into the all-gather buffer, the gradients' copy into the reduce-scatter one
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<2>, at::native::(anonymous namespace)::UnaryOpFunctor<c10::BFloat16, 2, 1, 1>, "
    "at::native::Copy<float, c10::BFloat16> >(...)": "copies",
    "void at::native::(anonymous namespace)::chunk_cat_cuda_kernel<float, float>(...)": "copies",
    "void at::native::(anonymous namespace)::split_with_sizes_copy_out_contiguous_no_cast_kernel(...)": "copies",
}


@pytest.mark.parametrize("name", KERNELS, ids=lambda name: name[:40])
def test_kernels_are_sorted_into_the_roofline_classes_by_name(name):
    assert inspection.kernel_class(name) == KERNELS[name]


def test_the_profile_and_the_roofline_share_their_classes():
    from cost_model import step_model

    assert step_model.CLASSES == inspection.WORK_CLASSES
    assert set(inspection.GPU_TIME_CLASSES) == {*inspection.WORK_CLASSES, "communication", "copies", "idle"}


def kernel(name, start_us, duration_us, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": start_us, "dur": duration_us, "pid": 0, "tid": 7}


def two_step_trace():
    """Two profiled steps of 1,000 us on the GPU, 100 us apart: a GEMM, attention, the loss, the optimizer, a copy,
    and an all-reduce that overlaps the second GEMM."""
    events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "ts": 0, "dur": 1}
              for n in (6, 7)]
    for step, offset in enumerate((10_000, 11_100)):
        events += [
            {"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{6 + step}", "ts": offset, "dur": 1_000},
            kernel("nvjet_hsh_256x128_64x4_2x1_v_bz_coopB_NTN", offset, 400),
            kernel("pytorch_flash::flash_fwd_kernel", offset + 400, 100),
            kernel("triton_red_fused__log_softmax__to_copy_nll_loss_forward_12", offset + 500, 50),
            kernel("multi_tensor_apply_kernel<FusedAdamMathFunctor>", offset + 600, 200),
            kernel("Memcpy HtoD (Pinned -> Device)", offset + 800, 20, cat="gpu_memcpy"),
            kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", offset + 300, 150),  # overlaps the GEMM
        ]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 10_000, "dur": 5})  # host work: not GPU time
    return {"traceEvents": events, "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}]}


def test_gpu_time_per_step_sums_each_class_and_finds_the_idle_time():
    per_step = inspection.gpu_time_per_step(two_step_trace())
    ms = {work: round(1e3 * seconds, 6) for work, seconds in per_step.items() if work != "steps"}
    assert per_step["steps"] == 2
    assert ms["step"] == 1.05  # 2,100 us from the first step's start to the last one's end, gap included
    assert (ms["matmul"], ms["attention"], ms["loss"], ms["optimizer"], ms["copies"], ms["communication"]) == (
        0.4, 0.1, 0.05, 0.2, 0.02, 0.15)
    assert ms["norm_activation"] == ms["elementwise"] == 0
    # busy per step: 0-550 (GEMM, the all-reduce inside it, attention, loss) and 600-820; the rest is idle,
    # the 100 us between the steps too: (1,000 - 770) per step + 100 / 2
    assert ms["idle"] == pytest.approx(0.28)


def test_a_trace_without_gpu_work_has_no_breakdown():
    trace = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]}
    assert inspection.gpu_time_per_step(trace) is None
    assert "no GPU kernels" in inspection.gpu_time_line(None, "6-8")


def test_the_log_line_reads_back_as_the_gpu_tier_reads_it():
    per_step = inspection.gpu_time_per_step(two_step_trace())
    line = inspection.gpu_time_line(per_step, "6-7")
    assert line.startswith("GPU time per step of steps 6-7 (kernels by name): 1.05 ms = matmuls 0.40 ms (38%)")
    shares = gpu_time_shares(f"some output\n{line}\nmore output")
    assert shares["matmul"] == pytest.approx(0.4e-3) and shares["idle"] == pytest.approx(0.28e-3)
    assert "norm_activation" not in shares and shares["step"] == pytest.approx(1.05e-3)


def write(tmp_path, trace, name="run.pt.trace.json"):
    path = tmp_path / name
    path.write_text(json.dumps(trace), encoding="utf-8")
    return path


def test_step_time_prints_each_class_beside_its_roofline_floor(tmp_path, capsys):
    path = write(tmp_path, two_step_trace())
    assert step_time.main([str(path), "--roofline", ROOT_ROOFLINE, "--rung", "10"]) == 0
    out = capsys.readouterr().out
    floors = json.loads(open(ROOT_ROOFLINE).read())["rungs"][10]["classes"]
    matmul_floor_ms = 1e3 * floors["matmul"]["floor_seconds"]
    assert f"| matmuls | 0.40 | 38.1% | {matmul_floor_ms:.2f} | {0.4 / matmul_floor_ms:.1f}x |" in out, out
    assert "| idle | 0.28 |" in out and "| communication | 0.15 |" in out, out
    assert "rung 10" in out and "batch 32 x 1024" in out, out


def test_step_time_finds_the_roofline_shipped_for_the_traces_gpu(tmp_path, capsys):
    assert step_time.main([str(write(tmp_path, two_step_trace())), "--rung", "10"]) == 0
    out = capsys.readouterr().out
    assert "roofline: docs/roofline/H100/roofline.json, rung 10" in out, out  # the repository's path, not the disk's


def test_a_gzipped_trace_reads_as_the_trace_itself(tmp_path, capsys):
    """The traces under bench/results/ are shipped gzipped: step_time reads them without a gunzip first."""
    import gzip

    path = write(tmp_path, two_step_trace())
    zipped = tmp_path / "trace.json.gz"
    zipped.write_bytes(gzip.compress(path.read_bytes()))
    assert step_time.main([str(path), "--rung", "10"]) == 0
    plain = capsys.readouterr().out
    assert step_time.main([str(zipped), "--rung", "10"]) == 0
    assert capsys.readouterr().out == plain and "| matmuls | 0.40 |" in plain


def test_step_time_names_the_overlap_and_the_top_kernels(tmp_path, capsys):
    assert step_time.main([str(write(tmp_path, two_step_trace()))]) == 0
    out = capsys.readouterr().out
    assert "add up to 114% of the step: kernels of overlapping streams" in out, out  # 1.2 ms in 1.05 ms
    top = [line for line in out.splitlines() if line.startswith("| `")]
    assert top[0].startswith("| `nvjet_hsh") and "| matmuls | 0.400 | 1 |" in top[0], top


@pytest.mark.parametrize("case", ["missing", "not-json", "cpu-trace", "other-gpu", "no-such-rung", "roofline-alone",
                                  "no-shipped-roofline"])
def test_step_time_refuses_with_one_line(tmp_path, capsys, case):
    good = write(tmp_path, two_step_trace())
    other_gpu = write(tmp_path, {**two_step_trace(), "deviceProperties": [{"name": "NVIDIA A100-SXM4-80GB"}]}, "a.json")
    argv = {
        "missing": [str(tmp_path / "nothing.json")],
        "not-json": [str(tmp_path / "x.json")],
        "cpu-trace": [str(write(tmp_path, {"traceEvents": []}, "cpu.json"))],
        "other-gpu": [str(other_gpu), "--roofline", ROOT_ROOFLINE, "--rung", "10"],
        "no-such-rung": [str(good), "--roofline", ROOT_ROOFLINE, "--rung", "12"],
        "roofline-alone": [str(good), "--roofline", ROOT_ROOFLINE],
        "no-shipped-roofline": [str(write(tmp_path, {**two_step_trace(), "deviceProperties": [{"name": "NVIDIA L4"}]},
                                          "l4.json")), "--rung", "10"],
    }[case]
    (tmp_path / "x.json").write_text("{ cut short", encoding="utf-8")
    expected = {"missing": "cannot read the trace", "not-json": "not JSON", "cpu-trace": "no GPU kernels",
                "other-gpu": "models the H100", "no-such-rung": "not rung 12", "roofline-alone": "--roofline needs --rung",
                "no-shipped-roofline": "ships no roofline for the NVIDIA L4"}[case]
    assert step_time.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured
    assert expected in captured.err, captured.err
