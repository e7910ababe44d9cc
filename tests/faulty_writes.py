"""Run a stage script with a fault in its file writes, for the reliability tests (no root needed).

    python tests/faulty_writes.py FAULT STAGE_SCRIPT [its flags...]
    torchrun ... tests/faulty_writes.py FAULT 02_opt_multi_gpu_ddp.py [its flags...]

FAULT is one of:
- enospc-save-N: the N-th torch.save writes part of the checkpoint, then the disk is full (ENOSPC);
- erofs-plot: saving a plot fails with a read-only file system (EROFS), after the checkpoint and metrics;
- slow-save-N: the N-th torch.save writes half the checkpoint, prints SAVING on stderr and pauses 5 s before
  writing the rest (time for a second Ctrl-C in the middle of the write).

The stage then runs as `python STAGE ...` would run it (runpy, as __main__), with the same exit code.
"""

import errno
import io
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def install(fault):
    import matplotlib.figure
    import torch

    real_save = torch.save
    calls = {"save": 0}
    kind, _, number = fault.rpartition("-") if fault[-1].isdigit() else (fault, "", "0")

    def faulty_save(obj, f, *args, **kwargs):
        if not isinstance(f, io.BufferedWriter):  # only writes to files count (not to memory buffers)
            return real_save(obj, f, *args, **kwargs)
        calls["save"] += 1
        if calls["save"] != int(number):
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        f.write(data[:len(data) // 2])
        f.flush()
        if kind == "enospc-save":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        print("SAVING", file=sys.stderr, flush=True)
        time.sleep(5)
        f.write(data[len(data) // 2:])

    def read_only_savefig(self, fname, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(fname))

    if kind in ("enospc-save", "slow-save"):
        torch.save = faulty_save
    elif fault == "erofs-plot":
        matplotlib.figure.Figure.savefig = read_only_savefig
    else:
        raise SystemExit(f"unknown fault {fault!r}")


if __name__ == "__main__":
    fault, script, *flags = sys.argv[1:]
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    install(fault)
    sys.argv = [script, *flags]
    runpy.run_path(str(ROOT / script), run_name="__main__")
