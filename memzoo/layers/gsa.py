"""Gated Slot Attention (Zhang, Yang, Zhu, Zhang, Cui, Wang, Wang, Shi, Wang, Bi, Zhou & Fu 2024, "Gated
Slot Attention for Efficient Linear-Time Sequence Modeling", arXiv 2409.07146) as a memory layer: the GSA
token mixer of Sec. 3.

ABC's bounded memory of m slots (keys K̃ and values Ṽ), each slot written through a forget gate α_t and
read by a softmax over the slots (Sec. 3), per head:

    K̃_t = Diag(α_t) K̃_{t-1} + (1 − α_t) k_tᵀ                                   K̃_t ∈ R^{m×K}
    Ṽ_t = Diag(α_t) Ṽ_{t-1} + (1 − α_t) v_tᵀ                                   Ṽ_t ∈ R^{m×V}
    o_t = Ṽ_tᵀ softmax(K̃_t q_t)                                                (read: inclusive)

Each slot's forget gate is also its write strength: a slot that forgets takes the token in, one that
keeps holds on. This is two passes of gated linear attention joined by a softmax (Sec. 3, "GSA as
two-pass GLA"): the first with the key k_t, the value 1 − α_t and the decay α_t on its value axis (the
slots), the state K̃ᵀ ∈ R^{K×m}; the second with the query softmax(K̃_t q_t), the key 1 − α_t, the value
v_t and the decay α_t on its key axis (GLA's Diag(α_t)), the state Ṽ ∈ R^{m×V}:

    ô_t = (K̃_tᵀ)ᵀ q_t ∈ R^m,    K̃_tᵀ = K̃_{t-1}ᵀ Diag(α_t) + k_t (1 − α_t)ᵀ
    o_t = Ṽ_tᵀ softmax(ô_t),    Ṽ_t = Diag(α_t) Ṽ_{t-1} + (1 − α_t) v_tᵀ

Both passes and the softmax are the op :func:`memzoo.ops.gsa.gsa`: on the torch path two runs of
:mod:`memzoo.ops.linear_attention`'s chunked form (the first with its decay per value channel, the second
with its decay per key channel), the paper's chunkwise two-pass GLA; on CUDA fla's ``chunk_gsa``, the same
math in one fused op. The slow projections (Sec. 3, the GSA layer):

    q_t = swish(W_q x_t),  k_t = swish(W_k x_t),  v_t = swish(W_v x_t)
    α_t = sigmoid(W_α x_t)^{1/τ},  τ = 8           (log α_t = logsigmoid(W_α x_t) / τ ≤ 0; 1 − α_t = −expm1)
    y_t = W_O RMSNorm(swish(o_t))                  the norm over the heads' o_t joined

with K = expand_k · D / H, V = expand_v · D / H, and m = num_slots slots per head (the paper: 64 slots,
4 heads).

Where the paper is silent or differs, fla's layer (``fla/layers/gsa.py``, ``GatedSlotAttention``, and
``fla.ops.gsa.naive.naive_recurrent_gsa``) decides: no scale on the slot scores (fla's layer passes
``scale=1``); the feature map is swish on q and k (fla's default of swish, relu and t2r) and silu on v;
the output is RMSNorm(swish(o)) with a learned weight over the whole value width, then W_O, with no output
gate (fla's ``use_output_gate`` is unused in its forward); no bias, every Linear at torch's default init
(fla leaves them to the model); no short convolution (``use_short_conv=False``); as many key-value heads
as query heads (fla's ``num_kv_heads`` grouping is left out).

The MemoryLayer verbs: ``read_state`` is o = Ṽᵀ softmax(K̃ q) with the memory so far (every projection
is pointwise, so a read is the same function in `read` and in `forward`); ``write_state`` applies every
token's writes in order; ``forward_state`` writes token t then reads it (``inclusive = True``): the two
passes, chunked. The state, per sequence and token-recurrent: ``Sk`` = K̃ᵀ [B, H, K, m] and ``Sv`` = Ṽ
[B, H, m, V].
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.layers._delta import linear
from memzoo.layers.base import MemoryLayer, State
from memzoo.modules.norm import rms_norm
from memzoo.modules.precision import compute_dtype
from memzoo.ops.gsa import gsa
from memzoo.ops.linear_attention import linear_attention_final_state
from memzoo.registration import register_layer


def gsa_gate(logits: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """The slots' write strength and forget gate (Sec. 3): (1 − α_t, log α_t), log α_t = logsigmoid(·) / τ."""
    log_alpha = F.logsigmoid(logits) / temperature
    return -torch.expm1(log_alpha), log_alpha


def gsa_write(Sk: Tensor, Sv: Tensor, k: Tensor, v: Tensor, s: Tensor, log_alpha: Tensor) -> tuple[Tensor, Tensor]:
    """K̃ᵀ ← K̃ᵀ Diag(α_t) + k_t s_tᵀ and Ṽ ← Diag(α_t) Ṽ + s_t v_tᵀ for every token in order, s_t = 1 − α_t:
    the new (Sk [B, H, K, m], Sv [B, H, m, V])."""
    return (linear_attention_final_state(k, s, None, Sk, log_decay_v=log_alpha),
            linear_attention_final_state(s, v, log_alpha, Sv))


def gsa_read(q: Tensor, Sk: Tensor, Sv: Tensor) -> Tensor:
    """o = Ṽᵀ softmax(K̃ q) for every query q [B, T, H, K] of one memory: [B, T, H, V]."""
    p = torch.einsum("bthk,bhkm->bthm", q, Sk).softmax(-1)
    return torch.einsum("bthm,bhmv->bthv", p, Sv)


@register_layer("gsa")
class GatedSlotAttention(MemoryLayer):
    """GSA as a memory layer; see the module docstring for the equations.

    Args:
        d_model: model width D.
        num_heads: H heads (the paper: 4).
        num_slots: m slots per head (the paper: 64).
        expand_k: key width H·K = expand_k · D (the paper and fla: D).
        expand_v: value width H·V = expand_v · D (the paper and fla: D).
        gate_logit_normalizer: τ, the forget gate's temperature, α = sigmoid(·)^{1/τ} (the paper: 8).
        norm_eps: eps of the RMSNorm.
    """

    family = "slots"
    chunk_size = None
    per_sequence = True
    #: forward writes token t, then reads it (Sec. 3: o_t reads K̃_t and Ṽ_t)
    inclusive: ClassVar[bool] = True
    #: chunk length of the chunked op inside forward (any value is exact); its [C, C, m] decays stay small
    parallel_chunk: int = 16
    bench_cost = 1.6

    def __init__(self, d_model: int, num_heads: int = 4, num_slots: int = 64, expand_k: float = 1.0,
                 expand_v: float = 1.0, gate_logit_normalizer: float = 8.0, norm_eps: float = 1e-5):
        super().__init__(d_model)
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        if int(num_slots) != num_slots or num_slots < 1:
            raise ValueError(f"num_slots must be an integer >= 1, got {num_slots}")
        for name, e in (("expand_k", expand_k), ("expand_v", expand_v)):
            width = e * d_model
            if not (width > 0 and width == int(width) and int(width) % num_heads == 0):
                raise ValueError(f"{name} * d_model = {width} must be a positive integer divisible by num_heads={num_heads}")
        if not gate_logit_normalizer > 0:
            raise ValueError(f"gate_logit_normalizer (the temperature τ) must be > 0, got {gate_logit_normalizer}")
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {norm_eps}")
        self.key_dim, self.value_dim = int(expand_k * d_model), int(expand_v * d_model)
        self.num_heads, self.num_slots = num_heads, int(num_slots)
        self.head_dim, self.head_v_dim = self.key_dim // num_heads, self.value_dim // num_heads
        self.temperature, self.eps = float(gate_logit_normalizer), norm_eps
        self.q_proj = linear(d_model, self.key_dim)
        self.k_proj = linear(d_model, self.key_dim)
        self.v_proj = linear(d_model, self.value_dim)
        self.f_proj = linear(d_model, num_heads * self.num_slots)  # W_α
        self.g_norm_weight = nn.Parameter(torch.ones(self.value_dim))
        self.o_proj = linear(self.value_dim, d_model)

    # ---- the slow projections ------------------------------------------------------------------
    def cdtype(self) -> torch.dtype:
        return compute_dtype(self.o_proj.weight)

    def heads(self, u: Tensor, d: int) -> Tensor:
        return u.to(self.cdtype()).unflatten(-1, (self.num_heads, d))

    def query(self, x: Tensor) -> Tensor:
        """q_t = swish(W_q x_t): [B, T, H, K]."""
        return F.silu(self.heads(self.q_proj(x), self.head_dim))

    def keys_values(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """k_t [B, T, H, K], v_t [B, T, H, V], 1 − α_t and log α_t [B, T, H, m]."""
        s, log_alpha = gsa_gate(self.heads(self.f_proj(x), self.num_slots), self.temperature)
        k = F.silu(self.heads(self.k_proj(x), self.head_dim))
        return k, F.silu(self.heads(self.v_proj(x), self.head_v_dim)), s, log_alpha

    def output(self, o: Tensor, x: Tensor) -> Tensor:
        """y = W_O RMSNorm(swish(o)) over the heads joined: o [B, T, H, V]."""
        o = F.silu(o.flatten(-2))
        o = rms_norm(o, self.g_norm_weight, self.eps)
        return self.o_proj(o.to(x.dtype))

    # ---- state and verbs -----------------------------------------------------------------------
    def init_state(self, batch_size: int) -> State:
        dev, dt = self.o_proj.weight.device, self.cdtype()
        B, H, m = batch_size, self.num_heads, self.num_slots
        return {"Sk": torch.zeros(B, H, self.head_dim, m, dtype=dt, device=dev),
                "Sv": torch.zeros(B, H, m, self.head_v_dim, dtype=dt, device=dev)}

    def read_state(self, x: Tensor, state: State) -> Tensor:
        """o_t = Ṽᵀ softmax(K̃ q_t) with the memory so far; x itself is not written."""
        Sk, Sv = state["Sk"], state["Sv"]
        return self.output(gsa_read(self.query(x).to(Sk.dtype), Sk, Sv), x)

    def write_state(self, x: Tensor, state: State) -> State:
        """K̃ ← Diag(α_t) K̃ + (1 − α_t) k_tᵀ, Ṽ ← Diag(α_t) Ṽ + (1 − α_t) v_tᵀ for every token of x, in order."""
        Sk, Sv = gsa_write(state["Sk"], state["Sv"], *self.keys_values(x))
        return {"Sk": Sk, "Sv": Sv}

    def forward_state(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        o, Sk, Sv = gsa(self.query(x), *self.keys_values(x), state["Sk"], state["Sv"], self.parallel_chunk)
        return self.output(o, x), {"Sk": Sk, "Sv": Sv}

    # ---- the pairs adapter (bench/suites/pairs.py) -----------------------------------------------
    # The slot a pair goes to is chosen by the forget gate, not by its key; there is no gate that stores
    # a pair without choosing (α = 1 writes nothing; one α for every slot writes the same sum to each, and
    # the softmax reads their mean). Neutral: pair i replaces slot i mod m (1 − α = e_{i mod m}, α = 1 on
    # the other slots; e^-30 of the slot's old content stays), a slot per pair, the rule's best case until
    # the slots run out; the read softmax(K̃ k) at the key itself.
    no_pairs: ClassVar[str | None] = None
    #: log α on the slot a neutral pair replaces (finite, so that the op's decay differences stay finite)
    neutral_log_forget: ClassVar[float] = -30.0

    def pair_dims(self) -> tuple[int, int, int]:
        return self.num_heads, self.head_dim, self.head_v_dim

    def pair_inputs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.keys_values(x)[:2]

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """The slots' writes a pair at a time (the layer's op); α from x, else pair i replaces slot i mod m."""
        Sk, Sv = self.state["Sk"], self.state["Sv"]
        if x is not None:
            s, log_alpha = (t.to(Sk.dtype) for t in self.keys_values(x)[2:])
        else:
            B, n, H, _ = k.shape
            slot = F.one_hot(torch.arange(n, device=k.device) % self.num_slots, self.num_slots).bool()
            log_alpha = torch.zeros(n, self.num_slots, dtype=Sk.dtype, device=k.device)
            log_alpha = log_alpha.masked_fill(slot, self.neutral_log_forget)[None, :, None].expand(B, n, H, -1)
            s = -torch.expm1(log_alpha)
        Sk, Sv = gsa_write(Sk, Sv, k.to(Sk.dtype), v.to(Sk.dtype), s, log_alpha)
        self.load_state({"Sk": Sk, "Sv": Sv})

    def read_keys(self, k: Tensor) -> Tensor:
        Sk, Sv = self.state["Sk"], self.state["Sv"]
        return gsa_read(k.to(Sk.dtype), Sk, Sv)

    # ---- diagnostics ---------------------------------------------------------------------------
    @torch.no_grad()
    def stats(self) -> dict:
        out = super().stats()
        for name in ("Sk", "Sv"):
            for h, n in enumerate(self.state[name].float().pow(2).sum(dim=(0, 2, 3)).sqrt().tolist()):
                out[f"norm/{name}/head{h}"] = n
        return out

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, num_heads={self.num_heads}, num_slots={self.num_slots}, "
                f"head_dim={self.head_dim}, head_v_dim={self.head_v_dim}, temperature={self.temperature}")
