"""The GPU tier: full-size runs on one CUDA GPU; its log is a report of what it measured.

Three parts, each one command of a few minutes on one H100, the numbers the README needs first:

    python -m pytest -q tests/gpu/test_full_size_runs.py          # 6 min 44 s on an H100: the four stages at full size
    python -m pytest -q tests/gpu/test_memory_and_profile.py tests/gpu/test_attention_kernels.py \
        tests/gpu/test_checkpointing_under_compile.py              # 2 min 18 s (H200), before its gradient checks
    python -m pytest -q tests/gpu/test_compile_options.py          # 20.7 s on an H100: the math of a compile option

The times above are measured (part 1 on 2026-11-25, part 2 on 2026-11-26, the compile options on 2026-11-27, PyTorch
2.11.0+cu130); the times in each file's docstring and each test's comments are estimates, written before a GPU ran them.

It runs on its own: the CPU suite (python -m pytest -q tests) hides the GPU and leaves this folder out. Without a
GPU every test is skipped, with the reason on one line, and pytest exits 0. With one, each test hands what it
measured to `report`: every line is printed at once and appended to runs/gpu_tier/measured.txt (or the file
GPU_TIER_REPORT names) as it is taken, so that a command stopped at its limit loses nothing, and the lines are
printed together again at the end of the run, whether the test passed or not and whatever pytest's capture settings.
"""

import contextlib
import datetime
import os
import sys
from pathlib import Path

import pytest
import torch

import conftest as suite  # tests/conftest.py

MEASURED = pytest.StashKey[list]()
REPORT_FILE = pytest.StashKey[object]()
SKIP_REASON = pytest.StashKey[str]()


def skip_reason(config):
    if not suite.gpu_tier_requested(config):
        return "the GPU tier runs on its own: python -m pytest -q tests/gpu"
    if not torch.cuda.is_available():
        return (f"no CUDA GPU: PyTorch {torch.__version__} (CUDA build: {torch.version.cuda}) sees none, and every "
                "test of this tier trains on one")
    return ""


def pytest_collection_modifyitems(config, items):
    reason = config.stash[SKIP_REASON] = skip_reason(config)
    if reason:
        for item in items:
            if suite.GPU_TIER in item.path.parents:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter, config):
    reason = config.stash.get(SKIP_REASON, None)
    if reason:
        terminalreporter.write_line(f"GPU tier skipped: {reason}")
        return
    if reason is None:  # collection did not get that far
        return
    terminalreporter.section("GPU report")
    terminalreporter.write_line(f"{torch.cuda.get_device_name()} | PyTorch {torch.__version__}, CUDA "
                                f"{torch.version.cuda} | {datetime.date.today()}")
    for line in config.stash.get(MEASURED, []):
        terminalreporter.write_line(line)


def report_file(config):
    """The file that keeps every measured line, headed once per command with the GPU, versions and command line."""
    if REPORT_FILE not in config.stash:
        path = Path(os.environ.get("GPU_TIER_REPORT") or suite.ROOT / "runs" / "gpu_tier" / "measured.txt")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as file:
            file.write(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC | "
                       f"{torch.cuda.get_device_name()} | PyTorch {torch.__version__}, CUDA {torch.version.cuda} | "
                       f"{' '.join(sys.argv)}\n")
        config.stash[REPORT_FILE] = path
    return config.stash[REPORT_FILE]


@pytest.fixture
def report(request):
    """report(text): one line of the GPU report. Printed at once, past pytest's capture, so that a command stopped
    at a time limit still shows what was measured before, and again with the others at the end of the run."""
    lines = request.config.stash.setdefault(MEASURED, [])
    capture = request.config.pluginmanager.getplugin("capturemanager")
    terminal = request.config.pluginmanager.getplugin("terminalreporter")
    path = report_file(request.config)

    def add(line):
        lines.append(line)
        with path.open("a", encoding="utf-8") as file:  # opened and closed per line: nothing waits in a buffer
            file.write(f"{request.node.nodeid}: {line}\n")
        if terminal is not None:
            with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
                terminal.write_line(f"\nmeasured: {line}", flush=True)

    add.folder = path.parent  # where a test leaves a file of what it measured, beside the report
    return add


@pytest.fixture(scope="session", autouse=True)
def empty_compile_cache(tmp_path_factory):
    """The tier compiles into a torch.compile cache of its own, empty at the start: its compilation times mean the
    same on every run of the tier, and TORCH_LOGS=aot_graphs shows every graph (PyTorch 2.11 logs none that it takes
    from the cache). The stages it starts inherit the setting."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("torch_compile_cache")))
        yield


@pytest.fixture(scope="session")
def validation_windows():
    """How many windows of 1,024 tokens the validation split of the shipped text holds (the stages' own split)."""
    from data import load_corpus

    stage = suite.load_stage("01_opt_single_gpu.py")
    context = stage.GPT_CONFIG_124M["context_length"]
    return len(stage.SlidingWindowDataset(load_corpus("shakespeare").val, context, context))
