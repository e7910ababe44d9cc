"""Stage-independent plumbing shared by the stage scripts: the corpus, its token shards and the tokenizer."""

from data.corpus import CORPORA, load_text
from data.tokenizer import get_tokenizer

__all__ = ["CORPORA", "get_tokenizer", "load_corpus", "load_text"]


def load_corpus(name_or_path, cache_dir=None):
    """data.prepare.load_corpus, imported here at the first call: `python -m data.prepare` must not import itself."""
    from data.prepare import load_corpus as prepared_corpus

    return prepared_corpus(name_or_path, cache_dir)
