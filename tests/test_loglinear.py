"""Log-linear Mamba-2 (Guo et al. 2025, Sec. 3) against independent references, fp64 on a CPU.

- The op as the layer runs it (memzoo/ops/log_linear_attention.py, a call per chunk of 8 over T = 21, on the
  C, B, Δx, ΔA and λ the layer's own projections give) against fla's ``naive_log_linear_attn`` (the paper's
  quadratic form (Q Kᵀ ⊙ M^S ⊙ M^H) V with fla's level masks, scale 1, from an empty prefix: fla's reference
  has no state in or out): outputs and the gradients of q, k, v, log a and λ.
- The Fenwick recurrence, a token loop written here from the paper's Fenwick recurrence (every level decays, the query reads
  Σ_ℓ λ^ℓ S^ℓᵀ q, the token and the levels below the carry merge one level up), against the paper's quadratic
  form written here from the bucket definition (t's buckets counted back from t, sizes the set bits of t):
  the decomposition equals the masked matrix. Then the op, from a nonzero state in the middle of a stream
  (levels held at n = 5) and in calls that split the tokens anywhere, against that token loop: outputs,
  final levels, and gradients of every input and of the initial levels.
- With every λ = 1 the op is Mamba-2's SSD: the shared op's recurrent reference.

Each check prints the largest difference it sees (`pytest -s`).
"""

from __future__ import annotations

import pytest
import torch

from conftest import rand_x, tiny_layer
from memzoo.ops.linear_attention import linear_attention_recurrent
from memzoo.ops.log_linear_attention import log_linear_chunk
from test_delta_rules import fp64

TOL = 1e-6
ll_naive = pytest.importorskip("fla.ops.log_linear_attn.naive")


def leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def layer_inputs(T: int = 21):
    """C, B, Δx, ΔA [B, T, H], λ [B, T, H, L] from the tiny layer's projections of a random input."""
    layer = tiny_layer("loglinear_mamba2", noise=0.05)
    x_in = rand_x(2, T)
    with torch.no_grad():
        _, x, Bm, Cm, dt, log_a = layer.project(x_in, layer.init_state(2))
        lam = layer.levels(x_in)
    return layer, Cm, Bm, dt[..., None] * x, log_a, lam


def in_calls(q, k, v, g, lam, S, pos: int, bounds):
    """The op over the tokens in calls [a, b) for consecutive bounds, carrying (S, n)."""
    outs, n = [], torch.full((k.shape[0],), pos, dtype=torch.long)
    for a, b in zip(bounds[:-1], bounds[1:]):
        o, S = log_linear_chunk(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], lam[:, a:b], S, n)
        outs.append(o)
        n = n + (b - a)
    return torch.cat(outs, dim=1), S


def check(ours, ref, inputs, what: str) -> float:
    gen = torch.Generator().manual_seed(9)
    r = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in ours]
    ga = torch.autograd.grad(sum((a * b).sum() for a, b in zip(ours, r)), inputs, retain_graph=True)
    gb = torch.autograd.grad(sum((a * b).sum() for a, b in zip(ref, r)), inputs, retain_graph=True)
    worst = 0.0
    for i, (a, b) in enumerate(zip((*ours, *ga), (*ref, *gb))):
        err = (a - b).abs().max().item()
        assert err <= TOL, f"{what}: term {i} (outputs/states first, then the input gradients) differs by {err:.3g}"
        worst = max(worst, err)
    print(f"{what}: largest difference {worst:.2e} ({len(ours)} outputs, {len(inputs)} input gradients)")
    return worst


def test_loglinear_op_matches_fla_naive_log_linear_attn():
    layer, q, k, v, g, lam = layer_inputs()
    q, k, v, g, lam = ins = leaves(q, k, v, g, lam)
    S0 = torch.zeros(2, layer.num_heads, layer.num_levels - 1, layer.d_state, layer.head_dim, dtype=torch.float64)
    o, _ = in_calls(q, k, v, g, lam, S0, 0, [0, 8, 16, 21])
    with fp64(ll_naive):
        ref = ll_naive.naive_log_linear_attn(q, k, v, g, lam, scale=1.0)
    check((o,), (ref,), ins, "log-linear op vs fla naive_log_linear_attn")


# ---- the paper's two forms, written here -----------------------------------------------------------
def buckets(t: int) -> dict[int, int]:
    """key position s < t -> its level: t's buckets counted back from t, one per set bit b of t (size 2^b,
    level b + 1), the smallest nearest t (Sec. 3's Fenwick partition of the prefix)."""
    out, end = {}, t
    for b in range(t.bit_length()):
        if (t >> b) & 1:
            for s in range(end - (1 << b), end):
                out[s] = b + 1
            end -= 1 << b
    assert end == 0
    return out


def quadratic_form(q, k, v, g, lam):
    """O = (Q Kᵀ ⊙ M^S ⊙ M^H) V from position 0: M^S_{ts} = Π_{r=s+1..t} a_r, M^H_{ts} = λ_t^{level of s for t}."""
    B, T, H, _ = q.shape
    b = g.cumsum(1)
    rows = []
    for t in range(T):
        lv = buckets(t)
        o = lam[:, t, :, 0, None] * (q[:, t] * k[:, t]).sum(-1, keepdim=True) * v[:, t]
        for s in range(t):
            w = lam[:, t, :, lv[s]] * (b[:, t] - b[:, s]).exp() * (q[:, t] * k[:, s]).sum(-1)
            o = o + w[..., None] * v[:, s]
        rows.append(o)
    return torch.stack(rows, dim=1)


def fenwick_loop(q, k, v, g, lam, S, pos: int):
    """The Fenwick recurrence a token at a time from levels S (level ℓ at index ℓ − 1) held at position pos."""
    outs = []
    for i in range(q.shape[1]):
        t = pos + i
        S = g[:, i].exp()[:, :, None, None, None] * S
        own = k[:, i, :, :, None] * v[:, i, :, None, :]
        levels = torch.cat([own[:, :, None], S], dim=2)  # level 0 (the token), then 1 .. L-1
        outs.append(torch.einsum("bhl,bhn,bhlnp->bhp", lam[:, i], q[:, i], levels))
        carry = 0
        while (t >> carry) & 1:  # t + 1 clears the trailing ones of t and sets the next bit
            carry += 1
        merged = levels[:, :, : carry + 1].sum(2)
        S = torch.cat([torch.zeros_like(S[:, :, :carry]), merged[:, :, None], S[:, :, carry + 1:]], dim=2)
    return torch.stack(outs, dim=1), S


def random_inputs(T=23, H=2, N=3, P=4, L=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(2, T, H, N), r(2, T, H, N), r(2, T, H, P)
    g = -0.4 * torch.rand(2, T, H, generator=gen, dtype=torch.float64)
    lam = 0.5 + torch.rand(2, T, H, L, generator=gen, dtype=torch.float64)
    return q, k, v, g, lam


def test_fenwick_recurrence_equals_the_papers_quadratic_form():
    q, k, v, g, lam = ins = leaves(*random_inputs())
    S0 = torch.zeros(2, 2, lam.shape[-1] - 1, 3, 4, dtype=torch.float64)
    o_loop, _ = fenwick_loop(q, k, v, g, lam, S0, 0)
    check((o_loop,), (quadratic_form(q, k, v, g, lam),), ins, "Fenwick token loop vs the quadratic form")


@pytest.mark.parametrize("bounds", [[0, 23], [0, 1, 2, 3, 10, 11, 23], [0, 8, 16, 23]])
def test_loglinear_op_matches_the_fenwick_token_loop_mid_stream(bounds):
    q, k, v, g, lam = random_inputs(seed=1)
    gen = torch.Generator().manual_seed(2)
    held = torch.randn(2, 2, 2, 3, 4, generator=gen, dtype=torch.float64)  # n = 5 = 101b: levels 1 and 3 held
    q, k, v, g, lam, held = ins = leaves(q, k, v, g, lam, held)
    # the empty levels are zeros, not inputs (a gradient there is off the states a stream can reach)
    z = torch.zeros_like(held[:, :, :1])
    S0 = torch.cat([held[:, :, :1], z, held[:, :, 1:], z, z, z], dim=2)
    ours = in_calls(q, k, v, g, lam, S0, 5, bounds)
    ref = fenwick_loop(q, k, v, g, lam, S0, 5)
    check(ours, ref, ins, f"log-linear op in calls {bounds} from n = 5 vs the Fenwick token loop")


def test_with_every_lambda_one_it_is_mamba2s_ssd():
    q, k, v, g, lam = random_inputs(seed=3)
    lam = torch.ones_like(lam)
    S0 = torch.zeros(2, 2, lam.shape[-1] - 1, 3, 4, dtype=torch.float64)
    o, S = in_calls(q, k, v, g, lam, S0, 0, [0, 5, 23])
    o_ref, h = linear_attention_recurrent(q, k, v, g)
    err = max((o - o_ref).abs().max().item(), (S.sum(2) - h).abs().max().item())
    print(f"log-linear with λ = 1 vs the SSD: largest difference {err:.2e}")
    assert err <= TOL


def test_the_state_count_is_the_levels_filled():
    layer = tiny_layer("loglinear_mamba2")
    per_level = layer.num_heads * layer.d_state * layer.head_dim
    conv = (layer.conv_size - 1) * layer.conv_dim
    for n, filled in ((1, 1), (7, 3), (8, 4), (21, 5)):
        layer.reset(2)
        with torch.no_grad():
            layer(rand_x(2, n))
        assert layer.fast_weight_numel() == filled * per_level + 1 + conv


def test_a_stream_past_its_levels_names_num_levels():
    layer = tiny_layer("loglinear_mamba2", num_levels=3)  # 2^2 - 1 = 3 tokens
    layer.reset(1)
    layer(rand_x(1, 3))
    with pytest.raises(ValueError, match="num_levels"):
        layer(rand_x(1, 1))


@pytest.mark.parametrize("opts, option", [(dict(num_levels=1), "num_levels"), (dict(head_dim=48), "head_dim"),
                                          (dict(d_state=0), "d_state")])
def test_bad_options_name_the_option(opts, option):
    from memzoo.registry import build_layer

    with pytest.raises(ValueError, match=option):
        build_layer("loglinear_mamba2", 32, **opts)
