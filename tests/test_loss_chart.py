"""python -m bench.loss_chart: the README's picture of validation loss against training seconds, 00 beside 01.

Rendered from the committed H200 runs into a temporary folder: about a second (matplotlib, no torch)."""

import shutil

import pytest
from conftest import ROOT

from bench import loss_chart

STAGES = ROOT / "bench" / "results" / "nvidia-h200" / "stages"


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    out = tmp_path_factory.mktemp("chart") / "loss.png"
    runs = {run["run"]: run for run in loss_chart.render(STAGES, out)}
    return runs, out


def test_the_seconds_are_the_sum_of_each_interval_s_tokens_over_its_speed():
    metrics = {"log": [{"timed_tokens": 100, "step_tok_per_sec": 50, "val_loss": 9.0},
                       {"timed_tokens": 300, "step_tok_per_sec": 100, "val_loss": 7.0}]}
    assert loss_chart.loss_curve(metrics) == ([2.0, 5.0], [9.0, 7.0])


def test_01_reaches_a_lower_loss_in_fewer_training_seconds_than_00(drawn):
    runs, _ = drawn
    baseline, optimized = runs["00"], runs["01-warm"]
    for run in runs.values():
        seconds = run["seconds"]
        assert all(later > earlier for earlier, later in zip(seconds, seconds[1:])) and seconds[0] > 0
        assert len(seconds) == len(run["metrics"]["log"])
    assert optimized["losses"][-1] < baseline["losses"][-1]
    assert optimized["seconds"][-1] < baseline["seconds"][-1]
    reached = loss_chart.time_to_reach(optimized, baseline["losses"][-1])
    assert reached is not None and reached < optimized["seconds"][-1]


def test_the_picture_is_a_small_png_and_its_labels_carry_the_runs_figures(drawn):
    runs, out = drawn
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) < 100_000
    label = loss_chart.label(runs["01-warm"])
    assert "batch 32" in label and "bf16" in label and f"{runs['01-warm']['metrics']['avg_tok_per_sec']:,.0f}" in label
    assert loss_chart.title(list(runs.values())) == "NVIDIA H200, PyTorch 2.11.0+cu130, 2026-11-26"
    assert loss_chart.tokens(7_209_984) == "7.2M" and loss_chart.tokens(25_600) == "25,600"  # a --tiny run's: not 0.0M


def test_the_readme_s_picture_is_committed_and_small():
    committed = ROOT / "docs" / "images" / "loss_against_time.png"
    assert committed.exists() and committed.stat().st_size < 100_000


def test_a_folder_without_the_runs_exits_2_with_one_line(tmp_path, capsys):
    shutil.copytree(STAGES / "rows", tmp_path / "rows")
    code = loss_chart.failures.run(lambda: loss_chart.main([str(tmp_path), "--out", str(tmp_path / "x.png")]))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "metrics.json does not exist" in err, err
    assert not (tmp_path / "x.png").exists()
