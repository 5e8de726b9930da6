"""Muon's orthogonalisation: a quintic Newton–Schulz iteration, batched over leading dims.

For an update matrix G = U S Vᵀ (SVD), Muon replaces G by (approximately) U Vᵀ, the nearest
semi-orthogonal matrix: every singular value is pushed towards 1, the singular vectors kept.
With the Frobenius normalisation X₀ = G / (‖G‖_F + ε) every singular value starts in (0, 1],
and each step applies the odd matrix polynomial

    X ← a X + b (X Xᵀ) X + c (X Xᵀ)² X                 (on the wide orientation, m ≤ n)

with a fresh (a, b, c) per step. The five triples below are the tuned schedule that LaCT's
``lact_llm/lact_model/ttt_operation.py::zeropower_via_newtonschulz5`` uses (taken there from
Moonlight's / modded-nanogpt's Muon): aggressive early steps, gentler late ones. After
the five steps the singular values of a well-conditioned input end within a few percent of 1
(0.98-1.06 measured on Gaussian 16x16, 32x16, 16x48 matrices); singular values far below the
largest (σ/σ_max ≲ 1e-2) are raised less, which is what five steps buy. Tall matrices (m > n) are
iterated on their transpose, so the Gram matrix X Xᵀ is the small one.

The reference casts to bfloat16 for speed; here the iteration runs in the input's dtype
(LaCT's fast weights are kept in fp32 or wider), which also makes it testable in fp64.
"""

from __future__ import annotations

from torch import Tensor

#: (a, b, c) of each of the five Newton–Schulz steps
NS5_COEFFS: tuple[tuple[float, float, float], ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)


def newton_schulz5(G: Tensor, eps: float = 1e-7) -> Tensor:
    """Approximately orthogonalise every matrix of G [..., m, n] (returns U Vᵀ of G = U S Vᵀ,
    up to the iteration's error). Differentiable; the output has G's shape and dtype."""
    if G.dim() < 2:
        raise ValueError(f"newton_schulz5 expects matrices [..., m, n], got shape {tuple(G.shape)}")
    tall = G.shape[-2] > G.shape[-1]
    X = G.mT if tall else G
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)  # spectral norm <= Frobenius norm <= 1
    for a, b, c in NS5_COEFFS:
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.mT if tall else X
