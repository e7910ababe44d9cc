"""The data/ plumbing: the offline GPT-2 tokenizer, the Shakespeare corpus, Middlemarch, text files."""

import contextlib
import functools
import hashlib
import http.server
import re
import socket
import threading
from pathlib import Path

import pytest

from conftest import run_script

import data
import failures
from data import corpus
from data import tokenizer as tokenizer_module

SHAKESPEARE_SHA256 = "74a4fecccf40c488105f7b744226956e98922db636ef141d58cb90e4946a4870"
SHAKESPEARE_BYTES = 4_987_515
PROXY_OFF = {"no_proxy": "*", "NO_PROXY": "*"}  # urllib must not route 127.0.0.1 through a proxy


def _cache_file(cache_dir, name):
    url = tokenizer_module.GPT2_FILES[name][0]
    return Path(cache_dir) / hashlib.sha1(url.encode()).hexdigest()


# Runs in a fresh interpreter, so tiktoken's in-process registry cannot hide a missing cache file.
# Any attempt to reach the network fails loudly.
_OFFLINE_TOKENIZER_CHECK = """
import socket, sys
def _no_network(*args, **kwargs):
    raise RuntimeError("test: network access attempted")
socket.socket.connect = _no_network
socket.create_connection = _no_network
import tiktoken.load
_read_file = tiktoken.load.read_file
def _read_local_only(blobpath):
    if "://" in blobpath:
        raise RuntimeError("test: tiktoken tried to download " + blobpath)
    return _read_file(blobpath)
tiktoken.load.read_file = _read_local_only
sys.path.insert(0, ".")
from data import get_tokenizer
enc = get_tokenizer()
ids = enc.encode("Every effort moves you")
assert ids == [6109, 3626, 6100, 345], ids
assert enc.decode(ids) == "Every effort moves you"
assert enc.n_vocab == 50257, enc.n_vocab
print("OK", ids)
"""


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def test_tokenizer_seeds_an_empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DATA_GYM_CACHE_DIR", raising=False)
    enc = data.get_tokenizer()
    assert enc.encode("Every effort moves you") == [6109, 3626, 6100, 345]
    # the two files are in tiktoken's cache, under tiktoken's names, byte for byte what it expects
    for name, (_url, sha256) in tokenizer_module.GPT2_FILES.items():
        cached = _cache_file(tmp_path, name)
        assert cached.is_file(), f"{name} was not seeded into {tmp_path}"
        assert hashlib.sha256(cached.read_bytes()).hexdigest() == sha256, name
    assert not list(tmp_path.glob("*.tmp")), "a temporary file was left behind"


def test_tokenizer_loads_offline_in_a_fresh_process(tmp_path):
    result = run_script("-c", _OFFLINE_TOKENIZER_CHECK, env={"TIKTOKEN_CACHE_DIR": str(tmp_path)}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "OK [6109, 3626, 6100, 345]" in result.stdout
    assert {p.name for p in tmp_path.iterdir()} == {
        _cache_file(tmp_path, name).name for name in tokenizer_module.GPT2_FILES}


def test_tokenizer_repairs_a_corrupt_cache_file(tmp_path):
    for name in tokenizer_module.GPT2_FILES:
        _cache_file(tmp_path, name).write_bytes(b"not the real file")
    result = run_script("-c", _OFFLINE_TOKENIZER_CHECK, env={"TIKTOKEN_CACHE_DIR": str(tmp_path)}, timeout=120)
    assert result.returncode == 0, result.stderr
    for name, (_url, sha256) in tokenizer_module.GPT2_FILES.items():
        assert hashlib.sha256(_cache_file(tmp_path, name).read_bytes()).hexdigest() == sha256, name


@pytest.mark.parametrize("text", [
    "Every effort moves you",
    "HAMLET:\nTo be, or not to be: that is the question.\n<|endoftext|>ROMEO:\n  O, she doth teach!",
    "Unicode survives: café, naïve, “quotes”, — dashes, 日本語, emoji 🙂.",
])
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, allowed_special={"<|endoftext|>"})
    assert all(isinstance(i, int) and 0 <= i < 50257 for i in ids)
    assert tokenizer.decode(ids) == text


def test_endoftext_is_one_special_token(tokenizer):
    assert tokenizer.encode("<|endoftext|>", allowed_special={"<|endoftext|>"}) == [50256]


# ---------------------------------------------------------------------------------------------
# Shakespeare
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shakespeare():
    return corpus.build_shakespeare()


def test_shakespeare_bytes_are_pinned(shakespeare):
    raw = shakespeare.encode("utf-8")
    assert len(raw) == SHAKESPEARE_BYTES
    assert hashlib.sha256(raw).hexdigest() == SHAKESPEARE_SHA256


def test_shakespeare_build_is_deterministic(shakespeare):
    assert corpus.build_shakespeare().encode("utf-8") == shakespeare.encode("utf-8")


def test_shakespeare_has_no_markdown_left(shakespeare):
    assert "**" not in shakespeare
    assert "*" not in shakespeare
    assert "_" not in shakespeare
    assert not re.search(r"(?m)^#", shakespeare), "a markdown heading mark survived"
    assert "\\[" not in shakespeare and "\\]" not in shakespeare, "a markdown escape survived"
    assert "\n\n\n" not in shakespeare, "runs of blank lines should be collapsed"


def test_shakespeare_plays_are_separated_by_endoftext(shakespeare):
    plays = corpus.play_files()
    assert len(plays) > 30  # the complete plays, not a handful
    assert shakespeare.count(corpus.ENDOFTEXT) == len(plays) - 1
    assert not shakespeare.startswith(corpus.ENDOFTEXT)
    pieces = shakespeare.split(corpus.ENDOFTEXT)
    assert all(piece.strip() for piece in pieces), "an empty play between two separators"


def test_shakespeare_speakers_are_plain_lines(shakespeare):
    assert re.search(r"(?m)^HAMLET:$", shakespeare)
    assert re.search(r"(?m)^ROMEO:$", shakespeare)
    assert len(re.findall(r"(?m)^[A-Z][A-Z' ]+:$", shakespeare)) > 10_000


def test_markdown_to_text_small_example():
    markdown = "# Title\n\n## ACT 1\n\n**HAMLET**  \nTo be \\[aside\\]\n\n\n\n*Exit* _Ghost_\n"
    assert corpus.markdown_to_text(markdown) == "Title\n\nACT 1\n\nHAMLET:\nTo be [aside]\n\nExit Ghost\n"


def test_load_shakespeare_writes_then_reads_the_cache(tmp_path, shakespeare, monkeypatch):
    text = data.load_text("shakespeare", cache_dir=tmp_path)
    assert text == shakespeare
    cached = list(tmp_path.glob("shakespeare-*.txt"))
    assert len(cached) == 1
    assert cached[0].read_bytes() == shakespeare.encode("utf-8")
    # the second call must read the cache, not rebuild
    monkeypatch.setattr(corpus, "build_shakespeare", lambda: pytest.fail("rebuilt despite the cache"))
    assert data.load_text("shakespeare", cache_dir=tmp_path) == shakespeare


# ---------------------------------------------------------------------------------------------
# Middlemarch, from a local HTTP server
# ---------------------------------------------------------------------------------------------

class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _serve(directory):
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _closed_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again when the socket goes


@pytest.fixture
def no_proxy(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in PROXY_OFF.items():
        monkeypatch.setenv(name, value)


def test_middlemarch_downloads_once_then_reads_the_cache(tmp_path, monkeypatch, no_proxy):
    served = tmp_path / "served"
    served.mkdir()
    content = "\ufeffMIDDLEMARCH\n\nBy George Eliot — “Prelude”.\n" * 50
    (served / "file.txt").write_bytes(content.encode("utf-8"))
    cache = tmp_path / "cache"
    with _serve(served) as port:
        monkeypatch.setenv("MIDDLEMARCH_URL", f"http://127.0.0.1:{port}/file.txt")
        text = data.load_text("middlemarch", cache_dir=cache)
    expected = content.replace("\ufeff", "", 1)  # utf-8-sig: the byte order mark goes
    assert text == expected
    assert (cache / "middlemarch.txt").read_text(encoding="utf-8") == expected
    assert not list(cache.glob("*.tmp")) and not list(cache.glob(".*")), "a temporary file was left behind"
    # the server is gone: the second call must come from the cache
    assert data.load_text("middlemarch", cache_dir=cache) == expected


def test_middlemarch_offline_is_a_usage_error(tmp_path, monkeypatch, no_proxy):
    monkeypatch.setenv("MIDDLEMARCH_URL", f"http://127.0.0.1:{_closed_port()}/pg145.txt")
    with pytest.raises(failures.UsageError) as info:
        data.load_text("middlemarch", cache_dir=tmp_path)
    message = str(info.value)
    assert "shakespeare" in message and "\n" not in message
    assert not (tmp_path / "middlemarch.txt").exists(), "a failed download must not leave a cache file"


def test_middlemarch_offline_exits_2_from_the_cli(tmp_path):
    cache = tmp_path / "cache"  # empty: the script has to try the download, and must leave nothing there
    url = f"http://127.0.0.1:{_closed_port()}/pg145.txt"
    result = run_script("00_orig.py", "--tiny", "--data", "middlemarch", "--max-steps", "1", "--out", tmp_path / "run",
                        env={"FAST_GPT2_CACHE": str(cache), "MIDDLEMARCH_URL": url, **PROXY_OFF}, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    err = result.stderr.strip()
    assert err and "\n" not in err, err
    assert "Traceback" not in result.stderr
    assert f"could not download {url}" in err and "--data shakespeare" in err, err
    assert not (cache / "middlemarch.txt").exists(), "a failed download must not leave a cache file"


# ---------------------------------------------------------------------------------------------
# Text files and corpus names
# ---------------------------------------------------------------------------------------------

def _usage_error(path_or_name):
    with pytest.raises(failures.UsageError) as info:
        data.load_text(str(path_or_name))
    message = str(info.value)
    assert message.strip() and "\n" not in message, repr(message)
    return message


def test_missing_file(tmp_path):
    message = _usage_error(tmp_path / "nope.txt")
    assert "no such file" in message and "nope.txt" in message


def test_directory(tmp_path):
    assert "is a directory" in _usage_error(tmp_path)


@pytest.mark.parametrize("content", [b"", b" \n\t\r\n  \n"], ids=["empty", "whitespace"])
def test_empty_or_blank_file(tmp_path, content):
    path = tmp_path / "blank.txt"
    path.write_bytes(content)
    assert "empty" in _usage_error(path)


@pytest.mark.parametrize("raw, offset", [(b"abc\xff", 3), (b"\xff", 0), ("héllo ".encode() + b"\xc3(", 7)])
def test_non_utf8_file_names_the_offset(tmp_path, raw, offset):
    path = tmp_path / "latin1.txt"
    path.write_bytes(raw)
    message = _usage_error(path)
    assert "not UTF-8" in message
    assert f"offset {offset}" in message


def test_utf8_file_with_bom_reads(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffHello, wörld\n".encode("utf-8"))
    assert data.load_text(str(path)) == "Hello, wörld\n"


def test_unknown_corpus_lists_the_names():
    message = _usage_error("shakespear")
    assert "shakespear'" in message or "'shakespear" in message
    for name in data.CORPORA:
        assert name in message
    assert set(data.CORPORA) == {"shakespeare", "middlemarch"}
