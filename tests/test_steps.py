"""python -m bench.steps N: a step's tagged code against what it replaces, its rung's parts, its measured rows.

Each test reads the stage files and committed results as they are, without torch: a second or less in all."""

import json
import re

import pytest
from conftest import ROOT, run_script

from bench import steps

H200 = ROOT / "bench" / "results" / "nvidia-h200"


def page(number, results=H200):
    return "\n".join(steps.describe(number, results))


@pytest.mark.parametrize("label, named", [("step 7", {7}), ("steps 3-5, 8", {3, 4, 5, 8}),
                                          ("step 5, float16 only", {5}), ("steps 3-5", {3, 4, 5}),
                                          ("DDP", {11}), ("FSDP", {12}), ("accumulation", set())])
def test_a_tag_names_its_steps(label, named):
    assert steps.tag_steps(label) == named


def test_step_7_shows_the_sdpa_call_beside_the_attention_it_replaces():
    text = page(7)
    assert "F.scaled_dot_product_attention(queries, keys, values, is_causal=True," in text
    assert "dropout_p=" in text  # the rest of the call's statement, under its tag comment
    removed = [line for line in text.splitlines() if line.startswith("-")]
    assert any("torch.softmax(scores" in line for line in removed), "00's attention is the 'before'"
    assert any(line.startswith("+") and "NEW (step 7)" in line for line in text.splitlines())


def test_step_9_shows_the_padded_vocabulary():
    text = page(9)
    assert '"vocab_size": 50304' in text and '"vocab_size": 50257' in text  # after and before
    assert "REAL_VOCAB_SIZE" in text


@pytest.mark.parametrize("number", range(1, 11))
def test_every_step_finds_its_tagged_lines_in_01(number):
    lines = (ROOT / "01_opt_single_gpu.py").read_text().splitlines()
    marked = steps.tagged_blocks(lines, number)
    # the lines whose own tag names the step, found without tagged_blocks: each is among the lines it marks
    tagged = {index for index, line in enumerate(lines)
              if any(number in steps.tag_steps(label) for label in steps.TAG.findall(line))}
    assert tagged and tagged <= marked, f"step {number}: tagged lines {sorted(tagged - marked)} not marked"
    shown = page(number)
    for index in marked:
        if lines[index].strip():
            assert f"{index + 1:>4}  {lines[index]}".rstrip() in shown  # with its line number in 01


@pytest.mark.parametrize("number", range(1, 13))
def test_a_plus_line_is_never_another_steps_tagged_line(number):
    for line in page(number).splitlines():
        labels = steps.TAG.findall(line)
        if line.startswith("+") and labels:
            assert any(number in steps.tag_steps(label) for label in labels), line


def test_another_steps_lines_in_a_steps_place_are_marked_as_theirs():
    shown = page(5).splitlines()
    pinned = [line for line in shown if "input_batch.pin_memory()" in line]  # step 4's `if` and its body
    assert pinned and all(line.startswith("~") for line in pinned)
    assert any(line.startswith("~") and "def training_loss" in line for line in shown)  # under step 8's decorator
    assert any(line.startswith("+") and "with torch.autocast(" in line for line in shown)  # step 5's own
    # an untagged line goes with the tagged line above it: the split that step 8 makes is step 8's
    assert any(line.startswith("~") and "def forward_and_loss" in line for line in shown)
    assert any(line.startswith("+") and "def forward_and_loss" in line for line in page(8).splitlines())
    # a line another step adds, shown near the step's, is marked as that step's, not as shared context
    assert any(line.startswith("~") and "NEW (step 5): the loss in float32" in line for line in page(4).splitlines())


def test_lines_are_shown_with_both_files_numbers():
    text = page(10)
    old = (ROOT / "00_orig.py").read_text().splitlines()
    before = next(number for number, line in enumerate(old, 1) if '"batch_size": 8,' in line)
    assert any(line.startswith(f"- {before:>4}") and '"batch_size": 8,' in line for line in text.splitlines())
    assert "@@ 00_orig.py" in text and "01_opt_single_gpu.py" in text


def test_the_rung_s_parts_come_from_rungs_py_s_own_table():
    import bench.rungs

    tables = steps.rungs_tables()
    assert tables["RUNG_PARTS"] == bench.rungs.RUNG_PARTS and tables["CHANGES"] == bench.rungs.CHANGES
    assert tables["MULTI_PROCESS_RUNGS"] == bench.rungs.MULTI_PROCESS_RUNGS
    covered = sorted(step for part in tables["RUNG_PARTS"].values() for step in part["steps"])
    assert covered == list(range(1, 11)), "every step lies in one part"
    rung_7 = "\n".join(steps.composition(7, tables))
    from_01, from_00 = rung_7.split("from 00_orig.py:")
    assert "model: GPTModel" in from_01 and "loss path" in from_01 and "without step 8" in from_01
    assert "model config: GPT_CONFIG_124M" in from_00 and "settings" in from_00
    assert "step 1 (causal mask made on the fly) put into it" in "\n".join(steps.composition(1, tables))


def test_the_measured_row_appears_with_the_ratio_over_the_rung_before():
    row = json.loads((H200 / "rows" / "rung-07.json").read_text())
    before = json.loads((H200 / "rows" / "rung-06.json").read_text())
    text = page(7)
    assert f"{row['tokens_per_sec']:,.0f} tok/s" in text
    assert f"{row['tokens_per_sec'] / before['tokens_per_sec']:.2f}x rung 6" in text
    assert f"{row['peak_reserved_gb']:.2f} GiB" in text and "NVIDIA H200" in text
    assert row["measured_at"].split(" ")[0] in text


def test_a_folder_without_the_row_says_so(tmp_path):
    assert "no results folder" in "\n".join(steps.measured(7, tmp_path))


def test_the_command_prints_step_7_without_importing_torch():
    done = run_script("-X", "importtime", "-m", "bench.steps", "7", timeout=60)
    assert done.returncode == 0, done.stderr
    assert "scaled_dot_product_attention" in done.stdout and "Measured by bench/ladder.py" in done.stdout
    assert not re.search(r"\|\s+torch(\.|$)", done.stderr, re.MULTILINE)  # -X importtime lists every import


@pytest.mark.parametrize("argument", ["99", "abc", "-1"])
def test_a_step_that_does_not_exist_exits_2_with_one_line(argument):
    done = run_script("-m", "bench.steps", argument, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "the steps are 0" in done.stderr, done.stderr


def test_a_results_folder_that_is_not_there_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        steps.main(["3", "--results", str(tmp_path / "nope")])
    assert stopped.value.code == 2 and "no such folder" in capsys.readouterr().err


def test_a_removed_line_goes_to_the_step_whose_line_replaces_it():
    # one hunk of the diff holds step 1's mask line and step 7's dropout line side by side
    def marks(number, text):
        return {line[0] for line in page(number).splitlines() if text in line and line[:1] in "-~"}

    assert marks(1, 'self.register_buffer("mask"') == {"-"} and marks(1, "nn.Dropout(dropout)") == {"~"}
    assert marks(7, 'self.register_buffer("mask"') == {"~"} and marks(7, "nn.Dropout(dropout)") == {"-"}
