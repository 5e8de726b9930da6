"""ppl: perplexity with fast weights carried across a document's sequences (FwPKM Sec. 4.2).

The paper evaluates "4K-token sequences in their original order with a batch size of 1 so that
sequences from the same document are presented sequentially. This enables fast weights to
capture the dependency between adjacent sequences." We do the same on two held-out corpora:

- ``shakespeare`` (long documents): the validation split's plays, ~100-170K characters each;
- ``sonnets`` (short documents): the 154 sonnets, ~600 characters each (kept out of the LM's
  training data, see :mod:`memzoo.bench.lm`).

Two modes per corpus, on the same trained LM:

- ``carry``: each sequence is new to the backbone (its mixers' state starts empty, as in the
  paper), but every memory layer's fast weights carry on from the previous sequence of the
  same document (``keep_memory=True``); at a document's start they go back to their trained
  value (persistent memories) or their initial value (per-sequence ones).
- ``reset``: every sequence starts from the trained/initial fast weights: what the memory
  gains within one sequence only. The baseline has no memory, so its two modes agree, which
  is a check of the harness.

The gap ``reset - carry`` is what a layer's memory of earlier sequences is worth. Metrics are
the mean next-token loss (nats/token) over every predicted token and its exponential; for
byte-level tokenizers also bits per byte. The carry row adds the gap with a 95% t-interval
over the paired per-sequence losses (``gain``, ``gain_half``: sequences of one document are
not independent, so read it as a guide) and the loss by position within the document
(``by_position``, buckets 0-256, 256-1K, 1K-4K, ... tokens: the length-extrapolation curve of
fla's evals/ppl.py, with the memory carried). Layers whose `stats()` report gate values (FwPKM)
add the histogram of their gates over the carried evaluation (the paper's Figure 3).

The LMs (:mod:`memzoo.bench.lm`). With ``document_order`` (the standard preset) the LMs of
layers whose fast weights outlive a sequence (FwPKM's and FwMLP's, shared by the batch and kept
across steps) train on their documents in order, each batch row continuing where it ended (as the
paper trains them), so that what ``carry`` asks of them at evaluation is what they trained for.

The memory the only route (``model``: the preset's backbone with these changes, for the LMs;
the standard preset's mixers are 4-token sliding windows, 12 tokens of reach over its 4 blocks):
each sequence's backbone starts empty, and within it reaches a few tokens back, so a carried gain
and the probe's gain come through the memory alone. The measurements: docs/journal/ppl.md.

A memory in a model a user already has (``host``, the attach preset): the LMs are a Hugging
Face causal LM pretrained once per seed, then trained further alone (the baseline) or with one
memory attached (:mod:`memzoo.attach`), equally long; where the probe runs, its positive control
is the host reading with its KV cache carried (:mod:`memzoo.bench.lm`).

The repeated-passage probe (setting ``{"corpus": "repeat", "mode": "carry"}``): ``passages``
held-out passages of ``passage_len`` tokens (the sonnets, unseen in training), each read
twice, the second reading in a new sequence with the carried state of the first: the memory
layers' fast weights, as in ``carry`` (the backbone's mixers start empty), and for the positive
control (``ctrl:attention``, with the baseline where ``niah.controls`` is on) its attention KV
cache, the memory that holds the whole first reading. ``gain`` = loss of the first reading -
loss of the second (mean over passages, with a 95% t-interval): what the memory recalls of a
passage it has read once, which is what an episodic memory is for. The baseline carries
nothing, so its gain is 0 by construction (a check of the harness); the control shows what
recall of the whole passage is worth.

Why the LMs read repeated passages in training (``repeat_mix``; issue 13). The probe measures a
memory only if the LM has learnt to use what it recalls, and the control shows whether it has.
It had not: the standard preset's attention control trained on plain text (1500 steps of 16 x 256
bytes, validation loss 1.495) predicted a sonnet's second reading, with the first in its KV
cache, no better than the first (gain -0.032 ± 0.023 nats/token; by 32-token quarter, first
reading 1.519 / 1.472 / 1.467 / 1.425, second 1.845 / 1.478 / 1.465 / 1.423). With a quarter of its
windows reading a passage twice (:class:`memzoo.data.RepeatMix`) it still did not copy, not even
in such training windows (loss by 32 tokens 1.653 / 1.468 / 1.346 / 1.337, then the copy 1.901 /
1.439 / 1.323 / 1.331; probe gain -0.008 ± 0.016). With half of them it learnt to, late (loss on
training-format repeated windows, first half / second half, one thread, AMD EPYC):

    steps   250    500    750    1000   1250   1500
    first   1.822  1.679  1.577  1.500  1.464  1.448
    copy    1.813  1.663  1.501  1.210  0.800  0.476
    val     1.84   1.68   1.591  1.57   1.535  1.559   (plain text)

so the standard preset's ppl LMs read half their windows twice (``repeat_mix`` 0.5), at a cost
on plain text (validation loss, 1500 steps: the control 1.613 against 1.495, the baseline 1.483
against 1.449). Trained so, the control's probe gain is +0.845 ± 0.028 nats/token (first reading
1.542, second 0.697). An LM at the paper's scale learns to copy from
text alone; ours are given the windows that teach it, and each layer's row then shows whether its
memory carries a passage from one sequence into the next, where the backbone starts empty.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from memzoo.bench.registry import Suite, register_suite
from memzoo.bench.schema import PPL_MODES, PPL_POSITIONS
from memzoo.bench.common import POSITIVE, Context, check_backbone, mean_ci

NAME = "ppl"
MODES = PPL_MODES



@dataclass
class Settings:
    corpora: list = field(default_factory=lambda: ["shakespeare", "sonnets"])
    seq_len: int = 256  # tokens per evaluated sequence (the paper: 4096)
    max_tokens: int = 32768  # per corpus: whole sequences in document order up to this many tokens
    reset_at_document: bool = True  # carry mode: fast weights back to their start at each document
    passages: int = 32  # the repeated-passage probe: passages read twice (0: no probe)
    passage_len: int = 128  # tokens per passage (twice this within the LMs' training length)
    repeat_mix: float = 0.0  # fraction of the LMs' training windows that read a passage twice (memzoo.data.RepeatMix)
    document_order: bool = False  # LMs with persistent fast weights train on documents in order (memzoo.data.DocumentStream)
    model: dict = field(default_factory=dict)  # the LMs' backbone: the preset's model: section with these changes
    # the LMs are a Hugging Face causal LM with the memory attached (memzoo.bench.lm): {config: {model_type: llama,
    # <its config's fields>}, steps: <its pretraining steps>}; {}: memzoo's backbone
    host: dict = field(default_factory=dict)

    def __post_init__(self):
        from memzoo.config import ConfigError

        for name in ("seq_len", "max_tokens", "passage_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ppl.{name} must be >= 1, got {getattr(self, name)}")
        if self.passages < 0:
            raise ConfigError(f"ppl.passages must be >= 0, got {self.passages}")
        if not 0.0 <= self.repeat_mix <= 1.0:
            raise ConfigError(f"ppl.repeat_mix must be in [0, 1], got {self.repeat_mix}")
        check_backbone(self.model, "ppl.model")
        if self.host:
            if set(self.host) != {"config", "steps"} or not isinstance(self.host["config"], dict) \
                    or "model_type" not in self.host["config"] or not isinstance(self.host["steps"], int) or self.host["steps"] < 1:
                raise ConfigError(f"ppl.host must be {{config: {{model_type: ..., <its fields>}}, steps: N >= 1}}, got {self.host!r}")
            if self.model or self.document_order:
                raise ConfigError("ppl.host: the LMs are the host, so ppl.model and ppl.document_order do not apply")

    def recorded(self) -> dict:
        """These settings as a row's config records them: without a host when there is none (the field came
        with the attach preset; the backbone's protocol, and so its rows' config hashes, stayed as they were)."""
        return {k: v for k, v in asdict(self).items() if k != "host" or v}


POSITIONS = PPL_POSITIONS  # bucket edges of the loss by position in a document


def _bucket(lo: int, hi: int | None) -> str:
    label = lambda n: f"{n // 1024}K" if n >= 1024 else str(n)  # noqa: E731
    return f"{label(lo)}-{label(hi)}" if hi is not None else f"{label(lo)}+"


def eval_corpus(model, docs: list[torch.Tensor], s: Settings, mode: str, device: str) -> dict:
    """Mean loss over `docs` in order, batch 1, sequences of `s.seq_len`, in `mode`; with the
    per-sequence losses (``seq_loss``, for paired intervals) and the loss by position in the
    document (``by_position``)."""
    from memzoo.data import sequential_chunks

    mems = model.memories()
    start = model.memory_state(persistent_only=True)  # the trained fast weights
    edges = list(POSITIONS)

    chunks = []
    n = 0
    for doc_id, x, y, first in sequential_chunks(docs, s.seq_len):
        if n >= s.max_tokens:
            break
        chunks.append((x, y, first))
        n += x.numel()
    nll, count, gates, t0 = 0.0, 0, {}, time.time()
    seq_loss, pos_nll, pos_n = [], [0.0] * len(edges), [0] * len(edges)
    with torch.no_grad():
        for x, y, first in chunks:
            if first:
                at = 1  # the position in the document of the first target (t[0] has no context)
            if mode == "reset" or (first and s.reset_at_document):
                model.load_memory_state(start)
            x, y = x[None].to(device), y[None].to(device)
            out = model(x, targets=y, keep_memory=(mode == "carry"))
            ce = F.cross_entropy(out.logits[0].float(), y[0], reduction="none").cpu()
            nll += ce.sum().item()
            count += y.numel()
            seq_loss.append(ce.mean().item())
            which = torch.bucketize(torch.arange(at, at + ce.numel()), torch.tensor(edges[1:]), right=True)
            for b in which.unique().tolist():
                pos_nll[b] += ce[which == b].sum().item()
                pos_n[b] += int((which == b).sum())
            at += ce.numel()
            if mode == "carry":
                for i, m in enumerate(mems):
                    h = m.stats().get("gate_hist")
                    if h is not None:
                        gates[i] = [a + b for a, b in zip(gates.get(i, [0.0] * len(h)), h)]
    model.load_memory_state(start)  # leave the model's memories as they were trained
    loss = nll / max(count, 1)
    out = {"loss": loss, "ppl": math.exp(loss), "tokens": count, "tokens_per_s": count / (time.time() - t0),
           "seq_loss": seq_loss,
           "by_position": {_bucket(lo, hi): pos_nll[b] / pos_n[b]
                           for b, (lo, hi) in enumerate(zip(edges, [*edges[1:], None])) if pos_n[b]}}
    if gates:
        out["gate_hist"] = {f"mem{i}": [c / sum(h) for c in h] for i, h in gates.items()}
    return out


def repeat_probe(model, passages: list[torch.Tensor], carry_cache: bool, device: str) -> dict:
    """Each passage read twice, the second reading in a new sequence with the first's carried
    state: the memories' fast weights, and with `carry_cache` the backbone's cache too.
    Returns the mean loss of each reading and the gain (first - second) with its 95% t-interval
    over the passages."""
    start = model.memory_state(persistent_only=True)
    first, second = [], []
    with torch.no_grad():
        for p in passages:
            x, y = p[None, :-1].to(device), p[None, 1:].to(device)
            model.load_memory_state(start)  # trained fast weights; per-sequence memories start anew
            one = model(x, targets=y, use_cache=carry_cache)
            two = model(x, targets=y, cache=one.cache, keep_memory=True)
            first.append(one.loss.item())
            second.append(two.loss.item())
    model.load_memory_state(start)
    gain, half = mean_ci([a - b for a, b in zip(first, second)])
    return {"first_loss": sum(first) / len(first), "second_loss": sum(second) / len(second), "gain": gain,
            "gain_half": half, "n_passages": len(passages)}


def work(ctx: Context, layer: str) -> int:
    """Units of work for the progress bar: the (corpus, mode) cells and the probe of one
    layer's LMs."""
    from memzoo.bench.lm import models

    s = ctx.preset.settings(NAME, Settings)
    return len(models(ctx, layer)) * (len(s.corpora) * len(MODES) + (s.passages > 0))


def passages(s: Settings, tok) -> list[torch.Tensor]:
    """The probe's passages: the first `passage_len` + 1 tokens of the first sonnets long enough
    (held out of every LM's training data, see memzoo.bench.lm)."""
    from memzoo.data import load_corpus, tokenize_corpus

    docs = [d for d in tokenize_corpus(load_corpus("sonnets"), tok) if d.numel() > s.passage_len]
    if len(docs) < s.passages:
        raise ValueError(f"ppl.passages={s.passages}: only {len(docs)} sonnets hold {s.passage_len + 1} tokens")
    return [d[: s.passage_len + 1] for d in docs[: s.passages]]


def recorded_rows(ctx: Context, layer: str) -> list[dict] | None:
    """The rows of `layer`'s LM (a model of `lm.models`) already recorded at every cell, as `lm.recorded`."""
    from memzoo.bench.lm import recorded

    s = ctx.preset.settings(NAME, Settings)
    cells = [{"corpus": c, "mode": m} for c in s.corpora for m in MODES] + ([{"corpus": "repeat", "mode": "carry"}] if s.passages else [])
    return recorded(ctx, NAME, layer, cells, {"ppl": s.recorded()})


def run(ctx: Context, layers: list[str]) -> list[dict]:
    from memzoo.bench.lm import models, shared_lm
    from memzoo.data import get_tokenizer, load_corpus, split_documents, tokenize_corpus

    s = ctx.preset.settings(NAME, Settings)
    rows = []
    for layer in [m for name in layers for m in models(ctx, name)]:
        done = recorded_rows(ctx, layer)
        if done:  # a resumed run: every cell of this LM is recorded
            rows += done
            ctx.advance(len(s.corpora) * len(MODES) + (s.passages > 0), f"ppl {layer} (recorded)")
            continue
        model, info = shared_lm(ctx, layer, NAME)
        tc = info["config"]["train"]
        tok = get_tokenizer(tc["tokenizer"])
        config = {"lm": info["config"], "ppl": s.recorded()}
        lm = dict(lm_train_loss=info["train_loss"], lm_val_loss=info["val_loss"], lm_steps=info["steps"],
                  lm_tokens=info.get("tokens"), lm_train_wall_s=info["train_wall_s"], params=info["params"])
        for corpus in s.corpora:
            ds = load_corpus(corpus)
            if corpus == tc["corpus"]:  # held-out documents of the training corpus
                ds = split_documents(ds, seed=tc["seed"])["validation"]
            docs = tokenize_corpus(ds, tok)
            found = {}
            for mode in MODES:
                t0, doing = time.time(), f"ppl {layer} {corpus} {mode}"
                ctx.advance(0, doing)
                m = eval_corpus(model, docs, s, mode, ctx.device)
                if tok.name == "byte":
                    m["bits_per_byte"] = m["loss"] / math.log(2)
                found[mode] = (m, time.time() - t0)
                ctx.advance(1, doing)
            (carry, _), (reset, _) = found["carry"], found["reset"]
            carry["gain"], carry["gain_half"] = mean_ci([r - c for r, c in zip(reset.pop("seq_loss"), carry.pop("seq_loss"))])
            for mode, (m, wall) in found.items():
                rows.append(ctx.record(NAME, layer, {"corpus": corpus, "mode": mode}, {**m, **lm}, config, wall))
        if s.passages:
            t0, doing = time.time(), f"ppl {layer} repeated passages"
            ctx.advance(0, doing)
            m = repeat_probe(model, passages(s, tok), layer == POSITIVE, ctx.device)
            rows.append(ctx.record(NAME, layer, {"corpus": "repeat", "mode": "carry"}, {**m, **lm}, config, time.time() - t0))
            ctx.advance(1, doing)
    return rows


register_suite(Suite(NAME, Settings, run, work, uses_lm=True, recorded=recorded_rows))
