"""What the suites write into rows and the report reads back, with no torch: the suites' slice and
column names. The suites import them from here, so that the report (`memzoo leaderboard`) renders
from rows without importing torch or the trainer."""

from __future__ import annotations

import ast
from pathlib import Path

BASELINE = "baseline"  # the backbone with no memory layer
# The controls, run with the baseline where a suite has them: the positive control is full softmax
# attention in every block with a short convolution on q, k and v (Zoology's attention is
# Hybrid([BaseConv, MHA]) for this reason), the negative one a backbone with no token mixer.
POSITIVE, NEGATIVE = "ctrl:attention", "ctrl:none"
CONTROLS = (POSITIVE, NEGATIVE)

#: the suites, in run order (cheapest first; ppl and niah share the trained LMs), the preset sections
#: holding their settings and the leaderboard's order; each is a module of memzoo.bench.suites
SUITE_NAMES = ("cost", "pairs", "toys", "ppl", "niah")


def lead(name: str) -> str:
    """The first paragraph of suite `name`'s docstring (what it measures), read from its source
    without importing it: the report renders rows without torch, which the suites import."""
    if name not in SUITE_NAMES:
        raise ValueError(f"unknown suite {name!r}; valid suites: {', '.join(SUITE_NAMES)}")
    here = Path(__file__).parent / "suites"
    path = here / f"{name}.py" if (here / f"{name}.py").is_file() else here / name / "__init__.py"
    return (ast.get_docstring(ast.parse(path.read_text())) or "").strip().split("\n\n")[0]

#: the toys suite's tasks: multi-query associative recall, Ba et al.'s associative retrieval
TOYS_TASKS = ("mqar", "ar")

#: the recall level the state table and the overview ask a model's seeds' mean (MQAR accuracy) to reach
RECALL_REACH = 0.9

#: the recall accuracy at which the pairs suite counts n pairs as held by a write rule
PAIRS_HELD_AT = 0.9

#: the ppl suite's evaluations: fast weights carried across a document's sequences, or reset
PPL_MODES = ("carry", "reset")
#: bucket edges (tokens) of the ppl suite's loss by position in a document
PPL_POSITIONS = (0, 256, 1024, 4096, 16384, 65536)


def slice_order(name: str) -> tuple[float, float]:
    """Sort key of a toys slice's name ("8", or "kv@length" with several lengths): by length (one
    length: 0), then kv count or pairs."""
    kv, _, length = name.partition("@")
    return float(length or 0), float(kv)


def layer_order(names) -> list[str]:
    """Layer names for tables and figures: the baseline first, then the layers by name, then
    the controls."""
    return sorted(set(names), key=lambda n: (n != BASELINE, n in CONTROLS, n))
