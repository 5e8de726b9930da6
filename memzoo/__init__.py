"""memzoo: fast-weight memory layers behind one interface, a hybrid LM backbone, a bench."""

from memzoo.layers.base import MemoryLayer
from memzoo.registry import build_layer, get_layer, layer_names, register_layer

__version__ = "0.1.0"
__all__ = ["MemoryLayer", "build_layer", "get_layer", "layer_names", "register_layer", "__version__"]
