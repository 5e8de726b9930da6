"""A rerun of toy cells beside the published rows: does it reproduce them, and what did it cost?

    python -m memzoo.bench.report.reruns leaderboards/reruns/standard-toys-pkm-seeds-100-102 --fresh-seeds
    python -m memzoo.bench.report.reruns RERUN_DIR --published leaderboards/results.jsonl
    python -m memzoo.bench.report.reruns leaderboards/reruns/standard-toys-pkm-seeds-100-102 --fresh-seeds

A rerun is ``memzoo bench --suite toys --out RERUN_DIR`` (with ``--resume``, continued after a
kill): the same preset, configs and seeds as published, measured again, e.g. on another processor
or with faster code. For every (model, task) whose seeds the rerun holds, each slice's published
mean ± 95% t half-width beside the rerun's, and whether the rerun's mean lies inside the published
interval; then seed by seed how many cells came out the same (test accuracy to 3 decimals, steps
and stop). Only rows with the published row's config hash are compared (the tables' rule: the
latest row per setting and seed). A rerun with a fresh seed set (``memzoo bench --seed 100``) is
compared with ``--fresh-seeds``: its seeds' means against the published seeds' intervals, which is
what the seed spread of a published row claims to predict.

Then the ranking, which is what issue 12 found flipping between two processors: per task and width,
every pair of models whose mean test accuracies the published rows separate (disjoint 95% t-intervals
over the seeds both runs hold, the rule of the tables' ▲/▼), and whether the rerun orders the pair
the same way; a flip that the rerun's own intervals also separate contradicts the published table.

Then what the rerun cost: per model, its cells' summed wall time (thread-hours: each worker has
one thread), and per run id (a resumed run has several) its span, from the start of its first cell
(a row's time less its wall time) to its last row. A killed segment also spent the time from its
last row to the kill on a cell it did not finish, which no row records: the spans are lower bounds.

A run in segments pays each group's cold compiles (a model, task and width: the cells that differ
only in the seed compile the same graphs) once per segment whose compile cache lacks them. Rows
that record ``compile_s`` (the first step of each input shape) are also counted as one
uninterrupted run would pay: each group's costliest ``compile_s`` (its cold compile) once, its
cheapest (a start from the cache) for its other cells, and the makespan of the bench's queue on
``--jobs`` workers (every group's first cell first, each cell to whichever worker is free).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from datetime import datetime
from pathlib import Path

from memzoo.bench.common import RESULTS, mean_ci, read_results
from memzoo.bench.schema import layer_order
from memzoo.bench.schema import slice_order


def _key(r: dict) -> tuple:
    return r["preset"], r["layer"], r["setting"]["task"], r["setting"]["d_model"], r["seed"], r["config_hash"]


def latest(rows: list[dict]) -> dict[tuple, dict]:
    """The latest toys row per (preset, layer, task, width, seed, config hash)."""
    out = {}
    for r in rows:
        if r["suite"] == "toys":
            out[_key(r)] = r
    return out


def matched(rerun: list[dict], published: list[dict], fresh: bool = False) -> dict[tuple, tuple[list, list]]:
    """(preset, layer, task, width) -> (published rows, rerun rows) of the published row's config
    hash: the seeds both runs hold, in the same order (a rerun of the published seeds), or with
    `fresh` (a rerun with a fresh seed set) every published seed beside every rerun seed."""
    new, old = latest(rerun), latest(published)
    out = defaultdict(lambda: ([], []))
    if fresh:
        drop_seed = lambda k: k[:4] + k[5:]  # noqa: E731
        hashes = {drop_seed(k) for k in new}
        for k, r in old.items():
            if drop_seed(k) in hashes:
                out[k[:4]][0].append(r)
        for k, r in new.items():
            if k[:4] in out:
                out[k[:4]][1].append(r)
    else:
        for k, r in new.items():
            if k in old:
                out[k[:4]][0].append(old[k])
                out[k[:4]][1].append(r)
    return dict(out)


def compare(rerun: list[dict], published: list[dict], fresh: bool = False) -> tuple[list[dict], dict]:
    """(one dict per (model, task, width, slice): published and rerun mean ± half-width and
    whether the rerun mean is inside, over the seeds of `matched`; counts of identical cells,
    seed by seed, which a fresh seed set has none of)."""
    cells = matched(rerun, published, fresh)
    lines, same = [], {"cells": 0, "same": 0}
    order = layer_order(k[1] for k in cells)
    for (preset, layer, task, width), (olds, news) in sorted(cells.items(), key=lambda kv: (order.index(kv[0][1]), kv[0])):
        for o, n in [] if fresh else zip(olds, news):
            same["cells"] += 1
            same["same"] += (round(o["metrics"]["accuracy"], 3) == round(n["metrics"]["accuracy"], 3)
                             and o["metrics"]["steps"] == n["metrics"]["steps"] and o["metrics"]["stop"] == n["metrics"]["stop"])
        for s in sorted(olds[0]["metrics"]["acc_by_kv"], key=slice_order):
            pm, ph = mean_ci([o["metrics"]["acc_by_kv"][s] for o in olds])
            rm, rh = mean_ci([n["metrics"]["acc_by_kv"][s] for n in news])
            lines.append({"layer": layer, "task": task, "width": width, "slice": s, "seeds": len(news),
                          "published": (pm, ph), "rerun": (rm, rh), "inside": pm - ph - 1e-9 <= rm <= pm + ph + 1e-9})
    return lines, same


def orders(rerun: list[dict], published: list[dict], fresh: bool = False) -> list[dict]:
    """One dict per (task, width, pair of models) that the published rows separate: disjoint 95%
    t-intervals of the mean test accuracy over the seeds of `matched` (at least two). Each says which model the
    published rows put above (``above``, ``below``), the two runs' (mean, half-width) per model, and
    ``same`` (the rerun's means in that order) and ``contradicts`` (the rerun's intervals separate
    the pair the other way)."""
    acc = {(k[2], k[3], k[1]): tuple([r["metrics"]["accuracy"] for r in rows] for rows in v)
           for k, v in matched(rerun, published, fresh).items()}  # (task, width, layer) -> (published, rerun)
    out = []
    for (task, width) in sorted({k[:2] for k in acc}):
        # an interval needs two seeds: a model with one is in no pair (the tables mark none either)
        layers = layer_order(k[2] for k in acc if k[:2] == (task, width) and min(map(len, acc[k])) > 1)
        stats = {m: tuple(mean_ci(v) for v in acc[task, width, m]) for m in layers}
        for i, a in enumerate(layers):
            for b in layers[i + 1:]:
                (pa, ha), (ra, rha) = stats[a]
                (pb, hb), (rb, rhb) = stats[b]
                if pa - ha > pb + hb or pb - hb > pa + ha:
                    hi, lo = (a, b) if pa > pb else (b, a)
                    (_, (rh, rhh)), (_, (rl, rlh)) = stats[hi], stats[lo]
                    out.append({"task": task, "width": width, "above": hi, "below": lo,
                                "published": (stats[hi][0], stats[lo][0]), "rerun": ((rh, rhh), (rl, rlh)),
                                "same": rh > rl, "contradicts": rh + rhh < rl - rlh})
    return out


def cost(rerun: list[dict]) -> tuple[dict[str, float], dict[str, tuple[float, int]]]:
    """(thread-seconds per model; (span in seconds, rows) per run id)."""
    per_model, spans = defaultdict(float), defaultdict(list)
    for r in rerun:
        per_model[r["layer"]] += r["wall_s"]
        end = datetime.strptime(r["time"], "%Y-%m-%dT%H:%M:%SZ").timestamp()
        spans[r["run_id"]].append((end - r["wall_s"], end))
    return dict(per_model), {rid: (max(e for _, e in v) - min(s for s, _ in v), len(v)) for rid, v in spans.items()}


def uninterrupted(rerun: list[dict], jobs: int = 2) -> tuple[float, float, int]:
    """(thread-seconds, makespan in seconds, rows without ``compile_s``) of the rerun's cells as one
    uninterrupted run on `jobs` workers would spend them (module docstring). A row without
    ``compile_s`` (recorded before the field) counts its wall time as it is."""
    rows = sorted(latest(rerun).values(), key=lambda r: r["time"])
    group = lambda r: (r["layer"], r["setting"]["task"], r["setting"]["d_model"])  # noqa: E731
    comp = defaultdict(list)
    for r in rows:
        if "compile_s" in r["metrics"]:
            comp[group(r)].append(r["metrics"]["compile_s"])
    seen, firsts, rest = set(), [], []
    for r in rows:
        (rest if group(r) in seen else firsts).append(r)
        seen.add(group(r))
    first_ids = {id(r) for r in firsts}
    workers, total, lacking = [0.0] * jobs, 0.0, 0
    for r in firsts + rest:
        c = r["metrics"].get("compile_s")
        if c is None:
            lacking += 1
            t = r["wall_s"]
        else:
            t = r["wall_s"] - c + (max(comp[group(r)]) if id(r) in first_ids else min(comp[group(r)]))
        total += t
        workers[workers.index(min(workers))] += t
    return total, max(workers), lacking


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rerun", type=Path, help="the rerun's --out directory (or its results.jsonl)")
    p.add_argument("--published", type=Path, default=Path("leaderboards") / RESULTS)
    p.add_argument("--jobs", type=int, default=2, help="workers of the uninterrupted run counted (default 2)")
    p.add_argument("--fresh-seeds", action="store_true",
                   help="the rerun used other seeds (--seed): compare its seeds with all the published ones")
    a = p.parse_args(argv)
    path = a.rerun / RESULTS if a.rerun.is_dir() else a.rerun
    rerun = [r for r in read_results(path) if r["suite"] == "toys"]
    if not rerun:
        raise SystemExit(f"no toys rows in {path}")
    published = read_results(a.published)
    lines, same = compare(rerun, published, a.fresh_seeds)
    hw = sorted({r["hardware"]["cpu"] for r in rerun})
    print(f"{len(rerun)} rerun rows ({', '.join(hw)}) against {a.published}\n")
    print(f"{'model':15} {'task':5} {'slice':>5}  {'published':>15}  {'rerun':>15}  seeds  inside")
    for ln in lines:
        (pm, ph), (rm, rh) = ln["published"], ln["rerun"]
        print(f"{ln['layer']:15} {ln['task']:5} {ln['slice']:>5}  {pm:.3f} ± {ph:.3f}    {rm:.3f} ± {rh:.3f}    "
              f"{ln['seeds']:>5}  {'yes' if ln['inside'] else 'NO'}")
    inside = sum(ln["inside"] for ln in lines)
    print(f"\nrerun means inside the published interval: {inside} of {len(lines)} slices" + ("" if a.fresh_seeds else
          f"; cells identical (test accuracy to 3 decimals, steps, stop): {same['same']} of {same['cells']}"))
    pairs = orders(rerun, published, a.fresh_seeds)
    over = "each run's own seeds" if a.fresh_seeds else "the seeds both runs hold"
    print(f"\nmodel pairs the published rows separate (disjoint 95% intervals of mean test accuracy, "
          f"over {over}): {len(pairs)}; in the same order in the rerun: "
          f"{sum(p['same'] for p in pairs)}; separated the other way by the rerun: {sum(p['contradicts'] for p in pairs)}")
    for p in pairs:
        if not p["same"]:
            ((ph, _), (pl, _)), ((rh, rhh), (rl, rlh)) = p["published"], p["rerun"]
            print(f"  flipped: {p['task']} d={p['width']}: {p['above']} {ph:.3f} > {p['below']} {pl:.3f} published; "
                  f"rerun {rh:.3f} ± {rhh:.3f} vs {rl:.3f} ± {rlh:.3f}" + ("  (contradicts)" if p["contradicts"] else ""))
    per_model, spans = cost(rerun)
    print("\nthread-hours per model: " + ", ".join(f"{m} {s / 3600:.2f}" for m, s in
                                                  sorted(per_model.items(), key=lambda kv: -kv[1])))
    print(f"in all {sum(per_model.values()) / 3600:.2f} thread-hours")
    for rid, (span, n) in sorted(spans.items()):
        print(f"run {rid}: {n} rows in {span / 3600:.2f} h (first cell's start to last row; a lower bound)")
    total, span, lacking = uninterrupted(rerun, a.jobs)
    print(f"as one uninterrupted run: {total / 3600:.2f} thread-hours, {span / 3600:.2f} h on {a.jobs} workers"
          + (f" ({lacking} rows without compile_s counted at their wall time)" if lacking else ""))


if __name__ == "__main__":
    main()
