"""What a compiled rung's training step keeps in GPU memory, counted by PyTorch's own partitioner, on a CPU.

torch.compile splits the training step into a forward graph and a backward graph (AOTAutograd). Every tensor the
backward needs is either saved by the forward, and so stays in memory from the moment it is made until the backward
has used it, or recomputed in the backward from what was saved. Which ones are saved is decided by the min-cut
partitioner, the same code on every device; `torch._functorch.config.activation_memory_budget` (1.0 by default)
tells it how much of that memory it may keep, and below 1.0 it recomputes the cheapest work first.

This script runs that decision for a compiled rung (8, 9 or 10; rung 10 is 01_opt_single_gpu.py as it is) at full
size, without a GPU and without memory:
- the rung is composed as the ladder composes it (bench.rungs.compose_for_gpu), on fake tensors (shapes, dtypes,
  no storage), under bf16 autocast;
- SDPA is called as FlashAttention's own aten op (cost_model.step_model.flash_attention), which is what CUDA runs at
  these shapes (on a CPU, SDPA with dropout takes its math path and would save the tokens x tokens matrix);
- torch.compile runs Dynamo, AOTAutograd and Inductor's graph passes and partitioner, up to the point where Inductor
  would generate kernels; there, the forward and backward graphs are kept instead, and the forward graph's outputs
  are read: the loss and the saved tensors, with their exact shapes and dtypes.
CUDA's autocast and CPU's pick the same dtypes for every op of these models (checked op by op in
tests/test_memory_model.py), and the dropout masks come from Inductor's own random numbers on both.

The peak it reports is a model, not a measurement: at the start of the backward the GPU holds the float32 weights,
AdamW's two moments (12 bytes per parameter; the gradients were freed by zero_grad and are rebuilt during the
backward) and everything saved. The loss's gradient with respect to the logits, as large as the logits, adds
nothing: AOTAutograd hands the saved tensors to the backward graph to reuse (`donated_buffer`, on by default), and
Inductor writes that gradient over the saved logits, which the loss's backward reads for the last time as it
writes it (tests/test_memory_model.py reads it in Inductor's generated code); with donation off, it would add the
logits' size. With the head and the loss in chunks (--chunked-loss, bench/chunked_loss.py) no logits are saved,
and the peak comes at the end of the forward instead: everything saved, plus one chunk's logits, over which
Inductor writes their gradient. The caching allocator reserves somewhat more than that (it rounds blocks and keeps
freed ones), and the backward's own gradients come on top as it goes. What the GPU reports, `Reserved memory` in a
stage's log and `peak_reserved_gb` in the ladder, is the measurement.

    python cost_model/memory_model.py                    # rung 10: 01 at batch 32
    python cost_model/memory_model.py --budget 0.8       # what the ladder's --option memory-budget sets
    python cost_model/memory_model.py --chunked-loss     # what the ladder's --option chunked-loss changes
    python cost_model/memory_model.py --rung 8 --model gpt2-medium --batch-size 4
"""

import argparse
import functools
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the plumbing modules and bench, wherever the script is started from

import torch  # noqa: E402

from bench import chunked_loss  # noqa: E402
from bench.rungs import compose_for_gpu  # noqa: E402
from cost_model.step_model import flash_attention  # noqa: E402

COMPILED_RUNGS = (8, 9, 10)
MODELS = ("gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl")
# Ops that make a view or a cast of one tensor: a saved tensor is named after the op its data came from
PASS_THROUGH = {"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "squeeze", "unsqueeze",
                "slice", "select", "alias"}
SPLITS = {"split", "split_with_sizes", "chunk", "unbind"}  # their outputs share the input's memory


# What the saved tensors of these models are, for the table: (end of the module's path, made by) -> words
KNOWN = [
    ("out_head", "mm", "the logits, for the loss's backward"),
    ("ff.layers.0", "addmm", "the MLP's hidden layer, GELU's input"),
    ("ff.layers.2", "cast of mul", "GELU's output, the second MLP matmul's input"),
    ("ff.layers.0", "cast of add", "norm2's output, the first MLP matmul's input"),
    ("att", "mm", "Q, K and V (views of the qkv matmul's output)"),
    ("att.qkv", "cast of add", "norm1's output, the qkv matmul's input"),
    ("att", "_scaled_dot_product_flash_attention[0]", "attention's output"),
    ("att", "_scaled_dot_product_flash_attention[1]", "attention's log-sum-exp per row"),
    ("norm1", "mul", "(x - mean) / std, for the norm's backward"),
    ("norm2", "mul", "(x - mean) / std, for the norm's backward"),
    ("final_norm", "mul", "(x - mean) / std, for the norm's backward"),
    ("out_head", "cast of add", "final_norm's output, the head's input"),
    ("drop_shortcut", "gt", "dropout masks, 1 byte per element"),
    ("drop_emb", "gt", "dropout mask, 1 byte per element"),
    ("tok_emb", "embedding", "the token embeddings"),
    ("pos_emb", "embedding", "the position embeddings"),
    ("att.out_proj", "addmm", "attention's projection, before dropout"),
    ("ff.layers.2", "addmm", "the MLP's output, before dropout"),
    ("norm1", "var_mean[1]", "the norm's mean per token"),
    ("norm2", "var_mean[1]", "the norm's mean per token"),
    ("norm1", "rsqrt", "the norm's 1 / std per token"),
    ("norm2", "rsqrt", "the norm's 1 / std per token"),
    ("-", "div", "a norm's 1 / std / width, per token", 3),  # LayerNorm's backward uses it
    ("-", "cast of a parameter", "a weight's bf16 copy, for the matmuls' backward"),
    ("-", "mm", "the head input's gradient, made in the forward (chunked loss)"),
    ("-", "addmm", "the head weight's gradient, made in the forward (chunked loss), in bf16", 2),
]


def describe(module, made_by, shape=()):
    """Words for a saved tensor of these models, or an empty string. An entry with a fourth item matches tensors
    of that many dimensions only."""
    return next((entry[2] for entry in KNOWN if module.endswith(entry[0]) and made_by == entry[1]
                 and (len(entry) < 4 or len(shape) == entry[3])), "")


@dataclass
class Saved:
    """One tensor the forward graph hands to the backward graph."""
    module: str       # where the model made it, the block's number replaced by *: trf_blocks.*.norm1
    made_by: str      # the aten op its data came from: addmm, native_dropout's mask (gt), flash attention[1], ...
    dtype: torch.dtype
    shape: tuple
    nbytes: int


@dataclass
class StepMemory:
    rung: int
    model: str
    batch_size: int
    context_length: int
    vocab_size: int
    budget: float
    num_params: int
    saved: list             # Saved, in the forward graph's order
    backward_matmuls: int   # mm, addmm and bmm calls in the backward graph: recomputed matmuls add to them
    logits_bytes: int       # the logits (and their gradient): tokens x vocabulary in the autocast dtype
    chunk_tokens: int = None  # the head and the loss in chunks of this many tokens (bench/chunked_loss.py)
    donated: bool = True    # torch._functorch.config.donated_buffer: the backward may write over saved tensors
    grad_accum_steps: int = 1  # micro-batches per optimizer step: from the second on, the gradients are kept

    @property
    def saved_bytes(self):
        return sum(item.nbytes for item in self.saved)

    @property
    def states_bytes(self):
        return 12 * self.num_params  # float32 weights and AdamW's two moments

    @property
    def head_bytes(self):
        """What the head and the loss hold at the peak beyond what is saved. All at once: nothing where the saved
        logits are donated to the backward (their gradient is written over them), else the logits' gradient. In
        chunks: the last chunk's logits, made at the end of the forward, when everything else is saved already;
        Inductor writes their gradient over them (it reuses the buffer of a tensor whose last reader writes one of
        the same size), and the next chunk's logits over that."""
        if not self.chunk_tokens:
            return 0 if self.donated else self.logits_bytes
        tokens = self.batch_size * self.context_length
        return self.logits_bytes * min(self.chunk_tokens, tokens) // tokens

    @property
    def kept_gradient_bytes(self):
        """With accumulation, the float32 gradients of the micro-batches before are held while the next one's
        backward starts: 4 bytes per parameter on top of the peak (without it they are made during the backward,
        while the saved tensors are freed)."""
        return 4 * self.num_params if self.grad_accum_steps > 1 else 0

    @property
    def peak_bytes(self):
        return self.states_bytes + self.saved_bytes + self.head_bytes + self.kept_gradient_bytes


def _op_name(node):
    target = node.target
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def _origin(node):
    """The op that made a saved tensor's data, looking through views and splits; a cast says what it cast."""
    while node.op == "call_function" and (_op_name(node) in PASS_THROUGH | SPLITS or _op_name(node) == "getitem"
                                          and _op_name(node.args[0]) in SPLITS):
        node = node.args[0]
    if node.op == "placeholder":
        return "a parameter"
    if node.op != "call_function":
        return node.op
    name = _op_name(node)
    if name == "getitem":
        source, index = node.args
        return f"{_op_name(source)}[{index}]"
    if name == "convert_element_type":
        return f"cast of {_origin(node.args[0])}"
    return name


def _module(node):
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "-"
    path, _ = list(stack.values())[-1]
    parts = path.split(".")[1:]  # without Dynamo's name for the argument, L['model']
    if len(parts) > 1 and parts[0] == "trf_blocks" and parts[1].isdigit():
        parts[1] = "*"  # every transformer block together
    return ".".join(parts) or "model"


def saved_tensors(forward_graph):
    """The forward graph's outputs beyond the loss that are not graph inputs (parameters, the batch)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    output = next(node for node in forward_graph.graph.nodes if node.op == "output")
    results, counted = [], set()
    for node in output.args[0][1:]:  # the first output is the loss
        value = getattr(node, "meta", {}).get("val")
        if node is None or node.op == "placeholder" or not isinstance(value, torch.Tensor):
            continue
        storage = StorageWeakRef(value.untyped_storage())  # views of one tensor (Q, K and V) count once
        nbytes = 0 if storage in counted else value.untyped_storage().nbytes()
        counted.add(storage)
        results.append(Saved(module=_module(node), made_by=_origin(node), dtype=value.dtype,
                             shape=tuple(value.shape), nbytes=nbytes))
    return results


def _count_matmuls(graph_module):
    return sum(1 for node in graph_module.graph.nodes
               if node.op == "call_function" and _op_name(node) in ("mm", "addmm", "bmm"))


def trace_step(rung=10, model="gpt2-small", batch_size=None, budget=1.0, tiny_config=None, chunk_tokens=None):
    """Compile one training step of `rung` on fake tensors and return what it saves (StepMemory).

    `tiny_config` replaces the model's config entries given (for tests: fewer layers, a shorter context);
    `chunk_tokens` takes the head and the loss in chunks of that many tokens (bench/chunked_loss.py).
    """
    from torch._functorch import config as functorch_config
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    if rung not in COMPILED_RUNGS:
        raise ValueError(f"rung {rung} is not compiled; the compiled rungs are {COMPILED_RUNGS}")
    graphs = {}

    def keep_graph(graph_module, example_inputs, **kwargs):  # where Inductor would generate the kernels
        graphs["backward" if kwargs.get("is_backward") else "forward"] = graph_module
        return make_boxed_func(graph_module.forward)

    def backend(graph_module, example_inputs):
        return compile_fx(graph_module, example_inputs, inner_compile=keep_graph)

    fake_mode = FakeTensorMode()
    with fake_mode:
        modelled = compose_for_gpu(rung, torch.device("cpu"), has_tf32=True, autocast_precision="bf16",
                                   model=model, batch_size=batch_size)
        net, cfg = modelled.model, dict(modelled.cfg)
        if tiny_config:
            cfg.update(tiny_config)
            with torch.device("cpu"):
                net = type(net)(cfg)
            net.train()
        batch = modelled.settings["batch_size"]
        inputs = torch.zeros(batch, cfg["context_length"], dtype=torch.long)
        targets = torch.zeros(batch, cfg["context_length"], dtype=torch.long)
    forward_and_loss = type(net).forward.__globals__["forward_and_loss"]  # 01's lines: the module the model came from
    if chunk_tokens:  # the ladder's --option chunked-loss
        forward_and_loss = functools.partial(chunked_loss.forward_and_loss, chunk_tokens=chunk_tokens)
    torch._dynamo.reset()
    step = torch.compile(forward_and_loss, backend=backend, fullgraph=True)
    with functorch_config.patch(activation_memory_budget=budget, enable_autograd_cache=False), fake_mode:
        with mock.patch("torch.nn.functional.scaled_dot_product_attention", flash_attention), \
                torch.autocast("cpu", dtype=modelled.autocast_dtype):
            loss = step(net, inputs, targets)
        loss.backward()  # the backward graph compiles here, under the same budget
    torch._dynamo.reset()
    return StepMemory(rung=rung, model=model, batch_size=batch, context_length=cfg["context_length"],
                      vocab_size=cfg["vocab_size"], budget=budget, num_params=sum(p.numel() for p in net.parameters()),
                      saved=saved_tensors(graphs["forward"]), backward_matmuls=_count_matmuls(graphs["backward"]),
                      logits_bytes=batch * cfg["context_length"] * cfg["vocab_size"] * modelled.autocast_dtype.itemsize,
                      chunk_tokens=chunk_tokens, donated=bool(getattr(functorch_config, "donated_buffer", False)))


def grouped(saved):
    """Rows of the table: saved tensors of the same module, op, dtype and shape together, largest total first."""
    groups = defaultdict(list)
    for item in saved:
        groups[(item.module, item.made_by, item.dtype, item.shape)].append(item)
    rows = [(module, made_by, dtype, shape, len(items), sum(item.nbytes for item in items))
            for (module, made_by, dtype, shape), items in groups.items()]
    return sorted(rows, key=lambda row: -row[5])


def _gib(nbytes):
    return f"{nbytes / 2**30:.2f} GiB"  # the unit of the stages' memory lines and of the allocator


def report(memory, smallest_row_bytes=2**20):
    dtype_names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.bool: "bool",
                   torch.int64: "int64", torch.uint64: "uint64"}
    lines = [f"Rung {memory.rung}'s compiled training step, {memory.model}, batch {memory.batch_size} x "
             f"{memory.context_length}, vocabulary {memory.vocab_size:,}, bf16 autocast, "
             f"activation_memory_budget {memory.budget:g}" + (" (PyTorch's default)" if memory.budget == 1.0 else "")
             + (f", head and loss in chunks of {memory.chunk_tokens:,} tokens" if memory.chunk_tokens else ""),
             "", "Saved by the forward for the backward (per tensor, and all of them):", ""]
    header = ("what it is", "where in the model", "made by", "dtype", "shape", "count", "total")
    groups = grouped(memory.saved)
    rows = [(describe(module, made_by, shape), module, made_by, dtype_names.get(dtype, str(dtype)), "x".join(map(str, shape)) or "scalar", str(count),
             _gib(total)) for module, made_by, dtype, shape, count, total in groups
            if total >= smallest_row_bytes]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * width for width in widths), *rows]:
        lines.append("  ".join(cell.ljust(width) if i < 5 else cell.rjust(width)
                               for i, (cell, width) in enumerate(zip(row, widths))))
    small = [row for row in groups if row[5] < smallest_row_bytes]
    if small:
        lines.append(f"(and {sum(row[4] for row in small)} small tensors, {_gib(sum(row[5] for row in small))} in all)")
    lines += ["",
              f"Saved in all: {_gib(memory.saved_bytes)} "
              f"({memory.saved_bytes / (memory.batch_size * memory.context_length):,.0f} bytes per token); "
              f"the backward graph runs {memory.backward_matmuls} matmuls",
              f"Model of the peak, at the {'last chunk of the head' if memory.chunk_tokens else 'start of the backward'}"
              f": {_gib(memory.peak_bytes)} = weights and AdamW "
              f"moments {_gib(memory.states_bytes)} (12 bytes x {memory.num_params:,} parameters) + saved "
              f"{_gib(memory.saved_bytes)} + " + (f"a chunk's logits, then their gradient {_gib(memory.head_bytes)}"
                                                 if memory.chunk_tokens else
                                                 f"the logits' gradient {_gib(memory.head_bytes)}"
                                                 + (" (written over the saved logits: donated_buffer)"
                                                    if memory.donated else ""))
              + (f" + the gradients kept between the {memory.grad_accum_steps} micro-batches "
                 f"{_gib(memory.kept_gradient_bytes)}" if memory.kept_gradient_bytes else ""),
              "(a model of the tensors alive at the peak: on a GPU, compare the allocated figure of a run's Peak "
              "memory line or the ladder's peak alloc.; reserved adds the allocator's slack to it)"]
    return "\n".join(lines)


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--rung", type=int, choices=COMPILED_RUNGS, default=10,
                        help="a compiled rung of the ladder (10: 01_opt_single_gpu.py as it is; default 10)")
    parser.add_argument("--model", choices=MODELS, default="gpt2-small", help="the model size (default gpt2-small)")
    parser.add_argument("--batch-size", type=int, default=None, metavar="N", help="sequences per step (default: the rung's)")
    parser.add_argument("--budget", type=float, default=1.0, metavar="FRACTION",
                        help="torch._functorch.config.activation_memory_budget, 0 to 1 (default 1.0, PyTorch's)")
    parser.add_argument("--chunked-loss", action="store_true",
                        help=f"the head and the loss in chunks of {chunked_loss.CHUNK_TOKENS:,} tokens, their gradient "
                             "made in the forward (bench/chunked_loss.py; the ladder's --option chunked-loss)")
    parser.add_argument("--grad-accum-steps", type=int, default=1, metavar="N",
                        help="micro-batches of --batch-size per optimizer step, as 01's flag (default 1)")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0.0 <= args.budget <= 1.0:
        parser.error(f"--budget must lie between 0 and 1, not {args.budget}")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be at least 1, not {args.batch_size}")
    chunk_tokens = chunked_loss.CHUNK_TOKENS if args.chunked_loss else None
    if args.grad_accum_steps < 1:
        parser.error(f"--grad-accum-steps must be at least 1, not {args.grad_accum_steps}")
    print(f"Tracing rung {args.rung}'s compiled step on fake tensors (10-25 s on a CPU) ...", file=sys.stderr,
          flush=True)
    memory = trace_step(args.rung, args.model, args.batch_size, args.budget, chunk_tokens=chunk_tokens)
    memory.grad_accum_steps = args.grad_accum_steps
    print(report(memory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
