"""The table of registered layers and the decorator that fills it, and every registry's did-you-mean. A leaf that imports
no layer, so that the layer modules register into it while `memzoo.registry`, which looks layers up,
imports them (the lookups load the built-in layers and the plugins first): the import graph has no
cycle (tests/test_imports.py)."""

from __future__ import annotations

import difflib

#: name (lower case) -> MemoryLayer subclass
LAYERS: dict[str, type] = {}


def register_layer(name: str):
    """Class decorator: register a MemoryLayer subclass under ``name``."""
    key = name.lower()
    if not key.replace("_", "").isalnum():
        raise ValueError(f"layer name {name!r} must be alphanumeric (underscores allowed)")

    def deco(cls):
        # a MemoryLayer subclass, read from its bases (importing memzoo.layers here would load every layer)
        if not (isinstance(cls, type) and any(c.__module__ == "memzoo.layers.base" and c.__qualname__ == "MemoryLayer"
                                              for c in cls.__mro__)):
            raise TypeError(f"@register_layer({name!r}) expects a MemoryLayer subclass, got {cls!r}")
        old = LAYERS.get(key)
        if old is not None and old.__qualname__ != cls.__qualname__:
            raise ValueError(f"layer name {name!r} is already taken by {old.__module__}.{old.__qualname__}")
        cls.name = key
        LAYERS[key] = cls
        return cls

    return deco


def did_you_mean(name: str, valid) -> str:
    """' (did you mean 'x'?)' for the closest of `valid` to `name`, or '': the hint of every registry's
    unknown-name error (layers, suites, config keys)."""
    close = difflib.get_close_matches(str(name), list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
