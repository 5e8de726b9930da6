"""The pairs adapter (MemoryLayer.pair_dims / pair_inputs / write_pairs / read_keys) of the layers whose
write rule is gradient steps on a regression loss: TTT-Linear, TTT-MLP, Titans, LaCT, FwMLP.

Three properties per layer (bench/suites/pairs.py drives the adapter; memzoo/layers/base.py defines it):

1. ties to forward: ``write(x)`` and ``write_pairs(*pair_inputs(x), x)`` from a reset state leave fast
   weights that read the same at any keys (the adapter runs the layer's own op with the step sizes and
   gates the layer computes from x);
2. read_keys leaves the state as it was;
3. the closed form of the neutral write: the update each paper states, computed here from the loss
   with ``torch.autograd.grad`` (not with the layer's hand-written gradients), chunk by chunk; and one
   pair written at the neutral settings moves the read at its key toward its value.

Small sizes (d_model 32, heads of 8, B = 2, chunks / mini-batches of 4).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import memzoo.layers  # noqa: F401  (registers the layers)
from memzoo.registry import build_layer

D, B, C = 32, 2, 4

#: the five layers at small sizes (C tokens per chunk / mini-batch)
LAYERS = {
    "ttt_linear": dict(num_heads=2, head_dim=8, mini_batch_size=C),
    "ttt_mlp": dict(num_heads=2, head_dim=8, mini_batch_size=C),
    "titans": dict(num_heads=2, head_dim=8, chunk_size=C),
    "lact": dict(num_heads=4, chunk_size=C, rope_head_dim=8),  # heads of D / H = 8; RoPE on, momentum on
    "fwmlp": dict(input_dim=8, intermediate_dim=16, output_dim=8, chunk_size=C, per_sequence=True),
}
#: options whose write takes other paths, for the tie to forward
VARIANTS = {
    **{n: (n, o) for n, o in LAYERS.items()},
    "lact-muon": ("lact", {**LAYERS["lact"], "use_muon": True}),
    "lact-sgd-nope": ("lact", {**LAYERS["lact"], "use_momentum": False, "rope_head_dim": None}),
    "fwmlp-shared": ("fwmlp", {**LAYERS["fwmlp"], "per_sequence": False}),
    "fwmlp-gated-mean": ("fwmlp", {**LAYERS["fwmlp"], "gate_weighted_loss": True, "lookahead_target": "mean"}),
    "fwmlp-no-lookahead": ("fwmlp", {**LAYERS["fwmlp"], "lookahead": False}),
}


def _layer(name: str, opts: dict, dtype=torch.float32):
    torch.manual_seed(0)
    return build_layer(name, D, **opts).to(dtype)


def _keys(layer, n: int, g: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    """Unit keys per head [B, n, H, K] (the keys' normalisation of TTT's and FwMLP's layers is none:
    unit keys are among those they take)."""
    H, K, _ = layer.pair_dims()
    return F.normalize(torch.randn(B, n, H, K, generator=g, dtype=dtype), dim=-1)


def _values(layer, n: int, g: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    H, _, V = layer.pair_dims()
    return torch.randn(B, n, H, V, generator=g, dtype=dtype) / math.sqrt(V)


def _snapshot(layer) -> dict:
    return {k: v.clone() for k, v in layer.state.items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- 1. ties to forward ------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [2 * C, 2 * C + 3])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_write_pairs_of_pair_inputs_is_write(variant, T):
    """write(x) and write_pairs(*pair_inputs(x), x) from a reset state read alike at random unit keys
    (two whole chunks, and two and a partial one)."""
    name, opts = VARIANTS[variant]
    L = _layer(name, opts)
    g = torch.Generator().manual_seed(1)
    x, kq = torch.randn(B, T, D, generator=g), _keys(L, 5, g)
    with torch.no_grad():
        L.reset(B)
        before = L.read_keys(kq)
        L.write(x)
        a = L.read_keys(kq)
        L.reset(B)
        k, v = L.pair_inputs(x)
        H, K, V = L.pair_dims()
        assert k.shape == (B, T, H, K) and v.shape == (B, T, H, V)
        L.write_pairs(k, v, x)
        b = L.read_keys(kq)
    assert a.shape == (B, 5, H, V)
    assert (a - before).abs().max() > 1e-5  # the write did something
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


# ---- 2. read_keys leaves the state unchanged -------------------------------------------------------------
@pytest.mark.parametrize("name", list(LAYERS))
def test_read_keys_leaves_the_state(name):
    L = _layer(name, LAYERS[name])
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        L.reset(B)
        L.write_pairs(_keys(L, 6, g), _values(L, 6, g))  # a partial chunk pending (TTT's pos = 2)
        before = _snapshot(L)
        r1 = L.read_keys(_keys(L, 5, g))
        assert _same(before, _snapshot(L))
        kq = _keys(L, 3, g)
        torch.testing.assert_close(L.read_keys(kq), L.read_keys(kq), atol=0, rtol=0)
    assert r1.shape[:2] == (B, 5)


# ---- 3. closed forms of the neutral write --------------------------------------------------------------
def _chunked_gd(theta: dict, k: torch.Tensor, v: torch.Tensor, step) -> dict:
    """θ after the pairs k, v [n, ...] in chunks of C: θ ← step(θ, chunk's k, v), every gradient of a chunk
    at the θ it started from."""
    for s in range(0, k.shape[0], C):
        theta = step(theta, k[s : s + C], v[s : s + C])
    return theta


def _grad(loss, theta: dict) -> dict:
    names = list(theta)
    return dict(zip(names, torch.autograd.grad(loss, [theta[n] for n in names])))


def _leaf(theta: dict) -> dict:
    return {n: t.detach().clone().requires_grad_(True) for n, t in theta.items()}


def _ttt_expected(L, k, v, kq):
    """TTT (Sun et al. 2024, "Learning to (Learn at Test Time)", arXiv 2407.04620, Sec. 2.5-2.7): per head,
    mini-batch GD on ℓ(θ; k, v) = ½‖LN(f_res(k; θ)) − (v − k)‖² with every gradient of a mini-batch at its
    first weights, θ_i = θ_0 − c_i η Σ_{j≤i} ∇ℓ(θ_0; k_j, v_j), η = base_lr / d (the neutral lr, gate σ = 1),
    c_i = 1/i at the i-th token of the mini-batch (the layer's c at init); the read f(k) = k + LN(f_res(k; θ))."""
    mlp = L.inner == "mlp"

    def f_res(u, th):
        if mlp:
            return F.gelu(u @ th["W1"] + th["b1"], approximate="tanh") @ th["W2"] + th["b2"]
        return u @ th["W1"] + th["b1"]

    eta, c = L.base_lr / L.head_dim, L.position_factor().detach()
    out = torch.empty(B, kq.shape[1], L.num_heads, L.head_dim, dtype=k.dtype)
    for h in range(L.num_heads):
        gam, bet = L.ln_weight[h, 0].detach(), L.ln_bias[h, 0].detach()
        ln = lambda z: F.layer_norm(z, (L.head_dim,), gam, bet, L.eps)  # noqa: E731

        def step(th, kc, vc):
            th = _leaf(th)
            loss = 0.5 * (ln(f_res(kc, th)) - (vc - kc)).pow(2).sum()
            gr = _grad(loss, th)
            return {n: (th[n] - c[kc.shape[0] - 1] * eta * gr[n]).detach() for n in th}

        for b in range(B):
            th0 = {n: getattr(L, f"{n}_0")[h].detach() for n in (("W1", "b1", "W2", "b2") if mlp else ("W1", "b1"))}
            th = _chunked_gd(th0, k[b, :, h], v[b, :, h], step)
            out[b, :, h] = kq[b, :, h] + ln(f_res(kq[b, :, h], th))
    return out


def _titans_expected(L, k, v, kq):
    """Titans (Behrouz, Zhong & Mirrokni 2025, arXiv 2501.00663, Eq. 12-13 with η_t = 0, α_t = 0, chunked as
    Eq. 16-18): per head, M ← M − θ Σ_{t∈chunk} ∇‖M(k_t) − v_t‖² at the chunk's first M, θ = max_lr / d; the
    read M(k) = k + LN(silu(k W1) W2) (the head's LN weights)."""
    theta = L.max_lr / L.head_dim
    out = torch.empty(B, kq.shape[1], L.num_heads, L.head_dim, dtype=k.dtype)
    for h in range(L.num_heads):
        w, b_ = L.ln_weight[h].detach(), L.ln_bias[h].detach()
        mem = lambda u, M: u + F.layer_norm(F.silu(u @ M["W1"]) @ M["W2"], (L.head_dim,), eps=L.eps) * w + b_  # noqa: E731

        def step(M, kc, vc):
            M = _leaf(M)
            gr = _grad((mem(kc, M) - vc).pow(2).sum(), M)
            return {n: (M[n] - theta * gr[n]).detach() for n in M}

        for b in range(B):
            M = _chunked_gd({"W1": L.W1_0[h].detach(), "W2": L.W2_0[h].detach()}, k[b, :, h], v[b, :, h], step)
            out[b, :, h] = mem(kq[b, :, h], M)
    return out


def _lact_expected(L, k, v, kq):
    """LaCT (Zhang et al. 2025, "Test-Time Training Done Right", the reference's ttt_operation.py:146-200, no
    momentum, no Muon): per head and chunk, W_i ← W_i + η ∇_{W_i} Σ_t f(k_t; W)·v_t, η = base_lr, then each row
    of W_i rescaled to the norm of W⁰_i's row (L2 weight normalisation); f(x) = W1 (silu(W0 x) ⊙ (W2 x))."""
    f = lambda u, W: (F.silu(u @ W["w0"].mT) * (u @ W["w2"].mT)) @ W["w1"].mT  # noqa: E731
    w0 = {n: t.detach() for n, t in L.initial_weights().items()}
    out = torch.empty(B, kq.shape[1], L.num_heads, L.head_dim, dtype=k.dtype)
    for h in range(L.num_heads):
        norms = {n: w0[n][h].norm(dim=-1, keepdim=True) for n in w0}

        def step(W, kc, vc):
            W = _leaf(W)
            gr = _grad((f(kc, W) * vc).sum(), W)
            new = {n: W[n] + L.base_lr * gr[n] for n in W}
            return {n: (w / (w.norm(dim=-1, keepdim=True) + 1e-5) * norms[n]).detach() for n, w in new.items()}

        for b in range(B):
            W = _chunked_gd({n: w0[n][h] for n in w0}, k[b, :, h], v[b, :, h], step)
            out[b, :, h] = f(kq[b, :, h], W)
    return out


def _fwmlp_expected(L, k, v, kq):
    """FwMLP (the FwPKM paper, App. A "FwMLP"): per sequence and chunk, one SGD step θ ← θ − η ∇_θ
    mean_{pairs, features} (f(k; θ) − v)², η = the layer's lr, no gates;
    f(q) = W_down (silu(W_gate q + b_gate) ⊙ (W_up q + b_up)) + b_down."""
    def f(u, t):
        return (F.silu(u @ t["w_gate"].T + t["b_gate"]) * (u @ t["w_up"].T + t["b_up"])) @ t["w_down"].T + t["b_down"]

    def step(th, kc, vc):
        th = _leaf(th)
        gr = _grad((f(kc, th) - vc).pow(2).mean(), th)
        return {n: (th[n] - L.lr * gr[n]).detach() for n in th}

    init = L.init_state(B)
    out = torch.empty(B, kq.shape[1], 1, L.output_dim, dtype=k.dtype)
    for b in range(B):
        th = _chunked_gd({n: t[b] for n, t in init.items()}, k[b, :, 0], v[b, :, 0], step)
        out[b, :, 0] = f(kq[b, :, 0], th)
    return out


EXPECTED = {"ttt_linear": _ttt_expected, "ttt_mlp": _ttt_expected, "titans": _titans_expected,
            "lact": _lact_expected, "fwmlp": _fwmlp_expected}


@pytest.mark.parametrize("n", [1, 2 * C + 1])
@pytest.mark.parametrize("name", list(LAYERS))
def test_neutral_write_is_the_papers_update(name, n):
    """write_pairs(k, v) (x None: the neutral settings) from a reset state leaves the fast weights the
    paper's update gives (each `_*_expected` names its source), in fp64: one pair; two whole chunks and a
    pair more."""
    L = _layer(name, LAYERS[name], torch.float64)
    g = torch.Generator().manual_seed(3)
    k, v, kq = _keys(L, n, g, torch.float64), _values(L, n, g, torch.float64), _keys(L, 5, g, torch.float64)
    kq = torch.cat([k[:, :1], kq], 1)  # the first pair's key among the reads
    L.reset(B)
    with torch.no_grad():
        L.write_pairs(k, v)
        got = L.read_keys(kq)
    torch.testing.assert_close(got, EXPECTED[name](L, k, v, kq), atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("name", list(LAYERS))
def test_one_neutral_pair_moves_the_read_toward_its_value(name):
    """After write_pairs of one pair (neutral) the read at its key is nearer its value in angle, for
    every sequence and head."""
    L = _layer(name, LAYERS[name])
    g = torch.Generator().manual_seed(4)
    k, v = _keys(L, 1, g), _values(L, 1, g)
    with torch.no_grad():
        L.reset(B)
        before = F.cosine_similarity(L.read_keys(k), v, dim=-1)
        L.write_pairs(k, v)
        after = F.cosine_similarity(L.read_keys(k), v, dim=-1)
    assert (after > before).all(), (before, after)


def test_pairs_adapters_are_declared():
    from memzoo.registry import get_layer

    for name in LAYERS:
        assert get_layer(name).no_pairs is None
