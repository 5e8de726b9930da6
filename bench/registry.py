"""The table of the bench's suites and the decorator-like call that fills it (`register_suite`); a leaf
that imports no suite, so that the suites register into it while :mod:`memzoo.bench.suites` imports
them and :mod:`memzoo.bench.lm` reads the LM suites' settings from it (the import graph has no cycle:
tests/test_imports.py). What a :class:`Suite` holds: :mod:`memzoo.bench.suites`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from memzoo.bench.schema import SUITE_NAMES as NAMES
from memzoo.registration import did_you_mean


@dataclass(frozen=True)
class Suite:
    name: str
    settings: type
    run: Callable
    work: Callable
    parts: Callable | None = None
    uses_lm: bool = False
    recorded: Callable | None = None  # an LM suite's (ctx, model) -> the rows of that model's LM a resumed run skips, or None


SUITES: dict[str, Suite] = {}


def register_suite(suite: Suite) -> Suite:
    """Register `suite` under its name (one of SUITE_NAMES: the preset sections and the report know those)."""
    if suite.name not in NAMES:
        raise ValueError(f"suite {suite.name!r} is not one of {', '.join(NAMES)} (memzoo.bench.schema.SUITE_NAMES)")
    SUITES[suite.name] = suite
    return suite


def get_suite(name: str) -> Suite:
    """The registered suite `name` (the built-in ones register when memzoo.bench.suites is imported);
    an unknown name is one error naming the valid ones."""
    if name in NAMES and name not in SUITES:  # a built-in one, asked for before memzoo.bench.suites ran
        raise ValueError(f"suite {name!r} is not registered yet: import memzoo.bench.suites first (it registers "
                         f"the built-in suites)")
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}{did_you_mean(name, NAMES)}; "
                         f"valid suites: {', '.join(NAMES)}")
    return SUITES[name]

