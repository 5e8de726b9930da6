"""Gated DeltaNet token mixer (Yang et al. 2024), as used by Qwen3-Next and the FwPKM paper.

    q, k, v = silu(conv4(W_q x)), silu(conv4(W_k x)), silu(conv4(W_v x))   causal depthwise, size 4
    q, k    = L2-normalised per head                                       8 heads of dim 64
    β_t     = sigmoid(W_b x_t)                                             writing strength
    g_t     = -exp(A_log) · softplus(W_a x_t + dt_bias)                    log decay α_t = exp(g_t)
    S_t     = α_t S_{t-1} (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ                 gated delta rule (ops)
    o_t     = W_o (RMSNorm(S_t q_t) ⊙ silu(W_g x_t))

The recurrence is `memzoo.ops.gated_delta_rule` (chunked pure torch on CPU, fla kernels on
CUDA, or there where fla cannot run the torch path compiled). Streaming: the cache holds the last 3 inputs of each short convolution and the
recurrent state S, so split calls equal one call.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.ops.gated_delta_rule import gated_delta_rule
from memzoo.ops.short_conv import causal_conv, conv_weights
from memzoo.storage import load_transposed


class ShortConv(nn.Module):
    """Causal depthwise conv1d + SiLU whose left context streams across calls. Its weight is
    stored taps first, [size, dim] (`memzoo.ops.short_conv` says why), drawn as nn.Conv1d draws
    its [dim, 1, size] weight."""

    def __init__(self, dim: int, size: int = 4):
        super().__init__()
        self.size = size
        self.weight = nn.Parameter(conv_weights(dim, size))

    def forward(self, x: Tensor, past: Tensor | None) -> tuple[Tensor, Tensor]:
        # x [B, T, D]; past [B, size-1, D] = the previous call's last inputs (zeros at start)
        if past is None:
            past = x.new_zeros(x.shape[0], self.size - 1, x.shape[2])
        xp = torch.cat([past, x], dim=1)
        return F.silu(causal_conv(xp, self.weight)), xp[:, -(self.size - 1) :].detach()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        load_transposed(state_dict, prefix + "weight", self.weight.shape)  # conv1d's [dim, 1, size] before
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


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
        # Mamba-2 style init: decay rates A ~ U(0, 16), time steps dt ~ logU(1e-3, 1e-1)
        self.A_log = nn.Parameter(torch.empty(num_heads).uniform_(1e-4, 16).log())
        dt = torch.exp(torch.rand(num_heads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
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
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias)
        # one dtype for q, k, v (fla's kernels require it; the torch path computes in fp32 anyway)
        q, k = q.to(v.dtype), k.to(v.dtype)
        o, S = gated_delta_rule(
            q, k, v, g, beta, initial_state=cache.get("S"), output_final_state=True, chunk_size=self.chunk_size,
            backend="auto-compiled",  # training's lengths repeat: each compiles once
        )
        # per-head RMSNorm of the read, gated by silu(W_g x)
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm_weight
        gate = F.silu(self.g_proj(x).view(B, T, self.h, self.d).float())
        y = self.o_proj((of * gate).to(x.dtype).reshape(B, T, -1))
        return y, {"conv_q": cq, "conv_k": ck, "conv_v": cv, "S": S.detach()}
