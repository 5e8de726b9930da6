"""Titans' neural long-term memory, the LMM as a layer (Behrouz, Zhong & Mirrokni 2025, "Titans:
Learning to Memorize at Test Time", arXiv 2501.00663, Sec. 3.1-3.2), without the MAC / MAG / MAL
architectures around it.

The memory is a network M (an MLP of two layers, per head) trained as the sequence streams to map
keys to values, with the gradient as "surprise" and momentum (Eq. 11-14):

    k_t = L2(silu(conv(W_K x_t))),  v_t = silu(conv(W_V x_t)),  q_t = L2(silu(W_Q x_t))   (Sec. 4.4)
    ℓ(M; x_t) = ‖M(k_t) − v_t‖²                                                          Eq. 12
    S_t = η_t S_{t−1} − θ_t ∇ℓ(M_{t'}; x_t)                                               Eq. 10/13
    M_t = (1 − α_t) M_{t−1} + S_t                                                         Eq. 13
    y_t = W_o (RMSNorm(M*(q_t)) ⊙ σ(W_g x_t))       read without update (Eq. 15), then Sec. 4.4's
                                                    normalisation and gate before the projection

M(x) = x + LN(silu(x W1) W2) (bias-free, hidden `expansion` × d; the paper gives L_M ≥ 2 layers and
neither width nor normalisation: lucidrains/titans-pytorch decides, its MemoryMLP of depth 2 and expansion 4
inside its default ResidualNorm, the MLP's output layer-normed plus the input, as TTT's inner model and
fla's Titans have it; SiLU as the paper's other non-linearities). W1, W2 of every sequence start from learned
slow weights; the LN's affine weights are slow, per head (TTT's). Why the LN and the residual: without them
the inner loop diverged on text (docs/journal/ppl.md, "Titans' inner loop diverged on text").
θ_t = max_lr · σ(w_θ·x_t + b_θ) / d, η_t = σ(w_η·x_t + b_η), α_t = σ(w_α·x_t + b_α), per token and head
("data-dependent", end of Sec. 3.2;
the paper gives no init: η starts near 0.9, α near 0.02, θ at max_lr / 2d). The 1/d is lucidrains'
(its loss averages the squared error over the d features, Eq. 12 sums them): with the sum and no 1/d the
inner loop diverged on the first batch of the recall preset at every outer lr (the momentum multiplies
a step by up to 1/(1 − η) = 10, against the loss's curvature, ~1 at init). The ceiling max_lr / d
grows as heads shrink: with small heads the inner loop can leave its stable range and the memory overflow
within a sequence (docs/journal/toys.md, 2026-12-07 later: head_dim 4).

The parallel form the paper trains with (Sec. 3.2, Eq. 16-18): the sequence is cut into chunks of b
tokens and every gradient of a chunk is taken at the weights M_{t'} the chunk started from; the
momentum and the forgetting are then two first-order linear recurrences with scalar gates, computed
for the whole chunk at once in their closed form (:func:`write_chunk`). A chunk is read with the
memory as it was before the chunk (the MAC's M_{t−1} of the previous segment, Eq. 21; the memory is
"read without update"), then written: a chunk-level read-then-write layer, exact when a sequence is
split on chunk boundaries. The state is M (W1, W2) and the momentum S of both, per sequence, and the
short convolutions' histories. Family: regression loss (gradient steps).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.layers.base import MemoryLayer, State, head_size, state_precision
from memzoo.modules.norm import rms_norm
from memzoo.modules.precision import compute_dtype
from memzoo.ops.inner_loop import layer_norm, layer_norm_backward, mlp_backward, mlp_forward
from memzoo.modules.conv import causal_conv_stream, conv_weights
from memzoo.registration import register_layer

FAST = ("W1", "W2")


# ---- the memory's math, pure functions --------------------------------------------------------
def memory_read(q: Tensor, M: dict, ln: tuple) -> Tensor:
    """M(q) = q + LN(silu(q W1) W2): q [B, H, L, d] -> [B, H, L, d]; ln = (weight, bias, eps) of the LN."""
    return q + layer_norm(mlp_forward(q, M["W1"], None, M["W2"], None, "silu")[0], *ln)[0]


def _loss_grads(k: Tensor, v: Tensor, M: dict, ln: tuple) -> tuple[Tensor, Tensor, Tensor]:
    """For ℓ_t = ‖M(k_t) − v_t‖² at M, every token: (∂ℓ/∂z1, ∂ℓ/∂y, h), z1 = k W1, h = silu(z1), y = h W2."""
    y, z1, h = mlp_forward(k, M["W1"], None, M["W2"], None, "silu")
    out, zhat, rstd = layer_norm(y, *ln)
    dy = layer_norm_backward(2 * (k + out - v), zhat, rstd, ln[0])
    return mlp_backward(dy, z1, M["W2"], "silu"), dy, h


def surprise(k: Tensor, v: Tensor, M: dict, ln: tuple) -> dict:
    """∇ℓ(M; x_t) of ℓ = ‖M(k_t) − v_t‖² for every token t, all at M: W1 [B, H, L, d, h], W2 [B, H, L, h, d]."""
    dz1, dy, h = _loss_grads(k, v, M, ln)
    return {"W1": k[..., :, None] * dz1[..., None, :], "W2": h[..., :, None] * dy[..., None, :]}


def decay_products(g: Tensor) -> Tensor:
    """P[..., t, j] = ∏_{j<i≤t} g_i for j ≤ t (1 on the diagonal), 0 above it: g [..., L] -> [..., L, L].

    A cumprod along i of the [L, L] gates masked to 1 where i ≤ j: no division, no logarithm, so a gate
    exactly 0 or 1 is exact (and so is its gradient: cumprod's backward handles zeros)."""
    L = g.shape[-1]
    i = torch.arange(L, device=g.device)
    after = i[None, :] > i[:, None]  # [j, i]: i > j
    P = torch.where(after, g[..., None, :], torch.ones((), dtype=g.dtype, device=g.device)).cumprod(-1)  # [.., j, t]
    return P.transpose(-1, -2).masked_fill(after, 0)  # [.., t, j]; above the diagonal (j > t): 0


def write_chunk(k: Tensor, v: Tensor, theta: Tensor, eta: Tensor, alpha: Tensor, M: dict, S: dict,
                ln: tuple) -> tuple[dict, dict]:
    """One chunk of L tokens (gates [B, H, L]): the gradients u_t at M (the chunk's start M_0, S_0), then
    S_t = η_t S_{t−1} − θ_t u_t and M_t = (1 − α_t) M_{t−1} + S_t, t = 1..L. Returns (M_L, S_L).

    Both recurrences have scalar coefficients: with a_{tj} = ∏_{j<i≤t} η_i (:func:`decay_products`),
    A_t = ∏_{i≤t} η_i, f_t = ∏_{t<i≤L} (1 − α_i) and F = ∏_{i≤L} (1 − α_i),

        S_t = A_t S_0 − Σ_{j≤t} a_{tj} θ_j u_j
        S_L = A_L S_0 − Σ_j θ_j a_{Lj} u_j
        M_L = F M_0 + Σ_t f_t S_t = F M_0 + (Σ_t f_t A_t) S_0 − Σ_j θ_j (Σ_{t≥j} f_t a_{tj}) u_j

    and, u_j being an outer product (k_j ⊗ ∂ℓ_j/∂z1 for W1, h_j ⊗ ∂ℓ_j/∂y for W2), each Σ_j w_j u_j is
    one matmul, kᵀ (w ⊙ ∂ℓ/∂z1): no per-token gradient is formed. The token loop is the tests' reference."""
    dz1, dy, h = _loss_grads(k, v, M, ln)
    a = decay_products(eta)  # [.., t, j]
    f = decay_products(1 - alpha)[..., -1, :]  # [.., t]: ∏_{t<i≤L} (1 − α_i)
    A = eta[..., :1] * a[..., :, 0]  # [.., t]: ∏_{i≤t} η_i
    sc = lambda c: c[..., None, None]  # noqa: E731  [..] -> [.., 1, 1]
    cS, cM, cF = sc(A[..., -1]), sc((f * A).sum(-1)), sc((1 - alpha[..., 0]) * f[..., 0])  # A_L, Σ f_t A_t, F
    wS = (theta * a[..., -1, :]).unsqueeze(-1)  # [.., j, 1]: θ_j a_{Lj}
    wM = (theta * (f.unsqueeze(-2) @ a).squeeze(-2)).unsqueeze(-1)  # θ_j Σ_t f_t a_{tj}
    newM, newS = {}, {}
    for n, (x, dout) in (("W1", (k, dz1)), ("W2", (h, dy))):
        US, UM = (x.transpose(-1, -2) @ torch.cat((wS * dout, wM * dout), -1)).chunk(2, -1)  # Σ_j w_j x_jᵀ dout_j
        newS[n] = cS * S[n] - US
        newM[n] = cF * M[n] + cM * S[n] - UM
    return newM, newS


@register_layer("titans")
class Titans(MemoryLayer):
    """Titans' neural long-term memory as a layer; see the module docstring.

    Args:
        d_model: model width D.
        num_heads: H heads.
        head_dim: d per head; default D // H.
        chunk_size: b tokens whose gradients are taken at the same weights (16).
        expansion: the memory MLP's hidden size is expansion × d (4).
        max_lr: θ_t's ceiling is max_lr / d (1.0).
        conv_size: short-convolution width on k and v (0 or 1 = none).
        norm_eps: eps of the memory's LayerNorm and the output RMSNorm.
    """

    family = "regression"
    per_sequence = True
    bench_cost = 1.8

    def __init__(self, d_model: int, num_heads: int = 4, head_dim: int | None = None, chunk_size: int = 16,
                 expansion: int = 4, max_lr: float = 1.0, conv_size: int = 4, norm_eps: float = 1e-6):
        super().__init__(d_model)
        head_dim = head_size(d_model, num_heads, head_dim)
        for name, val in (("chunk_size", chunk_size), ("expansion", expansion)):
            if val < 1:
                raise ValueError(f"{name} must be >= 1, got {val}")
        if not max_lr > 0:
            raise ValueError(f"max_lr must be > 0, got {max_lr}")
        if conv_size < 0:
            raise ValueError(f"conv_size must be >= 0 (0 or 1 = no short convolution), got {conv_size}")
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {norm_eps}")
        H, d = num_heads, head_dim
        self.num_heads, self.head_dim, self.chunk_size, self.expansion = H, d, chunk_size, expansion
        self.max_lr, self.conv_size, self.eps = max_lr, conv_size, norm_eps
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, H * d, bias=False) for _ in range(3))
        self.gates = nn.Linear(d_model, 3 * H)  # θ, η, α per head
        with torch.no_grad():
            self.gates.weight.mul_(0.1)
            self.gates.bias.copy_(torch.tensor([0.0, 2.2, -4.0]).repeat_interleave(H))
        if conv_size > 1:
            self.k_conv = nn.Parameter(conv_weights(H * d, conv_size))
            self.v_conv = nn.Parameter(conv_weights(H * d, conv_size))
        self.W1_0 = nn.Parameter(nn.init.xavier_uniform_(torch.empty(H, d, expansion * d)))
        self.W2_0 = nn.Parameter(nn.init.xavier_uniform_(torch.empty(H, expansion * d, d)))
        self.ln_weight = nn.Parameter(torch.ones(H, 1, d))  # the memory's LayerNorm (slow, per head)
        self.ln_bias = nn.Parameter(torch.zeros(H, 1, d))
        self.g_proj = nn.Linear(d_model, H * d, bias=False)
        self.o_norm_weight = nn.Parameter(torch.ones(d))
        self.o_proj = nn.Linear(H * d, d_model, bias=False)

    # ---- state -----------------------------------------------------------------------------------
    def _sdtype(self) -> torch.dtype:
        return compute_dtype(self.W1_0)

    def init_state(self, batch_size: int) -> State:
        """M_0 for every sequence (a differentiable copy of the slow weights), S = 0, empty conv histories."""
        sd, dev = self._sdtype(), self.W1_0.device
        st: State = {}
        for n in FAST:
            w = getattr(self, f"{n}_0").to(sd)
            st[n] = w.unsqueeze(0).expand(batch_size, *w.shape).clone()
            st[f"S{n}"] = torch.zeros_like(st[n]).detach()
        if self.conv_size > 1:
            for n in ("conv_k", "conv_v"):
                st[n] = torch.zeros(batch_size, self.conv_size - 1, self.num_heads * self.head_dim, dtype=sd, device=dev)
        return st

    def _ln(self) -> tuple[Tensor, Tensor, float]:
        sd = self._sdtype()
        return self.ln_weight.to(sd), self.ln_bias.to(sd), self.eps

    # ---- projections -----------------------------------------------------------------------------
    def _heads(self, u: Tensor) -> Tensor:  # [B, T, H·d] -> [B, H, T, d]
        return u.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def _conv(self, name: str, u: Tensor, state: State, new: State) -> Tensor:
        if self.conv_size > 1:
            u, new[f"conv_{name}"] = causal_conv_stream(u, state[f"conv_{name}"], getattr(self, f"{name}_conv"))
        return F.silu(u)

    # ---- read (Eq. 15) ---------------------------------------------------------------------------
    def read_state(self, x: Tensor, state: State) -> Tensor:
        """y_t = W_o (RMSNorm(M(q_t)) ⊙ σ(W_g x_t)), M as the state holds it; x is not written."""
        sd = self._sdtype()
        q = F.normalize(F.silu(self._heads(self.q_proj(x).to(sd))), dim=-1)
        with state_precision(x.device):
            o = memory_read(q, {n: state[n] for n in FAST}, self._ln())
        o = rms_norm(o, self.o_norm_weight, self.eps)
        o = o * torch.sigmoid(self._heads(self.g_proj(x).to(o.dtype)))
        return self.o_proj(o.transpose(1, 2).flatten(-2).to(x.dtype))

    # ---- write (Eq. 12-14, chunked as Eq. 16-18) ----------------------------------------------------
    def _keys_values(self, x: Tensor, state: State, new: State) -> tuple[Tensor, Tensor]:
        """k_t = L2(silu(conv(W_K x_t))), v_t = silu(conv(W_V x_t)): [B, H, T, d]; the convolutions'
        new histories go into `new`."""
        sd = self._sdtype()
        k = F.normalize(self._heads(self._conv("k", self.k_proj(x).to(sd), state, new)), dim=-1)
        v = self._heads(self._conv("v", self.v_proj(x).to(sd), state, new))
        return k, v

    def _gates(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """θ_t = max_lr σ(·) / d, η_t = σ(·), α_t = σ(·): each [B, H, T]."""
        gates = torch.sigmoid(self.gates(x).to(self._sdtype())).unflatten(-1, (3, self.num_heads)).permute(2, 0, 3, 1)
        return self.max_lr * gates[0] / self.head_dim, gates[1], gates[2]

    def _write(self, k: Tensor, v: Tensor, theta: Tensor, eta: Tensor, alpha: Tensor, state: State) -> State:
        """M and S after writing k, v [B, H, T, d] chunk by chunk (:func:`write_chunk`)."""
        M, S = {n: state[n] for n in FAST}, {n: state[f"S{n}"] for n in FAST}
        C = self.chunk_size
        with state_precision(k.device):
            ln = self._ln()
            for s in range(0, k.shape[-2], C):
                c = slice(s, s + C)
                M, S = write_chunk(k[..., c, :], v[..., c, :], theta[..., c], eta[..., c], alpha[..., c], M, S, ln)
        return {**M, **{f"S{n}": S[n] for n in FAST}}

    def write_state(self, x: Tensor, state: State) -> State:
        """Write x chunk by chunk: each chunk's gradients at the memory it found, then the momentum
        and the forgetting over its tokens (in closed form, :func:`write_chunk`)."""
        new: State = {}
        k, v = self._keys_values(x, state, new)
        return {**new, **self._write(k, v, *self._gates(x), state)}

    # ---- the pairs adapter (bench/suites/pairs.py): write_chunk on given k, v ------------------------
    # A pair is (k, v) as _keys_values gives them (k unit per head); the loss ‖M(k) − v‖² (Eq. 12).
    # Neutral (x None):
    #   θ   the ceiling of the layer's θ_t, max_lr / d (σ = 1; the 1/d is the layer's, module docstring)
    #   η   0: no momentum (S_t = −θ ∇ℓ, the surprise of the token alone)
    #   α   0: no forgetting (M_t = M_{t−1} + S_t)
    #   chunks of the layer's chunk_size, gradients at the chunk's start (Eq. 16-18)
    # With x: the layer's data-dependent θ_t, η_t, α_t (_gates(x)). The convolutions' histories are not
    # touched: a pair does not pass through them.
    no_pairs = None

    def pair_dims(self) -> tuple[int, int, int]:
        return self.num_heads, self.head_dim, self.head_dim

    def pair_inputs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """k_t, v_t [B, T, H, d] as write(x) computes them from a reset state (empty convolution histories)."""
        k, v = self._keys_values(x, self.init_state(x.shape[0]), {})
        return k.transpose(1, 2), v.transpose(1, 2)

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """S_t = η_t S_{t−1} − θ_t ∇ℓ(M_{t'}; k_t, v_t), M_t = (1 − α_t) M_{t−1} + S_t, a pair a token in the
        layer's chunks (:func:`write_chunk`); θ, η, α from x, else max_lr / d, 0, 0."""
        state, sd = self.state, self._sdtype()
        k, v = (t.to(sd).transpose(1, 2) for t in (k, v))  # [B, H, n, d]
        if x is not None:
            theta, eta, alpha = self._gates(x)
        else:
            theta, eta = k.new_full(k.shape[:3], self.max_lr / self.head_dim), k.new_zeros(k.shape[:3])
            alpha = eta
        self.load_state({**state, **self._write(k, v, theta, eta, alpha, state)})

    def read_keys(self, k: Tensor) -> Tensor:
        """M(k) = k + LN(silu(k W1) W2) per head [B, n, H, d] (the read before its norm and gate); the state unchanged."""
        state = self.state
        with state_precision(k.device):
            return memory_read(k.to(self._sdtype()).transpose(1, 2), {n: state[n] for n in FAST}, self._ln()).transpose(1, 2)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"expansion={self.expansion}, max_lr={self.max_lr}")
