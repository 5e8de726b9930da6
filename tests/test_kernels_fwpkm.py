"""memzoo.kernels.fwpkm against the torch references they replace, on CPU under TRITON_INTERPRET=1
(set by conftest; compiled on a CUDA machine): (a) the fused product-key lookup, (b) the
embedding-bag read and its backward, (c) the sorted-segment sum under FwPKM's write, and the
FwPKM and PKM layers with the kernels routed in against the same layers on the torch path.

Sizes are small and odd on purpose (n, d, k not powers of two; T not a multiple of the 16-token
block), and every output buffer a kernel fills comes from a NaN / sentinel-poisoned
``torch.empty`` (fla's trick), so an element a kernel forgets to write fails the comparison.
Tolerances: fp32 agrees to 1e-4 relative (the issue's bar; the sums differ in order only); bf16
inputs (read in bf16, accumulated in fp32) to 2e-2 relative, bf16's own rounding.
"""

from __future__ import annotations

import math

import pytest
import torch

from memzoo.kernels import fwpkm as kernels
from memzoo.registry import build_layer
from memzoo.ops import fwpkm as fw
from memzoo.ops import product_key as pk

RTOL = 1e-4


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch):
    """torch.empty returns NaN (floats) or a sentinel (ints) instead of whatever memory held."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(math.nan if t.is_floating_point() else -12345)

    monkeypatch.setattr(torch, "empty", poisoned)


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL) -> bool:
    """Relative to the reference's scale (entries near 0 compare against its largest)."""
    a, b = a.detach().double(), b.detach().double()
    return torch.allclose(a, b, rtol=rtol, atol=rtol * float(b.abs().max().clamp(min=1e-6)))


# ---- (a) lookup -----------------------------------------------------------------------------


@pytest.mark.parametrize("score", ["idw", "dot"])
@pytest.mark.parametrize("lead,H,n,d,k,per_seq", [
    ((2, 19), 2, 20, 5, 3, False),   # T = 19: one full 16-token block and a partial one
    ((3,), 1, 40, 8, 8, False),      # 1-D lead, k = 8 (a power of two)
    ((2, 7), 2, 24, 6, 5, True),     # a sub-key set per sequence
    ((1, 33), 1, 130, 3, 4, True),   # n > the 128-key block: the running top-k merges blocks
])
def test_lookup_matches_torch(lead, H, n, d, k, per_seq, score):
    g = torch.Generator().manual_seed(n + d)
    q = torch.randn(*lead, H, 2 * d, generator=g)
    keys = torch.randn(*((lead[0],) if per_seq else ()), H, 2, n, d, generator=g)
    got, want = kernels.lookup(q, keys, k, score), pk.lookup(q, keys, k, score)
    for field in ("index", "sub_index", "pair"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert close(got.scores, want.scores) and close(got.sub_scores, want.sub_scores)


def test_lookup_finds_the_brute_force_top_k():
    g = torch.Generator().manual_seed(3)
    q, keys = torch.randn(21, 2, 10, generator=g), torch.randn(2, 2, 17, 5, generator=g)
    got = kernels.lookup(q, keys, 6, "idw")
    scores, index = pk.brute_force_topk(q, keys, 6, "idw")
    assert torch.equal(got.index, index) and close(got.scores, scores)


def test_lookup_rejects_what_the_reference_rejects():
    with pytest.raises(ValueError, match="top-k"):
        kernels.lookup(torch.randn(3, 1, 4), torch.randn(1, 2, 3, 2), 4)
    with pytest.raises(ValueError, match="score"):
        kernels.lookup(torch.randn(3, 1, 4), torch.randn(1, 2, 3, 2), 2, "cos")


# ---- (b) embedding bag ----------------------------------------------------------------------


@pytest.mark.parametrize("rows,D,m,lead", [(37, 13, 6, (2, 5)), (5, 130, 3, (17,)), (300, 7, 24, (3, 11))])
def test_embedding_bag_forward_and_backward(rows, D, m, lead):
    g = torch.Generator().manual_seed(rows)
    V = torch.randn(rows, D, generator=g, requires_grad=True)
    idx = torch.randint(0, rows, (*lead, m), generator=g)  # rows repeat: the backward sums them
    w = torch.randn(*lead, m, generator=g, requires_grad=True)
    got = kernels.embedding_bag(V, idx, w)
    want = pk.gather_values(V.double(), idx, w.double())
    assert close(got, want)
    go = torch.randn(*lead, D, generator=g)
    gV, gw = torch.autograd.grad(got, (V, w), go)
    rV, rw = torch.autograd.grad(want, (V, w), go.double())
    assert close(gV, rV) and close(gw, rw)


def test_embedding_bag_bf16():
    g = torch.Generator().manual_seed(0)
    V, w = torch.randn(50, 24, generator=g), torch.softmax(torch.randn(9, 8, generator=g), -1)
    idx = torch.randint(0, 50, (9, 8), generator=g)
    got = kernels.embedding_bag(V.bfloat16(), idx, w.bfloat16())
    assert close(got, pk.gather_values(V.double(), idx, w.double()), rtol=2e-2)


# ---- (c) segment sum ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["plain", "count", "table", "scalar"])
def test_segment_sum_matches_index_add(mode):
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 23, (9, 5), generator=g)  # 9 tokens x 5 entries, 23-row table
    coef, x = torch.randn(45, generator=g), torch.randn(9, 11, generator=g)
    table = torch.randn(23, 11, generator=g)
    kw = {"plain": {}, "count": dict(count=(torch.rand(9, generator=g) > 0.3).float(), alpha=-0.7, accumulate=True),
          "table": dict(table=table, alpha=2.0)}.get(mode)
    if mode == "scalar":  # no x: Σ coef per row, D = 1
        got = kernels.segment_sum(torch.zeros(23, 1), kernels.Segments(rows), coef)
        want = kernels.segment_sum_reference(torch.zeros(23, 1), rows, coef)
    else:
        got = kernels.segment_sum(table.clone(), kernels.Segments(rows), coef, x, per_token=5, **kw)
        want = kernels.segment_sum_reference(table.clone(), rows, coef, x, per_token=5, **kw)
    assert close(got, want)
    assert torch.equal(got[~torch.isin(torch.arange(23), rows)], (table if mode != "scalar" else torch.zeros(23, 1))[
        ~torch.isin(torch.arange(23), rows)]), "untouched rows must stay as they were"


def test_segment_sum_is_deterministic():
    g = torch.Generator().manual_seed(2)
    rows = torch.randint(0, 4, (200,), generator=g)  # long segments: order would show in the last bits
    coef, x = torch.randn(200, generator=g), torch.randn(200, 9, generator=g) * 1e3
    a = kernels.segment_sum(torch.zeros(4, 9), kernels.Segments(rows), coef, x)
    b = kernels.segment_sum(torch.zeros(4, 9), kernels.Segments(rows), coef, x)
    assert torch.equal(a, b)


# ---- FwPKM's ops (memzoo.ops.fwpkm): the kernel path of each against its torch reference ---------


def _fw_chunk(per_seq: bool, H: int = 2, n: int = 9, d: int = 4, k: int = 3, B: int = 2, T: int = 7):
    """A chunk's lookup on random sub-keys, with one token that counts nowhere."""
    g = torch.Generator().manual_seed(3 + per_seq)
    keys = torch.randn(*((B,) if per_seq else ()), H, 2, n, d, generator=g)
    q = torch.randn(B, T, H * 2 * d, generator=g)
    lk, w = fw.lookup(q.view(B, T, H, 2 * d), keys, k, "idw", 1e-3, triton=False)
    ok = torch.ones(B, T, dtype=torch.bool)
    ok[1, 2] = False
    return q, keys, lk, w, fw.slot_rows(lk.index.flatten(-2), n * n, per_seq), ok, g


@pytest.mark.parametrize("per_seq", [False, True])
def test_fwpkm_value_step_on_kernels_matches_its_reference(per_seq, on_kernels):
    q, keys, lk, w, idx, ok, g = _fw_chunk(per_seq)
    B, T, _ = idx.shape
    values = torch.randn((B if per_seq else 1) * 81, 5, generator=g)
    err = torch.randn(B, T - 1, 5, generator=g)  # the last token reads but writes nothing
    got = fw.value_step(values.clone(), idx, w, err, ok, 0.7, functional=False)
    want = fw.value_step_reference(values.clone(), idx, w, err, ok, 0.7, functional=False)
    assert close(got, want)


@pytest.mark.parametrize("per_seq,pooled,score", [(False, False, "idw"), (True, True, "idw"), (True, False, "dot")])
def test_fwpkm_addressing_key_grad_on_kernels_matches_its_reference(per_seq, pooled, score, monkeypatch):
    q, keys, lk, w, idx, ok, g = _fw_chunk(per_seq)
    if score == "dot":
        B, T, _ = q.shape
        lk, w = fw.lookup(q.view(B, T, 2, -1), keys, 3, "dot", 1e-3, triton=False)
    kw = dict(weight=10.0, score=score, eps=1e-3, pooled_entropy=pooled)
    want = fw.addressing_key_grad(q, ok, lk, keys, triton=False, **kw)
    monkeypatch.setattr(pk, "kernels_for", lambda t: True)
    got = fw.addressing_key_grad(q, ok, lk, keys, **kw)
    assert close(got, want)


# ---- the layers with the kernels routed in ------------------------------------------------


@pytest.fixture
def on_kernels(monkeypatch):
    """Route the layers' product-key work to the kernels on CPU tensors (the interpreter)."""
    monkeypatch.setattr(pk, "kernels_for", lambda t: True)


def _run_fwpkm(opts: dict, kernel: bool, monkeypatch, steps: int = 2):
    if kernel:
        monkeypatch.setattr(pk, "kernels_for", lambda t: True)
    else:
        monkeypatch.setattr(pk, "kernels_for", lambda t: False)
    torch.manual_seed(0)
    layer = build_layer("fwpkm", 24, key_dim=10, value_dim=7, n_subkeys=11, topk=3, chunk_size=6, **opts)
    layer.reset(batch_size=2)
    g = torch.Generator().manual_seed(5)
    outs = []
    for _ in range(steps):  # two calls: the second reads what the first wrote
        x = torch.randn(2, 15, 24, generator=g)  # 15 tokens: chunks of 6, 6, 3
        outs.append(layer(x))
    loss = sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs)
    grads = torch.autograd.grad(loss, [p for p in layer.parameters() if p.requires_grad], allow_unused=True)
    return outs, {k: v.detach().clone() for k, v in layer.state.items()}, grads


@pytest.mark.parametrize("opts", [
    dict(),                                            # the paper: shared memory, IDW, addressing loss
    dict(per_sequence=True),
    dict(score="dot", heads=2),
    dict(per_sequence=True, heads=2, pooled_entropy=True, release_value_scale=True),
    dict(addr_loss=False),                             # keys follow the memorisation loss (torch; reads on kernels)
    dict(variant="release"),                           # grad through the update: the embedding bag's value backward
])
def test_fwpkm_on_kernels_matches_torch(opts, monkeypatch):
    o1, s1, g1 = _run_fwpkm(opts, True, monkeypatch)
    o2, s2, g2 = _run_fwpkm(opts, False, monkeypatch)
    for a, b in zip(o1, o2):
        assert close(a, b)
    for k in s2:
        assert close(s1[k], s2[k]), k
    for a, b in zip(g1, g2):
        assert (a is None) == (b is None) and (a is None or close(a, b))


def test_fwpkm_triton_false_keeps_the_torch_path(monkeypatch):
    called = []
    monkeypatch.setattr(pk, "kernels_for", lambda t: called.append(1) or True)
    monkeypatch.setattr(kernels, "lookup", lambda *a, **k: pytest.fail("kernel called with triton=False"))
    layer = build_layer("fwpkm", 16, key_dim=8, value_dim=4, n_subkeys=5, topk=2, chunk_size=4, triton=False)
    layer(torch.randn(1, 9, 16))
    assert not called


def test_pkm_on_kernels_matches_torch(monkeypatch):
    torch.manual_seed(0)
    layer = build_layer("pkm", 24, key_dim=10, value_dim=9, heads=2, topk=3, n_subkeys=13)
    x = torch.randn(2, 19, 24)
    res = []
    for kernel in (True, False):
        monkeypatch.setattr(pk, "kernels_for", lambda t, k=kernel: k)
        y = layer(x)
        res.append((y, torch.autograd.grad(y.pow(2).sum(), list(layer.parameters()))))
    (y1, g1), (y2, g2) = res
    assert close(y1, y2)
    for a, b in zip(g1, g2):
        assert close(a, b)


def test_fwpkm_on_kernels_keeps_non_finite_tokens_out_of_the_memory(on_kernels):
    """A NaN token writes nothing (the layer's rule): the shared memory stays finite and the
    other sequence's output is the one it gets without the NaN."""
    torch.manual_seed(0)
    layer = build_layer("fwpkm", 16, key_dim=8, value_dim=5, n_subkeys=7, topk=2, chunk_size=4)
    x = torch.randn(2, 9, 16)
    clean = layer(x)
    layer.reset()
    x[0, 3] = math.nan
    dirty = layer(x)
    assert all(t.isfinite().all() for t in layer.state.values())
    assert not dirty[0, 3].isfinite().all()
    assert dirty[0, :3].isfinite().all()
    assert close(dirty[1, :4], clean[1, :4])  # the first chunk reads the memory before any write
