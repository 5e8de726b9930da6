"""MesaNet (von Oswald et al. 2025, the Mesa rule, Eq. 5) against independent references, fp64 on a CPU.

- The op as the layer runs it (memzoo/ops/mesa.py: the chunked op at chunks of 8, T = 20, from a nonzero
  (H_0, G_0), on the q, k, v, β, γ, λ the layer's own projections give) against fla's
  ``naive_mesa_net_CG`` at the same number of conjugate-gradient steps (fla's ε = 1e-5, x_0 = 0): the
  outputs and final states, and the gradients of the final states. fla's reference differentiates
  through its iterations; the layer (as fla's kernel, ``chunk_mesa_cg_bwd``) takes the implicit gradient of
  the solve, which equals the exact solve's once the iteration has converged: the gradients through the
  solve are checked against the exact solve below, not against the unrolled iterations.
- Where the conjugate gradient has converged (ε = 0, the textbook iteration, 2K steps: exact after K in
  exact arithmetic; fla's ε stalls the iteration near a residual of √ε), against fla's
  ``naive_mesa_net_exact`` (``torch.linalg.solve`` per token): outputs, final states and the gradients of
  q, k, v, β, log γ, λ, H_0 (as a symmetric matrix: the state every write builds) and G_0.
- The whole block against a token loop of the paper's Eq. 5 written here (exact solve), from the layer's
  weights: the projections, convolutions, L2 norms, strengths, λ, the RMSNorm and W_O written out;
  outputs and the gradients of every slow weight. And the layer's read of x_t from the memory before t
  (its one-step unrolled read) against the same loop's output at t.

Each check prints the largest difference it sees (`pytest -s`).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from conftest import rand_x, tiny_layer
from memzoo.ops.mesa import conjugate_gradient, mesa_chunked
from test_delta_rules import fp64 as fp64_casts

TOL = 1e-6
mesa_naive = pytest.importorskip("fla.ops.mesa_net.naive")


@contextlib.contextmanager
def fp64(module):
    """fla's casts to fp32 redirected to fp64 (tests/test_delta_rules.py), and its `torch.zeros` without a
    dtype made fp64 too (the default dtype, restored after)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with fp64_casts(module):
            yield
    finally:
        torch.set_default_dtype(default)


def leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def inputs(T: int = 20, seed: int = 5):
    """The layer (2 heads of 16), and q, k, v, β, log γ, λ from its projections; a nonzero symmetric
    positive semi-definite H_0 and a G_0."""
    layer = tiny_layer("mesanet", noise=0.05)
    state = layer.init_state(2)
    with torch.no_grad():
        q, k, v, beta, g = layer.project(rand_x(2, T), state)
        lam = layer.lam()
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(2, 2, 16, 16, generator=gen, dtype=torch.float64)
    H0 = 0.1 * A @ A.transpose(-1, -2)
    G0 = 0.3 * torch.randn(2, 2, 16, 16, generator=gen, dtype=torch.float64)
    return layer, q, k, v, beta, g, lam, H0, G0


def largest(a, b, what: str) -> float:
    err = (a - b).abs().max().item()
    assert err <= TOL, f"{what} differs by {err:.3g}"
    return err


@pytest.mark.parametrize("steps", [3, 30])
def test_mesanet_op_matches_fla_naive_cg(steps):
    _, q, k, v, beta, g, lam, H0, G0 = inputs()
    q, k, v, beta, g, lam, H0, G0 = ins = leaves(q, k, v, beta, g, lam, H0, G0)
    o, H, G = mesa_chunked(q, k, v, beta, g, lam, H0, G0, steps, chunk_size=8)
    with fp64(mesa_naive):
        o_r, H_r, G_r = mesa_naive.naive_mesa_net_CG(q, k, v, g, lam, beta, chunk_size=4, max_CG_iteration=steps,
                                                     h_kk_init=H0, h_kv_init=G0)
    worst = max(largest(o, o_r, "o"), largest(H, H_r, "H_T"), largest(G, G_r, "G_T"))
    gen = torch.Generator().manual_seed(9)
    rh, rg = torch.randn(H.shape, generator=gen, dtype=torch.float64), torch.randn(G.shape, generator=gen,
                                                                                     dtype=torch.float64)
    sel = [k, v, beta, g, H0, G0]
    ga = torch.autograd.grad((H * rh).sum() + (G * rg).sum(), sel, retain_graph=True)
    gb = torch.autograd.grad((H_r * rh).sum() + (G_r * rg).sum(), sel)
    for a, b, n in zip(ga, gb, ("k", "v", "beta", "log gamma", "H0", "G0")):
        worst = max(worst, largest(a, b, f"gradient of {n} through the states"))
    print(f"mesanet op vs fla naive_mesa_net_CG ({steps} steps): largest difference {worst:.2e} (o, H_T, G_T, "
          f"6 state gradients)")


def test_mesanet_op_matches_fla_exact_solve_where_cg_converged():
    _, q, k, v, beta, g, lam, H0, G0 = inputs()
    q, k, v, beta, g, lam, M, G0 = ins = leaves(q, k, v, beta, g, lam, H0, G0)
    H0 = (M + M.transpose(-1, -2)) / 2  # a symmetric H_0: its gradient is the symmetric part of either's
    o, H, G = mesa_chunked(q, k, v, beta, g, lam, H0, G0, steps=32, chunk_size=8, eps=0.0)
    with fp64(mesa_naive):
        o_r, H_r, G_r = mesa_naive.naive_mesa_net_exact(q, k, v, g, lam, beta, h_kk_init=H0, h_kv_init=G0)
    worst = max(largest(o, o_r, "o"), largest(H, H_r, "H_T"), largest(G, G_r, "G_T"))
    gen = torch.Generator().manual_seed(9)
    r = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (o, H, G)]
    ga = torch.autograd.grad(sum((a * b).sum() for a, b in zip((o, H, G), r)), ins, retain_graph=True)
    gb = torch.autograd.grad(sum((a * b).sum() for a, b in zip((o_r, H_r, G_r), r)), ins)
    for a, b, n in zip(ga, gb, ("q", "k", "v", "beta", "log gamma", "lambda", "H0", "G0")):
        worst = max(worst, largest(a, b, f"gradient of {n}"))
    print(f"mesanet op (CG converged) vs fla naive_mesa_net_exact: largest difference {worst:.2e} "
          f"(o, H_T, G_T, 8 input gradients)")


def test_conjugate_gradient_is_fla_decoding_cg_from_zero():
    """The iteration itself against the lines of fla's one-step decoding solve, written here from x_0 = 0 (fla's
    training kernel's start; its decoding starts from q / (diag H + λ)): the same H, 5 steps, ε = 1e-5."""
    gen = torch.Generator().manual_seed(3)
    A = torch.randn(2, 3, 8, 8, generator=gen, dtype=torch.float64)
    Hm = A @ A.transpose(-1, -2)
    lam = 0.5 + torch.rand(3, 8, generator=gen, dtype=torch.float64)
    b = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64)
    x = conjugate_gradient(lambda p: torch.einsum("bhij,bhi->bhj", Hm, p) + lam * p, b, steps=5)
    # the update lines of fla's ``naive_mesa_net_decoding_one_step``, from x_0 = 0
    xr = torch.zeros_like(b)
    r = b - (xr.unsqueeze(-1) * Hm).sum(-2) - lam * xr
    p, delta = r.clone(), (r * r).sum(-1)
    for _ in range(5):
        qv = (p.unsqueeze(-1) * Hm).sum(-2) + lam * p
        alpha = delta / ((p * qv).sum(-1) + 1e-5)
        xr = xr + alpha[..., None] * p
        r = r - alpha[..., None] * qv
        dn = (r * r).sum(-1)
        p = r + (dn / (delta + 1e-5))[..., None] * p
        delta = dn
    err = (x - xr).abs().max().item()
    print(f"conjugate_gradient vs fla's CG lines from x_0 = 0: largest difference {err:.2e}")
    assert err <= 1e-12


# ---- the whole block against the paper's Eq. 5, written here ---------------------------------------
def paper_block(layer, x, steps_state=None):
    """y_t = W_O RMSNorm(G_tᵀ (H_t + Λ)^{-1} q_t) with H_t = γ_t H_{t-1} + β_t k_t k_tᵀ, G_t = γ_t G_{t-1} +
    β_t k_t v_tᵀ (Eq. 5) from zero; q, k = L2(silu(causal conv(W x))), v = W_v x, β = σ(W_β x + b_β),
    γ = σ(W_γ x + b_γ), λ = softplus(λ̃) + λ_min; every piece from the layer's weights."""
    Hh, K, c = layer.num_heads, layer.head_dim, layer.conv_size

    def conv(u, w):  # w [c, C] taps first: y_t = Σ_j w_j u_{t-c+1+j}
        up = F.pad(u, (0, 0, c - 1, 0))
        return F.conv1d(up.transpose(1, 2), w.t()[:, None], groups=u.shape[-1]).transpose(1, 2)

    q = F.normalize(F.silu(conv(x @ layer.q_proj.weight.T, layer.q_conv)).unflatten(-1, (Hh, K)), dim=-1)
    k = F.normalize(F.silu(conv(x @ layer.k_proj.weight.T, layer.k_conv)).unflatten(-1, (Hh, K)), dim=-1)
    v = (x @ layer.v_proj.weight.T).unflatten(-1, (Hh, K))
    beta = torch.sigmoid(x @ layer.b_proj.weight.T + layer.b_proj.bias)
    gamma = torch.sigmoid(x @ layer.a_proj.weight.T + layer.a_proj.bias)
    lam = (F.softplus(layer.lambda_params) + layer.lambda_lower_bound).view(Hh, K)
    B, T = x.shape[:2]
    H = x.new_zeros(B, Hh, K, K)
    G = x.new_zeros(B, Hh, K, K)  # G_t = Σ v kᵀ as the paper writes it: [V, K]
    outs = []
    for t in range(T):
        H = gamma[:, t, :, None, None] * H + beta[:, t, :, None, None] * k[:, t, :, :, None] * k[:, t, :, None, :]
        G = gamma[:, t, :, None, None] * G + beta[:, t, :, None, None] * v[:, t, :, :, None] * k[:, t, :, None, :]
        q_star = torch.linalg.solve(H + torch.diag_embed(lam), q[:, t])
        outs.append(torch.einsum("bhvk,bhk->bhv", G, q_star))
    o = torch.stack(outs, dim=1)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.eps) * layer.o_norm_weight
    return o.flatten(-2) @ layer.o_proj.weight.T


def converged(layer):
    layer.cg_eps, layer.max_cg_steps = 0.0, 2 * layer.head_dim  # the textbook iteration, run to convergence
    return layer


def test_mesanet_block_matches_the_papers_eq5_token_loop():
    layer = converged(tiny_layer("mesanet", noise=0.05))
    layer.parallel_chunk = 8
    x = rand_x(2, 21)
    y, _ = layer.forward_state(x, layer.init_state(2))
    y_ref = paper_block(layer, x)
    worst = largest(y, y_ref, "y")
    gen = torch.Generator().manual_seed(9)
    r = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    params = [p for _, p in layer.named_parameters()]
    for (n, _), a, b in zip(layer.named_parameters(), torch.autograd.grad((y * r).sum(), params),
                            torch.autograd.grad((y_ref * r).sum(), params)):
        worst = max(worst, largest(a, b, f"gradient of {n}"))
    print(f"mesanet block vs the paper's Eq. 5 token loop: largest difference {worst:.2e} (y, {len(params)} "
          "slow-weight gradients)")


def test_mesanet_read_is_the_papers_output_from_the_memory_before():
    """The layer's read of x_t from the state after x_<t (its one-step unrolled read: the memory so far
    plus x_t's own write, the convolution continuing) is the paper's output at t."""
    layer = converged(tiny_layer("mesanet", noise=0.05))
    x = rand_x(2, 9)
    y_ref = paper_block(layer, x)
    state = layer.write_state(x[:, :8], layer.init_state(2))
    err = largest(layer.read_state(x[:, 8:], state), y_ref[:, 8:], "read of x_8")
    print(f"mesanet read vs the paper's Eq. 5 at t: largest difference {err:.2e}")


@pytest.mark.parametrize("opts, option", [
    (dict(num_heads=0), "num_heads"), (dict(head_dim=0), "head_dim"), (dict(conv_size=-1), "conv_size"),
    (dict(norm_eps=0), "norm_eps"), (dict(lambda_lower_bound=-1), "lambda_lower_bound"),
    (dict(lambda_init=0.25), "lambda_init"), (dict(max_cg_steps=0), "max_cg_steps"),
])
def test_bad_options_name_the_option(opts, option):
    from memzoo.registry import build_layer

    with pytest.raises(ValueError, match=option):
        build_layer("mesanet", 32, **opts)
