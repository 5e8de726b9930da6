"""HGRN-2 (Qin, Yang, Sun, Shen, Li, Sun & Zhong 2024, "HGRN2: Gated Linear RNNs with State Expansion",
arXiv 2404.07904) as a memory layer: the HGRU2 token mixer of Sec. 3.

HGRN-1's gated linear recurrence with its input expanded by an outer product (Sec. 3, Eq. 3), per head:

    h_t = Diag(f_t) h_{t-1} + (1 − f_t) i_tᵀ                                    h_t ∈ R^{K×V}
    y_t = h_tᵀ o_t                                                              (read: inclusive)

The key is tied to the forget gate: 1 − f_t is the key, the input i_t the value, the output gate o_t
the query (the paper's "linear attention interpretation", Sec. 3): GLA's recurrence with a decay per
key channel and no parameters for the key. The state grows from HGRN-1's d to d·K numbers ("state
expansion") at no cost in parameters. The slow projections, per token:

    f_t = sigmoid(W_f x_t)          (log f_t = logsigmoid(W_f x_t) ≤ 0, so 1 − f_t = −expm1(log f_t))
    i_t = W_i x_t,   o_t = swish(W_o x_t)
    out_t = W_out RMSNorm(y_t)      the norm over all heads' y_t joined (width D)

with K = expand_ratio (the paper's expansion ratio, 128 in its language models) and H = D / K heads,
so that V = D / H = K by default. The recurrence is the shared op :mod:`memzoo.ops.linear_attention`
with a decay per key channel (HGRN-2 trains with GLA's chunked kernels, as the paper says).

Where the paper is silent or differs, fla's layer (``fla/layers/hgrn2.py``, ``HGRN2Attention``) decides:
the read is scaled by 1/√K (fla runs GLA's ops, whose default scale is ``K ** -0.5``; the paper writes
y_t = o_t · h_t), folded into the query here; the output gate is swish and the input has no activation;
the norm is an RMSNorm with a learned weight over the whole width, then W_out, with no output gate
besides the query; no bias anywhere, every Linear at torch's default init (fla leaves them to the
model); no short convolution (fla's ``use_short_conv=False``); H = D / expand_ratio unless num_heads is
given. HGRN's lower bound on the forget gate (f_t = β + (1 − β) sigmoid(·), β rising with depth) is a
parameter of the model's stack of layers, which fla passes to each layer and sets to 0 for the first;
a memory layer stands alone, so β = 0 here, as in fla's first layer.

The MemoryLayer verbs: ``read_state`` is y = hᵀ o / √K with the memory so far (every projection is
pointwise, so a read is the same function in `read` and in `forward`); ``write_state`` applies every
token's write in order; ``forward_state`` writes token t then reads it (``inclusive = True``). The
state, per sequence and token-recurrent: ``S`` [B, H, K, V].
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.layers._delta import linear
from memzoo.layers._matrix import GatedLinearMemory
from memzoo.modules.norm import rms_norm
from memzoo.modules.precision import compute_dtype
from memzoo.registration import register_layer


def hgrn2_key_and_decay(f_logits: Tensor) -> tuple[Tensor, Tensor]:
    """The key tied to the forget gate (Sec. 3): (1 − f_t, log f_t) with f_t = sigmoid(f_logits)."""
    log_f = F.logsigmoid(f_logits)
    return -torch.expm1(log_f), log_f


@register_layer("hgrn2")
class HGRN2(GatedLinearMemory):
    """HGRN-2's HGRU2 as a memory layer; see the module docstring for the equations.

    Args:
        d_model: model width D (also the input's width H·V).
        expand_ratio: K, the state expansion: the key (forget gate) width of a head (the paper: 128).
        num_heads: H heads; None = D / expand_ratio (the paper's and fla's rule, so that H·K = D).
        norm_eps: eps of the RMSNorm.
    """

    family = "gated_hebbian"  # forward writes token t, then reads it (Eq. 3: y_t reads h_t): GatedLinearMemory
    bench_cost = 1.3

    def __init__(self, d_model: int, expand_ratio: int = 128, num_heads: int | None = None, norm_eps: float = 1e-5):
        super().__init__(d_model)
        if int(expand_ratio) != expand_ratio or expand_ratio < 1:
            raise ValueError(f"expand_ratio (the key width K of a head) must be an integer >= 1, got {expand_ratio}")
        expand_ratio = int(expand_ratio)
        if num_heads is None:
            if d_model % expand_ratio:
                raise ValueError(f"expand_ratio={expand_ratio} must divide d_model={d_model} (H = d_model / "
                                 "expand_ratio), or give num_heads")
            num_heads = d_model // expand_ratio
        if num_heads < 1 or d_model % num_heads:
            raise ValueError(f"num_heads={num_heads} must be >= 1 and divide d_model={d_model} (V = d_model / H)")
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {norm_eps}")
        self.num_heads, self.head_dim, self.head_v_dim = num_heads, expand_ratio, d_model // num_heads
        self.key_dim, self.eps = num_heads * expand_ratio, norm_eps
        self.scale = self.head_dim ** -0.5
        self.q_proj = linear(d_model, self.key_dim)  # W_o: the output gate, the query
        self.f_proj = linear(d_model, self.key_dim)  # W_f: the forget gate, whose complement is the key
        self.i_proj = linear(d_model, d_model)  # W_i: the input, the value
        self.g_norm_weight = nn.Parameter(torch.ones(d_model))
        self.o_proj = linear(d_model, d_model)

    # ---- the slow projections ------------------------------------------------------------------
    def cdtype(self) -> torch.dtype:
        return compute_dtype(self.o_proj.weight)

    def heads(self, u: Tensor, d: int) -> Tensor:
        return u.to(self.cdtype()).unflatten(-1, (self.num_heads, d))

    def query(self, x: Tensor) -> Tensor:
        """o_t / √K = swish(W_o x_t) / √K: [B, T, H, K] (the read's scale folded into the query)."""
        return self.scale * F.silu(self.heads(self.q_proj(x), self.head_dim))

    def keys_values(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """1 − f_t [B, T, H, K], i_t [B, T, H, V], log f_t [B, T, H, K]."""
        k, log_f = hgrn2_key_and_decay(self.heads(self.f_proj(x), self.head_dim))
        return k, self.heads(self.i_proj(x), self.head_v_dim), log_f

    def output(self, y: Tensor, x: Tensor) -> Tensor:
        """W_out RMSNorm(y) over the heads joined: y [B, T, H, V]."""
        y = y.flatten(-2)
        y = rms_norm(y, self.g_norm_weight, self.eps)
        return self.o_proj(y.to(x.dtype))

    # ---- state, verbs, pairs adapter and stats: GatedLinearMemory. The adapter's neutral write has no decay
    # (f = 1, so the tie of the key to 1 − f is off: the pair's own key is written) and reads Sᵀk.

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, num_heads={self.num_heads}, expand_ratio={self.head_dim}, "
                f"head_v_dim={self.head_v_dim}")
