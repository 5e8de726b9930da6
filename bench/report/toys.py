"""The toys suite's report: its rows -> tables, figures and the reading note."""

from __future__ import annotations

from pathlib import Path
from memzoo.bench.common import BASELINE, CONTROLS, NEGATIVE, POSITIVE, logit_ci
from memzoo.bench.report.common import failing, keyed, layer_order, one_per_seed, save_png, with_family
from memzoo.bench.report.overview import Headline
from memzoo.bench.schema import TOYS_TASKS as TASKS
from memzoo.bench.schema import RECALL_REACH, slice_order

NAME = "toys"

#: accuracy tables pool processor models: rows of one preset, protocol and config measure the same
#: cell wherever they ran (each names its processor); the controls must hold on each (`withheld`)
POOLED = True

#: the state sweep, and the preset whose cells are its top size: its section shows them
STATE, STATE_OF = "recall-state", "recall"
#: preset -> the presets whose cells its section shows: each shipped preset's `toys.reuse` (a test checks)
BORROWS = {STATE: (STATE_OF,), "recall-state-10x": ("recall-10x-seeds",)}
#: what identifies a cell of the tables (with its seed): `one_per_seed`
CELL = ["layer", "setting.task", "setting.d_model", "setting.route"]
#: the figure the overview opens with (above its table): recall against state, the question it ranks by
LEAD_FIGURES = ("toys_mqar_state",)

NOTE = """Accuracy is on the labelled positions of the test sets (MQAR: every query; Ba's task: the answer
after the query): the seeds' mean with the 95% interval of their logits [lo, hi], which stays within
0-1; seeds that split into two clusters (some solved, some at chance) are shown as the two ("2/3 at a,
1 at b"), not as one interval. ▲ / ▼: the layer's interval lies wholly above / below the baseline's
(never for a layer with a capped seed, whose value its budget may have set). Each training ran until validation accuracy
reached the target or stopped improving (*stop*: solved / plateau / chance / capped; a capped cell did not
converge; *chance*: stopped at chance, a statement about the budget), with the learning rate chosen
on the validation sets ("(edge)": chosen at the edge of the lrs tried; "none": at chance at every lr).
*Left chance at*: the sequences trained before validation accuracy first rose above twice chance
(the median over the seeds that did); *half right at*: before it first reached 0.5 (a dense memory's
plateau at 1/n of the pairs, a bag of the sequence's values, is above twice chance but below a half);
*budget*: the sequences the chosen lr trained (median, max).
A layer at chance is at chance through its budget, not at chance as a property: the learning curves
show where each training stood, and the recall-10x preset retrains the negative rows of the recall
preset at ten times its budget. ctrl:attention is the positive
control (attention with a short convolution), ctrl:none the negative one (no token mixer).
State: numbers one sequence carries (GDN matrices, the memory's fast weights, attention's KV
cache); a memory shared by the batch (FwPKM as the paper trains it) is counted whole."""


# ---- what a short budget can show ------------------------------------------------------------

#: the preset that checks the recall preset's negative rows at ten times its budget, and the one
#: that trains the layers that left chance there with three seeds, at the lr LONG chose
LONG, LONG_SEEDS = "recall-10x", "recall-10x-seeds"


def notes(rows: list[dict], published: list[dict]) -> list[str]:
    """One line per layer that the run's MQAR rows show at chance in every seed: the budget it was
    at chance through, and the published long-budget verdict on it (the `LONG` preset's row in
    `published`) with how many of the `LONG_SEEDS` preset's seeds left chance at each lr, and their
    mean test accuracy (the layer's own lr, and that of a variant that is the same model at another
    lr), or that none is published yet; a layer without fast weights on the memory-only route is a
    negative control by construction, and says so. A table at a short budget shows the budget, not
    the layer, until a longer training says otherwise."""
    out = []
    mine = [r for r in rows if r["suite"] == NAME and r["setting"].get("task") == "mqar"
            and r["preset"] not in (LONG, LONG_SEEDS)
            and r["layer"] not in CONTROLS and r["layer"] != BASELINE and "sequences" in r["metrics"]]
    long, seeds = {}, {}
    for r in sorted(published, key=lambda r: (r["time"], r["run_id"])):
        if r["suite"] == NAME and r["preset"] == LONG and r["seed"] == 0:
            long[r["layer"]] = r
        if r["suite"] == NAME and r["preset"] == LONG_SEEDS and r["setting"].get("task") == "mqar":
            seeds.setdefault(r["layer"], {})[r["seed"]] = r  # the latest row of each seed
    model = lambda r: r.get("config", {}).get("model")  # noqa: E731
    for layer in sorted({r["layer"] for r in mine}):
        g = [r for r in mine if r["layer"] == layer]
        if any(r["metrics"]["left_chance_at"] is not None for r in g):
            continue
        line = f"{layer}: at chance through {_count(max(r['metrics']['sequences'] for r in g))} sequences here"
        if all(r["setting"].get("route") == "memory" and r["metrics"].get("mem_state") == 0 for r in g):
            out.append(f"{line}; it has no fast weights, so with the memory the only route it is a negative control "
                       "by construction, not a verdict a longer budget could change")
            continue
        ref = long.get(layer)
        if ref is None:
            out.append(f"{line}; no long-budget check of it is published yet ({LONG}: docs/journal/toys.md)")
            continue
        m = ref["metrics"]
        verdict = (f"left chance at {_count(m['left_chance_at'])} sequences (test {m['accuracy']:.3f})"
                   if m["left_chance_at"] is not None else f"at chance through {_count(m['sequences'])} sequences"
                   + (", where its training diverged" if m.get("stop") == "diverged" else ""))
        lrs = ", ".join(m["val_by_lr"])
        where = f"preset {LONG}"
        # the layer's seeds, and those of its variants that are the same model at another lr (`lact/lr3.3e-4`)
        by_lr: dict = {}
        for name, v in seeds.items():
            if name == layer or (name.startswith(layer + "/") and model(ref) is not None
                                 and all(model(r) == model(ref) for r in v.values())):
                for r in v.values():
                    by_lr.setdefault(r["metrics"]["lr"], []).append(r)
        if by_lr:
            parts = [f"{sum(r['metrics']['left_chance_at'] is not None for r in g)} of {len(g)}"
                     + (" seeds left chance" if i == 0 else "") + f" at lr {lr:g}"
                     + f" (test {sum(r['metrics']['accuracy'] for r in g) / len(g):.3f}, their mean)"
                     for i, (lr, g) in enumerate(sorted(by_lr.items(), key=lambda kv: -kv[0]))]
            verdict += "; " + ", ".join(parts)
            where = f"presets {LONG} and {LONG_SEEDS}"
        out.append(f"{line}; at the recall preset's 10x budget (lrs {lrs}): {verdict} (leaderboards/README.md, toys — {where})")
    return out


# ---- rendering -----------------------------------------------------------------------------

ACC = "metrics.acc_by_kv."


def _slices(df) -> list[str]:
    """The acc_by_kv columns that hold a value in df, by length then kv count ("8", or "32@256")."""
    cols = [c for c in df.columns if c.startswith(ACC) and df[c].notna().any()]
    return sorted(cols, key=lambda c: slice_order(c[len(ACC):]))


#: seeds split into two groups this far apart (in accuracy) are shown as two groups, not one interval
SPLIT = 0.4


def _split(vals) -> tuple[list, list] | None:
    """(the low group, the high group) of seeds whose accuracies fall into two clusters with a gap
    wider than SPLIT between them (some seeds solved, some at chance), else None."""
    v = sorted(vals)
    gaps = [(b - a, i) for i, (a, b) in enumerate(zip(v, v[1:]))]
    if len(v) < 2 or max(gaps)[0] <= SPLIT:
        return None
    i = max(gaps)[1]
    return v[: i + 1], v[i + 1:]


def _fmt(vals, ref=None, marked: bool = True) -> str:
    """The seeds' accuracies: 'mean [lo, hi]' with the 95% interval of their logits (it stays within
    0-1), or, where the seeds split into two clusters, 'k/n at a, the rest at b'; ▲/▼ where the
    interval lies wholly above/below `ref`'s (`marked`: not for a layer with capped seeds, whose
    budget, not the layer, may set the value)."""
    if len(vals) == 1:
        return f"{vals[0]:.3f}"
    if (two := _split(vals)) is not None:
        lo, hi = two
        return f"{len(hi)}/{len(vals)} at {sum(hi) / len(hi):.3f}, {len(lo)} at {sum(lo) / len(lo):.3f}"
    m, lo, hi = logit_ci(vals)
    mark = ""
    if marked and ref is not None and len(ref) > 1 and _split(ref) is None:
        _, rlo, rhi = logit_ci(ref)
        mark = " ▲" if lo > rhi else " ▼" if hi < rlo else ""
    return f"{m:.3f} [{lo:.3f}, {hi:.3f}]{mark}"


def validity(df, task: str) -> list[str]:
    """What makes the harness invalid for `task` (empty: valid): the positive control below the
    target on the easiest slice in some seed, or the negative control above twice chance; with the
    memory the only route (``route: memory``), also any model without fast weights (the backbone
    alone, PKM) above twice chance on some slice: a negative control by construction."""
    d = df[df["setting.task"] == task]
    out = []
    pos, neg = d[d["layer"] == POSITIVE], d[d["layer"] == NEGATIVE]
    if pos.empty or neg.empty:
        missing = " and ".join(c for c, g in ((POSITIVE, pos), (NEGATIVE, neg)) if g.empty)
        return [f"no rows of {missing} (toys.controls off, or the run stopped before them)"]
    easiest = _slices(d)[0]
    for w, g in pos.groupby("setting.d_model"):
        worst = g[easiest].min()
        if worst < 0.99:
            out.append(f"the positive control reaches only {worst:.3f} at {TITLES[task][1]}={easiest[len(ACC):]}, d={w}")
    for w, g in neg.groupby("setting.d_model"):
        acc, chance = g["metrics.accuracy"].mean(), g["metrics.chance"].iloc[0]
        if acc > 2 * chance:
            out.append(f"the negative control is at {acc:.3f}, above twice chance ({chance:.3f}) at d={w}")
    if "setting.route" in d and (d["setting.route"] == "memory").any():
        slow = d[~d["layer"].isin(CONTROLS) & (d["metrics.mem_state"] == 0)]
        for (layer, w), g in slow.groupby(["layer", "setting.d_model"]):
            chance = g["metrics.chance"].iloc[0]
            for c in _slices(d):
                if g[c].mean() > 2 * chance:
                    out.append(f"{layer}, which has no fast weights, recalls {g[c].mean():.3f} at "
                               f"{TITLES[task][1]}={c[len(ACC):]}, d={w}: above twice chance ({chance:.3f}), so the "
                               f"backbone reaches past the memory")
    return out


def withheld(df) -> tuple:
    """(df without the rows of every processor whose controls fail on it, {task: ["processor: why"]}):
    a pooled table (`POOLED`) asks the controls to be valid on each processor that contributed rows
    (`validity` on that processor's rows, `failing`) and withholds only that processor's rows when they
    are not. With one processor, the section's own check (`validity`) decides, as before. A seed trained
    on two processors counts once (`one_per_seed`: the later training)."""
    keep, out = df.index == df.index, {}
    for task in [t for t in TASKS if "setting.task" in df and t in set(df["setting.task"])]:
        d = df[df["setting.task"] == task]
        for m, bad in failing(d, lambda g: validity(g, task)).items():
            keep &= ~df.index.isin(d[d["machine"] == m].index)
            out.setdefault(task, []).append(f"{m}: {'; '.join(bad)}")
    return one_per_seed(df[keep], CELL), out


def model_of(df) -> dict:
    """layer -> the model it is a size of: a state-sweep row (preset `STATE`) named MODEL/SIZE
    whose MODEL is the longest prefix that names a model of the section's other rows (the top size,
    from `STATE_OF`); every other layer is a model of its own."""
    own = set(df.loc[df["preset"] != STATE, "layer"]) if "preset" in df else set(df["layer"])
    out = {}
    for layer in df["layer"].unique():
        out[layer] = layer
        if layer in own:
            continue
        parts = layer.split("/")
        heads = ["/".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]
        out[layer] = next((h for h in heads if h in own), heads[-1] if heads else layer)
    return out


#: the state at which the state table reads every model's accuracy (log-interpolated between two
#: measured sizes): inside most models' measured ranges
COMMON_STATE = 1024


def _points(m, task_slices) -> dict:
    """model -> [(memory state, seeds' mean accuracy, [accuracies], [largest-slice accuracies], stops, layer,
    budget)] by state, for every model measured at two or more sizes (a size of the sweep, or a width; state > 0)."""
    of = model_of(m)
    largest = task_slices[-1]
    out: dict = {}
    for (layer, _), g in m[m["metrics.mem_state"] > 0].groupby(["layer", "setting.d_model"]):  # a size: a model and width
        accs = list(g["metrics.accuracy"])
        out.setdefault(of[layer], []).append((float(g["metrics.mem_state"].iloc[0]), sum(accs) / len(accs), accs,
                                              list(g[largest].dropna()), list(g["metrics.stop"]), layer,
                                              float(g["metrics.sequences"].max()) if "metrics.sequences" in g else None))
    return {k: sorted(v) for k, v in out.items() if len(v) > 1}


def _at(points, state: float) -> float | None:
    """The seeds' mean accuracy at `state`, log-interpolated between the two measured sizes around it."""
    import math

    for (s0, a0, *_), (s1, a1, *_) in zip(points, points[1:]):
        if s0 <= state <= s1:
            return a0 if s1 == s0 else a0 + (a1 - a0) * (math.log(state) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return None


def state_table(df):
    """The state sweep's table: per model measured at several sizes, its accuracy at each (state
    numbers: mean, and the stops and budget of a point not every seed solved), the smallest measured
    state whose seeds' mean reaches `RECALL_REACH` (or "not
    reached at <= S" with the budget), and its accuracy at `COMMON_STATE`."""
    import pandas as pd

    m = df[df["setting.task"] == "mqar"]
    pts = _points(m, _slices(m))
    recs = []
    for model in layer_order(list(pts)):
        p = pts[model]
        bound = lambda stops: any(s != "solved" for s in stops)  # noqa: E731  (a plateau too: a budget's)
        how = lambda x: ", ".join(f"{x[4].count(k)} {k}" for k in sorted(set(x[4])))  # noqa: E731
        reached = next((x for x in p if x[1] >= RECALL_REACH), None)
        budget = _count(max(x[6] for x in p if x[6] is not None)) if any(x[6] for x in p) else "?"
        at = _at(p, COMMON_STATE)
        recs.append({
            "model": model,
            "sizes (memory state: mean, stops)": "; ".join(
                f"{_count(x[0])}: {x[1]:.3f}" + (f" ({how(x)} through {_count(x[6])})" if bound(x[4]) and x[6] else "")
                for x in p),
            f"smallest state at {RECALL_REACH:g}": (f"{_count(reached[0])}" + (" (budget-bound seeds)" if bound(reached[4]) else "")
                                              if reached else f"not reached at <= {_count(p[-1][0])} (through {budget} sequences)"),
            f"accuracy at {_count(COMMON_STATE)} state": "" if at is None else f"{at:.3f}",
            "span": f"{p[-1][0] / p[0][0]:.0f}x",
        })
    return with_family(pd.DataFrame(recs).rename(columns={"model": "layer"})) if recs else None


def _state_figure(m, path: Path) -> Path | None:
    """toys_mqar_state.png: MQAR test accuracy against the memory's state numbers per sequence (log
    x), a line per model through its sizes with its seeds' 95% interval, a panel per write-rule family;
    top row the mean over the pair counts, bottom row the largest count. A point whose seeds all
    solved is filled; one with a seed capped, on a plateau or at chance is hollow: where the budget,
    not the state, may have set it (a plateau at a small state is "through N sequences", not a capacity). The attention control (its state is a KV cache) is the
    dashed reference line."""
    import matplotlib.pyplot as plt

    from memzoo.registry import family_of

    slices = _slices(m)
    pts = _points(m, slices)
    if not pts:
        return None
    fams = sorted({family_of(k) or "other" for k in pts})
    pos = m[m["layer"] == POSITIVE]
    fig, axes = plt.subplots(2, len(fams), figsize=(3.6 * len(fams) + 1.0, 6.4), sharey=True, sharex=True, squeeze=False)
    for j, fam in enumerate(fams):
        models = [k for k in layer_order(list(pts)) if (family_of(k) or "other") == fam]
        palette = _palette(models)
        for i, (label, idx) in enumerate((("mean over pair counts", 2), (f"{slices[-1][len(ACC):]} pairs", 3))):
            ax = axes[i][j]
            for k in models:
                p = pts[k]
                means, bars = _bars([x[idx] for x in p])
                ax.errorbar([x[0] for x in p], means, yerr=bars, color=palette[k], lw=1.2, capsize=2, label=k)
                for x, y in zip(p, means):
                    bound = any(s != "solved" for s in x[4])  # capped, a plateau or at chance: the budget's
                    ax.scatter([x[0]], [y], s=28, color=palette[k], zorder=3,
                               facecolors="white" if bound else palette[k], linewidths=1.2)
            if not pos.empty:
                ref = pos["metrics.accuracy"].mean() if idx == 2 else pos[slices[-1]].mean()
                ax.axhline(ref, color="black", lw=0.8, ls="--", label=f"{POSITIVE} (KV cache)")
            ax.set_xscale("log")
            ax.set_ylim(0, 1.02)
            if i == 0:
                ax.set_title(fam, fontsize=9)
            if i == 1:
                ax.set_xlabel("memory state per sequence (numbers, log)")
            if j == 0:
                ax.set_ylabel(f"MQAR test accuracy\n({label})")
        axes[0][j].legend(fontsize=6, loc="lower right")
    fig.suptitle("MQAR accuracy against state (hollow: a seed capped, on a plateau or at chance: the budget may have set it)",
                 fontsize=9)
    fig.tight_layout()
    return save_png(fig, path)


def _task_table(df, task: str, slice_name: str):
    import pandas as pd

    d = df[df["setting.task"] == task]
    base = d[d["layer"] == BASELINE]
    recs = []
    for layer in layer_order(d["layer"]):
        for w in sorted(d["setting.d_model"].unique()):
            g = d[(d["layer"] == layer) & (d["setting.d_model"] == w)].sort_values("seed")
            if g.empty:
                continue
            b = base[base["setting.d_model"] == w]
            b = None if layer == BASELINE or b.empty else b
            ref = lambda c: None if b is None else list(b[c].dropna())  # noqa: E731
            rec = {"layer": layer, "d_model": int(w), "seeds": len(g)}
            marked = not (g["metrics.stop"] == "capped").any()  # a capped seed's value is its budget's
            if "preset" in g and d["preset"].nunique() > 1:
                rec["preset"] = g["preset"].iloc[0]
            for c in _slices(d):
                rec[f"{slice_name}={c[len(ACC):]}"] = _fmt(list(g[c].dropna()), ref(c), marked)
            rec["mean"] = _fmt(list(g["metrics.accuracy"]), ref("metrics.accuracy"), marked)
            # seeds whose mean leaves chance (twice chance): a wide interval from seeds that split shows here
            rec["left chance"] = f"{int((g['metrics.accuracy'] > 2 * g['metrics.chance']).sum())}/{len(g)}"
            if "metrics.sequences" in g and g["metrics.sequences"].notna().all():
                rec["left chance at"] = _left_at(g)
                rec["half right at"] = _reached(g, 0.5)
                rec["budget (max)"] = f"{_count(g['metrics.sequences'].median())} ({_count(g['metrics.sequences'].max())})"
            else:  # rows of protocol 2 and before kept no validation history, nor their budget in sequences
                rec["left chance at"] = rec["half right at"] = ""
                rec["budget (max)"] = f"{int(g['metrics.steps'].median())} steps ({int(g['metrics.steps'].max())})"
            stops = g["metrics.stop"].value_counts()
            rec["stop"] = ", ".join(f"{n} {k}" for k, n in sorted(stops.items()))
            rec["lr"] = _lrs(g)
            if "metrics.lr_from" in d:  # rows since the main job cites where its lrs come from
                rec["lr from"] = ", ".join(sorted(set(g["metrics.lr_from"].dropna()))) if "metrics.lr_from" in g else ""
            if "metrics.left_chance_at_by_lr" in g or any(c.startswith("metrics.left_chance_at_by_lr.") for c in g):
                rec["val by lr (left chance at)"] = _by_lr(g)
            rec["state"] = int(g["metrics.state_size"].iloc[0])
            recs.append(rec)
    return pd.DataFrame(recs)


def _count(n) -> str:
    """A number of sequences, short: 640 / 12.8k / 1.28M."""
    n = float(n)
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def _left_at(g) -> str:
    """When a layer's seeds first left chance on validation, in sequences trained (the median of
    those that did, and how many did); a layer that never did is "at chance through" its budget."""
    at = g["metrics.left_chance_at"].dropna() if "metrics.left_chance_at" in g else []
    if len(at) == 0:
        return f"at chance through {_count(g['metrics.sequences'].max())}"
    return _count(at.median()) + ("" if len(at) == len(g) else f" ({len(at)}/{len(g)} seeds)")


def _reached(g, level: float) -> str:
    """When a layer's seeds' validation accuracy (their chosen lr's curve) first reached `level`,
    in sequences trained (the median of those that did, and how many did); a dense memory's 1/n
    plateau (a bag of the sequence's values) is above twice chance but far below a half."""
    at = []
    for hist in g["metrics.history"]:
        if isinstance(hist, list):
            at += [next((h["sequences"] for h in hist if h["val"] >= level), None)]
    hit = sorted(a for a in at if a is not None)
    if not hit:
        return "never" if at else ""
    return _count(hit[len(hit) // 2]) + ("" if len(hit) == len(g) else f" ({len(hit)}/{len(g)} seeds)")


def _lrs(g) -> str:
    """The lrs chosen on validation; "none (at chance)" for a seed at chance at every lr, "(edge)"
    for an lr chosen at the edge of the lrs tried."""
    out = []
    def flag(r, key) -> bool | None:
        v = r.get(key)
        return None if v is None or v != v else bool(v)  # absent, NaN (rows of protocol 2): None

    for _, r in g.iterrows():
        tried = sum(1 for c in g.columns if c.startswith("metrics.val_by_lr.") and r[c] == r[c])  # (not NaN)
        if flag(r, "metrics.lr_chosen") is False:
            out.append("none (at chance)")
        else:
            out.append(f"{r['metrics.lr']:g}" + (" (edge)" if flag(r, "metrics.lr_at_edge") and tried > 1 else ""))
    return ", ".join(sorted(set(out)))


def _by_lr(g) -> str:
    """Each lr tried: its validation accuracy (mean over seeds) and, if it left chance, when (median)."""
    lrs = sorted(float(c[len("metrics.val_by_lr."):]) for c in g.columns
                 if c.startswith("metrics.val_by_lr.") and g[c].notna().any())
    parts = []
    for lr in lrs:
        k = f"{lr:g}"
        val = g[f"metrics.val_by_lr.{k}"].dropna()
        at = g.get(f"metrics.left_chance_at_by_lr.{k}")
        at = at.dropna() if at is not None else []
        parts.append(f"{k}: {val.mean():.3f}" + (f" @ {_count(at.median())}" if len(at) else ""))
    return "; ".join(parts)


TITLES = {"mqar": ("MQAR test accuracy by key-value pairs", "kv"),
          "ar": ("Ba's associative retrieval test accuracy by pairs", "pairs")}
MEMORY_ROUTE = (", the memory the only route (a local backbone; every query lies beyond its reach, so the backbone "
                "alone and PKM are negative controls)")


def incomplete(df) -> tuple:
    """(df without them, {task: ["layer (n of N seeds)", ...]}): the layers and variants of a task
    and width with fewer seeds than the baseline's there (at a width without a baseline, such as
    a narrow variant's: than the task's baseline), such as a cell whose run was stopped between
    seeds (a resumed run adds the rest). A published cell has every seed; the controls stay, since
    the validity of the harness is judged on each of their seeds."""
    keep, out = df.index == df.index, {}
    for (task, w), d in df.groupby(["setting.task", "setting.d_model"]):
        base = d if (d["layer"] == BASELINE).any() else df[df["setting.task"] == task]
        full = base.loc[base["layer"] == BASELINE, "seed"].nunique()
        for layer, g in d.groupby("layer"):
            n = g["seed"].nunique()
            if layer != BASELINE and layer not in CONTROLS and n < full:
                keep &= ~df.index.isin(g.index)
                out.setdefault(task, []).append(f"{layer} ({n} of {full} seeds)")
    return df[keep], {k: sorted(v) for k, v in out.items()}


STATE_TITLE = ("MQAR accuracy against the memory's state (the state sweep: each model at several sizes; the smallest "
               "state whose seeds' mean reaches the level, and the accuracy at a common state)")


def tables(df) -> dict:
    """Per task: test accuracy by slice (mean ± 95% interval over seeds, ▲/▼ against the
    baseline), steps and stops, chosen lr and state size; then the state and parameters per
    model; each row with its layer's write-rule family (`with_family`). A task whose controls fail
    shows the controls only, under a title that says so; a layer with fewer seeds than the
    baseline is left out and named in the title (`incomplete`)."""
    import pandas as pd

    df, gone = withheld(df)
    df, partial = incomplete(df)
    out = {}
    if "preset" in df and STATE in set(df["preset"]) and not validity(df, "mqar"):
        table = state_table(df)
        if table is not None:
            out[STATE_TITLE] = keyed("state", table)
    for task in [t for t in TASKS if t in set(df["setting.task"])]:
        title, sl = TITLES[task]
        d = df[df["setting.task"] == task]
        if "setting.route" in d and (d["setting.route"] == "memory").any():
            title += MEMORY_ROUTE
        t = _task_table(df, task, sl)
        bad = validity(df, task)
        if bad:
            title = f"HARNESS INVALID for {task} ({'; '.join(bad)}): layer rows withheld; the controls"
            t = t[t["layer"].isin(CONTROLS)]
        elif task in partial:
            title += f" (withheld until every seed has run: {', '.join(partial[task])})"
        if task in gone:
            title += f" (withheld, the controls failing there: the rows measured on {'; '.join(gone[task])})"
        out[title] = keyed(task, with_family(t.reset_index(drop=True)))
    first = df.sort_values("seed").groupby(["layer", "setting.task", "setting.d_model"], as_index=False).first()
    first = first[first["setting.task"] == next(t for t in TASKS if t in set(first["setting.task"]))]
    order = {n: i for i, n in enumerate(layer_order(first["layer"]))}
    first = first.assign(_k=first["layer"].map(order)).sort_values(["_k", "setting.d_model"])
    out["Recurrent state per sequence (numbers) and parameters"] = with_family(pd.DataFrame({
        "layer": first["layer"].values,
        "d_model": first["setting.d_model"].astype(int).values,
        "GDN state": first["metrics.gdn_state"].astype(int).values,
        "KV cache": first.get("metrics.kv_cache", pd.Series(0, index=first.index)).fillna(0).astype(int).values,
        "memory state": first["metrics.mem_state"].astype(int).values,
        "total": first["metrics.state_size"].astype(int).values,
        "memory shared by the batch": first["metrics.state_shared"].map(lambda x: "yes" if x else "no").values,
        f"params ({first['setting.task'].iloc[0]})": first["metrics.params"].astype(int).values,
        "train tokens/s": first["metrics.tokens_per_s"].astype(int).values,
    }))
    return out


def _bars(groups) -> tuple[list[float], list[list[float]]]:
    """Means and matplotlib's [below, above] error bars of several groups of seeds' accuracies: the
    interval of their logits (`logit_ci`), which stays within 0-1."""
    stats = [logit_ci(v) for v in groups]
    return [m for m, _, _ in stats], [[m - lo for m, lo, _ in stats], [hi - m for m, _, hi in stats]]


def _palette(order: list[str]) -> dict:
    """A colour per model, none twice up to 20 models: tab10, or past 10 tab20's ten strong hues
    first and then their light pairs (in tab20's own order a model and the next share a hue)."""
    import seaborn as sns

    if len(order) <= 10:
        return dict(zip(order, sns.color_palette("tab10", len(order))))
    c = sns.color_palette("tab20", 20)
    return dict(zip(order, [*c[0::2], *c[1::2]] * (len(order) // 20 + 1)))


def _legend(axes, order: list[str]) -> None:
    """One legend, outside the last panel (no point hidden), naming every model drawn in any panel
    once, in `order`: a model drawn at one width only (``fwl/narrow``) is named too."""
    seen: dict = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, h)
    labels = sorted(seen, key=lambda k: order.index(k) if k in order else len(order))
    axes[-1].legend([seen[k] for k in labels], labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))


def _curves(m, order, palette, widths, path: Path) -> Path:
    """Validation accuracy (the slices' mean) against sequences trained, log x: a line per seed of
    each model (its chosen lr's training), twice chance dotted; a panel per width."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(1, len(widths), figsize=(4.8 * len(widths) + 1.4, 4), sharey=True, squeeze=False)
    for ax, w in zip(axes[0], widths):
        chance = None
        for layer in order:
            g = m[(m["layer"] == layer) & (m["setting.d_model"] == w)].sort_values("seed")
            label = layer
            for _, r in g.iterrows():
                hist = r["metrics.history"]
                if not isinstance(hist, list) or not hist:
                    continue
                ax.plot([h["sequences"] for h in hist], [h["val"] for h in hist], color=palette[layer], lw=1, alpha=0.8,
                        linestyle="--" if layer in CONTROLS else "-", label=label)
                label, chance = None, r["metrics.chance"]
        if chance is not None:
            ax.axhline(2 * chance, color="grey", lw=0.6, ls=":")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))  # 5k, 10k, 20k, ...
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _count(x)))
        ax.xaxis.set_minor_formatter(NullFormatter())  # (matplotlib's own minor labels overlap)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("sequences trained (log scale)")
        ax.set_title(f"MQAR validation, d_model={w}")
    axes[0][0].set_ylabel("validation accuracy (mean over kv; a line per seed)")
    _legend(axes[0], order)
    fig.tight_layout()
    return save_png(fig, path)


def figures(df, out_dir: Path) -> list[Path]:
    """toys_mqar_capacity.png: MQAR test accuracy against kv pairs, a line per model with its
    95% interval (cut at 0 and 1) and a cross per seed, a panel per width. toys_mqar_state.png, first,
    where a model was measured at two sizes or more (the state sweep): `_state_figure`.
    toys_mqar_curves.png: the learning curves (`_curves`), where the rows keep them. A task whose
    controls fail is not drawn, nor a layer with fewer seeds than the baseline, nor the rows of a
    processor whose controls fail on it (`withheld`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = incomplete(withheld(df)[0])[0]
    m = df[df["setting.task"] == "mqar"]
    if m.empty or validity(df, "mqar"):
        return []
    order = layer_order(m["layer"])
    palette = _palette(order)
    widths = sorted(int(w) for w in m["setting.d_model"].unique())
    names = [c[len(ACC):] for c in _slices(m)]
    kvs = [slice_order(n)[1] for n in names]  # x: the pairs (with several lengths, the labels name them)
    paths = []

    fig, axes = plt.subplots(1, len(widths), figsize=(4.8 * len(widths) + 1.4, 4), sharey=True, squeeze=False)
    for ax, w in zip(axes[0], widths):
        for i, layer in enumerate(order):
            g = m[(m["layer"] == layer) & (m["setting.d_model"] == w)]
            if g.empty:
                continue
            xs = [k * 2 ** (0.05 * (i - (len(order) - 1) / 2)) for k in kvs]  # dodged, so that bars do not hide each other
            means, bars = _bars([list(g[f"{ACC}{k}"].dropna()) for k in names])
            ax.errorbar(xs, means, yerr=bars, label=layer, marker="o", capsize=3,
                        color=palette[layer], linestyle="--" if layer in CONTROLS else "-")
            for _, r in g.sort_values("seed").iterrows():  # each seed: erratic seeds make wide intervals
                ax.scatter(xs, [r[f"{ACC}{k}"] for k in names], s=16, marker="x", alpha=0.6, color=palette[layer],
                           linewidths=1)
        ax.axhline(0.5, color="grey", lw=0.6, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(kvs, names)
        ax.minorticks_off()
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("key-value pairs")
        ax.set_title(f"MQAR, d_model={w}")
    axes[0][0].set_ylabel("test accuracy (mean, 95% interval; x: seeds)")
    _legend(axes[0], order)
    fig.tight_layout()
    paths.append(save_png(fig, Path(out_dir) / "toys_mqar_capacity.png"))

    if "metrics.history" in m and m["metrics.history"].notna().any():
        paths.append(_curves(m, order, palette, widths, Path(out_dir) / "toys_mqar_curves.png"))

    state = _state_figure(m, Path(out_dir) / "toys_mqar_state.png")  # a model at two sizes or more
    return ([state] if state else []) + paths


def reading(df, published: list[dict] | None = None) -> list[str]:
    """The reading note's lines computed from the section's rows: how the trainings stopped, and
    which layers' rows are statements about their budget (at chance or capped in every seed). With
    the `published` rows (the leaderboard gives them), a recall-preset section also says, for every
    layer with a seed at chance or capped, whether its long-budget check (`LONG`) is published. A
    layer withheld for want of seeds (`incomplete`) is not read either."""
    df, out = incomplete(withheld(df)[0])[0], []
    stops = df["metrics.stop"].value_counts()
    out.append("Stops: " + ", ".join(f"{n} {k}" for k, n in sorted(stops.items())) + ".")
    if "metrics.sequences" in df:
        short = df[df["metrics.stop"].isin(["chance", "capped"]) & ~df["layer"].isin(CONTROLS)]
        for layer, g in sorted(short.groupby("layer"), key=lambda kv: layer_order(short["layer"]).index(kv[0])):
            if (df["layer"] == layer).sum() == len(g):
                out.append(f"{layer}: every seed stopped {' or '.join(sorted(set(g['metrics.stop'])))} "
                           f"through {_count(g['metrics.sequences'].max())} sequences: a statement about that budget.")
        if published is not None and set(df["preset"]) == {"recall"} and len(short):
            long = {r["layer"] for r in published if r["suite"] == NAME and r["preset"] == LONG}
            mem = short[short["layer"] != BASELINE]  # the baseline is a control by construction here
            for layer, g in sorted(mem.groupby("layer"), key=lambda kv: layer_order(mem["layer"]).index(kv[0])):
                n = int((df["layer"] == layer).sum())
                check = (f"its long-budget check is published ({LONG})" if layer in long
                         else f"no long-budget check of it is published yet ({LONG})")
                out.append(f"{layer}: {len(g)} of {n} seeds stopped {' or '.join(sorted(set(g['metrics.stop'])))} "
                           f"through {_count(g['metrics.sequences'].max())} sequences; {check}.")
    return out


def problems(df) -> list[str]:
    """What makes the harness invalid in this section, task by task (empty: valid)."""
    df = withheld(df)[0]
    return [f"{task}: {p}" for task in TASKS if task in set(df["setting.task"]) for p in validity(df, task)]


def _top_sizes(sec, t) -> dict:
    """{model: its row label in the MQAR table}: each model of the state sweep (not its smaller sizes) at its widest row."""
    import pandas as pd

    mqar = [r for r in sec.rows if r["setting"].get("task") == "mqar"]
    of = model_of(pd.DataFrame([{"layer": r["layer"], "preset": r["preset"]} for r in mqar]))
    out = {}
    for i, rec in t.sort_values("d_model").iterrows():  # a layer's widest row stays
        if of.get(rec["layer"], rec["layer"]) == rec["layer"]:
            out[rec["layer"]] = i
    return out


def _cap(sec) -> str:
    """The sequences a cell of the section may train on (its budget)."""
    mqar = [r for r in sec.rows if r["setting"].get("task") == "mqar"]
    caps = [r["config"]["train"]["max_steps"] * r["config"]["train"]["batch_size"] for r in mqar
            if "max_steps" in r["config"].get("train", {})]
    return _count(max(caps, default=max(r["metrics"].get("sequences", 0) for r in mqar)))


HYBRID = "standard"  # the preset of the toys behind a GDN (the second view), whose headline the overview shows
_WHY_HYBRID = "the published toys behind a GDN: the section with the most seeds, then the latest"


def _hybrid(task: str, name: str) -> Headline:
    """The overview's column of `task` behind a GDN: each layer's seeds' mean at its widest model."""
    def cell(sec, t, layer):
        return t[t["layer"] == layer].sort_values("d_model")["mean"].iloc[-1]
    return Headline(column=f"toys behind a GDN: {name}", table=task, value="mean", rank=("seeds", "time"),
                    preset=HYBRID, why=_WHY_HYBRID, layers=lambda sec, t: list(dict.fromkeys(t["layer"])), text=cell)


_WHY = "one preset, one budget for every layer: the state sweep alone (its top sizes are the recall preset's cells)"
_SMALLEST = f"smallest state at {RECALL_REACH:g}"
HEADLINES = (
    Headline(column="recall: MQAR accuracy", table="mqar", value="mean", rank=(), preset=STATE, why=_WHY,
             layers=lambda sec, t: list(_top_sizes(sec, t)),
             text=lambda sec, t, layer: t.loc[_top_sizes(sec, t)[layer], "mean"]),
    Headline(column="recall: seeds, stops, budget", table="mqar", value="stop", rank=(), preset=STATE, why=_WHY,
             layers=lambda sec, t: list(_top_sizes(sec, t)),
             text=lambda sec, t, layer: (f"{t.loc[_top_sizes(sec, t)[layer], 'left chance']} left chance; "
                                         f"{t.loc[_top_sizes(sec, t)[layer], 'stop']}; cap {_cap(sec)} sequences ({sec.preset})")),
    Headline(column=f"recall: {_SMALLEST}", table="state", value=_SMALLEST, rank=(), preset=STATE, why=_WHY,
             layers=lambda sec, t: list(t["layer"]),
             text=lambda sec, t, layer: t.set_index("layer").loc[layer, _SMALLEST]),
    _hybrid("mqar", "MQAR accuracy"),
    _hybrid("ar", "Ba's AR accuracy"),
)



def summary(df) -> str:
    """One sentence of what a run's MQAR rows show, for the end of its output: the harness's
    validity, then which layers left chance (their mean test accuracy) and which did not (through
    how many sequences: a budget, not a verdict)."""
    d = df[df["setting.task"] == "mqar"] if "setting.task" in df else df.iloc[0:0]
    if d.empty:
        return ""
    bad = validity(df, "mqar")
    if bad:
        return f"recall (MQAR): the harness is INVALID ({'; '.join(bad)}), so no layer is judged"
    left, stayed = [], []
    for layer in layer_order(d["layer"]):
        if layer in CONTROLS or layer == BASELINE:
            continue
        g = d[d["layer"] == layer]
        n = int((g["metrics.accuracy"] > 2 * g["metrics.chance"]).sum())
        if n:
            left.append(f"{layer} {g['metrics.accuracy'].mean():.3f}" + ("" if n == len(g) else f" ({n}/{len(g)} seeds)"))
        else:
            stayed.append(layer)
    route = " with the memory the only route" if (d.get("setting.route") == "memory").any() else ""
    out = f"recall (MQAR{route}; the controls valid): "
    out += (f"left chance: {', '.join(left)}" if left else "no layer left chance")
    if stayed:
        most = _count(d[d["layer"].isin(stayed)]["metrics.sequences"].max())
        out += f"; at chance through {most} sequences (a budget, not a verdict): {', '.join(stayed)}"
    return out
