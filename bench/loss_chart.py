"""The picture at the top of the README: validation loss against training seconds, stage 00 beside stage 01.

  python -m bench.loss_chart                                      # the H200 runs committed in this repository
  python -m bench.loss_chart bench/results/<gpu>/stages --out docs/images/loss_against_time.png

It reads two end-to-end runs that bench/stages.py keeps in a results folder's stages/ (runs/00/metrics.json:
`python 00_orig.py --max-steps 200`; runs/01-warm/metrics.json: `python 01_opt_single_gpu.py`, its compiled code
loaded from the cache an earlier run filled) and the row files beside them (rows/<run>.json: the batch, the
command, the date). Each log entry of a metrics.json covers one interval between evaluations: its "timed_tokens"
trained at its "step_tok_per_sec", a clock that leaves evaluation and sampling out, so the interval took
timed_tokens / step_tok_per_sec seconds of training. Summed, they place each validation loss on a time axis. The
first interval holds the warm-up (and 01's loading of its compiled code): it is on the clock, as it is for the
user who runs the stage.

Exit code 0 when the picture is written; 2 with one line for a folder without the two runs.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # cli and data, wherever the script is started from

import cli  # noqa: E402  (imports no torch)
import failures  # noqa: E402
from data import files  # noqa: E402
from failures import UsageError  # noqa: E402

STAGES = ROOT / "bench" / "results" / "nvidia-h200" / "stages"
OUT = ROOT / "docs" / "images" / "loss_against_time.png"
RUNS = {"00": "#888888", "01-warm": "#1f77b4"}  # bench/stages.py's runs, and the colour of each line


def loss_curve(metrics):
    """(training seconds, validation loss) at each evaluation of a run's metrics.json (a dict): the seconds are the
    sum of every interval's timed_tokens / step_tok_per_sec up to that evaluation."""
    seconds, losses, clock = [], [], 0.0
    for entry in metrics["log"]:
        clock += entry["timed_tokens"] / entry["step_tok_per_sec"]
        seconds.append(clock)
        losses.append(entry["val_loss"])
    return seconds, losses


def read_run(stages, run):
    """A run's metrics.json and row, with its curve: a dict; a UsageError when the folder lacks it."""
    metrics_path, row_path = Path(stages) / "runs" / run / "metrics.json", Path(stages) / "rows" / f"{run}.json"
    try:
        metrics = json.loads(metrics_path.read_text(encoding="utf-8"))
        row = json.loads(row_path.read_text(encoding="utf-8"))
        seconds, losses = loss_curve(metrics)
    except FileNotFoundError as err:
        raise UsageError(f"{err.filename} does not exist: give the stages/ folder of a results folder that "
                         f"bench/stages.py filled (runs {' and '.join(RUNS)})") from None
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as err:
        raise UsageError(f"{metrics_path} or {row_path} is not what bench/stages.py writes "
                         f"({type(err).__name__}: {err})") from None
    return {"run": run, "metrics": metrics, "row": row, "seconds": seconds, "losses": losses}


def label(run):
    metrics, row = run["metrics"], run["row"]
    stage = Path(metrics["script"]).stem.split("_")[0]
    return (f"{stage}: batch {row['batch_size']}, {metrics['precision']}, {metrics['steps']} steps, "
            f"{tokens(metrics['tokens_seen'])} tokens, the run's Avg {metrics['avg_tok_per_sec']:,.0f} tok/s")


def tokens(count):
    """A token count as a legend reads it: 7.2M for a full run, 25,600 for a --tiny one (not 0.0M)."""
    return f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count:,}"


def time_to_reach(run, loss):
    """The training seconds at which a run's validation loss first reaches `loss`, interpolated linearly between its
    two evaluations around it (an estimate: the loss is only known at evaluations); None when it never does."""
    points = list(zip(run["seconds"], run["losses"]))
    for (before_seconds, before_loss), (seconds, reached) in zip(points, points[1:]):
        if reached <= loss < before_loss:
            return before_seconds + (seconds - before_seconds) * (before_loss - loss) / (before_loss - reached)
    return None


def title(runs):
    """GPU, PyTorch and the date(s) the runs were measured on."""
    devices = dict.fromkeys(run["metrics"]["device"].split(" (")[0] for run in runs)
    versions = dict.fromkeys(run["metrics"]["torch"] for run in runs)
    dates = dict.fromkeys(run["row"]["context"]["command"]["started_at"].split(" ")[0] for run in runs)
    return f"{' / '.join(devices)}, PyTorch {' / '.join(versions)}, {' / '.join(dates)}"


def render(stages, out):
    """Draw the chart of the runs in `stages` into `out` (a PNG); return the runs drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_run(stages, run) for run in RUNS]
    fig, axes = plt.subplots(figsize=(6, 3.5))
    for run, offset, align in zip(runs, ((-4, 11), (6, -3)), ("right", "left")):
        color = RUNS[run["run"]]
        axes.plot(run["seconds"], run["losses"], "o-", color=color, markersize=3, linewidth=1.6, label=label(run))
        end = (run["seconds"][-1], run["losses"][-1])
        axes.annotate(f"{end[1]:.2f} after {end[0]:.0f} s", end, textcoords="offset points", xytext=offset,
                      ha=align, va="center", fontsize=8, color=color)
    baseline, optimized = runs
    target = baseline["losses"][-1]
    reached = time_to_reach(optimized, target)
    if reached is not None:  # where 01 reaches the loss 00 ended with
        axes.axhline(target, color=RUNS[baseline["run"]], linestyle=":", linewidth=1)
        axes.annotate(f"00's last loss, reached by 01 after ~{reached:.0f} s", (reached, target),
                      textcoords="offset points", xytext=(4, 5), fontsize=8, color=RUNS[optimized["run"]])
    axes.set_xlim(left=0)
    axes.set_xlabel("training seconds (evaluation off the clock; the first interval includes warm-up and compilation)",
                    fontsize=8)
    axes.set_ylabel("validation loss", fontsize=9)
    axes.set_title(f"Validation loss against training time: {title(runs)}", fontsize=9)
    axes.tick_params(labelsize=8)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    try:
        files.save_atomically(lambda tmp: fig.savefig(tmp, dpi=120, format="png"), out)
    finally:
        plt.close(fig)
    return runs


def build_parser():
    parser = cli.OneLineParser(prog="python -m bench.loss_chart", description=__doc__, allow_abbrev=False,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stages", nargs="?", default=STAGES, metavar="RESULTS_STAGES_FOLDER",
                        help="a results folder's stages/ (default: bench/results/nvidia-h200/stages)")
    parser.add_argument("--out", default=OUT, help="the PNG to write (default: docs/images/loss_against_time.png)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        runs = render(args.stages, args.out)
    except OSError as err:
        raise UsageError(f"cannot write {args.out} ({err.strerror or err}): choose another --out") from None
    for run in runs:
        print(f"{run['run']}: validation loss {run['losses'][-1]:.3f} after {run['seconds'][-1]:.1f} training seconds")
    print(f"Wrote {args.out}")


if __name__ == "__main__":
    sys.exit(failures.process_done(failures.run(main)))
