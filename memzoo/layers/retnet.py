"""RetNet's multi-scale retention (Sun, Dong, Huang, Ma, Xia, Xue, Wang & Wei 2023, "Retentive Network: A
Successor to Transformer for Large Language Models", arXiv 2307.08621) as a memory layer.

Retention's recurrent representation (Sec. 2.1, Eq. 6), per head, in the [K, V] layout:

    S_n = γ S_{n-1} + K_nᵀ V_n                                                 S_n ∈ R^{K×V}
    Retention(X_n) = Q_n S_n                                                   (read: inclusive)

with Q_n = (X_n W_Q) ⊙ Θ_n, K_n = (X_n W_K) ⊙ Θ̄_n (Eq. 5: the position n as a rotation of the
query and key, relative in Q_n K_mᵀ), and a fixed decay per head (Sec. 2.2, "Multi-scale"):

    γ_h = 1 − 2^{−5−h},  h = 0 .. H−1
    Y = GroupNorm_h(Retention_h(X)) per head                                   (Eq. 8)
    MSR(X) = (swish(X W_G) ⊙ Y) W_O

γ never depends on the input (RetNet's decay is not a gate), so the write is the shared op
:mod:`memzoo.ops.linear_attention` with a constant log decay per head (its chunked form is Sec.
2.1's chunkwise recurrent representation).

Where the paper is silent or differs, fla's layer (``fla/layers/multiscale_retention.py``,
``MultiScaleRetention``) decides: the position's rotation Θ is RoPE in the rotate-half convention
(base 10000, over the whole key head; the paper's xPos adds a length-extrapolation scale that fla
leaves out), as ``memzoo.layers.lact.rope``; the query is scaled by 1/√K (fla's ops, and the
retention reference ``fla.ops.retention.naive``); the norm per head is an RMSNorm with a learned
weight (the paper's GroupNorm); no bias anywhere; K = expand_k·D/H and V = expand_v·D/H with the
paper's widths (d and 2d: fla's defaults 1 and 2); no short convolution, no feature map.

The MemoryLayer verbs (``inclusive = True``, token-recurrent): ``write_state`` writes the tokens of
x at the positions n that continue from the state's ``pos``; ``read_state`` reads every query of x
at the position of the last token written (``pos`` − 1), so that writing x_n and then reading it is
the paper's output at n (the property suite's definition); ``forward_state`` is the chunked op. The
state, per sequence: ``S`` [B, H, K, V] and ``pos`` [B], the next position (one integer).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.layers._delta import linear
from memzoo.layers._matrix import MatrixMemory
from memzoo.layers.base import State
from memzoo.layers.lact import rope
from memzoo.modules.norm import rms_norm
from memzoo.modules.precision import compute_dtype
from memzoo.ops.linear_attention import linear_attention, linear_attention_final_state
from memzoo.registration import register_layer


def retention_decays(num_heads: int) -> Tensor:
    """γ_h = 1 − 2^{−5−h}, h = 0 .. H−1 (Sec. 2.2), as log γ_h [H] in fp64."""
    return torch.log1p(-torch.exp2(-5.0 - torch.arange(num_heads, dtype=torch.float64)))


@register_layer("retnet")
class MultiScaleRetention(MatrixMemory):
    """RetNet's multi-scale retention as a memory layer; see the module docstring for the equations.

    Args:
        d_model: model width D.
        num_heads: H heads, each with its own decay γ_h.
        expand_k: key width H·K = expand_k · D (the paper: D).
        expand_v: value width H·V = expand_v · D (the paper: 2D).
        rope_theta: base of the position's rotation Θ.
        norm_eps: eps of the per-head RMSNorm.
    """

    family = "gated_hebbian"
    chunk_size = None
    per_sequence = True
    #: forward writes token n, then reads it (Eq. 6's output reads S_n)
    inclusive: ClassVar[bool] = True
    #: chunk length of the chunked op inside forward (any value is exact)
    parallel_chunk: int = 64
    bench_cost = 1.2

    def __init__(self, d_model: int, num_heads: int = 8, expand_k: float = 1.0, expand_v: float = 2.0,
                 rope_theta: float = 10000.0, norm_eps: float = 1e-5):
        super().__init__(d_model)
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        for name, e in (("expand_k", expand_k), ("expand_v", expand_v)):
            width = e * d_model
            if not (width > 0 and width == int(width) and int(width) % num_heads == 0):
                raise ValueError(f"{name} * d_model = {width} must be a positive integer divisible by num_heads={num_heads}")
        if (expand_k * d_model / num_heads) % 2:
            raise ValueError(f"the key head expand_k * d_model / num_heads = {expand_k * d_model / num_heads} must be "
                             "even (the rotation Θ turns pairs of channels): change expand_k or num_heads")
        if not rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {rope_theta}")
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {norm_eps}")
        self.key_dim, self.value_dim = int(expand_k * d_model), int(expand_v * d_model)
        self.num_heads = num_heads
        self.head_dim, self.head_v_dim = self.key_dim // num_heads, self.value_dim // num_heads
        self.rope_theta, self.eps = float(rope_theta), norm_eps
        self.scale = self.head_dim ** -0.5
        self.q_proj = linear(d_model, self.key_dim)
        self.k_proj = linear(d_model, self.key_dim)
        self.v_proj = linear(d_model, self.value_dim)
        self.g_proj = linear(d_model, self.value_dim)
        self.g_norm_weight = nn.Parameter(torch.ones(self.head_v_dim))
        self.o_proj = linear(self.value_dim, d_model)
        self.register_buffer("log_gamma", retention_decays(num_heads), persistent=False)

    # ---- the slow projections ------------------------------------------------------------------
    def cdtype(self) -> torch.dtype:
        return compute_dtype(self.o_proj.weight)

    def rotate(self, u: Tensor, pos: Tensor) -> Tensor:
        """(X W) ⊙ Θ at positions pos [B, T]: [B, T, H·K] -> [B, T, H, K]."""
        u = rope(u.to(self.cdtype()), pos, self.head_dim, self.rope_theta)
        return u.unflatten(-1, (self.num_heads, self.head_dim))

    def positions(self, x: Tensor, state: State) -> Tensor:
        """The positions n of x's tokens, continuing from the state: [B, T]."""
        return state["pos"][:, None] + torch.arange(x.shape[1], device=x.device)

    def keys_values(self, x: Tensor, state: State) -> tuple[Tensor, Tensor, Tensor]:
        """K_n = (x W_K) ⊙ Θ̄_n [B, T, H, K], V_n [B, T, H, V], log γ [B, T, H]."""
        k = self.rotate(self.k_proj(x), self.positions(x, state))
        v = self.v_proj(x).to(k.dtype).unflatten(-1, (self.num_heads, self.head_v_dim))
        return k, v, self.log_gamma.to(k.dtype).expand(*x.shape[:2], self.num_heads)

    def output(self, o: Tensor, x: Tensor) -> Tensor:
        """MSR = W_O (swish(x W_G) ⊙ RMSNorm(o)) per head: o [B, T, H, V]."""
        o = rms_norm(o, self.g_norm_weight, self.eps)
        g = F.silu(self.g_proj(x).to(o.dtype)).unflatten(-1, (self.num_heads, self.head_v_dim))
        return self.o_proj((g * o).flatten(-2).to(x.dtype))

    # ---- state and verbs -----------------------------------------------------------------------
    def init_state(self, batch_size: int) -> State:
        dev = self.o_proj.weight.device
        return {"S": torch.zeros(batch_size, self.num_heads, self.head_dim, self.head_v_dim, dtype=self.cdtype(),
                                 device=dev),
                "pos": torch.zeros(batch_size, dtype=torch.long, device=dev)}

    def read_state(self, x: Tensor, state: State) -> Tensor:
        """o = ((x W_Q) ⊙ Θ_{pos−1}) S / √K for every token of x, at the last written position; no write."""
        S = state["S"]
        at = (state["pos"] - 1)[:, None].expand(-1, x.shape[1])
        q = self.scale * self.rotate(self.q_proj(x), at).to(S.dtype)
        return self.output(torch.einsum("bthk,bhkv->bthv", q, S), x)

    def write_state(self, x: Tensor, state: State) -> State:
        """S ← γ S + K_nᵀ V_n for every token of x, at its position n (Eq. 6)."""
        S = linear_attention_final_state(*self.keys_values(x, state), state["S"])
        return {"S": S, "pos": state["pos"] + x.shape[1]}

    def forward_state(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        k, v, log_gamma = self.keys_values(x, state)
        q = self.scale * self.rotate(self.q_proj(x), self.positions(x, state))
        o, S = linear_attention(q, k, v, log_gamma, state["S"], chunk_size=self.parallel_chunk)
        return self.output(o, x), {"S": S, "pos": state["pos"] + x.shape[1]}

    # ---- the pairs adapter (bench/suites/pairs.py) -----------------------------------------------
    # Neutral: no decay (γ = 1), the raw read Sᵀk; keys rotated at the positions a write from the
    # initial state gives them (0, 1, ...), as `pair_inputs` returns them.
    no_pairs: ClassVar[str | None] = None

    def pair_inputs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.keys_values(x, self.init_state(x.shape[0]))[:2]

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """S ← γ S + k vᵀ a pair at a time (the layer's op); γ_h with x, else 1."""
        S = self.state["S"]
        log_gamma = self.log_gamma.to(S.dtype).expand(*k.shape[:3]) if x is not None else None
        S = linear_attention_final_state(k.to(S.dtype), v.to(S.dtype), log_gamma, S)
        self.load_state({"S": S, "pos": self.state["pos"] + k.shape[1]})

    # ---- diagnostics ---------------------------------------------------------------------------
    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"head_v_dim={self.head_v_dim}, gammas={[round(math.exp(g), 6) for g in self.log_gamma.tolist()]}")
