"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2025, "Gated Delta Networks: Improving Mamba2 with
Delta Rule", arXiv 2412.06464) as a memory layer, placed where a memory goes, so that it can sit
behind the recall preset's local backbone like every other memory. The backbone's GDN mixer
(memzoo/backbone/gdn.py) is this class used as a token mixer (its query convolved too).

The delta rule of DeltaNet with a data-dependent decay α_t ∈ (0, 1) per head (Eq. 10, [K, V] layout):

    S_t = α_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ
    o_t = S_tᵀ q_t / √K
    y_t = W_o (RMSNorm(o_t) ⊙ silu(W_g x_t))  per head                     (Sec. 3.3, the output gate)

α_t = exp(g_t), g_t = −exp(A_log) · softplus(W_a x_t + dt_bias), one A_log and dt_bias per head,
initialised as Mamba-2's (A ~ U(1e-4, 16), dt ~ logU(1e-3, 1e-1): the backbone GDN's init);
k, v, β, the short convolutions and the pointwise query as DeltaNet (memzoo/layers/deltanet.py).
(Eq. 10's α multiplies the whole transition; applying it before or after I − βkkᵀ is the same,
since the decay is a scalar.) The recurrence is :mod:`memzoo.ops.gated_delta_rule`, chunked.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor, nn

from memzoo.layers._delta import linear
from memzoo.layers.base import State
from memzoo.layers.deltanet import DeltaNet
from memzoo.modules.gates import gated_log_decay, mamba2_decay_init
from memzoo.modules.norm import gated_rms_norm
from memzoo.ops.gated_delta_rule import gated_delta_rule
from memzoo.registration import register_layer


@register_layer("gated_deltanet")
class GatedDeltaNet(DeltaNet):
    """Gated DeltaNet as a memory layer; see the module docstring. Args as DeltaNet's."""

    backend: ClassVar[str] = "auto"  # the op's dispatch (memzoo/ops/dispatch.py); the backbone's mixer compiles

    def __init__(self, d_model: int, num_heads: int = 4, head_dim: int | None = None, expand_v: float = 1.0,
                 conv_size: int = 4, allow_neg_eigval: bool = False, norm_eps: float = 1e-5):
        super().__init__(d_model, num_heads, head_dim, expand_v, conv_size, allow_neg_eigval, norm_eps)
        self.a_proj = linear(d_model, num_heads)
        A_log, dt_bias = mamba2_decay_init(num_heads)
        self.A_log, self.dt_bias = nn.Parameter(A_log), nn.Parameter(dt_bias)
        self.A_log._no_weight_decay = self.dt_bias._no_weight_decay = True
        self.g_proj = linear(d_model, self.value_dim)

    def log_decay(self, x: Tensor) -> Tensor:
        """g_t = log α_t = −exp(A_log) softplus(W_a x_t + dt_bias): [B, T, H]."""
        a = self.a_proj(x).to(self.cdtype())
        return gated_log_decay(a, self.A_log, self.dt_bias)

    def scan(self, x: Tensor, state: State, q: Tensor | None) -> tuple[Tensor | None, State]:
        new: State = {}
        k, v = self.keys_values(x, state, new)
        o, new["S"] = gated_delta_rule(k if q is None else q, k, v, self.log_decay(x), self.beta(x), scale=self.scale,
                                       initial_state=state["S"], output_final_state=True,
                                       chunk_size=self.parallel_chunk, backend=self.backend)
        return (None if q is None else o), new

    no_pairs = None  # the pairs adapter: neutral β = 1 and no decay (g = 0, α = 1): DeltaNet's delta rule

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """S ← α (I − β k kᵀ) S + β k vᵀ a pair at a time, by the op `scan` runs (the gated delta rule).
        With x: β and the decay g = log α the layer computes from x. Without: β = 1 and g = 0 (α = 1),
        the delta rule of Yang et al. 2024 (arXiv 2406.06484, Eq. 1-2): each pair replaces what its key held."""
        S = self.state["S"]
        if x is None:
            beta, g = k.new_ones(k.shape[:3], dtype=S.dtype), k.new_zeros(k.shape[:3], dtype=S.dtype)
        else:
            beta, g = self.beta(x).to(S.dtype), self.log_decay(x).to(S.dtype)
        k, v = k.to(S.dtype), v.to(S.dtype)
        _, S = gated_delta_rule(k, k, v, g, beta, scale=self.scale, initial_state=S, output_final_state=True,
                                chunk_size=self.parallel_chunk)
        self.load_state({**self.state, "S": S})

    def output(self, o: Tensor, x: Tensor) -> Tensor:
        """y = W_o (RMSNorm(o) ⊙ silu(W_g x)) per head."""
        dt = self.cdtype()
        gate = self.heads(self.g_proj(x).to(dt), self.head_v_dim)
        return self.o_proj(gated_rms_norm(o.to(dt), gate, self.o_norm_weight, self.eps).flatten(-2).to(x.dtype))
