"""The Mesa layer's read (von Oswald et al. 2025, "MesaNet: Sequence Modeling by Locally Optimal Test-Time
Training", arXiv 2506.05233): the solution of a regularised least-squares problem over the sequence so far,
by conjugate gradient (pure torch).

Per head, with keys k_t ∈ R^K, values v_t ∈ R^V, queries q_t ∈ R^K, an input strength β_t ∈ (0, 1), a
forget strength γ_t ∈ (0, 1) and a regulariser Λ = Diag(λ), λ ∈ R^K_{>0} (the Mesa rule, Eq. 5):

    H_t = γ_t H_{t-1} + β_t k_t k_tᵀ                    H_t ∈ R^{K×K}   the keys' second moment
    G_t = γ_t G_{t-1} + β_t k_t v_tᵀ                    G_t ∈ R^{K×V}   (the paper's G_t = Σ v kᵀ, transposed)
    q*_t = (H_t + Λ)^{-1} q_t                           the linear solve, by conjugate gradient
    o_t = G_tᵀ q*_t                                     the read: Φ_t q_t with Φ_t = argmin of the
                                                         γ-discounted, β-weighted squared error + ‖Φ Λ^½‖²

Both sums are the shared op :mod:`memzoo.ops.linear_attention` with a per-head decay log γ_t: H_t is the
op's state for keys β_t k_t and values k_t, G_t for keys β_t k_t and values v_t; and (H_t + Λ) p_t for every
t at once is the op's inclusive read with queries p_t (plus λ ⊙ p_t). From one conjugate-gradient step to the
next only the queries change, so the chunk-start memories H_n and the intra-chunk decays are built once per
solve and each step is a few batched matmuls per chunk; no H_t is ever materialised per token (the paper's
chunkwise-parallel solve).

The solve. Conjugate gradient for a fixed number of steps, per token (each t solves its own system,
vectors along the last dimension), as fla's references and kernels run it (``fla/ops/mesa_net/naive.py``
``naive_mesa_net_CG``, ``chunk_cg_solver_fwd.py``): x_0 = 0, and a stabiliser ε = 1e-5 in the step size's
and the direction update's denominators (α = δ / (pᵀAp + ε), β = δ' / (δ + ε)), so a converged
system (δ → 0) takes steps of 0 instead of 0/0. The gradient through the solve is the implicit one,
as fla's kernel computes it (``chunk_cg_solver_bwd.py``): for x = A^{-1} q with A symmetric and an upstream
gradient g, u = A^{-1} g by the same conjugate gradient; ∂q = u, and every parameter θ of A gets
−uᵀ (∂A/∂θ) x (for H_t: −u_t x_tᵀ spread over the keys, β and γ that built it). Where the solve has
converged this is the exact gradient of (H_t + Λ)^{-1} q_t; the iterations are not differentiated.

- :func:`conjugate_gradient` — the iteration, for any symmetric positive-definite matvec.
- :func:`mesa_solve` — x = A^{-1} q with the implicit gradient (a matvec built from tensors).
- :func:`mesa_chunked` — the whole inclusive read over a sequence from an initial (H_0, G_0): (o, H_T, G_T);
  or fla's ``chunk_mesa_net`` where :mod:`memzoo.ops.dispatch` picks it (the same rule, CG and implicit gradient).
- :func:`mesa_step_read` — every token's read from one memory (H, G) plus the token's own write only.
- :func:`mesa_recurrent` — the reference: a token loop of Eq. 5 with the exact solve (``torch.linalg.solve``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from memzoo.ops.dispatch import use_fla
from memzoo.ops.linear_attention import linear_attention_chunked, linear_attention_final_state

#: the stabiliser of the conjugate gradient's two divisions (fla's references and kernels)
CG_EPS = 1e-5


def conjugate_gradient(matvec: Callable[[Tensor], Tensor], b: Tensor, steps: int, eps: float = CG_EPS) -> Tensor:
    """x ≈ A^{-1} b after `steps` conjugate-gradient steps from x_0 = 0, for every vector along b's last
    dimension at once (A = matvec, symmetric positive definite, acting on that dimension):

        r = b, p = r, δ = rᵀr;  each step:  α = δ / (pᵀAp + ε),  x += α p,  r −= α Ap,
        δ' = rᵀr,  p = r + δ' / (δ + ε) p,  δ = δ'                  (ε = `eps`, fla's CG_EPS by default)

    With ε > 0 a residual far below √ε is no longer reduced at the conjugate-gradient rate (the steps
    shrink with δ / ε); ε = 0 is the textbook iteration, exact after K steps in exact arithmetic.
    """
    x = torch.zeros_like(b)
    r = b
    p = r
    delta = (r * r).sum(-1, keepdim=True)
    for _ in range(steps):
        Ap = matvec(p)
        alpha = delta / ((p * Ap).sum(-1, keepdim=True) + eps)
        x = x + alpha * p
        r = r - alpha * Ap
        delta_new = (r * r).sum(-1, keepdim=True)
        p = r + (delta_new / (delta + eps)) * p
        delta = delta_new
    return x


class _Solve(torch.autograd.Function):
    """x = A(θ)^{-1} q by conjugate gradient; backward: u = A^{-1} ∂x by conjugate gradient, ∂q = u,
    ∂θ = ∂/∂θ of −uᵀ A(θ) x at fixed u and x (A symmetric)."""

    @staticmethod
    def forward(ctx, matvec, steps, eps, q, *params):
        x = conjugate_gradient(lambda p: matvec(p, *params), q, steps, eps)
        ctx.matvec, ctx.steps, ctx.eps = matvec, steps, eps
        ctx.save_for_backward(x, *params)
        return x

    @staticmethod
    def backward(ctx, gx):
        x, *params = ctx.saved_tensors
        with torch.no_grad():
            u = conjugate_gradient(lambda p: ctx.matvec(p, *params), gx, ctx.steps, ctx.eps)
        need = ctx.needs_input_grad[4:]
        grads: list[Tensor | None] = [None] * len(params)
        if any(need):
            leaves = [p.detach().requires_grad_(n) for p, n in zip(params, need)]
            with torch.enable_grad():
                f = -(u * ctx.matvec(x, *leaves)).sum()
                wanted = [l for l, n in zip(leaves, need) if n]
                got = iter(torch.autograd.grad(f, wanted, allow_unused=True))
            grads = [next(got) if n else None for n in need]
        return (None, None, None, u if ctx.needs_input_grad[3] else None, *grads)


def mesa_solve(matvec: Callable[..., Tensor], q: Tensor, params: tuple[Tensor, ...], steps: int,
               eps: float = CG_EPS) -> Tensor:
    """x = A^{-1} q, A = ``matvec(·, *params)`` symmetric positive definite and linear in its first
    argument, by `steps` conjugate-gradient steps; differentiable in q and params by the implicit
    gradient (module docstring). A tensor of `params` that needs no gradient gets none."""
    return _Solve.apply(matvec, steps, eps, q, *params)


def _chunks(x: Tensor, C: int) -> Tensor:
    """[B, T, H, *] -> [B, H, N, C, *] (T padded with zeros to N·C)."""
    B, T, H = x.shape[:3]
    N = -(-T // C)
    if N * C > T:
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, N * C - T))
    return x.reshape(B, N, C, H, *x.shape[3:]).transpose(1, 3).transpose(2, 3)


def _unchunk(x: Tensor, T: int) -> Tensor:
    """[B, H, N, C, *] -> [B, T, H, *] (the padding dropped)."""
    B, H, N, C = x.shape[:4]
    return x.transpose(2, 3).transpose(1, 3).reshape(B, N * C, H, *x.shape[4:])[:, :T]


def _sequence_operator(k: Tensor, beta: Tensor, log_gamma: Tensor, H0: Tensor,
                       C: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """What p ↦ H_t p_t for every t needs, in chunks of C tokens, computed once per solve (none of it
    depends on p): the keys β k [B, H, N, C, K]; the keys k split as ``memzoo.ops.linear_attention.causal_matmul``
    splits its values (the finite part, and the carry of non-finite entries); the intra-chunk decays exp(b_t − b_s) [B, H, N, C, C] (0 for s > t);
    exp(b_t) on the read of the chunk's start memory; and those memories H_n [B, H, N, K, K] (b = cumulative
    log γ inside the chunk: the linear-attention op's chunked form, memzoo/ops/linear_attention.py, with
    queries p, keys β k and values k). Returns (those tensors, H_T)."""
    kb, kc = _chunks(beta[..., None] * k, C), _chunks(k, C)
    b = _chunks(log_gamma[..., None], C)[..., 0].cumsum(-1)  # [B, H, N, C]; padding has log γ = 0
    causal = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    decay = (b[..., :, None] - b[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # masked before exp
    writes = (kb * (b[..., -1:] - b)[..., None].exp()).mT @ kc  # Σ_s exp(b_C − b_s) β_s k_s k_sᵀ per chunk
    H, starts = H0.to(kb.dtype), []
    for n in range(kb.shape[2]):  # a loop over chunks, not tokens
        starts.append(H)
        H = b[:, :, n, -1].exp()[..., None, None] * H + writes[:, :, n]
    starts = torch.stack(starts, 2) if starts else H.new_zeros(*H.shape[:2], 0, *H.shape[2:])
    ok = kc.isfinite()
    return (kb, kc.where(ok, 0), kc.where(~ok, 0).cumsum(-2), decay, b.exp()[..., None], starts), H


def _sequence_matvec(p: Tensor, kb: Tensor, kc: Tensor, carry: Tensor, decay: Tensor, read_decay: Tensor,
                     starts: Tensor, lam: Tensor) -> Tensor:
    """(H_t + Λ) p_t for every t of p [B, T, H, K] on :func:`_sequence_operator`'s tensors: the read of the
    chunk's start memory, exp(b_t) H_nᵀ p_t, plus the chunk's own writes up to t,
    Σ_{s≤t} exp(b_t − b_s) (p_t · β_s k_s) k_s (selected causally as ``causal_matmul`` does, so a NaN at token s
    stays out of the reads before s), plus λ ⊙ p_t. p is chunked afresh each time, so its padding
    is always 0 and never enters the solve (a zero vector is 0/0 at ε = 0)."""
    pc = _chunks(p, decay.shape[-1])
    intra = ((pc @ kb.mT) * decay).tril() @ kc + carry
    return _unchunk(intra + read_decay * (pc @ starts), p.shape[1]) + lam * p


def _fla_mesa_unsupported(k: Tensor, v: Tensor, eps: float) -> str | None:
    """Why fla's ``chunk_mesa_net`` does not compute this call of :func:`mesa_chunked`, or None."""
    K, V = k.shape[-1], v.shape[-1]
    if eps != CG_EPS:
        return f"a conjugate-gradient stabiliser eps={eps} (fla's kernels fix it at {CG_EPS})"
    if K != V:
        return f"keys and values of different widths (K={K}, V={V}; fla's chunk_mesa_net needs K = V)"
    if K > 128:
        return f"a head width K={K} (fla's conjugate-gradient kernel takes K <= 128)"
    return None


def mesa_chunked(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_gamma: Tensor, lam: Tensor, H0: Tensor,
                 G0: Tensor, steps: int, chunk_size: int = 64, eps: float = CG_EPS, *,
                 backend: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """The Mesa read of every token, inclusive (token t's own write is in H_t and G_t), from (H_0, G_0):
    q, k [B, T, H, K], v [B, T, H, V], β and log γ [B, T, H], λ [H, K], H_0 [B, H, K, K], G_0 [B, H, K, V].
    Returns (o [B, T, H, V], H_T, G_T). One chunked linear attention per conjugate-gradient step.

    Or fla's ``chunk_mesa_net`` where `backend` picks it (the rule of :mod:`memzoo.ops.dispatch`): the same
    H_t, G_t (g = log γ, natural log; β and λ = Diag(λ) per head; scale 1; states [K, K] and [K, V] read as
    pᵀH), the same `steps` conjugate-gradient steps from x_0 = 0 with ε = 1e-5, and the same implicit
    gradient; fla's own chunk size (any chunk size is exact). Calls with another ε, K ≠ V or K > 128 keep
    the torch path, and so do fp32 calls under "auto" (bf16/fp16 ones, as under autocast, take fla). fla computes at a fixed precision whatever the inputs': q and k rounded to fp16, the
    chunks' G states in bf16, the backward's solve returned in fp16 (``ChunkMesaNetFunction``,
    ``chunk_mesa_fwd_h``, ``chunk_mesa_cg_bwd``), so it agrees with the torch path to fp16/bf16 rounding,
    not to fp32's. The glue, both for agreement with the torch path's gradient: H_T is the torch write
    (:func:`linear_attention_final_state`, one einsum), and ∂H_0 is transposed: fla's backward gives −Σ_t e^{b_t} u_t x_tᵀ, the transpose of the
    implicit gradient −Σ_t e^{b_t} x_t u_tᵀ of its own forward p ↦ H_0ᵀ p (the two agree on the
    symmetric directions, the only ones an H built by writes moves in)."""
    unsupported = _fla_mesa_unsupported(k, v, eps) or (
        "an fp32 call (fla's chunk_mesa_net computes at fp16/bf16 precision; backend='fla' takes it anyway)"
        if backend == "auto" and k.dtype == torch.float32 else None)
    if not use_fla("mesa_chunked", k, backend, unsupported) or k.shape[1] == 0:
        return _mesa_chunked_torch(q, k, v, beta, log_gamma, lam, H0, G0, steps, chunk_size, eps)
    from fla.ops.mesa_net import chunk_mesa_net  # lazy: only where fla runs

    h_kk = H0.detach() + (H0 - H0.detach()).mT  # the value H_0, its gradient transposed (docstring)
    o, _, G = chunk_mesa_net(q, k, v, log_gamma.float(), beta.float(), lam.float(), h_kk_init=h_kk.float(),
                             h_kv_init=G0.float(), output_final_state=True, max_CG_iteration=steps)
    H = linear_attention_final_state(beta[..., None] * k, k, log_gamma, H0)
    return o.to(v.dtype), H, G


def _mesa_chunked_torch(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_gamma: Tensor, lam: Tensor, H0: Tensor,
                        G0: Tensor, steps: int, chunk_size: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`mesa_chunked`'s torch path: the solve on the operator built once (:func:`_sequence_operator`),
    then the read G_tᵀ q*_t by the chunked op."""
    operator, H = _sequence_operator(k, beta, log_gamma, H0, min(chunk_size, max(q.shape[1], 1)))
    q_star = mesa_solve(_sequence_matvec, q, (*operator, lam.to(q.dtype)), steps, eps)
    o, G = linear_attention_chunked(q_star, beta[..., None] * k, v, log_gamma, G0, chunk_size=chunk_size)
    return o, H, G


def _step_matvec(p: Tensor, H: Tensor, k: Tensor, beta: Tensor, log_gamma: Tensor, lam: Tensor) -> Tensor:
    """(γ_t H + β_t k_t k_tᵀ + Λ) p_t for every t: the memory H before each token plus that token's own write
    (Hᵀ p_t, as the op reads a state: the same for the symmetric H every write builds)."""
    Hp = torch.einsum("bhji,bthj->bthi", H, p)
    return log_gamma.exp()[..., None] * Hp + (beta * (k * p).sum(-1))[..., None] * k + lam * p


def mesa_step_read(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_gamma: Tensor, lam: Tensor, H: Tensor,
                   G: Tensor, steps: int, eps: float = CG_EPS) -> Tensor:
    """Every token's read from the same memory (H, G) plus its own write only: with H'_t = γ_t H + β_t k_t k_tᵀ
    and G'_t = γ_t G + β_t k_t v_tᵀ, o_t = G'_tᵀ (H'_t + Λ)^{-1} q_t (Eq. 5 for one step from (H, G)); shapes as
    :func:`mesa_chunked`'s. Nothing is written: token t's read ignores the tokens before it in q.

    Torch only: fla's one-token op (``mesa_net_decoding_one_step``) starts its solve from the Jacobi guess
    q / (diag H + λ + 1e-5), not from 0, so after a fixed number of steps it is another function (and it
    takes one token per call, with no backward)."""
    lam = lam.to(q.dtype)
    q_star = mesa_solve(_step_matvec, q, (H, k, beta, log_gamma, lam), steps, eps)
    o = torch.einsum("bhkv,bthk->bthv", G, q_star)
    return log_gamma.exp()[..., None] * o + (beta * (k * q_star).sum(-1))[..., None] * v


def mesa_recurrent(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_gamma: Tensor, lam: Tensor,
                   H0: Tensor | None = None, G0: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Reference: Eq. 5 a token at a time with the exact solve, H_t = γ_t H_{t-1} + β_t k_t k_tᵀ,
    G_t = γ_t G_{t-1} + β_t k_t v_tᵀ, o_t = G_tᵀ (H_t + Λ)^{-1} q_t. Returns (o, H_T, G_T)."""
    B, T, Hh, K = k.shape
    V = v.shape[-1]
    H = k.new_zeros(B, Hh, K, K) if H0 is None else H0
    G = k.new_zeros(B, Hh, K, V) if G0 is None else G0
    Lam = torch.diag_embed(lam.to(k.dtype))
    outs = []
    for t in range(T):
        g = log_gamma[:, t].exp()[..., None, None]
        kb = beta[:, t, :, None] * k[:, t]
        H = g * H + kb[..., :, None] * k[:, t, :, None, :]
        G = g * G + kb[..., :, None] * v[:, t, :, None, :]
        q_star = torch.linalg.solve(H + Lam, q[:, t])
        outs.append(torch.einsum("bhk,bhkv->bhv", q_star, G))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, Hh, V)
    return o, H, G
