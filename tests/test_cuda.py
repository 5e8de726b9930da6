"""What only a CUDA machine can check: the Triton kernels compiled (not interpreted) against their
torch references at the paper's sizes, FwPKM's kernel path deterministic, bf16 training, and
generation on the GPU. Skipped, saying so, where CUDA is absent (the CPU run checks the same code
paths under TRITON_INTERPRET=1 and in fp32/fp64: tests/test_kernels_fwpkm.py, test_generate.py)."""

from __future__ import annotations

import pytest
import torch

from memzoo.registry import layer_names

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")

DEV = "cuda"


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 matmuls and convolutions in fp32, not TF32 (cuDNN's default): the comparisons here are
    of two fp32 paths."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def share_off(a, b, rtol) -> float:
    """The share of elements of `a` outside `close`'s tolerance of `b`."""
    a, b = a.detach().double(), b.detach().double()
    return (~torch.isclose(a, b, rtol=rtol, atol=rtol * float(b.abs().max().clamp(min=1e-6)))).float().mean().item()


def mismatch(a, b, rtol) -> str:
    """Where two tensors differ: the share of elements outside the tolerance and the largest gap."""
    gap = (a.detach().double() - b.detach().double()).abs().max().item()
    return f"{share_off(a, b, rtol):.2e} of elements differ, max |diff| {gap:.3g}"


def close(a, b, rtol=1e-4):
    a, b = a.detach().double(), b.detach().double()
    return torch.allclose(a, b, rtol=rtol, atol=rtol * float(b.abs().max().clamp(min=1e-6)))


@pytest.mark.parametrize("score,H,k", [("idw", 1, 8), ("dot", 4, 32)])
def test_compiled_lookup_at_paper_sizes(score, H, k):
    from memzoo.kernels import fwpkm
    from memzoo.ops import product_key as pk

    g = torch.Generator(DEV).manual_seed(0)
    q = torch.randn(2, 300, H, 512, device=DEV, generator=g)
    keys = torch.randn(H, 2, 512, 256, device=DEV, generator=g) / 16
    got, want = fwpkm.lookup(q, keys, k, score), pk.lookup(q, keys, k, score)
    # the same slots (two near-tied ones may come in either order in fp32), the same scores
    agree = (got.index.sort(-1).values == want.index.sort(-1).values).float().mean().item()
    assert agree > 0.999, f"{agree=}"
    assert close(got.scores.sort(-1).values, want.scores.sort(-1).values)


def test_compiled_embedding_bag_and_segment_sum():
    from memzoo.kernels import fwpkm
    from memzoo.ops import product_key as pk

    g = torch.Generator(DEV).manual_seed(0)
    V = torch.randn(512 * 512, 512, device=DEV, generator=g, requires_grad=True)
    idx = torch.randint(0, 512 * 512, (4096, 32), device=DEV, generator=g)
    w = torch.softmax(torch.randn(4096, 32, device=DEV, generator=g), -1).requires_grad_()
    got, want = fwpkm.embedding_bag(V, idx, w), pk.gather_values(V, idx, w)
    assert close(got, want)
    go = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (V, w), go), torch.autograd.grad(want, (V, w), go)):
        assert close(a, b)
    rows = torch.randint(0, 1000, (4096, 8), device=DEV, generator=g)
    coef, x = torch.randn(4096 * 8, device=DEV, generator=g), torch.randn(4096, 64, device=DEV, generator=g)
    out = fwpkm.segment_sum(torch.zeros(1000, 64, device=DEV), fwpkm.Segments(rows), coef, x, per_token=8)
    assert close(out, fwpkm.segment_sum_reference(torch.zeros(1000, 64, device=DEV), rows, coef, x, per_token=8))


def _fwpkm_run(triton: bool):
    from memzoo.registry import build_layer

    torch.manual_seed(0)
    layer = build_layer("fwpkm", 768, triton=triton, chunk_size=128).to(DEV)  # Table 3's sizes, shorter chunks
    x = torch.randn(4, 512, 768, device=DEV, generator=torch.Generator(DEV).manual_seed(1))
    y = layer(x)
    grads = torch.autograd.grad(y.pow(2).mean(), list(layer.parameters()))
    return y, {k: v.clone() for k, v in layer.state.items()}, grads


def test_fwpkm_kernel_path_matches_torch_and_is_deterministic():
    y1, s1, g1 = _fwpkm_run(True)
    y2, s2, g2 = _fwpkm_run(False)
    y3, s3, _ = _fwpkm_run(True)
    # all but a few elements: a near-tie in a top-k can pick another slot in the other fp32 path
    # (how many on an H200: docs/journal/performance.md)
    assert share_off(y1, y2, 1e-3) < 1e-3, mismatch(y1, y2, 1e-3)
    for k in s1:
        assert share_off(s1[k], s2[k], 1e-3) < 1e-3, f"state {k}: {mismatch(s1[k], s2[k], 1e-3)}"
    for i, (a, b) in enumerate(zip(g1, g2)):
        assert share_off(a, b, 1e-2) < 1e-3, f"grad {i}: {mismatch(a, b, 1e-2)}"
    assert torch.equal(y1, y3) and all(torch.equal(s1[k], s3[k]) for k in s1)  # sorted segment sums


def test_train_on_cuda_in_bf16(tmp_path):
    from memzoo.config import load_config
    from memzoo.train import resolve_precision, train

    rc = load_config("tiny/gdn-fwpkm")
    rc.train.device, rc.train.steps, rc.train.out_dir = DEV, 5, str(tmp_path / "run")
    assert resolve_precision(rc.train.precision, DEV) == "bf16"
    res = train(rc, progress=False)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in res["history"])


# with and without FwPKM (its kernels on and off), so that a mismatch says where it arises
@pytest.mark.parametrize("layout,triton", [("GDN+SWA", None), ("GDN+SWA | fwpkm@1", False), ("GDN+SWA | fwpkm@1", True)])
def test_generate_on_cuda_matches_one_forward(layout, triton):
    from memzoo.backbone import HybridLM
    from tests.conftest import TINY_LM, layer_options

    torch.manual_seed(0)
    memory = {} if triton is None else {"fwpkm": {**layer_options("fwpkm"), "triton": triton}}
    model = HybridLM.from_layout(layout, **TINY_LM, memory=memory).to(DEV).eval()
    prompt = torch.randint(1, 50, (2, 7), device=DEV)
    with torch.no_grad():
        before = model.memory_state()
        out = model.generate(prompt, max_new_tokens=9, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        model.load_memory_state(before)
        full = model(out.sequences).logits
    torch.testing.assert_close(torch.stack(out.logits, 1), full[:, 6:-1].float(), rtol=1e-3, atol=1e-3)


#: the largest relative difference a layer's CUDA path may show against its torch path on the CPU
#: (fp32, TF32 off: sums in another order, fla's chunked kernel against the chunked torch ops)
DEVICE_RTOL = 2e-3


@pytest.mark.parametrize("name", layer_names())
def test_each_layer_on_cuda_matches_its_torch_path_on_the_cpu(name, capsys):
    """Every registered layer (the delta-rule and gradient-descent memories of issues 66-67 with the
    rest): outputs, state and gradients on CUDA against the CPU's torch path; the largest relative
    difference of each is printed (gpu_check's log keeps it)."""
    from tests.conftest import device_paths_differ

    err = device_paths_differ(name, DEV)
    with capsys.disabled():
        print(f"\ncuda vs cpu: {name}: " + ", ".join(f"{k} {v:.2e}" for k, v in err.items()), flush=True)
    assert max(err.values()) < DEVICE_RTOL, err


def test_gdn_auto_without_fla_runs_compiled_and_agrees_with_the_torch_path(monkeypatch):
    """Where fla cannot run (not installed, or refused on Hopper with Triton < 3.7.1), the GDN
    mixer's "auto-compiled" runs the chunked torch path under torch.compile: outputs and
    gradients as the eager path's."""
    import torch.nn.functional as F

    from memzoo.ops import dispatch
    from memzoo.ops import gated_delta_rule as gdr

    monkeypatch.setattr(dispatch, "fla_unusable", lambda i=None: "fla refused (this test)")
    gen = torch.Generator().manual_seed(0)
    B, T, H, K = 2, 256, 4, 64
    r = lambda *s: torch.randn(*s, generator=gen).to(DEV)  # noqa: E731
    q, k = (F.normalize(r(B, T, H, K), dim=-1) for _ in range(2))
    v, g, beta = r(B, T, H, K), F.logsigmoid(r(B, T, H) + 2), torch.sigmoid(r(B, T, H))
    do = r(B, T, H, K)
    grads = {}
    for backend in ("auto-compiled", "torch"):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]
        o, _ = gdr.gated_delta_rule(*xs, backend=backend)
        (o * do).sum().backward()
        grads[backend] = [o, *(x.grad for x in xs)]
    assert gdr.gdn_op(DEV).startswith("torch, compiled") and gdr._compiled_chunked.cache_info().currsize == 1
    for name, a, b in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], grads["auto-compiled"], grads["torch"]):
        assert close(a, b, 1e-4), f"{name}: {mismatch(a, b, 1e-4)}"
