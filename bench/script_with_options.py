"""Run a stage script with some of the ladder's options switched on in its own process.

Rungs 11 and 12 are 02 and 03 as they are, under torchrun. An option that is a setting of PyTorch (a configuration
of its compiler, or FSDP2's fully_shard replaced: bench/rungs.py's SCRIPT_SETTINGS) has to be set inside each of the
script's processes, before the script imports or compiles anything, so the ladder (and bench/stages.py under
--option) starts this file in the script's place: it switches the options on, then runs the script as
`python SCRIPT FLAGS` would (as `__main__`, with its own sys.argv):

  torchrun --standalone --nproc_per_node=1 bench/script_with_options.py --option cuda-graphs \\
      02_opt_multi_gpu_ddp.py --max-steps 50

An option that changes the script's code (SCRIPT_CODE_OPTIONS: nested-compile-region marks its TransformerBlock)
is applied between the script's body, which defines its classes and functions, and its closing
`if __name__ == "__main__":` block, which runs main(): so main() builds the model from the marked class.

The script's file is not changed: what differs from its plain run is the options named, and this file's imports
(bench/rungs.py, PyTorch) before the script's own.
"""

import ast
import sys
import types
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


def is_main_block(statement):
    return isinstance(statement, ast.If) and ast.unparse(statement.test) == "__name__ == '__main__'"


def run_as_main(path, options):
    """Execute the script at `path` as `python SCRIPT` would (as the module __main__), with the options that change
    its code applied once its body has run and before its `if __name__ == "__main__":` block."""
    from bench.rungs import SCRIPT_CODE_OPTIONS, mark_code

    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    body, tail = tree.body, []
    if set(options) & SCRIPT_CODE_OPTIONS:
        if not tree.body or not is_main_block(tree.body[-1]):
            raise SystemExit(f"bench/script_with_options.py: {path.name} does not end with an "
                             "`if __name__ == \"__main__\":` block, so its code cannot be changed before main() runs")
        body, tail = tree.body[:-1], tree.body[-1:]
    module = types.ModuleType("__main__")
    module.__file__ = str(path)
    sys.modules["__main__"] = module  # what torch.compile looks the script's functions up in, as in a plain run
    exec(compile(ast.Module(body, type_ignores=[]), str(path), "exec"), module.__dict__)
    mark_code(module, options)
    exec(compile(ast.Module(tail, type_ignores=[]), str(path), "exec"), module.__dict__)


def main(argv=None):
    options, script, flags = split_command(sys.argv[1:] if argv is None else argv)
    from bench.rungs import SCRIPT_SETTINGS, apply_options

    unknown = [name for name in options if name not in SCRIPT_SETTINGS]
    if unknown:
        raise SystemExit(f"bench/script_with_options.py: {', '.join(unknown)} is no option a stage script takes "
                         f"(those are: {', '.join(sorted(SCRIPT_SETTINGS))})")
    apply_options(options)
    path = Path(script).resolve()
    sys.argv = [str(path), *flags]
    sys.path[0] = str(path.parent)  # as `python SCRIPT` would have it: the script's folder first
    run_as_main(path, options)


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # for bench.rungs, in place of this file's folder (bench/), which the script never sees
    main()
