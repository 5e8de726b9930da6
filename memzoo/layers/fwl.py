"""Fast Weight Layers (Clark et al. 2022, "Meta-Learning Fast Weight Language Models").

An FWL sits on top of the last layer of a language model. Its slow function (Sec. 2)

    f_θ(h) = LayerNorm(ReLU²(h U + a) W + b)         θ = {U, a, W, b, g, β}   (g, β: LayerNorm)

is evaluated twice. The *slow pass* runs f_θ and the model's output head over the sequence
and backpropagates every position's own next-token loss (Sec. 2, unnumbered)

    L_t = CE(softmax(head(f_θ(h_t))), x_{t+1})

to get T per-position gradients ∇_θ L_t in one backward pass (L_t depends on h_t only, the
head being position-wise). The *fast pass* re-runs f at every position t with the weights
that SGD on the losses of the previous positions would give,

    θ'_t = θ - α ∘ Σ_{i<t} ∇_θ L_i                   one learned step size per matrix / vector

(Sec. 2: "θ' ← θ' − α ∘ ∇θ L_t"; the gradients are all taken at the slow weights θ, which is
what makes them computable in parallel; true dynamic evaluation would take them at θ'_t.)
Nothing is stored per position but output gradients, by Eqs. 1-2: a weight gradient is an
outer product ∇_W L_i = v_iᵀ ∇_{o_i} L_i, so for o = v W

    o'_t = v'_t (W - α_W Σ_{i<t} ∇_W L_i)                                            (Eq. 1)
         = v'_t W - α_W Σ_{i<t} (v'_t · v_i) ∇_{o_i} L_i                             (Eq. 2)

causal linear attention with queries v'_t (fast-pass activations), keys v_i (slow-pass
activations) and values ∇_{o_i} L_i. Here for both matrices (v = h for U: the input is the
same in both passes; v = ReLU²(·) for W), and for the vectors a, b, g, β by an exclusive
cumulative sum of their per-position gradients (Sec. 2, "Computing fast weights for vectors
(e.g. biases or LayerNorm weights) ... using the cumsum operation"). All six of θ are fast,
as in the reference release (google-research/fwl, tf/fwl.py: kernel/bias step sizes for each
dense layer, alpha/beta step sizes for the LayerNorm; step sizes are raw learned scalars).
Position t never uses the loss of position t or later (strictly causal; the reference's
exclusive cumsum / strict causal mask).

Segments (Sec. 3, the Transformer-XL variant). The running update ΔΘ of previous segments is
carried as the layer's state and decays by a learned γ per matrix / vector:

    o'_t = v'_t (W - α_W ΔW - α_W Σ_{S≤i<t} ∇_W L_i)
    ΔW  ← γ_W ΔW + Σ_{S≤i≤T} ∇_W L_i                 (γ = sigmoid(learned logit))

A segment is a chunk of ``chunk_size`` tokens (the class attribute the MemoryLayer interface
uses to say where splits stream exactly): a call of several chunks equals calls chunk by chunk.
With ``chunk_size`` ≥ the sequence length (the default 512 for typical training sequences)
the layer is the paper's plain FWL, Eq. 2 over the whole sequence. The paper's "stopgrad"
on ΔW is the backbone's ``detach_state()`` at call boundaries (as Transformer-XL stops the
gradient at its segment boundary); within one call the chunks stay differentiable. The
paper writes the sum as Σ_{i=S}^{t}; we use i < t as Eq. 1 does, so t never sees its own target.

Training computes second-order gradients through the gradient updates ("We compute
second-order gradients for the FWL parameters, backpropagating through ∇θ L_t"): the
per-position gradients are built with ``create_graph`` whenever autograd records.

Where it sits and what it needs (``needs_targets``, ``needs_head``, ``site = "after_ffn"``). The slow
pass needs the next-token targets and the LM head. In a :class:`~memzoo.backbone.HybridLM`,
"... | FWL" places the layer on top of the last block (``default_where = "last"``, after that
block's FFN) and the backbone calls ``forward(x, targets=targets, head=head)`` with
``x = RMSNorm(h)`` and ``head(y) = E · RMSNorm_final(h + y)``: the LM logits if the layer's
output y is added to the residual h, i.e. softmax over the vocabulary through the final norm
and the tied output embedding. The FWL output *augments* the last layer's output: h ← h +
f_θ'(x), then the usual final norm and tied head (the paper feeds f_θ'(h) itself into the
softmax; in a pre-norm residual stream the residual form keeps the backbone's own prediction
and the FWL adds its gradient-adapted correction). Used alone, ``head`` defaults to the
identity: the output y [B, T, D] is read as logits over D classes (targets in [0, D)).

MemoryLayer verbs (targets/head as above; ``targets`` [B, T] int, -100 = ignore):

- ``forward(x, targets, head)``: the fast pass, per chunk Eq. 2 + carried ΔΘ; then ΔΘ is
  updated. Without targets (generation) there is no loss: the layer reads with the gradients
  it already has (the carried ΔΘ) and writes nothing.
- ``read(x)``: f with θ - α ∘ ΔΘ at every position (no within-call updates); pure.
- ``write(x, targets, head)``: adds the chunks' gradients to ΔΘ (with the decay). Without
  targets there is nothing to write (a no-op). Writes are not iterative: the gradients are
  taken at the slow weights, so writing the same data twice adds the same update twice.

State (per sequence): the running update ΔΘ, ``{"dU": [B, D, H], "da": [B, H], "dW": [B, H, D],
"db": [B, D], "dg": [B, D], "dbeta": [B, D]}``; the fast weights are θ - α ∘ ΔΘ. Kept in at
least fp32.

The math (the slow pass, the fast pass of Eq. 2, the update of ΔΘ) is the pure functions of
:mod:`memzoo.ops.fwl`; this class holds θ, α and γ, checks the targets and runs the chunks.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from memzoo.layers.base import MemoryLayer, State
from memzoo.modules.precision import compute_dtype
from memzoo.ops import fwl as ops
from memzoo.ops.fwl import FAST, Head
from memzoo.registration import register_layer


@register_layer("fwl")
class FWL(MemoryLayer):
    """Fast Weight Layer; see the module docstring for the equations.

    Args:
        d_model: model width D (input and output).
        expansion: hidden width H = expansion · D (4 in the reference release).
        chunk_size: segment length of the Transformer-XL variant (Sec. 3): the carried update
            decays once per chunk; within a chunk Eq. 2 is exact.
        step_size: initial value of the six learned step sizes α. The paper's L_t is a
            per-token loss; the reference's 0.01 multiplies a loss averaged over all B·T tokens
            of a batch, so its per-token step is ~0.01/(B·T). 1e-3 keeps the fast term a
            modest correction at initialisation.
        decay: initial value of the six learned decays γ (Sec. 3's γ_W; sigmoid-parametrised).
        eps: LayerNorm epsilon.
    """

    family = "regression"

    per_sequence = True
    needs_targets: ClassVar[bool] = True
    #: forward also takes `head`: y [B, T, D] -> LM logits [B, T, V] (position-wise)
    needs_head: ClassVar[bool] = True
    #: the block runs the layer on its output, after its FFN ("on top of the last layer")
    site = "after_ffn"
    #: "GDN+SWA | FWL" puts it on the last layer
    default_where: ClassVar[str] = "last"
    bench_cost = 1.6
    #: no pairs adapter: Eq. 2 is linear attention with keys v_i, but its values are the loss gradients
    #: ∇_{o_i} L_i (through the LM head, ReLU² and LayerNorm), which a target decides, not a given vector
    no_pairs: ClassVar[str | None] = (
        "the write is the gradient of the next-token loss at its outputs (Eqs. 1-2: keys v_i, values the "
        "output gradients through its head), not a given key-value pair; it could be probed by targets chosen "
        "as one-hot pairs through its head (write(keys, targets=value ids), read at the keys)")

    def __init__(
        self,
        d_model: int,
        expansion: int = 4,
        chunk_size: int = 512,
        step_size: float = 1e-3,
        decay: float = 0.9,
        eps: float = 1e-5,
    ):
        super().__init__(d_model)
        if expansion < 1:
            raise ValueError(f"expansion must be >= 1, got {expansion}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1) (it is sigmoid-parametrised), got {decay}")
        if not step_size >= 0:
            raise ValueError(f"step_size must be >= 0, got {step_size}")
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        self.hidden = H = expansion * d_model
        self.chunk_size = int(chunk_size)
        self.eps = eps
        # slow weights θ of f (Sec. 2)
        self.U = nn.Parameter(torch.randn(d_model, H) / math.sqrt(d_model))
        self.a = nn.Parameter(torch.zeros(H))
        self.W = nn.Parameter(torch.randn(H, d_model) / math.sqrt(H))
        self.b = nn.Parameter(torch.zeros(d_model))
        self.g = nn.Parameter(torch.ones(d_model))  # LayerNorm gain
        self.beta = nn.Parameter(torch.zeros(d_model))  # LayerNorm bias
        # learned step sizes α and decays γ = sigmoid(decay_logit), one per entry of FAST
        self.step_size = nn.Parameter(torch.full((len(FAST),), float(step_size)))
        self.decay_logit = nn.Parameter(torch.full((len(FAST),), math.log(decay / (1.0 - decay))))

    # ---- state ------------------------------------------------------------------------------
    def _state_dtype(self) -> torch.dtype:
        return compute_dtype(self.U)

    def init_state(self, batch_size: int) -> State:
        D, H = self.d_model, self.hidden
        kw = dict(dtype=self._state_dtype(), device=self.U.device)
        shapes = {"dU": (D, H), "da": (H,), "dW": (H, D), "db": (D,), "dg": (D,), "dbeta": (D,)}
        return {k: torch.zeros(batch_size, *s, **kw) for k, s in shapes.items()}

    # ---- the slow pass: f_θ, the per-position losses L_t and their gradients (memzoo.ops.fwl) ----
    def _theta(self) -> dict[str, Tensor]:
        return {n: getattr(self, n) for n in FAST}

    def _slow_pass(self, x: Tensor, targets: Tensor, head: Head | None) -> dict[str, Tensor]:
        return ops.slow_pass(self._theta(), x, targets, head, self.eps)

    def _check_targets(self, x: Tensor, targets: Tensor, head: Head | None) -> None:
        if targets.shape != x.shape[:2]:
            raise ValueError(
                f"FWL: targets must have shape [batch, time] = {tuple(x.shape[:2])}, got {tuple(targets.shape)}"
            )
        if targets.is_floating_point() or targets.dtype == torch.bool:
            raise TypeError(f"FWL: targets must be integer class ids (-100 = ignore), got {targets.dtype}")
        if head is None and targets.numel() and int(targets.max()) >= self.d_model:
            raise ValueError(
                f"FWL got targets up to {int(targets.max())} but no head: alone it reads its output as logits over "
                f"d_model={self.d_model} classes. Pass head=(y -> logits), or use it in a HybridLM ('... | FWL')"
            )

    # ---- step sizes α and decays γ -----------------------------------------------------------
    def _alpha_gamma(self, dtype: torch.dtype) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        alpha = dict(zip(FAST, self.step_size.to(dtype).unbind()))
        gamma = dict(zip(FAST, torch.sigmoid(self.decay_logit).to(dtype).unbind()))
        return alpha, gamma

    # ---- the functional core: Eq. 2 with the carried update (memzoo.ops.fwl) ----------------
    def read_state(self, x: Tensor, state: State) -> Tensor:
        """f with the fast weights θ - α ∘ ΔΘ at every position; no within-call updates."""
        alpha, _ = self._alpha_gamma(state["dU"].dtype)
        return ops.fast(self._theta(), x, state, None, alpha, self.eps).to(x.dtype)

    def _chunks(self, x: Tensor, slow: dict[str, Tensor]):
        C = self.chunk_size
        for s in range(0, x.shape[1], C):
            yield s, {k: v[:, s : s + C] for k, v in slow.items()}

    def write_state(self, x: Tensor, state: State, targets: Tensor | None = None, head: Head | None = None) -> State:
        """Add the per-position gradients of x's losses to ΔΘ, chunk by chunk with the decay.
        Without targets there is no loss and nothing to write."""
        if targets is None or x.shape[1] == 0:
            return state
        self._check_targets(x, targets, head)
        _, gamma = self._alpha_gamma(state["dU"].dtype)
        slow = self._slow_pass(x, targets, head)
        for _, sc in self._chunks(x, slow):
            state = ops.accumulate(state, sc, gamma)
        return state

    def forward_state(
        self, x: Tensor, state: State, targets: Tensor | None = None, head: Head | None = None
    ) -> tuple[Tensor, State]:
        """Per chunk: Eq. 2 (causal within the chunk) on top of the carried ΔΘ, then ΔΘ ← γΔΘ + Σ∇.
        Without targets: a read (the gradients the layer already has), state unchanged."""
        if targets is None or x.shape[1] == 0:
            return self.read_state(x, state), state
        self._check_targets(x, targets, head)
        alpha, gamma = self._alpha_gamma(state["dU"].dtype)
        slow = self._slow_pass(x, targets, head)  # one slow pass for the whole call (position-wise)
        ys = []
        for s, sc in self._chunks(x, slow):
            ys.append(ops.fast(self._theta(), x[:, s : s + self.chunk_size], state, sc, alpha, self.eps))
            state = ops.accumulate(state, sc, gamma)
        return torch.cat(ys, dim=1).to(x.dtype), state

    # ---- the stateful shell (targets and head pass through) ---------------------------------
    def forward(self, x: Tensor, targets: Tensor | None = None, head: Head | None = None) -> Tensor:
        y, self._state = self.forward_state(x, self._current(x), targets=targets, head=head)
        return y

    def write(self, x: Tensor, targets: Tensor | None = None, head: Head | None = None) -> None:
        """Memorize the losses of x's positions (needs targets; without them a no-op)."""
        self._state = self.write_state(x, self._current(x), targets=targets, head=head)

    # ---- diagnostics ------------------------------------------------------------------------
    @torch.no_grad()
    def stats(self) -> dict:
        out = super().stats()
        alpha, gamma = self._alpha_gamma(torch.float32)
        for n in FAST:
            out[f"step_size/{n}"] = alpha[n].item()
            out[f"decay/{n}"] = gamma[n].item()
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, hidden={self.hidden}"
