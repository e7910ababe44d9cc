"""The ladder's rungs as a table: what each rung adds, the stage scripts they are built from, and where each part of
a composed rung comes from. bench/rungs.py builds the rungs by it; `python -m bench.steps N` prints it. No torch
here, so that the steps page answers at once."""

STAGE_00 = "00_orig.py"
STAGE_01 = "01_opt_single_gpu.py"
STAGE_02 = "02_opt_multi_gpu_ddp.py"
STAGE_03 = "03_opt_multi_gpu_fsdp.py"

# The step each rung adds, in the README's order and with its numbers.
CHANGES = {
    0: "baseline: 00_orig.py as it is",
    1: "causal mask made on the fly",
    2: "TF32 tensor cores",
    3: "fused AdamW",
    4: "pinned memory, non-blocking copies",
    5: "autocast: bf16 (fp16 + GradScaler before Ampere)",
    6: "nn.LayerNorm and nn.GELU",
    7: "scaled_dot_product_attention, fused QKV",
    8: "torch.compile",
    9: "vocabulary padded to 50,304",
    10: "larger batch: 01_opt_single_gpu.py as it is",
    11: "DDP on every GPU: 02_opt_multi_gpu_ddp.py",
    12: "FSDP2 on every GPU: 03_opt_multi_gpu_fsdp.py",
}
# What a rung is built of, and where each part comes from: 01's from the rung named "from_01" on, 00's before it
# (None: neither stage's, the lines are bench/rungs.py's own). "steps" are the steps whose lines lie in the part. A
# step before its part's first rung from 01 is put into 00's part here (steps 1 and 6 into 00's model); a step after
# it is left out of 01's part until the step's rung (autocast and torch.compile, out of 01's loss path). compose()
# and compose_for_gpu() pick each part's stage by this table, and `python -m bench.steps N` prints it for rung N.
RUNG_PARTS = {
    "model config": {"from_01": 9, "steps": (9,), "names": "GPT_CONFIG_124M, or TINY_CONFIG with --tiny"},
    "settings": {"from_01": 10, "steps": (10,), "names": "OTHER_SETTINGS, or TINY_SETTINGS with --tiny"},
    "model": {"from_01": 7, "steps": (1, 6, 7), "names": "GPTModel and the modules it is built of"},
    "loss path": {"from_01": 4, "steps": (4, 5, 8),
                  "names": "SlidingWindowDataset, create_dataloader, calc_loss_batch and what it calls"},
    "set-up": {"from_01": None, "steps": (2, 3),
               "names": "the float32 matmul precision and the AdamW optimizer, made as 01's main() makes them"},
    "training step": {"from_01": None, "steps": (),
                      "names": "Rung.train_step (the stages' backward and optimizer lines, with step 5's gradient "
                               "scaler) and the clock of measure()"},
}


def takes_01(part, number):
    """Whether rung `number` takes `part` (a key of RUNG_PARTS) from 01 rather than from 00."""
    first = RUNG_PARTS[part]["from_01"]
    return first is not None and number >= first


MULTI_PROCESS_RUNGS = {11: STAGE_02, 12: STAGE_03}  # run as they are, under torchrun
