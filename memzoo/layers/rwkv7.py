"""RWKV-7 "Goose" time mixing (Peng et al. 2025, "RWKV-7 "Goose" with Expressive Dynamic State
Evolution", arXiv 2503.14456, Sec. 4) as a memory layer: its generalised delta rule with a decay
per key channel and an in-context learning rate, without the channel mixing around it.

The state evolves (Eq. 17, in the paper's [V, K] layout; memzoo keeps S in [K, V], its transpose):

    S_t = S_{t-1} (Diag(w_t) − κ̂_tᵀ (a_t ⊙ κ̂_t)) + v_tᵀ k̃_t
    p_t = S_t r_t  +  (r_t · (ρ ⊙ k̃_t)) v_t                         Eq. 19-20: the read and its "bonus"
    y_t = W_o (GroupNorm_H(p_t) ⊙ g_t)                             Eq. 21 (a LayerNorm per head)

with, from the token x_t (Sec. 4.1, Eq. 8-16; low-rank MLPs "lora" of one hidden layer):

    r_t = W_r x_t,  k_t = W_k x_t,  v_t = W_v x_t                  receptance (the query), key, value
    w_t = exp(−e^{−1/2} σ(d_t)),  d_t = w0 + W_w↑ tanh(W_w↓ x_t)   decay per key channel, in (0.545, 1)
    a_t = σ(a0 + W_a↑ W_a↓ x_t)                                    in-context learning rate, per channel
    g_t = W_g↑ σ(W_g↓ x_t)                                         output gate
    κ̂_t = L2(k_t ⊙ ξ)  per head                                   removal key (ξ: k_k)
    k̃_t = k_t ⊙ (1 + (a_t − 1) ⊙ α)                                replacement key (α: k_a)

so the state forgets along κ̂ at rate a_t (the delta rule's β, now a vector) and writes v along k̃.
Init: RWKV-7's for its first layer (fla's ``RWKV7Attention`` with layer_idx 0: the decay and
learning-rate biases as the head-periodic "zigzag" plus a ramp over the channels, ξ = 0.71 − ramp/10,
α = 1.02, ρ = −0.04, the loras' down projections at zero and their up projections orthogonal ×0.1,
W_k orthogonal ×0.1, W_o zero).

Where this layer departs from the paper, and why:

- **No token shift.** RWKV-7 mixes each projection's input with the previous token
  (x + (x_{t-1} − x) ⊙ μ). The bonus term reads the token's own k̃_t and v_t, so with a shift a read
  of x_t after its write would need x_{t-1}, a read of a fresh query the last token written: no
  state gives both (memzoo/layers/_delta.py). Every projection is pointwise; the backbone's own
  mixer (a short window in the recall preset, a GDN with its convolutions in the hybrids) mixes
  neighbouring tokens.
- **No value residual.** Layers after the first lerp v with the first layer's value (Eq. 12);
  a memory layer sees no other layer's values, so v is the first layer's own.

The recurrence is the diagonal-plus-low-rank op :mod:`memzoo.ops.dplr_delta_rule` with log decay
gk = log w_t, read vector κ̂_t, write direction −a_t ⊙ κ̂_t, key k̃_t, and scale 1 (as RWKV reads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.layers._delta import DeltaRuleMemory
from memzoo.layers.base import State
from memzoo.ops.dplr_delta_rule import dplr_delta_rule
from memzoo.registration import register_layer

LOG_DECAY_MAX = 0.6065306597126334  # e^{-1/2}: the largest −log w


class LoRA(nn.Module):
    """x -> W↑ act(W↓ x) (+ bias): RWKV-7's low-rank MLPs; W↓ starts at zero, W↑ orthogonal × 0.1."""

    def __init__(self, d_in: int, d_out: int, rank: int, act, bias: bool = True):
        super().__init__()
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=bias)
        self.act = act
        nn.init.zeros_(self.down.weight)
        nn.init.orthogonal_(self.up.weight, gain=0.1)
        if bias:
            nn.init.zeros_(self.up.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.up(self.act(self.down(x)))


def _rank(d_model: int, head_dim: int, mult: float, per_head: bool = True) -> int:
    """RWKV-7's low-rank widths: mult · √D (× head_dim / 64), in multiples of 32, at least 32."""
    f = head_dim / 64 if per_head else 1.0
    return max(32, int(round(mult * d_model ** 0.5 * f / 32) * 32))


@register_layer("rwkv7")
class RWKV7(DeltaRuleMemory):
    """RWKV-7's time mixing as a memory layer; see the module docstring.

    Args:
        d_model: model width D.
        num_heads: H heads.
        head_dim: key size K per head; default D // H.
        expand_v: value size V = expand_v · K.
        decay_rank, a_rank, gate_rank: the low-rank widths of the decay, learning-rate and gate
            MLPs; default RWKV-7's (2.5, 2.5 and 5 × √D in multiples of 32).
        norm_eps: the GroupNorm's eps is head_dim × norm_eps (RWKV-7's 64e-5 at heads of 64).
    """

    def __init__(self, d_model: int, num_heads: int = 4, head_dim: int | None = None, expand_v: float = 1.0,
                 decay_rank: int | None = None, a_rank: int | None = None, gate_rank: int | None = None,
                 norm_eps: float = 1e-5):
        super().__init__(d_model, num_heads, head_dim, expand_v, 0, norm_eps)
        H, K, KD, VD = num_heads, self.head_dim, self.key_dim, self.value_dim
        self.scale = 1.0
        self.k_proj = nn.Linear(d_model, KD, bias=False)
        self.v_proj = nn.Linear(d_model, VD, bias=False)
        self.w_lora = LoRA(d_model, KD, decay_rank or _rank(d_model, K, 2.5), torch.tanh)
        self.a_lora = LoRA(d_model, KD, a_rank or _rank(d_model, K, 2.5), nn.Identity())
        self.g_lora = LoRA(d_model, VD, gate_rank or _rank(d_model, K, 5, per_head=False), torch.sigmoid, bias=False)
        self.k_k = nn.Parameter(torch.empty(KD))
        self.k_a = nn.Parameter(torch.full((KD,), 1.02))
        self.r_k = nn.Parameter(torch.full((H, K), -0.04))
        self.ln_weight = nn.Parameter(torch.ones(VD))
        self.ln_bias = nn.Parameter(torch.zeros(VD))
        with torch.no_grad():  # the first layer's init (module docstring)
            n = torch.arange(KD, dtype=torch.float64)
            ramp = n / (KD - 1) - 0.5 if KD > 1 else n * 0
            zig = ((n % K) - (K - 1) / 2) / ((K - 1) / 2) if K > 1 else n * 0
            zig = zig * zig.abs()
            www = -6 + 6 * (n / (KD - 1) if KD > 1 else n)
            self.w_lora.up.bias.copy_(www + 0.5 + 2.5 * zig)
            self.a_lora.up.bias.copy_(-0.19 + 0.3 * zig + 0.4 * ramp)
            self.k_k.copy_(0.71 - 0.1 * ramp)
            nn.init.orthogonal_(self.q_proj.weight)
            nn.init.orthogonal_(self.k_proj.weight, gain=0.1)
            nn.init.orthogonal_(self.v_proj.weight)
            nn.init.zeros_(self.o_proj.weight)

    def query(self, x: Tensor) -> Tensor:
        """r_t = W_r x_t per head (the receptance; no activation, no norm): [B, T, H, K]."""
        return self.heads(self.q_proj(x).to(self.cdtype()))

    def keys(self, x: Tensor) -> dict[str, Tensor]:
        """The write's vectors of every position: log decay, removal key κ̂, its rate a ⊙ κ̂, the
        replacement key k̃ (all [B, T, H, K]) and v [B, T, H, V]."""
        dt = self.cdtype()
        k = self.heads(self.k_proj(x).to(dt))
        a = torch.sigmoid(self.heads(self.a_lora(x).to(dt)))
        kk = F.normalize(k * self.heads(self.k_k.to(dt)), dim=-1)
        return {
            "gk": -LOG_DECAY_MAX * torch.sigmoid(self.heads(self.w_lora(x).to(dt))),
            "kk": kk, "akk": a * kk,
            "k": k * (1 + (a - 1) * self.heads(self.k_a.to(dt))),
            "v": self.heads(self.v_proj(x).to(dt), self.head_v_dim),
        }

    def scan(self, x: Tensor, state: State, q: Tensor | None, w: dict | None = None) -> tuple[Tensor | None, State]:
        w = self.keys(x) if w is None else w
        o, S = dplr_delta_rule(w["k"] if q is None else q, w["k"], w["v"], w["kk"], -w["akk"], w["gk"], scale=1.0,
                               initial_state=state["S"], output_final_state=True, chunk_size=self.parallel_chunk)
        return (None if q is None else o), {"S": S}

    # ---- the pairs adapter: the pair is what the write stores, v along the replacement key k̃
    no_pairs = None

    def pair_inputs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The replacement keys k̃ [B, T, H, K] and values v [B, T, H, V] `write(x)` stores (as k̃ vᵀ)."""
        w = self.keys(x)
        return w["k"], w["v"]

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """S ← Diag(w) S − (a ⊙ κ̂)(κ̂ᵀ S) + k vᵀ a pair at a time, by `scan` itself (the DPLR delta rule), with
        the pair as (k̃, v). With x: the decay w, removal key κ̂ and rate a the layer computes from x (the
        removal key is not k̃: ``write_pairs(*pair_inputs(x), x)`` is ``write(x)``). Without: no decay (w = 1),
        removal key κ̂ = k at rate a = 1 (the DPLR op's a = k, b = −k): S ← (I − k kᵀ) S + k vᵀ, the delta
        rule at β = 1 (Yang et al. 2024, arXiv 2406.06484, Eq. 1-2)."""
        S = self.state["S"]
        k, v = k.to(S.dtype), v.to(S.dtype)
        if x is None:
            w = {"gk": torch.zeros_like(k), "kk": k, "akk": k}
        else:
            w = {n: t.to(S.dtype) for n, t in self.keys(x).items() if n in ("gk", "kk", "akk")}
        _, new = self.scan(x, self.state, None, {**w, "k": k, "v": v})
        self.load_state({**self.state, **new})

    def output(self, o: Tensor, x: Tensor, w: dict | None = None) -> Tensor:
        """y = W_o ((GroupNorm(o) + (r · (ρ ⊙ k̃)) v) ⊙ g)."""
        w = self.keys(x) if w is None else w
        o = F.layer_norm(o, o.shape[-1:], eps=self.head_dim * self.eps)
        o = o * self.heads(self.ln_weight.to(o.dtype), self.head_v_dim) + self.heads(self.ln_bias.to(o.dtype), self.head_v_dim)
        r = self.query(x)
        o = o + (r * w["k"] * self.r_k.to(o.dtype)).sum(-1, keepdim=True) * w["v"]
        return self.o_proj((o.flatten(-2) * self.g_lora(x).to(o.dtype)).to(x.dtype))

    def forward_state(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        w = self.keys(x)  # once for the write and the bonus
        o, new = self.scan(x, state, self.query(x), w)
        return self.output(o, x, w), new
