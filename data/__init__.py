"""Stage-independent plumbing shared by the stage scripts: the corpus, its token shards and the tokenizer."""

from data.corpus import CORPORA, UsageError, load_text
from data.shards import load_corpus
from data.tokenizer import get_tokenizer

__all__ = ["CORPORA", "UsageError", "get_tokenizer", "load_corpus", "load_text"]
