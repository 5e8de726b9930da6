"""What the suites' report modules share (`report.cost`, `report.toys`, ...): the cells' marks, the
family column, the figures' bytes, the table keys. The package's ``__init__`` imports those modules;
they import this one, never the package back."""

from __future__ import annotations

import math
from pathlib import Path

from memzoo.bench.common import processor
from memzoo.bench.schema import layer_order
from memzoo.registry import family_of


def machine(r: dict) -> str:
    """The processor a row was measured on: the GPU's name, else the CPU's."""
    return processor(r["hardware"])


def failing(df, check) -> dict[str, list[str]]:
    """{processor: what fails there} for each processor of a pooled section (``POOLED``) whose own
    rows fail `check` (the suite's controls' validity on that processor's rows); {} where the
    section has rows of one processor, whose check is the section's own."""
    if "machine" not in df or df["machine"].nunique() < 2:
        return {}
    return {m: bad for m, g in df.groupby("machine") if (bad := check(g))}


def one_per_seed(df, cell: list[str]):
    """The latest row of each `cell` (columns) and training seed: where a pooled section holds a seed
    trained on two processors, each training counts once (both stay in results.jsonl and in the
    controls' checks)."""
    if "machine" not in df or df["machine"].nunique() < 2:
        return df
    keys = [c for c in cell if c in df] + ["seed"]
    return with_seed(df).sort_values(["time", "run_id"]).drop_duplicates(keys, keep="last").sort_index()


def keyed(key: str, table):
    """`table` tagged with the key by which the overview finds it (`Section.table`): a title is for readers."""
    table.attrs["table"] = key
    return table


def versus(lo: float, hi: float, ref_lo: float, ref_hi: float) -> str:
    """' ▲' / ' ▼' where the interval [lo, hi] lies wholly above / below [ref_lo, ref_hi] (the
    baseline's), else '': intervals that touch are no difference."""
    return " ▲" if lo > ref_hi else " ▼" if hi < ref_lo else ""


def with_seed(df):
    """The frame with a ``seed`` column (frames made without one: every row seed 0), so that the
    tables can count and aggregate training seeds."""
    return df if "seed" in df else df.assign(seed=0)


def shared_count(values):
    """The count every seed shares (an int: passages, samples, steps), else their range 'lo-hi':
    seeds run with different settings show as such, not as one of them."""
    vals = sorted({int(v) for v in values if not math.isnan(float(v))})
    return vals[0] if len(vals) == 1 else f"{vals[0]}-{vals[-1]}" if vals else float("nan")


def fewer_seeds(k: int, n: int) -> str:
    """' (k of n seeds)' for a cell with fewer seeds than its layer's row, else '': a cell never
    passes for all of a layer's trainings when it holds only some."""
    return f" ({k} of {n} seeds)" if k < n else ""


def with_texts(table, texts: dict):
    """`table` with the cells in `texts` ({(index, column): text}, e.g. a mean with its interval
    over seeds) written in; in a column that gets one, the other numbers are printed as tabulate
    prints a float ('g'), so that a one-seed cell reads as it did in a column of numbers."""
    table = table.copy()
    for col in dict.fromkeys(c for _, c in texts):
        table[col] = [texts[(i, col)] if (i, col) in texts else format(v, "g") if isinstance(v, float) else v
                      for i, v in zip(table.index, table[col])]
    return table


def with_family(table):
    """`table` with a ``family`` column (`memzoo.registry.family_of` each row's layer: "" for the
    baseline and the controls, no registered layers) right after its layer: after
    a ``layer`` column, else first, the layer being the index (a ``layer, corpus`` index: the
    layer's name, then the corpus)."""
    table = table.copy()
    if "layer" in table.columns:
        at, names = table.columns.get_loc("layer") + 1, table["layer"]
    else:
        at, names = 0, table.index
    table.insert(at, "family", [family_of(str(n).split(" ")[0]) for n in names])
    return table


def save_png(fig, path: str | Path) -> Path:
    """Save a matplotlib figure so that the same data gives the same bytes: Agg, fixed dpi, no
    software/date metadata."""
    import matplotlib.pyplot as plt

    from memzoo.storage import save_figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=100, format="png", metadata={"Software": None})
    plt.close(fig)
    return path


def lm_lines(df, over: str) -> list[str]:
    """The LM suites' reading lines on their budget and seeds: the LMs' fixed step budget, and which
    layers have several training seeds (`over`: what a one-seed row's intervals are over)."""
    out = []
    if "metrics.lm_steps" in df and df["metrics.lm_steps"].notna().any():
        steps = sorted({int(v) for v in df["metrics.lm_steps"].dropna()})
        out.append(f"Every LM trained a fixed budget of {' or '.join(map(str, steps))} steps, not to convergence.")
    seeds = df.groupby("layer")["seed"].nunique()
    several = sorted(seeds[seeds > 1].index, key=layer_order(seeds.index).index)
    out.append(f"Training seeds: {', '.join(f'{n} ({seeds[n]})' for n in several)}; every other row one."
               if several else f"Every row is one training seed: its intervals are over {over}, not trainings.")
    return out


def lm_host(r: dict) -> dict | None:
    """The Hugging Face host an LM row's memory was attached to (`ppl.host`: the attach preset), else None:
    the one fact of a row's config its section says (the LMs are not memzoo's backbone)."""
    return ((r.get("config") or {}).get("lm") or {}).get("host")
