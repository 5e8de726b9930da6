"""The Mesa layer of MesaNet (von Oswald, Scherrer, Kobayashi, Versari, Yang, Schlegel, Maile, Schimpf,
Sieberling, Meulemans, Saurous, Lajoie, Frenkel, Pascanu, Agüera y Arcas & Sacramento 2025, "MesaNet:
Sequence Modeling by Locally Optimal Test-Time Training", arXiv 2506.05233) as a memory layer.

The read at t is the linear map that best fits the sequence so far, applied to the query: the minimiser of
the γ-discounted, β-weighted squared error of v_s ≈ Φ k_s over s ≤ t plus the regulariser ‖Φ Λ^½‖²
(locally optimal test-time training: the end point of the regression family, whose other members take
gradient steps on the same loss). Its closed form is the Mesa rule (Eq. 5), per head, in the [key, value]
layout of memzoo's ops:

    H_t = γ_t H_{t-1} + β_t k_t k_tᵀ                    H_t ∈ R^{K×K}
    G_t = γ_t G_{t-1} + β_t k_t v_tᵀ                    G_t ∈ R^{K×V}   (the paper's Σ v kᵀ, transposed)
    o_t = G_tᵀ (H_t + Λ)^{-1} q_t                       Λ = Diag(λ), λ ∈ R^K_{>0} per head

the solve (H_t + Λ)^{-1} q_t by conjugate gradient for a fixed number of steps (the paper's solver; its
step count trades compute for accuracy). The two sums are the shared op
:mod:`memzoo.ops.linear_attention` with a per-head decay (keys β_t k_t, values k_t and v_t), and every
conjugate-gradient step over a sequence is one chunked linear-attention read of memories built once per
solve: :mod:`memzoo.ops.mesa`.

The slow projections (Fig. 1 C: keys, queries, values, input and forget strengths from the input):

    q_t = L2(silu(conv(W_q x))_t),  k_t = L2(silu(conv(W_k x))_t),  v_t = W_v x_t      per head, K = V
    β_t = sigmoid(W_β x_t + b_β),   γ_t = sigmoid(W_γ x_t + b_γ)                        a scalar per head
    λ = softplus(λ̃) + λ_min                                                            a slow parameter
    y_t = W_O RMSNorm(o_t)  per head        (with use_output_gate: RMSNorm(o_t) ⊙ swish(W_g x_t))

Where the paper is silent, fla's layer (``fla/layers/mesa_net.py``, ``MesaNet``) and its ops decide:
the short convolutions (size 4, SiLU, no bias) on q and k only, not on v; q and k L2-normalised per head
after them (``use_qk_l2norm_in_kernel``); λ per key channel and head, λ = softplus(λ̃) + 0.25
(``lambda_lower_bound``), λ̃ initialised so that λ = 1; β and γ with a bias each (zero at init, as fla's
models initialise biases); no output gate by default (a per-head RMSNorm with a learned weight); the
conjugate gradient from x_0 = 0 with the stabiliser 1e-5 in its two divisions, 30 steps
(``max_cg_step_training``); the gradient through the solve is the implicit one, a second
conjugate-gradient solve on the output's gradient (``chunk_mesa_cg_bwd``), not a backward through the
iterations (:mod:`memzoo.ops.mesa`). fla's one-token decoding starts its solve from the Jacobi guess
q / (diag H + λ) instead; here every token, in forward, read and decoding alike, solves from 0 with the
same steps, so a stream splits exactly. Every Linear at torch's default init (memzoo/layers/_delta.py).

How the MemoryLayer verbs map onto the equations. The query is convolved (its convolution continues
from the history of the tokens before it), so the read of x_t cannot be a read of the memory after
x_t's write by a fresh query (the reason memzoo/layers/mamba2.py gives). As Mamba-2's, the read is
unrolled one step: ``read_state`` computes o_t from the memory *so far* and x_t's own write,

    o_t = (γ_t G + β_t k_t v_tᵀ)ᵀ (γ_t H + β_t k_t k_tᵀ + Λ)^{-1} q_t

never writing; ``write_state`` applies Eq. 5's two sums token by token; ``forward_state`` is the chunked
inclusive form, equal to the per-token read-then-write (``inclusive = False``, ``chunk_size = None``).
The state, per sequence: ``H`` [B, H, K, K], ``G`` [B, H, K, V], and the convolutions' last c−1 inputs
``conv_q``, ``conv_k`` [B, c−1, H·K].
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.layers._delta import linear
from memzoo.layers.base import MemoryLayer, State, state_precision
from memzoo.modules.conv import causal_conv_stream, conv_weights
from memzoo.modules.norm import rms_norm
from memzoo.modules.precision import compute_dtype
from memzoo.ops.linear_attention import linear_attention_final_state
from memzoo.ops.mesa import CG_EPS, mesa_chunked, mesa_step_read
from memzoo.registration import register_layer


def softplus_inverse(y: float) -> float:
    """x with softplus(x) = y > 0."""
    return y + math.log(-math.expm1(-y))


@register_layer("mesanet")
class MesaNet(MemoryLayer):
    """The Mesa layer as a memory layer; see the module docstring for the equations.

    Args:
        d_model: model width D.
        num_heads: H heads.
        head_dim: K = V, the width of a head's keys, queries and values.
        conv_size: width of the short convolutions on q and k (0 or 1 = none, then SiLU only).
        use_output_gate: RMSNorm(o) ⊙ swish(W_g x) instead of RMSNorm(o).
        norm_eps: eps of the per-head RMSNorm.
        lambda_lower_bound: λ_min, the floor of the regulariser λ = softplus(λ̃) + λ_min.
        lambda_init: λ at init (> λ_min).
        max_cg_steps: the conjugate gradient's steps per solve (forward, read and the backward's solve).
    """

    family = "regression"
    chunk_size = None
    per_sequence = True
    #: read with the memory so far plus the token's own write, then write (module docstring)
    inclusive: ClassVar[bool] = False
    #: chunk length of the chunked op inside forward (any value is exact); a conjugate-gradient step
    #: costs about 2·C·K + K² per token, so a short chunk keeps the C·C scores small
    parallel_chunk: int = 16
    #: the conjugate gradient's stabiliser (fla's; 0 = the textbook iteration, exact after K steps)
    cg_eps: float = CG_EPS
    bench_cost = 3.0

    def __init__(self, d_model: int, num_heads: int = 16, head_dim: int = 128, conv_size: int = 4,
                 use_output_gate: bool = False, norm_eps: float = 1e-5, lambda_lower_bound: float = 0.25,
                 lambda_init: float = 1.0, max_cg_steps: int = 30):
        super().__init__(d_model)
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        if head_dim < 1:
            raise ValueError(f"head_dim must be >= 1, got {head_dim}")
        if conv_size < 0:
            raise ValueError(f"conv_size must be >= 0 (0 or 1 = no short convolution), got {conv_size}")
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {norm_eps}")
        if not lambda_lower_bound >= 0:
            raise ValueError(f"lambda_lower_bound must be >= 0, got {lambda_lower_bound}")
        if not lambda_init > lambda_lower_bound:
            raise ValueError(f"lambda_init={lambda_init} must be > lambda_lower_bound={lambda_lower_bound}")
        if max_cg_steps < 1:
            raise ValueError(f"max_cg_steps must be >= 1, got {max_cg_steps}")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.key_dim = num_heads * head_dim
        self.conv_size, self.eps, self.use_output_gate = conv_size, norm_eps, use_output_gate
        self.lambda_lower_bound, self.max_cg_steps = float(lambda_lower_bound), max_cg_steps
        self.q_proj = linear(d_model, self.key_dim)
        self.k_proj = linear(d_model, self.key_dim)
        self.v_proj = linear(d_model, self.key_dim)
        self.a_proj = linear(d_model, num_heads, bias=True)  # γ_t, the forget strength
        self.b_proj = linear(d_model, num_heads, bias=True)  # β_t, the input strength
        self.lambda_params = nn.Parameter(torch.full((self.key_dim,), softplus_inverse(lambda_init - lambda_lower_bound)))
        self.lambda_params._no_weight_decay = True
        if conv_size > 1:
            self.q_conv = nn.Parameter(conv_weights(self.key_dim, conv_size))
            self.k_conv = nn.Parameter(conv_weights(self.key_dim, conv_size))
        if use_output_gate:
            self.g_proj = linear(d_model, self.key_dim)
        self.o_norm_weight = nn.Parameter(torch.ones(head_dim))
        self.o_proj = linear(self.key_dim, d_model)

    # ---- the slow projections ------------------------------------------------------------------
    def cdtype(self) -> torch.dtype:
        return compute_dtype(self.o_proj.weight)

    def heads(self, u: Tensor) -> Tensor:
        return u.to(self.cdtype()).unflatten(-1, (self.num_heads, self.head_dim))

    def conv(self, name: str, u: Tensor, state: State, new: State | None) -> Tensor:
        """silu(short conv of u along T, continuing state's history; the new history into `new`)."""
        u = u.to(self.cdtype())
        if self.conv_size > 1:
            u, hist = causal_conv_stream(u, state[f"conv_{name}"], getattr(self, f"{name}_conv"))
            if new is not None:
                new[f"conv_{name}"] = hist
        return F.silu(u)

    def project(self, x: Tensor, state: State, new: State | None = None):
        """q, k [B, T, H, K] (L2-normalised), v [B, T, H, K], β and log γ [B, T, H]."""
        q = F.normalize(self.heads(self.conv("q", self.q_proj(x), state, new)), dim=-1)
        k = F.normalize(self.heads(self.conv("k", self.k_proj(x), state, new)), dim=-1)
        v = self.heads(self.v_proj(x))
        beta = torch.sigmoid(self.b_proj(x).to(q.dtype))
        log_gamma = F.logsigmoid(self.a_proj(x).to(q.dtype))
        return q, k, v, beta, log_gamma

    def lam(self) -> Tensor:
        """λ = softplus(λ̃) + λ_min: [H, K]."""
        return (F.softplus(self.lambda_params.to(self.cdtype())) + self.lambda_lower_bound).view(
            self.num_heads, self.head_dim)

    def output(self, o: Tensor, x: Tensor) -> Tensor:
        """y = W_O RMSNorm(o) per head (⊙ swish(W_g x) with the output gate): o [B, T, H, V]."""
        o = rms_norm(o, self.o_norm_weight, self.eps)
        if self.use_output_gate:
            o = o * F.silu(self.heads(self.g_proj(x))).to(o.dtype)
        return self.o_proj(o.flatten(-2).to(x.dtype))

    # ---- state ---------------------------------------------------------------------------------
    def init_state(self, batch_size: int) -> State:
        dev, dt = self.o_proj.weight.device, self.cdtype()
        H, K = self.num_heads, self.head_dim
        st = {"H": torch.zeros(batch_size, H, K, K, dtype=dt, device=dev),
              "G": torch.zeros(batch_size, H, K, K, dtype=dt, device=dev)}
        if self.conv_size > 1:
            for name in ("q", "k"):
                st[f"conv_{name}"] = torch.zeros(batch_size, self.conv_size - 1, self.key_dim, dtype=dt, device=dev)
        return st

    # ---- the verbs -----------------------------------------------------------------------------
    def read_state(self, x: Tensor, state: State) -> Tensor:
        """o_t = (γ_t G + β_t k_t v_tᵀ)ᵀ (γ_t H + β_t k_t k_tᵀ + Λ)^{-1} q_t: the memory so far and x_t's own
        write (module docstring); nothing written."""
        with state_precision(x.device):
            q, k, v, beta, log_gamma = self.project(x, state)
            H, G = state["H"].to(q.dtype), state["G"].to(q.dtype)
            o = mesa_step_read(q, k, v, beta, log_gamma, self.lam(), H, G, self.max_cg_steps, self.cg_eps)
        return self.output(o, x)

    def write_state(self, x: Tensor, state: State) -> State:
        """H ← γ_t H + β_t k_t k_tᵀ, G ← γ_t G + β_t k_t v_tᵀ for every token of x, in order (Eq. 5)."""
        new: State = {}
        with state_precision(x.device):
            _, k, v, beta, log_gamma = self.project(x, state, new)
            kb = beta[..., None] * k
            new["H"] = linear_attention_final_state(kb, k, log_gamma, state["H"])
            new["G"] = linear_attention_final_state(kb, v, log_gamma, state["G"])
        return new

    def forward_state(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        """Eq. 5 over the sequence, inclusive, the solve by conjugate gradient on the chunked op."""
        new: State = {}
        with state_precision(x.device):
            q, k, v, beta, log_gamma = self.project(x, state, new)
            o, new["H"], new["G"] = mesa_chunked(q, k, v, beta, log_gamma, self.lam(), state["H"], state["G"],
                                                 self.max_cg_steps, self.parallel_chunk, self.cg_eps)
        return self.output(o, x), new

    # ---- the pairs adapter (bench/suites/pairs.py) -----------------------------------------------
    # Neutral: β = 1, no forgetting (γ = 1); the read at a key k is the Mesa read Gᵀ (H + Λ)^{-1} k.
    no_pairs: ClassVar[str | None] = None

    def pair_dims(self) -> tuple[int, int, int]:
        return self.num_heads, self.head_dim, self.head_dim

    def pair_inputs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.project(x, self.init_state(x.shape[0]))[1:3]

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """H ← γ H + β k kᵀ, G ← γ G + β k vᵀ a pair at a time (the layer's op); β, γ from x, else 1."""
        st = self.state
        H, G = st["H"], st["G"]
        k, v = k.to(H.dtype), v.to(H.dtype)
        if x is not None:
            _, _, _, beta, log_gamma = self.project(x, self.init_state(x.shape[0]))
            beta, log_gamma = beta.to(H.dtype), log_gamma.to(H.dtype)
        else:
            beta, log_gamma = torch.ones(k.shape[:3], dtype=H.dtype, device=k.device), None
        kb = beta[..., None] * k
        with state_precision(k.device):
            H, G = linear_attention_final_state(kb, k, log_gamma, H), linear_attention_final_state(kb, v, log_gamma, G)
        self.load_state({**st, "H": H, "G": G})

    def read_keys(self, k: Tensor) -> Tensor:
        """Gᵀ (H + Λ)^{-1} k per head: the value the least-squares map holds at k."""
        st = self.state
        H, G = st["H"], st["G"]
        k = k.to(H.dtype)
        zeros = torch.zeros(k.shape[:3], dtype=H.dtype, device=k.device)
        with state_precision(k.device):  # the step read with no write of its own (β = 0, γ = 1)
            return mesa_step_read(k, k, k, zeros, zeros, self.lam().to(H.dtype), H, G, self.max_cg_steps, self.cg_eps)

    # ---- diagnostics ---------------------------------------------------------------------------
    @torch.no_grad()
    def stats(self) -> dict:
        out = super().stats()
        for h, n in enumerate(self.state["G"].float().pow(2).sum(dim=(0, 2, 3)).sqrt().tolist()):
            out[f"norm/G/head{h}"] = n
        for h, lam in enumerate(self.lam().float().mean(-1).tolist()):
            out[f"lambda/head{h}"] = lam
        return out

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"conv_size={self.conv_size}, use_output_gate={self.use_output_gate}, "
                f"max_cg_steps={self.max_cg_steps}")
