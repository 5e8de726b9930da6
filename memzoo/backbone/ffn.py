"""The backbone's channel mixer: the SwiGLU FFN (Table 3). (Its RMSNorm: memzoo.modules.norm.)"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class SwiGLU(nn.Module):
    """FFN(x) = W_down (silu(W_gate x) * W_up x); no biases (Qwen3-Next)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))
