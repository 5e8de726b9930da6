"""pairs: what a write rule holds without training: n key-value pairs written with the layer's own
write rule, read back at their keys, across n and across state sizes, for every layer with a pairs
adapter (`MemoryLayer.write_pairs` / `read_keys`; a layer without one says why in `no_pairs`).

A trained recall row answers what a layer learned within a budget; this suite answers the other half
of "which memory holds the most per state number" with no training at all. For each layer and each
state size (the knob that sizes its state, as in the recall-state sweep; `sizes`), for each key
condition (random unit keys per head; correlated keys whose pairwise cosine is about `rho`) and each
gate setting (``neutral``: the write rule at the neutral gates and step sizes the adapter states, β = 1,
no decay, the paper's inner lr; ``init``: the gates the layer's initialisation computes from a random
input), `draws` independent draws of keys and values (a batch of sequences, one draw each) are written
for every n of `ns` up to `max_pairs_per_key` times the key size (heads × key dim, at most `max_pairs`), from a
reset state, and read back at every key. Metrics per n: recall accuracy (the nearest of the n stored
values, by cosine over the heads' values, is the right one) and relative error ‖read − v‖ / ‖v‖, each
over the draws; per draw, the largest n of the grid recalled at ≥ 0.9 ("held"); and that per 1,000
state numbers (the state a sequence carries, counted as the recall tables count it). Everything is
seeded: the same settings give the same rows, exactly.

    memzoo bench --suite pairs --layers all          # every layer with an adapter, a few CPU minutes
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from memzoo.bench.common import BASELINE, CONTROLS, Context
from memzoo.bench.registry import Suite, register_suite
from memzoo.bench.schema import PAIRS_HELD_AT as HELD_AT  # the level at which a rule "holds" n pairs
from memzoo.config import ConfigError

NAME = "pairs"


def _sizes() -> dict:
    """Each layer's state knob, a size a setting of it over the layer's bench options (the first: those
    options, the recall preset's size): >= 64x in state numbers, as recall-state.yaml's knobs reach."""
    heads = [{"head_dim": d} for d in (32, 4, 8, 16, 64)]
    out = {n: heads for n in ("deltanet", "gated_deltanet", "deltaproduct", "kda", "rwkv7", "mom", "ttt_linear",
                              "ttt_mlp", "titans")}
    out["lact"] = [{}] + [{"inter_multi": m} for m in (0.0625, 0.25, 2.0)] + [{"num_heads": 1, "inter_multi": 2.0}]
    out["fwmlp"] = [{}] + [{"intermediate_dim": h} for h in (4, 16, 64)]
    out["fwpkm"] = [{}] + [{"n_subkeys": n} for n in (8, 16, 32, 128)]
    out["linear"] = [{}] + [{"num_heads": 2, "head_dim": d} for d in (2, 4, 8, 32)]  # bench options: 4 heads of 16
    out["mamba2"] = [{}] + [{"d_state": n} for n in (2, 4, 8, 64)]  # bench options: N = 16 keys, 4 heads of P = 32
    out["gla"] = [{}] + [{"expand_k": e} for e in (0.125, 0.25, 1.0, 4.0)]  # bench options: keys D/2 in 4 heads
    out["retnet"] = [{}] + [{"expand_k": e} for e in (0.125, 0.25, 1.0, 4.0)]  # bench options: as GLA's
    out["hgrn2"] = [{}] + [{"expand_ratio": e} for e in (1, 4, 8, 64)]  # bench options: K = 16, H = D / K heads
    # bench options: 4 heads of 16 over m = 8 slots; one head of K = V = 16 over 2 slots at the bottom
    out["gsa"] = [{}] + [{"num_slots": m} for m in (2, 4, 16, 64)] + [
        {"num_heads": 1, "num_slots": 2, "expand_k": 0.25, "expand_v": 0.25}]
    out["loglinear_mamba2"] = [{}] + [{"d_state": n} for n in (1, 2, 8, 16)]  # bench options: N = 4, 2 heads of P = 32
    out["mesanet"] = [{}] + [{"head_dim": d} for d in (2, 4, 8, 32)]  # bench options: 4 heads of K = V = 16
    return out


@dataclass
class Settings:
    d_model: int = 64  # the width the layers are built at (the recall preset's)
    draws: int = 5  # independent draws of keys and values (the intervals are over them)
    conditions: list = field(default_factory=lambda: ["random", "correlated"])
    rho: float = 0.5  # correlated keys: k = normalize(√rho s + √(1 − rho) g), s shared by the draw's keys
    gates: list = field(default_factory=lambda: ["neutral", "init"])
    max_pairs_per_key: int = 4  # n up to this many times the key size (heads × key dim)
    max_pairs: int = 512
    sizes: dict = field(default_factory=_sizes)  # {layer: [options over its bench options, ...]}
    seed: int = 0

    def check(self) -> None:
        for name in ("d_model", "draws", "max_pairs_per_key", "max_pairs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"pairs.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.rho < 1:
            raise ConfigError(f"pairs.rho must be in [0, 1), got {self.rho}")
        for name, valid in (("conditions", ("random", "correlated")), ("gates", ("neutral", "init"))):
            bad = sorted(set(getattr(self, name)) - set(valid))
            if bad or not getattr(self, name):
                raise ConfigError(f"pairs.{name}: unknown or empty {bad or getattr(self, name)}; valid: {', '.join(valid)}")


def grid(key_size: int, s: Settings) -> list[int]:
    """n: 1, 2, 4, ... and the key size's multiples' halves between, up to max_pairs_per_key × key_size."""
    top = min(s.max_pairs_per_key * key_size, s.max_pairs)
    ns = {1, top}
    n = 1
    while n < top:
        ns |= {n, min(top, round(n * 1.5))}
        n *= 2
    return sorted(ns)


def keys_values(B: int, n: int, H: int, K: int, V: int, condition: str, rho: float, g: torch.Generator):
    """Keys [B, n, H, K] of unit length per head (random, or correlated through a shared direction) and
    Gaussian values [B, n, H, V] of unit expected length per head."""
    k = torch.randn(B, n, H, K, generator=g)
    if condition == "correlated":
        shared = torch.randn(B, 1, H, K, generator=g)
        k = math.sqrt(rho) * F.normalize(shared, dim=-1) + math.sqrt(1 - rho) * F.normalize(k, dim=-1)
    v = torch.randn(B, n, H, V, generator=g) / math.sqrt(V)
    return F.normalize(k, dim=-1), v


def scores(read: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per draw: the share of pairs whose nearest stored value (cosine, the heads' values joined) is their
    own, and the mean relative error ‖read − v‖ / ‖v‖."""
    r, t = read.flatten(2).float(), v.flatten(2).float()
    cos = F.normalize(r, dim=-1) @ F.normalize(t, dim=-1).transpose(1, 2)  # [B, n, n]: read i against value j
    acc = (cos.argmax(-1) == torch.arange(r.shape[1])).float().mean(-1)
    err = ((r - t).norm(dim=-1) / t.norm(dim=-1).clamp_min(1e-12)).mean(-1)
    return acc, err


def build(ctx: Context, layer: str, options: dict, s: Settings):
    """The layer at width d_model with the preset's options for it, the toys' options (a memory per
    sequence, chunks of 8) and the size's over them."""
    from memzoo.bench.suites.toys.settings import _toy_layer_options
    from memzoo.registry import build_layer

    spec = ctx.preset.layers.get(layer)
    opts = {**(spec.options if spec else {}), **_toy_layer_options().get(layer, {}), **options}
    return build_layer(layer, s.d_model, **opts), opts


@torch.no_grad()
def measure(layer, s: Settings, condition: str, gates: str, seed: int) -> dict:
    """One (layer, size, condition, gates): the metrics by n (module docstring)."""
    H, K, V = layer.pair_dims()
    g = torch.Generator().manual_seed(seed)
    ns = grid(H * K, s)
    acc_by_n, err_by_n, draws = {}, {}, []
    state = 0
    for n in ns:
        k, v = keys_values(s.draws, n, H, K, V, condition, s.rho, g)
        x = torch.randn(s.draws, n, s.d_model, generator=g) if gates == "init" else None
        layer.reset(s.draws)
        layer.write_pairs(k, v, x)
        acc, err = scores(layer.read_keys(k), v)
        state = layer.fast_weight_numel()
        acc_by_n[str(n)], err_by_n[str(n)] = [round(a, 4) for a in acc.tolist()], [round(e, 4) for e in err.tolist()]
        draws.append(acc)
    held = []
    for d in range(s.draws):  # the largest n recalled at HELD_AT (0: not even one pair)
        held.append(max([n for n, a in zip(ns, draws) if a[d] >= HELD_AT], default=0))
    mean = sum(held) / len(held)
    return {"ns": ns, "acc_by_n": acc_by_n, "err_by_n": err_by_n, "held": held, "held_mean": mean,
            "held_per_1k_state": round(1000 * mean / state, 4) if state else None, "mem_state": state,
            "pair_dims": [H, K, V], "held_at": HELD_AT, "grid_top": ns[-1]}


def adapted(layers: list[str]) -> list[str]:
    """The layers with a pairs adapter (`no_pairs` is None)."""
    from memzoo.registry import get_layer

    return [n for n in layers if n != BASELINE and n not in CONTROLS and get_layer(n).no_pairs is None]


def work(ctx: Context, layer: str) -> int:
    s = ctx.preset.settings(NAME, Settings)
    return len(s.sizes.get(layer, [{}])) * len(s.conditions) * len(s.gates) if adapted([layer]) else 0


def run(ctx: Context, layers: list[str]) -> list[dict]:
    """One row per layer with an adapter, size, key condition and gate setting (the baseline and the
    controls have no memory; a layer without an adapter is named once, with its reason)."""
    from memzoo.registry import get_layer

    s = ctx.preset.settings(NAME, Settings)
    s.check()
    for n in layers:
        if n not in adapted([n]) and n != BASELINE and n not in CONTROLS:
            print(f"pairs: {n}: no adapter ({get_layer(n).no_pairs})")
    rows = []
    for name in adapted(layers):
        for i, size in enumerate(s.sizes.get(name, [{}])):
            torch.manual_seed(s.seed)  # the layer's random init (its "init" gates) is part of the row
            layer, opts = build(ctx, name, size, s)
            layer.eval()
            for condition in s.conditions:
                for gates in s.gates:
                    setting = {"size": ", ".join(f"{k}={v}" for k, v in sorted(size.items())) or "bench options",
                               "condition": condition, "gates": gates, "top": i == 0}
                    config = {"options": opts, "d_model": s.d_model, "draws": s.draws, "rho": s.rho,
                              "max_pairs_per_key": s.max_pairs_per_key, "max_pairs": s.max_pairs, "seed": s.seed,
                              "version": 1}
                    if (done := ctx.recorded(NAME, name, setting, config)) is not None:
                        rows.append(done)
                        ctx.advance(1, f"pairs {name} (recorded)")
                        continue
                    t0 = time.perf_counter()
                    metrics = measure(layer, s, condition, gates, s.seed)
                    rows.append(ctx.record(NAME, name, setting, metrics, config, time.perf_counter() - t0))
                    ctx.advance(1, f"pairs {name} {setting['size']} {condition} {gates}")
    return rows


register_suite(Suite(NAME, Settings, run, work))
