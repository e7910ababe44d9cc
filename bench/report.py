"""The ladder's report: the table (ladder.md), numbers (ladder.json) and chart (ladder.png), rendered from the rows.

bench/ladder.py measures rungs, each into a row file of the results folder's rows/ (bench/rows.py); this file turns
the rows present into those three files, whichever commands measured them: a ladder measured in parts
(--rungs 0-5, then --rungs 6-12) is one table because its rows lie in one folder.

When a roofline.json that cost_model/roofline.py wrote for the same GPU and settings lies in the results folder (or
--roofline names one; else the one docs/roofline/ ships for the GPU), the table gains a column: each rung's
measured tok/s over the ceiling modelled for it.

Run alone, it renders the three files again from the folder's rows, with no rung run again (after roofline.json was
written beside them, or after a part was stopped before its chart):

  python bench/report.py bench/results/nvidia-h100-80gb-hbm3
  python bench/report.py RESULTS_FOLDER --roofline path/to/roofline.json
"""

import argparse
import json
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the plumbing modules and data, wherever the script is started from

import cli  # noqa: E402  (needs the path above; imports no torch)
import failures
import utilization
from bench import rows  # noqa: E402
from data import files  # noqa: E402
from failures import UsageError  # noqa: E402

# The original tutorial's figures, one A100 (rung 11: four), PyTorch 2.6: its README's "Avg tok/sec"
# for steps 0 to 7 and "Step tok/sec" at the end of epoch 1 for 8 to 11 (all GPUs together for 11),
# and torch.cuda.memory_reserved() after the first epoch, printed as "GB" but in GiB (bytes / 1024**3, the unit of
# every memory figure here). It had no FSDP.
REFERENCE_SOURCE = ("original tutorial, 1x A100, PyTorch 2.6 (rung 11: 4x A100): Sebastian Raschka, "
                    "LLMs-from-scratch, ch05/10_llm-training-speed/README.md")
REFERENCE = {
    0: (12_525, 26.26), 1: (12_526, 26.24), 2: (27_648, 26.24), 3: (28_399, 26.24), 4: (28_402, 26.24),
    5: (45_486, 13.79), 6: (55_256, 11.56), 7: (91_901, 5.90), 8: (112_046, 6.19), 9: (127_345, 5.89),
    10: (142_156, 22.51), 11: (419_259, 22.80),
}
# Its batch per step and GPU: the reference figures compare only with rows of the same batch.
REFERENCE_BATCH = {number: 8 if number < 10 else 32 for number in REFERENCE}

# Short names for the chart's axis.
SHORT_NAMES = {0: "baseline (00)", 1: "mask on the fly", 2: "TF32", 3: "fused AdamW", 4: "pinned memory",
               5: "bf16 / fp16", 6: "native LN/GELU", 7: "SDPA + fused QKV", 8: "torch.compile", 9: "vocab 50,304",
               10: "larger batch (01)", 11: "DDP (02)", 12: "FSDP2 (03)"}

# The documented keys of a row, in this order; the details follow them.
ROW_KEYS = ("rung", "change", "tokens_per_sec", "tokens_per_sec_min", "tokens_per_sec_max", "speedup_vs_previous",
            "speedup_vs_baseline", "mfu", "peak_allocated_gb", "peak_reserved_gb", "first_interval_peak_reserved_gb",
            "final_loss", "error", "measured_at")

# What must be the same in two rows for them to share a table, and how a refusal names it.
MATCHED = {"device_name": "device", "gpu_count": "visible GPUs", "torch": "PyTorch", "cuda": "CUDA",
           **{f"settings.{key}": name for key, name in (
               ("device", "device"), ("model", "--model"), ("tiny", "--tiny"), ("batch_size", "--batch-size"),
               ("data", "--data"), ("seed", "--seed"), ("warmup_steps", "--warmup"), ("steps", "--steps"),
               ("windows", "--windows"), ("options", "--option"), ("context_length", "--context-length"))}}
STAGES_CONTEXT = 1024  # what every stage trains at (a row's context_length None); tests/test_ladder.py checks it
ROOFLINE_NAME = "roofline.json"
SHIPPED_ROOFLINES = ROOT / "docs" / "roofline"  # cost_model/roofline.py's for the GPUs of the README


def repository_path(path):
    """A path as this repository names it: relative to its root where it lies inside, else as it is (POSIX)."""
    path = Path(path).resolve()
    return (path.relative_to(ROOT) if path.is_relative_to(ROOT) else path).as_posix()


def timestamp(moment=None):
    """A UTC time as the report writes it; such strings sort in time order."""
    return (moment or datetime.now(timezone.utc)).strftime("%Y-%m-%d %H:%M:%S UTC")


# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------

def rung_row_name(number):
    return f"rung-{number:02d}"


def check_row_name(script_name):
    return f"check-{Path(script_name).stem}"


def complete_row(row, seconds, log, context):
    """A rung's result as its row file keeps it: the documented keys first, then the details, the reference figures,
    how long it took, its log, and the context it was measured in (device, versions, settings, command); a
    --check-scripts run's result as it is, with the last three."""
    from bench.rungs import CHANGES

    if "script" in row:
        return {**row, "seconds": round(seconds, 1), "measured_at": timestamp(), "log": log, "context": context}
    number = row["rung"]
    full = {key: row.get(key) for key in ROW_KEYS}
    full["change"] = CHANGES[number]
    full.update({key: value for key, value in row.items() if key not in full})
    full.update(seconds=round(seconds, 1), measured_at=timestamp(), log=log)
    if row.get("windows_cross_epochs"):
        full["notes"] = [*(row.get("notes") or []), f"epochs of {row.get('steps_per_epoch')} steps are shorter "
                         "than a window: every window crosses an epoch boundary"]
    reference_speed, reference_reserved = REFERENCE.get(number, (None, None))
    full["reference"] = {"tokens_per_sec": reference_speed, "reserved_gb": reference_reserved,
                         "batch_size": REFERENCE_BATCH.get(number)}
    full["context"] = context
    return full


def add_comparisons(rows):
    """Speed-ups over the row above (when both were measured) and over rung 0 (when it is in the table).

    The row above is the rung just before only when every rung was measured: `previous_rung` names it."""
    baseline = next((row for row in rows if row["rung"] == 0 and row.get("tokens_per_sec")), None)
    previous = None
    for row in rows:
        speed = row.get("tokens_per_sec")
        row["previous_rung"] = previous["rung"] if previous else None
        row["speedup_vs_previous"] = (speed / previous["tokens_per_sec"]
                                      if speed and previous and previous.get("tokens_per_sec") else None)
        row["speedup_vs_baseline"] = speed / baseline["tokens_per_sec"] if speed and baseline else None
        previous = row


def collect(found):
    """The report of a folder's rows (rows.read_rows'): the header of the newest row, the commands that measured them,
    the rungs in order with their speed-ups, and the --check-scripts runs set beside their rungs."""
    newest = max(found.values(), key=lambda row: row["measured_at"])["context"]
    report = {key: newest[key] for key in ("device", "device_name", "gpu_count", "driver", "cuda", "torch", "python")}
    parts = rows.commands(found)
    for part in parts:
        part["rungs"] = [found[name]["rung"] for name in part.pop("rows") if name.startswith("rung-")]
    report.update(date=newest["command"]["started_at"], settings=newest["settings"], reference_source=REFERENCE_SOURCE,
                  parts=parts)
    without_context = {name: {key: value for key, value in row.items() if key != "context"}
                       | {"part": row["context"]["command"]["started_at"]} for name, row in found.items()}
    report["rungs"] = sorted(({key: row.get(key) for key in ROW_KEYS} | row for name, row in without_context.items()
                              if name.startswith("rung-")), key=lambda row: row["rung"])
    add_comparisons(report["rungs"])
    speeds = {row["rung"]: row.get("tokens_per_sec") for row in report["rungs"]}
    checks = [row for name, row in without_context.items() if name.startswith("check-")]
    for check in checks:  # against the rung's row as it is now
        check["rung_tokens_per_sec"] = speeds.get(check["rung"])
        check["script_over_rung"] = (check["tokens_per_sec"] / check["rung_tokens_per_sec"]
                                     if check.get("tokens_per_sec") and check["rung_tokens_per_sec"] else None)
    if checks:
        report["script_checks"] = checks
    return report


# ---------------------------------------------------------------------------------------------
# The ceiling from cost_model/roofline.py
# ---------------------------------------------------------------------------------------------

def _peak_table_entry(name):
    spelled = re.sub(r"[-_]+", " ", name)  # 'h100-pcie' names the same GPU as 'H100 PCIe'
    patterns = (entry[0] for entry in utilization.PEAK_TFLOPS)  # each entry: the name's pattern, then its figures
    return next((pattern for pattern in patterns if re.search(pattern, spelled, re.IGNORECASE)), None)


def same_gpu(roofline_gpu, device_name):
    """Whether the GPU a roofline models is the one measured: the same name once spelled alike, or the same row of
    the peak table (so 'H100' and 'NVIDIA H100 80GB HBM3' match, 'H100 PCIe' and the SXM card do not)."""
    def spelled(name):
        return re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-")

    if spelled(roofline_gpu) == spelled(device_name):
        return True
    entry = _peak_table_entry(str(roofline_gpu))
    return entry is not None and entry == _peak_table_entry(str(device_name))


def read_roofline(path):
    """{'path', 'gpu', 'modelled', 'ceilings'/'predictions': {rung: tok/s}, 'fitted_on'} from a roofline.json;
    ValueError when it is not one. `modelled` holds the model and batch it was modelled at, where the file says."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        ceilings = {int(entry["rung"]): float(entry["ceiling_tok_per_sec"]) for entry in data["rungs"]
                    if entry.get("ceiling_tok_per_sec") is not None}
        modelled = {key: data[key] for key in ("model", "batch_size", "context_length") if key in data}
        predictions = {int(entry["rung"]): float(entry["predicted_tok_per_sec"]) for entry in
                       data["rungs"] + data.get("predicted_one_gpu_rungs", []) if "predicted_tok_per_sec" in entry}
        return {"path": str(path), "gpu": str(data["gpu"]), "modelled": modelled, "ceilings": ceilings,
                "predictions": predictions, "fitted_on": "; ".join(data.get("fitted_on", []))}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path} is not a roofline.json of cost_model/roofline.py ({type(err).__name__}: {err})") from None


def roofline_mismatch(roofline, device_name, settings):
    """Why a roofline does not model the rungs measured (another GPU, model, batch or context), or None when it
    does."""
    if not same_gpu(roofline["gpu"], device_name):
        return f"it models the {roofline['gpu']}, not the {device_name}"
    if settings.get("tiny"):
        return "it models the full-size model, the rungs ran --tiny"
    for key, flag in (("model", "--model"), ("batch_size", "--batch-size")):
        if key in roofline["modelled"] and roofline["modelled"][key] != settings.get(key):
            return f"it models {flag} {roofline['modelled'][key]}, the rungs ran with {settings.get(key)}"
    modelled, trained = (roofline["modelled"].get("context_length") or STAGES_CONTEXT,
                         settings.get("context_length") or STAGES_CONTEXT)
    if modelled != trained:
        return f"it models context {modelled:,}, the rungs trained at {trained:,}"
    return None


def shipped_rooflines():
    """(path, read_roofline's dict) of each roofline this repository ships in docs/roofline/<GPU>/."""
    for path in sorted(SHIPPED_ROOFLINES.glob(f"*/{ROOFLINE_NAME}")):
        try:
            yield path, read_roofline(path)
        except ValueError:
            continue


def shipped_roofline(device_name, settings, say):
    """The roofline this repository ships that models these rungs, or None."""
    for path, roofline in shipped_rooflines():
        if roofline_mismatch(roofline, device_name, settings) is None:
            say(f"Ceilings from {repository_path(path)}, the roofline "
                f"shipped for the {roofline['gpu']} (--roofline gives another)")
            return roofline
    return None


def _no_roofline(device_name, path, say):
    """None, saying how to get the ceilings and predictions of a GPU of the peak table that nothing here models."""
    if utilization.peak_row(str(device_name)):
        say(f"No ceiling or prediction column: no roofline here models the {device_name} at these settings; "
            f"python cost_model/roofline.py --gpu '{device_name}' --predict --out {path.parent} (with the ladder's "
            "--model and --batch-size) writes one there, and python bench/report.py renders the table again")
    return None


def find_roofline(out, explicit, device_name, settings, say=print):
    """The roofline to set beside the rungs, or None.

    `explicit` (--roofline) must be readable and model these rungs (a UsageError otherwise); a roofline.json in the
    results folder is taken when it models them, and otherwise left out with a line saying why; without one there,
    the roofline shipped in docs/roofline/ for this GPU, where it models these rungs."""
    if explicit:
        try:
            roofline = read_roofline(explicit)
        except ValueError as err:
            raise UsageError(f"--roofline: {err}") from None
        why_not = roofline_mismatch(roofline, device_name, settings)
        if why_not:
            raise UsageError(f"--roofline {explicit} does not fit these rungs: {why_not}; give the one "
                             "cost_model/roofline.py wrote for this GPU and these settings")
        return roofline
    path = Path(out) / ROOFLINE_NAME
    if not path.exists():
        return shipped_roofline(device_name, settings, say) or _no_roofline(device_name, path, say)
    try:
        roofline = read_roofline(path)
    except ValueError as err:
        say(f"No ceiling column: {err}")
        return None
    why_not = roofline_mismatch(roofline, device_name, settings)
    if why_not:
        say(f"No ceiling column: {path} does not fit these rungs: {why_not}")
        return None
    return roofline


def attach_ceilings(report, roofline):
    """Each row's ceiling and measured / ceiling, or no such keys at all without a roofline."""
    if roofline is None:
        return
    report["roofline"] = {"path": repository_path(roofline["path"]), "gpu": roofline["gpu"],
                          "fitted_on": roofline.get("fitted_on")}
    for row in report["rungs"]:
        row["predicted_tok_per_sec"] = roofline.get("predictions", {}).get(row["rung"])
        ceiling = roofline["ceilings"].get(row["rung"])
        row["ceiling_tok_per_sec"] = ceiling
        row["fraction_of_ceiling"] = row["tokens_per_sec"] / ceiling if ceiling and row["tokens_per_sec"] else None


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------

UNSTEADY = 2  # timing windows whose tok/s differ by this factor: something else shared the machine
APART = 0.1  # a --check-scripts run this far from its rung's tok/s: one of the two is off


def unsteady(row):
    """["unsteady: ..."] for a row whose fastest timing window was UNSTEADY times its slowest or more: a median of
    such windows depends on what else ran (a shared CPU, another job on the GPU); [] for a steady one."""
    slowest, fastest = row.get("tokens_per_sec_min"), row.get("tokens_per_sec_max")
    if not slowest or not fastest or fastest < UNSTEADY * slowest:
        return []
    return [f"unsteady: its windows differ {fastest / slowest:.1f}x (other work on this machine?), so the median "
            "may mislead: measure it again"]


def check_notes(check):
    """The notes of a --check-scripts row: unsteady windows, and a script and rung apart by more than APART."""
    notes = unsteady(check)
    ratio = check.get("script_over_rung")
    if ratio and abs(ratio - 1) > APART:
        notes.append(f"the script and its rung differ by {abs(ratio - 1):.0%}: the same code should time alike "
                     f"(within {APART:.0%}), so one of the two ran slow: measure both again")
    return notes


def _number(value, digits=0, suffix=""):
    return "—" if value is None else f"{value:,.{digits}f}{suffix}"


def rung_ranges(numbers, dash="–", separator=", "):
    """[0, 1, 2, 5, 11, 12] -> '0–2, 5, 11–12' (with dash="-" and separator=",": '0-2,5,11-12', as --rungs takes
    them)."""
    ranges = []
    for number in sorted(numbers):
        if ranges and number == ranges[-1][1] + 1:
            ranges[-1][1] = number
        else:
            ranges.append([number, number])
    return separator.join(str(first) if first == last else f"{first}{dash}{last}" for first, last in ranges)


def ratio_label(row):
    """The row's speed-ups, each naming the rung it is measured against: '1.02× rung 5 · 2.31× rung 0'."""
    parts = []
    if row.get("speedup_vs_previous"):
        parts.append(f"{row['speedup_vs_previous']:.2f}× rung {row['previous_rung']}")
    if row.get("speedup_vs_baseline") and row["rung"] != 0 and row.get("previous_rung") != 0:
        parts.append(f"{row['speedup_vs_baseline']:.2f}× rung 0")
    return " · ".join(parts)


def reference_cells(row, settings):
    """The reference tok/s and reserved GiB; where the row's batch is not the reference's, the cells say its batch.
    A --tiny table or another --model leaves them empty: the reference trained GPT-2 small at full size."""
    if settings["tiny"] or settings.get("model", "gpt2-small") != "gpt2-small":
        return "—", "—"
    reference = row["reference"]
    batch = row.get("batch_size")
    other_batch = batch is not None and reference.get("batch_size") is not None and batch != reference["batch_size"]
    suffix = f" (at batch {reference['batch_size']})" if other_batch and reference["tokens_per_sec"] else ""
    return _number(reference["tokens_per_sec"]) + suffix, _number(reference["reserved_gb"], 2) + suffix


def describe_model(settings):
    model = "the stages' --tiny model" if settings["tiny"] else settings.get("model", "gpt2-small")
    batch = (f"--batch-size {settings['batch_size']} for every rung" if settings.get("batch_size")
             else "each stage's own batch")
    options = f", with --option {settings['options']} on every rung" if settings.get("options") else ""
    return f"{model}, {batch}{options}"


def render_markdown(report):
    settings = report["settings"]
    tiny = settings["tiny"]
    rows = report["rungs"]
    ceilings = report.get("roofline")
    predicted = bool(ceilings and ceilings.get("fitted_on"))
    lines = [
        f"# Benchmark ladder: {report['device_name']}" + (" (--tiny)" if tiny else ""),
        "",
        f"- Device: {report['device']}" + (f", {report['gpu_count']} visible" if report["gpu_count"] else ""),
        f"- Driver: {report['driver'] or 'n/a'} | CUDA: {report['cuda'] or 'n/a'} | PyTorch: {report['torch']} "
        f"| Python: {report['python']}",
        f"- Model: {describe_model(settings)}",
        f"- Measured in {len(report.get('parts', []))} part(s), each row dated in its \"measured (UTC)\" column:",
    ]
    for part in report.get("parts", []):
        measured = f"rungs {rung_ranges(part['rungs'])}" if part["rungs"] else "script checks"
        lines.append(f"  - {measured}: `{part['command']}`, started {part['started_at']}, code {part['git'] or 'n/a'}")
    lines += [
        f"- Each rung: a fresh process, corpus `{settings['data']}`, seed {settings['seed']}, "
        f"warm-up steps: {settings['warmup_steps']} (not timed), then {settings['steps']} steps timed in "
        f"{settings['windows']} window(s) that leave out the first step of each epoch where epochs are long "
        "enough; data loading on the clock, no evaluation.",
        "",
        "| rung | change | tok/s (median) | min – max | × row above | × rung 0 | MFU | peak alloc. GiB "
        "| peak reserved GiB (warm-up's) | final loss | " + ("measured / ceiling | " if ceilings else "")
        + ("predicted tok/s (error: predicted / measured - 1) | " if predicted else "")
        + "reference tok/s | reference reserved GiB | measured (UTC) | notes |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | " + ("---: | " if ceilings else "")
        + ("---: | " if predicted else "")
        + "---: | ---: | --- | --- |",
    ]
    for row in rows:
        spread = ("—" if row["tokens_per_sec"] is None else
                  f"{row['tokens_per_sec_min']:,.0f} – {row['tokens_per_sec_max']:,.0f}")
        above = (f"{row['speedup_vs_previous']:.2f}× rung {row['previous_rung']}" if row["speedup_vs_previous"]
                 else "—")
        notes = list(row.get("notes") or []) + unsteady(row)
        if row["error"]:
            notes.insert(0, f"**failed:** {row['error']}")
        cells = [
            str(row["rung"]), row["change"], _number(row["tokens_per_sec"]), spread, above,
            _number(row["speedup_vs_baseline"], 2, "×"),
            _number(None if row["mfu"] is None else 100 * row["mfu"], 1, "%"),
            _number(row["peak_allocated_gb"], 2), _number(row["peak_reserved_gb"], 2)
            + ("" if row.get("first_interval_peak_reserved_gb") is None
               else f" ({row['first_interval_peak_reserved_gb']:.2f})"), _number(row["final_loss"], 3),
        ]
        if ceilings:
            ceiling, fraction = row.get("ceiling_tok_per_sec"), row.get("fraction_of_ceiling")
            cells.append("—" if ceiling is None else
                         f"{'—' if fraction is None else f'{100 * fraction:.0f}%'} of {ceiling:,.0f}")
        if predicted:
            forecast, measured = row.get("predicted_tok_per_sec"), row["tokens_per_sec"]
            cells.append("—" if forecast is None else f"{forecast:,.0f}" + (
                f" ({100 * (forecast / measured - 1):+.0f}%)" if measured else ""))
        cells += [*reference_cells(row, settings), (row.get("measured_at") or "—")[:16],
                  "; ".join(notes).replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "tok/s: median over the timing windows (min – max beside it); rungs 11 and 12: all processes together, "
        "from the stage's own per-interval `Step tok/sec` after the warm-up. × row above: over the row above in "
        "this table, which the cell names (with a subset of rungs, not always the rung just before). "
        "MFU: per GPU, against the dense peak of the rung's precision (fp32, TF32 from rung 2 on Ampere and "
        "newer, bf16 from rung 5, fp16 on compute capability 7.x), FLOPs per token for the 50,257-token "
        "vocabulary; none on a CPU. Memory: the allocator's peaks (`torch.cuda.max_memory_allocated/reserved`) "
        "counted from the end of the warm-up, where the counters are reset (rungs 11 and 12: rank 0's, from the end "
        "of the stage's first log interval, its step 0); in brackets, the reserved peak before that reset "
        "(compilation included); a row without brackets kept one peak for its whole run; none on a CPU. Final "
        "loss: the last measured step's training loss (rungs 11 and 12: the stage's evaluation at its last step).",
        "",
    ]
    if ceilings:
        lines += [f"Measured / ceiling: the rung's median tok/s over the ceiling that cost_model/roofline.py modelled "
                  f"for it on the {ceilings['gpu']} (`{ceilings['path']}`)." + (
                      " Predicted: its cost_model/roofline.py --predict, a model fitted on " + ceilings["fitted_on"] +
                      "; in brackets its error, predicted / measured - 1 (+20%: predicted 20% faster than "
                      "measured; the cost model's own measure), which a --profile of the rung places in a class of "
                      "work."
                      if predicted else ""), ""]
    not_comparable = ("for the full-size model, so not comparable with a --tiny run" if tiny else
                      f"for gpt2-small, so not comparable with {settings['model']}"
                      if settings.get("model", "gpt2-small") != "gpt2-small" else "")
    lines += [
        f"Reference columns: the {report['reference_source']}; steps 0–7 are its `Avg tok/sec`, 8–11 its "
        "`Step tok/sec` at the end of epoch 1, reserved memory is `torch.cuda.memory_reserved()` after "
        "epoch 1; it had no rung 12. Quoted, not measured here" + (f"; left empty, as they are {not_comparable}."
                                                                     if not_comparable else ".")
        + " They were taken at batch 8 for rungs 0–9 and 32 per GPU for 10–11: they compare only with a row of the "
        "same batch, and where --batch-size made a row's batch another, its reference cells name the batch they "
        "were taken at.",
        "",
    ]
    lines += without_options_lines(report)
    if report.get("script_checks"):
        lines += [
            "Cross-check (`--check-scripts`): the stage scripts run as they are, with the same warm-up and "
            "steps, timed by their own clock (their per-interval `Step tok/sec`, evaluation left out).",
            "",
            "| script | its own tok/s (median) | min – max | rung | rung tok/s | script / rung | notes |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for check in report["script_checks"]:
            spread = ("—" if check["tokens_per_sec"] is None else
                      f"{check['tokens_per_sec_min']:,.0f} – {check['tokens_per_sec_max']:,.0f}")
            lines.append(f"| {check['script']} | {_number(check['tokens_per_sec'])} | {spread} | {check['rung']} | "
                         f"{_number(check['rung_tokens_per_sec'])} | {_number(check['script_over_rung'], 2, '×')} | "
                         + "; ".join([f"**failed:** {check['error']}"] if check["error"] else check_notes(check))
                         + " |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The chart
# ---------------------------------------------------------------------------------------------

def whisker_extents(rows):
    """How far each bar's whisker reaches below and above its median: to the slowest and the fastest timed window
    (matplotlib's xerr); nothing for a failed rung."""
    below = [row["tokens_per_sec"] - row["tokens_per_sec_min"] if row["tokens_per_sec"] else 0 for row in rows]
    above = [row["tokens_per_sec_max"] - row["tokens_per_sec"] if row["tokens_per_sec"] else 0 for row in rows]
    return below, above


def plot_ladder(report, path):
    """Two panels side by side: throughput per rung (median, whiskers from the slowest to the fastest window) and
    peak reserved GPU memory per rung."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = report["rungs"]
    labels = [f"{row['rung']}  {SHORT_NAMES[row['rung']]}" for row in rows]
    positions = list(range(len(rows)))
    colors = [{11: "tab:orange", 12: "tab:green"}.get(row["rung"], "tab:blue") for row in rows]
    figure, (speed_axis, memory_axis) = plt.subplots(1, 2, figsize=(14, 0.45 * len(rows) + 2.2), sharey=True)

    speeds = [row["tokens_per_sec"] or 0 for row in rows]
    speed_axis.barh(positions, speeds, color=colors, xerr=whisker_extents(rows), capsize=3,
                    error_kw={"elinewidth": 1, "ecolor": "black"})
    top_speed = max([row["tokens_per_sec_max"] or 0 for row in rows] + speeds) or 1
    for position, row in zip(positions, rows):
        if row["tokens_per_sec"] is None:
            speed_axis.text(top_speed * 0.01, position, "failed", va="center", color="tab:red", fontsize=9)
            continue
        ratios = ratio_label(row)
        speed_axis.text(row["tokens_per_sec_max"], position, f"  {row['tokens_per_sec']:,.0f}"
                        + (f"  ({ratios})" if ratios else ""), va="center", fontsize=9)
    speed_axis.set_xlim(0, top_speed * 1.6)
    speed_axis.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:,.0f}"))
    speed_axis.set_xlabel("training tokens per second: median, whiskers from the slowest to the fastest window "
                          "(rungs 11-12: all GPUs)", fontsize=9)
    speed_axis.set_title("Throughput per rung (higher is better)")
    speed_axis.set_yticks(positions, labels)
    speed_axis.invert_yaxis()  # rung 0 on top

    reserved = [row["peak_reserved_gb"] for row in rows]
    if any(value is not None for value in reserved):
        memory_axis.barh(positions, [value or 0 for value in reserved], color=colors)
        top_memory = max(value or 0 for value in reserved) or 1
        for position, value in zip(positions, reserved):
            memory_axis.text(value or 0, position, " n/a" if value is None else f" {value:.2f}", va="center",
                             fontsize=9)
        memory_axis.set_xlim(0, top_memory * 1.25)
    else:
        memory_axis.text(0.5, 0.5, "no GPU memory statistics\n(this run was on a CPU)", ha="center",
                         va="center", transform=memory_axis.transAxes, fontsize=11, color="gray")
        memory_axis.set_xticks([])
    memory_axis.set_xlabel("peak reserved GPU memory, GiB (rungs 11-12: rank 0)")
    memory_axis.set_title("GPU memory per rung (lower is better)")

    settings = report["settings"]
    dates = sorted(part["started_at"][:10] for part in report.get("parts", [])) or [report["date"][:10]]
    when = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    figure.suptitle(f"Benchmark ladder on {report['device_name']}{' (--tiny)' if settings['tiny'] else ''} | "
                    f"{describe_model(settings)} | PyTorch {report['torch']} | {when}", fontsize=11)
    figure.tight_layout()
    files.save_atomically(lambda tmp: figure.savefig(tmp, dpi=120, format="png"), path)
    plt.close(figure)


# ---------------------------------------------------------------------------------------------
# Writing the three files
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# An option's folder beside the same rungs without it
# ---------------------------------------------------------------------------------------------

def rungs_without_options(report, out):
    """{rung: (row, folder)}: for a folder measured with --option, the same rungs measured without any, from the
    folders beside it whose rows match in everything else (GPU, PyTorch, CUDA, every setting); the newest row of each
    rung. Empty for a folder measured without options."""
    if not report["settings"].get("options"):
        return {}
    out = Path(out).resolve()
    here = {key: report[key] for key in ("device_name", "gpu_count", "torch", "cuda")}
    here["settings"] = {**report["settings"], "options": None}
    found = {}
    for folder in sorted(path for path in out.parent.iterdir() if path != out and (path / rows.FOLDER).is_dir()):
        try:
            candidates = rows.read_rows(folder, "ladder.json")
        except UsageError:  # not a ladder's rows, or an older version's folder: nothing to compare with
            continue
        for name, row in candidates.items():
            if (name.startswith("rung-") and row.get("tokens_per_sec") and not row["context"]["settings"].get("options")
                    and not rows.differences(row["context"], here, MATCHED)):
                if row["rung"] not in found or row["measured_at"] > found[row["rung"]][0]["measured_at"]:
                    found[row["rung"]] = (row, folder)
    return found


def attach_without_options(report, out):
    """Each rung of an option's folder gets the same rung without the option (its tok/s, reserved memory, date and
    folder) and the ratio, where the folders beside it hold one (rungs_without_options)."""
    found = rungs_without_options(report, out)
    for row in report["rungs"]:
        row.pop("without_options", None)
        match = found.get(row["rung"]) if row.get("tokens_per_sec") else None
        if match:
            other, folder = match
            row["without_options"] = {"tokens_per_sec": other["tokens_per_sec"], "mfu": other.get("mfu"),
                                      "peak_reserved_gb": other.get("peak_reserved_gb"),
                                      "measured_at": other["measured_at"],
                                      "folder": repository_path(folder),
                                      "ratio": row["tokens_per_sec"] / other["tokens_per_sec"]}


def hours_between(first, second):
    """Hours between two of timestamp()'s strings ("2026-11-26 02:08:24 UTC")."""
    moments = [datetime.strptime(text, "%Y-%m-%d %H:%M:%S UTC") for text in (first, second)]
    return abs((moments[0] - moments[1]).total_seconds()) / 3600


def without_options_lines(report):
    """The Markdown section that sets an option's rungs beside the same rungs without it; none where none is known."""
    pairs = [row for row in report["rungs"] if row.get("without_options")]
    if not pairs:
        return []
    folders = sorted({row["without_options"]["folder"] for row in pairs})
    apart = max(hours_between(row["measured_at"], row["without_options"]["measured_at"]) for row in pairs)
    lines = [f"Against the same rungs without `--option`, from `{'`, `'.join(folders)}` (the same GPU, PyTorch, "
             "CUDA and settings):", "",
             "| rung | tok/s with | tok/s without | with / without | peak reserved GiB with / without "
             "| measured with / without (UTC) |", "| ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in pairs:
        other = row["without_options"]
        lines.append(f"| {row['rung']} | {_number(row['tokens_per_sec'])} | {_number(other['tokens_per_sec'])} | "
                     f"{other['ratio']:.3f}× | {_number(row['peak_reserved_gb'], 2)} / "
                     f"{_number(other['peak_reserved_gb'], 2)} | {row['measured_at'][:16]} / "
                     f"{other['measured_at'][:16]} |")
    lines += ["", f"Each side is its own command, the two up to {apart:.1f} h apart: a ratio of a few percent may be "
                  "the two commands' difference (another machine of the kind, another moment) rather than the "
                  "option's. To settle one, measure the rung into both folders in one session, one command after "
                  "the other.", ""]
    return lines


def write_report(report, out, roofline=None, chart=True):
    """ladder.json, ladder.md and (unless `chart` is off) ladder.png in `out`, from collect()'s report; returns the
    table."""
    out = Path(out)
    attach_ceilings(report, roofline)
    attach_without_options(report, out)
    files.write_json(out / "ladder.json", report)
    markdown = render_markdown(report)
    files.write_atomically(out / "ladder.md", markdown.encode("utf-8"))
    if chart:
        plot_ladder(report, out / "ladder.png")
    return markdown


def main(argv=None):
    parser = cli.OneLineParser(prog="bench/report.py", description=__doc__, allow_abbrev=False,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", metavar="RESULTS_FOLDER", help="a folder that bench/ladder.py wrote (--out)")
    parser.add_argument("--roofline", metavar="PATH",
                        help=f"cost_model/roofline.py's {ROOFLINE_NAME} for this GPU (default: the one in the folder, "
                             "if it models the same GPU)")
    args = parser.parse_args(argv)
    try:
        found = rows.read_rows(args.results, "ladder.json")
        if not found:
            raise UsageError(f"{Path(args.results) / rows.FOLDER} holds no rows: measure them with bench/ladder.py "
                             f"--out {args.results}")
        report = collect(found)
        roofline = find_roofline(args.results, args.roofline, report["device_name"], report["settings"])
        write_report(report, args.results, roofline)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return failures.EXIT_USAGE
    print(f"Wrote {Path(args.results) / 'ladder.md'}, ladder.json and ladder.png")
    return failures.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
