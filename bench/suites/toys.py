"""The toys suite: in-context recall on synthetic tasks, and how it grows with the state.

Two tasks, each learned from scratch by a small LM (the preset's backbone, ``n_layers`` = 2,
the memory layer at ``at``), for every width in ``widths`` and every learning rate in ``lrs``:

- ``mqar``: multi-query associative recall (Zoology, Arora et al. 2023, Sec. 3;
  :mod:`memzoo.data.mqar`): keys from the first half of the vocabulary, values from the second,
  queries placed with power-law spacing, accuracy on the labelled (query) positions. Training
  batches mix every count of ``mqar_kv`` in equal parts; each count is evaluated on its own
  held-out batches, so accuracy is sliced by the number of key-value pairs.
- ``ar``: Ba et al.'s associative retrieval (2016, Sec. 4.1; :mod:`memzoo.data.assoc_retrieval`),
  ``c9k8j3f1??c -> 9``, with the LM's prediction at the last position as the answer (the only
  labelled position). Training steps cycle through ``ar_pairs``; each is evaluated on its own.

A (layer, task, width) row reports the best learning rate's accuracy (chosen by the mean over
kv counts on the held-out sets, as Zoology reports the best of its sweep) and every learning
rate's mean, so a reader sees how sensitive the layer was. Chance is 1/10 for ``ar`` (ten
digits) and about 1/n for ``mqar`` with n pairs for a model that has learned to answer with one
of the sequence's values.

State size (the x axis of the capacity curve) is the recurrent state one sequence carries,
in numbers: every GDN mixer's matrix (heads × head_dim²) plus the memory layer's fast weights
(`fast_weight_numel()` after a forward). FwPKM and FwMLP as the paper trains them share one
memory across the batch and keep it across sequences; their whole memory is counted, which
overstates what one sequence can use of it. Short-convolution caches are not counted.

Sizes. The preset's backbone is scaled to each width: ``d_model`` = w, the FFN at the preset's
ratio, the GDN heads as in the preset with head size w / heads (so the GDN state grows as w²).
The memory layers keep the preset's options (sized for d_model = 128, so most of them do not
grow with w) with ``layer_options[layer]`` merged over them (a preset that sets
``layer_options`` replaces the default mapping as a whole).

Update chunks. With the preset's chunks (32-256 tokens) a toy sequence is a single chunk, read
before it is written, so a chunk-level layer (FwPKM, FwMLP, LaCT, FWL) could never recall a
pair of its own sequence. The tiny default shortens their chunk to 4 tokens (two pairs): pairs
start at even positions, so a pair never straddles a chunk (FwPKM's and FwMLP's lookahead binds
a key to the next token inside a chunk), and a query can read every pair written in earlier
chunks. A query in the chunk of its own pair (MQAR's power-law spacing puts many right after
the pairs when there are few) is left to the GDN mixers. With even ``ar_pairs`` Ba's query
always sits in a later chunk than every pair.

Budget (tiny preset, one CPU thread on a shared 2-core machine, 12 trainings of 150 steps per
layer): 45 s for the baseline, about 70 s for FwPKM and LaCT, 95 s for MoM. The tiny tasks are
small on purpose (MQAR: 16 tokens, vocabulary 32, 1-4 pairs): within that budget a 2-layer GDN
learns them only partly, and larger vocabularies and sequences stay at chance; the paper preset
has Zoology's sizes for a GPU. Learning rates are chosen on the held-out sets (no separate
validation split), as Zoology's sweeps are reported.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm.auto import tqdm

from memzoo.backbone.model import HybridLM
from memzoo.bench.common import BASELINE, Context, layer_order, save_png
from memzoo.config import ConfigError, ModelConfig
from memzoo.data import assoc_retrieval as ar
from memzoo.data import mqar
from memzoo.train import lr_at, make_step, param_groups

NAME = "toys"
TASKS = ("mqar", "ar")

# shown under the suite's tables in the leaderboard
EXPLANATION = """Accuracy is on the labelled positions of held-out sequences (MQAR: every query; Ba's task: the
answer after the query), for the best of the learning rates (chosen on those sets, as Zoology
reports its sweeps). Chance: 1/10 on Ba's task; on MQAR 2/vocabulary (1/16 in the tiny preset)
for a model that only knows the answer is a value, 1/n for one that picks a value of its sequence
(n pairs). State: numbers one sequence carries (GDN matrices + the memory's fast weights); a
memory shared by the batch (FwPKM as the paper trains it) is counted whole. Tiny preset: short training on a CPU (one seed),
so gaps of a few points are noise; chunk-level layers update every few tokens (see the preset)."""


def _short_chunks() -> dict:
    """Update chunks of 4 tokens for every chunk-level read-then-write layer: each registered
    layer whose constructor takes a `chunk_size` and that does not read its own token's write
    (not `inclusive`)."""
    import inspect

    from memzoo.registry import get_layer, layer_names

    return {n: {"chunk_size": 4} for n in layer_names()
            if "chunk_size" in inspect.signature(get_layer(n)).parameters and not get_layer(n).inclusive}


@dataclass
class Settings:
    tasks: list = field(default_factory=lambda: list(TASKS))
    widths: list = field(default_factory=lambda: [32, 64])  # d_model of each model; >= 2 for a curve
    n_layers: int = 2
    at: str = "last"  # where the memory layer goes ("last" = block 1 of 2)
    layer_options: dict = field(default_factory=_short_chunks)  # per layer, merged over the preset's
    lrs: list = field(default_factory=lambda: [3e-3, 1e-2, 3e-2])  # in increasing order: ties go to the first
    steps: int = 150
    batch_size: int = 32
    warmup: int = 10
    min_lr_ratio: float = 0.1  # cosine from lr down to lr * this
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_size: int = 256  # held-out sequences per kv count / n_pairs
    # MQAR (zoology's multiquery_ar)
    mqar_vocab: int = 32
    mqar_seq_len: int = 16
    mqar_kv: list = field(default_factory=lambda: [1, 2, 4])
    power_a: float = 0.01
    # Ba's associative retrieval
    ar_pairs: list = field(default_factory=lambda: [2, 4, 8])

    def check(self) -> None:
        bad = sorted(set(self.tasks) - set(TASKS))
        if bad or not self.tasks:
            raise ConfigError(f"toys.tasks: unknown or empty {bad or self.tasks}; valid tasks: {', '.join(TASKS)}")
        for name in ("widths", "lrs", "mqar_kv", "ar_pairs"):
            if not getattr(self, name):
                raise ConfigError(f"toys.{name} is empty")
        for n in self.mqar_kv:
            try:
                mqar.check_sizes(n, self.mqar_seq_len, self.mqar_vocab)
            except ValueError as e:
                raise ConfigError(f"toys.mqar_kv: {e}") from None
        for n in self.ar_pairs:
            if not 1 <= n <= ar.MAX_PAIRS:
                raise ConfigError(f"toys.ar_pairs: {n} is not in 1..{ar.MAX_PAIRS}")
        if self.steps < 1 or self.batch_size < 1 or self.eval_size < 1 or self.n_layers < 1:
            raise ConfigError("toys.steps, batch_size, eval_size and n_layers must be >= 1")
        if "mqar" in self.tasks and self.batch_size < len(self.mqar_kv):
            raise ConfigError(f"toys.batch_size={self.batch_size} cannot hold one sequence of each of the "
                              f"{len(self.mqar_kv)} mqar_kv counts")
        if any(not isinstance(w, int) or w < 1 for w in self.widths):
            raise ConfigError(f"toys.widths must be positive integers, got {self.widths}")
        from memzoo.registry import layer_names

        unknown = sorted(set(self.layer_options) - set(layer_names()))
        if unknown:
            raise ConfigError(f"toys.layer_options: unknown layer(s) {unknown}; valid: {', '.join(layer_names())}")


# ---- models --------------------------------------------------------------------------------


def toy_config(preset, layer: str, width: int, vocab_size: int, s: Settings) -> ModelConfig:
    """The preset's backbone scaled to `width` and `s.n_layers` blocks, with `layer` at `s.at`
    and the preset's options for it, `s.layer_options[layer]` merged over them. (The preset's
    own placement, e.g. "1,3", is for its deeper backbone, so `s.at` replaces it.)"""
    b = preset.backbone
    ref = ModelConfig.from_dict(b)
    scale = width / ref.d_model
    base = {
        **b,
        "vocab_size": vocab_size,
        "d_model": width,
        "n_layers": s.n_layers,
        "ffn_dim": max(1, round(ref.ffn_dim * scale)),
        "gdn_head_dim": max(1, width // ref.gdn_heads),
        "attn_head_dim": max(1, width // ref.attn_heads),
    }
    if layer == BASELINE:
        return ModelConfig.from_dict(base)
    spec = preset.layers.get(layer)
    opts = {**(spec.options if spec else {}), **(s.layer_options.get(layer) or {})}
    mixers = base.get("layout", "GDN").split("|")[0].strip()
    return ModelConfig.from_dict({**base, "layout": f"{mixers} | {layer}@{s.at}", "memory": {layer: opts}})


def state_size(model: HybridLM) -> dict:
    """Recurrent state of one sequence, in numbers (call after a forward so every memory has
    its state): GDN matrices and memory fast weights."""
    gdn = sum(b.mixer.h * b.mixer.d * b.mixer.d for b in model.blocks if b.kind == "GDN")
    mem = sum(m.fast_weight_numel() for m in model.memories())
    shared = any(not m.per_sequence for m in model.memories())
    return {"gdn_state": gdn, "mem_state": mem, "state_size": gdn + mem, "state_shared": shared}


# ---- data ----------------------------------------------------------------------------------


def _ar_targets(b: ar.AssocBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Ba's task as an LM batch: the answer is the prediction at the last position (the query)."""
    t = torch.full_like(b.tokens, mqar.IGNORE)
    t[:, -1] = b.answer
    return b.tokens, t


class Task:
    """Training batches (a pure function of the generator) and the held-out sets of one task."""

    def __init__(self, name: str, s: Settings, seed: int):
        self.name, self.s = name, s
        self.vocab = s.mqar_vocab if name == "mqar" else ar.VOCAB_SIZE
        self.slices = list(s.mqar_kv if name == "mqar" else s.ar_pairs)
        # held-out sets: their own generators, never shared with training draws
        self.held_out = {n: self._make(s.eval_size, n, torch.Generator().manual_seed(10_007 * (seed + 1) + n))
                         for n in self.slices}

    def _make(self, size: int, n: int, g: torch.Generator):
        s = self.s
        if self.name == "mqar":
            return tuple(mqar.make_batch(size, n, s.mqar_seq_len, s.mqar_vocab, s.power_a, g))
        return _ar_targets(ar.make_batch(size, n, g))

    def batch(self, step: int, g: torch.Generator):
        s = self.s
        if self.name == "mqar":  # every kv count in each batch
            return tuple(mqar.mixed_batch(s.batch_size, self.slices, s.mqar_seq_len, s.mqar_vocab, s.power_a, g))
        return self._make(s.batch_size, self.slices[step % len(self.slices)], g)  # lengths differ: cycle


# ---- training and evaluation ---------------------------------------------------------------


def train_one(
    mc: ModelConfig, task: Task, lr: float, s: Settings, seed: int, device: str = "cpu", on_step=None
) -> tuple[HybridLM, float]:
    """AdamW, warmup then cosine, `s.steps` steps of memzoo's training step from seed `seed`
    (the same initialisation and batches for every layer and lr); `on_step()` after each step.
    Returns the model and the mean training loss of the last tenth of the steps."""
    torch.manual_seed(seed)
    model = HybridLM(mc).to(device)
    tc = SimpleNamespace(lr=lr, min_lr=lr * s.min_lr_ratio, warmup=s.warmup, steps=s.steps, weight_decay=s.weight_decay)
    groups = param_groups(model, tc)
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98))
    train_step = make_step(model, opt, s.grad_clip)
    g = torch.Generator().manual_seed(seed)
    model.train()
    tail = []
    for step in range(s.steps):
        x, y = (t.to(device) for t in task.batch(step, g))  # drawn on the CPU: the same data anywhere
        loss = train_step([(x, y)], lr_at(step, tc))
        if step >= s.steps - max(1, s.steps // 10):
            tail.append(loss)
        if on_step is not None:
            on_step()
    return model, sum(tail) / len(tail)


@torch.no_grad()
def evaluate(model: HybridLM, task: Task, chunk: int = 128) -> dict[int, float]:
    """Accuracy on the labelled positions of each held-out set."""
    model.eval()
    out = {}
    for n, (x, y) in task.held_out.items():
        hits = total = 0
        dev = model.embed.weight.device
        for i in range(0, len(x), chunk):
            xc, yc = x[i : i + chunk].to(dev), y[i : i + chunk].to(dev)
            # targets as in training: layers that learn from them (FWL) see only earlier ones
            logits = model(xc, targets=yc).logits
            mask = yc != mqar.IGNORE
            hits += (logits.argmax(-1)[mask] == yc[mask]).sum().item()
            total += mask.sum().item()
        out[n] = hits / total
    return out


def work(ctx: Context, layer: str) -> int:
    """Units of work for the progress bar: the training steps of one layer."""
    s = ctx.preset.settings(NAME, Settings)
    return len(s.tasks) * len(s.widths) * len(s.lrs) * s.steps


def run(ctx: Context, layers: list[str]) -> list[dict]:
    """Train and evaluate every (layer, task, width, lr); record one row per (layer, task, width)."""
    s = ctx.preset.settings(NAME, Settings)
    s.check()
    tasks = {t: Task(t, s, ctx.seed) for t in s.tasks}
    rows = []
    for layer in layers:
        for tname, task in tasks.items():
            for width in s.widths:
                mc = toy_config(ctx.preset, layer, width, task.vocab, s)
                t0 = time.perf_counter()
                by_lr, best = {}, None  # best: (mean, lr, accuracy by slice, train loss, model)
                for lr in s.lrs:
                    doing = f"toys {layer} {tname} d={width} lr={lr:g}"
                    model, loss = train_one(mc, task, lr, s, ctx.seed, ctx.device, lambda d=doing: ctx.advance(1, d))
                    acc = evaluate(model, task)
                    by_lr[lr] = mean = sum(acc.values()) / len(acc)
                    if best is None or mean > best[0]:  # ties keep the earlier (smaller) lr
                        best = (mean, lr, acc, loss, model)
                mean, lr, acc, loss, model = best
                x, y = task.held_out[task.slices[0]]
                with torch.no_grad():  # a forward, so that every memory holds its state
                    model(x[:2].to(ctx.device), targets=y[:2].to(ctx.device))
                metrics = {
                    "accuracy": round(mean, 4),
                    "acc_by_kv": {str(n): round(a, 4) for n, a in acc.items()},
                    "best_lr": lr,
                    "acc_by_lr": {f"{k:g}": round(v, 4) for k, v in by_lr.items()},
                    "train_loss": round(loss, 4),
                    **state_size(model),
                    "params": sum(p.numel() for p in model.parameters()),
                    "steps": s.steps,
                }
                setting = {"task": tname, "d_model": width}
                config = {
                    "model": mc.to_dict(),
                    "settings": dataclasses.asdict(s),
                    "train": {"optimizer": "AdamW", "betas": [0.9, 0.98], "schedule": "warmup+cosine", "seed": ctx.seed},
                }
                rows.append(ctx.record(NAME, layer, setting, metrics, config, time.perf_counter() - t0))
                if ctx.progress:
                    tqdm.write(f"toys {layer:>8} {tname:>4} d={width:<4} acc {mean:.3f} (lr {lr:g}) "
                               f"state {metrics['state_size']}")
    return rows


# ---- rendering -----------------------------------------------------------------------------

ACC = "metrics.acc_by_kv."
LRS = "metrics.acc_by_lr."


def _order(df):
    """Rows sorted baseline first, then by layer name, then preset, task and width."""
    key = df["layer"].map(lambda n: (n != BASELINE, n))
    by = ["_k", "preset", "setting.task", "setting.d_model"]
    return df.assign(_k=key).sort_values(by, kind="stable").drop(columns="_k")


def _slices(df, prefix: str) -> list[str]:
    """The columns `prefix + number` that hold a value in df, in numeric order."""
    cols = [c for c in df.columns if c.startswith(prefix) and df[c].notna().any()]
    return sorted(cols, key=lambda c: float(c[len(prefix):]))


def _head(d) -> dict:
    """layer (and preset, where rows come from several) and d_model columns."""
    import pandas as pd

    cols = {"layer": d["layer"].values}
    if d["preset"].nunique() > 1:
        cols["preset"] = d["preset"].values
    cols["d_model"] = d["setting.d_model"].astype(int).values
    return pd.DataFrame(cols)


def _task_table(df, task: str, slice_name: str):
    d = _order(df[df["setting.task"] == task])
    out = _head(d)
    out["state"] = d["metrics.state_size"].astype(int).values
    for c in _slices(d, ACC):
        out[f"{slice_name}={c[len(ACC):]}"] = d[c].round(3).values
    out["mean"] = d["metrics.accuracy"].round(3).values
    out["best lr"] = d["metrics.best_lr"].map(lambda x: f"{x:g}").values
    return out.reset_index(drop=True)


def tables(df) -> dict:
    """MQAR accuracy by kv pairs, Ba's task by pairs (both with the state size and best lr),
    the state and parameters per layer and width, and every learning rate's mean accuracy."""
    out = {}
    tasks = set(df["setting.task"])
    if "mqar" in tasks:
        out["MQAR accuracy by key-value pairs (best lr)"] = _task_table(df, "mqar", "kv")
    if "ar" in tasks:
        out["Ba's associative retrieval accuracy by pairs (best lr)"] = _task_table(df, "ar", "pairs")
    # the state does not depend on the task (only the vocabulary, hence params, does): one task's rows
    first = "mqar" if "mqar" in tasks else sorted(tasks)[0]
    d = _order(df[df["setting.task"] == first])
    st = _head(d)
    st["GDN state"] = d["metrics.gdn_state"].astype(int).values
    st["memory state"] = d["metrics.mem_state"].astype(int).values
    st["total"] = d["metrics.state_size"].astype(int).values
    st["memory shared by the batch"] = d["metrics.state_shared"].map(lambda x: "yes" if x else "no").values
    st[f"params ({first})"] = d["metrics.params"].astype(int).values
    out["Recurrent state per sequence (numbers)"] = st.reset_index(drop=True)
    d = _order(df)
    sweep = _head(d)
    sweep.insert(len(sweep.columns) - 1, "task", d["setting.task"].values)
    for c in _slices(d, LRS):
        sweep[f"lr={c[len(LRS):]}"] = d[c].round(3).values
    out["Mean accuracy per learning rate"] = sweep.reset_index(drop=True)
    return out


def figures(df, out_dir: Path) -> list[Path]:
    """toys_mqar_capacity.png (MQAR accuracy vs state size: a line per layer through its
    widths) and toys_mqar_by_kv.png (accuracy vs kv pairs, a panel per width)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    m = _order(df[df["setting.task"] == "mqar"])
    if m.empty:
        return []
    order = layer_order(m["layer"])
    palette = dict(zip(order, sns.color_palette("tab10", len(order))))
    style = "preset" if m["preset"].nunique() > 1 else None
    paths = []

    cap = pd.DataFrame({"layer": m["layer"].values, "preset": m["preset"].values,
                        "state": m["metrics.state_size"].astype(float).values,
                        "accuracy": m["metrics.accuracy"].astype(float).values})
    cap["d_model"] = m["setting.d_model"].astype(int).values
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    sns.lineplot(data=cap, x="state", y="accuracy", hue="layer", hue_order=order, palette=palette, style=style,
                 marker="o", sort=True, errorbar=None, ax=ax)
    for r in cap.itertuples():  # which width each point is
        ax.annotate(f"d={r.d_model}", (r.state, r.accuracy), xytext=(4, -10), textcoords="offset points",
                    fontsize=7, color=palette[r.layer])
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("recurrent state per sequence (numbers, log scale)")
    ax.set_ylabel("MQAR accuracy (mean over kv counts)")
    ax.set_title("MQAR capacity curves")
    fig.tight_layout()
    paths.append(save_png(fig, Path(out_dir) / "toys_mqar_capacity.png"))

    long = pd.DataFrame([
        {"layer": r["layer"], "preset": r["preset"], "d_model": int(r["setting.d_model"]),
         "kv pairs": int(c[len(ACC):]), "accuracy": float(r[c])}
        for _, r in m.iterrows() for c in _slices(m, ACC) if pd.notna(r[c])
    ])
    widths = sorted(long["d_model"].unique())
    fig, axes = plt.subplots(1, len(widths), figsize=(4.5 * len(widths), 4), sharey=True, squeeze=False)
    kvs = sorted(long["kv pairs"].unique())
    for i, (ax, w) in enumerate(zip(axes[0], widths)):
        sns.lineplot(data=long[long["d_model"] == w], x="kv pairs", y="accuracy", hue="layer", hue_order=order,
                     palette=palette, style=style, marker="o", errorbar=None, legend=i == 0, ax=ax)
        ax.set_xscale("log", base=2)
        ax.set_xticks(kvs, [str(k) for k in kvs])
        ax.minorticks_off()
        ax.set_ylim(0, 1.02)
        ax.set_title(f"MQAR accuracy by kv pairs, d_model={w}")
    fig.tight_layout()
    paths.append(save_png(fig, Path(out_dir) / "toys_mqar_by_kv.png"))
    return paths
