"""What each rung will measure on a GPU, predicted: the roofline's floors, each over an efficiency fitted on a ladder.

  python cost_model/roofline.py --gpu "RTX 4090" --predict   # any GPU of the peak table, with a prediction per rung
  python cost_model/prediction.py                           # the README's table of predictions (--check: exit 1 if stale)

Each op's floor (cost_model/step_model.py) falls in one of six kinds of work by what bounds it, each reaching its own
share of the data sheet: matmuls on CUDA cores (float32) and on tensor cores, of their peak, and apart from these the
tensor-core matmuls with a dimension not a multiple of 16 bytes (the 50,257-wide head before step 9 pads it);
FlashAttention, of the 16-bit peak; eager and compiled (fused) memory-bound kernels, of the bandwidth. Each kernel
launched adds a fixed gap. These seven numbers per GPU generation, never one per rung, are fitted by least squares of
relative errors (shares at most 1) on a ladder's rungs (11 and 12 on one GPU do rung 10's step) and its profile of
rung 10, whose GPU time per class parts what grows together from step 8 on (matmuls, FlashAttention, fused kernels).
Another GPU keeps them; its data sheet sets the floors. Only Hopper has a ladder (the H200's): another generation is
an extrapolation.
"""

import argparse
import gzip
import itertools
import json
import re
import statistics
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import failures  # noqa: E402  (needs the path above)
from inspection import gpu_time_per_step  # noqa: E402
from bench.report import rung_ranges, same_gpu  # noqa: E402
from bench.rows import read_rows  # noqa: E402
from cost_model.gpus import find_gpu  # noqa: E402
from cost_model.step_model import BOUNDS, CLASSES, build_roofline  # noqa: E402

RESULTS = ROOT / "bench" / "results"
# The ladder each generation's efficiencies are fitted on: its folder (rows/ and profile/) and the GPU it ran on.
FITS = {"Hopper": ("nvidia-h200", "H200")}
PROFILED_RUNG = 10  # profile/ holds a trace of 01_opt_single_gpu.py as it is
PROFILED_PARTS = {"matmul": (0, 1, 5), "attention": (2,), "memory": (3, 4)}  # profile's classes: indices of SHARES
GENERATIONS = ((r"V100", "Volta"), (r"T4\b", "Turing"), (r"A100|A10\b|RTX 30|RTX A6000", "Ampere"),  # oldest first
               (r"L40S|L4\b|RTX 40", "Ada"), (r"H100|H200|H800", "Hopper"), (r"B200|GB200", "Blackwell"))
SHARES = {"CUDA-core matmuls": "of the fp32 peak", "tensor-core matmuls": "of the peak of their precision",
          "FlashAttention": "of the 16-bit peak", "eager memory-bound kernels": "of the bandwidth",
          "compiled memory-bound kernels": "of the bandwidth",
          "unaligned tensor-core matmuls": "of the peak of their precision"}  # each kind of work: what it is a share of
SHARE_OF = {"fp32 matmul": 0, "tf32 matmul": 1, "bf16 matmul": 1, "fp16 matmul": 1, "flash": 2, "traffic": 3,
            "fused traffic": 4, "unaligned matmul": 5}
ONE_GPU_RUNGS = {11: "DDP on one GPU", 12: "FSDP2 on one GPU"}  # rung 10's step, under 02's and 03's code
README_GPUS = ("RTX 3090", "RTX 4090", "A10", "L4", "T4", "V100", "A100", "H100", "H200")
README, README_BLOCK = ROOT / "README.md", ("<!-- predictions: cost_model/prediction.py writes this table -->",
                                         "<!-- /predictions -->")
TUTORIAL_SAME_WORK = range(0, 5)  # its rungs 0-4 ran 00's code at batch 8 as rungs 0-4 do; from 5 on it differs


def measured_ladders(gpu_name):
    """({folder: {rung: tok/s}}, {folder: where and when}) of the committed ladders measured alike (the stages'
    batch and context, gpt2-small at full size, no options, one GPU) on the GPU named."""
    found, when, dates = {}, {}, {}
    for folder in sorted(path for path in RESULTS.iterdir() if (path / "rows").is_dir()):
        for row in read_rows(folder, "ladder.json").values():
            context, settings = row["context"], row["context"]["settings"]
            if "rung" in row and row.get("tokens_per_sec") and row.get("world_size", 1) == 1 and not (
                    settings.get("batch_size") or settings.get("options") or settings.get("model") != "gpt2-small"
                    or settings.get("tiny") or settings.get("context_length")
                    or not same_gpu(gpu_name, context["device_name"])):
                found.setdefault(folder.name, {})[row["rung"]] = row["tokens_per_sec"]
                dates.setdefault(folder.name, set()).add(row["measured_at"][:10])  # a ladder measured in parts
                when[folder.name] = (f"{context['device_name']}, PyTorch {context['torch']}, "
                                     + ", ".join(sorted(dates[folder.name])))
    return found, when


def profiled_seconds(folder):
    """{"matmul", "attention", "memory"}: GPU seconds per step of the profile in `folder`/profile."""
    with gzip.open(next((RESULTS / folder / "profile").glob("*.pt.trace.json.gz")), "rt", encoding="utf-8") as f:
        per_step = gpu_time_per_step(json.load(f))
    return {"matmul": per_step["matmul"], "attention": per_step["attention"],
            "memory": sum(per_step[work] for work in CLASSES if work not in ("matmul", "attention"))}


def _terms(row):
    """A row's floor seconds per share, and its kernels: predicted seconds = terms . (1 / shares, gap)."""
    terms = [0.0] * len(SHARES) + [row["launches"]]
    for bound in BOUNDS:
        terms[SHARE_OF[bound]] += row["bound_seconds"][bound]
    return terms


def fit(table, measured, profile):
    """The shares and the gap that fit `measured` ({rung: tok/s}) and `profile` (profiled_seconds) best, by least
    squares of relative errors, with every share at most 1 and the gap at least 0."""
    import numpy

    rows = [table["rungs"][PROFILED_RUNG if rung in ONE_GPU_RUNGS else rung] for rung in sorted(measured)]
    equations = [_terms(row) for row in rows]
    targets = [row["tokens_per_step"] / measured[rung] for row, rung in zip(rows, sorted(measured))]
    for work, indices in PROFILED_PARTS.items():
        profiled = _terms(table["rungs"][PROFILED_RUNG])
        equations.append([value if index in indices else 0.0 for index, value in enumerate(profiled)])
        targets.append(profile[work])
    relative = numpy.array(equations) / numpy.array(targets)[:, None]
    lowest = numpy.array([1.0] * len(SHARES) + [0.0])  # 1 / share >= 1, gap >= 0
    wanted = 1.0 - relative @ lowest
    best = (numpy.inf, numpy.zeros(len(lowest)))
    for free in itertools.product((False, True), repeat=len(lowest)):  # least squares with bounds: each active set
        solution, columns = numpy.zeros(len(lowest)), numpy.array(free)
        solution[columns] = numpy.linalg.lstsq(relative[:, columns], wanted, rcond=None)[0] if any(free) else []
        residual = float(numpy.sum((relative @ solution - wanted) ** 2))
        best = (residual, solution) if (solution >= 0).all() and residual < best[0] else best
    inverse = lowest + best[1]
    return {"shares": {name: float(1 / value) for name, value in zip(SHARES, inverse)},
            "gap_seconds": float(inverse[-1])}


def predicted_seconds(row, fitted):
    factors = [1 / fitted["shares"][name] for name in SHARES] + [fitted["gap_seconds"]]
    return sum(term * factor for term, factor in zip(_terms(row), factors))


def fitted_for(gpu, counted_steps=None):
    """The fit that `gpu`'s prediction uses, with what it was fitted on and how it applies to `gpu`; `counted_steps`
    (step_model.model_rung's) shares the steps counted for `gpu` with the fitted GPU's table."""
    order = [gen for _, gen in GENERATIONS]
    mine = next((gen for pattern, gen in GENERATIONS if re.search(pattern, gpu.name, re.IGNORECASE)), None)
    fitted_gen = mine if mine in FITS else min(FITS, key=lambda gen: abs(order.index(gen) - order.index(mine or gen)))
    how = (f"{mine} GPU, fitted on {mine}" if mine == fitted_gen else
           f"{mine or 'unknown'} GPU: the {fitted_gen} fit, the nearest generation measured, an extrapolation")
    return {**_fit_of(fitted_gen, counted_steps), "how": how}


_FITTED = {}  # generation: its fit, made once per process however many GPUs are predicted from it


def _fit_of(generation, counted_steps):
    if generation not in _FITTED:
        folder, fit_gpu = FITS[generation]
        measured, profile = measured_ladders(fit_gpu)[0][folder], profiled_seconds(folder)
        table = build_roofline(find_gpu(fit_gpu), counted_steps=counted_steps)
        fitted = fit(table, measured, profile)
        fitted["fitted_on"] = [f"bench/results/{folder}: the {fit_gpu}'s rungs {rung_ranges(measured, '-')}, and "
                               f"profile/ (GPU time per class of rung {PROFILED_RUNG})"]
        fitted["profile_check"] = profile_check(table["rungs"][PROFILED_RUNG], fitted, profile)
        _FITTED[generation] = fitted
    return _FITTED[generation]


def profile_check(row, fitted, profile):
    """{class: (fitted seconds, profiled seconds)} of the profiled rung."""
    terms = _terms(row)
    return {work: (sum(terms[index] / fitted["shares"][name] for index, name in enumerate(SHARES) if index in indices),
                   profile[work]) for work, indices in PROFILED_PARTS.items()}


def add_predictions(table, fitted):
    """Each rung's "predicted_tok_per_sec", rungs 11 and 12 on one GPU, and what the fit is, into a roofline table."""
    for row in table["rungs"]:
        row["predicted_tok_per_sec"] = row["tokens_per_step"] / predicted_seconds(row, fitted)
    table["predicted_one_gpu_rungs"] = [{"rung": rung, "change": f"{what}: rung 10's step", "predicted_tok_per_sec":
                                         table["rungs"][PROFILED_RUNG]["predicted_tok_per_sec"]}
                                        for rung, what in ONE_GPU_RUNGS.items()]
    table["fitted_on"] = fitted["fitted_on"]
    table["prediction"] = {key: fitted[key] for key in ("how", "shares", "gap_seconds", "profile_check")}
    return table


def predictions(table):
    """{rung: predicted tok/s} of a roofline table with predictions, rungs 11 and 12 included."""
    return {row["rung"]: row["predicted_tok_per_sec"] for row in table["rungs"] + table.get(
        "predicted_one_gpu_rungs", []) if "predicted_tok_per_sec" in row}


def measured_beside(table):
    """{rung: (measured tok/s, where)} to hold the predictions against: this GPU's committed ladders, or on an A100
    the original tutorial's rungs 0-4 (the only ones that ran this repository's computation)."""
    found, (ladders, when) = {}, measured_ladders(table["gpu"])
    for folder, rungs in ladders.items():
        found.update({rung: (value, f"bench/results/{folder} ({when[folder]})") for rung, value in rungs.items()})
    for row in table["rungs"]:
        if "tutorial_tok_per_sec" in row and row["rung"] in TUTORIAL_SAME_WORK and not ladders:
            found[row["rung"]] = (row["tutorial_tok_per_sec"], "the original tutorial (A100, PyTorch 2.6), its rungs "
                                  "0-4 only: from step 5 on it kept bf16 weights, another computation")
    return found


def errors(table):
    """{rung: predicted / measured - 1}, and their median and worst in absolute value (None without any)."""
    predicted, measured = predictions(table), measured_beside(table)
    found = {rung: predicted[rung] / value - 1 for rung, (value, _) in sorted(measured.items()) if rung in predicted}
    sizes = [abs(error) for error in found.values()] or [None]
    return found, statistics.median(sizes), max(sizes)


def worst_step(table):
    """The step whose predicted gain (rung N over rung N - 1) misses the measured one most: (step, predicted gain,
    measured gain), or None where no two neighbouring rungs were measured."""
    predicted, measured = predictions(table), {rung: value for rung, (value, _) in measured_beside(table).items()}
    gains = {step: (predicted[step] / predicted[step - 1], measured[step] / measured[step - 1])
             for step in range(1, 11) if {step, step - 1} <= measured.keys()}
    if not gains:
        return None
    step = max(gains, key=lambda step: abs(gains[step][0] / gains[step][1] - 1))
    return (step, *gains[step])


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
    checked, median, worst = errors(held_out)
    own, own_median, own_worst = errors(tables["H200"])  # the fit's own GPU: it need not match every rung either
    own_worst_rung = max(own, key=lambda rung: abs(own[rung]))
    step, predicted_gain, measured_gain = worst_step(tables["H200"])
    dates = sorted({date for _, where in measured_beside(held_out).values()
                    for date in re.findall(r"\d{4}-\d{2}-\d{2}", where)})
    lines = ["| GPU | " + " | ".join(f"step {number}" for number in range(1, 11)) + " | stage 01, predicted tok/s |",
             "| --- |" + " ---: |" * 11]
    for name, table in tables.items():
        found = predictions(table)
        lines.append(f"| {name} | " + " | ".join(f"{found[number] / found[number - 1]:.2f}x" for number in
                                                range(1, 11)) + f" | {found[10]:,.0f} |")
    lines += [""] + textwrap.wrap(
        "Predicted, not measured: each step's gain at the rungs' own batch and 01's tok/s, from each card's data sheet "
        "and seven numbers fitted on the H200's measurements (six shares of peak or bandwidth, a launch cost). "
        "On the H100 "
        "(rungs "
        f"{rung_ranges(checked, '-')} of {', '.join(dates)}), unseen by the fit, they "
        f"missed rungs by {100 * median:.0f}% (median), {100 * worst:.0f}% at worst; on the H200 itself by "
        f"{100 * own_median:.0f}%, {100 * own_worst:.0f}% at rung {own_worst_rung}; a step's gain can miss more (H200 "
        f"step {step}: {predicted_gain:.2f}x predicted, {measured_gain:.2f}x measured). Runs must fit (else a "
        "lower `--batch-size`): 01 reserved up to 18.1 GiB in its warm-up, rungs 0-4 26.3 (batch 8). Other "
        "generations extrapolated; T4, V100: fp16; GeForce: no TF32 gain (step 2). "
        "[Method](docs/roofline.md#predictions-for-your-gpu).",
        width=118, break_on_hyphens=False)
    return "\n".join(lines)


def main(argv=None):
    from bench.readme_tables import _with_block, block

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--check", action="store_true", help="change nothing: exit 1 where the README's table differs")
    check, text = parser.parse_args(argv).check, README.read_text(encoding="utf-8")
    table = readme_table(readme_tables())
    if check and block(text, README_BLOCK) != table:
        print(f"{README}: the predictions differ from the model's: run python cost_model/prediction.py", file=sys.stderr)
        return 1
    if not check:
        README.write_text(_with_block(text, README_BLOCK, table), encoding="utf-8")
        print(f"Wrote the predictions into {README}")
    return 0


if __name__ == "__main__":
    sys.exit(failures.process_done(failures.run(main)))
