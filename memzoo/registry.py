"""Name -> MemoryLayer class. A user's own layer becomes usable by name with one decorator.

    from memzoo import MemoryLayer, register_layer

    @register_layer("mylayer")
    class MyLayer(MemoryLayer):
        ...

    HybridLM.from_layout("GDN | mylayer@2,6")

Names are case-insensitive, so the paper's spelling ("FwPKM", "LaCT") works in layout strings.
"""

from __future__ import annotations

_LAYERS: dict[str, type] = {}


def register_layer(name: str):
    """Class decorator: register a MemoryLayer subclass under ``name``."""
    key = name.lower()
    if not key.replace("_", "").isalnum():
        raise ValueError(f"layer name {name!r} must be alphanumeric (underscores allowed)")

    def deco(cls):
        from memzoo.layers.base import MemoryLayer

        if not (isinstance(cls, type) and issubclass(cls, MemoryLayer)):
            raise TypeError(f"@register_layer({name!r}) expects a MemoryLayer subclass, got {cls!r}")
        old = _LAYERS.get(key)
        if old is not None and old.__qualname__ != cls.__qualname__:
            raise ValueError(f"layer name {name!r} is already taken by {old.__module__}.{old.__qualname__}")
        cls.name = key
        _LAYERS[key] = cls
        return cls

    return deco


def _ensure_builtin():
    import memzoo.layers  # noqa: F401  (registers the built-in layers)


def layer_names() -> list[str]:
    _ensure_builtin()
    return sorted(_LAYERS)


def get_layer(name: str) -> type:
    _ensure_builtin()
    try:
        return _LAYERS[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown memory layer {name!r}; registered layers: {', '.join(layer_names())}. "
            "Register your own with @memzoo.register_layer('name')."
        ) from None
