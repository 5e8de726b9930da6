"""Gated delta rule (GDN): a pure-torch chunked reference, a token-by-token
definition, and a dispatcher that uses flash-linear-attention's kernel on CUDA.

The recurrence (Yang, Kautz & Hatamizadeh, "Gated Delta Networks"), in the
paper's notation with a [V, K] state S_t and alpha_t = exp(g_t):

    S_t = S_{t-1} (alpha_t (I - beta_t k_t k_t^T)) + beta_t v_t k_t^T
    o_t = S_t q_t                                       (times `scale`)

i.e. decay the memory by alpha_t, erase what it stores under key k_t (a delta
rule step with learning rate beta_t) and write v_t there. This module follows
flash-linear-attention's conventions instead: the state is stored transposed,
h_t = S_t^T of shape [K, V], and a step reads

    h'_t = exp(g_t) h_{t-1}                       # gate (decay)
    u_t  = beta_t (v_t - h'_t^T k_t)              # delta: target minus prediction
    h_t  = h'_t + k_t u_t^T                       # rank-1 write
    o_t  = scale * h_t^T q_t                      # read

Tensors are [B, T, H, K] (q, k), [B, T, H, V] (v), [B, T, H] (g, beta) and
[B, H, K, V] (states). g is a log-decay (<= 0), beta lies in (0, 1), and q and
k are expected to be L2-normalised by the caller (the mixer does it); nothing
here normalises them. scale defaults to K ** -0.5, as in fla.

Public functions:
    gated_delta_rule            dispatcher ("auto" -> fla on CUDA, else torch; "auto-compiled": the
                                torch path compiled where it runs on CUDA, for fixed-length callers)
    gated_delta_rule_chunked    chunked torch algorithm (the library reference)
    gated_delta_rule_recurrent  token-by-token loop (the readable definition)

All torch paths compute in fp32 (fp64 if any input is fp64), are differentiable
with plain autograd, and return o in v's dtype and the final state in the
compute dtype (fp32 for fp32/bf16/fp16 inputs).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from memzoo.modules.precision import compute_dtype
from memzoo.ops import dispatch
from memzoo.ops.dispatch import use_fla


# -----------------------------------------------------------------------------
# helpers

def _check_shapes(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, H):
            raise ValueError(f"{name} must be [B, T, H] = [{B}, {T}, {H}], got {tuple(x.shape)}")
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [B, H, K, V] = [{B}, {H}, {K}, {v.shape[-1]}], "
                         f"got {tuple(initial_state.shape)}")


# -----------------------------------------------------------------------------
# the readable definition: one token at a time

def gated_delta_rule_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Token-by-token gated delta rule. O(T) Python steps: the definition, not the fast path."""
    _check_shapes(q, k, v, g, beta, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    scale = K ** -0.5 if scale is None else scale

    # head-first, compute dtype: [B, H, T, *]
    q, k, v = (x.transpose(1, 2).to(dt) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).to(dt) for x in (g, beta))
    h = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)

    outs = []
    for t in range(T):
        k_t, v_t = k[:, :, t], v[:, :, t]                              # [B, H, K], [B, H, V]
        h = h * g[:, :, t].exp()[..., None, None]                       # h' = alpha_t h
        pred = torch.einsum("bhk,bhkv->bhv", k_t, h)                    # what the memory returns for k_t
        u_t = beta[:, :, t, None] * (v_t - pred)                        # delta-rule correction
        h = h + k_t[..., :, None] * u_t[..., None, :]                   # rank-1 write
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, :, t], h))

    o = torch.stack(outs, dim=2) if T > 0 else v.new_zeros(B, H, 0, V)
    o = o.transpose(1, 2).to(v.dtype if v.dtype.is_floating_point else dt)
    return o, (h if output_final_state else None)


# -----------------------------------------------------------------------------
# the chunked algorithm

def gated_delta_rule_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """Chunked gated delta rule in pure torch (WY / UT-transform form), exact up to fp rounding.

    Everything inside a chunk is batched matmuls over all chunks at once; only
    the [K, V] state is carried across chunks by a Python loop of length T / C.
    Non-finite input: a token whose q, k, v, g or beta is not finite (per head) is zeroed before
    the chunk algebra, and its output and every later one of its head, and the final state, are
    set to NaN at the end. The chunks then compute on finite numbers with plain masked matmuls
    (0 × NaN = NaN would carry a later token's NaN into every earlier row of a matmul), and a
    NaN/inf at position t leaves every output before t exactly as it was.
    """
    _check_shapes(q, k, v, g, beta, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    out_dtype = v.dtype if v.dtype.is_floating_point else dt
    scale = K ** -0.5 if scale is None else scale
    h0 = q.new_zeros(B, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    if T == 0:
        return v.new_zeros(B, 0, H, V, dtype=out_dtype), (h0 if output_final_state else None)

    # A sequence shorter than one chunk is one (smaller) chunk: no padding waste at decode time.
    C = min(chunk_size, T)
    N = -(-T // C)                      # number of chunks
    pad = N * C - T

    # non-finite tokens: zeroed here, their outputs poisoned at the end (docstring)
    # (one sum per token: non-finite iff an element is, short of finite values near the dtype's max)
    bad = ~(q.sum(-1, dtype=dt) + k.sum(-1, dtype=dt) + v.sum(-1, dtype=dt) + g.to(dt) + beta.to(dt)).isfinite()
    # eager on a CPU, asking whether there is one costs nothing and saves the masking (~10% of forward
    # and backward at the toys' shapes); on an accelerator it would wait for the device, and compiled it
    # would break the graph (where the masking is fused anyway), so there it masks always
    masked = bad.device.type != "cpu" or torch.compiler.is_compiling() or bool(bad.any())
    if masked:
        q, k, v = (x.where(~bad[..., None], 0) for x in (q, k, v))
        g, beta = (x.where(~bad, 0) for x in (g, beta))
        seen = bad.cumsum(1) > 0                                    # [B, T, H]: at or after one

    # head-first, compute dtype, then pad T up to N*C. Padded tokens have k = v = 0,
    # beta = 0 and g = 0 (no decay), so they leave the state untouched and the final
    # state stays exact; their outputs are dropped at the end.
    # (contiguous once here: every batched matmul below would otherwise copy its operands again)
    q, k, v = (x.transpose(1, 2).to(dt).contiguous() for x in (q, k, v))  # [B, H, T, *]
    g, beta = (x.transpose(1, 2).to(dt).contiguous() for x in (g, beta))  # [B, H, T]
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    q, k, v = (x.reshape(B, H, N, C, -1) for x in (q, k, v))       # [B, H, N, C, *]
    g, beta = (x.reshape(B, H, N, C) for x in (g, beta))           # [B, H, N, C]

    # ---- within-chunk quantities, all chunks at once ------------------------------
    # Let h be the state entering a chunk and G_r = g_1 + ... + g_r the cumulative
    # log-decay inside it (gamma_r = exp(G_r)). Unrolling the recurrence:
    #   h_r = gamma_r h + sum_{j<=r} exp(G_r - G_j) k_j u_j^T
    #   u_r = beta_r (v_r - k_r^T h'_r),   h'_r = gamma_r h + sum_{j<r} exp(G_r - G_j) k_j u_j^T
    # so the pseudo-values u solve the unit lower-triangular system
    #   (I + A) U = diag(beta) V - diag(beta gamma) K h,  A_rj = beta_r exp(G_r - G_j) k_r.k_j  (j < r)
    # giving the WY / UT-transform form  U = U0 - W h  with
    #   U0 = (I + A)^{-1} diag(beta) V,   W = (I + A)^{-1} diag(beta gamma) K,
    # both independent of h, hence computable for every chunk in parallel.
    G = g.cumsum(-1)                                                # [B, H, N, C]
    idx = torch.arange(C, device=q.device)
    # decay between positions j < r of a chunk; masked to -inf first so exp never overflows
    D_strict = (G[..., :, None] - G[..., None, :]).masked_fill(idx[:, None] <= idx[None, :], float("-inf")).exp()
    eye = torch.eye(C, dtype=dt, device=q.device)
    D = D_strict + eye                                              # j <= r: exp(G_r - G_r) = 1 exactly
    A = ((beta[..., None] * k) @ k.transpose(-1, -2)) * D_strict   # strictly lower; beta on [C, K], not [C, C]
    rhs = torch.cat([beta[..., None] * v, (beta * G.exp())[..., None] * k], dim=-1)  # [B, H, N, C, V+K]
    # (I + A)^{-1} first, then one batched matmul: solving for C columns instead of V + K is less
    # triangular-solve work, and on CPU the pair runs faster (forward and backward) than one solve
    inv = torch.linalg.solve_triangular(A + eye, eye.expand_as(A), upper=False, unitriangular=True)
    sol = inv @ rhs
    U0, W = sol[..., :V], sol[..., V:]                              # [B,H,N,C,V], [B,H,N,C,K]

    # Output of a chunk: o_r = scale (gamma_r q_r^T h + sum_{j<=r} exp(G_r - G_j) (q_r.k_j) u_j)
    P = (q @ k.transpose(-1, -2)) * D                               # scores, 0 for j > r (D is)
    q_dec = q * G.exp()[..., None]                                  # gamma_r q_r
    # State at the chunk end: h_C = gamma_C h + sum_j exp(G_C - G_j) k_j u_j^T
    k_dec = k * (G[..., -1:] - G).exp()[..., None]                  # exp(G_C - G_j) k_j
    chunk_decay = G[..., -1].exp()[..., None, None]                 # gamma_C: [B, H, N, 1, 1]

    # ---- inter-chunk recurrence: the only sequential part --------------------------
    # (unbind rather than [:, :, n] indexing: its backward is one stack, not N zero-filled copies)
    h = h0
    states, us = [], []
    for U0_n, W_n, kd_n, a_n in zip(U0.unbind(2), W.unbind(2), k_dec.unbind(2), chunk_decay.unbind(2)):
        states.append(h)                                            # state entering this chunk
        u = U0_n - W_n @ h                                          # its pseudo-values, [B, H, C, V]
        us.append(u)
        h = a_n * h + kd_n.transpose(-1, -2) @ u                    # state leaving it
    Hs = torch.stack(states, dim=2)                                 # [B, H, N, K, V]
    U = torch.stack(us, dim=2)                                      # [B, H, N, C, V]

    # ---- outputs, all chunks at once ------------------------------------------------
    o = scale * (q_dec @ Hs + P @ U)                                # [B, H, N, C, V]
    o = o.reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    if masked:
        o = o.where(~seen[..., None], float("nan"))
        h = h.where(~seen[:, -1, :, None, None], float("nan"))
    return o.to(out_dtype), (h if output_final_state else None)


# -----------------------------------------------------------------------------
# dispatcher

def _fla_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # lazy: only where fla runs

    if initial_state is not None:
        initial_state = initial_state.float()
    o, final_state = chunk_gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
    )
    return o.to(v.dtype), final_state


@functools.cache
def _compiled_chunked():
    """The chunked torch path under torch.compile (one graph per sequence length: the chunk loop
    unrolls), built on first use."""
    return torch.compile(gated_delta_rule_chunked)


#: shorter sequences (decoding, a prompt's tail) take the eager torch path: compiling each new
#: length would cost more than it saves
COMPILE_MIN_T = 64


def gdn_op(device: str | torch.device) -> str:
    """Which gated delta rule the GDN mixer ("auto-compiled") runs on `device`, in words (recorded
    with timed rows)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return "torch"
    why = dispatch.fla_unusable(dev.index)
    return f"torch, compiled ({why})" if why else "fla"


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Gated delta rule over a sequence: S_t = S_{t-1}(alpha_t (I - beta_t k_t k_t^T)) + beta_t v_t k_t^T.

    Args:
        q, k: [B, T, H, K], expected L2-normalised along K by the caller.
        v: [B, T, H, V].
        g: [B, T, H] log-decay (<= 0); alpha_t = exp(g_t).
        beta: [B, T, H] write strength in (0, 1).
        scale: query scale, default K ** -0.5.
        initial_state: [B, H, K, V] (fp32) state to start from, e.g. a previous call's final state.
        output_final_state: also return the [B, H, K, V] fp32 state after the last token.
        chunk_size: chunk length of the torch path (fla's kernel uses its own, 64).
        backend: "auto", "torch" or "fla" (the rule of :mod:`memzoo.ops.dispatch`); "auto-compiled"
            (as auto, but on CUDA the torch path runs compiled for sequences of COMPILE_MIN_T tokens
            or more, unless the caller is being compiled already: for callers whose lengths repeat,
            as the GDN mixer's in training, since each new length compiles a graph); or "compiled"
            (the torch path under torch.compile).

    Returns:
        (o [B, T, H, V] in v's dtype, final_state [B, H, K, V] fp32 or None).
    """
    if backend == "auto-compiled":
        backend = "fla" if use_fla("gated_delta_rule", q, "auto") else "compiled" if (
            q.is_cuda and q.shape[1] >= COMPILE_MIN_T and not torch.compiler.is_compiling()) else "torch"
    elif backend in ("auto", "fla"):
        backend = "fla" if use_fla("gated_delta_rule", q, backend) else "torch"
    if backend == "compiled":
        return _compiled_chunked()(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state, chunk_size=chunk_size)
    if backend == "torch":
        return gated_delta_rule_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                        output_final_state=output_final_state, chunk_size=chunk_size)
    if backend == "fla":
        _check_shapes(q, k, v, g, beta, initial_state)
        return _fla_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state)
    raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'auto-compiled', 'torch', 'compiled' or 'fla'")
