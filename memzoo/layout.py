"""Layout strings in the FwPKM paper's notation (Sec. 4.1, Table 2).

    layout   := mixers [ "|" memories ]
    mixers   := MIXER [ "+" MIXER ]            A+B interleaves A:B at 3:1 (B at every 4th layer)
    MIXER    := GDN | SWA | FA | FA-pSWA | NONE (case-insensitive; NONE: no token mixer)
    memories := item { "+" item }
    item     := NAME "@" where | NAME          NAME: any registered MemoryLayer
    where    := "all" | "last" | INT { "," INT }

Layer indices are 0-based: "PKM@2,6,10" in a 12-layer model puts PKM in the 3rd, 7th and
11th blocks, the GDN blocks just before each attention block of "GDN+SWA" (attention
sits at 3, 7, 11 as in Qwen3-Next). A bare NAME uses the layer's `default_where`
(e.g. FWL sits on top of the last layer); layers without one need "@".

Examples: "GDN", "GDN+SWA | PKM@6 + FwPKM@2,10", "FA-pSWA | FwPKM@2,6,10", "SWA | LaCT@all".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MIXERS = ("GDN", "SWA", "FA", "FA-pSWA", "NONE")
_CANON = {m.lower(): m for m in MIXERS}


class LayoutError(ValueError):
    """A malformed layout string; the message names the bad part and the fix."""


@dataclass(frozen=True)
class Layout:
    text: str
    mixers: tuple[str, ...]  # one per layer
    memories: tuple[tuple[str, tuple[int, ...]], ...] = field(default=())  # (layer name, indices)

    def memories_at(self, i: int) -> list[str]:
        return [name for name, where in self.memories if i in where]


def _fail(text: str, msg: str):
    raise LayoutError(f"bad layout {text!r}: {msg}")


def parse_layout(text: str, n_layers: int) -> Layout:
    """Parse a layout string for a model of `n_layers` blocks; raise LayoutError on any fault."""
    from memzoo.registry import get_layer, layer_names

    if not isinstance(text, str) or not text.strip():
        _fail(text, f"empty; expected e.g. 'GDN' or 'GDN+SWA | FwPKM@2,6,10' (mixers: {', '.join(MIXERS)})")
    if text.count("|") > 1:
        _fail(text, "more than one '|'; write 'MIXERS | MEM@i,j + MEM2@k'")
    mix_part, _, mem_part = text.partition("|")

    kinds = [m.strip() for m in mix_part.split("+")]
    if len(kinds) > 2:
        _fail(text, f"{mix_part.strip()!r} names {len(kinds)} mixers; at most two ('A' or 'A+B', 3:1)")
    for k in kinds:
        if not k:
            _fail(text, f"empty token mixer in {mix_part.strip()!r}; valid mixers: {', '.join(MIXERS)}")
        if k.lower() not in _CANON:
            _fail(text, f"unknown token mixer {k!r}; valid mixers: {', '.join(MIXERS)}")
    kinds = [_CANON[k.lower()] for k in kinds]
    if len(kinds) == 2 and kinds[0] == kinds[1]:
        _fail(text, f"'{kinds[0]}+{kinds[1]}' interleaves a mixer with itself; write '{kinds[0]}'")
    # A+B: B at every 4th layer (indices 3, 7, 11, ...), as in Qwen3-Next
    mixers = tuple(kinds[1] if len(kinds) == 2 and i % 4 == 3 else kinds[0] for i in range(n_layers))

    memories: list[tuple[str, tuple[int, ...]]] = []
    if "|" in text:
        if not mem_part.strip():
            _fail(text, "nothing after '|'; name memory layers, e.g. '| FwPKM@2,6,10'")
        seen: dict[int, str] = {}
        for item in mem_part.split("+"):
            item = item.strip()
            m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:@\s*(.*))?", item)
            if not m:
                _fail(text, f"cannot read memory item {item!r}; expected NAME@i,j or NAME@all")
            name, where = m.group(1), m.group(2)
            try:
                cls = get_layer(name)
            except ValueError:
                _fail(text, f"unknown memory layer {name!r}; registered: {', '.join(layer_names())}")
            if where is None:
                where = cls.default_where
                if where is None:
                    _fail(text, f"{item!r} needs positions, e.g. '{name}@2,6,10' or '{name}@all'")
            where = where.strip()
            if where.lower() == "all":
                idx = tuple(range(n_layers))
            elif where.lower() == "last":
                idx = (n_layers - 1,)
            else:
                parts = [p.strip() for p in where.split(",")]
                if not all(re.fullmatch(r"\d+", p) for p in parts):
                    _fail(text, f"positions {where!r} of {name!r} must be 'all', 'last' or integers like 2,6,10")
                idx = tuple(int(p) for p in parts)
                if len(set(idx)) != len(idx):
                    _fail(text, f"positions {where!r} of {name!r} repeat a layer")
                bad = [i for i in idx if i >= n_layers]
                if bad:
                    _fail(text, f"{name}@{bad[0]} is out of range for {n_layers} layers (indices are 0..{n_layers - 1})")
            if cls.site == "ffn":  # two FFN replacements cannot share a block
                for i in idx:
                    if i in seen:
                        _fail(text, f"{name} and {seen[i]} both replace the FFN of layer {i}")
                    seen[i] = name
            memories.append((cls.name, idx))
    return Layout(text=text, mixers=mixers, memories=tuple(memories))
