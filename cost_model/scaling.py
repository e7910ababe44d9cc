"""Gradient accumulation and data parallelism over the roofline of one training step (cost_model/step_model.py).

  python cost_model/scaling.py --gpu A100 --gpus 4 --link nvlink-a100            # rung 11 as the original tutorial ran it
  python cost_model/scaling.py --gpu H100 --gpus 16 --link ib-100g --batch-size 8 --grad-accum-steps 1,4,8

With N micro-batches per optimizer step (--grad-accum-steps) everything but AdamW happens N times, AdamW once, and
the backward of every micro-batch after the first adds its gradients to the kept ones: one more read of them and
a read and a write of the sums, 12 bytes per float32 gradient. Under DDP (rung 11) every optimizer step all-reduces
the float32 gradients once: a ring all-reduce sends and receives 2 (P - 1) / P times their bytes through each GPU's
link. DDP overlaps it with the backward of the last micro-batch (about two thirds of a micro-batch's floor: the
backward does twice the forward's matmuls), so only what outlasts that backward adds to the step. The ceiling is
the tokens of all GPUs over that floor: an upper bound, as every floor here is.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import cli  # noqa: E402  (needs the path above)
import failures

# Each GPU's link to the others, GB/s in one direction (the all-reduce sends and receives at once).
LINKS_GB_PER_S = {
    "nvlink-a100": 300.0,   # NVLink 3, 12 links: 600 GB/s both ways (A100 data sheet)
    "nvlink-h100": 450.0,   # NVLink 4, 18 links: 900 GB/s both ways (H100 SXM data sheet)
    "pcie4": 32.0,          # PCIe 4.0 x16, no NVLink
    "pcie5": 64.0,          # PCIe 5.0 x16
    "ib-400g": 50.0,        # 400 Gb/s InfiniBand per GPU, between nodes
    "ib-100g": 12.5,        # 100 Gb/s InfiniBand or Ethernet per GPU
    "eth-25g": 3.125,       # 25 Gb/s Ethernet shared by a node's GPUs: per GPU, divide by their number
}
BACKWARD_SHARE = 2 / 3  # of a micro-batch's floor: the window an all-reduce can hide in
GRADIENT_BYTES = 4      # float32 gradients: DDP reduces them as they are


def accumulated(row, steps):
    """A model_rung row for `steps` micro-batches of its batch per optimizer step: floor, ceiling and classes per
    optimizer step."""
    if steps == 1:
        return row
    classes = {}
    for work, entry in row["classes"].items():
        times = 1 if work == "optimizer" else steps
        classes[work] = {**entry, **{key: entry[key] * times for key in
                                     ("flops", "tensor_core_flops", "bytes", "compute_seconds", "memory_seconds")}}
    summing = classes["elementwise"]
    summing["bytes"] += (steps - 1) * 12 * row["parameters"]
    summing["memory_seconds"] += (steps - 1) * 12 * row["parameters"] / (row["bandwidth_gb_per_s"] * 1e9)
    for entry in classes.values():
        entry["floor_seconds"] = max(entry["compute_seconds"], entry["memory_seconds"])
        entry["bound"] = "compute" if entry["compute_seconds"] >= entry["memory_seconds"] else "memory"
    floor = sum(entry["floor_seconds"] for entry in classes.values())
    for entry in classes.values():
        entry["share"] = entry["floor_seconds"] / floor
    tokens = row["tokens_per_step"] * steps
    return {**row, "classes": classes, "grad_accum_steps": steps, "tokens_per_step": tokens,
            "floor_seconds": floor, "ceiling_tok_per_sec": tokens / floor,
            **{key: sum(entry[key] for entry in classes.values()) for key in ("flops", "tensor_core_flops", "bytes")}}


def data_parallel(row, gpus, link_gb_per_s):
    """Rung 11's ceiling from a (possibly accumulated) rung-10 row: `gpus` GPUs, each with its own batch, one
    all-reduce of the gradients per optimizer step."""
    steps = row.get("grad_accum_steps", 1)
    all_reduce_bytes = 2 * (gpus - 1) / gpus * GRADIENT_BYTES * row["parameters"] if gpus > 1 else 0.0
    all_reduce_seconds = all_reduce_bytes / (link_gb_per_s * 1e9) if all_reduce_bytes else 0.0
    micro_floor = (row["floor_seconds"] - row["classes"]["optimizer"]["floor_seconds"]) / steps
    exposed = max(0.0, all_reduce_seconds - BACKWARD_SHARE * micro_floor)
    floor = row["floor_seconds"] + exposed
    return {"gpus": gpus, "grad_accum_steps": steps, "link_gb_per_s": link_gb_per_s,
            "tokens_per_step": row["tokens_per_step"] * gpus, "all_reduce_bytes_per_gpu": all_reduce_bytes,
            "all_reduce_seconds": all_reduce_seconds, "exposed_seconds": exposed, "floor_seconds": floor,
            "ceiling_tok_per_sec": row["tokens_per_step"] * gpus / floor,
            "all_reduce_bytes_per_token": all_reduce_bytes / row["tokens_per_step"]}


def link_speed(text):
    if text in LINKS_GB_PER_S:
        return LINKS_GB_PER_S[text]
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': one of {', '.join(LINKS_GB_PER_S)}, or GB/s") from None


def main(argv=None):
    from cost_model.gpus import find_gpu
    from cost_model.step_model import model_rung

    parser = cli.OneLineParser(prog="cost_model/scaling.py", description=__doc__, allow_abbrev=False,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", required=True, metavar="NAME", help="a GPU of utilization.PEAK_TFLOPS, e.g. A100, H100")
    parser.add_argument("--gpus", type=cli.whole_number(1), default=1, help="GPUs under DDP (default: 1)")
    parser.add_argument("--link", type=link_speed, default=LINKS_GB_PER_S["nvlink-h100"],
                        help=f"each GPU's link: {', '.join(LINKS_GB_PER_S)} or GB/s (default: nvlink-h100)")
    parser.add_argument("--batch-size", type=cli.whole_number(1), default=32,
                        help="sequences per micro-batch and GPU (default: 32, 01's)")
    parser.add_argument("--grad-accum-steps", default="1,4", metavar="N[,N...]",
                        help="micro-batches per optimizer step, one row each (default: 1,4)")
    parser.add_argument("--model", choices=tuple(cli.MODEL_SIZES), default="gpt2-small")
    args = parser.parse_args(argv)
    try:
        steps_list = [int(part) for part in args.grad_accum_steps.split(",")]
        assert all(steps >= 1 for steps in steps_list)
    except (ValueError, AssertionError):
        parser.error(f"--grad-accum-steps {args.grad_accum_steps}: whole numbers of at least 1, comma-separated")
    gpu = find_gpu(args.gpu)
    row = model_rung(10, gpu, model=args.model, batch_size=args.batch_size)
    link = f"{args.link:g} GB/s link each way" if args.gpus > 1 else "no link: one GPU all-reduces nothing"
    print(f"{args.model} on {args.gpus} x {args.gpu} ({link}), micro-batch "
          f"{args.batch_size} x {row['context_length']}")
    print("| accumulation steps | tokens per optimizer step, all GPUs | floor ms | all-reduce ms (exposed) "
          "| all-reduce bytes per token | ceiling tok/s, all GPUs | per GPU |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for steps in steps_list:
        scaled = data_parallel(accumulated(row, steps), args.gpus, args.link)
        print(f"| {steps} | {scaled['tokens_per_step']:,} | {1e3 * scaled['floor_seconds']:.1f} | "
              f"{1e3 * scaled['all_reduce_seconds']:.1f} ({1e3 * scaled['exposed_seconds']:.1f}) | "
              f"{scaled['all_reduce_bytes_per_token']:,.0f} | {scaled['ceiling_tok_per_sec']:,.0f} | "
              f"{scaled['ceiling_tok_per_sec'] / args.gpus:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(failures.process_done(failures.run(main)))
