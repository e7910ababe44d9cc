"""The command line the stages share: flags, defaults, --resume's settings, and the header's batch.

A stage builds its parser here, adds the flags of its own lesson, and resolves them (with a checkpoint's settings
for --resume); the cheap checks come first, before the corpus is read and the model built.
"""

import argparse
import difflib
import os
import sys
from pathlib import Path

import checkpoints
import failures
import inspection
from failures import UsageError


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2 instead of argparse's usage block
        if failures.reports_for_the_job():  # under torchrun every process parses the same command line: one line
            print(f"{self.prog}: error: {message}{self.closest_flags(message)} (see --help)", file=sys.stderr)
        sys.exit(failures.EXIT_USAGE)

    def closest_flags(self, message):
        """For unknown flags (a typo, or a shortened name: the stages take no abbreviations), the flags meant."""
        if not message.startswith("unrecognized arguments: "):
            return ""
        flags = [option for action in self._actions for option in action.option_strings]
        hints, torchruns = "", []
        for word in message.split(": ", 1)[1].split():
            name = word.split("=", 1)[0]
            found = [flag for flag in flags if flag.startswith(name)] or difflib.get_close_matches(name, flags, 1)
            if name in LATER_STAGES_FLAGS:
                hints += f"; {name} is a flag of {LATER_STAGES_FLAGS[name]}"
            elif name in TORCHRUN_FLAGS:
                torchruns.append(word)
            elif name.startswith("--") and found:
                hints += f"; {name}: did you mean {found[0]}?"
        if torchruns:  # 00 and 01 train in one process: several take 02
            script = self.prog if self.prog.startswith(("02", "03")) else "02_opt_multi_gpu_ddp.py"
            hints += f"; {' '.join(torchruns)}: torchrun's, before the script: torchrun {' '.join(torchruns)} {script}"
        return hints


# Flags that a stage lacks but a later one has, and torchrun's own, which go before the script's name
LATER_STAGES_FLAGS = {"--no-compile": "stages 01 to 03", "--grad-accum-steps": "stages 01 to 03",
                      "--activation-checkpointing": "stage 03"}
TORCHRUN_FLAGS = ("--nproc_per_node", "--nproc-per-node", "--nnodes", "--node_rank", "--node-rank", "--master_addr",
                  "--master-addr", "--master_port", "--master-port", "--standalone", "--rdzv_endpoint",
                  "--rdzv-endpoint", "--rdzv_backend", "--rdzv-backend")


def whole_number(minimum):
    """An argparse type: an int no smaller than `minimum`."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


_positive_int, _non_negative_int = whole_number(1), whole_number(0)


# The book's four GPT-2 sizes (--model): width, layers and heads; the rest of the config is the stage's own.
MODEL_SIZES = {
    "gpt2-small": {"emb_dim": 768, "n_layers": 12, "n_heads": 12},     # 124M in the book (163M, untied head)
    "gpt2-medium": {"emb_dim": 1024, "n_layers": 24, "n_heads": 16},   # 355M (406M)
    "gpt2-large": {"emb_dim": 1280, "n_layers": 36, "n_heads": 20},    # 774M (838M)
    "gpt2-xl": {"emb_dim": 1600, "n_layers": 48, "n_heads": 25},       # 1558M (1638M)
}


def describe_model(args, cfg):
    """The header's name of the model: "gpt2-small (12 layers, 768 wide)", or "tiny (--tiny: 2 layers, 64 wide)",
    which --model does not change."""
    name = "tiny (--tiny: " if args.tiny else f"{args.model} ("
    return f"{name}{cfg['n_layers']} layers, {cfg['emb_dim']} wide)"


def model_config(args, config, tiny_config, resume=None):
    """The model config of this run: --tiny's, or the stage's config at the size --model names. The checkpoint of
    --resume (`resume`) must hold the same config: checked here, before the corpus is read and the model built."""
    cfg = dict(tiny_config) if args.tiny else {**config, **MODEL_SIZES[args.model]}
    if resume:
        check_config(resume, args.resume, cfg)
    return cfg


# Flags that a resumed run takes from its checkpoint unless they are given again: (flag, key in the settings).
RESUMED_FLAGS = (("epochs", "num_epochs"), ("max_steps", "max_steps"), ("eval_freq", "eval_freq"),
                 ("eval_iter", "eval_iter"), ("save_every", "save_every"), ("data", "data"),
                 ("batch_size", "batch_size"), ("seed", "seed"), ("tiny", "tiny"), ("model", "model"),
                 ("grad_accum_steps", "grad_accum_steps"))  # the last: stages 01 to 03 only
# What a flag left unset means when there is no checkpoint to take it from (the rest come from the stage's dicts).
PLAIN_DEFAULTS = {"save_every": 0, "data": "shakespeare", "seed": 123, "tiny": False, "model": "gpt2-small",
                  "grad_accum_steps": 1}
# The help of 01 to 03's --grad-accum-steps (NEW (accumulation): the batch a step needs, in micro-batches that fit)
GRAD_ACCUM_HELP = ("micro-batches of --batch-size per optimizer step, each its own forward and backward pass; "
                   "the global batch is --batch-size x GRAD_ACCUM_STEPS x processes (default: 1)")


def build_parser(description, settings, tiny_settings):
    """The flags shared by the four stages; `settings` gives the stage's defaults.

    Flags a resumed run can take from its checkpoint default to None here, so that resolve_settings() can tell
    a flag given again from one left out.
    """
    parser = OneLineParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                           allow_abbrev=False)  # --max-step must be an error, not --max-steps
    script = Path(sys.argv[0]).stem
    profiled = inspection.PROFILE_WAIT + inspection.PROFILE_WARMUP  # the first step of the kept trace, from 0

    def default(key):
        return f"default: {settings[key]}; {tiny_settings[key]} with --tiny"

    parser.add_argument("--data", metavar="NAME_OR_PATH",
                        help="'shakespeare' (shipped, offline), 'middlemarch' (downloaded once and cached), the "
                             "path of a UTF-8 text file (both tokenized once into the cache) or a folder prepared "
                             "by python -m data.prepare (default: shakespeare)")
    parser.add_argument("--tiny", action="store_true", default=None,
                        help="a small model and batch for CPUs and tests: a few dozen steps take seconds")
    parser.add_argument("--epochs", type=_positive_int, help=f"epochs over the training split ({default('num_epochs')})")
    parser.add_argument("--max-steps", type=_non_negative_int,
                        help="stop after this many optimizer steps (the log counts steps from 0, so the last is "
                             f"step N-1); 0: no limit ({default('max_steps')})")
    parser.add_argument("--batch-size", type=_positive_int,
                        help=f"sequences per forward pass and process: a step's batch (with 01 to 03's "
                             f"--grad-accum-steps, each micro-batch's) ({default('batch_size')})")
    parser.add_argument("--eval-freq", type=_positive_int,
                        help=f"evaluate and log every N steps ({default('eval_freq')})")
    parser.add_argument("--eval-iter", type=_positive_int,
                        help=f"batches per loss estimate at each evaluation ({default('eval_iter')})")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "mps"), default="auto",
                        help="where to train; auto: CUDA when available, else Apple's MPS (not in 02 and 03), else "
                             "the CPU (default: auto)")
    parser.add_argument("--model", choices=tuple(MODEL_SIZES),
                        help="which of the book's GPT-2 sizes to train; --tiny replaces it with a small model "
                             "(default: gpt2-small)")
    parser.add_argument("--seed", type=int, help="random seed (default: 123)")
    parser.add_argument("--out",
                        help=f"folder for metrics.json, loss.pdf/png and model.pth (default: runs/{script}; with "
                             "--resume, the checkpoint's folder)")
    parser.add_argument("--resume", metavar="PATH",
                        help="continue the run this checkpoint (a model.pth) came from: in its folder, with its "
                             "limits and schedule (--epochs, --max-steps, --eval-freq, --eval-iter, --save-every, "
                             "--data, --batch-size, --seed, --tiny, --model, and 01 to 03's --grad-accum-steps), "
                             "unless given again; the seed and the global batch (batch x accumulation steps x "
                             "processes) must stay")
    parser.add_argument("--save-every", type=_non_negative_int, metavar="N",
                        help="also write the checkpoint every N steps; 0: only at the end and on an "
                             "interrupt (default: 0)")
    parser.add_argument("--profile", action="store_true",
                        help=f"profile training steps {profiled} to {profiled + inspection.PROFILE_ACTIVE - 1} "
                             "(counted from 0, as in the log; later, where an evaluation, a checkpoint or an epoch's "
                             "end would fall among them: 7 to 9 with --tiny) with torch.profiler, the ones before "
                             "warm up and compile: a trace under <out>/profile/ and a table of the top operators; "
                             "those steps are left out of tok/s")
    parser.add_argument("--memory-snapshot", action="store_true",
                        help=f"CUDA only: record the caching allocator's history over the first "
                             f"{inspection.SNAPSHOT_STEPS} steps into <out>/memory_snapshot.pickle (open it on "
                             "https://pytorch.org/memory_viz); those steps are left out of tok/s")
    return parser


def resolve_settings(args, settings, tiny_settings):
    """Fill the flags left unset, from the checkpoint of --resume, else from the stage's (or --tiny's) settings;
    returns the arguments and that checkpoint, opened (checkpoints.Checkpoint; None without --resume).

    The cheap checks come first, before the corpus is tokenized and the model is built: a missing or unreadable
    checkpoint, one of another stage, a --data file that cannot be read.
    """
    from data.shards import check_data_source

    resume = checkpoints.open_checkpoint(args.resume, Path(sys.argv[0]).name) if args.resume else None
    if resume:
        for flag, key in RESUMED_FLAGS:
            if flag == "model" and resume["settings"].get("tiny"):
                continue  # a --tiny run's model is its own: its "model" setting names no size it trained
            if getattr(args, flag, False) is None and key in resume["settings"]:  # False: a flag this stage lacks
                setattr(args, flag, resume["settings"][key])
                resume.flags_taken.append(flag)
        if args.out is None:
            args.out = str(Path(args.resume).parent)
            resume.flags_taken.append("out")
    if args.tiny and args.model is not None and not (resume and "model" in resume.flags_taken):
        raise UsageError(f"--resume {args.resume}: the checkpoint holds the --tiny model, and a run keeps its model: "
                         f"leave out --model {args.model}, or start a new run in another --out" if resume else
                         f"--tiny trains a small model of its own, not --model {args.model}: leave out one of them")
    for flag, value in PLAIN_DEFAULTS.items():
        if getattr(args, flag, False) is None:
            setattr(args, flag, value)
    chosen = tiny_settings if args.tiny else settings
    for flag, key in (("epochs", "num_epochs"), ("batch_size", "batch_size"),
                      ("eval_freq", "eval_freq"), ("eval_iter", "eval_iter"), ("max_steps", "max_steps")):
        if getattr(args, flag) is None:
            setattr(args, flag, chosen[key])
    if args.out is None:
        args.out = f"runs/{Path(sys.argv[0]).stem}"
    check_data_source(args.data)
    failures.resume_hint = continue_command(args)
    return args, resume


def run_settings(args, settings, tiny_settings):
    """The settings dict a checkpoint and metrics.json keep: the stage's, with this run's flags in it."""
    return {**(tiny_settings if args.tiny else settings), "num_epochs": args.epochs, "batch_size": args.batch_size,
            "eval_freq": args.eval_freq, "eval_iter": args.eval_iter, "max_steps": args.max_steps,
            "save_every": args.save_every, "seed": args.seed, "data": args.data, "tiny": args.tiny,
            "model": None if args.tiny else args.model,  # --tiny's model is none of --model's sizes
            **({"grad_accum_steps": args.grad_accum_steps} if hasattr(args, "grad_accum_steps") else {})}


def processes():
    """The processes of this job: torchrun's WORLD_SIZE, else 1."""
    return int(os.environ.get("WORLD_SIZE", 1))


def global_batch(batch_size, grad_accum_steps=1, world_size=1):
    """(sequences per optimizer step, "8 x 4 accumulation steps x 2 processes"): the micro-batch times the
    accumulation steps times the processes, and how it is split."""
    factors = [str(batch_size)] + ([f"{grad_accum_steps} accumulation steps"] if grad_accum_steps > 1 else []) + (
        [f"{world_size} processes"] if world_size > 1 else [])
    return batch_size * grad_accum_steps * world_size, " x ".join(factors)


def _optimizer_step(args):
    """global_batch() of this run: --batch-size, the accumulation steps (stages 01 to 03), the processes."""
    return global_batch(args.batch_size, getattr(args, "grad_accum_steps", 1), processes())


def describe_split(batch_size, grad_accum_steps=1, world_size=1):
    """"4 x 2 processes = 8 sequences": a global batch and how it is split ("4 sequences" where it is not)."""
    sequences, factors = global_batch(batch_size, grad_accum_steps, world_size)
    return f"{factors} = {sequences:,} sequences" if factors != str(sequences) else f"{sequences:,} sequences"


def describe_batch(args, context):
    """The header's batch: "batch 8 x 1024 tokens", or with accumulation or several processes, e.g. "batch 8 x
    4 accumulation steps x 2 processes = 64 sequences (65,536 tokens) per optimizer step"."""
    sequences, factors = _optimizer_step(args)
    if sequences == args.batch_size:
        return f"batch {args.batch_size} x {context} tokens"
    return f"batch {factors} = {sequences} sequences ({sequences * context:,} tokens) per optimizer step"


def check_splits(args, train_windows, val_windows, context):
    """Refuse (exit code 2) a corpus too short for one optimizer step (every micro-batch of every process) or for
    one validation window."""
    needed, _ = _optimizer_step(args)
    window = f"{context + 1} tokens (a window of {context} and the token after it, its last target)"
    if train_windows < needed:
        split = describe_split(args.batch_size, getattr(args, "grad_accum_steps", 1), processes())
        raise UsageError(f"the training split of '{args.data}' holds {train_windows:,} "
                         f"{'window' if train_windows == 1 else 'windows'} of {window}, fewer than one optimizer step "
                         f"of {split}: use a longer text"
                         + ("" if train_windows == 0 else " or a smaller --batch-size")  # no batch fits in none
                         + (" or fewer --grad-accum-steps" if train_windows and getattr(args, "grad_accum_steps", 1) > 1
                            else "")
                         + (" or fewer processes" if train_windows and processes() > 1 else ""))
    if val_windows == 0:
        raise UsageError(f"the validation split of '{args.data}' is shorter than one window of {window}: "
                         "use a longer text (or prepare it with a larger --val-fraction)")


def check_config(checkpoint, path, cfg):
    """Refuse a checkpoint of another model configuration (exit code 2)."""
    for key, value in cfg.items():
        if checkpoint["config"].get(key) != value:
            raise UsageError(f"--resume {path}: model {key} is {checkpoint['config'].get(key)} in the checkpoint "
                             f"but {value} here (--tiny or --model given on one side only?)")


def check_continuation(checkpoint, args, tokens_per_step):
    """Refuse (exit code 2) a checkpoint that this run's batch or seed cannot continue.

    `tokens_per_step` is this run's global batch in tokens (--batch-size x --grad-accum-steps x processes x
    context). It must be the checkpoint's, however it is split: the steps done and the position in the epoch are
    counted in steps of that batch, and the learning rate was set for it."""
    if checkpoint["tokens_per_step"] != tokens_per_step:
        accumulation = getattr(args, "grad_accum_steps", None)  # None: stage 00, which has no accumulation
        ours = describe_split(args.batch_size, accumulation or 1, processes())
        per_micro_batch = tokens_per_step // (accumulation or 1)  # --batch-size x processes x context
        fits = accumulation and checkpoint["tokens_per_step"] % per_micro_batch == 0
        raise UsageError(f"--resume {args.resume}: the checkpoint trained {checkpoint['tokens_per_step']:,} tokens "
                         f"per step{_split_of(checkpoint)}, this run {tokens_per_step:,} ({ours}): keep the global "
                         + ("batch, --batch-size x --grad-accum-steps x processes (how it is split may change)"
                            if accumulation else "batch, --batch-size")
                         + (f"; with this --batch-size and these processes: --grad-accum-steps "
                            f"{checkpoint['tokens_per_step'] // per_micro_batch}" if fits
                            else _a_split_that_fits(checkpoint["tokens_per_step"], per_micro_batch // args.batch_size,
                                                    args.batch_size, accumulation)))
    if checkpoint["settings"].get("seed") != args.seed:
        raise UsageError(f"--resume {args.resume}: the checkpoint used --seed {checkpoint['settings'].get('seed')}: "
                         "leave out --seed (--resume takes the checkpoint's) so that the batch order continues")


def _a_split_that_fits(checkpoint_tokens, tokens_per_sequence_and_process, batch_size, accumulation):
    """"; for example --batch-size 2 --grad-accum-steps 4": the largest --batch-size up to this run's that divides
    the checkpoint's sequences per process, with the accumulation that makes up the rest (stage 00, without
    accumulation: the --batch-size that does); empty where the processes cannot share the checkpoint's batch."""
    sequences, rest = divmod(checkpoint_tokens, tokens_per_sequence_and_process)
    if rest:
        return ""
    if accumulation is None:
        return f"; --batch-size {sequences}"
    fitting = max(size for size in range(1, min(batch_size, sequences) + 1) if sequences % size == 0)
    return f"; for example --batch-size {fitting} --grad-accum-steps {sequences // fitting}"


def _split_of(checkpoint):
    """" (4 x 2 accumulation steps x 2 processes = 16 sequences)": how the checkpoint's global batch was split, from
    its settings and its tokens per step; empty where they do not tell."""
    settings, context = checkpoint["settings"], checkpoint["config"].get("context_length")
    batch_size, accum_steps = settings.get("batch_size"), settings.get("grad_accum_steps", 1)
    sequences, rest = divmod(checkpoint["tokens_per_step"], context or 1)
    if not (batch_size and accum_steps and context) or rest or sequences % (batch_size * accum_steps):
        return ""
    return f" ({describe_split(batch_size, accum_steps, sequences // (batch_size * accum_steps))})"


# A resume with more processes than the checkpoint's run: what the ranks it had no random state for do (02 and 03)
NEW_DROPOUT_MASKS = "ranks the checkpoint had no random state for draw new dropout masks"


def resume_line(args, checkpoint):
    """The header line of a resumed run: where it continues and which settings came from the checkpoint."""
    flags = ", ".join(f"--{flag.replace('_', '-')}" + ("" if flag == "tiny" else f" {getattr(args, flag)}")
                      for flag in checkpoint.flags_taken if flag != "tiny" or args.tiny)
    states = checkpoint.get("rng")  # 02 and 03 keep one random state per process, 00 and 01 one
    written_by, now = len(states) if isinstance(states, list) else 1, processes()
    other_count = written_by != now and "world_size" not in checkpoint  # 03 says so in its "Resharding" line
    return (f"Resuming {args.resume} after step {checkpoint['step'] - 1:06d} (epoch {checkpoint['epoch'] + 1})"
            + (f" | from the checkpoint: {flags}" if flags else "")
            + (f" | written by {written_by} process(es), this run has {now}: the global batch is the same, so each "
               "step trains the same windows" if other_count else "")
            + (f"; {NEW_DROPOUT_MASKS}" if other_count and now > written_by else ""))


def continue_command(args):
    """The exact command that continues this run from its checkpoint, to copy and paste after an interrupt.

    Flags kept in the checkpoint (and --out, implied by the checkpoint's path) are left out: --resume brings
    them back. Under torchrun the command is torchrun's, with the processes of this launch.
    """
    import shlex

    kept = {flag for flag, _ in RESUMED_FLAGS} | {"out", "resume", "profile", "memory_snapshot"}
    given, words = [], sys.argv[1:]
    i = 0
    while i < len(words):
        word = words[i]
        name = word.split("=", 1)[0]
        takes_value = name not in ("--tiny", "--profile", "--memory-snapshot", "--no-compile",
                                   "--activation-checkpointing") and "=" not in word
        if name.startswith("--") and name[2:].replace("-", "_") not in kept:
            given += words[i:i + 2] if takes_value else [word]
        i += 2 if takes_value and name.startswith("--") else 1
    script = ["python", sys.argv[0]]
    if "LOCAL_WORLD_SIZE" in os.environ:  # started by torchrun
        nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
        script = ["torchrun", *(["--standalone"] if nodes == 1 else [f"--nnodes={nodes}", "--node_rank=<this node>",
                                                                       f"--master_addr={os.environ['MASTER_ADDR']}",
                                                                       f"--master_port={os.environ['MASTER_PORT']}"]),
                  f"--nproc_per_node={os.environ['LOCAL_WORLD_SIZE']}", sys.argv[0]]
    return shlex.join([*script, *given, "--resume", str(Path(args.out) / "model.pth")])
