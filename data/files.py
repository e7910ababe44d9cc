"""Atomic file writes: readers (and a crash) see the old file or the new one, never half of one."""

import json
import os
import tempfile
from pathlib import Path


def save_atomically(save, path):
    """Call save(tmp_path) for a temporary file beside `path`, flush it to disk, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.close(fd)
        save(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes files private; give them the usual mode
        os.replace(tmp, path)
    except BaseException:  # an error or a second Ctrl-C: the old file stays, the half-written one goes
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomically(path, data):
    save_atomically(lambda tmp: Path(tmp).write_bytes(data), path)


def write_json(path, obj, save_atomically=save_atomically):
    """`obj` as indented JSON (allow_nan=False: JSON has no NaN), written by `save_atomically` (a run passes
    checkpoints.save_atomically, which reports a failed write in one line)."""
    data = (json.dumps(obj, indent=2, allow_nan=False) + "\n").encode("utf-8")
    save_atomically(lambda tmp: Path(tmp).write_bytes(data), path)


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask
