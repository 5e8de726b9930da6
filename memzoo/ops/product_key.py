"""Product-key addressing (Lample et al. 2019; FwPKM paper Sec. 2 and Eqs. 27-32), shared by
PKM and FwPKM.

N = n² slots sit on an n × n grid. A query is split in two halves (Eq. 5/27); each half is
scored against its own n sub-keys (dot product, Eq. 6, or IDW, Eq. 21/28); the top-k of
each half (Eq. 7/29) are combined into k × k candidate slots whose score is the sum of the
two halves' scores, and the top-k of those are the retrieved slots (Eq. 8/31), weighted
by a softmax over their scores (Eq. 3/32). Cost: O(n + k²) per query instead of O(N).

Shapes: queries [..., H, Dk] (H heads); sub-keys [H, 2, n, Dk/2] shared by all queries, or
[B, H, 2, n, Dk/2] with one set per sequence for queries [B, T, H, Dk].
"""

from __future__ import annotations

import torch
from torch import Tensor

from memzoo.ops.slots import Lookup  # noqa: F401  (the lookup's result; re-exported)


def subkey_scores(q: Tensor, subkeys: Tensor, score: str = "dot", eps: float = 1e-3) -> Tensor:
    """Scores of each query half against its sub-keys: [..., H, Dk] x [H, 2, n, Dk/2] -> [..., H, 2, n].

    dot: s_i = q·K_i (Eq. 6).  idw: s_i = -log(eps + ||q - K_i||²) (Eq. 21), eps = 1e-3.
    """
    if score not in ("dot", "idw"):
        raise ValueError(f"unknown score {score!r}; use 'dot' or 'idw'")
    *lead, H, Dk = q.shape
    qh = q.reshape(*lead, H, 2, Dk // 2)  # Eq. 5: [q¹; q²] = q
    if subkeys.dim() == 4:  # shared sub-keys
        dot = torch.einsum("...hsd,hsnd->...hsn", qh, subkeys)
        k2 = subkeys.pow(2).sum(-1)  # [H, 2, n]
    else:  # one set per sequence: q [B, T, H, Dk], sub-keys [B, H, 2, n, d]
        dot = torch.einsum("bthsd,bhsnd->bthsn", qh, subkeys)
        k2 = subkeys.pow(2).sum(-1)[:, None]  # [B, 1, H, 2, n]
    if score == "dot":
        return dot
    # ||q - K||² expanded as ||q||² - 2 q·K + ||K||²: no [..., n, d] difference tensor
    d2 = qh.pow(2).sum(-1, keepdim=True) - 2 * dot + k2
    return -torch.log(eps + d2.clamp(min=0))


def candidate_pairs(k: int, device=None) -> Tensor:
    """The cells (a, b) of the k × k candidate grid, as a · k + b, that can be among its top k:
    with each half's scores sorted best first, cell (a, b) is beaten or tied by the (a+1)(b+1) − 1
    cells (a' ≤ a, b' ≤ b) other than itself, so only cells with (a+1)(b+1) ≤ k can place (20 of 64
    at k = 8; Σ_a ⌊k/(a+1)⌋ ~ k ln k of k²). The top k of these are the top k of the grid."""
    return torch.tensor([a * k + b for a in range(k) for b in range(k) if (a + 1) * (b + 1) <= k], device=device)


def product_topk(sub: Tensor, k: int) -> Lookup:
    """Top-k slots of the n × n grid from per-half scores `sub` [..., H, 2, n] (Eqs. 29-32)."""
    n = sub.shape[-1]
    if k > n:
        raise ValueError(f"top-k ({k}) cannot exceed the number of sub-keys per half ({n})")
    s, i = sub.topk(k, dim=-1)  # [..., H, 2, k] (Eq. 29), best first
    # the k × k candidate grid, score(a, b) = s¹_a + s²_b (Eq. 31), at the cells that can place
    cells = candidate_pairs(k, sub.device)
    cand = s[..., 0, :].index_select(-1, cells // k) + s[..., 1, :].index_select(-1, cells % k)
    best, j = cand.topk(k, dim=-1)  # [..., H, k]
    flat = cells[j]
    row = i[..., 0, :].gather(-1, flat // k)
    col = i[..., 1, :].gather(-1, flat % k)
    return Lookup(best, row * n + col, s, i, flat)


def lookup(q: Tensor, subkeys: Tensor, k: int, score: str = "dot", eps: float = 1e-3) -> Lookup:
    """Product-key lookup of queries [..., H, Dk] in sub-keys [H, 2, n, Dk/2]."""
    return product_topk(subkey_scores(q, subkeys, score, eps), k)


def pair_scores(top: Tensor, pair: Tensor) -> Tensor:
    """Slot scores s¹_a + s²_b (Eq. 31) from per-half top-k scores `top` [..., H, 2, k]
    (e.g. recomputed differentiably by `selected_subkey_scores`) and `Lookup.pair`."""
    k = top.shape[-1]
    return top[..., 0, :].gather(-1, pair // k) + top[..., 1, :].gather(-1, pair % k)


def gather_values(values: Tensor, index: Tensor, weights: Tensor) -> Tensor:
    """v̂ = Σ_i s'_i V_i (Eq. 4/32): values [N, Dv], index/weights [..., m] -> [..., Dv].
    (An embedding bag; the gather materialises [..., m, Dv], fine for m = heads × top-k.)"""
    return torch.einsum("...m,...md->...d", weights, gather_rows(values, index))


def brute_force_topk(q: Tensor, subkeys: Tensor, k: int, score: str = "dot", eps: float = 1e-3):
    """Reference: score all n² slots explicitly and take the top-k (O(N); for tests only)."""
    sub = subkey_scores(q, subkeys, score, eps)  # [..., H, 2, n]
    full = (sub[..., 0, :, None] + sub[..., 1, None, :]).flatten(-2)  # [..., H, n²]
    return full.topk(k, dim=-1)  # (scores, index)


def subkey_rows(subkeys: Tensor, sub_index: Tensor) -> Tensor:
    """Row ids into ``subkeys.reshape(-1, d)`` of the sub-keys `sub_index` [..., H, 2, k] selects
    in subkeys [H, 2, n, d] (shared) or [B, H, 2, n, d] (one set per sequence; then
    sub_index is [B, T, H, 2, k]). A flat row id per sub-key lets index_select (and its
    index_add backward) do the gather: much faster than advanced indexing with broadcast
    (b, h, s, i) index tensors."""
    H, _, n, _ = subkeys.shape[-4:]
    hs = torch.arange(2 * H, device=sub_index.device).view(H, 2, 1) * n  # [H, 2, 1]
    if subkeys.dim() == 5:
        hs = hs + torch.arange(subkeys.shape[0], device=sub_index.device).view(-1, 1, 1, 1, 1) * (2 * H * n)
    return sub_index + hs


def gather_rows(table: Tensor, rows: Tensor) -> Tensor:
    """table.reshape(-1, d)[rows] -> [*rows.shape, d], by index_select."""
    d = table.shape[-1]
    return table.reshape(-1, d).index_select(0, rows.reshape(-1)).view(*rows.shape, d)


def selected_subkey_scores(q: Tensor, subkeys: Tensor, sub_index: Tensor, score: str = "dot", eps: float = 1e-3) -> Tensor:
    """Scores of the selected sub-keys only, [..., H, 2, k], differentiable in `subkeys`.

    The gradients of FwPKM's key updates (Eqs. 37-39) reach only the top-k sub-keys of each
    query, so recomputing these k scores costs O(k·d) per query instead of O(n·d).
    q [..., H, Dk]; subkeys [H, 2, n, d] or [B, H, 2, n, d] (then q is [B, T, H, Dk]);
    sub_index [..., H, 2, k] from `product_topk`.
    """
    *lead, H, Dk = q.shape
    qh = q.reshape(*lead, H, 2, 1, Dk // 2)
    K = gather_rows(subkeys, subkey_rows(subkeys, sub_index))  # [..., H, 2, k, d]
    if score == "dot":
        return (qh * K).sum(-1)
    return -torch.log(eps + (qh - K).pow(2).sum(-1))


def kernels_for(t: Tensor) -> bool:
    """Whether product-key work on `t` runs the Triton kernels of :mod:`memzoo.kernels.fwpkm`
    (CUDA tensors; the CPU path never imports them). The layers ask through this one function,
    so a test can route them to the kernels under ``TRITON_INTERPRET=1`` on CPU."""
    return t.is_cuda


def kernels(t: Tensor, enabled: bool = True):
    """The module :mod:`memzoo.kernels.fwpkm` where product-key work on `t` runs its kernels
    (`enabled`, the layer's ``triton`` option, and :func:`kernels_for`), else None."""
    if not (enabled and kernels_for(t)):
        return None
    from memzoo.kernels import fwpkm

    return fwpkm
