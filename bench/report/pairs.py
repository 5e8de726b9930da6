"""The pairs suite's report: its rows -> tables, figures and the reading note."""

from __future__ import annotations

from pathlib import Path

from memzoo.bench.common import logit_ci, mean_ci
from memzoo.bench.report.common import keyed, layer_order, save_png, with_family
from memzoo.bench.report.overview import Headline
from memzoo.bench.schema import PAIRS_HELD_AT

NAME = "pairs"
PAIRS_COLUMN = f"pairs: held at {PAIRS_HELD_AT:g} per 1k state (no training)"  # the overview's column

NOTE = f"""Each row is a write rule at one state size, driven by explicit pairs with the layer's own op (no
training): n key-value pairs written from a reset state and read back at their keys, over several
independent draws of keys and values. *held at {PAIRS_HELD_AT:g}*: the largest n of the grid whose pairs were
recalled at {PAIRS_HELD_AT:g} or better (the nearest stored value by cosine is the right one), the draws' mean with
its 95% interval (t over the draws); "≥ N" where the largest n tried was still held (the grid, not the
rule, stopped it). *per 1k state*: that over the state numbers a sequence carries (as the recall tables
count them). *gates*: neutral (β = 1, no decay, the paper's inner lr: each adapter's docstring) or the
values the layer's initialisation gives a random input. *keys*: random unit keys per head, or
correlated ones (pairwise cosine about 0.5). A layer without an adapter is not a row: its `no_pairs`
says why (docs/suites/pairs.md)."""


def _held(g) -> str:
    """The pairs held over the draws: their mean with its 95% t-interval (cut at 0), or "≥ top" where
    every draw held the grid's largest n."""
    held = [h for hs in g["metrics.held"] for h in hs]
    top = int(g["metrics.grid_top"].iloc[0])
    if all(h >= top for h in held):
        return f"≥ {top}"
    m, half = mean_ci(held)
    return f"{m:.1f} [{max(0.0, m - half):.1f}, {m + half:.1f}]" if len(held) > 1 else f"{held[0]}"


def tables(df) -> dict:
    """One table per key condition and gate setting: per layer and size, its state, the pairs held at
    0.9 and per 1k state numbers, the accuracy at n = the key size and at the grid's top."""
    import pandas as pd

    out = {}
    for (cond, gates), d in df.groupby(["setting.condition", "setting.gates"], sort=True):
        recs = []
        for layer in layer_order(d["layer"]):
            for size, g in d[d["layer"] == layer].groupby("setting.size", sort=False):
                m = g.iloc[0]
                H, K, V = m["metrics.pair_dims"]
                key = str(max(n for n in m["metrics.ns"] if n <= H * K))
                acc = lambda n: sum(m[f"metrics.acc_by_n.{n}"]) / len(m[f"metrics.acc_by_n.{n}"])  # noqa: E731
                recs.append({"layer": layer, "size": size, "state": int(m["metrics.mem_state"]),
                             "key size (H×K)": H * K, f"held at {m['metrics.held_at']:g}": _held(g),
                             "per 1k state": "" if m["metrics.held_per_1k_state"] is None else f"{m['metrics.held_per_1k_state']:.2f}",
                             f"accuracy at n = H×K": f"{acc(key):.3f}",
                             "accuracy at the grid's top": f"{acc(m['metrics.grid_top']):.3f} (n = {m['metrics.grid_top']})"})
        t = pd.DataFrame(recs)
        t = t.sort_values(["layer", "state"], key=lambda c: c.map({n: i for i, n in enumerate(layer_order(t["layer"]))})
                          if c.name == "layer" else c, kind="stable")
        out[f"Pairs held without training: {cond} keys, {gates} gates"] = keyed(f"{cond}-{gates}", with_family(t.reset_index(drop=True)))
    return out


def figures(df, out_dir: Path) -> list[Path]:
    """pairs_held.png: pairs held at 0.9 against state numbers (log-log), a line per layer through its
    sizes, a panel per family; random keys, neutral gates and init gates (two rows).
    pairs_recall.png: recall accuracy against n at each layer's bench size (random keys, neutral gates)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from memzoo.registry import family_of

    from .toys import _palette

    d = df[df["setting.condition"] == "random"]
    if d.empty:
        return []
    fams = sorted({family_of(n) or "other" for n in d["layer"]})
    gates = [g for g in ("neutral", "init") if g in set(d["setting.gates"])]
    fig, axes = plt.subplots(len(gates), len(fams), figsize=(3.6 * len(fams) + 1, 3.2 * len(gates)), squeeze=False,
                             sharex=True, sharey=True)
    for i, gate in enumerate(gates):
        for j, fam in enumerate(fams):
            ax = axes[i][j]
            layers = [n for n in layer_order(d["layer"]) if (family_of(n) or "other") == fam]
            pal = _palette(layers)
            for n in layers:
                g = d[(d["layer"] == n) & (d["setting.gates"] == gate)].sort_values("metrics.mem_state")
                xs = list(g["metrics.mem_state"])
                ys = [max(sum(h) / len(h), 0.5) for h in g["metrics.held"]]  # 0 held: drawn at 0.5 on the log axis
                ax.plot(xs, ys, marker="o", color=pal[n], label=n, lw=1.2)
            ax.set_xscale("log")
            ax.set_yscale("log")
            if i == 0:
                ax.set_title(fam, fontsize=9)
            if i == len(gates) - 1:
                ax.set_xlabel("state numbers per sequence (log)")
            if j == 0:
                ax.set_ylabel(f"pairs held at {PAIRS_HELD_AT:g} ({gate} gates)")
            ax.legend(fontsize=6)
    fig.suptitle("Pairs a write rule holds without training, against its state (random keys)", fontsize=9)
    fig.tight_layout()
    paths = [save_png(fig, Path(out_dir) / "pairs_held.png")]

    top = d[(d["setting.top"] == True) & (d["setting.gates"] == "neutral")]  # noqa: E712
    if not top.empty:
        fig, axes = plt.subplots(1, len(fams), figsize=(3.6 * len(fams) + 1, 3.2), squeeze=False, sharey=True)
        for j, fam in enumerate(fams):
            ax = axes[0][j]
            layers = [n for n in layer_order(top["layer"]) if (family_of(n) or "other") == fam]
            pal = _palette(layers)
            for n in layers:
                m = top[top["layer"] == n].iloc[0]
                ns = m["metrics.ns"]
                stats = [logit_ci(m[f"metrics.acc_by_n.{k}"]) for k in ns]
                ax.errorbar(ns, [s[0] for s in stats], yerr=[[s[0] - s[1] for s in stats], [s[2] - s[0] for s in stats]],
                            color=pal[n], label=n, lw=1.2, capsize=2)
            ax.axhline(PAIRS_HELD_AT, color="grey", lw=0.6, ls=":")
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.02)
            ax.set_title(fam, fontsize=9)
            ax.set_xlabel("pairs written (n, log)")
            ax.legend(fontsize=6)
        axes[0][0].set_ylabel("recall accuracy (neutral gates)")
        fig.tight_layout()
        paths.append(save_png(fig, Path(out_dir) / "pairs_recall.png"))
    return paths


def _bench_size(sec) -> dict:
    """{layer: its row at its bench size} of the section (random keys, neutral gates)."""
    return {r["layer"]: r for r in sec.rows if r["setting"].get("top") and r["setting"].get("condition") == "random"
            and r["setting"].get("gates") == "neutral"}


def _pairs_cell(sec, t, layer) -> str:
    """The pairs held at 0.9 per 1k state numbers at the layer's bench size, and of how many numbers."""
    m = _bench_size(sec)[layer]["metrics"]
    v = m.get("held_per_1k_state")
    return "" if v is None else f"{v:.2f} ({m['held_mean']:.1f} of {m['mem_state']:,} numbers)"


HEADLINES = (Headline(
    column=PAIRS_COLUMN, table="random-neutral", value="per 1k state", rank=("time",), text=_pairs_cell,
    layers=lambda sec, t: list(_bench_size(sec)),
    why="what the rule holds without training at the size the other columns measure: the latest measurement"),)
