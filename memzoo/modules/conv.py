"""The short causal depthwise convolution of GDN, the delta-rule layers, Mamba-2, MoM, Titans
and the attention control; its history streams across calls.

    y_t = Σ_{j<c} w_j ⊙ x_{t-c+1+j}          (per channel; x padded on the left with c-1 inputs)

Written as c shifted multiply-adds rather than ``F.conv1d(groups=C)``: the same function (a
cross-correlation, as conv1d computes), which torch.compile fuses with the SiLU after it into
one kernel, forward and backward, where the grouped conv1d's backward on a CPU is a slow path of
its own. The weights are stored taps first, ``w [c, C]`` (the transpose of conv1d's ``[C, 1, c]``),
so that tap j's C weights lie side by side, as the inputs' channels do, and torch.compile's CPU
code runs the multiply-adds in vector registers (with conv1d's layout it wrote scalar loops). The
measurements: docs/journal/performance.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.storage import load_transposed


def causal_conv(xp: Tensor, w: Tensor) -> Tensor:
    """xp [..., c-1+T, C] (the c-1 inputs before the first output, then T inputs), w [c, C] (taps
    first) -> y [..., T, C]. In xp's dtype (as a convolution under autocast: w is cast to it)."""
    c = w.shape[0]
    if xp.is_meta:  # FLOP counting (memzoo.flops): the same function as conv1d, which the counter prices
        y = F.conv1d(xp.flatten(0, -3).transpose(1, 2), w.to(xp.dtype).t()[:, None], groups=w.shape[1])
        return y.transpose(1, 2).unflatten(0, xp.shape[:-2])
    T = xp.shape[-2] - c + 1
    w = w.to(xp.dtype)
    return sum(xp[..., j : j + T, :] * w[j] for j in range(c))


def causal_conv_stream(u: Tensor, past: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """`causal_conv` of u [B, T, C] continuing from `past` [B, c-1, C] (the inputs before u): (y [B, T, C],
    the c-1 inputs a next call continues from)."""
    xp = torch.cat([past, u], dim=1)
    return causal_conv(xp, w), xp[:, xp.shape[1] - (w.shape[0] - 1):]


def conv_weights(channels: int, size: int) -> Tensor:
    """Weights for :func:`causal_conv`, taps first [size, channels], drawn as nn.Conv1d draws its
    depthwise [channels, 1, size] weight (kaiming-uniform, fan_in = size), from the same numbers."""
    w = nn.init.kaiming_uniform_(torch.empty(channels, 1, size), a=math.sqrt(5))
    return w[:, 0].t().contiguous()


class ShortConv(nn.Module):
    """Causal depthwise convolution + SiLU whose left context streams across calls (the backbone's
    GDN mixer and the attention control). Its weight is stored taps first, [size, dim], drawn as
    nn.Conv1d draws its [dim, 1, size] weight."""

    def __init__(self, dim: int, size: int = 4):
        super().__init__()
        self.size = size
        self.weight = nn.Parameter(conv_weights(dim, size))

    def forward(self, x: Tensor, past: Tensor | None) -> tuple[Tensor, Tensor]:
        """x [B, T, D]; past [B, size-1, D] = the previous call's last inputs (zeros at start)."""
        if past is None:
            past = x.new_zeros(x.shape[0], self.size - 1, x.shape[2])
        y, past = causal_conv_stream(x, past, self.weight)
        return F.silu(y), past.detach()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        load_transposed(state_dict, prefix + "weight", self.weight.shape)  # conv1d's [dim, 1, size] before
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
