"""The ppl suite's report: its rows -> tables, figures and the reading note."""

from __future__ import annotations

import math
from pathlib import Path
from memzoo.bench.common import BASELINE, CONTROLS, LM_LAYER_KEYS, POSITIVE, mean_ci
from memzoo.bench.report.common import (
    failing, fewer_seeds, keyed, layer_order, lm_host, lm_lines, one_per_seed, save_png, shared_count, versus, with_family,
    with_seed, with_texts,
)
from memzoo.bench.report.overview import Headline
from memzoo.bench.schema import PPL_MODES as MODES
from memzoo.bench.schema import PPL_POSITIONS as POSITIONS

#: printed under the ppl tables of the leaderboard
NOTE = """**Reading the PPL numbers.** Loss in nats per token (bytes) on held-out text, batch 1 in
document order. *gain* (reset - carry) is what fast weights carried from the document's earlier
sequences are worth; the baseline and the controls carry nothing, so their gains are 0 by
construction (a check of the harness); ▲/▼ where the 95% interval excludes 0. *seeds*: the LMs
(training seeds) behind a row. A cell of one seed is its LM's, the interval of its gain over
sequences (a document's sequences are correlated: read it as a guide) or, in the probe, over
passages; a cell of several seeds is their mean ± a 95% t-interval over the trainings (for
perplexity, exp of the mean loss and of its interval), marked against the baseline's interval over
its trainings where the baseline has several seeds too. The repeated-passage probe is the test with
a known answer: the attention control keeps a passage's first reading in its KV cache and must
predict its second reading better in every seed; a memory layer's probe gain is what its fast
weights alone carry of the passage into a new sequence, read against the control's. Where the LMs'
mixers are 4-token windows (the standard preset), a carried gain comes through the memory alone.
What these numbers cannot show: the paper's gains on 4K-token sequences with LMs of 100M+
parameters. The findings behind the rows, with their history: docs/journal/ppl.md."""


# ---- leaderboard ------------------------------------------------------------------------------

#: a loss is the protocol's wherever it ran: a section pools the processors that measured one protocol
#: (each row names its processor); the probe's control must hold on each (`withheld`), and the LMs'
#: training time stays per processor
POOLED = True

#: a section is one protocol of the preset's LMs (their config without a layer's own: `report._kind`)
LAYER_KEYS = LM_LAYER_KEYS

#: what identifies a cell of the tables (with its seed): `one_per_seed`
CELL = ["layer", "setting.corpus", "setting.mode"]

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


def withheld(df) -> tuple:
    """(df without the probe rows of every processor whose positive control fails the probe there,
    {processor: why}): a pooled section asks the control to hold on each processor that contributed
    probe rows (`validity` on that processor's rows, `failing`); the losses have no control to fail."""
    probe = df["setting.corpus"] == "repeat"
    gone = failing(df[probe], validity)
    return (df[~(probe & df["machine"].isin(gone))] if gone else df), gone


def _read(df):
    """The rows the tables, figures and notes read: those `withheld` keeps, one training per cell and
    seed (`one_per_seed`)."""
    return one_per_seed(withheld(with_seed(df))[0], CELL)


def _gain(m: float, half: float, ref: tuple[float, float] = (0.0, 0.0)) -> str:
    """'gain ± half', with ▲/▼ where the interval lies wholly above/below `ref`: the baseline's
    gain, 0 (it carries no memory, so its carried and reset readings are the same computation),
    or its interval over trainings where both it and the row have several seeds."""
    if math.isnan(m):
        return ""
    return f"{m:+.4f} ± {half:.4f}" + versus(m - half, m + half, *ref)


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
    cell of one, as recorded); every table says the layer's seeds, none picks one (a seed trained on
    two processors counts once), and each row its layer's write-rule family (`with_family`). In a
    section of several processors, the LMs' training time is a column per processor and a processor
    whose probe control fails has its probe rows withheld (`withheld`)."""
    import pandas as pd

    every, gone = withheld(with_seed(df))  # the LMs' training time: every training, each on its processor
    df = one_per_seed(every, CELL)
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
           "what carried fast weights are worth)": keyed("loss", with_texts(out, texts))}
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
        if gone:
            where = "; ".join(f"{m}: {'; '.join(why)}" for m, why in gone.items())
            title += f" (withheld, the control failing there: the rows measured on {where})"
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
        res[title] = keyed("probe", with_texts(p, {(layer, col): text for layer in order for key, col in readings
                                                   if (text := _over_seeds(by_layer[layer][key], len(by_layer[layer]))) is not None}))
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
    lm = _train_time(lm, every[every["setting.corpus"] != "repeat"])
    over = "; where seeds > 1 the val loss is their mean ± its 95% interval, the rest their mean" if several else ""
    res[f"The LMs (one per layer and training seed, *seeds* of them; niah evaluates them too unless its preset gives "
        f"it LMs of its own, niah.lm{over})"] = lm
    return {title: with_family(t) for title, t in res.items()}


def _train_time(lm, every):
    """The LMs' table with its training time per processor (a timing belongs to one): where the
    section pools several, a column "LM train s on P" for each (its seeds' mean), none mixed."""
    if "machine" not in every or every["machine"].nunique() < 2:
        return lm
    at = lm.columns.get_loc("LM train s")
    lm = lm.drop(columns="LM train s")
    for i, (m, g) in enumerate(every.groupby("machine")):
        per = g.groupby(["layer", "seed"])["metrics.lm_train_wall_s"].first().groupby(level="layer").mean().round(1)
        lm.insert(at + i, f"LM train s on {m}", [per.get(layer, "") for layer in lm.index])
    return lm


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
    df = _read(df)
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
            sns.barplot(data=sub, x="gate", y="fraction", hue="corpus", ax=ax, hue_order=sorted(sub["corpus"].unique()),
                        seed=0)  # the error bars' bootstrap over seeds: the same rows draw the same bytes
            ax.set_title(f"{layer} {mem}: gate values (carried evaluation)")
            ax.set_xticks(range(len(sub["gate"].unique())))
            ax.set_xticklabels([f"{v:.2f}" for v in sorted(sub["gate"].unique())], fontsize=7)
        fig.tight_layout()
        paths.append(save_png(fig, out_dir / "ppl_gates.png"))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    d = df.assign(setting=df["setting.corpus"] + " " + df["setting.mode"]).sort_values(["layer", "setting"])
    sns.barplot(data=d, x="layer", y="metrics.loss", hue="setting", order=layer_order(d["layer"]), ax=ax, seed=0)
    ax.set_ylabel("loss (nats/token)")
    ax.set_ylim(d["metrics.loss"].min() * 0.95, d["metrics.loss"].max() * 1.02)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    paths.append(save_png(fig, out_dir / "ppl.png"))
    return paths


def reading(df) -> list[str]:
    """The reading note's lines computed from the section's rows: the positive control's probe,
    the LMs' budget and how many training seeds the rows have."""
    df = _read(df)
    out = []
    pos = df[(df["layer"] == POSITIVE) & (df["setting.corpus"] == "repeat")]
    for _, r in pos.sort_values("seed").iterrows():
        out.append(f"The positive control predicts a passage's second reading {r['metrics.gain']:+.3f} ± "
                   f"{r['metrics.gain_half']:.3f} nats/token better than its first (seed {r['seed']}).")
    if pos.empty and (df["setting.corpus"] == "repeat").any():
        out.append("The probe ran without its positive control: its rows are withheld.")
    return out + _host_lines(df) + lm_lines(df, "sequences or passages")


def _host_lines(df) -> list[str]:
    """What the LMs are where they are a Hugging Face host with memories attached (`ppl.host`)."""
    if "host.steps" not in df or df["host.steps"].isna().all():
        return []
    r = df[df["host.steps"].notna()].iloc[0]
    cfg = lambda k: r.get(f"host.config.{k}")  # noqa: E731
    return [f"The LMs are a Hugging Face {cfg('model_type')} ({cfg('num_hidden_layers')} layers, width {cfg('hidden_size')}), "
            f"random-init and pretrained {int(r['host.steps'])} steps once per seed, then trained further with "
            "everything trainable: the baseline alone, a layer's with that memory attached (memzoo.attach), so that each "
            "memory stands against the same model trained as long without it."]


def problems(df) -> list[str] | None:
    """What makes the repeated-passage probe invalid (empty: valid); None where the section has
    no probe (its losses have no control with a known answer)."""
    probe = df[df["setting.corpus"] == "repeat"]
    return None if probe.empty else validity(_read(probe))


def _carried_gain(sec, t, layer) -> str:
    """The carried-state gain on the section's first corpus (the loss table's first gain column), as the table shows it."""
    col = next((c for c in t.columns if str(c).endswith(" gain")), None)
    return "" if col is None else f"{t.loc[layer, col]} ({col[:-len(' gain')]}, {sec.preset})"


def on_the_backbone(sec, t) -> list:
    """The layers a section gives the overview: its table's, where its LMs are memzoo's backbone; none where
    they are a Hugging Face host with the memory attached (the attach preset: another model, its own section)."""
    return [] if any(lm_host(r) for r in sec.rows) else list(t.index)


_WHY = ("the most trainings behind each number, then a published preset, then the latest (LMs of memzoo's "
        "backbone: the attach preset's host LMs have their own section)")
HEADLINES = (
    Headline(column="PPL: carried-state gain (nats)", table="loss", value="seeds", rank=("seeds", "not tiny", "time"),
             text=_carried_gain, why=_WHY, layers=on_the_backbone),
    Headline(column="PPL: re-reading gain (nats)", table="probe", value="gain", rank=("seeds", "not tiny", "time"),
             text=lambda sec, t, layer: f"{t.loc[layer, 'gain']} ({sec.preset})", why=_WHY, layers=on_the_backbone),
)
