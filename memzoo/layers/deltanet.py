"""DeltaNet: linear attention with the delta rule (Schlag, Irie & Schmidhuber 2021; Yang, Wang,
Zhang, Shen & Kim 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence
Length", arXiv 2406.06484).

The memory S ∈ R^{K×V} per head replaces the value it holds at a key instead of adding to it
(Yang et al. Eq. 1-2, written in fla's [K, V] layout):

    v_t^old = S_{t-1}ᵀ k_t                                   what the memory returns for k_t
    S_t     = S_{t-1} − β_t k_t (v_t^old − v_t)ᵀ
            = (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ       one step of SGD on ½‖Sᵀk_t − v_t‖², lr β_t
    o_t     = S_tᵀ q_t / √K

Slow projections (Sec. 4 / fla ``DeltaNet``'s defaults): a short convolution (size 4) then SiLU on
k and v, L2-normalised keys and queries (so that I − β k kᵀ has eigenvalues in [1 − β, 1]: the
memory stays bounded), β_t = sigmoid(W_β x_t) per head (``allow_neg_eigval``: 2·sigmoid, eigenvalues
down to −1, Grazzi et al. 2024), and the output y = W_o RMSNorm(o) per head (fla's ``use_gate=False``).
The query has no convolution (memzoo/layers/_delta.py says why). The recurrence is the gated delta
rule with no decay (g = 0): :mod:`memzoo.ops.gated_delta_rule`, chunked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.layers._delta import DeltaRuleMemory, linear
from memzoo.layers.base import State
from memzoo.modules.norm import rms_norm
from memzoo.ops.gated_delta_rule import gated_delta_rule
from memzoo.registration import register_layer


@register_layer("deltanet")
class DeltaNet(DeltaRuleMemory):
    """DeltaNet as a memory layer; see the module docstring.

    Args:
        d_model: model width D.
        num_heads: H heads.
        head_dim: key size K per head; default D // H.
        expand_v: value size V = expand_v · K.
        conv_size: short-convolution width on k and v (0 or 1 = none, then SiLU only).
        allow_neg_eigval: β_t = 2 · sigmoid(·), so I − β k kᵀ may reflect (eigenvalue down to −1).
        norm_eps: eps of the output RMSNorm.
    """

    def __init__(self, d_model: int, num_heads: int = 4, head_dim: int | None = None, expand_v: float = 1.0,
                 conv_size: int = 4, allow_neg_eigval: bool = False, norm_eps: float = 1e-5):
        super().__init__(d_model, num_heads, head_dim, expand_v, conv_size, norm_eps)
        self.allow_neg_eigval = bool(allow_neg_eigval)
        self.k_proj = linear(d_model, self.key_dim)
        self.v_proj = linear(d_model, self.value_dim)
        self.b_proj = linear(d_model, num_heads)
        self.o_norm_weight = nn.Parameter(torch.ones(self.head_v_dim))
        self.add_convs(k=self.key_dim, v=self.value_dim)

    def beta(self, x: Tensor) -> Tensor:
        """β_t [B, T, H] in (0, 1), or (0, 2) with allow_neg_eigval."""
        b = torch.sigmoid(self.b_proj(x).to(self.cdtype()))
        return 2 * b if self.allow_neg_eigval else b

    def keys_values(self, x: Tensor, state: State, new: State) -> tuple[Tensor, Tensor]:
        """k_t = L2(silu(conv(W_k x))), v_t = silu(conv(W_v x)): [B, T, H, K], [B, T, H, V]."""
        dt = self.cdtype()
        k = F.normalize(self.heads(self.conv("k", self.k_proj(x).to(dt), state, new)), dim=-1)
        v = self.heads(self.conv("v", self.v_proj(x).to(dt), state, new), self.head_v_dim)
        return k, v

    def scan(self, x: Tensor, state: State, q: Tensor | None) -> tuple[Tensor | None, State]:
        new: State = {}
        k, v = self.keys_values(x, state, new)
        beta = self.beta(x)
        o, new["S"] = gated_delta_rule(k if q is None else q, k, v, torch.zeros_like(beta), beta, scale=self.scale,
                                       initial_state=state["S"], output_final_state=True,
                                       chunk_size=self.parallel_chunk)
        return (None if q is None else o), new

    no_pairs = None  # the pairs adapter: neutral β = 1 (each pair overwrites what its key held)

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """S ← (I − β k kᵀ) S + β k vᵀ a pair at a time (the gated delta rule, g = 0); β from x, else 1."""
        beta = self.beta(x) if x is not None else k.new_ones(k.shape[:3])
        S = self.state["S"]
        _, S = gated_delta_rule(k.to(S.dtype), k.to(S.dtype), v.to(S.dtype), torch.zeros_like(beta, dtype=S.dtype),
                                beta.to(S.dtype), scale=self.scale, initial_state=S, output_final_state=True,
                                chunk_size=self.parallel_chunk)
        self.load_state({**self.state, "S": S})

    def output(self, o: Tensor, x: Tensor) -> Tensor:
        """y = W_o RMSNorm(o) per head."""
        return self.o_proj(rms_norm(o, self.o_norm_weight, self.eps).flatten(-2).to(x.dtype))
