"""Language-model data: tokenised documents, reproducible training batches, sequential chunks.

* :func:`tokenize_corpus` -- one 1-D ``LongTensor`` per document, EOS appended, cached on disk.
* :class:`LMStream` -- random training windows; batch ``step`` is a pure function of
  ``(seed, step, batch_size)``, so a resumed run sees exactly the batches it would have seen.
* :func:`sequential_chunks` -- consecutive non-overlapping windows of each document in order,
  for perplexity with recurrent / fast-weight state carried across a document's sequences.
* :func:`unigram_entropy`, :func:`unigram_cross_entropy` -- the reference a model must beat.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator, Sequence

import torch

from memzoo.data.corpora import cache_dir
from memzoo.data.tokenizers import Tokenizer
from memzoo.storage import torch_save

_TOKEN_CACHE_VERSION = 1


def _corpus_digest(ds) -> str:
    """SHA-1 of the corpus' ``doc_id``/``text`` columns: the corpus half of the cache key."""
    h = hashlib.sha1()
    ids = ds["doc_id"] if "doc_id" in ds.column_names else range(len(ds))
    for doc_id, text in zip(ids, ds["text"]):
        data = text.encode("utf-8")
        h.update(f"{doc_id}:{len(data)}:".encode())
        h.update(data)
    return h.hexdigest()[:16]


def tokenize_corpus(ds, tok: Tokenizer, *, cache: bool = True) -> list[torch.Tensor]:
    """Tokenise every document of ``ds`` (column ``text``) and append ``tok.eos_id`` to each.

    Returns one 1-D ``torch.long`` tensor per row, in row order. Results are cached at
    ``$MEMZOO_CACHE/tokens/<tokenizer>-<corpus sha1>.pt`` (written atomically), keyed by the
    corpus text and ``tok.fingerprint``, so a second call on the same corpus is a file load.
    Pass ``cache=False`` to skip the disk cache.
    """
    path = None
    if cache:
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", tok.fingerprint)[:120]
        path = cache_dir("tokens") / f"v{_TOKEN_CACHE_VERSION}-{safe}-{_corpus_digest(ds)}.pt"
        if path.exists():
            try:
                blob = torch.load(path, map_location="cpu", weights_only=True)
                flat, lengths = blob["flat"].long(), blob["lengths"].tolist()
                return list(torch.split(flat, lengths))
            except Exception:  # corrupt or old-format file: rebuild it below
                pass
    eos = torch.tensor([tok.eos_id], dtype=torch.long)
    docs = [torch.cat([tok.encode_tensor(text), eos]) for text in ds["text"]]
    if path is not None:
        flat = torch.cat(docs) if docs else torch.empty(0, dtype=torch.long)
        dtype = torch.int32 if tok.vocab_size < 2**31 else torch.long
        lengths = torch.tensor([len(d) for d in docs], dtype=torch.long)
        torch_save({"flat": flat.to(dtype), "lengths": lengths}, path)
    return docs


def _step_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed that depends only on ``(seed, step)``."""
    digest = hashlib.blake2b(f"memzoo-lmstream:{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class LMStream:
    """Random fixed-length training windows over the concatenation of documents.

    Documents (each already ending in EOS, as from :func:`tokenize_corpus`) are concatenated
    in order; :meth:`batch` draws ``batch_size`` windows of ``seq_len + 1`` tokens at
    uniformly random offsets using a ``torch.Generator`` seeded from ``(seed, step)`` only.
    Windows may straddle a document boundary (the EOS token marks it).

    Args:
        docs: 1-D integer tensors, one per document.
        seq_len: tokens per training sequence ``T``.
        seed: base seed of the stream.
    """

    def __init__(self, docs: Sequence[torch.Tensor], seq_len: int, seed: int = 0):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if len(docs) == 0:
            raise ValueError("LMStream needs at least one document")
        self.tokens = torch.cat([d.reshape(-1).long() for d in docs])
        if self.tokens.numel() < seq_len + 1:
            raise ValueError(
                f"corpus has {self.tokens.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}"
            )
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self._offsets = torch.arange(self.seq_len + 1)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number ``step``: ``(x, y)``, both ``LongTensor[batch_size, seq_len]``, ``y`` = ``x`` shifted by one.

        Depends only on ``(seed, step, batch_size)`` and the tokens, never on earlier calls.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        g = torch.Generator().manual_seed(_step_seed(self.seed, step))
        n_starts = self.num_tokens - self.seq_len  # valid starts: 0 .. N - T - 1
        starts = torch.randint(0, n_starts, (batch_size,), generator=g)
        windows = self.tokens[starts[:, None] + self._offsets]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()



class DocumentStream:
    """Training windows that follow documents in order: row b of batch i + 1 continues where
    row b of batch i ended (FwPKM Sec. 4.2 trains this way, so that fast weights carried from one
    step to the next hold the preceding text of the same documents).

    The documents, in an order shuffled by `seed`, are concatenated (each ends in EOS) and cut
    into `rows` equal parts; batch `step` is window ``step mod n`` of every part, where n is the
    number of whole windows in a part (the stream then starts again). ``batch(step, rows)`` is a
    pure function of (seed, step); the batch size must be `rows`.
    """

    def __init__(self, docs: Sequence[torch.Tensor], seq_len: int, rows: int, seed: int = 0):
        if seq_len < 1 or rows < 1:
            raise ValueError(f"seq_len and rows must be >= 1, got {seq_len} and {rows}")
        if len(docs) == 0:
            raise ValueError("DocumentStream needs at least one document")
        order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
        self.tokens = torch.cat([docs[i].reshape(-1).long() for i in order])
        self.seq_len, self.rows, self.seed = int(seq_len), int(rows), int(seed)
        self.part = self.tokens.numel() // rows
        self.windows = (self.part - 1) // seq_len  # whole windows (seq_len + 1 tokens, overlapping by one) per part
        if self.windows < 1:
            raise ValueError(f"{self.tokens.numel()} tokens cannot fill {rows} rows of {seq_len + 1}")
        self._offsets = torch.arange(self.seq_len + 1)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if batch_size != self.rows:
            raise ValueError(f"a DocumentStream of {self.rows} rows gives batches of {self.rows}, not {batch_size}")
        starts = torch.arange(self.rows) * self.part + (step % self.windows) * self.seq_len
        w = self.tokens[starts[:, None] + self._offsets]
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


class HubStream:
    """Training windows from a dataset streamed by `datasets` (``load_dataset(..., streaming=True)``):
    a Hub corpus by name when online (fineweb-edu, a long-document corpus), or a local dataset
    directory, tokenized as it arrives (EOS after each document) by any memzoo tokenizer.

    Packing keeps document order as :class:`DocumentStream` does: row b of batch i + 1 continues
    where row b of batch i ended, a row taking the stream's next document when its own ends, so
    fast weights carried from step to step hold the preceding text of the same documents (FwPKM
    Sec. 4.2). A stream cannot jump: ``batch(step)`` produces batches in order and drops those it
    is not asked for (a resumed run, or another rank's micro-batches, reads past them), so batch
    `step` is still a pure function of the stream and `step`.
    """

    def __init__(self, docs, tok, seq_len: int, rows: int):
        if seq_len < 1 or rows < 1:
            raise ValueError(f"seq_len and rows must be >= 1, got {seq_len} and {rows}")
        self.tok, self.seq_len, self.rows = tok, int(seq_len), int(rows)
        self._docs = iter(docs)
        self._buf = [torch.empty(0, dtype=torch.long) for _ in range(rows)]
        self._next = 0  # the batch the stream produces next

    def _document(self) -> torch.Tensor:
        try:
            text = next(self._docs)["text"]
        except StopIteration:
            raise RuntimeError(f"the streamed corpus ran out after {self._next} batches; train fewer steps") from None
        return torch.cat([self.tok.encode_tensor(text), torch.tensor([self.tok.eos_id])])

    def _produce(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = []
        for b in range(self.rows):
            while self._buf[b].numel() < self.seq_len + 1:
                self._buf[b] = torch.cat([self._buf[b], self._document()])
            w.append(self._buf[b][: self.seq_len + 1])
            self._buf[b] = self._buf[b][self.seq_len :]  # the next window starts at this one's last token
        self._next += 1
        w = torch.stack(w)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if batch_size != self.rows:
            raise ValueError(f"a HubStream of {self.rows} rows gives batches of {self.rows}, not {batch_size}")
        if step < self._next:
            raise ValueError(f"a HubStream produces batches in order: batch {step} was already read "
                             f"(next: {self._next})")
        while self._next < step:
            self._produce()
        return self._produce()


class RepeatMix:
    """A training stream in which a fraction `mix` of the windows read a passage twice.

    Wraps `stream` (an :class:`LMStream`, or anything with ``batch(step, batch_size) -> (x, y)``
    of token ids); each row of a batch is, with probability `mix`, replaced by its own first
    ``h = ceil((seq_len + 1) / 2)`` tokens followed by the same tokens again (cut to
    ``seq_len + 1``), so the second half is a verbatim copy of the first. Batch `step` is a pure
    function of (seed, step, batch_size), like LMStream's.

    Why (the ppl suite's repeated-passage probe, bench/suites/ppl.py): a 1M-parameter LM
    trained for minutes on plain text forms no copy circuit, so even full attention that sees a
    passage's first reading predicts its second no better (measured there). Windows that repeat
    themselves teach copying, the skill that LMs at the paper's scale pick up from text; a
    memory layer can then show whether it carries a passage from one sequence to the next.
    """

    def __init__(self, stream, seq_len: int, mix: float, seed: int = 0):
        if not 0.0 <= mix <= 1.0:
            raise ValueError(f"mix must be in [0, 1], got {mix}")
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 to repeat a passage, got {seq_len}")
        self.stream, self.seq_len, self.mix, self.seed = stream, int(seq_len), float(mix), int(seed)

    def __getattr__(self, name):  # num_tokens, tokens, ...: the wrapped stream's
        if name == "stream":
            raise AttributeError(name)
        return getattr(self.stream, name)

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.stream.batch(step, batch_size)
        g = torch.Generator().manual_seed(_step_seed(self.seed + 7919, step))
        rows = torch.nonzero(torch.rand(batch_size, generator=g) < self.mix).flatten()
        if rows.numel() == 0:
            return x, y
        w = torch.cat([x[rows], y[rows, -1:]], dim=1)  # the rows' windows, seq_len + 1 tokens
        h = (self.seq_len + 2) // 2
        w = torch.cat([w[:, :h], w[:, :h]], dim=1)[:, : self.seq_len + 1]
        x, y = x.clone(), y.clone()
        x[rows], y[rows] = w[:, :-1], w[:, 1:]
        return x, y


def sequential_chunks(
    docs: Sequence[torch.Tensor],
    seq_len: int,
    doc_ids: Sequence[int] | None = None,
    drop_last: bool = False,
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, bool]]:
    """Yield ``(doc_id, x, y, is_first_of_doc)`` over documents in order.

    Document ``d`` with tokens ``t[0..n-1]`` gives windows ``x = t[kT : kT+T]``,
    ``y = t[kT+1 : kT+T+1]`` for ``k = 0, 1, ...``: consecutive, non-overlapping, and together
    predicting every token ``t[1..n-1]`` exactly once (``t[0]`` has no context in the document).
    The last window of a document is shorter than ``T`` unless ``drop_last`` drops it.
    ``x`` and ``y`` are 1-D ``LongTensor``\\ s; ``is_first_of_doc`` tells the caller to reset
    carried state. ``doc_ids`` defaults to ``0..len(docs)-1``.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if doc_ids is None:
        doc_ids = range(len(docs))
    if len(doc_ids) != len(docs):
        raise ValueError(f"got {len(doc_ids)} doc_ids for {len(docs)} docs")
    for doc_id, doc in zip(doc_ids, docs):
        doc = doc.reshape(-1).long()
        n_pred = doc.numel() - 1
        first = True
        for start in range(0, max(n_pred, 0), seq_len):
            end = min(start + seq_len, n_pred)
            if drop_last and end - start < seq_len:
                break
            yield int(doc_id), doc[start:end], doc[start + 1 : end + 1], first
            first = False


def _counts(tokens, vocab_size: int) -> torch.Tensor:
    if isinstance(tokens, (list, tuple)):
        tokens = torch.cat([t.reshape(-1) for t in tokens]) if tokens else torch.empty(0)
    tokens = tokens.reshape(-1).long()
    if tokens.numel() == 0:
        raise ValueError("no tokens")
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got [{int(tokens.min())}, {int(tokens.max())}]")
    return torch.bincount(tokens, minlength=vocab_size).double()


def unigram_entropy(tokens, vocab_size: int) -> float:
    """Entropy in nats/token of the empirical unigram distribution of ``tokens``.

    ``tokens`` is a tensor or a list of tensors. A model that has learned nothing beyond
    token frequencies reaches this loss; a trained LM must get below it.
    """
    c = _counts(tokens, vocab_size)
    p = c[c > 0] / c.sum()
    return float(-(p * p.log()).sum())


def unigram_cross_entropy(train_tokens, eval_tokens, vocab_size: int, alpha: float = 1.0) -> float:
    """Cross-entropy (nats/token) of ``eval_tokens`` under the add-``alpha`` unigram of ``train_tokens``.

    The held-out version of :func:`unigram_entropy`: the loss of a frequency-only model on
    validation data.
    """
    c_train = _counts(train_tokens, vocab_size)
    c_eval = _counts(eval_tokens, vocab_size)
    logp = torch.log((c_train + alpha) / (c_train.sum() + alpha * vocab_size))
    if not math.isfinite(float(logp[c_eval > 0].min())):
        raise ValueError("eval tokens unseen in training need alpha > 0")
    return float(-(c_eval * logp.where(c_eval > 0, torch.zeros_like(logp))).sum() / c_eval.sum())
