"""Time: the training clock (training only, CUDA events on a GPU), and the wall clock of a run split into the
phases where they happen, which says what the run is doing during a long one.
"""

import contextlib
import importlib.util
import os
import sys
import threading
import time
from functools import partial
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
# The wall clock, phase by phase, and a line every ~10 s of a long phase (CPU steps, compilation, evaluation)
# ---------------------------------------------------------------------------------------------

class WallClock:
    """The wall clock of a run, split into WALL_CLOCK_PHASES where they happen: enter() at each boundary (a phase
    lasts until the next begins), phase() for a block inside another (a file written during evaluation), and
    torch.compile's own callbacks carve the compilation out of whatever it interrupted (the first training step,
    the first evaluation, the lazily compiled backward pass). A phase or a compilation has a timer thread of its
    own, which ends with it: every `every_s` seconds it says what the run is doing ("  ... evaluating (41 s since
    start)"; `doing`: a text, or a function that gives one). Start-up is kept in parts (start_up(), START_UP_PARTS):
    the imports before this object, then each part until the next begins."""

    current = None  # the process's wall clock, for the file writers that have none passed to them (`busy`)
    DOING = {"evaluation": "evaluating", "sampling": "generating a sample", "checkpoints and outputs": "writing outputs"}

    def __init__(self, every_s=10.0):
        # under torchrun only rank 0 says what the run is doing (from the start: the other ranks' own output is
        # silenced only once they have joined the process group, and a rendezvous can take a while)
        self.every_s = every_s if os.environ.get("RANK", "0") == "0" else None
        self.started = self._since = time.monotonic()
        self.seconds = dict.fromkeys(WALL_CLOCK_PHASES, 0.0)
        # the interpreter and the imports came before this object: start-up's first part, "imports"
        self.seconds["start-up"] = self.imports = process_age()
        self.phase_now, self.doing, self.compiling = "start-up", "starting", False
        self.part, self.parts = "command line", {"command line": 0.0}  # start-up's part now, and each part's seconds
        self._timer, self._callbacks = None, []  # the current phase's timer thread; torch.compile's callbacks
        if "torch._dynamo" in sys.modules:  # a stage that compiles (01 on): time torch.compile as it reports itself
            from torch._dynamo.callback import callback_handler as handler

            start, end = partial(self._compiling, True), partial(self._compiling, False)
            handler.register_start_callback(start)
            handler.register_end_callback(end)
            self._callbacks = [(handler.remove_start_callback, start), (handler.remove_end_callback, end)]
        WallClock.current = self

    def enter(self, phase, doing=None):
        """From now until the next enter(), the run's time goes to `phase` (`doing`: what the line of a long phase
        says; the phase's usual activity if None)."""
        self._close()
        self.phase_now, self.doing = phase, doing or self.DOING.get(phase, phase)
        if not self.compiling:
            self._say_after_every(self.every_s)

    def start_up(self, part, doing=None):
        """Start-up's next part (a key of START_UP_PARTS, whose text the line of a long part says unless `doing`
        does) runs until the next part or phase begins."""
        self.enter("start-up", doing or START_UP_PARTS[part])
        self.part = part
        self.parts.setdefault(part, 0.0)

    @contextlib.contextmanager
    def phase(self, phase, doing=None):
        """The block's time goes to `phase`, then the phase it interrupted goes on."""
        interrupted = self.phase_now, self.doing
        self.enter(phase, doing)
        try:
            yield
        finally:
            self.enter(*interrupted)

    def said(self):
        """A line was printed: the next line of a long phase comes `every_s` seconds after it."""
        self._say_after_every(self.every_s)

    def _compiling(self, starting, _callback_args):  # torch.compile starts or ends
        self._close()
        self.compiling = starting
        self._say_after_every(self.every_s)

    def _close(self):
        now = time.monotonic()
        phase = "compilation" if self.compiling else self.phase_now
        self.seconds[phase] += now - self._since
        if phase == "start-up":
            self.parts[self.part] += now - self._since
        self._since = now

    def stop(self):
        """The clock stops (its timer thread ends, torch.compile's callbacks go). Returns, for metrics.json, the seconds
        since the process started by phase (WALL_CLOCK_PHASES) and in total, then "imports": the part of start-up
        before the clock was made (the interpreter and the imports), and "start-up parts": the rest of start-up
        part by part (START_UP_PARTS: the command line, the device, the corpus, ...), so that each shows, and
        "imports compiled from source": True where PyTorch's Python had no bytecode to load (bytecode_cached)."""
        self._close()
        self._say_after_every(None)
        for remove, callback in self._callbacks:
            remove(callback)
        self._callbacks, WallClock.current = [], None
        split = {phase: round(seconds, 2) for phase, seconds in self.seconds.items()}
        return {**split, "total": round(sum(self.seconds.values()), 2), "imports": round(self.imports, 2),
                "start-up parts": {part: round(seconds, 2) for part, seconds in self.parts.items()},
                "imports compiled from source": not bytecode_cached()}

    def describe(self):
        """What the run is doing now, e.g. "compiling the training graph (torch.compile): training: epoch 1, step 0"."""
        doing = self.doing() if callable(self.doing) else self.doing
        if not self.compiling:
            return doing
        graph = {"training": "training graph", "evaluation": "evaluation graph"}.get(self.phase_now, "graph")
        return f"compiling the {graph} (torch.compile): {doing}"

    def _say_after_every(self, seconds):
        """The previous timer thread ends; a new one (unless `seconds` is None) says its line every `seconds`."""
        if self._timer:
            self._timer[0].set()
            self._timer[1].join()
        stopped = threading.Event()
        self._timer = seconds and (stopped, threading.Thread(target=self._say, args=(stopped, seconds), daemon=True))
        if self._timer:
            self._timer[1].start()

    def _say(self, stopped, seconds):
        main = threading.main_thread()  # a run that fails ends its phase with the process: so does this thread
        while not stopped.wait(seconds) and main.is_alive():
            print(f"  ... {self.describe()} ({time.monotonic() - self.started:.0f} s since start)", flush=True)


# Where PyTorch's Python has no bytecode cache, the wall clock line adds how to make one, once
BYTECODE_HINT = ("Imports: PyTorch's Python files have no bytecode cache (.pyc) and Python writes none here "
                 "(PYTHONDONTWRITEBYTECODE, or a read-only folder), so every start compiles them again. Compile them "
                 "once: python -m compileall -q -j 0 \"$(python -c 'import torch, os; "
                 "print(os.path.dirname(torch.__path__[0]))')\" (where that folder is read-only, run it and the stages "
                 "with PYTHONPYCACHEPREFIX set to a folder of yours)")
WALL_CLOCK_PHASES = ("start-up", "compilation", "training", "evaluation", "sampling", "checkpoints and outputs")
# Start-up's parts after the imports, in a stage's order, with what the line of a long one says. "device" holds
# CUDA's start (and in 02 and 03 the process group's); "until the first step" what is left before the first step.
START_UP_PARTS = {
    "command line": "reading the command line",
    "device": "starting the device",
    "corpus": "opening the corpus (a named corpus or a text file is tokenized once)",
    "tokenizer": "loading the tokenizer",
    "model": "building the model and its optimizer",
    "until the first step": "preparing the first step",
}


def process_age():
    """Seconds since this process started (Linux: /proc), so that start-up includes importing PyTorch; else 0."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, counted after the command name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def bytecode_cached(module="torch"):
    """Whether the Python files of `module` (imported or not) have the bytecode cache (.pyc) that this interpreter
    loads. Without one, where the install shipped none and Python may not write it (PYTHONDONTWRITEBYTECODE, a
    read-only folder), every process compiles them from source again: seconds of every start-up's imports."""
    imported = sys.modules.get(module)
    source = getattr(imported, "__file__", None) or getattr(importlib.util.find_spec(module), "origin", None)
    if not source or not source.endswith(".py"):
        return True  # nothing compiled from source to cache (a built-in or extension module)
    return os.path.exists(importlib.util.cache_from_source(source))  # honours PYTHONPYCACHEPREFIX


def busy(what):
    """A long call that writes a file, e.g. "writing model.pth": its time goes to "checkpoints and outputs" on the
    process's wall clock (if there is one), then the phase it interrupted goes on."""
    clock = WallClock.current
    return contextlib.nullcontext() if clock is None else clock.phase("checkpoints and outputs", what)


def start_up_parts(split):
    """Start-up's parts of a split that has them, for the log: "imports 4.1 s, device 1.2 s, ..." (parts under
    0.05 s left out); only the imports for a split recorded before the parts were kept, "" before the imports were."""
    parts = {"imports": split["imports"], **split.get("start-up parts", {})} if "imports" in split else {}
    return ", ".join(f"{part} {seconds:.1f} s" for part, seconds in parts.items() if seconds >= 0.05)


def wall_clock_line(split):
    """"Wall clock: 51.2 s since the process started = start-up 6.0 s (imports 4.1 s, device 1.2 s, ...) +
    compilation 30.1 s + ..." for the log."""
    def part(phase):
        parts = start_up_parts(split) if phase == "start-up" else ""
        return f"{phase} {split[phase]:.1f} s" + (f" ({parts})" if parts else "")

    parts = " + ".join(part(phase) for phase in WALL_CLOCK_PHASES)
    line = f"Wall clock: {split['total']:.1f} s since the process started = {parts}"
    if split.get("imports compiled from source"):
        line += "\n" + BYTECODE_HINT
    return line
