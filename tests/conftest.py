"""Shared test helpers: run the stage scripts as a user would, and import them as modules.

The suite runs on the CPU wherever it runs; the GPU tier in tests/gpu runs on its own (python -m pytest -q tests/gpu).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.sitecustomize import FORCE_PRECISION, forced_precision

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GPU_TIER = ROOT / "tests" / "gpu"
TEST_HOOKS = ROOT / "tests" / "support"  # sitecustomize.py: the test hooks of the processes the tests start


def gpu_tier_requested(config):
    """Whether this pytest run asked for the GPU tier alone: every path it was given lies in tests/gpu."""
    paths = [Path(config.invocation_params.dir, arg.split("::")[0]).resolve() for arg in config.args]
    return bool(paths) and all(path == GPU_TIER or GPU_TIER in path.parents for path in paths)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    # The CPU suite runs its files on two workers (pytest-xdist) unless -n is given (-n 0: one process): most tests
    # wait on one single-threaded stage run, so one worker leaves a core of a 2-core machine idle. Whole files go to
    # one worker (loadfile), so a file's shared runs are made once. The GPU tier stays in one process: two at once
    # would share one GPU and spoil each other's timings.
    is_worker = hasattr(config, "workerinput") or "PYTEST_XDIST_WORKER" in os.environ  # a worker starts none
    if (config.pluginmanager.hasplugin("xdist") and config.option.numprocesses is None and not is_worker
            and not gpu_tier_requested(config) and not config.option.collectonly):
        config.option.numprocesses, config.option.dist = 2, "loadfile"
    # A failing test's report shows the log records captured while it ran; torch.compile's structured trace logs
    # hundreds of empty DEBUG lines, which bury the traceback. Warnings and errors are still shown.
    if config.option.log_level is None:
        config.option.log_level = "WARNING"


def pytest_configure(config):
    # The CPU suite stays on the CPU on a machine with a GPU too (--device auto would pick CUDA: 2-process torchrun
    # tests on one GPU, CPU timings, CUDA's non-deterministic backward...). An empty CUDA_VISIBLE_DEVICES, set here
    # before any test module imports torch, hides the GPU from this process and from every process the tests start,
    # however they start it (run_script, torchrun and its workers, hand-built commands, tests added later), which
    # passing --device cpu in the runner helpers would not.
    if not gpu_tier_requested(config):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # Every process the tests start imports the test hooks at its start (they do nothing unless a test sets one).
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(TEST_HOOKS) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(TEST_HOOKS), *filter(None, paths)])
    # Two workers (above) on two cores: one thread each for PyTorch in the workers and in every process they
    # start, set before any of them imports torch. Two threads each would oversubscribe the cores and spin.
    if (getattr(config.option, "numprocesses", None) or 0) > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The corpora the tests prepare (the shipped one, and every small text file a test writes) go to a folder of
    # this run's, shared by its workers, not into the checkout's data/cache/.
    if "FAST_GPT2_CACHE" not in os.environ:
        import tempfile

        os.environ["FAST_GPT2_CACHE"] = config._test_corpus_cache = tempfile.mkdtemp(prefix="fast-gpt2-test-cache-")


def pytest_unconfigure(config):
    folder = getattr(config, "_test_corpus_cache", None)
    if folder:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def pytest_ignore_collect(collection_path, config):
    # The GPU tier needs the GPU hidden above, and its full-size runs would not fit the CPU suite's time budget.
    if collection_path == GPU_TIER and not gpu_tier_requested(config):
        return True
    return None


def load_stage(filename):
    """Import a stage script (its name starts with a digit) as a module: a fresh copy per call, registered in
    sys.modules under a name of its own, as bench.rungs.load_stage does. torch.compile 2.11 imports by name the
    module of a function it inlines from another (a compiled checkpoint_wrapper around a stage's block): a copy
    missing from sys.modules fails there with ModuleNotFoundError, on the GPU where that path is taken."""
    from bench.rungs import load_stage as fresh_copy

    return fresh_copy(filename)


def aten_dtypes():
    """A dispatch mode that records (aten op name, output dtypes) of every aten op run under it, in order (.ops)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class AtenDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._schema.name.startswith("aten::"):
                outs = out if isinstance(out, (tuple, list)) else (out,)
                self.ops.append((func._schema.name, [o.dtype for o in outs if isinstance(o, torch.Tensor)]))
            return out

    return AtenDtypes()


def run_script(*args, timeout=300, env=None):
    """Run `python <args>` from the repository root, offline, and return the CompletedProcess."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def wait_for(predicate, timeout, interval=0.2):
    """Whether predicate() came true within `timeout` seconds, asked every `interval`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def process_alive(pid):
    """Whether process `pid` still runs, on Linux (a zombie waiting for its reaper does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def processes_mentioning(text):
    """The pids of the processes whose command line contains `text`, on Linux."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in found if process_alive(pid)]


def run_with_fault(tmp_path, small_text, fault, *flags, script="00_orig.py", env=None):
    """Run a stage's main in a subprocess, --tiny on `small_text` into tmp_path/run, after the Python code `fault`
    has replaced some of its functions (the stage module is `stage`; torch and the plumbing modules cli,
    devices, failures, timekeeping and utilization are imported)."""
    code = f"""
import sys, torch
sys.path.insert(0, {str(ROOT / 'tests')!r})
from conftest import load_stage
import cli, devices, failures, timekeeping, utilization
stage = load_stage({script!r})
{fault}
sys.argv = [{script!r}, "--tiny", "--data", {str(small_text)!r}, "--out", {str(tmp_path / 'run')!r}, *{flags!r}]
sys.exit(failures.process_done(failures.run(stage.main)))
"""
    return run_script("-c", code, env=env)


def logged_losses(out):
    """{step: (train loss, validation loss)} of every log line in <out>/metrics.json."""
    log = json.loads((Path(out) / "metrics.json").read_text())["log"]
    return {entry["step"]: (entry["train_loss"], entry["val_loss"]) for entry in log}


def check_wall_clock(stdout, out, compiled):
    """The run's wall clock: split into its phases in metrics.json, printed once as the log's last line, with
    compilation time exactly where torch.compile ran."""
    import timekeeping

    split = json.loads((Path(out) / "metrics.json").read_text())["wall_clock_s"]
    assert list(split) == [*timekeeping.WALL_CLOCK_PHASES, "total", "imports", "start-up parts",
                           "imports compiled from source"], split
    assert split["imports compiled from source"] is (not timekeeping.bytecode_cached()), split  # this interpreter's
    assert abs(sum(split[phase] for phase in timekeeping.WALL_CLOCK_PHASES) - split["total"]) < 0.05, split
    assert 0 < split["imports"] < split["start-up"], split  # importing PyTorch, then the stage's own set-up
    parts = split["start-up parts"]  # each part of the stage's own set-up, in its order, adding up to start-up
    assert list(parts) == list(timekeeping.START_UP_PARTS) and min(parts.values()) >= 0, parts
    assert abs(split["imports"] + sum(parts.values()) - split["start-up"]) < 0.05, split
    for phase in ("start-up", "training", "evaluation", "sampling", "checkpoints and outputs"):
        assert split[phase] > 0, (phase, split)
    assert (split["compilation"] > 0) == compiled, split
    lines = [line for line in stdout.splitlines() if line.startswith("Wall clock: ")]
    assert len(lines) == 1 and stdout.rstrip().endswith(timekeeping.wall_clock_line(split)), stdout[-2000:]


@pytest.fixture
def bf16_cpu(monkeypatch):
    """Step 5's bf16 path on every CPU for an in-process test (the test hook): a CPU without bfloat16 arithmetic
    trains in float32, where a test about bf16 logits would check nothing. Processes the test starts inherit it."""
    import devices

    monkeypatch.setattr(devices, "autocast_precision", forced_precision("bf16"))
    monkeypatch.setenv(FORCE_PRECISION, "bf16")


@pytest.fixture(scope="session")
def stage00():
    return load_stage("00_orig.py")


@pytest.fixture(scope="session")
def tokenizer():
    from data import get_tokenizer
    return get_tokenizer()


@pytest.fixture
def small_text(tmp_path):
    """A short public-domain-style text file, long enough for a --tiny run of a few dozen steps."""
    from data import load_text
    text = load_text("shakespeare")[:60_000]
    path = tmp_path / "small.txt"
    path.write_text(text, encoding="utf-8")
    return path
