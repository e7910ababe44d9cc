"""Prepared token shards: `python -m data.prepare` and the stages' one data path (data/shards.py).

The corpora here are small (tens to hundreds of kilobytes of the shipped Shakespeare, cut into chunks of a few
kilobytes), so that the properties of a large preparation (many chunks, several processes, an interruption) show
in about a second each.
"""

import contextlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT
from data import get_tokenizer, load_text
import data.prepare as preparation
from data.prepare import main as prepare_main, prepare
from data.prepare import load_corpus
from data.shards import DESCRIPTION, open_prepared
from failures import UsageError

EOT = 50256


@pytest.fixture(scope="module")
def play_text():
    return load_text("shakespeare")[:200_000]


@pytest.fixture(scope="module")
def stage01():
    from conftest import load_stage
    return load_stage("01_opt_single_gpu.py")


@pytest.fixture(scope="module")
def encode():
    tokenizer = get_tokenizer()
    return lambda text: tokenizer.encode(text, allowed_special={"<|endoftext|>"})


def stream(split):
    return split[0:len(split)].tolist()


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# 1. the tokens are those of the whole text, split as the book splits it
# ---------------------------------------------------------------------------------------------

def test_chunks_in_two_processes_give_the_tokens_of_the_whole_text(tmp_path, play_text, encode, capsys):
    source = write(tmp_path / "plays.txt", play_text)
    description = prepare([source], tmp_path / "out", workers=2, chunk_mb=0.02)  # ~10 chunks of ~20 kB
    assert len(description["train"]) + len(description["val"]) >= 9  # one shard a chunk, the cut chunk two
    corpus = open_prepared(tmp_path / "out")
    cut = int(0.9 * len(play_text))  # the book: the last 10% of the text validates
    assert stream(corpus.train) == encode(play_text[:cut])
    assert stream(corpus.val) == encode(play_text[cut:])
    assert description["tokens"] == {"train": len(corpus.train), "val": len(corpus.val)}
    output = capsys.readouterr().out
    assert "2 worker process(es)" in output
    progress = [line for line in output.splitlines() if line.startswith("prepare: ") and "left" in line]
    assert progress and all("MB/s" in line and "tokens" in line for line in progress), output
    assert "(100%)" in progress[-1], output
    # every shard is whole: 2 bytes a token, nothing left of the work
    for shard in description["train"] + description["val"]:
        assert (tmp_path / "out" / shard["file"]).stat().st_size == 2 * shard["tokens"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.endswith(".bin")) == [DESCRIPTION]
    assert not (tmp_path / "out.partial").exists()


def test_the_named_corpus_is_the_book_split_of_its_text(tmp_path, encode):
    corpus = load_corpus("shakespeare", cache_dir=tmp_path)
    text = load_text("shakespeare")
    cut = int(0.9 * len(text))
    assert len(corpus.train) == 1_376_206 and len(corpus.val) == 155_353  # the counts every earlier run logged
    assert stream(corpus.val) == encode(text[cut:])
    assert corpus.train[0:50].tolist() == encode(text[:cut][:400])[:50]
    again = load_corpus("shakespeare", cache_dir=tmp_path)  # prepared once: the second call only maps it
    assert again.folder == corpus.folder and again.description["prepared"] == corpus.description["prepared"]


def test_a_text_file_is_prepared_once_and_again_when_it_changes(tmp_path, capsys):
    source = write(tmp_path / "notes.txt", "First words of a small corpus.\n" * 200)
    first = load_corpus(str(source), cache_dir=tmp_path / "cache")
    assert "Preparing" in capsys.readouterr().out
    assert load_corpus(str(source), cache_dir=tmp_path / "cache").folder == first.folder
    assert "Preparing" not in capsys.readouterr().out
    write(source, "Other words entirely, and more of them.\n" * 300)
    os.utime(source, ns=(1, 1))  # a changed file (size and time) is a corpus of its own
    changed = load_corpus(str(source), cache_dir=tmp_path / "cache")
    assert changed.folder != first.folder and len(changed.train) != len(first.train)


def test_folders_and_jsonl_documents_are_joined_with_endoftext(tmp_path, encode):
    docs = ["The first document.", "A second one, longer than the first.", "Third."]
    write(tmp_path / "src" / "a.jsonl", "\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)) + "\n\n")
    write(tmp_path / "src" / "sub" / "b.txt", "A plain text file after them.")
    write(tmp_path / "src" / "ignored.csv", "not a source")
    description = prepare([tmp_path / "src"], tmp_path / "out", workers=1, val_fraction=0.2)
    corpus = open_prepared(tmp_path / "out")
    docs.append("A plain text file after them.")
    cut = int(0.8 * sum(map(len, docs))) - sum(map(len, docs[:3]))  # the last 20% begins inside the last document
    assert 0 < cut < len(docs[3])
    expected = [*encode(docs[0]), EOT, *encode(docs[1]), EOT, *encode(docs[2]), EOT, *encode(docs[3][:cut])]
    assert stream(corpus.train) == expected
    assert stream(corpus.val) == encode(docs[3][cut:])  # the document holding the cut is cut there
    assert description["documents"] == 4 and [s["kind"] for s in description["sources"]] == ["jsonl", "text"]
    assert [os.path.basename(s["path"]) for s in description["sources"]] == ["a.jsonl", "b.txt"]
    assert all(s["bytes"] > 0 for s in description["sources"])
    assert description["val_fraction"] == 0.2 and 0 < len(corpus.val) < len(corpus.train)


def test_json_lines_cut_into_many_chunks_give_the_tokens_of_one(tmp_path, play_text):
    text = play_text.replace("<|endoftext|>", "")  # no separator of its own: the count below is prepare's
    lines = [json.dumps({"text": text[i:i + 700]}) for i in range(0, 140_000, 700)]  # 200 documents
    source = write(tmp_path / "dump.jsonl", "\n".join(lines) + "\n")
    many = prepare([source], tmp_path / "many", workers=1, chunk_mb=0.01)  # about 10 kB a chunk
    one = prepare([source], tmp_path / "one", workers=1)
    assert len(many["train"]) > 10 and len(one["train"]) == 1
    assert many["documents"] == one["documents"] == 200
    for split in ("train", "val"):
        assert stream(getattr(open_prepared(tmp_path / "many"), split)) == stream(
            getattr(open_prepared(tmp_path / "one"), split))
    # 180 documents train, 20 validate (the cut falls between two): 179 separators, and the next one validates
    assert stream(open_prepared(tmp_path / "one").train).count(EOT) == 179
    assert stream(open_prepared(tmp_path / "one").val)[0] == EOT


def test_the_command_line_prepares_and_a_stage_trains_on_the_folder(tmp_path, play_text):
    source = write(tmp_path / "plays.txt", play_text)
    out = tmp_path / "prepared"
    result = subprocess.run([sys.executable, "-m", "data.prepare", str(source), "--out", str(out),
                             "--val-fraction", "0.1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "prepare: wrote" in result.stdout and "MB/s" in result.stdout, result.stdout
    assert json.loads((out / DESCRIPTION).read_text())["command"].startswith("python -m data.prepare")
    run = subprocess.run([sys.executable, "00_orig.py", "--tiny", "--data", str(out), "--max-steps", "2",
                          "--out", str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"Data: {out} | train {json.loads((out / DESCRIPTION).read_text())['tokens']['train']:,} tokens" in run.stdout
    assert "Preparing" not in run.stdout


# ---------------------------------------------------------------------------------------------
# 2. an interrupted preparation goes on; a failed one leaves a good folder alone
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def interrupted_after(chunks):
    """prepare() in this process (workers=1) stopped as by Ctrl-C once `chunks` chunks are tokenized."""
    tokenize, done = preparation.tokenize_chunk, []

    def tokenize_then_stop(job):
        if len(done) == chunks:
            raise KeyboardInterrupt
        done.append(job)
        return tokenize(job)

    with pytest.MonkeyPatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(preparation, "tokenize_chunk", tokenize_then_stop)
        yield


def test_an_interrupted_preparation_goes_on_where_it_stopped(tmp_path, play_text, capsys):
    source = write(tmp_path / "plays.txt", play_text)
    out = tmp_path / "out"
    with interrupted_after(3):
        prepare([source], out, workers=1, chunk_mb=0.02)
    assert not out.exists()  # nothing a run could read half-written
    assert len(list((tmp_path / "out.partial").glob("chunk-*.json"))) == 3
    capsys.readouterr()
    prepare([source], out, workers=1, chunk_mb=0.02)
    assert "going on from an interrupted preparation: 3 of" in capsys.readouterr().out
    clean = prepare([source], tmp_path / "clean", workers=1, chunk_mb=0.02)
    assert stream(open_prepared(out).train) == stream(open_prepared(tmp_path / "clean").train)
    assert json.loads((out / DESCRIPTION).read_text())["tokens"] == clean["tokens"]


def test_an_interrupted_preparation_of_other_settings_starts_clean(tmp_path, play_text, capsys):
    source = write(tmp_path / "plays.txt", play_text)
    with interrupted_after(2):
        prepare([source], tmp_path / "out", workers=1, chunk_mb=0.02)
    capsys.readouterr()
    prepare([source], tmp_path / "out", workers=1, chunk_mb=0.02, val_fraction=0.05)
    output = capsys.readouterr().out
    assert "starting clean" in output and "going on" not in output
    assert json.loads((tmp_path / "out" / DESCRIPTION).read_text())["val_fraction"] == 0.05


def test_a_failed_preparation_never_replaces_a_good_folder(tmp_path, capsys):
    good = write(tmp_path / "good.txt", "A good corpus of a few words.\n" * 100)
    out = tmp_path / "out"
    assert prepare_main([str(good), "--out", str(out), "--workers", "1"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text field"}) + "\n")
    capsys.readouterr()
    assert prepare_main([str(good), str(bad), "--out", str(out), "--workers", "1"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "no \"text\" string field" in error and "bad.jsonl" in error, error
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # a good run replaces it only when whole
    other = write(tmp_path / "other.txt", "Another corpus altogether, with other words.\n" * 100)
    assert prepare_main([str(other), "--out", str(out), "--workers", "1"]) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} != before


# ---------------------------------------------------------------------------------------------
# 3. bad input: one line, exit code 2
# ---------------------------------------------------------------------------------------------

def prepare_error(capsys, *argv):
    capsys.readouterr()
    assert prepare_main([str(a) for a in argv]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("python -m data.prepare: error: "), error
    return error


def test_bad_sources_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert "holds no .txt or .jsonl files" in prepare_error(capsys, tmp_path / "empty", "--out", tmp_path / "o")
    assert "no sources" in prepare_error(capsys, "--out", tmp_path / "o")
    assert "no such file or folder" in prepare_error(capsys, tmp_path / "missing.txt", "--out", tmp_path / "o")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Caf\u00e9 au lait\n".encode("latin-1"))
    assert "not UTF-8 text (invalid byte at offset 3)" in prepare_error(capsys, latin1, "--out", tmp_path / "o")
    broken = write(tmp_path / "broken.jsonl", '{"text": "one"}\n{"text": \n')
    assert "is not JSON" in prepare_error(capsys, broken, "--out", tmp_path / "o")
    blank = write(tmp_path / "blank.jsonl", "\n\n")
    assert "hold no text" in prepare_error(capsys, blank, "--out", tmp_path / "o")
    write(tmp_path / "taken" / "notes.md", "someone's folder")
    good = write(tmp_path / "good.txt", "words\n" * 10)
    assert "not a prepared corpus" in prepare_error(capsys, good, "--out", tmp_path / "taken")
    assert "--val-fraction" in prepare_error(capsys, good, "--out", tmp_path / "o", "--val-fraction", "1.5")
    assert not (tmp_path / "o").exists()


@pytest.fixture
def prepared(tmp_path, play_text):
    source = write(tmp_path / "plays.txt", play_text)
    prepare([source], tmp_path / "prepared", workers=1, chunk_mb=0.05)
    return tmp_path / "prepared"


def edit_description(folder, change):
    path = folder / DESCRIPTION
    description = json.loads(path.read_text())
    change(description)
    path.write_text(json.dumps(description))


def test_damaged_folders_are_refused_when_opened(prepared, tmp_path):
    shard = prepared / "train-000001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])  # a shard cut short
    with pytest.raises(UsageError, match="holds .* bytes, its description says"):
        open_prepared(prepared)
    shard.unlink()
    with pytest.raises(UsageError, match="train-000001.bin named in corpus.json is missing"):
        open_prepared(prepared)
    edit_description(prepared, lambda d: d.update(tokenizer="cl100k_base", vocab_size=100277))
    with pytest.raises(UsageError, match="tokenizer 'cl100k_base' with 100277 ids"):
        open_prepared(prepared)
    edit_description(prepared, lambda d: d.update(format="something else"))
    with pytest.raises(UsageError, match="not a description written by python -m data.prepare"):
        open_prepared(prepared)
    (prepared / DESCRIPTION).unlink()
    with pytest.raises(UsageError, match="not a prepared corpus"):
        open_prepared(prepared)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="not a prepared corpus"):
        load_corpus(str(tmp_path / "empty"))


def test_a_token_outside_the_vocabulary_is_refused(prepared):
    edit_description(prepared, lambda d: d["val"][0].update(max_token=50257))  # said by the description
    with pytest.raises(UsageError, match="token id 50257, outside the vocabulary"):
        open_prepared(prepared)
    edit_description(prepared, lambda d: d["val"][0].update(max_token=50256))
    shard = prepared / "train-000000.bin"  # or found in a window (the description does not know)
    tokens = np.fromfile(shard, dtype="<u2")
    tokens[100] = 60000
    tokens.tofile(shard)
    corpus = open_prepared(prepared)
    assert corpus.train[0:100].shape == (100,)  # the windows before it read as ever
    with pytest.raises(UsageError, match="token id 60000 .* outside the vocabulary of 50,257"):
        corpus.train[64:129]


def run_stage(tmp_path, *flags):
    return subprocess.run([sys.executable, "01_opt_single_gpu.py", "--tiny", "--no-compile", *map(str, flags),
                           "--out", str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_stage_refuses_a_damaged_folder_in_one_line(prepared, tmp_path):
    shard = prepared / "val-000000.bin"
    shard.write_bytes(shard.read_bytes()[:10])
    result = run_stage(tmp_path, "--data", prepared, "--max-steps", 1)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stdout + result.stderr
    assert result.stderr.strip().count("\n") == 0 and "cut short" in result.stderr, result.stderr


def test_splits_too_short_for_a_step_or_a_window_are_refused(tmp_path, stage01, monkeypatch):
    """What the stages check on a prepared folder's windows (cli.check_splits, exit code 2 through the stages'
    error handling, as tests/test_cli_00.py shows for text files): a training split shorter than one optimizer
    step of --tiny's batch of 4, a validation split shorter than one window of 64 + 1 tokens."""
    import argparse

    import cli

    def windows(folder):
        corpus, context = open_prepared(folder), stage01.TINY_CONFIG["context_length"]
        return (len(stage01.SlidingWindowDataset(corpus.train, context, context)),
                len(stage01.SlidingWindowDataset(corpus.val, context, context)), context)

    args = argparse.Namespace(data="DIR", batch_size=4, grad_accum_steps=1)
    short = write(tmp_path / "short.txt", "Too few words for a batch of four windows of sixty-four tokens.\n" * 6)
    prepare([short], tmp_path / "short", workers=1)
    with pytest.raises(UsageError, match=r"window(s)? of 65 tokens \(a window of 64 and the token after it, its last "
                                         r"target\), fewer than one optimizer step of 4 sequences: use"):
        cli.check_splits(args, *windows(tmp_path / "short"))
    prepare([write(tmp_path / "mid.txt", load_text("shakespeare")[:8_000])], tmp_path / "mid", workers=1,
            val_fraction=0.01)
    train, val, context = windows(tmp_path / "mid")
    assert train >= 4 and val == 0
    with pytest.raises(UsageError, match="validation split .* --val-fraction"):
        cli.check_splits(args, train, val, context)
    # what to lower: only what this run has more than one of (accumulation steps, processes)
    for accumulation, world_size, hints in ((1, 1, []), (2, 1, ["fewer --grad-accum-steps"]),
                                            (1, 4, ["fewer processes"])):
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        with pytest.raises(UsageError) as refused:
            cli.check_splits(argparse.Namespace(data="DIR", batch_size=train + 1, grad_accum_steps=accumulation),
                             train, 1, context)
        assert [hint for hint in ("fewer --grad-accum-steps", "fewer processes") if hint in str(refused.value)] == \
            hints, str(refused.value)


def test_shards_pickle_without_their_maps(prepared):
    import pickle

    corpus = open_prepared(prepared)
    corpus.train[0:10]
    copy = pickle.loads(pickle.dumps(corpus.train))  # a loader worker gets paths, not the mapped bytes
    assert copy._maps is None and torch.equal(copy[5:500], corpus.train[5:500])
