"""The fla path of every op that has one, run on the CPU through Triton's interpreter (the shims in
tests/fla_interpret.py; on a CUDA machine, fla's compiled kernels: `memzoo.bench.gpu_check --only tests`) at small shapes, against memzoo's chunked torch path: outputs, the final state
and the gradients of every input (the initial state included), in fp32. Each test prints its largest
error. What this checks is the glue (layouts, scale, gate signs, initial and final state, dtypes);
fla's kernels themselves are fla's. Skipped, with the reason, where the shims cannot apply.

    python -m pytest -q -s tests/test_fla_paths.py      # -s shows each op's largest error
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests import fla_interpret

WHY = fla_interpret.apply()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"fla under Triton's interpreter: {WHY}")

B, T, H, K, V = 2, 48, 2, 16, 16  # T not a multiple of fla's 64-token chunks nor of the torch path's
DEV = fla_interpret.device()
#: fp32 both ways on the CPU; on CUDA fla's Triton dots run in TF32
TOL = 2e-5 if DEV == "cpu" else 5e-3


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV)


def compare(op: str, run, inputs: dict) -> None:
    """run(backend, **inputs) -> (o, final state) on both backends; the outputs, the final state and every
    input's gradient (through random cotangents of o and the state) agree within TOL (relative to each
    tensor's largest magnitude); the largest error is printed."""
    got = {}
    for backend in ("fla", "torch"):
        xs = {n: t.clone().requires_grad_(True) for n, t in inputs.items()}
        o, S = run(backend, **xs)
        loss = (o * randn(*o.shape, seed=11)).sum() + (S * randn(*S.shape, seed=12)).sum()
        grads = torch.autograd.grad(loss, list(xs.values()))
        got[backend] = {"o": o.detach(), "state": S.detach(), **{f"d{n}": g for n, g in zip(xs, grads)}}
    worst = 0.0
    for name, want in got["torch"].items():
        have = got["fla"][name]
        assert have.shape == want.shape and have.dtype == want.dtype, (name, have.shape, want.shape, have.dtype)
        err = ((have - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()
        worst = max(worst, err)
        assert err < TOL, f"{op}: {name} differs by {err:.2e} (relative to its largest magnitude)"
    print(f"\n{op}: fla vs torch on {DEV}, largest relative error {worst:.2e} (o, final state, all gradients)")


def test_fla_path_gated_delta_rule():
    """GDN's mixer, DeltaNet, Gated DeltaNet, DeltaProduct and MoM run this op."""
    from memzoo.ops.gated_delta_rule import gated_delta_rule

    inputs = {"q": F.normalize(randn(B, T, H, K, seed=1), dim=-1), "k": F.normalize(randn(B, T, H, K, seed=2), dim=-1),
              "v": randn(B, T, H, V, seed=3), "g": F.logsigmoid(randn(B, T, H, seed=4) + 3),
              "beta": torch.sigmoid(randn(B, T, H, seed=5)), "h0": randn(B, H, K, V, seed=6) * 0.1}

    def run(backend, q, k, v, g, beta, h0):
        return gated_delta_rule(q, k, v, g, beta, scale=K**-0.5, initial_state=h0, output_final_state=True,
                                chunk_size=16, backend=backend)

    compare("gated_delta_rule", run, inputs)


@pytest.mark.parametrize("decay", ["none", "per head", "per key channel"])
def test_fla_path_linear_attention(decay):
    """Linear attention (none), RetNet and Mamba-2 (per head: fla's simple_gla), GLA, HGRN-2 and GSA's
    second pass (per key channel: fla's gla)."""
    from memzoo.ops.linear_attention import linear_attention

    inputs = {"q": randn(B, T, H, K, seed=1) * 0.3, "k": randn(B, T, H, K, seed=2) * 0.3, "v": randn(B, T, H, V, seed=3),
              "h0": randn(B, H, K, V, seed=6) * 0.1}
    if decay == "per head":
        inputs["g"] = F.logsigmoid(randn(B, T, H, seed=4) + 3)
    elif decay == "per key channel":
        inputs["g"] = F.logsigmoid(randn(B, T, H, K, seed=4) + 3)

    def run(backend, q, k, v, h0, g=None):
        return linear_attention(q, k, v, g, h0, chunk_size=16, backend=backend)

    compare(f"linear_attention ({decay})", run, inputs)


def test_fla_path_dplr_delta_rule():
    """RWKV-7 and KDA run this op (a = κ̂, b = −a ⊙ κ̂ for RWKV-7; here random a, b = −β a of a unit a)."""
    from memzoo.ops.dplr_delta_rule import dplr_delta_rule

    a = F.normalize(randn(B, T, H, K, seed=7), dim=-1)
    inputs = {"q": randn(B, T, H, K, seed=1) * 0.3, "k": randn(B, T, H, K, seed=2) * 0.3, "v": randn(B, T, H, V, seed=3),
              "a": a, "b": -a * torch.sigmoid(randn(B, T, H, 1, seed=8)),
              "gk": F.logsigmoid(randn(B, T, H, K, seed=4) + 3), "h0": randn(B, H, K, V, seed=6) * 0.1}

    def run(backend, q, k, v, a, b, gk, h0):
        return dplr_delta_rule(q, k, v, a, b, gk, scale=1.0, initial_state=h0, output_final_state=True,
                               chunk_size=16, backend=backend)

    compare("dplr_delta_rule", run, inputs)


def test_value_channel_decay_keeps_the_torch_path():
    """GSA's first pass (a decay per value channel) has no fla kernel: "fla" says so, "auto" runs torch."""
    from memzoo.ops.linear_attention import linear_attention

    q, k, v = randn(1, 8, 1, 4, seed=1), randn(1, 8, 1, 4, seed=2), randn(1, 8, 1, 4, seed=3)
    with pytest.raises(RuntimeError, match="per value channel"):
        linear_attention(q, k, v, log_decay_v=-torch.ones_like(v), backend="fla")
    linear_attention(q, k, v, log_decay_v=-torch.ones_like(v), backend="auto")
