"""Time: the training clock (training only, CUDA events on a GPU), the heartbeat that speaks during long silent
waits, and the wall clock of a run split into its phases.
"""

import contextlib
import os
import sys
import threading
import time
from pathlib import Path


class TrainClock:
    """Accumulates training time only: start() and stop() around the steps, take() at each log line.

    On CUDA it times with events in the stream, so queued kernels are counted in full: stop() waits for the GPU
    to reach its event (what follows, an evaluation or a sample, then starts on an idle GPU, and the host's wall
    clock gives training its own time), except stop(wait=False), between steps that run off the clock (profiled
    ones), where a wait would leave the GPU idle before the next step, as training never does; take() reads the
    events, after waiting for the last.
    """

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.mps = device.type == "mps"  # no timing events there: synchronize, then read the host clock
        self.torch = torch
        self.seconds = 0.0
        self._start = None
        self._spans = []  # CUDA: (start, end) events not yet read

    def start(self):
        if self.cuda:
            self._start = self.torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            if self.mps:
                self.torch.mps.synchronize()
            self._start = time.perf_counter()

    def stop(self, wait=True):
        if self._start is None:
            return
        if self.cuda:
            end = self.torch.cuda.Event(enable_timing=True)
            end.record()
            self._spans.append((self._start, end))
            if wait:
                end.synchronize()
        else:
            if self.mps:
                self.torch.mps.synchronize()
            self.seconds += time.perf_counter() - self._start
        self._start = None

    def take(self):
        """The seconds timed since the last take(); on CUDA it waits for the GPU to reach the last stop()."""
        if self._spans:
            self._spans[-1][1].synchronize()  # one stream: the earlier events have completed too
            self.seconds += sum(start.elapsed_time(end) for start, end in self._spans) / 1000
            self._spans = []
        seconds, self.seconds = self.seconds, 0.0
        return seconds


# ---------------------------------------------------------------------------------------------
# Heartbeat: a line every ~10 s while nothing else is printed (CPU steps, compilation, evaluation)
# ---------------------------------------------------------------------------------------------

class _TimedStdout:
    def __init__(self, stream):
        self._stream = stream
        self.last_write = time.monotonic()

    def write(self, text):
        self.last_write = time.monotonic()
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class Heartbeat:
    """Say what the run is doing when it has printed nothing for `every_s` seconds, and keep its wall clock.

    The stages name what they do (`heartbeat.doing = "evaluating"`); each activity's host time goes to one of
    WALL_CLOCK_PHASES, and torch.compile's own callbacks carve the compilation out of whatever it interrupted
    (the first training step, the first evaluation, the lazily compiled backward pass).
    """

    current = None  # the process's heartbeat, for the file writers that have none passed to them (`busy`)

    def __init__(self, every_s=10.0):
        self._doing = "starting"
        self.every_s = every_s
        if not isinstance(sys.stdout, _TimedStdout):
            sys.stdout = _TimedStdout(sys.stdout)
        self._stdout = sys.stdout
        self._started = time.monotonic()
        self._phase_started = self._started
        self.seconds = dict.fromkeys(WALL_CLOCK_PHASES, 0.0)
        self.seconds["start-up"] = process_age()  # the interpreter and the imports came before this object
        self.imports = self.seconds["start-up"]  # start-up's first part: what ran before main() made this object
        self.compiling = False
        if "torch._dynamo" in sys.modules:  # a stage that compiles (01 on): say so while torch.compile works
            from torch._dynamo.callback import callback_handler

            callback_handler.register_start_callback(lambda *_: self._compiling(True))
            callback_handler.register_end_callback(lambda *_: self._compiling(False))
        Heartbeat.current = self
        threading.Thread(target=self._run, daemon=True).start()

    @property
    def doing(self):
        return self._doing

    @doing.setter
    def doing(self, what):
        if not self.compiling:
            self._close_phase(self._phase_of(self._doing))
        self._doing = what

    def _compiling(self, starting):
        self._close_phase("compilation" if self.compiling else self._phase_of(self._doing))
        self.compiling = starting

    def _phase_of(self, doing):
        if doing.startswith("training"):
            return "training"
        if doing.startswith("evaluating"):
            return "evaluation"
        if doing.startswith("generating"):
            return "sampling"
        if doing.startswith("writing"):
            return "checkpoints and outputs"
        return "start-up" if self.seconds["training"] == 0 else "checkpoints and outputs"

    def _close_phase(self, phase):
        now = time.monotonic()
        self.seconds[phase] += now - self._phase_started
        self._phase_started = now

    def wall_clock(self):
        """Seconds since the process started, by phase (WALL_CLOCK_PHASES) and in total, then "imports": the part of
        start-up before the stage's main() began its set-up (the interpreter, the imports, the command line; in 02
        and 03 the process group's start too), so that the rest of start-up (the data, the model, the GPU's own
        start, the FLOP count) shows; for metrics.json."""
        self._close_phase("compilation" if self.compiling else self._phase_of(self._doing))
        split = {phase: round(seconds, 2) for phase, seconds in self.seconds.items()}
        return {**split, "total": round(sum(self.seconds.values()), 2), "imports": round(self.imports, 2)}

    def describe(self):
        """What the run is doing now, e.g. "compiling the training graph (torch.compile): epoch 1, step 0"."""
        if not self.compiling:
            return self.doing
        graph = ("training graph" if self.doing.startswith("training") else
                 "evaluation graph" if self.doing.startswith("evaluating") else "graph")
        return f"compiling the {graph} (torch.compile): {self.doing}"

    def _run(self):
        while True:
            time.sleep(1.0)
            quiet = time.monotonic() - self._stdout.last_write
            if quiet >= self.every_s:
                elapsed = time.monotonic() - self._started
                print(f"  ... {self.describe()} ({elapsed:.0f} s since start)", flush=True)


WALL_CLOCK_PHASES = ("start-up", "compilation", "training", "evaluation", "sampling", "checkpoints and outputs")


def process_age():
    """Seconds since this process started (Linux: /proc), so that start-up includes importing PyTorch; else 0."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, counted after the command name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


@contextlib.contextmanager
def busy(what):
    """Tell the heartbeat (if any) what a long call is doing, e.g. "writing model.pth", then go back."""
    heartbeat = Heartbeat.current
    if heartbeat is None:
        yield
        return
    before = heartbeat.doing
    heartbeat.doing = what
    try:
        yield
    finally:
        heartbeat.doing = before


def wall_clock_line(split):
    """"Wall clock: 51.2 s since the process started = start-up 6.0 s (imports 4.1 s) + compilation 30.1 s + ..."
    for the log (a split recorded before "imports" was kept has no such part)."""
    def part(phase):
        imports = f" (imports {split['imports']:.1f} s)" if phase == "start-up" and "imports" in split else ""
        return f"{phase} {split[phase]:.1f} s{imports}"

    parts = " + ".join(part(phase) for phase in WALL_CLOCK_PHASES)
    return f"Wall clock: {split['total']:.1f} s since the process started = {parts}"
