"""Kernel (c), the reduction under every write: a deterministic, sort-based segment sum.

FwPKM's value step (Eqs. 35-36), the key gradient of its addressing loss (Eqs. 37-39) and the
backward of the embedding-bag read to the value table all have one shape: many (row, token)
entries, each adding ``coef_e · X[token_e]`` to ``row_e`` of a table. Torch's references do it
with ``index_add`` (atomics on CUDA: the summation order, and so the last bits, change from run
to run). Here the entries are sorted by row once (``torch.sort``, stable), each row's entries form
one contiguous segment, and one program sums a segment in entry order and writes its row: no
atomics, no two programs touching one row, **deterministic** (bit-identical across runs), and the
write is in place and O(rows touched), never O(table). The price is the sort, O(E log E) on E =
tokens × reads, small beside the reads. Nothing waits for the device: one program per sorted entry
is launched (E is known on the host), and only the first entry of each row's run sums it, walking
forward while the row repeats; the others return at once. (Counting the distinct rows first, to
launch one program per row, would make the host wait for the count at every write.) Deterministic matters here more than in most kernels:
FwPKM's memory is carried across steps, so run-to-run noise in a write compounds.

For each touched row r, with the entries e of its segment:

    out[r] (+)= alpha / max(Σ_e cnt[tok_e], 1)^[count] · (Σ_e coef_e X[tok_e] - [table] (Σ_e coef_e) table[r])

``tok_e = e // per_token`` (entries are laid out token-major), ``count``: divide by the number of
counted reads of the row (FwPKM's N_i^read), ``table``: subtract the table's own row times the
coefficient sum (the IDW key gradient Σ c_e (q_e - K_r) without a per-entry difference).
Torch reference: :func:`segment_sum_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _segment_kernel(ORDER, ROWS, COEF, CNT, X, TABLE, OUT, E, D, per_token, alpha,
                    HAS_X: tl.constexpr, COUNT: tl.constexpr, SUB: tl.constexpr, ACCUMULATE: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    start = tl.program_id(0)  # a position in the sorted entries: it sums its row if it starts the row's run
    row = tl.load(ROWS + start)
    first = (start == 0) | (tl.load(ROWS + tl.maximum(start - 1, 0)) != row)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = (offs < D) & first  # a program that does not start its row's run reads and writes nothing
    end = start + first.to(tl.int32)  # (no early return: a plain masked program)
    while first & (end < E) & (tl.load(ROWS + tl.minimum(end, E - 1)) == row):
        end += 1
    row = row.to(tl.int64)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    csum = tl.zeros((1,), tl.float32)  # loop-carried scalars as tensors, for the compiler
    cnt = tl.zeros((1,), tl.float32)
    for p in range(start, end):
        e = tl.load(ORDER + p)
        tok = e // per_token
        c = tl.load(COEF + e).to(tl.float32)
        if HAS_X:
            acc += c * tl.load(X + tok * D + offs, mask=dmask, other=0.0).to(tl.float32)
        else:
            acc += c
        csum += c
        if COUNT:
            cnt += tl.load(CNT + tok).to(tl.float32)
    if SUB:
        acc -= csum * tl.load(TABLE + row * D + offs, mask=dmask, other=0.0).to(tl.float32)
    scale = alpha
    if COUNT:
        scale = alpha / tl.maximum(cnt, 1.0)
    acc = acc * scale
    if ACCUMULATE:
        acc += tl.load(OUT + row * D + offs, mask=dmask, other=0.0).to(tl.float32)
    tl.store(OUT + row * D + offs, acc.to(OUT.dtype.element_ty), mask=dmask)


class Segments:
    """The entries' rows sorted once (stable: each row's entries in entry order), reusable by every
    reduction over the same rows."""

    def __init__(self, rows: Tensor):
        rows = rows.reshape(-1)
        self.rows, self.order = torch.sort(rows, stable=True)
        self.entries = rows.numel()


@torch.compiler.disable  # a launch of our own, outside any compiled graph
def segment_sum(out: Tensor, seg: Segments, coef: Tensor, x: Tensor | None = None, *, per_token: int = 1,
                alpha: float = 1.0, count: Tensor | None = None, table: Tensor | None = None,
                accumulate: bool = False) -> Tensor:
    """out [R, D] (R table rows; D = 1 when x is None): the formula of the module docstring,
    written into the touched rows of `out` only (in place; others are left as they are).
    coef [E] per entry; x [E // per_token, D] per token; count [E // per_token] per token;
    `table` [R, D]: subtract (Σ_e coef_e) table[r] (the module docstring's [sub])."""
    if seg.entries != coef.numel():
        raise ValueError(f"{coef.numel()} coefficients for {seg.entries} entries")
    if x is None and table is not None:
        raise ValueError("table needs x (its rows are subtracted from the coef-weighted x)")
    D = out.shape[-1] if out.dim() > 1 else 1
    if seg.entries == 0:
        return out
    xx = x.contiguous() if x is not None else coef
    cnt = count.contiguous() if count is not None else coef
    BLOCK_D = min(max(triton.next_power_of_2(D), 16), 128)
    _segment_kernel[(seg.entries, triton.cdiv(D, BLOCK_D))](
        seg.order, seg.rows, coef.contiguous(), cnt, xx, out if table is None else table.contiguous(), out,
        seg.entries, D, per_token, float(alpha), HAS_X=x is not None, COUNT=count is not None, SUB=table is not None,
        ACCUMULATE=accumulate, BLOCK_D=BLOCK_D)
    torch.autograd.graph.increment_version(out)  # a written table: autograd refuses a stale saved copy
    return out


def segment_sum_reference(out: Tensor, rows: Tensor, coef: Tensor, x: Tensor | None = None, *, per_token: int = 1,
                          alpha: float = 1.0, count: Tensor | None = None, table: Tensor | None = None,
                          accumulate: bool = False) -> Tensor:
    """The same with index_add, in float64 (the tests' reference)."""
    rows = rows.reshape(-1)
    E = rows.numel()
    tok = torch.arange(E, device=rows.device) // per_token
    flat = out.view(out.shape[0], -1)
    D = flat.shape[1]
    c = coef.reshape(-1).double()
    src = c[:, None] * (x.double()[tok] if x is not None else torch.ones(E, D, dtype=torch.float64, device=rows.device))
    acc = torch.zeros(flat.shape, dtype=torch.float64, device=rows.device).index_add_(0, rows, src)
    if table is not None:
        csum = torch.zeros(flat.shape[0], dtype=torch.float64, device=rows.device).index_add_(0, rows, c)
        acc -= csum[:, None] * table.reshape(flat.shape).double()
    scale = torch.full((flat.shape[0], 1), float(alpha), dtype=torch.float64, device=rows.device)
    if count is not None:
        n = torch.zeros(flat.shape[0], dtype=torch.float64, device=rows.device).index_add_(0, rows, count.double()[tok])
        scale = scale / n.clamp(min=1)[:, None]
    touched = torch.zeros(flat.shape[0], dtype=torch.bool, device=rows.device)
    touched[rows] = True
    new = acc * scale + (flat.double() if accumulate else 0)
    flat[touched] = new[touched].to(flat.dtype)
    return out
