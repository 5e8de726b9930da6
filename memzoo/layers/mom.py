"""Mixture-of-Memories (Du et al. 2025, "MoM: Linear Sequence Modeling with Mixture-of-Memories").

M independent gated-delta-rule memories; a router sends each token to k of them, and a shared
memory sees every token. A token reads the router-weighted mixture of its memories.

Router (Sec. 3.2.1), one Linear W_g: D -> M without bias:

    scores_t = TopK(softmax(x_t W_g)) ∈ R^k                                   Eq. 3
    g_t      = scores_t / Σ scores_t                                          Eq. 4 (renormalised)

Each memory m has its own key, value, write-strength and decay projections (Eq. 5; the
decay/β are the gated delta rule's, as in the paper's GDN backend), the query projection is
SHARED by all memories (Eq. 9 applies one q_t to the mixed memory):

    k_t^m = L2(silu(conv_k(x W_k^m))),  v_t^m = silu(conv_v(x W_v^m))          Eq. 5 (+ short convs)
    β_t^m = sigmoid(x_t W_b^m),  γ_t^m = -exp(A_log) · softplus(x_t W_a^m + dt_bias)   (log α_t^m)
    q_t   = L2(silu(x_t W_q))

Write, for every memory m that token t is routed to (memories not routed to stay unchanged):

    S_t^m = α_t^m S_{t-1}^m (I - β_t^m k_t^m k_t^mᵀ) + β_t^m v_t^m k_t^mᵀ       Eq. 6-7 with Table 1's
                                                                            G-DeltaNet rule
The shared memory (Sec. 3.3) has its own W_k^s, W_v^s, W_b^s, W_a^s and is written by every
token with the same rule (Eq. 11-12).

Read (the layer is a token mixer: position t reads after its own write, ``inclusive``):

    M̃_t = S_t^s + Σ_{m ∈ TopK(t)} g_t^(m) S_t^m                             Eq. 8, 13
    o_t = q_t M̃_t  (= S^s-read + Σ_m g_t^(m) · (q_t S_t^m), Sec. 3.3)        Eq. 9
    y_t = W_o (RMSNorm(o_t) ⊙ silu(W_g' x_t))  per head                        Eq. 10 as released

Sec. 3.3's "mixing the memories before the query equals querying each memory and mixing" is
how the parallel forward works: the tokens routed to memory m are gathered in time order
(a stable sort), run through the chunked gated delta rule (:mod:`memzoo.ops.gated_delta_rule`;
fla's kernel on CUDA) starting from that memory's state, and the outputs are scattered back
and mixed with the router weights. All memories of all sequences are one batched op call
(sequences right-padded with k = v = β = γ = 0 tokens, which leave a state exactly unchanged;
padded slots are zeroed with ``where``, not by multiplying with 0, so that a NaN/inf token never
reaches a memory it was not routed to, nor, through 0 × NaN, earlier outputs).

Load balancing (Sec. 4.2.8, "with and without aux loss"): the Switch-Transformer loss
(Fedus et al. 2022, Eq. 4-6) in the top-k form of the reference code, computed over the
tokens of one forward call (B·T = N tokens) and weighted by ``aux_loss_weight`` (0.01):

    f_m = (1/N) Σ_t 1[m ∈ TopK(t)],   P_m = (1/N) Σ_t softmax(x_t W_g)_m
    L_aux = aux_loss_weight · M · Σ_m f_m P_m              (= weight · k when perfectly balanced)

It is set as ``self.aux_loss`` by ``forward`` in training mode (HybridLM adds it to the loss).

Details the paper leaves open, settled by the reference (fla-org/flash-linear-attention,
``fla/layers/mom.py`` ``MomAttention``, and ``fla/models/mom``):

- defaults: 4 memories, top-2, shared memory on, expand_v = 1, aux weight 0.01
  (``MomConfig``: num_memories=4, topk=2, shared_mem=True, expand_v=1., aux_loss_scale=0.01);
- the router: ``self.gate = nn.Linear(hidden, num_memories, bias=False)``, softmax in fp32,
  ``torch.topk``, ``routing_weights /= routing_weights.sum(-1)``;
- per-memory ``k_proj``/``v_proj``/``b_proj``/``a_proj`` lists, one shared ``q_proj``; ONE
  ``A_log`` and ``dt_bias`` per head shared by all memories (``g = -A_log.exp() *
  softplus(a_expert(x) + dt_bias)``, Mamba-2 init A ~ U(0, 16), dt ~ logU(1e-3, 1e-1));
- short convolutions (size 4, SiLU, no bias) whose weights are shared by all memories and the
  shared memory; a routed memory's k/v convolution runs along *that memory's routed
  subsequence* (``transform`` gathers, then ``k_conv1d(cu_seqlens=...)`` per memory segment),
  the shared memory's along the whole sequence (``shared_o``);
- the shared memory's output is added with weight 1 (``o += shared_o``, Eq. 13);
- output: ``FusedRMSNormGated(head_v_dim)`` with ``g_proj``, then ``o_proj`` (no bias);
- Linear init ``xavier_uniform_(gain=2 ** -2.5)``;
- the load-balancing loss: ``load_balancing_loss_func`` in ``fla/models/mom/modeling_mom.py``
  (mean over tokens of the top-k one-hot times mean probability, times num_experts).

Where we differ from the reference, on purpose:

- **No short convolution on the query.** A MemoryLayer's ``read(x)`` retrieves for the
  positions of x without writing, and the inclusive forward is defined as write(x_t) then
  read(x_t). A causal conv on q would need, when reading x_t right after writing it, the input
  *before* x_t's write — which the state, advanced by the write, no longer holds — while a
  read of fresh queries needs the history *including* the last write. No state makes both
  exact, so q is pointwise (the reference's ``use_short_conv=False`` form, ``silu(q_proj(x))``).
  k and v, used only by writes, keep their convolutions. This also makes q_t the same for every
  memory, which Eq. 9 assumes (the reference convolves q along each memory's subsequence, so
  its q_t differs per memory).
- The reference skips the per-segment boundaries of the short convolution in training
  (``conv_cu_seqlens = None`` when ``self.training``: the conv runs across the concatenated
  segments of different memories and sequences). We always use the per-memory boundaries
  (the reference's inference path), so training and streaming compute the same function.
- The balance loss is per layer (Switch Transformer's form; HybridLM sums the layers) rather
  than over all layers' router logits concatenated.
- No capacity factor: the reference's ``capacity`` argument is unused there too.

State (per sequence, token-recurrent): ``S`` [B, M, H, K, V] (the routed memories, in fla's
transposed [K, V] layout), ``S_shared`` [B, H, K, V], and the short-conv histories: the last
``conv_size - 1`` pre-conv k/v projections of the tokens routed to each memory, ``conv_k``
[B, M, c-1, H·K], ``conv_v`` [B, M, c-1, H·V], and of the whole sequence for the shared memory,
``conv_k_shared`` [B, c-1, H·K], ``conv_v_shared`` [B, c-1, H·V]. Splitting a sequence at any
token therefore streams exactly. Everything is kept in fp32 (fp64 for fp64 weights).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.layers.base import MemoryLayer, State, head_size
from memzoo.modules.norm import rms_norm
from memzoo.modules.precision import compute_dtype
from memzoo.ops.gated_delta_rule import gated_delta_rule
from memzoo.modules.conv import causal_conv, conv_weights
from memzoo.registration import register_layer
from memzoo.storage import load_transposed


def load_balancing_loss(router_logits: Tensor, topk: int) -> Tensor:
    """Switch-Transformer load balancing in its top-k form (unweighted): M · Σ_m f_m P_m.

    router_logits [..., M] for N tokens; f_m = fraction of tokens with m among their top-k
    (Σ_m f_m = k), P_m = mean router probability of m. Minimum k at uniform routing.
    """
    M = router_logits.shape[-1]
    logits = router_logits.reshape(-1, M)
    probs = logits.to(compute_dtype(logits)).softmax(-1)
    chosen = probs.topk(topk, dim=-1).indices
    f = torch.zeros_like(probs).scatter(-1, chosen, 1.0).mean(0)
    P = probs.mean(0)
    return M * (f * P).sum()


@register_layer("mom")
class MoM(MemoryLayer):
    """Mixture-of-Memories with gated-delta-rule memories; see the module docstring.

    Args:
        d_model: model width D.
        num_memories: M routed memories (4 in the paper).
        topk: memories each token is routed to (2 in the paper).
        shared_memory: add the always-on shared memory (Sec. 3.3; on in the paper).
        num_heads: H heads per memory.
        head_dim: key size K per head; default D // H.
        expand_v: value size V = expand_v · K (1 in the released MoM config).
        conv_size: short-convolution width on k and v (0 or 1 = none, then SiLU only).
        aux_loss_weight: weight of the load-balancing loss (0.01, the release's aux_loss_scale).
        norm_eps: eps of the output RMSNorm.
    """

    family = "delta"

    chunk_size = None
    per_sequence = True
    #: forward writes each token to its memories, then reads them (position t sees its own write)
    inclusive: ClassVar[bool] = True
    #: chunk length of the gated delta rule's chunked torch path inside forward (any value is exact;
    #: 16 is the fastest on a CPU: one thread, fwd + bwd, 8 × 512 tokens 191 ms against 64's 251, and
    #: the compiled standard toy step 500 ms against 558)
    parallel_chunk: int = 16
    bench_cost = 2.0

    def __init__(
        self,
        d_model: int,
        num_memories: int = 4,
        topk: int = 2,
        shared_memory: bool = True,
        num_heads: int = 4,
        head_dim: int | None = None,
        expand_v: float = 1.0,
        conv_size: int = 4,
        aux_loss_weight: float = 0.01,
        norm_eps: float = 1e-6,
    ):
        super().__init__(d_model)
        if num_memories < 1:
            raise ValueError(f"num_memories must be >= 1, got {num_memories}")
        if not 1 <= topk <= num_memories:
            raise ValueError(f"topk must be in [1, num_memories={num_memories}], got {topk}")
        head_dim = head_size(d_model, num_heads, head_dim)
        v_dim = head_dim * expand_v
        if head_dim < 1 or v_dim < 1 or v_dim != int(v_dim):
            raise ValueError(f"head_dim={head_dim} and head_dim * expand_v={v_dim} must be positive integers")
        if conv_size < 0:
            raise ValueError(f"conv_size must be >= 0 (0 = no short convolution), got {conv_size}")
        if not aux_loss_weight >= 0:
            raise ValueError(f"aux_loss_weight must be >= 0, got {aux_loss_weight}")
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {norm_eps}")
        self.num_memories, self.topk, self.shared_memory = num_memories, topk, bool(shared_memory)
        self.num_heads, self.head_dim, self.head_v_dim = num_heads, head_dim, int(v_dim)
        self.expand_v, self.conv_size = expand_v, conv_size
        self.aux_loss_weight, self.eps = aux_loss_weight, norm_eps
        self.scale = head_dim ** -0.5
        M, H = num_memories, num_heads
        key_dim, value_dim = H * head_dim, H * self.head_v_dim
        self.key_dim, self.value_dim = key_dim, value_dim

        # ---- slow weights --------------------------------------------------------------------
        self.gate = nn.Linear(d_model, M, bias=False)  # router W_g (Eq. 3)
        self.q_proj = nn.Linear(d_model, key_dim, bias=False)  # shared query
        # per-memory projections, stacked [M, out, D] so that all memories are one einsum (Eq. 5)
        self.k_proj = nn.Parameter(torch.empty(M, key_dim, d_model))
        self.v_proj = nn.Parameter(torch.empty(M, value_dim, d_model))
        self.b_proj = nn.Parameter(torch.empty(M, H, d_model))
        self.a_proj = nn.Parameter(torch.empty(M, H, d_model))
        if self.shared_memory:  # Eq. 11
            self.shared_k = nn.Linear(d_model, key_dim, bias=False)
            self.shared_v = nn.Linear(d_model, value_dim, bias=False)
            self.shared_b = nn.Linear(d_model, H, bias=False)
            self.shared_a = nn.Linear(d_model, H, bias=False)
        # decay α = exp(-exp(A_log) softplus(a + dt_bias)), one per head, shared by all memories
        self.A_log = nn.Parameter(torch.empty(H).uniform_(0, 16).log())
        dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        if conv_size > 1:  # depthwise causal convs, shared by all memories (and the shared memory); taps first
            self.k_conv = nn.Parameter(conv_weights(key_dim, conv_size))
            self.v_conv = nn.Parameter(conv_weights(value_dim, conv_size))
        self.g_proj = nn.Linear(d_model, value_dim, bias=False)  # output gate
        self.o_norm_weight = nn.Parameter(torch.ones(self.head_v_dim))
        self.o_proj = nn.Linear(value_dim, d_model, bias=False)

        gain = 2 ** -2.5  # the release's init for every Linear
        for w in (self.gate.weight, self.q_proj.weight, self.g_proj.weight, self.o_proj.weight):
            nn.init.xavier_uniform_(w, gain=gain)
        for w in (self.k_proj, self.v_proj, self.b_proj, self.a_proj):
            for wm in w.data:
                nn.init.xavier_uniform_(wm, gain=gain)
        if self.shared_memory:
            for lin in (self.shared_k, self.shared_v, self.shared_b, self.shared_a):
                nn.init.xavier_uniform_(lin.weight, gain=gain)
        self._last_usage: Tensor | None = None

    def meta_scalar(self, x: Tensor) -> int:
        """While FLOPs are counted on meta: every memory runs over the tokens routed to it, padded
        to the busiest memory's count (`int(counts.max())` in forward_state); counted at perfectly
        balanced routing, T · top-k / M tokens per memory (what the load-balancing loss aims at)."""
        return math.ceil(x.shape[1] * self.topk / self.num_memories)

    # ---- router (Eq. 3-4) ---------------------------------------------------------------------
    def _cdtype(self) -> torch.dtype:
        return compute_dtype(self.q_proj.weight)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(router logits [B, T, M], full routing weights [B, T, M] (g_t on the top-k, 0
        elsewhere), routed mask [B, T, M])."""
        logits = self.gate(x)
        probs = logits.to(self._cdtype()).softmax(-1)
        w, idx = probs.topk(self.topk, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        weights = torch.zeros_like(probs).scatter(-1, idx, w)
        routed = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, idx, True)
        return logits, weights, routed

    # ---- projections --------------------------------------------------------------------------
    def _query(self, x: Tensor) -> Tensor:
        """q_t = L2(silu(W_q x_t)) per head: [B, T, H, K] (pointwise: no short conv, see docstring)."""
        q = F.silu(self.q_proj(x).to(self._cdtype()))
        return F.normalize(q.unflatten(-1, (self.num_heads, self.head_dim)), dim=-1)

    def _conv(self, u: Tensor, past: Tensor, w: Tensor) -> Tensor:
        """Causal depthwise conv along dim -2: u [..., L, C] with past [..., c-1, C] -> [..., L, C]."""
        return causal_conv(torch.cat([past, u], dim=-2), w)

    def _kv(self, kp: Tensor, vp: Tensor, ck: Tensor, cv: Tensor) -> tuple[Tensor, Tensor]:
        """Short conv + SiLU (+ L2 on k) of the pre-conv projections; returns k [..., L, H, K], v [..., L, H, V]."""
        if self.conv_size > 1:
            kp, vp = self._conv(kp, ck, self.k_conv), self._conv(vp, cv, self.v_conv)
        k = F.normalize(F.silu(kp).unflatten(-1, (self.num_heads, self.head_dim)), dim=-1)
        v = F.silu(vp).unflatten(-1, (self.num_heads, self.head_v_dim))
        return k, v

    def _decay(self, a: Tensor) -> Tensor:
        """log α = -exp(A_log) softplus(a + dt_bias), a [..., H]."""
        return -self.A_log.to(a.dtype).exp() * F.softplus(a + self.dt_bias.to(a.dtype))

    # ---- state --------------------------------------------------------------------------------
    def init_state(self, batch_size: int) -> State:
        dev, dt = self.q_proj.weight.device, self._cdtype()
        B, M, H, K, V, c = batch_size, self.num_memories, self.num_heads, self.head_dim, self.head_v_dim, self.conv_size
        st = {"S": torch.zeros(B, M, H, K, V, dtype=dt, device=dev)}
        if self.conv_size > 1:
            st["conv_k"] = torch.zeros(B, M, c - 1, self.key_dim, dtype=dt, device=dev)
            st["conv_v"] = torch.zeros(B, M, c - 1, self.value_dim, dtype=dt, device=dev)
        if self.shared_memory:
            st["S_shared"] = torch.zeros(B, H, K, V, dtype=dt, device=dev)
            if self.conv_size > 1:
                st["conv_k_shared"] = torch.zeros(B, c - 1, self.key_dim, dtype=dt, device=dev)
                st["conv_v_shared"] = torch.zeros(B, c - 1, self.value_dim, dtype=dt, device=dev)
        return st

    # ---- read (Eq. 8-10, 13) ------------------------------------------------------------------
    def mixed_memory(self, x: Tensor, state: State) -> Tensor:
        """M̃_t = S^s + Σ_m g_t^(m) S^m for every position of x: [B, T, H, K, V] (Eq. 8, 13).
        The read never forms it (it queries each memory, then mixes); it is here to inspect."""
        _, weights, _ = self.route(x)
        Mt = torch.einsum("btm,bmhkv->bthkv", weights, state["S"])
        return Mt + state["S_shared"][:, None] if self.shared_memory else Mt

    def read_heads(self, x: Tensor, state: State) -> Tensor:
        """o_t = q_t M̃_t, computed as S^s-read + Σ_m g_t^(m) (q_t S^m): [B, T, H, V] (Eq. 9)."""
        _, weights, _ = self.route(x)
        q = self._query(x) * self.scale
        o = torch.einsum("btm,bthk,bmhkv->bthv", weights, q, state["S"])
        if self.shared_memory:
            o = o + torch.einsum("bthk,bhkv->bthv", q, state["S_shared"])
        return o

    def _output(self, o: Tensor, x: Tensor) -> Tensor:
        """y = W_o (RMSNorm(o) ⊙ silu(W_g' x)) per head (Eq. 10 as released)."""
        o = rms_norm(o, self.o_norm_weight, self.eps)
        gate = F.silu(self.g_proj(x).to(o.dtype)).unflatten(-1, (self.num_heads, self.head_v_dim))
        return self.o_proj((o * gate).flatten(-2).to(x.dtype))

    def read_state(self, x: Tensor, state: State) -> Tensor:
        """Retrieve with the memories so far; x itself is not written."""
        return self._output(self.read_heads(x, state), x)

    # ---- write (Eq. 5-7, 11-12) and the parallel causal forward -------------------------------
    def _run(self, x: Tensor, state: State, with_output: bool, pair: tuple[Tensor, Tensor] | None = None,
             capture: dict | None = None) -> tuple[Tensor | None, State]:
        """Write every token of x to its routed memories (and the shared one), in order; with
        `with_output`, also the inclusive read of every position, o [B, T, H, V]. The pairs adapter's
        hooks (see `write_pairs`): `pair` (k [B, T, H, K], v [B, T, H, V]) written in place of the shared
        memory's own (k, v), or without a shared memory of each token's first-choice memory's; `capture`
        receives the first-choice memory's k, v in time order (without a shared memory)."""
        B, T, D = x.shape
        M, H, c, dt = self.num_memories, self.num_heads, self.conv_size, self._cdtype()
        _, weights, routed = self.route(x)
        q = self._query(x) if with_output else None
        new: State = {}

        # gather: the tokens routed to memory m, in time order (stable sort), right-padded to L
        order = torch.argsort((~routed).to(torch.uint8), dim=1, stable=True)  # [B, T, M]
        counts = routed.sum(1)  # [B, M]
        # eager: pad to the busiest memory's count; compiled: to T, a static shape (the count is
        # data-dependent: a graph break and a recompilation at every new value). Same function.
        L = T if torch.compiler.is_compiling() or T == 0 else int(counts.max())
        pos = order[:, :L].transpose(1, 2)  # [B, M, L] positions (distinct per memory)
        valid = torch.arange(L, device=x.device) < counts[..., None]  # [B, M, L]
        # flat row ids b·T + t: index_select and index_add gather and scatter (and are each other's
        # backward), ~3x faster on a CPU than advanced indexing, whose backward is an index_put
        rows = (pos + torch.arange(B, device=x.device)[:, None, None] * T).reshape(-1)  # [B·M·L]
        gather = lambda u: u.reshape(B * T, *u.shape[2:]).index_select(0, rows).view(B, M, L, *u.shape[2:])  # noqa: E731
        xg = gather(x)  # [B, M, L, D]
        W = torch.cat([self.k_proj, self.v_proj, self.b_proj, self.a_proj], dim=1)  # [M, out, D]
        proj = torch.einsum("bmld,mod->bmlo", xg, W).to(dt)
        kp, vp, b, a = proj.split([self.key_dim, self.value_dim, H, H], dim=-1)
        ck, cv = state.get("conv_k"), state.get("conv_v")
        k, v = self._kv(kp, vp, ck, cv)
        if not self.shared_memory and (pair is not None or capture is not None):
            first = weights.argmax(-1)  # [B, T] each token's first-choice memory (top-1)
            mine = (first.gather(1, pos.flatten(1)).view(B, M, L) == torch.arange(M, device=x.device)[:, None]) & valid
            mine = mine[..., None, None]
            if capture is not None:  # scattered back to time order: each token's only slot left unmasked
                for name, u in (("k", k), ("v", v)):
                    capture[name] = u.new_zeros(B * T, *u.shape[3:]).index_add(
                        0, rows, u.where(mine, 0).flatten(0, 2)).view(B, T, *u.shape[3:])
            if pair is not None:
                k, v = gather(pair[0].to(dt)).where(mine, k), gather(pair[1].to(dt)).where(mine, v)
        # padding: k = v = β = log α = 0 leaves a state unchanged (selected with where: padded
        # slots hold other positions' tokens, and 0 × NaN = NaN; see the module docstring)
        vm = valid[..., None]
        k, v = k.where(vm[..., None], 0), v.where(vm[..., None], 0)
        beta, g = torch.sigmoid(b).where(vm, 0), self._decay(a).where(vm, 0)
        if c > 1:  # new conv history: the last c-1 pre-conv projections of each memory's tokens
            hidx = (counts[..., None] + torch.arange(c - 1, device=x.device))[..., None]  # [B, M, c-1, 1]
            new["conv_k"] = torch.cat([ck, kp], dim=2).gather(2, hidx.expand(-1, -1, -1, self.key_dim))
            new["conv_v"] = torch.cat([cv, vp], dim=2).gather(2, hidx.expand(-1, -1, -1, self.value_dim))
        qg = gather(q) if with_output else k
        flat = lambda u: u.flatten(0, 1)  # noqa: E731  [B, M, ...] -> [B*M, ...]
        o, S = gated_delta_rule(
            flat(qg), flat(k), flat(v), flat(g), flat(beta), scale=self.scale,
            initial_state=flat(state["S"]), output_final_state=True, chunk_size=self.parallel_chunk,
        )
        new["S"] = S.unflatten(0, (B, M)).to(dt)
        out = None
        if with_output:  # scatter back to time order and mix with the router weights (Eq. 8-9)
            o = o.unflatten(0, (B, M)).to(dt)  # [B, M, L, H, V]
            wg = weights.transpose(1, 2).gather(2, pos)  # [B, M, L]
            o = (o * wg[..., None, None]).where(valid[..., None, None], 0)  # padded slots add nothing
            out = o.new_zeros(B * T, H, self.head_v_dim).index_add(0, rows, o.flatten(0, 2)).view(B, T, H, self.head_v_dim)

        if self.shared_memory:  # the shared memory sees every token (Eq. 11-13)
            kp = self.shared_k(x).to(dt)
            vp = self.shared_v(x).to(dt)
            cks, cvs = state.get("conv_k_shared"), state.get("conv_v_shared")
            k, v = self._kv(kp, vp, cks, cvs)
            if pair is not None:
                k, v = pair[0].to(dt), pair[1].to(dt)
            beta = torch.sigmoid(self.shared_b(x).to(dt))
            g = self._decay(self.shared_a(x).to(dt))
            if c > 1:
                new["conv_k_shared"] = torch.cat([cks, kp], dim=1)[:, T:]
                new["conv_v_shared"] = torch.cat([cvs, vp], dim=1)[:, T:]
            o_s, S_s = gated_delta_rule(
                q if with_output else k, k, v, g, beta, scale=self.scale,
                initial_state=state["S_shared"], output_final_state=True, chunk_size=self.parallel_chunk,
            )
            new["S_shared"] = S_s.to(dt)
            if with_output:
                out = out + o_s.to(dt)
        if T > 0:  # kept on the device: a copy to the host would stop a compiled graph (and sync CUDA)
            self._last_usage = routed.detach().float().mean(dim=(0, 1))
        return out, new

    def write_state(self, x: Tensor, state: State) -> State:
        """Route x and write each token into its top-k memories and the shared memory, in order."""
        return self._run(x, state, with_output=False)[1]

    def forward_state(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        """Inclusive causal mixing: per token, write to the routed memories, then read the mixture."""
        o, new = self._run(x, state, with_output=True)
        return self._output(o, x), new

    # ---- the pairs adapter (bench/suites/pairs.py) -------------------------------------------------
    #: neutral (no x): pair i goes to memory i mod M alone (routing weight 1, as a top-1 router gives),
    #: β = 1, no decay, and the shared memory is not written (the layer adds its read at weight 1 to a
    #: routed mixture of weight 1: written too, a read would return 2v): M delta-rule memories side by side
    no_pairs = None

    def pair_dims(self) -> tuple[int, int, int]:
        return self.num_heads, self.head_dim, self.head_v_dim

    def pair_inputs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """One (k, v) a token, as `write(x)` from a reset state computes them: the shared memory's (each
        routed memory has keys of its own, so no one pair is what a token writes everywhere); without a
        shared memory, the token's first-choice memory's (along that memory's routed subsequence)."""
        st, dt = self.init_state(x.shape[0]), self._cdtype()
        if self.shared_memory:
            return self._kv(self.shared_k(x).to(dt), self.shared_v(x).to(dt), st.get("conv_k_shared"),
                            st.get("conv_v_shared"))
        capture: dict = {}
        self._run(x, st, with_output=False, capture=capture)
        return capture["k"], capture["v"]

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """Write the pairs with the gated delta rule (`_run`'s op). With x: `write(x)` itself (the router,
        every memory's β and decay, the routed memories' own keys and values, the convolution histories),
        with the pair in place of the shared memory's (k, v), or without a shared memory of each token's
        first-choice memory's: ``write_pairs(*pair_inputs(x), x)`` is ``write(x)``. Without x: the neutral
        routing above (pair i to memory i mod M), β = 1, no decay: on each memory's pairs the delta rule of
        Yang et al. 2024 (arXiv 2406.06484, Eq. 1-2)."""
        state = self.state
        if x is not None:
            self.load_state(self._run(x, state, with_output=False, pair=(k, v))[1])
            return
        S, M = state["S"], self.num_memories
        B, n, H, K = k.shape
        L = -(-n // M)
        def per_memory(u: Tensor) -> Tensor:  # [B, M·L, ...] as [B·M, L, ...]: memory m holds pairs m, m + M, ...
            u = F.pad(u.to(S.dtype), (0, 0, 0, 0, 0, L * M - n))
            return u.view(B, L, M, *u.shape[2:]).transpose(1, 2).flatten(0, 1)

        km, vm = per_memory(k), per_memory(v)
        valid = (torch.arange(L * M, device=k.device) < n).view(L, M).T  # [M, L]; padding: k = v = β = 0
        beta = valid[None, :, :, None].to(S.dtype).expand(B, M, L, H).flatten(0, 1)
        _, S = gated_delta_rule(km, km, vm, torch.zeros_like(beta), beta, scale=self.scale,
                                initial_state=S.flatten(0, 1), output_final_state=True, chunk_size=self.parallel_chunk)
        self.load_state({**state, "S": S.unflatten(0, (B, M)).to(state["S"].dtype)})

    def read_keys(self, k: Tensor) -> Tensor:
        """The layer's read (without its query scale) of key i under the neutral routing: memory i mod M at
        weight 1, plus the shared memory's read at weight 1 (Eq. 13): S^{i mod M}ᵀ k_i + S^sᵀ k_i."""
        state = self.state
        S, M = state["S"], self.num_memories
        B, n = k.shape[:2]
        L = -(-n // M)
        kp = F.pad(k.to(S.dtype), (0, 0, 0, 0, 0, L * M - n)).view(B, L, M, *k.shape[2:])
        o = torch.einsum("blmhk,bmhkv->blmhv", kp, S).flatten(1, 2)[:, :n]
        if self.shared_memory:
            o = o + torch.einsum("bnhk,bhkv->bnhv", k.to(S.dtype), state["S_shared"])
        return o

    # ---- the shell: forward also sets the load-balancing loss -----------------------------------
    def load_balancing_loss(self, x: Tensor) -> Tensor:
        """aux_loss_weight · M · Σ_m f_m P_m over the tokens of x (Switch Transformer, top-k form)."""
        return self.aux_loss_weight * load_balancing_loss(self.gate(x), self.topk)

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        self.aux_loss = self.load_balancing_loss(x) if self.training and x.shape[1] > 0 else None
        return y

    # ---- diagnostics --------------------------------------------------------------------------
    @torch.no_grad()
    def stats(self) -> dict:
        out = super().stats()
        S = self.state["S"].float()
        for m, n in enumerate(S.pow(2).sum(dim=(0, 2, 3, 4)).sqrt().tolist()):
            out[f"norm/S/mem{m}"] = n
        if self._last_usage is not None:  # fraction of the last call's tokens routed to each memory
            for m, f in enumerate(self._last_usage.tolist()):
                out[f"usage/mem{m}"] = f
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self.conv_size > 1:  # [dim, conv_size] before
            for name in ("k_conv", "v_conv"):
                load_transposed(state_dict, prefix + name, getattr(self, name).shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, num_memories={self.num_memories}, topk={self.topk}, "
            f"shared_memory={self.shared_memory}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"head_v_dim={self.head_v_dim}, conv_size={self.conv_size}"
        )
