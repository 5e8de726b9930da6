"""Product Key Memory (Lample et al. 2019, "Large Memory Layers with Product Keys"): the
slow-weight sparse key-value memory that *replaces the FFN* of its block (FwPKM paper Sec. 2
and Sec. 4.1; sizes of Table 3).

N = n² value slots sit on an n × n grid; the key of slot (i, j) is the concatenation of the
i-th sub-key of the first half and the j-th of the second, so the top-k of all N slots is found
from 2n sub-key scores (the shared ops in :mod:`memzoo.ops.product_key`). Per head h = 1..H:

    q^h              = Norm(W_q x + b_q)^h                     query network (Lample et al. Sec. 3.2)
    [q¹; q²]         = q^h                                      Eq. 5   (split in halves)
    s^{1,2}_i        = q^{1,2}ᵀ K^{h,{1,2}}_i                   Eq. 6   (dot-product sub-key scores)
    I^{1,2}          = T_k(s^{1,2})                             Eq. 7
    I^h              = T_k({s¹_i + s²_j | i ∈ I¹, j ∈ I²})      Eq. 8   (slot (i, j) = row i·n + j)
    s'               = softmax({s_(i,j)}_{(i,j) ∈ I^h})         Eq. 3   (per head, over its top-k)
    v̂^h              = Σ_{(i,j) ∈ I^h} s'_(i,j) V_(i,j)          Eq. 9 (= Eq. 4)

The H heads read *one* value table V ∈ R^{N × D_V} and their reads are summed, as XLM does
(``v̂ = Σ_h v̂^h``: one embedding bag over the H·k retrieved slots). The output is mapped back
to the model width with the SwiGLU-style gated projection of Meta's memory-layer code that the
FwPKM authors' release uses (``swilu_projection=True`` in ``src/models/pkm/memory.py``;
Berges et al. 2024, "Memory Layers at Scale"):

    y = W_o (v̂ ⊙ silu(W_g x + b_g)) + b_o                    W_g: D → D_V, W_o: D_V → D

(``output_gate=False`` drops W_g: y = W_o v̂ + b_o.)

Parameters at the paper's sizes (D = 768, D_K = D_V = 512, H = 4, k = 32, n = 512), matching the
release's ``HashingMemory(input_dim=768, output_dim=768, mem_k_dim=512, mem_v_dim=512,
mem_heads=4, mem_knn=32, mem_n_keys=512, mem_share_values=False, mem_query_rmsnorm=True)``:

    values V       512² × 512             134,217,728
    sub-keys K     4 × 2 × 512 × 256        1,048,576
    W_q, b_q       768 × 2048 + 2048        1,574,912
    query RMSNorm  2048                         2,048
    W_g, b_g       768 × 512 + 512            393,728
    W_o, b_o       512 × 768 + 768            393,984
    total                                 137,630,976

which reproduces every ``| PKM@2,6,10`` row of Table 2 from its plain row (e.g. GDN: 112.11 M
− 3 SwiGLU FFNs of 5,308,416 + 3 × 137,630,976 = 509.08 M). The gated projection is what makes
the count right (without it each row is 1.18 M short); a BatchNorm's extra 2,048 affine biases
per layer would make three of the four rows round up by 0.01 M.

Query normalisation (``query_norm``):

- ``"rmsnorm"`` (default): RMSNorm over the H·D_K query features of each token (the release's
  ``mem_query_rmsnorm=True``, its default and what the paper's configs train with). Per token,
  so the layer is causal and streams exactly in training and evaluation alike.
- ``"batchnorm"``: BatchNorm1d over the H·D_K query features, Lample et al.'s remedy for
  memory collapse (slot usage 64.4% -> 97.9% at 4 heads × top-32, as quoted in FwPKM
  Sec. 3.3.1). **In training mode it is not causal**: the mean and variance are taken over all
  batch × time positions of the call, so a token's query depends on later tokens (and on the
  other sequences of the batch), and splitting a sequence changes the output. In eval mode it
  uses the running statistics and is per token again.
- ``"none"``: the raw projection.

How the MemoryLayer verbs map: PKM is the degenerate memory layer. Its memory is slow weights,
trained by the outer optimizer only; there is no fast state (``state == {}``), ``write`` is a
no-op, and ``read(x) == forward(x)``. It is one state shared across the batch
(``per_sequence = False``, any batch size), token-recurrent (``chunk_size = None``), and takes
its block's RMSNorm'd input in place of the FFN (``site = "ffn"``, ``prenorm = True``).

Optimisation: the values are slow weights with an optimizer group of their own
(:meth:`PKM.optim_groups`), without weight decay and with learning rate ``value_lr_scale`` × the
schedule's. XLM trains them with a separate Adam at a constant 1e-3 and no weight decay
(``--mem_values_optimizer "adam,lr=0.001"`` in ``xlm/model/memory/memory.py``; the PKM notebook:
"a constant learning rate of 1e-3 to learn the values, independently of ... the rest of the
network"), Meta's memory layers with ``value_fixed_lr=0.001``. The paper's peak LR is 1e-3
(Table 3), so the default scale 1.0 gives the values that 1e-3 at the peak; our trainer only
scales the shared schedule, so it then decays with the cosine like every other group. (The
FwPKM release keeps ``value_fixed_lr`` as an argument but its ``pretrain.py`` never reads it:
there the values train at the model LR *with* weight decay 0.1.) No weight decay because the
table is updated sparsely: a decoupled decay would shrink all N rows every step while a row
receives a gradient only when it is retrieved.

Initialisation as in the release's ``HashingMemory.reset_parameters`` (applied after the
Hugging Face init, which zeroes linear biases): sub-keys U(±D_K^-½), values N(0, D_V^-½),
W_q Xavier-uniform, W_g and W_o N(0, D^-½), biases 0, norm weights 1.

``stats()`` adds the slot usage of the last forward/read: the fraction of the N slots retrieved
by at least one (token, head) (Lample et al.'s "memory usage", the paper's usage figures), and
the KL divergence from uniform of the summed read weights (Lample et al.'s second measure).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.layers.base import MemoryLayer, State
from memzoo.modules.precision import compute_dtype
from memzoo.ops import product_key as pk
from memzoo.ops.product_key import Lookup, lookup, pair_scores, selected_subkey_scores
from memzoo.registration import register_layer

QUERY_NORMS = ("rmsnorm", "batchnorm", "none")


class QueryRMSNorm(nn.RMSNorm):
    """RMSNorm of the query features, computed in at least fp32 (as the release's Qwen3RMSNorm)
    and returned in the input dtype; float64 stays float64."""

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(compute_dtype(x))
        return F.rms_norm(xf, self.normalized_shape, self.weight.to(xf.dtype), self.eps).to(x.dtype)


@register_layer("pkm")
class PKM(MemoryLayer):
    """Product Key Memory replacing its block's FFN; see the module docstring for the equations.

    Args:
        d_model: model width D (input and output).
        key_dim: query / key size D_K per head (even: it is split in two halves, Eq. 5).
        value_dim: value size D_V.
        heads: number of read heads H (queries; they share the sub-key shapes and the values).
        topk: slots retrieved per head, k (Eqs. 7-8); at most n_subkeys.
        n_subkeys: sub-keys per half, n; the memory has N = n² slots.
        query_norm: "rmsnorm" (default, the release's; causal), "batchnorm" (Lample et al.;
            not causal in training mode) or "none".
        output_gate: the SwiGLU-style gated output projection of the release (default True).
        value_lr_scale: learning-rate multiplier of the values' optimizer group (default 1.0:
            1e-3 at the paper's peak LR, XLM's value learning rate).
        norm_eps: epsilon of the query RMSNorm / BatchNorm (1e-6 as the release).
        triton: on CUDA tensors, look up and read with the Triton kernels of
            :mod:`memzoo.kernels.fwpkm` (default True); False keeps the torch path.
    """

    family = "slots"

    chunk_size = None
    per_sequence = False  # no batch dimension; any batch size (the memory is the slow weights)
    site = "ffn"
    bench_cost = 1.3
    #: a token reads k rows of the values: Table 2's FLOPs leave them out (memzoo.flops)
    sparse_params = ("values",)
    #: no pairs adapter: the value table is a slow parameter (module docstring: ``write`` is a no-op)
    no_pairs = ("its memory is slow weights: write stores nothing per sequence; its capacity is that of its "
                "trained value table, probed by training, not by writes")

    def __init__(
        self,
        d_model: int,
        key_dim: int = 512,
        value_dim: int = 512,
        heads: int = 4,
        topk: int = 32,
        n_subkeys: int = 512,
        query_norm: str = "rmsnorm",
        output_gate: bool = True,
        value_lr_scale: float = 1.0,
        norm_eps: float = 1e-6,
        triton: bool = True,
    ):
        super().__init__(d_model)
        if key_dim < 2 or key_dim % 2:
            raise ValueError(f"key_dim must be even and >= 2 (it is split in two halves, Eq. 5), got {key_dim}")
        for what, v in (("value_dim", value_dim), ("heads", heads), ("topk", topk), ("n_subkeys", n_subkeys)):
            if v < 1:
                raise ValueError(f"{what} must be >= 1, got {v}")
        if topk > n_subkeys:
            raise ValueError(
                f"topk={topk} exceeds n_subkeys={n_subkeys}: the product top-k takes k sub-keys per half; "
                f"use topk <= {n_subkeys} or more sub-keys"
            )
        if query_norm not in QUERY_NORMS:
            raise ValueError(f"unknown query_norm {query_norm!r}; choose one of {list(QUERY_NORMS)}")
        if value_lr_scale < 0:
            raise ValueError(f"value_lr_scale must be >= 0, got {value_lr_scale}")
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {norm_eps}")
        self.key_dim, self.value_dim, self.heads = key_dim, value_dim, heads
        self.topk, self.n_subkeys = topk, n_subkeys
        self.n_slots = n_subkeys**2
        self.query_norm_kind = query_norm
        self.output_gate = bool(output_gate)
        self.value_lr_scale = float(value_lr_scale)
        self.triton = triton

        # ---- slow weights -------------------------------------------------------------------
        q_features = heads * key_dim
        self.query_proj = nn.Linear(d_model, q_features, bias=True)
        if query_norm == "rmsnorm":
            self.query_norm = QueryRMSNorm(q_features, eps=norm_eps)
        elif query_norm == "batchnorm":
            self.query_norm = nn.BatchNorm1d(q_features, eps=norm_eps, momentum=0.1, affine=True)
        else:
            self.query_norm = nn.Identity()
        self.subkeys = nn.Parameter(torch.empty(heads, 2, n_subkeys, key_dim // 2))  # K^{h,{1,2}}
        self.values = nn.Parameter(torch.empty(self.n_slots, value_dim))  # V, shared by the heads
        self.gate_proj = nn.Linear(d_model, value_dim, bias=True) if self.output_gate else None
        self.out_proj = nn.Linear(value_dim, d_model, bias=True)
        self.reset_parameters()

        self._usage: tuple[Tensor, Tensor] | None = None  # (slots, weights) of the last read; stats() counts them

    def reset_parameters(self) -> None:
        """The release's init (see the module docstring)."""
        with torch.no_grad():
            bound = 1.0 / math.sqrt(self.key_dim)
            nn.init.uniform_(self.subkeys, -bound, bound)
            nn.init.normal_(self.values, mean=0.0, std=self.value_dim**-0.5)
            nn.init.xavier_uniform_(self.query_proj.weight)
            nn.init.zeros_(self.query_proj.bias)
            for lin in (self.gate_proj, self.out_proj):
                if lin is not None:
                    nn.init.normal_(lin.weight, mean=0.0, std=self.d_model**-0.5)
                    nn.init.zeros_(lin.bias)
            if isinstance(self.query_norm, (nn.RMSNorm, nn.BatchNorm1d)):
                self.query_norm.reset_parameters()

    # ---- optimisation --------------------------------------------------------------------
    def optim_groups(self) -> list[dict]:
        """The values in a group of their own: lr × value_lr_scale, no weight decay (see the
        module docstring). The trainer's `param_groups` takes them out of the default groups."""
        return [{"params": [self.values], "lr_scale": self.value_lr_scale, "weight_decay": 0.0}]

    # ---- state: none (the memory is slow weights) ----------------------------------------
    @property
    def _state(self) -> State:
        return {}

    @_state.setter
    def _state(self, state: State | None) -> None:
        if state:
            raise KeyError(f"PKM has no fast weights; got state keys {sorted(state)}")

    def init_state(self, batch_size: int) -> State:
        return {}

    # ---- slow projections ----------------------------------------------------------------
    def queries(self, x: Tensor) -> Tensor:
        """x [B, T, D] -> normalised queries [B, T, H, D_K]."""
        q = self.query_proj(x)
        if isinstance(self.query_norm, nn.BatchNorm1d):  # statistics over all B·T positions
            q = self.query_norm(q.reshape(-1, q.shape[-1])).reshape(q.shape)
        else:
            q = self.query_norm(q)
        return q.unflatten(-1, (self.heads, self.key_dim))

    def address(self, x: Tensor) -> tuple[Lookup, Tensor]:
        """Eqs. 5-8 and 3: the top-k slots of every head and their softmax weights [B, T, H, k]."""
        q, kern = self.queries(x), pk.kernels(x, self.triton)
        if kern and self.topk <= kern.LOOKUP_MAX_K:  # the fused kernel selects; the k selected scores are recomputed differentiably
            with torch.no_grad():
                look = kern.lookup(q, self.subkeys, self.topk, score="dot")
            top = selected_subkey_scores(q, self.subkeys, look.sub_index, score="dot")
            look = look._replace(scores=pair_scores(top, look.pair), sub_scores=top)
        else:
            look = lookup(q, self.subkeys, self.topk, score="dot")
        acc = compute_dtype(look.scores)  # softmax in >= fp32, as the release
        weights = F.softmax(look.scores.to(acc), dim=-1)
        return look, weights

    # ---- read ----------------------------------------------------------------------------
    def read_state(self, x: Tensor, state: State) -> Tensor:
        """y = W_o(Σ_h Σ_{i ∈ I^h} s'_i V_i ⊙ silu(W_g x + b_g)) + b_o for every position (Eq. 9)."""
        B, T, _ = x.shape
        look, weights = self.address(x)
        m = self.heads * self.topk
        # Σ over heads and top-k in one embedding bag (Eq. 9 summed over heads), the math of
        # memzoo.ops.product_key.gather_values without materialising [B·T, H·k, D_V] (the release
        # uses an xformers embedding bag for the same reason).
        kern = pk.kernels(x, self.triton)
        if kern:
            v = kern.embedding_bag(self.values, look.index.reshape(B * T, m), weights.reshape(B * T, m))
            v = v.to(self.values.dtype).reshape(B, T, self.value_dim)
        else:
            v = F.embedding_bag(look.index.reshape(B * T, m), self.values,
                                per_sample_weights=weights.reshape(B * T, m).to(self.values.dtype),
                                mode="sum").reshape(B, T, self.value_dim)
        self._usage = (look.index.detach(), weights.detach())  # counted only when stats() asks
        if self.gate_proj is not None:
            v = v * F.silu(self.gate_proj(x))
        return self.out_proj(v)

    # ---- write: a no-op --------------------------------------------------------------------
    def write_state(self, x: Tensor, state: State) -> State:
        """PKM memorizes nothing from the sequence; its values are learned by the outer optimizer."""
        return dict(state)

    def forward_state(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        """forward == read (nothing is written)."""
        return self.read_state(x, state), dict(state)

    # ---- diagnostics ---------------------------------------------------------------------
    @torch.no_grad()
    def stats(self) -> dict:
        """Slot usage of the last forward/read: usage/slots (fraction of the N slots retrieved at
        least once), usage/slots_hit, usage/kl_uniform (KL(p || uniform) of the summed read
        weights p, Lample et al.; 0 = perfectly even), usage/reads (token × head × top-k reads)."""
        out = super().stats()
        if self._usage is not None:
            idx, w = (t.reshape(-1) for t in self._usage)
            hits = torch.bincount(idx, minlength=self.n_slots)
            mass = torch.zeros(self.n_slots, dtype=torch.float32, device=idx.device).index_add_(0, idx, w.float())
            n_hit = int((hits > 0).sum().item())
            out["usage/slots"] = n_hit / self.n_slots
            out["usage/slots_hit"] = n_hit
            out["usage/reads"] = int(hits.sum().item())
            total = mass.sum()
            if total > 0:
                p = mass / total
                nz = p[p > 0]
                out["usage/kl_uniform"] = float((nz * (nz * self.n_slots).log()).sum().item())
        return out

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, slots={self.n_subkeys}²={self.n_slots}, key_dim={self.key_dim}, "
            f"value_dim={self.value_dim}, heads={self.heads}, topk={self.topk}, "
            f"query_norm={self.query_norm_kind!r}, output_gate={self.output_gate}"
        )
