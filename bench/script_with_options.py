"""Run a stage script with some of the ladder's options switched on in its own process.

Rungs 11 and 12 are 02 and 03 as they are, under torchrun. An option that is a setting of PyTorch (a configuration
of its compiler, or FSDP2's fully_shard replaced: bench/rungs.py's SCRIPT_SETTINGS) has to be set inside each of the
script's processes, before the script imports or compiles anything, so the ladder starts this file in the script's
place: it switches the options on, then runs the script as `python SCRIPT FLAGS` would (as `__main__`, with its own
sys.argv):

  torchrun --standalone --nproc_per_node=1 bench/script_with_options.py --option cuda-graphs \\
      02_opt_multi_gpu_ddp.py --max-steps 50

The script's code is not changed: what differs from its plain run is the settings named, and this file's imports
(bench/rungs.py, PyTorch) before the script's own.
"""

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def split_command(argv):
    """`--option NAME` pairs first, then the script and its flags: (options, script, flags)."""
    options = []
    while argv[:1] == ["--option"] and len(argv) > 1:
        options.append(argv[1])
        argv = argv[2:]
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: bench/script_with_options.py [--option NAME ...] SCRIPT [FLAGS ...]")
    return options, argv[0], argv[1:]


def main(argv=None):
    options, script, flags = split_command(sys.argv[1:] if argv is None else argv)
    from bench.rungs import SCRIPT_SETTINGS, apply_options

    unknown = [name for name in options if name not in SCRIPT_SETTINGS]
    if unknown:
        raise SystemExit(f"bench/script_with_options.py: {', '.join(unknown)} is no setting a stage script takes "
                         f"(those are: {', '.join(sorted(SCRIPT_SETTINGS))})")
    apply_options(options)
    path = Path(script).resolve()
    sys.argv = [str(path), *flags]
    sys.path[0] = str(path.parent)  # as `python SCRIPT` would have it: the script's folder first
    runpy.run_path(str(path), run_name="__main__")


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # for bench.rungs, in place of this file's folder (bench/), which the script never sees
    main()
