"""Where the GPU time of a profiled training step goes, class by class, beside the roofline's floor for each class.

  python 01_opt_single_gpu.py --max-steps 20 --profile      # writes runs/01_opt_single_gpu/profile/*.json
  python bench/step_time.py runs/01_opt_single_gpu/profile/01_opt_single_gpu.pt.trace.json
  python bench/step_time.py TRACE --rung 10       # beside rung 10 of docs/roofline/<this GPU>/roofline.json
  python bench/step_time.py bench/results/nvidia-h200/profile/01_opt_single_gpu.pt.trace.json.gz --rung 10
  python bench/step_time.py TRACE --roofline PATH --rung 10   # another roofline.json of cost_model/roofline.py

It reads the trace that --profile wrote (steps 6-8 of the run, or the later ones it moved to), sorts every GPU
kernel into the roofline's six classes of work by its name (inspection.kernel_class: cuBLAS's GEMMs, FlashAttention,
the loss's log-softmax, AdamW's multi-tensor kernels, norms and activations, everything else elementwise), adds
NCCL's communication, the copies, and the time the GPU ran nothing ("idle": the host did not keep it fed), and
prints a markdown table of milliseconds per step. With --rung (and --roofline, or the roofline docs/roofline/ ships
for the trace's GPU), each class also gets the floor that cost_model/roofline.py modelled for it on that GPU, and
measured over floor: the class furthest above its floor is where a change can gain most. Then the kernels that took
the most time, with their class, so that a name the rules sort wrongly shows.

The roofline must model the run that was profiled: the same GPU (checked against the trace's device), the same
rung (rung 10 is 01 as it is; 00 is rung 0) and the same batch (the roofline's batch is printed; the trace does
not record one).

Exit code 0 with the table; 2 with one line for a missing or unreadable trace, a trace without GPU kernels (a
CPU run), or a roofline of another GPU or without that rung.
"""

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # inspection and bench.report, wherever the script is started from

import failures  # noqa: E402  (needs the path above)
from bench.report import repository_path, same_gpu, shipped_rooflines  # noqa: E402
from failures import UsageError  # noqa: E402
from inspection import (GPU_BUSY_CATEGORIES, GPU_TIME_CLASSES, WORK_CLASSES, WORK_LABELS,  # noqa: E402
                        gpu_time_per_step, kernel_class)

TOP_KERNELS = 12


def read_trace(path):
    """The trace as json.load gives it; gzipped too (the traces shipped under bench/results/ are .json.gz)."""
    try:
        with open(path, "rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"
        with (gzip.open if gzipped else open)(path, "rt", encoding="utf-8") as f:
            trace = json.load(f)
    except OSError as err:
        raise UsageError(f"cannot read the trace {path}: {err.strerror or err}; --profile writes it under "
                         "<out>/profile/") from None
    except ValueError as err:
        raise UsageError(f"{path} is not a trace of torch.profiler (not JSON: {err})") from None
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise UsageError(f"{path} is not a trace of torch.profiler (no traceEvents)")
    return trace


def trace_gpu_name(trace):
    """The name of the GPU the trace was taken on, where the trace records it."""
    devices = trace.get("deviceProperties") or []
    return devices[0].get("name") if devices and isinstance(devices[0], dict) else None


def shipped_roofline_path(gpu_name):
    """docs/roofline/<GPU>/roofline.json for the GPU the trace was taken on (--rung without --roofline)."""
    for path, roofline in shipped_rooflines():
        if gpu_name and same_gpu(roofline["gpu"], gpu_name):
            return path
    raise UsageError(f"docs/roofline/ ships no roofline for the {gpu_name or 'GPU of this trace'}: write one with "
                     f"python cost_model/roofline.py --gpu '{gpu_name or 'NAME'}' --out DIR and give it with --roofline")


def roofline_floors(path, rung, gpu_name):
    """{class: floor seconds} of `rung` in a roofline.json, and the line that says what it models."""
    try:
        roofline = json.loads(Path(path).read_text(encoding="utf-8"))
        rows = {int(row["rung"]): row for row in roofline["rungs"]}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"{path} is not a roofline.json of cost_model/roofline.py ({type(err).__name__}: {err})") from None
    if rung not in rows:
        raise UsageError(f"{path} models rungs {sorted(rows)}, not rung {rung}")
    if gpu_name and not same_gpu(roofline["gpu"], gpu_name):
        raise UsageError(f"{path} models the {roofline['gpu']}, but the trace was taken on the {gpu_name}: run "
                         f"python cost_model/roofline.py --gpu '{gpu_name}' --out DIR for this GPU")
    row = rows[rung]
    floors = {work: row["classes"][work]["floor_seconds"] for work in WORK_CLASSES}
    what = (f"roofline: {repository_path(path)}, rung {rung} ({row.get('change', '')}) on the {roofline['gpu']}, "
            f"batch {row['batch_size']} x {row['context_length']} tokens, floor {1e3 * row['floor_seconds']:.2f} ms")
    return floors, what


def top_kernels(trace, steps, limit=TOP_KERNELS):
    """[(name, class, seconds per step, launches per step)] of the kernels that took the most GPU time."""
    totals, launches, classes = defaultdict(float), defaultdict(int), {}
    for event in trace["traceEvents"]:
        if event.get("ph") == "X" and event.get("cat") in GPU_BUSY_CATEGORIES:
            name = event.get("name", "")
            totals[name] += float(event.get("dur", 0)) / 1e6
            launches[name] += 1
            classes[name] = GPU_BUSY_CATEGORIES[event["cat"]] or kernel_class(name)
    ranked = sorted(totals, key=totals.get, reverse=True)[:limit]
    return [(name, classes[name], totals[name] / steps, launches[name] / steps) for name in ranked]


def render(per_step, kernels, gpu_name, floors=None, roofline_line=None):
    step = per_step["step"]
    lines = [f"GPU time per profiled step: {1e3 * step:.2f} ms on the {gpu_name or 'GPU'} "
             "(kernels sorted into classes by their names: inspection.kernel_class)", ""]
    if roofline_line:
        lines += [roofline_line, ""]
    header = "| class | ms per step | share of the step |" + (" roofline floor, ms | measured / floor |"
                                                          if floors else "")
    lines += [header, "| --- | ---: | ---: |" + (" ---: | ---: |" if floors else "")]
    for work in GPU_TIME_CLASSES:
        if per_step[work] == 0 and work not in WORK_CLASSES and work != "idle":
            continue
        row = f"| {WORK_LABELS[work]} | {1e3 * per_step[work]:.2f} | {per_step[work] / step:.1%} |"
        if floors:
            floor = floors.get(work)
            ratio = f"{per_step[work] / floor:.1f}x" if floor else "-"
            row += f" {1e3 * floor:.2f} | {ratio} |" if floor is not None else " - | - |"
        lines.append(row)
    busy = sum(per_step[work] for work in GPU_TIME_CLASSES)
    if busy > step * 1.001:
        lines += ["", f"The classes add up to {busy / step:.0%} of the step: kernels of overlapping streams "
                      "(communication beside the backward) run at the same time."]
    lines += ["", f"The {len(kernels)} kernels that took the most time:", "",
              "| kernel | class | ms per step | launches per step |", "| --- | --- | ---: | ---: |"]
    for name, work, seconds, count in kernels:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{short.replace('|', '/')}` | {WORK_LABELS[work]} | {1e3 * seconds:.3f} | {count:g} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("trace", help="the .pt.trace.json that --profile wrote under <out>/profile/")
    parser.add_argument("--roofline", help="a roofline.json of cost_model/roofline.py for the same GPU")
    parser.add_argument("--rung", type=int, help="the rung the profiled run is (10: 01 as it is; 0: 00)")
    args = parser.parse_args(argv)
    try:
        if args.roofline is not None and args.rung is None:
            raise UsageError("--roofline needs --rung: the floors are those of one rung (10: 01 as it is; 0: 00)")
        trace = read_trace(args.trace)
        per_step = gpu_time_per_step(trace)
        if per_step is None:
            raise UsageError(f"{args.trace} holds no GPU kernels (a CPU run's trace?): profile a run on a GPU")
        gpu_name = trace_gpu_name(trace)
        if args.rung is not None and args.roofline is None:
            args.roofline = shipped_roofline_path(gpu_name)
        floors, roofline_line = (roofline_floors(args.roofline, args.rung, gpu_name) if args.roofline
                                 else (None, None))
        print(render(per_step, top_kernels(trace, per_step["steps"]), gpu_name, floors, roofline_line))
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return failures.EXIT_USAGE
    return failures.EXIT_OK


if __name__ == "__main__":
    sys.exit(failures.process_done(main()))
