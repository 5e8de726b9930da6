"""The generalised delta rule with a diagonal-plus-low-rank transition, in pure torch.

    S_t = Diag(exp(gk_t)) S_{t-1} + b_t (a_tᵀ S_{t-1}) + k_t v_tᵀ        S ∈ R^{K×V} per head
    o_t = scale · S_tᵀ q_t

(fla's ``generalized_delta_rule/dplr``: the transition Diag(α_t) + b_t a_tᵀ acts on the state a
token finds; a is the vector it reads the state with, b the direction the read is written back
along.) Two memories of the zoo are this op with other names:

- RWKV-7 (Peng et al. 2025, Eq. 17): S_t = S_{t-1}(diag(w_t) − κ̂_tᵀ(a_t ⊙ κ̂_t)) + v_tᵀ k̃_t, in
  the [K, V] layout gk = log w, a = κ̂, b = −a ⊙ κ̂, k = k̃ (``memzoo.layers.rwkv7``);
- Kimi Delta Attention (arXiv 2510.26692, Eq. 1): S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t-1}
  + β_t k_t v_tᵀ, with a = α_t ⊙ k_t (since k_tᵀ Diag(α_t) S = (α_t ⊙ k_t)ᵀ S), b = −β_t k_t and
  the written key β_t k_t (``memzoo.layers.kda``).

A scalar decay and b = −β k, a = k is the gated delta rule, which has a faster op of its own
(:mod:`memzoo.ops.gated_delta_rule`, no [C, C, K] tensor).

The chunked form. Inside a chunk of C tokens let G_r = gk_1 + … + gk_r (per channel; G_0 = 0),
h the state entering it and u_r = S_{r-1}ᵀ a_r the V-vector each token reads. Unrolling,

    S_r = e^{G_r} ⊙ h + Σ_{j≤r} e^{G_r − G_j} ⊙ (b_j u_jᵀ + k_j v_jᵀ)
    u_r = hᵀ(a_r ⊙ e^{G_{r-1}}) + Σ_{j<r} [a_r·(e^{G_{r-1} − G_j} ⊙ b_j)] u_j + [a_r·(e^{G_{r-1} − G_j} ⊙ k_j)] v_j

so the reads solve a unit lower-triangular system, (I − M_ab) U = M_ak V + A h, and are affine in
h: U = U0 + W h, with U0 and W computed for every chunk at once; only h crosses the chunks. The
decays between two positions of a chunk, e^{G_{r-1} − G_j} (j < r, ≤ 1), are formed per channel as
a [C, C, K] tensor, never as e^{G} / e^{G}: a strong decay cannot overflow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from memzoo.modules.precision import compute_dtype, state_precision
from memzoo.ops.dispatch import use_fla



def _check(q, k, v, a, b, gk, initial_state) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got {tuple(q.shape)}")
    B, T, H, K = q.shape
    for name, x in (("k", k), ("a", a), ("b", b), ("gk", gk)):
        if x.shape != (B, T, H, K):
            raise ValueError(f"{name} must be [B, T, H, K] = [{B}, {T}, {H}, {K}], got {tuple(x.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] with B, T, H = {B}, {T}, {H}, got {tuple(v.shape)}")
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [B, H, K, V] = [{B}, {H}, {K}, {v.shape[-1]}], "
                         f"got {tuple(initial_state.shape)}")


def dplr_delta_rule(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, gk: Tensor, scale: float = 1.0,
                    initial_state: Tensor | None = None, output_final_state: bool = False,
                    chunk_size: int = 16, backend: str = "auto") -> tuple[Tensor, Tensor | None]:
    """Chunked DPLR delta rule (module docstring), exact up to rounding; or fla's
    ``chunk_dplr_delta_rule`` (`backend`: the rule of :mod:`memzoo.ops.dispatch`; fla's own chunk size).

    Args:
        q, k, a, b: [B, T, H, K]; v: [B, T, H, V]; gk: [B, T, H, K] log-decay per key channel (<= 0).
        scale: the read's scale.
        initial_state: [B, H, K, V], e.g. a previous call's final state.
        chunk_size: tokens per chunk of the torch path (any value gives the same result; memory grows as C²K).
        backend: "auto" (fla's kernel on CUDA where it can run), "torch" or "fla".

    Returns:
        (o [B, T, H, V] in v's dtype, the final state [B, H, K, V] in fp32 (fp64 for fp64 input) or None).

    A token whose inputs are not finite is zeroed before the chunk algebra, and its output, every
    later one of its head and the final state are NaN: 0 × NaN inside a chunk's matmuls would
    otherwise reach the outputs before it (as :func:`memzoo.ops.gated_delta_rule.gated_delta_rule_chunked`).
    """
    _check(q, k, v, a, b, gk, initial_state)
    if use_fla("dplr_delta_rule", q, backend) and q.shape[1] > 0:
        from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule  # lazy: only where fla runs

        o, S = chunk_dplr_delta_rule(q, k, v, a, b, gk, scale=scale, output_final_state=output_final_state,
                                     initial_state=None if initial_state is None else initial_state.float())
        return o.to(v.dtype), S
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = compute_dtype(q, k, v, a, b, gk, initial_state)
    h = q.new_zeros(B, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    if T == 0:
        return v.new_zeros(B, 0, H, V), (h if output_final_state else None)

    with state_precision(q.device):  # fp32 matmuls under autocast too: the state is the memory
        return _chunked(q, k, v, a, b, gk, scale, h, output_final_state, chunk_size, dt)


def _chunked(q, k, v, a, b, gk, scale, h, output_final_state, chunk_size, dt):
    B, T, H, K = q.shape
    V = v.shape[-1]
    xs = [x.to(dt) for x in (q, k, v, a, b, gk)]
    bad = ~sum(x.sum(-1) for x in xs).isfinite()                                  # [B, T, H]
    masked = bad.device.type != "cpu" or torch.compiler.is_compiling() or bool(bad.any())
    if masked:
        xs = [x.where(~bad[..., None], 0) for x in xs]
        seen = bad.cumsum(1) > 0
    C = min(chunk_size, T)
    N, pad = -(-T // C), -T % C
    # [B, H, N, C, *]; padded tokens (all zero) leave the state as it is
    q, k, v, a, b, gk = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)).reshape(B, H, N, C, -1) for x in xs)

    G = gk.cumsum(-2)                                                             # G_r
    Gp = G - gk                                                                   # G_{r-1}
    idx = torch.arange(C, device=q.device)
    strict = (idx[:, None] > idx[None, :])[..., None]                             # j < r
    # e^{G_{r-1} − G_j} for j < r, else 0: [B, H, N, C(r), C(j), K]
    E = (Gp[..., :, None, :] - G[..., None, :, :]).where(strict, float("-inf")).exp()
    M_ab = torch.einsum("...rc,...rjc,...jc->...rj", a, E, b)
    M_ak = torch.einsum("...rc,...rjc,...jc->...rj", a, E, k)
    eye = torch.eye(C, dtype=dt, device=q.device)
    Tinv = torch.linalg.solve_triangular(eye - M_ab, eye.expand_as(M_ab), upper=False, unitriangular=True)
    U0 = Tinv @ (M_ak @ v)                                                        # [.., C, V]
    W = Tinv @ (a * Gp.exp())                                                     # [.., C, K]
    # reads of the outputs: e^{G_r − G_j} = e^{gk_r} e^{G_{r-1} − G_j} (j < r), 1 on the diagonal
    qd = q * gk.exp()
    Q_b = torch.einsum("...rc,...rjc,...jc->...rj", qd, E, b) + torch.diag_embed((q * b).sum(-1))
    Q_k = torch.einsum("...rc,...rjc,...jc->...rj", qd, E, k) + torch.diag_embed((q * k).sum(-1))
    q_h = q * G.exp()                                                             # e^{G_r} ⊙ q_r
    to_end = (G[..., -1:, :] - G).exp()                                           # e^{G_C − G_j}
    b_end, k_end, decay = b * to_end, k * to_end, G[..., -1, :].exp()[..., None]  # decay: [B, H, N, K, 1]

    states, us = [], []
    for U0_n, W_n, be, ke, d, v_n in zip(U0.unbind(2), W.unbind(2), b_end.unbind(2), k_end.unbind(2),
                                         decay.unbind(2), v.unbind(2)):
        states.append(h)
        u = U0_n + W_n @ h
        us.append(u)
        h = d * h + be.transpose(-1, -2) @ u + ke.transpose(-1, -2) @ v_n
    Hs, U = torch.stack(states, 2), torch.stack(us, 2)
    o = scale * (q_h @ Hs + Q_b @ U + Q_k @ v)
    o = o.reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    if masked:
        o = o.where(~seen[..., None], float("nan"))
        h = h.where(~seen[:, -1, :, None, None], float("nan"))
    return o.to(v.dtype), (h if output_final_state else None)
