"""A run's own folder and its cheap checks: one live run per folder, refusals before any slow work, outputs that
stop growing part-way on a real file, a checkout that cannot be written, and the progress line of a compile."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_script, run_with_fault

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


# Kineto, the profiler's C++ core, logs to stderr on its own ("USDT:... profiler_start", "ERROR:... Failed to write")
KINETO_LOG = re.compile(r"^(USDT|INFO|WARNING|ERROR):\d{4}-\d\d-\d\d [\d:]+ \d+:\d+ \S+\.cpp:\d+\]")


def one_error_line(result):
    lines = [line for line in result.stderr.strip().splitlines() if line.strip() and not KINETO_LOG.match(line)]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


# ---------------------------------------------------------------------------------------------
# 1. Two runs never write into one folder at the same time
# ---------------------------------------------------------------------------------------------

def test_a_second_run_into_the_folder_of_a_live_run_stops_before_writing(small_text, tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "00_orig.py", "--tiny", "--data", str(small_text), "--out", str(out),
                              "--epochs", "50", "--eval-freq", "5", "--save-every", "5"], cwd=ROOT, env=ENV,
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (out / "model.pth").exists():  # the first run has written a checkpoint of its own
            assert first.poll() is None and time.monotonic() < deadline, "the first run ended or never saved"
            time.sleep(0.2)
        before = {path.name: path.stat().st_mtime_ns for path in out.iterdir()}
        second = run_script("00_orig.py", "--tiny", "--data", small_text, "--out", out, "--max-steps", 3)
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        line = one_error_line(second)
        assert f"--out {out} is in use by a live run (process {first.pid})" in line, line
        assert "Ep " not in second.stdout  # it trained nothing
        assert not (out / "metrics.json").exists()  # and wrote nothing: the files are the first run's
        first.kill()  # a killed run leaves no stale lock: the OS drops it with the process
        first.wait(timeout=30)
        assert {path.name for path in out.iterdir()} >= set(before)
    finally:
        first.kill()
    third = run_script("00_orig.py", "--tiny", "--data", small_text, "--out", out, "--max-steps", 2)
    assert third.returncode == 0, third.stderr[-2000:]  # a finished (here: killed) run's files are no obstacle


# ---------------------------------------------------------------------------------------------
# 2. Cheap checks come first
# ---------------------------------------------------------------------------------------------

def test_a_missing_resume_is_refused_about_as_fast_as_help(tmp_path):
    def seconds(*args):
        started = time.monotonic()
        result = run_script("00_orig.py", *args)
        return time.monotonic() - started, result

    help_seconds, _ = seconds("--help")
    missing = tmp_path / "nowhere" / "model.pth"
    refuse_seconds, result = seconds("--resume", missing)
    assert result.returncode == 2
    assert f"--resume {missing}: no such checkpoint file" in one_error_line(result)
    # importing torch dominates both; the corpus and the model (8-11 s before) must not be touched
    assert refuse_seconds < 1.5 * help_seconds + 1.0, (refuse_seconds, help_seconds)


def test_flags_are_never_abbreviated():
    result = run_script("00_orig.py", "--max-step", "3")
    assert result.returncode == 2
    assert "unrecognized arguments: --max-step 3" in one_error_line(result)


# ---------------------------------------------------------------------------------------------
# 3. An output that stops growing part-way, on a real file: RLIMIT_FSIZE makes write() fail with EFBIG
# ---------------------------------------------------------------------------------------------

# Right before the write of `target` (its `nth` write in the run), file sizes are capped at `limit` bytes: the
# write starts on a real file and fails part-way, as on a disk that fills up. For torch.save that is the case
# where the zip writer's cleanup raises a RuntimeError over the OSError.
FILE_SIZE_LIMIT = """
import resource, signal
from pathlib import Path
import checkpoints
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing the process
real_save, seen = checkpoints.save_atomically, {{}}
def capped_save(save, path):
    seen[Path(path).name] = seen.get(Path(path).name, 0) + 1
    if Path(path).name == {target!r} and seen[Path(path).name] == {nth}:
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))
    return real_save(save, path)
checkpoints.save_atomically = capped_save
"""
CAPPED_OUTPUTS = {  # target file: (its write to cap, size cap in bytes, extra flags)
    "model.pth": (2, 200_000, ["--save-every", "4"]),  # the second checkpoint; the first stays whole
    "metrics.json": (1, 600, []),
    "loss.png": (1, 5_000, []),
    "00_orig.pt.trace.json": (1, 5_000, ["--profile"]),
}


@pytest.mark.parametrize("target", CAPPED_OUTPUTS)
def test_an_output_that_stops_growing_part_way_ends_in_one_line(target, small_text, tmp_path):
    nth, limit, flags = CAPPED_OUTPUTS[target]
    fault = FILE_SIZE_LIMIT.format(target=target, nth=nth, limit=limit)
    result = run_with_fault(tmp_path, small_text, fault, "--max-steps", "10", "--eval-freq", "100", *flags)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    line = one_error_line(result)
    assert line.startswith("error: cannot write ") and target in line and "File too large" in line, line
    out = tmp_path / "run"
    leftovers = [path for path in out.rglob("*") if path.name.endswith(".tmp")]
    assert not leftovers, leftovers
    if target == "model.pth":
        assert torch.load(out / "model.pth", weights_only=True)["step"] == 4  # the previous checkpoint, whole


# ---------------------------------------------------------------------------------------------
# 4. A checkout that cannot be written, with an empty cache
# ---------------------------------------------------------------------------------------------

def test_a_read_only_checkout_trains_and_caches_in_the_users_cache(small_text):
    base = Path(tempfile.mkdtemp(prefix="read-only-checkout-"))
    try:
        checkout = base / "repo"
        checkout.mkdir()
        for name in ("00_orig.py", "checkpoints.py", "cli.py", "devices.py", "failures.py", "gpu_memory.py",
                     "inspection.py", "progress.py", "timekeeping.py", "utilization.py"):
            shutil.copy(ROOT / name, checkout / name)
        shutil.copytree(ROOT / "data", checkout / "data", ignore=shutil.ignore_patterns("cache", "__pycache__"))
        home, out = base / "home", base / "out"
        home.mkdir()
        out.mkdir()
        for folder in (base, home, out):
            folder.chmod(0o777 if folder != base else 0o755)
        for path in [checkout, *checkout.rglob("*")]:
            path.chmod(0o555 if path.is_dir() else 0o444)
        env = {**ENV, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "PYTHONDONTWRITEBYTECODE": "1",
               "TIKTOKEN_CACHE_DIR": str(home / "tiktoken"), "TORCHINDUCTOR_CACHE_DIR": str(home / "inductor")}
        env.pop("FAST_GPT2_CACHE", None)  # the default places: the checkout's data/cache, else the user's cache
        # root writes into read-only folders; in a user namespace of its own it keeps its files but loses that power
        as_owner_only = ["unshare", "--user"] if os.getuid() == 0 else []
        if as_owner_only and (not shutil.which("unshare")
                              or subprocess.run([*as_owner_only, "true"], capture_output=True).returncode != 0):
            pytest.skip("running as root without user namespaces (unshare --user): permissions cannot be enforced")
        result = subprocess.run([*as_owner_only, sys.executable, "00_orig.py", "--tiny", "--max-steps", "2",
                                 "--eval-freq", "1", "--out", str(out)], cwd=checkout, env=env, capture_output=True,
                                text=True, timeout=240)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        cache = home / ".cache" / "fast-gpt2-training"
        assert f"the corpus is cached in {cache}" in result.stdout
        assert list(cache.glob("shakespeare-*.txt")), "the corpus cache is not in the user's cache folder"
        assert list(cache.glob("shakespeare-*.tokens/corpus.json")), "the prepared corpus is not beside it"
        assert not (checkout / "data" / "cache").exists()
        assert (out / "metrics.json").is_file() and (out / "model.pth").is_file()
    finally:
        for path in [base, *base.rglob("*")]:
            if path.is_dir():
                path.chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# 5. Compiling says so
# ---------------------------------------------------------------------------------------------

def test_the_progress_line_says_when_and_what_torch_compile_compiles():
    import torch._dynamo  # noqa: F401  (imported by the stages that compile, before their wall clock starts)

    import timekeeping

    clock = timekeeping.WallClock(every_s=3600)  # no line of its own during the test
    seen = []

    def backend(graph_module, example_inputs):  # runs while torch.compile compiles: what would the line say?
        seen.append(clock.describe())
        return graph_module.forward

    clock.enter("training", "training: epoch 1, step 0")
    torch.compile(lambda x: torch.sin(x) + 1, backend=backend)(torch.ones(3))
    assert seen == ["compiling the training graph (torch.compile): training: epoch 1, step 0"], seen
    assert clock.describe() == "training: epoch 1, step 0"  # compiled: back to the plain activity
    clock.enter("evaluation")
    torch.compile(lambda x: torch.cos(x) * 2, backend=backend)(torch.ones(3))
    assert seen[-1].startswith("compiling the evaluation graph"), seen
    clock.stop()


def test_the_wall_clock_puts_compilation_in_its_own_phase_and_not_in_the_one_it_interrupted():
    import torch._dynamo  # noqa: F401  (imported by the stages that compile, before their wall clock starts)

    import timekeeping

    clock = timekeeping.WallClock(every_s=3600)

    def slow_backend(graph_module, example_inputs):  # a compilation that takes 0.6 s
        time.sleep(0.6)
        return graph_module.forward

    clock.enter("training", "training: epoch 1, step 0")
    time.sleep(0.2)
    torch.compile(lambda x: torch.tan(x) - 1, backend=slow_backend)(torch.ones(3))
    clock.enter("evaluation")
    time.sleep(0.1)
    with timekeeping.busy("writing model.pth"):
        time.sleep(0.1)
    assert (clock.phase_now, clock.describe()) == ("evaluation", "evaluating")  # back to what it was doing
    clock.enter("sampling")
    split = clock.stop()
    assert 0.6 <= split["compilation"] < 1.2, split
    assert 0.2 <= split["training"] < 0.75, split  # without the 0.6 s compilation it started
    assert 0.1 <= split["evaluation"] < 0.6 and 0.1 <= split["checkpoints and outputs"] < 0.6, split
    assert abs(split["total"] - timekeeping.process_age()) < 0.1, split  # the whole life of the process, start-up too


def test_a_long_phase_says_what_it_does_from_a_thread_that_ends_with_it(capsys, monkeypatch):
    import threading

    import timekeeping

    stdout, before = sys.stdout, set(threading.enumerate())
    clock = timekeeping.WallClock(every_s=0.2)
    clock.enter("evaluation")
    time.sleep(0.5)  # two lines
    evaluations = set(threading.enumerate()) - before
    clock.enter("sampling")
    assert len(evaluations) == 1 and not any(thread.is_alive() for thread in evaluations)  # ended with its phase
    split = clock.stop()
    assert not set(threading.enumerate()) - before and sys.stdout is stdout  # nothing left running, stdout untouched
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.startswith("  ... evaluating (") and line.endswith(" s since start)")
                                   for line in lines), lines
    assert split["evaluation"] >= 0.5 and timekeeping.WallClock.current is None, split

    monkeypatch.setenv("RANK", "1")  # another rank under torchrun: it keeps time and says nothing
    quiet = timekeeping.WallClock(every_s=0.2)
    quiet.start_up("device")
    time.sleep(0.3)
    assert not set(threading.enumerate()) - before and quiet.stop()["start-up parts"]["device"] >= 0.3
    assert capsys.readouterr().out == ""


def test_start_up_is_split_into_the_imports_and_the_parts_main_names():
    import timekeeping

    clock = timekeeping.WallClock(every_s=3600)
    before = timekeeping.process_age()
    time.sleep(0.1)  # the command line: the part before the first start_up()
    clock.start_up("device")
    time.sleep(0.2)
    with clock.phase("checkpoints and outputs", "writing a file"):  # a file written during start-up: not a part
        time.sleep(0.1)
    clock.start_up("model")
    time.sleep(0.3)
    clock.enter("training", "training: epoch 1, step 0")
    time.sleep(0.1)  # no longer start-up: no part grows
    split = clock.stop()
    parts = split["start-up parts"]
    assert list(parts) == ["command line", "device", "model"], parts
    assert 0.09 <= parts["command line"] < 0.2 and 0.19 <= parts["device"] < 0.3 and 0.29 <= parts["model"] < 0.4
    assert split["imports"] <= before + 0.05 and split["checkpoints and outputs"] >= 0.09, split
    assert abs(split["imports"] + sum(parts.values()) - split["start-up"]) < 0.02, split  # rounded to 0.01
    line = timekeeping.wall_clock_line(split)
    assert (f"start-up {split['start-up']:.1f} s (imports {split['imports']:.1f} s, command line 0.1 s, device 0.2 s, "
            "model 0.3 s) + compilation") in line, line
    older = {key: value for key, value in split.items() if key != "start-up parts"}  # a row from before the parts
    assert f"start-up {split['start-up']:.1f} s (imports {split['imports']:.1f} s) + compilation" in (
        timekeeping.wall_clock_line(older))
    oldest = {key: value for key, value in older.items() if key != "imports"}  # and from before the imports
    assert f"start-up {split['start-up']:.1f} s + compilation" in timekeeping.wall_clock_line(oldest)


def test_imports_without_a_bytecode_cache_are_found_and_the_wall_clock_says_how_to_make_one(tmp_path):
    """Where PyTorch's Python has no .pyc that the interpreter loads (none shipped, and PYTHONDONTWRITEBYTECODE or a
    read-only folder), every start compiles it again: the run's split says so and its last line says how to fix it."""
    import timekeeping

    env = {**ENV, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache")}  # an empty cache
    ask = [sys.executable, "-c", "import timekeeping; print(timekeeping.bytecode_cached())"]
    assert subprocess.run(ask, cwd=ROOT, env=env, capture_output=True, text=True).stdout.strip() == "False"
    # the hint's own command, into that prefix (torch's first file only, to keep the test short): found now
    compile_torch = [sys.executable, "-m", "compileall", "-q", torch.__file__]
    subprocess.run(compile_torch, cwd=ROOT, env=env, check=True, capture_output=True)
    assert subprocess.run(ask, cwd=ROOT, env=env, capture_output=True, text=True).stdout.strip() == "True"

    split = {phase: 1.0 for phase in timekeeping.WALL_CLOCK_PHASES} | {"total": 6.0, "imports": 0.5}
    assert timekeeping.wall_clock_line(split).count("\n") == 0  # a row from before the flag, or a cached run
    line = timekeeping.wall_clock_line(split | {"imports compiled from source": True})
    assert line.splitlines()[1] == timekeeping.BYTECODE_HINT and "compileall" in line


@pytest.mark.parametrize("script", ["00_orig.py", "01_opt_single_gpu.py", "02_opt_multi_gpu_ddp.py",
                                    "03_opt_multi_gpu_fsdp.py"])
def test_the_loss_plot_of_a_short_run_has_legible_epoch_ticks(script, tmp_path, monkeypatch):
    """A short run sees a fiftieth of an epoch: matplotlib's default ticks (0.0000, 0.0025, ...) ran into each
    other under the plot. The labels of both x-axes must not overlap, whatever the run's length."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from conftest import load_stage

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: figures.append(self))
    for epochs in (0.02, 5):  # a --tiny run of 50 steps; the default run's five epochs
        log = [{"epochs_seen": epochs * i / 10, "tokens_seen": 256 * i, "train_loss": 10 - i / 5,
                "val_loss": 10 - i / 6} for i in range(11)]
        load_stage(script).plot_losses(log, tmp_path / "loss")
    assert len(figures) == 4  # .pdf and .png of each
    for figure in figures[::2]:
        canvas = FigureCanvasAgg(figure)  # where the labels land, as the .png drew them
        canvas.draw()
        renderer = canvas.get_renderer()
        for axis in (figure.axes[0].xaxis, figure.axes[1].xaxis):
            boxes = [label.get_window_extent(renderer) for label in axis.get_ticklabels()
                     if label.get_visible() and label.get_text()]
            boxes = [box for box in boxes if figure.bbox.contains(box.x0, box.y0) or figure.bbox.contains(box.x1,
                                                                                                      box.y1)]
            assert len(boxes) >= 3, [label.get_text() for label in axis.get_ticklabels()]
            for left, right in zip(boxes, boxes[1:]):
                assert left.x1 < right.x0, [label.get_text() for label in axis.get_ticklabels()]
