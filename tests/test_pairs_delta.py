"""The pairs adapter (MemoryLayer.pair_dims / pair_inputs / write_pairs / read_keys, which the pairs
suite, bench/suites/pairs.py, drives) of the delta-rule memories Gated DeltaNet, KDA, DeltaProduct,
RWKV-7 and MoM: tied to the layer's own write, read-only reads, and the neutral closed forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import memzoo.layers  # noqa: F401  (registers the layers)
from memzoo.registry import build_layer, get_layer

H, K = 2, 8  # 2 heads of 8 at d_model 32
D = 32

#: (id, registry name, options): the five layers, and the variants whose adapter takes another path
CASES = [
    ("gated_deltanet", "gated_deltanet", {}),
    ("kda", "kda", {}),
    ("deltaproduct", "deltaproduct", {}),
    ("deltaproduct-gated-3", "deltaproduct", dict(num_householder=3, forget_gate=True, allow_neg_eigval=True)),
    ("rwkv7", "rwkv7", {}),
    ("mom", "mom", {}),
    ("mom-no-shared", "mom", dict(shared_memory=False)),
]
IDS = [c[0] for c in CASES]
DELTA = [c for c in CASES if c[1] != "mom"]  # neutral: the plain delta rule on one memory


def make(name: str, opts: dict, seed: int = 0):
    torch.manual_seed(seed)
    L = build_layer(name, D, num_heads=H, head_dim=K, **opts)
    L.reset(2)
    return L


def unit(*shape: int, seed: int = 1) -> torch.Tensor:
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), dim=-1)


def snapshot(L) -> dict:
    return {n: t.clone() for n, t in L.state.items()}


@pytest.mark.parametrize("name,opts", [c[1:] for c in CASES], ids=IDS)
def test_has_an_adapter(name, opts):
    L = make(name, opts)
    assert get_layer(name).no_pairs is None
    assert L.pair_dims() == (H, K, K)


@pytest.mark.parametrize("name,opts", [c[1:] for c in CASES], ids=IDS)
def test_ties_to_forward(name, opts):
    """write(x) and write_pairs(*pair_inputs(x), x) store the same memory: the same reads at random unit
    keys, the same fast weights (20 tokens: two of the chunked op's chunks of 16)."""
    L = make(name, opts)
    x = torch.randn(2, 20, D, generator=torch.Generator().manual_seed(2))
    kq = unit(2, 5, H, K)
    L.write(x)
    a, sa = L.read_keys(kq), snapshot(L)
    L.reset(2)
    k, v = L.pair_inputs(x)
    assert k.shape == (2, 20, H, K) and v.shape == (2, 20, H, K)
    L.write_pairs(k, v, x)
    b = L.read_keys(kq)
    assert a.shape == (2, 5, H, K)
    assert a.abs().max() > 1e-3  # not an empty memory
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    for n in ("S", "S_shared"):
        if n in sa:
            torch.testing.assert_close(L.state[n], sa[n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,opts", [c[1:] for c in CASES], ids=IDS)
def test_the_pair_is_written(name, opts):
    """With x given, the pair's own value is what changes the memory (the adapter does not fall back to
    the layer's projections of x): other values, another read."""
    L = make(name, opts)
    x = torch.randn(2, 12, D, generator=torch.Generator().manual_seed(3))
    k, v = L.pair_inputs(x)
    L.write_pairs(k, v, x)
    a = L.read_keys(k)
    L.reset(2)
    L.write_pairs(k, v + 1.0, x)
    assert (L.read_keys(k) - a).abs().max() > 1e-3


@pytest.mark.parametrize("gates", ["neutral", "x"])
@pytest.mark.parametrize("name,opts", [c[1:] for c in CASES], ids=IDS)
def test_read_keys_leaves_the_state(name, opts, gates):
    L = make(name, opts)
    k, v = unit(2, 12, H, K, seed=4), torch.randn(2, 12, H, K)
    L.write_pairs(k, v, torch.randn(2, 12, D) if gates == "x" else None)
    before = snapshot(L)
    L.read_keys(unit(2, 7, H, K, seed=5))
    after = L.state
    assert set(after) == set(before)
    for n, t in before.items():
        assert torch.equal(after[n], t), n


def orthonormal_keys(seed: int = 6) -> torch.Tensor:
    """K orthonormal keys per sequence and head: [2, K, H, K]."""
    Q = torch.linalg.qr(torch.randn(2, H, K, K, generator=torch.Generator().manual_seed(seed))).Q
    return Q.permute(0, 3, 1, 2).contiguous()  # key i = column i


def delta_rule(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference: S ← (I − k kᵀ) S + k vᵀ per pair from S = 0 (Yang et al. 2024, Eq. 1-2, β = 1)."""
    S = k.new_zeros(k.shape[0], k.shape[2], k.shape[3], v.shape[3])
    for t in range(k.shape[1]):
        kt, vt = k[:, t, ..., None], v[:, t, :, None, :]
        S = S - kt * (kt.transpose(-1, -2) @ S) + kt * vt
    return S


@pytest.mark.parametrize("name,opts", [c[1:] for c in DELTA], ids=[c[0] for c in DELTA])
def test_neutral_is_the_delta_rule(name, opts):
    """Neutral gates (x None) of Gated DeltaNet (β = 1, α = 1), KDA (β = 1, α = 1 per channel),
    DeltaProduct (each of its n_h steps the pair at β = 1, no decay) and RWKV-7 (w = 1, removal key k at
    rate 1) are the delta rule at β = 1 (Yang et al. 2024, "Parallelizing Linear Transformers with the
    Delta Rule over Sequence Length", arXiv 2406.06484, Eq. 1-2: S ← (I − β k kᵀ) S + β k vᵀ):
    with n = K orthonormal keys every value reads back exactly; the same key written with v1 then v2
    reads v2; and 20 random unit pairs (more than K) give the reference recurrence's memory."""
    L = make(name, opts)
    k, v = orthonormal_keys(), torch.randn(2, K, H, K)
    L.write_pairs(k, v)
    torch.testing.assert_close(L.read_keys(k), v, atol=1e-5, rtol=1e-5)

    L.reset(2)
    k1 = unit(2, 1, H, K, seed=7)
    v1, v2 = torch.randn(2, 1, H, K), torch.randn(2, 1, H, K)
    L.write_pairs(torch.cat([k1, k1], 1), torch.cat([v1, v2], 1))
    torch.testing.assert_close(L.read_keys(k1), v2, atol=1e-5, rtol=1e-5)

    L.reset(2)
    k, v = unit(2, 20, H, K, seed=8), torch.randn(2, 20, H, K)
    L.write_pairs(k, v)
    torch.testing.assert_close(L.state["S"], delta_rule(k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("opts", [{}, dict(shared_memory=False)], ids=["shared", "no-shared"])
def test_mom_neutral(opts):
    """MoM at neutral gates (pair i to memory i mod M alone, β = 1, no decay, the shared memory not
    written; read_keys: memory i mod M at weight 1 plus the shared memory, Du et al. 2025 Eq. 13): one
    pair reads back exactly; so do M pairs with any keys (one a memory); the shared memory stays empty;
    and each memory holds the delta rule (Yang et al. 2024, arXiv 2406.06484, Eq. 1-2) over its pairs."""
    L = make("mom", opts)
    M = L.num_memories
    k, v = unit(2, 1, H, K, seed=9), torch.randn(2, 1, H, K)
    L.write_pairs(k, v)
    torch.testing.assert_close(L.read_keys(k), v, atol=1e-5, rtol=1e-5)

    L.reset(2)
    k, v = unit(2, M, H, K, seed=10), torch.randn(2, M, H, K)
    L.write_pairs(k, v)
    torch.testing.assert_close(L.read_keys(k), v, atol=1e-5, rtol=1e-5)
    if "S_shared" in L.state:
        assert not L.state["S_shared"].any()

    L.reset(2)
    n = 3 * M + 1  # memories of unequal counts
    k, v = unit(2, n, H, K, seed=11), torch.randn(2, n, H, K)
    L.write_pairs(k, v)
    for m in range(M):
        torch.testing.assert_close(L.state["S"][:, m], delta_rule(k[:, m::M], v[:, m::M]), atol=1e-5, rtol=1e-5)
