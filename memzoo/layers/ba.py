"""Ba fast weights (Ba, Hinton, Mnih, Leibo & Ionescu 2016, "Using Fast Weights to Attend to
the Recent Past", arXiv:1610.06258; equation numbers as in the paper).

A recurrent net with hidden state h ∈ R^R keeps, per sequence, a fast weight matrix A ∈ R^{R×R}
that stores its own recent hidden states by a decaying Hebbian outer product (Sec. 3, Eq. 1):

    A(t) = λ A(t−1) + η h(t) h(t)ᵀ                                       A(0) = 0, h(0) = 0

The next hidden state is found by a short "inner loop" of S settling steps: the slow transition
W h(t) + C x(t+1) is held fixed while the fast weights pull the state towards stored states
similar to it (Sec. 3, Eq. 2, with the layer normalization of Sec. 3.1):

    h_0(t+1)     = f(LN[W h(t) + C x(t+1)])                               preliminary vector
    h_{s+1}(t+1) = f(LN[W h(t) + C x(t+1) + A(t) h_s(t+1)])               s = 0 .. S−1
    h(t+1)       = h_S(t+1)

(Eq. 2 writes the input that arrives with step t+1 as x(t); we index it by the step.) By Eq. 3,
A(t) h_s = η Σ_{τ≤t} λ^{t−τ} h(τ) ⟨h(τ), h_s⟩: each settling step is attention to the past
hidden states, weighted by their scalar product with the current one and by the decay. LN has
a learned gain and bias (Ba et al.'s layer normalization); f is ReLU in the paper ("relu") or
"tanh". W is initialised to 0.05·I (the paper's identity-like init for the slow recurrence).

ReLU vs tanh. ReLU states are non-negative, so every stored state has a positive scalar product
with every query and the fast term adds a common direction to each new state: at init on the
retrieval toy (R = 50, η = 0.5) stored states have mean cosine 0.96 with ReLU against 0.15 with
tanh (0.34 with ReLU at η = 0). Retrieval then returns a blend of all stored values, which is
the ~38% plateau at n_pairs = 4 ("which digits occur, not which letter owns each"). A smaller η
shortens the plateau (η = 0.05: ~12k steps instead of ~22k); tanh has none to speak of.

This module writes that update once and uses it in two forms:

- :func:`fast_weight_write` (Eq. 1), :func:`fast_weight_settle` (Eq. 2 + Sec. 3.1) and their
  composition :func:`fast_weight_step`, wrapped with the slow weights W and LN in
  :class:`FastWeightsCell`;
- :class:`BaFastWeights` (registered as ``"ba"``): the cell as a token mixer in the backbone;
- :class:`FastWeightsRNN`: the paper's associative-retrieval network (Sec. 4.1), a 37-token
  embedding as C x(t), the cell, and a softmax classifier on the last hidden state.

The token mixer (``"ba"``). Input x_t ∈ R^D (the raw residual stream), output y_t ∈ R^D:

    x̂_t = RMSNorm(x_t)                         learned gain; the layer's own input norm
    u_t = W h_{t−1} + C x̂_t                     C: Linear(D, R, no bias), init N(0, 1/D); LN supplies the bias
    h_t = settle(A_{t−1}, u_t)                  the inner loop above (S steps)
    A_t = λ A_{t−1} + η h_t h_tᵀ                Eq. 1
    y_t = O h_t                                 O: Linear(R, D, no bias)

i.e. exactly the recurrent net of Eqs. 1-2 run over the token sequence, read out by O. The
input norm and C's init are the one adaptation beyond the paper: its x(t) is one-hot, so C x(t)
is an embedding row with a fixed scale (~1 per unit), while the fast term A h_s has the scale
η·|h|² set by the LN'd hidden states. LN acts on the *sum*, so the ratio of the two decides
whether the stored states are driven by the input or swamped by the memory. RMSNorm + N(0, 1/D)
gives C x̂ the embedding's scale whatever the residual's scale (the block therefore passes the
raw residual: ``prenorm = False``). With nn.Linear's default init on unnormalised inputs the
layer stays at chance in the shared memorization property; with this init it reaches ~0.8. It is
token-recurrent (``chunk_size = None``) with per-sequence state ``{"A": [B, R, R], "h": [B, R]}``
(A_t and h_t of the last token; zeros at reset). The hidden state h is part of the state
because W h_{t−1} is: streaming across calls needs it.

How the MemoryLayer verbs map onto the equations (``inclusive = False``):

- ``read_state(x, state)``: for every position t of x, the hidden state that x_t would produce
  from the stored (A, h): y_t = O settle(A, W h + C x̂_t). Pure: neither A nor h changes, and
  the positions of x do not see each other (each is a query against the memory so far).
- ``write_state(x, state)``: runs the recurrence over x: h_t from (A_{t−1}, h_{t−1}, x_t), then
  Eq. 1, token after token.
- ``forward_state``: per token, read then write — the read of x_t *is* h_t, the hidden state the
  write then stores, so forward computes it once: y_t = O h_t of the recurrence. The fast weights
  used at token t hold h_1..h_{t−1} (the paper's A(t) used for h(t+1)); x_t reaches its own
  output through C x̂_t, not through A.

Cost: per token O(B·R²) for each of the S settling steps. The decayed outer-product write is the
recurrence of :mod:`memzoo.ops.linear_attention` with k = v = h and a constant λ, but h_t depends
non-linearly on A_{t−1} through the inner loop, so there is no parallel (chunked) form over time;
the recurrence runs token by token. :func:`scan` runs it in blocks of ``SCAN_CHUNK`` tokens in the
form of Eq. 3: inside a block a read is the block's starting A plus attention to the block's
states so far, and A is formed once at the block's end, so training keeps an R×R matrix a block for
backward, not a token. Its ~10 small ops a token (and twice as many backward) are bound by
dispatch, so training on a CPU runs each block as one graph compiled by torch.compile (the same
ops, fused; one compile per shape and hyper-parameters, then reused by every layer):
docs/journal/performance.md.
"""

from __future__ import annotations

from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.layers.base import Compiled, MemoryLayer, State, state_precision, trains_on_cpu
from memzoo.modules.precision import compute_dtype
from memzoo.registration import register_layer

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": torch.relu, "tanh": torch.tanh}


# ---- the shared update (Eqs. 1-2, Sec. 3.1) ---------------------------------------------------
def fast_weight_write(A: Tensor, h: Tensor, decay: float, eta: float) -> Tensor:
    """Eq. 1: A ← λ A + η h hᵀ.  A [B, R, R], h [B, R]; returns a new tensor (A is not modified,
    so autograd can reach the previous A)."""
    # one fused kernel (λA + η h hᵀ); ~1.5x faster per step on CPU than three elementwise ops
    return torch.baddbmm(A, h.unsqueeze(-1), h.unsqueeze(-2), beta=decay, alpha=eta)


def _attend(A: Tensor, h: Tensor) -> Tensor:
    """A h for h [B, R] or, for several queries against one A per sequence, [B, T, R]."""
    if h.dim() == A.dim() - 1:
        # multiply-and-sum rather than bmm: a batched matrix-*vector* product (and its backward,
        # an outer product) takes bmm's slow path on CPU; with bmm the whole training step of the
        # retrieval RNN (B = 128, R = 50) ran ~2x slower
        return (A * h.unsqueeze(-2)).sum(-1)
    return h @ A.transpose(-1, -2)  # [B, T, R] @ [B, R, R]: row t is A h_t


def fast_weight_settle(
    A: Tensor, u: Tensor, inner_steps: int, norm: Callable[[Tensor], Tensor], act: Callable[[Tensor], Tensor]
) -> Tensor:
    """The inner loop of Eq. 2 with Sec. 3.1's layer normalization:

        h_0 = f(LN(u)),   h_{s+1} = f(LN(u + A h_s)) for s < S,   returns h_S

    where u = W h(t) + C x(t+1) is the slow pre-activation, held fixed while the state settles.
    A [B, R, R]; u [B, R] (one step) or [B, T, R] (T queries against the same memory).
    ``inner_steps = 0`` is the slow RNN alone (the fast weights are written but never read)."""
    h = act(norm(u))
    for _ in range(inner_steps):
        h = act(norm(u + _attend(A, h)))
    return h


def fast_weight_step(
    A: Tensor,
    u: Tensor,
    *,
    decay: float,
    eta: float,
    inner_steps: int,
    norm: Callable[[Tensor], Tensor],
    act: Callable[[Tensor], Tensor],
) -> tuple[Tensor, Tensor]:
    """One time step: h(t+1) = settle(A(t), u) (Eq. 2), then A(t+1) = λ A(t) + η h(t+1) h(t+1)ᵀ
    (Eq. 1). A [B, R, R], u [B, R] = W h(t) + C x(t+1). Returns (h(t+1), A(t+1))."""
    h = fast_weight_settle(A, u, inner_steps, norm, act)
    return h, fast_weight_write(A, h, decay, eta)


def scan(
    A: Tensor, h: Tensor, cx: Tensor, W: Tensor, gain: Tensor, bias: Tensor, *,
    decay: float, eta: float, inner_steps: int, activation: str, eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The recurrence over the inputs cx [B, T, R] = C x̂ from (A, h): for each t, u = W h + cx_t,
    then :func:`fast_weight_step`. Returns (h_1..h_T [B, T, R], A_T, h_T). Tensors and constants
    only (no module), so that one compiled graph serves every layer of the same shapes.

    Computed in blocks of SCAN_CHUNK tokens in the form of Eq. 3: within a block that starts from
    A_0 the fast weights are never formed token by token; the read after t writes is

        A(t) h = λ^t A_0 h + η Σ_{τ<t} λ^{t−1−τ} h_τ ⟨h_τ, h⟩

    and A is formed once at the block's end, A_T = λ^T A_0 + η Σ_τ λ^{T−1−τ} h_τ h_τᵀ. The same
    numbers as T steps of Eq. 1-2, without writing (and keeping for backward) an R×R matrix a token."""
    act = ACTIVATIONS[activation]

    def norm(u: Tensor) -> Tensor:
        return F.layer_norm(u, (u.shape[-1],), gain, bias, eps)

    out = []
    for s in range(0, cx.shape[1], SCAN_CHUNK):
        n = min(SCAN_CHUNK, cx.shape[1] - s)
        w = eta * decay ** torch.arange(n - 1, -1, -1, dtype=torch.float64)  # η λ^{n−1−τ}
        w = w.to(cx.dtype).to(cx.device)
        hs: list[Tensor] = []
        for t in range(n):
            H = torch.stack(hs, dim=1) if hs else None  # [B, t, R]: the block's states so far

            def fast(q: Tensor, t=t, H=H) -> Tensor:  # A(t) q by Eq. 3
                r = _attend(A, q) * decay**t
                if H is not None:
                    score = torch.bmm(H, q.unsqueeze(-1)).squeeze(-1) * w[n - t :]  # η λ^{t−1−τ} ⟨h_τ, q⟩
                    r = r + torch.bmm(score.unsqueeze(1), H).squeeze(1)
                return r

            u = cx[:, s + t] + F.linear(h, W)
            h = act(norm(u))
            for _ in range(inner_steps):
                h = act(norm(u + fast(h)))
            hs.append(h)
        H = torch.stack(hs, dim=1)
        A = torch.baddbmm(A, (H * w[:, None]).transpose(1, 2), H, beta=decay**n)
        out.append(H)
    return (torch.cat(out, dim=1) if out else cx.new_zeros(cx.shape)), A, h


#: tokens per block of the scan and per compiled graph: 16 compile in well under a minute (32: no faster)
SCAN_CHUNK = 16
_compiled_scan = Compiled(scan, "ba: the recurrence")


def _check_hparams(hidden_size: int, inner_steps: int, decay: float, eta: float, activation: str) -> None:
    if hidden_size < 1:
        raise ValueError(f"hidden_size must be >= 1, got {hidden_size}")
    if inner_steps < 0:
        raise ValueError(f"inner_steps (S) must be >= 0 (0 = no fast-weight read), got {inner_steps}")
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay (λ) must be in [0, 1], got {decay}")
    if not eta >= 0.0:
        raise ValueError(f"eta (η) must be >= 0, got {eta}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of {list(ACTIVATIONS)}")


class FastWeightsCell(nn.Module):
    """The slow weights of Eq. 2 around the shared update: W (R×R, init ``w_init``·I) and the
    layer norm (learned gain and bias), with the fixed λ, η, S and f.

    ``step(A, h, cx)``: one token, cx = C x(t+1) [B, R] -> (h(t+1), A(t+1)).
    ``settle(A, h, cx)``: the hidden state for each of T inputs cx [B, T, R] from the same
    (A, h), without writing (the layer's read)."""

    def __init__(
        self,
        hidden_size: int,
        inner_steps: int = 1,
        decay: float = 0.95,
        eta: float = 0.5,
        activation: str = "relu",
        w_init: float = 0.05,
        ln_eps: float = 1e-5,
    ):
        super().__init__()
        _check_hparams(hidden_size, inner_steps, decay, eta, activation)
        self.hidden_size = hidden_size
        self.inner_steps = int(inner_steps)
        self.decay = float(decay)
        self.eta = float(eta)
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.ln_eps = ln_eps
        self.W = nn.Parameter(w_init * torch.eye(hidden_size))
        self.norm = nn.LayerNorm(hidden_size, eps=ln_eps)

    def _norm(self, u: Tensor) -> Tensor:
        # the state may run in a wider dtype than the parameters (bf16 weights, fp32 fast weights)
        gain, bias = self.norm.weight.to(u.dtype), self.norm.bias.to(u.dtype)
        return F.layer_norm(u, (self.hidden_size,), gain, bias, self.ln_eps)

    def slow(self, h: Tensor, cx: Tensor) -> Tensor:
        """u = W h + C x (h [B, R]; cx [B, R] or [B, T, R], broadcast over T)."""
        wh = F.linear(h, self.W.to(h.dtype))
        return cx.to(h.dtype) + (wh if cx.dim() == h.dim() else wh.unsqueeze(1))

    def step(self, A: Tensor, h: Tensor, cx: Tensor) -> tuple[Tensor, Tensor]:
        return fast_weight_step(
            A,
            self.slow(h, cx),
            decay=self.decay,
            eta=self.eta,
            inner_steps=self.inner_steps,
            norm=self._norm,
            act=self.act,
        )

    def settle(self, A: Tensor, h: Tensor, cx: Tensor) -> Tensor:
        return fast_weight_settle(A, self.slow(h, cx), self.inner_steps, self._norm, self.act)

    def extra_repr(self) -> str:
        return (
            f"R={self.hidden_size}, S={self.inner_steps}, λ={self.decay}, η={self.eta}, "
            f"f={self.activation}"
        )


# ---- form 1: the token mixer ------------------------------------------------------------------
@register_layer("ba")
class BaFastWeights(MemoryLayer):
    """Ba et al.'s fast-weights RNN as a token mixer; see the module docstring for the equations.

    Args:
        d_model: model width D.
        hidden_size: R, the recurrent state (and fast-weight matrix R×R per sequence).
        inner_steps: S, settling steps of the inner loop (Eq. 2); the paper uses 1.
        decay: λ of Eq. 1 (0.95 in the paper's Sec. 4.1).
        eta: η of Eq. 1 (0.5 in the paper). A h scales like η·R·|h_i|²: keep η·R roughly
            fixed when changing R (e.g. η = 0.25 at R = 100). On long sequences A sums up to
            1/(1−λ) stored states, not the toy's ~10: at η = 0.5 the fast term is then ~35x the
            slow drive at init (R = 64, T = 256); the tiny preset uses η = 0.1 (~5x).
        activation: f, "relu" (the paper's) or "tanh" (the default here: with ReLU the layer stays
            at chance in the shared memorization property, and the retrieval toy often plateaus).
        w_init: W is initialised to w_init · I (0.05 in the paper).
    """

    family = "hebbian"

    chunk_size = None
    per_sequence = True
    #: the layer normalises its own input (module docstring), so the block passes the raw residual
    prenorm: ClassVar[bool] = False
    #: forward is per token read-then-write; the read of x_t is the h_t that is then written
    inclusive: ClassVar[bool] = False
    #: no pairs adapter: Eq. 1 is autoassociative. It stores h hᵀ of the layer's own hidden state, which
    #: the inner loop has just settled from A itself (Eq. 2), so key = value = h; a hetero-associative
    #: k vᵀ with a given v is not its rule, and A k at a stored key returns (mostly) k, not a value.
    #: In the paper a binding lives in the hidden state that the slow W and C mix from two tokens.
    no_pairs: ClassVar[str | None] = (
        "autoassociative: A ← λA + η h hᵀ (Eq. 1) stores the outer product of its own settled hidden state "
        "(key = value = h), not k vᵀ of a given pair; probed by writing states h and reading back the inner "
        "loop's settling toward them (Eq. 2), not by key-value pairs")

    def __init__(
        self,
        d_model: int,
        hidden_size: int = 64,
        inner_steps: int = 1,
        decay: float = 0.95,
        eta: float = 0.5,
        activation: str = "tanh",
        w_init: float = 0.05,
    ):
        super().__init__(d_model)
        _check_hparams(hidden_size, inner_steps, decay, eta, activation)  # before building any module
        # the paper's input is one-hot, so C x(t) has a fixed scale; a residual stream has not.
        # Normalising x and drawing C ~ N(0, 1/D) gives C x̂ the per-unit scale of the paper's
        # embedding (~1): that sets the balance between the slow drive and the fast term A h
        self.in_norm = nn.RMSNorm(d_model, eps=1e-6)
        self.in_proj = nn.Linear(d_model, hidden_size, bias=False)  # C
        nn.init.normal_(self.in_proj.weight, std=d_model**-0.5)
        self.cell = FastWeightsCell(hidden_size, inner_steps, decay, eta, activation, w_init)
        self.out_proj = nn.Linear(hidden_size, d_model, bias=False)  # O

    # ---- state ---------------------------------------------------------------------------
    def _state_dtype(self) -> torch.dtype:
        return compute_dtype(self.cell.W)

    def init_state(self, batch_size: int) -> State:
        R, w = self.cell.hidden_size, self.cell.W
        return {
            "A": torch.zeros(batch_size, R, R, dtype=self._state_dtype(), device=w.device),
            "h": torch.zeros(batch_size, R, dtype=self._state_dtype(), device=w.device),
        }

    # ---- read: each position queries the memory so far -----------------------------------
    def read_state(self, x: Tensor, state: State) -> Tensor:
        """y_t = O settle(A, W h + C x̂_t) for every t of x, all against the stored (A, h)."""
        cx = self.in_proj(self.in_norm(x))
        with state_precision(x.device):  # in the state's dtype, as the recurrence
            h = self.cell.settle(state["A"], state["h"], cx)
        return self.out_proj(h.to(x.dtype))

    # ---- write: run the recurrence ---------------------------------------------------------
    @torch.compiler.disable  # a loop over tokens: traced whole, it unrolls into a graph that takes minutes to compile
    def _run(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        cx = self.in_proj(self.in_norm(x))
        A, h, T = state["A"], state["h"], x.shape[1]
        # the recurrence in the state's dtype (>= fp32): under bf16 autocast the write would return
        # A in bf16, and every token's ops would cast
        with state_precision(x.device):
            c, cx = self.cell, cx.to(h.dtype)
            args = (c.W.to(h.dtype), c.norm.weight.to(h.dtype), c.norm.bias.to(h.dtype))
            kw = dict(decay=c.decay, eta=c.eta, inner_steps=c.inner_steps, activation=c.activation, eps=c.ln_eps)
            # compiled in pieces when training on a CPU on sequences of several pieces (module docstring);
            # split, not sliced: the backward of a slice writes into a zero tensor of the whole input
            compiled = trains_on_cpu(x) and T >= 4 * SCAN_CHUNK
            pieces = []
            for part in cx.split(SCAN_CHUNK, dim=1) if compiled else (cx,):
                out = _compiled_scan(A, h, part, *args, **kw) if compiled and part.shape[1] == SCAN_CHUNK else None
                hs, A, h = out or scan(A, h, part, *args, **kw)
                pieces.append(hs)
        return torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0], {"A": A, "h": h}

    def write_state(self, x: Tensor, state: State) -> State:
        """h_t = settle(A_{t−1}, W h_{t−1} + C x̂_t), A_t = λ A_{t−1} + η h_t h_tᵀ, t = 1..T."""
        return self._run(x, state)[1]

    # ---- causal mixing: per token read then write, computed once ---------------------------
    def forward_state(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        hs, state = self._run(x, state)
        return self.out_proj(hs.to(x.dtype)), state

    # ---- diagnostics ---------------------------------------------------------------------
    @torch.no_grad()
    def stats(self) -> dict:
        out = super().stats()
        st = self.state
        out["A/fro_per_seq"] = st["A"].float().flatten(1).norm(dim=1).mean().item()
        out["A/trace_per_seq"] = st["A"].float().diagonal(dim1=-2, dim2=-1).sum(-1).mean().item()
        out["h/norm_per_seq"] = st["h"].float().norm(dim=-1).mean().item()
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, hidden_size={self.cell.hidden_size}"


# ---- form 2: the paper's associative-retrieval network (Sec. 4.1) -----------------------------
class FastWeightsRNN(nn.Module):
    """The fast-weights RNN of Sec. 4.1: tokens -> C x(t) (an embedding: x(t) is one-hot) -> the
    recurrence of Eqs. 1-2 over the sequence -> softmax classifier on the last hidden state.

    ``forward(tokens [B, T]) -> logits [B, n_classes]`` (n_classes = vocab_size = 37 by default:
    the classifier covers the whole vocabulary, as in the paper; the answer is always a digit).
    """

    def __init__(
        self,
        vocab_size: int = 37,
        hidden_size: int = 50,
        inner_steps: int = 1,
        decay: float = 0.95,
        eta: float = 0.5,
        activation: str = "relu",
        w_init: float = 0.05,
        n_classes: int | None = None,
    ):
        super().__init__()
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        _check_hparams(hidden_size, inner_steps, decay, eta, activation)
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, hidden_size)  # C x(t) for a one-hot x(t)
        self.cell = FastWeightsCell(hidden_size, inner_steps, decay, eta, activation, w_init)
        self.classifier = nn.Linear(hidden_size, n_classes or vocab_size)

    def run(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """All hidden states h(1..T) [B, T, R] and the final fast weights A(T) [B, R, R]."""
        if tokens.dim() != 2 or tokens.dtype not in (torch.long, torch.int):
            raise ValueError(
                f"tokens must be integer ids of shape [batch, time], got {tokens.dtype} {tuple(tokens.shape)}"
            )
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            lo, hi = tokens.min().item(), tokens.max().item()
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {lo}..{hi}")
        B, R = tokens.shape[0], self.cell.hidden_size
        cx = self.embed(tokens)
        A = cx.new_zeros(B, R, R)
        h = cx.new_zeros(B, R)
        hs = []
        for t in range(tokens.shape[1]):
            h, A = self.cell.step(A, h, cx[:, t])
            hs.append(h)
        return torch.stack(hs, dim=1), A

    def forward(self, tokens: Tensor) -> Tensor:
        hs, _ = self.run(tokens)
        return self.classifier(hs[:, -1])
