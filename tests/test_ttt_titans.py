"""The test-time-training memories against independent references, in fp64 on a CPU.

- TTT-Linear's dual form (memzoo.ops.ttt) against fla's `fla.ops.ttt.naive.chunk_ttt_linear_ref`. The
  conventions differ in two places, and the comparison is set where they meet: fla's inner learning
  rate is one number per target token (η_i), the release's (and ours) c_i lr_j, so lr_j is taken
  constant within a mini-batch and fla's η_i = c_i lr; fla's output is Z + LN(Z) where the paper's
  f(q) is q + LN(Z), so fla's output is compared with the op's Z plus its LN. fla casts to fp32; its
  casts are redirected to fp64 (`fp64`, from test_delta_rules).
- TTT-MLP's (and TTT-Linear's) dual form against a loop of explicit inner steps written from the
  paper's equations, each gradient by `torch.autograd.grad` (with create_graph, so that the slow
  gradients flow through the reference too): W_i = W_0 − c_i Σ_{j≤i} lr_j ∇ℓ_j(W_0), z_i = f(q_i; W_i).
- Titans' memory against a token loop of Eq. 12-14 with the chunked gradients of Eq. 16-18, each
  gradient by `torch.autograd.grad`. fla's `fla.ops.titans.naive` is not a reference for it: its
  memory is linear with TTT's LayerNorm residual (Titans' is an MLP), and its gradient line scales
  only the sum term by 1/(D·rstd) (`D * grad - grad.sum(-1) / (rstd * D)`, where its own TTT reads
  `(D * grad - grad.sum(-1) - ...) / (rstd * D)`).

Forward, final state and the gradients with respect to every input (slow weights included), to 1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import rand_x, tiny_layer
from test_delta_rules import TOL, fp64
from memzoo.ops.inner_loop import gelu_tanh, layer_norm
from memzoo.ops.ttt import ttt_scan

fla_ttt = pytest.importorskip("fla.ops.ttt.naive")
F64 = torch.float64


def randn(*shape, seed, scale=1.0):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)).requires_grad_()


def check(outs, refs, inputs, what):
    """Outputs equal, and the gradients of a fixed random projection of them w.r.t. every input."""
    worst = 0.0
    for a, b in zip(outs, refs):
        err = (a - b).abs().max().item()
        assert err <= TOL, f"{what}: outputs differ by {err:.3g}"
        worst = max(worst, err)
    gen = torch.Generator().manual_seed(7)
    proj = [torch.randn(o.shape, generator=gen, dtype=F64) for o in outs]
    ga = torch.autograd.grad(sum((o * p).sum() for o, p in zip(outs, proj)), inputs, allow_unused=True, retain_graph=True)
    gb = torch.autograd.grad(sum((o * p).sum() for o, p in zip(refs, proj)), inputs, allow_unused=True)
    for i, (x, y) in enumerate(zip(ga, gb)):
        x = torch.zeros_like(inputs[i]) if x is None else x
        y = torch.zeros_like(inputs[i]) if y is None else y
        err = (x - y).abs().max().item()
        assert err <= TOL, f"{what}: gradient of input {i} differs by {err:.3g}"
        worst = max(worst, err)
    print(f"{what}: largest difference {worst:.2e} ({len(outs)} outputs, {len(inputs)} input gradients)")


B, H, d, b = 2, 2, 8, 4


def test_ttt_linear_matches_fla_naive():
    T = 12  # whole mini-batches: fla pads a ragged tail, and its padded rows move the final bias
    q, k, v = (randn(B, T, H, d, seed=s) for s in (1, 2, 3))
    lr_h = (torch.rand(B, H, 1, dtype=F64, generator=torch.Generator().manual_seed(4)) * 0.5).requires_grad_()
    lr = lr_h.expand(B, H, T)  # one lr a head: fla's η_i = c_i lr and the release's c_i lr_j meet
    c = (torch.rand(b, dtype=F64, generator=torch.Generator().manual_seed(5)) + 0.2).requires_grad_()
    W0, b0 = randn(B, H, d, d, seed=6, scale=0.3), randn(B, H, 1, d, seed=7, scale=0.1)
    ln_w, ln_b = (1 + randn(H, 1, d, seed=8, scale=0.1)).detach().requires_grad_(), randn(H, 1, d, seed=9, scale=0.1)
    t = lambda x: x.transpose(1, 2)  # noqa: E731  [B, T, H, d] -> [B, H, T, d]
    acc = {"W1": torch.zeros_like(W0), "b1": torch.zeros_like(b0)}
    zq, fast, _, pos = ttt_scan(t(q), t(k), t(v), lr, c, {"W1": W0, "b1": b0}, acc, 0, ln_w, ln_b, eps=1e-6, act=None)
    assert pos == 0
    ours = t(zq + layer_norm(zq, ln_w, ln_b, 1e-6)[0])  # fla's output: Z + LN(Z)
    eta = (c.repeat(T // b)[None, None, :] * lr)[..., None]  # η_i = c_i lr: [B, H, T, 1]
    with fp64(fla_ttt):
        o_ref, W_ref, b_ref = fla_ttt.chunk_ttt_linear_ref(
            q.clone(), k, v, ln_w[:, 0], ln_b[:, 0], t(eta), scale=1.0, eps=1e-6, mini_batch_size=b,
            initial_state=W0, initial_state_bias=b0, output_final_state=True)
    check([ours, fast["W1"], fast["b1"]], [o_ref, W_ref, b_ref], [q, k, v, lr_h, c, W0, b0, ln_w, ln_b],
          "ttt_linear vs fla chunk_ttt_linear_ref")


def reference_ttt(q, k, v, lr, c, W0, ln_w, ln_b, mlp: bool):
    """Mini-batch GD token by token: every gradient at the mini-batch's W_0 (autograd), token i reads
    W_0 − c_i Σ_{j≤i} lr_j ∇ℓ_j(W_0); ℓ_j = ½‖LN(f_res(k_j)) − (v_j − k_j)‖², z_i = q_i + LN(f_res(q_i; W_i))."""
    def f_res(x, W):
        if mlp:
            return gelu_tanh(x @ W["W1"] + W["b1"]) @ W["W2"] + W["b2"]
        return x @ W["W1"] + W["b1"]

    def ln(z):
        return F.layer_norm(z, z.shape[-1:], eps=1e-6) * ln_w + ln_b

    T, W, outs = q.shape[-2], dict(W0), []
    for s in range(0, T, b):
        grads = []
        for j in range(s, min(s + b, T)):
            kj, vj = k[..., j:j + 1, :], v[..., j:j + 1, :]
            loss = 0.5 * (ln(f_res(kj, W)) - (vj - kj)).pow(2).sum()
            grads.append(dict(zip(W, torch.autograd.grad(loss, list(W.values()), create_graph=True))))
            i = j - s
            Wi = {n: W[n] - c[i] * sum(lr[..., s + m, None, None] * grads[m][n] for m in range(i + 1)) for n in W}
            outs.append(q[..., j:j + 1, :] + ln(f_res(q[..., j:j + 1, :], Wi)))
        if len(grads) == b:
            W = Wi
    return torch.cat(outs, -2), Wi  # and the weights the last token read


@pytest.mark.parametrize("mlp", [False, True], ids=["ttt_linear", "ttt_mlp"])
def test_ttt_dual_form_matches_explicit_inner_steps(mlp):
    T, hid = 14, 16  # a ragged last mini-batch
    q, k, v = (randn(B, H, T, d, seed=s) for s in (1, 2, 3))
    lr = (0.5 * torch.rand(B, H, T, dtype=F64, generator=torch.Generator().manual_seed(4))).requires_grad_()
    c = (torch.rand(b, dtype=F64, generator=torch.Generator().manual_seed(5)) + 0.2).requires_grad_()
    if mlp:
        W0 = {"W1": randn(B, H, d, hid, seed=6, scale=0.3), "b1": randn(B, H, 1, hid, seed=7, scale=0.1),
              "W2": randn(B, H, hid, d, seed=8, scale=0.3), "b2": randn(B, H, 1, d, seed=9, scale=0.1)}
    else:
        W0 = {"W1": randn(B, H, d, d, seed=6, scale=0.3), "b1": randn(B, H, 1, d, seed=7, scale=0.1)}
    ln_w, ln_b = (1 + randn(H, 1, d, seed=10, scale=0.1)).detach().requires_grad_(), randn(H, 1, d, seed=11, scale=0.1)
    acc = {n: torch.zeros_like(w) for n, w in W0.items()}
    zq, fast, acc, pos = ttt_scan(q, k, v, lr, c, W0, acc, 0, ln_w, ln_b, eps=1e-6, act="gelu" if mlp else None)
    z = q + layer_norm(zq, ln_w, ln_b, 1e-6)[0]
    z_ref, W_ref = reference_ttt(q, k, v, lr, c, W0, ln_w, ln_b, mlp)
    assert pos == T % b
    # the state after a partial mini-batch: W_0 and the sums; its last token read W_0 − c_pos G
    eff = {n: fast[n] - c[pos - 1] * acc[n] for n in fast}
    names = list(W0)
    check([z, *(eff[n] for n in names)], [z_ref, *(W_ref[n] for n in names)],
          [q, k, v, lr, c, *W0.values(), ln_w, ln_b], f"{'ttt_mlp' if mlp else 'ttt_linear'} vs explicit inner steps")


def _ln(y, w, b, eps):
    """The memory's LayerNorm (torch's, then the per-head affine)."""
    return F.layer_norm(y, y.shape[-1:], eps=eps) * w + b


def test_titans_matches_the_papers_recurrence():
    """Eq. 12-14, chunked as Eq. 16-18, token by token: u_t = ∇‖M_{t'}(k_t) − v_t‖² at the chunk's
    start (autograd), S_t = η_t S_{t−1} − θ_t u_t, M_t = (1 − α_t) M_{t−1} + S_t; a chunk reads
    M(q) = q + LN(silu(q W1) W2) with the memory before it."""
    layer = tiny_layer("titans", noise=0.05)  # chunks of 4
    x = rand_x(2, 14)  # a ragged last chunk
    layer.reset(2)
    y = layer(x)
    M_out = {n: layer.state[n] for n in ("W1", "W2", "SW1", "SW2")}

    heads = lambda u: u.unflatten(-1, (layer.num_heads, layer.head_dim)).transpose(1, 2)  # noqa: E731
    st = layer.init_state(2)
    new = {}
    k = F.normalize(heads(layer._conv("k", layer.k_proj(x), st, new)), dim=-1)
    v = heads(layer._conv("v", layer.v_proj(x), st, new))
    q = F.normalize(F.silu(heads(layer.q_proj(x))), dim=-1)
    gates = torch.sigmoid(layer.gates(x)).unflatten(-1, (3, layer.num_heads)).permute(2, 0, 3, 1)
    theta, eta, alpha = layer.max_lr * gates[0] / layer.head_dim, gates[1], gates[2]
    M = {"W1": st["W1"], "W2": st["W2"]}
    S = {n: torch.zeros_like(w) for n, w in M.items()}
    mem = lambda u, M: u + _ln(F.silu(u @ M["W1"]) @ M["W2"], layer.ln_weight, layer.ln_bias, layer.eps)  # noqa: E731
    reads = []
    for s in range(0, x.shape[1], layer.chunk_size):
        c = slice(s, s + layer.chunk_size)
        reads.append(mem(q[..., c, :], M))  # y = M*(q): read without update (Eq. 15)
        M0 = M
        for t in range(s, min(s + layer.chunk_size, x.shape[1])):
            loss = (mem(k[..., t:t + 1, :], M0) - v[..., t:t + 1, :]).pow(2).sum()
            u = dict(zip(M0, torch.autograd.grad(loss, list(M0.values()), create_graph=True)))
            g = lambda a: a[..., t, None, None]  # noqa: E731
            S = {n: g(eta) * S[n] - g(theta) * u[n] for n in M}
            M = {n: (1 - g(alpha)) * M[n] + S[n] for n in M}
    o = torch.cat(reads, -2)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.eps) * layer.o_norm_weight
    y_ref = layer.o_proj((o * torch.sigmoid(heads(layer.g_proj(x)))).transpose(1, 2).flatten(-2))
    params = list(layer.parameters())
    check([y, M_out["W1"], M_out["W2"], M_out["SW1"], M_out["SW2"]], [y_ref, M["W1"], M["W2"], S["W1"], S["W2"]],
          params, "titans vs Eq. 12-18 token by token")


def test_titans_surprise_is_the_gradient_of_its_loss():
    from memzoo.layers.titans import surprise

    k, v = randn(2, 2, 5, d, seed=1), randn(2, 2, 5, d, seed=2)
    M = {"W1": randn(2, 2, d, 16, seed=3, scale=0.3), "W2": randn(2, 2, 16, d, seed=4, scale=0.3)}
    ln = (1 + randn(2, 1, d, seed=5, scale=0.1), randn(2, 1, d, seed=6, scale=0.1), 1e-6)
    u = surprise(k, v, M, ln)
    for t in range(5):
        kt = k[..., t:t + 1, :]
        loss = (kt + _ln(F.silu(kt @ M["W1"]) @ M["W2"], *ln) - v[..., t:t + 1, :]).pow(2).sum()
        for n, g in zip(M, torch.autograd.grad(loss, list(M.values()))):
            torch.testing.assert_close(u[n][..., t, :, :], g, rtol=0, atol=1e-12)


# ---- Titans' closed-form chunk write against the token loop it replaced ---------------------------------
def titans_write_chunk_loop(k, v, theta, eta, alpha, M, S, ln):
    """The reference: the gradients u_t at the chunk's start (`surprise`, checked against autograd above),
    then S_t = η_t S_{t−1} − θ_t u_t and M_t = (1 − α_t) M_{t−1} + S_t token by token (Eq. 13)."""
    from memzoo.layers.titans import FAST, surprise

    u = surprise(k, v, M, ln)
    for t in range(k.shape[-2]):
        g = lambda a: a[..., t, None, None]  # noqa: E731  [B, H, 1, 1]
        S = {n: g(eta) * S[n] - g(theta) * u[n][..., t, :, :] for n in FAST}
        M = {n: (1 - g(alpha)) * M[n] + S[n] for n in FAST}
    return M, S


def _chunk_inputs(L, seed, hid=12):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=gen, dtype=F64)).requires_grad_()  # noqa: E731
    k, v = F.normalize(r(B, H, L, d), dim=-1).detach().requires_grad_(), r(B, H, L, d)
    u = lambda: torch.rand(B, H, L, generator=gen, dtype=F64)  # noqa: E731
    theta, eta, alpha = 0.3 * u(), u(), u()
    # gates exactly 0 and exactly 1 (a head's first token, a run in the middle, the last token)
    eta[0, 0, 0], eta[0, 1, L // 2], eta[1, 0, -1], alpha[1, 1, L // 2], alpha[0, 0, -1] = 0, 0, 1, 0, 1
    alpha[0, 1, 0], eta[1, 1, : (L + 1) // 2], alpha[1, 0, : (L + 1) // 2] = 1, 1, 0
    theta[1, 1, -1] = 0
    theta, eta, alpha = (g.requires_grad_() for g in (theta, eta, alpha))
    M = {"W1": r(B, H, d, hid, scale=0.3), "W2": r(B, H, hid, d, scale=0.3)}
    S = {"W1": r(B, H, d, hid, scale=0.05), "W2": r(B, H, hid, d, scale=0.05)}
    ln = ((1 + 0.1 * torch.randn(H, 1, d, generator=gen, dtype=F64)).requires_grad_(), r(H, 1, d, scale=0.1), 1e-6)
    return [k, v, theta, eta, alpha], M, S, ln


@pytest.mark.parametrize("L", [1, 2, 3, 4, 7, 16])
def test_titans_closed_form_chunk_equals_the_token_loop(L):
    """write_chunk (cumulative decay products, one matmul per weight) = the loop of Eq. 13, in fp64 to
    1e-12, gates exactly 0 and 1 included; and so do the gradients w.r.t. every input (gates, k, v, M_0, S_0,
    the LN's weights)."""
    from memzoo.layers.titans import write_chunk

    ins, M, S, ln = _chunk_inputs(L, seed=L)
    got, ref = write_chunk(*ins, M, S, ln), titans_write_chunk_loop(*ins, M, S, ln)
    outs = [*got[0].values(), *got[1].values()]
    refs = [*ref[0].values(), *ref[1].values()]
    for a, b_ in zip(outs, refs):
        torch.testing.assert_close(a, b_, rtol=0, atol=1e-12)
    leaves = [*ins, *M.values(), *S.values(), *ln[:2]]
    gen = torch.Generator().manual_seed(3)
    proj = [torch.randn(o.shape, generator=gen, dtype=F64) for o in outs]
    ga = torch.autograd.grad(sum((o * p).sum() for o, p in zip(outs, proj)), leaves)
    gb = torch.autograd.grad(sum((o * p).sum() for o, p in zip(refs, proj)), leaves)
    for i, (x, y) in enumerate(zip(ga, gb)):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-11, msg=lambda m: f"gradient of input {i}: {m}")


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 5, 16])
def test_titans_layer_equals_its_token_loop_path(chunk_size, monkeypatch):
    """The layer (forward of 14 tokens: a partial last chunk but for chunk 1) with the closed form, and
    with write_chunk swapped for the token loop: outputs and state to 1e-12, the slow weights' gradients to a
    relative 1e-9;
    and write_pairs at its neutral gates (η = α = 0 exactly) and at data-dependent ones."""
    import memzoo.layers.titans as titans

    def run(loop: bool):
        if loop:
            monkeypatch.setattr(titans, "write_chunk", titans_write_chunk_loop)
        else:
            monkeypatch.setattr(titans, "write_chunk", write_chunk)
        layer = tiny_layer("titans", noise=0.05, chunk_size=chunk_size)
        x = rand_x(2, 14)
        layer.reset(2)
        y = layer(x)
        st = {n: layer.state[n] for n in ("W1", "W2", "SW1", "SW2")}
        loss = (y * torch.linspace(-1, 1, y.numel(), dtype=F64).view_as(y)).sum() + sum(
            (w * w).sum() for w in st.values())
        grads = torch.autograd.grad(loss, list(layer.parameters()))
        pairs = []
        for xx in (None, x):
            layer.reset(2)
            k, v = layer.pair_inputs(x)
            layer.write_pairs(k, v, xx)
            pairs.append(layer.read_keys(k))
        return [y, *st.values(), *pairs], grads

    write_chunk = titans.write_chunk
    (outs, grads), (routs, rgrads) = run(False), run(True)
    for a, b_ in zip(outs, routs):
        torch.testing.assert_close(a, b_, rtol=0, atol=1e-12)
    for a, b_ in zip(grads, rgrads):  # the sums' order differs: fp64 round-off, relative
        torch.testing.assert_close(a, b_, rtol=1e-9, atol=1e-12)
