"""Tests for memzoo.ops.gated_delta_rule: the chunked torch reference against fla's naive
references (forward, final state, gradients), against our own token loop, streaming
equivalence, and backend dispatch."""

import sys

import pytest
import torch
import torch.nn.functional as F

from memzoo.ops.gated_delta_rule import (
    gated_delta_rule,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)

fla_naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
naive_recurrent = fla_naive.naive_recurrent_gated_delta_rule  # (q, k, v, beta, g, ...)
naive_chunk = fla_naive.naive_chunk_gated_delta_rule          # (q, k, v, g, beta, chunk_size, ...)

ATOL = 1e-5


def make_inputs(B, T, H, K, V, dtype=torch.float32, seed=0, with_h0=True, requires_grad=False):
    """Realistic inputs: L2-normalised q/k, small log-decays, beta = sigmoid."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q = F.normalize(r(B, T, H, K), dim=-1)
    k = F.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, H, V)
    g = F.logsigmoid(r(B, T, H) + 2.0)              # in (-inf, 0), mostly small: -0.13 typical
    beta = torch.sigmoid(r(B, T, H))
    h0 = r(B, H, K, V) if with_h0 else None
    out = [q, k, v, g, beta, h0]
    out = [None if x is None else x.to(dtype).requires_grad_(requires_grad) for x in out]
    return out


def slice_t(xs, a, b):
    q, k, v, g, beta = xs
    return q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b]


# (B, T, H, K, V, chunk_size): multiples, ragged tails, T < chunk, V != K, chunk of 1
SHAPES = [
    (2, 64, 2, 16, 16, 16),
    (2, 37, 2, 16, 24, 16),
    (1, 100, 2, 16, 16, 64),
    (2, 5, 2, 16, 16, 64),
    (1, 20, 2, 8, 32, 1),
]


# ----------------------------------------------------------------------------- forward vs fla


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("B,T,H,K,V,C", SHAPES)
def test_chunked_matches_fla_naive_recurrent(B, T, H, K, V, C, with_h0):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, with_h0=with_h0)
    o, ht = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C)
    o_ref, ht_ref = naive_recurrent(q, k, v, beta, g, initial_state=h0, output_final_state=True)
    assert o.shape == (B, T, H, V) and ht.shape == (B, H, K, V)
    assert o.dtype == v.dtype and ht.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(ht, ht_ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("B,T,H,K,V,C", SHAPES)
def test_chunked_matches_fla_naive_chunk(B, T, H, K, V, C, with_h0):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, with_h0=with_h0, seed=1)
    o, ht = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C)
    # fla's naive chunk pads T up to a multiple of the chunk; compare valid positions only
    o_ref, ht_ref = naive_chunk(q, k, v, g, beta, chunk_size=C, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref[:, :T], atol=ATOL, rtol=0)
    torch.testing.assert_close(ht, ht_ref, atol=ATOL, rtol=0)


def test_default_scale_and_explicit_scale():
    q, k, v, g, beta, h0 = make_inputs(1, 19, 2, 16, 8)
    for scale in (None, 0.3):
        o, _ = gated_delta_rule_chunked(q, k, v, g, beta, scale=scale, initial_state=h0, chunk_size=8)
        o_ref, _ = naive_recurrent(q, k, v, beta, g, scale=scale, initial_state=h0)
        torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)


def test_strong_decay_is_stable():
    # cumulative log-decay far below fp32's exp range inside one chunk: no inf/nan, still exact
    q, k, v, g, beta, h0 = make_inputs(1, 64, 2, 16, 16, seed=11)
    g = (g * 60.0).detach().requires_grad_(True)  # ~ -8 per token, ~ -500 over a chunk
    o, ht = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=64)
    o_ref, ht_ref = naive_recurrent(q, k, v, beta, g, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(ht, ht_ref, atol=ATOL, rtol=0)
    (o.sum() + ht.sum()).backward()
    assert torch.isfinite(g.grad).all()


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("B,T,H,K,V,C", [(2, 37, 2, 16, 24, 16), (1, 12, 2, 8, 8, 64)])
def test_gradients_match_fla_naive_recurrent(B, T, H, K, V, C):
    ours = make_inputs(B, T, H, K, V, requires_grad=True, seed=2)
    ref = [x.detach().clone().requires_grad_(True) for x in ours]
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(B, T, H, V, generator=gen)
    dht = torch.randn(B, H, K, V, generator=gen)

    q, k, v, g, beta, h0 = ours
    o, ht = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C)
    ((o * do).sum() + (ht * dht).sum()).backward()

    q, k, v, g, beta, h0 = ref
    o_ref, ht_ref = naive_recurrent(q, k, v, beta, g, initial_state=h0, output_final_state=True)
    ((o_ref * do).sum() + (ht_ref * dht).sum()).backward()

    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], ours, ref):
        assert a.grad is not None and torch.isfinite(a.grad).all(), name
        torch.testing.assert_close(a.grad, b.grad, atol=ATOL, rtol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def test_gradcheck_chunked_float64():
    # exact analytic-vs-numeric check of autograd through solve_triangular, padding and the chunk loop
    xs = make_inputs(1, 7, 1, 3, 2, dtype=torch.float64, requires_grad=True, seed=4)

    def f(q, k, v, g, beta, h0):
        return gated_delta_rule_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=3)

    assert torch.autograd.gradcheck(f, tuple(xs), eps=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- our two paths


@pytest.mark.parametrize("C", [1, 4, 16, 64])
@pytest.mark.parametrize("with_h0", [False, True])
def test_recurrent_equals_chunked(C, with_h0):
    q, k, v, g, beta, h0 = make_inputs(2, 45, 2, 8, 12, dtype=torch.float64, with_h0=with_h0, seed=5)
    o_c, ht_c = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C)
    o_r, ht_r = gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o_c.dtype == torch.float64
    torch.testing.assert_close(o_c, o_r, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ht_c, ht_r, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_chunked_is_causal_under_nonfinite_input(bad):
    """A non-finite token at s (mid-chunk) leaves the outputs before s as they were: the causal
    masks select, they never multiply a later token by 0 (0 × NaN = NaN)."""
    q, k, v, g, beta, h0 = make_inputs(2, 45, 2, 8, 12, dtype=torch.float64, seed=5)
    o_ref, _ = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=h0, chunk_size=16)
    s = 21
    for t in (q, k, v, g, beta):
        t[:, s] = bad
    o, h = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    torch.testing.assert_close(o[:, :s], o_ref[:, :s], atol=1e-10, rtol=1e-10)
    assert not o[:, s:].isfinite().all(-1).any() and not h.isfinite().all()


def test_recurrent_matches_fla_naive_recurrent():
    q, k, v, g, beta, h0 = make_inputs(2, 21, 2, 16, 8, seed=6)
    o, ht = gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = naive_recurrent(q, k, v, beta, g, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(ht, ht_ref, atol=ATOL, rtol=0)


def test_dtypes_and_no_final_state():
    q, k, v, g, beta, h0 = make_inputs(1, 10, 2, 8, 8)
    o, ht = gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, initial_state=h0,
                             output_final_state=True, chunk_size=4)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    o32, ht32 = gated_delta_rule(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), g, beta,
                                 initial_state=h0, output_final_state=True, chunk_size=4)
    torch.testing.assert_close(o.float(), o32, atol=2e-2, rtol=2e-2)  # bf16 rounding of the output only
    torch.testing.assert_close(ht, ht32, atol=1e-5, rtol=0)
    for fn in (gated_delta_rule_chunked, gated_delta_rule_recurrent):
        _, none = fn(q, k, v, g, beta)
        assert none is None


def test_bad_shapes_raise():
    q, k, v, g, beta, h0 = make_inputs(1, 10, 2, 8, 8)
    with pytest.raises(ValueError):
        gated_delta_rule_chunked(q, k, v, g[..., :1], beta)
    with pytest.raises(ValueError):
        gated_delta_rule_chunked(q, k, v[:, :5], g, beta)
    with pytest.raises(ValueError):
        gated_delta_rule_chunked(q, k, v, g, beta, initial_state=h0[..., :4])


# ----------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("a", [1, 5, 15, 16, 17, 32, 40, 47])
def test_streaming_equals_one_call(a):
    T, C = 48, 16
    q, k, v, g, beta, h0 = make_inputs(2, T, 2, 16, 8, seed=7)
    xs = (q, k, v, g, beta)
    o_full, ht_full = gated_delta_rule(*xs, initial_state=h0, output_final_state=True, chunk_size=C)
    o1, h1 = gated_delta_rule(*slice_t(xs, 0, a), initial_state=h0, output_final_state=True, chunk_size=C)
    o2, h2 = gated_delta_rule(*slice_t(xs, a, T), initial_state=h1, output_final_state=True, chunk_size=C)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o_full, atol=ATOL, rtol=0)
    torch.testing.assert_close(h2, ht_full, atol=ATOL, rtol=0)


def test_streaming_token_by_token_matches_chunked():
    # decode-style: one token per call, carrying the state, equals a single chunked call
    T = 23
    q, k, v, g, beta, _ = make_inputs(1, T, 2, 8, 8, seed=8, with_h0=False)
    xs = (q, k, v, g, beta)
    o_full, ht_full = gated_delta_rule(*xs, output_final_state=True, chunk_size=8)
    h, outs = None, []
    for t in range(T):
        o_t, h = gated_delta_rule(*slice_t(xs, t, t + 1), initial_state=h, output_final_state=True, chunk_size=8)
        outs.append(o_t)
    torch.testing.assert_close(torch.cat(outs, dim=1), o_full, atol=ATOL, rtol=0)
    torch.testing.assert_close(h, ht_full, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- dispatch


def test_fla_backend_on_cpu_raises_clear_error(monkeypatch):
    """Outside Triton's interpreter a CPU tensor cannot run fla's kernel: backend="fla" says so (under it,
    tests/test_fla_paths.py runs the kernel)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, g, beta, _ = make_inputs(1, 8, 2, 8, 8)
    with pytest.raises(RuntimeError, match="CPU tensor"):
        gated_delta_rule(q, k, v, g, beta, backend="fla")


def test_unknown_backend_raises():
    q, k, v, g, beta, _ = make_inputs(1, 8, 2, 8, 8)
    with pytest.raises(ValueError, match="backend"):
        gated_delta_rule(q, k, v, g, beta, backend="triton")


def test_auto_on_cpu_uses_torch_without_fla_or_cuda(monkeypatch):
    q, k, v, g, beta, h0 = make_inputs(1, 30, 2, 8, 8)
    expected = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=8)
    # make every fla import fail and every CUDA query explode: "auto" on CPU must need neither
    for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "fla", None)

    def no_cuda(*_, **__):
        raise AssertionError("CUDA was queried on the CPU path")

    monkeypatch.setattr(torch.cuda, "is_available", no_cuda)
    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    o, ht = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=8)
    torch.testing.assert_close(o, expected[0], atol=0, rtol=0)
    torch.testing.assert_close(ht, expected[1], atol=0, rtol=0)


def _cuda_inputs(B=2, T=200, H=4, K=64, V=64):
    xs = [x.cuda().requires_grad_(True) for x in make_inputs(B, T, H, K, V, seed=9)]
    gen = torch.Generator().manual_seed(10)
    do, dht = torch.randn(B, T, H, V, generator=gen).cuda(), torch.randn(B, H, K, V, generator=gen).cuda()
    return xs, do, dht


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for fla's Triton kernel")
def test_fla_backend_forward_matches_torch_on_cuda():
    (q, k, v, g, beta, h0), _, _ = _cuda_inputs()
    with torch.no_grad():
        o_f, ht_f = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)  # auto -> fla
        o_t, ht_t = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
    assert o_f.dtype == v.dtype and ht_f.dtype == torch.float32
    # fla runs its dots in tf32-ish precision; the torch path is exact fp32
    torch.testing.assert_close(o_f, o_t, atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(ht_f, ht_t, atol=5e-3, rtol=5e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for fla's Triton kernel")
def test_fla_backend_gradients_match_torch_on_cuda():
    xs, do, dht = _cuda_inputs()
    results = {}
    for backend in ("fla", "torch"):
        for x in xs:
            x.grad = None
        o, ht = gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, backend=backend)
        try:
            ((o * do).sum() + (ht * dht).sum()).backward()
        except RuntimeError as e:  # fla 0.6.0 refuses its gated backward on Hopper with Triton in [3.4, 3.7.1)
            if backend == "fla" and "Triton" in str(e):
                pytest.skip(f"fla backward unavailable here: {e}")
            raise
        results[backend] = [x.grad.clone() for x in xs]
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], results["fla"], results["torch"]):
        torch.testing.assert_close(a, b, atol=5e-3, rtol=5e-3, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("capability,triton_version,refused", [((9, 0), "3.6.0", True), ((9, 0), "3.8.0", False),
                                                                ((8, 0), "3.6.0", False)])
def test_auto_leaves_fla_where_it_refuses_the_gated_backward(monkeypatch, capability, triton_version, refused):
    # fla 0.6 raises in the gated backward on Hopper with Triton in [3.4, 3.7.1) (its #640): "auto"
    # must take the torch path there (torch 2.11 ships Triton 3.6), and fla's kernel elsewhere
    import triton

    from memzoo.ops import dispatch
    from memzoo.ops import gated_delta_rule as gdr

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: capability)
    monkeypatch.setattr(triton, "__version__", triton_version)
    dispatch.fla_unusable.cache_clear()
    try:
        why = dispatch.fla_unusable(0)
    finally:
        dispatch.fla_unusable.cache_clear()
    assert (why is not None) == refused
    if refused:
        assert "Hopper" in why and triton_version in why


def test_the_compiled_torch_path_matches_fla_naive_recurrent_forward_and_backward(gdn_compiled_traced_only):
    """backend="compiled" (what "auto" runs on CUDA where fla cannot): the same chunked algorithm
    under torch.compile, checked on the CPU against fla's naive recurrence (traced and differentiated
    as compiled, without the CPU's code generation: the fixture)."""
    B, T, H, K, V = 1, 32, 2, 8, 8
    xs = make_inputs(B, T, H, K, V, seed=3, requires_grad=True)
    gen = torch.Generator().manual_seed(4)
    do, dht = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64), torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    o, ht = gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, chunk_size=8, backend="compiled")
    ((o * do).sum() + (ht * dht).sum()).backward()
    got = [o.detach(), ht.detach(), *(x.grad.clone() for x in xs)]
    for x in xs:
        x.grad = None
    q, k, v, g, beta, h0 = xs
    ro, rh = naive_recurrent(q, k, v, beta, g, initial_state=h0, output_final_state=True)
    ((ro * do).sum() + (rh * dht).sum()).backward()
    want = [ro.detach(), rh.detach(), *(x.grad for x in xs)]
    for name, a, b in zip(["o", "h_T", "dq", "dk", "dv", "dg", "dbeta", "dh0"], got, want):
        torch.testing.assert_close(a, b.to(a.dtype), atol=1e-6, rtol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_gdn_op_names_what_auto_runs(monkeypatch):
    from memzoo.ops import dispatch
    from memzoo.ops import gated_delta_rule as gdr

    assert gdr.gdn_op("cpu") == "torch"
    monkeypatch.setattr(dispatch, "fla_unusable", lambda i=None: "flash-linear-attention is not installed")
    assert gdr.gdn_op("cuda:0") == "torch, compiled (flash-linear-attention is not installed)"
    monkeypatch.setattr(dispatch, "fla_unusable", lambda i=None: None)
    assert gdr.gdn_op("cuda") == "fla"
