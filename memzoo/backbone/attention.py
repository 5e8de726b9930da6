"""Gated softmax attention as in Qwen3-Next (the paper's FA / SWA / FA-pSWA mixers).

    [q; gate] = W_q x      k = W_k x      v = W_v x          (12 query heads, 4 k/v heads, dim 64)
    q, k      = RoPE(RMSNorm(q)), RoPE(RMSNorm(k))           per-head q/k norm
    o         = W_o (softmax(q kᵀ / √d + mask) v  ⊙  sigmoid(gate))

The mask is causal; with a window w a query at t sees keys t-w < s <= t (SWA, w = 512).
With `conv_size` c > 0 (`model.attn_conv`; 0 in the paper's models), q, k and v first pass a
causal depthwise convolution of size c with SiLU, the short convolution of GDN: each key then
also holds the tokens just before it, so one layer can bind a key to the next value (an
induction head). The toys' positive control is this attention, as Zoology pairs its attention
with a short convolution (`Hybrid([BaseConv, MHA])`) for the same reason.
FA-pSWA (Sec. 4.2, Finding 3): during training each call uses the window with
probability p (0.9 in the paper), full attention otherwise; evaluation is always full.

Streaming: `forward(x, cache)` continues from `cache` (past keys/values after RoPE and
the position offset) and returns the new cache; SWA keeps only the last w-1 keys.

A window shorter than the sequence is computed block-locally off CUDA (`local_attention`): queries
in blocks of w, each reading its own block and the one before, O(T·w) rather than the masked O(T²)
of a full score matrix (why: docs/journal/performance.md, "the memory-only LMs' 4-token windows"). On CUDA
the masked fused kernels stay: they hold no score matrix, where the block-local one holds T·2w scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.modules.norm import RMSNorm
from memzoo.modules.conv import ShortConv


def rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Rotary embedding (rotate-half convention) of x [B, H, T, D] at integer positions pos [T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.to(torch.float32)[:, None] * inv_freq[None]  # [T, D/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    rot = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rot * sin).to(x.dtype)


def local_attention(q: Tensor, k: Tensor, v: Tensor, window: int) -> Tensor:
    """Causal softmax attention in which a query at t sees the keys t-w < s <= t, for q [B, H, T, D]
    and k, v [B, Hkv, T, D] (query head h reads k/v head h // (H/Hkv)); the same as the masked
    `scaled_dot_product_attention` at O(T·w). Queries are cut in blocks of w; block n's keys are
    blocks n-1 and n (2w keys, a view of k padded by one block of zeros in front), masked to the window."""
    B, H, T, D = q.shape
    hkv, w = k.shape[1], window
    g, nb = H // hkv, -(-T // w)
    pad = nb * w - T
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    kb = F.pad(k, (0, 0, w, 0)).unfold(2, 2 * w, w).transpose(-1, -2)  # [B, Hkv, nb, 2w, D]
    vb = F.pad(v, (0, 0, w, 0)).unfold(2, 2 * w, w).transpose(-1, -2)
    qb = q.view(B, hkv, g, nb, w, D).permute(0, 1, 3, 2, 4, 5).reshape(B, hkv, nb, g * w, D)
    s = qb @ kb.transpose(-1, -2)  # [B, Hkv, nb, g·w, 2w]
    s = s.to(torch.promote_types(s.dtype, torch.float32)) * D**-0.5  # the softmax in fp32 at least
    i = torch.arange(w, device=q.device).repeat(g)[:, None]  # the query's place in its block
    j = torch.arange(-w, w, device=q.device)[None, :]  # the key's place, relative to the block's start
    first = torch.arange(nb, device=q.device)[:, None, None] * w + j < 0  # block 0's padding
    s = s.masked_fill((j > i) | (i - j >= w) | first, float("-inf"))
    o = s.softmax(-1).to(vb.dtype) @ vb
    return o.view(B, hkv, nb, g, w, D).permute(0, 1, 3, 2, 4, 5).reshape(B, H, nb * w, D)[:, :, :T]


class GatedAttention(nn.Module):
    def __init__(
        self,
        d_model: int,
        num_heads: int = 12,
        num_kv_heads: int = 4,
        head_dim: int = 64,
        window: int | None = None,
        p_window: float = 1.0,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-5,
        conv_size: int = 0,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.h, self.hkv, self.d = num_heads, num_kv_heads, head_dim
        self.window, self.p_window, self.theta = window, p_window, rope_theta
        self.q_proj = nn.Linear(d_model, 2 * num_heads * head_dim, bias=False)  # query and output gate
        self.k_proj = nn.Linear(d_model, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, d_model, bias=False)
        self.q_norm = RMSNorm(head_dim, norm_eps)
        self.k_norm = RMSNorm(head_dim, norm_eps)
        widths = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        self.convs = nn.ModuleList(ShortConv(w, conv_size) for w in widths) if conv_size else None

    def _window_now(self) -> int | None:
        if self.window is None:
            return None
        if self.p_window >= 1.0 or not self.training:
            return self.window if self.p_window >= 1.0 else None
        # pSWA: draw per call from torch's global RNG (saved in checkpoints, so resume is exact)
        return self.window if torch.rand(()) < self.p_window else None

    def forward(self, x: Tensor, cache: dict | None = None) -> tuple[Tensor, dict]:
        B, T, _ = x.shape
        qg = self.q_proj(x).view(B, T, self.h, 2 * self.d)
        q, gate = qg.split(self.d, dim=-1)
        k = self.k_proj(x).view(B, T, self.hkv, self.d)
        v = self.v_proj(x).view(B, T, self.hkv, self.d)
        conv_cache = {}
        if self.convs is not None:
            qkv = []
            for name, t, conv in zip(("conv_q", "conv_k", "conv_v"), (q, k, v), self.convs):
                y, conv_cache[name] = conv(t.reshape(B, T, -1), None if cache is None else cache[name])
                qkv.append(y.view_as(t))
            q, k, v = qkv
        q, k, v = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2), v.transpose(1, 2)

        past = 0 if cache is None else cache["pos"]
        pos = torch.arange(past, past + T, device=x.device)
        q, k = rope(q, pos, self.theta), rope(k, pos, self.theta)
        if cache is not None and cache["k"].shape[2]:
            k = torch.cat([cache["k"], k], dim=2)
            v = torch.cat([cache["v"], v], dim=2)

        window = self._window_now()
        L = k.shape[2]
        if L == T and (window is None or window >= T):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif L == T and q.device.type != "cuda":  # on CUDA the fused masked kernels hold no score matrix
            o = local_attention(q, k, v, window)
        else:  # a cache continued (streaming, generation), or CUDA: the masked kernels
            qpos = pos[:, None]
            kpos = torch.arange(past + T - L, past + T, device=x.device)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= qpos - kpos < window
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        o = o.transpose(1, 2) * torch.sigmoid(gate)
        y = self.o_proj(o.reshape(B, T, self.h * self.d))

        # the cache keeps what a later query may still see: everything (FA) or the last w-1 keys
        keep = L if self.window is None or self.p_window < 1.0 else min(L, self.window - 1)
        new_cache = {"k": k[:, :, L - keep :].detach(), "v": v[:, :, L - keep :].detach(), "pos": past + T, **conv_cache}
        return y, new_cache
