"""The cost suite's report: its rows -> tables, figures and the reading note."""

from __future__ import annotations

import re
from pathlib import Path
from memzoo.bench.common import BASELINE
from memzoo.bench.report.common import keyed, machine, save_png, with_family
from memzoo.bench.report.overview import Headline

RATIO = "× baseline's tokens/s"  # the paired throughput column: the overview's cost cell

NOTE = """\
**The two FLOPs columns.** *Table-2 style* is the paper's accounting, which we reconstructed and
checked against all 16 rows of its Table 2: 6 × (counted parameters) × tokens for one step of
8 × 4096 tokens, where every slow parameter counts once per token (2 FLOPs per multiply-add
forward, 4 backward) except PKM's value tables, which a token reads only k rows of; FwPKM's
sub-keys and values are fast weights and are not counted, PKM's sub-keys are (scoring them is a
dense product). Nothing else is in it: not the softmax-attention scores, not the gated delta
rule's recurrence, not FwPKM's lookup and write. *Full* counts what one training step computes:
the same step run on the meta device under torch's FlopCounterMode (every matmul, the GDN chunked
recurrence's products and triangular solves, product-key scoring, the fast-weight updates) plus
formulas for what it misses: attention over exactly the (query, key) pairs the causal or
sliding-window mask keeps, embedding-bag sums, index_add / scatter_add writes, and grouped
convolutions' backward. Full exceeds Table-2 style by the attention (large for FA layers at 4096
tokens, small for SWA's 512 window), the GDN recurrence and the memory layers' own work
(lookups, fast-weight updates, FWL's per-position loss gradients through the LM head); for a
routed layer (MoM) Table-2 style charges every memory's projections to every token, while the
full count runs each memory on its routed tokens only (counted at balanced routing).
Elementwise ops, top-k and the optimizer are in neither. Achieved FLOP/s and MFU use the full
count; the paper's FLOPS column is its FLOPs over its step time, i.e. Table-2 style."""


# ---- rendering --------------------------------------------------------------------------------


def _col(df, key):
    import pandas as pd

    c = f"metrics.{key}"
    return df[c] if c in df else pd.Series([float("nan")] * len(df), index=df.index)


def _unit(df) -> tuple[str, float]:
    top = _col(df, "flops_full").max()
    return ("T", 1e12) if top >= 1e12 else ("G", 1e9)


def _sorted(df):
    """Rows in a fixed order: baseline first, then layers by name; Table 2's configs in the
    paper's order (backbone, then plain, PKM, FwPKM, mixed); then by step shape."""
    shape = [df[f"setting.{k}"].fillna(0).tolist() if f"setting.{k}" in df else [0] * len(df) for k in ("batch", "seq_len")]
    keys = [(_order_key(n), b, t) for n, b, t in zip(df["layer"], *shape)]
    return df.iloc[sorted(range(len(df)), key=keys.__getitem__)]


def _order_key(name: str) -> tuple:
    if name == BASELINE:
        return (0, "", 0)
    stem = name.split("/")[-1]
    tails = ("-pkm2-6-10", "-fwpkm2-6-10", "-pkm6-fwpkm2-10")
    i = next((i + 1 for i, tail in enumerate(tails) if stem.endswith(tail)), 0)
    stem = stem[: -len(tails[i - 1])] if i else stem
    rank = {"gdn": "0", "gdn-swa": "1", "gdn-fa": "2", "fa": "3"}  # Table 2's order
    return (1, rank.get(stem, "9" + stem), i)


def _table2(df):
    import pandas as pd

    u, sc = _unit(df)
    df = _sorted(df)
    t = pd.DataFrame({"config": [n.split("/")[-1] for n in df["layer"]]}, index=df.index)
    t["params (M)"] = (_col(df, "params") / 1e6).round(2)
    t["paper (M)"] = (_col(df, "params_paper") / 1e6).round(2)
    t["Δ params %"] = _col(df, "params_diff_pct").round(3) + 0.0  # + 0.0: no "-0"
    t[f"FLOPs Table-2 style ({u})"] = (_col(df, "flops_table2") / sc).round(2)
    t[f"paper ({u})"] = (_col(df, "flops_table2_paper") / sc).round(2)
    t["Δ FLOPs %"] = _col(df, "flops_table2_diff_pct").round(3) + 0.0
    t[f"FLOPs full ({u})"] = (_col(df, "flops_full") / sc).round(2)
    t["full / Table-2"] = (_col(df, "flops_full") / _col(df, "flops_table2")).round(3)
    if _col(df, "step_s").notna().any():
        t["samples/s"] = _col(df, "samples_per_s").round(2)
        t["paper samples/s"] = _col(df, "samples_per_s_paper").round(2)
        t[f"FLOPS Table-2 style ({u}/s)"] = (_col(df, "flops_per_s_table2") / sc).round(2)
        t[f"paper FLOPS ({u}/s)"] = (_col(df, "flops_per_s_table2_paper") / sc).round(2)
        t[f"FLOPS full ({u}/s)"] = (_col(df, "flops_per_s") / sc).round(2)
        t["MFU %"] = (100 * _col(df, "mfu")).round(1)
        t["device"] = _col(df, "device")
    return t.set_index("config")


def _layers(df):
    import pandas as pd

    u, sc = _unit(df)
    df = _sorted(df)
    t = pd.DataFrame({"layer": df["layer"]}, index=df.index)
    t["params (M)"] = (_col(df, "params") / 1e6).round(3)
    t[f"FLOPs Table-2 style ({u})"] = (_col(df, "flops_table2") / sc).round(2)
    t[f"FLOPs full ({u})"] = (_col(df, "flops_full") / sc).round(2)
    for k, name in (("attention", "attention"), ("contractions", "other matmuls"), ("sparse", "sparse")):
        t[f"of which {name} ({u})"] = (_col(df, f"flops_{k}") / sc).round(3)
    t["step (B x T)"] = _col(df, "step_shape")
    if _col(df, "step_s").notna().any():
        t["samples/s"] = _col(df, "samples_per_s").round(2)
        t["tokens/s"] = _col(df, "tokens_per_s").round(0)
        if _col(df, "step_spread").notna().any():  # the timed steps' 10-90% range over their median
            t["step spread %"] = (100 * _col(df, "step_spread")).round(1)
        t[f"achieved {u}FLOP/s"] = (_col(df, "flops_per_s") / sc).round(2)
        # against the baseline timed in the same rounds where the row has it (paired), else its row
        noisy = _col(df, "noisy").notna() & (_col(df, "noisy") != "")
        quiet_base = _col(df, "flops_per_s")[(df["layer"] == BASELINE) & ~noisy].max()
        base = _col(df, "baseline_flops_per_s_beside").fillna(quiet_base)
        t[f"× baseline's {u}FLOP/s"] = (_col(df, "flops_per_s") / base).round(2).where(~noisy)  # not from a noisy timing
        # throughput against the baseline's timed beside it (the same step shape), else its row's
        base_step = _col(df, "baseline_step_s_beside").fillna(_col(df, "step_s")[(df["layer"] == BASELINE) & ~noisy].min())
        t[RATIO] = (base_step / _col(df, "step_s")).round(2).where(~noisy)
        t[f"peak {u}FLOP/s"] = (_col(df, "peak_flops_per_s") / sc).round(1)
        t["MFU %"] = (100 * _col(df, "mfu")).round(2).where(~noisy)
        if noisy.any():
            t["timing"] = ["noisy: " + str(why) if n else "" for n, why in zip(noisy, _col(df, "noisy"))]
        t["device"] = _col(df, "device")
    return with_family(t.set_index("layer"))


def tables(df) -> dict:
    """The Table 2 comparison (configs beside the paper) and the per-layer cost table (each layer
    with its write-rule family)."""
    import pandas as pd

    out = {}
    cfg = df.get("setting.config", pd.Series(None, index=df.index, dtype=object)).notna()
    if cfg.any():
        out["Table 2 beside the paper: parameters, FLOPs of one training step, throughput"] = keyed("table2", _table2(df[cfg]))
    if (~cfg).any():
        out["Cost per layer: parameters, FLOPs of one training step, measured throughput"] = keyed("layers", _layers(df[~cfg]))
    return out


def figures(df, out_dir: Path) -> list[Path]:
    """cost.png: parameters and FLOPs per model (both counts, and the paper's where known)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    if df.empty:
        return []
    u, sc = _unit(df)
    df = _sorted(df).drop_duplicates("layer", keep="last")  # one bar per model: its largest step
    short = [n.split("/")[-1] for n in df["layer"]]
    def long(keys, value):  # one row per (model, what) with a value
        parts = [pd.DataFrame({"model": short, value: (_col(df, k) / scale).values, "count": label})
                 for k, label, scale in keys]
        return pd.concat(parts).dropna()

    params = long((("params", "memzoo", 1e6), ("params_paper", "paper", 1e6)), "params (M)")
    flops = long((("flops_table2", "Table-2 style", sc), ("flops_full", "full count", sc),
                  ("flops_table2_paper", "paper (Table 2)", sc)), f"FLOPs ({u})")
    with matplotlib.rc_context():  # the theme stays with this figure: the others keep theirs
        sns.set_theme(style="whitegrid")
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, max(3.5, 0.45 * len(short) + 1.8)), sharey=True)
        for ax, data, x, palette in ((a, params, "params (M)", ["#4C72B0", "#55A868"]),
                                     (b, flops, f"FLOPs ({u})", ["#4C72B0", "#DD8452", "#55A868"])):
            hues = list(dict.fromkeys(data["count"]))  # first-seen order: ours, then the paper's
            sns.barplot(data=data, y="model", x=x, hue="count", order=short, hue_order=hues,
                        palette=palette[: len(hues)], ax=ax)
            ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=8, frameon=False)
        shape = _col(df, "step_shape").dropna()
        a.set_title("parameters", pad=20)
        b.set_title(f"FLOPs of one training step ({shape.iloc[0] if len(shape) else ''} tokens)", pad=20)
        fig.tight_layout()
        return [save_png(fig, Path(out_dir) / "cost.png")]


def reading(df) -> list[str]:
    """The reading note's lines computed from the rows: which timings stayed noisy after their
    retimes (their ratio columns are left blank)."""
    if "metrics.noisy" not in df:
        return []
    noisy = df[df["metrics.noisy"].notna() & (df["metrics.noisy"] != "")]
    name = lambda r: r["setting.config"] if isinstance(r.get("setting.config"), str) else r["layer"]  # noqa: E731
    return [f"{name(r)}: a noisy timing ({r['metrics.noisy']}), kept out of the ratio columns" for _, r in noisy.iterrows()]


def _cost_cell(sec, t, layer) -> str:
    """Training throughput over the baseline's (the table's paired column), the parameters, the preset and processor."""
    where = " ".join(re.sub(r"\((R|TM)\)|\bProcessor\b|\bCPU\b", " ", machine(sec.rows[0])).split())
    return f"{t.loc[layer, RATIO]:.2f}× · {t.loc[layer, 'params (M)']:.2f} M params ({sec.preset}, {where})"


HEADLINES = (Headline(
    column="cost: training tokens/s × baseline's", table="layers", value=RATIO, rank=("layers", "time"), text=_cost_cell,
    layers=lambda sec, t: list(t[RATIO].dropna().index),  # a noisy timing has no ratio
    why="a ratio is only comparable within one run on one machine: the section timing the most layers, then the latest"),)


def summary(df) -> str:
    """One clause of what a run's cost rows show: each layer's training throughput against the
    baseline's (the table's paired column)."""
    tables_ = tables(df)
    t = next((t for t in tables_.values() if t.attrs.get("table") == "layers"), None)
    if t is None or RATIO not in t.columns:
        return ""
    parts = [f"{layer} {t.loc[layer, RATIO]:.2f}x" for layer in t.index if layer != BASELINE and t.loc[layer, RATIO] == t.loc[layer, RATIO]]
    return f"cost: training tokens/s against the baseline's: {', '.join(parts)}" if parts else ""
