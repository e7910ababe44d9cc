"""Stage 03's plumbing: sharded checkpoints, the full-weights export, the per-rank memory report, HFU.

Nothing here is a step of the lesson (that is fully_shard, the mixed-precision policy, activation checkpointing and
per-block compilation, all in 03_opt_multi_gpu_fsdp.py); it is what a sharded model needs around it.

Checkpoints. <out>/model.pth holds the full model's weights, gathered to rank 0 one tensor at a time into CPU
memory (never the optimizer), plus the run's progress: it loads with torch.load(..., weights_only=True) into
stage 03's GPTModel or stage 01's at the same config. The training state that --resume needs (each rank's shard
of the weights and of AdamW's two moments) goes through torch.distributed.checkpoint (DCP) into a folder beside
it, <out>/model.dcp/step-NNNNNN/, each rank writing its own file. model.pth names its folder and is written
(atomically) only after that folder is complete, and the folders of earlier saves are removed only after that:
whenever a run stops, model.pth and the folder it names belong together.
"""

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

import checkpoints
import cli
import failures
import gpu_memory
import timekeeping
import utilization

# ---------------------------------------------------------------------------------------------
# Checkpoints: every rank its shard (DCP), rank 0 the full weights
# ---------------------------------------------------------------------------------------------

def save_checkpoint(model, optimizer, checkpoint, path):
    """Every rank calls this. `checkpoint` holds the metadata and progress (the keys of checkpoints.CHECKPOINT_KEYS
    but the model and the optimizer); the weights and AdamW's state are added here."""
    with timekeeping.busy("writing the sharded checkpoint"):  # the wall clock counts it as output (and says so if long)
        _save_checkpoint(model, optimizer, checkpoint, path)


def _save_checkpoint(model, optimizer, checkpoint, path):
    path = Path(path).absolute()
    parent = path.parent / checkpoints.SHARDED_FOLDER
    folder = [None]
    if dist.get_rank() == 0:  # a folder no earlier model.pth can name, so an interrupted save spoils nothing
        name, number = f"step-{checkpoint['step']:06d}", 1
        while (parent / name).exists():
            name, number = f"step-{checkpoint['step']:06d}-{number}", number + 1
        folder = [parent / name]
    # rank 0's folder on every rank (across nodes it must be on a file system that all of them see)
    dist.broadcast_object_list(folder, src=0)
    folder = folder[0]
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    try:
        dcp.save(state, checkpoint_id=folder)  # each rank writes its own shards; rank 0 also the index
    except (CheckpointException, OSError) as err:  # CheckpointException (every rank gets it) names the failures
        if dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
        raise _write_error(folder, err) from None
    # the export: each tensor gathered in turn and copied to rank 0's CPU memory; other ranks get an empty dict
    full_weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return
    checkpoint = {**checkpoint, "model": full_weights, "world_size": dist.get_world_size(),
                  "optimizer": None,  # AdamW's state is sharded: it lives in the folder below
                  "sharded_state": f"{checkpoints.SHARDED_FOLDER}/{folder.name}"}  # relative to model.pth's folder
    checkpoints.save_torch(checkpoint, path)
    for old in parent.iterdir():  # earlier saves, and what an interrupted save left
        if old != folder:
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)


def _write_error(folder, err):
    """One line for a failed sharded save: the OS error of the first rank that failed, if there is one."""
    causes = [err] if isinstance(err, OSError) else [failure[0] if isinstance(failure, tuple) else failure
                                                      for failure in getattr(err, "failures", {}).values()]
    os_error = next((cause for cause in causes if isinstance(cause, OSError)), None)
    reason = (f"{os_error.strerror or os_error} (errno {os_error.errno})" if os_error is not None
              else type(causes[0] if causes else err).__name__)
    return failures.OutputError(f"cannot write the sharded checkpoint {folder}: {reason}; the previous checkpoint "
                              "(model.pth and the folder it names) is kept")


def load_checkpoint(model, optimizer, setup, steps_per_epoch):
    """--resume: model.pth (setup.resume, opened at the start, its batch and seed checked by the stage); every rank
    reads its shards of the weights and AdamW's state from the folder it names (DCP reshards them).

    The global batch, --batch-size x --grad-accum-steps x processes (the train loader's batch, which holds the
    accumulation steps, times the processes), must be the checkpoint's; how it is split may change, the number
    of processes included. The progress is counted in optimizer steps of that batch (the epoch, the steps done
    in it, the step count), and it carries over one to one: DistributedSampler deals one shuffled order of the
    windows, the same at any world size, to the ranks in turn (rank r takes windows r, r + P, r + 2P, ... of
    it), so whatever the split, step k of an epoch trains windows k x G to (k + 1) x G - 1 of that order (G
    sequences per step), and an epoch has the same `steps_per_epoch`. At the world size the checkpoint was
    written at, the run goes on exactly; at another, it goes on from the first window not yet trained on,
    the ranks the checkpoint had with their own random state, new ones with a fresh one.
    """
    checkpoint, args, world_size = setup.resume, setup.args, dist.get_world_size()
    folder = Path(args.resume).parent / checkpoint["sharded_state"]  # checked when --resume opened the checkpoint
    saved_world_size = int(checkpoint.get("world_size", world_size))
    if saved_world_size != world_size:
        saved = checkpoint["settings"]
        there = cli.describe_split(saved["batch_size"], saved.get("grad_accum_steps", 1), saved_world_size)
        here = cli.describe_split(args.batch_size, args.grad_accum_steps, world_size)
        print(f"Resharding: the checkpoint was written by {saved_world_size} process(es), this run has {world_size}: "
              f"DCP reshards the weights and AdamW's state. The global batch is the same ({there} there, {here} "
              f"here), so each step trains the same windows of the epoch's shuffled order: the run goes on at step "
              f"{checkpoint['step']} ({checkpoint['batches_done']} of epoch {checkpoint['epoch'] + 1}'s "
              f"{steps_per_epoch} steps done) with the first window not yet trained on"
              + (f"; {cli.NEW_DROPOUT_MASKS}." if world_size > saved_world_size else "."))
    del checkpoint["model"]  # the full weights: DCP reads this rank's shards of them instead
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


# ---------------------------------------------------------------------------------------------
# Memory per rank: ZeRO's 16 bytes per parameter, divided among the ranks
# ---------------------------------------------------------------------------------------------

def _local_bytes(tensors):
    """Bytes of this rank's part of `tensors`: a DTensor's local shard, or a plain tensor."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors if t is not None)


class ShardMemory:
    """What one rank holds of the model's state, estimated in the header and measured on its local shards.

    The estimate is ZeRO's accounting (Rajbhandari et al. 2019) with float32 weights: 4 bytes of weights, 4 of
    gradients and 8 of AdamW's two moments per parameter, divided among the ranks. The measurement reads the
    bytes of the local shards (DTensor.to_local()) right after the first optimizer step, the first moment when
    the gradients and AdamW's state both exist, and gathers every rank's figures on every rank (rank 0 prints them).
    """

    def __init__(self, model, optimizer, cfg, args):
        self.model, self.world_size = model, dist.get_world_size()
        self.num_params = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the whole tensor's
        self.formula_bytes_per_rank = 16 * self.num_params / self.world_size
        self.measured = None
        self._hook = optimizer.register_step_post_hook(self._measure)
        print(self.header_line(cfg, args.batch_size, args.activation_checkpointing))

    def header_line(self, cfg, batch_size, activation_checkpointing):
        """The estimate, with the activations (Korthikanti et al. 2022, 16-bit, no attention scores: about 34 x
        width bytes per token per layer; recomputing each block keeps only its input, 2 x width bytes, plus one
        block's activations while it is recomputed) and, as 02's header counts them, the 16-bit logits and their
        gradient (4 x vocabulary bytes per token), which no recomputation removes."""
        tokens, width, layers = batch_size * cfg["context_length"], cfg["emb_dim"], cfg["n_layers"]
        per_token = (2 * layers + 34) * width if activation_checkpointing else 34 * layers * width
        per_token += gpu_memory.logits_bytes_per_token(cfg)
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        return (f"Memory per rank: weights + gradients + AdamW state ~ 16 bytes x {self.num_params:,} parameters / "
                f"{ranks} = {_gb(self.formula_bytes_per_rank)} (DDP holds {_gb(16 * self.num_params)} "
                f"on every rank); activations and logits ~ "
                f"{_gb(per_token * tokens)} at {batch_size} x {cfg['context_length']} tokens"
                + (" with activation checkpointing" if activation_checkpointing else "")
                + "; measured after the first step")

    def _measure(self, optimizer, args, kwargs):
        if all(group["lr"] == 0 for group in optimizer.param_groups):
            return  # --resume: DCP creates AdamW's state by a step at learning rate 0 on zero gradients: not training
        self._hook.remove()  # once
        parameters = list(self.model.parameters())
        local = {"parameter_bytes": _local_bytes(parameters),
                 "gradient_bytes": _local_bytes(p.grad for p in parameters),
                 "optimizer_state_bytes": _local_bytes(value for state in optimizer.state.values()
                                                       for value in state.values() if torch.is_tensor(value))}
        local["total_bytes"] = sum(local.values())
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, local)
        self.measured = everyone
        ranks = " | ".join(f"rank {rank}: weights {_gb(m['parameter_bytes'])}, gradients {_gb(m['gradient_bytes'])}, "
                           f"AdamW {_gb(m['optimizer_state_bytes'])}" for rank, m in enumerate(everyone))
        print(f"Memory per rank, measured on the local shards after the first step: {ranks} "
              f"(formula: {_gb(self.formula_bytes_per_rank)} each)", flush=True)

    def as_json(self):
        return {"formula_bytes_per_rank": self.formula_bytes_per_rank, "measured": self.measured}


def _gb(num_bytes):  # three decimals: a rank's shards are measured to the byte
    return gpu_memory.gib(num_bytes, 3)


# ---------------------------------------------------------------------------------------------
# FLOPs: what the hardware does when blocks are recomputed (HFU)
# ---------------------------------------------------------------------------------------------

def hardware_flops_per_token(cfg, vocab_size, activation_checkpointing):
    """utilization.flops_per_token plus, with activation checkpointing, the blocks' forward done again in backward:
    forward is a third of a block's training FLOPs (2 of 6 per weight), so recomputed blocks cost 8/6 of their
    model FLOPs. The output head is not recomputed. MFU counts the model's FLOPs, HFU the recomputation too (both
    leave out the padded vocabulary columns of step 9: `vocab_size` is the real one)."""
    model_flops = utilization.flops_per_token(cfg, vocab_size)
    if not activation_checkpointing:
        return model_flops
    d, layers, context = cfg["emb_dim"], cfg["n_layers"], cfg["context_length"]
    block_flops = 6 * layers * 12 * d * d + 12 * layers * d * context
    return model_flops + block_flops / 3
