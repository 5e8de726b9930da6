"""Log-linear attention (Guo, Yang, Goel, Xing, Dao & Kim 2025, "Log-Linear Attention", arXiv 2506.04761) with a
decay per head: the prefix before each query split into its Fenwick-tree buckets, one state per bucket,
each bucket read with a weight of its own (pure torch).

For a query at position t, the keys s ≤ t fall into levels (the paper's Fenwick partition, Sec. 3):

    ℓ(t, s) = 0                              s = t           (the token itself)
    ℓ(t, s) = bit_length(t XOR s)            s < t           (the bucket of the highest bit where they differ)

so level ℓ ≥ 1 holds the 2^{ℓ-1} keys of t's bucket for bit ℓ−1 (present when that bit of t is set), and
a prefix of length t holds at most bit_length(t) buckets. With a decay a_t per head (Mamba-2's gates) and a
weight λ_t^ℓ per query, level and head, the output (the paper's quadratic form of log-linear Mamba-2,
O = (Q Kᵀ ⊙ M^S ⊙ M^H) V, M^S the decay mask, M^H the hierarchical mask):

    o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} (Π_{r=s+1..t} a_r) (q_t·k_s) v_s

and its recurrent (Fenwick) form keeps one state per level, S^ℓ = Σ_{s in bucket ℓ} (Π a) k_s v_sᵀ:

    o_t = Σ_ℓ λ_t^ℓ S_t^{ℓ ᵀ} q_t,     S_t^0 = k_t v_tᵀ,   S_t^ℓ = a_t S_{t-1}^ℓ (ℓ ≥ 1)
    after t: the token and the levels 1..c merge into level c+1, c the number of trailing ones of t
    (t + 1 in binary: the carry), the other levels kept.

Here the state after n tokens is kept as an array of levels 1..L−1 (zero where the bucket is empty), with
n alongside: every bucket of that state is an aligned block [a, a + 2^{ℓ-1}) of positions, and any such
block before a later position P lies inside exactly one of P's buckets, the level bit_length(P XOR a). So
a call of T tokens from the state at n needs no token loop: the carried buckets are read and merged by
that rule, the call's own keys by ℓ(t, s). Shapes (B batch, T time, H heads, N key dim, P value dim, L levels):

    q, k      [B, T, H, N]         v [B, T, H, P]         log_a [B, T, H] (log a_t ≤ 0)
    lam       [B, T, H, L]         λ_t^ℓ for ℓ = 0 .. L−1
    S         [B, H, L−1, N, P]    the levels 1 .. L−1 (level ℓ at index ℓ−1)      pos [B] (n, int64)

- :func:`log_linear_chunk` — one call: the outputs (the intra-call keys as a masked matrix, applied with the
  causal selection of :func:`memzoo.ops.linear_attention.causal_matmul`; the carried levels read per query)
  and the state after it (the merge as :func:`memzoo.ops.linear_attention.linear_attention_final_state`
  over the levels as heads, per-head decay). Cost O(T² + T·L) per call: the layer calls it per chunk.
- :func:`log_linear_attention` — a whole call, what the layer's forward runs: :func:`log_linear_chunk` a chunk
  at a time (its [C, C] masks stay small), or fla's ``chunk_log_linear_attn`` for the call's own keys where
  :mod:`memzoo.ops.dispatch` picks it.
- :func:`log_linear_recurrent` — the reference: the Fenwick recurrence a token at a time.
"""

from __future__ import annotations

import torch
from torch import Tensor

from memzoo.ops.dispatch import use_fla
from memzoo.ops.linear_attention import causal_matmul, linear_attention_final_state

#: fla's ``chunk_log_linear_attn``: its state dimension comes in blocks of BLOCK_K = 64, and its chunk
#: levels stop at 2^17 tokens ("Sequence length must be less than 2**17")
FLA_BLOCK_K, FLA_MAX_T = 64, 2**17


def bit_length(x: Tensor, bits: int) -> Tensor:
    """The bit length of non-negative int64 x (0 for 0), for x < 2^bits: the count of b < bits with x >> b > 0."""
    out = torch.zeros_like(x)
    for b in range(bits):
        out = out + ((x >> b) > 0).to(x.dtype)
    return out


def fenwick_level(t: Tensor, s: Tensor, bits: int) -> Tensor:
    """ℓ(t, s) for s ≤ t: 0 where s = t, else bit_length(t XOR s) (int64 positions, < 2^bits)."""
    return bit_length(torch.bitwise_xor(t, s), bits)


def bucket_starts(pos: Tensor, levels: int) -> Tensor:
    """The first position of the bucket of each level 1..levels held at n = pos: n with its bits below ℓ
    cleared, ((n >> ℓ) << ℓ) — [B, levels] (a level whose bit of n is 0 holds nothing)."""
    ell = torch.arange(1, levels + 1, device=pos.device)
    return (pos[:, None] >> ell) << ell


def log_linear_chunk(q: Tensor | None, k: Tensor, v: Tensor, log_a: Tensor, lam: Tensor | None, S: Tensor,
                     pos: Tensor) -> tuple[Tensor | None, Tensor]:
    """T tokens at positions pos, pos + 1, ... from the state (S, pos): (o [B, T, H, P] or None without q,
    the levels after them [B, H, L−1, N, P]). See the module docstring; the caller moves pos on by T."""
    B, T, H, N = k.shape
    Lh = S.shape[2]  # levels 1 .. L-1
    bits = Lh + 1
    dt = S.dtype
    q = None if q is None else q.to(dt)
    k, v, log_a = k.to(dt), v.to(dt), log_a.to(dt)
    p = pos[:, None] + torch.arange(T, device=k.device)  # [B, T] absolute positions
    b = log_a.cumsum(1)  # [B, T, H]
    starts = bucket_starts(pos, Lh)  # [B, L-1]
    o = None
    if q is not None:
        lam = lam.to(dt)
        lam_h = lam.permute(0, 2, 1, 3)  # [B, H, T, L]
        # the call's own keys: λ_t^{ℓ(t,s)} exp(b_t − b_s) (q_t·k_s), s ≤ t (the rest dropped by selection)
        lvl = fenwick_level(p[:, :, None], p[:, None, :], bits).clamp(max=Lh)  # [B, T, T]
        w = lam_h.gather(-1, lvl[:, None].expand(B, H, T, T))  # [B, H, T, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=k.device).tril()
        bh = b.permute(0, 2, 1)  # [B, H, T]
        decay = (bh[..., :, None] - bh[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        scores = torch.einsum("bthn,bshn->bhts", q, k) * decay * w
        o = causal_matmul(scores, v.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)  # [B, T, H, P]
        # the carried levels: level j's bucket lies in the query's bucket bit_length(p_t XOR a_j)
        lvl0 = fenwick_level(p[:, :, None], starts[:, None, :], bits).clamp(max=Lh)  # [B, T, L-1]
        w0 = lam.gather(-1, lvl0[:, :, None, :].expand(B, T, H, Lh))  # [B, T, H, L-1]
        read = torch.einsum("bthn,bhjnp->bthjp", q, S)
        o = o + b.exp()[..., None] * (w0[..., None] * read).sum(3)
    # the state after the call, at P = pos + T: each key and each carried level to its bucket of P
    P = (pos + T)[:, None]
    one_hot = torch.arange(1, Lh + 1, device=k.device)
    key_level = fenwick_level(P, p, bits)  # [B, T], >= 1 (s < P)
    mk = (key_level[..., None] == one_hot).to(dt)  # [B, T, L-1]
    carried = fenwick_level(P, starts, bits)  # [B, L-1]
    mc = (carried[..., None] == one_hot).to(dt)  # [B, j, m]
    S0 = torch.einsum("bjm,bhjnp->bhmnp", mc, S)
    k_lv = (k[:, :, :, None, :] * mk[:, :, None, :, None]).flatten(2, 3)  # [B, T, H·(L-1), N]
    v_lv = v[:, :, :, None, :].expand(B, T, H, Lh, v.shape[-1]).flatten(2, 3)
    g_lv = log_a[..., None].expand(B, T, H, Lh).flatten(2, 3)
    S_new = linear_attention_final_state(k_lv, v_lv, g_lv, S0.flatten(1, 2)).unflatten(1, (H, Lh))
    return o, S_new


def _fla_log_linear_unsupported(k: Tensor, v: Tensor, S: Tensor, pos: Tensor) -> str | None:
    """Why fla's ``chunk_log_linear_attn`` does not give this call's own-key outputs, or None."""
    T, N, P, L = k.shape[1], k.shape[-1], v.shape[-1], S.shape[2] + 1
    m = (T - 1).bit_length()  # the call's own levels: ℓ(t, s) <= bit_length(T - 1)
    if N % FLA_BLOCK_K:
        return f"a key width N={N} (fla's chunk_log_linear_attn takes multiples of {FLA_BLOCK_K})"
    if P & (P - 1):
        return f"a value width P={P} (fla's chunk_log_linear_attn takes powers of two)"
    if T > FLA_MAX_T:
        return f"{T} tokens in one call (fla's chunk_log_linear_attn takes fewer than {FLA_MAX_T})"
    if m > L - 1:
        return (f"{T} tokens reach level {m}, past the {L} levels of λ (this op weighs them by λ^(L-1), "
                f"fla's kernel by 0)")
    if bool((pos % (1 << m)).any()):
        return (f"a call of {T} tokens from a position that is not a multiple of 2^{m} (fla counts levels from "
                f"the call's first token, equal to the absolute positions' only there)")
    return None


def log_linear_attention(q: Tensor, k: Tensor, v: Tensor, log_a: Tensor, lam: Tensor, S: Tensor, pos: Tensor,
                         chunk_size: int = 64, *, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """T tokens at positions pos, pos + 1, ... from the state (S, pos): (o [B, T, H, P], the levels after them
    [B, H, L−1, N, P]), shapes and math as :func:`log_linear_chunk`'s, which the torch path runs a `chunk_size`
    of tokens at a time. The caller moves pos on by T.

    Or, where `backend` picks it (the rule of :mod:`memzoo.ops.dispatch`), the part of o from the call's own
    keys, Σ_{s≤t in the call} λ_t^{ℓ(t,s)} e^{b_t − b_s} (q_t·k_s) v_s, from fla's ``chunk_log_linear_attn``
    (the same Fenwick levels ℓ, 0 the token itself; g = log a, natural log, per head; λ [B, T, H, L] per
    query, head and level; scale 1; started from no state), and the rest as the torch path computes it: the
    read of the carried levels S (skipped where S is zero and needs no gradient) and the levels after the
    call (the pure write of :func:`log_linear_chunk`, q = None), chunk by chunk. fla numbers positions from
    the call's first token and its state (``LogLinearAttentionState``: chunk levels plus the raw inputs of a
    partial chunk, no backward through it) is not this op's levels, hence that split. The split is exact
    where the call's levels are fla's: every pos a multiple of 2^m, m = bit_length(T − 1) (a fresh state,
    or a stream in power-of-two segments), and m <= L − 1; other calls, and fla's limits on N, P and T,
    keep the torch path."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    B, T, H, _ = k.shape
    dt = S.dtype
    if T == 0:
        return v.new_zeros(B, 0, H, v.shape[-1], dtype=dt), S
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    unsupported = None if backend == "torch" else _fla_log_linear_unsupported(k, v, S, pos)  # (a host sync)
    if not use_fla("log_linear_attention", k, backend, unsupported):
        outs = []
        for a in range(0, T, chunk_size):
            o, S = log_linear_chunk(q[:, a:a + chunk_size], k[:, a:a + chunk_size], v[:, a:a + chunk_size],
                                    log_a[:, a:a + chunk_size], lam[:, a:a + chunk_size], S, pos + a)
            outs.append(o)
        return torch.cat(outs, dim=1), S
    from fla.ops.log_linear_attn import chunk_log_linear_attn  # lazy: where fla runs

    o, _ = chunk_log_linear_attn(q, k, v, log_a.float(), lam.float(), scale=1.0)
    o = o.to(dt)
    Lh = S.shape[2]
    if S.requires_grad or bool(S.any()):  # the carried levels, read by every query: log_linear_chunk's read
        b = log_a.to(dt).cumsum(1)  # [B, T, H]
        starts = bucket_starts(pos, Lh)
        reads = []
        for a in range(0, T, chunk_size):
            p = pos[:, None] + torch.arange(a, min(a + chunk_size, T), device=k.device)
            lvl0 = fenwick_level(p[:, :, None], starts[:, None, :], Lh + 1).clamp(max=Lh)  # [B, C, L-1]
            lam_c = lam[:, a:a + chunk_size].to(dt)
            w0 = lam_c.gather(-1, lvl0[:, :, None, :].expand(*lam_c.shape[:3], Lh))  # [B, C, H, L-1]
            read = torch.einsum("bthn,bhjnp->bthjp", q[:, a:a + chunk_size], S)
            reads.append(b[:, a:a + chunk_size].exp()[..., None] * (w0[..., None] * read).sum(3))
        o = o + torch.cat(reads, dim=1)
    for a in range(0, T, chunk_size):  # the levels after the call: the pure write
        _, S = log_linear_chunk(None, k[:, a:a + chunk_size], v[:, a:a + chunk_size], log_a[:, a:a + chunk_size],
                                None, S, pos + a)
    return o, S


def log_linear_recurrent(q: Tensor, k: Tensor, v: Tensor, log_a: Tensor, lam: Tensor, S: Tensor,
                         pos: int) -> tuple[Tensor, Tensor]:
    """Reference: the Fenwick recurrence a token at a time (module docstring) from the levels S at position
    pos (an int): decay every level by a_t, read Σ_ℓ λ_t^ℓ S^ℓᵀ q_t with S^0 = k_t v_tᵀ, then merge the token
    and the levels 1..c (c the trailing ones of t) into level c + 1. Returns (o [B, T, H, P], S after)."""
    outs = []
    for i in range(k.shape[1]):
        t = pos + i
        S = log_a[:, i].exp()[:, :, None, None, None] * S
        own = k[:, i, :, :, None] * v[:, i, :, None, :]  # [B, H, N, P]
        o = lam[:, i, :, 0, None] * torch.einsum("bhn,bhnp->bhp", q[:, i], own)
        o = o + torch.einsum("bhj,bhn,bhjnp->bhp", lam[:, i, :, 1:], q[:, i], S)
        outs.append(o)
        c = 0
        while (t >> c) & 1:
            c += 1
        if c >= S.shape[2]:
            raise ValueError(f"position {t + 1} needs level {c + 1}: more levels than the state's {S.shape[2]}")
        merged = own + S[:, :, :c].sum(2)
        S = torch.cat([torch.zeros_like(S[:, :, :c]), merged[:, :, None], S[:, :, c + 1:]], dim=2)
    return torch.stack(outs, dim=1), S
