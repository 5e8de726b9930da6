"""What the suites write into rows and the report reads back, with no torch: the suites' slice and
column names. The suites import them from here, so that the report (`memzoo leaderboard`) renders
from rows without importing torch or the trainer."""

from __future__ import annotations

from memzoo.bench.common import BASELINE, CONTROLS

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
