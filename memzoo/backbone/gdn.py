"""Gated DeltaNet token mixer (Yang et al. 2024), as used by Qwen3-Next and the FwPKM paper.

    q, k, v = silu(conv4(W_q x)), silu(conv4(W_k x)), silu(conv4(W_v x))   causal depthwise, size 4
    q, k    = L2-normalised per head                                       8 heads of dim 64
    β_t     = sigmoid(W_b x_t)                                             writing strength
    g_t     = -exp(A_log) · softplus(W_a x_t + dt_bias)                    log decay α_t = exp(g_t)
    S_t     = α_t S_{t-1} (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ                 gated delta rule (ops)
    o_t     = W_o (RMSNorm(S_t q_t) ⊙ silu(W_g x_t))

One implementation with the `gated_deltanet` memory layer (memzoo/layers/gated_deltanet.py): this class
is that layer used as a token mixer. What a token mixer may do and a memory may not is the one thing
it adds: the query is convolved too, as in fla's and Qwen3-Next's GDN (a memory's read must be
pointwise: memzoo/layers/_delta.py), so it has no read without a write (`read_state` says so). Its defaults
are the paper's sizes, and `reset_parameters` draws its weights in the order the published hybrid
backbones were seeded with, so a seed builds the same model as before the two were one.
The recurrence is `memzoo.ops.gated_delta_rule` (chunked pure torch on CPU, fla kernels on
CUDA, or there where fla cannot run the torch path compiled). Streaming: the cache holds the last 3
inputs of each short convolution and the recurrent state S, so split calls equal one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from memzoo.layers import gated_deltanet
from memzoo.layers.base import State
from memzoo.modules.conv import conv_weights
from memzoo.modules.gates import mamba2_decay_init
from memzoo.storage import load_transposed


class GDNMixer(gated_deltanet.GatedDeltaNet):
    """The GDN token mixer: d_model → num_heads heads of head_dim, a short convolution of conv_size on
    q, k and v, the chunked op at chunk_size."""

    backend = "auto-compiled"  # training's lengths repeat: each compiles once

    def __init__(self, d_model: int, num_heads: int = 8, head_dim: int = 64, conv_size: int = 4,
                 chunk_size: int = 64, norm_eps: float = 1e-5):
        devices = [torch.cuda.current_device()] if torch.get_default_device().type == "cuda" else []
        with torch.random.fork_rng(devices):  # draws that reset_parameters replaces, in its order
            super().__init__(d_model, num_heads, head_dim, conv_size=conv_size, norm_eps=norm_eps)
            self.add_convs(q=self.key_dim)
        self.parallel_chunk = chunk_size
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """torch's default init of each projection, nn.Conv1d's of each convolution, Mamba-2's of the decay,
        in this order of draws (the published backbones')."""
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj, self.g_proj, self.o_proj):
            lin.reset_parameters()
        for name in ("q", "k", "v") if self._convs else ():
            getattr(self, f"{name}_conv").copy_(conv_weights(self._convs[name], self.conv_size))
        self.o_norm_weight.fill_(1.0)
        A_log, dt_bias = mamba2_decay_init(self.num_heads)
        self.A_log.copy_(A_log)
        self.dt_bias.copy_(dt_bias)

    def op_dtype(self, x: Tensor) -> torch.dtype:
        """The dtype q, k and v enter the op in: autocast's where it is on (bf16 into fla's kernels, as the
        published backbones trained; the state stays fp32), else the layer's."""
        dev = x.device.type
        if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
            return torch.get_autocast_dtype(dev)
        return self.cdtype()

    def keys_values(self, x: Tensor, state: State, new: State) -> tuple[Tensor, Tensor]:
        k, v = super().keys_values(x, state, new)
        return k.to(self.op_dtype(x)), v.to(self.op_dtype(x))

    def forward_state(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        """The token mixer over x [B, T, D] from `state` (S may be None: zeros)."""
        new: State = {}
        q = F.normalize(self.heads(self.conv("q", self.q_proj(x).to(self.cdtype()), state, new)), dim=-1)
        o, written = self.scan(x, state, q.to(self.op_dtype(x)))
        return self.output(o, x), {**new, **written}

    def forward(self, x: Tensor, cache: dict | None = None) -> tuple[Tensor, dict]:
        """x [B, T, D] → (y [B, T, D], the cache a next call continues from)."""
        y, state = self.forward_state(x, cache or {**self.init_state(x.shape[0]), "S": None})
        return y, {k: v.detach() for k, v in state.items()}

    def read_state(self, x: Tensor, state: State) -> Tensor:
        raise TypeError("the GDN token mixer has no read without a write (its query's convolution needs the "
                        "token's own history): call it as a mixer, or use the 'gated_deltanet' memory layer")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in self._convs:  # checkpoints before the two were one: ShortConv modules, `<name>_conv.weight`
            old = f"{prefix}{name}_conv.weight"
            if old in state_dict:
                state_dict[f"{prefix}{name}_conv"] = state_dict.pop(old)
            load_transposed(state_dict, f"{prefix}{name}_conv", getattr(self, f"{name}_conv").shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
