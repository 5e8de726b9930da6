"""FwMLP: a fast-weight SwiGLU MLP memory (FwPKM paper, App. A "FwMLP"; Sec. 4.1, Table 3).

The paper's dense baseline for FwPKM: the product-key memory is replaced by a SwiGLU MLP
whose three matrices *and their biases* are fast weights,

    f(q; θ) = W_down (silu(W_gate q + b_gate) ⊙ (W_up q + b_up)) + b_down
    θ = {W_up, b_up, W_gate, b_gate, W_down, b_down}          512 → 2304 → 512 in Table 3

inside the same slow-weight shell as FwPKM (:mod:`memzoo.layers.fw_io`):

    q_t, v_t, g_t = Linear^{q,v,g}(RMSNorm^{q,v,g}(h_t))      Eq. 26 (g through a sigmoid)
    v_t          <- zscore(v_t)                                Sec. 3.4.3 (``value_norm``)
    o_t           = g_t f(q_t; θ) + (1 - g_t) v_t              Eq. 33 (``gating``; else f + v)
    o'_t          = Linear^o(RMSNorm^o(o_t))                   Eq. 34

Read: o'_t for every position with the fast weights so far (θ is not changed).

Write (App. A), per chunk of C tokens (``chunk_size``, 512 in the paper): one step of SGD
with learning rate η (0.1, Table 3) on the MSE between the prediction at q_t and the
lookahead target v_{t+1} (Sec. 3.4.2, Eq. 22; pairs never straddle a chunk boundary, so
a chunk of C tokens writes C - 1 pairs; ``lookahead_target="mean"`` takes the release's
(v_t + v_{t+1}) / 2 instead),

    L(θ) = 1/(N·D_v) Σ_{t=1}^{N} ‖f(q_t; θ) - v_{t+1}‖²        N = B·(C-1) pairs of the chunk
    θ'   = θ - η ∇_θ L(θ)

"Due to its dense nature, we reduce the MSE losses in a chunk by averaging over both sample
and feature dimensions, and we do not apply the loss aggregation and gradient shaping
techniques [summed reduction, 1/N^read, Sec. 3.2.2] ... addressing optimization in
Section 3.3 is irrelevant too" (App. A). There is no ½ factor and no gradient clipping
(the release's FwMLP run passes ``fwpkm_grad_clip: false``; ``grad_clip=True`` is the release
class's own default, each entry of the fast weights' gradient clamped to [-1, 1], see "Stability"). The release does not weight
the FwMLP loss by the gates (its "mlp" branch calls the memory without ``gates``); the
option ``gate_weighted_loss=True`` uses L = mean_t(g_t · mean_d (f(q_t) - v_{t+1})_d²),
FwPKM's Eq. 35 weighting with App. A's reduction.

Paper and release. ``variant`` picks the paper's text (default) or the authors' release (the
code behind the paper's FwMLP numbers); each single option overrides it (for ablations):

    option               variant="paper" (default)              variant="release"
    lookahead_target     "next": v_{t+1} (Sec. 3.4.2)            "mean": (v_t + v_{t+1}) / 2
    grad_through_update  False: a local update (Sec. 3.4.1)      True: create_graph in training
    before_mixer         False: between mixer and FFN (Sec. 4.1)  True: before the token mixer

Both variants take the release's choices where the paper is silent (no gates in the loss, no
gradient clipping as the released FwMLP config sets, the initial fast weights below).

Non-finite input. A pair with a non-finite query, value or gate is left out of the write and of
the mean over pairs, so one sequence's NaN reaches neither the other sequences (which share the
fast weights) nor later calls; its own outputs are non-finite.

Fast weights are shared by all sequences of a batch and persist across calls
(``per_sequence=False``, as the paper trains FwMLP and FwPKM: App. A contrasts them with
LaCT's per-sequence fast weights); the chunk's loss then averages over the whole batch.
``per_sequence=True`` gives every sequence its own fast weights (state with a leading batch
dim), each updated by the mean loss of its own pairs. Fast weights are kept in at least
fp32 (the release's ``fp32_fw``); the read is cast back to the input dtype.

Gradient of the write. The paper's memory loss is local: "gradients cannot reach slow
weights" through it (Sec. 3.4.1); the value residual of Eq. 33 is what trains v's
projection. By default (``grad_through_update=False``) the update is computed from detached
queries and targets and the new fast weights carry no autograd graph; the slow weights learn
through the read only. With ``grad_through_update=True`` the update is differentiated
(``create_graph``) whenever autograd is recording, so the LM loss also reaches the q/v
projections through every write of the current sequence: the authors' release in training
(``create_graph=self.training``). Either way the gradient is the chain rule through f written
out (``swiglu_grads``: what ``torch.autograd.grad`` gives, tested against it) in differentiable
ops, so the differentiated update needs no ``create_graph``, writes also work under
``torch.no_grad()`` (evaluation with memory updates), and a compiled model traces the layer
whole (an ``autograd.grad`` inside it broke the graph at every chunk).

Write strength. With App. A's averaged loss and η = 0.1, one write moves f(q_t) only a small
step toward its target: at initial slow weights it removes ~0.7% of the memorisation MSE at
the tiny test sizes and ~0.015% at paper size (512 → 2304 → 512, 8 × 512 tokens). Stronger
writes need larger queries, which only ``grad_through_update=True`` gives the slow weights a
reason to learn; with the default local update recall after one write stays near chance in
the shared suite's short memorization task (see ``stats()``: ``mem_mse/before|after``).

Stability. The write is one step of plain SGD, stable while η·λ < 2 for the largest curvature λ
of the memorisation loss in the fast weights. h = silu(W_gate q) ⊙ W_up q is quadratic in q, so
λ grows as ‖q‖⁴ (for W_down: λ ≈ 2‖h‖²/D_v when a chunk's pairs are alike): at the release's
initial fast weights and η = 0.1 the step is stable for ‖q‖² ≈ D_in and overshoots once the slow
weights have roughly doubled ‖q‖ (e.g. ‖q‖ = 10 at D_in = 64, D_h = 288 gives η·λ ≈ 1). Nothing
in the paper's recipe bounds ‖q‖. Measured on the standard toys (MQAR, per-sequence memory,
chunk 8, slow lr 3e-3): the mean ‖q‖ grew from 4.6 to 10.4 in 177 steps, and at step 177 a
write's gradient was non-finite (fp32 and bf16 alike, at the same step: the trajectory, not the
precision). ``grad_clip=True`` bounds every step.

Initial fast weights follow the release's ``FastWeightMLP.reset_parameters``: W_up, W_gate ~
N(0, 1/D_in), W_down ~ N(0, 1/D_hidden), biases 0. They are drawn inside ``init_state`` from a
per-layer seed (a ``torch.Generator`` on CPU, then moved), so ``reset()`` restores them
exactly without storing a copy; the seed is a (saved) buffer, drawn from torch's global RNG
at construction unless given. On the meta device the state is empty meta tensors.

State: ``{"w_up": [H, Din], "b_up": [H], "w_gate": [H, Din], "b_gate": [H], "w_down":
[Dout, H], "b_down": [Dout]}``, with a leading batch dim when ``per_sequence``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from memzoo.layers.base import MemoryLayer, State
from memzoo.layers.fw_io import FastWeightIO, finite_tokens, from_variant
from memzoo.layers.fw_io import write_pairs as chunk_pairs  # a chunk's pairs (not the adapter's write_pairs)
from memzoo.modules.precision import compute_dtype
from memzoo.registration import register_layer

FAST_KEYS = ("w_up", "b_up", "w_gate", "b_gate", "w_down", "b_down")

#: the choices where the paper's text and the authors' release differ (module docstring)
VARIANTS = {
    "paper": dict(lookahead_target="next", grad_through_update=False, before_mixer=False),
    "release": dict(lookahead_target="mean", grad_through_update=True, before_mixer=True),
}


def _linear(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """x [B, T, I] with shared weights w [O, I], b [O] or per-sequence w [B, O, I], b [B, O]."""
    if w.dim() == 2:
        return F.linear(x, w, b)
    return torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2))


def swiglu(q: Tensor, st: State) -> Tensor:
    """f(q; θ) = W_down (silu(W_gate q + b_gate) ⊙ (W_up q + b_up)) + b_down."""
    h = F.silu(_linear(q, st["w_gate"], st["b_gate"])) * _linear(q, st["w_up"], st["b_up"])
    return _linear(h, st["w_down"], st["b_down"])


def swiglu_grads(q: Tensor, tgt: Tensor, c: Tensor, st: State) -> list[Tensor]:
    """∇_θ Σ_{b,n} c_bn · mean_d (f(q_bn; θ) - tgt_bn)², in FAST_KEYS order, by the chain rule:

        a = W_gate q + b_gate,  u = W_up q + b_up,  h = silu(a) ⊙ u,  y = W_down h + b_down
        ∂y = (2/D_out) c (y - tgt),  ∂h = W_downᵀ ∂y,  ∂u = ∂h ⊙ silu(a),
        ∂a = ∂h ⊙ u ⊙ σ(a) (1 + a (1 - σ(a)))                       (silu'(a))
        ∇W = Σ_n ∂(out)_n ⊗ (in)_n,  ∇b = Σ_n ∂(out)_n            per sequence, or over the batch (shared θ)
    """
    a, u = _linear(q, st["w_gate"], st["b_gate"]), _linear(q, st["w_up"], st["b_up"])
    sig = torch.sigmoid(a)
    act = a * sig
    h = act * u
    dy = (_linear(h, st["w_down"], st["b_down"]) - tgt) * (2.0 / tgt.shape[-1]) * c[..., None]
    dh = dy @ st["w_down"]
    du, da = dh * act, dh * u * sig * (1 + a * (1 - sig))
    shared = st["w_up"].dim() == 2
    outer = lambda d, x: torch.einsum("bno,bni->oi" if shared else "bno,bni->boi", d, x)  # noqa: E731
    total = lambda d: d.sum((0, 1)) if shared else d.sum(1)  # noqa: E731
    return [outer(du, q), total(du), outer(da, q), total(da), outer(dy, h), total(dy)]


@register_layer("fwmlp")
class FwMLP(MemoryLayer):
    """Fast-weight SwiGLU MLP memory (App. A); see the module docstring for the equations.

    Args:
        d_model: model width D (the shell's input h_t).
        input_dim: query size D_in (512 in Table 3).
        intermediate_dim: hidden size of the fast SwiGLU (2304).
        output_dim: value size D_out (512).
        lr: SGD learning rate η of the write (0.1).
        chunk_size: tokens per write (512); forward reads a chunk, then writes it.
        lookahead: pair q_t with v_{t+1} (Sec. 3.4.2); False pairs q_t with v_t.
        variant: "paper" (default) or "release": the defaults of the three options below.
        lookahead_target: "next" (the paper: v_{t+1}) or "mean" ((v_t + v_{t+1}) / 2, what the
            release's FwMLP computes: its ``lookahead_strategy`` defaults to "mean" and the
            model never overrides it, while its FwPKM takes v_{t+1}); default from ``variant``.
        gating: scalar gate g_t interpolating memory and value residual (Eq. 33).
        value_norm: z-score the values/targets (Sec. 3.4.3).
        gate_weighted_loss: weight each pair's MSE by g_t (FwPKM's Eq. 35; off for FwMLP in
            the release).
        per_sequence: one set of fast weights per sequence instead of one shared, persistent set.
        grad_through_update: differentiate through the writes (release training), or a local
            update with detached inputs (paper); default from ``variant``.
        before_mixer: place the layer before its block's token mixer (the release's
            ``fwpkm_before_attn: true``) or between mixer and FFN (the paper); default from ``variant``.
            It sets the layer's ``site``: "before_mixer" or "after_mixer".
        seed: seed of the initial fast weights; default drawn from torch's global RNG.
        norm_eps: epsilon of the shell's RMSNorms.
    """

    family = "regression"

    #: the layer has its own RMSNorms (Eq. 26) and reads the raw residual stream
    prenorm: ClassVar[bool] = False
    bench_cost = 1.4

    def __init__(
        self,
        d_model: int,
        input_dim: int = 512,
        intermediate_dim: int = 2304,
        output_dim: int = 512,
        lr: float = 0.1,
        chunk_size: int = 512,
        lookahead: bool = True,
        gating: bool = True,
        value_norm: bool = True,
        gate_weighted_loss: bool = False,
        per_sequence: bool = False,
        grad_clip: bool = False,
        variant: str = "paper",
        lookahead_target: str | None = None,
        grad_through_update: bool | None = None,
        before_mixer: bool | None = None,
        seed: int | None = None,
        norm_eps: float = 1e-5,
    ):
        super().__init__(d_model)
        opts = from_variant(VARIANTS, variant, lookahead_target=lookahead_target,
                            grad_through_update=grad_through_update, before_mixer=before_mixer)
        lookahead_target, grad_through_update, before_mixer = opts.values()
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        for k, v in (("input_dim", input_dim), ("intermediate_dim", intermediate_dim), ("output_dim", output_dim)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{k} must be a positive integer, got {v!r}")
        if not isinstance(chunk_size, int) or chunk_size < 1 or (lookahead and chunk_size < 2):
            raise ValueError(
                f"chunk_size must be an integer >= {2 if lookahead else 1}"
                f"{' (lookahead pairs need two tokens per chunk)' if lookahead else ''}, got {chunk_size!r}"
            )
        if lookahead_target not in ("next", "mean"):
            raise ValueError(
                f"lookahead_target must be 'next' (v_{{t+1}}) or 'mean' ((v_t + v_{{t+1}}) / 2), "
                f"got {lookahead_target!r}"
            )
        if gate_weighted_loss and not gating:
            raise ValueError("gate_weighted_loss=True needs gating=True (the weights are the gates g_t)")
        self.variant = variant
        self.input_dim, self.intermediate_dim, self.output_dim = input_dim, intermediate_dim, output_dim
        self.lr = float(lr)
        self.chunk_size = chunk_size
        self.lookahead = bool(lookahead)
        self.lookahead_target = lookahead_target
        self.gate_weighted_loss = bool(gate_weighted_loss)
        self.per_sequence = bool(per_sequence)
        self.grad_clip = bool(grad_clip)
        self.grad_through_update = bool(grad_through_update)
        self.site = "before_mixer" if before_mixer else "after_mixer"

        # slow weights: the shell of Eqs. 26, 33-34 (shared with FwPKM)
        self.io = FastWeightIO(d_model, input_dim, output_dim, gating=gating, value_norm=value_norm, norm_eps=norm_eps)
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())
        self.register_buffer("init_seed", torch.tensor(int(seed), dtype=torch.long, device="cpu"))
        self._last_gate: float | None = None
        self._last_write: tuple | None = None
        self.reset()

    @property
    def gating(self) -> bool:
        return self.io.gating

    @property
    def value_norm(self) -> bool:
        return self.io.value_norm

    # ---- state ---------------------------------------------------------------------------
    def _state_dtype(self) -> torch.dtype:
        return compute_dtype(self.io.q_proj.weight)

    def init_state(self, batch_size: int) -> State:
        """θ_0 as the release's reset_parameters, from the layer's seed (identical every call)."""
        device, dtype = self.io.q_proj.weight.device, self._state_dtype()
        Din, H, Dout = self.input_dim, self.intermediate_dim, self.output_dim
        shapes = {
            "w_up": (H, Din), "b_up": (H,), "w_gate": (H, Din), "b_gate": (H,), "w_down": (Dout, H), "b_down": (Dout,)
        }
        lead = (batch_size,) if self.per_sequence else ()
        if device.type == "meta" or self.init_seed.device.type == "meta":
            return {k: torch.empty(*lead, *s, dtype=dtype, device="meta") for k, s in shapes.items()}
        g = torch.Generator(device="cpu").manual_seed(int(self.init_seed.item()))
        std = {"w_up": Din**-0.5, "w_gate": Din**-0.5, "w_down": H**-0.5}
        state = {}
        for k in FAST_KEYS:  # fixed draw order: w_up, w_gate, w_down
            # drawn in fp32 whatever the state dtype: a layer cast with .double() holds the same
            # numbers in its buffers as a reset() after the cast
            if k.startswith("w"):
                v = torch.randn(*shapes[k], generator=g, dtype=torch.float32) * std[k]
            else:
                v = torch.zeros(shapes[k], dtype=torch.float32)
            v = v.to(device=device, dtype=dtype)
            state[k] = v.expand(*lead, *v.shape).clone() if lead else v
        return state

    def _fast(self, state: State) -> State:
        """The fast weights in the state dtype (at least fp32, like the release's ``fp32_fw``),
        also after a ``model.to(torch.bfloat16)`` has cast the shared-state buffers."""
        sd = self._state_dtype()
        return state if state["w_up"].dtype == sd else {k: v.to(sd) for k, v in state.items()}

    # ---- read ----------------------------------------------------------------------------
    def _read(self, q: Tensor, v: Tensor, g: Tensor | None, state: State) -> Tensor:
        state = self._fast(state)
        v_hat = swiglu(q.to(state["w_up"].dtype), state).to(v.dtype)
        return self.io.output(v_hat, v, g)

    def read_state(self, x: Tensor, state: State) -> Tensor:
        """Eqs. 26, 33-34 with f(q; θ) at the current fast weights; θ is not changed."""
        return self._read(*self._project(x), state)

    # ---- write ---------------------------------------------------------------------------
    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        q, v, g = self.io.project(x)
        if g is not None and g.numel() and not torch.compiler.is_compiling():  # .item(): a graph break
            self._last_gate = g.detach().float().mean().item()
        return q, v, g

    def _differentiable(self) -> bool:
        """Whether a write is differentiated (module docstring: Gradient of the write)."""
        return self.grad_through_update and torch.is_grad_enabled()

    def _inputs(self, *ts: Tensor) -> tuple[Tensor, ...]:
        """A write's inputs in the state dtype, detached unless the write is differentiated."""
        sd, keep_graph = self._state_dtype(), self._differentiable()
        return tuple((t if keep_graph else t.detach()).to(sd) for t in ts)

    def _weights(self, keep: Tensor, w: Tensor) -> Tensor:
        """Each pair's weight in the loss: w (its gate, or 1) over the number of pairs in the mean, the
        chunk's (shared) or its sequence's (per sequence: every sequence's fast weights get the gradient of
        its own mean); pairs with a non-finite token (keep = 0) weigh 0."""
        c = torch.where(keep > 0, w, 0)
        return c / (keep.sum(1, keepdim=True) if self.per_sequence else keep.sum()).clamp(min=1)

    def _update(self, q: Tensor, v: Tensor, g: Tensor | None, state: State) -> State:
        """One SGD step on one chunk's pairs: θ' = θ - η ∇_θ mean_{pairs, features} (f(q_t) - v_{t+1})².
        Pairs with a non-finite token are left out of the write and of the mean (module docstring)."""
        # zero non-finite tokens with where (0 × NaN is NaN), then drop their pairs; no branch on
        # the data (no device sync; the meta-device FLOP count runs through it)
        ok, T = finite_tokens(q, v, g), q.shape[1]
        q, v = q.where(ok[..., None], 0), v.where(ok[..., None], 0)
        g = None if g is None else g.where(ok, 0)
        q, tgt, w = chunk_pairs(q, v, g, self.lookahead, self.gate_weighted_loss)
        if self.lookahead and self.lookahead_target == "mean":
            tgt = 0.5 * (v[:, :-1] + tgt)
        if q.shape[1] == 0:  # a one-token chunk has no lookahead pair
            return dict(state)
        keep = (ok[:, : q.shape[1]] & ok[:, T - q.shape[1] :]).to(q.dtype)  # the pair's query and target tokens
        q, tgt, w = self._inputs(q, tgt, w)
        return self._step(q, tgt, self._weights(keep, w if self.gate_weighted_loss else torch.ones_like(w)), state)

    def _step(self, q: Tensor, tgt: Tensor, c: Tensor, state: State) -> State:
        """The SGD step of one chunk: θ' = θ − η ∇_θ Σ_{b,n} c_bn · mean_d (f(q_bn; θ) − tgt_bn)² for the
        pairs q [B, n, D_in], tgt [B, n, D_out] and their weights c [B, n] (`_weights`), clipped with
        ``grad_clip``."""
        state = self._fast(state)
        differentiable = self._differentiable()
        theta = state if differentiable else {k: p.detach() for k, p in state.items()}
        grads = swiglu_grads(q, tgt, c, theta)
        if self.grad_clip:  # the release's FastWeightMLP: each gradient entry clamped to [-1, 1]
            grads = [g.clamp(-1.0, 1.0) for g in grads]
        new = {}
        for k, gr in zip(FAST_KEYS, grads):
            p = state[k] if differentiable else state[k].detach()
            new[k] = p - self.lr * gr
        if not torch.compiler.is_compiling():  # diagnostics stay out of compiled graphs
            self._last_write = (q.detach(), tgt.detach(), {k: t.detach() for k, t in state.items()}, new)
        return new

    def write_state(self, x: Tensor, state: State) -> State:
        """Memorize x chunk by chunk (``chunk_size`` tokens, one SGD step each)."""
        q, v, g = self._project(x)
        C = self.chunk_size
        for s in range(0, x.shape[1], C):
            state = self._update(q[:, s : s + C], v[:, s : s + C], None if g is None else g[:, s : s + C], state)
        return state

    # ---- the pairs adapter (bench/suites/pairs.py): the layer's SGD step (_step) on given pairs ------------
    # One head (H = 1): a key is a query q [D_in] as the shell projects it (no normalisation), a value a
    # target [D_out]; the loss mean_{pairs, features} (f(k) − v)² of App. A, one SGD step per chunk.
    # Neutral (x None):
    #   lr        the layer's lr (η, 0.1 in Table 3), its grad_clip as it is set
    #   gates     none: every pair weighs 1 in its chunk's mean (gate = 1), whatever gate_weighted_loss
    #   chunks    of chunk_size pairs, all of them written (explicit pairs need no lookahead shift)
    #   state     per sequence with per_sequence=True (each sequence's own mean), else one mean over the batch
    # With x: the pair weights are the gates g_t the shell computes from x where gate_weighted_loss, else 1
    # (FwMLP has no other data-dependent step size). The lookahead lives in pair_inputs' values.
    no_pairs = None

    def pair_dims(self) -> tuple[int, int, int]:
        return 1, self.input_dim, self.output_dim

    def pair_inputs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The queries q_t [B, T, 1, D_in] and the targets write(x) trains f(q_t) toward [B, T, 1, D_out]:
        with lookahead the next token's value v_{t+1} ("mean": (v_t + v_{t+1}) / 2, the z-scored values);
        without, v_t. Pairs never straddle a chunk (Sec. 3.4.2), so write(x) writes nothing at a chunk's
        last token: its value here is NaN, and write_pairs leaves a pair with a non-finite key or value
        out of the write and of its chunk's mean, as the layer's write does."""
        q, v, _ = self.io.project(x)
        if not self.lookahead:
            return q.unsqueeze(2), v.unsqueeze(2)
        tgt = torch.cat([v[:, 1:], torch.full_like(v[:, :1], float("nan"))], 1)  # v_{t+1}: none after the last
        if self.lookahead_target == "mean":
            tgt = 0.5 * (v + tgt)
        last = torch.arange(x.shape[1], device=x.device) % self.chunk_size == self.chunk_size - 1
        tgt = tgt.where(~last[None, :, None], float("nan"))  # a chunk's last token: no pair
        return q.unsqueeze(2), tgt.unsqueeze(2)

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """One SGD step per chunk of chunk_size pairs (`_step`, the layer's own), the neutral settings
        above, or with x the gates as pair weights (gate_weighted_loss)."""
        q, tgt = k[:, :, 0], v[:, :, 0]  # [B, n, D_in], [B, n, D_out]
        g = self._project(x)[2] if x is not None and self.gate_weighted_loss else None
        ok = finite_tokens(q, tgt, g)
        q, tgt = q.where(ok[..., None], 0), tgt.where(ok[..., None], 0)
        w = torch.ones(q.shape[:2], dtype=q.dtype, device=q.device) if g is None else g.where(ok, 0)
        state, C = self.state, self.chunk_size
        for s in range(0, q.shape[1], C):
            c = slice(s, s + C)
            qc, tc, wc = self._inputs(q[:, c], tgt[:, c], w[:, c])
            state = self._step(qc, tc, self._weights(ok[:, c].to(qc.dtype), wc), state)
        self.load_state(state)

    def read_keys(self, k: Tensor) -> Tensor:
        """f(k; θ) [B, n, 1, D_out], the fast MLP at the keys (before the gate and the value residual of
        Eq. 33); the state unchanged."""
        state = self._fast(self.state)
        return swiglu(k[:, :, 0].to(state["w_up"].dtype), state).unsqueeze(2)

    # ---- causal mixing: per chunk, read with the memory so far, then write -------------------
    def forward_state(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        """The base definition with the projections computed once for the whole call."""
        q, v, g = self._project(x)
        C, ys = self.chunk_size, []
        for s in range(0, x.shape[1], C):
            qc, vc, gc = q[:, s : s + C], v[:, s : s + C], None if g is None else g[:, s : s + C]
            ys.append(self._read(qc, vc, gc, state))
            state = self._update(qc, vc, gc, state)
        if not ys:
            return self._read(q, v, g, state), state
        return torch.cat(ys, dim=1), state

    # ---- diagnostics ---------------------------------------------------------------------
    @torch.no_grad()
    def stats(self) -> dict:
        """Norms of the fast weights, the mean gate of the last call, and the memorisation MSE
        (plain mean over pairs and features) of the last chunk written, before and after its update."""
        out = super().stats()
        if self._last_gate is not None:
            out["gate/mean"] = self._last_gate
        if self._last_write is not None:
            q, tgt, before, after = self._last_write
            after = {k: t.detach() for k, t in after.items()}
            out["mem_mse/before"] = F.mse_loss(swiglu(q, before), tgt).item()
            out["mem_mse/after"] = F.mse_loss(swiglu(q, after), tgt).item()
        return out

    def reset(self, batch_size: int = 1) -> None:
        self._last_write = None
        super().reset(batch_size)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, fast={self.input_dim}->{self.intermediate_dim}->{self.output_dim}, "
            f"lr={self.lr}, lookahead={self.lookahead}, lookahead_target={self.lookahead_target!r}, "
            f"gating={self.gating}, value_norm={self.value_norm}, "
            f"gate_weighted_loss={self.gate_weighted_loss}, grad_through_update={self.grad_through_update}, "
            f"grad_clip={self.grad_clip}"
        )
