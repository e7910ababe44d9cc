"""00_orig.py run as a user runs it: a whole tiny training run, --help, and every kind of bad input."""

import json
import re

import pytest
import torch

from conftest import check_wall_clock, run_script

LOG_LINE = re.compile(r"^Ep \d+, Step \d{6}, Train: \d+\.\d{3}, Val: \d+\.\d{3}, Step tok/sec: \d+, "
                      r"Avg tok/sec: (\d+|n/a)")
FLAGS = ("--data", "--tiny", "--epochs", "--max-steps", "--batch-size", "--eval-freq", "--eval-iter",
         "--device", "--seed", "--out", "--resume", "--save-every", "--profile", "--memory-snapshot")
OUTPUTS = ("metrics.json", "loss.pdf", "loss.png", "model.pth", ".run.lock")  # the lock: see checkpoints.py


def test_tiny_run_end_to_end(stage00, small_text, tmp_path):
    out = tmp_path / "run"
    result = run_script("00_orig.py", "--tiny", "--data", small_text, "--out", out,
                        "--max-steps", "30", "--eval-freq", "5", timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr

    # the log lines, in the original tutorial's format
    lines = result.stdout.splitlines()
    log_lines = [line for line in lines if line.startswith("Ep ")]
    assert log_lines and all(LOG_LINE.match(line) for line in log_lines), "\n".join(log_lines)
    steps = [int(re.search(r"Step (\d+)", line).group(1)) for line in log_lines]
    assert steps == [0, 5, 10, 15, 20, 25, 29]  # and the final step
    averages = [LOG_LINE.match(line).group(1) for line in log_lines]
    assert averages[0] == "n/a", "the first interval is warm-up: no average yet"
    assert all(value.isdigit() and int(value) > 0 for value in averages[1:])
    assert not any("MFU" in line for line in log_lines), "no MFU on a CPU: its peak is unknown"
    assert sum(line.startswith("Every effort moves you") for line in lines) == 1, "one epoch, one sample"
    # the header names the model --tiny trains and the processor's threads
    assert any(line.startswith("Model: tiny (--tiny: 2 layers, 64 wide), ") for line in lines), lines[:6]
    threads = re.search(r"CPU \(\d+ cores?, (\d+) (threads?)\)", result.stdout)
    assert threads and (threads.group(2) == "thread") == (threads.group(1) == "1"), lines[0]

    # the four files
    for name in OUTPUTS:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "loss.pdf").read_bytes()[:5] == b"%PDF-"
    assert not [p.name for p in out.iterdir() if p.name not in OUTPUTS], "temporary files left behind"

    # metrics.json
    metrics = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    assert metrics["script"] == "00_orig.py"
    assert metrics["device"].startswith("CPU")
    assert metrics["world_size"] == 1
    assert metrics["steps"] == 30
    assert metrics["tokens_seen"] == 30 * 4 * 64
    assert metrics["avg_tok_per_sec"] > 0
    assert metrics["mfu"] is None
    for key in ("allocated_gb", "reserved_gb", "peak_reserved_gb"):
        assert key in metrics and metrics[key] is None, key
    log = metrics["log"]
    assert [entry["step"] for entry in log] == [0, 5, 10, 15, 20, 25, 29]  # and the final step
    for entry in log:
        for key in ("epoch", "step", "train_loss", "val_loss", "step_tok_per_sec", "avg_tok_per_sec", "mfu"):
            assert key in entry, key
        assert entry["epoch"] == 1 and entry["mfu"] is None and entry["step_tok_per_sec"] > 0
    assert log[0]["avg_tok_per_sec"] is None and all(entry["avg_tok_per_sec"] > 0 for entry in log[1:])
    # the printed losses are the logged ones, rounded
    for line, entry in zip(log_lines, log):
        assert f"Train: {entry['train_loss']:.3f}, Val: {entry['val_loss']:.3f}" in line
    # an untrained model starts near ln(50257) = 10.8; 30 steps must bring the validation loss down
    assert 10.0 < log[0]["val_loss"] < 11.5
    assert log[-1]["val_loss"] < log[0]["val_loss"] - 0.2, [entry["val_loss"] for entry in log]
    check_wall_clock(result.stdout, out, compiled=False)

    # the checkpoint loads safely into a fresh model of the same stage
    checkpoint = torch.load(out / "model.pth", weights_only=True)
    model = stage00.GPTModel(stage00.TINY_CONFIG)
    model.load_state_dict(checkpoint["model"], strict=True)
    assert checkpoint["step"] == 30
    assert checkpoint["config"] == stage00.TINY_CONFIG
    assert "optimizer" in checkpoint
    fresh = stage00.GPTModel(stage00.TINY_CONFIG).state_dict()
    assert any(not torch.equal(fresh[name], checkpoint["model"][name]) for name in fresh
               if fresh[name].is_floating_point() and name.endswith("weight")), "the saved weights are untrained"


def test_help_documents_every_flag():
    result = run_script("00_orig.py", "--help", timeout=120)
    assert result.returncode == 0, result.stderr
    for flag in FLAGS:
        assert flag in result.stdout, flag
    assert "--no-compile" not in result.stdout, "--no-compile belongs to stages 01 and 02 only"


# ---------------------------------------------------------------------------------------------
# Bad input: exit code 2, one line on stderr, no traceback, nothing overwritten
# ---------------------------------------------------------------------------------------------

def _words(count):
    return " ".join(f"word{i % 97}" for i in range(count)) + "\n"


def _short_validation_text(tokenizer, small_text):
    """Enough training windows for a batch of 4, but the last 10% (by characters) is under 65 tokens."""
    source = small_text.read_text(encoding="utf-8")
    text = source[:2000]
    split = int(0.9 * len(text))  # 00_orig.py's split
    assert len(tokenizer.encode(text[:split])) >= 4 * 64 + 1
    assert len(tokenizer.encode(text[split:])) < 65
    return text


def _write(tmp_path, name, content):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def _missing(tmp_path, small_text, tokenizer):
    return ["--data", tmp_path / "no-such-file.txt"], "no such file"


def _directory(tmp_path, small_text, tokenizer):
    (tmp_path / "a-folder").mkdir()
    return ["--data", tmp_path / "a-folder"], "is a folder but not a prepared corpus"


def _empty(tmp_path, small_text, tokenizer):
    return ["--data", _write(tmp_path, "empty.txt", b"")], "empty"


def _not_utf8(tmp_path, small_text, tokenizer):
    return ["--data", _write(tmp_path, "latin1.txt", "Ça va très bien, merci.\n".encode("latin-1"))], "UTF-8"


def _too_short(tmp_path, small_text, tokenizer):
    return ["--data", _write(tmp_path, "short.txt", _words(20))], "windows"


def _short_validation(tmp_path, small_text, tokenizer):
    return ["--data", _write(tmp_path, "shortval.txt", _short_validation_text(tokenizer, small_text))], "validation"


def _flag(*args, expect):
    def case(tmp_path, small_text, tokenizer):
        return ["--data", small_text, *args], expect
    return case


def _out_under_a_file(tmp_path, small_text, tokenizer):
    return ["--data", small_text, "--out", tmp_path / "sentinel.txt" / "run"], "--out"


def _out_is_a_file(tmp_path, small_text, tokenizer):
    return ["--data", small_text, "--out", tmp_path / "sentinel.txt"], "is a file, not a folder"


BAD_INPUTS = {
    "missing-file": _missing,
    "directory": _directory,
    "empty-file": _empty,
    "not-utf8": _not_utf8,
    "too-short-for-a-window": _too_short,
    "validation-too-short": _short_validation,
    "batch-size-0": _flag("--batch-size", "0", expect="--batch-size"),
    "batch-size-negative": _flag("--batch-size", "-3", expect="--batch-size"),
    "epochs-0": _flag("--epochs", "0", expect="--epochs"),
    "eval-freq-0": _flag("--eval-freq", "0", expect="--eval-freq"),
    "batch-larger-than-data": _flag("--batch-size", "100000", expect="--batch-size"),
    "unknown-corpus": _flag("--data", "shakespear", expect="shakespeare"),  # the later --data wins
    "cuda-without-gpu": _flag("--device", "cuda", expect="cuda"),
    "tiny-with-model": _flag("--model", "gpt2-xl", expect="--tiny trains a small model of its own, not --model gpt2-xl"),
    "out-under-a-file": _out_under_a_file,
    "out-is-a-file": _out_is_a_file,
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(case, tmp_path, small_text, tokenizer):
    if case == "cuda-without-gpu" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    out = tmp_path / "out"
    out.mkdir()
    sentinel = out / "model.pth"
    sentinel.write_bytes(b"an earlier run's checkpoint")
    blocker = tmp_path / "sentinel.txt"  # a regular file: --out under it cannot be created
    blocker.write_text("a file, not a folder\n", encoding="utf-8")

    args, expect = BAD_INPUTS[case](tmp_path, small_text, tokenizer)
    if "--out" not in args:
        args += ["--out", out]
    # --max-steps 2 keeps a run short should a bad input slip through
    result = run_script("00_orig.py", "--tiny", "--max-steps", "2", *args, timeout=120)

    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    err = result.stderr.strip()
    assert err, "no message on stderr"
    assert "\n" not in err, f"more than one line on stderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr
    assert expect in err, err
    if case == "too-short-for-a-window":  # no window at all: a smaller batch cannot help
        assert "holds 0 windows" in err and err.endswith("use a longer text"), err
    assert not re.search(r"^Ep \d", result.stdout, re.MULTILINE), "it trained"
    assert sentinel.read_bytes() == b"an earlier run's checkpoint"
    written = sorted(p.name for p in out.iterdir())
    assert written == ["model.pth"], "files were written into --out (a lock file left behind?)"
    assert blocker.read_text(encoding="utf-8") == "a file, not a folder\n"


def test_a_wrong_input_found_late_leaves_no_folder_behind(tmp_path, tokenizer):
    """The text turns out too short after --out was made and locked: exit 2, and the folders it made are gone."""
    short = _write(tmp_path, "short.txt", _words(20))
    out = tmp_path / "new" / "out"
    result = run_script("00_orig.py", "--tiny", "--data", short, "--out", out, timeout=120)
    assert result.returncode == 2 and "windows" in result.stderr, result.stderr
    assert not (tmp_path / "new").exists()


def test_a_mistyped_or_shortened_flag_names_the_flag_meant(stage00, capsys):
    import cli

    parser = cli.build_parser(stage00.__doc__, stage00.OTHER_SETTINGS, stage00.TINY_SETTINGS)
    for typed, meant in (("--max-step", "--max-steps"), ("--batchsize", "--batch-size"), ("--epoch=2", "--epochs")):
        with pytest.raises(SystemExit) as stopped:
            parser.parse_args([typed, "5"] if "=" not in typed else [typed])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and f"{typed.split('=')[0]}: did you mean {meant}?" in err, err
        assert err.count("\n") == 1


def test_another_stages_flag_or_torchruns_says_where_it_belongs(capsys):
    import cli

    for script, typed, hint in (("00_orig.py", ["--grad-accum-steps", "2"], "a flag of stages 01 to 03"),
                                ("01_opt_single_gpu.py", ["--activation-checkpointing"], "a flag of stage 03"),
                                ("00_orig.py", ["--nproc_per_node=2"],
                                 "torchrun's, before the script: torchrun --nproc_per_node=2 02_opt_multi_gpu_ddp.py"),
                                ("03_opt_multi_gpu_fsdp.py", ["--standalone"],
                                 "torchrun --standalone 03_opt_multi_gpu_fsdp.py")):
        parser = cli.OneLineParser(prog=script)
        parser.add_argument("--max-steps")
        with pytest.raises(SystemExit):
            parser.parse_args(typed)
        err = capsys.readouterr().err
        assert hint in err and "did you mean" not in err, err


def test_a_single_process_stage_under_torchrun_is_refused(tmp_path, small_text):
    """torchrun --nproc_per_node=2 00_orig.py would start two runs that share no work and write one --out:
    exit 2 from the first process (as torchrun starts it), one line naming 02, nothing left behind."""
    out = tmp_path / "out"
    result = run_script("00_orig.py", "--tiny", "--max-steps", "1", "--data", small_text, "--out", out, timeout=120,
                        env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "02_opt_multi_gpu_ddp.py under torchrun" in result.stderr
    assert not out.exists()
