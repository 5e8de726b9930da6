"""TTT-MLP (Sun et al. 2024, arXiv 2407.04620, Sec. 2.7): TTT-Linear with a 2-layer MLP as its hidden
state's model,

    f(x; W) = x + LN(GELU(x W1 + b1) W2 + b2)            hidden 4d, GELU (tanh approximation)

trained and read exactly as TTT-Linear (memzoo/layers/ttt_linear.py: the loss, mini-batch GD, the
learnable inner learning rate, the output, the departures from the release), with the release's
smaller base learning rate (0.1). The dual form runs layer by layer (:mod:`memzoo.ops.ttt`): the
second layer's with the query's hidden state under its own updated first layer, dotted with the
keys' hidden states under W_0.

The pairs adapter is TTT-Linear's (the same loss, op and neutral settings: lr = base_lr / d, here
0.1 / d); read_keys returns k + LN(GELU(k W1 + b1) W2 + b2), the inner MLP's reconstruction of v.
"""

from __future__ import annotations

from typing import ClassVar

from memzoo.layers.ttt_linear import TTTLinear
from memzoo.registration import register_layer


@register_layer("ttt_mlp")
class TTTMLP(TTTLinear):
    """TTT-MLP as a memory layer. Args as TTT-Linear's, and `expansion`: the hidden size is
    expansion × head_dim (4); base_lr defaults to 0.1."""

    inner: ClassVar[str] = "mlp"
    act: ClassVar[str] = "gelu"
    bench_cost = 2.0

    def __init__(self, d_model: int, num_heads: int = 4, head_dim: int | None = None, mini_batch_size: int = 16,
                 base_lr: float = 0.1, expansion: int = 4, norm_eps: float = 1e-6):
        if expansion < 1:
            raise ValueError(f"expansion must be >= 1, got {expansion}")
        self.expansion = expansion
        super().__init__(d_model, num_heads, head_dim, mini_batch_size, base_lr, norm_eps)

    def inner_shapes(self) -> dict[str, tuple[int, int]]:
        d, h = self.head_dim, self.expansion * self.head_dim
        return {"W1": (d, h), "b1": (1, h), "W2": (h, d), "b2": (1, d)}
