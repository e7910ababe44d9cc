"""The output head and the loss in chunks of tokens, with their gradient made in the forward: no logits kept.

The largest tensor of a training step is the logits, batch x tokens x vocabulary (3 GiB in bf16 for 01 at batch
32), and the forward keeps them until the loss's backward has written their gradient (over them: cost_model/memory_model.py
counts them among the saved tensors). Once the loss is known, its gradient with respect to the logits is known too:
softmax(logits) - one_hot(target), divided by the number of tokens. So the forward can finish the head's backward
itself, a chunk of tokens at a time, and keep only what the backward needs from it: the gradient of the head's
input (tokens x width) and of its weight (vocabulary x width). A chunk's logits are gone before the next chunk's are
made.

The matmuls are the same three as before (the logits, and the two gradient matmuls), plus one dot product per token
for the loss (its own logit: a 50,304th of the head's matmul), so no FLOP to speak of is added. The same
idea is llm.c's fused classifier and Liger Kernel's fused linear cross-entropy. `--option chunked-loss` of
bench/ladder.py measures it on the composed rungs (4 to 10: the rungs whose loss is 01's forward_and_loss), and
`--option fused-loss` the same with the whole batch as one chunk (fused_forward_and_loss): no memory saved then, but
the backward no longer reads the logits again, as 01's loss does to make their gradient.
"""

import torch
import torch.nn.functional as F

CHUNK_TOKENS = 8192  # 8,192 x 50,304 logits: 0.77 GiB in bf16, a matmul as large as the GPU needs to be busy
IGNORE_INDEX = -100  # F.cross_entropy's default: rows the loss skips (01 pads a short evaluation batch with them)


def compute_dtype(tensor):
    """The dtype the head's matmuls run in: autocast's where it is on (step 5), else the tensor's own."""
    device_type = tensor.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return tensor.dtype


class LinearCrossEntropy(torch.autograd.Function):
    """cross_entropy(hidden @ weight.T, targets), mean over the targets that are not IGNORE_INDEX.

    hidden: (tokens, width), weight: (vocabulary, width), targets: (tokens,). The forward computes the gradients of
    hidden and weight as well, chunk by chunk, and saves only them; the backward scales them by the loss's gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens):
        dtype = compute_dtype(hidden)
        weight_cast = weight.to(dtype)  # once, not per chunk
        counted = (targets != IGNORE_INDEX).sum()
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        # The head's weight gradient, summed chunk by chunk with addmm: each matmul adds its chunk's part to the sum
        # so far (accumulating in float32 inside the kernel, rounding once per chunk). Written as `sum += part`,
        # Inductor fused the additions into one kernel after the last chunk and kept every part alive until then.
        grad_weight = torch.zeros_like(weight, dtype=dtype)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            hidden_chunk, target_chunk = hidden[rows].to(dtype), targets[rows]
            kept = (target_chunk != IGNORE_INDEX).unsqueeze(1)
            target_or_zero = torch.where(kept, target_chunk.unsqueeze(1), 0)
            logits = hidden_chunk @ weight_cast.t()
            # The loss in float32: log_softmax written out, so that its two per-token figures, the largest logit and
            # the log of the sum of exponentials, are at hand for the loss as well
            logits_float = logits.float()
            peak = logits_float.amax(dim=-1, keepdim=True)
            log_total = (logits_float - peak).exp().sum(dim=-1, keepdim=True).log()
            # Each token's own logit, from its hidden state and its target's row of the weight (a batch of one-row
            # matmuls, in the logits' own precision) rather than read back from the logits: the loss reads nothing of
            # a chunk's logits then, so that wherever Inductor puts the loss's kernels, no logits wait for them (on
            # an H200 a version that read them held nine chunk-sized buffers at once; the CPU's code held one)
            own_logit = (hidden_chunk.unsqueeze(1) @ weight_cast[target_or_zero].transpose(1, 2)).float().squeeze(2)
            loss_sum = loss_sum + torch.where(kept, peak + log_total - own_logit, 0.0).sum()
            # counted x d loss / d logits = softmax - one_hot(target), zero on skipped rows. The division by
            # counted waits until after the matmuls: in float16 (GPUs before Ampere) p / 32,768 would underflow.
            # (one elementwise expression: compiled, the kernels go from the bf16 logits to their bf16 gradient
            # with no float32 chunk in between, and write it over the logits' buffer)
            one_hot = torch.arange(logits.shape[1], device=logits.device) == target_or_zero
            probs = (logits_float - peak - log_total).exp()
            grad_logits = torch.where(kept, probs - one_hot.to(probs.dtype), 0.0).to(dtype)
            grad_hidden[rows] = grad_logits @ weight_cast
            grad_weight = torch.addmm(grad_weight, grad_logits.t(), hidden_chunk)
        ctx.save_for_backward(grad_hidden / counted, grad_weight.float() / counted)
        return loss_sum / counted

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_loss * grad_hidden, grad_loss * grad_weight, None, None


def forward_and_loss(model, input_batch, target_batch, chunk_tokens=CHUNK_TOKENS):
    """01's forward_and_loss with the head and the loss in chunks: the same loss, the same gradients.

    The lines before the head are 01's GPTModel.forward; only where the gradient is wanted (training) does the head
    take the chunked path, since evaluation keeps nothing for a backward anyway."""
    num_tokens = input_batch.shape[1]
    positions = torch.arange(num_tokens, device=input_batch.device)
    x = model.drop_emb(model.tok_emb(input_batch) + model.pos_emb(positions))
    hidden = model.final_norm(model.trf_blocks(x))
    if not (torch.is_grad_enabled() and model.out_head.weight.requires_grad):
        logits = model.out_head(hidden)
        return F.cross_entropy(logits.flatten(0, 1).float(), target_batch.flatten())
    return LinearCrossEntropy.apply(hidden.flatten(0, 1), model.out_head.weight, target_batch.flatten(), chunk_tokens)


def fused_forward_and_loss(model, input_batch, target_batch):
    """forward_and_loss with the whole batch as one chunk: the logits' gradient written in the pass that makes the
    loss, where 01 reads the logits again in the backward to make it."""
    return forward_and_loss(model, input_batch, target_batch, chunk_tokens=input_batch.numel())
