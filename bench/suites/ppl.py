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
and the probe's gain come through the memory alone. The measurements: docs/ppl.md.

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
from pathlib import Path

import torch
import torch.nn.functional as F

from memzoo.bench.common import (
    BASELINE, CONTROLS, POSITIVE, Context, beyond, check_backbone, fewer_seeds, layer_order, mean_ci, save_png, shared_count,
    with_seed, with_texts,
)

NAME = "ppl"
MODES = ("carry", "reset")

#: printed under the ppl tables of the leaderboard
EXPLANATION = """**Reading the PPL numbers.** Loss in nats per token (bytes) on held-out text, batch 1 in
document order, 256-token sequences. *gain* (reset - carry) is what fast weights carried from the
document's earlier sequences are worth; the baseline and the controls carry nothing, so their
gains are 0 by construction (a check of the harness); ▲/▼ where the 95% interval excludes 0. *seeds*:
the LMs (training seeds) behind a row. A cell of one seed is its LM's, the interval of its gain
over sequences (a document's sequences are correlated: read it as a guide) or, in the probe, over
passages; a cell of several seeds is their mean ± a 95% t-interval over the trainings (for
perplexity, exp of the mean loss and of its interval), marked against the baseline's interval over
its trainings where the baseline has several seeds too. The positive control must copy in every
seed.

*Standard preset*: the memory the only route. Every mixer of the LMs' backbone is a 4-token
sliding window (12 tokens of reach over 4 blocks), and each sequence's backbone starts empty, so a
carried gain, and the probe's, come through the memory alone. The repeated-passage probe is the
test with a known answer: the attention control, which keeps the first reading in its KV cache,
predicts a held-out sonnet's second reading 0.726 ± 0.024 nats/token better than its first (1.533
-> 0.807): the harness can train and measure recall of a passage. A memory layer's probe gain is
what its fast weights alone carry of a 128-token passage into a new sequence; read it against the
control's.

Measured (standard): FWL carries the passage best of all, the control included (+1.27 ± 0.04), but
its carried state hurts on the plays (-0.39 ± 0.03): trained with its state reset per sequence, its
fast weights drift over a long document; LaCT likewise (probe +0.20, plays -0.25). MoM's carried
state helps on the plays and the sonnets (+0.0069 ± 0.0015, +0.0086 ± 0.0032) and carries nothing
of a passage. FwPKM, trained on its documents in order, carries a little (probe +0.010 ± 0.001,
1.4% of the control's; plays +0.0003 ± 0.0007). Linear attention: probe +0.011 ± 0.006, plays
-0.021. PKM has no fast weights (gains 0); Ba and FwMLP carry nothing usable.

What these numbers can show at this scale: whether a memory carries anything usable from one
sequence to the next, and how much of the control's recall it recovers. What they cannot: the
paper's gains on 4K-token sequences with LMs of 100M+ parameters. The standard LMs have 1M
parameters and saw 6.1M tokens, half of their windows reading a passage twice (without those no
LM here learned to copy at all: the suite's docstring), so their losses are not those of
plain-text LMs. Every standard LM is trained for a fixed budget (capped at 1500 steps, not to
convergence). The numbers quoted here are training seed 0's; a row of one seed has intervals over
sequences or passages, not over trainings, while a row of several seeds has its intervals over
their trainings.
The tiny preset (200 steps, no controls) is a check of the harness; its probe rows are withheld."""


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


POSITIONS = (0, 256, 1024, 4096, 16384, 65536)  # bucket edges of the loss by position in a document


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


USES_LM = True  # evaluates the shared LM of memzoo.bench.lm


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


def run(ctx: Context, layers: list[str]) -> list[dict]:
    from memzoo.bench.lm import models, recorded, shared_lm
    from memzoo.data import get_tokenizer, load_corpus, split_documents, tokenize_corpus

    s = ctx.preset.settings(NAME, Settings)
    rows = []
    cells = [{"corpus": c, "mode": m} for c in s.corpora for m in MODES] + ([{"corpus": "repeat", "mode": "carry"}] if s.passages else [])
    for layer in [m for name in layers for m in models(ctx, name)]:
        done = recorded(ctx, NAME, layer, cells, {"ppl": asdict(s)})
        if done:  # a resumed run: every cell of this LM is recorded
            rows += done
            ctx.advance(len(s.corpora) * len(MODES) + (s.passages > 0), f"ppl {layer} (recorded)")
            continue
        model, info = shared_lm(ctx, layer, NAME)
        tc = info["config"]["train"]
        tok = get_tokenizer(tc["tokenizer"])
        config = {"lm": info["config"], "ppl": asdict(s)}
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
            (carry, wc), (reset, wr) = found["carry"], found["reset"]
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


# ---- leaderboard ------------------------------------------------------------------------------


MIN_PROBE_GAIN = 0.1  # nats/token: the positive control's probe gain must clear this with its whole interval


def validity(df) -> list[str]:
    """What makes the repeated-passage probe invalid (empty: valid), judged in every training
    seed: the positive control's probe not run (in some seed that has probe rows), or its gain's
    95% interval not wholly above MIN_PROBE_GAIN nats/token in some seed (an LM that does not copy
    a passage it can see leaves nothing for a memory to show, and a seed's layer rows rest on
    that seed's control)."""
    probe = with_seed(df)
    probe = probe[probe["setting.corpus"] == "repeat"]
    pos = probe[probe["layer"] == POSITIVE]
    if pos.empty:
        return ["the positive control's probe was not run (niah.controls, ppl.passages)"]
    missing = sorted(set(probe["seed"]) - set(pos["seed"]))
    if missing:
        return [f"the positive control's probe was not run in seed {', '.join(map(str, missing))} (niah.controls, ppl.passages)"]
    several = probe["seed"].nunique() > 1
    out = []
    for _, r in pos.sort_values("seed").iterrows():
        lo = r["metrics.gain"] - r["metrics.gain_half"]
        if not lo > MIN_PROBE_GAIN:
            out.append(f"the positive control's gain{f' in seed {r.seed}' if several else ''} is {r['metrics.gain']:+.3f} ± "
                       f"{r['metrics.gain_half']:.3f} nats/token, not clearly above {MIN_PROBE_GAIN}")
    return out


def _gain(m: float, half: float, ref: tuple[float, float] = (0.0, 0.0)) -> str:
    """'gain ± half', with ▲/▼ where the interval lies wholly above/below `ref`: the baseline's
    gain, 0 (it carries no memory, so its carried and reset readings are the same computation),
    or its interval over trainings where both it and the row have several seeds."""
    if math.isnan(m):
        return ""
    return f"{m:+.4f} ± {half:.4f}" + beyond(m - half, m + half, *ref)


def _gains(g, base) -> str:
    """A cell's gain: one seed's with its recorded interval (over sequences or passages), or the
    seeds' mean ± a 95% t-interval over the trainings, marked against the baseline's `base`
    rows' (`_gain`)."""
    g = g[g["metrics.gain"].notna()]
    if len(g) == 0:
        return ""
    if len(g) == 1:
        return _gain(g["metrics.gain"].iloc[0], g["metrics.gain_half"].iloc[0])
    m, h = mean_ci(g["metrics.gain"])
    ref = (0.0, 0.0)
    if base is not None and base["metrics.gain"].notna().sum() > 1:
        bm, bh = mean_ci(base["metrics.gain"].dropna())
        ref = (bm - bh, bm + bh)
    return _gain(m, h, ref)


def _over_seeds(vals, seeds: int, digits: int = 4) -> str | None:
    """The text of a cell of several seeds' values ('mean ± half', a 95% t-interval over the
    trainings), or of one seed's value where its layer has more; None where the cell is a plain
    number (its layer's one seed)."""
    vals = [float(v) for v in vals if not math.isnan(float(v))]
    if len(vals) > 1:
        m, h = mean_ci(vals)
        return f"{m:.{digits}f} ± {h:.{digits}f}" + fewer_seeds(len(vals), seeds)
    if len(vals) == 1 and seeds > 1:
        return format(round(vals[0], digits), "g") + fewer_seeds(1, seeds)
    return None


def _perplexity(vals, loss: float, seeds: int) -> str:
    """A perplexity cell of several seeds: exp of their mean loss [exp of its 95% t-interval over
    the trainings]; of one seed where its layer has more: exp of its (rounded) loss, as a one-seed
    table prints it."""
    if len(vals) > 1:
        m, h = mean_ci(vals)
        return f"{math.exp(m):.3f} [{math.exp(m - h):.3f}, {math.exp(m + h):.3f}]" + fewer_seeds(len(vals), seeds)
    return format(round(math.exp(loss), 3), "g") + fewer_seeds(len(vals), seeds)


def tables(df) -> dict:
    """Loss carried / reset and the gain (± its 95% interval) per corpus; perplexity; the
    repeated-passage probe; the carried loss by position in the document; the LMs. A layer's
    cell of several training seeds is their mean with a 95% t-interval over the trainings (a
    cell of one, as recorded); every table says the layer's seeds, none picks one."""
    import pandas as pd

    df = with_seed(df)
    probe = df[df["setting.corpus"] == "repeat"]
    df = df[df["setting.corpus"] != "repeat"]
    t = df.pivot_table(index="layer", columns=["setting.corpus", "setting.mode"], values="metrics.loss", aggfunc="mean")
    t = t.reindex(layer_order(t.index))
    corpora = sorted(df["setting.corpus"].unique())
    seeds = df.groupby("layer")["seed"].nunique().to_dict()
    cells = {k: g.sort_values("seed") for k, g in df.groupby(["layer", "setting.corpus", "setting.mode"])}
    several = any(len(g) > 1 for g in cells.values())
    carry = df[df["setting.mode"] == "carry"]
    out = pd.DataFrame({"seeds": [seeds[layer] for layer in t.index]}, index=t.index)
    texts, ppl_texts = {}, {}
    for corpus in corpora:
        for mode in MODES:
            col = f"{corpus} {mode}"
            out[col] = t[(corpus, mode)].round(4)
            for layer in t.index:
                vals = cells[(layer, corpus, mode)]["metrics.loss"].dropna() if (layer, corpus, mode) in cells else []
                if (text := _over_seeds(vals, seeds[layer])) is not None:
                    texts[(layer, col)] = text
                    ppl_texts[(layer, col)] = _perplexity(vals, out.loc[layer, col], seeds[layer])
        if "metrics.gain_half" in carry:
            base = cells.get((BASELINE, corpus, "carry"))
            gains = []
            for layer in t.index:
                g = cells.get((layer, corpus, "carry"))
                text = "" if g is None else _gains(g, None if layer == BASELINE else base)
                gains.append(text + fewer_seeds(len(g), seeds[layer]) if text else text)
            out[f"{corpus} gain"] = gains
        else:  # rows from before the interval was recorded
            out[f"{corpus} gain"] = (t[(corpus, "reset")] - t[(corpus, "carry")]).round(4)
    out.index.name = "layer"
    losses = [c for c in out.columns if c != "seeds" and not c.endswith("gain")]
    ppl = out[losses].map(lambda v: round(math.exp(v), 3))
    ppl.insert(0, "seeds", out["seeds"])
    over = " over sequences" + (" (over trainings where seeds > 1: a cell is then the seeds' mean ± its interval)"
                                if several else "")
    res = {f"Loss (nats/token; gain = reset - carry ± 95% interval{over}, ▲/▼ where it excludes the baseline's 0: "
           "what carried fast weights are worth)": with_texts(out, texts)}
    over = " (where seeds > 1: exp of the seeds' mean loss [exp of its 95% interval over trainings])" if several else ""
    res[f"Perplexity{over}"] = with_texts(ppl, ppl_texts)
    if not probe.empty:
        over = " over passages" + (" (over trainings where seeds > 1)" if probe.groupby("layer").size().max() > 1 else "")
        title = (f"Repeated-passage probe (nats/token; gain = first reading - second, ± 95% interval{over}, ▲/▼ where it "
                 "excludes the baseline's 0)")
        bad = validity(probe)
        if bad:
            probe = probe[probe["layer"].isin(CONTROLS)]
            title = f"HARNESS INVALID ({'; '.join(bad)}): layer rows withheld; {title}"
        order = layer_order(probe["layer"])
        by_layer = {layer: g.sort_values("seed") for layer, g in probe.groupby("layer")}
        mean = probe.groupby("layer")[["metrics.first_loss", "metrics.second_loss"]].mean().reindex(order).round(4)
        p = pd.DataFrame({
            "seeds": [len(by_layer[layer]) for layer in order],
            "passages": [shared_count(by_layer[layer]["metrics.n_passages"]) for layer in order],
            "first reading": mean["metrics.first_loss"],
            "second reading": mean["metrics.second_loss"],
            "gain": [_gains(by_layer[layer], None if layer == BASELINE else by_layer.get(BASELINE)) for layer in order],
        }, index=pd.Index(order, name="layer"))
        readings = (("metrics.first_loss", "first reading"), ("metrics.second_loss", "second reading"))
        res[title] = with_texts(p, {(layer, col): text for layer in order for key, col in readings
                                    if (text := _over_seeds(by_layer[layer][key], len(by_layer[layer]))) is not None})
    pos = sorted((c for c in carry.columns if c.startswith("metrics.by_position.")),
                 key=lambda c: POSITIONS.index(_edge(c)))
    if pos:
        rows = [(layer, c) for layer in layer_order(carry["layer"]) for c in corpora if (layer, c, "carry") in cells]
        by = pd.DataFrame([cells[(layer, c, "carry")][pos].mean() for layer, c in rows],
                          index=pd.Index([f"{layer} {c}" for layer, c in rows], name="layer, corpus")).round(4)
        by.columns = [c[len("metrics.by_position."):] for c in pos]
        by = with_texts(by, {(f"{layer} {c}", col[len("metrics.by_position."):]): text for layer, c in rows for col in pos
                             if (text := _over_seeds(cells[(layer, c, "carry")][col], seeds[layer])) is not None})
        by.insert(0, "seeds", [seeds[layer] for layer, _ in rows])
        over = "; ± 95% interval over trainings where seeds > 1" if several else ""
        res[f"Carried loss by position in the document (tokens; nats/token{over})"] = by
    lms = df.sort_values("layer").groupby(["layer", "seed"]).first().groupby(level="layer")  # a row per LM
    first = lms.mean(numeric_only=True)
    lm = pd.DataFrame(
        {
            "seeds": lms.size(),
            "params (M)": (first["metrics.params"] / 1e6).round(3),
            "LM steps": lms["metrics.lm_steps"].agg(shared_count),
            **({"LM tokens (M)": (first["metrics.lm_tokens"] / 1e6).round(2)} if "metrics.lm_tokens" in first else {}),
            "LM val loss": first["metrics.lm_val_loss"].round(4),
            "LM train s": first["metrics.lm_train_wall_s"].round(1),
        }
    ).reindex(layer_order(first.index))
    lm = with_texts(lm, {(layer, "LM val loss"): text for layer, g in lms
                         if (text := _over_seeds(g["metrics.lm_val_loss"], len(g))) is not None})
    over = "; where seeds > 1 the val loss is their mean ± its 95% interval, the rest their mean" if several else ""
    res[f"The LMs (one per layer and training seed, *seeds* of them; niah evaluates them too unless its preset gives "
        f"it LMs of its own, niah.lm{over})"] = lm
    return res


def _edge(col: str) -> int:
    """The lower edge (tokens) of a by_position column's bucket."""
    lo = col[len("metrics.by_position."):].split("-")[0].rstrip("+")
    return int(lo[:-1]) * 1024 if lo.endswith("K") else int(lo)


def figures(df, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    paths = []
    df = df[df["setting.corpus"] != "repeat"]  # the probe is a table
    g = df[(df["setting.mode"] == "carry")]
    cols = [c for c in g.columns if c.startswith("metrics.gate_hist.")]
    recs = []
    for _, r in g.sort_values(["layer", "setting.corpus"]).iterrows():
        for c in sorted(cols):
            h = r[c]
            if isinstance(h, list):
                for b, v in enumerate(h):
                    recs.append({"layer": r["layer"], "memory": c.rsplit(".", 1)[1], "corpus": r["setting.corpus"],
                                 "gate": (b + 0.5) / len(h), "fraction": v})
    if recs:
        import pandas as pd

        d = pd.DataFrame(recs)
        rows = sorted({(a, b) for a, b in zip(d["layer"], d["memory"])})
        fig, axes = plt.subplots(len(rows), 1, figsize=(6, 2.2 * len(rows)), squeeze=False)
        for ax, (layer, mem) in zip(axes[:, 0], rows):
            sub = d[(d["layer"] == layer) & (d["memory"] == mem)]
            sns.barplot(data=sub, x="gate", y="fraction", hue="corpus", ax=ax, hue_order=sorted(sub["corpus"].unique()))
            ax.set_title(f"{layer} {mem}: gate values (carried evaluation)")
            ax.set_xticks(range(len(sub["gate"].unique())))
            ax.set_xticklabels([f"{v:.2f}" for v in sorted(sub["gate"].unique())], fontsize=7)
        fig.tight_layout()
        paths.append(save_png(fig, out_dir / "ppl_gates.png"))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    d = df.assign(setting=df["setting.corpus"] + " " + df["setting.mode"]).sort_values(["layer", "setting"])
    sns.barplot(data=d, x="layer", y="metrics.loss", hue="setting", order=layer_order(d["layer"]), ax=ax)
    ax.set_ylabel("loss (nats/token)")
    ax.set_ylim(d["metrics.loss"].min() * 0.95, d["metrics.loss"].max() * 1.02)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    paths.append(save_png(fig, out_dir / "ppl.png"))
    return paths
