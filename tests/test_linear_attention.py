"""Linear attention: the chunked op against the recurrence, and the layer against a naive
explicit per-token loop (M ← λ M + k vᵀ) written from its weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_layer
from memzoo import build_layer, get_layer
from memzoo.layers.linear_attention import LinearAttentionMemory
from memzoo.ops.linear_attention import (
    causal_matmul,
    linear_attention_chunked,
    linear_attention_final_state,
    linear_attention_recurrent,
)

F64 = dict(rtol=1e-9, atol=1e-11)


def _inputs(B=2, T=37, H=3, K=5, V=4, seed=0, dtype=torch.float64, decay=True, state=True, decay_shift=2.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    ld = F.logsigmoid(torch.randn(B, T, H, generator=g, dtype=dtype) + decay_shift) if decay else None
    s0 = torch.randn(B, H, K, V, generator=g, dtype=dtype) if state else None
    return q, k, v, ld, s0


# ---- the op ----------------------------------------------------------------------------------
@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("T,chunk", [(1, 64), (37, 8), (64, 16), (100, 64), (37, 1), (5, 64)])
def test_chunked_equals_recurrent(decay, state, T, chunk):
    q, k, v, ld, s0 = _inputs(T=T, decay=decay, state=state)
    o_ref, s_ref = linear_attention_recurrent(q, k, v, ld, s0)
    o, s = linear_attention_chunked(q, k, v, ld, s0, chunk_size=chunk)
    torch.testing.assert_close(o, o_ref, **F64)
    torch.testing.assert_close(s, s_ref, **F64)
    torch.testing.assert_close(linear_attention_final_state(k, v, ld, s0), s_ref, **F64)


def test_recurrent_is_the_equation():
    """Spot-check the reference itself: S_t = λ_t S_{t-1} + k_t v_tᵀ, o_t = q_tᵀ S_t (inclusive)."""
    q, k, v, ld, s0 = _inputs(B=1, T=3, H=1, K=2, V=2)
    o, s = linear_attention_recurrent(q, k, v, ld, s0)
    S = s0[0, 0]
    for t in range(3):
        S = ld[0, t, 0].exp() * S + torch.outer(k[0, t, 0], v[0, t, 0])
        torch.testing.assert_close(o[0, t, 0], q[0, t, 0] @ S, **F64)
    torch.testing.assert_close(s[0, 0], S, **F64)


@pytest.mark.parametrize("decay", [False, True])
def test_chunked_gradients_match_recurrent(decay):
    args = [a.requires_grad_() if a is not None else None for a in _inputs(T=21, decay=decay)]
    r = torch.randn(2, 21, 3, 4, dtype=torch.float64)
    rs = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    grads = []
    for fn in (linear_attention_recurrent, lambda *a: linear_attention_chunked(*a, chunk_size=8)):
        o, s = fn(*args)
        live = [a for a in args if a is not None]
        grads.append(torch.autograd.grad((o * r).sum() + (s * rs).sum(), live))
    for g_ref, g in zip(*grads):
        torch.testing.assert_close(g, g_ref, **F64)


def test_strong_decay_is_stable_in_float32():
    """Cumulative log decays reach -2000 over the sequence; the chunked form must not overflow."""
    q, k, v, _, s0 = _inputs(T=200, dtype=torch.float32)
    ld = torch.full((2, 200, 3), -10.0)
    o_ref, s_ref = linear_attention_recurrent(q, k, v, ld, s0)
    o, s = linear_attention_chunked(q, k, v, ld, s0, chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(linear_attention_final_state(k, v, ld, s0), s_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("diagonal", [0, -1])
def test_causal_matmul(diagonal):
    """Finite values: exactly the masked matmul. A non-finite value (or a non-finite score above
    the diagonal) reaches only the rows allowed to see it."""
    g = torch.Generator().manual_seed(0)
    A, V = torch.randn(2, 7, 7, generator=g, dtype=torch.float64), torch.randn(2, 7, 3, generator=g, dtype=torch.float64)
    assert torch.equal(causal_matmul(A, V, diagonal), A.tril(diagonal) @ V)
    A[:, 2, 5], V[:, 4, 1] = float("nan"), float("inf")
    out = causal_matmul(A, V, diagonal)
    first = 4 - diagonal  # the first row that sees V's row 4
    torch.testing.assert_close(out[:, :first], (A.tril(diagonal) @ V.nan_to_num(posinf=0))[:, :first], rtol=0, atol=0)
    assert not out[:, first:, 1].isfinite().any()


@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_chunked_is_causal_under_nonfinite_input(decay, bad):
    """A non-finite token at s (mid-chunk) leaves the outputs before s as they were: the causal
    mask selects, it never multiplies a later token by 0 (0 × NaN = NaN)."""
    q, k, v, ld, s0 = _inputs(T=37, decay=decay)
    o_ref, _ = linear_attention_chunked(q, k, v, ld, s0, chunk_size=8)
    s = 13
    for t in (q, k, v):
        t[:, s] = bad
    if decay:
        ld[:, s] = float("nan")
    o, S = linear_attention_chunked(q, k, v, ld, s0, chunk_size=8)
    torch.testing.assert_close(o[:, :s], o_ref[:, :s], **F64)
    assert not o[:, s:].isfinite().all(-1).any() and not S.isfinite().all()


def test_op_dtypes_and_empty_sequence():
    q, k, v, ld, s0 = _inputs(T=9, dtype=torch.bfloat16, state=False)
    o, s = linear_attention_chunked(q, k, v, ld, chunk_size=4)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32  # computed in float32
    o_ref, _ = linear_attention_recurrent(q.float(), k.float(), v.float(), ld.float())
    torch.testing.assert_close(o.float(), o_ref, rtol=2e-2, atol=2e-2)

    q, k, v, ld, s0 = _inputs(T=0)
    for fn in (linear_attention_recurrent, linear_attention_chunked):
        o, s = fn(q, k, v, ld, s0)
        assert o.shape == (2, 0, 3, 4)
        torch.testing.assert_close(s, s0)


def test_op_shape_errors():
    q, k, v, ld, s0 = _inputs()
    with pytest.raises(ValueError, match="q and k"):
        linear_attention_chunked(q[..., :2], k, v)
    with pytest.raises(ValueError, match="log_decay"):
        linear_attention_chunked(q, k, v, ld[:, :3])
    with pytest.raises(ValueError, match="initial_state"):
        linear_attention_recurrent(q, k, v, None, s0[..., :1])
    with pytest.raises(ValueError, match="v must be"):
        linear_attention_final_state(k, v[:, :3])
    with pytest.raises(ValueError, match="chunk_size"):
        linear_attention_chunked(q, k, v, chunk_size=0)


# ---- the layer against a naive per-token loop ---------------------------------------------
CONFIGS = [
    dict(),  # elu+1, normalised (Katharopoulos)
    dict(normalize=False),
    dict(feature_map="identity"),
    dict(feature_map="l2"),
    dict(decay=True),
    dict(feature_map="l2", decay=True, num_heads=2, head_dim=6),
]


def make(D=16, seed=0, **kw) -> LinearAttentionMemory:
    # noise: the decay gate's weight starts at 0; make it data-dependent for the test
    return tiny_layer("linear", seed=seed, noise=0.3, d_model=D, **kw)


def naive(layer: LinearAttentionMemory, x: torch.Tensor, inclusive: bool = True):
    """Explicit loop, one matrix M (and z) per batch element and head, from the layer's weights."""
    B, T, _ = x.shape
    H, K = layer.num_heads, layer.head_dim
    phi = {"elu": lambda u: F.elu(u) + 1, "identity": lambda u: u, "l2": lambda u: u / u.norm(dim=-1, keepdim=True)}[
        layer.feature_map
    ]
    Wq, Wk, Wv, Wo = (m.weight for m in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj))
    M = torch.zeros(B, H, K, K, dtype=x.dtype)
    z = torch.zeros(B, H, K, dtype=x.dtype)
    ys = []
    for t in range(T):
        xt = x[:, t]
        q = phi((xt @ Wq.T).view(B, H, K))
        k = phi((xt @ Wk.T).view(B, H, K))
        v = (xt @ Wv.T).view(B, H, K)
        lam = torch.sigmoid(layer.decay_proj(xt)) if layer.decay else torch.ones(B, H, dtype=x.dtype)
        o_heads = []
        for b in range(B):
            for h in range(H):
                M_new = lam[b, h] * M[b, h] + torch.outer(k[b, h], v[b, h])
                z_new = lam[b, h] * z[b, h] + k[b, h]
                Mr, zr = (M_new, z_new) if inclusive else (M[b, h], z[b, h])
                o = Mr.T @ q[b, h]
                if layer.normalize:
                    o = o / (zr @ q[b, h] + layer.eps)
                o_heads.append(o)
                M[b, h], z[b, h] = M_new, z_new
        ys.append(torch.stack(o_heads).view(B, H * K) @ Wo.T)
    return torch.stack(ys, dim=1), M, z


def naive_read(layer: LinearAttentionMemory, M, z, x):
    """y_t = W_o [Mᵀ φ(q_t) (/ zᵀ φ(q_t) + ε)] with fixed M, z for every position."""
    B, T, _ = x.shape
    H, K = layer.num_heads, layer.head_dim
    q = (x @ layer.q_proj.weight.T).view(B, T, H, K)
    q = {"elu": lambda u: F.elu(u) + 1, "identity": lambda u: u, "l2": lambda u: F.normalize(u, dim=-1)}[
        layer.feature_map
    ](q)
    o = torch.einsum("bhkv,bthk->bthv", M, q)
    if layer.normalize:
        o = o / (torch.einsum("bhk,bthk->bth", z, q)[..., None] + layer.eps)
    return o.reshape(B, T, H * K) @ layer.o_proj.weight.T


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_layer_matches_naive_loop(kw):
    layer = make(**kw)
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    y_ref, M, z = naive(layer, x, inclusive=True)
    layer.parallel_chunk = 4  # several chunks plus a partial one
    layer.reset(2)
    torch.testing.assert_close(layer(x), y_ref, **F64)  # forward is inclusive
    torch.testing.assert_close(layer.state["S"], M, **F64)
    assert ("z" in layer.state) == layer.normalize
    if layer.normalize:
        torch.testing.assert_close(layer.state["z"], z, **F64)

    # write is the same update; read uses the memory so far only (never its own tokens)
    layer.reset(2)
    layer.write(x)
    torch.testing.assert_close(layer.state["S"], M, **F64)
    x2 = torch.randn(2, 7, 16, dtype=torch.float64)
    torch.testing.assert_close(layer.read(x2), naive_read(layer, M, z, x2), **F64)
    torch.testing.assert_close(layer.state["S"], M, **F64)


def test_forward_is_inclusive_read_is_not():
    layer = make()
    x = torch.randn(1, 1, 16, dtype=torch.float64)
    layer.reset(1)
    assert layer.read(x).abs().max() == 0  # empty memory, read does not write x
    assert layer(x).abs().max() > 0  # forward: the token reads its own write


def test_normalised_read_of_one_write_returns_its_value():
    """With qᵀz normalisation and one stored pair, the read is exactly W_o v (up to ε)."""
    layer = make(eps=0.0)
    x = torch.randn(1, 1, 16, dtype=torch.float64)
    layer.reset(1)
    layer.write(x)
    q = torch.randn(1, 5, 16, dtype=torch.float64)
    expected = layer.o_proj(layer.v_proj(x)).expand(1, 5, 16)
    torch.testing.assert_close(layer.read(q), expected, **F64)


def test_options_and_errors():
    assert build_layer("LINEAR", d_model=32).__class__ is LinearAttentionMemory
    assert get_layer("linear").chunk_size is None and get_layer("linear").per_sequence
    assert make().normalize and not make(feature_map="l2").normalize and not make(feature_map="identity").normalize
    assert not make(normalize=False).normalize
    with pytest.raises(ValueError, match="positive feature map"):
        LinearAttentionMemory(16, feature_map="l2", normalize=True)
    with pytest.raises(ValueError, match="unknown feature_map"):
        LinearAttentionMemory(16, feature_map="relu")
    with pytest.raises(ValueError, match="not divisible"):
        LinearAttentionMemory(15, num_heads=4)
    with pytest.raises(ValueError, match="unknown option"):
        build_layer("linear", d_model=16, heads=2)
    layer = LinearAttentionMemory(15, num_heads=4, head_dim=3)
    layer.reset(2)
    assert layer(torch.randn(2, 5, 15)).shape == (2, 5, 15)
    assert layer.state["S"].shape == (2, 4, 3, 3) and layer.state["z"].shape == (2, 4, 3)


def test_decay_option():
    layer = LinearAttentionMemory(16, num_heads=4, decay=True)
    lam0 = torch.sigmoid(layer.decay_proj.bias)
    torch.testing.assert_close(lam0, 1 - 2.0 ** -torch.linspace(5, 9, 4))  # RetNet-like start
    assert (layer.decay_proj.weight == 0).all()
    x = torch.randn(2, 6, 16)
    layer.reset(2)
    layer(x)
    st = layer.stats()
    for h in range(4):
        assert 0 < st[f"decay/mean/head{h}"] < 1
        assert st[f"decay/bias/head{h}"] == pytest.approx(lam0[h].item())
        assert st[f"norm/S/head{h}"] > 0
    assert st["norm/S"] == pytest.approx(sum(st[f"norm/S/head{h}"] ** 2 for h in range(4)) ** 0.5, rel=1e-5)

    # forgetting: a pair written long ago fades under decay, not without it
    for decay in (False, True):
        torch.manual_seed(0)
        layer = LinearAttentionMemory(16, num_heads=2, decay=decay, normalize=False)
        if decay:
            with torch.no_grad():
                layer.decay_proj.bias.fill_(-2.0)  # λ ≈ 0.12
        layer.reset(1)
        layer.write(torch.randn(1, 1, 16))
        n0 = layer.state["S"].norm()
        layer.write(torch.zeros(1, 20, 16))  # zero input: k = φ(0) = 1, v = 0, so only decay acts
        n1 = layer.state["S"].norm()
        assert (n1 < 1e-6 * n0) if decay else torch.isclose(n1, n0)


def test_stats_without_decay():
    layer = LinearAttentionMemory(16, num_heads=2)
    layer.reset(1)
    layer.write(torch.randn(1, 3, 16))
    st = layer.stats()
    assert set(st) == {"norm/S", "norm/z", "norm/S/head0", "norm/S/head1"}


def test_l2_feature_map_memorizes_well():
    """Capacity check beside the shared suite: with L2-normalised keys the trained layer recalls
    8 pairs almost perfectly (the default elu+1 kernel is much blurrier, ~0.44 in the suite)."""
    torch.manual_seed(0)
    D, n, h = 32, 8, 16
    layer = LinearAttentionMemory(D, feature_map="l2")
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)

    def pairs(b):
        keys = F.normalize(torch.randn(b, n, h, generator=g), dim=-1)
        vals = F.normalize(torch.randn(b, n, h, generator=g), dim=-1)
        return torch.cat([keys, vals], -1), torch.cat([keys, torch.zeros_like(vals)], -1), vals

    for _ in range(100):
        xw, xq, vals = pairs(32)
        layer.reset(32)
        layer.write(xw)
        loss = F.mse_loss(layer.read(xq)[..., h:], vals)
        opt.zero_grad()
        loss.backward()
        opt.step()
    xw, xq, vals = pairs(64)
    layer.reset(64)
    layer.write(xw)
    pred = layer.read(xq)[..., h:].detach()
    acc = (torch.einsum("bid,bjd->bij", pred, vals).argmax(-1) == torch.arange(n)).float().mean()
    assert acc > 0.9, acc
