"""Linear attention as a fast weight programmer (Schlag, Irie & Schmidhuber 2021).

"Linear Transformers are secretly fast weight programmers": a slow network (the
projections below) programs, token by token, a fast weight matrix per head by
outer-product writes, and the same matrix is queried by the current token.

Slow projections (no bias), for H heads of key/value size K = V = head_dim:

    q_t = φ(W_q x_t),  k_t = φ(W_k x_t),  v_t = W_v x_t                    q_t, k_t ∈ R^K, v_t ∈ R^V

with the feature map φ (Katharopoulos et al. 2020 use φ(u) = elu(u) + 1):
``"elu"`` → elu(u) + 1 (positive), ``"identity"`` → u, ``"l2"`` → u / ‖u‖ (Schlag et al.
normalise keys and queries so that the fast-weight memory stays bounded).

Write (fast-weight update; λ_t = 1 unless ``decay=True``):

    S_t = λ_t S_{t-1} + k_t v_tᵀ                      S ∈ R^{K×V}  (Schlag et al. Eq. 4-5, "sum" update)
    z_t = λ_t z_{t-1} + k_t                           only with ``normalize`` (Katharopoulos Eq. 6)

Read:

    o_t = S_tᵀ q_t                                     (unnormalised, Schlag et al. Eq. 6)
    o_t = S_tᵀ q_t / (z_tᵀ q_t + ε)                    (``normalize=True``, Katharopoulos Eq. 6)
    y_t = W_o [o_t^1; …; o_t^H]

Decay (``decay=True``): a data-dependent per-head forget gate
``λ_t = sigmoid(w_hᵀ x_t + b_h)`` (the gated/retention family: GLA, RetNet when w = 0).
We chose the data-dependent gate because it contains the fixed per-head scalar as a special
case: ``w`` is initialised to zero and ``b`` so that the heads start with RetNet's fixed
decays λ_h ∈ [1 − 2⁻⁵, 1 − 2⁻⁹]; training can then make forgetting content-dependent.

How the MemoryLayer verbs map onto the equations — **forward is inclusive**:

- ``read_state(x, S)``: o_t = Sᵀ q_t for every position of x with the memory so far;
  it never writes, not even x's own tokens (pure).
- ``write_state(x, S)``: applies the writes of every token of x, in order.
- ``forward_state(x, S)``: the causal token mixer of linear attention. Per token it
  **writes x_t, then reads at x_t** (position t sees its own value, as in every linear
  transformer; otherwise the first token would read nothing). This is *not* the base
  class's default read-then-write; the class attribute ``inclusive = True`` declares it,
  and the shared property suite checks forward against exactly this per-token definition.
  The parallel form is the chunked op in :mod:`memzoo.ops.linear_attention`.

The state is per sequence (``per_sequence = True``) and token-recurrent (``chunk_size =
None``): ``{"S": [B, H, K, V]}``, plus ``{"z": [B, H, K]}`` when normalising.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.layers._matrix import MatrixMemory
from memzoo.layers.base import State, head_size
from memzoo.modules.precision import compute_dtype
from memzoo.ops.linear_attention import linear_attention, linear_attention_final_state
from memzoo.registration import register_layer

FEATURE_MAPS = ("elu", "identity", "l2")


@register_layer("linear")
class LinearAttentionMemory(MatrixMemory):
    """Linear attention / fast weight programmer; see the module docstring for the equations.

    Args:
        d_model: model width D.
        num_heads: number of heads H.
        head_dim: K = V per head; default D // H.
        feature_map: "elu" (elu+1, Katharopoulos), "identity", or "l2" (L2-normalise q and k).
        decay: add a data-dependent per-head forget gate λ_t = sigmoid(w_hᵀx_t + b_h).
        normalize: divide the read by qᵀz (Katharopoulos). None (default) = True for the
            positive "elu" map, False otherwise; True with a map that can make qᵀz ≤ 0
            ("identity", "l2") is rejected.
        eps: added to the normaliser qᵀz.
    """

    family = "hebbian"

    chunk_size = None
    per_sequence = True
    #: forward is per token write-then-read (see module docstring)
    inclusive: ClassVar[bool] = True
    #: chunk length of the parallel (chunked) op inside forward; any value gives the same result
    parallel_chunk: int = 64
    bench_cost = 1.1

    def __init__(
        self,
        d_model: int,
        num_heads: int = 4,
        head_dim: int | None = None,
        feature_map: str = "elu",
        decay: bool = False,
        normalize: bool | None = None,
        eps: float = 1e-6,
    ):
        super().__init__(d_model)
        head_dim = head_size(d_model, num_heads, head_dim)
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"unknown feature_map {feature_map!r}; choose one of {list(FEATURE_MAPS)}")
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if normalize is None:
            normalize = feature_map == "elu"
        elif normalize and feature_map != "elu":
            raise ValueError(
                f"normalize=True needs a positive feature map so that qᵀz > 0; feature_map={feature_map!r} "
                "can make it zero or negative. Use feature_map='elu' or normalize=False"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.feature_map = feature_map
        self.decay = bool(decay)
        self.normalize = bool(normalize)
        self.eps = eps

        inner = num_heads * head_dim
        # slow weights
        self.q_proj = nn.Linear(d_model, inner, bias=False)
        self.k_proj = nn.Linear(d_model, inner, bias=False)
        self.v_proj = nn.Linear(d_model, inner, bias=False)
        self.o_proj = nn.Linear(inner, d_model, bias=False)
        if self.decay:
            self.decay_proj = nn.Linear(d_model, num_heads, bias=True)
            nn.init.zeros_(self.decay_proj.weight)
            with torch.no_grad():
                exps = torch.linspace(5.0, 9.0, num_heads) if num_heads > 1 else torch.tensor([5.0])
                lam = 1.0 - 2.0 ** (-exps)
                self.decay_proj.bias.copy_(torch.log(lam) - torch.log1p(-lam))  # sigmoid(b) = λ
        self._last_decay: Tensor | None = None

    # ---- slow projections ---------------------------------------------------------------
    def _phi(self, u: Tensor) -> Tensor:
        if self.feature_map == "elu":
            return F.elu(u) + 1.0
        if self.feature_map == "l2":
            return F.normalize(u, dim=-1)
        return u

    def _heads(self, u: Tensor) -> Tensor:  # [B, T, H*K] -> [B, T, H, K]
        return u.reshape(*u.shape[:-1], self.num_heads, self.head_dim)

    def _query(self, x: Tensor) -> Tensor:
        return self._phi(self._heads(self.q_proj(x)))

    def _keys_values(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        k = self._phi(self._heads(self.k_proj(x)))
        v = self._heads(self.v_proj(x))
        log_decay = None
        if self.decay:
            log_decay = F.logsigmoid(self.decay_proj(x))  # [B, T, H], log λ_t
            with torch.no_grad():
                if log_decay.shape[1] > 0:
                    self._last_decay = log_decay.detach().exp().float().mean(dim=(0, 1)).cpu()
        if self.normalize:  # a ones column in v accumulates z in the last column of the state
            v = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)
        return k, v, log_decay

    # ---- state ---------------------------------------------------------------------------
    def _state_dtype(self) -> torch.dtype:
        return compute_dtype(self.q_proj.weight)

    def init_state(self, batch_size: int) -> State:
        w = self.q_proj.weight
        H, K = self.num_heads, self.head_dim
        state = {"S": torch.zeros(batch_size, H, K, K, dtype=self._state_dtype(), device=w.device)}
        if self.normalize:
            state["z"] = torch.zeros(batch_size, H, K, dtype=self._state_dtype(), device=w.device)
        return state

    def _pack(self, state: State) -> Tensor:
        if self.normalize:
            return torch.cat([state["S"], state["z"][..., None]], dim=-1)
        return state["S"]

    def _unpack(self, S: Tensor) -> State:
        if self.normalize:
            return {"S": S[..., :-1], "z": S[..., -1]}
        return {"S": S}

    def _output(self, o: Tensor, x: Tensor) -> Tensor:
        """o: [B, T, H, V(+1)] in state dtype -> y [B, T, D]."""
        if self.normalize:
            o = o[..., :-1] / (o[..., -1:] + self.eps)
        return self.o_proj(o.flatten(-2).to(x.dtype))

    # ---- read ----------------------------------------------------------------------------
    def read_state(self, x: Tensor, state: State) -> Tensor:
        """o_t = Sᵀ q_t (/ zᵀ q_t + ε): retrieve with the memory so far; x itself is not written."""
        S = self._pack(state)
        q = self._query(x).to(S.dtype)
        return self._output(torch.einsum("bthk,bhkv->bthv", q, S), x)

    # ---- write ---------------------------------------------------------------------------
    def write_state(self, x: Tensor, state: State) -> State:
        """S ← λ_t S + k_t v_tᵀ (z ← λ_t z + k_t) for t = 1..T, all at once (one einsum)."""
        k, v, log_decay = self._keys_values(x)
        return self._unpack(linear_attention_final_state(k, v, log_decay, self._pack(state)))

    # ---- causal mixing (inclusive: per token write, then read) ----------------------------
    def forward_state(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        q = self._query(x)
        k, v, log_decay = self._keys_values(x)
        o, S = linear_attention(q, k, v, log_decay, self._pack(state), chunk_size=self.parallel_chunk)
        return self._output(o, x), self._unpack(S)

    # ---- the pairs adapter (bench/suites/pairs.py) -----------------------------------------
    # Neutral: no decay (λ = 1), the raw read Sᵀk (the normaliser z is kept as the layer keeps it, not
    # divided by: the outer product's crosstalk is what a pair read shows).
    no_pairs: ClassVar[str | None] = None

    def pair_dims(self) -> tuple[int, int, int]:
        return self.num_heads, self.head_dim, self.head_dim

    def pair_inputs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        k, v, _ = self._keys_values(x)
        return k, v[..., : self.head_dim]

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """S ← λ S + k vᵀ a pair at a time (the layer's op); λ from x with ``decay``, else 1."""
        log_decay = self._keys_values(x)[2] if x is not None else None
        if self.normalize:
            v = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)
        S = self._pack(self.state)
        self.load_state(self._unpack(linear_attention_final_state(k.to(S.dtype), v.to(S.dtype), log_decay, S)))

    # ---- diagnostics ---------------------------------------------------------------------
    @torch.no_grad()
    def stats(self) -> dict:
        out = super().stats()  # the per-head norms of S (MatrixMemory)
        if self.decay:
            for h, b in enumerate(torch.sigmoid(self.decay_proj.bias.float()).tolist()):
                out[f"decay/bias/head{h}"] = b  # λ of a zero input
            if self._last_decay is not None:  # mean λ_t over the tokens of the last write/forward
                for h, lam in enumerate(self._last_decay.tolist()):
                    out[f"decay/mean/head{h}"] = lam
        return out

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"feature_map={self.feature_map!r}, decay={self.decay}, normalize={self.normalize}"
        )
