"""bench/stages.py: the stages as a user runs them, with 01 compiled into an empty cache and then a warm one."""

import json
import signal
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest

from bench import stages
from conftest import ROOT, processes_mentioning, run_script


def test_01_cold_then_warm_compile_cache_and_the_tables(tmp_path):
    out = tmp_path / "stages"
    result = run_script("bench/stages.py", "--tiny", "--runs", "01-warm,01-cold", "--out", out, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "stages.json").read_text())
    cold, warm = report["runs"]  # in their own order, whatever --runs said
    assert (cold["run"], warm["run"]) == ("01-cold", "01-warm")
    for row in (cold, warm):
        assert row["error"] is None and row["steps"] == stages.TINY_STEPS, row
        assert row["command"] == "python 01_opt_single_gpu.py --tiny --max-steps 12 --eval-freq 4", row
        split = row["wall_clock_s"]
        assert split["total"] <= row["command_seconds"] + 0.5, row  # the run's own clock lies inside the command's
        assert (out / "logs" / f"{row['run']}.log").read_text().startswith("$ ")
        assert sorted(path.name for path in (out / "runs" / row["run"]).iterdir()) == [
            "loss.pdf", "loss.png", "metrics.json"]  # the checkpoint is gone
    # the warm cache spares most of the compilation (measured here: 76 s cold, 2 s warm on a busy 2-core CPU)
    assert warm["wall_clock_s"]["compilation"] < 0.5 * cold["wall_clock_s"]["compilation"], (cold, warm)
    assert not (out / "compile-cache").exists()
    table = (out / "stages.md").read_text()
    assert "| 01-cold | `python 01_opt_single_gpu.py --tiny" in table and "| 01-warm |" in table, table
    assert "| run | whole command | start-up | compilation | training | evaluation | sampling |" in table, table
    assert result.stdout.rstrip().endswith("stages.json, rows/, logs/ and runs/")


def test_the_commands_are_the_ones_a_user_types(tmp_path):
    args = Namespace(tiny=False, device="auto", option=[])
    shown, command = stages.command_of("02", args, tmp_path / "02")
    assert shown == "torchrun --standalone --nproc_per_node=1 02_opt_multi_gpu_ddp.py"
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--nproc_per_node=1" in command
    assert "--standalone" in command and "--local-addr=127.0.0.1" in command  # no host name to resolve
    assert command[-2:] == ["--out", tmp_path / "02"]
    shown, command = stages.command_of("00", Namespace(tiny=False, device="cuda", option=[]), tmp_path / "00")
    assert shown == "python 00_orig.py --max-steps 200 --device cuda"
    assert command[0] == sys.executable and str(command[1]).endswith("00_orig.py")


def test_an_option_starts_the_compiled_runs_through_the_launcher_into_a_folder_of_their_own(tmp_path, monkeypatch,
                                                                                              capsys):
    """--option: 01 and 02 start through bench/script_with_options.py (shown so in the table), with the option's
    environment; their rows go to <gpu>-<option>/stages/, whose table says what the option does; 00 is refused."""
    args = Namespace(tiny=False, device="auto", option=["nested-compile-region"])
    shown, command = stages.command_of("02", args, tmp_path / "02")
    assert shown == ("torchrun --standalone --nproc_per_node=1 bench/script_with_options.py --option "
                     "nested-compile-region 02_opt_multi_gpu_ddp.py")
    launcher = command.index(ROOT / "bench" / "script_with_options.py")
    assert command[launcher + 1:launcher + 4] == ["--option", "nested-compile-region", "02_opt_multi_gpu_ddp.py"]
    shown, command = stages.command_of("01-cold", args, tmp_path / "01")
    assert shown == "python bench/script_with_options.py --option nested-compile-region 01_opt_single_gpu.py"
    assert command[:2] == [sys.executable, ROOT / "bench" / "script_with_options.py"]

    seen = {}

    def fake_run(command, log_path, timeout, env):
        seen[log_path.stem] = (command, env)
        return 1, ["a fake run"]

    monkeypatch.setattr(stages, "run_streaming", fake_run)
    monkeypatch.setattr(stages, "ROOT", tmp_path)  # the default folder, bench/results/<device>-<options>/stages
    assert stages.main(["--device", "cpu", "--option", "expandable-segments", "--option",
                        "nested-compile-region"]) == 1  # every fake run failed
    assert sorted(seen) == ["01-cold", "01-warm", "02"]  # all but 00
    command, env = seen["01-warm"]
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    # an environment variable, not a setting: script_with_options.py would refuse it (it once was passed on)
    assert command[2:5] == ["--option", "nested-compile-region", "01_opt_single_gpu.py"]
    assert stages.command_of("01-warm", Namespace(tiny=False, device="auto", option=["expandable-segments"]),
                             tmp_path / "01")[0] == ("PYTORCH_ALLOC_CONF=expandable_segments:True PYTORCH_CUDA_ALLOC_CONF="
                                                     "expandable_segments:True python 01_opt_single_gpu.py")
    [out] = (tmp_path / "bench" / "results").iterdir()
    assert out.name.endswith("-expandable-segments-nested-compile-region")
    table = (out / "stages" / "stages.md").read_text()
    assert "With `--option nested-compile-region`: torch.compiler.nested_compile_region on" in table, table
    assert json.loads((out / "stages" / "rows" / "02.json").read_text())["context"]["options"] == (
        "expandable-segments,nested-compile-region")
    assert stages.main(["--device", "cpu", "--option", "nested-compile-region", "--runs", "01-cold,00"]) == 2
    assert "00 compiles nothing and takes no option" in capsys.readouterr().err
    assert stages.missing_runs({}, ["nested-compile-region"]) == ["01-cold", "01-warm", "02"]
    assert stages.missing_runs({}) == list(stages.RUNS)


def test_only_01_warm_finds_a_filled_cache(tmp_path, monkeypatch):
    """A command cut off outright (a time limit's SIGKILL) leaves its compile cache behind: the next command's cold
    runs must not compile into it, or "cold" would be warm."""
    out, seen = tmp_path / "stages", {}

    def fake_run(command, log_path, timeout, env):
        seen[command[-1].name] = sorted(path.name for path in Path(env["TORCHINDUCTOR_CACHE_DIR"]).glob("*"))
        return 1, ["a fake run"]

    monkeypatch.setattr(stages, "run_streaming", fake_run)
    (out / "logs").mkdir(parents=True)
    args = Namespace(tiny=True, device="cpu", run_timeout=10, option=[])
    for name in ("01-cold", "01-warm", "02"):
        left_over = out / "compile-cache" / stages.RUNS[name][2] / "inductor" / f"before-{name}"
        left_over.mkdir(parents=True)
        assert stages.measure(name, args, out)["error"]
    assert seen == {"01-cold": [], "01-warm": ["before-01-warm"], "02": []}


def test_commands_into_one_folder_fill_one_table(tmp_path, monkeypatch):
    """Where a command may run for 10 minutes at most, the runs go in parts: each part's rows join the folder's,
    a run measured again replaces its row, and a folder measured with another PyTorch is refused, untouched."""
    measured = []

    def fake_measure(name, args, out):
        measured.append(name)
        return {"run": name, "command": f"the command of {name} #{len(measured)}", "error": None, "steps": 1,
                "batch_size": 2, "avg_tok_per_sec": 100.0 * len(measured), "mfu": None, "reserved_gb": None,
                "peak_reserved_gb": None, "final_val_loss": 5.0, "command_seconds": 1.0, "wall_clock_s": {}}

    monkeypatch.setattr(stages, "measure", fake_measure)
    out, flags = tmp_path / "stages", ["--device", "cpu", "--out", str(tmp_path / "stages")]
    for runs in ("02,01-cold,01-warm", "00", "02"):
        assert stages.main(["--runs", runs, *flags]) == 0
    report = json.loads((out / "stages.json").read_text())
    assert [(row["run"], row["command"]) for row in report["runs"]] == [
        ("00", "the command of 00 #4"), ("01-cold", "the command of 01-cold #1"),
        ("01-warm", "the command of 01-warm #2"), ("02", "the command of 02 #5")]
    assert [part["runs"] for part in report["parts"]] == [["01-cold", "01-warm"], ["00"], ["02"]]  # 02 measured again
    assert sorted(path.name for path in (out / "rows").iterdir()) == [f"{name}.json" for name in stages.RUNS]
    table = (out / "stages.md").read_text()
    assert table.count("python bench/stages.py --runs") == 3 and table.index("#4") < table.index("#1"), table
    assert "01-warm into the cache 01-cold filled; 02 started with an empty cache; 00 compiles nothing." in table
    assert stages.cache_note(["01-cold", "01-warm"]) == ("01-cold compiled into an empty cache; 01-warm into the "
                                                         "cache 01-cold filled.")  # no word of runs not measured

    row = json.loads((out / "rows" / "02.json").read_text())
    row["context"]["torch"] = "1.0.0"
    (out / "rows" / "02.json").write_text(json.dumps(row))
    before = (out / "stages.json").read_bytes()
    assert stages.main(["--runs", "00", *flags]) == 2
    assert (out / "stages.json").read_bytes() == before and len(measured) == 5


def test_the_wall_clock_table_names_start_ups_imports_where_a_run_recorded_them():
    row = {"run": "01-cold", "command": "python 01_opt_single_gpu.py", "error": None, "steps": 1, "batch_size": 2,
           "avg_tok_per_sec": 1.0, "mfu": None, "reserved_gb": None, "peak_reserved_gb": None, "final_val_loss": 5.0,
           "command_seconds": 20.0, "wall_clock_s": {"start-up": 15.7, "compilation": 1.0, "training": 1.0,
                                                     "evaluation": 1.0, "sampling": 0.5, "checkpoints and outputs": 0.5,
                                                     "total": 19.7, "imports": 6.1}}
    older = {**row, "run": "00", "wall_clock_s": {k: v for k, v in row["wall_clock_s"].items() if k != "imports"}}
    lines = stages.tables({"runs": [row, older]})
    assert "| 01-cold | 20.0 | 15.7 (imports 6.1) | 1.0 | 1.0 | 1.0 | 0.5 | 0.5 |" in lines, lines
    assert "| 00 | 20.0 | 15.7 | 1.0 | 1.0 | 1.0 | 0.5 | 0.5 |" in lines, lines  # a row from before the split
    assert any("Start-up's imports:" in line for line in lines)
    assert not any("Start-up's imports:" in line for line in stages.tables({"runs": [older]}))
    assert not any("part by part" in line for line in lines)  # no row recorded start-up's parts
    parts = {"command line": 0.01, "device": 1.2, "corpus": 0.05, "tokenizer": 0.2, "model": 0.3,
             "until the first step": 0.4}
    newest = {**row, "run": "01-warm", "wall_clock_s": {**row["wall_clock_s"], "start-up parts": parts}}
    lines = stages.tables({"runs": [newest, older]})
    assert "| run | imports | command line | device | corpus | tokenizer | model | until the first step |" in lines
    assert "| 01-warm | 6.10 | 0.01 | 1.20 | 0.05 | 0.20 | 0.30 | 0.40 |" in lines, lines
    assert not any(line.startswith("| 00 | 6.10") for line in lines)  # a run without parts has no row there
    assert not any("No .pyc" in line for line in lines)
    uncached = {**row, "wall_clock_s": {**row["wall_clock_s"], "imports compiled from source": True}}
    lines = stages.tables({"runs": [uncached, older]})
    assert "| 01-cold | 20.0 | 15.7 (imports 6.1, no .pyc) | 1.0 | 1.0 | 1.0 | 0.5 | 0.5 |" in lines, lines
    assert any("No .pyc: PyTorch's Python had no bytecode cache" in line for line in lines)


def test_runs_missing_goes_on_where_the_folder_stopped(tmp_path, monkeypatch, capsys):
    """--runs missing, the same command again after one was cut off: the runs without a row, with 01-cold again
    where 01-warm is missing (its cache is gone with the command that filled it), then nothing."""
    measured = []

    def fake_measure(name, args, out):
        measured.append(name)
        return {"run": name, "command": name, "error": None, "steps": 1, "batch_size": 2, "avg_tok_per_sec": 1.0,
                "mfu": None, "reserved_gb": None, "peak_reserved_gb": None, "final_val_loss": 5.0,
                "command_seconds": 1.0, "wall_clock_s": {}}

    monkeypatch.setattr(stages, "measure", fake_measure)
    flags = ["--device", "cpu", "--out", str(tmp_path / "stages")]
    assert stages.main(["--runs", "00,02", *flags]) == 0
    assert stages.main(["--runs", "missing", *flags]) == 0
    assert measured == ["00", "02", "01-cold", "01-warm"]
    capsys.readouterr()
    assert stages.main(["--runs", "missing", *flags]) == 0 and len(measured) == 4
    assert "nothing left to run" in capsys.readouterr().out
    assert stages.missing_runs({"00": {}, "01-cold": {}}) == ["01-cold", "01-warm", "02"]
    assert stages.missing_runs({}) == list(stages.RUNS)


@pytest.mark.parametrize("runs, message", [("01-warm", "01-warm reuses the compile cache"),
                                           ("00,03", "unknown 03")])
def test_a_wrong_list_of_runs_is_refused_with_one_line(runs, message, tmp_path, capsys):
    assert stages.main(["--runs", runs, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_stops_the_run_in_progress_with_everything_it_started(tmp_path):
    """A job queue's time limit sends SIGTERM: the run in progress leads its own session, so it is stopped by
    bench/stages.py itself, which exits 143 with the runs that finished written; nothing goes on using the GPU."""
    out = tmp_path / "stages"
    process = subprocess.Popen([sys.executable, "bench/stages.py", "--tiny", "--runs", "00,02", "--out", str(out)],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stdout:  # the first log line of 00: it is training
            if "Ep 1, Step" in line:
                break
        assert processes_mentioning(str(out / "runs" / "00")), "00 is not running"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 20
        while processes_mentioning(str(out)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not processes_mentioning(str(out)), "a run outlived bench/stages.py"
        assert "interrupted: the runs that finished are in stages.md" in process.stderr.read()
        assert not (out / "runs" / "02").exists()  # never started
    finally:
        process.kill()


def test_the_tables_import_no_torch():
    """bench/readme_tables.py renders the README's tables from bench/stages.py's functions on any machine, quickly:
    importing either must not import PyTorch (the options' module, which does, is imported where a run needs it)."""
    probe = "import sys, bench.readme_tables, bench.stages; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr
