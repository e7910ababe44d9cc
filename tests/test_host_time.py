"""bench/host_time.py: the host's time per step of each stage's machinery, on a model too small to hide it."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "host_time.py"


def host_time(*flags):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, flags)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def block_parameters(width):
    """One block of the book's GPT at `width`, without qkv biases: attention 4 w^2 + w, MLP 8 w^2 + 5 w, two
    LayerNorms 4 w."""
    return 12 * width * width + 10 * width


def test_each_stage_is_timed_phase_by_phase_in_a_process_of_its_own():
    done = host_time("--runs", "01,02-split,03", "--no-compile", "--steps", 3, "--warmup", 1, "--layers", 2,
                     "--repeats", 1)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split(" | ")[0].strip("| "): line for line in done.stdout.splitlines() if line.startswith("| 0")}
    assert list(rows) == ["01", "02-split", "03"], done.stdout
    for run, line in rows.items():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        step, phases, ratio = float(cells[1].split()[0]), [float(cell) for cell in cells[2:5]], float(cells[5])
        assert step > 0 and all(ms > 0 for ms in phases), line
        assert step >= max(phases), line  # a step holds its three phases
        if run == "01":
            assert ratio == 1.0
    assert "2 blocks 64 wide" in done.stdout and "eager (--no-compile)" in done.stdout
    # DDP's 25 MiB buckets shrunk by the ratio of a 64-wide block to GPT-2 small's 768-wide one: about a block each
    expected = 25 * block_parameters(64) / block_parameters(768)
    assert f"buckets of {expected:.3f} MiB" in rows["02-split"], rows["02-split"]
    assert re.search(r"\| 03 \|.*\|\s*\|$", rows["03"])  # no notes where nothing was shrunk


def test_an_unknown_run_or_a_missing_gpu_is_refused_in_one_line():
    for flags, message in ((("--runs", "01,04"), "the runs are 01, 02, 02-split, 03"),
                           (("--device", "cuda"), "sees no CUDA GPU"),
                           (("--repeats", 0), "--steps, --layers and --repeats take a whole number from 1")):
        done = host_time(*flags)
        assert done.returncode == 2 and message in done.stderr, (flags, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and not done.stdout
