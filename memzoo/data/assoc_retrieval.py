"""Ba et al.'s associative-retrieval toy task (Ba et al. 2016, "Using Fast Weights to Attend
to the Recent Past", Sec. 4.1).

A sequence lists ``n_pairs`` key/value pairs — a letter followed by a digit, the letters of a
sequence all distinct — then two ``?`` separators, then one of the keys as the query. The
target is the digit that followed the queried letter::

    c9k8j3f1??c   ->  9          (the paper's example, n_pairs = 4)

With ``trailing_read=True`` one more ``?`` is appended (``c9k8j3f1??c?``): a step with no new
information after the query, so a recurrent model gets one more update to settle on the
answer (the `k1 v1 … kn vn ? ? q ?` form; the paper's form has no trailing ``?``).
A sequence has ``2 * n_pairs + 3`` tokens (``+ 1`` with the trailing read).

Vocabulary (37 tokens, as in the paper): ids 0-25 are the letters ``a``-``z``, ids 26-35 the
digits ``0``-``9``, id 36 is ``?``. Targets are token ids (so a 37-way classifier predicts
them directly); ``digit = answer - DIGIT_OFFSET``.

Batches are pure functions of a ``torch.Generator``: the same seed gives the same batches.

    g = torch.Generator().manual_seed(0)
    b = make_batch(128, n_pairs=4, generator=g)    # b.tokens [128, 11], b.answer [128], b.slot [128]
    decode(b.tokens[0]), decode(b.answer[:1])      # e.g. ('c9k8j3f1??c', '9')
"""

from __future__ import annotations

import string
from typing import NamedTuple

import torch
from torch import Tensor

LETTERS = string.ascii_lowercase  # keys
DIGITS = string.digits  # values
QUERY_MARK = "?"
VOCAB = LETTERS + DIGITS + QUERY_MARK  # id = position in this string
VOCAB_SIZE = len(VOCAB)  # 37
LETTER_OFFSET, DIGIT_OFFSET, QUERY_ID = 0, len(LETTERS), len(LETTERS) + len(DIGITS)
MAX_PAIRS = len(LETTERS)  # keys are distinct letters
_CHAR_TO_ID = {c: i for i, c in enumerate(VOCAB)}


class AssocBatch(NamedTuple):
    """tokens [B, L] (long), answer [B] (token id of the digit), slot [B] (which pair, 0 = first, was queried)."""

    tokens: Tensor
    answer: Tensor
    slot: Tensor


def seq_len(n_pairs: int, trailing_read: bool = False) -> int:
    """Length of one sequence: n pairs, '??', the query (and the trailing '?')."""
    return 2 * n_pairs + 3 + int(trailing_read)


def encode(text: str) -> Tensor:
    """'c9k8j3f1??c' -> LongTensor of token ids."""
    try:
        return torch.tensor([_CHAR_TO_ID[c] for c in text], dtype=torch.long)
    except KeyError as e:
        raise ValueError(f"character {e.args[0]!r} is not in the vocabulary {VOCAB!r}") from None


def decode(ids: Tensor) -> str:
    """Token ids (1-D) -> string."""
    return "".join(VOCAB[i] for i in ids.tolist())


def make_batch(
    batch_size: int,
    n_pairs: int,
    generator: torch.Generator | None = None,
    *,
    trailing_read: bool = False,
) -> AssocBatch:
    """A batch of ``batch_size`` sequences with ``n_pairs`` pairs each (see module docstring).

    Keys are distinct letters drawn uniformly (a random permutation per row); values are digits
    drawn uniformly and independently (they may repeat); the queried pair is uniform.
    """
    if not 1 <= n_pairs <= MAX_PAIRS:
        raise ValueError(f"n_pairs must be in 1..{MAX_PAIRS} (keys are distinct letters), got {n_pairs}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    g = generator
    B, n = batch_size, n_pairs
    keys = torch.rand(B, len(LETTERS), generator=g).argsort(dim=1)[:, :n] + LETTER_OFFSET  # distinct per row
    values = torch.randint(0, len(DIGITS), (B, n), generator=g) + DIGIT_OFFSET
    slot = torch.randint(0, n, (B,), generator=g)
    rows = torch.arange(B)
    query, answer = keys[rows, slot], values[rows, slot]

    pairs = torch.stack([keys, values], dim=2).reshape(B, 2 * n)  # k1 v1 k2 v2 ...
    marks = torch.full((B, 2), QUERY_ID, dtype=torch.long)
    parts = [pairs, marks, query[:, None]]
    if trailing_read:
        parts.append(torch.full((B, 1), QUERY_ID, dtype=torch.long))
    return AssocBatch(torch.cat(parts, dim=1), answer, slot)


def eval_set(
    size: int, n_pairs: int, seed: int = 1234, *, trailing_read: bool = False
) -> AssocBatch:
    """A fixed held-out set (its own generator, so it never shares draws with training batches).
    There are 26!/(26-n)! · 10^n · n sequences, so a random training batch repeats a held-out
    sequence with negligible probability for n >= 3 (n = 1 has only 26·10 distinct ones)."""
    return make_batch(size, n_pairs, torch.Generator().manual_seed(seed), trailing_read=trailing_read)


