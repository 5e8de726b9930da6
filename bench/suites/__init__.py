"""The bench's suites: the one list that the preset sections, `memzoo bench` and the report
all read. A suite measures; its rows are rendered by its half in :mod:`memzoo.bench.report`.

Each suite is a module here with

    NAME                      its name (the preset section holding its settings)
    Settings                  a dataclass of those settings (unknown keys are errors)
    run(ctx, layers)          measure, record and return rows (`ctx.advance` per unit of work)
    work(ctx, layer)          the units of work `run` does for one layer, for the progress bar

and optionally ``USES_LM`` (it evaluates the shared language model of :mod:`memzoo.bench.lm`,
trained once per layer) and ``parts(ctx, layer)`` (its run for one layer cut into independent
parts that ``run(ctx, [layer], only=[part])`` measures alone: the toys' cells, which `memzoo
bench` hands to whichever worker is free; each as ``(part, cost, group)``, with a relative cost
and the group of parts that compile the same graphs: the same model and shapes, another seed).
Nothing here formats a table.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

# run order, cheapest first; ppl and niah share the trained LMs. The leaderboard's order too.
NAMES = ("cost", "pairs", "toys", "ppl", "niah")


def suite(name: str) -> ModuleType:
    """The suite module `name` (imported on first use: suites import the harness)."""
    if name not in NAMES:
        raise ValueError(f"unknown suite {name!r}; valid suites: {', '.join(NAMES)}")
    return importlib.import_module(f"{__name__}.{name}")


def lead(name: str) -> str:
    """The first paragraph of suite `name`'s docstring (what it measures), read from its source
    without importing it: the report renders rows without torch, which the suites import."""
    if name not in NAMES:
        raise ValueError(f"unknown suite {name!r}; valid suites: {', '.join(NAMES)}")
    origin = importlib.util.find_spec(f"{__name__}.{name}").origin
    return (ast.get_docstring(ast.parse(Path(origin).read_text())) or "").strip().split("\n\n")[0]
