"""Memory layers. Importing this package registers every layer defined in it by name:
a new layer is one file here with an @register_layer class (base and fw_io are not layers),
or one file anywhere importable, loaded as a plugin (see memzoo.registry)."""

import importlib
import pkgutil

from memzoo.layers.base import MemoryLayer, State

for _mod in pkgutil.iter_modules(__path__):
    if not _mod.name.startswith("_") and _mod.name not in ("base", "fw_io"):
        importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = ["MemoryLayer", "State"]
