"""What each rung will measure on a GPU, predicted: the roofline's floors, each divided by an efficiency fitted on a
measured ladder, plus a fixed gap per kernel.

  python bench/roofline.py --gpu "RTX 4090" --predict     # the roofline of any GPU of the peak table, predicted
  python bench/prediction.py --write                     # the README's "what to expect on your GPU" table
  python bench/prediction.py --check                     # exit 1 where the README's table is not the model's

The model. Every op of a rung's step has a floor on the GPU, max(FLOPs / peak, bytes / bandwidth) at the dtypes
and kernels the rung runs (bench/step_model.py), and what bounds it puts it in one of five kinds of work, each of
which reaches its own share of the data sheet's figure: matmuls on CUDA cores (float32 before step 2) and matmuls
on tensor cores (TF32, bf16, fp16), as shares of their precision's peak; FlashAttention, as a share of the 16-bit
peak; memory-bound eager kernels (norms, activations, dropout, casts, the hand-written attention's softmax and
masks, the loss, AdamW, matmuls too small to be compute-bound) and the kernels torch.compile fused, as shares of the
memory bandwidth (the fusion model's bytes are a lower bound: what Inductor reads twice lowers its share). Each
kernel launched adds a fixed gap: the GPU waiting for the host. A step's predicted time is the sum.

The fit. Those five shares and the gap, six numbers, are fitted once per GPU generation, never per rung, by least
squares of the relative error over a measured ladder's rungs (11 and 12, run on one GPU, do rung 10's step) and the
GPU time per class of the profile committed beside it (bench/step_time.py's matmuls, attention, and memory-bound
classes of rung 10): from step 8 on the matmuls, FlashAttention and the fused kernels grow together, and only the
profile tells them apart. Shares are kept at most 1 and the gap at least 0. On another GPU the same shares multiply
that GPU's data-sheet peaks and bandwidth (utilization.PEAK_TFLOPS) and the gap stays as it is. Only Hopper has a
measured ladder (the H200's); for any other generation its fit is an extrapolation, and says so.
"""

import argparse
import itertools
import re
import statistics
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import failures  # noqa: E402  (needs the path above)
from bench.step_model import BOUNDS, CLASSES, MODELLED_RUNGS, build_roofline, find_gpu  # noqa: E402

RESULTS = ROOT / "bench" / "results"
# The ladder each generation's efficiencies are fitted on: its folder (rows/ and profile/) and the GPU it ran on.
FITS = {"Hopper": ("nvidia-h200", "H200")}
PROFILED_RUNG = 10  # profile/ holds a trace of 01_opt_single_gpu.py as it is
GENERATIONS = ((r"B200|GB200", "Blackwell"), (r"H100|H200|H800", "Hopper"), (r"L40S|L4\b|RTX 40", "Ada"),
               (r"A100|A10\b|RTX 30|RTX A6000", "Ampere"), (r"T4\b", "Turing"), (r"V100", "Volta"))
ORDER = ("Volta", "Turing", "Ampere", "Ada", "Hopper", "Blackwell")
SHARES = ("CUDA-core matmuls", "tensor-core matmuls", "FlashAttention", "eager memory-bound kernels",
          "compiled memory-bound kernels")
SHARE_OF = {"fp32 matmul": 0, "tf32 matmul": 1, "16-bit matmul": 1, "flash": 2, "attention traffic": 3,
            "traffic": 3, "fused traffic": 4}
OF_WHAT = ("of the fp32 peak", "of the peak of their precision", "of the 16-bit peak", "of the bandwidth",
           "of the bandwidth")
ONE_GPU_RUNGS = {11: "DDP on one GPU", 12: "FSDP2 on one GPU"}  # rung 10's step, under 02's and 03's code
README_GPUS = ("RTX 3090", "RTX 4090", "A10", "L4", "T4", "V100", "A100", "H100", "H200")
README_BLOCK = ("<!-- predictions: bench/prediction.py writes this table -->", "<!-- /predictions -->")
PAGE_BLOCK = ("<!-- the fit: bench/prediction.py writes these tables -->", "<!-- /the fit -->")
PAGE = ROOT / "docs" / "roofline.md"
TUTORIAL_SAME_WORK = range(0, 5)  # its rungs 0-4 ran 00's code at batch 8 as rungs 0-4 do; from 5 on it differs


def generation(name):
    return next((gen for pattern, gen in GENERATIONS if re.search(pattern, name, re.IGNORECASE)), None)


def measured_ladders(gpu_name=None):
    """({folder: {rung: tok/s}}, {folder: where and when}) of the committed ladders measured alike (the stages'
    batch, gpt2-small, no options, one GPU) on the GPU named (None: any GPU)."""
    from bench.report import same_gpu
    from bench.rows import read_rows

    found, when = {}, {}
    for folder in sorted(RESULTS.iterdir()):
        for row in read_rows(folder, "ladder.json").values() if (folder / "rows").is_dir() else ():
            settings = row["context"]["settings"]
            if "rung" in row and row.get("tokens_per_sec") and row.get("world_size", 1) == 1 and \
                    settings.get("batch_size") is None and not settings.get("options") and \
                    settings.get("model") == "gpt2-small" and \
                    (gpu_name is None or same_gpu(gpu_name, row["context"]["device_name"])):
                found.setdefault(folder.name, {})[row["rung"]] = row["tokens_per_sec"]
                context = row["context"]
                when.setdefault(folder.name, set()).add(f"{context['device_name']}, PyTorch {context['torch']}, "
                                                        f"{row['measured_at'][:10]}")
    return found, {folder: "; ".join(sorted(days)) for folder, days in when.items()}


def profiled_seconds(folder):
    """{"matmul", "attention", "memory"}: GPU seconds per step of the profile in `folder`/profile."""
    import gzip
    import json

    from inspection import gpu_time_per_step

    with gzip.open(next((RESULTS / folder / "profile").glob("*.pt.trace.json.gz")), "rt", encoding="utf-8") as f:
        per_step = gpu_time_per_step(json.load(f))
    return {"matmul": per_step["matmul"], "attention": per_step["attention"],
            "memory": sum(per_step[work] for work in CLASSES if work not in ("matmul", "attention"))}


def _terms(row):
    """A row's floor seconds per share, and its kernels: predicted seconds = terms . (1 / shares, gap)."""
    terms = [0.0] * (len(SHARES) + 1)
    for bound in BOUNDS:
        terms[SHARE_OF[bound]] += row["bound_seconds"][bound]
    terms[-1] = row["launches"]
    return terms


def fit(table, measured, profile):
    """The shares and the gap that fit `measured` ({rung: tok/s}) and `profile` (profiled_seconds) best, by least
    squares of relative errors, with every share at most 1 and the gap at least 0."""
    import numpy

    rows = {row["rung"]: row for row in table["rungs"]}
    equations, targets = [], []
    for rung, tok_per_sec in sorted(measured.items()):
        row = rows[PROFILED_RUNG if rung in ONE_GPU_RUNGS else rung]
        equations.append(_terms(row))
        targets.append(row["tokens_per_step"] / tok_per_sec)
    profiled = _terms(rows[PROFILED_RUNG])
    for work, indices in (("matmul", (0, 1)), ("attention", (2,)), ("memory", (3, 4))):
        equations.append([value if index in indices else 0.0 for index, value in enumerate(profiled)])
        targets.append(profile[work])
    relative = numpy.array(equations) / numpy.array(targets)[:, None]
    lowest = numpy.array([1.0] * len(SHARES) + [0.0])  # 1 / share >= 1, gap >= 0
    wanted = 1.0 - relative @ lowest
    best = None
    for free in itertools.product((False, True), repeat=len(lowest)):  # least squares with bounds: each active set
        columns = [index for index, chosen in enumerate(free) if chosen]
        solution = numpy.zeros(len(lowest))
        if columns:
            solution[columns] = numpy.linalg.lstsq(relative[:, columns], wanted, rcond=None)[0]
        residual = float(numpy.sum((relative @ solution - wanted) ** 2))
        if (solution >= 0).all() and (best is None or residual < best[0]):
            best = (residual, solution)
    inverse = lowest + best[1]
    return {"shares": {name: float(1 / value) for name, value in zip(SHARES, inverse)},
            "gap_seconds": float(inverse[-1])}


def predicted_seconds(row, fitted):
    inverse = [1 / fitted["shares"][name] for name in SHARES] + [fitted["gap_seconds"]]
    return sum(term * factor for term, factor in zip(_terms(row), inverse))


def fitted_for(gpu, counted_steps=None):
    """The fit that `gpu`'s prediction uses, with what it was fitted on and how it applies to `gpu`; `counted_steps`
    (step_model.model_rung's) shares the steps counted for `gpu` with the fitted GPU's table."""
    mine = generation(gpu.name)
    fitted_gen = mine if mine in FITS else min(FITS, key=lambda gen: abs(ORDER.index(gen) - ORDER.index(mine))
                                                if mine else 0)
    folder, fit_gpu = FITS[fitted_gen]
    measured, profile = measured_ladders(fit_gpu)[0][folder], profiled_seconds(folder)
    table = build_roofline(find_gpu(fit_gpu), counted_steps=counted_steps)
    fitted = fit(table, measured, profile)
    how = (f"{mine} GPU, fitted on {mine}" if mine == fitted_gen else
           f"{mine or 'unknown'} GPU: the {fitted_gen} fit, the nearest generation measured"
           + ("" if mine and ORDER.index(mine) > ORDER.index(fitted_gen) else ", an extrapolation"))
    fitted["fitted_on"] = [f"bench/results/{folder}: the {fit_gpu}'s rungs {_ranges(measured)}, and profile/ "
                           f"(GPU time per class of rung {PROFILED_RUNG})"]
    fitted["how"] = how
    fitted["residuals"] = {rung: predicted_tok_per_sec(table, rung, fitted) / value - 1
                           for rung, value in measured.items()}
    rung10 = next(row for row in table["rungs"] if row["rung"] == PROFILED_RUNG)
    fitted["profile_check"] = profile_check(rung10, fitted, profile)
    return fitted


def profile_check(row, fitted, profile):
    """{class: (fitted seconds, profiled seconds)} of the profiled rung."""
    terms, inverse = _terms(row), [1 / fitted["shares"][name] for name in SHARES]
    parts = {"matmul": (0, 1), "attention": (2,), "memory": (3, 4)}
    return {work: (sum(terms[index] * inverse[index] for index in indices), profile[work])
            for work, indices in parts.items()}


def predicted_tok_per_sec(table, rung, fitted):
    row = next(row for row in table["rungs"] if row["rung"] == (PROFILED_RUNG if rung in ONE_GPU_RUNGS else rung))
    return row["tokens_per_step"] / predicted_seconds(row, fitted)


def add_predictions(table, fitted):
    """Each rung's "predicted_tok_per_sec", rungs 11 and 12 on one GPU, and what the fit is, into a roofline table."""
    for row in table["rungs"]:
        row["predicted_tok_per_sec"] = predicted_tok_per_sec(table, row["rung"], fitted)
    if PROFILED_RUNG in {row["rung"] for row in table["rungs"]}:
        table["predicted_one_gpu_rungs"] = [
            {"rung": rung, "change": f"{what}: rung 10's step", "predicted_tok_per_sec": predicted_tok_per_sec(
                table, rung, fitted)} for rung, what in ONE_GPU_RUNGS.items()]
    table["fitted_on"] = fitted["fitted_on"]
    table["prediction"] = {key: fitted[key] for key in ("how", "shares", "gap_seconds", "residuals", "profile_check")}
    return table


def predictions(table):
    """{rung: predicted tok/s} of a roofline table with predictions, rungs 11 and 12 included."""
    found = {row["rung"]: row["predicted_tok_per_sec"] for row in table["rungs"] if "predicted_tok_per_sec" in row}
    found.update({row["rung"]: row["predicted_tok_per_sec"] for row in table.get("predicted_one_gpu_rungs", ())})
    return found


def measured_beside(table):
    """{rung: (measured tok/s, where)} to hold the predictions against: this GPU's committed ladders, or on an A100
    the original tutorial's rungs 0-4 (the only ones that ran this repository's computation)."""
    found = {}
    ladders, when = measured_ladders(table["gpu"])
    for folder, rungs in ladders.items():
        where = f"bench/results/{folder} ({when[folder]})"
        found.update({rung: (value, where) for rung, value in rungs.items()})
    for row in table["rungs"]:
        if "tutorial_tok_per_sec" in row and row["rung"] in TUTORIAL_SAME_WORK and row["rung"] not in found:
            found[row["rung"]] = (row["tutorial_tok_per_sec"], "the original tutorial (A100, PyTorch 2.6)")
    return found


def errors(table):
    """{rung: predicted / measured - 1}, and their median and worst in absolute value (None without any)."""
    predicted, measured = predictions(table), measured_beside(table)
    found = {rung: predicted[rung] / value - 1 for rung, (value, _) in sorted(measured.items()) if rung in predicted}
    if not found:
        return found, None, None
    sizes = [abs(error) for error in found.values()]
    return found, statistics.median(sizes), max(sizes)


def _ranges(numbers):
    from bench.report import rung_ranges

    return rung_ranges(sorted(numbers), dash="-")


# ---------------------------------------------------------------------------------------------
# The README's table
# ---------------------------------------------------------------------------------------------

def readme_tables():
    """{GPU: roofline table with predictions} for README_GPUS, the steps counted once per kind of GPU."""
    counted, tables = {}, {}  # model_rung tells steps apart by their ops: one dict serves every GPU
    for name in README_GPUS:
        gpu = find_gpu(name)
        tables[name] = add_predictions(build_roofline(gpu, counted_steps=counted), fitted_for(gpu, counted))
    return tables


def readme_table(tables):
    """The README's table: per GPU, each step's predicted gain over the step before, and stage 01's tok/s."""
    held_out = tables["H100"]
    _, median, worst = errors(held_out)
    lines = ["| GPU | " + " | ".join(f"step {number}" for number in range(1, 11)) + " | stage 01, tok/s |",
             "| --- |" + " ---: |" * 11]
    for name, table in tables.items():
        found = predictions(table)
        lines.append(f"| {name} | " + " | ".join(f"{found[number] / found[number - 1]:.2f}x" for number in
                                                range(1, 11)) + f" | {found[10]:,.0f} |")
    lines += [""] + textwrap.wrap(
        "Predicted, not measured: each step's gain at the rungs' own batch and 01's tok/s, from each card's data sheet "
        f"and six efficiencies fitted on {fitted_gpu_words(held_out)}; on the H100, unseen by the fit, the error per "
        f"measured rung is {100 * median:.0f}% (median), {100 * worst:.0f}% at worst. Other generations: an "
        "extrapolation; T4, V100: fp16; A10: the peak table's row (\"A10G\" does not match it). [Memory, smaller "
        "batches, the method](docs/roofline.md#predictions-for-your-gpu).",
        width=115, break_on_hyphens=False)
    return "\n".join(lines)


def page_block(tables):
    """docs/roofline.md's block: the fitted shares, the errors on each GPU with measurements, the profile's check."""
    fitted = tables["H100"]["prediction"]
    lines = ["| kind of work | fitted share |", "| --- | ---: |"]
    lines += [f"| {name} | {100 * share:.0f}% {of} |" for (name, share), of in zip(fitted["shares"].items(), OF_WHAT)]
    lines += [f"| every kernel launched | {1e6 * fitted['gap_seconds']:.1f} us of gap |", "",
              "| GPU | compared with | median error | worst | error per rung |", "| --- | --- | ---: | ---: | --- |"]
    for name, what in (("H200", "its own ladder: the fit's residuals"), ("H100", "its ladder, never seen by the fit"),
                       ("A100", "the original tutorial's rungs 0-4, an extrapolation")):
        found, median, worst = errors(tables[name])
        lines.append(f"| {name} | {what} | {100 * median:.1f}% | {100 * worst:.1f}% | " + ", ".join(
            f"{rung}: {100 * error:+.1f}%" for rung, error in found.items()) + " |")
    lines += ["", "Rung 10 against the H200's profile, GPU ms per step, fitted / profiled: " + "; ".join(
        f"{work} {1e3 * mine:.2f} / {1e3 * profiled:.2f} ({100 * (mine / profiled - 1):+.0f}%)"
        for work, (mine, profiled) in fitted["profile_check"].items()) + " (memory: the four memory-bound classes)."]
    return "\n".join(lines)


def fitted_gpu_words(table):
    return "the H200's ladder and profile" if "nvidia-h200" in table["fitted_on"][0] else table["fitted_on"][0]


def main(argv=None):
    from bench.readme_tables import _with_block, block

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="render the README's and docs/roofline.md's tables")
    action.add_argument("--check", action="store_true", help="change nothing: exit 1 where a page differs")
    parser.add_argument("--readme", default=str(ROOT / "README.md"), help=argparse.SUPPRESS)
    parser.add_argument("--page", default=str(PAGE), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    tables = readme_tables()
    stale = []
    for path, markers, rendered in ((Path(args.readme), README_BLOCK, readme_table(tables)),
                                    (Path(args.page), PAGE_BLOCK, page_block(tables))):
        text = path.read_text(encoding="utf-8")
        if args.check and block(text, markers) != rendered:
            stale.append(str(path))
        elif args.write:
            path.write_text(_with_block(text, markers, rendered), encoding="utf-8")
            print(f"Wrote the predictions into {path}")
    if stale:
        print(f"{', '.join(stale)}: the predictions differ from the model's: run python bench/prediction.py --write",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(failures.run(lambda: main()))
