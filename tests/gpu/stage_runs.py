"""Running a stage as a user would and reading what it printed: the helpers of the GPU tier.

The readers search the output rather than match whole lines (torchrun and torch's loggers add prefixes) and return
None or an empty list where a line is missing, so that a test can say what was missing and show the output.
tests/test_inspection.py checks them on the output of a real CPU run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.runner import SINGLE_NODE_TORCHRUN, parent_death_signal, stop_process_group

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_ONE_PROCESS = [sys.executable, *SINGLE_NODE_TORCHRUN, "--nproc_per_node=1"]


@dataclass
class StageRun:
    command: list
    out: Path
    returncode: int | None  # None: killed at its timeout
    stdout: str
    stderr: str
    seconds: float

    def describe(self, tail=4000):
        """What to look at when a check fails: the command, how it ended, and the end of its output."""
        ending = "killed at its timeout" if self.returncode is None else f"exit code {self.returncode}"
        return (f"\n$ {shlex.join(map(str, self.command))}\n({ending} after {self.seconds:.0f} s)\n"
                f"--- stdout, last {tail} characters ---\n{self.stdout[-tail:]}\n"
                f"--- stderr, last {tail} characters ---\n{self.stderr[-tail:]}")

    def metrics(self):
        return json.loads((self.out / "metrics.json").read_text(encoding="utf-8"))


def run_stage(script, *flags, out, env=None, torchrun=False, timeout=300, keep_checkpoint=False):
    """Run `python SCRIPT FLAGS --out OUT` (under torchrun with one process if asked) from the repository root.

    The environment is inherited (PYTHONPATH included: the data packages may live there). A run that outlives
    `timeout` is killed with every process it started. The checkpoint is deleted unless kept: 2 GB at full size,
    and no check reads it.
    """
    launcher = TORCHRUN_ONE_PROCESS if torchrun else [sys.executable]
    command = [*launcher, script, *map(str, flags), "--out", str(out)]
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True, preexec_fn=parent_death_signal())  # ends with pytest, too
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        stop_process_group(proc)  # torchrun's workers too, which lead sessions of their own and hold the pipes
        stdout, stderr = proc.communicate()
        returncode = None
    if not keep_checkpoint:
        (Path(out) / "model.pth").unlink(missing_ok=True)
    return StageRun(command, Path(out), returncode, stdout, stderr, time.monotonic() - start)


# ---------------------------------------------------------------------------------------------
# Readers of a run's output
# ---------------------------------------------------------------------------------------------

LOG_LINE = re.compile(r"Ep (\d+), Step (\d+), Train: ([^,\s]+), Val: ([^,\s]+), Step tok/sec: (\d+|n/a), "
                      r"Avg tok/sec: (\d+|n/a)(?:, MFU: ([\d.]+)%)?")
MEMORY_LINE = re.compile(r"(Allocated|Reserved) memory: ([\d.]+) GiB")
TRACED_FRAME = re.compile(r"(?:\[(\d+)/(\d+)(?:_\d+)?\]\s+)?(?:Step 1: )?torchdynamo start tracing (\S+)")
DDP_SPLIT = re.compile(r"DDPOptimizer used bucket cap (\d+) and created (\d+) buckets")


def _number(text):
    return None if text in (None, "n/a") else float(text)


def log_entries(stdout):
    """The log lines (`Ep 1, Step 000010, Train: ..., MFU: 38.9%`) as dicts; tok/s and MFU are None where n/a,
    MFU a fraction."""
    entries = []
    for match in LOG_LINE.finditer(stdout):
        epoch, step, train, val, step_tokens, avg_tokens, mfu = match.groups()
        entries.append({"epoch": int(epoch), "step": int(step), "train_loss": float(train), "val_loss": float(val),
                        "step_tok_per_sec": _number(step_tokens), "avg_tok_per_sec": _number(avg_tokens),
                        "mfu": None if mfu is None else float(mfu) / 100})
    return entries


def memory_gb(stdout):
    """{"allocated": GiB, "reserved": GiB} from the last memory lines printed after an epoch (empty off CUDA)."""
    return {kind.lower(): float(value) for kind, value in MEMORY_LINE.findall(stdout)}


def traced_frames(stderr):
    """(frame, compile attempt, function) for each frame torch.compile started tracing (TORCH_LOGS=dynamo); an
    attempt above 0 is a recompile. Frame and attempt are None where the log line carries no compile id."""
    return [(int(frame) if frame else None, int(attempt) if attempt else None, name)
            for frame, attempt, name in TRACED_FRAME.findall(stderr)]


def torch_log(stderr, artifact, phrase):
    """The lines TORCH_LOGS=<artifact> printed: torch tags them [__<artifact>]; `phrase` also finds an untagged
    line (another PyTorch version's format)."""
    return [line for line in stderr.splitlines() if f"[__{artifact}]" in line or phrase in line]


ATTENTION_OP = re.compile(r"torch\.ops\.aten\.(_scaled_dot_product_\w+)\.default")


def attention_ops(stderr):
    """The SDPA kernels' aten ops (`_scaled_dot_product_flash_attention`, its `_backward`, ...) in the graphs that
    AOTAutograd traced (TORCH_LOGS=aot_graphs): which attention backend the compiled steps run, chosen at trace time."""
    return sorted({name for line in torch_log(stderr, "aot_graphs", "torch.ops.aten._scaled_dot_product")
                   for name in ATTENTION_OP.findall(line)})


def ddp_bucket_splits(stderr):
    """The number of buckets (one compiled graph each) for every graph DDPOptimizer split (TORCH_LOGS=dynamo)."""
    return [int(buckets) for _, buckets in DDP_SPLIT.findall(stderr)]


GPU_TIME_PART = re.compile(r"^(.+) ([\d.]+) ms \(\d+%\)$")


def gpu_time_shares(stdout):
    """{class: seconds per step, "step": seconds} from --profile's line "GPU time per step of steps 6-8 (kernels
    by name): 43.10 ms = matmuls 25.10 ms (58%) + ..." (classes as in inspection.WORK_LABELS); {} without it."""
    from inspection import WORK_LABELS

    line = next((line for line in stdout.splitlines() if line.startswith("GPU time per step of steps")), None)
    if line is None or " = " not in line:
        return {}
    total, parts = line.split(" = ", 1)
    by_label = {label: work for work, label in WORK_LABELS.items()}
    matches = [GPU_TIME_PART.match(part.strip()) for part in parts.split(" + ")]
    shares = {by_label[m.group(1)]: float(m.group(2)) / 1e3 for m in matches if m and m.group(1) in by_label}
    return {**shares, "step": float(re.search(r"([\d.]+) ms$", total).group(1)) / 1e3}


def profile_rows(stdout):
    """The row names of the --profile table (torch.profiler's key_averages().table()), top row first.

    The table follows the line "Profile of steps ..."; three rules of dashes frame its header and rows, and the
    first run of dashes is as wide as the name column (long names end in "...").
    """
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if "Profile of steps" in line), None)
    if start is None:
        return []
    rules = [i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("---")][:3]
    if len(rules) < 3:
        return []
    width = len(lines[rules[0]].split()[0])
    return [line[:width].strip() for line in lines[rules[1] + 1:rules[2]] if line.strip()]
