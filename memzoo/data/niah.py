"""Needle in a haystack (NIAH), as the FwPKM paper builds it (Sec. 4.3).

"Each sample contains a haystack - a 4K-length sequence from the LAMBADA dataset with 5
needles inserted at random positions, where each needle contains a unique 4-character key
and a 6-digit value - and a question that requests the value of a specific key."

Here a sample is three token sequences:

    haystack   real text (held-out documents) with 5 needles inserted at line starts,
               exactly ``length`` tokens:            "... Remember qzfa=481273.\\n ..."
    question   after the haystack:                   "\\nWhat is qzfa? qzfa="
    answer     the 6 digits                          "481273"

The paper gives neither the needle nor the question wording; ours ends the question with the
needle's own "qzfa=", so the answer is the recall of what followed the key in the haystack, one
associative hop (with "The key qzfa holds 481273" the key sits 7 tokens before the digits and
tiny byte-level models trained for minutes stayed at chance). Keys are 4 distinct lowercase letters, values 6-digit numbers (no leading zero),
both unique within a sample. The haystack is a window of the concatenated texts starting at a
line start (wrapping round when the texts are shorter than the window); needles go in at line
starts, so they never split a word, and each records its depth (start token / ``length``).
Everything is a pure function of the seed, and works with any :class:`Tokenizer` (needles and
filler are tokenised separately and concatenated, so the length in tokens is exact).

:class:`NeedleMix` is the training side for tiny models: a training stream in which a fraction
of the windows are short needle samples (1-5 needles, question and answer inside the window).
A small LM trained for minutes on plain text never meets the question format, so without
such windows its NIAH accuracy would be zero for every memory layer and compare nothing.
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from memzoo.data.tokenizers import Tokenizer

NEEDLE = "Remember {key}={value}.\n"
QUESTION = "\nWhat is {key}? {key}="
KEY_LEN, VALUE_DIGITS = 4, 6


@dataclass
class Needle:
    key: str
    value: str
    position: int  # token index of the needle's first token in the haystack
    depth: float  # position / haystack length, in [0, 1)


@dataclass
class NiahSample:
    haystack: torch.Tensor  # [length] token ids, needles included
    question: torch.Tensor  # token ids of the question (ends right before the answer)
    answer: torch.Tensor  # token ids of the 6-digit value of the queried needle
    needles: list[Needle]  # in haystack order
    query: int  # index into `needles` of the key the question asks for

    @property
    def depth(self) -> float:
        """Depth of the queried needle (what the depth x length heatmap bins)."""
        return self.needles[self.query].depth

    @property
    def length(self) -> int:
        return int(self.haystack.numel())


def _rng(*parts) -> random.Random:
    """A generator that depends only on `parts` (not on PYTHONHASHSEED or call order)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


class TextSource:
    """Token windows of real text that start at a line start, and where lines begin in them.

    `texts` are joined with newlines; a window wraps round to the start when it is longer
    than what is left (or than all the text)."""

    def __init__(self, texts: Sequence[str], tokenizer: Tokenizer):
        parts = [t.strip("\n") for t in texts if t and t.strip()]
        if not parts:
            raise ValueError("TextSource needs at least one non-empty text")
        self.text = "\n".join(parts) + "\n"
        self.tok = tokenizer
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", self.text[:-1])]
        sample = self.text[:20000]
        self.chars_per_token = len(sample) / max(1, len(tokenizer.encode(sample)))
        self._ends_line: dict[int, bool] = {}

    def _chars(self, start: int, n: int) -> str:
        out, left = [], n
        while left > 0:
            piece = self.text[start : start + left]
            out.append(piece)
            left -= len(piece)
            start = 0
        return "".join(out)

    def window(self, n_tokens: int, rng: random.Random) -> torch.Tensor:
        """`n_tokens` ids of text from a random line start."""
        if n_tokens <= 0:
            return torch.empty(0, dtype=torch.long)
        start = rng.choice(self.line_starts)
        n_chars = int(n_tokens * self.chars_per_token * 1.1) + 64
        while True:
            ids = self.tok.encode_tensor(self._chars(start, n_chars))
            if ids.numel() >= n_tokens:
                return ids[:n_tokens]
            n_chars *= 2

    def line_starts_of(self, ids: torch.Tensor) -> list[int]:
        """Positions i in [1, len) where token i starts a line (token i-1 ends with a newline),
        plus 0 (a window starts at a line start)."""
        for i in torch.unique(ids).tolist():  # decode each distinct id once per source
            if i not in self._ends_line:
                self._ends_line[i] = self.tok.decode([i]).endswith("\n")
        newline = [i for i, e in self._ends_line.items() if e]
        if not newline or ids.numel() < 2:
            return [0]
        ends = torch.isin(ids[:-1], torch.tensor(newline, dtype=ids.dtype))
        return [0] + (torch.nonzero(ends).flatten() + 1).tolist()


def _keys_values(rng: random.Random, n: int) -> tuple[list[str], list[str]]:
    keys: list[str] = []
    while len(keys) < n:
        k = "".join(rng.choice(string.ascii_lowercase) for _ in range(KEY_LEN))
        if k not in keys:
            keys.append(k)
    values: list[str] = []
    while len(values) < n:
        v = str(rng.randrange(10 ** (VALUE_DIGITS - 1), 10**VALUE_DIGITS))
        if v not in values:
            values.append(v)
    return keys, values


def _question(tok: Tokenizer, key: str, value: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Question and answer ids. The answer is the continuation of the question's tokens in
    the tokenisation of question + value where that keeps the question as a prefix (it
    always does for bytes), else the value tokenised on its own."""
    q_text = QUESTION.format(key=key)
    q, full = tok.encode(q_text), tok.encode(q_text + value)
    a = full[len(q) :] if full[: len(q)] == q and len(full) > len(q) else tok.encode(value)
    return torch.tensor(q, dtype=torch.long), torch.tensor(a, dtype=torch.long)


def _assemble(
    source: TextSource,
    rng: random.Random,
    keys: list[str],
    values: list[str],
    query: int,
    length: int,
    depth: tuple[float, float] | None,
) -> tuple[torch.Tensor, list[Needle], int]:
    """Filler text with the needles inserted at distinct random line starts; exactly `length`
    tokens. `depth` = (lo, hi) puts the queried needle's insertion point in that depth range
    (as a fraction of the filler; the nearest line start when the range holds none). Returns
    the ids, the needles in haystack order, and the queried needle's index among them."""
    tok = source.tok
    ids = [tok.encode_tensor(NEEDLE.format(key=k, value=v)) for k, v in zip(keys, values)]
    F = length - sum(int(x.numel()) for x in ids)
    if F < 0:
        need = length - F
        raise ValueError(f"a haystack of {length} tokens cannot hold {len(keys)} needles ({need} tokens); use a longer length")
    filler = source.window(F, rng)
    cands = source.line_starts_of(filler) if F > 0 else [0]
    pos = [0] * len(keys)
    if depth is not None:
        lo, hi = depth
        inside = [c for c in cands if lo <= c / max(F, 1) < hi]
        mid = (lo + hi) / 2 * F
        pos[query] = rng.choice(inside) if inside else min(cands, key=lambda c: (abs(c - mid), c))
    else:
        pos[query] = rng.choice(cands)
    rest = [c for c in cands if c != pos[query]]
    others = [i for i in range(len(keys)) if i != query]
    picks = rng.sample(rest, len(others)) if len(rest) >= len(others) else [rng.choice(cands) for _ in others]
    for i, p in zip(others, picks):
        pos[i] = p
    order = sorted(range(len(keys)), key=lambda i: (pos[i], i))
    segs, needles, prev, shift = [], [], 0, 0
    for i in order:
        segs += [filler[prev : pos[i]], ids[i]]
        start = pos[i] + shift
        needles.append(Needle(keys[i], values[i], start, start / length))
        shift += int(ids[i].numel())
        prev = pos[i]
    segs.append(filler[prev:])
    hay = torch.cat(segs)
    assert hay.numel() == length, (hay.numel(), length)
    return hay, needles, order.index(query)


def make_sample(
    source: TextSource,
    length: int,
    rng: random.Random,
    n_needles: int = 5,
    depth: tuple[float, float] | None = None,
) -> NiahSample:
    """One NIAH sample: a `length`-token haystack from `source` with `n_needles` needles, and a
    question for one of them (the queried needle in depth range `depth` if given)."""
    if n_needles < 1:
        raise ValueError(f"n_needles must be >= 1, got {n_needles}")
    keys, values = _keys_values(rng, n_needles)
    query = rng.randrange(n_needles)
    q, a = _question(source.tok, keys[query], values[query])
    hay, needles, qi = _assemble(source, rng, keys, values, query, length, depth)
    return NiahSample(hay, q, a, needles, qi)


def depth_bins(n: int) -> list[tuple[float, float]]:
    return [(i / n, (i + 1) / n) for i in range(n)]


def depth_label(lo: float, hi: float) -> str:
    return f"{round(lo * 100)}-{round(hi * 100)}%"


def niah_samples(
    texts: Sequence[str] | TextSource,
    tokenizer: Tokenizer,
    length: int,
    n: int,
    seed: int = 0,
    n_needles: int = 5,
    depth_buckets: int = 1,
) -> list[NiahSample]:
    """`n` samples of `length` tokens; sample i is a pure function of (seed, length, i). With
    `depth_buckets` > 1 the queried needle of sample i lies in depth bucket i mod depth_buckets
    (stratified, so a depth x length heatmap has every cell filled); the other needles stay
    uniformly random. Eval haystacks should come from text the model was not trained on."""
    source = texts if isinstance(texts, TextSource) else TextSource(texts, tokenizer)
    bins = depth_bins(depth_buckets) if depth_buckets > 1 else None
    return [
        make_sample(source, length, _rng("memzoo-niah", seed, length, i), n_needles, bins[i % len(bins)] if bins else None)
        for i in range(n)
    ]


class NeedleMix:
    """A training stream whose windows are a fraction `mix` of needle samples (tiny preset).

    Wraps `stream` (an :class:`memzoo.data.LMStream`, or anything with the same
    ``batch(step, batch_size) -> (x, y)``); each row of a batch is, with probability `mix`,
    replaced by a needle window of ``seq_len + 1`` tokens from `train_texts`: a short haystack
    with 1..`max_needles` needles (as many as fit), then a question and its answer for every
    needle, which end the window. ``x, y`` are the window and the window shifted by one, as in plain LM
    training (every position is a target, the answer digits included). Batch `step` is a pure
    function of (seed, step, batch_size), like LMStream's, so resumed runs see the same data.

    `answer_weight` (w != 1): the batches are ``x, (y, weights)``, where a target that is an
    answer token weighs w and every other target 1 (:func:`memzoo.train.lm_loss` takes the
    weighted mean). The answer digits are 2-5% of a needle window, and with the plain loss
    they give no signal until a copy circuit exists: a tiny full-attention LM stayed at chance
    for as long as we trained it, and learnt to copy within 750 steps with w = 20
    (:mod:`research.niah_control`).
    """

    def __init__(
        self,
        stream,
        train_texts: Sequence[str],
        tokenizer: Tokenizer,
        seq_len: int,
        mix: float = 0.3,
        seed: int = 0,
        max_needles: int = 5,
        answer_weight: float = 1.0,
    ):
        if not 0.0 <= mix <= 1.0:
            raise ValueError(f"mix must be in [0, 1], got {mix}")
        if max_needles < 1:
            raise ValueError(f"max_needles must be >= 1, got {max_needles}")
        if not answer_weight > 0:
            raise ValueError(f"answer_weight must be > 0, got {answer_weight}")
        self.stream, self.seq_len, self.mix, self.seed = stream, int(seq_len), float(mix), int(seed)
        self.max_needles, self.answer_weight = max_needles, float(answer_weight)
        self.source = TextSource(train_texts, tokenizer)
        # the smallest window: one needle, its question and answer
        rng = _rng("memzoo-needlemix-check", seed)
        keys, values = _keys_values(rng, 1)
        q, a = _question(tokenizer, keys[0], values[0])
        need = q.numel() + a.numel() + tokenizer.encode_tensor(NEEDLE.format(key=keys[0], value=values[0])).numel()
        if need > self.seq_len + 1:
            raise ValueError(f"seq_len={seq_len} is too short for a needle window ({need} tokens); use seq_len >= {need}")

    def __getattr__(self, name):  # num_tokens, tokens, ...: the wrapped stream's
        if name == "stream":
            raise AttributeError(name)
        return getattr(self.stream, name)

    def window(self, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
        """One needle window: ``seq_len + 1`` ids: a short haystack with n needles, then a
        question and answer for each needle in random order (n recalls per window, not one:
        the recall signal a minutes-trained model gets is n times denser); and the mask of
        its answer tokens."""
        tok, n = self.source.tok, rng.randint(1, self.max_needles)
        while True:
            keys, values = _keys_values(rng, n)
            asked = rng.sample(range(n), n)
            qa = [_question(tok, keys[i], values[i]) for i in asked]
            L = self.seq_len + 1 - sum(int(q.numel() + a.numel()) for q, a in qa)
            try:
                hay, _, _ = _assemble(self.source, rng, keys, values, asked[-1], L, None)
            except ValueError:  # too many needles for this window: one fewer
                if n == 1:
                    raise
                n -= 1
                continue
            ids, answer = [hay], [torch.zeros(hay.numel(), dtype=torch.bool)]
            for q, a in qa:
                ids += [q, a]
                answer += [torch.zeros(q.numel(), dtype=torch.bool), torch.ones(a.numel(), dtype=torch.bool)]
            return torch.cat(ids), torch.cat(answer)

    def batch(self, step: int, batch_size: int):
        x, y = self.stream.batch(step, batch_size)
        weighted = self.answer_weight != 1.0
        if self.mix == 0.0:
            return (x, (y, torch.ones(y.shape))) if weighted else (x, y)
        x, y = x.clone(), y.clone()
        answer = torch.zeros(y.shape, dtype=torch.bool)
        rng = _rng("memzoo-needlemix", self.seed, step, batch_size)
        for r in range(batch_size):
            if rng.random() < self.mix:
                w, a = self.window(rng)
                x[r], y[r], answer[r] = w[:-1], w[1:], a[1:]
        if not weighted:
            return x, y
        return x, (y, 1.0 + (self.answer_weight - 1.0) * answer.float())
