"""The pairs adapter on every layer that has one (the property suite's half: it stores what the
layer's own write stores, and its read leaves the state alone), the closed forms of the write rules
it drives, and the pairs suite (bench/suites/pairs.py): rows, determinism, the layers without one."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import memzoo.layers  # noqa: F401  (registers the layers)
from memzoo.registry import build_layer, get_layer, layer_names

from conftest import tiny_layer

ADAPTED = [n for n in layer_names() if get_layer(n).no_pairs is None]
WITHOUT = [n for n in layer_names() if get_layer(n).no_pairs is not None]


def _length(name: str) -> int:
    """Two of the layer's chunks (or 8 tokens for a token-recurrent layer)."""
    layer = tiny_layer(name)
    return 2 * (layer.chunk_size or 4)


@pytest.mark.parametrize("name", ADAPTED)
def test_the_adapter_stores_what_the_layers_own_write_stores(name):
    """write(x) and write_pairs(*pair_inputs(x), x) leave memories that read the same at any key;
    read_keys changes nothing."""
    layer = tiny_layer(name, dtype=torch.float64)
    H, K, V = layer.pair_dims()
    x = torch.randn(2, _length(name), layer.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    kq = F.normalize(torch.randn(2, 5, H, K, dtype=torch.float64, generator=torch.Generator().manual_seed(2)), dim=-1)
    layer.reset(2)
    layer.write(x)
    own = layer.read_keys(kq)
    layer.reset(2)
    k, v = layer.pair_inputs(x)
    assert k.shape[-2:] == (H, K) and v.shape[-2:] == (H, V)
    layer.write_pairs(k, v, x)
    before = {n: t.clone() for n, t in layer.state.items()}
    adapted = layer.read_keys(kq)
    assert adapted.shape == (2, 5, H, V)
    torch.testing.assert_close(adapted, own, atol=1e-8, rtol=1e-6)
    assert all(torch.equal(before[n], t) for n, t in layer.state.items())


@pytest.mark.parametrize("name", WITHOUT)
def test_a_layer_without_an_adapter_says_why(name):
    layer = tiny_layer(name)
    assert len(get_layer(name).no_pairs) > 20
    with pytest.raises(NotImplementedError, match=get_layer(name).no_pairs[:20]):
        layer.write_pairs(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))


def _orthonormal(K: int, H: int, V: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(K, K, dtype=torch.float64, generator=g))[0].T  # K orthonormal rows
    return q[None, :, None, :].expand(1, K, H, K).contiguous(), torch.randn(1, K, H, V, dtype=torch.float64, generator=g)


@pytest.mark.parametrize("name", ["linear", "deltanet"])
def test_with_orthonormal_keys_the_outer_product_and_the_delta_rule_recall_exactly_up_to_k(name):
    """Schlag, Irie & Schmidhuber 2021 ("Linear Transformers are secretly fast weight programmers",
    Sec. 4): with orthonormal keys S = Σ k_i v_iᵀ reads Sᵀk_j = v_j exactly, for n ≤ d_k; the delta
    rule at β = 1 (S ← (I − k kᵀ)S + k vᵀ, Eq. 16-17) too, each write leaving the others' keys alone."""
    layer = build_layer(name, 32, num_heads=2, head_dim=8).double()
    layer.reset(1)
    k, v = _orthonormal(8, 2, 8)
    layer.write_pairs(k, v)
    torch.testing.assert_close(layer.read_keys(k), v, atol=1e-10, rtol=0)


def test_the_delta_rule_overwrites_where_the_outer_product_adds():
    """Schlag et al. 2021 Sec. 4.2: written (k, v1) then (k, v2), the delta rule (β = 1) reads v2, the
    outer product v1 + v2 (a unit key)."""
    k = F.normalize(torch.randn(1, 1, 2, 8, dtype=torch.float64), dim=-1).expand(1, 2, 2, 8).contiguous()
    v = torch.randn(1, 2, 2, 8, dtype=torch.float64)
    reads = {}
    for name in ("deltanet", "linear"):
        layer = build_layer(name, 32, num_heads=2, head_dim=8).double()
        layer.reset(1)
        layer.write_pairs(k, v)
        reads[name] = layer.read_keys(k[:, :1])[:, 0]
    torch.testing.assert_close(reads["deltanet"], v[:, 1], atol=1e-10, rtol=0)
    torch.testing.assert_close(reads["linear"], v[:, 0] + v[:, 1], atol=1e-10, rtol=0)


def test_the_suite_scores_pairs_and_counts_what_is_held():
    from memzoo.bench.suites import pairs

    v = torch.eye(4)[None, :, None, :]  # four orthogonal values, one head
    acc, err = pairs.scores(v, v)
    assert acc.tolist() == [1.0] and err.tolist() == [0.0]
    acc, _ = pairs.scores(v.roll(1, dims=1), v)
    assert acc.tolist() == [0.0]
    s = pairs.Settings(max_pairs_per_key=4, max_pairs=512)
    assert pairs.grid(8, s) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    k, _ = pairs.keys_values(2, 50, 1, 16, 4, "correlated", 0.5, torch.Generator().manual_seed(0))
    cos = (k[0, :, 0] @ k[0, :, 0].T)[~torch.eye(50, dtype=bool)]
    assert 0.4 < cos.mean() < 0.6  # the stated pairwise cosine


def test_the_suite_writes_deterministic_rows_for_every_adapted_layer(tmp_path):
    """Two runs, the same rows (metrics exactly); the baseline and a layer without an adapter give none."""
    from memzoo.bench.run import run_bench

    layers = f"deltanet,{WITHOUT[0]}"
    preset = tmp_path / "p.yaml"
    preset.write_text("base: tiny\npairs: {draws: 2, max_pairs: 16, conditions: [random], sizes: {deltanet: "
                      "[{}, {head_dim: 4}]}}\n")
    for out in ("a", "b"):
        run_bench(layers, "pairs", str(preset), out=tmp_path / out, work_dir=tmp_path / "w", progress=False)
    rows = [[json.loads(line) for line in (tmp_path / out / "results.jsonl").read_text().splitlines()] for out in "ab"]
    assert [r["metrics"] for r in rows[0]] == [r["metrics"] for r in rows[1]]
    assert {(r["layer"], r["setting"]["size"], r["setting"]["gates"]) for r in rows[0]} == {
        ("deltanet", s, g) for s in ("bench options", "head_dim=4") for g in ("neutral", "init")}
    m = rows[0][0]["metrics"]
    assert m["held_per_1k_state"] == pytest.approx(1000 * m["held_mean"] / m["mem_state"], abs=1e-4)
