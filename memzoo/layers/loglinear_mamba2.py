"""Log-linear Mamba-2 (Guo, Yang, Goel, Xing, Dao & Kim 2025, "Log-Linear Attention", arXiv 2506.04761) as a
memory layer: the Mamba-2 block (memzoo/layers/mamba2.py) whose one SSM state per head becomes a Fenwick
tree of O(log T) states, each read with its own input-chosen weight.

Mamba-2's SSD reads o_t = Σ_{s≤t} (Π_{r=s+1..t} a_r)(C_t·B_s) Δ_s x_s: one state h_t, everything before t
under one decay. Log-linear attention (Sec. 3) splits the prefix before t into its Fenwick buckets (sizes
1, 2, 4, ... counted back from t: the set bits of t) and weights each by λ_t^ℓ (the hierarchical mask M^H of
applied to Mamba-2's decay mask M^S: the paper's log-linear Mamba-2):

    o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} (Π_{r=s+1..t} a_r)(C_t·B_s) Δ_s x_s
    ℓ(t, s) = 0 (s = t),  bit_length(t XOR s) (s < t)                         the level of s's bucket
    y_t = o_t + D x_t,                                                          then the block's gate, norm, W_out

The recurrent form (the paper's Fenwick-tree recurrence) keeps one state per level, S^ℓ_t ∈ R^{N×P} per head: o_t = Σ_ℓ λ_t^ℓ S^ℓ_tᵀ C_t,
all levels decay by a_t each token, and after token t the token and levels 1..c (c = the trailing ones of
t) merge into level c + 1 (the carry of t + 1). The math is :mod:`memzoo.ops.log_linear_attention` (the
merge through the shared op :func:`memzoo.ops.linear_attention.linear_attention_final_state`, the levels as
heads with Mamba-2's per-head decay); with every λ_t^ℓ = 1 it is Mamba-2's SSD.

The weights, per head and level (fla's layer: the paper gives λ as a projection of x_t):

    λ_t^ℓ = softplus(L_{h,ℓ} · (W_λ u_t)_{h,ℓ}),    ℓ = 0 .. num_levels − 1,  L initialised to 1

Where the paper is silent, fla's layer (``fla/layers/log_linear_mamba2.py``, ``LogLinearMamba2``) decides:
λ as above, with num_levels = 15 (``MAX_NUM_LEVELS``: sequences up to 2^14 tokens), from the block's input
projection (here its own W_λ, the same rows of a wider W_in); the rest of the block is Mamba-2's. Where this
layer departs from fla's on purpose: the block is memzoo's Mamba-2 unchanged (fla's Mamba2 decisions: no
bias on W_in, W_out, W_λ, a bias on the convolution, A ~ U(1, 16)), where fla's LogLinearMamba2 has biases on
W_in and W_out, none on the convolution and A_h = h: so this layer differs from ``mamba2`` by the hierarchy
alone.

The MemoryLayer verbs, as Mamba-2's (its C_t is convolved; memzoo/layers/mamba2.py): read-then-write per
token (``inclusive = False``, ``chunk_size = None``). ``read_state`` reads every token of x at the next
position n, as the paper's output there: the held levels are n's buckets, so o = a_t Σ_ℓ λ_t^ℓ S^ℓᵀ C_t +
λ_t^0 Δ_t (C_t·B_t) x_t; ``write_state`` writes x's tokens at n, n + 1, ... (one call, no token loop);
``forward_state`` runs the op a chunk at a time (the paper's chunkwise form: the chunk's keys by the masked
matrix, the earlier ones by their levels), equal to the per-token read-then-write; or fla's kernel for the
call's own keys where it covers the call (:func:`memzoo.ops.log_linear_attention.log_linear_attention`).

The state, per sequence: ``S`` [B, H, num_levels − 1, N, P], the levels 1 .. num_levels − 1 held in a fixed
array, a level zero while its bucket is empty (a state dict of fixed shapes, so load_state, detach and
streaming treat it as any other); ``pos`` [B], the next position n (int64; the level structure is a
function of it); ``conv`` as Mamba-2's. A stream runs to 2^(num_levels−1) − 1 tokens (then a ValueError
names num_levels). The state count (``fast_weight_numel``) is what the memory holds at its length n: the
levels a stream of n tokens has filled, bit_length(n) of them (⌊log2 n⌋ + 1), each N·P per head, plus n
itself and the convolution's history; the zero levels above them are not memory yet.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.layers._delta import linear
from memzoo.layers.base import State, state_precision
from memzoo.layers.mamba2 import Mamba2
from memzoo.ops.log_linear_attention import (
    bit_length,
    log_linear_attention,
    log_linear_chunk,
)
from memzoo.registration import register_layer

#: fla's number of λ levels (``MAX_NUM_LEVELS``: ceil(log2 16384) + 1)
NUM_LEVELS = 15


@register_layer("loglinear_mamba2")
class LogLinearMamba2(Mamba2):
    """Log-linear Mamba-2 as a memory layer; see the module docstring for the equations.

    Args:
        d_model, d_state, head_dim, expand, conv_size, norm_eps: Mamba-2's (memzoo/layers/mamba2.py).
        num_levels: the levels λ weighs, 0 (the token) .. num_levels − 1; the state holds levels
            1 .. num_levels − 1, a stream up to 2^(num_levels − 1) − 1 tokens.
    """

    #: chunk length of the op inside forward (any value is exact); its [C, C] masks stay small
    parallel_chunk: int = 64
    bench_cost = 1.6

    def __init__(self, d_model: int, d_state: int = 128, head_dim: int = 64, expand: float = 2, conv_size: int = 4,
                 norm_eps: float = 1e-5, num_levels: int = NUM_LEVELS):
        super().__init__(d_model, d_state=d_state, head_dim=head_dim, expand=expand, conv_size=conv_size,
                         norm_eps=norm_eps)
        if not 2 <= num_levels <= 62:
            raise ValueError(f"num_levels must be in 2 .. 62 (levels 0 .. num_levels - 1), got {num_levels}")
        self.num_levels = num_levels
        self.lambda_proj = linear(d_model, self.num_heads * num_levels)  # W_λ: fla's in_proj rows for dl
        self.L = nn.Parameter(torch.ones(self.num_heads, num_levels))
        self.L._no_weight_decay = True

    # ---- the slow projections ------------------------------------------------------------------
    def levels(self, u: Tensor) -> Tensor:
        """λ_t^ℓ = softplus(L_{h,ℓ} (W_λ u_t)_{h,ℓ}): [B, T, H, num_levels]."""
        dl = self.lambda_proj(u).to(self.cdtype()).unflatten(-1, (self.num_heads, self.num_levels))
        return F.softplus(self.L.to(dl.dtype) * dl)

    def check_length(self, pos: Tensor, T: int) -> None:
        if pos.is_meta or T == 0:
            return
        end = int(pos.max()) + T
        if end >= 2 ** (self.num_levels - 1):
            raise ValueError(f"a stream of {end} tokens needs more than num_levels={self.num_levels} levels "
                             f"(at most 2^(num_levels-1) - 1 = {2 ** (self.num_levels - 1) - 1} tokens): raise num_levels")

    # ---- state ---------------------------------------------------------------------------------
    def init_state(self, batch_size: int) -> State:
        st = super().init_state(batch_size)
        S = st["S"]
        st["S"] = S.new_zeros(batch_size, self.num_heads, self.num_levels - 1, self.d_state, self.head_dim)
        st["pos"] = torch.zeros(batch_size, dtype=torch.long, device=S.device)
        return st

    def fast_weight_numel(self) -> int:
        """The levels a stream of n tokens has filled (bit_length(n)) times N·P per head, n itself, the
        convolution's history (module docstring)."""
        st = self.state
        n = st["pos"].max() if st["pos"].numel() else st["pos"].new_zeros(())
        filled = min(int(bit_length(n.reshape(1), self.num_levels)[0]), self.num_levels - 1)
        conv = st["conv"][0].numel() if "conv" in st else 0
        return filled * self.num_heads * self.d_state * self.head_dim + 1 + conv

    # ---- the verbs -----------------------------------------------------------------------------
    def read_state(self, u: Tensor, state: State) -> Tensor:
        """o_t = a_t Σ_ℓ λ_t^ℓ S^ℓᵀ C_t + λ_t^0 Δ_t (C_t·B_t) x_t, every token at the next position (the held
        levels are its buckets); y = o + D x through the block's output. No write."""
        z, x, Bm, Cm, dt, log_a = self.project(u, state)
        lam = self.levels(u)
        with state_precision(u.device):
            S = state["S"].to(x.dtype)
            held = torch.einsum("bthn,bhjnp->bthjp", Cm, S)
            o = log_a.exp()[..., None] * (lam[..., 1:, None] * held).sum(3)
            o = o + (lam[..., 0] * dt * (Cm * Bm).sum(-1))[..., None] * x
        return self.output(o + self.D.to(x.dtype)[:, None] * x, z, u)

    def write_state(self, u: Tensor, state: State) -> State:
        """The tokens of u at positions n, n + 1, ...: every level decays by a_t, each token and held level
        lands in its bucket of n + T (the Fenwick merge), as the op computes it."""
        new: State = {}
        self.check_length(state["pos"], u.shape[1])
        _, x, Bm, _, dt, log_a = self.project(u, state, new)
        with state_precision(u.device):
            _, new["S"] = log_linear_chunk(None, Bm, dt[..., None] * x, log_a, None, state["S"], state["pos"])
        new["pos"] = state["pos"] + u.shape[1]
        return new

    def forward_state(self, u: Tensor, state: State) -> tuple[Tensor, State]:
        """The log-linear SSD over the call (o_t with every level, the token's own at level 0), y = o + D x: the
        op a chunk at a time, or fla's kernel where it covers the call (:func:`log_linear_attention`)."""
        new: State = {}
        self.check_length(state["pos"], u.shape[1])
        z, x, Bm, Cm, dt, log_a = self.project(u, state, new)
        lam = self.levels(u)
        with state_precision(u.device):
            o, new["S"] = log_linear_attention(Cm, Bm, dt[..., None] * x, log_a, lam, state["S"], state["pos"],
                                               self.parallel_chunk)
        new["pos"] = state["pos"] + u.shape[1]
        return self.output(o + self.D.to(x.dtype)[:, None] * x, z, u), new

    # ---- the pairs adapter (bench/suites/pairs.py) -----------------------------------------------
    # Neutral: no decay (a = 1) and every λ = 1; keys B_t and values Δ_t x_t as the layer's write makes them.
    # The read at a key k is the hierarchy's read at the next position, Σ_ℓ λ^ℓ S^ℓᵀ k (λ = 1: the sum of the
    # levels, Mamba-2's h); the write merges pairs into their buckets as the layer's own write does.
    no_pairs: ClassVar[str | None] = None

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """The pairs at positions n, n + 1, ... into their levels (the layer's op); a = exp(Δ_t A) from x, else 1."""
        st = self.state
        S = st["S"]
        self.check_length(st["pos"], k.shape[1])
        if x is not None:
            log_a = self.project(x, self.init_state(x.shape[0]))[5].to(S.dtype)
        else:
            log_a = torch.zeros(k.shape[:3], dtype=S.dtype, device=k.device)
        _, S = log_linear_chunk(None, k.to(S.dtype), v.to(S.dtype), log_a, None, S, st["pos"])
        self.load_state({**st, "S": S, "pos": st["pos"] + k.shape[1]})

    def read_keys(self, k: Tensor) -> Tensor:
        """Σ_ℓ S^ℓᵀ k per head (every λ = 1): the value the levels hold at key k."""
        S = self.state["S"]
        return torch.einsum("bnhk,bhjkv->bnhv", k.to(S.dtype), S)

    # ---- diagnostics ---------------------------------------------------------------------------
    @torch.no_grad()
    def stats(self) -> dict:
        out = super(Mamba2, self).stats()
        for j, n in enumerate(self.state["S"].float().pow(2).sum(dim=(0, 1, 3, 4)).sqrt().tolist()):
            out[f"norm/S/level{j + 1}"] = n
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_levels={self.num_levels}"
