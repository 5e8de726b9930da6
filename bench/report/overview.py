"""The overview: the leaderboard's first table, one row per layer (and published variant).

Each suite's report module declares what it gives the overview as data, ``HEADLINES``: a
:class:`Headline` per column, naming the table it reads (by the key `keyed` gave it, never by its
title), the table's column, the criteria that rank a section above another (`RANK`) and why. A
layer measured in several sections of a suite (presets, machines) gets the cell of its
highest-ranked one, and the cell links to that section. Nothing is computed here that the
sections' tables do not show: a cell is a table's text, and the page or README beside it says
where it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from memzoo.bench.schema import PAIRS_HELD_AT, RECALL_REACH, layer_order
from memzoo.registry import family_of

NOTE = """\
One row per layer and published variant; each cell is the headline of one section below and links
to it. *recall*: MQAR with the memory the only route, from one preset, the state sweep's
(`recall-state`, whose top sizes are the `recall` preset's cells; one budget for every layer; a layer
without rows there has no recall cell): the seeds' mean accuracy over the slices at the layer's
recall-preset size with its 95% interval (▲/▼: wholly above / below the baseline's), how many seeds
left chance, their stops (a capped or at-chance cell is a statement about that budget), and the
smallest state (memory numbers per sequence) at which its seeds' mean reached the level named. *pairs*:
what the layer's write rule holds without training at its bench size (random keys, neutral gates): the
pairs recalled at 0.9 per 1,000 state numbers (the draws' mean, and of how many numbers). *toys behind a
GDN*: the standard preset's MQAR and Ba's retrieval with the memory beside a GDN backbone (the second
view: what the memory adds to a model that recalls already), the seeds' mean test accuracy. *NIAH*: exact match (%)
after one memorization pass, by haystack length. *PPL*: what carried fast weights are worth in nats
per token (reset − carry) on the first corpus, and the repeated-passage probe's gain (first reading −
second), with their intervals. *cost*: training tokens/s over the baseline's, timed in the same
section, and the parameters. Cells of the toys-behind-a-GDN, NIAH, PPL and cost columns come from the section with the
most seeds (cost: the most layers), a preset other than the tiny one where both exist. An empty
cell: not measured (or withheld by its section's harness check)."""


#: what ranks a section of a suite above another for a layer's cell (`Headline.rank`), from the section,
#: the headline's table and its column
RANK: dict[str, Callable] = {
    "seeds": lambda sec, t, col: len({r["seed"] for r in sec.rows}),    # more trainings behind each number
    "not tiny": lambda sec, t, col: sec.preset != "tiny",               # a published preset over the main job's
    "layers": lambda sec, t, col: int(t[col].notna().sum()),            # one run's comparison of the most layers
    "lengths": lambda sec, t, col: sum(str(c).endswith(" x1") for c in t.columns),  # NIAH: the haystack lengths
    "time": lambda sec, t, col: max(r["time"] for r in sec.rows),       # the latest measurement
}


@dataclass(frozen=True)
class Headline:
    """One overview column a suite fills: the text of `value` in its table `table` per layer
    (`text` formats it; `layers` picks the table's rows, default its index), from the section of the
    suite that ranks first by `rank` (`RANK` criteria, compared in order), because `why`; only
    sections of `preset` where one is named."""

    column: str
    table: str
    value: str
    rank: tuple
    why: str
    text: Callable  # (section, table, layer) -> the cell's text
    layers: Callable | None = None  # (section, table) -> the layers it gives a cell, each a row label of the table
    preset: str = ""

    def cells(self, sec) -> dict:
        """{layer: (rank, text)} of this column in section `sec` ({} where it gives none)."""
        t = sec.table(self.table)
        if (self.preset and sec.preset != self.preset) or t is None or self.value not in t.columns:
            return {}
        rank = tuple(RANK[c](sec, t, self.value) for c in self.rank)
        layers = self.layers(sec, t) if self.layers else list(t.index)
        return {layer: (rank, self.text(sec, t, layer)) for layer in layers}


def headline(sec, headlines) -> dict:
    """{column: {layer: (rank, text)}} of a section: its suite's `headlines` (`HEADLINES`)."""
    return {h.column: cells for h in headlines if (cells := h.cells(sec))}


@dataclass
class Overview:
    table: object  # DataFrame: layer, family, then the suites' columns (texts)
    links: dict  # (layer, column) -> the anchor of the section the cell comes from
    figures: list = field(default_factory=list)  # shown above the table: the sections' lead figures (recall against state)


def overview(secs: list) -> Overview:
    """The overview of the published sections `secs` (:func:`memzoo.bench.report.sections`)."""
    import pandas as pd

    best: dict[tuple[str, str], tuple] = {}  # (layer, column) -> (rank, text, anchor)
    columns: list[str] = []
    for sec in secs:
        if sec.problems:  # a section whose harness check failed shows no layer rows
            continue
        for col, cells in (sec.headline or {}).items():
            if col not in columns:
                columns.append(col)
            for layer, (rank, text) in cells.items():
                old = best.get((layer, col))
                if old is None or rank > old[0]:
                    best[(layer, col)] = (rank, text, sec.anchor)
    order = {c: i for i, c in enumerate(COLUMN_ORDER)}
    columns.sort(key=lambda c: order.get(c, len(order)))
    layers = layer_order({layer for layer, _ in best})
    table = pd.DataFrame({
        "layer": layers,
        "family": [family_of(n) or "" for n in layers],
        **{c: [best[(n, c)][1] if (n, c) in best else "" for n in layers] for c in columns},
    })
    links = {k: v[2] for k, v in best.items()}
    figures = [p for sec in secs if not sec.problems for p in (sec.lead_figures or [])]
    return Overview(table=table, links=links, figures=figures)


#: the columns in the order a reader asks: does it recall, does it find the needle, is it worth it in
#: an LM, what does it cost
COLUMN_ORDER = ("recall: MQAR accuracy", "recall: seeds, stops, budget", f"recall: smallest state at {RECALL_REACH:g}",
                f"pairs: held at {PAIRS_HELD_AT:g} per 1k state (no training)",
                "toys behind a GDN: MQAR accuracy", "toys behind a GDN: Ba's AR accuracy",
                "NIAH: exact match % by length",
                "PPL: carried-state gain (nats)", "PPL: re-reading gain (nats)", "cost: training tokens/s × baseline's")


def markdown(ov: Overview) -> str:
    """The overview as a Markdown table whose cells link to their sections (``#anchor``)."""
    def cell(layer, col, text):
        text = str(text).replace("|", "\\|")
        anchor = ov.links.get((layer, col))
        return f"[{text}](#{anchor})" if anchor and text else text

    cols = list(ov.table.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(":---" for _ in cols) + "|"]
    for _, r in ov.table.iterrows():
        lines.append("| " + " | ".join(cell(r["layer"], c, r[c]) if c not in ("layer", "family") else str(r[c])
                                       for c in cols) + " |")
    return "\n".join(lines)
