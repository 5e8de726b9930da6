"""TTT-Linear (Sun, Li, Dalal, Xu, Vikram, Zhang, Dubois, Chen, Wang, Koyejo, Hashimoto & Guestrin
2024, "Learning to (Learn at Test Time): RNNs with Expressive Hidden States", arXiv 2407.04620).

The hidden state is a model, and the update rule a step of self-supervised learning (Sec. 2). Per
head, with the views (Sec. 2.3) k_t = θ_K x_t, v_t = θ_V x_t, q_t = θ_Q x_t:

    f(x; W)  = x + LN(x W + b)                                      the inner model (Sec. 2.7: LN and residual)
    ℓ_t(W)   = ½ ‖LN(k_t W + b) − (v_t − k_t)‖²                      the self-supervised loss (Eq. 4)
    W_t      = W_{t'} − c_t Σ_{s=t'+1..t} lr_s ∇ℓ_s(W_{t'})          mini-batch GD, b = 16 (Sec. 2.5)
    z_t      = f(q_t; W_t)                                           the output rule (Eq. 5)
    y_t      = W_o LayerNorm(z_t)                                    the release's post-norm, then o_proj

t' is the start of t's mini-batch: every gradient of a mini-batch is taken at the weights it began
with, and the dual form (Sec. 2.6) computes all of its outputs with matmuls
(:mod:`memzoo.ops.ttt`). The learnable inner learning rate (Sec. 2.7, as the release computes it):
lr_s = base_lr · σ(θ_lr · x_s + b_lr) / d per head, and c_t = max(0, 1/(i+1) + ε_i) for t at place i
of its mini-batch, ε learned from 0. W_0 and b_0 (the weights every sequence starts from), θ_lr, ε
and the inner LN are slow weights; Linear weights start as the release's, N(0, 0.02).

Where this layer departs from the release (test-time-training/ttt-lm-pytorch), and why:

- **No RoPE on q and k.** The release rotates them by their place in the mini-batch (positions
  restart every 16 tokens), so a key matches its query differently by where each falls in its
  mini-batch; the backbone gives positions (its mixers), as it does to every memory here.
- **One sequence, one stream.** A call's last partial mini-batch is continued by the next call
  rather than run as a mini-batch of its own (:mod:`memzoo.ops.ttt`, "Streaming"): the outputs of
  one call are the release's; split calls give what one call gives.

The layer is token-recurrent and inclusive (token t reads with the gradient of its own loss
included): its state is the current mini-batch's W_0, the sums G of its tokens' scaled gradients and
their count `pos`, so it streams exactly at any split. Family: regression loss (gradient steps).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from memzoo.layers.base import MemoryLayer, State, head_size, state_precision
from memzoo.modules.precision import compute_dtype
from memzoo.ops.inner_loop import layer_norm
from memzoo.ops.ttt import KEYS, effective, f_res, ttt_scan
from memzoo.registration import register_layer


@torch.compiler.disable
def _place(pos: Tensor) -> int:
    """The place in its mini-batch the next token takes (the state's `pos`, the same for every
    sequence): a Python int, since the mini-batches' boundaries shape the computation. Outside any
    compiled graph (one break there, rather than a graph per value)."""
    return int(pos[0]) if pos.numel() else 0


def _normal(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) * 0.02)


@register_layer("ttt_linear")
class TTTLinear(MemoryLayer):
    """TTT-Linear as a memory layer; see the module docstring.

    Args:
        d_model: model width D.
        num_heads: H heads.
        head_dim: d per head; default D // H.
        mini_batch_size: b tokens per inner step (16).
        base_lr: η_base of the inner learning rate (1.0 for TTT-Linear, the release's).
        norm_eps: eps of the inner LN and the post-norm (1e-6).
    """

    family = "regression"
    chunk_size = None
    per_sequence = True
    #: token t reads with its own gradient included (W_t)
    inclusive: ClassVar[bool] = True
    bench_cost = 1.6
    #: the inner model: "linear" (x W + b) or "mlp" (TTT-MLP)
    inner: ClassVar[str] = "linear"
    act: ClassVar[str | None] = None

    def __init__(self, d_model: int, num_heads: int = 4, head_dim: int | None = None, mini_batch_size: int = 16,
                 base_lr: float = 1.0, norm_eps: float = 1e-6):
        super().__init__(d_model)
        head_dim = head_size(d_model, num_heads, head_dim)
        if mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be >= 1, got {mini_batch_size}")
        if not base_lr > 0:
            raise ValueError(f"base_lr must be > 0, got {base_lr}")
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {norm_eps}")
        H, d = num_heads, head_dim
        self.num_heads, self.head_dim, self.mini_batch_size = H, d, mini_batch_size
        self.base_lr, self.eps = base_lr, norm_eps
        # the views θ_K, θ_V, θ_Q and the output
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, H * d, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(H * d, d_model, bias=False)
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(lin.weight, std=0.02)
        self.post_norm = nn.LayerNorm(H * d, eps=norm_eps)
        # the inner learning rate: lr_s = base_lr σ(θ_lr x_s + b_lr) / d, and c_i = max(0, 1/(i+1) + ε_i)
        self.lr_weight = _normal(H, d_model)
        self.lr_bias = nn.Parameter(torch.zeros(H))
        self.token_idx_offset = nn.Parameter(torch.zeros(mini_batch_size))
        # the inner model's LN and its initial weights W_0 (slow: every sequence starts from them)
        self.ln_weight = nn.Parameter(torch.ones(H, 1, d))
        self.ln_bias = nn.Parameter(torch.zeros(H, 1, d))
        for name, shape in self.inner_shapes().items():
            setattr(self, f"{name}_0", _normal(H, *shape) if name.startswith("W") else nn.Parameter(torch.zeros(H, *shape)))

    def inner_shapes(self) -> dict[str, tuple[int, int]]:
        d = self.head_dim
        return {"W1": (d, d), "b1": (1, d)}

    # ---- the inner learning rate ---------------------------------------------------------------
    def position_factor(self) -> Tensor:
        """c_i = max(0, 1/(i+1) + ε_i) for the b places of a mini-batch."""
        i = torch.arange(1, self.mini_batch_size + 1, device=self.token_idx_offset.device)
        return (1.0 / i + self.token_idx_offset).clamp(min=0)

    def inner_lr(self, x: Tensor) -> Tensor:
        """lr_s = base_lr σ(θ_lr x_s + b_lr) / d: [B, H, T]."""
        return self.base_lr * torch.sigmoid(x @ self.lr_weight.t() + self.lr_bias).transpose(1, 2) / self.head_dim

    # ---- state -----------------------------------------------------------------------------------
    def _sdtype(self) -> torch.dtype:
        return compute_dtype(self.W1_0)

    def init_state(self, batch_size: int) -> State:
        """W_0 for every sequence (a differentiable copy of the slow weights), G = 0, pos = 0."""
        sd = self._sdtype()
        st: State = {}
        for n in KEYS[self.inner]:
            w = getattr(self, f"{n}_0").to(sd)
            st[n] = w.unsqueeze(0).expand(batch_size, *w.shape).clone()
            st[f"G{n}"] = torch.zeros_like(st[n]).detach()
        st["pos"] = torch.zeros(batch_size, dtype=torch.long, device=self.W1_0.device)
        return st

    def meta_scalar(self, x: Tensor) -> int:
        """While FLOPs are counted on meta: the place in its mini-batch a call starts at (`int(pos)`),
        0 for a new sequence."""
        return 0

    def _split(self, state: State) -> tuple[dict, dict, int]:
        keys = KEYS[self.inner]
        return {n: state[n] for n in keys}, {n: state[f"G{n}"] for n in keys}, _place(state["pos"])

    def _join(self, fast: dict, acc: dict, pos: int, like: Tensor) -> State:
        st = {**fast, **{f"G{n}": a for n, a in acc.items()}}
        st["pos"] = torch.full_like(like, pos)
        return st

    # ---- views and output ------------------------------------------------------------------------
    def _views(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v [B, H, T, d] in the state's dtype."""
        sd = self._sdtype()
        return tuple(p(x).to(sd).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
                     for p in (self.q_proj, self.k_proj, self.v_proj))

    def _output(self, z: Tensor, x: Tensor) -> Tensor:
        """y = W_o LayerNorm(z) over the heads' concatenation."""
        return self.o_proj(self.post_norm(z.transpose(1, 2).flatten(-2).to(x.dtype)))

    def _ln(self) -> tuple[Tensor, Tensor]:
        sd = self._sdtype()
        return self.ln_weight.to(sd), self.ln_bias.to(sd)

    # ---- the MemoryLayer verbs -------------------------------------------------------------------
    def _inner(self, u: Tensor, state: State) -> Tensor:
        """f(u; W) = u + LN(f_res(u; W)) for u [B, H, T, d], W = W_0 − c_pos G: the weights the last
        token written reads."""
        fast, acc, pos = self._split(state)
        with state_precision(u.device):
            c = self.position_factor().to(u.dtype)[pos - 1] if pos > 0 else 0.0
            w = effective(fast, acc, c)
            ln_w, ln_b = self._ln()
            return u + layer_norm(f_res(u, w, self.act), ln_w, ln_b, self.eps)[0]

    def read_state(self, x: Tensor, state: State) -> Tensor:
        """z = f(q; W_0 − c_pos G) with the weights the last token written reads; x is not written."""
        q, _, _ = self._views(x)
        return self._output(self._inner(q, state), x)

    def _scan(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        fast, acc, pos = self._split(state)
        q, k, v = self._views(x)
        with state_precision(x.device):
            ln_w, ln_b = self._ln()
            zq, fast, acc, pos = ttt_scan(q, k, v, self.inner_lr(x.to(q.dtype)), self.position_factor().to(q.dtype),
                                          fast, acc, pos, ln_w, ln_b, eps=self.eps, act=self.act)
            z = q + layer_norm(zq, ln_w, ln_b, self.eps)[0]  # f(q; W_t) = q + LN(f_res(q; W_t))
        return z, self._join(fast, acc, pos, state["pos"])

    def write_state(self, x: Tensor, state: State) -> State:
        return self._scan(x, state)[1]

    def forward_state(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        z, new = self._scan(x, state)
        return self._output(z, x), new

    # ---- the pairs adapter (bench/suites/pairs.py): the layer's mini-batch GD (ttt_scan) on given k, v ----
    # A pair is (k, v) as the views give them (no normalisation of k); the loss is the layer's own,
    # ½‖LN(f_res(k; W)) − (v − k)‖², so the read f(k; W) = k + LN(f_res(k; W)) is what is trained toward v.
    # Neutral (x None):
    #   inner lr   lr_s = base_lr · σ(·) / d with the gate at its maximum, σ = 1: base_lr / d for every pair
    #   c_i        the layer's own position factor max(0, 1/(i+1) + ε_i) (a slow weight, not computed from x)
    #   batching   mini-batches of the layer's mini_batch_size, continuing the one the state is in
    #   inner LN   as the layer applies it (its learned γ, β, eps), inside the loss and the read
    # With x: lr_s = base_lr · σ(θ_lr x_s + b_lr) / d, the layer's inner_lr(x).
    no_pairs: ClassVar[str | None] = None

    def pair_dims(self) -> tuple[int, int, int]:
        return self.num_heads, self.head_dim, self.head_dim

    def pair_inputs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The views k_t = θ_K x_t and v_t = θ_V x_t, [B, T, H, d] (the loss's target is v_t − k_t)."""
        _, k, v = self._views(x)
        return k.transpose(1, 2), v.transpose(1, 2)

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """Mini-batch GD on ½‖LN(f_res(k; W)) − (v − k)‖² a pair a token (:func:`memzoo.ops.ttt.ttt_scan`,
        the layer's op), lr from x or base_lr / d (the neutral settings above)."""
        state = self.state
        fast, acc, pos = self._split(state)
        sd = self._sdtype()
        k, v = (t.to(sd).transpose(1, 2) for t in (k, v))  # [B, H, n, d]
        with state_precision(k.device):
            lr = self.inner_lr(x.to(sd)) if x is not None else k.new_full(k.shape[:3], self.base_lr / self.head_dim)
            ln_w, ln_b = self._ln()
            # the queries are the keys: ttt_scan's outputs are not used, only the weights it leaves
            _, fast, acc, pos = ttt_scan(k, k, v, lr, self.position_factor().to(sd), fast, acc, pos, ln_w, ln_b,
                                         eps=self.eps, act=self.act)
        self.load_state(self._join(fast, acc, pos, state["pos"]))

    def read_keys(self, k: Tensor) -> Tensor:
        """f(k; W) = k + LN(f_res(k; W)) per head [B, n, H, d], W the weights the last pair written reads
        (W_0 − c_pos G, as `read`): the inner model's reconstruction of v at k; the state unchanged."""
        return self._inner(k.to(self._sdtype()).transpose(1, 2), self.state).transpose(1, 2)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"mini_batch_size={self.mini_batch_size}, base_lr={self.base_lr}")
