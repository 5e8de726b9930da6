"""Multi-query associative recall (MQAR; Arora, Eyuboglu et al. 2023, "Zoology: Measuring and
improving recall in efficient language models", Sec. 3), with the semantics of zoology's
``multiquery_ar`` generator.

A sequence of ``seq_len`` tokens starts with ``n_kv`` key-value pairs; after them every key
is asked once more, in random order, at even offsets of the rest of the sequence; the model
must emit the key's value at the position of the query::

    position   0  1  2  3  4  5  6  7  8  9  10 11        (n_kv = 2, seq_len = 12)
    input      k1 v1 k2 v2 k2 .  .  .  k1 .  .  .         '.' = a random filler token
    target     -  -  -  -  v2 -  -  -  v1 -  -  -         '-' = -100 (ignored)

- Vocabulary: keys are drawn from the first half, ``1 .. vocab_size // 2 - 1`` (0 is
  zoology's placeholder for "no query here", replaced by filler), values from the second half,
  ``vocab_size // 2 .. vocab_size - 1``; the keys of one sequence are distinct and so are its
  values.
- Query spacing follows a power law: the query of pair i sits at ``2 n_kv + gap + 2 s_i`` with
  the slots s_i drawn without replacement from ``0 .. space - 1`` (``space = (seq_len - 2 n_kv - gap) // 2``)
  with probability ``∝ a · j^(a-1)`` for ``j = s_i + 1``. Zoology's default ``a = 0.01`` puts
  most queries right after the pairs, as repeated bigrams cluster in real text; ``a = 1`` is
  uniform. ``gap`` (even, default 0 as in zoology) puts that many filler tokens between the last
  pair and the first query slot, so that every query lies more than ``gap`` tokens after its
  pair: beyond the reach of a backbone of local mixers (the toys' memory-only protocol).
- Every other position is a token drawn uniformly from the whole vocabulary (zoology's
  ``random_non_queries``), so a filler token may equal a key or a value; only the labelled
  positions count.
- ``targets[b, t]`` is what position t must predict (the value at a query, -100 elsewhere), the
  convention of ``HybridLM.forward(targets=...)``; accuracy is the fraction of labelled
  positions whose arg-max prediction is the value (zoology's metric).

Batches are pure functions of a ``torch.Generator``::

    g = torch.Generator().manual_seed(0)
    b = make_batch(64, n_kv=8, seq_len=64, vocab_size=256, generator=g)   # b.inputs, b.targets [64, 64]
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

IGNORE = -100


class MQARBatch(NamedTuple):
    """inputs [B, T] (long) and targets [B, T] (the value at each query position, -100 elsewhere)."""

    inputs: Tensor
    targets: Tensor


def check_sizes(n_kv: int, seq_len: int, vocab_size: int, gap: int = 0) -> None:
    """Raise a ValueError naming the fix when the sizes cannot make an MQAR sequence."""
    if n_kv < 1:
        raise ValueError(f"n_kv must be >= 1, got {n_kv}")
    if seq_len % 2:
        raise ValueError(f"seq_len must be even (queries sit at even offsets), got {seq_len}")
    if isinstance(gap, bool) or not isinstance(gap, int) or gap < 0 or gap % 2:
        raise ValueError(f"gap must be an even int >= 0 (queries sit at even offsets), got {gap!r}")
    if 4 * n_kv + gap > seq_len:  # zoology's bound: room for the pairs and as many query slots
        raise ValueError(f"n_kv={n_kv} needs seq_len >= 4 * n_kv + gap = {4 * n_kv + gap}, got {seq_len}")
    if vocab_size // 2 - 1 < n_kv:
        raise ValueError(
            f"vocab_size={vocab_size} has {vocab_size // 2 - 1} key tokens (1 .. vocab_size // 2 - 1) "
            f"but n_kv={n_kv} distinct keys are needed; use vocab_size >= {2 * n_kv + 2}"
        )


def power_law(space: int, power_a: float) -> Tensor:
    """p[j] ∝ a · (j + 1)^(a - 1), j = 0 .. space - 1: zoology's distribution of query gaps."""
    if not power_a > 0:
        raise ValueError(f"power_a must be > 0 (1 = uniform gaps), got {power_a}")
    j = torch.arange(1, space + 1, dtype=torch.float64)
    p = power_a * j ** (power_a - 1)
    return p / p.sum()


def _distinct(batch_size: int, low: int, high: int, n: int, g: torch.Generator | None) -> Tensor:
    """n distinct integers per row from low .. high - 1, uniformly."""
    return torch.rand(batch_size, high - low, generator=g).argsort(dim=1)[:, :n] + low


def make_batch(
    batch_size: int,
    n_kv: int,
    seq_len: int = 64,
    vocab_size: int = 256,
    power_a: float = 0.01,
    generator: torch.Generator | None = None,
    *,
    random_fill: bool = True,
    gap: int = 0,
) -> MQARBatch:
    """A batch of MQAR sequences (see the module docstring). ``random_fill=False`` leaves the
    filler as 0, zoology's form for printing examples."""
    check_sizes(n_kv, seq_len, vocab_size, gap)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    g, B, n, half = generator, batch_size, n_kv, vocab_size // 2
    keys = _distinct(B, 1, half, n, g)
    values = _distinct(B, half, vocab_size, n, g)
    context = 2 * n
    space = (seq_len - context - gap) // 2
    gaps = torch.multinomial(power_law(space, power_a).float().expand(B, space), n, replacement=False, generator=g)
    qpos = context + gap + 2 * gaps  # [B, n]: where key i is asked

    inputs = torch.zeros(B, seq_len, dtype=torch.long)
    inputs[:, 0:context:2], inputs[:, 1:context:2] = keys, values
    inputs.scatter_(1, qpos, keys)
    targets = torch.full((B, seq_len), IGNORE, dtype=torch.long)
    targets.scatter_(1, qpos, values)
    fill = torch.randint(0, vocab_size, (B, seq_len), generator=g)  # drawn always: the same stream either way
    if random_fill:
        free = torch.ones(B, seq_len, dtype=torch.bool)
        free[:, :context] = False  # (the gap's tokens are filler too)
        free.scatter_(1, qpos, False)
        inputs = torch.where(free, fill, inputs)
    return MQARBatch(inputs, targets)


def mixed_batch(
    batch_size: int,
    kv_counts: list[int],
    seq_len: int = 64,
    vocab_size: int = 256,
    power_a: float = 0.01,
    generator: torch.Generator | None = None,
    *,
    gap: int = 0,
) -> MQARBatch:
    """One batch holding every count of ``kv_counts`` in equal parts (the remainder goes to the
    first counts), as zoology trains on a mixture of difficulties."""
    if not kv_counts:
        raise ValueError("kv_counts is empty; give at least one number of key-value pairs")
    if batch_size < len(kv_counts):
        raise ValueError(f"batch_size={batch_size} is smaller than the {len(kv_counts)} kv counts it must hold")
    q, r = divmod(batch_size, len(kv_counts))
    parts = [make_batch(q + (i < r), n, seq_len, vocab_size, power_a, generator, gap=gap) for i, n in enumerate(kv_counts)]
    return MQARBatch(torch.cat([p.inputs for p in parts]), torch.cat([p.targets for p in parts]))


def accuracy(logits: Tensor, targets: Tensor) -> float:
    """Fraction of labelled positions (targets != -100) whose arg-max is the target."""
    mask = targets != IGNORE
    if not mask.any():
        raise ValueError("no labelled positions (every target is -100)")
    return (logits.argmax(-1)[mask] == targets[mask]).float().mean().item()


