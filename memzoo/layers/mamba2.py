"""Mamba-2 (Dao & Gu 2024, "Transformers are SSMs: Generalized Models and Efficient Algorithms Through
Structured State Space Duality", arXiv 2405.21060) as a memory layer: the Mamba-2 block (Sec. 7.1,
Fig. 6) with its SSD layer, the selective SSM whose transition is a scalar times the identity per head.

The SSM of one head, written as a fast-weight memory (Eq. 1a-1b, with the SSD layer's
scalar-times-identity A, discretised as Mamba's zero-order hold for A and Euler for B):

    h_t = a_t h_{t-1} + Δ_t B_t x_tᵀ        a_t = exp(Δ_t A) ∈ (0, 1)         (Eq. 1a; h_t ∈ R^{N×P})
    y_t = h_tᵀ C_t + D x_t                                                     (Eq. 1b, plus the skip D)

with x_t ∈ R^P the head's slice of the block's input, B_t, C_t ∈ R^N shared by all heads (the
multi-value pattern, Sec. 7.2: one group, fla's ``n_groups=1``), Δ_t a scalar per head. In the
terms of linear attention (the state space duality): B_t is a key, Δ_t x_t a value, C_t a query and
a_t a per-head decay, S_t = a_t S_{t-1} + k_t v_tᵀ, o_t = S_tᵀ q_t; the recurrence is the shared op
:mod:`memzoo.ops.linear_attention` (chunked: Sec. 6's SSD algorithm is its chunkwise form).

The block (Sec. 7.1, "Parallel parameter projections", Fig. 6 right), for width D, expansion E:

    [z, x, B, C, Δ̃] = W_in u_t                          one projection at the block's start
    [x, B, C]       = silu(conv1d([x, B, C]))            the short causal convolution (size 4, with bias)
    Δ_t             = softplus(Δ̃_t + dt_bias)            per head
    A               = −exp(A_log)                        per head
    y               = SSD(x, A, B, C, Δ) + D x           the recurrence above, D per head
    out             = W_out (RMSNorm(y ⊙ silu(z)) ⊙ w)   the extra normalisation of Sec. 7.1, gated

Where the paper is silent, fla's layer (``fla/layers/mamba2.py``, ``Mamba2.__init__`` and
``torch_forward``) decides: no bias on W_in / W_out, a bias on the convolution; D one per head,
initialised to 1; A ~ U(1, 16) (``A_init_range``) and softplus(dt_bias) ~ logU(1e-3, 1e-1) (the
init is :func:`memzoo.modules.gates.mamba2_decay_init`); no clamp on Δ (``dt_limit``
(0, ∞)); the gate multiplies *before* the norm (``norm_before_gate=False``) and the RMSNorm runs
over the whole E·D width (one group); no scale on the read (C_t is not divided by √N).

How the MemoryLayer verbs map onto the equations. The paper's output at t reads h_t, which holds
x_t's own write; written with h_{t-1},

    y_t = a_t C_tᵀ h_{t-1} + (Δ_t C_t·B_t + D) x_t

is a read of the memory *so far* plus the token's own diagonal term (the diagonal of the SSD's
semiseparable matrix, and the skip). So the layer is read-then-write per token (``inclusive = False``,
``chunk_size = None``): ``read_state`` computes this y_t from S and x alone, never writing;
``write_state`` applies h ← a h + Δ B xᵀ token by token; ``forward_state`` is the chunked SSD, equal to
the per-token read-then-write. The query C_t and the skip's x_t are convolved like the write's
inputs, continuing from the convolution's history, which is why the read cannot be the inclusive
``Sᵀ C_t`` after a write (a read of x_t right after its write would need the history before x_t,
memzoo/layers/_delta.py): the diagonal term makes the paper's convolved C_t readable.

The state, per sequence: ``S`` [B, H, N, P] (h in the [key, value] layout of the op) and
``conv`` [B, c−1, E·D + 2N], the last c−1 pre-convolution inputs, so a stream splits at any token.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.layers._delta import linear
from memzoo.layers._matrix import MatrixMemory
from memzoo.layers.base import State
from memzoo.modules.conv import causal_conv_stream, conv_weights
from memzoo.modules.gates import MAMBA2_A_RANGE, mamba2_decay_init
from memzoo.modules.norm import rms_norm
from memzoo.modules.precision import compute_dtype
from memzoo.ops.linear_attention import linear_attention, linear_attention_final_state
from memzoo.registration import register_layer


def ssd_read(S: Tensor, C: Tensor, B: Tensor, x: Tensor, dt: Tensor, log_a: Tensor, D: Tensor) -> Tensor:
    """y_t = a_t C_tᵀ S + (Δ_t C_t·B_t + D) x_t: the output at t from the memory before t (Eq. 1a-1b with
    h_t unrolled one step). S [B, H, N, P], C and B [B, T, H, N], x [B, T, H, P], dt, log_a [B, T, H], D [H]."""
    diag = dt * (C * B).sum(-1) + D  # [B, T, H]
    return log_a.exp()[..., None] * torch.einsum("bthn,bhnp->bthp", C, S) + diag[..., None] * x


@register_layer("mamba2")
class Mamba2(MatrixMemory):
    """The Mamba-2 block as a memory layer; see the module docstring for the equations.

    Args:
        d_model: model width D.
        d_state: N, the SSM state size (the size of B_t and C_t).
        head_dim: P, the channels of x per head; H = expand · D / P heads.
        expand: E, the block's expansion of x and z.
        conv_size: width of the short convolution on x, B, C (0 or 1 = none, then SiLU only).
        norm_eps: eps of the gated RMSNorm.
    """

    family = "gated_hebbian"
    chunk_size = None
    per_sequence = True
    #: read with the memory so far, then write; the read carries the token's own diagonal term
    inclusive: ClassVar[bool] = False
    #: chunk length of the chunked op inside forward (any value is exact)
    parallel_chunk: int = 64
    bench_cost = 1.3

    def __init__(self, d_model: int, d_state: int = 128, head_dim: int = 64, expand: float = 2, conv_size: int = 4,
                 norm_eps: float = 1e-5):
        super().__init__(d_model)
        inner = expand * d_model
        if not expand > 0 or inner != int(inner) or inner < 1:
            raise ValueError(f"expand must be > 0 with expand * d_model a positive integer; got expand={expand}")
        inner = int(inner)
        if head_dim < 1 or inner % head_dim:
            raise ValueError(f"head_dim={head_dim} must divide expand * d_model = {inner} (H = expand * d_model / head_dim)")
        if d_state < 1:
            raise ValueError(f"d_state must be >= 1, got {d_state}")
        if conv_size < 0:
            raise ValueError(f"conv_size must be >= 0 (0 or 1 = no short convolution), got {conv_size}")
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {norm_eps}")
        self.inner, self.d_state, self.head_dim = inner, d_state, head_dim
        self.num_heads = inner // head_dim
        self.expand, self.conv_size, self.eps = expand, conv_size, norm_eps
        self.conv_dim = inner + 2 * d_state
        # W_in: [z, x, B, C, Δ̃] (Sec. 7.1, all projections at the block's start)
        self.in_proj = linear(d_model, inner + self.conv_dim + self.num_heads)
        if conv_size > 1:
            self.conv_weight = nn.Parameter(conv_weights(self.conv_dim, conv_size))
            self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim))
        A_log, dt_bias = mamba2_decay_init(self.num_heads, MAMBA2_A_RANGE)
        self.A_log, self.dt_bias = nn.Parameter(A_log), nn.Parameter(dt_bias)
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.A_log._no_weight_decay = self.dt_bias._no_weight_decay = self.D._no_weight_decay = True
        self.norm_weight = nn.Parameter(torch.ones(inner))
        self.out_proj = linear(inner, d_model)

    # ---- the slow projections ------------------------------------------------------------------
    def cdtype(self) -> torch.dtype:
        return compute_dtype(self.out_proj.weight)

    def project(self, u: Tensor, state: State, new: State | None = None):
        """[z, x, B, C, Δ, log a] from u [B, T, D], the convolution continuing from state's history (its new
        history into `new`): z [B, T, E·D]; x [B, T, H, P]; B, C [B, T, H, N] (one group: the same for every
        head); Δ and log a_t = Δ_t A [B, T, H]."""
        dt_ = self.cdtype()
        z, xBC, dt_raw = self.in_proj(u).to(dt_).split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        if self.conv_size > 1:
            xBC, hist = causal_conv_stream(xBC, state["conv"], self.conv_weight)
            xBC = xBC + self.conv_bias.to(dt_)
            if new is not None:
                new["conv"] = hist
        x, Bm, Cm = F.silu(xBC).split([self.inner, self.d_state, self.d_state], dim=-1)
        H = self.num_heads
        x = x.unflatten(-1, (H, self.head_dim))
        Bm = Bm[..., None, :].expand(*Bm.shape[:-1], H, self.d_state)
        Cm = Cm[..., None, :].expand(*Cm.shape[:-1], H, self.d_state)
        dt = F.softplus(dt_raw + self.dt_bias.to(dt_))
        log_a = -self.A_log.to(dt_).exp() * dt
        return z, x, Bm, Cm, dt, log_a

    def output(self, y: Tensor, z: Tensor, u: Tensor) -> Tensor:
        """out = W_out (RMSNorm(y ⊙ silu(z)) ⊙ w), the norm over the whole E·D width: y [B, T, H, P]."""
        g = y.flatten(-2) * F.silu(z)
        g = rms_norm(g, self.norm_weight, self.eps)
        return self.out_proj(g.to(u.dtype))

    # ---- state ---------------------------------------------------------------------------------
    def init_state(self, batch_size: int) -> State:
        dev, dt = self.out_proj.weight.device, self.cdtype()
        st = {"S": torch.zeros(batch_size, self.num_heads, self.d_state, self.head_dim, dtype=dt, device=dev)}
        if self.conv_size > 1:
            st["conv"] = torch.zeros(batch_size, self.conv_size - 1, self.conv_dim, dtype=dt, device=dev)
        return st

    # ---- the verbs -----------------------------------------------------------------------------
    def read_state(self, u: Tensor, state: State) -> Tensor:
        """y_t = a_t C_tᵀ S + (Δ_t C_t·B_t + D) x_t with the memory so far (module docstring); no write."""
        z, x, Bm, Cm, dt, log_a = self.project(u, state)
        return self.output(ssd_read(state["S"].to(x.dtype), Cm, Bm, x, dt, log_a, self.D.to(x.dtype)), z, u)

    def write_state(self, u: Tensor, state: State) -> State:
        """h ← a_t h + B_t (Δ_t x_t)ᵀ for every token of u, in order (Eq. 1a)."""
        new: State = {}
        _, x, Bm, _, dt, log_a = self.project(u, state, new)
        new["S"] = linear_attention_final_state(Bm, dt[..., None] * x, log_a, state["S"])
        return new

    def forward_state(self, u: Tensor, state: State) -> tuple[Tensor, State]:
        """The SSD, chunked: o_t = C_tᵀ h_t (the op's inclusive read), y_t = o_t + D x_t (Eq. 1a-1b)."""
        new: State = {}
        z, x, Bm, Cm, dt, log_a = self.project(u, state, new)
        o, new["S"] = linear_attention(Cm, Bm, dt[..., None] * x, log_a, state["S"],
                                               chunk_size=self.parallel_chunk)
        return self.output(o + self.D.to(x.dtype)[:, None] * x, z, u), new

    # ---- the pairs adapter (bench/suites/pairs.py) -----------------------------------------------
    # Neutral: no decay (a = 1); the key B_t and the value Δ_t x_t as the layer's write makes them.
    no_pairs: ClassVar[str | None] = None

    def pair_dims(self) -> tuple[int, int, int]:
        return self.num_heads, self.d_state, self.head_dim

    def pair_inputs(self, u: Tensor) -> tuple[Tensor, Tensor]:
        _, x, Bm, _, dt, _ = self.project(u, self.init_state(u.shape[0]))
        return Bm, dt[..., None] * x

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """h ← a h + k vᵀ a pair at a time (the layer's op); a = exp(Δ_t A) from x, else 1."""
        S = self.state["S"]
        log_a = self.project(x, self.init_state(x.shape[0]))[5].to(S.dtype) if x is not None else None
        self.load_state({**self.state, "S": linear_attention_final_state(k.to(S.dtype), v.to(S.dtype), log_a, S)})

    # ---- diagnostics ---------------------------------------------------------------------------
    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, d_state={self.d_state}, head_dim={self.head_dim}, "
                f"num_heads={self.num_heads}, expand={self.expand}, conv_size={self.conv_size}")
