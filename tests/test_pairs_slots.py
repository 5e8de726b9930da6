"""The pairs adapter of the slot memories (issue 77): FwPKM's, tied to its own write and checked against
the closed forms of its value step (FwPKM paper Sec. 3.2.1, Eq. 16; Lample et al. 2019 product keys),
and the reasons the layers without one give (PKM, FWL, Ba)."""

from __future__ import annotations

import pytest
import torch

import memzoo.layers  # noqa: F401  (registers the layers)
from memzoo.registry import build_layer, get_layer

SMALL = dict(key_dim=16, value_dim=16, n_subkeys=8, topk=4, chunk_size=4, per_sequence=True, triton=False)


def fwpkm(**over):
    torch.manual_seed(0)
    layer = build_layer("fwpkm", 32, **{**SMALL, **over})
    with torch.no_grad():  # slow weights off their init, so that no gate or bias is trivially neutral
        for p in layer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return layer


def snapshot(layer) -> dict:
    return {k: v.detach().clone() for k, v in layer.state.items()}


VARIANTS = [dict(), dict(addr_loss=False), dict(lookahead=False), dict(gating=False), dict(heads=2),
            dict(variant="release"), dict(per_sequence=False), dict(gate_weighted_loss=False)]


@pytest.mark.parametrize("over", VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_write_pairs_of_pair_inputs_stores_what_write_stores(over):
    """reset; write(x); read_keys(kq) == reset; write_pairs(*pair_inputs(x), x); read_keys(kq), over two
    chunks and a partial one (T = 10, C = 4), fp32, the torch path; the states agree too."""
    layer = fwpkm(**over)
    H, K, V = layer.pair_dims()
    assert (H, K, V) == (1, layer.heads * layer.key_dim, layer.value_dim)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 10, 32, generator=g)
    kq = torch.randn(2, 5, H, K, generator=g) * 0.3
    layer.reset(2)
    layer.write(x)
    own, s_own = layer.read_keys(kq), snapshot(layer)
    layer.reset(2)
    k, v = layer.pair_inputs(x)
    assert k.shape == (2, 10, H, K) and v.shape == (2, 10, H, V)
    layer.write_pairs(k, v, x)
    torch.testing.assert_close(layer.read_keys(kq), own, atol=1e-5, rtol=1e-5)
    for n, t in snapshot(layer).items():
        torch.testing.assert_close(t, s_own[n], atol=1e-5, rtol=1e-5)


def test_write_is_chunk_by_chunk_as_forward_writes():
    """write(x) steps once per chunk of chunk_size tokens, the state forward(x) leaves (and pair_inputs'
    lookahead pairs stay inside a chunk: a chunk's last token stores none)."""
    layer = fwpkm()
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(3))
    layer.reset(2)
    layer.write(x)
    written = snapshot(layer)
    layer.reset(2)
    layer(x)
    for n, t in snapshot(layer).items():
        torch.testing.assert_close(t, written[n], atol=1e-6, rtol=1e-6)
    _, v = layer.pair_inputs(x)
    assert v[:, [3, 7, 9]].abs().max() == 0 and v[:, [0, 1, 2, 4, 8]].abs().min() > 0


def test_nonfinite_tokens_are_left_out_the_same_way():
    layer = fwpkm()
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(4))
    x[0, 5] = float("nan")
    layer.reset(2)
    layer.write(x)
    own = snapshot(layer)
    layer.reset(2)
    layer.write_pairs(*layer.pair_inputs(x), x)
    for n, t in snapshot(layer).items():
        assert torch.isfinite(t).all()
        torch.testing.assert_close(t, own[n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_x", [False, True])
def test_read_keys_leaves_the_state_unchanged(with_x):
    layer = fwpkm()
    g = torch.Generator().manual_seed(5)
    H, K, V = layer.pair_dims()
    layer.reset(2)
    x = torch.randn(2, 9, 32, generator=g)
    layer.write_pairs(torch.randn(2, 9, H, K, generator=g), torch.randn(2, 9, H, V, generator=g), x if with_x else None)
    before = snapshot(layer)
    out = layer.read_keys(torch.randn(2, 6, H, K, generator=g))
    assert out.shape == (2, 6, H, V)
    assert all(torch.equal(before[n], t) for n, t in layer.state.items())


def grid_keys(layer, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the N = n² slots (i, j), the query [K¹_i; K²_j] of sequence b's current sub-keys
    (distance 0 to both: it addresses slot (i, j) first), and the slot ids in row order i·n + j."""
    keys = layer.state["keys"][b, 0]  # [2, n, Dk/2], one head
    n = layer.n
    i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    return torch.cat([keys[0][i.reshape(-1)], keys[1][j.reshape(-1)]], dim=-1), (i * n + j).reshape(-1)


def test_a_slot_memory_with_n_distinct_slots_recalls_all_n():
    """Closed form (FwPKM paper Sec. 3.2.1, Eq. 16, on Lample et al. 2019's product keys): with top-1
    retrieval a query's read is its one slot's value (softmax weight 1), and the value step at η = 1,
    V_i += (1 / N_i^read) (v − V_i), lands that value on the target. n pairs whose keys address n
    distinct slots (keys on distinct sub-key pairs, here all N = 64 slots in a shuffled order, in
    chunks of 4, so no two pairs of a chunk share a slot: N_i^read = 1) are each recalled exactly,
    and every slot written holds its pair's value."""
    layer = fwpkm(topk=1)
    layer.reset(2)
    g = torch.Generator().manual_seed(6)
    ks, slots = [], []
    for b in range(2):
        k, s = grid_keys(layer, b)
        order = torch.randperm(len(s), generator=g)
        ks.append(k[order])
        slots.append(s[order])
    k = torch.stack(ks)[:, :, None]  # [2, 64, 1, 16]
    v = torch.randn(2, 64, 1, 16, generator=g)
    layer.write_pairs(k, v)
    torch.testing.assert_close(layer.read_keys(k), v, atol=1e-5, rtol=0)
    values = layer.state["values"]
    for b in range(2):
        torch.testing.assert_close(values[b][slots[b]], v[b, :, 0], atol=1e-5, rtol=0)


def test_a_rewritten_slot_reads_its_latest_value():
    """Eq. 16 again: the step rewrites (it does not add), so a key written with v1, then with v2 in a
    later chunk, reads v2 (top-1)."""
    layer = fwpkm(topk=1)
    layer.reset(2)
    k = grid_keys(layer, 0)[0][[5, 17, 40, 63]]
    k = k.expand(2, 4, 16)[:, :, None].contiguous()  # sequence 1 addresses by sequence 0's sub-keys: equal at init
    v1, v2 = torch.randn(2, 2, 4, 1, 16, generator=torch.Generator().manual_seed(7))
    layer.write_pairs(torch.cat([k, k], dim=1), torch.cat([v1, v2], dim=1))
    torch.testing.assert_close(layer.read_keys(k), v2, atol=1e-5, rtol=0)


def test_top_k_contracts_the_error_by_the_squared_weights_and_converges_to_the_target():
    """Closed form of the value step with top-k (Sec. 3.2.1, Eq. 17 + Eq. 18): a pair alone on its k
    slots (N_i^read = 1) moves V_i by η s'_i (v − v̂), so its read moves by η Σ_i s'_i² (v − v̂): after m
    writes v̂_m − v = (1 − Σ s'²)^m (v̂_0 − v). The fixed point is the target v (the step is exact only
    for k = 1, where Σ s'² = 1)."""
    layer = fwpkm(topk=4)
    layer.reset(2)
    g = torch.Generator().manual_seed(8)
    k = torch.randn(2, 1, 1, 16, generator=g) * 0.3
    v = torch.randn(2, 1, 1, 16, generator=g)
    _, w, _ = layer._lookup(k.reshape(2, 1, 16), layer.state)
    contraction = 1 - w.pow(2).sum(-1).reshape(2, 1, 1, 1)
    assert (contraction > 0.05).all()  # a genuine top-4 mixture: one step does not reach the target
    v0 = layer.read_keys(k)
    for m in range(1, 31):
        layer.write_pairs(k, v)
        torch.testing.assert_close(layer.read_keys(k) - v, contraction**m * (v0 - v), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(layer.read_keys(k), v, atol=1e-3, rtol=0)


def test_neutral_write_keeps_the_keys_and_pairs_key_step_moves_them():
    layer = fwpkm()
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(2, 8, 1, 16, generator=g), torch.randn(2, 8, 1, 16, generator=g)
    layer.reset(2)
    keys0 = layer.state["keys"].clone()
    layer.write_pairs(k, v)
    assert torch.equal(layer.state["keys"], keys0)
    layer.reset(2)
    layer.pairs_key_step = True
    layer.write_pairs(k, v)
    assert not torch.equal(layer.state["keys"], keys0)


def test_bad_pair_shapes_raise_clearly():
    layer = fwpkm()
    layer.reset(2)
    with pytest.raises(ValueError, match="keys"):
        layer.write_pairs(torch.zeros(2, 3, 2, 8), torch.zeros(2, 3, 2, 16))
    with pytest.raises(ValueError, match="batch size"):
        layer.read_keys(torch.zeros(3, 3, 1, 16))


@pytest.mark.parametrize("name", ["pkm", "fwl", "ba"])
def test_the_layers_without_an_adapter_say_why(name):
    reason = get_layer(name).no_pairs
    assert isinstance(reason, str) and len(reason) > 40 and reason != "no key-value adapter yet"
    layer = build_layer(name, 32)
    for call in (lambda: layer.write_pairs(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4)),
                 lambda: layer.read_keys(torch.zeros(1, 1, 1, 4)), layer.pair_dims,
                 lambda: layer.pair_inputs(torch.zeros(1, 2, 32))):
        with pytest.raises(NotImplementedError) as err:
            call()
        assert reason in str(err.value)


def test_fwpkm_has_an_adapter():
    assert get_layer("fwpkm").no_pairs is None
