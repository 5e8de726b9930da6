"""The learning rate of a toys cell, chosen on validation; one chosen at an edge of the lrs tried tries the
next beyond it (protocol step 3)."""

from __future__ import annotations

import functools
import statistics
from collections import Counter


def lr_grid(trainings: dict) -> tuple[float, bool]:
    """(the lr chosen on validation, whether it lies at an edge of the lrs tried): the best
    validation score (ties: the first tried); an edge is the smallest or largest lr tried."""
    lr = max(trainings, key=lambda k: trainings[k].val)
    return lr, lr in (min(trainings), max(trainings))


def past_edge(lr: float, trainings: dict) -> float:
    """The next lr past the edge `lr` of the grid: a third of the smallest, or three times the largest."""
    return round(lr / 3 if lr == min(trainings) else lr * 3, 12)


def at_chance(trainings: dict, chance: float) -> bool:
    """Whether no lr tried left chance (its best validation score within twice chance)."""
    return all(t.val <= 2 * chance for t in trainings.values())


#: how many lrs past an edge a cell tries before it records its choice at the edge
MAX_BEYOND = 2


def search(lrs: list[float], train_at, chance: float) -> dict:
    """{lr: Training} of the lrs a cell trains, `train_at(lr)` training one: every lr of the grid; if none
    left chance, one past each edge (the lr that trains within the budget may lie outside the
    grid); then, while the chosen lr lies at an edge of the lrs tried and left chance, the next lr
    past it, at most MAX_BEYOND times (a better one may lie beyond it). One lr given is a choice,
    not a grid: it is never extended."""
    trainings = {lr: train_at(lr) for lr in lrs}
    if len(trainings) > 1 and at_chance(trainings, chance):
        for nxt in [past_edge(min(trainings), trainings), past_edge(max(trainings), trainings)]:
            trainings[nxt] = train_at(nxt)
    lr, edge = lr_grid(trainings)
    extra = 0
    while edge and len(trainings) > 1 and trainings[lr].val > 2 * chance and extra < MAX_BEYOND:
        nxt = past_edge(lr, trainings)
        trainings[nxt] = train_at(nxt)
        extra += 1
        lr, edge = lr_grid(trainings)
    return trainings


def around(lr: float) -> list[float]:
    """A short grid centred on `lr`: a third of it, it, three times it (the state sweep's, whose
    smaller states want smaller lrs: docs/suites/toys.md, "The state sweep")."""
    return [float(f"{lr / 3:.6g}"), lr, float(f"{lr * 3:.6g}")]


@functools.cache
def published_choice(preset: str, model: str) -> float | None:
    """The lr the published rows of `preset` chose for `model` (toys): the median over seeds of the
    latest row of each seed that chose one (left chance at some lr); None if none did. Read from the
    checkout's leaderboards/results.jsonl, so that a commit fixes the choice and the cell hashes."""
    from memzoo.bench.common import published_rows, read_results

    path = published_rows()
    latest: dict = {}
    for r in read_results(path) if path else []:
        if r["suite"] == "toys" and r["preset"] == preset and r["layer"] == model:
            latest[r["seed"]] = r  # rows are in time order: the last of a seed is its latest
    chosen = sorted(r["metrics"]["lr"] for r in latest.values() if r["metrics"].get("lr_chosen", True)
                    and r["metrics"].get("stop") != "diverged" and r["metrics"].get("accuracy", 0) > 2 * r["metrics"]["chance"])
    return statistics.median_low(chosen) if chosen else None


@functools.cache
def most_chosen(preset: str) -> float | None:
    """The lr `preset`'s published rows chose (`published_choice`) for the most models, ties to the
    smaller; None if they chose none: the lr of a model that has no choice of its own there."""
    from memzoo.bench.common import published_rows, read_results

    path = published_rows()
    models = sorted({r["layer"] for r in (read_results(path) if path else []) if r["suite"] == "toys" and r["preset"] == preset})
    counts = Counter(lr for m in models if (lr := published_choice(preset, m)) is not None)
    return min(counts, key=lambda lr: (-counts[lr], lr)) if counts else None
