"""RMSNorm (Zhang & Sennrich 2019): y = x / sqrt(mean(x²) + eps) ⊙ w over the last dimension. One
function for every use: the backbone's pre-norms, the memories' per-head norms of the read (fla's
``RMSNorm`` / ``FusedRMSNormGated`` before the gate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.modules.precision import compute_dtype


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x², -1) + eps) ⊙ weight, in x's dtype."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x.dtype)


def gated_rms_norm(o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm(o) ⊙ silu(gate): the output gate of Gated DeltaNet (the backbone's mixer and the layer) and
    DeltaProduct (fla's ``FusedRMSNormGated``); in the inputs' dtypes, as the caller casts them."""
    return rms_norm(o, weight, eps) * F.silu(gate)


class RMSNorm(nn.Module):
    """`rms_norm` with a learned weight (ones at init), computed in >= fp32 and returned in the
    input's dtype (the backbone's norms under bf16 autocast)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x.to(compute_dtype(x)), self.weight, self.eps).to(x.dtype)
