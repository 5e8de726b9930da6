"""FwPKM: Fast-weight Product Key Memory (Zhao & Jones 2026, Sec. 3; summary in Sec. 3.5).

A Product Key Memory whose sub-keys K¹, K² and values V are fast weights, rewritten chunk by
chunk (chunk 512) by one step of gradient descent on a local memorisation objective.

Read (Eqs. 26-34), for every token of a chunk, with the memory so far:
    q_t, v_t, g_t = Linear(RMSNorm(h_t))                        Eq. 26 (FastWeightIO; v z-scored, Sec. 3.4.3)
    [q¹; q²] = q_t;  s^{1,2}_i = -log(ε + ||q^{1,2} - K^{1,2}_i||²)   Eqs. 27-28 (IDW score, ε = 1e-3)
    top-k per half, k×k combine, top-k, softmax                  Eqs. 29-31 (memzoo.ops.product_key)
    v̂_{t+1} = Σ_{i∈I} s'_i V_i                                  Eq. 32 (1 head, top-8, 512² slots)
    o'_t = Linear(RMSNorm(g_t v̂_{t+1} + (1 - g_t) v_t))          Eqs. 33-34

Write (Eqs. 35-39), once per chunk (``write(x)`` too: chunk by chunk, as forward), from the same
pre-update fast weights:
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

The math. Lookup, read, value step and key gradient are the pure functions of
:mod:`memzoo.ops.fwpkm`, each a torch reference and, on CUDA tensors, the Triton kernels of
:mod:`memzoo.kernels.fwpkm` behind one dispatch (a fused lookup, an embedding bag, deterministic
sorted-segment sums for the value step and the key gradient); ``triton=False`` keeps the torch
path everywhere, and a write that outer gradients flow through (``grad_through_update``) takes it
too. This class holds the fast weights, runs the chunk loop and notes the diagnostics of stats().

The pairs adapter (MemoryLayer.write_pairs / read_keys; bench/suites/pairs.py). A pair is one
query (the key, H·Dk: the heads' sub-queries joined, as one pair head, since the heads share one
softmax and one value table) and one target (the value, Dv: what the value step moves the read
toward; with lookahead v_{t+1}). `write_pairs` runs the layer's own chunk step (`_step`: the
lookup, `value_step` and, with x, the key step of :mod:`memzoo.ops.fwpkm`) a pair a token,
``chunk_size`` pairs a chunk, so ``write_pairs(*pair_inputs(x), x)`` stores what ``write(x)``
stores. Neutral (no x): every pair at weight 1 (no gate, no lookahead: the pairs are explicit),
the layer's value step (its lr, the paper's η = 1 by default; the release's × top-k × heads if
set) and no key step: the addressing loss is a usage regulariser over a chunk's queries, not the
storage of a pair, and without it each pair is stored at the slots the current sub-keys address
(``pairs_key_step = True`` steps them as write(x) does). `read_keys` is the lookup and Eq. 32's
read, before the gate and output. With top-1 slots (and one head) each value step lands the read
exactly on its target (Eq. 16); with top-k, a pair alone on its slots moves its read by the
fraction Σ_i s'_i² of the error per write (V_i += s'_i (v − v̂)), so repeated writes converge to
the target geometrically.

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
from memzoo.modules.precision import compute_dtype
from memzoo.ops import fwpkm as fw
from memzoo.ops.product_key import Lookup, gather_rows
from memzoo.registration import register_layer


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
        dt = compute_dtype(self.io.q_proj.weight)  # fast weights: >= fp32
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
        """Top-k slots for queries [B, T, H*Dk] (`fw.lookup`): the lookup, softmax weights
        [B, T, H*k] over heads × top-k jointly (release), and rows into the flat values [B, T, H*k]."""
        B, T, _ = q.shape
        qh = fw.fp32(q).view(B, T, self.heads, self.key_dim)
        lk, w = fw.lookup(qh, state["keys"], self.topk, self.score, self.idw_eps, self.triton)
        return lk, w, fw.slot_rows(lk.index.flatten(-2), self.N, self.per_sequence)

    def _values(self, state: State) -> Tensor:
        return state["values"].reshape(-1, self.value_dim)

    def read_state(self, x: Tensor, state: State) -> Tensor:
        q, v, g = self.io.project(x)
        lk, w, idx = self._lookup(q, state)
        v_hat = fw.read(self._values(state), idx, w, self.triton)
        self._note_read(idx, w, g)
        return self.io.output(v_hat.to(v.dtype), v, g)

    # ---- memorisation (Eqs. 35-39) ---------------------------------------------------------
    def write_state(self, x: Tensor, state: State) -> State:
        """Memorize x chunk by chunk (``chunk_size`` tokens, one update each, from the memory the
        previous chunk left): the writes forward makes (`one_chunk` sets chunk_size to the whole)."""
        q, v, g = self.io.project(x)
        out = dict(state)  # T = 0: nothing written
        for s in range(0, x.shape[1], self.chunk_size):
            c = slice(s, s + self.chunk_size)
            lk, w, idx = self._lookup(q[:, c], out)
            out = self._update(q[:, c], v[:, c], None if g is None else g[:, c], lk, w, idx, out)
        return out

    def _update(self, q, v, g, lk: Lookup, w, idx, state: State) -> State:
        """One chunk's write from the pre-update fast weights: the keys step on the addressing
        loss (Eqs. 37-39), the values on the memorisation loss (Eqs. 35-36)."""
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
        return self._step(q, ok, tgt, lw, lk, w, idx, state, key_step=True, stored=1 if self.lookahead else 0)

    def _step(self, q, ok, tgt, lw, lk: Lookup, w, idx, state: State, *, key_step: bool, stored: int) -> State:
        """The step of one chunk of T tokens whose first Tw = tgt.shape[1] write: queries q [B, T, H·Dk]
        (zero where not `ok` [B, T]), targets tgt [B, Tw, Dv] and pair weights lw [B, Tw] (0 for a pair
        that writes nothing), the lookup and reads (lk, w, idx) of all T tokens. `key_step`: the keys'
        step too (Eqs. 37-39, or App. B's memorisation loss); `stored`: the offset of the token whose
        value pair t stores (diagnostics: 1 with lookahead)."""
        B, T, _ = q.shape
        Tw = tgt.shape[1]
        outer = self.grad_through_update and torch.is_grad_enabled()  # outer gradients through the write
        new = dict(state)
        if key_step and self.addr_loss:
            key_grad = fw.addressing_key_grad(q, ok, lk, state["keys"], weight=self.addr_loss_weight, score=self.score,
                                              eps=self.idw_eps, pooled_entropy=self.pooled_entropy, outer=outer,
                                              triton=self.triton)
            new["keys"] = state["keys"] - self.lr * key_grad
        elif key_step:  # App. B: the keys follow the memorisation loss
            key_grad = fw.memorisation_key_grad(q, lk, state["keys"], self._values(state), tgt, lw, score=self.score,
                                                eps=self.idw_eps, outer=outer)
            new["keys"] = state["keys"] - self.lr * key_grad
        if Tw > 0:
            values = state["values"]
            flat = values.view(-1, self.value_dim)
            v_hat = fw.read(flat, idx[:, :Tw], w[:, :Tw], self.triton)  # the writing tokens' own retrieval
            # ∇_{v̂_t} of the gate-weighted ½||v_{t+1} - v̂_t||², summed over tokens and features (Sec. 3.2.2)
            err = fw.fp32(lw).unsqueeze(-1) * (v_hat - fw.fp32(tgt))  # [B, Tw, Dv]
            scale = self.lr * (self.topk * self.heads if self.release_value_scale else 1.0)
            functional = values.requires_grad or outer
            new["values"] = fw.value_step(flat, idx, w, err, ok, scale, functional=functional,
                                          triton=self.triton).view_as(values)
            self._note_write(idx[:, :Tw], B, Tw, stored)
        if not torch.compiler.is_compiling():  # diagnostics stay out of compiled graphs
            self._pos += T
        return new

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
            v_hats.append(fw.read(self._values(state), idx, w, self.triton))
            self._note_read(idx, w, gc, append=s > 0)
            state = self._update(qc, vc, gc, lk, w, idx, state)
        if not v_hats:  # T = 0
            return x.new_zeros(x.shape), state
        return self.io.output(torch.cat(v_hats, dim=1).to(v.dtype), v, g), state

    # ---- the pairs adapter (bench/suites/pairs.py; module docstring) -----------------------
    no_pairs = None
    #: without x, whether `write_pairs` also steps the keys on the addressing loss (Eqs. 37-39); off:
    #: the neutral write stores values at the slots the keys address now (module docstring)
    pairs_key_step: bool = False

    def pair_dims(self) -> tuple[int, int, int]:
        """One pair head: the key is the whole query (the heads' sub-queries joined, H·Dk: the heads
        read one joint softmax over H × top-k slots of one value table), the value one of Dv."""
        return 1, self.heads * self.key_dim, self.value_dim

    def pair_inputs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The queries q_t [B, T, 1, H·Dk] and the targets their write moves the read toward [B, T, 1, Dv]:
        v_t, or with lookahead v_{t+1} inside the chunk (Eq. 22); a chunk's last token stores no pair
        (its value here is 0, and with x its pair's weight is 0)."""
        q, v, _ = self.io.project(x)
        B, T, _ = q.shape
        if self.lookahead:
            t = torch.arange(T, device=v.device)
            keep = (t % self.chunk_size != self.chunk_size - 1) & (t < T - 1)
            v = torch.cat([v[:, 1:], v[:, :1]], dim=1).where(keep[:, None], 0)
        return q.unsqueeze(2), v.unsqueeze(2)

    def _check_pairs(self, k: Tensor, v: Tensor | None = None) -> None:
        H, K, V = self.pair_dims()
        if k.dim() != 4 or tuple(k.shape[2:]) != (H, K) or (v is not None and tuple(v.shape) != (*k.shape[:3], V)):
            got = tuple(k.shape) if v is None else (tuple(k.shape), tuple(v.shape))
            raise ValueError(f"FwPKM pairs: keys [B, n, {H}, {K}] and values [B, n, {H}, {V}] expected, got {got}")
        if self.per_sequence and k.shape[0] != self._batch_size:
            raise ValueError(f"FwPKM holds state for batch size {self._batch_size} but got a batch of {k.shape[0]} "
                             f"pair sequences; call reset(batch_size={k.shape[0]}) first")

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """The layer's write (lookup, value_step and, with x, the key step of :mod:`memzoo.ops.fwpkm`) on
        the pairs (k_t, v_t), a pair a token, chunk by chunk (``chunk_size`` pairs, each chunk addressed
        with the memory the previous one left). Each pair's slots step toward v_t: V_i += lr/N_i^read ·
        Σ_t w_{t,i} (v_t − v̂_t) (Eqs. 35-36). With x [B, n, D]: the weights, token mask and key step that
        write(x) computes from x (gates g_t, a chunk's last pair unwritten with lookahead, the addressing
        loss's step on the sub-keys). Without x (neutral): every pair written at weight 1 (no gate), the
        layer's own value step (lr, default the paper's η = 1), and the keys left as they are
        (`pairs_key_step` to step them too): pairs are stored at the slots the current sub-keys address."""
        self._check_pairs(k, v)
        B, n = k.shape[:2]
        if x is not None:
            if tuple(x.shape[:2]) != (B, n):
                raise ValueError(f"FwPKM.write_pairs: x must be [B, n, D] = [{B}, {n}, {self.d_model}], "
                                 f"got {tuple(x.shape)}")
            state = self._current(x)
            _, vx, g = self.io.project(x)
        else:
            state, vx, g = self.state, None, None
        q, tv = k.reshape(B, n, -1), v.reshape(B, n, -1)
        C = self.chunk_size
        for s in range(0, n, C):
            c = slice(s, s + C)
            state = self._pairs_chunk(q[:, c], tv[:, c], x is not None, None if vx is None else vx[:, c],
                                      None if g is None else g[:, c], state)
        self._state = state

    def _pairs_chunk(self, q: Tensor, v: Tensor, from_x: bool, vx: Tensor | None, g: Tensor | None,
                     state: State) -> State:
        """One chunk of pairs: `_update`'s masks and weights, the targets given rather than built from x."""
        lk, w, idx = self._lookup(q, state)
        if not self.grad_through_update:
            q, v, w = q.detach(), v.detach(), w.detach()
            vx = None if vx is None else vx.detach()
            g = None if g is None else g.detach()
        T = q.shape[1]
        if from_x:  # write(x)'s masks and weights: a token counts if its query, own value and gate are finite
            ok = finite_tokens(q, vx, g, w)
            g = None if g is None else g.where(ok, 0)
            Tw = T - 1 if self.lookahead else T  # with lookahead the chunk's last token stores no pair
            pair_ok = ok[:, :Tw] & ok[:, T - Tw :]  # and a pair needs its query's and its target's token
            lw = g[:, :Tw] if (self.gate_weighted_loss and g is not None) else q.new_ones(q.shape[0], Tw)
        else:  # neutral: every finite pair at weight 1
            ok = finite_tokens(q, v, w)
            Tw, pair_ok, lw = T, ok, q.new_ones(q.shape[:2])
        lw = lw * pair_ok
        tgt = v[:, :Tw].where(pair_ok[..., None], 0)
        q, w = q.where(ok[..., None], 0), w.where(ok[..., None], 0)
        return self._step(q, ok, tgt, lw, lk, w, idx, state, key_step=from_x or self.pairs_key_step,
                          stored=1 if from_x and self.lookahead else 0)

    def read_keys(self, k: Tensor) -> Tensor:
        """What the memory returns at keys k [B, n, 1, H·Dk]: the lookup and the read v̂ = Σ s'_i V_i
        (Eqs. 27-32, before the gate and output of Eqs. 33-34), [B, n, 1, Dv]; the state unchanged."""
        self._check_pairs(k)
        state = self.state
        lk, w, idx = self._lookup(k.reshape(*k.shape[:2], -1), state)
        return fw.read(self._values(state), idx, w, self.triton).unsqueeze(2)

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
    def _note_write(self, idx_w: Tensor, B: int, Tw: int, off: int) -> None:
        if torch.compiler.is_compiling():  # as _note_read
            return
        rows = self.N * (B if self.per_sequence else 1)
        if self._writer is None or self._writer.shape[0] != rows or self._writer.device != idx_w.device:
            # who wrote each slot last: stream position and batch row (-1: not since reset)
            self._writer = torch.full((rows, 2), -1, dtype=torch.long, device=idx_w.device)
        # off: from a pair's query token to the token whose value it stored (1 with lookahead)
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
