"""Roofline of one training step, rung by rung: the least time a given GPU needs for the work each rung does.

  python cost_model/roofline.py --gpu A100 --out runs/roofline/a100     # A100 alone is the SXM 80 GB part
  python cost_model/roofline.py --gpu H100 --out runs/roofline/h100     # also "H200", "A100 PCIe", "L40S"...
  python cost_model/roofline.py --gpu H100 --model gpt2-medium --batch-size 16 --out runs/roofline/h100-medium
  python cost_model/roofline.py --gpu H100 --batch-size 8 --grad-accum-steps 4    # each step as 4 micro-batches of 8
  python cost_model/roofline.py --gpu H100 --context-length 2048 --out /tmp/r    # windows of 2,048 tokens
  python cost_model/roofline.py --gpu "RTX 4090" --predict   # and each rung's predicted tok/s (cost_model/prediction.py)

For each single-GPU rung of the ladder (0 to 10, at full size and at each rung's own batch, precision and
kernels, at the stages' context of 1,024 tokens or --context-length's) it counts what one training step does, forward, loss, backward and AdamW, in FLOPs and in bytes read
and written, and sorts that work into six classes: matmuls; attention; norms and activations; other elementwise
work (dropout, residual adds, casts, embedding lookups, gradient sums); the loss; the optimizer. Each class gets
a floor time on the GPU, max(FLOPs / peak FLOP/s, bytes / memory bandwidth); the step's floor is their sum, and
tokens per step over that floor is the rung's ceiling in tok/s. The peaks are utilization.PEAK_TFLOPS's (the dense
figure of the precision each op runs in), the bandwidth gpus.BANDWIDTH_GB_PER_S's. Written to --out: roofline.md (the
tables), roofline.png (the chart) and roofline.json; --predict adds each rung's predicted tok/s (cost_model/prediction.py).

How the step is counted, and what the model assumes and leaves out, is told in cost_model/step_model.py.

Exit code 0 when the files are written; 2 with one line for a wrong command line, a GPU not in the table or an
--out that cannot be written; 1 when a file cannot be written after all (a full disk).
"""

import argparse
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the plumbing modules and bench.rungs, wherever the script is started from

import checkpoints  # noqa: E402  (needs the path above)
import cli  # noqa: E402
import failures
from data import files  # noqa: E402
from cost_model.scaling import accumulated  # noqa: E402
from cost_model.gpus import find_gpu  # noqa: E402
from cost_model.step_model import CLASS_COLORS, CLASS_LABELS, CLASS_WORDS, CLASSES, build_roofline  # noqa: E402
from cost_model import prediction  # noqa: E402
# ---------------------------------------------------------------------------------------------
# roofline.md, roofline.png
# ---------------------------------------------------------------------------------------------

def _g(value, unit=1e9):
    return f"{value / unit:,.1f}"


def _ms(seconds):
    return f"{seconds * 1e3:,.2f}"


def step_sentence(before, after):
    """One line on what step `after['rung']` removed, in words, from the class where its floor moved most."""
    gone, number = after["removed"], after["rung"]
    share = f"{100 * gone['share_of_previous_floor']:.0f}% of rung {before['rung']}'s floor"
    if abs(gone["floor_seconds"]) < 1e-3 * before["floor_seconds"]:
        if gone["flops"] < 0:
            return (f"Step {number} adds {_g(-gone['flops'])} GFLOP (the padded columns) and removes nothing the floor "
                    "counts: what it buys, matmul tiles that fit, is efficiency a floor does not model.")
        return (f"Step {number} changes almost nothing the GPU computes or moves ({_ms(gone['floor_seconds'])} ms); "
                "what it changes lies outside the floor (host work, memory kept between steps).")
    work = max(CLASSES, key=lambda name: gone["classes"][name]["floor_seconds"])
    part = gone["classes"][work]
    per = "per step" if before["tokens_per_step"] == after["tokens_per_step"] else \
        f"per {before['tokens_per_step']:,} tokens"
    if part["bytes"] > 0.05 * before["classes"][work]["bytes"] and before["classes"][work]["bound"] == "memory":
        return (f"Step {number} removes {_g(part['bytes'])} GB of {CLASS_WORDS[work]} traffic {per}: "
                f"{_ms(gone['floor_seconds'])} ms in all, {share}.")
    if after["precision"] != before["precision"]:
        return (f"Step {number} runs the {CLASS_WORDS[work]} work at the {after['precision']} peak instead of the "
                f"{before['precision']} one: {_ms(part['floor_seconds'])} ms less there, "
                f"{_ms(gone['floor_seconds'])} ms in all, {share}.")
    return (f"Step {number} removes {_ms(part['floor_seconds'])} ms of {CLASS_WORDS[work]} work {per} "
            f"({_g(part['bytes'])} GB, {_g(part['flops'])} GFLOP): {_ms(gone['floor_seconds'])} ms in all, {share}.")


def render_markdown(table):
    gpu, rows = table["gpu_peaks"], table["rungs"]
    peaks = ", ".join(f"{precision} {tflops:g}" for precision, tflops in gpu["tflops"].items() if tflops)
    ridges = ", ".join(f"{precision} {ridge:,.0f}" for precision, ridge in gpu["ridge_flops_per_byte"].items())
    batch = f"batch {table['batch_size']} for every rung" if table["batch_size"] else "each rung's own batch"
    lines = [
        f"# Roofline of one training step: {table['gpu']}",
        "",
        f"{table['model']}, context {rows[0]['context_length']:,}, {batch}; counted by `cost_model/roofline.py` on the "
        f"meta device with PyTorch {table['torch']} (a model of the GPU, not a measurement).",
        "",
        f"GPU: dense peak TFLOP/s {peaks}; memory bandwidth {gpu['bandwidth_gb_per_s']:,g} GB/s "
        "(utilization.PEAK_TFLOPS, cost_model/gpus.py's BANDWIDTH_GB_PER_S: NVIDIA's data sheets). Ridge point, the FLOPs per byte above which work is "
        f"compute-bound: {ridges}.",
        "",
        "Each class of work gets a floor time, max(FLOPs / peak, bytes / bandwidth); a step's floor is their sum; "
        "the ceiling is tokens per step over that floor. What the model leaves out (launch gaps, Python overhead, "
        "matmuls and eager kernels below peak) makes a measured step slower: a rung reaches its ceiling only in "
        "the limit.",
        "",
        "## Ceilings",
        "",
    ]
    has_reference = any("tutorial_tok_per_sec" in row for row in rows)
    header = "| rung | change | batch | precision | GFLOP/step | GB/step | floor ms | ceiling tok/s | largest class |"
    rule = "| ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"
    if has_reference:
        header += " original tutorial, A100 tok/s | tutorial / ceiling |"
        rule += " ---: | ---: |"
    lines += [header, rule]
    for row in rows:
        largest = max(CLASSES, key=lambda work: row["classes"][work]["floor_seconds"])
        line = (f"| {row['rung']} | {row['change']} | {row['batch_size']} | {row['precision']}"
                f"{', compiled' if row['compiled'] else ''} | {_g(row['flops'])} | {_g(row['bytes'])} | "
                f"{_ms(row['floor_seconds'])} | {row['ceiling_tok_per_sec']:,.0f} | {CLASS_LABELS[largest]} "
                f"({100 * row['classes'][largest]['share']:.0f}%) |")
        if has_reference:
            line += (f" {row['tutorial_tok_per_sec']:,} | {100 * row['tutorial_over_ceiling']:.0f}% |"
                     if "tutorial_tok_per_sec" in row else " | |")
        lines.append(line)
    if has_reference:
        lines += ["", "The original tutorial's figures (one A100, PyTorch 2.6, its own code and corpus; rungs 0-7 its "
                  "average tok/s, rungs 8-10 its step tok/s at the end of epoch 1; from step 5 on it kept its weights "
                  "in bf16) are its measurements, not this repository's. Each must lie below the ceiling."]
    lines += predicted_section(table)
    lines += ["", "## What each step removed", "",
              "Against the rung before, per step of that rung's size"
              + (" (every rung at one batch here, so step 10 changes nothing)" if table["batch_size"] else
                 " (step 10 changes the batch, so it is compared per token: its step of 4x the tokens counts as four "
                 "of the smaller)") + ". A negative figure is work a step adds.", "",
              "| step | change | GFLOP removed | GB removed | floor ms removed | of the previous floor |",
              "| ---: | --- | ---: | ---: | ---: | ---: |"]
    steps = [row for row in rows if "removed" in row]
    for row in steps:
        gone = row["removed"]
        lines.append(f"| {row['rung']} | {row['change']} | {_g(gone['flops'])} | {_g(gone['bytes'])} | "
                     f"{_ms(gone['floor_seconds'])} | {100 * gone['share_of_previous_floor']:.1f}% |")
    lines += [""] + [f"- {step_sentence(before, row)}" for before, row in zip(rows, rows[1:]) if "removed" in row]
    lines += ["", "## Each rung, class by class", ""]
    for row in rows:
        lines += [f"### Rung {row['rung']}: {row['change']}", "",
                  f"Batch {row['batch_size']} x {row['context_length']:,} tokens, vocabulary {row['vocab_size']:,}, "
                  f"{row['precision']}{', compiled (fusion model)' if row['compiled'] else ', eager'}: floor "
                  f"{_ms(row['floor_seconds'])} ms, ceiling {row['ceiling_tok_per_sec']:,.0f} tok/s.", "",
                  "| class | GFLOP | GB | FLOP/byte | bound | floor ms | share |",
                  "| --- | ---: | ---: | ---: | --- | ---: | ---: |"]
        for work in CLASSES:
            entry = row["classes"][work]
            intensity = f"{entry['arithmetic_intensity']:,.1f}" if entry["arithmetic_intensity"] else "-"
            lines.append(f"| {CLASS_LABELS[work]} | {_g(entry['flops'])} | {_g(entry['bytes'])} | {intensity} | "
                         f"{entry['bound']} | {_ms(entry['floor_seconds'])} | {100 * entry['share']:.1f}% |")
        lines.append("")
    lines += ["## How it is counted", "",
              "See the docstring of `cost_model/step_model.py`: the model and loss are the stages' own, built on the meta "
              "device; a dispatch mode counts every aten op of forward, loss, backward and AdamW; autocast's CUDA "
              "rules are applied there by the script; from step 7 attention is FlashAttention's kernel (an "
              "estimate: its re-reads of K and V from L2 are left out, causal halving is approximate); from step 8 "
              "a fusion model stands in for Inductor (an estimate). The floor leaves out kernel launch gaps, Python "
              "overhead, matmuls below peak at these shapes and eager kernels below peak bandwidth, which all make a "
              "measured step slower; it counts all traffic at HBM bandwidth, though a small tensor that stays in the "
              "L2 cache between two eager kernels costs less.", ""]
    return "\n".join(lines)


def prediction_words(table):
    """How the predictions were made, in a few sentences."""
    fitted = table["prediction"]
    return (f"each kind of work's floor over its share of the data sheet, plus {1e6 * fitted['gap_seconds']:.1f} us "
            "per kernel launched: " + ", ".join(f"{name} {100 * share:.0f}% {prediction.SHARES[name]}" for name, share
                                               in fitted["shares"].items()) + f"; fitted on {table['fitted_on'][0]} "
            f"({fitted['how']}). Rung 10 on the fitted GPU, ms per step, fitted / profiled: " + "; ".join(
                f"{work} {1e3 * mine:.2f} / {1e3 * profiled:.2f}" for work, (mine, profiled) in
                fitted["profile_check"].items()) + " (memory: the four memory-bound classes).")


def predicted_section(table):
    """roofline.md's predictions, beside what was measured on this GPU where a ladder (or the tutorial) did."""
    if "prediction" not in table:
        return []
    measured, (found, median, worst) = prediction.measured_beside(table), prediction.errors(table)
    ladder = any(where.startswith("bench/results") for _, where in measured.values())
    lines = ["", "## Predicted tok/s", "", f"A prediction, not a measurement: {prediction_words(table)} Rungs 11 and "
             "12 on one GPU do rung 10's step under 02's and 03's code.", "",
             "| rung | change | ceiling tok/s | predicted tok/s | measured tok/s | predicted / measured - 1 |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for row in table["rungs"] + table["predicted_one_gpu_rungs"]:
        value, ceiling = measured.get(row["rung"], (None,))[0], row.get("ceiling_tok_per_sec")
        lines.append(f"| {row['rung']} | {row['change']} | {'—' if ceiling is None else f'{ceiling:,.0f}'} | "
                     f"{row['predicted_tok_per_sec']:,.0f} | " + (f"{value:,.0f} | {100 * found[row['rung']]:+.1f}% |"
                                                                  if value else f"{'not measured yet' * ladder} | |"))
    fitted_here = any(where.split(" (")[0] + ":" in table["fitted_on"][0] for _, where in measured.values())
    return lines + ["", f"Measured: {'; '.join(sorted({where for _, where in measured.values()}))}. Error per rung, "
                    f"median {100 * median:.1f}%, worst {100 * worst:.1f}%: " + (
                        "the fit's residuals, on the rungs it was fitted on." if fitted_here else
                        "rungs the fit never saw.")] if found else lines


def render_chart(table, path):
    """Two panels: where each rung's floor goes (shares by class, the floor per 1,000 tokens on top), and each
    rung's ceiling in tok/s, with the original tutorial's measurements beside them on an A100."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    rows = table["rungs"]
    labels = [str(row["rung"]) for row in rows]
    fig, (shares, speeds) = plt.subplots(2, 1, figsize=(12, 8.5), sharex=True)
    bottoms = [0.0] * len(rows)
    for work in CLASSES:
        heights = [row["classes"][work]["share"] for row in rows]
        shares.bar(labels, heights, bottom=bottoms, color=CLASS_COLORS[work], label=CLASS_LABELS[work])
        bottoms = [base + height for base, height in zip(bottoms, heights)]
    for label, row in zip(labels, rows):
        shares.annotate(f"{1e6 * row['floor_seconds'] / row['tokens_per_step']:.1f}", (label, 1.0),
                        ha="center", va="bottom", fontsize=8)
    shares.set_ylim(0, 1.08)
    shares.yaxis.set_major_formatter(PercentFormatter(1.0))
    shares.set_ylabel("share of the step's floor")
    shares.set_title(f"Where the floor of one training step goes ({table['gpu']}, {table['model']}, context "
                     f"{rows[0]['context_length']:,}); "
                     "above each bar: floor in ms per 1,000 tokens", fontsize=10)
    shares.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))

    ceilings = [row["ceiling_tok_per_sec"] for row in rows]
    speeds.bar(labels, ceilings, color="#bbbbbb", label="ceiling: tokens per step / floor")
    for label, ceiling in zip(labels, ceilings):
        speeds.annotate(f"{ceiling / 1e3:,.0f}k", (label, ceiling), ha="center", va="bottom", fontsize=8)
    measured = [(str(row["rung"]), row["tutorial_tok_per_sec"]) for row in rows if "tutorial_tok_per_sec" in row]
    if measured:
        speeds.plot(*zip(*measured), "o", color="black", label="original tutorial, measured on an A100")
    speeds.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value / 1e3:,.0f}k"))
    speeds.set_ylim(0, 1.12 * max(ceilings))
    speeds.set_ylabel("tokens per second")
    speeds.set_xlabel("rung (0: the baseline, 00_orig.py; 10: all ten steps, 01_opt_single_gpu.py)")
    speeds.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    try:
        files.save_atomically(lambda tmp: fig.savefig(tmp, dpi=120, format="png"), path)
    finally:
        plt.close(fig)


def write_outputs(table, out):
    """roofline.json, roofline.md and roofline.png, each written whole or not at all."""
    for name, write in (("roofline.json", lambda path: files.write_json(path, table)),
                        ("roofline.md", lambda path: files.write_atomically(
                            path, render_markdown(table).encode("utf-8"))),
                        ("roofline.png", lambda path: render_chart(table, path))):
        try:
            write(out / name)
        except OSError as err:
            raise failures.OutputError(f"cannot write {out / name}: {err.strerror or err}") from None


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def slug(name):
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def build_parser():
    parser = cli.OneLineParser(prog="cost_model/roofline.py", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--gpu", required=True, metavar="NAME",
                        help="a GPU of utilization.PEAK_TFLOPS, e.g. A100 (the SXM 80 GB part), A100 PCIe, H100, H200")
    parser.add_argument("--out", help="folder for roofline.md, roofline.png and roofline.json "
                                      "(default: runs/roofline/<gpu>)")
    parser.add_argument("--model", choices=tuple(cli.MODEL_SIZES), default="gpt2-small",
                        help="which of the book's GPT-2 sizes (default: gpt2-small)")
    parser.add_argument("--batch-size", type=cli.whole_number(1),
                        help="sequences per step for every rung (default: each rung's own, 8 and 32 for rung 10)")
    parser.add_argument("--grad-accum-steps", type=cli.whole_number(1), default=1, metavar="N",
                        help="each step as N micro-batches of the batch: AdamW once per N (default: 1)")
    parser.add_argument("--predict", action="store_true",
                        help="also each rung's predicted tok/s, from efficiencies fitted on a measured ladder")
    parser.add_argument("--context-length", type=cli.whole_number(1), metavar="N",
                        help="tokens per sequence for every rung; the model's position embedding is built for it "
                             "(default: the stages' own, 1,024)")
    return parser


def main():
    parser = build_parser()
    args = parser.parse_args()
    if args.predict and args.grad_accum_steps != 1:
        parser.error("--predict models the ladder's steps, one micro-batch each: leave out --grad-accum-steps")
    gpu = find_gpu(args.gpu)  # an unknown GPU fails here, before anything is built
    out = checkpoints.claim_out_dir(args.out or ROOT / "runs" / "roofline" / slug(args.gpu))
    started, counted = time.perf_counter(), {}
    print(f"Counting each rung's work on the meta device{' and fitting the prediction' if args.predict else ''} "
          "(6-11 s on a 2-core CPU) ...", file=sys.stderr, flush=True)
    table = build_roofline(gpu, model=args.model, batch_size=args.batch_size, context_length=args.context_length,
                           step=lambda row: accumulated(row, args.grad_accum_steps), counted_steps=counted)
    table["grad_accum_steps"] = args.grad_accum_steps
    if args.predict:
        prediction.add_predictions(table, prediction.fitted_for(gpu, counted))
    write_outputs(table, out)
    print(f"{table['gpu']}: {table['model']}, context {table['context_length']:,} tokens, "
          + (f"batch {args.batch_size} for every rung" if args.batch_size else "each rung's own batch"))
    rows = table["rungs"] + table.get("predicted_one_gpu_rungs", [])
    width = max(len(row["change"]) for row in rows)  # the longest change sets the column, rung 5's included
    for row in rows:
        floor = (f"floor {_ms(row['floor_seconds']):>8} ms, ceiling {row['ceiling_tok_per_sec']:>9,.0f} tok/s, "
                 if "floor_seconds" in row else " " * 44)
        predicted = f"predicted {row['predicted_tok_per_sec']:>9,.0f} tok/s" if args.predict else ""
        print(f"rung {row['rung']:2d} {row['change']:<{width}} {floor}{predicted}".rstrip(", "))
    if args.predict:
        print("Predicted: " + prediction_words(table))
    print(f"Wrote {out}/roofline.md, roofline.png and roofline.json in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    sys.exit(failures.process_done(failures.run(main)))
