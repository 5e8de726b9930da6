"""The shell the delta-rule memories share (DeltaNet, Gated DeltaNet, DeltaProduct, KDA, RWKV-7).

Each of them keeps, per sequence and per head, one matrix S ∈ R^{K×V} that a token reads with its
query (o_t = scale · S_tᵀ q_t) and writes by a rule of the delta family: the value the memory holds
at the token's key is replaced, not added to. What differs is the rule (the layer's file, its
`scan`) and the output's norm and gate (its `output`); this class holds the rest once:

- the MemoryLayer verbs: ``read_state`` is the read with S as it is; ``write_state`` runs the rule
  over x; ``forward_state`` is the inclusive token mixer (per token: write, then read), the form
  every one of the papers defines, computed by the chunked op in one call;
- the state: ``S`` [B, H, K, V] and the short-convolution histories of the projections a layer
  convolves (``conv_<name>`` [B, c-1, channels]), so a sequence split at any token streams exactly;
- the short convolutions (size 4, SiLU, as fla's layers). **Only on what a write uses** (k, v, β
  inputs): the query is pointwise, ``L2(silu(W_q x))``. A read of x_t right after its write would
  need the convolution's history *before* x_t, a read of a fresh query the history *with* it; no
  state serves both (the same reason as MoM's, memzoo/layers/mom.py), and the memory read is then
  the same function in `read` and in `forward`.

Slow Linear weights start at torch's default init, as the backbone's GDN mixer's (fla's layers leave
theirs to the model's init); the state is fp32 (fp64 for fp64 weights), so bf16 autocast never rounds the fast weights.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.layers._matrix import MatrixMemory
from memzoo.layers.base import State, head_size
from memzoo.modules.conv import causal_conv_stream, conv_weights
from memzoo.modules.precision import compute_dtype

def linear(d_in: int, d_out: int, bias: bool = False) -> nn.Linear:
    """A slow projection: torch's default init (as the backbone's GDN), a bias at zero."""
    lin = nn.Linear(d_in, d_out, bias=bias)
    if bias:
        nn.init.zeros_(lin.bias)
    return lin


class DeltaRuleMemory(MatrixMemory):
    """Base of the delta-rule memories; see the module docstring. Subclasses define `scan` (the
    write rule over a sequence, with the inclusive read when given queries) and may override
    `query` and `output`."""

    family = "delta"
    chunk_size = None
    per_sequence = True
    #: forward writes token t, then reads it (the papers' token mixer)
    inclusive: ClassVar[bool] = True
    #: chunk length of the chunked op inside forward (any value is exact)
    parallel_chunk: int = 16
    bench_cost = 1.5

    def __init__(self, d_model: int, num_heads: int, head_dim: int | None, expand_v: float, conv_size: int,
                 norm_eps: float):
        super().__init__(d_model)
        head_dim = head_size(d_model, num_heads, head_dim)
        v_dim = head_dim * expand_v
        if head_dim < 1 or v_dim < 1 or v_dim != int(v_dim):
            raise ValueError(f"head_dim={head_dim} and head_dim * expand_v={v_dim} must be positive integers")
        if conv_size < 0:
            raise ValueError(f"conv_size must be >= 0 (0 or 1 = no short convolution), got {conv_size}")
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {norm_eps}")
        self.num_heads, self.head_dim, self.head_v_dim = num_heads, head_dim, int(v_dim)
        self.key_dim, self.value_dim = num_heads * head_dim, num_heads * int(v_dim)
        self.conv_size, self.eps = conv_size, norm_eps
        self.scale = head_dim ** -0.5
        self.q_proj = linear(d_model, self.key_dim)
        self.o_proj = linear(self.value_dim, d_model)
        self._convs: dict[str, int] = {}

    def add_convs(self, **channels: int) -> None:
        """Short convolutions (taps first, [c, channels]) on the named write-side projections."""
        if self.conv_size > 1:
            for name, ch in channels.items():
                setattr(self, f"{name}_conv", nn.Parameter(conv_weights(ch, self.conv_size)))
                self._convs[name] = ch

    # ---- helpers -------------------------------------------------------------------------------
    def cdtype(self) -> torch.dtype:
        return compute_dtype(self.o_proj.weight)

    def heads(self, u: Tensor, d: int | None = None) -> Tensor:
        """[..., H·d] -> [..., H, d] (d = head_dim by default)."""
        return u.unflatten(-1, (self.num_heads, d or self.head_dim))

    def conv(self, name: str, u: Tensor, state: State, new: State) -> Tensor:
        """silu(short conv of u [B, T, C] along T, continuing state's history); the new history goes
        into `new`. Without a convolution (conv_size <= 1): silu(u)."""
        if name in self._convs:
            u, new[f"conv_{name}"] = causal_conv_stream(u, state[f"conv_{name}"], getattr(self, f"{name}_conv"))
        return F.silu(u)

    # ---- state ---------------------------------------------------------------------------------
    def init_state(self, batch_size: int) -> State:
        dev, dt = self.o_proj.weight.device, self.cdtype()
        st = {"S": torch.zeros(batch_size, self.num_heads, self.head_dim, self.head_v_dim, dtype=dt, device=dev)}
        for name, ch in self._convs.items():
            st[f"conv_{name}"] = torch.zeros(batch_size, self.conv_size - 1, ch, dtype=dt, device=dev)
        return st

    # ---- what a layer defines ------------------------------------------------------------------
    def query(self, x: Tensor) -> Tensor:
        """q_t = L2(silu(W_q x_t)) per head: [B, T, H, K] (pointwise: module docstring)."""
        return F.normalize(F.silu(self.heads(self.q_proj(x).to(self.cdtype()))), dim=-1)

    def scan(self, x: Tensor, state: State, q: Tensor | None) -> tuple[Tensor | None, State]:
        """Write every token of x in order; with queries q, also the inclusive reads o [B, T, H, V]
        (scaled). Returns (o or None, the new state)."""
        raise NotImplementedError

    def output(self, o: Tensor, x: Tensor) -> Tensor:
        """o [B, T, H, V] -> y [B, T, D]."""
        raise NotImplementedError

    # ---- the pairs adapter (bench/suites/pairs.py): keys and values as `keys_values` gives them;
    # a layer defines `write_pairs` (its op, its gates) and sets ``no_pairs = None``
    def pair_inputs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.keys_values(x, self.init_state(x.shape[0]), {})

    # ---- the MemoryLayer verbs -----------------------------------------------------------------
    def read_state(self, x: Tensor, state: State) -> Tensor:
        """o_t = scale · Sᵀ q_t with the memory so far; x itself is not written."""
        q = self.query(x)
        return self.output(self.scale * torch.einsum("bthk,bhkv->bthv", q, state["S"].to(q.dtype)), x)

    def write_state(self, x: Tensor, state: State) -> State:
        return self.scan(x, state, None)[1]

    def forward_state(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        o, new = self.scan(x, state, self.query(x))
        return self.output(o, x), new

    # ---- diagnostics ---------------------------------------------------------------------------
    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"head_v_dim={self.head_v_dim}, conv_size={self.conv_size}")
