"""The model behind cost_model/roofline.py: one training step of a rung, counted on the meta device.

How the step is counted
- The model, optimizer and loss are the stages' own, composed as the ladder composes each rung
  (bench.rungs.compose_for_gpu), built on PyTorch's meta device: tensors with shapes, dtypes and strides but no
  memory, so a whole step of the full-size model runs in about a second on a CPU. Steps 2, 3 and 5 are decided as
  they would be on the named GPU, not on this machine.
- A TorchDispatchMode sees every aten op of the step (the backward's too). A view costs nothing; any other op
  reads its inputs and writes its outputs once, at the dtypes the rung really uses. A few ops touch less than their
  arguments: an embedding lookup reads only the rows it gathers, the negative log-likelihood only one entry per
  row, and its backward writes a fresh gradient without reading the log-probabilities.
- Classes come from where the work was created: ops run inside an nn.Linear are matmuls (their casts, bias
  gradients and copies are "other elementwise"), ops inside the attention module are attention (its projections
  are nn.Linear: matmuls), ops inside a LayerNorm or GELU module are norms and activations, everything after the
  model's forward is the loss. The backward inherits the class of the forward op that created each autograd
  node. Where the autograd engine sums two gradients of one tensor, the sum counts with the work that sent both
  (inside a hand-written GELU: an activation), as other elementwise work where they differ (the residual
  stream).
- FLOPs: matmuls as torch.utils.flop_counter counts them (2 x m x n x k); other work at one FLOP per element of
  its largest operand (a lower bound; that work is memory-bound by far, so the count does not move its floor).
  Tensor-core work runs at the peak of its dtype (TF32 for float32 matmuls from rung 2 on GPUs that have it),
  the rest at the float32 CUDA-core peak.

Precision on the meta device (step 5). CUDA's autocast casts CUDA tensors only, so it does nothing on meta
tensors. The step's forward and loss therefore run under a TorchFunctionMode that applies CUDA autocast's rules
itself, for the functions these models call: linear layers, matmuls and SDPA in bf16 (fp16 on GPUs without bf16);
softmax, log-softmax, pow, the norms and the losses in float32; everything else in the dtype of its inputs, with
PyTorch's usual type promotion. Casts are real `.to()` calls that autograd records, as autocast's are, so the
backward runs in the dtypes the GPU's would. tests/test_roofline.py checks the forward's dtypes op by op against
PyTorch's own CUDA autocast (run on fake CUDA tensors, which need no GPU for a forward pass).

Kernels the GPU picks. On the meta device PyTorch takes generic paths where CUDA has fused kernels, so the step
asks for CUDA's: dropout as native_dropout (one kernel writing the output and a boolean mask, where the generic path
makes a float mask in three ops), and SDPA (step 7) as FlashAttention. SDPA on meta would take its math path, with
the tokens x tokens matrix; on the GPU it takes FlashAttention for these shapes (bf16 or fp16, head size 64,
causal, dropout; before Ampere the memory-efficient kernel, which moves the same tensors), so the step calls that
kernel's own aten op, which has a meta implementation and a backward. Its bytes are what it must move: Q, K, V, the
output and its log-sum-exp forward; those again plus dO, with dQ, dK, dV written, backward; no tokens x tokens
matrix. The kernel re-reads K and V once per block of queries, mostly from the L2 cache: left out, an estimate.
Its FLOPs are QK^T and PV forward, those two recomputed plus three gradient matmuls backward, each halved for the
causal mask because FlashAttention skips the blocks above the diagonal (the diagonal blocks themselves make the
half an estimate, slightly low). The hand-written attention of rungs 0 to 6 is counted op by op, with every
tokens x tokens matrix it writes and reads.

Compiled rungs (step 8 on). torch.compile turns forward with loss into one graph and the backward into another;
the model here assumes Inductor fuses every op of such a graph except the matmuls and the attention kernel, and
that a run of such ops between two matmuls (or attention calls) becomes one kernel. So only these tensors move:
what the run reads that was made outside it (matmul outputs, weights, saved tensors), and what it makes that is
used outside it (by a matmul, by a later run, by the backward or the optimizer). A tensor the backward needs is
either saved or recomputed from its sources, whichever moves fewer bytes (AOTAutograd's partitioner makes that
choice); dropout masks are always saved. Matmuls, attention and the optimizer's reads and writes are counted in
full, as in eager mode. This is an estimate: Inductor may split a run into several kernels (a large reduction
such as the loss over 50,304 columns reads its input more than once) or fuse across a matmul as an epilogue.

What the floor leaves out, all of which make a measured step slower: kernel launch gaps and Python overhead between
kernels; matmuls below peak at these shapes (wave quantization, tile edges; cost_model/prediction.py gives those
step 9 pads to 16 bytes a share of their own); eager elementwise kernels below peak bandwidth; FlashAttention below
the matmul peak; the batch's copy to the GPU and the gradient scaler's small kernels (on fp16 GPUs the fused AdamW
unscales as it reads). One thing goes the other way: all traffic is counted at HBM bandwidth, and a small eager
tensor that stays in the L2 cache (40-50 MB; one layer's activations at batch 8 are 12-25 MB) costs less. So the
floor is a model, checked against published measurements (tests/test_roofline.py), not a proof.

Rungs whose ops are the same are counted once (rung 2 is rung 1 with another matmul peak, rung 8 is rung 7's ops
under the fusion model); the whole table takes about 5 s on a 2-core CPU (5.1-5.3 s, PyTorch 2.14.1, 2026-11-27).
"""


import math
import re
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the plumbing modules and bench.rungs, wherever the script is started from

import utilization  # noqa: E402
from inspection import WORK_CLASSES, WORK_LABELS  # noqa: E402

# The six classes of work, in the order of the tables and the chart: the same as a profile's (bench/step_time.py).
CLASSES = WORK_CLASSES
CLASS_LABELS = {work: WORK_LABELS[work] for work in CLASSES}
CLASS_WORDS = {"matmul": "matmul", "attention": "attention", "norm_activation": "norm and activation",
               "elementwise": "elementwise", "loss": "loss", "optimizer": "optimizer"}  # in a sentence
CLASS_COLORS = {"matmul": "#4c72b0", "attention": "#dd8452", "norm_activation": "#55a868",
                "elementwise": "#8172b3", "loss": "#c44e52", "optimizer": "#937860"}
MODELLED_RUNGS = range(0, 11)
TUTORIAL_CONTEXT_LENGTH = 1024  # the context the original tutorial measured at: its references hold there only
GRADIENT_SUM = "gradient sum"  # context of the autograd engine adding up two gradients of one tensor
COMPILED_PHASES = ("forward", "backward")  # step 8: forward with loss, and the backward, are compiled graphs

MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "_scaled_mm"}
FLASH_OPS = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"}
UNFUSIBLE = MATMUL_OPS | FLASH_OPS  # Inductor calls a library kernel for these; it fuses the rest of a graph
# No data moves: allocation, host-side scalars, aliases without an alias annotation.
FREE_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense",
            "_unsafe_view", "lift_fresh", "detach", "alias", "resize_", "record_stream", "set_"}
WRITE_ONLY = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_"}
MOVES_ONLY = {"_to_copy", "copy_", "clone", "cat", "stack", "embedding", "zeros_like", "ones_like", "zero_",
              "fill_", "full", "full_like", "zeros", "ones", "scalar_tensor", "index_select", "gather",
              "constant_pad_nd", "_foreach_copy_", "split_with_sizes_copy", "lift_fresh_copy", "tril", "triu",
              "arange"}  # copies and fills: bytes, no arithmetic
SHAPE_ONLY = {"zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like"}
# What bounds an op's floor (cost_model/prediction.py): matmuls at their peak, FlashAttention, eager or fused traffic.
BOUNDS = ("fp32 matmul", "tf32 matmul", "bf16 matmul", "fp16 matmul", "flash", "traffic", "fused traffic",
          "unaligned matmul")  # the last: tensor-core matmuls with a dimension not a multiple of 16 bytes (step 9)
RANDOM_MASKS = {"native_dropout": 1}  # output index of the random mask: saved, never recomputed, when compiled

# CUDA autocast's policy (aten/src/ATen/autocast_mode.cpp, "CUDA" lists; PyTorch's own test lists in
# torch/testing/_internal/autocast_test_lists.py) for the Python functions that reach it, by function name.
AUTOCAST_LOWER = {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm",
                  "addmv", "addr", "mv", "einsum", "chain_matmul", "scaled_dot_product_attention", "prelu",
                  "conv1d", "conv2d", "conv3d", "linalg_vecdot", "linalg_multi_dot"}
AUTOCAST_FP32 = {"acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
                 "reciprocal", "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm",
                 "rms_norm", "group_norm", "norm", "cosine_similarity", "poisson_nll_loss",
                 "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
                 "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
                 "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits",
                 "dist", "pdist", "cdist", "renorm", "logsumexp", "cross_entropy"}
AUTOCAST_FP32_DTYPE = {"softmax", "log_softmax", "cumprod", "cumsum", "prod", "sum"}  # float32 through dtype=
AUTOCAST_PROMOTE = {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
                    "index_put", "tensordot", "scatter_add", "cat", "stack"}


# ---------------------------------------------------------------------------------------------
# Counting one op: the bytes it reads and writes, its FLOPs
# ---------------------------------------------------------------------------------------------

@dataclass
class Op:
    """One aten op of the step. reads: (storage, bytes, view); writes: (storage, bytes)."""

    name: str
    flops: float
    matmul_dtype: object = None      # the dtype a tensor-core op multiplies in; None: CUDA-core work
    aligned: bool = True             # a matmul whose every dimension spans a multiple of 16 bytes (step 9)
    reads: list = field(default_factory=list)
    writes: list = field(default_factory=list)
    random: tuple = ()               # storages of random masks it wrote
    phase: str = None
    work: str = None                 # its class
    origin: str = None               # the module (forward) or autograd node (backward) it ran in

    @property
    def bytes(self):
        return sum(nbytes for _, nbytes, _ in self.reads) + sum(nbytes for _, nbytes in self.writes)


def _device_tensors(value):
    items = value if isinstance(value, (list, tuple)) else (value,)
    return [item for item in items if isinstance(item, _torch().Tensor) and item.device.type == "meta"]


def _touched_bytes(tensor):
    """Bytes of the distinct elements a tensor addresses: a broadcast (stride 0) dimension is read once."""
    return math.prod(size for size, stride in zip(tensor.shape, tensor.stride()) if stride != 0) * \
        tensor.element_size()


def _storage(tensor, keep=None):
    """A key for the memory a tensor lives in, the same for all its views. `keep` holds the storages seen, so that
    none is freed and its address reused while counting (holding the tensors instead would change what autograd
    does: it copies a gradient that something else still references, instead of taking it over)."""
    storage = tensor.untyped_storage()
    if keep is not None:
        keep.append(storage)
    return storage._cdata


def _view(tensor):
    return tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride())


def _bind(func, args, kwargs):
    """{argument name: (value, written)} for one call, by the op's schema."""
    bound = {}
    for index, argument in enumerate(func._schema.arguments):
        value = args[index] if index < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
        bound[argument.name] = (value, argument.alias_info is not None and argument.alias_info.is_write)
    return bound


def _flash_flops(bound, backward):
    """QK^T and PV (forward), plus QK^T again and the gradients dV, dP, dQ, dK (backward); causal halves them."""
    query, key = bound["query"][0], bound["key"][0]
    batch, heads, queries, head_dim = query.shape
    one_matmul = 2 * batch * heads * queries * key.shape[-2] * head_dim
    return one_matmul * (5 if backward else 2) * (0.5 if bound["is_causal"][0] else 1.0)


def count_op(func, args, kwargs, out, keep=None):
    """The Op for one aten call, or None where it moves nothing (views, allocation, host scalars). `keep`: a list
    that keeps each storage it touches alive (see _storage)."""
    namespace, name = func._schema.name.split("::")
    if namespace != "aten" or name in FREE_OPS:
        return None
    bound = _bind(func, args, kwargs)
    returns = func._schema.returns
    outs = out if isinstance(out, (tuple, list)) else (out,)
    written_args = [tensor for value, written in bound.values() if written for tensor in _device_tensors(value)]
    fresh = [tensor for index, item in enumerate(outs) if index < len(returns) and returns[index].alias_info is None
             for tensor in _device_tensors(item)]
    if not written_args and not fresh:
        return None  # a view, or an op on host tensors only
    op = Op(name=name, flops=0.0)

    # what it reads
    skip = set()
    if name in SHAPE_ONLY:
        skip.add("self")  # only its shape and dtype are used
    if name in ("nll_loss_backward", "nll_loss2d_backward"):
        skip.add("self")  # only its shape is used: the gradient is written fresh
    if name == "_fused_adamw_" or name == "_fused_adam_":
        skip.add("max_exp_avg_sqs")
    for argument, (value, written) in bound.items():
        if argument in skip or (written and name in WRITE_ONLY and argument == "self"):
            continue
        for tensor in _device_tensors(value):
            nbytes = _touched_bytes(tensor)
            if name == "embedding" and argument == "weight":
                nbytes = _touched_bytes(outs[0])  # the rows it gathers
            elif name in ("nll_loss_forward", "nll_loss2d_forward") and argument == "self":
                nbytes = tensor.numel() // tensor.shape[-1] * tensor.element_size() if tensor.dim() > 1 else nbytes
            op.reads.append((_storage(tensor, keep), nbytes, _view(tensor)))
    # what it writes
    for argument, (value, written) in bound.items():
        if written and not (name in ("_fused_adamw_", "_fused_adam_") and argument == "grads"):
            op.writes += [(_storage(tensor, keep), _touched_bytes(tensor)) for tensor in _device_tensors(value)]
    op.writes += [(_storage(tensor, keep), _touched_bytes(tensor)) for tensor in fresh]
    if name in RANDOM_MASKS:
        op.random = (_storage(outs[RANDOM_MASKS[name]], keep),)

    # its FLOPs
    if name in MATMUL_OPS:
        from torch.utils.flop_counter import flop_registry

        op.flops = float(flop_registry[func._overloadpacket](*args, **kwargs, out_val=out))
        op.matmul_dtype = fresh[0].dtype  # a matmul's output has its inputs' dtype
        op.aligned = all(size * tensor.element_size() % 16 == 0 for value, _ in bound.values()
                         for tensor in [*_device_tensors(value), *fresh] for size in tensor.shape[-2:])
    elif name in FLASH_OPS:
        op.flops = _flash_flops(bound, backward=name.endswith("_backward"))
        op.matmul_dtype = bound["query"][0].dtype
    elif name not in MOVES_ONLY:
        sizes = [sum(t.numel() for t in _device_tensors(value)) for value, _ in bound.values()]
        sizes += [tensor.numel() for tensor in fresh]
        op.flops = float(max(sizes, default=0))
    return op


def _torch():
    import torch

    return torch


# ---------------------------------------------------------------------------------------------
# Running one step under the counter
# ---------------------------------------------------------------------------------------------

def _dispatch_mode_base():
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def _function_mode_base():
    from torch.overrides import TorchFunctionMode

    return TorchFunctionMode


def module_class(module, enclosing):
    """The class of work a module's own ops belong to; `enclosing`: the classes of the modules around it."""
    kind = type(module).__name__
    if kind == "Linear":
        return "matmul"
    if "attention" in enclosing or "Attention" in kind:
        return "attention"
    if kind in ("LayerNorm", "GELU"):
        return "norm_activation"
    return "elementwise"


def refine(context, name):
    """An op's class from its context's: attention kernels are attention wherever they run; in an nn.Linear
    only the matmul is a matmul (casts of its weights, bias gradients, copies: other elementwise)."""
    if name in FLASH_OPS:
        return "attention"
    if context == "matmul" and name not in MATMUL_OPS:
        return "elementwise"
    return context


class StepCounter:
    """Records every aten op between enter and exit, with its class of work; see the module docstring."""

    def __init__(self, default_class="elementwise"):
        self.ops = []
        self.phase = "forward"
        self.default_class = default_class
        self._modules = []        # (class, first node it may class, its inputs' nodes, name) per running forward
        self._node_classes = {}   # autograd node -> class of the forward work that made it
        self._formula_done = None  # the node whose backward formula has returned: next come the gradient sums
        self._storages = []       # every storage seen: no address is reused while counting
        self._sent_by = {}        # storage of a gradient -> class of the autograd node that last passed it on
        self._handles = []
        outer = self

        class Mode(_dispatch_mode_base()):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                op = count_op(func, args, kwargs, out, outer._storages) if outer.phase is not None else None
                if op is not None:
                    op.phase = outer.phase
                    context, op.origin = outer.context()
                    if context == GRADIENT_SUM:  # the class of the work that sent the gradients, where it agrees
                        senders = {outer._sent_by.get(key) for key, _, _ in op.reads}
                        context = senders.pop() if len(senders) == 1 and None not in senders else "elementwise"
                        outer._sent_by.update((key, context) for key, _ in op.writes)  # a third gradient may come
                    op.work = refine(context, op.name)
                    outer.ops.append(op)
                return out

        self._mode = Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        return self._mode.__exit__(*exc)

    def context(self):
        """(class of work, where) for the op running now."""
        torch = _torch()
        if self.phase == "optimizer":
            return "optimizer", "optimizer.step"
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            if node is None:
                return "elementwise", "autograd engine"
            if node is self._formula_done:  # the engine summing the gradients of a tensor used twice
                return GRADIENT_SUM, f"sum of gradients after {type(node).__name__}"
            return self._node_classes.get(node, ("elementwise",))[0], type(node).__name__
        if self._modules:
            return self._modules[-1][0], self._modules[-1][3]
        return self.default_class, self.default_class

    def watch(self, model):
        """Classify the forward ops of `model`'s modules, and the autograd nodes they make."""
        for module in model.modules():
            self._handles.append(module.register_forward_pre_hook(self._enter_module))
            self._handles.append(module.register_forward_hook(self._leave_module))

    def _enter_module(self, module, inputs):
        work = module_class(module, [entry[0] for entry in self._modules])
        inputs = {tensor.grad_fn for tensor in _tensors(inputs) if tensor.grad_fn is not None}
        self._modules.append((work, len(self._node_classes), inputs, type(module).__name__))

    def _leave_module(self, module, inputs, output):
        work, first, boundary, _ = self._modules.pop()
        self.tag(output, work, first, boundary)

    def tag(self, outputs, work, first=None, boundary=()):
        """Give `work` to the autograd nodes behind `outputs` that have no class yet, back to the nodes of the
        module's inputs (`boundary`). The walk goes through nodes classed since the `first`-th (those of modules
        nested in this one) and stops at older ones and at the leaves."""
        first = len(self._node_classes) if first is None else first
        todo, seen = [tensor.grad_fn for tensor in _tensors(outputs)], set(boundary)
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if node in self._node_classes:
                if self._node_classes[node][1] < first:
                    continue  # made before this module's forward began
            else:
                self._node_classes[node] = (work, len(self._node_classes))
                if type(node).__name__ != "AccumulateGrad":
                    node.register_hook(lambda grad_inputs, grad_outputs, node=node:
                                       self._formula_returned(node, grad_inputs))
            todo.extend(next_node for next_node, _ in node.next_functions)

    def _formula_returned(self, node, gradients):
        """A node's backward has returned `gradients`; what the engine does next under it sums gradients."""
        self._formula_done = node
        for gradient in _tensors(gradients):
            if gradient.device.type == "meta":
                self._sent_by[_storage(gradient, self._storages)] = self._node_classes[node][0]


def _tensors(value):
    torch = _torch()
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in _tensors(item)]
    return []


def flash_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA as a GPU runs it for these models: FlashAttention's own aten op (meta implementation, backward)."""
    torch = _torch()
    if attn_mask is not None or enable_gqa:  # not a case of these models: SDPA's own choice
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                                                 scale=scale, enable_gqa=enable_gqa)
    return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                              scale=scale)[0]


def fused_dropout(func, args, kwargs):
    """Dropout as CUDA runs it: one kernel that writes the output and a boolean mask (native_dropout). On the meta
    device PyTorch would take its generic path instead, a float mask made by three separate ops."""
    torch = _torch()
    names = ("input", "p", "training", "inplace")
    given = {**dict(zip(names, args)), **{("training" if key == "train" else key): value
                                          for key, value in kwargs.items()}}
    tensor, p = given["input"], given.get("p", 0.5)
    if given.get("training", True) and not given.get("inplace", False) and 0 < p < 1 and tensor.numel():
        return torch.native_dropout(tensor, p, True)[0]
    return func(*args, **kwargs)


def _cast_floating(value, dtype):
    torch = _torch()
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.dtype not in (dtype, torch.float64):
            return value.to(dtype)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floating(item, dtype) for item in value)
    return value


def _widest_floating(values):
    torch = _torch()
    dtypes = [tensor.dtype for tensor in _tensors(values) if tensor.is_floating_point()]
    return torch.float32 if torch.float32 in dtypes else (dtypes[0] if dtypes else None)


def gpu_functions(autocast_dtype):
    """A TorchFunctionMode: CUDA autocast's casts for `autocast_dtype` (None: no autocast), SDPA as FlashAttention
    and dropout as its fused kernel, on the meta device as on a GPU; see the module docstring."""
    torch = _torch()

    class GpuFunctions(_function_mode_base()):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            name = getattr(func, "__name__", "")
            if autocast_dtype is not None:
                if name in AUTOCAST_LOWER:
                    args, kwargs = _cast_floating(args, autocast_dtype), {
                        key: _cast_floating(value, autocast_dtype) for key, value in kwargs.items()}
                elif name in AUTOCAST_FP32:
                    args, kwargs = _cast_floating(args, torch.float32), {
                        key: _cast_floating(value, torch.float32) for key, value in kwargs.items()}
                elif name in AUTOCAST_FP32_DTYPE:
                    first = next(iter(_tensors(args)), None)
                    given = kwargs.get("dtype") is not None or any(isinstance(arg, torch.dtype) for arg in args)
                    if first is not None and first.is_floating_point() and first.dtype != torch.float64 and not given:
                        kwargs["dtype"] = torch.float32
                elif name in AUTOCAST_PROMOTE:
                    widest = _widest_floating((args, kwargs))
                    if widest is not None:
                        args, kwargs = _cast_floating(args, widest), {
                            key: _cast_floating(value, widest) for key, value in kwargs.items()}
            if name == "scaled_dot_product_attention":
                return flash_attention(*args, **kwargs)
            if name == "dropout":
                return fused_dropout(func, args, kwargs)
            return func(*args, **kwargs)

    return GpuFunctions()


@contextmanager
def fused_adamw_on_meta():
    """The fused AdamW kernel checks that parameters are on a device it has a kernel for; its meta
    implementation (shapes only) serves here instead."""
    with mock.patch("torch.optim.adam._device_dtype_check_for_fused", lambda *args, **kwargs: None):
        yield


def count_step(rung):
    """All ops of one training step of a bench.rungs.ModelledRung built on the meta device."""
    torch = _torch()
    shape = (rung.batch_size, rung.cfg["context_length"])
    inputs = torch.zeros(shape, dtype=torch.long, device="meta")
    targets = torch.zeros(shape, dtype=torch.long, device="meta")
    counter = StepCounter(default_class="loss")  # in the forward, outside the model: the loss
    counter.watch(rung.model)
    with counter:
        counter.phase = "forward"
        with gpu_functions(rung.autocast_dtype):
            loss = rung.loss(inputs, targets)
        counter.tag(loss, "loss")
        counter.phase = "backward"
        loss.backward()
        with fused_adamw_on_meta():
            counter.phase = None  # the first step creates AdamW's state; the counted one is a later step's
            rung.optimizer.step()
            counter.phase = "optimizer"
            rung.optimizer.step()
        rung.optimizer.zero_grad()
    return counter.ops


# ---------------------------------------------------------------------------------------------
# Bytes under torch.compile's fusion
# ---------------------------------------------------------------------------------------------

def fused_bytes(ops):
    """Bytes of each op when forward and backward are compiled graphs: {op index: bytes} (see the docstring)."""
    fusible = [op.phase in COMPILED_PHASES and op.name not in UNFUSIBLE for op in ops]
    segment, current = [None] * len(ops), -1
    for index, op in enumerate(ops):
        if fusible[index]:
            if not (index and fusible[index - 1] and ops[index - 1].phase == op.phase):
                current += 1
            segment[index] = current
    producer, consumers, size, random = {}, defaultdict(list), defaultdict(int), set()
    for index, op in enumerate(ops):
        for key, nbytes, _ in op.reads:
            consumers[key].append(index)
            size[key] = max(size[key], nbytes)
        for key, nbytes in op.writes:
            producer.setdefault(key, index)
            size[key] = max(size[key], nbytes)
        random.update(op.random)

    def kept(key):
        """Whether a tensor must be in memory for a reason other than the backward pass."""
        made_by = producer.get(key)
        if made_by is None or not fusible[made_by] or key in random or not consumers[key]:
            return True
        return any(not fusible[user] or (ops[user].phase == ops[made_by].phase and segment[user] != segment[made_by])
                   for user in consumers[key])

    saved, recomputed = set(), {}
    for key in sorted(producer, key=producer.get):
        made_by = producer[key]
        if not fusible[made_by] or kept(key) or all(ops[user].phase == ops[made_by].phase for user in consumers[key]):
            continue
        sources, todo, seen = set(), [key], {key}
        while todo:
            for source, _, _ in ops[producer[todo.pop()]].reads:
                if source in seen:
                    continue
                seen.add(source)
                if kept(source) or source in saved:
                    sources.add(source)
                elif source in recomputed:
                    sources |= recomputed[source]
                else:
                    todo.append(source)
        if sum(size[source] for source in sources) < size[key]:
            recomputed[key] = sources
        else:
            saved.add(key)

    def materialized(key):
        return kept(key) or key in saved

    result = {}
    runs = defaultdict(list)
    for index, op in enumerate(ops):
        if fusible[index]:
            runs[segment[index]].append(index)
        else:
            result[index] = op.bytes
    for indices in runs.values():
        made_here = {key for index in indices for key, _ in ops[index].writes}
        seen, written = set(), set()
        for index in indices:
            op, nbytes_total = ops[index], 0
            for key, nbytes, view in op.reads:
                if key in made_here:
                    continue
                if key in recomputed and op.phase != ops[producer[key]].phase:
                    for source in recomputed[key]:
                        if (source, None) not in seen:
                            seen.add((source, None))
                            nbytes_total += size[source]
                    continue
                if (key, view) not in seen:
                    seen.add((key, view))
                    nbytes_total += nbytes
            for key, nbytes in op.writes:
                if materialized(key) and key not in written:
                    written.add(key)
                    nbytes_total += nbytes
            result[index] = nbytes_total
    return result


# ---------------------------------------------------------------------------------------------
# One rung, all rungs
# ---------------------------------------------------------------------------------------------

def same_work(rung):
    """What decides a rung's ops: its modules, config, batch, autocast, optimizer and loss lines. Two rungs that
    agree on all of it run the same ops (rung 2 differs from 1 only in the peak of its matmuls, rung 8 from 7
    only in how the same ops are fused), so their step is counted once."""
    optimizer = {key: value for key, value in rung.optimizer.defaults.items() if key in ("fused", "foreach")}
    return (str(rung.model), tuple(sorted(rung.cfg.items())), rung.batch_size, rung.autocast_dtype,
            tuple(sorted(optimizer.items())), rung.loss.__code__)


def model_rung(number, gpu, model="gpt2-small", batch_size=None, counted_steps=None, context_length=None):
    """The roofline of rung `number` on `gpu`: a dict as in roofline.json's "rungs". `counted_steps`: a dict of
    the steps counted so far (by same_work), to reuse. `context_length`: the stages' own where None."""
    torch = _torch()
    from bench import rungs

    rung = rungs.compose_for_gpu(number, torch.device("meta"), gpu.has_tf32, gpu.autocast_precision, model=model,
                                 batch_size=batch_size, context_length=context_length)
    counted_steps = {} if counted_steps is None else counted_steps
    work = same_work(rung)
    if work not in counted_steps:
        counted_steps[work] = count_step(rung)
    ops = counted_steps[work]
    op_bytes = fused_bytes(ops) if rung.compiled else {index: op.bytes for index, op in enumerate(ops)}

    def peak_of(op):
        if op.matmul_dtype is None:
            return "fp32"  # CUDA cores
        if op.matmul_dtype == torch.bfloat16:
            return "bf16"
        if op.matmul_dtype == torch.float16:
            return "fp16"
        return "tf32" if number >= 2 and gpu.has_tf32 else "fp32"

    classes = {work: {"flops": 0.0, "tensor_core_flops": 0.0, "bytes": 0.0, "compute_seconds": 0.0}
               for work in CLASSES}
    bounds, launches, fused_before = dict.fromkeys(BOUNDS, 0.0), 0, None
    for index, op in enumerate(ops):
        entry = classes[op.work]
        entry["flops"] += op.flops
        entry["bytes"] += op_bytes[index]
        compute = op.flops / gpu.peak(peak_of(op)) if op.flops else 0.0
        entry["compute_seconds"] += compute
        if op.matmul_dtype is not None:
            entry["tensor_core_flops"] += op.flops
        fused = rung.compiled and op.phase in COMPILED_PHASES and op.name not in UNFUSIBLE
        launches += not (fused and fused_before == op.phase)  # a compiled run of fused ops is one kernel
        fused_before = op.phase if fused else None
        memory = op_bytes[index] / gpu.bandwidth
        if compute < memory or op.matmul_dtype is None:
            bounds["fused traffic" if fused else "traffic"] += memory
        else:
            bounds["flash" if op.name in FLASH_OPS else f"{peak_of(op)} matmul" if op.aligned or
                   peak_of(op) == "fp32" else "unaligned matmul"] += compute
    for entry in classes.values():
        entry["memory_seconds"] = entry["bytes"] / gpu.bandwidth
        entry["floor_seconds"] = max(entry["compute_seconds"], entry["memory_seconds"])
        entry["bound"] = "compute" if entry["compute_seconds"] >= entry["memory_seconds"] else "memory"
        entry["arithmetic_intensity"] = entry["flops"] / entry["bytes"] if entry["bytes"] else None
    floor = sum(entry["floor_seconds"] for entry in classes.values())
    for entry in classes.values():
        entry["share"] = entry["floor_seconds"] / floor
    tokens = rung.batch_size * rung.cfg["context_length"]
    change = rungs.CHANGES[number] + (f" (none here: --batch-size {batch_size} for every rung)"
                                      if number == 10 and batch_size is not None else "")
    return {
        "rung": number, "change": change, "batch_size": rung.batch_size,
        "context_length": rung.cfg["context_length"], "tokens_per_step": tokens, "vocab_size": rung.cfg["vocab_size"],
        "precision": rung.precision, "compiled": rung.compiled,
        "flops": sum(entry["flops"] for entry in classes.values()),
        "tensor_core_flops": sum(entry["tensor_core_flops"] for entry in classes.values()),
        "bytes": sum(entry["bytes"] for entry in classes.values()),
        "floor_seconds": floor, "ceiling_tok_per_sec": tokens / floor, "classes": classes, "ops": len(ops),
        "parameters": sum(p.numel() for p in rung.model.parameters()), "bandwidth_gb_per_s": gpu.bandwidth_gb_per_s,
        "bound_seconds": bounds, "launches": launches,
    }


def tutorial_reference(gpu, model, batch_size, context_length=None):
    """The original tutorial's A100 tok/s per rung (bench/report.py's REFERENCE), where they compare: an A100,
    GPT-2 small, the tutorial's batch and context."""
    if (not re.search(r"A100", gpu.name, re.IGNORECASE) or model != "gpt2-small"
            or context_length not in (None, TUTORIAL_CONTEXT_LENGTH)):
        return {}
    from bench.report import REFERENCE

    return {number: REFERENCE[number][0] for number in MODELLED_RUNGS
            if number in REFERENCE and batch_size in (None, 8 if number < 10 else 32)}


def build_roofline(gpu, model="gpt2-small", batch_size=None, rung_numbers=MODELLED_RUNGS, step=lambda row: row,
                   context_length=None, counted_steps=None):
    """The whole table: {"gpu": ..., "rungs": [...]}, each rung with what its step removed from the one before;
    `step` turns a rung's row into the step the table models (cost_model/roofline.py: accumulation, cost_model/scaling.py);
    `context_length` replaces the stages' own for every rung (cost_model/roofline.py's --context-length);
    `counted_steps` (model_rung's) lets another GPU's table reuse the steps counted."""
    torch = _torch()
    started = time.perf_counter()
    reference = tutorial_reference(gpu, model, batch_size, context_length)
    rows, counted_steps = [], {} if counted_steps is None else counted_steps
    for number in rung_numbers:
        row = step(model_rung(number, gpu, model=model, batch_size=batch_size, counted_steps=counted_steps,
                              context_length=context_length))
        if number in reference:
            row["tutorial_tok_per_sec"] = reference[number]
            row["tutorial_over_ceiling"] = reference[number] / row["ceiling_tok_per_sec"]
        if rows and rows[-1]["rung"] == number - 1:
            row["removed"] = removed(rows[-1], row)
        rows.append(row)
    return {
        "gpu": gpu.name,
        "gpu_peaks": {"tflops": gpu.tflops, "bandwidth_gb_per_s": gpu.bandwidth_gb_per_s,
                      "ridge_flops_per_byte": {precision: gpu.ridge(precision)
                                               for precision in utilization.PRECISIONS if gpu.tflops[precision]}},
        "model": model, "batch_size": batch_size, "context_length": rows[0]["context_length"] if rows else None,
        "torch": torch.__version__,
        "seconds_to_build": time.perf_counter() - started, "rungs": rows,
    }


def removed(before, after):
    """What a step removed, per `before`'s tokens per step (step 10 changes the batch: compare per token)."""
    scale = before["tokens_per_step"] / after["tokens_per_step"]
    by_class = {work: {key: before["classes"][work][key] - after["classes"][work][key] * scale
                       for key in ("flops", "bytes", "floor_seconds")} for work in CLASSES}
    floor = before["floor_seconds"] - after["floor_seconds"] * scale
    return {"per_tokens": before["tokens_per_step"], "flops": before["flops"] - after["flops"] * scale,
            "bytes": before["bytes"] - after["bytes"] * scale, "floor_seconds": floor,
            "share_of_previous_floor": floor / before["floor_seconds"], "classes": by_class}
