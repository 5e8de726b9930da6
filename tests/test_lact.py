"""LaCT (FwPKM paper App. A; the official lact_llm): the chunk update against an autograd step
of its stated loss (plain SGD, momentum, Muon), the Newton–Schulz orthogonalisation against a
naive loop, apply-then-update order, streaming on chunk boundaries and per-sequence
independence, the paper config's parameter count through `memzoo params`, and the layer inside
a HybridLM training step. All numerics in fp64."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import TINY_LM, layer_options, rand_x, tiny_layer
from memzoo import build_layer
from memzoo.backbone import count_params
from memzoo.backbone.model import HybridLM
from memzoo.config import load_config
from memzoo.layers.lact import FAST_KEYS, MOMENTUM_KEYS, LaCT
from memzoo.ops.muon import NS5_COEFFS, newton_schulz5

D, C = 32, 8
TOL = dict(rtol=1e-9, atol=1e-11)
# every non-default option on, so that streaming covers them all
ALL_ON = {"use_muon": True, "qk_norm": True, "v_silu": False, "w0_w2_low_rank": 4, "inter_multi": 1.5}


def make(seed: int = 0, perturb: bool = True, **kw) -> LaCT:
    return tiny_layer("lact", seed=seed, noise=0.05 if perturb else 0.0, **kw)


def f_manual(x, w0, w1, w2):
    """f(x) = W1 (silu(W0 x) ⊙ (W2 x)), per batch and head, written out."""
    g = x @ w0.mT
    return (g * torch.sigmoid(g) * (x @ w2.mT)) @ w1.mT


def naive_ns5(G: torch.Tensor) -> torch.Tensor:
    """Newton–Schulz, one 2-D matrix at a time: X <- aX + b(XXᵀ)X + c(XXᵀ)²X on the wide side."""
    out = torch.empty_like(G)
    flat_in, flat_out = G.reshape(-1, *G.shape[-2:]), out.view(-1, *G.shape[-2:])
    for i in range(flat_in.shape[0]):
        X = flat_in[i]
        tall = X.shape[0] > X.shape[1]
        if tall:
            X = X.T
        X = X / (torch.linalg.matrix_norm(X) + 1e-7)
        for a, b, c in NS5_COEFFS:
            XXt = X @ X.T
            X = a * X + b * (XXt @ X) + c * (XXt @ XXt @ X)
        flat_out[i] = X.T if tall else X
    return out


def reference_write(layer: LaCT, p: dict, state: dict) -> dict:
    """One chunk written by hand: per matrix W_i, autograd of its stated loss
    L_i = -Σ_t η^i_t f(k_t)·v_t on a copy of the fast weights, the SGD(+momentum) step
    (Muon on the step when enabled), then each row rescaled to the row norm of W⁰."""
    w = {k: state[k].detach().clone().requires_grad_() for k in FAST_KEYS}
    k, v = p["k"].detach(), p["v"].detach()
    grads = []
    with torch.enable_grad():
        for i, key in enumerate(FAST_KEYS):
            fv = (f_manual(k, w["w0"], w["w1"], w["w2"]) * v).sum(-1)  # f(k_t)·v_t   [B, H, C]
            loss = -(p["lr"][i].detach() * fv).sum()
            grads.append(torch.autograd.grad(loss, w[key])[0])
    new = {}
    w_init = {kk: t.detach() for kk, t in layer.initial_weights().items()}
    for key, mkey, g in zip(FAST_KEYS, MOMENTUM_KEYS, grads):
        step = -g  # SGD: W <- W - ∇L (the step size lives in η)
        if layer.use_momentum:
            mu = p["mu"].detach().mean(-1)[..., None, None]  # μ̄ of the chunk, per sequence and head
            step = step + mu * state[mkey]
            new[mkey] = step
        if layer.use_muon:
            step = naive_ns5(step)
        wn = state[key] + step
        row0 = w_init[key].norm(dim=-1, keepdim=True)
        new[key] = wn / (wn.norm(dim=-1, keepdim=True) + 1e-5) * row0
    return new


# ---- (1) the chunk update is an autograd step of its stated loss ------------------------------
@pytest.mark.parametrize(
    "opts",
    [{"use_momentum": False}, {}, {"use_muon": True}, {"use_muon": True, "use_momentum": False}],
    ids=["sgd", "momentum", "momentum+muon", "muon"],
)
def test_update_is_autograd_step_of_dot_product_loss(opts):
    layer = make(**opts)
    x = rand_x(2, 3 * C)
    state = layer.init_state(2)
    p_all = layer.project(x, state)  # positions 0.. for the whole stream
    with torch.no_grad():
        for c in range(3):  # three chunks: the momentum buffers are non-zero from the second on
            pc = layer._chunks(p_all, C)[c]
            want = reference_write(layer, pc, state)
            got = layer.write_state(x[:, c * C : (c + 1) * C], state)
            for key in want:
                torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, k=key, c=c: f"chunk {c} {k}: {m}")
            assert torch.equal(got["pos"], state["pos"] + C)
            state = got
    # the weight normalisation: every row back to its initial norm (up to the 1e-5 in the divisor)
    w_init = layer.initial_weights()
    for key in FAST_KEYS:
        torch.testing.assert_close(
            state[key].norm(dim=-1), w_init[key].detach().norm(dim=-1).expand_as(state[key][..., 0]), rtol=1e-4, atol=0
        )
        assert not torch.allclose(state[key], w_init[key].detach().expand_as(state[key]))


def test_per_matrix_rates_share_one_loss():
    """With η⁰ = η¹ = η² the three steps are the gradient of the single loss -Σ η f(k)·v."""
    layer = make(use_momentum=False)
    with torch.no_grad():
        layer.lr_proj.weight.view(2, 3, D)[:] = layer.lr_proj.weight.view(2, 3, D)[:, :1]
        layer.lr_proj.bias.view(2, 3)[:] = layer.lr_proj.bias.view(2, 3)[:, :1]
    x = rand_x(2, C)
    state = layer.init_state(2)
    p = layer.project(x, state)
    torch.testing.assert_close(p["lr"][0], p["lr"][1], rtol=0, atol=0)
    w = {k: state[k].detach().clone().requires_grad_() for k in FAST_KEYS}
    fv = (f_manual(p["k"].detach(), *(w[k] for k in FAST_KEYS)) * p["v"].detach()).sum(-1)
    loss = -(p["lr"][0].detach() * fv).sum()
    grads = torch.autograd.grad(loss, [w[k] for k in FAST_KEYS])
    got = layer.write_state(x, state)
    for key, g in zip(FAST_KEYS, grads):
        wn = state[key] - g
        want = wn / (wn.norm(dim=-1, keepdim=True) + 1e-5) * layer.initial_weights()[key].norm(dim=-1, keepdim=True)
        torch.testing.assert_close(got[key], want, **TOL)


def test_rates_are_softplus_with_base_lr():
    """η = softplus(W_η h + b + softplus⁻¹(η₀)): a zero projection gives exactly the base rate."""
    layer = make(perturb=False, base_lr=1e-3)
    with torch.no_grad():
        layer.lr_proj.weight.zero_()
        layer.lr_proj.bias.zero_()
    p = layer.project(rand_x(1, C), layer.init_state(1))
    for lr in p["lr"]:
        torch.testing.assert_close(lr, torch.full_like(lr, 1e-3), rtol=1e-12, atol=0)


# ---- (2) Muon: Newton–Schulz ----------------------------------------------------------------
@pytest.mark.parametrize("shape", [(3, 16, 16), (2, 2, 32, 16), (2, 16, 48)])
def test_newton_schulz_matches_naive_and_is_near_orthogonal(shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    X = newton_schulz5(G)
    torch.testing.assert_close(X, naive_ns5(G), rtol=1e-12, atol=1e-12)
    # near-orthogonal: singular values close to 1, and X ≈ U Vᵀ of G = U S Vᵀ
    s = torch.linalg.svdvals(X)
    assert s.min() > 0.9 and s.max() < 1.1, (s.min().item(), s.max().item())
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    polar = U @ Vh
    assert (X - polar).norm() / polar.norm() < 0.05
    small = X.mT @ X if X.shape[-2] >= X.shape[-1] else X @ X.mT
    eye = torch.eye(small.shape[-1], dtype=X.dtype)
    assert (small - eye).abs().max() < 0.15
    # scale invariance (the Frobenius normalisation): Muon discards the step's magnitude
    torch.testing.assert_close(newton_schulz5(7.0 * G), X, rtol=1e-6, atol=1e-8)


def test_newton_schulz_errors():
    with pytest.raises(ValueError, match=r"matrices \[\.\.\., m, n\]"):
        newton_schulz5(torch.randn(5))


# ---- apply, then update ---------------------------------------------------------------------
def test_apply_then_update_order():
    """Chunk c is read with the weights written by chunks < c: its first chunk reads W⁰, a
    token changes nothing else in its own chunk, and changes the next chunks."""
    layer = make()
    x = rand_x(2, 3 * C)
    y = layer.forward_state(x, layer.init_state(2))[0]
    torch.testing.assert_close(y[:, :C], layer.read_state(x[:, :C], layer.init_state(2)), **TOL)
    x2 = x.clone()
    t = C + 3  # a token of the second chunk
    x2[:, t] += 1.0
    y2 = layer.forward_state(x2, layer.init_state(2))[0]
    same = [s for s in range(2 * C) if s != t]
    torch.testing.assert_close(y2[:, same], y[:, same], **TOL)
    assert (y2[:, t] - y[:, t]).abs().max() > 1e-6
    assert (y2[:, 2 * C :] - y[:, 2 * C :]).abs().amax(-1).min() > 1e-9  # every later token sees it


# ---- (3) streaming on chunk boundaries, per-sequence independence -----------------------------
@pytest.mark.parametrize(
    "opts", [{}, ALL_ON, {"rope_head_dim": None, "use_momentum": False}], ids=["default", "all-options", "nope-sgd"]
)
def test_streaming_on_chunk_boundaries(opts):
    layer = make(**opts)
    x = rand_x(3, 5 * C)
    layer.reset(3)
    y_full = layer(x).detach()
    s_full = {k: v.detach().clone() for k, v in layer.state.items()}
    for cuts in ([C], [3 * C], [C, 2 * C, 4 * C], [C, 2 * C, 3 * C, 4 * C]):
        layer.reset(3)
        b = [0, *cuts, 5 * C]
        y = torch.cat([layer(x[:, s:e]) for s, e in zip(b[:-1], b[1:])], dim=1).detach()
        torch.testing.assert_close(y, y_full, **TOL, msg=lambda m, cuts=cuts: f"cuts {cuts}: {m}")
        for k, v in layer.state.items():
            torch.testing.assert_close(v, s_full[k], **TOL, msg=lambda m, k=k: f"state[{k!r}]: {m}")
    if "pos" in s_full:
        assert torch.equal(s_full["pos"], torch.full((3,), 5 * C))
    # a partial last chunk is written too (and a write equals forward's state)
    layer.reset(3)
    layer.write(x[:, : 2 * C + 3])
    ref = layer.init_state(3)
    _, ref = layer.forward_state(x[:, : 2 * C + 3], ref)
    for k, v in layer.state.items():
        torch.testing.assert_close(v, ref[k], **TOL)


def test_sequences_are_independent():
    layer = make(**ALL_ON)
    xa, xb = rand_x(1, 4 * C, seed=3), rand_x(1, 4 * C, seed=4)
    layer.reset(2)
    y = layer(torch.cat([xa, xb])).detach()
    sa = {k: v[:1].detach().clone() for k, v in layer.state.items()}
    layer.reset(1)
    ya = layer(xa).detach()
    torch.testing.assert_close(y[:1], ya, **TOL)
    for k, v in layer.state.items():
        torch.testing.assert_close(v, sa[k], **TOL)
    layer.reset(2)
    y2 = layer(torch.cat([xa, rand_x(1, 4 * C, seed=5)])).detach()
    torch.testing.assert_close(y2[:1], y[:1], **TOL)  # the other sequence changed; this one did not
    # a new sequence starts from W⁰ = the slow parameters, zero momentum, position 0
    layer.reset(2)
    st = layer.state
    for k, w in layer.initial_weights().items():
        assert torch.equal(st[k], w.detach().expand_as(st[k]))
    assert all(torch.equal(st[m], torch.zeros_like(st[m])) for m in MOMENTUM_KEYS)
    assert torch.equal(st["pos"], torch.zeros(2, dtype=torch.long))


def test_initial_fast_weights_are_learned():
    """W⁰ are slow parameters: the LM-side loss reaches them through every read and update."""
    layer = make(w0_w2_low_rank=4)
    names = {n for n, _ in layer.named_parameters()}
    assert {"w1", "w0.left", "w0.right", "w2.left", "w2.right"} <= names
    layer.reset(2)
    (layer(rand_x(2, 3 * C)) * rand_x(2, 3 * C, seed=9)).sum().backward()
    for n in ("w1", "w0.left", "w0.right", "w2.left", "w2.right", "lr_proj.weight", "momentum_proj.weight"):
        assert layer.get_parameter(n).grad.abs().sum() > 0, n
    with torch.no_grad():  # low-rank W⁰ = L R + ½ I
        want = layer.w0.left @ layer.w0.right + 0.5 * torch.eye(16, 16, dtype=torch.float64)
        torch.testing.assert_close(layer.initial_weights()["w0"], want.expand(2, 16, 16), rtol=0, atol=0)


def test_fast_weights_stay_fp32_in_bf16():
    torch.manual_seed(0)
    layer = build_layer("lact", D, **layer_options("lact")).to(torch.bfloat16)
    layer.reset(2)
    y = layer(torch.randn(2, 2 * C, D, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    assert all(layer.state[k].dtype == torch.float32 for k in (*FAST_KEYS, *MOMENTUM_KEYS))


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"num_heads": 3}, "num_heads must be a positive integer dividing d_model=32"),
        ({"chunk_size": 0}, "chunk_size must be a positive integer"),
        ({"rope_head_dim": 12}, "rope_head_dim must be an even integer dividing d_model=32"),
        ({"w0_w2_low_rank": 0}, "w0_w2_low_rank must be a positive integer or None"),
        ({"base_lr": 0.0}, "base_lr must be > 0"),
        ({"no_such": 1}, "unknown option"),
    ],
)
def test_bad_options_raise_clearly(kw, match):
    with pytest.raises(ValueError, match=match):
        build_layer("lact", D, **{**layer_options("lact"), **kw})


def test_stats():
    layer = make()
    layer.reset(2)
    layer(rand_x(2, 2 * C))
    st = layer.stats()
    assert st["pos"] == 2 * C and st["drift/w1"] > 0 and 0 < st["momentum/mean"] < 1
    assert {"lr/w0", "lr/w1", "lr/w2", "norm/w0", "norm/m0"} <= set(st)
    assert layer.fast_weight_numel() == 2 * 3 * 2 * 16 * 16 + 1  # W0-2 and their momentum, 2 heads of 16; pos


# ---- (4) the paper config: `memzoo params` -------------------------------------------------------
def lact_layer_params(d: int, heads: int, inter: float, rank: int | None) -> int:
    """LaCT's slow parameters by formula: W_qkv, W_o, η/μ/scale projections (with bias), qk
    scale/offset, output RMSNorm (head size), W⁰ (low-rank W0/W2 if rank), + the block's RMSNorm."""
    hd = d // heads
    dh = int(hd * inter)
    w02 = 2 * heads * (dh * rank + rank * hd) if rank else 2 * heads * dh * hd
    return 3 * d * d + d * d + (3 * heads + heads + heads) * (d + 1) + 4 * d + hd + w02 + heads * hd * dh + d


def test_paper_config_params(capsys):
    from memzoo.bench.cli import main

    rc = load_config("paper/lact")
    assert rc.model.layout == "SWA | LaCT@all" and rc.model.n_layers == 12 and rc.model.d_model == 768
    assert rc.model.window == 2048 and rc.model.memory["lact"]["chunk_size"] == 512  # App. A: 512C+2048W
    assert "params_m" not in rc.paper  # Table 2 has no LaCT row
    assert main(["params", "zoo_configs/paper/lact.yaml"]) == 0
    out = capsys.readouterr().out
    n = count_params(rc.model)
    assert f"{n / 1e6:.2f}" in out and "SWA | LaCT@all" in out
    swa_only = count_params(dataclasses.replace(rc.model, layout="SWA", memory={}))
    assert n - swa_only == 12 * lact_layer_params(768, 4, 1.0, 32)
    print(f"paper/lact: {n:,} parameters ({n / 1e6:.2f} M); SWA backbone alone {swa_only:,}")


def test_tiny_config_builds():
    rc = load_config("tiny/swa-lact")
    model = HybridLM(rc.model)
    assert len(model.memories()) == rc.model.n_layers and all(isinstance(m, LaCT) for m in model.memories())
    assert count_params(rc.model) - count_params(dataclasses.replace(rc.model, layout="SWA", memory={})) == 4 * lact_layer_params(
        128, 4, 1.0, None
    )


# ---- (5) in the backbone ----------------------------------------------------------------------
def tiny_model() -> HybridLM:
    torch.manual_seed(0)
    return HybridLM.from_layout("SWA | LaCT@all", **TINY_LM, memory={"lact": layer_options("lact")})


def test_training_on_a_cpu_runs_the_chunks_compiled():
    """With gradients on, on a CPU, a call of COMPILE_TOKENS tokens or more and four chunks or more
    runs each chunk compiled (module docstring: Cost): the outputs, the state and the gradients of
    the same sequence run eager, in calls of two chunks (LaCT streams exactly on chunk boundaries)."""
    from memzoo.layers import lact

    layer = make()
    B, T = 4, lact.COMPILE_TOKENS // 4 + 3 * C  # a last partial chunk (eager) after the compiled ones
    x = rand_x(B, T, seed=4).requires_grad_()
    layer.reset(B)
    y = layer(x)
    assert lact._compiled_chunk.compiled not in (None, False)  # the compiled path ran
    state = {k: v.detach() for k, v in layer.state.items()}
    (gx,) = torch.autograd.grad((y * torch.cos(y)).sum(), x)

    xr = x.detach().requires_grad_()
    layer.reset(B)
    yr = torch.cat([layer(xr[:, s : s + 2 * C]) for s in range(0, T, 2 * C)], dim=1)
    (gr,) = torch.autograd.grad((yr * torch.cos(yr)).sum(), xr)
    torch.testing.assert_close(y, yr, **TOL)
    torch.testing.assert_close(gx, gr, **TOL)
    for k, v in layer.state.items():
        torch.testing.assert_close(state[k], v.detach(), **TOL, msg=lambda m, k=k: f"state[{k!r}]: {m}")


def test_hybrid_training_step():
    model = tiny_model().train()
    assert [type(m).__name__ for m in model.memories()] == ["LaCT", "LaCT"]
    ids = torch.randint(0, 50, (2, 3 * C), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        out = model(ids[:, :-1], targets=ids[:, 1:])
        opt.zero_grad()
        out.loss.backward()
        for n, p in model.named_parameters():
            if ".mems." in n:
                assert p.grad is not None and torch.isfinite(p.grad).all(), n
        opt.step()
        losses.append(out.loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    fast = {id(t) for m in model.memories() for t in m.state.values()}
    assert not fast & {id(p) for p in model.parameters()}


def test_hybrid_streaming_with_cache():
    """A sequence fed in two calls (split on a LaCT chunk boundary) gives the logits of one call:
    fast weights, momentum and RoPE positions carry over."""
    model = tiny_model().double().eval()
    ids = torch.randint(0, 50, (2, 4 * C), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        a = model(ids[:, : 2 * C], use_cache=True)
        b = model(ids[:, 2 * C :], cache=a.cache)
    torch.testing.assert_close(torch.cat([a.logits, b.logits], dim=1), full, rtol=1e-9, atol=1e-9)
