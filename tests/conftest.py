"""Shared test helpers: run the stage scripts as a user would, and import them as modules."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load_stage(filename):
    """Import a stage script (its name starts with a digit) as a module."""
    spec = importlib.util.spec_from_file_location(Path(filename).stem.replace("0", "stage0", 1), ROOT / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(*args, timeout=300, env=None):
    """Run `python <args>` from the repository root, offline, and return the CompletedProcess."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


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
