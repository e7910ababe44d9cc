"""Stage 01: stage 00 plus ten single-GPU speed optimizations, "NEW (step N)", and "NEW (accumulation)".

Without flags it trains the full 124M configuration (163M parameters); --tiny trains a small model
on a CPU in seconds; --help lists every flag. Each stage is the one before plus speed optimizations
marked "NEW": diff them, e.g. git diff --no-index 00_orig.py 01_opt_single_gpu.py
"""

import math
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, RandomSampler

import checkpoints
import cli
import devices
import failures
import gpu_memory
import progress
import timekeeping
import utilization
from data import files, get_tokenizer, load_corpus

GPT_CONFIG_124M = {
    "vocab_size": 50304,     # NEW (step 9): GPT-2's 50,257 ids padded to a multiple of 64 for faster matmuls
    "context_length": 1024,  # tokens per training window
    "emb_dim": 768,
    "n_heads": 12,
    "n_layers": 12,
    "drop_rate": 0.1,
    "qkv_bias": False,
}

OTHER_SETTINGS = {
    "learning_rate": 5e-4,
    "weight_decay": 0.1,
    "num_epochs": 5,
    "batch_size": 32,  # NEW (step 10): 4x the batch, paid for by the memory steps 5-8 saved
    "eval_freq": 20,
    "eval_iter": 5,
    "max_steps": 0,
}

REAL_VOCAB_SIZE = 50257  # NEW (step 9): the tokenizer's ids; the ids above are padding

# --tiny: a model and batch small enough for a CPU; the code path is the same as the full run.
TINY_CONFIG = {**GPT_CONFIG_124M, "context_length": 64, "emb_dim": 64, "n_heads": 4, "n_layers": 2}
TINY_SETTINGS = {**OTHER_SETTINGS, "num_epochs": 1, "batch_size": 4, "eval_freq": 5, "eval_iter": 2,
                 "max_steps": 30}


#####################################
# Chapter 2: data
#####################################

class SlidingWindowDataset(Dataset):
    """Cut the token stream into windows of `context_length`; a target is its input shifted by one."""

    def __init__(self, tokens, context_length, stride):
        self.tokens = tokens  # token ids, tokenized once (python -m data.prepare); a slice reads only its window
        self.context_length = context_length
        # a window needs context_length + 1 tokens: the inputs and the one token after them
        self.starts = range(0, len(tokens) - context_length, stride)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, index):
        start = self.starts[index]
        window = self.tokens[start:start + self.context_length + 1]
        return window[:-1], window[1:]


def create_dataloader(dataset, batch_size, shuffle, drop_last, seed=0):
    # the shuffle has its own generator, reseeded every epoch, so the batch order is reproducible
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed)) if shuffle else None
    # the loader's own generator (for worker seeds) leaves the global one, which drives dropout, alone
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, generator=torch.Generator())


#####################################
# Chapter 3: attention
#####################################

class MultiHeadAttention(nn.Module):
    """Causal self-attention: each token mixes in the values of itself and the tokens before it."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "the embedding must split evenly into heads"
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)  # NEW (step 7): one matmul for Q, K and V
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout_p = dropout  # NEW (step 7): a probability, no module: SDPA applies the dropout itself
        # NEW (step 1): no mask buffer (context_length goes unused): the causal mask is made on the fly (step 7: SDPA)

    def forward(self, x):
        batch, num_tokens, _ = x.shape

        def split_heads(t):  # (batch, tokens, d_out) -> (batch, heads, tokens, head_dim)
            return t.view(batch, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)

        queries, keys, values = map(split_heads, self.qkv(x).chunk(3, dim=-1))
        # NEW (step 7): scaled_dot_product_attention picks a fused kernel (FlashAttention from Ampere on): no scores
        context = F.scaled_dot_product_attention(queries, keys, values, is_causal=True,
                                                 dropout_p=self.dropout_p if self.training else 0.0)
        context = context.transpose(1, 2).reshape(batch, num_tokens, -1)
        return self.out_proj(context)


#####################################
# Chapter 4: the GPT model
#####################################

# NEW (step 6): the hand-written LayerNorm and GELU are gone: PyTorch's fused kernels replace them


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(cfg["emb_dim"], 4 * cfg["emb_dim"]),
            nn.GELU(approximate="tanh"),  # NEW (step 6)
            nn.Linear(4 * cfg["emb_dim"], cfg["emb_dim"]),
        )

    def forward(self, x):
        return self.layers(x)


class TransformerBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.att = MultiHeadAttention(d_in=cfg["emb_dim"], d_out=cfg["emb_dim"], context_length=cfg["context_length"],
                                      dropout=cfg["drop_rate"], num_heads=cfg["n_heads"], qkv_bias=cfg["qkv_bias"])
        self.ff = FeedForward(cfg)
        self.norm1 = nn.LayerNorm(cfg["emb_dim"])  # NEW (step 6)
        self.norm2 = nn.LayerNorm(cfg["emb_dim"])  # NEW (step 6)
        self.drop_shortcut = nn.Dropout(cfg["drop_rate"])

    def forward(self, x):
        # pre-LayerNorm residual blocks: x + f(norm(x))
        x = x + self.drop_shortcut(self.att(self.norm1(x)))
        x = x + self.drop_shortcut(self.ff(self.norm2(x)))
        return x


class GPTModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
        self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
        self.drop_emb = nn.Dropout(cfg["drop_rate"])
        self.trf_blocks = nn.Sequential(*[TransformerBlock(cfg) for _ in range(cfg["n_layers"])])
        self.final_norm = nn.LayerNorm(cfg["emb_dim"])  # NEW (step 6)
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)  # not tied to tok_emb

    def forward(self, in_idx):
        num_tokens = in_idx.shape[1]
        positions = torch.arange(num_tokens, device=in_idx.device)
        x = self.drop_emb(self.tok_emb(in_idx) + self.pos_emb(positions))
        x = self.trf_blocks(x)
        return self.out_head(self.final_norm(x))


def generate_text_simple(model, idx, max_new_tokens, context_size):
    """Greedy decoding: append the most likely next token, max_new_tokens times."""
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(idx[:, -context_size:])
        next_id = logits[:, -1, :REAL_VOCAB_SIZE].argmax(dim=-1, keepdim=True)  # NEW (step 9): no padded ids
        idx = torch.cat([idx, next_id], dim=1)
    return idx


#####################################
# Chapter 5: training
#####################################

def text_to_token_ids(text, tokenizer):
    return torch.tensor(tokenizer.encode(text, allowed_special={"<|endoftext|>"})).unsqueeze(0)


def token_ids_to_text(token_ids, tokenizer):
    return tokenizer.decode(token_ids.squeeze(0).tolist())


def calc_loss_batch(input_batch, target_batch, model, device):
    if device.type == "cuda":  # NEW (step 4): from pinned (page-locked) memory the copy below is asynchronous
        input_batch, target_batch = input_batch.pin_memory(), target_batch.pin_memory()
    # NEW (step 4): non_blocking: the host queues the copy and goes on queueing the step's kernels. Pinned by hand
    # here, evaluation batches too. No DataLoader workers in any stage: a window is a slice of memory-mapped tokens
    input_batch, target_batch = input_batch.to(device, non_blocking=True), target_batch.to(device, non_blocking=True)
    # NEW (step 5): autocast runs the matmuls in bf16 (float16 on GPUs without bf16); weights and the loss stay float32
    dtype = devices.autocast_dtype(device)  # None where no reduced precision helps (see the header's precision line)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        if model.training:  # NEW (step 8): training and evaluation are two compiled graphs, so neither recompiles
            return training_loss(model, input_batch, target_batch)
        return evaluation_loss(model, input_batch, target_batch)  # NEW (step 8)


def forward_and_loss(model, input_batch, target_batch):  # NEW (step 8): the code both compiled graphs share
    logits = model(input_batch)
    # NEW (step 5): the loss in float32; compiled (step 8), the cast stays inside the loss kernel: no float32 logits
    return F.cross_entropy(logits.flatten(0, 1).float(), target_batch.flatten())


@torch.compile  # NEW (step 8): training: forward and loss fused into one graph
def training_loss(model, input_batch, target_batch):
    return forward_and_loss(model, input_batch, target_batch)


@torch.compile  # NEW (step 8): evaluation (no dropout, no gradients) is another graph, in a function of its own
def evaluation_loss(model, input_batch, target_batch):  # so that switching modes never recompiles either
    return forward_and_loss(model, input_batch, target_batch)


def calc_loss_loader(data_loader, model, device, num_batches=None):
    """Mean loss over the first num_batches batches (all of them if None)."""
    num_batches = len(data_loader) if num_batches is None else min(num_batches, len(data_loader))
    if num_batches == 0:
        return float("nan")
    total = 0.0
    for i, (input_batch, target_batch) in enumerate(data_loader):
        if i >= num_batches:
            break
        # NEW (step 8): a short last batch would be a new shape and compile again: pad it with rows of token 0 ...
        missing_rows = data_loader.batch_size - len(input_batch)
        input_batch = F.pad(input_batch, (0, 0, 0, missing_rows))  # (0, 0): no columns; (0, missing_rows): rows below
        target_batch = F.pad(target_batch, (0, 0, 0, missing_rows), value=-100)  # ... whose targets the loss skips
        total += calc_loss_batch(input_batch, target_batch, model, device).item()
    return total / num_batches


def evaluate_model(model, train_loader, val_loader, device, eval_iter):
    model.eval()
    with torch.no_grad():
        train_loss = calc_loss_loader(train_loader, model, device, num_batches=eval_iter)
        val_loss = calc_loss_loader(val_loader, model, device, num_batches=eval_iter)
    model.train()
    return train_loss, val_loss


def generate_and_print_sample(model, tokenizer, device, start_context):
    model.eval()
    context_size = model.pos_emb.weight.shape[0]
    encoded = text_to_token_ids(start_context, tokenizer).to(device)
    token_ids = generate_text_simple(model, encoded, max_new_tokens=50, context_size=context_size)
    print(token_ids_to_text(token_ids, tokenizer).replace("\n", " "))
    model.train()


def check_finite(loss, step, *eval_losses):
    """Stop (exit code 1) once a loss is NaN or infinite; checked at log lines and saves, not every step."""
    if not all(math.isfinite(value) for value in (loss.item(), *eval_losses)):
        raise failures.TrainingError(f"the loss is not finite by step {step} (training {loss.item()}, evaluation "
                                   f"{list(eval_losses)}); the last checkpoint is kept: try a lower learning rate")


def train_model(model, optimizer, loaders, setup, save_checkpoint):
    """The training loop of the run `setup` describes (progress.RunSetup: its settings, device, tokenizer, the
    checkpoint of --resume): returns where it ends (progress.RunState), what metrics.json and the plot show.
    `save_checkpoint(run_state)` writes model.pth; `run` keeps the books (progress.py): position, clocks, log lines."""
    args, device = setup.args, setup.device
    train_loader, train_eval_loader, val_loader = loaders
    run = progress.TrainingProgress(setup, len(train_loader))
    inspector = run.inspector  # --profile, --memory-snapshot: the step's regions are labelled in the trace
    # NEW (step 5, float16 only): the scaler multiplies the loss so small gradients do not underflow to 0; with bf16 or
    # float32 it is disabled: scale(loss) returns the loss, step() calls optimizer.step(), update() does nothing
    scaler = torch.amp.GradScaler(device.type, enabled=devices.autocast_dtype(device) == torch.float16)
    if setup.resume and setup.resume.get("scaler"):
        scaler.load_state_dict(setup.resume["scaler"])  # NEW (step 5, float16 only): the loss scale goes on

    for epoch in range(run.start_epoch, args.epochs):
        model.train()
        train_loader.sampler.generator.manual_seed(args.seed + epoch)  # a new, reproducible order each epoch
        for input_batch, target_batch in run.batches(train_loader, epoch):  # resumed: the batches not yet trained
            with run.timed_step():  # one step, counted; the clock runs from batch to batch (a profiled step: off it)
                optimizer.zero_grad()
                micro_batches = zip(input_batch.chunk(args.grad_accum_steps), target_batch.chunk(args.grad_accum_steps))
                for micro_inputs, micro_targets in micro_batches:  # NEW (accumulation): N = --grad-accum-steps
                    with inspector.region("forward with loss"):  # NEW (accumulation): gradients add up: each loss / N
                        loss = calc_loss_batch(micro_inputs, micro_targets, model, device) / args.grad_accum_steps
                    with inspector.region("backward"):
                        scaler.scale(loss).backward()  # NEW (step 5, float16 only): else the same as loss.backward()
                with inspector.region("optimizer step"):
                    scaler.step(optimizer)  # NEW (step 5, float16 only): skips a step whose gradients overflowed
                    scaler.update()

            if run.log_due():  # every --eval-freq steps, and the last
                with run.off_clock("evaluation"):  # evaluation is not training: keep it off the clock
                    train_loss, val_loss = evaluate_model(model, train_eval_loader,
                                                          val_loader, device, args.eval_iter)
                    check_finite(loss, run.step, train_loss, val_loss)
                    run.log(train_loss, val_loss)  # the log line and history; the first also resets the memory peaks
            if run.save_due():  # every --save-every steps, the last, or a stop signal (which ends the run)
                with run.saving():  # off the clock too
                    check_finite(loss, run.step)
                    save_checkpoint({**run.state(), "scaler": scaler.state_dict()})  # NEW (step 5, float16 only)
            if run.done:
                break

        run.pause("sampling")  # the sample is not training either
        generate_and_print_sample(model, setup.tokenizer, device,
                                  start_context="Every effort moves you")
        if device.type == "cuda":
            print(f"Allocated memory: {torch.cuda.memory_allocated(device) / gpu_memory.GIB:.4f} GiB")
            print(f"Reserved memory: {torch.cuda.memory_reserved(device) / gpu_memory.GIB:.4f} GiB")
        if run.done:
            break
    return run.finish()


def plot_losses(log, path_stem):
    from matplotlib.figure import Figure  # straight to files, no window; imported here, so start-up does not wait
    fig = Figure(figsize=(5, 3))
    ax1 = fig.subplots()
    epochs_seen = [entry["epochs_seen"] for entry in log]
    ax1.plot(epochs_seen, [entry["train_loss"] for entry in log], label="Training loss")
    ax1.plot(epochs_seen, [entry["val_loss"] for entry in log], linestyle="-.", label="Validation loss")
    ax1.set_xlabel("Epochs")
    ax1.locator_params(axis="x", nbins=5)  # few ticks: a short run's fractions of an epoch stay legible
    ax1.set_ylabel("Loss")
    ax1.legend(loc="upper right")
    ax2 = ax1.twiny()  # a second x-axis: tokens seen
    ax2.plot([entry["tokens_seen"] for entry in log], [entry["train_loss"] for entry in log], alpha=0)
    ax2.set_xlabel("Tokens seen")
    fig.tight_layout()
    for suffix in (".pdf", ".png"):  # written atomically, like every output
        checkpoints.save_atomically(lambda tmp: fig.savefig(tmp, dpi=150, format=suffix[1:]), f"{path_stem}{suffix}")


#####################################
# Main
#####################################

def main():
    clock = timekeeping.WallClock()  # each phase's time (start-up's parts too), and a line every ~10 s of a long one
    parser = cli.build_parser(__doc__, OTHER_SETTINGS, TINY_SETTINGS)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (step 8)")  # NEW (step 8)
    parser.add_argument("--grad-accum-steps", type=cli.whole_number(1), help=cli.GRAD_ACCUM_HELP)  # NEW (accumulation)
    args, resume = cli.resolve_settings(parser.parse_args(), OTHER_SETTINGS, TINY_SETTINGS)  # --resume: its checkpoint
    out = checkpoints.claim_out_dir(args.out)  # cheap checks first: a writable folder that no live run is using
    cfg = cli.model_config(args, GPT_CONFIG_124M, TINY_CONFIG, resume)  # --model: the book's four GPT-2 sizes
    settings = cli.run_settings(args, OTHER_SETTINGS, TINY_SETTINGS)  # what the checkpoint keeps for --resume
    clock.start_up("device")
    device = devices.pick_device(args.device)
    # NEW (step 2): float32 matmuls on TF32 tensor cores (compute capability 8.0 and newer; older GPUs have none).
    # From step 5 on, autocast runs training's matmuls in bf16: TF32 is left with the sample's, outside autocast
    torch.set_float32_matmul_precision("high" if device.type == "cuda" else "highest")
    # NEW (step 7): FlashAttention, not cuDNN's attention (PyTorch 2.11's first choice on Hopper), whose kernels may
    # round dropout to a multiple of 1/16: the book's 0.1 would silently train at another rate (PyTorch 2.12 avoids it)
    torch.backends.cuda.enable_cudnn_sdp(False)
    precision, precision_reason = devices.autocast_precision(device)  # NEW (step 5): bf16, fp16 or fp32, and why

    print(f"PyTorch {torch.__version__} | device: {devices.describe_device(device)} | "
          f"precision: {precision} ({precision_reason})")

    # Data: token shards, memory-mapped; by default the last 10% of the text validates
    clock.start_up("corpus")
    corpus = load_corpus(args.data)
    clock.start_up("tokenizer")
    tokenizer = get_tokenizer()
    context = cfg["context_length"]
    train_dataset = SlidingWindowDataset(corpus.train, context, stride=context)
    val_dataset = SlidingWindowDataset(corpus.val, context, stride=context)
    cli.check_splits(args, len(train_dataset), len(val_dataset), context)  # one optimizer step, one window
    train_loader = create_dataloader(train_dataset, args.batch_size * args.grad_accum_steps,  # NEW (accumulation): one
                                     shuffle=True, drop_last=True, seed=args.seed)  # optimizer step's micro-batches
    train_eval_loader = create_dataloader(train_dataset, args.batch_size, shuffle=False, drop_last=True)
    val_loader = create_dataloader(val_dataset, args.batch_size, shuffle=False, drop_last=False)
    print(f"Data: {args.data} | train {len(train_dataset.tokens):,} tokens, {len(train_loader):,} steps/epoch | "
          f"validation {len(val_dataset.tokens):,} tokens | {cli.describe_batch(args, context)}")

    # Model and optimizer
    clock.start_up("model")
    torch.manual_seed(args.seed)
    with device:  # the weights are made where they train: no CPU initialization and copy
        model = GPTModel(cfg)
    torch.compiler.set_stance("force_eager" if args.no_compile else "default")  # NEW (step 8): --no-compile: eager
    devices.apply_fallbacks(device)  # NEW (steps 3-5, 8): on Apple's MPS, what cannot run falls back (a line each)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings["learning_rate"],
                                  weight_decay=settings["weight_decay"], fused=devices.has_fused(device))  # NEW (step 3)
    num_params = sum(p.numel() for p in model.parameters())
    setup = progress.RunSetup(args, cfg, device, tokenizer, clock, resume,  # what the run is: train_model's plan
                              tokens_per_step=train_loader.batch_size * context,
                              flops_per_token=utilization.flops_per_token(cfg, tokenizer.n_vocab),
                              peak_flops=utilization.peak_flops(device, precision))
    print(f"Model: {cli.describe_model(args, cfg)}, {num_params:,} parameters | "
          f"{setup.flops_per_token / 1e9:.2f} GFLOPs per token")
    print(gpu_memory.memory_line(num_params, cfg, args.batch_size, precision, flash_attention=True))  # NEW (step 7)
    print(utilization.mfu_line(device, precision))
    clock.start_up("until the first step")
    if device.type == "cpu" and not args.tiny:
        print(devices.cpu_speed_note(setup.flops_per_token * train_loader.batch_size * context, len(train_loader)))

    if resume:  # opened at the start; checked here against this run's batch and seed
        cli.check_continuation(resume, args, setup.tokens_per_step)
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        checkpoints.restore_rng(resume["rng"], device)  # dropout continues where it left off
        print(cli.resume_line(args, resume))

    def save_checkpoint(run_state):
        """model.pth: the plain model's weights plus everything --resume needs; written atomically."""
        checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "config": cfg,
                      "settings": settings, "script": Path(__file__).name,
                      "tokens_per_step": setup.tokens_per_step, **run_state}
        checkpoints.save_torch(checkpoint, out / "model.pth")

    start = time.time()
    try:
        state = train_model(model, optimizer, (train_loader, train_eval_loader, val_loader), setup, save_checkpoint)
    except torch.cuda.OutOfMemoryError:
        raise failures.out_of_memory(device, args.batch_size, context) from None
    print(f"Training took {(time.time() - start) / 60:.2f} minutes (evaluation, sampling and compilation included)")

    # Outputs: metrics.json, loss.pdf/png, model.pth
    clock.enter("checkpoints and outputs")
    metrics = {
        "script": Path(__file__).name, "device": devices.describe_device(device), "precision": precision,
        "torch": torch.__version__, "config": cfg, "settings": settings, "data": args.data,
        "parameters": num_params, "steps": state.steps, "tokens_seen": state.tokens_seen,
        "log": state.log, "avg_tok_per_sec": state.avg_tok_per_sec(), "profile": state.profile,
        "mfu": utilization.mfu(state.avg_tok_per_sec(), setup.flops_per_token, setup.peak_flops), "world_size": 1,
        **gpu_memory.memory_metrics(device),  # GiB: now, the steady state's peaks and the first interval's
    }
    metrics["wall_clock_s"] = clock.stop()  # since the process started: start-up, compilation, training, ...
    files.write_json(out / "metrics.json", metrics, checkpoints.save_atomically)
    plot_losses(state.log, out / "loss")
    if device.type == "cuda":  # the steady state's peaks beside the first interval's
        print(gpu_memory.peak_memory_line(metrics))
    print(checkpoints.outputs_line(out))
    print(timekeeping.wall_clock_line(metrics["wall_clock_s"]))


if __name__ == "__main__":
    sys.exit(failures.process_done(failures.run(main)))
