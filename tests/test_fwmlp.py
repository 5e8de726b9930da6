"""FwMLP (FwPKM paper, App. A): the write against an explicit SGD step written by hand, the
memorisation loss going down write after write, streaming and the per-sequence option, the
paper-size fast-weight count, and the layer inside a HybridLM training step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import D, TINY_LM, rand_x, tiny_layer
from memzoo import build_layer
from memzoo.backbone.model import HybridLM
from memzoo.layers.fwmlp import FAST_KEYS, FwMLP

F64 = dict(rtol=1e-10, atol=1e-10)

# tiny sizes with the paper's defaults otherwise (lr 0.1, detached writes); the shared suite's
# options strengthen the write, see "fwmlp" in tests/conftest.py
PAPER_DEFAULTS_TINY = {"input_dim": 16, "intermediate_dim": 32, "output_dim": 16, "chunk_size": 8}


def make(seed: int = 0, perturb: bool = True, **kw) -> FwMLP:
    return tiny_layer("fwmlp", seed=seed, noise=0.05 if perturb else 0.0, options=PAPER_DEFAULTS_TINY, **kw)


def manual_swiglu(q, p):
    """f(q) = W_down(silu(W_gate q + b_gate) ⊙ (W_up q + b_up)) + b_down, written out."""
    gate = q @ p["w_gate"].T + p["b_gate"]
    up = q @ p["w_up"].T + p["b_up"]
    return (gate * torch.sigmoid(gate) * up) @ p["w_down"].T + p["b_down"]


def manual_project(layer, x):
    """Eq. 26 through the shell (FastWeightIO; note its RMSNorms compute in fp32): q_t, v_t, g_t."""
    return layer.io.project(x)


def manual_pairs(layer, x):
    """The lookahead pairs of one chunk: q_t -> v_{t+1}, weights g_t."""
    q, v, g = manual_project(layer, x)
    return q[:, :-1], v[:, 1:], g[:, :-1]


def manual_step(theta, q, tgt, lr=0.1, w=None, clip=None):
    """One SGD step on mean over samples and features of (f(q) - tgt)², autograd on a copy;
    `clip`: each gradient entry clamped to [-clip, clip] first."""
    p = {k: t.detach().clone().requires_grad_() for k, t in theta.items()}
    err = (manual_swiglu(q, p) - tgt).pow(2)  # [B, N, D]
    loss = err.mean() if w is None else (err.mean(-1) * w).mean()
    grads = torch.autograd.grad(loss, list(p.values()))
    if clip is not None:
        grads = [torch.minimum(torch.maximum(g, torch.full_like(g, -clip)), torch.full_like(g, clip)) for g in grads]
    return {k: (p[k] - lr * g).detach() for k, g in zip(p, grads)}


# ---- (1) the write is one explicit SGD step -----------------------------------------------------
@pytest.mark.parametrize("gate_weighted", [False, True])
def test_write_is_one_manual_sgd_step(gate_weighted):
    layer = make(gate_weighted_loss=gate_weighted)
    C = layer.chunk_size
    x = rand_x(3, C)
    theta0 = {k: v.clone() for k, v in layer.state.items()}
    assert layer.state["w_up"].dtype == torch.float64
    q, tgt, g = manual_pairs(layer, x)
    expect = manual_step(theta0, q, tgt, lr=0.1, w=g if gate_weighted else None)

    layer.write(x)
    for k in FAST_KEYS:
        torch.testing.assert_close(layer.state[k], expect[k], **F64)
        assert not torch.equal(layer.state[k], theta0[k]), f"{k} did not move"

    # the read is the shell around the hand-written f(q) at the new weights
    xr = rand_x(3, 5, seed=9)
    qr, vr, gr = manual_project(layer, xr)
    o = gr[..., None] * manual_swiglu(qr, expect) + (1 - gr[..., None]) * vr  # Eq. 33
    torch.testing.assert_close(layer.read(xr), layer.io.o_proj(layer.io.o_norm(o)), **F64)  # Eq. 34


def test_grad_clip_clamps_each_gradient_entry():
    """grad_clip=True (the release's FastWeightMLP default): every entry of the fast weights'
    gradient is clamped to [-1, 1] before the step. Queries scaled up 30x make entries > 1, so
    the clamp changes the step (and bounds it: no weight moves by more than lr)."""
    layer = make(grad_clip=True)
    with torch.no_grad():
        layer.io.q_proj.weight.mul_(30.0)
    x = rand_x(3, layer.chunk_size)
    theta0 = {k: v.clone() for k, v in layer.state.items()}
    q, tgt, _ = manual_pairs(layer, x)
    clipped, plain = manual_step(theta0, q, tgt, clip=1.0), manual_step(theta0, q, tgt)
    assert any((plain[k] - theta0[k]).abs().max() > 0.1 + 1e-9 for k in FAST_KEYS)  # entries beyond 1 exist
    layer.write(x)
    for k in FAST_KEYS:
        torch.testing.assert_close(layer.state[k], clipped[k], **F64)
        assert (layer.state[k] - theta0[k]).abs().max() <= 0.1 + 1e-12


def test_write_steps_chunk_by_chunk_and_under_no_grad():
    """A write of 2.5 chunks is three SGD steps, one per chunk (pairs inside each chunk);
    under torch.no_grad it gives the same fast weights and they carry no graph."""
    layer = make()
    C = layer.chunk_size
    x = rand_x(2, 2 * C + C // 2)
    theta = {k: v.clone() for k, v in layer.state.items()}
    for s in range(0, x.shape[1], C):
        q, tgt, _ = manual_pairs(layer, x[:, s : s + C])
        theta = manual_step(theta, q, tgt)
    with torch.no_grad():
        layer.write(x)
    for k in FAST_KEYS:
        torch.testing.assert_close(layer.state[k], theta[k], **F64)
        assert layer.state[k].grad_fn is None and not layer.state[k].requires_grad


def test_lr_and_ablation_switches():
    """lr scales the step; without lookahead q_t is paired with v_t itself."""
    layer = make(lr=0.37, lookahead=False, gating=False, value_norm=False)
    x = rand_x(2, layer.chunk_size)
    theta0 = {k: v.clone() for k, v in layer.state.items()}
    io = layer.io
    q, v, g = io.project(x)
    assert g is None and not hasattr(io, "g_proj")
    torch.testing.assert_close(v, io.v_proj(io.v_norm(x)), **F64)  # no z-score
    layer.write(x)
    expect = manual_step(theta0, q, v, lr=0.37)
    for k in FAST_KEYS:
        torch.testing.assert_close(layer.state[k], expect[k], **F64)
    # the release's FwMLP target: the mean of the current and the next value
    mean = make(lookahead_target="mean")
    x = rand_x(2, mean.chunk_size)
    theta0 = {k: v.clone() for k, v in mean.state.items()}
    q, v, _ = mean.io.project(x)
    mean.write(x)
    expect = manual_step(theta0, q[:, :-1], (v[:, :-1] + v[:, 1:]) / 2)
    for k in FAST_KEYS:
        torch.testing.assert_close(mean.state[k], expect[k], **F64)
    with pytest.raises(ValueError, match="lookahead_target"):
        build_layer("fwmlp", D, lookahead_target="last")
    with pytest.raises(ValueError, match="gating=True"):
        build_layer("fwmlp", D, gating=False, gate_weighted_loss=True)
    with pytest.raises(ValueError, match="chunk_size"):
        build_layer("fwmlp", D, chunk_size=1)


# ---- (2) iterative memorisation -----------------------------------------------------------------
def test_writes_reduce_the_memorisation_mse():
    layer = make()
    x = rand_x(2, layer.chunk_size, seed=3)
    q, tgt, _ = manual_pairs(layer, x)

    def mse():
        return F.mse_loss(manual_swiglu(q, layer.state), tgt).item()

    m0 = mse()
    layer.write(x)
    m1 = mse()
    layer.write(x)
    m2 = mse()
    assert m2 < m1 < m0, (m0, m1, m2)
    st = layer.stats()  # the last chunk's loss before/after its update (the second write)
    assert st["mem_mse/before"] == pytest.approx(m1, rel=1e-9)
    assert st["mem_mse/after"] == pytest.approx(m2, rel=1e-9)
    assert 0 < st["gate/mean"] < 1
    assert {f"norm/{k}" for k in FAST_KEYS} <= set(st)


# ---- (3) streaming, persistence, per-sequence state ---------------------------------------------
@pytest.mark.parametrize("per_sequence", [False, True])
def test_streaming_on_chunk_boundaries(per_sequence):
    layer = make(per_sequence=per_sequence).eval()
    C = layer.chunk_size
    x = rand_x(2, 3 * C)
    B = 2 if per_sequence else 1
    layer.reset(B)
    y = layer(x)
    s = {k: v.clone() for k, v in layer.state.items()}
    layer.reset(B)
    y2 = torch.cat([layer(x[:, :C]), layer(x[:, C:])], dim=1)
    torch.testing.assert_close(y2, y, **F64)
    for k in FAST_KEYS:
        torch.testing.assert_close(layer.state[k], s[k], **F64)
        assert layer.state[k].dim() == (2 if k.startswith("w") else 1) + per_sequence
    # read-then-write: the first chunk reads the initial memory, the same for both settings
    layer.reset(B)
    torch.testing.assert_close(y[:, :C], layer.read(x[:, :C]), **F64)


def test_per_sequence_state_is_each_sequence_alone():
    """Per-sequence fast weights: sequence b's write equals writing b alone. Shared fast weights:
    one state, the batch's mean loss, and it persists across calls (no reset between them)."""
    per = make(per_sequence=True)
    x = rand_x(2, per.chunk_size)
    per.reset(2)
    per.write(x)
    alone = make(per_sequence=True)
    for b in range(2):
        alone.reset(1)
        alone.write(x[b : b + 1])
        for k in FAST_KEYS:
            torch.testing.assert_close(per.state[k][b], alone.state[k][0], **F64)

    shared = make()
    assert not shared.per_sequence and shared.state["w_up"].shape == (32, 16)
    theta0 = {k: v.clone() for k, v in shared.state.items()}
    shared.write(x)
    q, tgt, _ = manual_pairs(shared, x)
    expect = manual_step(theta0, q, tgt)  # one step on the mean over both sequences' pairs
    for k in FAST_KEYS:
        torch.testing.assert_close(shared.state[k], expect[k], **F64)
    shared(rand_x(5, 8))  # any batch size; the state persists across calls
    assert not torch.equal(shared.state["w_up"], expect["w_up"])
    assert "fast_w_up" in dict(shared.named_buffers())  # saved with the model


def test_reset_restores_seeded_init_and_layers_differ():
    a, b = make(seed=0, perturb=False), make(seed=1, perturb=False)
    init = {k: v.clone() for k, v in a.state.items()}
    a.write(rand_x(2, 16))
    a.reset()
    for k in FAST_KEYS:
        assert torch.equal(a.state[k], init[k])
    assert not torch.equal(a.state["w_up"], b.state["w_up"])  # per-layer seeds
    # the release's reset_parameters: N(0, 1/D_in) for up/gate, N(0, 1/H) for down, zero biases
    big = build_layer("fwmlp", D, input_dim=64, intermediate_dim=256, output_dim=64, seed=3)
    st = big.state
    assert st["w_up"].std().item() == pytest.approx(64**-0.5, rel=0.05)
    assert st["w_down"].std().item() == pytest.approx(256**-0.5, rel=0.05)
    assert all(st[k].abs().sum() == 0 for k in ("b_up", "b_gate", "b_down"))
    same = build_layer("fwmlp", D, input_dim=64, intermediate_dim=256, output_dim=64, seed=3)
    assert torch.equal(same.state["w_gate"], st["w_gate"])


# ---- gradients through the update ---------------------------------------------------------------
def test_grad_through_update_option():
    """Default: the update is local (detached) - the read of chunk 2 does not reach chunk 1's
    projections through the write. grad_through_update=True: it does (create_graph)."""
    x = rand_x(1, 16)
    C = 8
    for through in (False, True):
        layer = make(grad_through_update=through).train()
        xx = x.clone().requires_grad_()
        y = layer(xx)
        (g,) = torch.autograd.grad(y[:, C:].square().sum(), xx)
        reaches_chunk1 = g[:, : C - 1].abs().sum().item() > 0  # chunk 1's last token writes nothing
        assert reaches_chunk1 == through
        assert all(v.requires_grad == through for v in layer.state.values())
    with torch.no_grad():  # under no_grad the write still runs, graph-free
        layer.reset()
        layer(x)
    assert not any(v.requires_grad for v in layer.state.values())


# ---- (4) paper size on the meta device ----------------------------------------------------------
def test_paper_size_fast_weight_count_on_meta():
    with torch.device("meta"):
        layer = build_layer("fwmlp", 768)
    st = layer.state
    assert all(v.device.type == "meta" for v in st.values())
    assert {k: tuple(v.shape) for k, v in st.items()} == {
        "w_up": (2304, 512), "b_up": (2304,), "w_gate": (2304, 512), "b_gate": (2304,),
        "w_down": (512, 2304), "b_down": (512,),
    }
    assert layer.fast_weight_numel() == 3 * 512 * 2304 + 2 * 2304 + 512
    assert layer.chunk_size == 512 and layer.lr == 0.1 and layer.lookahead and not layer.per_sequence


# ---- (5) in a HybridLM --------------------------------------------------------------------------
def test_hybrid_lm_training_step():
    torch.manual_seed(0)
    model = HybridLM.from_layout("GDN | FwMLP@1", **TINY_LM, memory={"fwmlp": PAPER_DEFAULTS_TINY})
    (mem,) = model.memories()
    assert isinstance(mem, FwMLP) and not mem.prenorm
    fast = {id(v) for v in mem.state.values()}
    assert not any(id(p) in fast for p in model.parameters())
    assert not any("fast_" in n for n, _ in model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in mem.state.items()}
    q_proj = mem.io.q_proj.weight.detach().clone()
    for _ in range(2):
        out = model(ids, labels=ids)
        assert torch.isfinite(out.loss)
        opt.zero_grad()
        out.loss.backward()
        assert mem.io.q_proj.weight.grad.abs().sum() > 0
        opt.step()
    assert not torch.equal(mem.io.q_proj.weight, q_proj)  # slow weights trained
    assert not torch.equal(mem.state["w_up"], before["w_up"])  # fast weights written, and persist


def test_release_variant_equals_the_release_options_set_one_by_one():
    from memzoo.layers.fwmlp import VARIANTS

    by_hand = dict(lookahead_target="mean", grad_through_update=True, before_mixer=True)
    assert VARIANTS["release"] == by_hand
    paper = make()
    assert (paper.lookahead_target, paper.grad_through_update, paper.site) == ("next", False, "after_mixer")
    a, b = make(variant="release").train(), make(variant="paper", **by_hand).train()
    x = rand_x(2, 20).requires_grad_()
    ya, yb = a(x), b(x)
    assert torch.equal(ya, yb)
    ga = torch.autograd.grad(ya.pow(2).sum(), [x, *a.parameters()])
    gb = torch.autograd.grad(yb.pow(2).sum(), [x, *b.parameters()])
    assert all(torch.equal(u, v) for u, v in zip(ga, gb))
    assert all(torch.equal(a.state[k], b.state[k]) for k in FAST_KEYS)
    assert a.site == b.site == "before_mixer"  # the block runs it before its token mixer
    assert make(variant="release", lookahead_target="next").lookahead_target == "next"  # ablation override
    with pytest.raises(ValueError, match="variant"):
        make(variant="authors")


@pytest.mark.parametrize("bad", [dict(lr=-1.0), dict(lr=0.0), dict(chunk_size=0), dict(input_dim=0)])
def test_bad_options_are_rejected_by_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        make(**bad)


@pytest.mark.parametrize("per_sequence", [False, True])
def test_a_nan_in_one_sequence_reaches_no_other_sequence_and_no_later_call(per_sequence):
    """A pair with a non-finite token is left out of the write: here the other sequence's
    outputs equal those of a batch in which sequence 0 is clean but token 10's pairs carry no
    weight, i.e. are finite; the shared fast weights stay finite for later calls."""
    layer = make(per_sequence=per_sequence)
    x = rand_x(2, 24)
    x[0, 10, 3] = float("nan")
    with torch.no_grad():
        layer.reset(2)
        y = layer(x)
        assert torch.isfinite(y[1]).all() and torch.isfinite(y[0, :10]).all()
        assert not torch.isfinite(y[0, 10]).all()
        assert all(torch.isfinite(t).all() for t in layer.state.values())
        assert torch.isfinite(layer(rand_x(2, 16, seed=3))).all()


@pytest.mark.parametrize("per_sequence", [False, True])
def test_hand_written_gradients_are_autograds_first_and_second_order(per_sequence):
    """swiglu_grads (the write's chain rule, in differentiable ops) against torch.autograd.grad of
    the same weighted loss, and a gradient *through* it (what grad_through_update trains with)
    against autograd's create_graph double backward."""
    from memzoo.layers.fwmlp import swiglu_grads, swiglu

    g = torch.Generator().manual_seed(0)
    B, N, Din, H, Dout = 2, 5, 3, 4, 3
    lead = (B,) if per_sequence else ()
    shapes = {"w_up": (H, Din), "b_up": (H,), "w_gate": (H, Din), "b_gate": (H,), "w_down": (Dout, H), "b_down": (Dout,)}
    theta = {k: torch.randn(*lead, *s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
    q = torch.randn(B, N, Din, generator=g, dtype=torch.float64, requires_grad=True)
    tgt = torch.randn(B, N, Dout, generator=g, dtype=torch.float64)
    c = torch.rand(B, N, generator=g, dtype=torch.float64)
    theta = {k: v.requires_grad_() for k, v in theta.items()}
    loss = (c * (swiglu(q, theta) - tgt).pow(2).mean(-1)).sum()
    ref = torch.autograd.grad(loss, [theta[k] for k in FAST_KEYS], create_graph=True)
    ours = swiglu_grads(q, tgt, c, theta)
    for k, a, b in zip(FAST_KEYS, ours, ref):
        torch.testing.assert_close(a, b, **F64, msg=lambda m, k=k: f"{k}: {m}")
    r = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in ref]
    second = lambda grads: torch.autograd.grad(sum((x * y).sum() for x, y in zip(grads, r)), q, retain_graph=True)[0]  # noqa: E731
    torch.testing.assert_close(second(ours), second(ref), **F64)
