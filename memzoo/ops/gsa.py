"""Gated Slot Attention's recurrence (Zhang et al. 2024, arXiv 2409.07146, Sec. 3): two passes of gated linear
attention joined by a softmax over the m slots, per head,

    Sk_t = Sk_{t-1} Diag(α_t) + k_t s_tᵀ            Sk = K̃ᵀ ∈ R^{K×m}   (the slots on its last axis)
    p_t  = softmax(Sk_tᵀ q_t)                        over the m slots     (no scale on the scores)
    Sv_t = Diag(α_t) Sv_{t-1} + s_t v_tᵀ            Sv = Ṽ ∈ R^{m×V}    (the slots on its first axis)
    o_t  = Sv_tᵀ p_t                                 (inclusive: token t reads its own write)

with the decay α_t ∈ (0, 1]^m given as log α_t and the write strength s_t given by the caller (GSA's
s_t = 1 − α_t: the op does not derive it). The first pass is linear attention with q, k, the value s
and a decay per value channel; the second with the query p, the key s, the value v and a decay per key
channel (:mod:`memzoo.ops.linear_attention`).

Two implementations, one result: :func:`gsa_chunked`, the two passes of
:func:`memzoo.ops.linear_attention.linear_attention_chunked` (pure torch, the reference), and fla's
``chunk_gsa`` (``fla.ops.gsa``), which computes the same two passes and the softmax in one op: its
``naive_recurrent_gsa`` is the recurrence above verbatim (hk = Sk [K, m], hv = Sv [m, V], g = log α on
the slot axis of both, s the written slot vector, scale on q, softmax over the slots). :func:`gsa` picks
one by the rule of :mod:`memzoo.ops.dispatch`.
"""

from __future__ import annotations

from torch import Tensor

from memzoo.ops.dispatch import use_fla
from memzoo.ops.linear_attention import linear_attention_chunked


def _check(q: Tensor, k: Tensor, v: Tensor, s: Tensor, log_alpha: Tensor, Sk: Tensor | None,
           Sv: Tensor | None) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must be [B, T, H, K] alike; got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V]; got {tuple(v.shape)}")
    if s.dim() != 4 or s.shape[:3] != (B, T, H) or log_alpha.shape != s.shape:
        raise ValueError(f"s and log_alpha must be [B, T, H, m] = [{B}, {T}, {H}, m] alike; "
                         f"got {tuple(s.shape)} and {tuple(log_alpha.shape)}")
    m, V = s.shape[-1], v.shape[-1]
    if Sk is not None and Sk.shape != (B, H, K, m):
        raise ValueError(f"Sk must be [B, H, K, m] = [{B}, {H}, {K}, {m}] or None; got {tuple(Sk.shape)}")
    if Sv is not None and Sv.shape != (B, H, m, V):
        raise ValueError(f"Sv must be [B, H, m, V] = [{B}, {H}, {m}, {V}] or None; got {tuple(Sv.shape)}")


def gsa_chunked(q: Tensor, k: Tensor, v: Tensor, s: Tensor, log_alpha: Tensor, Sk: Tensor | None = None,
                Sv: Tensor | None = None, chunk_size: int = 16) -> tuple[Tensor, Tensor, Tensor]:
    """The two passes (each token's write, then its read), chunked in torch: scores = Sk_tᵀ q_t by linear
    attention with the decay per value channel, then o_t = Sv_tᵀ softmax(scores_t) with the decay per key
    channel. Returns (o [B, T, H, V] in v's dtype, Sk [B, H, K, m], Sv [B, H, m, V])."""
    scores, Sk = linear_attention_chunked(q, k, s, None, Sk, chunk_size, log_decay_v=log_alpha)
    o, Sv = linear_attention_chunked(scores.softmax(-1), s, v, log_alpha, Sv, chunk_size)
    return o, Sk, Sv


def gsa(q: Tensor, k: Tensor, v: Tensor, s: Tensor, log_alpha: Tensor, Sk: Tensor | None = None,
        Sv: Tensor | None = None, chunk_size: int = 16, *, backend: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """:func:`gsa_chunked`'s result, from fla's ``chunk_gsa`` where `backend` picks it (the rule of
    :mod:`memzoo.ops.dispatch`), else from the torch path: one fused op for both passes and the softmax.

    Args:
        q, k: [B, T, H, K] (in feature space); v: [B, T, H, V].
        s: [B, T, H, m] the slots' write strength (GSA: 1 − α_t); log_alpha: [B, T, H, m] log α_t ≤ 0.
        Sk: [B, H, K, m] and Sv: [B, H, m, V], the initial states (None: zeros), e.g. a previous call's.
        chunk_size: tokens per chunk of the torch path (any value gives the same result); fla uses its own.
        backend: "auto" (fla's kernel on CUDA where it can run), "torch" or "fla".

    Returns:
        (o [B, T, H, V] in v's dtype, Sk, Sv): the final states in fp32 (fp64 for fp64 input).

    The glue: fla's states have memzoo's layouts (hk [K, m], hv [m, V]), so they pass as they are, in
    fp32; g = log α; scale 1 (fla's default is K^-1/2; memzoo's GSA, like fla's layer, has none).
    """
    _check(q, k, v, s, log_alpha, Sk, Sv)
    if not use_fla("gsa", k, backend) or k.shape[1] == 0:
        return gsa_chunked(q, k, v, s, log_alpha, Sk, Sv, chunk_size)
    from fla.ops.gsa import chunk_gsa  # lazy: only where fla runs

    h0 = None if Sk is None and Sv is None else (None if Sk is None else Sk.float(), None if Sv is None else Sv.float())
    o, (Sk, Sv) = chunk_gsa(q, k, v, s, log_alpha.float(), scale=1.0, initial_state=h0, output_final_state=True)
    return o.to(v.dtype), Sk, Sv
