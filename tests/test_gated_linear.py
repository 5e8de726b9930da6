"""The gated linear-attention memories (Mamba-2, GLA, RetNet, HGRN-2, GSA) against independent references, in fp64
on a CPU.

Each layer's recurrence, run as the layer runs it (the chunked op of memzoo/ops/linear_attention.py,
chunks of 4 over a ragged length, from a nonzero initial state, on the keys, values, queries and
decays the layer's own projections give), against fla's pure-torch reference of the same rule: the
outputs, the final state, and the gradients of the queries, keys, values, decays and the initial
state, to 1e-6. fla's references cast to fp32; `fp64` (tests/test_delta_rules.py) redirects those
casts to fp64. Where fla's reference differs from the paper, a token loop of the paper's equation,
written here, is checked as well. Each check prints the largest difference it sees (`pytest -s`).

- Mamba-2's SSD (Dao & Gu 2024, Eq. 1a-1b with a scalar A per head) is fla's ``simple_gla`` with
  q = C, k = B, v = Δ x, g = Δ A and no scale: ``naive_recurrent_simple_gla(scale=1)``. The whole
  block (projection, short convolution, Δ, the SSD, D, the gated RMSNorm) is checked besides against
  fla's ``Mamba2.torch_forward`` with the layer's weights copied in.
- GLA (Yang et al. 2024, Sec. 4.1): ``naive_recurrent_gla`` reads with q / √K; the paper's o_t = S_tᵀ q_t
  has no scale. The layer folds fla's 1/√K into its query; the token loop of Sec. 4.1's recurrence checks the op
  without the scale.
- RetNet (Sun et al. 2023, Eq. 6): fla's ``naive_retention`` is the parallel form from the zero state
  (no state in or out, γ fixed inside it); the token loop of Eq. 6 checks the state and the decay.
- HGRN-2 (Qin et al. 2024, Eq. 3) is GLA's recurrence with the key 1 − f_t: ``naive_recurrent_gla``, which
  reads with q / √K as fla's HGRN-2 layer does (GLA's ops' default scale); the paper's y_t = o_t · h_t has
  no scale, so a token loop of Eq. 3 checks the op without it, and the tie k_t = 1 − f_t. The whole block
  besides against fla's ``HGRN2Attention`` with the layer's weights.
- GSA (Zhang et al. 2024, Sec. 3): the two passes as the layer runs them (the chunked op, the first pass
  with its decay per value channel) against fla's ``naive_recurrent_gsa`` (scale 1, as fla's layer), both
  states included; a token loop of the paper's K̃, Ṽ and o_t = Ṽᵀ softmax(K̃ q) in its own [m, K] layout; the
  whole block against fla's ``GatedSlotAttention``.
- The chunked op with a decay per key channel, and with one per value channel (alone and beside a decay per
  head or per key channel), against the op's own recurrent reference (the op's two forms must agree; the
  recurrent form is in turn checked against fla above), at several chunk lengths, with strong decays.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from conftest import rand_x, tiny_layer
from memzoo.ops.linear_attention import (
    linear_attention_chunked,
    linear_attention_final_state,
    linear_attention_recurrent,
)
from test_delta_rules import fp64

TOL = 1e-6
simple_gla = pytest.importorskip("fla.ops.simple_gla.naive")
gla_naive = pytest.importorskip("fla.ops.gla.naive")


def leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def check(ours, ref, inputs, what: str) -> float:
    """The largest difference of (o, S) (or (o, S, S'): GSA's two states) and of the gradients of a fixed random
    projection of them with respect to every input; asserts each within TOL; returns (and prints) the largest."""
    gen = torch.Generator().manual_seed(9)
    rand = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in ours]
    grads = [torch.autograd.grad(sum((t * r).sum() for t, r in zip(out, rand)), inputs, retain_graph=True)
             for out in (ours, ref)]
    worst = 0.0
    for a, b, part in zip(ours, ref, ["o", "final state"] + [f"final state {i}" for i in range(2, len(ours))]):
        err = (a - b).abs().max().item()
        assert err <= TOL, f"{what}: {part} differs by {err:.3g}"
        worst = max(worst, err)
    for i, (ga, gb) in enumerate(zip(*grads)):
        err = (ga - gb).abs().max().item()
        assert err <= TOL, f"{what}: gradient of input {i} differs by {err:.3g}"
        worst = max(worst, err)
    print(f"{what}: largest difference {worst:.2e} (o, final state, {len(inputs)} input gradients)")
    return worst


def initial_state(layer, B: int = 2) -> dict:
    state = layer.init_state(B)
    state["S"] = 0.3 * torch.randn(state["S"].shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    return state


# ---- Mamba-2 ------------------------------------------------------------------------------------
def test_mamba2_ssd_matches_fla_naive_simple_gla():
    """The SSD recurrence h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t x_tᵀ, y_t = C_tᵀ h_t (Eq. 1a-1b without the
    skip) as the layer runs it (chunks of 4, T = 21) against fla's scalar-gated recurrence, scale 1."""
    layer = tiny_layer("mamba2", noise=0.05)
    state = initial_state(layer)
    with torch.no_grad():
        _, x, Bm, Cm, dt, log_a = layer.project(rand_x(2, 21), state)
    q, k, v, g, S0 = leaves(Cm, Bm, dt[..., None] * x, log_a, state["S"])
    ours = linear_attention_chunked(q, k, v, g, S0, chunk_size=4)
    with fp64(simple_gla):
        o, S = simple_gla.naive_recurrent_simple_gla(q, k, v, g, scale=1.0, initial_state=S0)
    check(ours, (o, S), [q, k, v, g, S0], "mamba2 SSD vs fla naive_recurrent_simple_gla")
    # the write alone (what `write` runs): the final-state form
    S_w = linear_attention_final_state(k, v, g, S0)
    assert (S_w - S).abs().max().item() <= TOL


def test_mamba2_block_matches_fla_torch_forward():
    """The whole block (Sec. 7.1): W_in, the short convolution with bias, Δ = softplus(· + dt_bias),
    the SSD, D x, RMSNorm(y ⊙ silu(z)) over E·D, W_out, against fla's ``Mamba2.torch_forward`` (its
    chunked SSD at chunks of 4) with the layer's weights; the Triton-only pieces of fla's layer (its
    SiLU, its gated RMSNorm) replaced by fla's own torch references (F.silu, ``rms_norm_ref``).
    Output, final SSM state, and the gradients of every slow weight shared by both."""
    fla_mamba2 = pytest.importorskip("fla.layers.mamba2")
    from fla.modules.norm.layernorm_gated import rms_norm_ref

    layer = tiny_layer("mamba2", noise=0.05)
    with torch.no_grad():  # away from their inits, so that every term is seen
        layer.D.normal_(generator=torch.Generator().manual_seed(1))
        layer.norm_weight.add_(0.3 * torch.randn(layer.inner, generator=torch.Generator().manual_seed(2),
                                                 dtype=torch.float64))
        layer.conv_bias.normal_(generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            ref = fla_mamba2.Mamba2(hidden_size=32, head_dim=layer.head_dim, state_size=layer.d_state,
                                    expand=layer.expand, conv_kernel=layer.conv_size, chunk_size=4).double()
        finally:
            logging.disable(logging.NOTSET)
    ref.act = torch.nn.functional.silu
    norm = ref.norm
    norm.forward = lambda y, z: rms_norm_ref(y, norm.weight, None, z=z, eps=norm.eps, group_size=norm.group_size,
                                             norm_before_gate=norm.norm_before_gate, upcast=False)
    with torch.no_grad():
        for theirs, ours in ((ref.in_proj.weight, layer.in_proj.weight), (ref.conv1d.bias, layer.conv_bias),
                             (ref.dt_bias, layer.dt_bias), (ref.A_log, layer.A_log), (ref.D, layer.D),
                             (ref.norm.weight, layer.norm_weight), (ref.out_proj.weight, layer.out_proj.weight)):
            theirs.copy_(ours)
        ref.conv1d.weight.copy_(layer.conv_weight.t()[:, None])
    x = rand_x(2, 21)
    y, st = layer.forward_state(x, layer.init_state(2))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "float", torch.Tensor.double)
        y_ref, _, S_ref = ref.torch_forward(x)
    S_ref = S_ref.transpose(-1, -2)  # fla's [H, P, N] -> the op's [key N, value P]
    gen = torch.Generator().manual_seed(9)
    ry, rs = torch.randn(y.shape, generator=gen, dtype=torch.float64), torch.randn(S_ref.shape, generator=gen,
                                                                                   dtype=torch.float64)
    ours_p = [layer.in_proj.weight, layer.conv_bias, layer.dt_bias, layer.A_log, layer.D, layer.norm_weight,
              layer.out_proj.weight, layer.conv_weight]
    theirs_p = [ref.in_proj.weight, ref.conv1d.bias, ref.dt_bias, ref.A_log, ref.D, ref.norm.weight,
                ref.out_proj.weight, ref.conv1d.weight]
    g_ours = torch.autograd.grad((y * ry).sum() + (st["S"] * rs).sum(), ours_p)
    g_ref = list(torch.autograd.grad((y_ref * ry).sum() + (S_ref * rs).sum(), theirs_p))
    g_ref[-1] = g_ref[-1][:, 0].t()
    worst = max((y - y_ref).abs().max().item(), (st["S"] - S_ref).abs().max().item())
    assert worst <= TOL, f"mamba2 block vs fla torch_forward: output/state differ by {worst:.3g}"
    for a, b, n in zip(g_ours, g_ref, ("in_proj", "conv_bias", "dt_bias", "A_log", "D", "norm", "out_proj", "conv")):
        err = (a - b).abs().max().item()
        assert err <= TOL, f"mamba2 block vs fla torch_forward: gradient of {n} differs by {err:.3g}"
        worst = max(worst, err)
    print(f"mamba2 block vs fla Mamba2.torch_forward: largest difference {worst:.2e} (y, h, 8 gradients)")


def test_mamba2_read_is_the_papers_output_from_the_memory_before():
    """y_t = C_tᵀ h_t + D x_t (Eq. 1b) with h_t = a_t h_{t-1} + Δ_t B_t x_tᵀ (Eq. 1a), in a token loop
    written here, equals the layer's read of x_t from h_{t-1} (its read carries the token's own term)."""
    layer = tiny_layer("mamba2", noise=0.05)
    state = initial_state(layer)
    x_in = rand_x(2, 1)
    _, x, Bm, Cm, dt, log_a = layer.project(x_in, state)
    h = log_a[:, 0].exp()[..., None, None] * state["S"] + dt[:, 0, :, None, None] * Bm[:, 0, :, :, None] * x[:, 0, :, None, :]
    y = torch.einsum("bhn,bhnp->bhp", Cm[:, 0], h) + layer.D[:, None] * x[:, 0]
    z = layer.project(x_in, state)[0]
    want = layer.output(y[:, None], z, x_in)
    err = (layer.read_state(x_in, state) - want).abs().max().item()
    print(f"mamba2 read vs the paper's Eq. 1a-1b token: largest difference {err:.2e}")
    assert err <= TOL


# ---- GLA ----------------------------------------------------------------------------------------
def gla_inputs(T: int = 21):
    layer = tiny_layer("gla", noise=0.05)
    state = initial_state(layer)
    x = rand_x(2, T)
    with torch.no_grad():
        q = layer.heads(layer.q_proj(x), layer.head_dim)
        k, v, log_alpha = layer.keys_values(x)
    return layer, state, q, k, v, log_alpha


def test_gla_matches_fla_naive_recurrent_gla():
    """S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ, o_t = S_tᵀ q_t / √K, as the layer runs it (its query carries
    the 1/√K; chunks of 4, T = 21), against fla's ``naive_recurrent_gla`` (which scales q by K^-½)."""
    layer, state, q, k, v, g = gla_inputs()
    q, k, v, g, S0 = leaves(q, k, v, g, state["S"])
    ours = linear_attention_chunked(layer.scale * q, k, v, g, S0, chunk_size=4)
    with fp64(gla_naive):
        o, S = gla_naive.naive_recurrent_gla(q, k, v, g, initial_state=S0, output_final_state=True)
    check(ours, (o, S), [q, k, v, g, S0], "gla vs fla naive_recurrent_gla")
    S_w = linear_attention_final_state(k, v, g, S0)
    assert (S_w - S).abs().max().item() <= TOL


def test_gla_matches_the_papers_recurrence_token_loop():
    """fla's reference scales the read by 1/√K; the paper's recurrence (Sec. 4.1) does not: o_t = S_tᵀ q_t with
    S_t = (α_t 1ᵀ) ⊙ S_{t-1} + k_t v_tᵀ, as a token loop here, against the op on unscaled queries,
    and the decay α_t = sigmoid(W_α2 W_α1 x_t + b_α)^{1/τ} (Sec. 4.4) written out."""
    layer, state, q, k, v, g = gla_inputs()
    x = rand_x(2, 21)
    with torch.no_grad():
        alpha = torch.sigmoid(layer.gk_proj[1](layer.gk_proj[0](x))) ** (1 / 16)
    torch.testing.assert_close(g.exp(), alpha.unflatten(-1, (layer.num_heads, layer.head_dim)), rtol=1e-12, atol=1e-12)
    q, k, v, g, S0 = leaves(q, k, v, g, state["S"])
    S, outs = S0, []
    for t in range(q.shape[1]):
        S = g[:, t].exp()[..., None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    ref = (torch.stack(outs, dim=1), S)
    check(linear_attention_chunked(q, k, v, g, S0, chunk_size=4), ref, [q, k, v, g, S0], "gla vs the paper's Sec. 4.1 recurrence")


# ---- the op with a decay per key channel ------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_chunked_per_key_decay_matches_the_recurrence(chunk):
    """Decays per key channel down to exp(−6) a token (products of decays far below fp64's range over
    a chunk would overflow a factorised form; the op's per-pair differences never do)."""
    gen = torch.Generator().manual_seed(chunk)
    B, T, H, K, V = 2, 19, 2, 5, 3
    q, k, v = (torch.randn(B, T, H, d, generator=gen, dtype=torch.float64) for d in (K, K, V))
    g = -6 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    q, k, v, g, S0 = leaves(q, k, v, g, S0)
    check(linear_attention_chunked(q, k, v, g, S0, chunk_size=chunk), linear_attention_recurrent(q, k, v, g, S0),
          [q, k, v, g, S0], f"chunked (C={chunk}) vs recurrent, decay per key channel")
    S_w = linear_attention_final_state(k, v, g, S0)
    assert (S_w - linear_attention_recurrent(q, k, v, g, S0)[1]).abs().max().item() <= TOL


def test_a_decay_per_key_channel_equal_across_channels_is_the_per_head_decay():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 10, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    g = -torch.rand(1, 10, 2, generator=gen, dtype=torch.float64)
    gk = g[..., None].expand(1, 10, 2, 4)
    for fn in (linear_attention_recurrent, lambda *a: linear_attention_chunked(*a, chunk_size=4)):
        for a, b in zip(fn(q, k, v, g), fn(q, k, v, gk)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_a_bad_decay_shape_names_the_shapes():
    q = torch.zeros(1, 3, 2, 4)
    with pytest.raises(ValueError, match=r"log_decay must be \[B, T, H\]"):
        linear_attention_recurrent(q, q, q, torch.zeros(1, 3, 2, 5))


# ---- options ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, opts, option", [
    ("mamba2", dict(head_dim=48), "head_dim"), ("mamba2", dict(d_state=0), "d_state"),
    ("mamba2", dict(conv_size=-1), "conv_size"), ("mamba2", dict(expand=0), "expand"),
    ("gla", dict(num_heads=3), "expand_k"), ("gla", dict(gate_logit_normalizer=0), "gate_logit_normalizer"),
    ("gla", dict(gate_low_rank_dim=0), "gate_low_rank_dim"), ("gla", dict(norm_eps=0), "norm_eps"),
    ("retnet", dict(num_heads=3), "expand_k"), ("retnet", dict(num_heads=32), "expand_k"),
    ("retnet", dict(rope_theta=0), "rope_theta"),
    ("hgrn2", dict(expand_ratio=0), "expand_ratio"), ("hgrn2", dict(expand_ratio=5), "expand_ratio"),
    ("hgrn2", dict(num_heads=3), "num_heads"), ("hgrn2", dict(expand_ratio=16, norm_eps=0), "norm_eps"),
    ("gsa", dict(num_slots=0), "num_slots"), ("gsa", dict(num_heads=3), "expand_k"),
    ("gsa", dict(expand_v=0.1), "expand_v"), ("gsa", dict(gate_logit_normalizer=0), "gate_logit_normalizer"),
])
def test_bad_options_name_the_option(name, opts, option):
    from memzoo.registry import build_layer

    with pytest.raises(ValueError, match=option):
        build_layer(name, 32, **opts)


# ---- RetNet -------------------------------------------------------------------------------------
retention = pytest.importorskip("fla.ops.retention.naive")


def retnet_inputs(T: int = 21):
    layer = tiny_layer("retnet", noise=0.05)
    state = layer.init_state(2)
    x = rand_x(2, T)
    with torch.no_grad():
        k, v, g = layer.keys_values(x, state)
        q = layer.rotate(layer.q_proj(x), layer.positions(x, state))
    return layer, state, q, k, v, g


def test_retnet_decays_are_the_papers():
    """γ_h = 1 − 2^{−5−h} (Sec. 2.2), the same as fla's naive_retention computes them."""
    layer = tiny_layer("retnet", num_heads=4)
    want = 1 - 2.0 ** (-5 - torch.arange(4, dtype=torch.float64))
    torch.testing.assert_close(layer.log_gamma.exp(), want, rtol=0, atol=1e-15)


def test_retnet_matches_fla_naive_retention():
    """The retention of the rotated queries and keys as the layer runs it (chunks of 4, T = 21, from the
    zero state) against fla's parallel ``naive_retention`` (q scaled by K^-½, γ_h its own): outputs and
    the gradients of q, k, v. fla's reference has no initial or final state and a fixed decay: the state
    and the decay's gradient are checked by the token loop of the paper's Eq. 6 below."""
    layer, state, q, k, v, g = retnet_inputs()
    q, k, v = leaves(q, k, v)
    o, _ = linear_attention_chunked(layer.scale * q, k, v, g, state["S"], chunk_size=4)
    with fp64(retention):
        ref = retention.naive_retention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    gen = torch.Generator().manual_seed(9)
    r = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    worst = (o - ref).abs().max().item()
    assert worst <= TOL, f"retnet vs fla naive_retention: o differs by {worst:.3g}"
    for a, b in zip(torch.autograd.grad((o * r).sum(), [q, k, v]), torch.autograd.grad((ref * r).sum(), [q, k, v])):
        err = (a - b).abs().max().item()
        assert err <= TOL, f"retnet vs fla naive_retention: a gradient differs by {err:.3g}"
        worst = max(worst, err)
    print(f"retnet vs fla naive_retention: largest difference {worst:.2e} (o, 3 input gradients)")


def test_retnet_matches_the_papers_eq6_token_loop():
    """S_n = γ S_{n-1} + K_nᵀ V_n, o_n = Q_n S_n / √K (Eq. 6, fla's scale), a token loop here, from a
    nonzero state, against the op the layer runs: outputs, final state, gradients of q, k, v, log γ, S_0."""
    layer, state, q, k, v, g = retnet_inputs()
    S0 = initial_state(layer)["S"]
    q, k, v, g, S0 = leaves(q, k, v, g, S0)
    S, outs = S0, []
    for n in range(q.shape[1]):
        S = g[:, n].exp()[..., None, None] * S + k[:, n, :, :, None] * v[:, n, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", layer.scale * q[:, n], S))
    check(linear_attention_chunked(layer.scale * q, k, v, g, S0, chunk_size=4), (torch.stack(outs, dim=1), S),
          [q, k, v, g, S0], "retnet vs the paper's Eq. 6")


def test_retnet_rotation_is_relative():
    """Q_n K_mᵀ depends on n − m only (Eq. 5): a write and a read shifted by the same offset read the same."""
    layer = tiny_layer("retnet", noise=0.05)
    x = rand_x(2, 6)
    outs = []
    for start in (0, 37):
        state = layer.init_state(2)
        state["pos"] += start
        outs.append(layer.forward_state(x, state)[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-12)


# ---- the op with a decay per value channel ------------------------------------------------------
@pytest.mark.parametrize("rows", ["none", "per head", "per key"])
@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_chunked_per_value_decay_matches_the_recurrence(chunk, rows):
    """S_t = Diag(α_t) S_{t-1} Diag(β_t) + k_t v_tᵀ, β_t down to exp(−6) a token, chunked against the op's
    token loop; the final-state form too."""
    gen = torch.Generator().manual_seed(10 + chunk)
    B, T, H, K, V = 2, 19, 2, 5, 3
    q, k, v = (torch.randn(B, T, H, d, generator=gen, dtype=torch.float64) for d in (K, K, V))
    gv = -6 * torch.rand(B, T, H, V, generator=gen, dtype=torch.float64)
    g = {"none": None, "per head": -torch.rand(B, T, H, generator=gen, dtype=torch.float64),
         "per key": -3 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)}[rows]
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    q, k, v, gv, S0 = leaves(q, k, v, gv, S0)
    ref = linear_attention_recurrent(q, k, v, g, S0, log_decay_v=gv)
    check(linear_attention_chunked(q, k, v, g, S0, chunk_size=chunk, log_decay_v=gv), ref, [q, k, v, gv, S0],
          f"chunked (C={chunk}) vs recurrent, decay per value channel, rows {rows}")
    assert (linear_attention_final_state(k, v, g, S0, log_decay_v=gv) - ref[1]).abs().max().item() <= TOL


def test_the_recurrent_per_value_decay_scales_the_states_columns():
    """One token from S_0 with k = v = 0: S_1 = S_0 Diag(β) exactly (the columns, not the rows)."""
    gen = torch.Generator().manual_seed(3)
    S0 = torch.randn(1, 1, 3, 4, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, 1, 1, 4, generator=gen, dtype=torch.float64)
    zk, zv = torch.zeros(1, 1, 1, 3, dtype=torch.float64), torch.zeros(1, 1, 1, 4, dtype=torch.float64)
    _, S1 = linear_attention_recurrent(zk, zk, zv, None, S0, log_decay_v=beta.log())
    torch.testing.assert_close(S1, S0 * beta[0, 0, 0], rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match=r"log_decay_v must be \[B, T, H, V\]"):
        linear_attention_recurrent(zk, zk, zv, None, S0, log_decay_v=beta[..., :3].log())


# ---- HGRN-2 -------------------------------------------------------------------------------------
def hgrn2_inputs(T: int = 21):
    layer = tiny_layer("hgrn2", noise=0.05)
    state = initial_state(layer)
    x = rand_x(2, T)
    with torch.no_grad():
        o_gate = torch.nn.functional.silu(layer.heads(layer.q_proj(x), layer.head_dim))
        k, v, log_f = layer.keys_values(x)
    return layer, state, x, o_gate, k, v, log_f


def test_hgrn2_matches_fla_naive_recurrent_gla():
    """h_t = Diag(f_t) h_{t-1} + (1 − f_t) i_tᵀ, y_t = hᵀ o_t / √K as the layer runs it (chunks of 4, T = 21,
    its query carrying the 1/√K) against fla's ``naive_recurrent_gla`` (which scales q by K^-½, the scale of
    the GLA op that fla's HGRN-2 layer calls) on q = o_t, k = 1 − f_t, v = i_t, g = log f_t."""
    layer, state, _, q, k, v, g = hgrn2_inputs()
    q, k, v, g, S0 = leaves(q, k, v, g, state["S"])
    ours = linear_attention_chunked(layer.scale * q, k, v, g, S0, chunk_size=4)
    with fp64(gla_naive):
        o, S = gla_naive.naive_recurrent_gla(q, k, v, g, initial_state=S0, output_final_state=True)
    check(ours, (o, S), [q, k, v, g, S0], "hgrn2 vs fla naive_recurrent_gla")
    assert (linear_attention_final_state(k, v, g, S0) - S).abs().max().item() <= TOL


def test_hgrn2_matches_the_papers_eq3_token_loop():
    """The key is 1 − f_t with f_t = sigmoid(W_f x_t), the query o_t = swish(W_o x_t), the value i_t = W_i x_t
    (written out here); Eq. 3's h_t = Diag(f_t) h_{t-1} + (1 − f_t) ⊗ i_t, y_t = o_t · h_t (no scale: fla's
    1/√K is the layer's query's) as a token loop, against the op on the unscaled query."""
    layer, state, x, q, k, v, g = hgrn2_inputs()
    with torch.no_grad():
        f = torch.sigmoid(layer.f_proj(x)).unflatten(-1, (layer.num_heads, layer.head_dim))
        i = layer.i_proj(x).unflatten(-1, (layer.num_heads, layer.head_v_dim))
        o_gate = layer.q_proj(x) * torch.sigmoid(layer.q_proj(x))
    torch.testing.assert_close(k, 1 - f, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g.exp(), f, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v, i, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.query(x) * layer.head_dim ** 0.5, o_gate.unflatten(-1, (layer.num_heads, -1)),
                               rtol=1e-12, atol=1e-12)
    q, k, v, g, S0 = leaves(q, k, v, g, state["S"])
    h, outs = S0, []
    for t in range(q.shape[1]):
        h = g[:, t].exp()[..., None] * h + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], h))
    check(linear_attention_chunked(q, k, v, g, S0, chunk_size=4), (torch.stack(outs, dim=1), h), [q, k, v, g, S0],
          "hgrn2 vs the paper's Eq. 3")


def _quiet_fla_layer(build):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            return build().double()
        finally:
            logging.disable(logging.NOTSET)


def _block_check(layer, ref, pairs, x, run_ref, what: str) -> float:
    """y of the layer's forward against fla's layer's (from the zero state), and the gradients of the input
    and of every slow weight (pairs: ours, theirs) of a fixed random projection of y."""
    x = x.clone().requires_grad_(True)
    xr = x.detach().clone().requires_grad_(True)
    y, _ = layer.forward_state(x, layer.init_state(x.shape[0]))
    y_ref = run_ref(xr)
    r = torch.randn(y.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ours, theirs = [x] + [a for a, _ in pairs], [xr] + [b for _, b in pairs]
    g_ours = torch.autograd.grad((y * r).sum(), ours)
    g_ref = torch.autograd.grad((y_ref * r).sum(), theirs)
    worst = (y - y_ref).abs().max().item()
    assert worst <= TOL, f"{what}: y differs by {worst:.3g}"
    for i, (a, b) in enumerate(zip(g_ours, g_ref)):
        err = (a - b).abs().max().item()
        assert err <= TOL, f"{what}: gradient {i} (0 = x) differs by {err:.3g}"
        worst = max(worst, err)
    print(f"{what}: largest difference {worst:.2e} (y, {len(g_ours)} gradients)")
    return worst


def _rms_norm_linear_ref(x, norm_weight, norm_bias, linear_weight, linear_bias, eps=1e-5, **_):
    from fla.modules.norm.layernorm import rms_norm_ref

    return torch.nn.functional.linear(rms_norm_ref(x, norm_weight, norm_bias, eps=eps), linear_weight, linear_bias)


def test_hgrn2_block_matches_fla_layer():
    """The whole block (W_o, W_f, W_i, swish, the key 1 − f, the op, RMSNorm over the width, W_out) against fla's
    ``HGRN2Attention`` with the layer's weights, its Triton pieces replaced by fla's torch references
    (``naive_recurrent_gla``, ``rms_norm_ref``, F.silu for its swish): y and the gradients of x and every weight."""
    fla_hgrn2 = pytest.importorskip("fla.layers.hgrn2")
    layer = tiny_layer("hgrn2", noise=0.05)
    layer.parallel_chunk = 4
    with torch.no_grad():
        layer.g_norm_weight.add_(0.3 * torch.randn(layer.d_model, generator=torch.Generator().manual_seed(2),
                                                   dtype=torch.float64))
    ref = _quiet_fla_layer(lambda: fla_hgrn2.HGRN2Attention(mode="fused_recurrent", hidden_size=32,
                                                            expand_ratio=layer.head_dim, layer_idx=0))
    pairs = [(layer.q_proj.weight, ref.q_proj.weight), (layer.f_proj.weight, ref.f_proj.weight),
             (layer.i_proj.weight, ref.i_proj.weight), (layer.g_norm_weight, ref.g_norm.weight),
             (layer.o_proj.weight, ref.o_proj.weight)]
    with torch.no_grad():
        for ours, theirs in pairs:
            theirs.copy_(ours)

    def naive(q, k, v, gk, initial_state=None, output_final_state=False, **_):
        with fp64(gla_naive):
            return gla_naive.naive_recurrent_gla(q, k, v, gk, initial_state=initial_state,
                                                 output_final_state=output_final_state)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fla_hgrn2, "fused_recurrent_gla", naive)
        mp.setattr(fla_hgrn2, "swish", torch.nn.functional.silu)
        mp.setattr(fla_hgrn2, "rms_norm_linear", _rms_norm_linear_ref)
        _block_check(layer, ref, pairs, rand_x(2, 21), lambda x: ref(x)[0], "hgrn2 block vs fla HGRN2Attention")


# ---- GSA ----------------------------------------------------------------------------------------
gsa_naive = pytest.importorskip("fla.ops.gsa.naive")


def gsa_inputs(T: int = 21):
    layer = tiny_layer("gsa", noise=0.05)
    state = layer.init_state(2)
    gen = torch.Generator().manual_seed(5)
    for name in ("Sk", "Sv"):
        state[name] = 0.3 * torch.randn(state[name].shape, generator=gen, dtype=torch.float64)
    x = rand_x(2, T)
    with torch.no_grad():
        q = layer.query(x)
        k, v, s, log_alpha = layer.keys_values(x)
    return layer, state, x, q, k, v, s, log_alpha


def test_gsa_matches_fla_naive_recurrent_gsa():
    """The two passes as the layer runs them (``gsa_chunked``: the op at chunks of 4, T = 21, from nonzero
    K̃ᵀ and Ṽ) against fla's ``naive_recurrent_gsa`` with scale 1 (fla's layer's): the outputs, both final
    states, and the gradients of q, k, v, 1 − α, log α and both initial states."""
    from memzoo.ops.gsa import gsa_chunked

    _, state, _, q, k, v, s, g = gsa_inputs()
    q, k, v, s, g, Sk, Sv = leaves(q, k, v, s, g, state["Sk"], state["Sv"])
    ours = gsa_chunked(q, k, v, s, g, Sk, Sv, chunk_size=4)
    with fp64(gsa_naive):
        o, (hk, hv) = gsa_naive.naive_recurrent_gsa(q, k, v, s, g, scale=1.0, initial_state=(Sk, Sv),
                                                    output_final_state=True)
    check(ours, (o, hk, hv), [q, k, v, s, g, Sk, Sv], "gsa vs fla naive_recurrent_gsa")


def test_gsa_matches_the_papers_token_loop():
    """Sec. 3 in the paper's layout, a token loop here: K̃_t = Diag(α_t) K̃_{t-1} + (1 − α_t) ⊗ k_t ∈ R^{m×K},
    Ṽ_t = Diag(α_t) Ṽ_{t-1} + (1 − α_t) ⊗ v_t ∈ R^{m×V}, o_t = Ṽ_tᵀ softmax(K̃_t q_t), with α_t =
    sigmoid(W_α x_t)^{1/τ} (τ = 8) and q, k, v = swish(W x) written out; against the layer's ``gsa_chunked``
    (its K̃ᵀ compared transposed), and the layer's read of x_t after its write."""
    from memzoo.ops.gsa import gsa_chunked

    layer, state, x, q, k, v, s, g = gsa_inputs()
    with torch.no_grad():
        alpha = torch.sigmoid(layer.f_proj(x)).unflatten(-1, (layer.num_heads, layer.num_slots)) ** (1 / 8)
        sw = {n: (lambda u: u * torch.sigmoid(u))(getattr(layer, n)(x)).unflatten(-1, (layer.num_heads, -1))
              for n in ("q_proj", "k_proj", "v_proj")}
    torch.testing.assert_close(g.exp(), alpha, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s, 1 - alpha, rtol=1e-12, atol=1e-12)
    for a, n in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")):
        torch.testing.assert_close(a, sw[n], rtol=1e-12, atol=1e-12)
    q, k, v, s, g, Sk, Sv = leaves(q, k, v, s, g, state["Sk"], state["Sv"])
    Kt, Vt, outs = Sk.transpose(-1, -2), Sv, []
    for t in range(q.shape[1]):
        a = g[:, t].exp()[..., None]  # [B, H, m, 1]
        Kt = a * Kt + s[:, t, :, :, None] * k[:, t, :, None, :]
        Vt = a * Vt + s[:, t, :, :, None] * v[:, t, :, None, :]
        p = torch.einsum("bhmk,bhk->bhm", Kt, q[:, t]).softmax(-1)
        outs.append(torch.einsum("bhmv,bhm->bhv", Vt, p))
    o, Sk_T, Sv_T = gsa_chunked(q, k, v, s, g, Sk, Sv, chunk_size=4)
    check((o, Sk_T.transpose(-1, -2), Sv_T), (torch.stack(outs, dim=1), Kt, Vt), [q, k, v, s, g, Sk, Sv],
          "gsa vs the paper's Sec. 3 recurrence")
    # the verbs: writing x then reading it is the paper's o_T through the layer's output
    with torch.no_grad():
        st = layer.write_state(x, {n: t.detach() for n, t in state.items()})
        want = layer.output(outs[-1].detach()[:, None], x[:, -1:])
        err = (layer.read_state(x[:, -1:], st) - want).abs().max().item()
    assert err <= TOL, f"gsa: read after write differs from the paper's o_T by {err:.3g}"


def test_gsa_block_matches_fla_layer():
    """The whole block (W_q, W_k, W_v with swish, W_α at τ = 8, the two passes, RMSNorm(swish(o)), W_O) against
    fla's ``GatedSlotAttention`` with the layer's weights, its Triton pieces replaced by fla's torch references
    (``naive_recurrent_gsa``, ``rms_norm_ref``, F.silu for its swish feature map): y and the gradients of x and
    every weight."""
    fla_gsa = pytest.importorskip("fla.layers.gsa")
    import fla.modules.feature_map as fm

    layer = tiny_layer("gsa", noise=0.05)
    layer.parallel_chunk = 4
    with torch.no_grad():
        layer.g_norm_weight.add_(0.3 * torch.randn(layer.value_dim, generator=torch.Generator().manual_seed(2),
                                                   dtype=torch.float64))
    ref = _quiet_fla_layer(lambda: fla_gsa.GatedSlotAttention(
        mode="chunk", hidden_size=32, num_heads=layer.num_heads, num_slots=layer.num_slots, layer_idx=0))
    pairs = [(layer.q_proj.weight, ref.q_proj.weight), (layer.k_proj.weight, ref.k_proj.weight),
             (layer.v_proj.weight, ref.v_proj.weight), (layer.f_proj.weight, ref.f_proj.weight),
             (layer.g_norm_weight, ref.g_norm.weight), (layer.o_proj.weight, ref.o_proj.weight)]
    with torch.no_grad():
        for ours, theirs in pairs:
            theirs.copy_(ours)

    def naive(q, k, v, s, g, initial_state=None, output_final_state=False, scale=None, **_):
        with fp64(gsa_naive):
            return gsa_naive.naive_recurrent_gsa(q, k, v, s, g, scale=scale, initial_state=initial_state,
                                                 output_final_state=output_final_state)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fla_gsa, "fused_recurrent_gsa", naive)
        mp.setattr(fm, "swish", torch.nn.functional.silu)
        mp.setattr(fla_gsa, "rms_norm_linear", _rms_norm_linear_ref)
        _block_check(layer, ref, pairs, rand_x(2, 21), lambda x: ref(x)[0], "gsa block vs fla GatedSlotAttention")
