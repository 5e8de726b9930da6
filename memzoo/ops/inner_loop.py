"""The inner loop of the test-time-training memories: a small network trained by gradient steps on
a regression loss as the sequence streams (TTT-Linear, TTT-MLP: memzoo/ops/ttt.py; Titans:
memzoo/layers/titans.py).

The per-token gradients are written out (the backward of a LayerNorm, a 2-layer MLP), not taken
with autograd: they are batched over the tokens of a mini-batch (one gradient per token, all at the
weights the mini-batch started from), they enter the slow weights' graph as ordinary tensors, and
the tests check them against `torch.autograd.grad` of the loss they claim to differentiate.

Shapes: the leading dims are [..., L, d] (tokens L of a head); weights are [..., d_in, d_out] and
act on row vectors, x W.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def layer_norm(z: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """LN(z) = γ ⊙ (z − μ)/σ + β over the last dim (biased variance): (out, ẑ, 1/σ)."""
    mu = z.mean(-1, keepdim=True)
    rstd = torch.rsqrt((z - mu).pow(2).mean(-1, keepdim=True) + eps)
    zhat = (z - mu) * rstd
    return zhat * weight + bias, zhat, rstd


def layer_norm_backward(dout: Tensor, zhat: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    """∂ℓ/∂z given ∂ℓ/∂LN(z) (the LayerNorm's backward to its input)."""
    g = dout * weight
    d = g.shape[-1]
    return (d * g - g.sum(-1, keepdim=True) - zhat * (g * zhat).sum(-1, keepdim=True)) * rstd / d


_C = math.sqrt(2 / math.pi)


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU, tanh approximation (TTT-MLP's)."""
    return 0.5 * x * (1 + torch.tanh(_C * (x + 0.044715 * x.pow(3))))


def gelu_tanh_grad(x: Tensor) -> Tensor:
    t = torch.tanh(_C * (x + 0.044715 * x.pow(3)))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _C * (1 + 3 * 0.044715 * x * x)


def silu_grad(x: Tensor) -> Tensor:
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


ACTIVATIONS = {"gelu": (gelu_tanh, gelu_tanh_grad), "silu": (torch.nn.functional.silu, silu_grad)}


def mlp_forward(x: Tensor, W1: Tensor, b1: Tensor | None, W2: Tensor, b2: Tensor | None, act: str):
    """y = act(x W1 + b1) W2 + b2: (y, z1 the pre-activation, h the hidden)."""
    z1 = x @ W1 if b1 is None else x @ W1 + b1
    h = ACTIVATIONS[act][0](z1)
    y = h @ W2 if b2 is None else h @ W2 + b2
    return y, z1, h


def mlp_backward(dy: Tensor, z1: Tensor, W2: Tensor, act: str) -> Tensor:
    """∂ℓ/∂z1 given ∂ℓ/∂y for `mlp_forward` (the gradients of the weights are then, per token,
    xᵀ ∂ℓ/∂z1 for W1, hᵀ ∂ℓ/∂y for W2, and the two themselves for the biases)."""
    return (dy @ W2.transpose(-1, -2)) * ACTIVATIONS[act][1](z1)
