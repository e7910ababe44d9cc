"""Published measurements of other GPT-2-small trainings beside this repository's roofline ceilings.

  python cost_model/published.py     # docs/roofline.md's table, in markdown, to stdout (8 s on a 2-core CPU)

Beside this repository's own ladders, these show that the roofline describes reality: every ceiling must lie above
what others measured doing the same work on the same GPU and batch (the suite checks it). Each row names the rung
doing the closest work, and what the comparison glosses over. Figures: tok/s per GPU at a sequence length of 1,024,
from the published step times (tokens per step / seconds per step / GPUs).
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BUILD_NANOGPT = ("build-nanogpt (A. Karpathy's video \"Let's reproduce GPT-2\", its chapters' step times, batch 16 x "
                 "1,024)")
LLMC_A100 = "llm.c `scripts/run_gpt2_124M.sh`: ~300 ms per 524,288-token step on 8x A100 80GB SXM"
LLMC_H100 = "modded-nanogpt `records/track_1_short/2024-10-13_llmc`: llm.c at 140 ms per 524,288-token step, 8x H100"
MODDED = "modded-nanogpt, records of late 2024: ~141.8 ms per 524,288-token step on 8x H100"
TUTORIAL = "the original tutorial (rasbt/LLMs-from-scratch, ch05/10_llm-training-speed), 1x A100, PyTorch 2.6"
TIED = "tied head (one 38.6M matrix fewer for AdamW)"

# (who, what they measured, GPU, batch per GPU, tok/s per GPU, this repository's rung of the same work or None,
#  what the comparison glosses over, source)
PUBLISHED = (
    ("build-nanogpt", "float32", "A100", 16, 16 * 1024 / 1.000, 0, TIED, BUILD_NANOGPT),
    ("build-nanogpt", "+ TF32", "A100", 16, 16 * 1024 / 0.333, 2, TIED, BUILD_NANOGPT),
    ("build-nanogpt", "+ bf16 autocast", "A100", 16, 16 * 1024 / 0.300, 5,
     TIED + "; rung 5 also has fused AdamW and pinned memory", BUILD_NANOGPT),
    ("build-nanogpt", "+ torch.compile", "A100", 16, 16 * 1024 / 0.130, None,
     "compiled around its hand-written attention: no rung does that work", BUILD_NANOGPT),
    ("build-nanogpt", "+ FlashAttention", "A100", 16, 16 * 1024 / 0.096, 8,
     TIED + "; rung 8 also has fused AdamW", BUILD_NANOGPT),
    ("build-nanogpt", "+ vocabulary 50,304", "A100", 16, 16 * 1024 / 0.093, 9, TIED, BUILD_NANOGPT),
    ("build-nanogpt", "+ fused AdamW", "A100", 16, 16 * 1024 / 0.090, 9, TIED, BUILD_NANOGPT),
    ("llm.c", "CUDA, bf16, fused classifier", "A100", 64, 524_288 / 0.300 / 8, 10,
     TIED + "; vocabulary 50,304; gradients all-reduced across 8 GPUs", LLMC_A100),
    ("llm.c", "CUDA, bf16, fused classifier", "H100", 64, 524_288 / 0.140 / 8, 10,
     TIED + "; vocabulary 50,304; gradients all-reduced across 8 GPUs", LLMC_H100),
    ("modded-nanogpt", "PyTorch, Muon", "H100", 64, 524_288 / 0.1418 / 8, 10,
     "not the same work: rotary embeddings, ReLU², QK-norm, the Muon optimizer; 8 GPUs", MODDED),
    ("original tutorial", "its 01 at batch 32", "A100", 32, 142_156, 10, "none: the same model and batch", TUTORIAL),
)


def ceilings():
    """{(gpu, batch, rung): ceiling tok/s} for the rows above, from cost_model/step_model.py's roofline."""
    from cost_model.gpus import find_gpu
    from cost_model.step_model import build_roofline

    wanted = {}
    for _, _, gpu, batch, _, rung, _, _ in PUBLISHED:
        if rung is not None:
            wanted.setdefault((gpu, batch), set()).add(rung)
    found = {}
    for (gpu, batch), rungs in wanted.items():
        table = build_roofline(find_gpu(gpu), batch_size=batch, rung_numbers=sorted(rungs))
        found.update({(gpu, batch, row["rung"]): row["ceiling_tok_per_sec"] for row in table["rungs"]})
    return found


def markdown(found):
    lines = ["| implementation | what was measured | GPU | batch | published tok/s per GPU | rung | ceiling tok/s "
             "| share of the ceiling | what the comparison glosses over |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for who, what, gpu, batch, measured, rung, differences, _ in PUBLISHED:
        ceiling = found.get((gpu, batch, rung))
        lines.append(f"| {who} | {what} | {gpu} | {batch} | {measured:,.0f} | {'—' if rung is None else rung} | "
                     f"{'—' if ceiling is None else f'{ceiling:,.0f}'} | "
                     f"{'—' if ceiling is None else f'{measured / ceiling:.0%}'} | {differences} |")
    sources = sorted({source for *_, source in PUBLISHED})
    return "\n".join(lines + ["", "Sources: " + "; ".join(sources) + "."])


BLOCK = ("<!-- published measurements: cost_model/published.py writes this table -->", "<!-- /published measurements -->")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False).parse_args()
    print(markdown(ceilings()))
