"""The decay gates' inits: Mamba-2's (Dao & Gu 2024) time step and decay rate, which Mamba-2,
Gated DeltaNet (the backbone's mixer and the layer), DeltaProduct and KDA draw alike.

    log α_t = −exp(A_log) · softplus(W_a x_t + dt_bias)        A = exp(A_log) ~ U(a_range), softplus(dt_bias) ~ logU(1e-3, 1e-1)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

#: Gated DeltaNet's range of A (fla's ``uniform_(0, 16)``, kept off 0 so that log A is finite)
GDN_A_RANGE = (1e-4, 16.0)
#: Mamba-2's own range of A (its ``A_init_range``)
MAMBA2_A_RANGE = (1.0, 16.0)


def dt_bias_init(n: int) -> Tensor:
    """n time-step biases: softplus(dt_bias) ~ logU(1e-3, 1e-1) (dt_bias the inverse softplus of dt)."""
    dt = torch.exp(torch.rand(n) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))


def mamba2_decay_init(n: int, a_range: tuple[float, float] = GDN_A_RANGE) -> tuple[Tensor, Tensor]:
    """(A_log, dt_bias) of n gates: A ~ U(a_range), then `dt_bias_init` (in this order of draws)."""
    lo, hi = a_range
    return torch.empty(n).uniform_(lo, hi).log(), dt_bias_init(n)


def gated_log_decay(a: Tensor, A_log: Tensor, dt_bias: Tensor) -> Tensor:
    """log α_t = −exp(A_log) · softplus(a_t + dt_bias), in a's dtype: the decay of Gated DeltaNet (the
    backbone's mixer and the layer) and DeltaProduct, a per head of a_t = W_a x_t [..., H]."""
    return -A_log.to(a.dtype).exp() * F.softplus(a + dt_bias.to(a.dtype))
