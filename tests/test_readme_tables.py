"""bench/readme_tables.py: a results folder's figures go into docs/results.md and the README's glance table by a
command, never by hand, and the pages either show no GPU figure at all or exactly those of the folders they name."""


import json
import shutil

import pytest

from bench import readme_tables, stages
from conftest import ROOT
from test_ladder import hand_made_rows, write_rows

# rung: (median tok/s or None for a failed rung, peak reserved GiB), as a GPU's ladder could give them
SPEEDS = {0: (20_000.0, 30.1), 1: (20_050.0, 30.0), 2: (41_000.0, 30.0), 3: (43_000.0, 30.0), 4: (42_900.0, 30.0),
          5: (70_000.0, 16.2), 6: (None, None), 7: (150_000.0, 8.0), 8: (210_000.0, 8.5), 9: (230_000.0, 8.4),
          10: (300_000.0, 15.9), 11: (297_000.0, 16.4), 12: (280_000.0, 12.0)}


def stage_row(name, speed):
    command = {"02": "torchrun --standalone --nproc_per_node=1 02_opt_multi_gpu_ddp.py"}.get(
        name, f"python {'00_orig.py --max-steps 200' if name == '00' else '01_opt_single_gpu.py'}")
    return {"run": name, "command": command, "command_seconds": 50.0, "error": None, "steps": 200,
            "tokens_seen": 1_638_400, "avg_tok_per_sec": speed, "mfu": 0.4123, "reserved_gb": 15.87,
            "peak_reserved_gb": 16.0, "world_size": 1, "precision": "bf16", "batch_size": 32, "final_val_loss": 6.2,
            "wall_clock_s": {"start-up": 4.0, "compilation": 30.5, "training": 12.0, "evaluation": 2.0,
                             "sampling": 0.5, "checkpoints and outputs": 1.0, "total": 50.0}}


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A results folder as a GPU machine's commands leave it: the ladder's rows, and the stages' rows from
    bench/stages.py itself (its runs faked)."""
    out = tmp_path / "nvidia-x"
    write_rows(out, hand_made_rows(SPEEDS))
    speeds = {"00": 20_500.0, "01-cold": 301_000.0, "01-warm": 303_000.0, "02": 299_000.0}
    monkeypatch.setattr(stages, "measure", lambda name, args, where: stage_row(name, speeds[name]))
    monkeypatch.setattr(stages, "describe_device", lambda args: {
        "device_type": "cuda", "description": "NVIDIA X (compute capability 9.0)", "name": "NVIDIA X", "torch": "2.9.0",
        "cuda": "12.8", "python": "3.12", "slug": "nvidia-x"})
    assert stages.main(["--out", str(out / "stages")]) == 0
    return out


@pytest.fixture
def readme(tmp_path):
    """A copy of the results page (the fixture's name is the page's old home), and of the README beside it."""
    (tmp_path / "README.md").write_text((ROOT / "README.md").read_text(encoding="utf-8"), encoding="utf-8")
    path = tmp_path / "results.md"
    path.write_text((ROOT / "docs" / "results.md").read_text(encoding="utf-8"), encoding="utf-8")
    return path


def pages(folder, readme):
    """The flags that point the command at the copies and at the folder's parent for the glance table."""
    return [str(folder), "--page", str(readme), "--readme", str(readme.parent / "README.md"),
            "--results", str(folder.parent)]


def test_a_folder_fills_the_table_the_paragraph_and_the_results(folder, readme, capsys):
    assert readme_tables.main(pages(folder, readme)) == 0
    text = readme.read_text(encoding="utf-8")
    cells = readme_tables.measured_cells(text)
    assert cells[0] == "20,000, 30.10" and cells[1] == "20,050, 30.00 (1.00×)" and cells[2] == "41,000, 30.00 (2.04×)"
    assert cells[6] == "failed (see the ladder)" and cells[7] == "150,000, 8.00"  # no ratio across a failed row
    assert cells[10] == "300,000, 15.90 (1.30×)"
    paragraph = readme_tables.block(text, readme_tables.LADDER_BLOCK)
    assert "NVIDIA X, PyTorch 2.9.0, CUDA 12.8, driver 570.00, 2026-01-01" in paragraph
    assert ("All ten steps: 15.00× step 0 (the original tutorial: 11.35× on its A100); step 10 at 30.0% MFU."
            in paragraph)
    assert ("Did not pay on this GPU (under 2% over the step above): step 1 (mask on the fly) 1.00×, step 4 "
            "(pinned memory) 1.00×.") in paragraph  # step 3 paid; the failed step 6 is named as failed
    assert "Failed: step 6" in paragraph
    assert "rung 11 (DDP (02) on 1 GPU) 297,000 tok/s (0.99×)" in paragraph
    assert readme_tables.block(text, readme_tables.CEILINGS_BLOCK) == readme_tables.CEILINGS_PLACEHOLDER  # no roofline
    results = readme_tables.block(text, readme_tables.STAGES_BLOCK)
    assert ("| 01-warm | `python 01_opt_single_gpu.py` | 200 | 32 | 303,000 | 41.2% | 15.87 | 16.00 (n/a) | 6.200 |"
            in results) and "| 01-warm | 50.0 | 4.0 | 30.5 | 12.0 | 2.0 | 0.5 | 1.0 |" in results
    assert "01-warm over 00: 14.780× (target: at least 12×); 02 over 01-warm: 0.987× (target: within 2%)" in results
    # the rest of the README is untouched: emptied again, it is the README as it was, emptied the same way
    assert readme_tables.unfilled(text) == readme_tables.unfilled((ROOT / "docs" / "results.md").read_text(encoding="utf-8"))
    assert readme_tables.named_folder(text) == folder

    glance = readme_tables.block((readme.parent / "README.md").read_text(encoding="utf-8"), readme_tables.GLANCE_BLOCK)
    # the ladder's rows are of 2026-01-01, the whole runs beside them of today: a row names both days
    today = json.loads((folder / "stages" / "stages.json").read_text(encoding="utf-8"))["parts"][0]["date"][:10]
    assert f"| X (2.9.0, 2026-01-01 to {today}) | 01 | 300,000 | 30.0% | 15.90 |" in glance
    assert "| 02, 1 process | 297,000 |" in glance and "50.0 s (compile cache warm), 50.0 s (empty)" in glance
    assert "01 over 00, steady state: 15.00x on the X." in glance
    assert readme_tables.main([*pages(folder, readme), "--check"]) == 0
    readme.write_text(text.replace("| 41,000, 30.00 (2.04×) |", "| 42,000, 30.00 (2.04×) |"), encoding="utf-8")
    capsys.readouterr()
    assert readme_tables.main([*pages(folder, readme), "--check"]) == 1
    err = capsys.readouterr().err
    assert "step 2: the page shows '42,000, 30.00 (2.04×)', the folder gives '41,000, 30.00 (2.04×)'" in err
    assert f"to write the folder's figures: python bench/readme_tables.py {folder}" in err
    other = folder.parent / "nvidia-y"  # another GPU's folder, checked against the page of nvidia-x
    shutil.copytree(folder, other)
    write_rows(other, hand_made_rows({**SPEEDS, 2: (43_000.0, 30.0)}))
    assert readme_tables.main([*pages(other, readme), "--check"]) == 1
    err = capsys.readouterr().err
    assert f"shows {folder}, not {other}: check that folder" in err and "to write the folder's" not in err, err


def test_a_ladder_at_other_settings_is_refused(folder, readme, capsys):
    write_rows(folder, hand_made_rows(SPEEDS, "2026-01-02 00:00:00 UTC", batch_size=8))  # newer: the header's
    before = readme.read_text(encoding="utf-8")
    assert readme_tables.main(pages(folder, readme)) == 2
    assert "measured with --batch-size 8" in capsys.readouterr().err and readme.read_text(encoding="utf-8") == before
    assert readme_tables.main(pages(folder / "stages", readme)) == 2  # no ladder rows there
    write_rows(folder, hand_made_rows(SPEEDS, "2026-01-03 00:00:00 UTC", context_length=2048))
    assert readme_tables.main(pages(folder, readme)) == 2
    assert "measured with --context-length 2048" in capsys.readouterr().err and readme.read_text(encoding="utf-8") == before


def test_the_pages_show_no_gpu_figure_or_those_of_the_folders_they_name():
    text = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    named = readme_tables.named_folder(text)
    if named is None:
        assert text == readme_tables.unfilled(text), "a figure typed into the results page by hand"
    else:
        assert readme_tables.main([str(named), "--check"]) == 0


def test_the_ceilings_table_sets_each_step_beside_its_ceiling():
    """Only steps with a ceiling and a measurement get a row; a step's ratios are over the step just above, and a
    step whose neighbour above failed has none (no ratio across a gap)."""
    rows = [{"rung": 0, "tokens_per_sec": 30_000.0, "ceiling_tok_per_sec": 60_000.0, "fraction_of_ceiling": 0.5},
            {"rung": 1, "tokens_per_sec": 33_000.0, "ceiling_tok_per_sec": 60_000.0, "fraction_of_ceiling": 0.55},
            {"rung": 2, "tokens_per_sec": None, "error": "failed", "ceiling_tok_per_sec": 120_000.0},
            {"rung": 3, "tokens_per_sec": 66_000.0, "ceiling_tok_per_sec": 132_000.0, "fraction_of_ceiling": 0.5},
            {"rung": 11, "tokens_per_sec": 400_000.0, "ceiling_tok_per_sec": 500_000.0, "fraction_of_ceiling": 0.8}]
    ladder = {"device_name": "NVIDIA X", "rungs": rows, "roofline": {"path": "docs/roofline/X/roofline.json"}}
    table = readme_tables.ceilings_table(ladder)
    assert "on the NVIDIA X (the ladder above, beside the ceilings of `docs/roofline/X/roofline.json`)" in table
    assert "| 0 | baseline (00) | 60,000 | 30,000 | 50% |  |  |" in table
    assert "| 1 | mask on the fly | 60,000 | 33,000 | 55% | 1.00× | 1.10× |" in table
    assert "| 3 | fused AdamW | 132,000 | 66,000 | 50% |  |  |" in table
    assert "| 2 |" not in table and "| 11 |" not in table  # failed; not a step of the table
    no_ceilings = {"device_name": "NVIDIA X", "rungs": [{**row, "ceiling_tok_per_sec": None} for row in rows]}
    assert readme_tables.ceilings_table(no_ceilings) == readme_tables.CEILINGS_PLACEHOLDER


def test_the_glance_note_says_which_whole_runs_had_pytorchs_bytecode_cached():
    """A run that compiled PyTorch's Python from source started seconds slower: the note names it, and says nothing of
    runs that did not record it."""
    def run(name, flag):
        return {"run": name, "wall_clock_s": {} if flag is None else {"imports compiled from source": flag}}

    folders = [(None, {"device_name": "NVIDIA H100"}, {"runs": [run("00", None), run("01-cold", False),
                                                                 run("01-warm", False), run("02", True)]}),
               (None, {"device_name": "NVIDIA H200"}, {"runs": [run("01-warm", None)]})]
    note = readme_tables.bytecode_note(folders)
    assert note.startswith(" Start-up: PyTorch's bytecode (its `.pyc` files) was cached for the H100's 01-cold and "
                           "01-warm, not for the H100's 02, whose imports compiled its Python first; without that "
                           "cache imports take seconds more"), note
    assert note.endswith("The other runs did not record it.")
    only_from_source = readme_tables.bytecode_note([(None, {"device_name": "NVIDIA H100"}, {"runs": [run("02", True)]})])
    assert only_from_source.startswith(" Start-up: PyTorch had no bytecode cache for the H100's 02, whose imports")
    assert "H200" not in note and readme_tables.bytecode_note(folders[1:]) == ""
