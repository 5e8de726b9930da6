"""FWL (Clark et al. 2022) against explicit SGD on a copy of its weights, causality, segments
with the carried, decayed update (Sec. 3), and the backbone's targets/head mechanism."""

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_LM, layer_options, tiny_layer
from memzoo.backbone import HybridLM
from memzoo.config import load_config
from memzoo.layers.fwl import FAST, FWL

D, V = 32, 11
TOL = dict(rtol=1e-5, atol=1e-5)
BACKBONE = {**TINY_LM, "n_layers": 4}


def make_layer(seed=0, **kw) -> FWL:
    return tiny_layer("fwl", seed=seed, **kw)  # slow weights off their init (zero biases, unit gain, equal steps)


def random_head(B, T, seed=1):
    """A position-wise head like the backbone's: logits = E · RMSNorm(h + y), V classes."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    E = torch.randn(V, D, generator=g, dtype=torch.float64)
    head = lambda y: F.linear(F.rms_norm(h + y, (D,)), E)  # noqa: E731
    head_bt = lambda y, b, t: F.linear(F.rms_norm(h[b, t] + y, (D,)), E)  # noqa: E731
    return head, head_bt


def data(B=2, T=12, seed=2, n_cls=V):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    targets = torch.randint(0, n_cls, (B, T), generator=g)
    targets[0, 3] = -100  # an ignored position
    return x, targets


# ---- the definition, written out: SGD on a copy of the weights --------------------------------
def f(x, p, eps):
    """f_θ(x) = LayerNorm(ReLU²(xU + a)W + b) with torch's own layer_norm."""
    return F.layer_norm(F.relu(x @ p["U"] + p["a"]).square() @ p["W"] + p["b"], (D,), p["g"], p["beta"], eps)


def naive_fwl(layer, x, targets, head_bt, delta0=None, grad_at_fast=False):
    """Per sequence, per segment of chunk_size tokens, per position t: output f with the copy θ',
    then one SGD step θ' ← θ' - α ∘ ∇θ L_t with the learned step sizes. The gradient is taken at
    the slow weights θ (Sec. 2; `grad_at_fast` takes it at θ', i.e. true dynamic evaluation). At
    a segment end the running update decays: ΔΘ ← γ ∘ ΔΘ + Σ_segment ∇θ L_i, θ' = θ - α ∘ ΔΘ."""
    theta = {n: getattr(layer, n).detach().clone() for n in FAST}
    alpha = dict(zip(FAST, layer.step_size.detach()))
    gamma = dict(zip(FAST, torch.sigmoid(layer.decay_logit.detach())))
    B, T, _ = x.shape
    C = layer.chunk_size
    out = torch.zeros_like(x)
    finals = []
    for b in range(B):
        delta = {n: delta0["d" + n][b].clone() if delta0 else torch.zeros_like(theta[n]) for n in FAST}
        for s in range(0, T, C):
            fast = {n: theta[n] - alpha[n] * delta[n] for n in FAST}  # a copy of the weights
            seg = {n: torch.zeros_like(theta[n]) for n in FAST}
            for t in range(s, min(s + C, T)):
                out[b, t] = f(x[b, t], fast, layer.eps)
                if targets[b, t] == -100:
                    continue
                at = fast if grad_at_fast else theta
                p = {n: at[n].clone().requires_grad_() for n in FAST}
                loss = F.cross_entropy(head_bt(f(x[b, t], p, layer.eps), b, t)[None], targets[b, t][None])
                grads = torch.autograd.grad(loss, [p[n] for n in FAST])
                for n, g in zip(FAST, grads):
                    fast[n] = fast[n] - alpha[n] * g  # the SGD step
                    seg[n] = seg[n] + g
            delta = {n: gamma[n] * delta[n] + seg[n] for n in FAST}
        finals.append(delta)
    state = {"d" + n: torch.stack([d[n] for d in finals]) for n in FAST}
    return out, state


def random_state(layer, B, seed=3):
    g = torch.Generator().manual_seed(seed)
    return {k: 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in layer.init_state(B).items()}


# ---- 1. FWL == sequential SGD ---------------------------------------------------------------------
@pytest.mark.parametrize("with_head", [True, False])
def test_equals_sequential_sgd_within_one_segment(with_head):
    """One segment (chunk_size ≥ T), no carried update: FWL is plain SGD from θ, one step per
    previous position (Eq. 1-2), for the backbone-like head and for the identity head."""
    layer = make_layer(chunk_size=64)
    x, targets = data(n_cls=V if with_head else D)
    head, head_bt = random_head(*x.shape[:2]) if with_head else (None, lambda y, b, t: y)
    layer.reset(2)
    y = layer(x, targets=targets, head=head)
    ref, ref_state = naive_fwl(layer, x, targets, head_bt)
    torch.testing.assert_close(y, ref, **TOL)
    for k in ref_state:
        torch.testing.assert_close(layer.state[k], ref_state[k], **TOL)
    # the check is not vacuous: the fast term moves the output, and the gradients are taken at
    # the slow weights θ (Sec. 2), which is not true dynamic evaluation at θ'
    slow_only = layer.read_state(x, layer.init_state(2))
    assert (y - slow_only).abs().max() > 1e-2
    dyn, _ = naive_fwl(layer, x, targets, head_bt, grad_at_fast=True)
    assert (y - dyn).abs().max() > 1e-6


def test_segments_carry_a_decayed_update():
    """Transformer-XL variant (Sec. 3): three segments of chunk_size = 4 on top of a nonzero carried
    update; ΔΘ ← γ ∘ ΔΘ + Σ_segment ∇θ L_i between segments."""
    layer = make_layer()  # chunk_size 4, decay ~0.8
    x, targets = data(T=12)
    head, head_bt = random_head(2, 12)
    s0 = random_state(layer, 2)
    y, s = layer.forward_state(x, s0, targets=targets, head=head)
    ref, ref_state = naive_fwl(layer, x, targets, head_bt, delta0=s0)
    torch.testing.assert_close(y, ref, **TOL)
    for k in ref_state:
        torch.testing.assert_close(s[k], ref_state[k], **TOL)
    # the decay matters: with γ = 1 the outputs of later segments differ
    with torch.no_grad():
        layer.decay_logit.fill_(30.0)
    y1, _ = layer.forward_state(x, s0, targets=targets, head=head)
    torch.testing.assert_close(y1[:, :4], y[:, :4], rtol=0, atol=1e-12)  # the first segment reads ΔΘ undecayed
    assert (y1[:, 4:] - y[:, 4:]).abs().max() > 1e-3


# ---- 2. causality ---------------------------------------------------------------------------------
def test_causal_in_the_targets():
    """Changing the target at t changes no output ≤ t (within a segment and across segments)."""
    layer = make_layer(chunk_size=4)
    x, targets = data(T=12)
    head, _ = random_head(2, 12)
    y, _ = layer.forward_state(x, layer.init_state(2), targets=targets, head=head)
    for t in (0, 2, 3, 6, 10):
        t2 = targets.clone()
        t2[:, t] = (t2[:, t].clamp(min=0) + 1) % V
        y2, _ = layer.forward_state(x, layer.init_state(2), targets=t2, head=head)
        torch.testing.assert_close(y2[:, : t + 1], y[:, : t + 1], rtol=0, atol=0)
        assert (y2[:, t + 1 :] - y[:, t + 1 :]).abs().max() > 1e-6  # and it does reach the future


def test_a_nonfinite_input_poisons_only_its_own_sequence_from_there_on():
    """A NaN/inf at position t of one sequence: its outputs before t are exactly those of the
    clean input, every later output of its chunk is NaN (the in-chunk sums are taken on zeroed
    positions and the later outputs marked, not 0 × NaN), and the other sequence is untouched."""
    layer = make_layer(chunk_size=8)
    x, targets = data(T=8)
    head, _ = random_head(2, 8)
    y, _ = layer.forward_state(x, layer.init_state(2), targets=targets, head=head)
    for bad in (float("nan"), float("inf")):
        xb = x.clone()
        xb[1, 3, 0] = bad
        yb, _ = layer.forward_state(xb, layer.init_state(2), targets=targets, head=head)
        torch.testing.assert_close(yb[0], y[0], rtol=0, atol=0)
        torch.testing.assert_close(yb[1, :3], y[1, :3], rtol=0, atol=0)
        assert not yb[1, 3].isfinite().all() and yb[1, 4:].isnan().all()


def test_backbone_memory_learns_from_the_next_tokens():
    """In a HybridLM the layer's losses are against the sequence's next tokens (the paper's x_{t+1}),
    whatever positions the task's labels are on; causal in the inputs; without targets it only reads."""
    torch.manual_seed(0)
    model = HybridLM.from_layout("GDN+SWA | FWL", **BACKBONE, memory={"fwl": layer_options("fwl")}).double().eval()
    ids = torch.randint(0, 50, (2, 13))
    inp, tg = ids[:, :-1], ids[:, 1:].clone()
    ref = model(inp, targets=tg).logits
    labels_on_some = torch.full_like(tg, -100)
    labels_on_some[:, [3, 7, -1]] = tg[:, [3, 7, -1]]  # as MQAR labels its queries only
    torch.testing.assert_close(model(inp, targets=labels_on_some).logits, ref, rtol=0, atol=0)
    read_only = model(inp).logits
    torch.testing.assert_close(read_only[:, 0], ref[:, 0], rtol=0, atol=0)  # nothing written before position 0
    assert (read_only[:, 2:] - ref[:, 2:]).abs().max() > 1e-8
    t = 5
    changed = inp.clone()
    changed[:, t] = (changed[:, t] + 1) % 50
    new = model(changed, targets=tg).logits
    torch.testing.assert_close(new[:, :t], ref[:, :t], rtol=0, atol=0)
    assert (new[:, t + 1 :] - ref[:, t + 1 :]).abs().max() > 1e-8


# ---- 3. streaming and state ---------------------------------------------------------------------
def test_streams_across_calls_with_carried_state():
    """forward over 4 segments == calls of 1, 2 and 1 segments; write == forward's state."""
    layer = make_layer()
    x, targets = data(T=16)
    head, _ = random_head(2, 16)
    layer.reset(2)
    y = layer(x, targets=targets, head=head)
    full = {k: v.detach().clone() for k, v in layer.state.items()}
    for bounds in ([0, 4, 12, 16], [0, 8, 16]):
        layer.reset(2)
        h_sl = lambda a, b: (lambda y: head(F.pad(y, (0, 0, a, 16 - b)))[:, a:b])  # noqa: E731 (the head of a..b)
        parts = [layer(x[:, a:b], targets=targets[:, a:b], head=h_sl(a, b)) for a, b in zip(bounds, bounds[1:])]
        torch.testing.assert_close(torch.cat(parts, 1), y, rtol=1e-10, atol=1e-12)
        for k in full:
            torch.testing.assert_close(layer.state[k], full[k], rtol=1e-10, atol=1e-12)
    layer.reset(2)
    layer.write(x, targets=targets, head=head)
    for k in full:
        torch.testing.assert_close(layer.state[k], full[k], rtol=1e-10, atol=1e-12)


def test_without_targets_reads_what_it_has():
    """Generation: no targets, no loss: forward reads with the carried update and writes nothing."""
    layer = make_layer()
    x, targets = data(T=8)
    layer.reset(2)
    layer(x, targets=targets, head=random_head(2, 8)[0])
    before = {k: v.detach().clone() for k, v in layer.state.items()}
    q = torch.randn(2, 3, D, dtype=torch.float64)
    y = layer(q)
    torch.testing.assert_close(y, layer.read(q), rtol=0, atol=0)
    for k in before:
        assert torch.equal(layer.state[k], before[k])
    layer.write(q)  # nothing to write without targets
    for k in before:
        assert torch.equal(layer.state[k], before[k])
    assert (y - layer.read_state(q, layer.init_state(2))).abs().max() > 1e-3  # it does use the past


def test_write_is_a_gradient_step():
    """After write(x, targets) the loss at x is lower (one SGD step with small positive steps)."""
    layer = make_layer()
    with torch.no_grad():
        layer.step_size.fill_(1e-3)
    x, targets = data(T=8)
    head, _ = random_head(2, 8)
    loss = lambda y: F.cross_entropy(head(y).flatten(0, 1), targets.flatten(), ignore_index=-100)  # noqa: E731
    layer.reset(2)
    before = loss(layer.read(x)).item()
    layer.write(x, targets=targets, head=head)
    assert loss(layer.read(x)).item() < before


def test_no_grad_gives_the_same_values():
    layer = make_layer()
    x, targets = data(T=8)
    head, _ = random_head(2, 8)
    y, s = layer.forward_state(x, layer.init_state(2), targets=targets, head=head)
    with torch.no_grad():
        y0, s0 = layer.forward_state(x, layer.init_state(2), targets=targets, head=head)
    torch.testing.assert_close(y0, y.detach(), rtol=0, atol=1e-14)
    assert not y0.requires_grad and all(not v.requires_grad for v in s0.values())


# ---- 4. in the backbone -------------------------------------------------------------------------
def test_backbone_places_fwl_on_top_and_hands_it_the_lm_head():
    """"GDN+SWA | FWL": on the last block after its FFN; the logits are output_head(h + FWL(RMSNorm(h)))
    where FWL is SGD on L_t = CE(output_head(h_t + f_θ(x_t)), x_{t+1}): the backbone's own head, the
    sequence's next token (a label masked by the task does not mask the memory's loss)."""
    torch.manual_seed(0)
    model = HybridLM.from_layout("GDN+SWA | FWL", **BACKBONE, memory={"fwl": layer_options("fwl")}).double().eval()
    assert model.layout.memories == (("fwl", (3,)),)
    block = model.blocks[-1]
    (fwl,) = block.mems
    with torch.no_grad():
        fwl.step_size.fill_(0.5)  # make the fast term large
    seen = {}
    block.mem_norms[0].register_forward_hook(lambda m, a, o: seen.update(h=a[0].detach(), x=o.detach()))
    ids = torch.randint(0, 50, (2, 10))
    inp, tg = ids[:, :-1], ids[:, 1:].clone()
    tg[1, 2] = -100
    logits = model(inp, targets=tg).logits
    h, x = seen["h"], seen["x"]
    head_bt = lambda y, b, t: model.output_head(h[b, t] + y)  # noqa: E731
    ref, _ = naive_fwl(fwl, x, ids[:, 1:], head_bt)
    torch.testing.assert_close(logits, model.output_head(h + ref), **TOL)
    assert (ref - fwl.read_state(x, fwl.init_state(2))).abs().max() > 1e-3


def test_backbone_streams_with_cache_and_targets():
    torch.manual_seed(0)
    model = HybridLM.from_layout("GDN+SWA | FWL", **BACKBONE, memory={"fwl": layer_options("fwl")}).double().eval()
    ids = torch.randint(0, 50, (2, 17))
    inp, tg = ids[:, :-1], ids[:, 1:]
    full = model(inp, targets=tg).logits
    a = 8  # a chunk boundary (chunk_size 4)
    o1 = model(inp[:, :a], targets=tg[:, :a], use_cache=True)
    o2 = model(inp[:, a:], targets=tg[:, a:], cache=o1.cache, use_cache=True)
    torch.testing.assert_close(torch.cat([o1.logits, o2.logits], 1), full, rtol=1e-9, atol=1e-10)
    # generation continues from the fast weights without targets and leaves them as they are
    st = {k: v.clone() for k, v in model.memories()[0].state.items()}
    model(ids[:, -1:], cache=o2.cache, use_cache=True)
    assert all(torch.equal(model.memories()[0].state[k], st[k]) for k in st)


def test_backbone_trains():
    """Builds, a training step reaches every parameter (each step size and decay), loss decreases."""
    torch.manual_seed(0)
    model = HybridLM.from_layout("GDN+SWA | FWL", **BACKBONE, memory={"fwl": layer_options("fwl")})
    ids = torch.randint(0, 50, (4, 17))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(6):
        loss = model(ids[:, :-1], targets=ids[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        if step == 0:
            missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
            assert not missing, missing
            fwl = model.memories()[0]
            assert (fwl.step_size.grad != 0).all() and (fwl.decay_logit.grad != 0).all()  # 16 tokens = 4 segments
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


def test_needs_the_top_of_the_last_block():
    with pytest.raises(ValueError, match=r"must sit on top of the last block.*'fwl@last'"):
        HybridLM.from_layout("GDN | FWL@1", **BACKBONE)
    with pytest.raises(ValueError, match="must sit on top of the last block"):
        HybridLM.from_layout("GDN | FWL@all", **BACKBONE)
    HybridLM.from_layout("GDN | FWL@3", **BACKBONE)  # the last layer, spelled out


def test_bad_targets_raise_clearly():
    layer = make_layer()
    x, targets = data(T=8)
    layer.reset(2)
    with pytest.raises(ValueError, match=r"targets must have shape \[batch, time\]"):
        layer(x, targets=targets[:, :5])
    with pytest.raises(TypeError, match="integer class ids"):
        layer(x, targets=targets.double())
    with pytest.raises(ValueError, match="no head"):
        layer(x, targets=torch.full((2, 8), D))
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        layer(x, targets=targets.clamp(min=0))


def test_compiled_bf16_gradients_are_finite_and_agree():
    """The standard toys' FWL (batch 64 x 64 tokens, width 128, one segment) trains compiled in bf16
    autocast. With its state update compiled too, the input's gradient came out NaN on an Intel
    Xeon (the update is eager now); here the compiled layer's gradients against the eager layer's."""
    torch.manual_seed(0)
    layer = FWL(128, chunk_size=256)
    x0 = F.rms_norm(torch.randn(64, 64, 128), (128,))
    targets = torch.randint(0, 64, (64, 64))

    def loss(x):
        y, _ = layer.forward_state(x, layer.init_state(64), targets=targets)
        return y.float().square().mean()

    grads = []
    for f in (loss, torch.compile(loss, dynamic=False)):
        layer.zero_grad()
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            f(x).backward()
        grads.append((x.grad, layer.U.grad))
    (gx, gu), (cx, cu) = grads
    assert cx.isfinite().all() and cu.isfinite().all()
    assert (cx - gx).norm() / gx.norm() < 1e-2 and (cu - gu).norm() / gu.norm() < 1e-2


def test_tiny_config_builds():
    rc = load_config("zoo_configs/tiny/gdn-fwl.yaml")
    assert rc.model.layout == "GDN | FWL"
    model = HybridLM(rc.model)
    (fwl,) = model.memories()
    assert isinstance(fwl, FWL) and model.layout.memories == (("fwl", (rc.model.n_layers - 1,)),)
    assert fwl.chunk_size == rc.train.seq_len
