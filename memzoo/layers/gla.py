"""Gated Linear Attention (Yang, Wang, Shen, Panda & Kim 2024, "Gated Linear Attention Transformers with
Hardware-Efficient Training", arXiv 2312.06635) as a memory layer: the GLA layer of Sec. 4.4.

Linear attention whose memory decays per key channel, at a rate the input chooses (Sec. 4.1,
in the [K, V] layout):

    S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ = (α_t 1ᵀ) ⊙ S_{t-1} + k_t v_tᵀ         S_t ∈ R^{K×V} per head
    o_t = S_tᵀ q_t                                                             (read: inclusive)

The slow projections (Sec. 4.4, "GLA Transformer"):

    q_t = W_Q x_t,  k_t = W_K x_t,  v_t = W_V x_t                              no feature map, no bias
    α_t = sigmoid(W_α2 W_α1 x_t + b_α)^{1/τ},  τ = 16                          low rank 16 (Sec. 4.4)
    r_t = swish(W_r x_t)                                                       the output gate
    y_t = W_O (RMSNorm(o_t) ⊙ r_t)  per head

with K = expand_k · D / H (the paper's d_k = d/2) and V = expand_v · D / H (d_v = d). The decay is
kept as its log, log α_t = logsigmoid(W_α2 W_α1 x_t + b_α) / τ ≤ 0, so the chunked form's products of
decays are sums of logs. The recurrence is the shared op :mod:`memzoo.ops.linear_attention` with a
decay per key channel (its chunked form is Sec. 4.2's chunkwise parallel form).

Where the paper is silent or differs, fla's layer (``fla/layers/gla.py``, ``GatedLinearAttention``)
decides: the read is scaled by 1/√K (fla's ops scale q by ``K ** -0.5``; the paper writes
o_t = S_tᵀ q_t); the norm before the gate is a per-head RMSNorm with a learned weight (the paper's
LayerNorm), and the gate projection W_r has no bias (the paper's has b_r); b_α sits on the second
low-rank projection; no short convolution (``use_short_conv=False``); every Linear at torch's default
init (fla leaves them to the model's init, as memzoo/layers/_delta.py says).

The MemoryLayer verbs: ``read_state`` is o_t = Sᵀ q_t / √K with the memory so far (q is pointwise,
so a read is the same function in `read` and in `forward`); ``write_state`` applies the writes of
every token in order; ``forward_state`` writes token t then reads it (``inclusive = True``), as the
paper's layer. The state, per sequence and token-recurrent: ``S`` [B, H, K, V].
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.layers._delta import linear
from memzoo.layers._matrix import GatedLinearMemory
from memzoo.modules.norm import rms_norm
from memzoo.modules.precision import compute_dtype
from memzoo.registration import register_layer


def gla_log_decay(logits: Tensor, temperature: float) -> Tensor:
    """log α_t = log(sigmoid(logits)^{1/τ}) = logsigmoid(logits) / τ (Sec. 4.4), elementwise, ≤ 0."""
    return F.logsigmoid(logits) / temperature


@register_layer("gla")
class GatedLinearAttention(GatedLinearMemory):
    """GLA as a memory layer; see the module docstring for the equations.

    Args:
        d_model: model width D.
        num_heads: H heads.
        expand_k: key width H·K = expand_k · D (the paper: D/2).
        expand_v: value width H·V = expand_v · D (the paper: D).
        gate_low_rank_dim: the rank of the decay's projection W_α2 W_α1 (the paper: 16).
        gate_logit_normalizer: τ, the decay's temperature, α = sigmoid(·)^{1/τ} (the paper: 16).
        norm_eps: eps of the per-head RMSNorm.
    """

    family = "gated_hebbian"  # forward writes token t, then reads it (Sec. 4.1: o_t reads S_t): GatedLinearMemory
    bench_cost = 1.3

    def __init__(self, d_model: int, num_heads: int = 4, expand_k: float = 0.5, expand_v: float = 1.0,
                 gate_low_rank_dim: int = 16, gate_logit_normalizer: float = 16.0, norm_eps: float = 1e-5):
        super().__init__(d_model)
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        for name, e in (("expand_k", expand_k), ("expand_v", expand_v)):
            width = e * d_model
            if not (width > 0 and width == int(width) and int(width) % num_heads == 0):
                raise ValueError(f"{name} * d_model = {width} must be a positive integer divisible by num_heads={num_heads}")
        if gate_low_rank_dim < 1:
            raise ValueError(f"gate_low_rank_dim must be >= 1, got {gate_low_rank_dim}")
        if not gate_logit_normalizer > 0:
            raise ValueError(f"gate_logit_normalizer (the temperature τ) must be > 0, got {gate_logit_normalizer}")
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {norm_eps}")
        self.key_dim, self.value_dim = int(expand_k * d_model), int(expand_v * d_model)
        self.num_heads = num_heads
        self.head_dim, self.head_v_dim = self.key_dim // num_heads, self.value_dim // num_heads
        self.gate_low_rank_dim, self.temperature, self.eps = gate_low_rank_dim, float(gate_logit_normalizer), norm_eps
        self.scale = self.head_dim ** -0.5
        self.q_proj = linear(d_model, self.key_dim)
        self.k_proj = linear(d_model, self.key_dim)
        self.v_proj = linear(d_model, self.value_dim)
        self.gk_proj = nn.Sequential(linear(d_model, gate_low_rank_dim), nn.Linear(gate_low_rank_dim, self.key_dim))
        self.g_proj = linear(d_model, self.value_dim)
        self.g_norm_weight = nn.Parameter(torch.ones(self.head_v_dim))
        self.o_proj = linear(self.value_dim, d_model)

    # ---- the slow projections ------------------------------------------------------------------
    def cdtype(self) -> torch.dtype:
        return compute_dtype(self.o_proj.weight)

    def heads(self, u: Tensor, d: int) -> Tensor:
        return u.to(self.cdtype()).unflatten(-1, (self.num_heads, d))

    def query(self, x: Tensor) -> Tensor:
        """q_t / √K: [B, T, H, K] (the read's scale folded into the query)."""
        return self.scale * self.heads(self.q_proj(x), self.head_dim)

    def keys_values(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """k_t [B, T, H, K], v_t [B, T, H, V], log α_t [B, T, H, K]."""
        log_alpha = gla_log_decay(self.heads(self.gk_proj(x), self.head_dim), self.temperature)
        return self.heads(self.k_proj(x), self.head_dim), self.heads(self.v_proj(x), self.head_v_dim), log_alpha

    def output(self, o: Tensor, x: Tensor) -> Tensor:
        """y = W_O (RMSNorm(o) ⊙ swish(W_r x)) per head: o [B, T, H, V]."""
        o = rms_norm(o, self.g_norm_weight, self.eps)
        r = F.silu(self.heads(self.g_proj(x), self.head_v_dim)).to(o.dtype)
        return self.o_proj((o * r).flatten(-2).to(x.dtype))

    # ---- state, verbs, pairs adapter (neutral: no decay, the raw read Sᵀk) and stats: GatedLinearMemory

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"head_v_dim={self.head_v_dim}, gate_low_rank_dim={self.gate_low_rank_dim}, "
                f"temperature={self.temperature}")
