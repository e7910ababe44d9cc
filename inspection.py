"""Looking inside a run: --profile and --memory-snapshot, the same in every stage.

Configuration, not code in the loop: the stage labels a step's parts with region(), and the run's books
(progress.TrainingProgress.timed_step) ask off_clock() before each step and call step_done() after it; with both
flags off every call does nothing.
"""

import contextlib
import errno
import json
import os
import sys
from pathlib import Path

import checkpoints
import gpu_memory
from failures import UsageError

PROFILE_WAIT, PROFILE_WARMUP, PROFILE_ACTIVE = 5, 1, 3  # steps of torch.profiler's schedule, from the run's start
# The labels of the stage's regions and of torch.profiler's steps: the table ranks kernels and operators, not these
# (on CUDA their device-side copies span a whole step and would top a table sorted by device time).
REGION_LABELS = ("forward with loss", "backward", "optimizer step")
SNAPSHOT_STEPS = 3  # steps of allocator history in a memory snapshot

# The classes of work of a training step, the roofline's (cost_model/step_model.py) and the profile's breakdown, in the
# order of their tables; a profile adds what the GPU does besides computing, and the time it waits.
WORK_CLASSES = ("matmul", "attention", "norm_activation", "elementwise", "loss", "optimizer")
WORK_LABELS = {"matmul": "matmuls", "attention": "attention", "norm_activation": "norms, activations",
               "elementwise": "other elementwise", "loss": "loss", "optimizer": "optimizer",
               "communication": "communication", "copies": "copies", "idle": "idle"}
GPU_TIME_CLASSES = (*WORK_CLASSES, "communication", "copies", "idle")


def profile_start(first_step, total_steps, eval_freq, save_every, steps_per_epoch=0):
    """The warm-up step of --profile: PROFILE_WAIT steps into the run, or the first step after that from which the
    warm-up and the kept steps have no evaluation, checkpoint or end of an epoch (its sample) between them. Those
    run after a step, inside the trace (after the warm-up step or after a kept step but the last): their kernels
    and waits would count as the training step's. The earliest step is kept where no later one is clear
    (--eval-freq 1, say)."""
    earliest, length = first_step + PROFILE_WAIT, PROFILE_WARMUP + PROFILE_ACTIVE
    for start in range(earliest, min(total_steps - length, earliest + 10_000) + 1):
        if window_is_clear(start, eval_freq, save_every, steps_per_epoch):
            return start
    return earliest


def steps_for_a_clear_window(first_step, eval_freq, save_every, steps_per_epoch=0):
    """The --max-steps of the shortest run from `first_step` whose profiled steps have nothing but training between
    them (profile_start), or None where no run has (--eval-freq 1, say)."""
    start = profile_start(first_step, first_step + 20_000, eval_freq, save_every, steps_per_epoch)
    if window_is_clear(start, eval_freq, save_every, steps_per_epoch):
        return start + PROFILE_WARMUP + PROFILE_ACTIVE
    return None


def window_is_clear(start, eval_freq, save_every, steps_per_epoch=0):
    """Whether nothing but training follows the profile's warm-up step `start` or a kept step but the last."""
    return not any(step % eval_freq == 0 or (save_every and (step + 1) % save_every == 0)
                   or (steps_per_epoch and (step + 1) % steps_per_epoch == 0)
                   for step in range(start, start + PROFILE_WARMUP + PROFILE_ACTIVE - 1))


class RunInspection:
    """--profile and --memory-snapshot, the same in every stage; both off: it does nothing.

    --profile follows torch.profiler's schedule: PROFILE_WAIT steps or more not recorded (the first compiles; more
    where an evaluation would fall among the steps that follow: profile_start), PROFILE_WARMUP recorded and thrown
    away, then PROFILE_ACTIVE steps whose trace is kept. Those steps run off the training clock (profiling slows
    them), and so does the step before them, which ends by switching the profiler on; the stage labels the regions
    of each step with region(). --memory-snapshot records the CUDA caching allocator's history over the first
    SNAPSHOT_STEPS steps, which also run off the clock (recording every allocation slows them, and the dump after
    the last synchronizes and pickles). In a distributed run only rank 0 profiles and writes. Steps are numbered
    from 0 as in the log lines, and the trace's ProfilerStep#N labels use the same numbers.
    """

    def __init__(self, args, device, first_step, total_steps, steps_per_epoch=0):
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.out = Path(args.out)
        self.cuda = device.type == "cuda"
        self.first_step = first_step
        self.report = None
        if args.memory_snapshot and not self.cuda:
            raise UsageError("--memory-snapshot records the CUDA caching allocator: it needs a GPU (--device cuda)")
        between_steps = (args.eval_freq, args.save_every, steps_per_epoch)  # what may run after a step
        start = profile_start(first_step, total_steps, *between_steps)  # the warm-up step
        profiled_last = start + PROFILE_WARMUP + PROFILE_ACTIVE  # one past the last, 0-based
        clear_end = steps_for_a_clear_window(first_step, *between_steps) if args.profile else None
        if args.profile and total_steps < profiled_last:  # the run to suggest: one whose window is clear
            last = clear_end or profiled_last
            longer = [f"--max-steps {last} or more (or 0)"] if 0 < args.max_steps < last else []
            if steps_per_epoch and args.epochs * steps_per_epoch < last:  # the epochs end the run first
                longer.append(f"--epochs {-(-last // steps_per_epoch)} or more")
            raise UsageError(f"--profile records steps {last - PROFILE_ACTIVE} to {last - 1}"
                             + (" (after the warm-up, with no evaluation among them)" if clear_end else "")
                             + f", but this run's last step is {total_steps - 1}: use {' and '.join(longer)}")
        is_writer = not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)
        self.profiler = self.snapshot = None
        if args.profile and is_writer:
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                                   if self.cuda else [])
            self.profiler = torch.profiler.profile(
                activities=activities, on_trace_ready=self._write_trace,
                schedule=torch.profiler.schedule(wait=PROFILE_WAIT, warmup=PROFILE_WARMUP, active=PROFILE_ACTIVE,
                                                 repeat=1, skip_first=start - PROFILE_WAIT),
                acc_events=True)  # one cycle, so nothing accumulates; without it PyTorch 2.11 warns that it would not
            self.profiler.step_num = first_step  # ProfilerStep#N: N is the log's step number, also after --resume
            self.profiler.start()
            self.profiled_steps = range(start, profiled_last)  # warm-up and active
            if not window_is_clear(start, *between_steps):
                print(f"--profile: an evaluation, a checkpoint or an epoch's end falls among profiled steps {start}-"
                      f"{profiled_last - 1}, and this run ends too soon to move past it: its work is in the trace"
                      + (f" (--max-steps {clear_end} moves the window clear of it)" if clear_end else ""), flush=True)
            self.off_clock_steps = range(start - 1, profiled_last)  # and the step that switches the profiler on
        if args.memory_snapshot and is_writer:
            # Python stacks only: the C++ frames ("all", the default) are symbolized at the dump, which can take
            # minutes at this size; the Python lines are what memory_viz shows a reader of the stage
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
            torch.cuda.reset_peak_memory_stats(device)
            self.snapshot = device
            self.snapshot_recorded = 0  # steps done since the recording began; it stops after SNAPSHOT_STEPS

    def off_clock(self, step):
        """Whether step `step` (0-based) is profiled or recorded for the snapshot, and so left off the clock."""
        return ((self.profiler is not None and step in self.off_clock_steps)
                or self.snapshot is not None)  # still recording

    def region(self, name):
        """A labelled region of a step in the trace (nothing at all when not profiling)."""
        if self.profiler is None:
            return contextlib.nullcontext()
        return self.torch.profiler.record_function(name)

    def step_done(self, step):
        """Call after each training step (`step`, 0-based, the one just done)."""
        if self.profiler is not None:
            if self.cuda and step + 1 in (self.profiled_steps.start + PROFILE_WARMUP, self.profiled_steps.stop):
                # After the warm-up step, so that none of its kernels runs among the kept steps' (they would count),
                # and after the last kept one, so that the trace holds all of its kernels. Between kept steps the
                # host runs ahead of the GPU as in training: the idle time a profile shows is the training loop's,
                # not waits made for the trace. These steps are off the clock: waiting costs tok/s nothing.
                self.torch.cuda.synchronize()
            self.profiler.step()
            if step + 1 >= self.profiled_steps.stop:
                self.profiler.stop()
                self.profiler = None
        if self.snapshot is not None:
            self.snapshot_recorded += 1
            if self.snapshot_recorded >= SNAPSHOT_STEPS:
                self._write_snapshot()

    def _write_trace(self, prof):
        path = self.out / "profile" / f"{Path(sys.argv[0]).stem}.pt.trace.json"  # the name TensorBoard looks for
        written = []  # the trace as it was read back to check the write: parsed once
        checkpoints.save_atomically(lambda tmp: written.append(export_trace(prof, tmp)), path)
        sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        steps = f"{self.profiled_steps.start + PROFILE_WARMUP}-{self.profiled_steps.stop - 1}"
        averages = prof.key_averages()
        averages[:] = [row for row in averages if not is_label(row)]  # kernels and operators only
        self.report = (f"Profile of steps {steps} ({'CUDA' if self.cuda else 'CPU'} time; these steps are not in "
                       f"tok/s): {path} (open it in https://ui.perfetto.dev or chrome://tracing)\n"
                       + averages.table(sort_by=sort_by, row_limit=15))
        if self.cuda:  # and where each step's GPU time went, by class of work
            self.report += "\n" + gpu_time_line(gpu_time_per_step(written[-1]), steps)

    def _write_snapshot(self):
        torch, device = self.torch, self.snapshot
        torch.cuda.synchronize(device)
        path = self.out / "memory_snapshot.pickle"
        checkpoints.save_atomically(lambda tmp: torch.cuda.memory._dump_snapshot(tmp), path)
        torch.cuda.memory._record_memory_history(enabled=None)
        self.snapshot = None
        steps = self.snapshot_recorded
        allocated, reserved = gpu_memory.peaks_since_start(device)  # step 0's too: its counters were reset after it
        print(f"Memory snapshot of the first {steps} step{'s' if steps != 1 else ''}: {path} (drop it on "
              f"https://pytorch.org/memory_viz) | peak over them: {allocated:.2f} GiB allocated, "
              f"{reserved:.2f} GiB reserved", flush=True)

    def finish(self):
        """At the end of training: the memory snapshot of a run shorter than SNAPSHOT_STEPS (what it recorded), and
        the profile's table of top operators (if one was taken)."""
        if self.snapshot is not None:
            self._write_snapshot()
        if self.report:
            print(self.report, flush=True)
        return None if self.report is None else str(self.out / "profile")



def is_label(row):
    """Whether a row of the profiler's table is a label (a region of ours, a ProfilerStep#N) rather than work."""
    return (getattr(row, "is_user_annotation", False) or row.key in REGION_LABELS
            or row.key.startswith("ProfilerStep#"))


def export_trace(prof, path):
    """prof.export_chrome_trace, with a failed write raised as an OSError. The trace is written in C++ (Kineto),
    which only logs a failed write and leaves an incomplete file: a trace that does not parse is that case, and
    one more write from Python brings out the OS error behind it (a full disk, a size limit). Returns the trace
    as read back."""
    try:
        prof.export_chrome_trace(path)
    finally:
        Path(f"{path}.tmp").unlink(missing_ok=True)  # Kineto's own temporary file, left behind by a failed write
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError:
        with open(path, "ab") as f:
            f.write(b" " * 2**20)  # whitespace after JSON: harmless, and enough to meet a full disk or a size limit
            f.flush()
            os.fsync(f.fileno())
        raise OSError(errno.EIO, "the profiler's trace writer stopped part-way (incomplete trace)") from None


# ---------------------------------------------------------------------------------------------
# Where a profiled step's GPU time goes, by class of work (also bench/step_time.py)
# ---------------------------------------------------------------------------------------------

# Kernel names decide, first match wins; they are the names a trace shows: cuBLAS's (sm90_xmma_gemm_..., nvjet_...,
# cutlass_...), FlashAttention's and cuDNN's attention, PyTorch's eager kernels and Inductor's fused Triton kernels
# (triton_red_fused__log_softmax_..., named after the operators they fuse). A fused kernel goes to the first class
# its name matches, so the split is by name, not by FLOPs: good to a few percent on the small classes.
KERNEL_NAME_CLASSES = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("loss", ("log_softmax", "logsoftmax", "nll_loss", "cross_entropy", "crossentropy")),
    ("attention", ("softmax",)),  # an eager softmax is the attention's (00); the loss's is a log_softmax
    ("matmul", ("gemm", "xmma", "nvjet", "cutlass", "cublas", "splitkreduce", "triton_tem", "wgmma")),
    # FSDP2's copies into and out of its all-gather and reduce-scatter buffers (a foreach copy, _chunk_cat,
    # split_with_sizes_copy): before "optimizer", whose multi_tensor_apply the foreach copy shares
    ("copies", ("copy<", "chunk_cat", "split_with_sizes_copy")),
    ("optimizer", ("adam", "multi_tensor_apply")),
    ("norm_activation", ("layer_norm", "layernorm", "gelu", "tanh")),
)
GPU_BUSY_CATEGORIES = {"kernel": None, "gpu_memcpy": "copies", "gpu_memset": "copies"}


def kernel_class(name):
    """The class of work of one GPU kernel, from its name (KERNEL_NAME_CLASSES); the rest is elementwise."""
    lowered = name.lower()
    for work, words in KERNEL_NAME_CLASSES:
        if any(word in lowered for word in words):
            return work
    return "elementwise"


def gpu_time_per_step(trace):
    """{class: seconds per profiled step, ..., "step": seconds, "steps": count} from a Chrome trace of
    torch.profiler (a dict, as json.load gives it); None for a trace without GPU work.

    Each kernel, copy and memset counts in full for its class. The window runs from the start of the first
    profiled step to the end of the last, gaps between steps included (the GPU's spans of ProfilerStep#N where the
    trace has them, else its first and last activity); "idle" is the part of it in which the GPU ran nothing at
    all. The classes and idle add up to the step's time when one stream runs at a time; kernels of streams that
    overlap (NCCL's beside the backward) add up to more.
    """
    events = [event for event in trace.get("traceEvents", []) if event.get("ph") == "X"]
    busy = [(float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0)),
             GPU_BUSY_CATEGORIES[event["cat"]] or kernel_class(event.get("name", "")))
            for event in events if event.get("cat") in GPU_BUSY_CATEGORIES]
    if not busy:
        return None
    step_spans = [(float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0))) for event in events
                  if event.get("cat") == "gpu_user_annotation" and str(event["name"]).startswith("ProfilerStep#")]
    step_names = {event["name"] for event in events
                  if event.get("cat") == "user_annotation" and str(event["name"]).startswith("ProfilerStep#")}
    step_count = len(step_names) or len(step_spans) or 1
    spans = step_spans or [(start, end) for start, end, _ in busy]
    first, last = min(start for start, _ in spans), max(end for _, end in spans)
    seconds = dict.fromkeys(GPU_TIME_CLASSES, 0.0)
    for start, end, work in busy:
        seconds[work] += (end - start) / 1e6  # the trace's times are in microseconds
    in_window = [(max(start, first), min(end, last)) for start, end, _ in busy if start < last and end > first]
    seconds["idle"] = max(0.0, (last - first) - _covered(in_window)) / 1e6
    per_step = {work: value / step_count for work, value in seconds.items()}
    return {**per_step, "step": (last - first) / 1e6 / step_count, "steps": step_count}


def _covered(intervals):
    """The length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def gpu_time_line(per_step, steps):
    """One line: "GPU time per step of steps 6-8 (kernels by name): 43.1 ms = matmuls 25.1 ms (58%) + ..." (classes
    that ran, and idle)."""
    if per_step is None:
        return f"GPU time per step of steps {steps}: the trace holds no GPU kernels"
    step = per_step["step"]
    parts = [f"{WORK_LABELS[work]} {1e3 * per_step[work]:.2f} ms ({per_step[work] / step:.0%})"
             for work in GPU_TIME_CLASSES if per_step[work] > 0 or work == "idle"]
    return f"GPU time per step of steps {steps} (kernels by name): {1e3 * step:.2f} ms = " + " + ".join(parts)
