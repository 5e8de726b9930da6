"""The bench's suites, registered as layers are: each suite module registers a :class:`Suite` (its
name, its settings, its measure and its plan), and `memzoo bench` looks them up here. A suite's
report half (tables, figures, its overview headlines as data) is its module in
:mod:`memzoo.bench.report`; its name and run order are :data:`memzoo.bench.schema.SUITE_NAMES`,
which the torch-free report reads. Nothing here formats a table.

    Suite(name, settings, run, work, parts=None, uses_lm=False)

`settings`: the dataclass of its preset section (unknown keys are errors); `run(ctx, layers)`:
measure, record and return rows (`ctx.advance` per unit of work); `work(ctx, layer)`: the units of
work `run` does for one layer, for the progress bar; `parts(ctx, layer)`: its run for one layer cut
into independent parts that ``run(ctx, [layer], only=[part])`` measures alone (the toys' cells, which
`memzoo bench` hands to whichever worker is free), each ``(part, cost, group)`` with a relative cost
and the group of parts that compile the same graphs (the same model and shapes, another seed);
`uses_lm`: it evaluates the shared language model of :mod:`memzoo.bench.lm`, trained once per layer.
"""

from __future__ import annotations

from memzoo.bench.registry import SUITES, Suite, get_suite, register_suite  # noqa: F401
from memzoo.bench.schema import SUITE_NAMES as NAMES  # noqa: F401

# the built-in suites, each registering itself (in run order)
from memzoo.bench.suites import cost, pairs, toys, ppl, niah  # noqa: E402,F401
