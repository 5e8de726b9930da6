"""Memory layers. Importing this package registers the built-in layers by name."""

from memzoo.layers.base import MemoryLayer, State, build_layer
from memzoo.layers import fwmlp, fwpkm, linear_attention, pkm  # noqa: F401  (registers the built-in layers)

__all__ = ["MemoryLayer", "State", "build_layer"]
