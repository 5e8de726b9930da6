"""The delta-rule memories against independent references, in fp64 on a CPU.

Each layer's recurrence, run as the layer runs it (its `scan`: the chunked torch op over several
chunks, from a nonzero initial state), against fla's pure-torch reference of the same rule
(`fla.ops.*.naive`), or, for RWKV-7, a token loop written here from the paper's Eq. 17 in its own
[V, K] layout: the outputs, the final state, and the gradients of both with respect to every slow
weight, to 1e-6. fla's naive references cast to fp32 (`.float()`, `torch.float32`); `fp64` runs
them with those casts redirected to fp64, so the comparison is not bounded by fp32 rounding.

The memories' projections (keys, values, β, decays) come from the layer's own methods on both
sides; what is checked is the write rule and the read, which is what the papers' equations define.
The papers' own equations for the decays are written out here where the rule needs them.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from conftest import rand_x, tiny_layer

TOL = 1e-6
fla_naive = {name: pytest.importorskip(f"fla.ops.{name}.naive")
             for name in ("delta_rule", "gated_delta_rule", "gated_delta_product", "kda")}


class _Fp64Torch:
    """`torch`, with the names fla's naive references cast to (torch.float, torch.float32) meaning fp64."""

    float = float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def fp64(module):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "torch", _Fp64Torch())
        mp.setattr(torch.Tensor, "float", torch.Tensor.double)
        yield


def layer_and_state(name: str, T: int = 21, **over):
    """A tiny fp64 layer (chunks of 4 in its op: several chunks and a ragged tail), x [2, T, 32] and
    a state whose S is nonzero."""
    layer = tiny_layer(name, noise=0.05, **over)
    layer.parallel_chunk = 4
    layer.reset(2)
    state = {k: v.clone() for k, v in layer.state.items()}
    state["S"] = 0.3 * torch.randn(state["S"].shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    return layer, rand_x(2, T), state


def compare(layer, ours, ref, what: str) -> float:
    """The largest difference of (o, S) and of the gradients of a fixed random projection of them
    with respect to every slow weight; asserts each is within TOL; returns the largest."""
    gen = torch.Generator().manual_seed(9)
    ro, rs = (torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in ours)
    params = [p for p in layer.parameters()]
    worst = 0.0
    grads = []
    for o, S in (ours, ref):
        loss = (o * ro).sum() + (S * rs).sum()
        grads.append(torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True))
    for a, b, part in zip(ours, ref, ("o", "final state")):
        err = (a - b).abs().max().item()
        assert err <= TOL, f"{what}: {part} differs by {err:.3g}"
        worst = max(worst, err)
    for (n, _), ga, gb in zip(layer.named_parameters(), *grads):
        if ga is None and gb is None:
            continue
        ga = torch.zeros_like(gb) if ga is None else ga
        gb = torch.zeros_like(ga) if gb is None else gb
        err = (ga - gb).abs().max().item()
        assert err <= TOL, f"{what}: gradient of {n} differs by {err:.3g}"
        worst = max(worst, err)
    print(f"{what}: largest difference {worst:.2e} (o, final state, {len(params)} gradients)")
    return worst


def test_deltanet_matches_fla_naive_delta_rule():
    layer, x, state = layer_and_state("deltanet")
    o, new = layer.scan(x, state, layer.query(x))
    k, v = layer.keys_values(x, state, {})
    t = lambda u: u.transpose(1, 2)  # noqa: E731  fla's naive takes [B, H, T, *]
    with fp64(fla_naive["delta_rule"]):
        o_ref, S_ref = fla_naive["delta_rule"].delta_rule_recurrence(
            t(layer.query(x)), t(k), t(v), t(layer.beta(x)), initial_state=state["S"], output_final_state=True)
    compare(layer, (o, new["S"]), (t(o_ref), S_ref), "deltanet vs fla delta_rule_recurrence")


def test_gated_deltanet_matches_fla_naive_gated_delta_rule():
    layer, x, state = layer_and_state("gated_deltanet")
    o, new = layer.scan(x, state, layer.query(x))
    k, v = layer.keys_values(x, state, {})
    # the decay of Eq. 10 as the paper (Mamba-2's) parametrises it
    g = -layer.A_log.exp() * F.softplus(layer.a_proj(x) + layer.dt_bias)
    with fp64(fla_naive["gated_delta_rule"]):
        o_ref, S_ref = fla_naive["gated_delta_rule"].naive_recurrent_gated_delta_rule(
            layer.query(x), k, v, layer.beta(x), g, scale=layer.scale, initial_state=state["S"], output_final_state=True)
    compare(layer, (o, new["S"]), (o_ref, S_ref), "gated_deltanet vs fla naive_recurrent_gated_delta_rule")


@pytest.mark.parametrize("forget_gate", [False, True])
@pytest.mark.parametrize("n_h", [1, 3])
def test_deltaproduct_matches_fla_naive_gated_delta_product(n_h, forget_gate):
    layer, x, state = layer_and_state("deltaproduct", num_householder=n_h, forget_gate=forget_gate)
    o, new = layer.scan(x, state, layer.query(x))
    k, v, beta = layer.steps(x, state, {})
    g = -layer.A_log.exp() * F.softplus(layer.a_proj(x) + layer.dt_bias) if forget_gate else None
    with fp64(fla_naive["gated_delta_product"]):
        o_ref, S_ref = fla_naive["gated_delta_product"].naive_recurrent_gated_delta_product(
            layer.query(x), k, v, g, beta, scale=layer.scale, initial_state=state["S"], output_final_state=True,
            num_householder=n_h)
    compare(layer, (o, new["S"]), (o_ref, S_ref),
            f"deltaproduct (n_h {n_h}, forget gate {forget_gate}) vs fla naive_recurrent_gated_delta_product")


def test_kda_matches_fla_naive_kda():
    layer, x, state = layer_and_state("kda")
    o, new = layer.scan(x, state, layer.query(x))
    k, v = layer.keys_values(x, state, {})
    # the channel-wise decay of Sec. 3.2 (fla's naive_kda_gate): −exp(A_log) softplus(f + dt_bias)
    f = layer.f_proj(x).unflatten(-1, (layer.num_heads, layer.head_dim)) + layer.dt_bias.view(layer.num_heads, -1)
    g = -layer.A_log.exp()[:, None] * F.softplus(f)
    with fp64(fla_naive["kda"]):
        o_ref, S_ref = fla_naive["kda"].naive_recurrent_kda(
            layer.query(x), k, v, g, layer.beta(x), scale=layer.scale, initial_state=state["S"], output_final_state=True)
    compare(layer, (o, new["S"]), (o_ref, S_ref), "kda vs fla naive_recurrent_kda")


def test_rwkv7_matches_the_papers_recurrence():
    """Eq. 17 and the read of Eq. 19 as the paper writes them, S ∈ R^{V×K} (rows: values), r, κ̂, a,
    k̃ row vectors: S_t = S_{t-1} (diag(w_t) − κ̂_tᵀ (a_t ⊙ κ̂_t)) + v_tᵀ k̃_t, o_t = S_t r_tᵀ;
    w_t = exp(−e^{−1/2} σ(d_t)) (Eq. 13), a_t = σ(·) (Eq. 11), κ̂ = L2(k ⊙ ξ) (Eq. 14),
    k̃ = k ⊙ (1 + (a − 1) ⊙ α) (Eq. 15)."""
    layer, x, state = layer_and_state("rwkv7")
    r = layer.query(x)
    o, new = layer.scan(x, state, r)
    heads = lambda u: u.unflatten(-1, (layer.num_heads, layer.head_dim))  # noqa: E731
    k, v = heads(layer.k_proj(x)), heads(layer.v_proj(x))
    w = torch.exp(-torch.exp(torch.tensor(-0.5, dtype=torch.float64)) * torch.sigmoid(heads(layer.w_lora(x))))
    a = torch.sigmoid(heads(layer.a_lora(x)))
    kk = F.normalize(k * heads(layer.k_k), dim=-1)
    kt = k * (1 + (a - 1) * heads(layer.k_a))
    S = state["S"].transpose(-1, -2)  # [B, H, V, K]
    outs = []
    for t in range(x.shape[1]):
        trans = torch.diag_embed(w[:, t]) - kk[:, t, ..., :, None] * (a[:, t] * kk[:, t])[..., None, :]
        S = S @ trans + v[:, t, ..., :, None] * kt[:, t, ..., None, :]
        outs.append((S @ r[:, t, ..., None])[..., 0])
    compare(layer, (o, new["S"]), (torch.stack(outs, 1), S.transpose(-1, -2)), "rwkv7 vs Eq. 17 token by token")


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet", "deltaproduct", "kda", "rwkv7"])
def test_the_chunk_length_does_not_change_the_result(name):
    """The chunked op's chunk (parallel_chunk) is an implementation detail: 1, 4 and 64 agree."""
    layer, x, state = layer_and_state(name, T=13)
    runs = []
    for c in (1, 4, 64):
        layer.parallel_chunk = c
        runs.append(layer.forward_state(x, state))
    for y, st in runs[1:]:
        torch.testing.assert_close(y, runs[0][0], rtol=0, atol=1e-10)
        torch.testing.assert_close(st["S"], runs[0][1]["S"], rtol=0, atol=1e-10)


def test_deltaproduct_with_one_step_is_deltanet():
    """n_h = 1 is DeltaNet (Siems et al. Sec. 3): the same weights give the same layer."""
    dp = tiny_layer("deltaproduct", num_householder=1, forget_gate=False)
    dn = tiny_layer("deltanet", options={"num_heads": 2, "head_dim": 16})
    dn.load_state_dict(dp.state_dict())
    x = rand_x(2, 11)
    torch.testing.assert_close(dp(x), dn(x), rtol=0, atol=1e-12)


def test_rwkv7_decay_stays_in_its_range():
    """w_t ∈ (e^{−e^{−1/2}}, 1) ≈ (0.545, 1) for any input (Eq. 13)."""
    layer = tiny_layer("rwkv7")
    gk = layer.keys(100 * rand_x(2, 9))["gk"]
    assert (gk.exp() > 0.545).all() and (gk.exp() < 1).all()


@pytest.mark.parametrize("op", ["gated_delta_rule", "dplr_delta_rule"])
def test_the_delta_rule_replaces_the_value_at_a_key(op):
    """The family's defining property, on both ops: writing (k, v1) then (k, v2) with β = 1 and no
    decay leaves the memory returning v2 at k, not v1 + v2 (as a Hebbian write would)."""
    from memzoo.ops.dplr_delta_rule import dplr_delta_rule
    from memzoo.ops.gated_delta_rule import gated_delta_rule

    K = V = 8
    k = F.normalize(torch.randn(1, 1, 1, K, dtype=torch.float64), dim=-1).expand(1, 2, 1, K)
    v = torch.randn(1, 2, 1, V, dtype=torch.float64)
    if op == "dplr_delta_rule":  # a = k, b = −k: β = 1
        _, S = dplr_delta_rule(k, k, v, k, -k, torch.zeros_like(k), output_final_state=True)
    else:
        zero, one = torch.zeros(1, 2, 1, dtype=torch.float64), torch.ones(1, 2, 1, dtype=torch.float64)
        _, S = gated_delta_rule(k, k, v, zero, one, output_final_state=True)
    torch.testing.assert_close(torch.einsum("k,kv->v", k[0, 0, 0], S[0, 0]), v[0, 1, 0])
