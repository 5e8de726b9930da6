"""Memory layers. Importing this package registers the built-in layers by name."""

from memzoo.layers.base import MemoryLayer, State, build_layer
from memzoo.layers import linear_attention  # noqa: F401  (registers "linear")

__all__ = ["MemoryLayer", "State", "build_layer"]
