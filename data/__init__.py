"""Stage-independent plumbing shared by the three stage scripts: the corpus and the tokenizer."""

from data.corpus import CORPORA, UsageError, load_text
from data.tokenizer import get_tokenizer

__all__ = ["CORPORA", "UsageError", "get_tokenizer", "load_text"]
