"""A run's files and its life: the output folder and its lock, checkpoints, atomic writes, stopping on a signal.

The same in every stage; nothing here is a step of the lesson.
"""

import datetime
import errno
import os
import random
import signal
import sys
import tempfile
from pathlib import Path

import failures
from data import files
from failures import OutputError, UsageError
from timekeeping import busy

SHARDED_FOLDER = "model.dcp"  # stage 03's sharded training state, beside the model.pth that names it


def outputs_line(out):
    """The line that lists what a finished run wrote into `out`: in stage 03 model.pth needs its sharded folder."""
    names = ["metrics.json", "loss.pdf", "loss.png", "model.pth"]
    if (Path(out) / SHARDED_FOLDER).is_dir():
        names[-1] = f"model.pth with its sharded state in {SHARDED_FOLDER}/ (copy both to resume elsewhere)"
    return f"Wrote {out}/{', '.join(names[:-1])} and {names[-1]}"


LOCK_NAME = ".run.lock"  # in the output folder: held (flock) by the live run that writes there
_held_locks = {}  # resolved folder -> open lock file, kept open for the life of the process


def claim_out_dir(out):
    """Cheap checks before any slow work: the output folder can be written and no live run is writing there.

    The lock is an OS file lock (flock) on <out>/.run.lock: the OS releases it when its process ends, however it
    ends, so a crashed or killed run never leaves a stale lock behind, and the files of a finished run are no
    obstacle. In a distributed run rank 0 holds it for the job (the other ranks write only 03's checkpoint
    shards).
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder: choose a folder for the run's files")
    made = [folder for folder in (out, *out.parents) if not folder.exists()]  # the deepest first (and the lock file)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise UsageError(f"cannot write to --out {out} ({err.strerror}): choose a writable folder") from None
    failures.undo_if_nothing_kept(lambda: _undo_claim(out, made))  # e.g. a wrong input found later
    if os.environ.get("RANK", "0") != "0" or out.resolve() in _held_locks:
        return out
    try:
        import fcntl
    except ImportError:  # Windows has no flock: no lock there
        return out
    lock_is_new = not (out / LOCK_NAME).exists()
    lock = open(out / LOCK_NAME, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise UsageError(f"--out {out} is in use by a live run (process {holder}) that writes its files there: "
                         "wait for it to end, stop it, or choose another --out") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    _held_locks[out.resolve()] = lock
    if lock_is_new:
        made.insert(0, out / LOCK_NAME)
    return out


def _undo_claim(out, made):
    """When a run ends with nothing to keep: give up the lock of --out and remove what claim_out_dir made, the
    deepest first, where it is empty."""
    lock = _held_locks.pop(out.resolve(), None)
    if lock:
        lock.close()
    for path in made:
        try:
            path.unlink() if path.name == LOCK_NAME else path.rmdir()
        except OSError:  # a folder not empty (another rank's lock, someone else's file) or gone: keep the rest
            return


# How long a collective may wait in 02 and 03 before the job is declared broken (a lost process): NCCL's own default.
# It has to cover the longest wait of a healthy run: rank 0 writing a checkpoint (about 2 GB at full size: this
# allows a disk down to about 3.3 MB/s) while the others wait in their next gradient all-reduce, or one rank compiling
# slower than the rest. On one node a lost process ends the job at once (torchrun stops the other workers);
# across nodes, within this timeout.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


class StopSignal:
    """The first SIGINT/SIGTERM/SIGHUP asks the loop to finish its step, save and exit; a second SIGINT quits at
    once (a checkpoint being written then is left out: the previous one stays whole, see files.save_atomically).
    SIGHUP is what a closing terminal sends to a run started without nohup or tmux.

    In a distributed run every rank must stop after the same step (a rank that went on would wait forever
    in the next gradient all-reduce). The ranks agree through a small CPU (gloo) group, one step behind and
    without blocking: after each step a rank starts an all-reduce of its flag and collects the previous
    step's result, which completed while that step ran. So all ranks see a signal at the same step, one
    step after it arrived, and no rank waits here for the others to reach the same point.
    """

    def __init__(self):
        import torch.distributed as dist

        self.signum = None
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, self._handle)
        self._group = self._pending = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # every rank builds its StopSignal at the same point; the timeout is the training group's
            self._group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        if os.environ.get("RANK", "0") == "0":  # in 02 and 03, one message for the job: every rank got the signal
            print(f"\n{signal.Signals(signum).name}: finishing this step, then saving the checkpoint "
                  "(Ctrl-C again quits at once, without saving)", file=sys.stderr, flush=True)

    def requested(self):
        """The signal to stop for (0: none), the same on every rank; called by every rank after every step."""
        if self._group is None:
            return self.signum or 0
        import torch
        import torch.distributed as dist

        agreed = 0
        if self._pending is not None:  # the all-reduce started after the previous step: complete by now
            work, flag = self._pending
            work.wait()
            agreed = int(flag.item())
        flag = torch.tensor([self.signum or 0])
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return agreed


def rng_state(device):
    import torch

    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "mps": torch.mps.get_rng_state() if device.type == "mps" else None}


def rng_of_rank(states, rank, seed):
    """The random state a rank resumes with: its own from the checkpoint's list (one per process of the run that
    saved it), or, for a rank that run did not have (more processes now), a fresh one seeded with seed + rank, as the
    rank would have started with: never another rank's, which would repeat that rank's dropout masks."""
    import torch

    if rank < len(states):
        return states[rank]
    fresh = seed + rank
    return {"torch": torch.Generator().manual_seed(fresh).get_state(), "python": random.Random(fresh).getstate(),
            "cuda": None, "mps": None}


def restore_rng(state, device):
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    if device.type == "mps" and state.get("mps") is not None:
        torch.mps.set_rng_state(state["mps"])


CHECKPOINT_KEYS = ("model", "optimizer", "config", "settings", "script", "epoch", "batches_done", "step",
                   "history", "rng", "tokens_per_step")


class Checkpoint(dict):
    """A checkpoint opened for --resume (its tensors memory-mapped: read when used), with the flags of this run
    that its settings filled (cli.resolve_settings; the resume line names them)."""

    def __init__(self, contents):
        super().__init__(contents)
        self.flags_taken = []


def open_checkpoint(path, script):
    """The checkpoint for --resume, checked as far as its header goes, before the corpus and the model are built.

    The tensors are memory-mapped (mmap=True), not read: opening even a 2 GB checkpoint takes milliseconds.
    """
    import torch

    path = Path(path)
    if path.is_dir():
        hint = f": resume {path / 'model.pth'}" if (path / "model.pth").is_file() else " (a run writes <out>/model.pth)"
        raise UsageError(f"--resume {path}: a folder, not a checkpoint file{hint}")
    if not path.is_file():
        raise UsageError(f"--resume {path}: no such checkpoint file (a run writes <out>/model.pth)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # truncated zip, not a torch file, unreadable, unpickling refused...
        raise UsageError(f"--resume {path}: not a readable checkpoint ({type(err).__name__}); the file is "
                         "truncated, corrupt or unreadable: use an intact model.pth") from None
    if not isinstance(checkpoint, dict) or any(key not in checkpoint for key in CHECKPOINT_KEYS):
        raise UsageError(f"--resume {path}: not a checkpoint of these scripts (keys missing)")
    if checkpoint["script"] != script:
        raise UsageError(f"--resume {path}: written by {checkpoint['script']}, not {script}: "
                         f"resume it with {checkpoint['script']}")
    if "sharded_state" in checkpoint:  # stage 03's: the weights and AdamW's state are in the shards it names
        check_sharded_state(path, checkpoint)
    return Checkpoint(checkpoint)


def check_sharded_state(path, checkpoint):
    """Stage 03's checkpoint `path` names the folder of its shards (weights and AdamW's state), which must lie beside
    it, whole: DCP writes the folder's .metadata last."""
    folder = Path(path).parent / str(checkpoint.get("sharded_state"))
    if not checkpoint.get("sharded_state") or not (folder / ".metadata").is_file():
        raise UsageError(f"--resume {path}: its sharded training state {folder} is missing or incomplete (copy the "
                         f"{SHARDED_FOLDER} folder along with model.pth)")


# What to do when an output cannot be written, by the OS error's number.
_WRITE_FAILURE_HINTS = {
    errno.ENOSPC: "free some disk space",
    errno.EDQUOT: "free some space within your disk quota",
    errno.EROFS: "the file system is read-only: choose another --out",
    errno.EACCES: "make the folder writable again or choose another --out",
    errno.EPERM: "make the folder writable again or choose another --out",
    errno.ENOENT: "the folder was removed while the run went on: create it again or choose another --out",
    errno.EFBIG: "the file system or a size limit (ulimit -f) caps file sizes: raise it or choose another --out",
}


def save_atomically(save, path):
    """files.save_atomically, with an OS error turned into an OutputError: one line naming the file and the
    error. The previous file stays whole and no temporary file is left (files.save_atomically sees to both)."""
    try:
        with busy(f"writing {Path(path).name}"):  # the wall clock counts it as output (and says so if long)
            files.save_atomically(save, path)
    except (OSError, RuntimeError) as raised:
        if _in_chain(raised, KeyboardInterrupt):  # a second Ctrl-C inside torch.save: it quits, as anywhere else
            raise KeyboardInterrupt from None
        err = _in_chain(raised, OSError)
        if err is None:
            raise
        hint = _WRITE_FAILURE_HINTS.get(err.errno, "fix the cause or choose another --out")
        checkpoint = Path(path).parent / "model.pth"
        if not checkpoint.exists():
            resume = ""
        elif failures.training_over:  # the final checkpoint: a --resume would have nothing left to train
            resume = f"; training is over: {checkpoint} holds the trained model and the whole log"
        else:
            resume = f", then go on with --resume {checkpoint}"
        reason = err.strerror or str(err) or type(err).__name__
        raise OutputError(f"cannot write {path}: {reason} (errno {err.errno}); the previous file, if any, is "
                          f"kept: {hint}{resume}") from None


def _in_chain(err, kind):
    """The exception of `kind` behind `err`: itself, or one it was raised while handling. A disk that fills up (an
    OSError) or a Ctrl-C (a KeyboardInterrupt) in the middle of torch.save lands inside its zip writer, whose
    cleanup then raises a RuntimeError ("unexpected pos ...") over it: the first is that RuntimeError's
    __context__."""
    while err is not None and not isinstance(err, kind):
        err = err.__cause__ or err.__context__
    return err


def save_torch(obj, path):
    """torch.save, atomically. Through a Python file object, so that a full disk raises a real OSError
    (torch.save to a path reports it as an unspecific RuntimeError)."""
    import torch

    def save(tmp):
        with open(tmp, "wb") as f:
            torch.save(obj, f)
    save_atomically(save, path)

