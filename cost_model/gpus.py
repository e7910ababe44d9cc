"""A GPU's data sheet, as the cost model reads it: dense peak FLOP/s per precision and memory bandwidth.

The peaks are the stages' own table (utilization.PEAK_TFLOPS, which MFU divides by); the bandwidths sit here, one per
row of that table. `find_gpu("H100")` (any name the peak table's patterns match, a CUDA device name too) gives a `Gpu`
with both, its ridge points and the precision step 5 picks on it.
"""

from dataclasses import dataclass

import failures  # the plumbing modules sit beside cost_model/, on the path of whatever imports cost_model.gpus
import utilization


@dataclass(frozen=True)
class Gpu:
    name: str
    tflops: dict             # precision -> dense TFLOP/s, None where the GPU lacks the format
    bandwidth_gb_per_s: float

    @property
    def bandwidth(self):
        return self.bandwidth_gb_per_s * 1e9

    @property
    def has_tf32(self):
        return bool(self.tflops["tf32"])

    @property
    def autocast_precision(self):
        """Step 5 on this GPU, as devices.autocast_precision decides it: bf16 where tensor cores have it (compute
        capability 8.0+), fp16 with a gradient scaler where they have only that (7.x), else float32."""
        return "bf16" if self.tflops["bf16"] else "fp16" if self.tflops["fp16"] else "fp32"

    def peak(self, precision):
        return self.tflops[precision] * 1e12

    def ridge(self, precision):
        """FLOPs per byte above which work at this precision is compute-bound on this GPU."""
        return self.peak(precision) / self.bandwidth


# Memory bandwidth in GB/s of each row of utilization.PEAK_TFLOPS, by the row's name pattern: the HBM or GDDR
# figure of the same data sheets: A100 data sheet (80 GB SXM 2,039, 80 GB PCIe 1,935, 40 GB 1,555), H100 (SXM 3.35
# TB/s, PCIe 2 TB/s, NVL 3.9 TB/s), H800 (as H100), H200 and H200 NVL (4.8 TB/s), HGX B200 and GB200 NVL72 (8 TB/s
# per GPU), L40S 864, A10 600, L4 300, RTX A6000 768, GeForce RTX 4090 / 4080 / 3090 specifications (1,008 / 716.8 /
# 936), V100 900 (V100S 1,134), T4 320.
BANDWIDTH_GB_PER_S = {
    r"GB200": 8000, r"B200": 8000, r"H200 NVL": 4800, r"H200": 4800,
    r"H100 NVL": 3900, r"H100 PCIe": 2000, r"H100": 3350, r"H800 PCIe": 2000, r"H800": 3350,
    r"A100.*(PCIe.*\b40 ?GB|\b40 ?GB.*PCIe)": 1555, r"A100.*PCIe": 1935, r"A100.*\b40 ?GB": 1555, r"A100": 2039,
    r"L40S": 864, r"A10\b": 600, r"L4\b": 300, r"RTX A6000": 768,
    r"RTX 4090": 1008, r"RTX 4080": 716.8, r"RTX 3090": 936,
    r"V100S": 1134, r"V100.*PCIE": 900, r"V100": 900, r"\bT4\b": 320,
}


def find_gpu(name):
    row = utilization.peak_row(name)
    if row is None:
        readable = [utilization.readable_gpu_name(pattern) for pattern, _ in utilization.PEAK_TFLOPS]
        known = ", ".join(dict.fromkeys(gpu for gpu in readable if gpu))
        raise failures.UsageError(f"--gpu {name}: not in the peak table (utilization.PEAK_TFLOPS); known: {known}")
    pattern, tflops = row
    return Gpu(name=name, tflops=dict(zip(utilization.PRECISIONS, tflops)),
               bandwidth_gb_per_s=BANDWIDTH_GB_PER_S[pattern])
