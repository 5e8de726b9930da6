"""Kernel (a): product-key lookup, fused (Eqs. 27-31; Lample et al. Eqs. 5-8).

Torch reference: :func:`memzoo.ops.product_key.lookup` (sub-key scores for all n sub-keys, top-k
per half, the k × k combine, the final top-k). Here one program takes ``BLOCK_M`` queries of one
head and one sequence and keeps everything on chip: it scores the n sub-keys of a half in blocks
of ``BLOCK_N`` (dot product, or IDW expanded as ||q||² - 2 q·K + ||K||² as the reference does),
merges each block into a running top-k, sorts it, combines the two halves' top-k into k × k
candidates and takes their top-k. The [tokens, n] score matrix never reaches global memory.

Top-k is k rounds of (argmax, mask out) over a tile: no sort network, deterministic (ties go to
the lowest index, as ``tl.argmax`` breaks them), fine for the paper's k = 8 (FwPKM) and 32 (PKM).
The running top-k of a half is merged block by block: each round moves the block's best score
into the running set in place of its worst while it is better.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from memzoo.ops.slots import Lookup


@triton.jit
def _take(tile, cols, j):
    """tile[:, j] for a per-row column j [BM] (a gather along the minor axis)."""
    return tl.sum(tl.where(cols[None, :] == j[:, None], tile, 0), 1)


@triton.jit
def _half_topk(q_ptr, k_ptr, row0, rows_ok, n, d, eps,
               IDW: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
    """Top-k (scores desc, sub-key ids) of BLOCK_M query halves at q_ptr (row stride given by
    row0's layout: rows are contiguous halves of length d, `row0` [BM] their offsets) against
    the n sub-keys [n, d] at k_ptr."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_K)
    NEG: tl.constexpr = float("-inf")
    # the running top-k: unused places hold -inf (and are the first to be replaced)
    best = tl.full((BLOCK_M, BLOCK_K), NEG, tl.float32)
    best = tl.where(offs_k[None, :] < K, best, float("inf"))  # padding places are never replaced
    best_i = tl.zeros((BLOCK_M, BLOCK_K), tl.int32)
    for n0 in range(0, n, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        dot = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        q2 = tl.zeros((BLOCK_M,), tl.float32)
        k2 = tl.zeros((BLOCK_N,), tl.float32)
        for d0 in range(0, d, BLOCK_D):
            dd = d0 + offs_d
            q = tl.load(q_ptr + row0[:, None] + dd[None, :], mask=rows_ok[:, None] & (dd[None, :] < d), other=0.0)
            kk = tl.load(k_ptr + offs_n[:, None] * d + dd[None, :], mask=(offs_n[:, None] < n) & (dd[None, :] < d),
                         other=0.0)
            dot += tl.dot(q, tl.trans(kk), input_precision="ieee")
            if IDW:
                q2 += tl.sum(q * q, 1)
                k2 += tl.sum(kk * kk, 1)
        if IDW:
            d2 = q2[:, None] - 2 * dot + k2[None, :]
            s = -tl.log(eps + tl.maximum(d2, 0.0))
        else:
            s = dot
        s = tl.where(offs_n[None, :] < n, s, NEG)
        for _ in tl.static_range(K):  # move the block's best into the running set while it is better
            m = tl.max(s, 1)
            j = tl.argmax(s, 1)
            worst = tl.min(best, 1)
            w_at = tl.argmin(best, 1)
            take = m > worst
            hit = (offs_k[None, :] == w_at[:, None]) & take[:, None]
            best = tl.where(hit, m[:, None], best)
            best_i = tl.where(hit, (n0 + j)[:, None], best_i)
            s = tl.where(tl.arange(0, BLOCK_N)[None, :] == j[:, None], NEG, s)
    # sort the running set, best first
    out = tl.full((BLOCK_M, BLOCK_K), NEG, tl.float32)
    out_i = tl.zeros((BLOCK_M, BLOCK_K), tl.int32)
    work = tl.where(offs_k[None, :] < K, best, NEG)
    for r in tl.static_range(K):
        m = tl.max(work, 1)
        j = tl.argmax(work, 1)
        out = tl.where(offs_k[None, :] == r, m[:, None], out)
        out_i = tl.where(offs_k[None, :] == r, _take(best_i, offs_k, j)[:, None], out_i)
        work = tl.where(offs_k[None, :] == j[:, None], NEG, work)
    return out, out_i


@triton.jit
def _lookup_kernel(Q, KEYS, SCORES, INDEX, SUB_S, SUB_I, PAIR,
                   T, H, n, d, key_batch_stride, eps,
                   IDW: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
    """Q [B, T, H, 2, d]; KEYS [H, 2, n, d] (key_batch_stride 0) or [B, H, 2, n, d]. Grid:
    (cdiv(T, BLOCK_M), H, B). Outputs as :class:`Lookup`, over [B, T, H, ...]."""
    pid_t, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_t * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ok = offs_m < T
    tok = (b * T + offs_m).to(tl.int64) * H + h  # (b, t, h) row of the outputs
    kbase = KEYS + b.to(tl.int64) * key_batch_stride + h * 2 * n * d
    s1, i1 = _half_topk(Q, kbase, tok * 2 * d, rows_ok, n, d, eps, IDW, K, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_K)
    s2, i2 = _half_topk(Q, kbase + n * d, tok * 2 * d + d, rows_ok, n, d, eps, IDW, K, BLOCK_M, BLOCK_N, BLOCK_D,
                        BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    kmask = rows_ok[:, None] & (offs_k[None, :] < K)
    sub = tok[:, None] * 2 * K + offs_k[None, :]
    tl.store(SUB_S + sub, s1, mask=kmask)
    tl.store(SUB_S + sub + K, s2, mask=kmask)
    tl.store(SUB_I + sub, i1.to(tl.int64), mask=kmask)
    tl.store(SUB_I + sub + K, i2.to(tl.int64), mask=kmask)
    # the k × k candidates s¹_a + s²_b (Eq. 31), padded places at -inf; their top-k
    cand = s1[:, :, None] + s2[:, None, :]
    a_id = tl.arange(0, BLOCK_K)[None, :, None] + tl.zeros((1, 1, BLOCK_K), tl.int32)
    b_id = tl.arange(0, BLOCK_K)[None, None, :] + tl.zeros((1, BLOCK_K, 1), tl.int32)
    cand = tl.where((a_id < K) & (b_id < K), cand, float("-inf"))
    cand = tl.reshape(cand, (BLOCK_M, BLOCK_K * BLOCK_K))
    flat = tl.arange(0, BLOCK_K * BLOCK_K)
    out = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    out_row = tl.zeros((BLOCK_M, BLOCK_K), tl.int64)
    out_pair = tl.zeros((BLOCK_M, BLOCK_K), tl.int64)
    for r in tl.static_range(K):
        m = tl.max(cand, 1)
        f = tl.argmax(cand, 1)
        a, bb = f // BLOCK_K, f % BLOCK_K
        slot = _take(i1, offs_k, a).to(tl.int64) * n + _take(i2, offs_k, bb)
        here = offs_k[None, :] == r
        out = tl.where(here, m[:, None], out)
        out_row = tl.where(here, slot[:, None], out_row)
        out_pair = tl.where(here, (a * K + bb).to(tl.int64)[:, None], out_pair)
        cand = tl.where(flat[None, :] == f[:, None], float("-inf"), cand)
    top = tok[:, None] * K + offs_k[None, :]
    tl.store(SCORES + top, out, mask=kmask)
    tl.store(INDEX + top, out_row, mask=kmask)
    tl.store(PAIR + top, out_pair, mask=kmask)


# The merge keeps a [BLOCK_M, k²] candidate tile in registers: at PKM's k = 32 (16K floats a program)
# the lookup stalled on an H200 (docs/journal/performance.md), so the layers use it up to this k.
LOOKUP_MAX_K = 16


def _pow2(x: int, low: int = 16) -> int:
    return max(low, triton.next_power_of_2(x))


@torch.compiler.disable  # a launch of our own, outside any compiled graph
def lookup(q: Tensor, subkeys: Tensor, k: int, score: str = "dot", eps: float = 1e-3) -> Lookup:
    """Fused product-key lookup; the same contract as :func:`memzoo.ops.product_key.lookup`.

    q [..., H, Dk] with sub-keys [H, 2, n, Dk/2] shared, or q [B, T, H, Dk] with sub-keys
    [B, H, 2, n, Dk/2] one set per sequence. Scores are computed in fp32 (inputs are upcast);
    no gradient (the layers recompute the k selected scores differentiably)."""
    if score not in ("dot", "idw"):
        raise ValueError(f"unknown score {score!r}; use 'dot' or 'idw'")
    *lead, H, Dk = q.shape
    n, d = subkeys.shape[-2], subkeys.shape[-1]
    if k > n:
        raise ValueError(f"top-k ({k}) cannot exceed the number of sub-keys per half ({n})")
    if Dk != 2 * d:
        raise ValueError(f"query dim {Dk} must be twice the sub-key dim {d}")
    per_seq = subkeys.dim() == 5
    if per_seq:
        B, T = lead
    else:
        B, T = 1, int(torch.tensor(lead).prod()) if lead else 1
    qf = q.detach().float().contiguous()
    kf = subkeys.detach().float().contiguous()
    dev = q.device
    scores = torch.empty(*lead, H, k, device=dev)
    index = torch.empty(*lead, H, k, device=dev, dtype=torch.long)
    sub_s = torch.empty(*lead, H, 2, k, device=dev)
    sub_i = torch.empty(*lead, H, 2, k, device=dev, dtype=torch.long)
    pair = torch.empty(*lead, H, k, device=dev, dtype=torch.long)
    if B * T == 0:
        return Lookup(scores, index, sub_s, sub_i, pair)
    BLOCK_M = 16
    grid = (triton.cdiv(T, BLOCK_M), H, B)
    _lookup_kernel[grid](qf, kf, scores, index, sub_s, sub_i, pair, T, H, n, d,
                         kf.stride(0) if per_seq else 0, eps, IDW=score == "idw", K=k, BLOCK_M=BLOCK_M,
                         BLOCK_N=min(_pow2(n), 128), BLOCK_D=min(_pow2(d), 64), BLOCK_K=triton.next_power_of_2(k))
    return Lookup(scores, index, sub_s, sub_i, pair)
