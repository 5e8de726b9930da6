"""Training: schedule shape, real-text training reduces loss, and resume after a kill is exact."""

import math

import pytest
import torch

from conftest import layer_options
from memzoo.config import ModelConfig, RunConfig, TrainConfig
from memzoo.train import lr_at, train


def _rc(tmp_path, layout="GDN+SWA | linear@1", **train_kw) -> RunConfig:
    model = ModelConfig(layout=layout, vocab_size=257, d_model=32, n_layers=2, ffn_dim=64,
                        attn_heads=2, attn_kv_heads=1, attn_head_dim=16, window=16, gdn_heads=2, gdn_head_dim=16,
                        gdn_chunk=16, memory={"fwpkm": layer_options("fwpkm")} if "fwpkm" in layout.lower() else {})
    tc = dict(seq_len=32, batch_size=4, steps=8, warmup=2, lr=3e-3, min_lr=3e-4, eval_every=4, eval_batches=2,
              ckpt_every=2, out_dir=str(tmp_path / "run"))
    tc.update(train_kw)
    return RunConfig(model, TrainConfig(**tc))


def test_schedule_warmup_then_cosine_to_min():
    tc = TrainConfig(lr=1e-3, min_lr=1e-4, warmup=10, steps=110)
    lrs = [lr_at(s, tc) for s in range(110)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # monotone decay after warmup
    assert lr_at(110, tc) == pytest.approx(1e-4)
    assert lr_at(60, tc) == pytest.approx(1e-4 + 0.5 * 9e-4)


@pytest.mark.parametrize("layout", ["GDN+SWA | linear@1", "FA-pSWA | FwPKM@1"])
def test_kill_and_resume_gives_the_same_next_step_loss(tmp_path, layout):
    """Per-sequence memory, and FwPKM's persistent memory (carried across steps, so it must be
    checkpointed), with pSWA's random windows (torch's RNG must be restored too)."""
    torch.manual_seed(0)
    full = train(_rc(tmp_path / "a", layout), progress=False)["history"]
    # "kill" after 5 steps: the last checkpoint is at step 4, step 5 is lost as in a real kill
    killed = train(_rc(tmp_path / "b", layout), stop_after=5, progress=False)
    assert killed["killed"] and killed["step"] == 5
    resumed = train(_rc(tmp_path / "b", layout), resume=True, progress=False)["history"]
    assert [r["step"] for r in resumed] == list(range(1, 9))
    for a, b in zip(full, resumed):
        assert a["loss"] == b["loss"], (a, b)  # bit-exact, every step including the one after resume
    assert full[-1]["val_loss"] == resumed[-1]["val_loss"]


def test_resume_refuses_another_config(tmp_path):
    train(_rc(tmp_path, steps=2), progress=False)
    with pytest.raises(ValueError, match="different config"):
        train(_rc(tmp_path, steps=2, lr=1e-2), resume=True, progress=False)


def test_training_on_real_text_beats_unigram(tmp_path):
    r = train(_rc(tmp_path, steps=200, eval_every=200, batch_size=8, seq_len=64, lr=1e-2, warmup=10), progress=False)
    assert math.isfinite(r["val_loss"])
    assert r["history"][-1]["loss"] < r["history"][0]["loss"] - 1.0
    assert r["val_loss"] < r["unigram_entropy"]


def test_vocab_too_small_is_explained(tmp_path):
    rc = _rc(tmp_path)
    rc.model.vocab_size = 100
    with pytest.raises(ValueError, match="vocab_size >= 257"):
        train(rc, progress=False)


def test_bad_train_values_are_explained(tmp_path):
    with pytest.raises(ValueError, match="train.steps must be >= 1"):
        train(_rc(tmp_path, steps=0), progress=False)


def test_train_step_accumulates_micro_batches_and_runs_bf16(tmp_path):
    """make_step: two micro-batches of 2 take the step one batch of 4 takes (the same mean loss,
    up to float rounding); bf16 autocast runs; an unknown precision is refused."""
    from memzoo.backbone.model import HybridLM
    from memzoo.train import make_step, param_groups

    rc = _rc(tmp_path)
    x = torch.randint(0, 257, (4, 16), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, 1)
    results = []
    for batches in ([(x, y)], [(x[:2], y[:2]), (x[2:], y[2:])]):
        torch.manual_seed(0)
        model = HybridLM(rc.model)
        opt = torch.optim.SGD(param_groups(model, rc.train), lr=1.0)  # the weights move by the gradient
        loss = make_step(model, opt, grad_clip=1.0)(batches, lr=1.0)
        assert all(p.grad is None for p in model.parameters())  # zeroed after the step
        results.append((loss, [p.detach().clone() for p in model.parameters()]))
    (a, pa), (b, pb) = results
    assert a == pytest.approx(b, rel=1e-5)
    assert all(torch.allclose(p, q, atol=1e-5) for p, q in zip(pa, pb))
    assert math.isfinite(make_step(model, opt, precision="bf16")([(x, y)]))
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16"):
        make_step(model, opt, precision="fp16")


def test_lm_loss_weights_the_targets(tmp_path):
    """lm_loss with (targets, weights): sum(w * ce) / sum(w) over the targets that are not -100,
    plus the memories' auxiliary loss; all-ones weights give the plain loss."""
    from memzoo.backbone.model import HybridLM
    from memzoo.train import lm_loss

    torch.manual_seed(0)
    mc = _rc(tmp_path, layout="GDN | mom@1").model
    mc.memory = {"mom": layer_options("mom")}  # MoM has an auxiliary (load-balancing) loss
    model = HybridLM(mc)
    x = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, 1)
    y[0, 3] = -100
    w = torch.ones(2, 16)
    w[1, 5], w[0, 7], w[0, 3] = 20.0, 5.0, 7.0  # the weight of an ignored target does not count
    out = model(x, targets=y)
    logp = torch.log_softmax(out.logits.float(), -1)
    num = den = 0.0
    for b in range(2):
        for t in range(16):
            if y[b, t] != -100:
                num += -w[b, t] * logp[b, t, y[b, t]]
                den += w[b, t]
    want = num / den + out.aux_loss
    assert out.aux_loss is not None and lm_loss(model, x, (y, w)).item() == pytest.approx(want.item(), rel=1e-5)
    assert lm_loss(model, x, (y, torch.ones(2, 16))).item() == pytest.approx(out.loss.item(), rel=1e-5)


def test_tune_cpu_flushes_subnormals():
    from memzoo.cpu import tune_cpu

    tune_cpu()
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # subnormal in fp32
    assert (tiny * 1.0).item() == 0.0


def test_bf16_gemms_in_fp32_pass_keeps_bf16_autocast_arithmetic():
    """The post-grad pass make_step uses where bf16 GEMMs are slow: every bf16 matrix product of
    two matrices in a traced autocast graph (addmm of a linear layer, mm) becomes an fp32 product
    of the same bf16 operands, rounded to bf16, which is what bf16 autocast computes: the result
    equals fp32 arithmetic on the bf16-rounded operands, and matches eager autocast up to one bf16
    rounding. Batched products (bmm of an einsum) are left in bf16."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from memzoo.cpu import _bf16_gemms_in_fp32_pass

    aten = torch.ops.aten
    gemms = {aten.mm.default, aten.addmm.default}

    def f(x, w, b, v):
        h = torch.nn.functional.linear(x, w, b)  # addmm
        return h @ v, torch.einsum("bij,bjk->bik", h.view(2, 4, 12), v.expand(2, 12, 6))  # mm, bmm

    g = torch.Generator().manual_seed(0)
    x, w, b, v = (torch.randn(*s, generator=g) for s in ((8, 5), (12, 5), (12,), (12, 6)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gm = make_fx(f, tracing_mode="fake")(x, w, b, v)
        want = f(x, w, b, v)
    nodes = lambda ops: [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ops]  # noqa: E731
    assert {n.meta["val"].dtype for n in nodes(gemms)} == {torch.bfloat16} and len(nodes(gemms)) == 2
    assert [n.meta["val"].dtype for n in nodes({aten.bmm.default})] == [torch.bfloat16]
    _bf16_gemms_in_fp32_pass()(gm.graph)
    gm.recompile()
    assert {n.meta["val"].dtype for n in nodes(gemms)} == {torch.float32} and len(nodes(gemms)) == 2
    assert [n.meta["val"].dtype for n in nodes({aten.bmm.default})] == [torch.bfloat16]  # untouched
    got = gm(x, w, b, v)
    r = lambda t: t.bfloat16().double()  # noqa: E731  a bf16 operand, exactly
    h = r(r(x) @ r(w).T + r(b))  # the linear layer's output, rounded to bf16
    exact = (r(h @ r(v)), r(torch.einsum("bij,bjk->bik", h.view(2, 4, 12), r(v).expand(2, 12, 6))))
    for out, ref, eager in zip(got, exact, want):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), ref, rtol=2 ** -7, atol=1e-6)  # one bf16 rounding apart at most
        torch.testing.assert_close(out, eager, rtol=2 ** -7, atol=1e-6)


def test_bf16_gemms_in_fp32_pass_widens_a_tensor_once_for_all_its_views():
    """A linear layer's backward reads its output gradient twice, as is (dx = g W) and transposed
    (dW = gᵀ x): the pass converts it to fp32 once and takes the transpose of that copy (one fp32
    buffer, not one per view), and the products are still the fp32 products rounded to bf16."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from memzoo.cpu import _bf16_gemms_in_fp32_pass

    aten, prims = torch.ops.aten, torch.ops.prims

    def f(g, w, x):
        return g @ w, g.t() @ x

    gen = torch.Generator().manual_seed(0)
    g, w, x = (torch.randn(*s, generator=gen).bfloat16() for s in ((8, 5), (5, 3), (8, 4)))
    gm = make_fx(f, tracing_mode="fake")(g, w, x)
    _bf16_gemms_in_fp32_pass()(gm.graph)
    gm.recompile()
    casts = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == prims.convert_element_type.default
             and n.args[1] == torch.float32]
    g_node = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert [n.args[0] for n in casts].count(g_node) == 1  # g widened once
    views = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (aten.t.default, aten.permute.default)]
    assert [n.args[0].meta["val"].dtype for n in views if n.users] == [torch.float32]  # the transpose of the fp32 copy
    for out, ref in zip(gm(g, w, x), (g.double() @ w.double(), g.double().T @ x.double())):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), ref.bfloat16().double(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("slow", [True, False])
def test_make_step_multiplies_in_fp32_only_where_bf16_gemms_are_slow(tmp_path, monkeypatch, slow):
    """Compiled bf16 on a CPU: the pass is given to torch.compile exactly when the probe finds
    bf16 GEMMs slow; fp32 and eager steps never ask the probe."""
    import memzoo.train as T
    from memzoo.backbone.model import HybridLM

    seen = []
    monkeypatch.setattr(T, "cpu_bf16_gemm_is_slow", lambda: slow)
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.append(kw.get("options")) or model)
    model = HybridLM(_rc(tmp_path).model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    T.make_step(model, opt, precision="bf16", compile=True)
    T.make_step(model, opt, precision="fp32", compile=True)
    passes = [o and o.get("post_grad_custom_post_pass") for o in seen]
    assert (type(passes[0]).__name__ == "Bf16GemmsInFp32") == slow and passes[1] is None
