"""Run a stage script as `python STAGE ...` would, keeping what the resume tests compare a resumed run with.

    python tests/recorded_run.py STAGE_SCRIPT [its flags...]
    torchrun ... tests/recorded_run.py STAGE_SCRIPT [its flags...]

Set in the environment:
- KEEP_CHECKPOINT_AT=N and KEEP_CHECKPOINT_IN=DIR: when the run has saved its checkpoint after N steps (it needs
  --save-every), the process that wrote model.pth copies it into DIR, with the shard folder it names (stage 03).
  The run goes on uninterrupted, and DIR holds what a run stopped after step N would have left: resuming it and
  going on must give the rest of this run.
- TRAINED_WINDOWS=PATH: every process appends a line per training forward pass (the model in training mode, with
  gradients): its rank, then an id for each window of the batch (a hash of its tokens), in the batch's order.

The stage runs as __main__ (runpy), with the same exit code as without these hooks.
"""

import os
import runpy
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def keep_checkpoint(step, folder):
    import checkpoints

    real_save = checkpoints.save_torch

    def save_torch(obj, path):
        real_save(obj, path)
        if Path(path).name == "model.pth" and obj.get("step") == step:
            Path(folder).mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, Path(folder) / "model.pth")
            if obj.get("sharded_state"):  # stage 03: model.pth names the folder of every rank's shards
                shutil.copytree(Path(path).parent / obj["sharded_state"], Path(folder) / obj["sharded_state"])

    checkpoints.save_torch = save_torch  # the stages and sharding.py call it through the module


def record_trained_windows(path):
    import torch

    rank = os.environ.get("RANK", "0")

    def record(module, args):
        if (type(module).__name__.endswith("GPTModel") and module.training and torch.is_grad_enabled()
                and args[0].device.type != "meta"):  # not the FLOP count of the header, on the meta device
            ids = [str(hash(tuple(row.tolist()))) for row in args[0]]  # ints hash alike in every process
            with open(path, "a", encoding="utf-8") as log:
                log.write(f"{rank} {' '.join(ids)}\n")

    torch.nn.modules.module.register_module_forward_pre_hook(record)  # FSDP's subclass of GPTModel too


def window_id(tokens):
    """The id recorded for a window of these input tokens."""
    return str(hash(tuple(int(token) for token in tokens)))


if __name__ == "__main__":
    script, *flags = sys.argv[1:]
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    if os.environ.get("KEEP_CHECKPOINT_AT"):
        keep_checkpoint(int(os.environ["KEEP_CHECKPOINT_AT"]), os.environ["KEEP_CHECKPOINT_IN"])
    if os.environ.get("TRAINED_WINDOWS"):
        record_trained_windows(os.environ["TRAINED_WINDOWS"])
    sys.argv = [script, *flags]
    runpy.run_path(str(ROOT / script), run_name="__main__")
