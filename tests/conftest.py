"""What the tests know about each memory layer, and helpers the test files share.

A built-in layer's options in the tests (build_layer kwargs for d_model = 32: tiny sizes, and any
other value that differs from the layer's default, with the reason beside it) are its `test` column
of zoo_configs/sizes.yaml, the table of every layer's sizes. LAYER_TESTS holds, per registered layer
name, what else the tests need and the layer itself does not (the layer classes carry nothing
test-only). Every key is optional:

  iterative    True = writing the same data again improves recall (gradient-style writes): the
               memorization property then checks that a second write lowers the error.
  targets      for needs_targets layers: x [B, T, D] -> targets [B, T]; sliced along dim 1
               together with x when streaming.
  grad_exempt  fnmatch patterns of parameter names that may get an all-zero gradient from one
               forward (say why).
  train_steps  steps of the memorization property's brief training (200; say why a layer needs more).

A layer without a row or an entry (a user's plugin layer) is tested with its constructor defaults
and `iterative=False`. A plugin supplies its own entries, options included, with a module-level dict
in the module that defines the layer:

    MEMZOO_TESTS = {"mylayer": {"options": {"hidden": 16}, "iterative": True}}

and runs the shared property suite with `pytest -p MODULE tests/test_layer_properties.py`
(or MEMZOO_PLUGINS=MODULE; the module must be importable).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

# Triton kernels (memzoo.kernels) run on CPU under the interpreter, which triton reads when a
# kernel is decorated: set before anything imports them (a CUDA machine runs them compiled).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# research/ (one-off experiments, not installed) is imported from the checkout by its tests
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memzoo.config import layer_sizes  # noqa: E402
from memzoo.layers.base import MemoryLayer  # noqa: E402
from memzoo.registry import build_layer  # noqa: E402
from memzoo.registry import get_layer

D = 32  # the d_model of the tests' layer options (the `test` column of zoo_configs/sizes.yaml)
#: a tiny HybridLM backbone for the layers' in-a-model tests: two blocks, 50 tokens
TINY_LM = dict(d_model=D, n_layers=2, vocab_size=50, ffn_dim=64, gdn_heads=2, gdn_head_dim=16,
               attn_heads=2, attn_kv_heads=1, attn_head_dim=16, window=8)


def _fwl_targets(x: torch.Tensor) -> torch.Tensor:
    """Class of a token for the standalone (identity-head) FWL: the largest feature of its
    second half, D/2 + argmax(x[..., D/2:]) (for the suite's key+value tokens: the value)."""
    h = x.shape[-1] // 2
    return x[..., h:].argmax(-1) + h


LAYER_TESTS: dict[str, dict] = {
    "fwl": {
        # Not iterative: the gradients are taken at the slow weights, so writing the same data twice adds
        # the same update twice.
        "targets": _fwl_targets,
    },
    "fwmlp": {"iterative": True},  # SGD steps on the memorisation loss: a second write corrects the error left
    "fwpkm": {"iterative": True},  # gradient steps on the touched values (Eq. 35)
    "lact": {
        # Not iterative: the dot-product loss is linear in f, so its gradient does not shrink as
        # recall improves (W1's step η v hᵀ does not even depend on W1: a Hebbian write, as in
        # linear attention). Writing the same pairs twice re-adds the same outer products (plus
        # momentum) and renormalises; it corrects no error. Measured at the suite's sizes (8 pairs,
        # its test options): recall MSE 0.034 after one write, 0.061 after two (RoPE: the second copy
        # sits at other positions); 0.0285 vs 0.0298 without RoPE.
        "iterative": False,
    },
    # iterative: each write is an SGD step on ½‖Sᵀk − v‖², so writing the pairs again corrects what is left
    "deltanet": {"iterative": True},
    # silu output gate W_g x (no bias): the memorization property's queries are zero-mean random keys, so
    # the gate's sign is random per query until W_g learns gates that grow with |x|: it needs 600 steps
    # (measured: docs/adding-a-layer.md, "What went wrong the first time")
    "gated_deltanet": {"train_steps": 600},
    "deltaproduct": {"train_steps": 600},  # the forget gate brings Gated DeltaNet's output gate (above)
    "kda": {"iterative": True},  # (as DeltaNet)
    "retnet": {"train_steps": 600},  # its swish output gate, as Gated DeltaNet's
    # Mamba-2's output is gated by silu(z), so the memorisation property's brief training takes Gated
    # DeltaNet's 600 steps (same reason: the gate's sign is random per query until W_in learns it)
    "mamba2": {"train_steps": 600},
    # log-linear Mamba-2: Mamba-2's silu(z) gate, as above (measured: docs/journal/toys.md, 2026-12-07)
    "loglinear_mamba2": {"train_steps": 600},
    # GLA: its swish output gate as above, and raw (not L2-normalised) q and k: 1200 steps
    # (docs/journal/toys.md, 2026-12-06)
    "gla": {"train_steps": 1200},
    # GSA: the forget gate both picks a pair's slot and lets it in, and W_α has to learn that from the keys:
    # 600 steps (measured: docs/journal/toys.md, 2026-12-07)
    "gsa": {"train_steps": 600},
    # MesaNet: not iterative: the closed-form regression; writing the pairs again only halves the
    # regulariser's weight, it corrects no error. 600 steps: its forget strength γ = sigmoid(W_γ x + b_γ)
    # starts at 1/2 (fla's zero bias), and the regulariser λ = 1 outweighs a few β-weighted writes (measured:
    # docs/journal/toys.md, 2026-12-07)
    "mesanet": {"train_steps": 600},
    # the test-time-training memories: gradient steps on a regression loss, so a second write corrects what
    # the first left
    "ttt_linear": {"iterative": True},
    # the suite's brief training lifts the N(0, 0.02)-initialised MLP out of its flat start slowly: 600 steps
    # (measured: docs/adding-a-layer.md, "What went wrong the first time")
    "ttt_mlp": {"iterative": True, "train_steps": 600},
    "titans": {"iterative": True},
}


def layer_test(name: str) -> dict:
    """The test entry of a registered layer: its `test` options of zoo_configs/sizes.yaml and its
    LAYER_TESTS, then the MEMZOO_TESTS of the module that defines it, over the defaults (no options, not
    iterative, no targets, no exemptions)."""
    cls = get_layer(name)
    hook = getattr(sys.modules.get(cls.__module__), "MEMZOO_TESTS", {})
    entry = {"options": {}, "iterative": False, "targets": None, "grad_exempt": (), "train_steps": 200}
    entry["options"] = layer_sizes("test").get(cls.name, {})
    entry.update(LAYER_TESTS.get(cls.name, {}))
    entry.update(hook.get(cls.name, {}))
    return {**entry, "options": dict(entry["options"])}


def layer_options(name: str) -> dict:
    """build_layer kwargs of a layer at d_model = 32 for the tests (a fresh dict)."""
    return layer_test(name)["options"]


def perturb(layer: MemoryLayer, scale: float) -> MemoryLayer:
    """Move every slow weight off its init by scale · N(0, 1) (zero biases, unit norms, zero-init
    gates), so that no property holds vacuously; draws from torch's global RNG."""
    if scale:
        with torch.no_grad():
            for p in layer.parameters():
                if p.is_floating_point():
                    p.add_(scale * torch.randn_like(p))
    return layer


def tiny_layer(name: str, *, seed: int = 0, dtype=torch.float64, noise: float = 0.05, d_model: int = D,
               options: dict | None = None, **over) -> MemoryLayer:
    """build_layer(name) seeded, with its test options (or `options`) updated by `over`, in
    `dtype`, its slow weights perturbed by `noise`. In training mode, as built."""
    torch.manual_seed(seed)
    opts = layer_options(name) if options is None else dict(options)
    return perturb(build_layer(name, d_model, **{**opts, **over}).to(dtype), noise)


def rand_x(b: int, t: int, seed: int = 1, dtype=torch.float64) -> torch.Tensor:
    """A seeded random input [b, t, 32]."""
    return torch.randn(b, t, D, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def device_paths_differ(name: str, device: str, seed: int = 0) -> dict:
    """A registered layer at its test options in fp32, once on the CPU (the torch path, the
    reference) and once on `device` (on CUDA: fla's kernel where it runs, the Triton kernels of
    FwPKM and PKM, else the torch ops on the GPU), from the same weights and input: the largest
    difference of the outputs, of the state after the call and of the gradients (input and slow
    weights), each relative to the reference's largest entry."""
    import copy

    ref = tiny_layer(name, seed=seed, dtype=torch.float32)
    other = copy.deepcopy(ref).to(device)
    T = 4 * ref.chunk_size if ref.chunk_size else 24
    x = rand_x(2, T, seed=seed + 1, dtype=torch.float32)
    targets = layer_test(name)["targets"](x) if ref.needs_targets else None
    weight = torch.linspace(-1, 1, x.numel()).view_as(x)  # an outer loss that reads every output
    runs = []
    for layer, dev in ((ref, "cpu"), (other, device)):
        layer.reset(batch_size=2)
        xd = x.to(dev).requires_grad_()
        y = layer(xd) if targets is None else layer(xd, targets=targets.to(dev))
        params = [p for p in layer.parameters() if p.requires_grad]
        grads = torch.autograd.grad((y * weight.to(dev)).sum(), [xd, *params], allow_unused=True)
        runs.append((y, {k: v.detach() for k, v in layer.state.items()}, grads))

    def rel(a, b) -> float:
        if a is None or b is None:
            return 0.0 if a is None and b is None else float("inf")
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item() if b.numel() else 0.0

    (y0, s0, g0), (y1, s1, g1) = runs
    return {"output": rel(y1, y0), "state": max((rel(s1[k], s0[k]) for k in s0), default=0.0),
            "grads": max((rel(a, b) for a, b in zip(g1, g0)), default=0.0)}


@pytest.fixture
def gdn_compiled_traced_only(monkeypatch):
    """The GDN op's "compiled" backend as on CUDA up to code generation: torch.compile's tracing and
    AOTAutograd (backend aot_eager), without inductor's C++ codegen for the CPU. That codegen runs in no
    path of the library (the compiled GDN runs on CUDA only, where inductor emits Triton: test_cuda.py)
    is the slowest compile of the suite on a machine without inductor's cache (docs/journal/bench.md)."""
    import functools

    from memzoo.ops import gated_delta_rule as gdr

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    gdr._compiled_chunked.cache_clear()
    yield
    gdr._compiled_chunked.cache_clear()
