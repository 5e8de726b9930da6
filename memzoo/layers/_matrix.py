"""What the memories whose state is one matrix per head share, written once (not a layer: modules
starting with ``_`` are not autoloaded).

`MatrixMemory`: a state ``S`` [B, H, K, V] (the linear-attention, gated Hebbian and delta-rule
layers): its read by a key for the pairs suite, ``read_keys`` (Sᵀk per head, the read without its
query's scale), ``pair_dims`` (H, K, V) and the per-head norms of ``stats``. A subclass sets
``num_heads``, ``head_dim`` (K) and ``head_v_dim`` (V), or overrides ``pair_dims``.

`GatedLinearMemory`: a `MatrixMemory` written by the shared op :mod:`memzoo.ops.linear_attention`,
S ← Diag(α_t) S + k_t v_tᵀ and read o_t = S_tᵀ q_t after its token's write (GLA, HGRN-2): the verbs and
the pairs adapter, from the layer's ``query(x)``, ``keys_values(x) -> (k, v, log α)``, ``output(o, x)``,
``cdtype()`` and ``parallel_chunk``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from memzoo.layers.base import MemoryLayer, State
from memzoo.ops.linear_attention import linear_attention, linear_attention_final_state


class MatrixMemory(MemoryLayer):
    """A memory whose state ``S`` is one matrix per head, [B, H, K, V]."""

    def pair_dims(self) -> tuple[int, int, int]:
        return self.num_heads, self.head_dim, self.head_v_dim

    def read_keys(self, k: Tensor) -> Tensor:
        """Sᵀ k per head: the value the memory holds at key k (the read without its query's scale)."""
        S = self.state["S"]
        return torch.einsum("bnhk,bhkv->bnhv", k.to(S.dtype), S)

    @torch.no_grad()
    def stats(self) -> dict:
        out = super().stats()
        for h, n in enumerate(self.state["S"].float().pow(2).sum(dim=(0, 2, 3)).sqrt().tolist()):
            out[f"norm/S/head{h}"] = n
        return out


class GatedLinearMemory(MatrixMemory):
    """A matrix memory on the shared linear-attention op with a decay; see the module docstring."""

    chunk_size = None
    per_sequence = True
    #: forward writes token t, then reads it (o_t reads S_t)
    inclusive: ClassVar[bool] = True
    #: chunk length of the chunked op inside forward (any value is exact); its [C, C, K] decays stay small
    parallel_chunk: int = 16

    def init_state(self, batch_size: int) -> State:
        w = self.o_proj.weight
        return {"S": torch.zeros(batch_size, self.num_heads, self.head_dim, self.head_v_dim, dtype=self.cdtype(),
                                 device=w.device)}

    def read_state(self, x: Tensor, state: State) -> Tensor:
        """o_t = Sᵀ q_t with the memory so far (the query's scale folded into it); x itself is not written."""
        S = state["S"]
        return self.output(torch.einsum("bthk,bhkv->bthv", self.query(x).to(S.dtype), S), x)

    def write_state(self, x: Tensor, state: State) -> State:
        """S ← Diag(α_t) S + k_t v_tᵀ for every token of x, in order."""
        return {"S": linear_attention_final_state(*self.keys_values(x), state["S"])}

    def forward_state(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        k, v, log_alpha = self.keys_values(x)
        o, S = linear_attention(self.query(x), k, v, log_alpha, state["S"], chunk_size=self.parallel_chunk)
        return self.output(o, x), {"S": S}

    # ---- the pairs adapter (bench/suites/pairs.py): neutral, no decay (α = 1) and the raw read Sᵀk
    no_pairs: ClassVar[str | None] = None

    def pair_inputs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.keys_values(x)[:2]

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """S ← Diag(α) S + k vᵀ a pair at a time (the layer's op); α from x, else 1."""
        S = self.state["S"]
        log_alpha = self.keys_values(x)[2].to(S.dtype) if x is not None else None
        self.load_state({"S": linear_attention_final_state(k.to(S.dtype), v.to(S.dtype), log_alpha, S)})
