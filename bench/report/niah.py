"""The niah suite's report: its rows -> tables, figures and the reading note."""

from __future__ import annotations

import math
from pathlib import Path
from memzoo.bench.common import BASELINE, CONTROLS, LM_LAYER_KEYS, NEGATIVE, POSITIVE, logit_ci, mean_ci
from memzoo.bench.report.common import (
    failing, fewer_seeds, keyed, layer_order, lm_lines, one_per_seed, save_png, shared_count, versus, with_family,
    with_seed, with_texts,
)
from memzoo.bench.report.overview import Headline

#: printed under the NIAH tables of the leaderboard
NOTE = """**Reading the NIAH numbers.** Exact match is all six digits right, with a 95% Wilson interval
over the samples (▲/▼: the interval lies wholly above/below the baseline's). *Digits right* (chance
one in ten; with its 95% t-interval over the samples, marked the same way) and the *answer loss*
(chance ln 10 nats per digit) are graded signals. *seeds*: the LMs (training seeds) behind a row. A
cell of one seed has the intervals above, over its samples; a cell of several is the seeds' mean
with a 95% t-interval over the trainings (for exact match and digits on the logit scale, so it
stays within 0-100%; for the answer loss ± its half-width), marked against the baseline's interval
over its trainings where the baseline has several seeds too (a one-seed cell: against the
baseline's row of the same seed). The controls must pass in every seed, and read each haystack
once (n-iter is a memory's). Where the LMs' mixers are 4-token windows (the standard preset), the
backbone alone cannot copy a needle, so a row above it got the needle through its memory. What
these numbers cannot show: recall among several needles, and anything at the paper's scale. The
findings behind the rows, with their history: docs/journal/niah.md."""


#: an accuracy is the protocol's wherever it ran: a section pools the processors that measured one
#: protocol (each row names its processor); the controls must hold on each (`withheld`), and the
#: throughput table stays per processor
POOLED = True

#: a section is one protocol of the preset's LMs (their config without a layer's own: `report._kind`)
LAYER_KEYS = LM_LAYER_KEYS

#: what identifies a cell of the tables (with its seed): `one_per_seed`
CELL = ["layer", "setting.length", "setting.n_iter"]

# ---- leaderboard ------------------------------------------------------------------------------


def _len_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def validity(df) -> list[str]:
    """What makes the harness invalid (empty: valid), judged in every training seed, since a
    seed's layer rows rest on that seed's controls: the controls not run (in some seed that has
    rows), no haystack length inside the LMs' training length, the positive control below 90%
    exact match at such a length (1-iter) in any seed, or the negative control's or the backbone
    alone's digits above twice chance (0.1) in any seed and cell: where the backbone finds the
    needle, a layer row does not measure its memory."""
    df = with_seed(df)
    pos, neg = df[df["layer"] == POSITIVE], df[df["layer"] == NEGATIVE]
    if pos.empty or neg.empty:
        return ["the controls were not run (niah.controls)"]
    missing = sorted(set(df["seed"]) - (set(pos["seed"]) & set(neg["seed"])))
    if missing:
        return [f"the controls were not run in seed {', '.join(map(str, missing))} (niah.controls)"]
    flag = pos["metrics.inside_training"].fillna(False).astype(bool) if "metrics.inside_training" in pos else False
    inside = pos[(pos["setting.n_iter"] == 1) & flag]
    if inside.empty:
        return ["no haystack length inside the LMs' training length (add one to niah.lengths)"]
    several = df["seed"].nunique() > 1  # then each message names its seed
    out = [f"no haystack length inside the LMs' training length in seed {s}" for s in sorted(set(pos["seed"]) - set(inside["seed"]))]
    out += [f"the positive control's exact match is {100 * a:.1f}% at {_len_label(int(n))} tokens"
            f"{f' in seed {s}' if several else ''} (< 90%)"
            for n, a, s in zip(inside["setting.length"], inside["metrics.accuracy"], inside["seed"]) if a < 0.9]
    for rows, who in ((neg, "the negative control"), (df[df["layer"] == BASELINE], "the backbone alone (baseline)")):
        for s, g in rows.groupby("seed"):
            worst = g["metrics.digit_accuracy"].max()
            if worst > 0.2:
                out.append(f"{who} gets {100 * worst:.1f}% of the digits{f' in seed {s}' if several else ''}, "
                           "above twice chance (10%)")
    return out


def withheld(df) -> tuple:
    """(df without the rows of every processor whose controls fail on it, {processor: why}): a pooled
    section asks the controls to hold on each processor that contributed rows (`validity` on that
    processor's rows, `failing`)."""
    gone = failing(df, validity)
    return (df[~df["machine"].isin(gone)] if gone else df), gone


def _read(df):
    """The rows the accuracy tables, figures and notes read: those `withheld` keeps, one training per
    cell and seed (`one_per_seed`)."""
    return one_per_seed(withheld(with_seed(df))[0], CELL)


def _ns(g):
    """The cell's sample counts, one per seed (what `logit_ci` clips each value by)."""
    return list(g["metrics.n_samples"]) if "metrics.n_samples" in g else None


def _cell(g) -> tuple[str, float, float]:
    """A cell's exact match as (text, lo, hi) in %: one seed's accuracy with its recorded Wilson
    interval over the samples, or the seeds' mean with their logit interval over trainings."""
    if len(g) == 1:
        acc, lo, hi = (100 * g.iloc[0].get(f"metrics.{k}", float("nan")) for k in ("accuracy", "accuracy_lo", "accuracy_hi"))
        return (f"{acc:.1f}" if math.isnan(lo) else f"{acc:.1f} [{lo:.0f}, {hi:.0f}]"), lo, hi
    g = g[g["metrics.accuracy"].notna()]
    acc, lo, hi = (100 * v for v in logit_ci(g["metrics.accuracy"], _ns(g)))
    return f"{acc:.1f} [{lo:.0f}, {hi:.0f}]", lo, hi


def _digits(g) -> tuple[str, float, float]:
    """A cell's digits right as (text, lo, hi) in %: one seed's digits with the t-interval over the
    samples cut to 0-100 (a share of digits cannot leave it; the value alone where the row has no
    interval), or the seeds' mean with their logit interval over trainings."""
    if len(g) == 1:
        d, h = (100 * g.iloc[0].get(f"metrics.{k}", float("nan")) for k in ("digit_accuracy", "digit_accuracy_half"))
        lo, hi = max(0.0, d - h), min(100.0, d + h)
        return (f"{d:.1f}" if math.isnan(h) else f"{d:.1f} [{lo:.1f}, {hi:.1f}]"), lo, hi
    g = g[g["metrics.digit_accuracy"].notna()]
    d, lo, hi = (100 * v for v in logit_ci(g["metrics.digit_accuracy"], _ns(g)))
    return f"{d:.1f} [{lo:.1f}, {hi:.1f}]", lo, hi


def _against(groups: dict, layer: str, col: str):
    """The baseline's rows that a cell is marked against: none for the baseline itself; for a
    one-seed cell the baseline's row of the same seed where it has one (today's comparison,
    interval over samples against interval over samples), else all of the baseline's seeds
    (with several, its interval over trainings)."""
    b, g = groups.get((BASELINE, col)), groups[(layer, col)]
    if layer == BASELINE or b is None:
        return None
    same = b[b["seed"] == g["seed"].iloc[0]]
    return same if len(g) == 1 and len(b) > 1 and len(same) == 1 else b


def tables(df) -> dict:
    """Exact match (%, with its 95% interval: Wilson over the samples for one training seed,
    logit-t over the trainings for several; ▲/▼ against the baseline), digits right (%) and
    answer NLL by layer x (length, n-iter), each with the layer's seeds; throughput and peak
    memory by layer x length, a table per processor. Every seed's row counts, none is picked (a seed
    trained on two processors, once). Where the controls fail (`validity`, in any seed), the layer
    rows are withheld; in a section of several processors, those of the processor they fail on
    (`withheld`). Each row names its layer's write-rule family (`with_family`)."""
    import pandas as pd

    if df.empty:
        return {}
    every, gone = withheld(with_seed(df))  # the throughput tables' rows: every training, each on its processor
    df = one_per_seed(every, CELL).copy()
    df["col"] = [f"{_len_label(int(l))} x{int(n)}" for l, n in zip(df["setting.length"], df["setting.n_iter"])]
    cols = [
        f"{_len_label(l)} x{n}"
        for l, n in sorted({(int(l), int(n)) for l, n in zip(df["setting.length"], df["setting.n_iter"])})
    ]
    bad = validity(df)
    if bad:
        df = df[df["layer"].isin(CONTROLS)]
    order = layer_order(df["layer"])
    index = pd.Index(order, name="layer")
    seeds = df.groupby("layer")["seed"].nunique().to_dict()
    groups = {k: g.sort_values("seed") for k, g in df.groupby(["layer", "col"])}
    several = any(len(g) > 1 for g in groups.values())

    def table(cell) -> "pd.DataFrame":
        texts = {}
        for (layer, col), g in groups.items():
            text, lo, hi = cell(g)
            b = _against(groups, layer, col)
            if b is not None:
                text += versus(lo, hi, *cell(b)[1:])
            texts[(layer, col)] = text + fewer_seeds(len(g), seeds[layer])
        return pd.DataFrame({"seeds": [seeds[layer] for layer in order],
                             **{c: [texts.get((layer, c), "") for layer in order] for c in cols}}, index=index)

    over = "over samples" + ("; over trainings where seeds > 1" if several else "")
    title = f"NIAH exact-match accuracy (%) [95% interval {over}], length x n-iter"
    if gone:
        where = "; ".join(f"{m}: {'; '.join(bad)}" for m, bad in gone.items())
        title += f" (withheld, the controls failing there: the rows measured on {where})"
    out = {f"HARNESS INVALID ({'; '.join(bad)}): layer rows withheld; {title}" if bad else title: keyed("exact", table(_cell))}
    if df.empty:
        return {title: with_family(t) for title, t in out.items()}
    over = "[95% interval over samples, within 0-100] where recorded" + ("; over trainings where seeds > 1" if several else "")
    out[f"NIAH answer digits right (%, {over}; ▲/▼ as above), length x n-iter"] = table(_digits)
    if "metrics.answer_nll" in df:
        t = df.pivot_table(index="layer", columns="col", values="metrics.answer_nll", aggfunc="mean")
        t = t.reindex(index=order, columns=cols).round(3)
        t = t.astype(object).where(t.notna(), "")
        texts = {}
        for (layer, col), g in groups.items():
            vals = list(g["metrics.answer_nll"].dropna())
            if len(vals) > 1:  # the t-interval, bounded below by 0: a loss is never negative
                m, h = mean_ci(vals)
                texts[(layer, col)] = f"{m:.3f} [{max(0.0, m - h):.3f}, {m + h:.3f}]" + fewer_seeds(len(vals), seeds[layer])
            elif vals and seeds[layer] > 1:
                texts[(layer, col)] = format(t.loc[layer, col], "g") + fewer_seeds(1, seeds[layer])
        t = with_texts(t, texts)
        t.insert(0, "seeds", [seeds[layer] for layer in order])
        over = "; [95% interval over trainings, within 0-∞] where seeds > 1" if several else ""
        out[f"NIAH answer NLL (nats per answer token; chance ln 10{over}), length x n-iter"] = t
    shown = every[every["layer"].isin(order)]
    per = list(shown.groupby("machine")) if "machine" in shown else [("", shown)]
    for m, rows in per:
        title = "NIAH throughput and memory" + (f" on {m}" if len(per) > 1 else "")
        out[title + (" (tokens/s: the seeds' mean; peak RSS: their highest)" if several else "")] = _cost(rows, order)
    return {title: with_family(t) for title, t in out.items()}


def _cost(df, order: list[str]):
    """Throughput and peak memory by layer x length, of rows measured on one processor (a timing
    belongs to one): one row per length, its seeds' mean tokens/s and highest peak RSS."""
    import pandas as pd

    one = df.sort_values("setting.n_iter").groupby(["layer", "setting.length", "seed"], as_index=False).first()
    per_len = one.groupby(["layer", "setting.length"], as_index=False).agg(
        seeds=("seed", "size"), samples=("metrics.n_samples", shared_count), tps=("metrics.tokens_per_s", "mean"),
        rss=("metrics.peak_rss_gib", "max"))
    cost = pd.DataFrame({
        "layer": per_len["layer"],
        "length": per_len["setting.length"].astype(int),
        "seeds": per_len["seeds"],
        "samples": per_len["samples"],
        "tokens/s": per_len["tps"].round(0).astype(int),
        "peak RSS (GiB)": per_len["rss"].round(2),
    })
    cost["k"] = cost["layer"].map({n: i for i, n in enumerate(order)})
    return cost.sort_values(["k", "length"]).drop(columns="k").reset_index(drop=True)


def figures(df, out_dir: Path) -> list[Path]:
    """niah_iters.png: Figure 4's stacked bars (a bar per layer, one panel per length; the
    n-iter accuracies drawn on top of each other, tallest first, so each colour shows what
    one more iteration adds). niah_depth.png: accuracy by depth of the queried needle x length,
    a heatmap per layer (columns) and n-iter (rows). A cell of several training seeds is their
    mean (the title says so), never one seed's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    df = _read(df)
    if validity(df):  # the layer rows are withheld, as in the tables
        df = df[df["layer"].isin(CONTROLS)]
    if df.empty:
        return []
    out_dir = Path(out_dir)
    order = layer_order(df["layer"])
    lengths = sorted({int(v) for v in df["setting.length"]})
    iters = sorted({int(v) for v in df["setting.n_iter"]})
    cells = df.groupby(["layer", "setting.length", "setting.n_iter"])
    acc = {(layer, int(n), int(i)): float(v) for (layer, n, i), v in cells["metrics.accuracy"].mean().items()}
    seeds = " (mean over training seeds)" if cells.size().max() > 1 else ""  # every seed counts, as in the tables
    colors = dict(zip(iters, sns.color_palette("crest", len(iters))))
    paths = []

    fig, axes = plt.subplots(1, len(lengths), figsize=(1.9 + 0.55 * len(order) * len(lengths) + 0.8 * len(lengths), 3.6),
                             sharey=True, squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for x, layer in enumerate(order):
            bars = sorted(((acc[(layer, length, n)], n) for n in iters if (layer, length, n) in acc), key=lambda t: (-t[0], t[1]))
            for v, n in bars:  # tallest first: the shorter ones stay visible in front
                ax.bar(x, 100 * v, width=0.7, color=colors[n], edgecolor="white", linewidth=0.5)
        ax.set_xticks(range(len(order)), order, rotation=45, ha="right")
        ax.set_title(f"{_len_label(length)} tokens")
        ax.set_ylim(0, 100)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("exact-match accuracy (%)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in iters]
    fig.legend(handles, [f"{n}-iter" for n in iters], loc="center right", fontsize=8, frameon=False)
    fig.suptitle(f"NIAH accuracy, n-iter memorization{seeds}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 0.9 / fig.get_figwidth(), 1))
    paths.append(save_png(fig, out_dir / "niah_iters.png"))

    depth_cols = sorted(
        (c for c in df.columns if c.startswith("metrics.by_depth.")), key=lambda c: float(c.split(".")[-1].split("-")[0])
    )
    labels = [c[len("metrics.by_depth.") :] for c in depth_cols]
    fig, axes = plt.subplots(len(iters), len(order), figsize=(1.2 + 2.4 * len(order), 0.6 + 2.0 * len(iters)),
                             squeeze=False)
    for i, n in enumerate(iters):
        for j, layer in enumerate(order):
            ax = axes[i][j]
            grid = []
            for c in depth_cols:
                row = []
                for length in lengths:
                    sel = df[(df["layer"] == layer) & (df["setting.length"] == length) & (df["setting.n_iter"] == n)]
                    row.append(100 * float(sel[c].mean()) if len(sel) else float("nan"))
                grid.append(row)
            sns.heatmap(grid, ax=ax, vmin=0, vmax=100, cmap="viridis", annot=True, fmt=".0f", cbar=False,
                        annot_kws={"fontsize": 7}, xticklabels=[_len_label(l) for l in lengths], yticklabels=labels)
            if i == 0:
                ax.set_title(layer, fontsize=9)
            ax.set_ylabel(f"{n}-iter: depth" if j == 0 else "")
            ax.set_xlabel("length" if i == len(iters) - 1 else "")
            ax.tick_params(labelsize=7)
    fig.suptitle(f"NIAH accuracy (%) by depth of the queried needle{seeds}", fontsize=10)
    fig.tight_layout()
    paths.append(save_png(fig, out_dir / "niah_depth.png"))
    return paths


def reading(df) -> list[str]:
    """The reading note's lines computed from the section's rows: the controls' results, the
    LMs' budget and how many training seeds the rows have."""
    df = _read(df)
    out = []
    pos = df[(df["layer"] == POSITIVE) & (df["setting.n_iter"] == 1)]
    if "metrics.inside_training" in pos:
        pos = pos[pos["metrics.inside_training"].fillna(False).astype(bool)]
        for length, g in pos.groupby("setting.length"):
            accs = ", ".join(f"{100 * a:.0f}%" for a in g.sort_values("seed")["metrics.accuracy"])
            out.append(f"The positive control finds the needle in {accs} of the {_len_label(int(length))}-token haystacks "
                       f"(inside its training length; seeds {', '.join(map(str, sorted(g['seed'])))}).")
    chance = df[df["layer"].isin([NEGATIVE, BASELINE])]
    if not chance.empty:
        lo, hi = 100 * chance["metrics.digit_accuracy"].min(), 100 * chance["metrics.digit_accuracy"].max()
        out.append(f"The negative control and the backbone alone get {lo:.0f}-{hi:.0f}% of the digits (chance: one in ten; "
                   f"the harness holds them under twice that).")
    return out + lm_lines(df, "haystacks")


def problems(df) -> list[str]:
    """What makes the harness invalid in this section (empty: valid): the controls failing on every
    processor that measured it (one failing processor's rows are withheld, `withheld`)."""
    return validity(_read(df))


def _short(text: str) -> str:
    """A table cell without its interval, its ▲/▼ kept."""
    return text.split(" [")[0] + "".join(m for m in (" ▲", " ▼") if m.strip() in text)


def _niah_cell(sec, t, layer) -> str:
    """Exact match (%) with one memorization pass at each length, as the table marks it, and the preset."""
    cells = [f"{c[:-3]}: {_short(str(t.loc[layer, c]))}" for c in t.columns if str(c).endswith(" x1") and str(t.loc[layer, c])]
    return " · ".join(cells) + f" ({sec.preset})"


HEADLINES = (Headline(
    column="NIAH: exact match % by length", table="exact", value="seeds", rank=("seeds", "not tiny", "lengths", "time"),
    text=_niah_cell, why="the most trainings behind each number, then a published preset, the most lengths, the latest"),)
