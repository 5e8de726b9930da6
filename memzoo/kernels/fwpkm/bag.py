"""Kernel (b): the weighted embedding bag, v̂_t = Σ_m w_{t,m} V[idx_{t,m}] (Eq. 32 / Eq. 4), with
its backward to the weights and, where the table takes gradients (PKM's slow values; FwPKM's
fast ones under ``grad_through_update``), to the table.

Torch reference: :func:`memzoo.ops.product_key.gather_values` (which materialises the
[tokens, m, D_V] gathered rows; the kernel never does). Forward: one program per
(BLOCK_T tokens, BLOCK_D features) sums its m rows in registers. Backward to the weights:
dL/dw_{t,m} = <dL/dv̂_t, V[idx_{t,m}]>, one program per BLOCK_T tokens. Backward to the table:
the deterministic segment sum of :mod:`.segment` (dL/dV_r = Σ_{(t,m): idx=r} w_{t,m} dL/dv̂_t).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .segment import Segments, segment_sum


@triton.jit
def _bag_fwd(V, IDX, W, OUT, n_tok, D, M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tmask = offs_t < n_tok
    mask = tmask[:, None] & (offs_d[None, :] < D)
    acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    for j in tl.static_range(M):
        i = tl.load(IDX + offs_t.to(tl.int64) * M + j, mask=tmask, other=0)
        w = tl.load(W + offs_t.to(tl.int64) * M + j, mask=tmask, other=0.0).to(tl.float32)
        row = tl.load(V + i[:, None] * D + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += w[:, None] * row
    tl.store(OUT + offs_t.to(tl.int64)[:, None] * D + offs_d[None, :], acc, mask=mask)


@triton.jit
def _bag_bwd_w(V, IDX, GO, GW, n_tok, D, M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = offs_t < n_tok
    for j in tl.static_range(M):
        i = tl.load(IDX + offs_t.to(tl.int64) * M + j, mask=tmask, other=0)
        acc = tl.zeros((BLOCK_T,), tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask = tmask[:, None] & (offs_d[None, :] < D)
            go = tl.load(GO + offs_t.to(tl.int64)[:, None] * D + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
            row = tl.load(V + i[:, None] * D + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += tl.sum(go * row, 1)
        tl.store(GW + offs_t.to(tl.int64) * M + j, acc, mask=tmask)


def _blocks(D: int) -> tuple[int, int]:
    return 16, min(max(triton.next_power_of_2(D), 16), 128)


class _Bag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: Tensor, index: Tensor, weights: Tensor, snapshot: bool) -> Tensor:
        lead, M = index.shape[:-1], index.shape[-1]
        D = values.shape[-1]
        V = values.reshape(-1, D).contiguous()
        idx = index.reshape(-1, M).contiguous()
        w = weights.reshape(-1, M).float().contiguous()
        n_tok = idx.shape[0]
        out = torch.empty(n_tok, D, device=values.device, dtype=torch.float32)
        if n_tok:
            BT, BD = _blocks(D)
            _bag_fwd[(triton.cdiv(n_tok, BT), triton.cdiv(D, BD))](V, idx, w, out, n_tok, D, M=M, BLOCK_T=BT,
                                                                   BLOCK_D=BD)
        # the weights' backward reads the rows as they were: from the table, or from a copy of the
        # rows read when the table is written in place before the backward runs (`snapshot`)
        rows = V.index_select(0, idx.reshape(-1)).view(n_tok, M, D) if snapshot and ctx.needs_input_grad[2] else None
        ctx.save_for_backward(V if rows is None or ctx.needs_input_grad[0] else None, idx, w, rows)
        ctx.shapes = (values.shape, weights.dtype, values.dtype)
        return out.view(*lead, D)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        V, idx, w, rows = ctx.saved_tensors
        vshape, wdtype, vdtype = ctx.shapes
        n_tok, M = idx.shape
        D = vshape[-1]
        go = grad_out.reshape(n_tok, D).float().contiguous()
        gw = gv = None
        if ctx.needs_input_grad[2] and rows is not None:
            gw = torch.einsum("td,tmd->tm", go, rows.float()).to(wdtype).view(*grad_out.shape[:-1], M)
        elif ctx.needs_input_grad[2]:
            gw = torch.empty(n_tok, M, device=V.device, dtype=torch.float32)
            if n_tok:
                BT, BD = _blocks(D)
                _bag_bwd_w[(triton.cdiv(n_tok, BT),)](V, idx, go, gw, n_tok, D, M=M, BLOCK_T=BT, BLOCK_D=BD)
            gw = gw.view(*grad_out.shape[:-1], M).to(wdtype)
        if ctx.needs_input_grad[0]:
            gv = torch.zeros(V.shape, device=V.device, dtype=torch.float32)  # (V is saved when it takes a gradient)
            segment_sum(gv, Segments(idx), w.reshape(-1), go, per_token=M)
            gv = gv.view(vshape).to(vdtype)
        return gv, None, gw, None


@torch.compiler.disable  # a launch of our own, outside any compiled graph
def embedding_bag(values: Tensor, index: Tensor, weights: Tensor, snapshot: bool = False) -> Tensor:
    """Σ_m weights[..., m] · values.reshape(-1, D)[index[..., m]] -> [..., D] in fp32; the same
    contract as :func:`memzoo.ops.product_key.gather_values`, differentiable in `weights` and
    `values`. `snapshot`: the table will be written in place before the backward (FwPKM's
    memory), so the rows read are kept for the weights' gradient (the torch gather keeps them
    too); without it the backward reads the table, and autograd raises if it was written since."""
    if index.shape != weights.shape:
        raise ValueError(f"index {tuple(index.shape)} and weights {tuple(weights.shape)} must have one shape")
    return _Bag.apply(values, index, weights, snapshot)
