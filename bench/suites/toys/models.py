"""The toys' models: the preset's backbone scaled to a width with the memory in its last block, the
reach of its own mixers (the memory route's check), and the recurrent state one sequence carries."""

from __future__ import annotations

from memzoo.backbone.model import HybridLM
from memzoo.bench.common import BASELINE, CONTROLS, POSITIVE, model_config
from memzoo.config import ConfigError, ModelConfig

from .settings import Settings


def toy_config(preset, layer: str, width: int, vocab_size: int, s: Settings) -> ModelConfig:
    """The preset's backbone (with `s.model` over it) scaled to `width` and `s.n_layers` blocks,
    with `layer` at `s.at` (the toys' placement rule: `Settings.at`) and the preset's options for it,
    `s.layer_options[layer]` merged over them. The controls replace the mixers: attention with a short
    convolution, or none."""
    b = {**preset.backbone, **s.model}
    ref = ModelConfig.from_dict(b)
    scale = width / ref.d_model
    base = {
        **b,
        "vocab_size": vocab_size,
        "d_model": width,
        "n_layers": s.n_layers,
        "ffn_dim": max(1, round(ref.ffn_dim * scale)),
        "gdn_head_dim": s.model.get("gdn_head_dim", max(1, width // ref.gdn_heads)),  # a set head size stays
        "attn_head_dim": max(1, width // ref.attn_heads),
    }
    if layer == BASELINE or layer in CONTROLS:
        return model_config(preset, layer, **base)
    variant = s.variants.get(layer, {})
    layer = variant.get("layer", layer)
    spec = preset.layers.get(layer)
    opts = {**(spec.options if spec else {}), **(s.layer_options.get(layer) or {}), **(variant.get("options") or {})}
    mixers = base.get("layout", "GDN").split("|")[0].strip()
    at = variant.get("at", s.at)
    return ModelConfig.from_dict({**base, "layout": f"{mixers} | {layer}@{at}", "memory": {layer: opts}})


def reach(mc: ModelConfig) -> int | None:
    """How many tokens back the backbone's own mixers carry information, stacked over its blocks
    (None: unbounded): a sliding window of w sees w - 1 tokens back, its short convolution of c
    (``attn_conv``) c - 1 more; a block without a mixer none. Memories are not counted."""
    from memzoo.layout import parse_layout

    total = 0
    for kind in parse_layout(mc.layout, mc.n_layers).mixers:
        if kind == "NONE":
            continue
        if kind != "SWA":
            return None
        total += mc.window - 1 + max(mc.attn_conv - 1, 0)
    return total


def check_route(mc: ModelConfig, layer: str, s: Settings) -> None:
    """With ``route: memory``, every model but the positive control must be unable to carry a
    pair to its query without its memory: the backbone's reach is shorter than the distance
    from the last pair's value to the first query (``mqar_gap`` + 1)."""
    if s.route != "memory" or layer == POSITIVE:
        return
    r = reach(mc)
    if r is None or r > s.mqar_gap:
        raise ConfigError(f"toys.route=memory: the backbone {mc.layout.split('|')[0].strip()!r} of {mc.n_layers} blocks "
                          f"reaches {'every token' if r is None else f'{r} tokens'} back, but a query may lie "
                          f"{s.mqar_gap + 1} tokens after its pair; use local mixers (toys.model: {{layout: SWA, window: w}}) "
                          f"and toys.mqar_gap >= n_layers * (w - 1)")


def state_size(model: HybridLM, seq_len: int) -> dict:
    """Recurrent state of one sequence, in numbers (call after a forward so every memory has
    its state): GDN matrices, memory fast weights, attention's keys and values at `seq_len` (a
    sliding window's: the last `window` tokens' at most)."""
    gdn = sum(b.mixer.num_heads * b.mixer.head_dim * b.mixer.head_v_dim for b in model.blocks if b.kind == "GDN")
    kv = sum(2 * b.mixer.hkv * b.mixer.d * (min(seq_len, b.mixer.window) if b.kind == "SWA" else seq_len)
             for b in model.blocks if b.kind in ("FA", "SWA", "FA-pSWA"))
    mems = model.memories()
    mem = sum(m.fast_weight_numel() for m in mems)
    shared = any(not m.per_sequence and m.fast_weight_numel() > 0 for m in mems)  # (PKM: no fast weights)
    return {"gdn_state": gdn, "kv_cache": kv, "mem_state": mem, "state_size": gdn + kv + mem, "state_shared": shared}



def state_numbers(mc: ModelConfig, seq_len: int) -> int:
    """The memory's state numbers per sequence of a toy model (`state_size`'s ``mem_state``), from a
    forward of two sequences of `seq_len` tokens at its initialisation: what ``--dry-run`` prints."""
    import torch

    model = HybridLM(mc).eval()
    with torch.no_grad():
        model(torch.zeros(2, seq_len, dtype=torch.long))
    return state_size(model, seq_len)["mem_state"]
