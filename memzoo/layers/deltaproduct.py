"""DeltaProduct (Siems, Carstensen, Zela, Hutter, Pontil & Grazzi 2025, "DeltaProduct: Improving
State-Tracking in Linear RNNs via Householder Products", arXiv 2502.10297).

Each token takes n_h delta-rule steps instead of one, with keys, values and step sizes of their own
(Sec. 3, Eq. 4-5, [K, V] layout):

    H_{t,0} = S_{t-1}
    H_{t,j} = (I − β_{t,j} k_{t,j} k_{t,j}ᵀ) H_{t,j-1} + β_{t,j} k_{t,j} v_{t,j}ᵀ        j = 1 … n_h
    S_t     = H_{t,n_h}
    o_t     = S_tᵀ q_t / √K

so the transition of a token is a product of n_h generalised Householder matrices (rank n_h, not 1:
DeltaNet is n_h = 1). The token's n_h keys, values and β come from projections n_h times as wide
(k_{t,j} = L2(silu(conv(W_k x_t)))_j, …). ``forget_gate`` adds the Gated DeltaProduct's decay α_t,
once per token before its steps (S_t = H_{t,n_h} with H_{t,0} = α_t S_{t-1}; fla's
``GatedDeltaProduct``); ``allow_neg_eigval`` takes β ∈ (0, 2), the paper's [−1, 1] eigenvalue
range (Sec. 3; DeltaProduct_{n_h}[−1, 1] in its tables). The output is DeltaNet's (RMSNorm per head),
or Gated DeltaNet's (⊙ silu(W_g x)) with the forget gate, as fla's layer gates its output.

The computation is the paper's (Sec. 3.2) and fla's: the n_h steps of every token are n_h tokens of
a gated delta rule over a sequence n_h times as long (the decay on a token's first step, the read
after its last), so :mod:`memzoo.ops.gated_delta_rule` runs it, chunked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.layers._delta import DeltaRuleMemory, linear
from memzoo.layers.base import State
from memzoo.modules.gates import gated_log_decay, mamba2_decay_init
from memzoo.modules.norm import gated_rms_norm, rms_norm
from memzoo.ops.gated_delta_rule import gated_delta_rule
from memzoo.registration import register_layer


@register_layer("deltaproduct")
class DeltaProduct(DeltaRuleMemory):
    """DeltaProduct as a memory layer; see the module docstring.

    Args:
        d_model, num_heads, head_dim, expand_v, conv_size, norm_eps: as DeltaNet's.
        num_householder: n_h delta steps per token (2).
        forget_gate: the Gated DeltaProduct's decay α_t per token and head (and the gated output).
        allow_neg_eigval: β ∈ (0, 2) (eigenvalues of each step in [−1, 1]).
    """

    def __init__(self, d_model: int, num_heads: int = 4, head_dim: int | None = None, expand_v: float = 1.0,
                 conv_size: int = 4, num_householder: int = 2, forget_gate: bool = False,
                 allow_neg_eigval: bool = False, norm_eps: float = 1e-5):
        super().__init__(d_model, num_heads, head_dim, expand_v, conv_size, norm_eps)
        if num_householder < 1:
            raise ValueError(f"num_householder must be >= 1, got {num_householder}")
        n = self.num_householder = num_householder
        self.forget_gate, self.allow_neg_eigval = bool(forget_gate), bool(allow_neg_eigval)
        self.k_proj = linear(d_model, n * self.key_dim)
        self.v_proj = linear(d_model, n * self.value_dim)
        self.b_proj = linear(d_model, n * num_heads)
        self.o_norm_weight = nn.Parameter(torch.ones(self.head_v_dim))
        if self.forget_gate:
            self.a_proj = linear(d_model, num_heads)
            A_log, dt_bias = mamba2_decay_init(num_heads)
            self.A_log, self.dt_bias = nn.Parameter(A_log), nn.Parameter(dt_bias)
            self.A_log._no_weight_decay = self.dt_bias._no_weight_decay = True
            self.g_proj = linear(d_model, self.value_dim)
        self.add_convs(k=n * self.key_dim, v=n * self.value_dim)

    def steps(self, x: Tensor, state: State, new: State) -> tuple[Tensor, Tensor, Tensor]:
        """The n_h steps of every token, in order: k [B, T·n_h, H, K], v [B, T·n_h, H, V], β [B, T·n_h, H]."""
        B, T, _ = x.shape
        dt, n, H = self.cdtype(), self.num_householder, self.num_heads
        k = self.conv("k", self.k_proj(x).to(dt), state, new).reshape(B, T * n, H, self.head_dim)
        v = self.conv("v", self.v_proj(x).to(dt), state, new).reshape(B, T * n, H, self.head_v_dim)
        beta = torch.sigmoid(self.b_proj(x).to(dt)).reshape(B, T * n, H)
        return F.normalize(k, dim=-1), v, 2 * beta if self.allow_neg_eigval else beta

    def log_decays(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """log α of every step, in order: [B, T·n_h, H]; the forget gate's on each token's first step, else 0."""
        B, T, _ = x.shape
        g = torch.zeros(B, T, self.num_householder, self.num_heads, dtype=dtype, device=x.device)
        if self.forget_gate:  # log α_t on each token's first step
            a = self.a_proj(x).to(g.dtype)
            g0 = gated_log_decay(a, self.A_log, self.dt_bias)
            g = torch.cat([g0[:, :, None], g[:, :, 1:]], dim=2)
        return g.flatten(1, 2)

    def rule(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
        """The steps (n_h a token, in order) as one gated delta rule over a sequence n_h times as long."""
        return gated_delta_rule(q, k, v, g, beta, scale=self.scale, initial_state=S, output_final_state=True,
                                chunk_size=self.parallel_chunk * self.num_householder)

    def scan(self, x: Tensor, state: State, q: Tensor | None) -> tuple[Tensor | None, State]:
        new: State = {}
        B, T, _ = x.shape
        n, H = self.num_householder, self.num_heads
        k, v, beta = self.steps(x, state, new)
        qs = k if q is None else torch.cat([q.new_zeros(B, T, n - 1, H, self.head_dim), q[:, :, None]], 2).flatten(1, 2)
        o, new["S"] = self.rule(qs, k, v, self.log_decays(x, k.dtype), beta, state["S"])
        return (None if q is None else o[:, n - 1 :: n]), new

    # ---- the pairs adapter: a token writes n_h different keys, so one pair a token is its LAST step's
    no_pairs = None

    def pair_inputs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The key and value of every token's last Householder step (the one a read right after the token
        sees last), as `write(x)` from a reset state computes them: [B, T, H, K], [B, T, H, V]."""
        k, v, _ = self.steps(x, self.init_state(x.shape[0]), {})
        n = self.num_householder
        return k[:, n - 1 :: n], v[:, n - 1 :: n]

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """Each pair a token of n_h delta steps, by `scan`'s op (the gated delta rule over the steps).

        With x: the token's own n_h steps from x and the current state's convolution history (their keys,
        values, β and the forget gate's decay, the state's histories advanced as `write(x)` does), but the
        pair's (k, v) in place of its last step's: ``write_pairs(*pair_inputs(x), x)`` is ``write(x)``.
        Without x: every step writes the pair itself at β = 1, no decay: for a unit key the first step is the
        delta rule's replacement (Sᵀk = v after it) and the other n_h − 1 find Sᵀk = v and change nothing,
        so it is the delta rule at β = 1 (Yang et al. 2024, arXiv 2406.06484, Eq. 1-2)."""
        state, n = self.state, self.num_householder
        S = state["S"]
        k, v = k.to(S.dtype), v.to(S.dtype)
        B, T, H, _ = k.shape
        new: State = {}
        if x is None:
            ks = k[:, :, None].expand(B, T, n, H, k.shape[-1]).flatten(1, 2)
            vs = v[:, :, None].expand(B, T, n, H, v.shape[-1]).flatten(1, 2)
            beta, g = ks.new_ones(B, T * n, H), ks.new_zeros(B, T * n, H)
        else:
            ks, vs, beta = self.steps(x, state, new)
            ks = torch.cat([ks.unflatten(1, (T, n))[:, :, : n - 1], k[:, :, None]], 2).flatten(1, 2)
            vs = torch.cat([vs.unflatten(1, (T, n))[:, :, : n - 1], v[:, :, None]], 2).flatten(1, 2)
            g = self.log_decays(x, S.dtype)
        _, new["S"] = self.rule(ks, ks, vs, g, beta.to(S.dtype), S)
        self.load_state({**state, **new})

    def output(self, o: Tensor, x: Tensor) -> Tensor:
        if self.forget_gate:  # Gated DeltaNet's output gate
            o = gated_rms_norm(o, self.heads(self.g_proj(x).to(o.dtype), self.head_v_dim), self.o_norm_weight, self.eps)
        else:
            o = rms_norm(o, self.o_norm_weight, self.eps)
        return self.o_proj(o.flatten(-2).to(x.dtype))
