"""Measure a published row again from its recorded config (`memzoo verify --rerun`).

A suite that can be re-measured row by row says how here: the cost suite's counts (parameters and
both FLOPs counts of one training step, counted on the meta device: deterministic, so they must be
equal), and a toys cell (MQAR) trained again at its recorded lr and seed and scored on the same test
sets (within the interval of its layer's seeds in the file, or 0.01 for a layer of one seed). The
other suites' rows (an LM trained for minutes to hours) are not re-measured here.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

#: the toys' tolerance for a layer with one seed in the file (no interval to stand in for it)
ONE_SEED_TOLERANCE = 0.01


@dataclass
class Agreement:
    total: int = 0
    agree: int = 0
    failures: list = field(default_factory=list)


def estimate_s(row: dict) -> float | None:
    """Roughly how long re-measuring `row` takes (None: this suite's rows are not re-measured)."""
    if row["suite"] == "cost":
        return 1.0 + row["metrics"].get("params", 0) / 1e8
    if row["suite"] == "toys" and row["config"].get("task") == "mqar" and "data" in row["config"] \
            and "lr" in row["metrics"] and "train" in row["config"]:
        return row["wall_s"] / max(1, len(row["metrics"].get("val_by_lr") or [1]))
    return None


def _cost(row: dict) -> list[tuple[str, float, float, float]]:
    from memzoo.bench.suites.cost import Settings, measure
    from memzoo.config import ModelConfig

    cfg = row["config"]
    mc = ModelConfig.from_dict(cfg["model"])
    got = measure(mc, None, Settings(**cfg["settings"]), "cpu", row["seed"], with_time=False)
    return [(k, row["metrics"][k], got[k], 0.0) for k in ("params", "flops_table2", "flops_full") if k in row["metrics"]]


def _toys(row: dict, rows: list[dict]) -> list[tuple[str, float, float, float]]:
    import torch

    from memzoo.bench.common import logit_ci
    from memzoo.bench.suites import toys
    from memzoo.config import ModelConfig

    cfg = row["config"]
    keep = {k: v for k, v in cfg["train"].items() if k in toys.Settings.__dataclass_fields__}
    s = toys.Settings(**toys.MQAR.settings_of(cfg["data"]), **keep)
    task = toys.MQAR(s)
    torch.set_num_threads(max(1, row["hardware"].get("threads") or 1))
    trained = toys.train_cell(ModelConfig.from_dict(cfg["model"]), task, row["metrics"]["lr"], s, row["seed"], "cpu")
    acc = toys.evaluate(trained.model, task.test, task.eval_batch)
    got = sum(acc.values()) / len(acc)
    seeds = [r["metrics"]["accuracy"] for r in rows if r["suite"] == "toys" and r["preset"] == row["preset"]
             and r["layer"] == row["layer"] and r["setting"] == row["setting"]
             and r["hardware"].get("cpu") == row["hardware"].get("cpu") and r["hardware"].get("gpu") == row["hardware"].get("gpu")]
    if len(seeds) > 1:
        m, lo, hi = logit_ci(seeds)
        tol = max(hi - row["metrics"]["accuracy"], row["metrics"]["accuracy"] - lo)
    else:
        tol = ONE_SEED_TOLERANCE
    return [("accuracy", row["metrics"]["accuracy"], round(got, 4), tol)]


def rerun_rows(path: Path, parsed: list[tuple[int, dict]], k: int, lines: list[int] | None, out) -> Agreement:
    """Re-measure the `k` cheapest rows of `parsed` ((line, row) pairs that passed the other
    checks), or those at `lines`; print one line each; the rows that disagree are failures."""
    res = Agreement()
    rows = [r for _, r in parsed]
    if lines:
        chosen = [(i, r) for i, r in parsed if i in set(lines)]
        for i in sorted(set(lines) - {i for i, _ in chosen}):
            res.failures.append(f"{path}:{i}: no row that passed the checks at this line to re-measure")
    else:
        able = sorted(((estimate_s(r), i, r) for i, r in parsed if estimate_s(r) is not None), key=lambda t: (t[0], t[1]))
        chosen = [(i, r) for _, i, r in able[:k]]
    head = _head()
    for i, row in chosen:
        where = f"{path}:{i}"
        if estimate_s(row) is None:
            res.failures.append(f"{where}: a {row['suite']} row is not re-measured by `--rerun` (only cost and toys MQAR rows)")
            continue
        t0 = time.perf_counter()
        got = _cost(row) if row["suite"] == "cost" else _toys(row, rows)
        res.total += 1
        bad = [(name, want, have, tol) for name, want, have, tol in got if abs(have - want) > tol]
        said = ", ".join(f"{name} {want:g} -> {have:g}" + (f" (within {tol:.3g})" if tol else "") for name, want, have, tol in got)
        what = f"{row['suite']} {row['preset']} {row['layer']} seed {row['seed']}"
        if bad:
            older = "" if row["git_sha"].startswith(head) else f"; the row is of commit {row['git_sha'][:12]}, measured " \
                                                                 f"again with {head[:12]} (its protocol may have changed since)"
            res.failures.append(f"{where}: rerun of {what} disagrees: {said}{older}")
        else:
            res.agree += 1
        print(f"memzoo verify: rerun {where} ({what}, {time.perf_counter() - t0:.0f} s): {said}: "
              + ("DISAGREE" if bad else "agree"), file=out)
    return res


def _head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
    except OSError:
        return "?"
