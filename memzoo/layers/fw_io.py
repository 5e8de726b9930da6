"""The slow-weight shell shared by FwPKM and FwMLP (FwPKM paper Sec. 3.4-3.5, App. A).

Around a fast-weight memory f(q; θ) that predicts the next token's value:

    q_t, v_t, g_t = Linear^{q,v,g}(RMSNorm^{q,v,g}(h_t))      Eq. 26 (g through a sigmoid)
    v_t          <- zscore(v_t)                                Sec. 3.4.3, target value normalisation
    o_t           = g_t f(q_t) + (1 - g_t) v_t                 Eq. 33 (value residual, Sec. 3.4.1)
    o'_t          = Linear^o(RMSNorm^o(o_t))                   Eq. 34

and the write pairs each query with the next position's value (lookahead, Sec. 3.4.2),
weighted by g_t (Sec. 3.2.2). Each switch exists for the paper's App. B ablations.
Linear layers carry biases and the gate is a scalar per token, as in the authors' release.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from memzoo.modules.norm import RMSNorm


def zscore(v: Tensor, eps: float = 1e-6) -> Tensor:
    """Zero mean, unit (unbiased) standard deviation over the feature dimension (Sec. 3.4.3)."""
    if v.numel() == 0:  # no tokens (T = 0): nothing to normalise
        return v
    return (v - v.mean(-1, keepdim=True)) / (v.std(-1, keepdim=True) + eps)


class FastWeightIO(nn.Module):
    def __init__(
        self,
        d_model: int,
        query_dim: int,
        value_dim: int,
        gating: bool = True,
        value_norm: bool = True,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        self.gating, self.value_norm = gating, value_norm
        self.q_norm, self.q_proj = RMSNorm(d_model, norm_eps), nn.Linear(d_model, query_dim)
        self.v_norm, self.v_proj = RMSNorm(d_model, norm_eps), nn.Linear(d_model, value_dim)
        if gating:
            self.g_norm, self.g_proj = RMSNorm(d_model, norm_eps), nn.Linear(d_model, 1)
        self.o_norm, self.o_proj = RMSNorm(value_dim, norm_eps), nn.Linear(value_dim, d_model)

    def project(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Eq. 26: queries [B, T, Dq], (normalised) values [B, T, Dv], gates [B, T] or None."""
        q = self.q_proj(self.q_norm(h))
        v = self.v_proj(self.v_norm(h))
        if self.value_norm:
            v = zscore(v)
        g = torch.sigmoid(self.g_proj(self.g_norm(h))).squeeze(-1) if self.gating else None
        return q, v, g

    def output(self, v_hat: Tensor, v: Tensor, g: Tensor | None) -> Tensor:
        """Eqs. 33-34. Without gating the prediction and the value residual are added."""
        o = v_hat + v if g is None else g.unsqueeze(-1) * v_hat + (1 - g.unsqueeze(-1)) * v
        return self.o_proj(self.o_norm(o))


def write_pairs(q: Tensor, v: Tensor, g: Tensor | None, lookahead: bool, gate_weighted: bool):
    """What a chunk writes: queries, their targets and per-pair loss weights.

    With lookahead (Eq. 22) q_t is paired with v_{t+1} inside the chunk, so the chunk's last
    token writes nothing (as in the authors' release: pairs never straddle a chunk boundary,
    which keeps chunked streaming exact). Weights are g_t (Eq. 35) or 1.
    """
    if lookahead:
        q, tgt, g = q[:, :-1], v[:, 1:], (None if g is None else g[:, :-1])
    else:
        tgt = v
    w = g if (gate_weighted and g is not None) else torch.ones(q.shape[:2], dtype=q.dtype, device=q.device)
    return q, tgt, w


def finite_tokens(*xs: Tensor | None) -> Tensor:
    """[B, T] mask of the tokens whose every input ([B, T] or [B, T, D]) is finite."""
    ok = None
    for x in xs:
        if x is not None:
            f = torch.isfinite(x) if x.dim() == 2 else torch.isfinite(x).all(-1)
            ok = f if ok is None else ok & f
    return ok


def from_variant(variants: dict, variant: str, **given) -> dict:
    """The paper/release options (FwPKM, FwMLP): each given value, or where it is None the
    value `variant` takes (`variants[variant]`)."""
    if variant not in variants:
        raise ValueError(f"variant must be one of {sorted(variants)}, got {variant!r}")
    return {k: variants[variant][k] if v is None else v for k, v in given.items()}
