"""Mixture-of-Memories: the layer against a naive per-token loop over its memories, the paper's
"mix the memories, then query == query each memory, then mix" (Sec. 3.3) on the layer's actual
states, the Switch load-balancing loss on a hand example, streaming at arbitrary split points,
and a training step inside HybridLM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import D, TINY_LM, layer_options, rand_x, tiny_layer
from memzoo import build_layer
from memzoo.backbone.model import HybridLM
from memzoo.layers.mom import MoM, load_balancing_loss

TOL = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def make(seed=0, dtype=torch.float64, **over) -> MoM:
    # break the symmetric small init (as the shared suite), then spread the routing
    layer = tiny_layer("mom", seed=seed, dtype=dtype, **over).eval()
    with torch.no_grad():
        layer.gate.weight.mul_(20.0)
    return layer


def random_state(layer: MoM, B: int, seed=3) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in layer.init_state(B).items()}


# ---- (1) the naive loop ---------------------------------------------------------------------------
def naive(layer: MoM, x: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
    """Token by token, from the weights alone: route; for each routed memory m (and the shared
    one) push the projections into its conv history, gate, erase, write (the gated delta rule in
    its matrix form); read q_t·(S^s + Σ_m g_m S^m); gated RMSNorm; o_proj."""
    B, T, _ = x.shape
    M, H, K, V, c = layer.num_memories, layer.num_heads, layer.head_dim, layer.head_v_dim, layer.conv_size
    st = {k: v.clone() for k, v in state.items()}
    A = layer.A_log.exp()
    ys = torch.zeros(B, T, D, dtype=x.dtype)

    def conv(hist, new, w):  # hist [c-1, C] (oldest first), new [C], w [c, C] -> conv output, new history
        window = torch.cat([hist, new[None]], 0)  # [c, C]
        return (window * w).sum(0), window[1:]

    def features(kp, vp, hk, hv):
        if c > 1:
            kp, hk = conv(hk, kp, layer.k_conv)
            vp, hv = conv(hv, vp, layer.v_conv)
        k = F.normalize(F.silu(kp).view(H, K), dim=-1)
        v = F.silu(vp).view(H, V)
        return k, v, hk, hv

    def delta_step(S, k, v, beta, logalpha):  # S [H, K, V]: S ← α S (I - β k kᵀ) + β v kᵀ (transposed)
        out = torch.empty_like(S)
        for h in range(H):
            Sh = logalpha[h].exp() * S[h]
            Sh = (torch.eye(K, dtype=S.dtype) - beta[h] * torch.outer(k[h], k[h])) @ Sh
            out[h] = Sh + beta[h] * torch.outer(k[h], v[h])
        return out

    for b in range(B):
        for t in range(T):
            xt = x[b, t]
            p = torch.softmax(layer.gate.weight @ xt, -1)
            top = torch.topk(p, layer.topk).indices.tolist()
            w = {m: p[m] / p[top].sum() for m in top}
            q = F.normalize(F.silu(layer.q_proj.weight @ xt).view(H, K), dim=-1) * K ** -0.5
            o = torch.zeros(H, V, dtype=x.dtype)
            for m in top:  # only the routed memories change
                hk = st["conv_k"][b, m] if c > 1 else None
                hv = st["conv_v"][b, m] if c > 1 else None
                k, v, hk, hv = features(layer.k_proj[m] @ xt, layer.v_proj[m] @ xt, hk, hv)
                if c > 1:
                    st["conv_k"][b, m], st["conv_v"][b, m] = hk, hv
                beta = torch.sigmoid(layer.b_proj[m] @ xt)
                la = -A * F.softplus(layer.a_proj[m] @ xt + layer.dt_bias)
                st["S"][b, m] = delta_step(st["S"][b, m], k, v, beta, la)
                o = o + w[m] * torch.einsum("hk,hkv->hv", q, st["S"][b, m])
            if layer.shared_memory:
                hk = st["conv_k_shared"][b] if c > 1 else None
                hv = st["conv_v_shared"][b] if c > 1 else None
                k, v, hk, hv = features(layer.shared_k.weight @ xt, layer.shared_v.weight @ xt, hk, hv)
                if c > 1:
                    st["conv_k_shared"][b], st["conv_v_shared"][b] = hk, hv
                beta = torch.sigmoid(layer.shared_b.weight @ xt)
                la = -A * F.softplus(layer.shared_a.weight @ xt + layer.dt_bias)
                st["S_shared"][b] = delta_step(st["S_shared"][b], k, v, beta, la)
                o = o + torch.einsum("hk,hkv->hv", q, st["S_shared"][b])
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.eps) * layer.o_norm_weight
            gate = F.silu(layer.g_proj.weight @ xt).view(H, V)
            ys[b, t] = layer.o_proj.weight @ (o * gate).reshape(-1)
    return ys, st


@pytest.mark.parametrize(
    "over",
    [{}, {"shared_memory": False}, {"conv_size": 0}, {"topk": 1}, {"expand_v": 2.0, "conv_size": 3},
     {"num_memories": 3, "topk": 3}],
    ids=["default", "no-shared", "no-conv", "top1", "expand_v2", "all-routed"],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_layer_matches_naive_loop(over, dtype):
    layer = make(dtype=dtype, **over)
    layer.parallel_chunk = 5  # several chunks per memory inside the op
    x = rand_x(2, 19, dtype=dtype)
    s0 = random_state(layer, 2)
    with torch.no_grad():
        y, s = layer.forward_state(x, {k: v.clone() for k, v in s0.items()})
        y_ref, s_ref = naive(layer, x, s0)
        _, _, routed = layer.route(x)
    n = routed.sum(1)  # tokens per (sequence, memory): the routing really is sparse and spread
    if layer.topk < layer.num_memories:
        assert (n > 0).float().mean() > 0.7 and (n < 19).all(), n
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    assert set(s) == set(s_ref)
    for k in s:
        torch.testing.assert_close(s[k], s_ref[k], **TOL[dtype], msg=lambda m, k=k: f"state[{k!r}]: {m}")


def test_compiled_path_pads_every_memory_to_the_sequence_and_agrees(monkeypatch):
    """Under torch.compile every memory's routed subsequence is padded to T (a static shape), not
    to the busiest memory's count: the naive loop's outputs and states still come out. The path
    is taken here in eager mode, by answering is_compiling() with True (a compile takes minutes)."""
    layer = make()
    layer.parallel_chunk = 5
    x = rand_x(2, 19, dtype=torch.float64)
    s0 = random_state(layer, 2)
    lengths = []
    real = layer._run.__func__.__globals__["gated_delta_rule"]
    monkeypatch.setitem(layer._run.__func__.__globals__, "gated_delta_rule",
                        lambda q, *a, **kw: lengths.append(q.shape[1]) or real(q, *a, **kw))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.no_grad():
        y, s = layer.forward_state(x, {k: v.clone() for k, v in s0.items()})
    y_ref, s_ref = naive(layer, x, s0)
    assert lengths == [19, 19]  # the routed memories (padded to T) and the shared one
    torch.testing.assert_close(y, y_ref, **TOL[torch.float64])
    for k in s:
        torch.testing.assert_close(s[k], s_ref[k], **TOL[torch.float64])


def test_unrouted_memories_stay_unchanged():
    layer = make()
    x = rand_x(1, 1)
    s0 = random_state(layer, 1)
    s1 = layer.write_state(x, {k: v.clone() for k, v in s0.items()})
    routed = layer.route(x)[2][0, 0]
    for m in range(layer.num_memories):
        same = torch.equal(s1["S"][0, m], s0["S"][0, m]) and torch.equal(s1["conv_k"][0, m], s0["conv_k"][0, m])
        assert same != bool(routed[m]), f"memory {m}: routed={bool(routed[m])}, changed={not same}"
    assert not torch.equal(s1["S_shared"], s0["S_shared"])


# ---- (2) mixing memories before the query == querying each, then mixing ---------------------------
def test_mixing_then_query_equals_query_then_mixing():
    """Sec. 3.3 (Eq. 8-9, 13): q_t·(S^s + Σ_m g_m S^m) == q_t·S^s + Σ_m g_m (q_t·S^m), on the
    layer's own states: after every token of a forward (the parallel gather/scatter path) and
    for reads of fresh queries."""
    layer = make()
    x = rand_x(2, 17)
    with torch.no_grad():
        o_fwd, _ = layer._run(x, layer.init_state(2), with_output=True)  # query each memory, then mix
        state = layer.init_state(2)
        for t in range(x.shape[1]):  # the states the forward passes through
            state = layer.write_state(x[:, t : t + 1], state)
            xt = x[:, t : t + 1]
            q = layer._query(xt) * layer.scale
            mixed = torch.einsum("bthk,bthkv->bthv", q, layer.mixed_memory(xt, state))  # mix, then query
            torch.testing.assert_close(o_fwd[:, t : t + 1], mixed, rtol=1e-10, atol=1e-12)
            # the same mixture spelled out from the raw state tensors
            w = layer.route(xt)[1]
            M_tilde = state["S_shared"][:, None] + torch.einsum("btm,bmhkv->bthkv", w, state["S"])
            torch.testing.assert_close(layer.mixed_memory(xt, state), M_tilde, rtol=1e-12, atol=1e-14)

        xq = rand_x(2, 9, seed=5)  # fresh queries against the final memories
        q = layer._query(xq) * layer.scale
        mixed = torch.einsum("bthk,bthkv->bthv", q, layer.mixed_memory(xq, state))
        torch.testing.assert_close(layer.read_heads(xq, state), mixed, rtol=1e-10, atol=1e-12)


# ---- (3) the load-balancing loss -----------------------------------------------------------------
P_HAND = torch.tensor([[0.4, 0.3, 0.2, 0.1],   # top-2 {0, 1}
                       [0.1, 0.2, 0.3, 0.4],   # {3, 2}
                       [0.5, 0.1, 0.3, 0.1],   # {0, 2}
                       [0.6, 0.1, 0.1, 0.2]],  # {0, 3}
                      dtype=torch.float64)
# f = (3, 1, 2, 2) / 4, P = column means (0.4, 0.175, 0.225, 0.2):
# M Σ f P = 4 (0.75·0.4 + 0.25·0.175 + 0.5·0.225 + 0.5·0.2) = 4 · 0.55625 = 2.225
HAND_LOSS = 2.225


def test_load_balancing_loss_hand_example():
    logits = P_HAND.log()
    torch.testing.assert_close(load_balancing_loss(logits, topk=2), torch.tensor(HAND_LOSS, dtype=torch.float64))
    torch.testing.assert_close(load_balancing_loss(logits[None] + 3.0, topk=2),  # batched, shift-invariant
                               torch.tensor(HAND_LOSS, dtype=torch.float64))
    # uniform router: f sums to k and P = 1/M, so the loss is exactly k (its minimum)
    assert load_balancing_loss(torch.zeros(5, 4, dtype=torch.float64), topk=2).item() == pytest.approx(2.0)
    # top-1, all tokens to memory 0 with probability 1: M · 1 · 1 = M
    assert load_balancing_loss(torch.tensor([[50.0, 0, 0, 0]] * 3, dtype=torch.float64), 1).item() == \
        pytest.approx(4.0)


def test_forward_sets_weighted_aux_loss_in_training_only():
    layer = make()
    with torch.no_grad():  # router logits of token t = W_g[:, t] = log p_t (x_t = e_t)
        layer.gate.weight.zero_()
        layer.gate.weight[:, :4] = P_HAND.log().T
    x = torch.zeros(1, 4, D, dtype=torch.float64)
    x[0, torch.arange(4), torch.arange(4)] = 1.0
    layer.train().reset(1)
    layer(x)
    torch.testing.assert_close(layer.aux_loss, torch.tensor(0.01 * HAND_LOSS, dtype=torch.float64))
    layer.aux_loss.backward()
    assert layer.gate.weight.grad.abs().sum() > 0  # P_m is differentiable: the loss trains the router
    layer.eval().reset(1)
    layer(x)
    assert layer.aux_loss is None


# ---- (4) streaming -------------------------------------------------------------------------------
@pytest.mark.parametrize("over", [{}, {"conv_size": 0, "shared_memory": False}], ids=["default", "bare"])
def test_streaming_at_arbitrary_splits(over):
    layer = make(**over)
    layer.parallel_chunk = 4
    T = 41
    x = rand_x(3, T)
    with torch.no_grad():
        layer.reset(3)
        y_full = layer(x)
        s_full = {k: v.clone() for k, v in layer.state.items()}
        gen = torch.Generator().manual_seed(0)
        plans = [[0, 1, 2, 3, 4, 5, 6], [0, 0, 7], [1, 40], [17]]
        plans += [sorted(torch.randint(0, T + 1, (5,), generator=gen).tolist()) for _ in range(4)]
        for cuts in plans:
            layer.reset(3)
            bounds = [0, *cuts, T]
            y = torch.cat([layer(x[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
            torch.testing.assert_close(y, y_full, rtol=1e-9, atol=1e-11, msg=lambda m, c=cuts: f"cuts {c}: {m}")
            for k, v in layer.state.items():
                torch.testing.assert_close(v, s_full[k], rtol=1e-9, atol=1e-11)
        layer.reset(3)  # write alone reaches the same memories
        layer.write(x)
        for k, v in layer.state.items():
            torch.testing.assert_close(v, s_full[k], rtol=1e-9, atol=1e-11)


def test_options_and_errors():
    with pytest.raises(ValueError, match="topk"):
        build_layer("mom", D, num_memories=2, topk=3)
    with pytest.raises(ValueError, match="num_heads"):
        build_layer("mom", 30, num_heads=4)
    with pytest.raises(ValueError, match="unknown option"):
        build_layer("mom", D, experts=4)
    layer = build_layer("mom", 64)  # the paper's defaults
    assert (layer.num_memories, layer.topk, layer.shared_memory, layer.aux_loss_weight) == (4, 2, True, 0.01)
    layer.reset(2)
    layer(torch.randn(2, 9, 64))
    s = layer.stats()
    assert sum(s[f"usage/mem{m}"] for m in range(4)) == pytest.approx(2.0)  # each token: top-2
    assert layer.fast_weight_numel() == sum(v[0].numel() for v in layer.state.values())


# ---- (5) in the backbone ------------------------------------------------------------------------
def test_mom_trains_in_hybrid_lm():
    torch.manual_seed(0)
    model = HybridLM.from_layout("GDN | MoM@1", **TINY_LM, memory={"mom": layer_options("mom")}).train()
    mom = [m for m in model.memories() if isinstance(m, MoM)]
    assert len(mom) == 1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 50, (2, 33))
    losses = []
    for _ in range(4):
        out = model(ids[:, :-1], targets=ids[:, 1:])
        assert out.aux_loss is not None and out.aux_loss.item() > 0
        torch.testing.assert_close(out.aux_loss, mom[0].aux_loss)
        lm = F.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten())
        torch.testing.assert_close(out.loss, lm + out.aux_loss)
        opt.zero_grad()
        out.loss.backward()
        assert mom[0].gate.weight.grad.abs().sum() > 0
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0]
    model.eval()
    assert model(ids[:, :-1], targets=ids[:, 1:]).aux_loss is None
