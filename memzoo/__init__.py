"""memzoo: fast-weight memory layers behind one interface, a hybrid LM backbone, a bench.

The names below are imported on first use, so that a part that needs no torch (the bench's
report: `memzoo leaderboard`) imports none."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
__all__ = ["MemoryLayer", "build_layer", "get_layer", "layer_names", "register_layer", "__version__"]

_WHERE = {"MemoryLayer": "memzoo.layers.base", "build_layer": "memzoo.registry", "get_layer": "memzoo.registry",
          "layer_names": "memzoo.registry", "register_layer": "memzoo.registry"}


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'memzoo' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_WHERE])
