"""The GPU tier: full-size runs on one CUDA GPU; its log is a report of what it measured.

    python -m pytest -q tests/gpu

Budget on one H100: 8 minutes at most. The estimates in the tests' comments add up to about 8.1 (full-size runs
6.25, memory and profile 1.7, attention kernels 0.15): guesses at the edge of the budget until a GPU has run the tier,
and 02's compilation (one graph per DDP bucket, from a cold cache) is the least certain of them. Where one command
may run for at most 10 minutes, run the files in two commands: test_full_size_runs.py, then the other two.

It runs on its own: the CPU suite (python -m pytest -q tests) hides the GPU and leaves this folder out. Without a
GPU every test is skipped, with the reason on one line, and pytest exits 0. With one, each test hands what it
measured to `report`, and the lines are printed together at the end of the run, whether the test passed or not
and whatever pytest's capture settings.
"""

import contextlib
import datetime

import pytest
import torch

import conftest as suite  # tests/conftest.py

MEASURED = pytest.StashKey[list]()
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


@pytest.fixture
def report(request):
    """report(text): one line of the GPU report. Printed at once, past pytest's capture, so that a command stopped
    at a time limit still shows what was measured before, and again with the others at the end of the run."""
    lines = request.config.stash.setdefault(MEASURED, [])
    capture = request.config.pluginmanager.getplugin("capturemanager")
    terminal = request.config.pluginmanager.getplugin("terminalreporter")

    def add(line):
        lines.append(line)
        if terminal is not None:
            with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
                terminal.write_line(f"\nmeasured: {line}", flush=True)

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
    from data import get_tokenizer, load_text

    stage = suite.load_stage("01_opt_single_gpu.py")
    text = load_text("shakespeare")
    context = stage.GPT_CONFIG_124M["context_length"]
    return len(stage.SlidingWindowDataset(text[int(0.9 * len(text)):], get_tokenizer(), context, context))
