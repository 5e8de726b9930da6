"""Name -> MemoryLayer class. A user's own layer becomes usable by name with one decorator.

    from memzoo import MemoryLayer, register_layer

    @register_layer("mylayer")
    class MyLayer(MemoryLayer):
        ...

    HybridLM.from_layout("GDN | mylayer@2,6")

Names are case-insensitive, so the paper's spelling ("FwPKM", "LaCT") works in layout strings.

Plugins: a layer defined outside memzoo is usable by name everywhere (bench, train configs,
layouts) once its module is imported. Name the module in the environment variable
MEMZOO_PLUGINS (comma-separated module names) or with `memzoo --plugin MODULE ...` (which adds
it there); the registry imports them before its first lookup (`load_plugins`), in every process,
so the bench's spawned workers, which inherit the environment, see them too. The module must be
importable: installed, or its folder on PYTHONPATH. For the tests: `pytest -p MODULE` (or
MEMZOO_PLUGINS) runs the shared property suite on its layers (see tests/conftest.py).
"""

from __future__ import annotations

import ast
import functools
import importlib
import os
from pathlib import Path

from memzoo.registration import did_you_mean
from memzoo.registration import LAYERS as _LAYERS
from memzoo.registration import register_layer  # noqa: F401  (`memzoo.register_layer`, as plugins call it)

PLUGINS_ENV = "MEMZOO_PLUGINS"

_PLUGINS: set[str] = set()  # plugin modules imported (or being imported) by load_plugins


class PluginError(ImportError):
    """A plugin module named in MEMZOO_PLUGINS (or by --plugin) could not be imported."""


def plugin_modules() -> list[str]:
    """The module names in MEMZOO_PLUGINS, in order."""
    return [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]


def add_plugin(module: str) -> None:
    """Add `module` to MEMZOO_PLUGINS (so that child processes load it too) and import it."""
    mods = plugin_modules()
    if module not in mods:
        os.environ[PLUGINS_ENV] = ",".join([*mods, module])
    load_plugins()


def load_plugins() -> None:
    """Import every module named in MEMZOO_PLUGINS that is not imported yet (its
    @register_layer classes register themselves); a module that fails is a PluginError naming it."""
    for mod in plugin_modules():
        if mod in _PLUGINS:
            continue
        _PLUGINS.add(mod)  # first: a plugin that looks up layers while importing does not recurse
        try:
            importlib.import_module(mod)
        except Exception as e:
            _PLUGINS.discard(mod)
            if isinstance(e, ModuleNotFoundError) and e.name and (mod + ".").startswith(e.name + "."):
                why = "no such module (a plugin must be importable: installed, or its folder on PYTHONPATH)"
            else:
                why = f"{type(e).__name__}: {' '.join(str(e).split())}"  # one line
            raise PluginError(f"cannot import memzoo plugin {mod!r} (from --plugin or {PLUGINS_ENV}): {why}") from e


def _ensure_loaded():
    import memzoo.layers  # noqa: F401  (registers the built-in layers)

    load_plugins()


def layer_names() -> list[str]:
    _ensure_loaded()
    return sorted(_LAYERS)


def get_layer(name: str) -> type:
    _ensure_loaded()
    try:
        return _LAYERS[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown memory layer {name!r}{did_you_mean(name.lower(), layer_names())}; registered layers: {', '.join(layer_names())}. "
            "Register your own with @memzoo.register_layer('name')."
        ) from None


def family_of(name: str) -> str:
    """The label (memzoo.families.FAMILIES) of the write-rule family of layer `name`, or of a
    variant ``layer/variant`` (named after its layer); "" for a name no layer is registered under (the
    bench's baseline and controls, a layer since removed) and for a layer that names none (a plugin may
    leave it); a plugin's own key outside FAMILIES shows as itself. A built-in layer's family is read
    from its source (`builtin_families`) unless its class is loaded already, so the report needs no torch."""
    from memzoo.families import FAMILIES

    key = name.split("/")[0].lower()
    if key in _LAYERS:
        fam = _LAYERS[key].family
    elif key in builtin_families():
        fam = builtin_families()[key]
    elif plugin_modules():  # a plugin's layer: import it
        try:
            fam = get_layer(key).family
        except ValueError:
            return ""
    else:
        return ""
    return FAMILIES.get(fam, fam)


@functools.cache
def builtin_families() -> dict[str, str]:
    """{name: family key} of the layers in memzoo/layers/, read from their source with `ast`, not
    imported (the layers import torch; the leaderboard does not): the class @register_layer(NAME)
    decorates, its ``family = "..."`` or that of the nearest base class of the folder that sets one
    (DeltaNet's from DeltaRuleMemory). tests/test_imports.py checks it against the imported classes."""
    classes = {}  # class name -> (registered name or None, family or None, base class names)
    for f in sorted((Path(__file__).parent / "layers").glob("*.py")):
        for node in ast.parse(f.read_text()).body:
            if not isinstance(node, ast.ClassDef):
                continue
            reg = next((d.args[0].value for d in node.decorator_list if isinstance(d, ast.Call)
                        and getattr(d.func, "id", "") == "register_layer" and d.args
                        and isinstance(d.args[0], ast.Constant)), None)
            fam = next((st.value.value for st in node.body if isinstance(st, ast.Assign)
                        and any(getattr(t, "id", "") == "family" for t in st.targets)
                        and isinstance(st.value, ast.Constant)), None)
            classes[node.name] = (reg, fam, [b.id for b in node.bases if isinstance(b, ast.Name)])

    def family(cls: str) -> str | None:
        _, fam, bases = classes.get(cls, (None, None, []))
        return fam if fam is not None else next((f for b in bases if (f := family(b)) is not None), None)

    return {reg.lower(): family(c) or "" for c, (reg, _, _) in classes.items() if reg}


def build_layer(name: str, d_model: int, **kwargs) -> "MemoryLayer":
    """Build a registered layer by name; unknown keyword arguments are rejected by name."""
    import inspect

    cls = get_layer(name)
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        allowed = [k for k in params if k not in ("self", "d_model")]
        bad = sorted(set(kwargs) - set(allowed))
        if bad:
            raise ValueError(f"{cls.name}: unknown option(s) {bad}; valid options: {allowed}")
    return cls(d_model, **kwargs)
