"""memzoo: fast-weight memory layers behind one interface, a hybrid LM backbone, a bench.

The names below are imported on first use, so that a part that needs no torch (the bench's
report: `memzoo leaderboard`) imports none."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["MemoryLayer", "attach", "build_layer", "detach", "get_layer", "layer_names", "register_layer", "__version__"]


def __getattr__(name: str):
    if name == "MemoryLayer":
        from memzoo.layers.base import MemoryLayer as value
    elif name == "attach":  # the module, callable: memzoo.attach(model, ...) and memzoo.attach.from_pretrained
        import memzoo.attach as value
    elif name == "detach":
        from memzoo.attach import detach as value
    elif name in ("build_layer", "get_layer", "layer_names", "register_layer"):
        from memzoo import registry

        value = getattr(registry, name)
    else:
        raise AttributeError(f"module 'memzoo' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *__all__])
