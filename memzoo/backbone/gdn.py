"""Gated DeltaNet token mixer (Yang et al. 2024), as used by Qwen3-Next and the FwPKM paper.

    q, k, v = silu(conv4(W_q x)), silu(conv4(W_k x)), silu(conv4(W_v x))   causal depthwise, size 4
    q, k    = L2-normalised per head                                       8 heads of dim 64
    β_t     = sigmoid(W_b x_t)                                             writing strength
    g_t     = -exp(A_log) · softplus(W_a x_t + dt_bias)                    log decay α_t = exp(g_t)
    S_t     = α_t S_{t-1} (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ                 gated delta rule (ops)
    o_t     = W_o (RMSNorm(S_t q_t) ⊙ silu(W_g x_t))

The same math as the `gated_deltanet` memory layer, written once: the recurrence, the decay
(`modules.gates.gated_log_decay`, Mamba-2's init), the gated output norm (`modules.norm.gated_rms_norm`) and
the short convolution (`modules.conv`). What differs is what a token mixer may do and a memory may not: the
query is convolved too (a memory's read must be pointwise: memzoo/layers/_delta.py), and its parameters keep
the names and the order of draws the published backbones were trained and seeded with.
The recurrence is `memzoo.ops.gated_delta_rule` (chunked pure torch on CPU, fla kernels on
CUDA, or there where fla cannot run the torch path compiled). Streaming: the cache holds the last 3 inputs of each short convolution and the
recurrent state S, so split calls equal one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.modules.conv import ShortConv
from memzoo.modules.gates import gated_log_decay, mamba2_decay_init
from memzoo.modules.norm import gated_rms_norm
from memzoo.ops.gated_delta_rule import gated_delta_rule


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        d_model: int,
        num_heads: int = 8,
        head_dim: int = 64,
        conv_size: int = 4,
        chunk_size: int = 64,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        self.h, self.d, self.chunk_size = num_heads, head_dim, chunk_size
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(d_model, inner, bias=False)
        self.k_proj = nn.Linear(d_model, inner, bias=False)
        self.v_proj = nn.Linear(d_model, inner, bias=False)
        self.a_proj = nn.Linear(d_model, num_heads, bias=False)
        self.b_proj = nn.Linear(d_model, num_heads, bias=False)
        self.g_proj = nn.Linear(d_model, inner, bias=False)
        self.o_proj = nn.Linear(inner, d_model, bias=False)
        self.q_conv, self.k_conv, self.v_conv = (ShortConv(inner, conv_size) for _ in range(3))
        self.o_norm_weight = nn.Parameter(torch.ones(head_dim))
        self.eps = norm_eps
        A_log, dt_bias = mamba2_decay_init(num_heads)  # Mamba-2's init at Gated DeltaNet's range of A
        self.A_log, self.dt_bias = nn.Parameter(A_log), nn.Parameter(dt_bias)
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True

    def forward(self, x: Tensor, cache: dict | None = None) -> tuple[Tensor, dict]:
        B, T, _ = x.shape
        cache = cache or {}
        q, cq = self.q_conv(self.q_proj(x), cache.get("conv_q"))
        k, ck = self.k_conv(self.k_proj(x), cache.get("conv_k"))
        v, cv = self.v_conv(self.v_proj(x), cache.get("conv_v"))
        q = F.normalize(q.view(B, T, self.h, self.d).float(), dim=-1)
        k = F.normalize(k.view(B, T, self.h, self.d).float(), dim=-1)
        v = v.view(B, T, self.h, self.d)
        beta = torch.sigmoid(self.b_proj(x).float())
        g = gated_log_decay(self.a_proj(x).float(), self.A_log, self.dt_bias)
        # one dtype for q, k, v (fla's kernels require it; the torch path computes in fp32 anyway)
        q, k = q.to(v.dtype), k.to(v.dtype)
        o, S = gated_delta_rule(
            q, k, v, g, beta, initial_state=cache.get("S"), output_final_state=True, chunk_size=self.chunk_size,
            backend="auto-compiled",  # training's lengths repeat: each compiles once
        )
        # per-head RMSNorm of the read, gated by silu(W_g x)
        of = gated_rms_norm(o.float(), self.g_proj(x).view(B, T, self.h, self.d).float(), self.o_norm_weight, self.eps)
        y = self.o_proj(of.to(x.dtype).reshape(B, T, -1))
        return y, {"conv_q": cq, "conv_k": ck, "conv_v": cv, "S": S.detach()}
