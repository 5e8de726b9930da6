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
byte-level tokenizers also bits per byte. Layers whose `stats()` report gate values (FwPKM)
add the histogram of their gates over the carried evaluation (the paper's Figure 3).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from memzoo.bench.common import Context, layer_order, save_png

NAME = "ppl"
MODES = ("carry", "reset")


@dataclass
class Settings:
    corpora: list = field(default_factory=lambda: ["shakespeare", "sonnets"])
    seq_len: int = 256  # tokens per evaluated sequence (the paper: 4096)
    max_tokens: int = 32768  # per corpus: whole sequences in document order up to this many tokens
    reset_at_document: bool = True  # carry mode: fast weights back to their start at each document


def eval_corpus(model, docs: list[torch.Tensor], s: Settings, mode: str, device: str) -> dict:
    """Mean loss over `docs` in order, batch 1, sequences of `s.seq_len`, in `mode`."""
    from memzoo.data import sequential_chunks

    mems = model.memories()
    start = model.memory_state(persistent_only=True)  # the trained fast weights

    chunks = []
    n = 0
    for doc_id, x, y, first in sequential_chunks(docs, s.seq_len):
        if n >= s.max_tokens:
            break
        chunks.append((x, y, first))
        n += x.numel()
    nll, count, gates, t0 = 0.0, 0, {}, time.time()
    with torch.no_grad():
        for x, y, first in chunks:
            if mode == "reset" or (first and s.reset_at_document):
                model.load_memory_state(start)
            x, y = x[None].to(device), y[None].to(device)
            out = model(x, targets=y, keep_memory=(mode == "carry"))
            nll += F.cross_entropy(out.logits[0].float(), y[0], reduction="sum").item()
            count += y.numel()
            if mode == "carry":
                for i, m in enumerate(mems):
                    h = m.stats().get("gate_hist")
                    if h is not None:
                        gates[i] = [a + b for a, b in zip(gates.get(i, [0.0] * len(h)), h)]
    model.load_memory_state(start)  # leave the model's memories as they were trained
    loss = nll / max(count, 1)
    out = {"loss": loss, "ppl": math.exp(loss), "tokens": count, "tokens_per_s": count / (time.time() - t0)}
    if gates:
        out["gate_hist"] = {f"mem{i}": [c / sum(h) for c in h] for i, h in gates.items()}
    return out


USES_LM = True  # evaluates the shared LM of memzoo.bench.lm


def work(ctx: Context, layer: str) -> int:
    """Units of work for the progress bar: the (corpus, mode) cells of one layer."""
    return len(ctx.preset.settings(NAME, Settings).corpora) * len(MODES)


def run(ctx: Context, layers: list[str]) -> list[dict]:
    from memzoo.bench.lm import shared_lm
    from memzoo.data import get_tokenizer, load_corpus, split_documents, tokenize_corpus

    s = ctx.preset.settings(NAME, Settings)
    rows = []
    for layer in layers:
        model, info = shared_lm(ctx, layer)
        tc = info["config"]["train"]
        tok = get_tokenizer(tc["tokenizer"])
        for corpus in s.corpora:
            ds = load_corpus(corpus)
            if corpus == tc["corpus"]:  # held-out documents of the training corpus
                ds = split_documents(ds, seed=tc["seed"])["validation"]
            docs = tokenize_corpus(ds, tok)
            for mode in MODES:
                t0, doing = time.time(), f"ppl {layer} {corpus} {mode}"
                ctx.advance(0, doing)
                m = eval_corpus(model, docs, s, mode, ctx.device)
                if tok.name == "byte":
                    m["bits_per_byte"] = m["loss"] / math.log(2)
                m.update(lm_train_loss=info["train_loss"], lm_val_loss=info["val_loss"], lm_steps=info["steps"],
                         lm_train_wall_s=info["train_wall_s"], params=info["params"])
                config = {"lm": info["config"], "ppl": asdict(s)}
                rows.append(ctx.record(NAME, layer, {"corpus": corpus, "mode": mode}, m, config, time.time() - t0))
                ctx.advance(1, doing)
    return rows


# ---- leaderboard ------------------------------------------------------------------------------


def tables(df) -> dict:
    import pandas as pd

    t = df.pivot_table(index="layer", columns=["setting.corpus", "setting.mode"], values="metrics.loss", aggfunc="first")
    t = t.reindex(layer_order(t.index))
    out = pd.DataFrame(index=t.index)
    for corpus in sorted(df["setting.corpus"].unique()):
        out[f"{corpus} carry"] = t[(corpus, "carry")].round(4)
        out[f"{corpus} reset"] = t[(corpus, "reset")].round(4)
        out[f"{corpus} gain"] = (t[(corpus, "reset")] - t[(corpus, "carry")]).round(4)
    out.index.name = "layer"
    ppl = out[[c for c in out.columns if not c.endswith("gain")]].map(lambda v: round(math.exp(v), 3))
    first = df.sort_values("layer").groupby("layer").first()
    lm = pd.DataFrame(
        {
            "params (M)": (first["metrics.params"] / 1e6).round(3),
            "LM steps": first["metrics.lm_steps"].astype(int),
            "LM val loss": first["metrics.lm_val_loss"].round(4),
            "LM train s": first["metrics.lm_train_wall_s"].round(1),
        }
    ).reindex(layer_order(first.index))
    return {
        "Loss (nats/token; gain = reset - carry: what carried fast weights are worth)": out,
        "Perplexity": ppl,
        "The shared LMs (trained once per layer for ppl and niah)": lm,
    }


def figures(df, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    paths = []
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
