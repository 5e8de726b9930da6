"""LaCT: Large-Chunk Test-Time Training with a fast-weight SwiGLU (FwPKM paper, Sec. 4.1, App. A
"LaCT", Table 3; Zhang et al., "Test-Time Training Done Right", the official ``lact_llm``).

The FwPKM paper's second baseline: "a sliding window attention, a fast-weight SwiGLU MLP, and
a slow-weight SwiGLU MLP in every layer. The fast weights are optimized to minimize a dot
product loss via SGD with momentum or Muon ... LaCT uses data-dependent learning rate and L2
weight normalization" (App. A). In memzoo the baseline is a *layout*, ``"SWA | LaCT@all"``:
the backbone's SWA mixer and SwiGLU FFN are the attention and the slow MLP, and this layer is
the fast-weight part (zoo_configs/paper/lact.yaml). Details the paper leaves open follow the
reference, ``a1600012888/LaCT`` at commit 1f84d47: ``lact_llm/lact_model/layer_lact_swiglu.py``
(cited as ``layer:<line>``) and ``ttt_operation.py::block_causal_lact_swiglu`` (``ttt:<line>``),
with the options the FwPKM authors ran (``LikeACloud7/fast-weight-product-key-memory``
``cfgs/model_config/baseline/l12-lact-c512w2048.json``).

Slow projections (input h_t: the block's RMSNorm'd residual, as ``attn_norm`` feeds the
reference layer). For H heads of size d = D / H (``num_heads``, 4):

    [q; k; v]  = W_qkv h_t                                  layer:292 (no bias; ``qkv_bias``)
    q, k       = RMSNorm(q), RMSNorm(k)                      layer:296, only with ``qk_norm``
    q, k       = q ⊙ s_q + o_q,  k ⊙ s_k + o_k              layer:299 per-channel scale/offset
    q, k, v    = silu(q), silu(k), silu(v)                   layer:403 (``v_silu=False``: v raw)
    q, k       = q / (‖q‖ + 1e-5), k / (‖k‖ + 1e-5)          layer:413 per fast-weight head
    q, k       = RoPE(q, t), RoPE(k, t)                      layer:416 on heads of ``rope_head_dim``
    η^i_t      = softplus(w_η^i·h_t + b_η^i + softplus⁻¹(η₀))   layer:463, i ∈ {0,1,2}, η₀ = 1e-3
    μ_t        = sigmoid(w_μ·h_t + b_μ)                      layer:476 (``use_momentum``)

one learning rate per head *per fast-weight matrix* (the reference's ``lr_dim`` = 1 → 3 per
head, split as lr0, lr1, lr2 → W0, W1, W2, layer:473), and one momentum rate per head.

Fast weights, per head and per sequence: the SwiGLU (ttt:88)

    f(x; W) = W1 (silu(W0 x) ⊙ (W2 x))            W0, W2 ∈ R^{d_h×d}, W1 ∈ R^{d×d_h}, d_h = d·inter_multi

whose *initial* values W⁰ are learned slow parameters (layer:214-220; initialised N(0, 1/d),
N(0, 1/d_h)), or with ``w0_w2_low_rank = r`` the reference's low-rank form
W0⁰ = L R + ½ I (layer:52-107, r = 32 and gain ½ in the FwPKM authors' run).

Read: o_t = f(q_t; W) with the fast weights so far (q_t's own chunk is not yet written).

Write, once per chunk c of C tokens (``chunk_size``; ttt:124-200). The TTT loss is the negative
dot product between the prediction at the key and the value, token-weighted by η:

    L_i(W) = − Σ_{t ∈ c} η^i_t · f(k_t; W) · v_t           (the loss of matrix W_i, i = 0,1,2)
    G_i    = −∇_{W_i} L_i                                   ttt:146-168, written out by hand
    M_i   ← G_i + μ̄_c M_i,   G_i ← M_i                      ttt:170-179, μ̄_c = mean_{t∈c} μ_t
    G_i   ← NewtonSchulz5(G_i)                              ttt:181, ``use_muon`` (memzoo.ops.muon)
    W_i   ← W_i + G_i                                       ttt:193 (SGD step, step size in η)
    W_i   ← W_i / (‖W_i‖_row + 1e-5) · ‖W⁰_i‖_row            ttt:197-200 L2 weight normalisation

Each matrix is moved by the gradient of its own loss L_i (they differ only in the per-token
rates η^i). The row norms are those of the initial (slow) weights W⁰ (the reference takes them
from the weights it is handed at the start of the sequence, ttt:108-110, i.e. W⁰); recomputing
them from the slow parameters keeps a stream split into calls identical to one call.
The momentum buffers M_i start at zero per sequence and are part of the state.

Order: **apply, then update** ("Apply then Update => Shifted Block Causal LaCT", ttt:87;
ttt:139-144 read the chunk's queries with the previous weights, ttt:146-200 then update; the
fused kernel the FwPKM authors ran does the same, ``ttt_operation_fused_kernel.py:150-158``).
This is MemoryLayer's read-then-write (``inclusive = False``): chunk c reads the fast weights written
by chunks < c. The reference never writes the *last* chunk of a call (ttt:124, 202: nothing
would read it); here that write happens and is carried in the state, which changes no output
of the call and lets the next call continue the sequence.

Output (layer:557-570): a per-head RMSNorm (weight shared across heads), optionally a per-head
scale silu(w_s·h_t + b_s) (``learnable_ttt_scale``), heads concatenated, then W_o.
The reference adds this to the sliding-window attention's output before one shared W_o and
shares W_qkv with the attention; as a MemoryLayer beside the backbone's SWA, LaCT has its own
W_qkv and W_o (4·D² parameters more per layer) and adds to the residual after the mixer
(h = h + SWA(norm h); h = h + LaCT(norm h); h = h + FFN(norm h)).

Cost: the chunks run in order, each a read and an update of some 30 ops on [B, H, C, d] tensors
(and twice as many backward). At small chunks these are bound by dispatch, so training on a CPU
(batches of ``COMPILE_TOKENS`` tokens or more, four chunks or more) runs each chunk's read and
update (:func:`lact_chunk`) as one graph compiled by torch.compile: the same ops, fused; one
compile per shape and options (docs/journal/performance.md).

Initialisation (modeling_lact.py ``_init_weights``): every slow linear layer N(0, 0.02²) with
zero bias (the FwPKM authors' ``initializer_range``), qk scale 1 and offset 0; so at the start
η ≈ η₀ = 1e-3, μ ≈ ½ and the output scale silu(≈0) ≈ 0. With ``use_muon`` each of G0, G1, G2
is orthogonalised on its own, as the torch reference does (its fused kernel orthogonalises
[G0; G2] stacked). The reference computes the TTT matmuls in bf16; here they run in the
fast-weight dtype (fp32 or wider), so the update is exact enough to test against autograd.

State (per sequence, ``per_sequence = True``; a new sequence starts from W⁰):
``{"w0": [B, H, d_h, d], "w1": [B, H, d, d_h], "w2": [B, H, d_h, d]}``, plus the momentum
buffers ``"m0", "m1", "m2"`` (``use_momentum``) and ``"pos": [B]`` (long: the position of the
next token, for RoPE; absent when ``rope_head_dim`` is None, the reference's ``ttt_nope``).
The state column (``fast_weight_numel``, the base class's count per sequence) counts all of it,
the RoPE position (one integer) too: the momentum buffers are per-sequence optimiser state that each
chunk's update reads (M_i ← G_i + μ̄ M_i), as many numbers as the fast weights (tests/test_state_count.py).
Fast weights are kept in at least fp32 (the reference's ``fp32_states``); reads are cast back
to the input dtype. Writes are differentiable: the LM loss reaches every slow weight through
the updates (η, μ and k, v train only this way), as in the reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memzoo.modules.norm import RMSNorm
from memzoo.layers.base import Compiled, MemoryLayer, State, state_precision, trains_on_cpu
from memzoo.modules.precision import compute_dtype
from memzoo.ops.inner_loop import silu_grad
from memzoo.ops.muon import newton_schulz5
from memzoo.registration import register_layer
from memzoo.storage import load_transposed

FAST_KEYS = ("w0", "w1", "w2")
MOMENTUM_KEYS = ("m0", "m1", "m2")


def inv_softplus(y: float) -> float:
    """x with softplus(x) = y (the reference's base learning-rate offset)."""
    return y + math.log(-math.expm1(-y))


def rope(x: Tensor, pos: Tensor, head_dim: int, theta: float) -> Tensor:
    """Rotary embedding (rotate-half convention, as the backbone's attention) of x [B, T, D]
    split into heads of ``head_dim``, at per-sequence positions pos [B, T]. Computed in x's dtype
    (at least fp32), so an fp64 layer stays exact."""
    B, T, D = x.shape
    dt = compute_dtype(x)
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=x.device, dtype=dt) / head_dim)
    ang = pos.to(dt)[..., None] * inv_freq  # [B, T, r/2]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, :, None], torch.cat([ang, ang], -1).sin()[:, :, None]
    xh = x.to(dt).view(B, T, D // head_dim, head_dim)
    x1, x2 = xh.chunk(2, dim=-1)
    out = xh * cos + torch.cat([-x2, x1], dim=-1) * sin
    return out.reshape(B, T, D).to(x.dtype)


def swiglu_fast(x: Tensor, w: State) -> Tensor:
    """f(x) = W1 (silu(W0 x) ⊙ (W2 x)) per sequence and head: x [B, H, T, d] -> [B, H, T, d]."""
    h = F.silu(x @ w["w0"].mT) * (x @ w["w2"].mT)
    return h @ w["w1"].mT


def lact_update(
    w: State,
    k: Tensor,
    v: Tensor,
    lr: tuple[Tensor, Tensor, Tensor],
    w_norms: tuple[Tensor, Tensor, Tensor],
    momentum: Tensor | None = None,
    m: State | None = None,
    use_muon: bool = False,
) -> tuple[State, State | None]:
    """One LaCT write of one chunk (the module docstring's update, ttt:146-200).

    w: fast weights {"w0", "w1", "w2"} [B, H, ., .]; k [B, H, C, d]; v [B, H, C, d];
    lr: (η⁰, η¹, η²), each [B, H, C]; w_norms: the target row norms of W0, W1, W2, [H, rows, 1]
    (or broadcastable); momentum: μ̄ [B, H] (None: no momentum) with the buffers m {"m0", ...}.
    Returns the new fast weights and the new momentum buffers (None without momentum).
    """
    w0, w1, w2 = w["w0"], w["w1"], w["w2"]
    g = k @ w0.mT  # [B, H, C, d_h] gate pre-activation
    u = k @ w2.mT  # [B, H, C, d_h]
    sg = F.silu(g)
    hid = sg * u
    dhid = v @ w1  # ∂(v·f)/∂hid  [B, H, C, d_h]
    lr0, lr1, lr2 = (x[..., None] for x in lr)
    # G_i = −∇_{W_i} L_i = Σ_t η^i_t ∂(f(k_t)·v_t)/∂W_i
    G = {
        "w0": (dhid * u * silu_grad(g) * lr0).mT @ k,  # [B, H, d_h, d]
        "w1": (v * lr1).mT @ hid,  # [B, H, d, d_h]
        "w2": (dhid * sg * lr2).mT @ k,  # [B, H, d_h, d]
    }
    new_m = None
    if momentum is not None:
        mu = momentum[..., None, None]
        new_m = {mk: G[wk] + mu * m[mk] for mk, wk in zip(MOMENTUM_KEYS, FAST_KEYS)}
        G = {wk: new_m[mk] for mk, wk in zip(MOMENTUM_KEYS, FAST_KEYS)}
    if use_muon:
        G = {wk: newton_schulz5(G[wk]) for wk in FAST_KEYS}
    new_w = {}
    for wk, n0 in zip(FAST_KEYS, w_norms):
        wn = w[wk] + G[wk]
        new_w[wk] = wn / (wn.norm(dim=-1, keepdim=True) + 1e-5) * n0
    return new_w, new_m


def lact_chunk(
    w: State, q: Tensor | None, k: Tensor, v: Tensor, lr: tuple[Tensor, Tensor, Tensor],
    w_norms: tuple[Tensor, Tensor, Tensor], mu: Tensor | None, m: State | None, use_muon: bool,
) -> tuple[Tensor | None, State, State | None]:
    """One chunk of the causal forward: read f(q; W) at the fast weights so far (None without q),
    then write the chunk (:func:`lact_update`, momentum rate μ̄ = the chunk's mean of mu [B, H, C]).
    Tensors and constants only, so that one compiled graph serves every layer of the same shapes."""
    o = swiglu_fast(q, w) if q is not None else None
    new_w, new_m = lact_update(w, k, v, lr, w_norms, None if mu is None else mu.mean(-1), m, use_muon)
    return o, new_w, new_m


#: the chunk loop when training on a CPU (module docstring: Cost), on calls of this many tokens or more
_compiled_chunk = Compiled(lact_chunk, "lact: the chunk update")
COMPILE_TOKENS = 1024


class LowRankInit(nn.Module):
    """The reference's low-rank initial fast weight W⁰ = L R + ½ I (layer:52-107)."""

    def __init__(self, heads: int, rows: int, cols: int, rank: int, gain: float):
        super().__init__()
        self.left = nn.Parameter(torch.randn(heads, rows, rank) * gain / math.sqrt(rank))
        self.right = nn.Parameter(torch.randn(heads, rank, cols) * gain / math.sqrt(cols))

    def forward(self) -> Tensor:
        eye = torch.eye(self.left.shape[1], self.right.shape[2], device=self.left.device, dtype=self.left.dtype)
        return self.left @ self.right + 0.5 * eye


@register_layer("lact")
class LaCT(MemoryLayer):
    """Large-chunk TTT with a per-head fast-weight SwiGLU; see the module docstring.

    Args:
        d_model: model width D.
        num_heads: fast-weight heads H (the reference's ``num_lact_heads``, 4); head size D / H.
        inter_multi: hidden size of the fast SwiGLU as a multiple of the head size (1).
        chunk_size: tokens per update (2048, the reference's default; 512 in the FwPKM authors'
            best run, App. A). forward reads a chunk, then writes it.
        use_momentum: SGD with momentum (per-chunk rate μ̄ from a projection; True). False: plain SGD.
        use_muon: orthogonalise each update with Newton–Schulz (Muon; False, App. A found SGD +
            momentum better).
        base_lr: η₀, the learning rate at a zero projection (1e-3).
        learnable_ttt_scale: per-head output scale silu(w_s·h + b_s) (True).
        qk_norm: RMSNorm on q, k before the per-channel scale (the reference's ``attn_qk_norm``,
            off in its configs).
        v_silu: silu on v too (the reference's ``qkv_silu`` without ``no_v_silu``). The FwPKM
            authors' run sets ``no_v_silu: true`` (l12-lact-c512w2048.json), i.e. ``v_silu=False``.
        rope_head_dim: RoPE on q, k in heads of this size (64: the attention head size the
            reference borrows); None = no positional encoding (the reference's ``ttt_nope``).
        rope_theta: RoPE base (10000 in the FwPKM authors' config).
        w0_w2_low_rank: rank r of the low-rank initial W0, W2 (None = full; 32 in the FwPKM run).
        fw_init_gain: gain of the low-rank initialisation (0.5).
        qkv_bias: bias on W_qkv (False).
        norm_eps: epsilon of the RMSNorms (q/k, output).
        init_std: std of the slow linear layers' initialisation (0.02, the authors' config).
    """

    family = "regression"

    per_sequence = True
    bench_cost = 1.6

    def __init__(
        self,
        d_model: int,
        num_heads: int = 4,
        inter_multi: float = 1.0,
        chunk_size: int = 2048,
        use_momentum: bool = True,
        use_muon: bool = False,
        base_lr: float = 1e-3,
        learnable_ttt_scale: bool = True,
        qk_norm: bool = False,
        v_silu: bool = True,
        rope_head_dim: int | None = 64,
        rope_theta: float = 10000.0,
        w0_w2_low_rank: int | None = None,
        fw_init_gain: float = 0.5,
        qkv_bias: bool = False,
        norm_eps: float = 1e-5,
        init_std: float = 0.02,
    ):
        super().__init__(d_model)
        if not isinstance(num_heads, int) or num_heads < 1 or d_model % num_heads:
            raise ValueError(f"num_heads must be a positive integer dividing d_model={d_model}, got {num_heads!r}")
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        head = d_model // num_heads
        hidden = int(head * inter_multi)
        if hidden < 1:
            raise ValueError(f"inter_multi={inter_multi!r} gives an empty fast hidden layer (head size {head})")
        if rope_head_dim is not None and (
            not isinstance(rope_head_dim, int) or rope_head_dim < 2 or rope_head_dim % 2 or d_model % rope_head_dim
        ):
            raise ValueError(
                f"rope_head_dim must be an even integer dividing d_model={d_model} (or None for no RoPE), "
                f"got {rope_head_dim!r}"
            )
        if w0_w2_low_rank is not None and (not isinstance(w0_w2_low_rank, int) or w0_w2_low_rank < 1):
            raise ValueError(f"w0_w2_low_rank must be a positive integer or None (full rank), got {w0_w2_low_rank!r}")
        if not base_lr > 0:
            raise ValueError(f"base_lr must be > 0 (softplus rates are positive), got {base_lr!r}")
        for what, v in (("rope_theta", rope_theta), ("norm_eps", norm_eps)):
            if not v > 0:
                raise ValueError(f"{what} must be > 0, got {v!r}")
        if not init_std >= 0:
            raise ValueError(f"init_std must be >= 0, got {init_std!r}")
        self.num_heads, self.head_dim, self.hidden_dim = num_heads, head, hidden
        self.inter_multi = inter_multi
        self.chunk_size = chunk_size
        self.use_momentum, self.use_muon = bool(use_momentum), bool(use_muon)
        self.base_lr = float(base_lr)
        self.qk_norm, self.v_silu = bool(qk_norm), bool(v_silu)
        self.rope_head_dim, self.rope_theta = rope_head_dim, float(rope_theta)
        self.w0_w2_low_rank = w0_w2_low_rank

        # slow projections
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=qkv_bias)
        if self.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(d_model, norm_eps), RMSNorm(d_model, norm_eps)
        # rows q, k (the reference's [d_model, 2] transposed: each row's channels contiguous, which
        # compiled CPU code needs to vectorize; 353 -> 335 ms a standard toy MQAR step, Intel Xeon)
        self.qk_scale = nn.Parameter(torch.ones(2, d_model))
        self.qk_offset = nn.Parameter(torch.zeros(2, d_model))
        self.lr_proj = nn.Linear(d_model, 3 * num_heads)
        self.momentum_proj = nn.Linear(d_model, num_heads) if self.use_momentum else None
        self.ttt_scale_proj = nn.Linear(d_model, num_heads) if learnable_ttt_scale else None
        self.ttt_norm = RMSNorm(head, norm_eps)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        for lin in (self.qkv, self.lr_proj, self.momentum_proj, self.ttt_scale_proj, self.o_proj):
            if lin is not None:
                nn.init.normal_(lin.weight, std=init_std)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)

        # the initial fast weights W⁰ (slow parameters)
        if w0_w2_low_rank is None:
            self.w0 = nn.Parameter(torch.randn(num_heads, hidden, head) / math.sqrt(head))
            self.w2 = nn.Parameter(torch.randn(num_heads, hidden, head) / math.sqrt(head))
        else:
            self.w0 = LowRankInit(num_heads, hidden, head, w0_w2_low_rank, fw_init_gain)
            self.w2 = LowRankInit(num_heads, hidden, head, w0_w2_low_rank, fw_init_gain)
        self.w1 = nn.Parameter(torch.randn(num_heads, head, hidden) / math.sqrt(hidden))
        self._diag: dict = {}

    @property
    def learnable_ttt_scale(self) -> bool:
        return self.ttt_scale_proj is not None

    # ---- state ---------------------------------------------------------------------------
    def _state_dtype(self) -> torch.dtype:
        return compute_dtype(self.w1)

    def initial_weights(self) -> State:
        """W⁰ = the slow parameters, [H, ., .] (composed when low-rank)."""
        get = lambda p: p if isinstance(p, Tensor) else p()  # noqa: E731
        return {"w0": get(self.w0), "w1": self.w1, "w2": get(self.w2)}

    def _row_norms(self) -> tuple[Tensor, Tensor, Tensor]:
        sd = self._state_dtype()
        w = self.initial_weights()
        return tuple(w[k].to(sd).norm(dim=-1, keepdim=True) for k in FAST_KEYS)

    def init_state(self, batch_size: int) -> State:
        """W⁰ for every sequence (a differentiable copy of the slow parameters), zero momentum,
        position 0."""
        sd = self._state_dtype()
        state = {
            k: w.to(sd).unsqueeze(0).expand(batch_size, *w.shape).clone() for k, w in self.initial_weights().items()
        }
        if self.use_momentum:
            for mk, wk in zip(MOMENTUM_KEYS, FAST_KEYS):
                state[mk] = torch.zeros_like(state[wk], requires_grad=False)
        if self.rope_head_dim is not None:
            state["pos"] = torch.zeros(batch_size, dtype=torch.long, device=self.w1.device)
        return state

    def _fast(self, state: State) -> State:
        sd = self._state_dtype()
        return {k: (v.to(sd) if k != "pos" and v.dtype != sd else v) for k, v in state.items()}

    # ---- slow projections ------------------------------------------------------------------
    def project(self, x: Tensor, state: State) -> dict:
        """The fast-weight inputs of every position of x (positions continue from the state):
        q, k, v [B, H, T, d] (state dtype), lr (η⁰, η¹, η²) each [B, H, T], mu [B, H, T] or None,
        scale [B, H, T] or None."""
        B, T, D = x.shape
        H, d = self.num_heads, self.head_dim
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * self.qk_scale[0] + self.qk_offset[0]
        k = k * self.qk_scale[1] + self.qk_offset[1]
        q, k = F.silu(q), F.silu(k)
        if self.v_silu:
            v = F.silu(v)
        heads = lambda t: t.view(B, T, H, d)  # noqa: E731
        q, k = heads(q), heads(k)
        q = (q / (q.norm(dim=-1, keepdim=True) + 1e-5)).reshape(B, T, D)
        k = (k / (k.norm(dim=-1, keepdim=True) + 1e-5)).reshape(B, T, D)
        if self.rope_head_dim is not None:
            pos = state["pos"][:, None] + torch.arange(T, device=x.device)
            q, k = rope(q, pos, self.rope_head_dim, self.rope_theta), rope(k, pos, self.rope_head_dim, self.rope_theta)
        sd = self._state_dtype()
        to_heads = lambda t: t.reshape(B, T, H, d).transpose(1, 2).to(sd)  # noqa: E731  [B, H, T, d]
        lr = F.softplus(self.lr_proj(x).to(sd) + inv_softplus(self.base_lr)).view(B, T, H, 3).permute(3, 0, 2, 1)
        out = {"q": to_heads(q), "k": to_heads(k), "v": to_heads(v), "lr": (lr[0], lr[1], lr[2])}
        out["mu"] = torch.sigmoid(self.momentum_proj(x).to(sd)).transpose(1, 2) if self.use_momentum else None
        out["scale"] = F.silu(self.ttt_scale_proj(x)).transpose(1, 2) if self.ttt_scale_proj is not None else None
        return out

    @staticmethod
    def _chunks(p: dict, C: int) -> list[dict]:
        """p split along time into chunks of C positions (split, not sliced: the backward of a split
        is one concatenation, that of each slice a zero tensor of the whole call written into)."""
        sp = lambda t: [None] * math.ceil(p["q"].shape[2] / C) if t is None else t.split(C, dim=2)  # noqa: E731
        lr = [sp(t) for t in p["lr"]]
        return [{"q": q, "k": k, "v": v, "lr": tuple(r[i] for r in lr), "mu": mu, "scale": sc}
                for i, (q, k, v, mu, sc) in enumerate(zip(*(sp(p[n]) for n in ("q", "k", "v", "mu", "scale"))))]

    # ---- read ------------------------------------------------------------------------------
    def _fast_read(self, p: dict, state: State) -> Tensor:
        """f(q; W) per head, [B, H, T, d], in the fast weights' dtype."""
        with state_precision(p["q"].device):
            return swiglu_fast(p["q"], state)

    def _output(self, o: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
        """y = W_o [scale ⊙ RMSNorm(o)]_heads (layer:557-570), o [B, H, T, d]: per position, so
        applied once to the reads of all chunks."""
        o = self.ttt_norm(o.to(dtype))
        if scale is not None:
            o = o * scale[..., None]
        B, H, T, d = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * d))

    def read_state(self, x: Tensor, state: State) -> Tensor:
        """f(q_t; W) at the current fast weights for every position of x; the state is unchanged."""
        state = self._fast(state)
        p = self.project(x, state)
        return self._output(self._fast_read(p, state), p["scale"], x.dtype)

    # ---- write -----------------------------------------------------------------------------
    def _run(self, x: Tensor, state: State, with_output: bool) -> tuple[Tensor | None, State]:
        """Per chunk of ``chunk_size`` tokens (a last partial chunk too): read with the fast weights
        so far (`with_output`), then update (ttt:87, 139-200); the projections and the output map
        run once for the whole call. Returns (y or None, the new state)."""
        state = self._fast(state)
        p = self.project(x, state)
        if x.shape[1] == 0:
            return (self._output(self._fast_read(p, state), p["scale"], x.dtype) if with_output else None), state
        norms, C, os = self._row_norms(), self.chunk_size, []
        chunks = self._chunks(p, C)
        # compiled when training on a CPU on batches of several chunks (module docstring: Cost)
        compiled = trains_on_cpu(x) and len(chunks) >= 4 and x.shape[0] * x.shape[1] >= COMPILE_TOKENS
        for pc in chunks:
            w = {k: state[k] for k in FAST_KEYS}
            m = {k: state[k] for k in MOMENTUM_KEYS} if self.use_momentum else None
            args = (w, pc["q"] if with_output else None, pc["k"], pc["v"], pc["lr"], norms, pc["mu"], m, self.use_muon)
            with state_precision(x.device):  # in the fast weights' dtype, also under autocast
                out = _compiled_chunk(*args) if compiled and pc["k"].shape[2] == C else None
                o, new_w, new_m = out or lact_chunk(*args)
            os.append(o)
            state = {**state, **new_w, **(new_m or {})}
            if "pos" in state:
                state["pos"] = state["pos"] + pc["k"].shape[2]
        self._note(chunks[-1])
        return (self._output(torch.cat(os, dim=2), p["scale"], x.dtype) if with_output else None), state

    def _note(self, p: dict) -> None:
        """Diagnostics of the last chunk written, kept as tensors (no device sync); stats() reads them."""
        self._diag = {f"lr/{k}": r.detach().mean() for k, r in zip(FAST_KEYS, p["lr"])}
        if p["mu"] is not None:
            self._diag["momentum/mean"] = p["mu"].detach().mean(-1).mean()

    def advance_state(self, state: State, n: int) -> State:
        return {**state, "pos": state["pos"] + n} if "pos" in state else state

    def write_state(self, x: Tensor, state: State) -> State:
        """Memorize x: one update per chunk of ``chunk_size`` tokens (a last partial chunk too)."""
        return self._run(x, state, with_output=False)[1]

    # ---- causal mixing: apply, then update ---------------------------------------------------
    def forward_state(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        """Per chunk: read with the fast weights so far, then update."""
        return self._run(x, state, with_output=True)

    # ---- the pairs adapter (bench/suites/pairs.py): lact_chunk on given k, v ----------------------------
    # A pair is (k, v) as `project` gives them: k unit per head (k / (‖k‖ + 1e-5)) and, with RoPE, rotated
    # to its position (positions from a reset state); the loss −η f(k; W)·v per matrix (the module docstring).
    # Neutral (x None):
    #   lr        η⁰ = η¹ = η² = base_lr for every pair (the softplus rate at a zero projection)
    #   momentum  none: μ̄ = 0 (the buffers, with use_momentum, then hold the chunk's own step, M_i = G_i)
    #   Muon      none: plain SGD steps, whatever use_muon
    #   chunks of the layer's chunk_size; the L2 weight normalisation to ‖W⁰‖'s rows kept (part of the rule)
    # With x: the layer's per-token η⁰, η¹, η², its μ_t (use_momentum) and its use_muon.
    no_pairs = None

    def pair_dims(self) -> tuple[int, int, int]:
        return self.num_heads, self.head_dim, self.head_dim

    def pair_inputs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """k_t, v_t [B, T, H, d] as write(x) takes them from a reset state (RoPE at positions 0..T−1)."""
        p = self.project(x, self.init_state(x.shape[0]))
        return p["k"].transpose(1, 2), p["v"].transpose(1, 2)

    def write_pairs(self, k: Tensor, v: Tensor, x: Tensor | None = None) -> None:
        """One LaCT update per chunk of the n pairs (:func:`lact_chunk` without a read, the layer's op):
        rates, momentum and Muon from x, else the neutral settings above. RoPE's position moves on by n."""
        state, sd = self._fast(self.state), self._state_dtype()
        k, v = (t.to(sd).transpose(1, 2) for t in (k, v))  # [B, H, n, d]
        B, H, n, _ = k.shape
        if x is not None:
            p = self.project(x, state)
            lr, mu, muon = p["lr"], p["mu"], self.use_muon
        else:
            lr = (k.new_full((B, H, n), self.base_lr),) * 3
            mu, muon = (k.new_zeros(B, H, n) if self.use_momentum else None), False
        norms, C = self._row_norms(), self.chunk_size
        for s in range(0, n, C):
            c = slice(s, s + C)
            w = {key: state[key] for key in FAST_KEYS}
            m = {key: state[key] for key in MOMENTUM_KEYS} if self.use_momentum else None
            with state_precision(k.device):
                _, new_w, new_m = lact_chunk(w, None, k[..., c, :], v[..., c, :], tuple(r[..., c] for r in lr), norms,
                                             None if mu is None else mu[..., c], m, muon)
            state = {**state, **new_w, **(new_m or {})}
        if "pos" in state:
            state["pos"] = state["pos"] + n
        self.load_state(state)

    def read_keys(self, k: Tensor) -> Tensor:
        """f(k; W) = W1 (silu(W0 k) ⊙ (W2 k)) per head [B, n, H, d] (the read before its norm and scale);
        the state unchanged."""
        state = self._fast(self.state)
        with state_precision(k.device):
            return swiglu_fast(k.to(self._state_dtype()).transpose(1, 2), state).transpose(1, 2)

    # ---- diagnostics -----------------------------------------------------------------------
    @torch.no_grad()
    def stats(self) -> dict:
        """Norms of the fast weights and momentum buffers, the position, and the mean learning
        rates (per matrix) and momentum rate of the last chunk written."""
        st = self.state
        out = {f"norm/{k}": v.float().norm().item() for k, v in st.items() if k != "pos"}
        w0 = self.initial_weights()
        out.update({f"drift/{k}": (st[k].float() - w0[k].float()).norm().item() for k in FAST_KEYS})
        if "pos" in st:
            out["pos"] = int(st["pos"].max().item()) if st["pos"].numel() else 0
        out.update({k: v.item() for k, v in self._diag.items()})
        return out

    def reset(self, batch_size: int = 1) -> None:
        self._diag = {}
        super().reset(batch_size)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("qk_scale", "qk_offset"):  # [d_model, 2] before
            load_transposed(state_dict, prefix + name, getattr(self, name).shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, heads={self.num_heads}, fast={self.head_dim}->{self.hidden_dim}->"
            f"{self.head_dim}, momentum={self.use_momentum}, muon={self.use_muon}, base_lr={self.base_lr}, "
            f"rope_head_dim={self.rope_head_dim}, w0_w2_low_rank={self.w0_w2_low_rank}"
        )
