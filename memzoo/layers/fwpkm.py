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
from memzoo.ops.product_key import Lookup, gather_values, lookup, pair_scores, selected_subkey_scores
from memzoo.registry import register_layer


def _fp32(x: Tensor) -> Tensor:
    """Fast-weight math runs in at least fp32 (the release's fp32_fw)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


#: the choices where the paper's text and the authors' release differ (module docstring)
VARIANTS = {
    "paper": dict(addr_loss_weight=10.0, release_value_scale=False, grad_through_update=False,
                  before_mixer=False, pooled_entropy=False),
    "release": dict(addr_loss_weight=1.0, release_value_scale=True, grad_through_update=True,
                    before_mixer=True, pooled_entropy=True),
}


@register_layer("fwpkm")
class FwPKM(MemoryLayer):
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
        self.per_sequence, self.seed = per_sequence, seed
        self.addr_loss_weight = float(opts["addr_loss_weight"])
        self.release_value_scale, self.grad_through_update = opts["release_value_scale"], opts["grad_through_update"]
        self.site = "before_mixer" if opts["before_mixer"] else "after_mixer"
        self.pooled_entropy = opts["pooled_entropy"]
        self.io = FastWeightIO(d_model, heads * key_dim, value_dim, gating, value_norm)
        self._diag: dict = {}
        self._pos, self._writer = 0, None  # stream position; who last wrote each slot
        self.reset_stats()
        if not per_sequence:
            self.reset()  # shared fast weights exist as buffers from the start

    # ---- fast weights ----------------------------------------------------------------------
    def init_state(self, batch_size: int) -> State:
        """K ~ U(±1/√Dk), V ~ N(0, 1/Dv) as in the release, from a fixed seed so reset is exact."""
        dev = self.io.q_proj.weight.device
        dt = torch.promote_types(self.io.q_proj.weight.dtype, torch.float32)  # fast weights: >= fp32
        kshape = (self.heads, 2, self.n, self.key_dim // 2)
        vshape = (self.N, self.value_dim)
        if dev.type == "meta":
            keys, values = torch.empty(kshape, device=dev), torch.empty(vshape, device=dev)
        else:
            gen = torch.Generator().manual_seed(self.seed)
            bound = 1 / math.sqrt(self.key_dim)
            keys = (torch.rand(kshape, generator=gen) * 2 - 1).mul_(bound).to(dev, dt)
            values = (torch.randn(vshape, generator=gen) * self.value_dim**-0.5).to(dev, dt)
        if self.per_sequence:  # real copies: writes update values in place
            keys, values = keys.repeat(batch_size, 1, 1, 1, 1), values.repeat(batch_size, 1, 1)
        return {"keys": keys, "values": values}

    # ---- retrieval (Eqs. 27-32) ------------------------------------------------------------
    def _lookup(self, q: Tensor, state: State) -> tuple[Lookup, Tensor, Tensor]:
        """Top-k slots for queries [B, T, H*Dk]: the lookup, softmax weights [B, T, H*k] over
        heads × top-k jointly (release), and slot ids into the flattened values [B, T, H*k].
        Selection needs no gradient; the k selected scores are then recomputed
        differentiably (O(k·d) per query, not O(n·d)) for the weights' gradient to q."""
        B, T, _ = q.shape
        qh = _fp32(q).view(B, T, self.heads, self.key_dim)
        with torch.no_grad():
            lk = lookup(qh, state["keys"], self.topk, self.score, self.idw_eps)
        top = selected_subkey_scores(qh, state["keys"], lk.sub_index, self.score, self.idw_eps)
        w = torch.softmax(pair_scores(top, lk.pair).flatten(-2), dim=-1)
        return lk, w, self._rows(lk.index.flatten(-2))

    def _rows(self, idx: Tensor) -> Tensor:
        if self.per_sequence:  # each sequence addresses its own block of rows
            idx = idx + torch.arange(idx.shape[0], device=idx.device).view(-1, 1, 1) * self.N
        return idx

    def _values(self, state: State) -> Tensor:
        return state["values"].reshape(-1, self.value_dim)

    def read_state(self, x: Tensor, state: State) -> Tensor:
        q, v, g = self.io.project(x)
        lk, w, idx = self._lookup(q, state)
        v_hat = gather_values(self._values(state), idx, w)
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
            v_hat = gather_values(flat, idx_w, w_w)
            # ∇_{v̂_t} of the gate-weighted ½||v_{t+1} - v̂_t||², summed over tokens and features (Sec. 3.2.2)
            err = _fp32(lw).unsqueeze(-1) * (v_hat - _fp32(tgt))  # [B, Tw, Dv]
            # N_i^read (Eq. 36): every read of row i in the chunk, the last token's included
            # (a non-finite token's reads go to row -1, which nothing writes)
            _, inv, n_read = torch.unique(idx.where(ok[..., None], -1), return_inverse=True, return_counts=True)
            rows, n_w = idx_w.reshape(-1), n_read[inv[:, :Tw]].reshape(-1)
            scale = self.lr * (self.topk * self.heads if self.release_value_scale else 1.0)
            # Eqs. 35-36: each entry's share of its row's gradient, divided by the row's N_i^read
            delta = (w_w.unsqueeze(-1) * err.unsqueeze(-2)).reshape(-1, self.value_dim)
            delta = delta * (-scale / n_w.to(delta.dtype)).unsqueeze(-1)
            if values.requires_grad or (self.grad_through_update and torch.is_grad_enabled()):
                flat = flat.index_add(0, rows, delta)  # functional: outer gradients flow through it
            else:
                flat.index_add_(0, rows, delta)  # in place: O(rows touched), not O(N)
            new["values"] = flat.view_as(values)
            self._note_write(idx_w, B, Tw)
        if not torch.compiler.is_compiling():  # diagnostics stay out of compiled graphs
            self._pos += T
        return new

    def _key_grad(self, q, ok, lk: Lookup, tgt, lw, state: State) -> Tensor:
        """∇_K of the addressing loss (Eqs. 37-39), or of the memorisation loss when that is
        switched off (App. B). Only the selected sub-keys get gradient, so only their scores
        are recomputed (differentiably in K): O(k·d) per token. `ok` [B, T] marks the tokens
        that count."""
        keys = state["keys"]
        outer = self.grad_through_update and torch.is_grad_enabled()  # keep the graph (release)
        B, T, _ = q.shape
        with torch.enable_grad():
            K = keys if keys.requires_grad else keys.detach().requires_grad_()
            qh = _fp32(q).view(B, T, self.heads, self.key_dim)
            top = selected_subkey_scores(qh, K, lk.sub_index, self.score, self.idw_eps)  # [B, T, H, 2, k]
            if self.addr_loss:
                # s' over each half's top-k (Eq. 30), zero elsewhere, for the counted tokens
                p = torch.softmax(top, -1) * ok[:, :, None, None, None]
                # p̄ (Eq. 37): the mean over the chunk's tokens (and the batch, for a shared memory;
                # and the heads, if pooled) of the scattered s', per sub-key set
                kept = ([0] if self.per_sequence else []) + ([] if self.pooled_entropy else [2]) + [3]
                perm = kept + [d for d in range(4) if d not in kept] + [4]
                p, idx = p.permute(perm), lk.sub_index.permute(perm)
                shape = p.shape[: len(kept)]
                n_tok = ok[:, :, None, None, None].expand(B, T, self.heads, 2, 1).permute(perm)
                n_tok = n_tok.reshape(*shape, -1).sum(-1, keepdim=True).clamp(min=1)
                p_bar = p.new_zeros(*shape, self.n).scatter_add(-1, idx.reshape(*shape, -1), p.reshape(*shape, -1))
                p_bar = p_bar / n_tok
                entropy = -(p_bar * torch.log(p_bar + 1e-8)).sum(-1)  # per (sequence,) (head,) sub-key set
                loss = -self.addr_loss_weight * entropy.sum()  # Eq. 38: maximise H(p̄)
            else:  # App. B "w/o addr loss": keys follow ½·mean over pairs and features of the MSE
                Tw = tgt.shape[1]
                if Tw == 0:
                    return torch.zeros_like(keys)
                w = torch.softmax(pair_scores(top[:, :Tw], lk.pair[:, :Tw]).flatten(-2), -1)
                idx = self._rows(lk.index[:, :Tw].flatten(-2))
                v_hat = gather_values(self._values(state).detach(), idx, w)
                n = Tw if self.per_sequence else B * Tw  # pairs behind each memory
                loss = 0.5 * (_fp32(lw).unsqueeze(-1) * (_fp32(tgt) - v_hat).pow(2)).sum() / (n * self.value_dim)
            (grad,) = torch.autograd.grad(loss, K, create_graph=outer)
        return grad

    # ---- causal mixing: one lookup per chunk shared by read and write ---------------------
    def forward_state(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        ys = []
        for s in range(0, x.shape[1], self.chunk_size):
            q, v, g = self.io.project(x[:, s : s + self.chunk_size])
            lk, w, idx = self._lookup(q, state)
            v_hat = gather_values(self._values(state), idx, w)
            self._note_read(idx, w, g, append=s > 0)
            ys.append(self.io.output(v_hat.to(v.dtype), v, g))
            state = self._update(q, v, g, lk, w, idx, state)
        if not ys:  # T = 0
            return x.new_zeros(x.shape), state
        return torch.cat(ys, dim=1), state

    # ---- diagnostics (Sec. 3.3 usage, Fig. 3 gates, Fig. 5 retrieval trace) ---------------
    def reset(self, batch_size: int = 1) -> None:
        super().reset(batch_size)
        self._pos, self._writer = 0, None

    def reset_stats(self) -> None:
        """Start a new slot-usage count (stats()['usage'] counts slots read since)."""
        self._hits = None

    @torch.no_grad()
    def _note_read(self, idx: Tensor, w: Tensor, g: Tensor | None, append: bool = False) -> None:
        """Record a read for stats(): slots hit since reset_stats(), and the last call's slots,
        weights, gates and the writers of the slots read (`append`: a later chunk of the same
        call, concatenated along time so the trace covers the whole call). Not kept under
        torch.compile (they would cost a recompilation per chunk)."""
        if torch.compiler.is_compiling():
            return
        rows = self.N * (idx.shape[0] if self.per_sequence else 1)
        if self._hits is None or self._hits.numel() != rows or self._hits.device != idx.device:
            self._hits = torch.zeros(rows, dtype=torch.bool, device=idx.device)
        self._hits[idx.reshape(-1)] = True
        new = {"index": idx.detach(), "weights": w.detach(), "gates": None if g is None else g.detach()}
        if self._writer is not None and self._writer.device == idx.device:  # who had written the slots read
            new["writer"] = self._writer[idx]
        old = dict(self._diag) if append else {}
        if old and "writer" in new and "writer" not in old:  # the first write came between the chunks
            old["writer"] = torch.full((*old["index"].shape, 2), -1, dtype=torch.long, device=idx.device)
        if old and old.keys() == new.keys():
            new = {k: None if v is None else torch.cat([old[k], v], dim=1) for k, v in new.items()}
        self._diag = new

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
        d = self._diag
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
