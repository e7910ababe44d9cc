"""The test hooks: paths the tests need in the processes they start, kept out of the shipped code.

conftest.py puts this folder on PYTHONPATH, so Python imports this module at the start of every process the tests
start (a stage script, torchrun's workers, the ladder's rung workers). It reads the hooks' variables once, there,
and with none set it does nothing. Each set hook patches one module as that module is imported:

- TEST_FORCE_PRECISION=bf16|fp16|fp32: devices.autocast_precision answers that on every device (autocast float16
  and GradScaler work on the CPU too), so that the float16 + GradScaler path trains and resumes without a V100.
- DATA_READ_LOG=FILE: every read of a token shard window appends "RANK SPLIT START STOP" to FILE.
- LADDER_FAIL_RUNG=3 (or 3,11): those rungs of bench/ladder.py fail on purpose, a crash as a real one looks.

In-process tests patch the same functions with monkeypatch, through forced_precision below.
"""

import os
import re
import sys

FORCE_PRECISION = "TEST_FORCE_PRECISION"
READ_LOG = "DATA_READ_LOG"
FAIL_RUNG = "LADDER_FAIL_RUNG"


def forced_precision(precision):
    """A stand-in for devices.autocast_precision that answers `precision` on every device."""
    if precision not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"{FORCE_PRECISION}={precision}: use bf16, fp16 or fp32 (or unset it)")
    return lambda device: (precision, f"forced by the test hook {FORCE_PRECISION}")


def log_reads(shards, path):
    """data.shards.TokenShards logging each window it reads to the file `path`."""
    read = shards.TokenShards.__getitem__

    def logged_read(self, key):
        window = read(self, key)
        start, stop, _ = key.indices(len(self))
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"{os.environ.get('RANK', '0')} {self.split} {start} {stop}\n")
        return window

    shards.TokenShards.__getitem__ = logged_read


def failure_message(number):
    return f"rung {number} failed on purpose ({FAIL_RUNG} testing hook)"


def fail_composed_rungs(rungs, numbers):
    """bench.rungs.measure raising for the rungs `numbers`, before the first step."""
    measure = rungs.measure

    def failing_measure(rung, *args, **kwargs):
        if rung.number in numbers:
            raise RuntimeError(failure_message(rung.number))
        return measure(rung, *args, **kwargs)

    rungs.measure = failing_measure


def fail_script_rungs(runner, numbers):
    """bench.runner.run_multi_process_rung failing the rungs `numbers` (11, 12) without starting them."""
    run = runner.run_multi_process_rung

    def failing_run(number, args, device_info, logs, *rest, **kwargs):
        if number not in numbers:
            return run(number, args, device_info, logs, *rest, **kwargs)
        (logs / f"rung-{number:02d}.log").write_text(failure_message(number) + "\n")
        return {"rung": number, "error": failure_message(number)}

    runner.run_multi_process_rung = failing_run


def patches(environ):
    """{module name: patch(module)} for the hooks set in `environ`."""
    found = {}
    if environ.get(FORCE_PRECISION):
        precision = forced_precision(environ[FORCE_PRECISION])
        found["devices"] = lambda devices: setattr(devices, "autocast_precision", precision)
    if environ.get(READ_LOG):
        found["data.shards"] = lambda shards: log_reads(shards, environ[READ_LOG])
    failing = {int(number) for number in re.findall(r"\d+", environ.get(FAIL_RUNG, ""))}
    if failing:
        found["bench.rungs"] = lambda rungs: fail_composed_rungs(rungs, failing)
        found["bench.runner"] = lambda runner: fail_script_rungs(runner, failing)
    return found


class PatchOnImport:
    """A finder of sys.meta_path that finds nothing itself: it lets the others find a patched module, and patches
    the module once it has run."""

    def __init__(self, patches):
        self.patches = patches

    def find_spec(self, name, path, target=None):
        patch = self.patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *_: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        execute = spec.loader.exec_module

        def execute_and_patch(module):
            execute(module)
            patch(module)

        spec.loader.exec_module = execute_and_patch
        return spec


if __name__ == "sitecustomize":  # imported by Python at a process's start, not by a test
    _patches = patches(os.environ)
    if _patches:
        sys.meta_path.insert(0, PatchOnImport(_patches))
