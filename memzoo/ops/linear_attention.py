"""Causal linear attention with an optional decay, per head or per key channel (pure torch).

This is the fast-weight recurrence shared by the linear-attention / fast-weight-programmer
layer (Schlag et al. 2021), retention-style decayed variants, and Ba et al.'s fast weights:

    S_t = λ_t S_{t-1} + k_t v_tᵀ                 (write: outer-product update, decay λ_t ∈ (0, 1])
    S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ            (or a decay per key channel, α_t ∈ (0, 1]^K: GLA)
    S_t = S_{t-1} Diag(β_t) + k_t v_tᵀ            (and/or per value channel, β_t ∈ (0, 1]^V: GSA's first pass)
    o_t = q_tᵀ S_t                                (read: inclusive — position t sees its own write)

with, per batch element and head, ``S_t ∈ R^{K×V}``. Inputs are given in "feature space":
any feature map (elu+1, L2-normalisation, ...) has already been applied to ``q`` and ``k``.
The decay is passed as its logarithm, ``log_decay = log λ_t ≤ 0`` (``None`` means λ_t = 1,
plain linear attention), so products of decays are sums of logs and never underflow to
0/0 in the parallel form.

Shapes (B batch, T time, H heads, K key dim, V value dim):

    q, k         [B, T, H, K]
    v            [B, T, H, V]
    log_decay    [B, T, H] (λ_t, a scalar per head: RetNet, Mamba-2's SSD), [B, T, H, K] (α_t, one
                 decay per key channel, scaling row i of S: GLA's Diag(α_t)), or None
    log_decay_v  [B, T, H, V] (β_t, one decay per value channel, scaling column j of S: the slots of
                 Gated Slot Attention's first pass, whose decaying axis is the one read out), or None;
                 a keyword, with or without log_decay (S_t = Diag(α_t) S_{t-1} Diag(β_t) + k_t v_tᵀ)
    state        [B, H, K, V]     (initial_state may be None = zeros)

Three entry points, all returning new tensors (never in place), differentiable (and
:func:`linear_attention`, the dispatcher the layers call: fla's chunk kernel on CUDA, else the chunked form):

- :func:`linear_attention_recurrent` — the reference: a Python loop over t, the equations verbatim.
- :func:`linear_attention_chunked` — the parallel form used in practice. With the cumulative
  log decay inside a chunk, ``b_t = Σ_{s≤t} log λ_s``,

      o_t = exp(b_t) q_tᵀ S_0  +  Σ_{s≤t} exp(b_t − b_s) (q_t·k_s) v_s          (inter + intra chunk)
      S_C = exp(b_C) S_0       +  Σ_{s≤C} exp(b_C − b_s) k_s v_sᵀ               (state carried on)

  intra-chunk terms are a masked ``q kᵀ`` matrix times a decay matrix, applied to the values
  by :func:`causal_matmul`; the state is carried across chunks by a short loop over
  ``T / chunk_size`` chunks. With a decay per key channel, b_t ∈ R^K and the decays move inside
  the products: ``o_t = (q_t ⊙ exp(b_t))ᵀ S_0 + Σ_{s≤t} (Σ_i q_ti k_si exp(b_ti − b_si)) v_s`` and
  ``S_C = Diag(exp(b_C)) S_0 + Σ_s (k_s ⊙ exp(b_C − b_s)) v_sᵀ`` (GLA Sec. 4.2's chunkwise form,
  with the decay differences taken per pair (t, s), so every exponent is ≤ 0 and nothing overflows).
  A decay per value channel (c_t = Σ_{s≤t} log β_s ∈ R^V) is the same on the other axis: every term
  reaching o_t from s is scaled by ``exp(c_t − c_s)`` per value channel (a [C, C, V] tensor per chunk),
  the read of S_0 by ``exp(c_t)``, the write by ``v_s ⊙ exp(c_C − c_s)``, and the columns of S by ``exp(c_C)``.
- :func:`linear_attention_final_state` — only ``S_T`` (what a pure ``write`` needs), one einsum.

A normalised read (Katharopoulos et al. 2020, ``o_t = q_tᵀS_t / q_tᵀz_t`` with
``z_t = λ_t z_{t-1} + k_t``) is obtained by appending a column of ones to ``v``: the last
column of the state is then ``z`` and the last output column is the denominator.

Computation runs in at least float32 (half-precision inputs are upcast); outputs are cast
back to the input dtype, states are returned in the compute dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from memzoo.modules.precision import compute_dtype
from memzoo.ops.dispatch import use_fla


def _check(q: Tensor | None, k: Tensor, v: Tensor, log_decay: Tensor | None, initial_state: Tensor | None,
           log_decay_v: Tensor | None = None):
    if k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"k and v must be [B, T, H, K] and [B, T, H, V]; got {tuple(k.shape)} and {tuple(v.shape)}")
    B, T, H, K = k.shape
    if q is not None and q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape [B, T, H, K]; got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V]; got {tuple(v.shape)}")
    if log_decay is not None and log_decay.shape not in ((B, T, H), (B, T, H, K)):
        raise ValueError(f"log_decay must be [B, T, H] = [{B}, {T}, {H}] (per head), [B, T, H, K] = "
                         f"[{B}, {T}, {H}, {K}] (per key channel) or None; got {tuple(log_decay.shape)}")
    V = v.shape[-1]
    if log_decay_v is not None and log_decay_v.shape != v.shape:
        raise ValueError(f"log_decay_v must be [B, T, H, V] = [{B}, {T}, {H}, {V}] (per value channel) or None; "
                         f"got {tuple(log_decay_v.shape)}")
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        raise ValueError(
            f"initial_state must be [B, H, K, V] = [{B}, {H}, {K}, {V}] or None; got {tuple(initial_state.shape)}"
        )
    return B, T, H, K, V


def causal_matmul(scores: Tensor, values: Tensor, diagonal: int = 0) -> Tensor:
    """``tril(scores, diagonal) @ values`` over the last two dims (row t sums the values of
    rows s ≤ t + diagonal, diagonal ≤ 0), causal under non-finite input.

    A matmul with a 0/1-masked score matrix multiplies every *later* value by its masked score
    0, and 0 × NaN = NaN reaches all earlier rows. Here ``tril`` selects the scores (whatever
    lies above the diagonal is dropped), the matmul sees the values with non-finite entries
    zeroed, and a cumulative sum carries those entries to the rows allowed to see them. With
    finite values the carry is 0 and the result is the masked matmul exactly.
    """
    ok = values.isfinite()
    carry = values.where(~ok, 0).cumsum(-2)
    if diagonal:
        carry = torch.nn.functional.pad(carry, (0, 0, -diagonal, 0))[..., : values.shape[-2], :]
    return scores.tril(diagonal) @ values.where(ok, 0) + carry


def linear_attention_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor | None = None,
    initial_state: Tensor | None = None,
    *,
    log_decay_v: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Reference recurrence, one token at a time: ``S_t = λ_t S_{t-1} + k_t v_tᵀ; o_t = q_tᵀ S_t``
    (``S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ`` with a decay per key channel; ``S_{t-1} Diag(β_t)`` with one
    per value channel).

    Returns ``(o [B, T, H, V], final_state [B, H, K, V])``.
    """
    B, T, H, K, V = _check(q, k, v, log_decay, initial_state, log_decay_v)
    dt = compute_dtype(q, k, v, log_decay, initial_state, log_decay_v)
    out_dtype = v.dtype
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    outs = []
    for t in range(T):
        if log_decay is not None and log_decay.dim() == 4:  # Diag(α_t): row i of S times α_ti
            S = log_decay[:, t].to(dt).exp()[..., None] * S
        elif log_decay is not None:
            S = log_decay[:, t].to(dt).exp()[..., None, None] * S
        if log_decay_v is not None:  # Diag(β_t) on the right: column j of S times β_tj
            S = S * log_decay_v[:, t].to(dt).exp()[..., None, :]
        S = S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o.to(out_dtype), S


def linear_attention_final_state(
    k: Tensor,
    v: Tensor,
    log_decay: Tensor | None = None,
    initial_state: Tensor | None = None,
    *,
    log_decay_v: Tensor | None = None,
) -> Tensor:
    """Only the state after the whole sequence (a pure write):

        S_T = exp(b_T) S_0 + Σ_s exp(b_T − b_s) k_s v_sᵀ,   b_t = Σ_{r≤t} log λ_r
        S_T = Diag(exp(b_T)) S_0 + Σ_s (exp(b_T − b_s) ⊙ k_s) v_sᵀ       (a decay per key channel)
        S_T = S_0 Diag(exp(c_T)) + Σ_s k_s (exp(c_T − c_s) ⊙ v_s)ᵀ       (per value channel, c_t = Σ log β)

    Every exponent is ≤ 0, so this is stable for any T. Returns ``[B, H, K, V]``.
    """
    B, T, H, K, V = _check(None, k, v, log_decay, initial_state, log_decay_v)
    dt = compute_dtype(k, v, log_decay, initial_state, log_decay_v)
    k, v = k.to(dt), v.to(dt)
    if log_decay_v is not None:  # the column decays fold into v and S_0; the rows' below are unchanged
        c = log_decay_v.to(dt).cumsum(dim=1)  # [B, T, H, V]
        c_T = c[:, -1:] if T > 0 else c.new_zeros(B, 1, H, V)
        v = v * (c_T - c).exp()
        if initial_state is not None:
            initial_state = initial_state.to(dt) * c_T[:, 0, :, None, :].exp()
    if log_decay is None:
        S = torch.einsum("bthk,bthv->bhkv", k, v)
        if initial_state is not None:
            S = initial_state.to(dt) + S
        return S
    b = log_decay.to(dt).cumsum(dim=1)  # [B, T, H] or [B, T, H, K]
    b_T = b[:, -1:] if T > 0 else b.new_zeros(B, 1, *b.shape[2:])
    w = (b_T - b).exp()  # exp(b_T - b_s) in (0, 1]
    if log_decay.dim() == 4:
        S = torch.einsum("bthk,bthv->bhkv", k * w, v)
        if initial_state is not None:
            S = b_T[:, 0].exp()[..., None] * initial_state.to(dt) + S
        return S
    S = torch.einsum("bthk,bth,bthv->bhkv", k, w, v)
    if initial_state is not None:
        S = b_T[:, 0].exp()[..., None, None] * initial_state.to(dt) + S
    return S


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor | None = None,
    initial_state: Tensor | None = None,
    chunk_size: int = 64,
    *,
    log_decay_v: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """What the layers call: :func:`linear_attention_chunked`'s result from fla's chunk kernel where
    `backend` picks it (the rule of :mod:`memzoo.ops.dispatch`), else from the torch path. fla's
    ``chunk_simple_gla`` serves no decay and a decay per head, ``chunk_gla`` a decay per key channel,
    both with scale 1 (q is given in feature space) and fla's own chunk size; a decay per value
    channel (`log_decay_v`, GSA's first pass) has no fla kernel here and keeps the torch path."""
    unsupported = "a decay per value channel (log_decay_v) has no fla kernel here" if log_decay_v is not None else None
    if not use_fla("linear_attention", k, backend, unsupported) or k.shape[1] == 0:
        return linear_attention_chunked(q, k, v, log_decay, initial_state, chunk_size, log_decay_v=log_decay_v)
    _check(q, k, v, log_decay, initial_state, log_decay_v)
    h0 = None if initial_state is None else initial_state.float()
    if log_decay is not None and log_decay.dim() == 4:
        from fla.ops.gla import chunk_gla  # lazy: only where fla runs

        o, S = chunk_gla(q, k, v, log_decay.float(), scale=1.0, initial_state=h0, output_final_state=True)
    else:
        from fla.ops.simple_gla import chunk_simple_gla

        g = None if log_decay is None else log_decay.float()
        o, S = chunk_simple_gla(q, k, v, g, scale=1.0, initial_state=h0, output_final_state=True)
    return o.to(v.dtype), S


def linear_attention_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor | None = None,
    initial_state: Tensor | None = None,
    chunk_size: int = 64,
    *,
    log_decay_v: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Chunked parallel form; equal to :func:`linear_attention_recurrent` up to rounding.

    Within a chunk of length C (positions t, s relative to the chunk start, b = cumulative
    log decay inside the chunk):

        o_t = exp(b_t) q_tᵀ S_0 + Σ_{s≤t} exp(b_t − b_s) (q_t·k_s) v_s
        S_C = exp(b_C) S_0      + Σ_s exp(b_C − b_s) k_s v_sᵀ

    With a decay per key channel, b_t ∈ R^K: ``q_t·k_s`` becomes ``Σ_i q_ti k_si exp(b_ti − b_si)``
    (a [C, C, K] decay tensor per chunk), ``exp(b_t) q_t`` and ``exp(b_C − b_s) k_s`` are elementwise,
    and the state's rows decay by ``exp(b_C)``. With a decay per value channel, c_t ∈ R^V: the term
    from s to o_t is ``(q_t·k_s) exp(c_t − c_s) ⊙ v_s`` (a [C, C, V] tensor per chunk, selected causally
    as :func:`causal_matmul` selects), the read of S_0 is scaled by ``exp(c_t)``, the write takes
    ``exp(c_C − c_s) ⊙ v_s``, and the state's columns decay by ``exp(c_C)``.

    T need not be a multiple of ``chunk_size``: the tail is padded with k = v = 0 and
    λ = 1, which leaves the state unchanged. The causal mask is applied by selection
    (``masked_fill`` on the decays, :func:`causal_matmul` on scores and values), never by
    multiplying with 0, so a NaN/inf at position t leaves every output before t finite.
    Returns ``(o [B, T, H, V], final_state [B, H, K, V])``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    B, T, H, K, V = _check(q, k, v, log_decay, initial_state, log_decay_v)
    dt = compute_dtype(q, k, v, log_decay, initial_state, log_decay_v)
    out_dtype = v.dtype
    S = q.new_zeros(B, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    if T == 0:
        return v.new_zeros(B, 0, H, V), S
    C = min(chunk_size, T)
    N = -(-T // C)
    pad = N * C - T

    def prep(x: Tensor) -> Tensor:  # [B, T, H, *] -> [B, H, N, C, *]
        x = x.to(dt)
        if pad:
            x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(B, N, C, H, *x.shape[3:]).transpose(1, 3).transpose(2, 3)

    qc, kc, vc = prep(q), prep(k), prep(v)  # [B, H, N, C, K|V]
    per_key = log_decay is not None and log_decay.dim() == 4
    if per_key:
        b = prep(log_decay).cumsum(dim=-2)  # [B, H, N, C, K]; prep pads with log α = 0 (α = 1)
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        diff = b[..., :, None, :] - b[..., None, :, :]  # b_t - b_s per channel: [B, H, N, C, C, K]
        diff = diff.masked_fill(~causal[..., None], float("-inf"))  # masked before exp: never overflows
        attn = torch.einsum("bhntk,bhnsk,bhntsk->bhnts", qc, kc, diff.exp())
        q_in = qc * b.exp()  # exp(b_t) ⊙ q_t: reads the chunk's initial state
        k_out = kc * (b[..., -1:, :] - b).exp()  # exp(b_C - b_s) ⊙ k_s: writes the state
        chunk_decay = b[..., -1, :].exp()[..., None]  # Diag(exp(b_C)) [B, H, N, K, 1]
    else:
        attn = qc @ kc.transpose(-1, -2)  # [B, H, N, C, C]; causal_matmul keeps its lower triangle
        q_in, k_out, chunk_decay = qc, kc, None
    if log_decay is not None and not per_key:
        ld = log_decay.to(dt)
        if pad:
            ld = torch.nn.functional.pad(ld, (0, 0, 0, pad))  # λ = 1 on padding
        b = ld.reshape(B, N, C, H).permute(0, 3, 1, 2).cumsum(dim=-1)  # [B, H, N, C]
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        diff = b[..., :, None] - b[..., None, :]  # b_t - b_s, masked before exp so it never overflows
        attn = attn * diff.masked_fill(~causal, float("-inf")).exp()
        q_in = qc * b[..., None].exp()  # exp(b_t) q_t: reads the chunk's initial state
        k_out = kc * (b[..., -1:] - b)[..., None].exp()  # exp(b_C - b_s) k_s: writes the state
        chunk_decay = b[..., -1].exp()  # exp(b_C) [B, H, N]
    if log_decay_v is not None:  # a decay per value channel on top of the scores: [B, H, N, C, C, V]
        c = prep(log_decay_v).cumsum(dim=-2)  # [B, H, N, C, V]; padded with log β = 0
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()[..., None]
        diff_v = (c[..., :, None, :] - c[..., None, :, :]).masked_fill(~causal, float("-inf"))
        scores = torch.where(causal, attn[..., None] * diff_v.exp(), 0)  # selected: later NaNs never reach t
        ok = vc.isfinite()
        o_intra = torch.einsum("bhntsv,bhnsv->bhntv", scores, vc.where(ok, 0)) + vc.where(~ok, 0).cumsum(-2)
        v_out = vc * (c[..., -1:, :] - c).exp()  # exp(c_C - c_s) ⊙ v_s: writes the state
        read_decay, col_decay = c.exp(), c[..., -1, :].exp()  # exp(c_t) on the read of S_0; exp(c_C) on S's columns
    else:
        o_intra = causal_matmul(attn, vc)  # [B, H, N, C, V]
        v_out, read_decay, col_decay = vc, None, None
    kv = k_out.transpose(-1, -2) @ v_out  # per-chunk write Σ_s exp(b_C - b_s) k_s v_sᵀ: [B, H, N, K, V]

    o_inter = []
    for n in range(N):
        o_inter.append(q_in[:, :, n] @ S if read_decay is None else (q_in[:, :, n] @ S) * read_decay[:, :, n])
        if per_key:
            S = chunk_decay[:, :, n] * S
        elif chunk_decay is not None:
            S = chunk_decay[:, :, n, None, None] * S
        if col_decay is not None:
            S = S * col_decay[:, :, n, None, :]
        S = S + kv[:, :, n]
    o = o_intra + torch.stack(o_inter, dim=2)  # [B, H, N, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(out_dtype), S
