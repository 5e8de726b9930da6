"""The toys' tasks, one class each (`TASK_TYPES`, by name): MQAR and Ba et al.'s associative retrieval."""

from __future__ import annotations

import torch

from memzoo.data import assoc_retrieval as ar
from memzoo.data import mqar

from .settings import TASKS, Settings


def slice_name(key) -> str:
    """A slice's name in a row: its kv count or pairs ("8"), or kv count and length ("32@256")."""
    return f"{key[1]}@{key[0]}" if isinstance(key, tuple) else str(key)


class Task:
    """A toys task: training batches (a pure function of the generator), and the validation and
    test sets of each slice, from generators of their own. One class per task (`TASK_TYPES`, by
    name); the suite asks a task, it never branches on the task's name. A subclass gives ``name``,
    ``vocab_of(s)``, ``mean_length(s)``, ``data(s)`` (what a row's config records of it), and sets
    ``slices``, ``lengths``, ``seq_len`` and ``chance`` before calling this ``__init__``, with
    ``_make`` (a set of sequences) and ``batch`` (a training batch)."""

    name: str = ""
    slices: list
    lengths: list  # the training lengths, in turn (one length: [None])

    def __init__(self, s: Settings):
        self.s, self.vocab = s, self.vocab_of(s)
        self.val = {k: self._make(s.val_size, k, torch.Generator().manual_seed(7_919 + self._offset(k))) for k in self.slices}
        self.test = {k: self._make(s.test_size, k, torch.Generator().manual_seed(10_007 + self._offset(k)))
                     for k in self.slices}

    @staticmethod
    def _offset(key) -> int:
        return key[1] + 1_000 * key[0] if isinstance(key, tuple) else key

    def eval_batch(self, key) -> int:
        """The batch a slice is evaluated in: its length's training batch."""
        return self.s.batch_of(key[0]) if isinstance(key, tuple) else self.s.batch_size

    def sequences(self, steps: int) -> int:
        """Training sequences in the first `steps` steps."""
        if self.lengths == [None]:
            return steps * self.s.batch_size
        per = [self.s.batch_of(n) for n in self.lengths]
        full, part = divmod(steps, len(per))
        return full * sum(per) + sum(per[:part])


class MQAR(Task):
    """Multi-query associative recall (Zoology): each slice a kv count (with ``mqar_slices``,
    (seq_len, kv)); a training batch mixes every kv count of its length in equal parts."""

    name = "mqar"

    @staticmethod
    def vocab_of(s: Settings) -> int:
        return s.mqar_vocab

    @staticmethod
    def mean_length(s: Settings) -> float:
        """Tokens per training sequence, on average over the steps (with several lengths, weighted
        by their batches, in sequences of ``batch_size``)."""
        if not s.mqar_slices:
            return s.mqar_seq_len
        lengths = sorted({sl[0] for sl in s.mqar_slices})
        return sum(n * s.batch_of(n) for n in lengths) / len(lengths) / s.batch_size

    @staticmethod
    def seq_len_of(s: Settings) -> int:
        """The longest sequence (a sequence's state is counted at it)."""
        return max(sl[0] for sl in s.mqar_slices) if s.mqar_slices else s.mqar_seq_len

    @staticmethod
    def data(s: Settings) -> dict:
        if s.mqar_slices:  # several lengths: the slices and their batches replace seq_len and kv
            return {"vocab": s.mqar_vocab, "slices": [list(sl) for sl in s.mqar_slices], "power_a": s.power_a,
                    "gap": s.mqar_gap, "batch_by_length": {str(k): v for k, v in sorted(s.batch_by_length.items())}}
        return {"vocab": s.mqar_vocab, "seq_len": s.mqar_seq_len, "kv": s.mqar_kv, "power_a": s.power_a, "gap": s.mqar_gap}

    @staticmethod
    def settings_of(data: dict) -> dict:
        """The `Settings` fields a row's ``config.data`` records (the inverse of `data`; a row
        measured again from its config, `memzoo verify --rerun`). Rows before the gap record none: 0."""
        common = {"tasks": ["mqar"], "mqar_vocab": data["vocab"], "power_a": data["power_a"], "mqar_gap": data.get("gap", 0)}
        if "slices" in data:
            return {**common, "mqar_slices": [list(sl) for sl in data["slices"]],
                    "batch_by_length": {int(k): v for k, v in data.get("batch_by_length", {}).items()}}
        return {**common, "mqar_seq_len": data["seq_len"], "mqar_kv": list(data["kv"])}

    def __init__(self, s: Settings):
        several = bool(s.mqar_slices)
        self.slices = [tuple(sl) for sl in s.mqar_slices] if several else list(s.mqar_kv)
        self.lengths = sorted({sl[0] for sl in self.slices}) if several else [None]
        self.seq_len = self.seq_len_of(s)
        self.chance = 2 / s.mqar_vocab
        super().__init__(s)

    def _make(self, size: int, key, g: torch.Generator):
        s = self.s
        length, n = key if isinstance(key, tuple) else (s.mqar_seq_len, key)
        return tuple(mqar.make_batch(size, n, length, s.mqar_vocab, s.power_a, g, gap=s.mqar_gap))

    def batch(self, step: int, g: torch.Generator):
        s = self.s
        if self.lengths == [None]:  # every kv count in each batch
            return tuple(mqar.mixed_batch(s.batch_size, self.slices, s.mqar_seq_len, s.mqar_vocab, s.power_a, g,
                                          gap=s.mqar_gap))
        length = self.lengths[step % len(self.lengths)]  # one length a step, in turn; its kv counts in each batch
        kvs = [n for n_len, n in self.slices if n_len == length]
        return tuple(mqar.mixed_batch(s.batch_of(length), kvs, length, s.mqar_vocab, s.power_a, g, gap=s.mqar_gap))


class AssocRetrieval(Task):
    """Ba et al.'s associative retrieval (``c9k8j3f1??c -> 9``): each slice a count of pairs, the
    answer the prediction at the last position; a training batch holds one count, in turn."""

    name = "ar"

    @staticmethod
    def vocab_of(s: Settings) -> int:
        return ar.VOCAB_SIZE

    @staticmethod
    def mean_length(s: Settings) -> float:
        return sum(ar.seq_len(n) for n in s.ar_pairs) / len(s.ar_pairs)

    @staticmethod
    def seq_len_of(s: Settings) -> int:
        """The longest sequence (the most pairs)."""
        return ar.seq_len(max(s.ar_pairs))

    @staticmethod
    def data(s: Settings) -> dict:
        return {"pairs": s.ar_pairs}

    def __init__(self, s: Settings):
        self.slices, self.lengths = list(s.ar_pairs), [None]
        self.seq_len = self.seq_len_of(s)
        self.chance = 1 / 10
        super().__init__(s)

    def _make(self, size: int, key, g: torch.Generator):
        b = ar.make_batch(size, key, g)
        t = torch.full_like(b.tokens, mqar.IGNORE)
        t[:, -1] = b.answer
        return b.tokens, t

    def batch(self, step: int, g: torch.Generator):
        return self._make(self.s.batch_size, self.slices[step % len(self.slices)], g)  # lengths differ: cycle


#: the tasks by name (`Settings.tasks`, a row's ``setting.task``)
TASK_TYPES = {t.name: t for t in (MQAR, AssocRetrieval)}
assert tuple(TASK_TYPES) == TASKS
