"""Data for memzoo LMs: real English corpora, tokenizers, and LM batching.

>>> from memzoo.data import load_corpus, split_documents, get_tokenizer, tokenize_corpus, LMStream
>>> ds = load_corpus("shakespeare")                      # doc_id, title, text; one row per work
>>> splits = split_documents(ds, val_fraction=0.1, seed=0)
>>> tok = get_tokenizer("byte")                          # or "mistral", or an HF name
>>> train = tokenize_corpus(splits["train"], tok)        # list of 1-D LongTensors, EOS appended
>>> x, y = LMStream(train, seq_len=512, seed=0).batch(step=0, batch_size=8)
"""

from memzoo.data.corpora import (
    BIBLE_SETUP,
    SHAKESPEARE_SETUP,
    CorpusUnavailableError,
    cache_dir,
    corpus_available,
    corpus_names,
    load_corpus,
    split_documents,
)
from memzoo.data.lm import (
    DocumentStream,
    HubStream,
    LMStream,
    RepeatMix,
    sequential_chunks,
    tokenize_corpus,
    unigram_cross_entropy,
    unigram_entropy,
)
from memzoo.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    get_tokenizer,
    mistral_tokenizer_path,
)

__all__ = [
    "BIBLE_SETUP",
    "SHAKESPEARE_SETUP",
    "ByteTokenizer",
    "CorpusUnavailableError",
    "DocumentStream",
    "HubStream",
    "HFTokenizer",
    "LMStream",
    "RepeatMix",
    "SentencePieceTokenizer",
    "Tokenizer",
    "cache_dir",
    "corpus_available",
    "corpus_names",
    "get_tokenizer",
    "load_corpus",
    "mistral_tokenizer_path",
    "sequential_chunks",
    "split_documents",
    "tokenize_corpus",
    "unigram_cross_entropy",
    "unigram_entropy",
]
