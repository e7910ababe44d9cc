"""Tokenize a corpus once into token shards that every stage memory-maps (`--data DIR`).

    python -m data.prepare SOURCE... --out DIR [--workers N] [--val-fraction F] [--chunk-mb MB]

SOURCE: UTF-8 text files (each one document), JSON-lines files (`.jsonl`: one document per line, in its "text"
field) and folders of them (every .txt and .jsonl below, in name order). Documents are joined with GPT-2's
<|endoftext|> token. The last --val-fraction of the characters validates (0.1: the book's last 10%); the document
that holds the cut is cut there, as the book cuts its one text.

The sources are cut into chunks (at a line break between two visible characters, where GPT-2's tokenizer would
split anyway: the tokens are those of the whole text) that the worker processes tokenize in parallel. Each chunk
becomes one shard (the chunk that holds the validation cut, two): raw little-endian uint16 token ids, 2 bytes a
token. `corpus.json` describes them: the tokenizer, each shard's tokens, the sources with their sizes, the split.

Everything is written into DIR.partial and moved to DIR only when whole, so a run never reads a half-written shard
and a failed preparation never replaces a good DIR. An interrupted preparation run again with the same sources and
settings keeps the chunks it finished and goes on; with others it starts clean.

`load_corpus` is the one data path of the stages: a prepared folder is opened as it is (data.shards); a named corpus
or a text file is prepared once into the cache here, under a lock that one process of a launch holds while the
others wait, and then opened the same way.
"""

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from data.corpus import CORPORA, ENDOFTEXT, cache_folder, cached_text_path, check_text_source
from data.files import save_atomically, write_atomically
from data.shards import (DEFAULT_VAL_FRACTION, DESCRIPTION, DTYPE, FORMAT, TOKENIZER, VOCAB_SIZE, is_prepared,
                         open_prepared)
from failures import UsageError

TEXT_SUFFIXES = {".txt"}
JSONL_SUFFIXES = {".jsonl"}
PLAN_VERSION = 1
# a chunk may end after a line break with a visible ASCII character on each side: the tokenizer splits there
SAFE_CUT = re.compile(rb"[\x21-\x7e]\n(?=[\x21-\x7e])")


def find_sources(arguments):
    """The files to tokenize, in order: each argument, or every .txt/.jsonl file below a folder (sorted)."""
    if not arguments:
        raise UsageError("no sources: name text files, .jsonl files or folders of them")
    files = []
    for argument in arguments:
        path = Path(argument)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES | JSONL_SUFFIXES
                           and not p.name.startswith("."))
            if not found:
                raise UsageError(f"{path} holds no .txt or .jsonl files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"no such file or folder: {path}")
    return [{"path": str(p.resolve()), "kind": "jsonl" if p.suffix in JSONL_SUFFIXES else "text",
             "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in files]


def plan_chunks(sources, chunk_bytes):
    """Cut each source into chunks of about chunk_bytes: text at safe line breaks, JSON lines at line starts."""
    chunks = []
    for number, source in enumerate(sources):
        size, start = source["bytes"], 0
        with open(source["path"], "rb") as handle:
            while start < size or (start == 0 and size == 0):
                end = min(size, start + chunk_bytes)
                if end < size:  # move the end forward to the next place a chunk may end
                    handle.seek(end - 1)
                    ahead = handle.read(1 << 20)
                    if source["kind"] == "jsonl":
                        newline = ahead.find(b"\n")
                        end = size if newline < 0 else end + newline
                    else:
                        match = SAFE_CUT.search(ahead)
                        end = size if match is None else end - 1 + match.end()
                chunks.append({"source": number, "start": start, "end": end})
                if size == 0:
                    break
                start = end
    return chunks


_ENCODER = None


def encoder():
    global _ENCODER
    if _ENCODER is None:
        from data.tokenizer import get_tokenizer
        _ENCODER = get_tokenizer()
    return _ENCODER


def documents(source, chunk, first_chunk):
    """The chunk's documents as (whether an <|endoftext|> goes before it, its text)."""
    with open(source["path"], "rb") as handle:
        handle.seek(chunk["start"])
        raw = handle.read(chunk["end"] - chunk["start"])
    if source["kind"] == "text":
        skip = 3 if chunk["start"] == 0 and raw.startswith(b"\xef\xbb\xbf") else 0  # a byte-order mark
        try:
            text = raw[skip:].decode("utf-8")
        except UnicodeDecodeError as err:
            raise UsageError(f"{source['path']} is not UTF-8 text (invalid byte at offset "
                             f"{chunk['start'] + skip + err.start}): convert it, e.g. with iconv -t UTF-8") from None
        return [(chunk["start"] == 0 and not first_chunk, text)] if text else []
    docs, offset = [], chunk["start"]
    for line in raw.split(b"\n"):
        where = offset
        offset += len(line) + 1
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise UsageError(f"{source['path']} is not UTF-8 text (invalid byte at offset {where + err.start})") from None
        except ValueError as err:
            raise UsageError(f"{source['path']}: the line at byte offset {where} is not JSON ({err})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise UsageError(f"{source['path']}: the line at byte offset {where} has no \"text\" string field "
                             "(each line must be a JSON object with the document in \"text\")")
        if record["text"]:
            docs.append((not (first_chunk and not docs), record["text"]))
    return docs


def encode(docs):
    """Token ids of documents: <|endoftext|> before each that asks for one; the literal string is that token too."""
    enc, ids = encoder(), []
    for separator, text in docs:
        if separator:
            ids.append(enc.eot_token)
        ids.extend(enc.encode(text, allowed_special={ENDOFTEXT}))
    return ids


def save_tokens(ids, path):
    top = max(ids, default=0)
    if top >= 1 << 16:
        raise UsageError(f"token id {top} does not fit in {DTYPE}")
    save_atomically(lambda tmp: np.asarray(ids, dtype="<u2").tofile(tmp), path)
    return {"tokens": len(ids), "max_token": top}


def count_chunk(job):
    """Worker: the characters of one chunk's documents (reading and checking them: bad input fails here, early)."""
    number, source, chunk = job
    return sum(len(text) for _, text in documents(source, chunk, first_chunk=number == 0))


def tokenize_chunk(job):
    """Worker: tokenize one chunk into its shard (two, split at `cut`, for the chunk that holds the validation
    split's start), then write its summary: the chunk is done when that exists."""
    number, source, chunk, work = job
    docs = documents(source, chunk, first_chunk=number == 0)
    if chunk["cut"] is None:
        parts = {chunk["side"]: save_tokens(encode(docs), Path(work) / f"chunk-{number:06d}-{chunk['side']}.bin")}
    else:
        before, after, seen = [], [], 0
        for separator, text in docs:  # the document holding the cut is cut there
            if seen + len(text) <= chunk["cut"]:
                before.append((separator, text))
            elif seen >= chunk["cut"]:
                after.append((separator, text))
            else:
                before.append((separator, text[:chunk["cut"] - seen]))
                after.append((False, text[chunk["cut"] - seen:]))
            seen += len(text)
        parts = {side: save_tokens(encode(part), Path(work) / f"chunk-{number:06d}-{side}.bin")
                 for side, part in (("train", before), ("val", after))}
    summary = {"parts": parts, "documents": len(docs), "bytes": chunk["end"] - chunk["start"],
               "tokens": sum(part["tokens"] for part in parts.values())}
    write_atomically(Path(work) / f"chunk-{number:06d}.json", json.dumps(summary).encode())
    return number, summary


def place_cut(chunks, characters, val_fraction):
    """Mark each chunk as training or validation text, and the chunk that holds the cut with its offset in it."""
    cut, seen = int((1 - val_fraction) * sum(characters)), 0
    for chunk, count in zip(chunks, characters):
        chunk["characters"] = count
        if seen + count <= cut or seen >= cut:
            chunk["side"], chunk["cut"] = ("train" if seen + count <= cut else "val"), None
        else:
            chunk["side"], chunk["cut"] = "both", cut - seen
        seen += count
    return chunks


class Progress:
    def __init__(self, total_bytes, quiet, started, every=2.0):
        self.total, self.quiet, self.every = total_bytes, quiet, every
        self.start, self.last = started, time.monotonic()
        self.done = self.tokens = 0

    def add(self, summary, force=False):  # force: the last chunk's line, always shown
        self.done += summary["bytes"]
        self.tokens += summary["tokens"]
        now = time.monotonic()
        if self.quiet or (now - self.last < self.every and not force):
            return
        self.last = now
        rate = self.done / max(now - self.start, 1e-9)
        left = (self.total - self.done) / rate if rate else 0
        print(f"prepare: {self.done / 1e6:,.1f} of {self.total / 1e6:,.1f} MB ({self.done / max(self.total, 1):.0%}) "
              f"| {rate / 1e6:.1f} MB/s | {self.tokens:,} tokens | ~{left:.0f} s left", flush=True)


def prepare(arguments, out, workers=None, val_fraction=0.1, chunk_mb=32, quiet=False, command=None, lock=True):
    """Prepare the sources into folder `out` (see the module's docstring); returns the description. `lock=False`:
    the caller already holds locked(out)."""
    if not 0 < val_fraction < 1:
        raise UsageError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    out = Path(out)
    if out.exists() and not (out / DESCRIPTION).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} exists and is not a prepared corpus: choose another --out (nothing was written)")
    started = time.monotonic()  # the rates count the planning too
    sources = find_sources(arguments)
    total = sum(source["bytes"] for source in sources)
    if not workers:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    chunk_bytes = int(chunk_mb * (1 << 20))
    if workers > 1:  # several chunks for every worker, so that none waits long for the last one
        chunk_bytes = min(chunk_bytes, max(1 << 20, total // (8 * workers)))
    settings = {"version": PLAN_VERSION, "tokenizer": TOKENIZER, "val_fraction": val_fraction,
                "chunk_bytes": chunk_bytes, "sources": sources}
    with locked(out) if lock else contextlib.nullcontext(), worker_pool(workers) as pool:
        work = out.with_name(out.name + ".partial")
        plan_path = work / "plan.json"
        if work.exists():
            try:
                resumed = json.loads(plan_path.read_text(encoding="utf-8"))["settings"] == settings
            except (OSError, ValueError, KeyError):
                resumed = False
            if not resumed:
                if not quiet:
                    print(f"prepare: {work} holds an interrupted preparation of other sources or settings: "
                          "starting clean", flush=True)
                shutil.rmtree(work)
        if not work.exists():
            chunks = plan_chunks(sources, chunk_bytes)
            characters = run_jobs(count_chunk, [(n, sources[c["source"]], c) for n, c in enumerate(chunks)], pool)
            if not sum(characters):
                raise UsageError("the sources hold no text: nothing to train on")
            work.mkdir(parents=True)
            chunks = place_cut(chunks, characters, val_fraction)
            write_atomically(plan_path, json.dumps({"settings": settings, "chunks": chunks}).encode())
        chunks = json.loads(plan_path.read_text(encoding="utf-8"))["chunks"]
        return _tokenize_and_assemble(sources, chunks, work, out, pool, workers, val_fraction, quiet, command, total,
                                      started)


def worker_pool(workers):
    """The worker processes, or None for one. Forked on Linux when PyTorch is not loaded (a second to start fewer);
    else spawned: no fork of a process that may hold PyTorch's threads or a GPU."""
    if workers <= 1:
        return contextlib.nullcontext(None)
    method = "fork" if sys.platform.startswith("linux") and "torch" not in sys.modules else "spawn"
    return multiprocessing.get_context(method).Pool(workers)


def run_jobs(function, jobs, pool, each=None):
    """function(job) for every job, in the pool's processes if there is one; each(index, result) as results arrive
    (in any order). Returns the results in the jobs' order."""
    results = [None] * len(jobs)
    if pool is not None and len(jobs) > 1:
        for index, result in pool.imap_unordered(_indexed, [(function, i, job) for i, job in enumerate(jobs)]):
            results[index] = result
            if each:
                each(index, result)
    else:
        for index, job in enumerate(jobs):
            results[index] = function(job)
            if each:
                each(index, results[index])
    return results


def _indexed(item):
    function, index, job = item
    return index, function(job)


def _tokenize_and_assemble(sources, chunks, work, out, pool, workers, val_fraction, quiet, command, total, started):
    summaries, progress = {}, Progress(total, quiet, started)
    for number in range(len(chunks)):
        path = work / f"chunk-{number:06d}.json"
        if path.is_file():  # written after the chunk's shards: they are whole
            summaries[number] = json.loads(path.read_text(encoding="utf-8"))
            progress.add(summaries[number])
    if summaries and not quiet:
        print(f"prepare: going on from an interrupted preparation: {len(summaries)} of {len(chunks)} chunks "
              "already done", flush=True)
    jobs = [(n, sources[c["source"]], c, str(work)) for n, c in enumerate(chunks) if n not in summaries]
    if not quiet:
        print(f"prepare: {len(sources)} source(s), {total / 1e6:,.1f} MB in {len(chunks)} chunk(s), "
              f"{min(workers, max(len(jobs), 1))} worker process(es)", flush=True)

    def finished(index, result):
        number, summary = result
        summaries[number] = summary
        progress.add(summary, force=len(summaries) == len(chunks))

    run_jobs(tokenize_chunk, jobs, pool, finished)
    description = assemble(sources, chunks, summaries, work, val_fraction)
    description["command"] = command
    description["prepared"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    write_atomically(work / DESCRIPTION, json.dumps(description, indent=1).encode())
    for name in ("plan.json", *(f"chunk-{n:06d}.json" for n in range(len(chunks)))):
        (work / name).unlink(missing_ok=True)
    swap_in(work, out)
    if not quiet:
        tokens, seconds = description["tokens"], time.monotonic() - progress.start
        print(f"prepare: wrote {out}: {tokens['train']:,} training and {tokens['val']:,} validation tokens in "
              f"{len(description['train']) + len(description['val'])} shards ({2 * sum(tokens.values()) / 1e6:,.1f} "
              f"MB) in {seconds:.1f} s ({total / 1e6 / max(seconds, 1e-9):.1f} MB/s of text)", flush=True)
    return description


def assemble(sources, chunks, summaries, work, val_fraction):
    """Name the chunks' shards by split and in order: train-000000.bin, ..., val-000000.bin, ..."""
    splits = {"train": [], "val": []}
    for number in range(len(chunks)):
        for side, part in summaries[number]["parts"].items():
            name = f"{side}-{len(splits[side]):06d}.bin"
            os.replace(work / f"chunk-{number:06d}-{side}.bin", work / name)
            splits[side].append({"file": name, **part})
    return {"format": FORMAT, "tokenizer": TOKENIZER, "vocab_size": VOCAB_SIZE, "dtype": DTYPE,
            "endoftext": VOCAB_SIZE - 1, "val_fraction": val_fraction,
            "characters": sum(chunk["characters"] for chunk in chunks),
            "documents": sum(s["documents"] for s in summaries.values()),
            "tokens": {side: sum(shard["tokens"] for shard in shards) for side, shards in splits.items()},
            "sources": [{"path": s["path"], "kind": s["kind"], "bytes": s["bytes"]} for s in sources], **splits}


def swap_in(work, out):
    """Move the finished folder to `out`; a good folder already there is replaced only now, when the new one is
    whole."""
    if out.exists():
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(work, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(work, out)


def load_corpus(name_or_path, cache_dir=None):
    """The corpus of --data, memory-mapped: a prepared folder as it is; a named corpus or a text file prepared once
    into the cache (the book's split: the last 10% of the text validates)."""
    if Path(name_or_path).is_dir():
        return open_prepared(name_or_path)
    if name_or_path in CORPORA:
        source = cached_text_path(name_or_path, cache_dir)
        folder = source.with_suffix(".tokens")
    else:
        check_text_source(name_or_path)
        source = Path(name_or_path).resolve()
        stat = source.stat()
        key = hashlib.sha1(f"{source}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        folder = cache_folder(cache_dir) / f"{source.stem}-{key}.tokens"
    if not is_prepared(folder) and not os.access(folder.parent, os.W_OK):
        folder = cache_folder() / folder.name  # a read-only checkout that ships the text: the user's cache
    if not is_prepared(folder):
        with locked(folder):
            if not is_prepared(folder):  # another process of this launch may have prepared it meanwhile
                print(f"Preparing {name_or_path} once: tokenizing into {folder} (later runs map it)", flush=True)
                workers = max(1, min(os.cpu_count() or 1, source.stat().st_size // (32 << 20)))
                prepare([source], folder, workers, DEFAULT_VAL_FRACTION, quiet=workers == 1, lock=False)
    return open_prepared(folder)


@contextlib.contextmanager
def locked(folder):
    """Hold an exclusive lock beside `folder` (where the platform has flock): one process of a launch prepares,
    the others wait for it."""
    lock_path = Path(folder).parent / f".{Path(folder).name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no flock: each process may prepare; the last rename wins, every result is whole
        yield
        return
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="*", metavar="SOURCE", help="text files, .jsonl files, or folders of them")
    parser.add_argument("--out", required=True, metavar="DIR", help="the prepared folder (train with --data DIR)")
    parser.add_argument("--workers", type=int, default=None,
                        help="tokenizing processes (default: every core this process may use)")
    parser.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                        help="the share of the characters, at the end, that validates (default: 0.1, the book's "
                             "last 10%%; a large corpus needs far less, e.g. 0.001)")
    parser.add_argument("--chunk-mb", type=float, default=32, metavar="MB",
                        help="text per chunk, in MiB, and so per shard: each chunk ends at the next safe cut after "
                             "it (default: 32; smaller for a small corpus, so that every worker gets several)")
    parser.error = lambda message: (print(f"python -m data.prepare: error: {message} (see --help)", file=sys.stderr),
                                    sys.exit(2))
    args = parser.parse_args(argv)
    if (args.workers is not None and args.workers < 1) or args.chunk_mb < 0.01:
        parser.error("--workers must be at least 1 and --chunk-mb at least 0.01")
    command = " ".join(["python -m data.prepare", *(sys.argv[1:] if argv is None else argv)])
    try:
        prepare(args.sources, args.out, args.workers, args.val_fraction, args.chunk_mb, command=command)
    except UsageError as err:
        print(f"python -m data.prepare: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"python -m data.prepare: interrupted: run the same command again to go on ({args.out} is unchanged)",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
