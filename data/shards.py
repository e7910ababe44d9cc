"""Reading a prepared corpus: token shards on disk, memory-mapped, read window by window.

A prepared folder (written by `python -m data.prepare`) holds `corpus.json`, the description, and the shards it
lists: raw little-endian uint16 token ids, the training split's shards then the validation split's. A run opens
the description, checks it against the shards (cheap: sizes and counts, never the contents), and maps the shards:
the tokens a process reads are the windows it trains on, so start-up and memory do not grow with the corpus.

The stages open their corpus through data.prepare.load_corpus, which prepares a named corpus or a text file first.
"""

import bisect
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.corpus import check_text_source
from failures import DamagedWindow, UsageError

DESCRIPTION = "corpus.json"
FORMAT = "fast-gpt2 token shards"
TOKENIZER = "gpt2"
VOCAB_SIZE = 50257  # GPT-2's byte-pair vocabulary, <|endoftext|> (50256) included
DTYPE = "uint16"
DEFAULT_VAL_FRACTION = 0.1  # the book's split: the last 10% of the text validates


class TokenShards:
    """One split's token stream, several shard files end to end, sliced like a tensor: `tokens[a:b]` is an int64
    tensor of those tokens, read from the memory-mapped files. `len(tokens)` is the stream's length."""

    def __init__(self, paths, counts, vocab_size=VOCAB_SIZE, split="train"):
        self.paths, self.counts, self.vocab_size, self.split = [str(p) for p in paths], list(counts), vocab_size, split
        self.ends = np.cumsum(self.counts).tolist()  # where each shard ends in the stream
        self._maps = None  # opened on first use, in the process that reads (never pickled)

    def __len__(self):
        return self.ends[-1] if self.ends else 0

    def __getstate__(self):
        return {**self.__dict__, "_maps": None}

    def _shard(self, index):
        if self._maps is None:
            self._maps = [None] * len(self.paths)
        if self._maps[index] is None:
            self._maps[index] = np.memmap(self.paths[index], dtype=np.uint16, mode="r", shape=(self.counts[index],))
        return self._maps[index]

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("token shards are read in contiguous slices: tokens[start:stop]")
        start, stop, _ = key.indices(len(self))
        pieces, position = [], start
        while position < stop:
            index = bisect.bisect_right(self.ends, position)
            shard_start = self.ends[index] - self.counts[index]
            end = min(stop, self.ends[index])
            pieces.append(self._shard(index)[position - shard_start:end - shard_start])
            position = end
        window = np.concatenate(pieces) if len(pieces) != 1 else pieces[0]
        if window.size and int(window.max()) >= self.vocab_size:
            bad = int(window.max())
            raise DamagedWindow(f"token id {bad} at or after position {start} of the {self.split} split is outside the "
                                f"vocabulary of {self.vocab_size:,} ({self.paths[0].rsplit(os.sep, 2)[-2]}): the "
                                "shards are damaged or of another tokenizer; prepare the corpus again")
        import torch  # here, not above: `python -m data.prepare` and its workers need no PyTorch

        return torch.from_numpy(window.astype(np.int64))


@dataclass
class Corpus:
    folder: Path
    description: dict
    train: TokenShards
    val: TokenShards


def open_prepared(folder, vocab_size=VOCAB_SIZE):
    """Open a prepared folder, checking its description against its shards: one line (exit code 2) for a folder
    that is not prepared, a description of another tokenizer or format, a missing or cut-short shard."""
    folder = Path(folder)
    description = read_description(folder)
    splits = {}
    for split in ("train", "val"):
        paths, counts = [], []
        for shard in description[split]:
            path = folder / shard["file"]
            expected = 2 * shard["tokens"]
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise UsageError(f"{folder}: shard {shard['file']} named in {DESCRIPTION} is missing: prepare the "
                                 "corpus again (python -m data.prepare ... --out DIR)") from None
            if size != expected:
                raise UsageError(f"{folder}: shard {shard['file']} holds {size:,} bytes, its description says "
                                 f"{shard['tokens']:,} tokens ({expected:,} bytes): it was cut short or changed; "
                                 "prepare the corpus again")
            if shard["max_token"] >= vocab_size:
                raise UsageError(f"{folder}: shard {shard['file']} holds token id {shard['max_token']}, outside the "
                                 f"vocabulary of {vocab_size:,}: prepare the corpus again")
            if shard["tokens"]:
                paths.append(path)
                counts.append(shard["tokens"])
        splits[split] = TokenShards(paths, counts, vocab_size, split)
    return Corpus(folder, description, splits["train"], splits["val"])


def read_description(folder):
    folder = Path(folder)
    path = folder / DESCRIPTION
    if not folder.is_dir():
        raise UsageError(f"no such folder: {folder}")
    if not path.is_file():
        raise UsageError(f"{folder} is a folder but not a prepared corpus (no {DESCRIPTION}): prepare it with "
                         f"python -m data.prepare {folder} --out DIR, then --data DIR")
    try:
        description = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UsageError(f"{path} cannot be read as a corpus description ({err}): prepare the corpus again") from None
    if not isinstance(description, dict) or description.get("format") != FORMAT:
        raise UsageError(f"{path} is not a description written by python -m data.prepare: prepare the corpus again")
    found = (description.get("tokenizer"), description.get("vocab_size"), description.get("dtype"))
    if found != (TOKENIZER, VOCAB_SIZE, DTYPE):
        raise UsageError(f"{folder} holds tokens of tokenizer {found[0]!r} with {found[1]} ids as {found[2]}; these "
                         f"stages train on {TOKENIZER!r} ({VOCAB_SIZE:,} ids, {DTYPE}): prepare the corpus again")
    try:
        for split in ("train", "val"):
            for shard in description[split]:
                shard["file"], shard["tokens"], shard["max_token"] = (str(shard["file"]), int(shard["tokens"]),
                                                                      int(shard["max_token"]))
                if os.sep in shard["file"] or shard["file"].startswith("."):
                    raise ValueError(f"shard name {shard['file']!r}")
    except (KeyError, TypeError, ValueError) as err:
        raise UsageError(f"{path} does not list its shards as python -m data.prepare writes them ({err}): prepare "
                         "the corpus again") from None
    return description


def is_prepared(folder):
    return (Path(folder) / DESCRIPTION).is_file()


def check_data_source(name_or_path):
    """The cheap checks of --data, made before any slow work: a prepared folder, a known corpus or a UTF-8 file."""
    if Path(name_or_path).is_dir():
        read_description(name_or_path)
    else:
        check_text_source(name_or_path)
