"""Kimi Delta Attention (Kimi Team 2025, "Kimi Linear: An Expressive, Efficient Attention
Architecture", arXiv 2510.26692, Sec. 3).

The gated delta rule with a decay per key channel instead of per head (Eq. 1, [K, V] layout):

    S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ          α_t ∈ (0, 1)^K
    o_t = S_tᵀ q_t / √K
    y_t = W_o (RMSNorm(o_t) ⊙ sigmoid(W_g↑ W_g↓ x_t))  per head           (Eq. 4's output gate)

The channel-wise gate (Sec. 3.2, and fla's ``KimiDeltaAttention``): a low-rank projection
f_t = W_f↑ W_f↓ x_t (rank head_v_dim) and log α_t = −exp(A_log) · softplus(f_t + dt_bias), one A_log
per head (A ~ U(1, 16)) and one dt_bias per key channel, initialised as fla's KDA model initialises it
(``KDAPreTrainedModel._init_weights``: Mamba-2's softplus(dt_bias) ~ logU(1e-3, 1e-1); the layer's own
zeros, which the model overwrites, start every channel at α = e^{−A·0.69} ≤ 0.5 a token, a memory that
forgets a pair before its query: at chance in the recall preset at every lr, docs/journal/toys.md). k, v, β, the short convolutions and
the pointwise query are DeltaNet's (memzoo/layers/deltanet.py); the output gate is low-rank too
(rank head_v_dim, with a bias), through a sigmoid.

The recurrence is the diagonal-plus-low-rank op :mod:`memzoo.ops.dplr_delta_rule`: since
k_tᵀ Diag(α_t) S = (α_t ⊙ k_t)ᵀ S, KDA's step is S_t = Diag(α_t) S + b_t (a_tᵀ S) + k'_t v_tᵀ with
a_t = α_t ⊙ k_t, b_t = −β_t k_t and k'_t = β_t k_t.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.layers._delta import linear
from memzoo.layers.base import State
from memzoo.layers.deltanet import DeltaNet
from memzoo.modules.gates import dt_bias_init
from memzoo.modules.norm import rms_norm
from memzoo.ops.dplr_delta_rule import dplr_delta_rule
from memzoo.registration import register_layer


@register_layer("kda")
class KimiDeltaAttention(DeltaNet):
    """Kimi Delta Attention as a memory layer; see the module docstring. Args as DeltaNet's."""

    def __init__(self, d_model: int, num_heads: int = 4, head_dim: int | None = None, expand_v: float = 1.0,
                 conv_size: int = 4, allow_neg_eigval: bool = False, norm_eps: float = 1e-5):
        super().__init__(d_model, num_heads, head_dim, expand_v, conv_size, allow_neg_eigval, norm_eps)
        self.f_proj = nn.Sequential(linear(d_model, self.head_v_dim), linear(self.head_v_dim, self.key_dim))
        self.A_log = nn.Parameter(torch.empty(num_heads).uniform_(1, 16).log())
        self.dt_bias = nn.Parameter(dt_bias_init(self.key_dim))  # as fla's KDA model initialises it
        self.A_log._no_weight_decay = self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Sequential(linear(d_model, self.head_v_dim), linear(self.head_v_dim, self.value_dim, bias=True))

    def log_decay(self, x: Tensor) -> Tensor:
        """log α_t = −exp(A_log) softplus(W_f↑ W_f↓ x_t + dt_bias), per channel: [B, T, H, K]."""
        f = self.heads(self.f_proj(x).to(self.cdtype()) + self.dt_bias.to(self.cdtype()))
        return -self.A_log.to(f.dtype).exp()[:, None] * F.softplus(f)

    def rule(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
        """KDA's step as the DPLR op (module docstring): per-channel log decay g [B, T, H, K], β [B, T, H, 1]."""
        return dplr_delta_rule(q, beta * k, v, g.exp() * k, -beta * k, g, scale=self.scale, initial_state=S,
                               output_final_state=True, chunk_size=self.parallel_chunk)

    def scan(self, x: Tensor, state: State, q: Tensor | None) -> tuple[Tensor | None, State]:
        new: State = {}
        k, v = self.keys_values(x, state, new)
        o, new["S"] = self.rule(k if q is None else q, k, v, self.log_decay(x), self.beta(x)[..., None], state["S"])
        return (None if q is None else o), new

    no_pairs = None  # the pairs adapter: neutral β = 1 and no decay (α = 1 on every channel): the delta rule

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """S ← (I − β k kᵀ) Diag(α) S + β k vᵀ a pair at a time, by `scan`'s op (the DPLR delta rule). With x:
        β and the per-channel decay the layer computes from x. Without: β = 1 and log α = 0 on every channel,
        the delta rule of Yang et al. 2024 (arXiv 2406.06484, Eq. 1-2): each pair replaces what its key held."""
        S = self.state["S"]
        k, v = k.to(S.dtype), v.to(S.dtype)
        if x is None:
            g, beta = torch.zeros_like(k), k.new_ones(*k.shape[:3], 1)
        else:
            g, beta = self.log_decay(x).to(S.dtype), self.beta(x)[..., None].to(S.dtype)
        _, S = self.rule(k, k, v, g, beta, S)
        self.load_state({**self.state, "S": S})

    def output(self, o: Tensor, x: Tensor) -> Tensor:
        """y = W_o (RMSNorm(o) ⊙ sigmoid(W_g↑ W_g↓ x)) per head."""
        gate = torch.sigmoid(self.heads(self.g_proj(x).to(o.dtype), self.head_v_dim))
        return self.o_proj((rms_norm(o, self.o_norm_weight, self.eps) * gate).flatten(-2).to(x.dtype))
