"""Host time per training step: what each stage's machinery costs when the step's arithmetic is too small to hide it.

  python bench/host_time.py                          # every run below on this machine's CPU
  python bench/host_time.py --runs 01,03 --steps 200 --device cuda
  python bench/host_time.py --runs 01,03 --profile 30  # then 30 steps more under the profiler: where the time goes

On a GPU the host queues a step's kernels while the GPU runs the previous ones, so the host's own work per step
(Python, the compiled graphs' wrappers, DDP's and FSDP2's hooks, the collectives' calls) costs nothing until it takes
longer than the GPU's. On an H100, a step of 01 at batch 32 took about 74 ms, and at batch 8 about 26 ms: there the
stages parted, 02 and 03 at one process running at 56% and 27% of 01's speed (02 with its graph split, 03 gathering
each block again for its backward, then).

This script measures the host's side alone. Each run is a process of its own (a fresh compiler, a process group of
one) that builds the stage's own GPTModel with GPT-2 small's 12 blocks, but 64 wide, with a vocabulary of 512 and
a batch of 2 x 64 tokens, so small that the arithmetic takes a few milliseconds. It wraps the model as the stage does
and times --steps training steps after --warmup, each with the stage's own calc_loss_batch (compiled as the stage
compiles it, under its autocast) and fused AdamW; forward with the loss, backward and the optimizer step apart.
PyTorch runs on one thread, as the host that queues a GPU's kernels does: on a 2-core CPU with two threads, one
process's median was up to 31% off another's of the same run (2026-11-27), with one thread up to 14%. Each run is
repeated in --repeats processes, taken in turns (01, 02, ..., then 01 again); the table gives the median process,
with the range of all of them.

  01        one compiled graph of forward and loss
  02        01 inside DDP at one process: one graph too (02 splits its graph only at two processes or more)
  02-split  02 with its graph split per gradient bucket, as at two processes or more. DDP's 25 MiB buckets (and
            the 1 MiB first) are shrunk by the ratio of this model's block to GPT-2 small's, so that it splits
            into as many graphs as GPT-2 small does, 14 (the notes give the count from Dynamo's log)
  03        FSDP2: every block compiled on its own and sharded (a process group of one: whole shards, which each
            block keeps gathered from its forward to its backward)
  03-resharded  03 as at two processes or more: each block frees its gathered weights after its forward and
            gathers them again for its backward
  03-one-unit  03 with FSDP2 on the whole model alone, not on each block: one unit, so one gather, one
            reduce-scatter and one set of hooks a step, over the same 137 parameters (03 over 03-one-unit: what
            the twelve blocks' own units cost; 03-one-unit over 03-unsharded: what FSDP2 costs per parameter)
  03-unsharded  03 without FSDP2: its blocks compiled one by one and the rest eager, as in 03, but nothing
            sharded and no bf16 policy: float32 weights under autocast, as in 01 (03-unsharded over 01: the graphs
            cut at the blocks; 03 over 03-unsharded: FSDP2 itself, its policy's casts included)

On a CPU the step's arithmetic is part of every figure, the same in each run; the differences between the runs are
what each stage's machinery adds. On a GPU (--device cuda) each phase is timed up to a synchronize.

--profile STEPS adds a second table: STEPS more steps in each process under torch.profiler, their host time (the mean
of a run's processes) split by the regions that PyTorch's own code labels (FSDP2's hooks by name, the compiled graphs'
calls, the collectives, the optimizer's step; the rest is Python, autograd's engine and eager ops between them). The
profiler slows each event, so the second table's steps are longer than the first's: read it for where the time goes,
the first for how much. On a GPU the regions hold only the host's side (the kernels run apart); on a CPU, the
arithmetic too (inside the compiled graphs, and FSDP2's copies inside its hooks).
Exit code 0 with the table; 1 when a run's process failed (its error printed); 2 with one line for an unknown run
or a device this machine lacks.
"""

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import devices  # noqa: E402  (needs the path above)
import failures  # noqa: E402
from failures import UsageError  # noqa: E402

RUNS = {"01": "01_opt_single_gpu.py", "02": "02_opt_multi_gpu_ddp.py", "02-split": "02_opt_multi_gpu_ddp.py",
        "03": "03_opt_multi_gpu_fsdp.py", "03-resharded": "03_opt_multi_gpu_fsdp.py",
        "03-one-unit": "03_opt_multi_gpu_fsdp.py", "03-unsharded": "03_opt_multi_gpu_fsdp.py"}
SMALL = {"vocab_size": 512, "context_length": 64, "emb_dim": 64, "n_heads": 4, "n_layers": 12, "drop_rate": 0.1,
         "qkv_bias": False}
BATCH = 2
PHASES = ("forward with loss", "backward", "optimizer step")
# --profile: where a step's host time goes, by the regions PyTorch's own code labels for the profiler. The first
# pattern that an event's name matches names its region; an event inside one already counted is not counted again.
REGIONS = (("FSDP2: {}", r"FSDP::(\w+)"),  # FSDP2's hooks, by their labels: pre_forward, all_gather, ...
           ("compiled graphs, forward", r"Torch-Compiled Region"),
           ("compiled graphs, backward", r"CompiledFunctionBackward$"),
           ("collectives", r"c10d::|nccl:|gloo:"),
           ("optimizer step", r"Optimizer\.step#"))
REST = "the rest: Python, autograd's engine, eager ops"  # the profiled step's time outside every region


def block_bytes(stage, cfg):
    """The float32 bytes of one of the stage's blocks at `cfg` (built on the meta device: no memory)."""
    import torch

    with torch.device("meta"):
        return sum(p.numel() * 4 for p in stage.TransformerBlock(cfg).parameters())


class BucketCount(logging.Handler):
    """The number of buckets, so of graphs, that Dynamo's DDP optimizer split the compiled graph into (its log)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        found = re.search(r"created (\d+) buckets", record.getMessage())
        self.count = int(found.group(1)) if found else self.count  # the last split (a recompile splits again)


def resharding_blocks(fully_shard):
    """fully_shard as 03 calls it at two processes or more: where 03 chooses whether a unit reshards after its
    forward (its blocks), it does."""
    def wrapped(module, **options):
        if "reshard_after_forward" in options:
            options["reshard_after_forward"] = True
        return fully_shard(module, **options)
    return wrapped


def region_of(name):
    """The REGIONS name for a profiler event's name, or None."""
    for label, pattern in REGIONS:
        found = re.match(pattern, name)
        if found:
            return label.format(*found.groups())
    return None


def host_regions(events, steps, step_ms):
    """Milliseconds per step in each region of REGIONS, from the profiler's CPU events of `steps` steps (each event
    counted once: not inside another counted one), and the rest of `step_ms`, the profiled steps' own time."""
    regions = {}
    for event in events:
        region, parent = region_of(event.name), event.cpu_parent
        while region and parent is not None:  # counted already, inside a region of its own?
            region = None if region_of(parent.name) else region
            parent = parent.cpu_parent
        if region:
            regions[region] = regions.get(region, 0.0) + event.cpu_time_total / 1000 / steps
    regions = dict(sorted(regions.items(), key=lambda item: -item[1]))
    regions[REST] = step_ms - sum(regions.values())
    return regions


def measure(run, device_name, steps, warmup, layers, compiled, profile=0):
    """One run, in this process: the stage's model, wrapped as the stage wraps it; milliseconds per phase."""
    import torch
    import torch.distributed as dist
    from bench.rungs import load_stage, whole_model_unit

    stage = load_stage(RUNS[run])
    if not compiled:
        torch.compiler.set_stance("force_eager")
    device = torch.device(device_name)
    torch.set_num_threads(1)  # the host's one thread (see the docstring)
    cfg = {**SMALL, "n_layers": layers}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(devices.free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    torch._dynamo.config.optimize_ddp = run == "02-split"  # 02 sets world_size > 1; 02-split plays two processes
    torch.manual_seed(0)
    with device:
        model = stage.GPTModel(cfg)
    trained, notes = model, ""
    if run.startswith("03"):
        if run == "03-resharded":  # the blocks' choice at two processes or more (the model's own unit: as it is)
            stage.fully_shard = resharding_blocks(stage.fully_shard)
            notes = "each block gathers its weights again for its backward"
        if run == "03-one-unit":  # the root's unit holds every parameter (FSDP2 keeps a root's gathered to backward)
            stage.fully_shard = whole_model_unit(stage.fully_shard)
            notes = "FSDP2's unit on the whole model alone, not on each block"
        if run == "03-unsharded":  # shard_model's per-block compile, without the sharding (and its bf16 policy)
            stage.fully_shard = lambda module, **options: module
            notes = "no FSDP2: the blocks compiled one by one, the rest eager"
        stage.shard_model(model, device, activation_checkpointing=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1, fused=True)
    buckets = BucketCount()
    if run.startswith("02"):
        cap_mb = 25  # DDP's default bucket
        if run == "02-split":  # DDP's and Dynamo's caps, shrunk alike (Dynamo reads the first bucket's from here)
            scale = block_bytes(stage, cfg) / block_bytes(stage, stage.GPT_CONFIG_124M)
            cap_mb *= scale
            dist._DEFAULT_FIRST_BUCKET_BYTES = int(dist._DEFAULT_FIRST_BUCKET_BYTES * scale)
            notes = f"buckets of {cap_mb:.3f} MiB" + ("" if compiled else ", eager: no graph to split")
            split_log = logging.getLogger("torch._dynamo.backends.distributed")  # "... created N buckets"
            split_log.setLevel(logging.INFO)
            split_log.addHandler(buckets)
        trained = stage.DDP(stage.ModelWithLoss(model), bucket_cap_mb=cap_mb, gradient_as_bucket_view=True)
    trained.train()
    inputs = torch.randint(0, cfg["vocab_size"], (BATCH, cfg["context_length"]))
    targets = torch.randint(0, cfg["vocab_size"], (BATCH, cfg["context_length"]))
    times = {phase: [] for phase in PHASES}

    def clock():
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def train_step():
        start = clock()
        optimizer.zero_grad()
        loss = stage.calc_loss_batch(inputs, targets, trained, device)
        forward = clock()
        loss.backward()
        backward = clock()
        optimizer.step()
        return forward - start, backward - forward, clock() - backward

    for step in range(warmup + steps):
        seconds = train_step()
        if step >= warmup:
            for phase, phase_seconds in zip(PHASES, seconds):
                times[phase].append(phase_seconds * 1000)
    regions = None
    if profile:  # more steps, under the profiler (which slows them): the timed ones above are left alone
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            start = clock()
            for _ in range(profile):
                train_step()
            step_ms = (clock() - start) * 1000 / profile
        regions = host_regions(profiler.events(), profile, step_ms)
    dist.destroy_process_group()
    if buckets.count:
        notes += f": {buckets.count} graphs"
    result = {phase: statistics.median(values) for phase, values in times.items()}
    result["step"] = statistics.median([sum(parts) for parts in zip(*times.values())])
    return {"run": run, "ms": result, "notes": notes, "torch": torch.__version__, "regions": regions}


def median_process(results, run):
    """The process of `run` whose step time is the median of its processes' (the lower of two middle ones)."""
    processes = sorted((r for r in results if r["run"] == run), key=lambda r: r["ms"]["step"])
    return processes[(len(processes) - 1) // 2]


def table(results, args):
    """The median process of each run (by its step time), with the range of all its processes' step times."""
    lines = [f"Host time per step, in ms (each process: the median of {args.steps} steps after {args.warmup}; "
             f"{args.repeats} process{'es' if args.repeats > 1 else ''} per run), on {args.device}, "
             f"PyTorch {results[0]['torch']}: the stages' "
             f"GPTModel with {args.layers} blocks 64 wide, vocabulary {SMALL['vocab_size']}, batch {BATCH} x "
             f"{SMALL['context_length']} tokens{'' if args.compile else ', eager (--no-compile)'}", "",
             "| run | step (all processes) | " + " | ".join(PHASES) + " | step / 01's | notes |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    median = {run: (median_process(results, run), [r["ms"]["step"] for r in results if r["run"] == run])
              for run in dict.fromkeys(r["run"] for r in results)}
    for run, (middle, steps) in median.items():
        ratio = f"{middle['ms']['step'] / median['01'][0]['ms']['step']:.2f}" if "01" in median else "n/a"
        lines.append(f"| {run} | {middle['ms']['step']:.2f} ({min(steps):.2f}-{max(steps):.2f}) | "
                     + " | ".join(f"{middle['ms'][phase]:.2f}" for phase in PHASES) + f" | {ratio} | "
                     f"{middle['notes']} |")
    return "\n".join(lines)


def mean_regions(results, run):
    """The regions of every process of `run`, averaged (a region a process lacks counts 0 there), so that the
    regions and the rest still add up to the mean profiled step."""
    processes = [r["regions"] for r in results if r["run"] == run]
    names = dict.fromkeys(name for regions in processes for name in regions)
    return {name: sum(regions.get(name, 0.0) for regions in processes) / len(processes) for name in names}


def region_table(results, args):
    """--profile: each run's profiled steps, region by region (REGIONS), averaged over its processes, runs side by
    side."""
    runs = list(dict.fromkeys(r["run"] for r in results))
    regions = {run: mean_regions(results, run) for run in runs}
    names = list(dict.fromkeys(name for run in runs for name in regions[run] if name != REST))
    lines = [f"Where the host's time goes, in ms per step: {args.profile} more steps in each process, under "
             "torch.profiler (CPU events; slower than the steps above), by the regions PyTorch labels, the mean of "
             "each run's processes", "",
             "| region | " + " | ".join(runs) + " |", "| --- |" + " ---: |" * len(runs)]
    for name in [*names, REST]:
        lines.append(f"| {name} | " + " | ".join(f"{regions[run][name]:.2f}" if name in regions[run] else "-"
                                                 for run in runs) + " |")
    lines.append("| profiled step | " + " | ".join(f"{sum(regions[run].values()):.2f}" for run in runs) + " |")
    return "\n".join(lines)


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=100, help="timed steps per run (default 100)")
    parser.add_argument("--warmup", type=int, default=5, help="steps first, untimed: the compilation (default 5)")
    parser.add_argument("--layers", type=int, default=12, help="blocks (default 12, GPT-2 small's)")
    parser.add_argument("--repeats", type=int, default=3, help="processes per run, taken in turns (default 3)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="every run eager")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="then STEPS more steps under torch.profiler: a second table, where their host time goes")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one run, in its own process: prints its JSON
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.worker, args.device, args.steps, args.warmup, args.layers, args.compile,
                                 args.profile)))
        return failures.EXIT_OK
    runs = [name.strip() for name in args.runs.split(",") if name.strip()]
    try:
        if not runs or any(name not in RUNS for name in runs):
            raise UsageError(f"--runs {args.runs}: the runs are {', '.join(RUNS)}")
        if min(args.steps, args.layers, args.repeats) < 1 or min(args.warmup, args.profile) < 0:
            raise UsageError("--steps, --layers and --repeats take a whole number from 1, --warmup and --profile "
                             "from 0")
        if args.device == "cuda":
            import torch
            if not torch.cuda.is_available():
                raise UsageError("--device cuda: this machine's PyTorch sees no CUDA GPU")
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return failures.EXIT_USAGE
    results = []
    for turn, run in ((turn, run) for turn in range(args.repeats) for run in runs):
        print(f"  ... {run} ({turn + 1} of {args.repeats})", file=sys.stderr, flush=True)
        command = [sys.executable, __file__, "--worker", run, "--device", args.device, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--layers", str(args.layers), "--profile", str(args.profile)] + (
                       [] if args.compile else ["--no-compile"])
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            print(f"{run} failed (exit {done.returncode}):\n{done.stderr[-3000:]}", file=sys.stderr)
            return failures.EXIT_FAILED
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(table(results, args))
    if args.profile:
        print("\n" + region_table(results, args))
    return failures.EXIT_OK


if __name__ == "__main__":
    sys.exit(failures.process_done(main()))
