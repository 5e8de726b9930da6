"""FwPKM: Fast-weight Product Key Memory (Zhao & Jones 2026, Sec. 3; summary in Sec. 3.5).

A Product Key Memory whose sub-keys K¹, K² and values V are fast weights, rewritten chunk by
chunk (chunk 512) by one step of gradient descent on a local memorisation objective.

Read (Eqs. 26-34), for every token of a chunk, with the memory so far:
    q_t, v_t, g_t = Linear(RMSNorm(h_t))                        Eq. 26 (FastWeightIO; v z-scored, Sec. 3.4.3)
    [q¹; q²] = q_t;  s^{1,2}_i = -log(ε + ||q^{1,2} - K^{1,2}_i||²)   Eqs. 27-28 (IDW score, ε = 1e-3)
    top-k per half, k×k combine, top-k, softmax                  Eqs. 29-31 (memzoo.ops.product_key)
    v̂_{t+1} = Σ_{i∈I} s'_i V_i                                  Eq. 32 (1 head, top-8, 512² slots)
    o'_t = Linear(RMSNorm(g_t v̂_{t+1} + (1 - g_t) v_t))          Eqs. 33-34

Write (Eqs. 35-39), once per chunk, from the same pre-update fast weights:
    V_i <- V_i - η (1/N_i^read) Σ_t g_t (v̂_t - v_{t+1}) s'_{t,i}  Eqs. 35-36: the gradient of the summed,
                                                                gate-weighted ½||v - v̂||² (Sec. 3.2.2), each
                                                                row divided by N_i^read; η = 1, no clipping
    K <- K - η ∇_K L_addr,  L_addr = -H(p̄) per sub-key set,     Eqs. 37-39: p̄ = mean over the chunk of the
                                                                top-k-softmaxed sub-key scores (zeros elsewhere)
N_i^read is "the number of times value row V_i is accessed within the current chunk" (Sec. 3.2.2):
every read of row i by every token of the chunk (each of a token's heads × top-k reads counts),
the chunk's last token included although it writes nothing; the release's bincount over the
chunk's indices counts the same. With top-1 retrieval the value step rewrites the prediction
exactly to its target (Eq. 16).

Paper and release. The paper's text and the authors' release (the code behind its numbers)
differ in five places; `variant` picks one column, and each single option overrides it (for
ablations):

    option              variant="paper" (default)             variant="release"
    addr_loss_weight    10 (Table 3)                          1.0
    release_value_scale False                                 True: the value step × top-k × heads
    grad_through_update False: the memorisation loss "cannot  True: the update graph is kept in training,
                        reach slow weights" (Sec. 3.4.1)      outer gradients pass through every write
    before_mixer        False: between mixer and FFN (4.1)    True: before the token mixer
    pooled_entropy      False: H(p̄) per sub-key set (Eq. 38)  True: p̄ pooled over heads (same for 1 head)
    (FwMLP, in fwmlp.py: lookahead_target "next" vs "mean", grad_through_update, before_mixer)

`before_mixer` sets the layer's `site` ("before_mixer" or "after_mixer", see MemoryLayer).

Where the paper is silent both variants follow the release: joint softmax over heads × top-k,
the gate as a sigmoid scalar, z-scored values (std unbiased + 1e-6), lookahead pairs inside a
chunk (the chunk's last token writes nothing, as in the release's training path), key init
U(±1/√Dk), value init N(0, 1/Dv), the summed loss for the value step (the release's ½·mean
scaled back by B·(C−1)·D_v, the sample count its model passes with the attention mask).
Fast weights are shared across the batch and persist across calls (the paper and release);
`per_sequence=True` gives each sequence its own. They are buffers, never slow parameters.
App. B ablations: `lookahead`, `gating`, `gate_weighted_loss`, `value_norm`, `addr_loss`
(off: the keys follow the memorisation loss instead, as the release's `no_addr_loss` config runs
it: the gradient of ½·mean over the chunk's pairs and features, the same loss the value step
sums), `score="dot"` (the paper found IDW necessary).

Kernels. On CUDA tensors the lookup, the read and the write run the Triton kernels of
:mod:`memzoo.kernels.fwpkm` (a fused lookup, an embedding bag, deterministic sorted-segment sums
for the value step and the key gradient); ``triton=False`` keeps the torch path everywhere. The
write keeps the torch path where outer gradients flow through it (``grad_through_update``).

Non-finite input. The memory is shared by the batch and persists, so one sequence's NaN must
not reach the others or later calls: a token whose query, value or gate is not finite is left
out of the write (it writes no pair, is not counted in N^read or p̄); its own output is
non-finite, every other output and the memory stay finite.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from memzoo.layers.base import MemoryLayer, State
from memzoo.layers.fw_io import FastWeightIO, finite_tokens, from_variant, write_pairs
from memzoo.ops import product_key as pk
from memzoo.ops.product_key import (Lookup, gather_rows, gather_values, lookup, pair_scores, selected_subkey_scores,
                                    subkey_rows)
from memzoo.registry import register_layer


def _fp32(x: Tensor) -> Tensor:
    """Fast-weight math runs in at least fp32 (the release's fp32_fw)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@torch.compiler.disable
def _add_rows(table: Tensor, rows: Tensor, delta: Tensor) -> None:
    """table[rows] += delta in place, outside any torch.compile graph: traced, the in-place
    write to a large memory is functionalised into a copy of the whole table per chunk."""
    table.index_add_(0, rows, delta)


#: the choices where the paper's text and the authors' release differ (module docstring)
VARIANTS = {
    "paper": dict(addr_loss_weight=10.0, release_value_scale=False, grad_through_update=False,
                  before_mixer=False, pooled_entropy=False),
    "release": dict(addr_loss_weight=1.0, release_value_scale=True, grad_through_update=True,
                    before_mixer=True, pooled_entropy=True),
}


@register_layer("fwpkm")
class FwPKM(MemoryLayer):
    family = "slots"
    prenorm = False  # Eq. 26 normalises h itself
    bench_cost = 1.6

    def __init__(
        self,
        d_model: int,
        key_dim: int = 512,
        value_dim: int = 512,
        heads: int = 1,
        topk: int = 8,
        n_subkeys: int = 512,
        chunk_size: int = 512,
        lr: float = 1.0,
        score: str = "idw",
        idw_eps: float = 1e-3,
        addr_loss: bool = True,
        lookahead: bool = True,
        gating: bool = True,
        gate_weighted_loss: bool = True,
        value_norm: bool = True,
        per_sequence: bool = False,
        variant: str = "paper",
        addr_loss_weight: float | None = None,
        release_value_scale: bool | None = None,
        grad_through_update: bool | None = None,
        before_mixer: bool | None = None,
        pooled_entropy: bool | None = None,
        triton: bool = True,
        seed: int = 0,
    ):
        super().__init__(d_model)
        for name, v, low in (("key_dim", key_dim, 2), ("value_dim", value_dim, 1), ("heads", heads, 1),
                             ("topk", topk, 1), ("n_subkeys", n_subkeys, 1), ("chunk_size", chunk_size, 1 + bool(lookahead))):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                why = " (a lookahead pair needs two tokens of a chunk)" if name == "chunk_size" and lookahead else ""
                raise ValueError(f"{name} must be an int >= {low}{why}, got {v!r}")
        if key_dim % 2:
            raise ValueError(f"key_dim must be even (two product halves), got {key_dim}")
        if topk > n_subkeys:
            raise ValueError(f"topk ({topk}) cannot exceed n_subkeys ({n_subkeys})")
        if score not in ("idw", "dot"):
            raise ValueError(f"score must be 'idw' or 'dot', got {score!r}")
        if not lr > 0 or not idw_eps > 0:
            raise ValueError(f"lr and idw_eps must be > 0, got lr={lr!r}, idw_eps={idw_eps!r}")
        opts = from_variant(VARIANTS, variant, addr_loss_weight=addr_loss_weight, release_value_scale=release_value_scale,
                            grad_through_update=grad_through_update, before_mixer=before_mixer,
                            pooled_entropy=pooled_entropy)
        if not opts["addr_loss_weight"] >= 0:
            raise ValueError(f"addr_loss_weight must be >= 0, got {opts['addr_loss_weight']!r}")
        self.variant = variant
        self.key_dim, self.value_dim, self.heads, self.topk, self.n = key_dim, value_dim, heads, topk, n_subkeys
        self.N = n_subkeys**2
        self.chunk_size, self.lr, self.score, self.idw_eps = chunk_size, lr, score, idw_eps
        self.addr_loss, self.lookahead, self.gate_weighted_loss = addr_loss, lookahead, gate_weighted_loss
        self.per_sequence, self.seed, self.triton = per_sequence, seed, triton
        self.addr_loss_weight = float(opts["addr_loss_weight"])
        self.release_value_scale, self.grad_through_update = opts["release_value_scale"], opts["grad_through_update"]
        self.site = "before_mixer" if opts["before_mixer"] else "after_mixer"
        self.pooled_entropy = opts["pooled_entropy"]
        self.io = FastWeightIO(d_model, heads * key_dim, value_dim, gating, value_norm)
        self._reads: list = []  # the last call's reads, per chunk (stats())
        self._init: tuple = (None,)  # ((device, dtype), keys, values) of init_state
        self._pos, self._writer = 0, None  # stream position; who last wrote each slot
        self.reset_stats()
        if not per_sequence:
            self.reset()  # shared fast weights exist as buffers from the start

    # ---- fast weights ----------------------------------------------------------------------
    def init_state(self, batch_size: int, reuse: State | None = None) -> State:
        """K ~ U(±1/√Dk), V ~ N(0, 1/Dv) as in the release, from a fixed seed so reset is exact.
        `reuse` (reset's old state): tensors of the right shape are refilled in place, since
        allocating a fresh per-sequence [B, n², Dv] costs more than the copy (page faults)."""
        dev = self.io.q_proj.weight.device
        dt = torch.promote_types(self.io.q_proj.weight.dtype, torch.float32)  # fast weights: >= fp32
        kshape = (self.heads, 2, self.n, self.key_dim // 2)
        vshape = (self.N, self.value_dim)
        if dev.type == "meta":
            return {"keys": torch.empty(kshape, device=dev), "values": torch.empty(vshape, device=dev)}
        if self._init[0] != (dev, dt):  # drawn once per device and dtype
            gen = torch.Generator().manual_seed(self.seed)
            bound = 1 / math.sqrt(self.key_dim)
            keys = (torch.rand(kshape, generator=gen) * 2 - 1).mul_(bound).to(dev, dt)
            self._init = ((dev, dt), keys, (torch.randn(vshape, generator=gen) * self.value_dim**-0.5).to(dev, dt))
        lead = (batch_size,) if self.per_sequence else ()
        state = {}
        for name, init in zip(("keys", "values"), self._init[1:]):
            old, full = (reuse or {}).get(name), init.expand(*lead, *init.shape)
            fits = old is not None and old.shape == full.shape and old.dtype == dt and old.device == dev
            state[name] = old.copy_(full) if fits and not old.requires_grad else full.clone()  # real copies
        return state

    # ---- retrieval (Eqs. 27-32) ------------------------------------------------------------
    def _lookup(self, q: Tensor, state: State) -> tuple[Lookup, Tensor, Tensor]:
        """Top-k slots for queries [B, T, H*Dk]: the lookup, softmax weights [B, T, H*k] over
        heads × top-k jointly (release), and slot ids into the flattened values [B, T, H*k].
        Selection needs no gradient; the k selected scores are then recomputed
        differentiably (O(k·d) per query, not O(n·d)) for the weights' gradient to q."""
        B, T, _ = q.shape
        qh = _fp32(q).view(B, T, self.heads, self.key_dim)
        with torch.no_grad():
            kern = pk.kernels(q, self.triton)
            lk = (kern.lookup if kern else lookup)(qh, state["keys"], self.topk, self.score, self.idw_eps)
        top = selected_subkey_scores(qh, state["keys"], lk.sub_index, self.score, self.idw_eps)
        w = torch.softmax(pair_scores(top, lk.pair).flatten(-2), dim=-1)
        # the selected scores as recomputed (exact ||q - K||², not the lookup's expansion): the
        # kernel path's key gradient reads them
        return lk._replace(sub_scores=top.detach()), w, self._rows(lk.index.flatten(-2))

    def _gather(self, values: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        """v̂ = Σ s'_i V_i (Eq. 32): the embedding-bag kernel on CUDA, else the torch gather."""
        kern = pk.kernels(w, self.triton)
        if kern is None:
            return gather_values(values, idx, w)
        return kern.embedding_bag(values, idx, w, snapshot=not values.requires_grad)  # written in place next

    def _rows(self, idx: Tensor) -> Tensor:
        if self.per_sequence:  # each sequence addresses its own block of rows
            idx = idx + torch.arange(idx.shape[0], device=idx.device).view(-1, 1, 1) * self.N
        return idx

    def _values(self, state: State) -> Tensor:
        return state["values"].reshape(-1, self.value_dim)

    def read_state(self, x: Tensor, state: State) -> Tensor:
        q, v, g = self.io.project(x)
        lk, w, idx = self._lookup(q, state)
        v_hat = self._gather(self._values(state), idx, w)
        self._note_read(idx, w, g)
        return self.io.output(v_hat.to(v.dtype), v, g)

    # ---- memorisation (Eqs. 35-39) ---------------------------------------------------------
    def write_state(self, x: Tensor, state: State) -> State:
        q, v, g = self.io.project(x)
        lk, w, idx = self._lookup(q, state)
        return self._update(q, v, g, lk, w, idx, state)

    def _update(self, q, v, g, lk: Lookup, w, idx, state: State) -> State:
        B, T, _ = q.shape
        if T == 0:
            return dict(state)
        if not self.grad_through_update:  # a local update (Sec. 3.4.1): no outer graph through it
            q, v, w = q.detach(), v.detach(), w.detach()
            g = None if g is None else g.detach()
        # non-finite tokens write nothing and count nowhere (module docstring); zeroing them
        # (with where, not a product: 0 × NaN is NaN) keeps every sum below finite. No branch
        # on the data: no device sync, and the meta-device FLOP count runs through it.
        ok = finite_tokens(q, v, g, w)
        q, v, w = (t.where(ok[..., None], 0) for t in (q, v, w))
        g = None if g is None else g.where(ok, 0)
        qw, tgt, lw = write_pairs(q, v, g, self.lookahead, self.gate_weighted_loss)
        Tw = qw.shape[1]
        lw = lw * (ok[:, :Tw] & ok[:, T - Tw :])  # a pair needs its query's and its target's token
        new = dict(state)
        new["keys"] = state["keys"] - self.lr * self._key_grad(q, ok, lk, tgt, lw, state)
        if Tw > 0:
            values = state["values"]
            flat = values.view(-1, self.value_dim)
            w_w, idx_w = w[:, :Tw], idx[:, :Tw]  # the writing tokens' own retrieval
            v_hat = self._gather(flat, idx_w, w_w)
            # ∇_{v̂_t} of the gate-weighted ½||v_{t+1} - v̂_t||², summed over tokens and features (Sec. 3.2.2)
            err = _fp32(lw).unsqueeze(-1) * (v_hat - _fp32(tgt))  # [B, Tw, Dv]
            scale = self.lr * (self.topk * self.heads if self.release_value_scale else 1.0)
            functional = values.requires_grad or (self.grad_through_update and torch.is_grad_enabled())
            kern = None if functional else pk.kernels(q, self.triton)
            if kern:  # Eqs. 35-36 in one deterministic segment sum per touched row, in place
                err_all = err.new_zeros(B, T, self.value_dim)
                err_all[:, :Tw] = err  # the chunk's last token reads (N_i^read) but writes nothing
                kern.segment_sum(flat, kern.Segments(idx), w.reshape(-1), err_all.view(-1, self.value_dim),
                                 per_token=idx.shape[-1], alpha=-scale, count=ok.to(flat.dtype).reshape(-1),
                                 accumulate=True)
                new["values"] = values
                self._note_write(idx_w, B, Tw)
                return self._advance(new, T)
            # N_i^read (Eq. 36): every read of row i in the chunk, the last token's included
            # (a non-finite token's reads count 0)
            n_read = flat.new_zeros(flat.shape[0]).index_add_(
                0, idx.reshape(-1), ok[..., None].expand_as(idx).reshape(-1).to(flat.dtype))
            rows = idx_w.reshape(-1)
            n_w = n_read[rows].clamp(min=1)  # (a row only a non-finite token read gets a zero step)
            # Eqs. 35-36: each entry's share of its row's gradient, divided by the row's N_i^read
            delta = (w_w.unsqueeze(-1) * err.unsqueeze(-2)).reshape(-1, self.value_dim)
            delta = delta * (-scale / n_w).unsqueeze(-1)
            if functional:
                flat = flat.index_add(0, rows, delta)  # outer gradients flow through it
            else:
                _add_rows(flat, rows, delta)  # in place: O(rows touched), not O(N)
            new["values"] = flat.view_as(values)
            self._note_write(idx_w, B, Tw)
        return self._advance(new, T)

    def _advance(self, state: State, T: int) -> State:
        if not torch.compiler.is_compiling():  # diagnostics stay out of compiled graphs
            self._pos += T
        return state

    def _key_grad(self, q, ok, lk: Lookup, tgt, lw, state: State) -> Tensor:
        """∇_K of the addressing loss (Eqs. 37-39), or of the memorisation loss when that is
        switched off (App. B). Only the selected sub-keys get gradient: O(k·d) per token.
        `ok` [B, T] marks the tokens that count.

        The addressing loss's gradient is written out (no autograd call: cheaper, and the
        same expression keeps its graph when `grad_through_update` asks for outer gradients).
        For each counted token and sub-key set, with s_j its k selected scores (IDW, Eq. 28),
        p = softmax(s) (Eq. 30) and p̄ the set's mean of the scattered p (Eq. 37):
            L = -λ Σ_sets H(p̄),  H(p̄) = -Σ_i p̄_i log(p̄_i + 1e-8)              (Eq. 38)
            ∂L/∂p̄_i = λ (log(p̄_i + 1e-8) + p̄_i / (p̄_i + 1e-8))
            ∂L/∂p_j = ∂L/∂p̄_{i_j} / n_set,  ∂L/∂s_j = p_j (∂L/∂p_j - Σ_l p_l ∂L/∂p_l)
            ∂s_j/∂K_{i_j} = 2 (q - K_{i_j}) / (ε + ||q - K_{i_j}||²)   (IDW; dot: q)
        and each ∂L/∂K_i sums the tokens that selected sub-key i."""
        if not self.addr_loss:
            return self._memorisation_key_grad(q, lk, tgt, lw, state)
        keys = state["keys"]
        B, T, _ = q.shape
        H, n, d = self.heads, self.n, self.key_dim // 2
        outer = self.grad_through_update and torch.is_grad_enabled()
        kern = None if outer else pk.kernels(q, self.triton)
        with torch.set_grad_enabled(outer):
            qh = _fp32(q).view(B, T, H, 2, 1, d)
            rows = subkey_rows(keys, lk.sub_index)  # [B, T, H, 2, k] into keys.reshape(-1, d)
            if kern:  # the selected scores as _lookup recomputed them (0 for a token that counts nowhere)
                s = lk.sub_scores.where(ok[:, :, None, None, None], 0)
            else:
                K = gather_rows(keys, rows)  # [B, T, H, 2, k, d]
                if self.score == "idw":
                    diff = qh - K
                    dist = self.idw_eps + diff.pow(2).sum(-1)
                    s, ds_dK = -torch.log(dist), 2 * diff / dist[..., None]
                else:
                    s, ds_dK = (qh * K).sum(-1), qh.expand_as(K)
            okf = ok[:, :, None, None, None].to(s.dtype)
            p = torch.softmax(s, -1) * okf  # s' over each half's top-k (Eq. 30), counted tokens only
            # p̄ (Eq. 37) per sub-key set: one per sequence (a memory per sequence), head (unless
            # pooled) and half; the mean over the set's counted tokens (and heads, if pooled)
            dev, n_h = q.device, 1 if self.pooled_entropy else H
            b_set = torch.arange(B, device=dev).view(B, 1, 1, 1) if self.per_sequence else torch.zeros((), dtype=torch.long)
            h_set = torch.zeros((), dtype=torch.long) if self.pooled_entropy else torch.arange(H, device=dev).view(H, 1)
            set_id = ((b_set * n_h + h_set) * 2 + torch.arange(2, device=dev)).expand(B, T, H, 2)
            n_sets = (B if self.per_sequence else 1) * n_h * 2
            n_tok = okf.new_zeros(n_sets).index_add_(0, set_id.reshape(-1), okf.expand(B, T, H, 2, 1).reshape(-1))
            n_tok = n_tok.clamp(min=1).take(set_id)[..., None]  # [B, T, H, 2, 1]
            bucket = set_id[..., None] * n + lk.sub_index  # [B, T, H, 2, k]: sub-key i of its set
            if kern:
                p_bar = kern.segment_sum(p.new_zeros(n_sets * n, 1), kern.Segments(bucket), (p / n_tok).reshape(-1))[:, 0]
            else:
                p_bar = p.new_zeros(n_sets * n).index_add(0, bucket.reshape(-1), (p / n_tok).reshape(-1))
            dp_bar = self.addr_loss_weight * (torch.log(p_bar + 1e-8) + p_bar / (p_bar + 1e-8))
            dp = dp_bar.take(bucket) / n_tok * okf
            ds = p * (dp - (p * dp).sum(-1, keepdim=True))  # softmax backward
            grad = keys.new_zeros(keys.numel() // d, d)
            if kern:  # IDW: Σ_j 2 ds_j (q - K_i) / dist_j, dist = exp(-s), as Σ c_j q - (Σ c_j) K_i
                c = 2 * ds * torch.exp(s) if self.score == "idw" else ds
                kern.segment_sum(grad, kern.Segments(rows), c.reshape(-1), qh.reshape(-1, d), per_token=self.topk,
                                 table=keys.reshape(-1, d) if self.score == "idw" else None)
                return grad.view_as(keys)
            grad = grad.index_add(0, rows.reshape(-1), (ds[..., None] * ds_dK).reshape(-1, d))
            return grad.view_as(keys)

    def _memorisation_key_grad(self, q, lk: Lookup, tgt, lw, state: State) -> Tensor:
        """App. B "w/o addr loss": the keys follow ½·mean over pairs and features of the MSE
        (the release's `no_addr_loss`), by autograd."""
        keys = state["keys"]
        Tw = tgt.shape[1]
        if Tw == 0:
            return torch.zeros_like(keys)
        outer = self.grad_through_update and torch.is_grad_enabled()  # keep the graph (release)
        B, T, _ = q.shape
        with torch.enable_grad():
            K = keys if keys.requires_grad else keys.detach().requires_grad_()
            qh = _fp32(q).view(B, T, self.heads, self.key_dim)
            top = selected_subkey_scores(qh[:, :Tw], K, lk.sub_index[:, :Tw], self.score, self.idw_eps)
            w = torch.softmax(pair_scores(top, lk.pair[:, :Tw]).flatten(-2), -1)
            idx = self._rows(lk.index[:, :Tw].flatten(-2))
            v_hat = gather_values(self._values(state).detach(), idx, w)
            n = Tw if self.per_sequence else B * Tw  # pairs behind each memory
            loss = 0.5 * (_fp32(lw).unsqueeze(-1) * (_fp32(tgt) - v_hat).pow(2)).sum() / (n * self.value_dim)
            (grad,) = torch.autograd.grad(loss, K, create_graph=outer)
        return grad

    # ---- causal mixing: one lookup per chunk shared by read and write ---------------------
    def forward_state(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        """The read-then-write loop over chunks. Eq. 26's projections and Eqs. 33-34's output
        are per token, so they run once over the whole call; only the lookups, reads and
        writes, which depend on the memory, run chunk by chunk."""
        q, v, g = self.io.project(x)
        v_hats = []
        for s in range(0, x.shape[1], self.chunk_size):
            c = slice(s, s + self.chunk_size)
            qc, vc, gc = q[:, c], v[:, c], None if g is None else g[:, c]
            lk, w, idx = self._lookup(qc, state)
            v_hats.append(self._gather(self._values(state), idx, w))
            self._note_read(idx, w, gc, append=s > 0)
            state = self._update(qc, vc, gc, lk, w, idx, state)
        if not v_hats:  # T = 0
            return x.new_zeros(x.shape), state
        return self.io.output(torch.cat(v_hats, dim=1).to(v.dtype), v, g), state

    # ---- diagnostics (Sec. 3.3 usage, Fig. 3 gates, Fig. 5 retrieval trace) ---------------
    @torch.compiler.disable  # traced, the in-place refill becomes a fresh [B, n², Dv] clone per call (10x slower)
    def reset(self, batch_size: int = 1) -> None:
        self._batch_size = batch_size
        self._state = self.init_state(batch_size if self.per_sequence else 1, reuse=self._state)
        self._pos, self._writer = 0, None
        self._drop_held()

    def reset_stats(self) -> None:
        """Start a new slot-usage count (stats()['usage'] counts slots read since)."""
        self._hits = None

    @torch.no_grad()
    def _note_read(self, idx: Tensor, w: Tensor, g: Tensor | None, append: bool = False) -> None:
        """Record a read for stats(): slots hit since reset_stats(), and the last call's slots,
        weights, gates and the writers of the slots read (`append`: a later chunk of the same
        call, kept with the earlier ones; stats() concatenates them along time). Not kept under
        torch.compile (they would cost a recompilation per chunk)."""
        if torch.compiler.is_compiling():
            return
        rows = self.N * (idx.shape[0] if self.per_sequence else 1)
        if self._hits is None or self._hits.numel() != rows or self._hits.device != idx.device:
            self._hits = torch.zeros(rows, dtype=torch.bool, device=idx.device)
        self._hits[idx.reshape(-1)] = True
        new = {"index": idx.detach(), "weights": w.detach(), "gates": None if g is None else g.detach()}
        if self._writer is not None and self._writer.device == idx.device:  # who had written the slots read
            new["writer"] = gather_rows(self._writer, idx)
        self._reads = [*self._reads, new] if append else [new]  # concatenated by stats(), not per chunk

    def _trace(self) -> dict:
        """The last call's reads, chunks concatenated along time (a chunk read before the first
        write has writer -1)."""
        reads = self._reads
        if not reads:
            return {}
        if any("writer" in r for r in reads):
            reads = [r if "writer" in r else {**r, "writer": torch.full((*r["index"].shape, 2), -1, dtype=torch.long,
                                                                            device=r["index"].device)} for r in reads]
        return {k: None if reads[0][k] is None else torch.cat([r[k] for r in reads], dim=1) for k in reads[0]}

    @torch.no_grad()
    def _note_write(self, idx_w: Tensor, B: int, Tw: int) -> None:
        if torch.compiler.is_compiling():  # as _note_read
            return
        rows = self.N * (B if self.per_sequence else 1)
        if self._writer is None or self._writer.shape[0] != rows or self._writer.device != idx_w.device:
            # who wrote each slot last: stream position and batch row (-1: not since reset)
            self._writer = torch.full((rows, 2), -1, dtype=torch.long, device=idx_w.device)
        off = 1 if self.lookahead else 0  # the token whose value was stored
        pos = (self._pos + off + torch.arange(Tw, device=idx_w.device)).view(1, Tw, 1).expand_as(idx_w)
        seq = torch.arange(B, device=idx_w.device).view(B, 1, 1).expand_as(idx_w)
        self._writer[idx_w.reshape(-1)] = torch.stack([pos.reshape(-1), seq.reshape(-1)], -1)  # later ones win

    @torch.no_grad()
    def stats(self) -> dict:
        out = super().stats()
        if self._hits is not None:
            out["usage"] = (self._hits > 0).float().mean().item()
        d = self._trace()
        if d:
            # marginal entropy of each sub-key set over the last read, normalised by log n
            sub = torch.stack([d["index"] // self.n, d["index"] % self.n]) % self.n
            for h, name in enumerate(("sub1", "sub2")):
                p = torch.bincount(sub[h].reshape(-1), minlength=self.n).float()
                p = p / p.sum()
                out[f"marginal_entropy/{name}"] = (-(p * torch.log(p + 1e-12)).sum() / math.log(self.n)).item()
            if d["gates"] is not None:
                out["gate_hist"] = torch.histc(d["gates"].float(), bins=10, min=0, max=1).tolist()
                out["gate_mean"] = d["gates"].float().mean().item()
                out["gates"] = d["gates"]  # per token of the last call [B, T] (Fig. 6)
            trace = {"slots": d["index"], "weights": d["weights"]}
            if "writer" in d:
                trace["writer_pos"], trace["writer_seq"] = d["writer"][..., 0], d["writer"][..., 1]
            out["trace"] = trace
        return out
