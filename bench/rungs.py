"""The rungs of the benchmark ladder, composed from the stage scripts' own code.

Rung 0 is 00_orig.py, rung 10 is 01_opt_single_gpu.py, and rung k (1 to 9) is rung k-1 plus
optimization k, numbered as in the README's "The ten steps". No rung has a model of
its own: each one loads fresh copies of 00 and 01 as modules and picks its parts from them (model classes,
config dicts, data loader, loss function), wired in the order 01's main() wires them. The one part neither
stage has is rung 1's attention (stage 00's hand-written attention, but with the causal mask made at each
call): it is below.

Why one timing loop for every rung 0..10 instead of running 00 and 01 themselves for rungs 0 and 10:
the scripts log at evaluation points, leave only their first interval out as warm-up and evaluate
between intervals, so their clock differs from what a composed rung could use. Measuring all eleven
single-process rungs with the same loop (same corpus, seed, batch order, warm-up and timing windows,
nothing but training steps on the clock) makes every ratio between two rungs a clean one. Rungs 11
(DDP) and 12 (FSDP2) need several processes and cannot be composed that way; ladder.py runs the real 02
and 03 under torchrun.
"""

import importlib.util
import itertools
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
import torch.nn as nn

import cli
import devices
import gpu_memory
from bench import chunked_loss
from bench.rung_table import (CHANGES, MULTI_PROCESS_RUNGS, RUNG_PARTS, STAGE_00, STAGE_01,  # noqa: F401 (the
                              STAGE_02, STAGE_03, takes_01)  # ladder's names for them)

ROOT = Path(__file__).resolve().parents[1]
# Measured options: a change tried on top of the composed rungs (0-10) before it earns a place in 01: a setting of
# PyTorch that a reader could add to 01 in a line, a decorator on one of 01's functions (nested-compile-region), a
# function that would replace one of 01's (chunked-loss), or a price to know (no-dropout: the book's dropout off). The
# ladder measures a rung with and without one (--option NAME, into a results folder of its own) and the change is
# kept only if the numbers show it.
MEMORY_BUDGET = 0.8  # any value from 0.7 to 0.95 gives gpt2-small the same partition: no matmul recomputed
ACCUMULATION_STEPS = 4  # --option grad-accum: each step's batch as this many micro-batches
OPTIONS = {
    "max-autotune": "torch._inductor.config.max_autotune = True: Inductor benchmarks Triton templates against "
                    "cuBLAS for every matmul shape and tunes its kernels' launch settings (compiles for minutes)",
    "coordinate-descent": "torch._inductor.config.coordinate_descent_tuning = True: Inductor tunes the block "
                          "sizes of its own kernels (the loss's and the norms' reductions) one step at a time",
    "cudnn-attention": "SDPA on cuDNN's attention kernels only (torch.backends.cuda: flash, memory-efficient and "
                       "math off): NVIDIA's own FlashAttention for Hopper instead of PyTorch's. 01 turns it off "
                       "because its kernels may round dropout to a multiple of 1/16 (another rate than 0.1; "
                       "PyTorch 2.12 and newer refuse it at 0.1, and the rungs fail)",
    "memory-budget": f"torch._functorch.config.activation_memory_budget = {MEMORY_BUDGET}: the compiled step saves "
                     "less for its backward and recomputes the norms, GELU and the residual stream there "
                     "(cost_model/memory_model.py shows what it saves)",
    "chunked-loss": "01's forward_and_loss replaced by bench/chunked_loss.py's: the output head and the loss in "
                    f"chunks of {chunked_loss.CHUNK_TOKENS:,} tokens, their gradient made in the forward, so the "
                    "logits are never kept whole (rungs 4-10, whose loss is 01's)",
    "fused-loss": "01's forward_and_loss replaced by bench/chunked_loss.py's with the whole batch as one chunk: "
                  "the loss's forward writes the logits' gradient in the same pass, and the head's two gradient "
                  "matmuls run there too, so the backward does not read the logits again (llm.c's fused classifier; "
                  "rungs 4-10, whose loss is 01's)",
    "grad-accum": f"gradient accumulation: each optimizer step's batch as {ACCUMULATION_STEPS} micro-batches of a "
                  f"{ACCUMULATION_STEPS}th of it, their gradients summed (the same math: rung 10 as 4 x 8 against "
                  "32 shows what the smaller matmuls cost; rungs 11 and 12 run the stage scripts with "
                  f"--grad-accum-steps {ACCUMULATION_STEPS}: one all-reduce per step, not per micro-batch)",
    "no-dropout": "the book's dropout (0.1) off everywhere: embeddings, attention weights and residual branches "
                  "(not the book's math: what dropout costs, and what SDPA's kernels do without it; pretraining "
                  "runs of GPT-2-sized models usually train without dropout)",
    "cuda-graphs": "torch._inductor.config.triton.cudagraphs = True (torch.compile's mode=\"reduce-overhead\"): each "
                   "compiled graph is replayed as one CUDA graph, so the host launches it once instead of kernel by "
                   "kernel (rungs 8-12, which compile)",
    "nested-compile-region": "torch.compiler.nested_compile_region on TransformerBlock.forward: torch.compile "
                             "traces and compiles one block and reuses that code for the others (what it buys is "
                             "compile time, a cold start's largest part; rungs 8-11, and the stage runs of "
                             "bench/stages.py), with "
                             "torch._inductor.config.allow_buffer_reuse = False: with reuse, Inductor (PyTorch 2.14.1, "
                             "CPU) gave wrong gradients from two blocks on (2.11.0's were exact either way); without, exact "
                             "ones. A row counts only "
                             "where tests/gpu/test_compile_options.py passed on the same PyTorch",
    "fsdp-one-unit": "03 (rung 12) with FSDP2 on the whole model alone, not on each block: one unit, so one "
                     "gather, one reduce-scatter and one set of hooks a step where 03 has thirteen. At one process "
                     "the shards are the whole weights either way; at more, the whole model is gathered at once "
                     "(what 03's per-block units cost the host; bench/host_time.py's 03-one-unit)",
    "expandable-segments": "PYTORCH_ALLOC_CONF=expandable_segments:True in the rung's environment: the CUDA "
                           "caching allocator grows a segment in place instead of reserving new fixed-size ones, so "
                           "reserved memory stays closer to allocated (the same tensors, less fragmentation)",
}
# Options that act through the environment a rung's process starts with (the allocator reads it once, at CUDA's
# initialization): the ladder sets it when it starts the rung.
# PYTORCH_ALLOC_CONF is the name PyTorch reads first since 2.9; before, only PYTORCH_CUDA_ALLOC_CONF (now its
# deprecated fallback, ignored where the new name is set): both, so that no setting of the machine's wins.
OPTION_ENVIRONMENT = {"expandable-segments": {"PYTORCH_ALLOC_CONF": "expandable_segments:True",
                                              "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
SINGLE_PROCESS_RUNGS = range(0, 11)
ALL_RUNGS = range(0, 13)
# The rungs each option applies to: the composed rungs 0-10, unless named here. Rungs 11 and 12 are the stage
# scripts as they are; they take grad-accum as their own flag, the allocator's setting in their environment, and the
# settings of PyTorch below in their own processes (bench/script_with_options.py starts them so, under torchrun).
OPTION_RUNGS = {**{name: SINGLE_PROCESS_RUNGS for name in OPTIONS},
                **{name: ALL_RUNGS for name in ("grad-accum", "expandable-segments", "max-autotune",
                                                "coordinate-descent", "memory-budget", "cuda-graphs")},
                "nested-compile-region": range(0, 12),  # not 03's: it compiles each block on its own
                "fsdp-one-unit": range(12, 13)}
SCRIPT_OPTIONS = {name for name, numbers in OPTION_RUNGS.items() if set(numbers) & {11, 12}}
SCRIPT_SETTINGS = SCRIPT_OPTIONS - {"grad-accum", "expandable-segments"}  # applied in the script's process
# Of those, the ones that change the script's code, not only PyTorch's settings: bench/script_with_options.py applies
# them once the script has defined its classes, before its main() runs (mark_code).
SCRIPT_CODE_OPTIONS = {"nested-compile-region"}
# The options of bench/stages.py's runs of 01 and 02 (whole runs, as a user starts them): what rung 11 takes, except
# grad-accum, which would change the runs' batches.
STAGE_OPTIONS = sorted(name for name in SCRIPT_OPTIONS if 11 in OPTION_RUNGS[name] and name != "grad-accum")


def option_rungs(names):
    """The rungs that every option of `names` applies to (all of them without options), in order."""
    return [number for number in ALL_RUNGS if all(number in OPTION_RUNGS[name] for name in names)]

_load_counter = itertools.count()


def apply_options(names):
    """Switch on the measured options `names` (keys of OPTIONS) for this process; before the rung is composed.

    chunked-loss, fused-loss, grad-accum and no-dropout change the rung's code or config, not a setting of PyTorch:
    compose() takes them (its `options`); nested-compile-region is both (compose() marks the block)."""
    for name in names:
        if name in ("chunked-loss", "fused-loss", "grad-accum", "no-dropout"):  # compose() takes these
            continue
        if name in OPTION_ENVIRONMENT:
            missing = {key: value for key, value in OPTION_ENVIRONMENT[name].items() if os.environ.get(key) != value}
            if missing:  # set too late here: the ladder starts the rung's process with it
                raise ValueError(f"option {name} needs {missing} in the environment the process starts with "
                                 "(bench/ladder.py sets it)")
            continue
        if name == "max-autotune":
            import torch._inductor.config as inductor_config
            inductor_config.max_autotune = True
        elif name == "coordinate-descent":
            import torch._inductor.config as inductor_config
            inductor_config.coordinate_descent_tuning = True
        elif name == "cuda-graphs":
            import torch._inductor.config as inductor_config
            inductor_config.triton.cudagraphs = True
        elif name == "nested-compile-region":  # compose() marks the block; here the setting its gradients need
            import torch._inductor.config as inductor_config
            inductor_config.allow_buffer_reuse = False
        elif name == "fsdp-one-unit":  # before 03 imports fully_shard from the package
            import torch.distributed.fsdp as fsdp
            fsdp.fully_shard = whole_model_unit(fsdp.fully_shard)
        elif name == "memory-budget":
            import torch._functorch.config as functorch_config
            functorch_config.activation_memory_budget = MEMORY_BUDGET
        elif name == "cudnn-attention":
            torch.backends.cuda.enable_flash_sdp(False)
            torch.backends.cuda.enable_mem_efficient_sdp(False)
            torch.backends.cuda.enable_math_sdp(False)  # no silent fallback: a rung without cuDNN fails, and says so
            torch.backends.cuda.enable_cudnn_sdp(True)
        else:
            raise ValueError(f"unknown option {name!r}; the options are {', '.join(OPTIONS)}")


def mark_code(module, names):
    """The options of `names` that change a stage's code (SCRIPT_CODE_OPTIONS), on the classes `module` defines:
    nested-compile-region makes TransformerBlock.forward a region that torch.compile traces once for every block."""
    if "nested-compile-region" in names:
        module.TransformerBlock.forward = torch.compiler.nested_compile_region(module.TransformerBlock.forward)


def whole_model_unit(fully_shard):
    """fully_shard for the whole model alone (the module holding the blocks): 03's calls for its blocks leave them to
    that one unit."""
    def wrapped(module, **options):
        return fully_shard(module, **options) if hasattr(module, "trf_blocks") else module
    return wrapped


def option_environment(names):
    """The environment variables the options `names` need in a rung's process, from its start."""
    return {key: value for name in names for key, value in OPTION_ENVIRONMENT.get(name, {}).items()}


def load_stage(filename):
    """A fresh module object for a stage script (its name starts with a digit, so no plain import).

    Every call executes the file again, so patching one copy's globals never leaks into another rung. Each copy is
    registered in sys.modules under its own name, as an import would do: torch.compile (2.11) looks a module up
    there when a compiled function of another module calls into this one (bench/chunked_loss.py into the model).
    """
    path = ROOT / filename
    if not path.exists():
        raise FileNotFoundError(f"{filename} does not exist")
    name = f"ladder_{path.stem}_{next(_load_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# The parts neither stage has
# ---------------------------------------------------------------------------------------------

def on_the_fly_mask_attention(stage00):
    """Rung 1's attention: stage 00's class, minus its stored mask buffer; the mask is made per call.

    Built per stage-00 module because it subclasses that module's own MultiHeadAttention.
    """

    class OnTheFlyMaskAttention(stage00.MultiHeadAttention):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            del self.mask  # the (context x context) buffer that step 1 removes

        def forward(self, x):
            batch, num_tokens, _ = x.shape

            def split_heads(t):  # (batch, tokens, d_out) -> (batch, heads, tokens, head_dim)
                return t.view(batch, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)

            queries, keys, values = split_heads(self.W_query(x)), split_heads(self.W_key(x)), split_heads(self.W_value(x))
            scores = queries @ keys.transpose(2, 3)
            # step 1: True above the diagonal marks the future, made for this call's length only
            future = torch.triu(torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=x.device), diagonal=1)
            scores = scores.masked_fill(future, float("-inf"))
            weights = self.dropout(torch.softmax(scores / self.head_dim**0.5, dim=-1))
            context = (weights @ values).transpose(1, 2).reshape(batch, num_tokens, -1)
            return self.out_proj(context)

    return OnTheFlyMaskAttention


def native_layer_norm(emb_dim):
    """Step 6: stands in for stage 00's LayerNorm class (same constructor call) with PyTorch's own."""
    return nn.LayerNorm(emb_dim)


def native_gelu():
    """Step 6: stands in for stage 00's GELU class with PyTorch's own (the same tanh approximation)."""
    return nn.GELU(approximate="tanh")


# ---------------------------------------------------------------------------------------------
# Composing a rung
# ---------------------------------------------------------------------------------------------

@dataclass
class Rung:
    """Everything the timing loop needs for one rung, taken from the stage modules."""

    number: int
    device: torch.device
    cfg: dict
    settings: dict
    precision: str                 # what MFU is measured against: fp32, tf32, bf16 or fp16
    model: nn.Module
    optimizer: torch.optim.Optimizer
    data_stage: ModuleType         # the stage whose dataset, DataLoader and calc_loss_batch this rung uses
    scaler: torch.amp.GradScaler   # step 5's gradient scaler: enabled where it autocasts to float16
    notes: list = field(default_factory=list)
    accumulation: int = 1          # micro-batches per optimizer step (--option grad-accum)

    @property
    def batch_size(self):
        return self.settings["batch_size"]

    def make_train_loader(self, tokens, seed):
        """The training split's loader (`tokens`: the corpus's training tokens), cut and shuffled exactly as the
        stage scripts do it."""
        context = self.cfg["context_length"]
        dataset = training_windows(self.data_stage, tokens, context)
        loader = self.data_stage.create_dataloader(dataset, self.batch_size, shuffle=True, drop_last=True, seed=seed)
        if len(loader) == 0:
            raise ValueError(f"the training split holds {len(dataset)} windows of {context + 1} tokens, "
                             f"fewer than one batch of {self.batch_size}: use a longer text (--data)")
        return loader

    def train_step(self, inputs, targets):
        """One optimizer step, the stage scripts' lines (a disabled scaler passes the loss and the step through);
        the loss returned is the mean over the step's micro-batches."""
        self.optimizer.zero_grad()
        loss = 0
        for micro_inputs, micro_targets in zip(inputs.chunk(self.accumulation), targets.chunk(self.accumulation)):
            micro_loss = self.data_stage.calc_loss_batch(micro_inputs, micro_targets, self.model,
                                                         self.device) / self.accumulation
            self.scaler.scale(micro_loss).backward()
            loss = loss + micro_loss.detach()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss


def training_windows(stage, tokens, context):
    """The training split's windows, cut by a stage's own dataset class from the training tokens of a corpus."""
    return stage.SlidingWindowDataset(tokens, context, stride=context)


class _DevicesWithoutAutocast:
    """Stage 01's `devices` for rungs 0-4: the same module, except that step 5's autocast is not taken yet."""

    def __getattr__(self, name):
        return getattr(devices, name)

    @staticmethod
    def autocast_dtype(device):
        return None


def model_config(number, tiny, stage00, stage01, model="gpt2-small", context_length=None):
    """The model config dict of rung `number` at size `model`, picked as the stages pick it (--tiny wins):
    step 9 (the padded vocabulary) comes with 01's. `context_length`, when given, replaces the stage's own (the
    ladder's and the roofline's --context-length): the model's position embedding is built for it."""
    stage = stage01 if takes_01("model config", number) else stage00
    cfg = dict(stage.TINY_CONFIG) if tiny else {**stage.GPT_CONFIG_124M, **cli.MODEL_SIZES[model]}
    if context_length is not None:
        cfg["context_length"] = context_length
    return cfg


def stage_context_length(tiny, stage00=None):
    """The context every stage trains at (its tiny config's under --tiny): what --context-length replaces."""
    stage00 = stage00 or load_stage(STAGE_00)
    return (stage00.TINY_CONFIG if tiny else stage00.GPT_CONFIG_124M)["context_length"]


def context_length_note(context_length, own):
    """The note of a row whose context --context-length changed, or None where it is the stages' own (`own`)."""
    if context_length is None or context_length == own:
        return None
    return f"context {context_length:,} set by --context-length (the stages' own: {own:,})"


def training_settings(number, tiny, stage00, stage01, batch_size=None):
    """The settings dict (batch size, learning rate...) of rung `number`: step 10 comes with 01's.
    `batch_size` replaces the stage's own, as the stages' --batch-size does."""
    stage = stage01 if takes_01("settings", number) else stage00
    settings = dict(stage.TINY_SETTINGS if tiny else stage.OTHER_SETTINGS)
    if batch_size is not None:
        settings["batch_size"] = batch_size
    return settings


def batch_size_note(batch_size, stage_batch_size):
    """The note of a row whose batch --batch-size changed, or None where it is the stage's own."""
    if batch_size is None or batch_size == stage_batch_size:
        return None
    return f"batch {batch_size} set by --batch-size (the stage's own: {stage_batch_size})"


def has_tf32(device):
    """Whether `device` has TF32 tensor cores for float32 matmuls (step 2): GPUs of compute capability 8.0 and up."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def compose(number, device, tiny, seed=123, model="gpt2-small", batch_size=None, options=(), context_length=None):
    """Build rung `number` (0 to 10): stage 00 plus optimizations 1..number, parts from 00 and 01.

    `model` is one of cli.MODEL_SIZES (ignored under `tiny`, as in the stages); `batch_size`, when given,
    replaces every rung's batch (--batch-size of bench/ladder.py); `options` are the ladder's --option names, of
    which compose acts on chunked-loss, fused-loss, grad-accum, no-dropout and nested-compile-region
    (apply_options switches on the others); `context_length`, when given, replaces every rung's context
    (--context-length)."""
    if number not in SINGLE_PROCESS_RUNGS:
        raise ValueError(f"rung {number} is not a single-process rung (0 to 10)")
    stage00, stage01 = load_stage(STAGE_00), load_stage(STAGE_01)
    cfg = model_config(number, tiny, stage00, stage01, model, context_length)
    settings = training_settings(number, tiny, stage00, stage01, batch_size)
    notes = [note for note in (context_length_note(context_length, stage_context_length(tiny, stage00)),) if note]
    if "no-dropout" in options:  # --option no-dropout: every dropout of the model at 0 (the config's one rate)
        notes.append(f"dropout {cfg['drop_rate']} -> 0")
        cfg = {**cfg, "drop_rate": 0.0}
    if number == 9:
        notes.append(f"vocab {model_config(8, tiny, stage00, stage01)['vocab_size']:,} -> {cfg['vocab_size']:,}")
    own_batch = training_settings(number, tiny, stage00, stage01)["batch_size"]
    if number == 10 and batch_size is not None:
        notes.append(f"--batch-size {batch_size} for every rung: step 10 (the larger batch) changes nothing here")
    elif number == 10:
        before = training_settings(9, tiny, stage00, stage01)["batch_size"]
        notes.append(f"batch {before} -> {settings['batch_size']}" if before != settings["batch_size"]
                     else f"batch {before}, as at rung 9 (--tiny keeps the stages' tiny batch)")
    override = batch_size_note(batch_size, own_batch)
    if override:
        notes.append(override)

    # Steps 2 and 5, decided as 01's main() decides them.
    tensor_cores = has_tf32(device)
    torch.set_float32_matmul_precision("high" if number >= 2 and tensor_cores else "highest")
    autocast_precision, reason = devices.autocast_precision(device)
    autocasts = number >= 5 and autocast_precision != "fp32"
    precision = autocast_precision if autocasts else "tf32" if number >= 2 and tensor_cores else "fp32"
    if number == 2 and not tensor_cores:
        notes.append("no effect here: TF32 needs a GPU of compute capability 8.0 or newer")
    if number == 4 and device.type != "cuda":
        notes.append("no effect here: pinning and non_blocking copies need CUDA")
    if number == 5:
        notes.append(f"{autocast_precision}: {reason}" if autocasts else f"no effect here: {reason}")
    # Step 7's backend, as 01's main() sets it: FlashAttention, cuDNN's attention off (--option cudnn-attention
    # measures it instead). Rungs 0-6 do not call SDPA.
    torch.backends.cuda.enable_cudnn_sdp("cudnn-attention" in options)

    torch.manual_seed(seed)
    with device:  # built where it trains, as every stage builds it
        model = stage_model(number, stage00, stage01).GPTModel(cfg)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings["learning_rate"],
                                  weight_decay=settings["weight_decay"],
                                  fused=devices.has_fused(device) if number >= 3 else None)  # step 3

    # Steps 4, 5 and 8 live in 01's loss path, calc_loss_batch: pinned batches and non_blocking copies (on CUDA),
    # then autocast around forward and loss, compiled. This rung's copy of 01 leaves out the
    # steps it has not reached: no autocast before step 5, the eager forward and loss before step 8.
    data_stage = stage01 if takes_01("loss path", number) else stage00
    for name, loss in (("chunked-loss", chunked_loss.forward_and_loss),
                       ("fused-loss", chunked_loss.fused_forward_and_loss)):
        if name not in options:  # --option chunked-loss, fused-loss: before training_loss is pointed at it below
            continue
        if takes_01("loss path", number):
            stage01.forward_and_loss = loss
        else:
            notes.append(f"no effect here: {name} replaces 01's forward_and_loss, and this rung's loss is 00's")
    if "nested-compile-region" in options:  # on the class of this rung's own copy of 01, before it compiles
        if number >= 8:
            mark_code(stage01, ["nested-compile-region"])
        else:
            notes.append("no effect here: nested-compile-region changes what torch.compile does, from rung 8 on")
    if number < 5:
        stage01.devices = _DevicesWithoutAutocast()
    if number < 8:
        stage01.training_loss = stage01.evaluation_loss = stage01.forward_and_loss
    scaler = torch.amp.GradScaler(device.type, enabled=autocasts and precision == "fp16")
    accumulation = ACCUMULATION_STEPS if "grad-accum" in options else 1
    if settings["batch_size"] % accumulation:
        raise ValueError(f"--option grad-accum splits each batch into {accumulation} micro-batches: batch "
                         f"{settings['batch_size']} does not divide (give --batch-size a multiple of {accumulation})")
    if accumulation > 1:
        notes.append(f"{accumulation} micro-batches of {settings['batch_size'] // accumulation} per step")
    return Rung(number=number, device=device, cfg=cfg, settings=settings, precision=precision, model=model,
                optimizer=optimizer, data_stage=data_stage, scaler=scaler, notes=notes, accumulation=accumulation)


# ---------------------------------------------------------------------------------------------
# A rung for a GPU that need not be here (cost_model/roofline.py counts one step of it on the meta device)
# ---------------------------------------------------------------------------------------------

@dataclass
class ModelledRung:
    """One rung as it would train on a described GPU: its model, optimizer and loss, built anywhere."""

    number: int
    cfg: dict
    settings: dict
    precision: str          # of its matmuls on that GPU: fp32, tf32, bf16 or fp16
    autocast_dtype: object  # step 5 on that GPU: torch.bfloat16 or torch.float16, or None (no autocast)
    compiled: bool          # step 8: forward, loss and backward would run as compiled graphs
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: object            # loss(inputs, targets): the stage's forward and loss lines, eager, without autocast

    @property
    def batch_size(self):
        return self.settings["batch_size"]


def stage_model(number, stage00, stage01):
    """The stage module whose GPTModel is rung `number`'s, its globals swapped for the steps taken so far.

    From rung 7 on (RUNG_PARTS) every model part is 01's, so 01's GPTModel itself is used; before that stage 00's
    GPTModel, which looks its MultiHeadAttention, LayerNorm and GELU up among its module globals when it is built."""
    if takes_01("model", number):
        return stage01
    if number >= 1:
        stage00.MultiHeadAttention = on_the_fly_mask_attention(stage00)
    if number >= 6:
        stage00.LayerNorm = native_layer_norm
        stage00.GELU = native_gelu
    return stage00


def compose_for_gpu(number, device, has_tf32, autocast_precision, model="gpt2-small", batch_size=None, seed=123,
                    context_length=None):
    """Rung `number` (0 to 10) as compose() builds it at full size, for a GPU described instead of present.

    `has_tf32` and `autocast_precision` ("bf16", "fp16" or "fp32") are what has_tf32(device) and
    devices.autocast_precision would answer on that GPU, so steps 2 and 5 are decided as 01's main() decides them
    there; step 3 is fused AdamW, which PyTorch has for CUDA. `device` is where the model is built (the meta device:
    shapes and dtypes, no memory). Two steps are left to the caller, because they act on a GPU's tensors only:
    `loss` runs the stage's lines eagerly and without autocast, and `autocast_dtype` and `compiled` say what
    steps 5 and 8 add to it.
    """
    if number not in SINGLE_PROCESS_RUNGS:
        raise ValueError(f"rung {number} is not a single-process rung (0 to 10)")
    stage00, stage01 = load_stage(STAGE_00), load_stage(STAGE_01)
    cfg = model_config(number, False, stage00, stage01, model, context_length)
    settings = training_settings(number, False, stage00, stage01, batch_size)
    autocasts = number >= 5 and autocast_precision != "fp32"
    precision = autocast_precision if autocasts else "tf32" if number >= 2 and has_tf32 else "fp32"
    torch.manual_seed(seed)
    with device:  # built in place: on the meta device nothing is allocated or initialized
        net = stage_model(number, stage00, stage01).GPTModel(cfg)
    net.train()
    # Step 3. Before it, fused=None: on CUDA parameters PyTorch then takes its foreach implementation, asked for
    # here by name (on the meta device its default would be the loop over tensors instead).
    optimizer = torch.optim.AdamW(net.parameters(), lr=settings["learning_rate"],
                                  weight_decay=settings["weight_decay"],
                                  fused=True if number >= 3 else None, foreach=None if number >= 3 else True)
    if takes_01("loss path", number):  # 01's calc_loss_batch, less its GPU copies (step 4), autocast (5), compile (8)
        def loss(inputs, targets):
            return stage01.forward_and_loss(net, inputs, targets)
    else:
        def loss(inputs, targets):
            return stage00.calc_loss_batch(inputs, targets, net, device)
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return ModelledRung(number=number, cfg=cfg, settings=settings, precision=precision,
                        autocast_dtype=autocast_dtype, compiled=number >= 8, model=net, optimizer=optimizer,
                        loss=loss)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

def endless_batches(loader, seed):
    """The scripts' batch order, epoch after epoch: the shuffle is reseeded with seed + epoch.

    The generator that drives the shuffle is the sampler's (the stages' RandomSampler); a loader
    shuffling with its own generator (shuffle=True) is reseeded there instead.
    """
    shuffle_generator = getattr(loader.sampler, "generator", None) or loader.generator
    for epoch in itertools.count():
        shuffle_generator.manual_seed(seed + epoch)
        yield from loader


def window_sizes(steps, windows):
    """Split `steps` into `windows` runs of nearly equal length (never an empty one)."""
    windows = max(1, min(windows, steps))
    return [steps // windows + (1 if i < steps % windows else 0) for i in range(windows)]


class WindowTimer:
    """Seconds of one timing window: CUDA events after a synchronize on GPU, perf_counter on CPU.

    The end event is waited for, so every kernel queued in the window is counted in full; gaps in
    which the GPU waits for the host (e.g. for data) lie between the events and are counted too.
    """

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            torch.cuda.synchronize()
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return self._start.elapsed_time(end) / 1000
        return time.perf_counter() - self._start


def crosses_epoch(first_step, last_step, steps_per_epoch):
    """Whether steps first_step..last_step (0-based, counted from the run's first step) hold an epoch's first
    step, after the run's very first one. The scripts restart their batch iterator there and sample text
    (off their clock), so a timing window over it is not like the others: windows avoid it where they can."""
    return any(step % steps_per_epoch == 0 for step in range(max(1, first_step), last_step + 1))


def measure(rung, loader, seed, warmup, steps, windows, say=print):
    """Warm up (untimed), then time `steps` training steps in windows; no evaluation on the clock.

    A window that would hold the first step of an epoch is run untimed instead, unless an epoch is too short
    to hold a whole window (then every window crosses one, and the result says so).
    """
    batches = endless_batches(loader, seed)
    tokens_per_step = rung.batch_size * rung.cfg["context_length"]
    steps_per_epoch = len(loader)

    started = time.perf_counter()
    for step in range(warmup):
        loss = rung.train_step(*next(batches))
        if step == 0:
            say(f"warm-up step 1 took {time.perf_counter() - started:.1f} s"
                + (" (includes compilation)" if rung.number >= 8 else ""))
    if rung.device.type == "cuda":
        torch.cuda.synchronize()
    warmup_seconds = time.perf_counter() - started
    gpu_memory.end_of_warm_up(rung.device)  # the memory peaks of the timed steps count from here
    say(f"warm-up: {warmup} steps in {warmup_seconds:.1f} s")

    timer = WindowTimer(rung.device)
    window_tok_per_sec = []
    sizes = window_sizes(steps, windows)
    avoid_boundaries = steps_per_epoch > max(sizes)
    step, skipped_steps = warmup, 0
    for index, size in enumerate(sizes):
        while avoid_boundaries and crosses_epoch(step, step + size - 1, steps_per_epoch):
            loss = rung.train_step(*next(batches))  # untimed, up to the first step of the next epoch
            step, skipped_steps = step + 1, skipped_steps + 1
        timer.start()
        for _ in range(size):
            loss = rung.train_step(*next(batches))
        seconds = timer.stop()
        step += size
        window_tok_per_sec.append(size * tokens_per_step / seconds)
        say(f"window {index + 1}/{len(sizes)}: {size} steps in {seconds:.3f} s, "
            f"{window_tok_per_sec[-1]:,.0f} tok/s")
    if skipped_steps:
        say(f"{skipped_steps} untimed steps kept the windows clear of epoch boundaries ({steps_per_epoch} steps "
            "per epoch)")

    return {
        "tokens_per_sec": statistics.median(window_tok_per_sec),
        "tokens_per_sec_min": min(window_tok_per_sec),
        "tokens_per_sec_max": max(window_tok_per_sec),
        "window_tokens_per_sec": window_tok_per_sec,
        "final_loss": loss.item(),  # the last measured step's loss, read after the clock stopped
        "warmup_seconds": warmup_seconds,
        "tokens_per_step": tokens_per_step,
        "steps_per_epoch": steps_per_epoch,
        "windows_cross_epochs": not avoid_boundaries,
    }
