"""Errors and exit codes: what a run's failures mean to the shell (docs/operations.md, "Exit codes").

The stages raise these; failures.run(main) turns them into one line on stderr and the documented exit code.
"""

import gc
import os
import signal
import sys
from pathlib import Path

__all__ = ["UsageError", "DamagedWindow", "TrainingError", "OutputError", "NothingToTrain", "Interrupted", "run"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
resume_hint = None  # the command that continues this run, for an interrupt's message (cli.resolve_settings sets it)
training_over = False  # set once training ended: then a failed write of the outputs has nothing to resume
_undo_if_nothing_kept = []  # what a run made that it removes if it ends with nothing to keep (see undo_if_nothing_kept)


class UsageError(Exception):
    """A mistake in the command line or the input files: exit code 2, one line, no traceback."""


class DamagedWindow(UsageError):
    """A window of the token shards that cannot be trained on. Each process of a job reads windows of its own, so
    this one, unlike other usage errors, may be found by one process alone: that process reports it."""


class TrainingError(Exception):
    """The run failed while training (out of memory, a non-finite loss): exit code 1."""


class OutputError(TrainingError):
    """An output could not be written mid-run (disk full, quota, a folder gone or read-only): exit code 1."""


class NothingToTrain(Exception):
    """--resume of a checkpoint that already reached --max-steps or the last epoch: exit code 0."""


class Interrupted(Exception):
    """SIGINT, SIGTERM or SIGHUP arrived; the checkpoint is saved. Exit code 128 + the signal's number."""

    def __init__(self, signum, step):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.step = signum, step  # the last step done (0-based, as in the log)


# ---------------------------------------------------------------------------------------------
# Failures
# ---------------------------------------------------------------------------------------------

def out_of_memory(device, batch_size, context_length, script=None):
    """The message for CUDA running out of memory: what failed, what was in use, and the levers that exist."""
    import torch

    in_use = ""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        in_use = (f" ({torch.cuda.memory_allocated(device) / 1024**3:.1f} GiB allocated, "
                  f"{torch.cuda.memory_reserved(device) / 1024**3:.1f} GiB reserved of {total / 1024**3:.1f} GiB)")
    script = Path(script or sys.argv[0]).name
    levers = [f"a smaller --batch-size ({batch_size // 2})"] if batch_size > 1 else []
    if script.startswith("03"):
        levers += ["--activation-checkpointing", "more GPUs (torchrun --nproc_per_node=N, more nodes: they share the "
                   "weights, gradients and optimizer state, not a batch's activations)"]
    else:
        levers += ["a smaller --model", "03_opt_multi_gpu_fsdp.py with --activation-checkpointing or more GPUs "
                   "(it shards the weights, gradients and optimizer state)"]
    return TrainingError(f"out of GPU memory with a batch of {batch_size} x {context_length} tokens{in_use}; "
                         f"levers: {'; '.join(levers)}")


# ---------------------------------------------------------------------------------------------
# Files and exit codes
# ---------------------------------------------------------------------------------------------

def undo_if_nothing_kept(undo):
    """Call undo() if the run ends with nothing to keep: a wrong input (exit code 2), nothing left to train, or a
    Ctrl-C that quits at once. undo() removes what the run made (the --out folder, its lock file) where it is
    still empty, so a run that did save something keeps it."""
    _undo_if_nothing_kept.append(undo)


def _lost_a_peer(err):
    """Whether `err` is a collective failing because another process of a distributed job is gone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    text = str(err)
    return isinstance(err, getattr(dist, "DistError", ())) or (
        isinstance(err, RuntimeError) and ("Connection closed by peer" in text or "Connection reset by peer" in text))


def reports_for_the_job():
    """Whether this process prints the usage errors that every process of a job finds alike (the same command line,
    files and checkpoint): alone, always; under torchrun, the first process of each node (LOCAL_RANK 0), so that
    the launch's terminal shows one line instead of one per process. The other processes exit with the same code."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _ctrl_c_while_importing(kind, value, traceback):
    """sys.excepthook while a stage imports, before failures.run(main) takes over: a Ctrl-C there still exits
    with 130 (Python's traceback first). Python itself would, but exits with 1 once torch._dynamo is imported,
    which a stage's @torch.compile lines do."""
    _python_excepthook(kind, value, traceback)
    if issubclass(kind, KeyboardInterrupt):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)  # nothing of a run exists yet: no exit handler has anything to do


_python_excepthook, sys.excepthook = sys.excepthook, _ctrl_c_while_importing


def process_done(exit_code):
    """`exit_code`, for sys.exit where a process has done its work: every object is left out of the interpreter's
    last garbage collections, which over PyTorch's objects took about a second of each run's exit (whatever is still
    alive is freed with the process)."""
    gc.freeze()
    return exit_code


def run(main):
    """Run a stage's main() and turn its failures into the exit codes of docs/operations.md ("Exit codes"); an exit
    code main() returns itself (a tool's --check: 1) is kept."""
    try:
        return _run(main)
    except KeyboardInterrupt:  # a Ctrl-C that quits at once, wherever it lands (while an outcome is reported, too)
        print("interrupted at once: the last saved checkpoint (if any) is intact", file=sys.stderr)
        _undo_what_was_made()
        return 130


def _undo_what_was_made():
    for undo in _undo_if_nothing_kept:
        undo()


def _run(main):
    global training_over
    _undo_if_nothing_kept.clear()  # only this run's (the tests run several in one process)
    training_over = False
    try:
        code = main()
    except UsageError as err:
        if reports_for_the_job() or isinstance(err, DamagedWindow):  # one line per launch; 2 on every process
            print(f"error: {err}", file=sys.stderr)
        _undo_what_was_made()
        return EXIT_USAGE
    except NothingToTrain as err:
        print(f"Nothing left to train: {err}")
        _undo_what_was_made()
        return EXIT_OK
    except OutputError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except TrainingError as err:
        print(f"training failed: {err}", file=sys.stderr)
        return EXIT_FAILED
    except Interrupted as err:
        if os.environ.get("RANK", "0") == "0":  # in 02 and 03 every rank stops: one message for the job
            print(f"stopped by {err} after step {err.step:06d}; the checkpoint is saved and whole. To go on:\n"
                  f"  {resume_hint}", file=sys.stderr)
        return 128 + err.signum
    except Exception as err:
        if not _lost_a_peer(err):
            raise
        first_line = (str(err).strip().splitlines() or [""])[0][:200]
        print(f"error: another process of this job ended (its own output says why), so this one stops too: "
              f"{first_line}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK if code is None else code
