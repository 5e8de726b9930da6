"""FwPKM numerics against the paper's equations (Sec. 3, Eqs. 16, 26-39)."""

import math

import pytest
import torch

from conftest import TINY_LM, layer_options
from memzoo.backbone import HybridLM
from memzoo.layers.fwpkm import FwPKM
from memzoo.ops.product_key import gather_values


def grid_layer(**kw) -> FwPKM:
    """2 × 2 slots on 1-d sub-keys at 0 and 10: a query (a, b) reads slot 2·[a≈10] + [b≈10]."""
    cfg = dict(key_dim=2, value_dim=2, topk=1, n_subkeys=2, chunk_size=16, value_norm=False)
    cfg.update(kw)
    layer = FwPKM(8, **cfg).double()
    keys = torch.tensor([0.0, 10.0], dtype=torch.float64).view(1, 1, 2, 1).expand(1, 2, 2, 1).clone()
    layer.load_state({"keys": keys, "values": torch.tensor([[1.0, 0], [5, 5], [7, 7], [0, 1]], dtype=torch.float64)})
    return layer


def write(layer: FwPKM, q, v, g):
    q, v = torch.tensor([q], dtype=torch.float64), torch.tensor([v], dtype=torch.float64)
    g = None if g is None else torch.tensor([g], dtype=torch.float64)
    state = layer.state
    lk, w, idx = layer._lookup(q, state)
    return layer._update(q, v, g, lk, w, idx, state)["values"]


def test_hand_computed_value_update_with_gates_and_read_counts():
    # tokens A and B both read slot 0, C reads slot 3; no lookahead: targets are their own values
    layer = grid_layer(lookahead=False)
    V = write(layer, q=[[0.0, 0.0], [0.1, 0.0], [10.0, 10.0]], v=[[3.0, 1.0], [-1.0, 2.0], [4.0, -3.0]], g=[0.5, 1.0, 0.25])
    # Eq. 35: V0' = V0 - (1/2)[0.5 (V0 - vA) + 1.0 (V0 - vB)] = (1,0) - ½[(-1,-0.5) + (2,-2)] = (0.5, 1.25)
    #         V3' = V3 - 0.25 (V3 - vC) = (0,1) - 0.25 (-4, 4) = (1, 0); slots 1 and 2 untouched
    expect = torch.tensor([[0.5, 1.25], [5, 5], [7, 7], [1, 0]], dtype=torch.float64)
    torch.testing.assert_close(V, expect, rtol=0, atol=1e-12)


def test_lookahead_pairs_each_query_with_the_next_value():
    layer = grid_layer(lookahead=True)
    # q_0 -> v_1, q_1 -> v_2; the last token writes nothing; gates g_0 = 1, g_1 = 0.5
    V = write(layer, q=[[0.0, 0.0], [10.0, 10.0], [0.0, 10.0]], v=[[9.0, 9.0], [3.0, 1.0], [4.0, -3.0]], g=[1.0, 0.5, 1.0])
    expect = torch.tensor([[3.0, 1.0], [5, 5], [7, 7], [2.0, -1.0]], dtype=torch.float64)  # V3 = (0,1) - .5((0,1)-(4,-3))
    torch.testing.assert_close(V, expect, rtol=0, atol=1e-12)


def test_ungated_loss_and_release_scale():
    layer = grid_layer(lookahead=False, gate_weighted_loss=False)
    V = write(layer, q=[[10.0, 10.0]], v=[[4.0, -3.0]], g=[0.25])
    torch.testing.assert_close(V[3], torch.tensor([4.0, -3.0], dtype=torch.float64))  # one-step rewrite
    layer = grid_layer(lookahead=False, gate_weighted_loss=False, release_value_scale=True, lr=0.5)
    V = write(layer, q=[[10.0, 10.0]], v=[[4.0, -3.0]], g=None)
    # the release's extra top-k × heads factor (= 1 here) times lr 0.5: half way to the target
    torch.testing.assert_close(V[3], torch.tensor([2.0, -1.0], dtype=torch.float64))


def test_one_step_rewriting_top1_distinct_slots():
    """Eq. 16: with top-1 retrieval and distinct slots, one write makes every read return its target."""
    torch.manual_seed(0)
    n, dk, dv, T = 16, 8, 32, 40
    layer = FwPKM(16, key_dim=dk, value_dim=dv, topk=1, n_subkeys=n, chunk_size=64, value_norm=False).double()
    state = layer.state
    # queries sitting on distinct grid points of the product keys
    ids = torch.randperm(n * n)[: T + 1]
    rows, cols = ids // n, ids % n
    sub = state["keys"][0]  # [2, n, dk/2]
    q_all = torch.cat([sub[0, rows], sub[1, cols]], -1)[None] + 1e-4 * torch.randn(1, T + 1, dk, dtype=torch.float64)
    q = q_all[:, :T]  # T + 1 tokens: q_t is paired with v_{t+1}; the last one only reads (its own slot)
    v = torch.randn(1, T + 1, dv, dtype=torch.float64)
    lk, w, idx = layer._lookup(q_all, state)
    assert idx[0, :, 0].unique().numel() == T + 1  # distinct slots: every N_read = 1
    new = layer._update(q_all, v, None, lk, w, idx, state)
    lk2, w2, idx2 = layer._lookup(q, new)
    assert torch.equal(idx2, idx[:, :T])  # top-1 keys do not move (a 1-way softmax has no gradient)
    got = gather_values(new["values"], idx2, w2)
    rel = (got - v[:, 1:]).norm() / v[:, 1:].norm()
    assert rel < 1e-4, rel


def _clustered_stream(layer: FwPKM, chunks: int, C: int, seed: int = 0) -> float:
    g = torch.Generator().manual_seed(seed)
    centers = 3.0 * torch.randn(4, layer.d_model, generator=g)
    with torch.no_grad():
        for i in range(chunks):
            if i == chunks - 16:
                layer.reset_stats()  # usage over the last 16 chunks
            pick = torch.randint(0, 4, (1, C), generator=g)
            x = centers[pick] + 0.3 * torch.randn(1, C, layer.d_model, generator=g)
            layer(x)
    return layer.stats()["usage"]


def test_addressing_loss_keeps_slots_in_use():
    """Sec. 3.3.1: on clustered queries the marginal-entropy loss spreads the keys over them."""
    cfg = dict(key_dim=16, value_dim=16, topk=4, n_subkeys=16, chunk_size=64)
    usage = {}
    for on in (True, False):
        torch.manual_seed(0)
        layer = FwPKM(32, addr_loss=on, **cfg).eval()
        usage[on] = _clustered_stream(layer, chunks=64, C=64)
    print(f"slot usage over the last 16 of 64 chunks: with addressing loss {usage[True]:.3f}, without {usage[False]:.3f}")
    assert usage[True] >= 2 * usage[False], usage


def test_fast_weights_are_buffers_not_parameters():
    layer = FwPKM(32, **layer_options("fwpkm"))
    params = {id(p) for p in layer.parameters()}
    assert all(id(t) not in params for t in layer.state.values())
    names = {n for n, _ in layer.named_buffers()}
    assert {"fast_keys", "fast_values"} <= names
    layer2 = FwPKM(32, **layer_options("fwpkm"))
    layer(torch.randn(1, 16, 32))
    layer2.load_state_dict(layer.state_dict())  # the memory travels with the weights
    torch.testing.assert_close(layer2.state["values"], layer.state["values"])


def test_per_sequence_option_keeps_sequences_apart():
    torch.manual_seed(0)
    layer = FwPKM(32, per_sequence=True, **layer_options("fwpkm"))
    x = torch.randn(2, 16, 32)
    layer.reset(2)
    y = layer(x)
    layer.reset(1)
    y0 = layer(x[:1])
    torch.testing.assert_close(y[:1], y0)  # sequence 0 is not affected by sequence 1


def test_grad_through_update_option():
    """Paper default: a write is a local update, so a later chunk's output has no gradient
    w.r.t. an earlier chunk's input; the release's option keeps the update graph."""
    cfg = layer_options("fwpkm")  # chunk 8
    for through in (False, True):
        torch.manual_seed(0)
        layer = FwPKM(32, grad_through_update=through, **cfg)
        x = torch.randn(1, 16, 32, requires_grad=True)
        layer.reset()
        layer(x)[:, 8:].sum().backward()  # the 2nd chunk reads what the 1st wrote
        reached = x.grad[:, :8].abs().sum().item()
        assert (reached > 0) == through, (through, reached)
        st = layer.state
        assert st["values"].requires_grad == through and st["keys"].requires_grad == through


def test_stats_report_usage_gates_entropy_and_trace():
    torch.manual_seed(0)
    layer = FwPKM(32, **layer_options("fwpkm"))
    layer(torch.randn(2, 16, 32))
    s = layer.stats()
    assert 0 < s["usage"] <= 1 and 0 < s["marginal_entropy/sub1"] <= 1
    assert len(s["gate_hist"]) == 10 and sum(s["gate_hist"]) == 2 * 16  # every token of the call
    assert s["gates"].shape == (2, 16)
    tr = s["trace"]  # the whole call's reads: slots, and who wrote them
    assert tr["slots"].shape == (2, 16, 2) and tr["writer_pos"].shape == (2, 16, 2)
    assert (tr["writer_pos"][:, :8] == -1).all()  # the first chunk read a memory nothing had written
    written = tr["writer_pos"][:, 8:][tr["writer_pos"][:, 8:] >= 0]
    assert written.numel() and ((written >= 1) & (written < 8)).all()  # lookahead: positions 1..7 of chunk 1


@pytest.mark.parametrize("layout", ["GDN | FwPKM@1", "GDN+SWA | PKM@0 + FwPKM@1"])
def test_fwpkm_trains_in_a_model(layout):
    torch.manual_seed(0)
    memory = {n: layer_options(n) for n in ("fwpkm", "pkm") if f" {n}@" in layout.lower().replace("+", " ")}
    model = HybridLM.from_layout(layout, **TINY_LM, memory=memory)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 50, (2, 33))
    losses = []
    for _ in range(5):
        loss = model(ids[:, :-1], targets=ids[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    fw = [m for m in model.memories() if isinstance(m, FwPKM)][0]
    assert all(id(t) not in {id(p) for p in model.parameters()} for t in fw.state.values())


def test_trained_memory_survives_save_pretrained(tmp_path):
    """The shared fast weights are part of a trained FwPKM model: they round-trip through
    save_pretrained / from_pretrained, so the reloaded model continues identically."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = HybridLM.from_layout("GDN | FwPKM@1", **TINY_LM, memory={"fwpkm": layer_options("fwpkm")}).eval()
    model(torch.randint(0, 50, (2, 24)))  # writes: the memory is no longer at its initial value
    ids = torch.randint(0, 50, (1, 16))
    model.save_pretrained(tmp_path)
    ref = model(ids).logits
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded(ids).logits, ref)


def test_n_read_counts_every_read_of_the_chunk_the_last_tokens_included():
    """Eqs. 35-36, Sec. 3.2.2: N_i^read is "the number of times value row V_i is accessed within
    the current chunk": here all three tokens read slot 0, although only A and B write."""
    layer = grid_layer(lookahead=True)
    # A -> v_B, B -> v_C; C (the chunk's last token) writes nothing but reads slot 0 too
    V = write(layer, q=[[0.0, 0.0], [0.1, 0.0], [0.0, 0.2]], v=[[9.0, 9.0], [3.0, 1.0], [-1.0, 2.0]], g=[0.5, 1.0, 1.0])
    # V0' = V0 - (1/3)[g_A (V0 - v_B) + g_B (V0 - v_C)] = (1,0) - (1/3)[(-1,-0.5) + (2,-2)] = (2/3, 5/6)
    expect = torch.tensor([[2 / 3, 5 / 6], [5, 5], [7, 7], [0, 1]], dtype=torch.float64)
    torch.testing.assert_close(V, expect, rtol=0, atol=1e-12)


def test_no_addressing_loss_key_step_is_half_the_mean_squared_error():
    """App. B "w/o addressing loss" as the release runs it (`fwpkm_addr_loss: null`,
    `mem_grad_to_values_only: false`): K <- K - η ∇_K ½·mean over pairs and features of
    g_t ||v_{t+1} - v̂_t||². Two tokens (one lookahead pair), dot scores, top-2 of 2 × 2 slots."""
    layer = FwPKM(8, key_dim=2, value_dim=2, topk=2, n_subkeys=2, chunk_size=8, score="dot",
                  addr_loss=False, value_norm=False).double()
    K1, K2 = [0.5, 0.0], [0.3, 0.0]  # 1-d sub-keys of the two halves
    keys = torch.tensor([K1, K2], dtype=torch.float64).view(1, 2, 2, 1)
    values = torch.tensor([[2.0, 0.0], [-1.0, 4.0], [5, 5], [7, 7]], dtype=torch.float64)
    layer.load_state({"keys": keys, "values": values})
    g0, t = 0.5, (1.0, 1.0)  # token 0's gate; token 1's value is the target of token 0's query
    q = torch.tensor([[[1.0, 1.0], [0.0, 3.0]]], dtype=torch.float64)
    v = torch.tensor([[[9.0, 9.0], list(t)]], dtype=torch.float64)
    state = layer.state
    new = layer._update(q, v, torch.tensor([[g0, 1.0]], dtype=torch.float64), *layer._lookup(q, state), state)
    # q_0 = (1, 1): slot scores (0,0) 0.8, (0,1) 0.5, (1,0) 0.3, (1,1) 0; top-2 = slots 0 and 1,
    # w0 = σ(0.8 - 0.5) = σ(b (K2_0 - K2_1)) with b = 1; v̂ = w0 V0 + (1 - w0) V1
    w0 = 1 / (1 + math.exp(-0.3))
    v_hat = [w0 * 2.0 + (1 - w0) * -1.0, w0 * 0.0 + (1 - w0) * 4.0]
    # L = ½ g0 Σ_d (v̂_d - t_d)² / (1 pair × 2 features); dL/dK2_0 = -dL/dK2_1 = dL/dw0 · w0 (1 - w0) · b
    dL_dw0 = 0.5 * g0 * sum((v_hat[d] - t[d]) * (values[0, d] - values[1, d]).item() for d in range(2))
    gk = dL_dw0 * w0 * (1 - w0)
    expect = torch.tensor([K1, [K2[0] - gk, K2[1] + gk]], dtype=torch.float64).view(1, 2, 2, 1)  # K1 gets none
    torch.testing.assert_close(new["keys"], expect, rtol=0, atol=1e-12)


def test_release_variant_equals_the_release_options_set_one_by_one():
    from memzoo.layers.fwpkm import VARIANTS

    cfg = dict(key_dim=16, value_dim=16, topk=2, n_subkeys=16, chunk_size=8, heads=2)
    by_hand = dict(addr_loss_weight=1.0, release_value_scale=True, grad_through_update=True, before_mixer=True,
                   pooled_entropy=True)
    assert VARIANTS["release"] == by_hand
    paper = FwPKM(32, **cfg)
    assert (paper.addr_loss_weight, paper.release_value_scale, paper.grad_through_update, paper.site,
            paper.pooled_entropy) == (10.0, False, False, "after_mixer", False)
    layers = []
    for kw in (dict(variant="release"), dict(variant="paper", **by_hand)):
        torch.manual_seed(0)
        layers.append(FwPKM(32, **cfg, **kw).train())
    x = torch.randn(2, 24, 32, requires_grad=True)
    outs = [m(x).pow(2).sum() for m in layers]
    grads = [torch.autograd.grad(o, [x, *m.parameters()]) for o, m in zip(outs, layers)]
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    for k in ("keys", "values"):
        assert torch.equal(layers[0].state[k], layers[1].state[k])
    assert layers[0].site == layers[1].site == "before_mixer"  # the block runs it before its token mixer
    # an explicit option overrides the variant (for ablations)
    assert FwPKM(32, variant="release", addr_loss_weight=10.0, **cfg).addr_loss_weight == 10.0
    with pytest.raises(ValueError, match="variant"):
        FwPKM(32, variant="authors", **cfg)


def test_pooled_entropy_is_the_entropy_of_the_head_pooled_marginal():
    """The release's addressing loss pools p̄ over heads (one marginal per sub-key set); with
    one head the two forms are the same loss."""
    cfg = dict(key_dim=4, value_dim=4, topk=2, n_subkeys=4, chunk_size=8, value_norm=False)
    torch.manual_seed(0)
    x = torch.randn(1, 8, 16)
    for heads, same in ((1, True), (2, False)):
        steps = []
        for pooled in (False, True):
            torch.manual_seed(1)
            layer = FwPKM(16, heads=heads, pooled_entropy=pooled, **cfg)
            k0 = layer.state["keys"].clone()
            with torch.no_grad():
                layer(x)
            steps.append(layer.state["keys"] - k0)
        assert torch.allclose(steps[0], steps[1], atol=1e-7) == same


@pytest.mark.parametrize("bad", [dict(topk=0), dict(chunk_size=0), dict(chunk_size=1), dict(lr=-1.0), dict(lr=0.0),
                                 dict(n_subkeys=0), dict(score="cos"), dict(addr_loss_weight=-1.0), dict(heads=0)])
def test_bad_options_are_rejected_by_name(bad):
    cfg = dict(key_dim=16, value_dim=16, topk=2, n_subkeys=16, chunk_size=8)
    cfg.update(bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        FwPKM(32, **cfg)


@pytest.mark.parametrize("per_sequence", [False, True])
def test_a_nan_in_one_sequence_reaches_no_other_sequence_and_no_later_call(per_sequence):
    torch.manual_seed(0)
    layer = FwPKM(32, per_sequence=per_sequence, **layer_options("fwpkm"))
    clean = FwPKM(32, per_sequence=per_sequence, **layer_options("fwpkm"))
    clean.load_state_dict(layer.state_dict())
    x = torch.randn(2, 24, 32)
    bad = x.clone()
    bad[0, 10, 3] = float("nan")
    with torch.no_grad():
        layer.reset(2), clean.reset(2)
        y = layer(bad)
        assert torch.isfinite(y[1]).all() and torch.isfinite(y[0, :10]).all()
        assert all(torch.isfinite(t).all() for t in layer.state.values())
        # the other sequence reads what it would have read had sequence 0 skipped token 10 (and
        # the pairs that touch it): check later clean calls stay finite everywhere
        y2 = layer(torch.randn(2, 16, 32))
        assert torch.isfinite(y2).all()
    assert not torch.isfinite(y[0, 10]).all()  # the NaN token's own output is not finite


def naive_addressing_loss(q, keys, k, score, eps, per_sequence, pooled, weight):
    """Eqs. 37-38 by the definition, densely: every sub-key scored, the top-k softmaxed and
    scattered into an n-vector per token, p̄ the mean per sub-key set, loss = -λ Σ H(p̄)."""
    B, T, H, Dk = q.shape
    K = keys if per_sequence else keys.expand(B, *keys.shape)  # [B, H, 2, n, d]
    qh = q.view(B, T, H, 2, 1, Dk // 2)
    if score == "idw":
        s = -torch.log(eps + (qh - K[:, None]).pow(2).sum(-1))  # [B, T, H, 2, n]
    else:
        s = (qh * K[:, None]).sum(-1)
    top, idx = s.detach().topk(k, -1)
    p = torch.zeros_like(s).scatter(-1, idx, torch.softmax(s.gather(-1, idx), -1))  # [B, T, H, 2, n]
    sets = []  # one p̄ per (sequence if per_sequence) (head unless pooled) half
    for b in range(B) if per_sequence else [slice(None)]:
        for h in [slice(None)] if pooled else range(H):
            for half in range(2):
                sets.append(p[b, :, h, half].reshape(-1, p.shape[-1]).mean(0))
    p_bar = torch.stack(sets)
    return -weight * (-(p_bar * torch.log(p_bar + 1e-8)).sum(-1)).sum()


@pytest.mark.parametrize("per_sequence", [False, True])
@pytest.mark.parametrize("heads,pooled", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("score", ["idw", "dot"])
def test_key_step_is_minus_lr_times_the_addressing_loss_gradient(per_sequence, heads, pooled, score):
    """Eq. 39 against autograd of the loss written densely by its definition (Eqs. 37-38)."""
    torch.manual_seed(0)
    layer = FwPKM(16, key_dim=6, value_dim=4, heads=heads, topk=3, n_subkeys=5, chunk_size=7, lr=0.5,
                  score=score, per_sequence=per_sequence, pooled_entropy=pooled).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    layer.reset(2)
    k0 = layer.state["keys"].clone()
    with torch.no_grad():
        layer(x)
        q, _, _ = layer.io.project(x)
    K = k0.clone().requires_grad_()
    loss = naive_addressing_loss(q.view(2, 7, heads, 6), K, 3, score, layer.idw_eps, per_sequence, pooled,
                                 layer.addr_loss_weight)
    (grad,) = torch.autograd.grad(loss, K)
    assert grad.abs().max() > 1e-3  # the test sees a real step
    torch.testing.assert_close(layer.state["keys"] - k0, -0.5 * grad, rtol=1e-9, atol=1e-12)
