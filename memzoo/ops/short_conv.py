"""The short convolution of GDN, MoM and the attention control: causal and depthwise.

    y_t = Σ_{j<c} w_j ⊙ x_{t-c+1+j}          (per channel; x padded on the left with c-1 inputs)

Written as c shifted multiply-adds rather than ``F.conv1d(groups=C)``: the same function (a
cross-correlation, as conv1d computes), which torch.compile fuses with the SiLU after it into
one kernel, forward and backward. On a CPU the grouped conv1d's backward is a slow path of its
own: ~6 ms for each [64, 67, 128] convolution of a GDN toy step (six a step, ~400 ms in all; one
thread, Intel Xeon). Compiled, one such convolution's forward and backward (bf16 autocast, SiLU
included) took 12.7 ms as conv1d and 8.2 ms as the multiply-adds.

The weights are stored taps first, ``w [c, C]`` (the transpose of conv1d's ``[C, 1, c]``), so that
tap j's C weights lie side by side, as the inputs' channels do: torch.compile's CPU code then runs
the multiply-adds in vector registers. With conv1d's layout the weight's stride along the channels
is c, and inductor wrote every loop that reads it as scalar code (a transposed copy made in the
graph is folded back into the strided read). Measured: docs/journal/performance.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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
