"""Gated Slot Attention's fla path (fla's ``chunk_gsa``: both passes and the softmax in one op) run on the CPU
through Triton's interpreter (the shims in tests/fla_interpret.py) at small shapes, against memzoo's chunked
torch path: the output, both final states (Sk, Sv) and the gradients of every input (both initial states
included), in fp32, as tests/test_fla_paths.py checks the other ops. Each test prints its largest error.

    python -m pytest -q -s tests/test_fla_paths_gsa.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.test_fla_paths import WHY, B, H, K, T, V, compare, randn

pytestmark = pytest.mark.skipif(WHY is not None, reason=f"fla under Triton's interpreter: {WHY}")


def gsa_inputs(m: int) -> dict:
    """GSA's inputs as its layer makes them: swish q, k, v, log α = logsigmoid(·) / 8, s = 1 − α, and
    nonzero initial states (a streaming call's)."""
    log_alpha = F.logsigmoid(randn(B, T, H, m, seed=4)) / 8
    return {"q": F.silu(randn(B, T, H, K, seed=1)), "k": F.silu(randn(B, T, H, K, seed=2)),
            "v": F.silu(randn(B, T, H, V, seed=3)), "s": -torch.expm1(log_alpha), "log_alpha": log_alpha,
            "Sk": randn(B, H, K, m, seed=6) * 0.3, "Sv": randn(B, H, m, V, seed=7) * 0.3}


@pytest.mark.parametrize("m", [8, 16])
def test_fla_path_gsa(m):
    """The GSA layer's op: fla's chunk_gsa vs the two torch passes (both final states compared as one
    tensor, Sk [B, H, K, m] and Sv [B, H, m, V] flattened and joined; the torch path at chunks of 16)."""
    from memzoo.ops.gsa import gsa

    def run(backend, q, k, v, s, log_alpha, Sk, Sv):
        o, Sk, Sv = gsa(q, k, v, s, log_alpha, Sk, Sv, chunk_size=16, backend=backend)
        return o, torch.cat([Sk.flatten(), Sv.flatten()])

    compare(f"gsa (m={m})", run, gsa_inputs(m))


def test_gsa_layer_fla_path():
    """The layer through backend "fla" (its forward_state with fla's op) equals its torch path: the layer's
    glue (states, dtypes) as the layer calls the op, at the test sizes of the registry."""
    from conftest import rand_x, tiny_layer

    import memzoo.layers.gsa as layer_mod
    from memzoo.ops.gsa import gsa

    layer = tiny_layer("gsa", dtype=torch.float32)
    x = rand_x(B, T, dtype=torch.float32)
    state = {n: t + 0.1 for n, t in layer.init_state(B).items()}
    outs = {}
    for backend in ("fla", "torch"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(layer_mod, "gsa", lambda *a, b=backend, **kw: gsa(*a, **kw, backend=b))
            y, st = layer.forward_state(x, state)
        outs[backend] = (y, st)
    worst = 0.0
    for a, b in ((outs["fla"][0], outs["torch"][0]), *((outs["fla"][1][n], outs["torch"][1][n]) for n in state)):
        assert a.dtype == b.dtype and a.shape == b.shape
        worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    print(f"\ngsa layer forward_state: fla vs torch, largest relative error {worst:.2e} (y, Sk, Sv)")
    assert worst < 2e-5


def test_gsa_fla_backend_refuses_fp64():
    """fp64 (the layers' reference checks) has no fla kernel: "fla" says why, "auto" runs the torch path."""
    from memzoo.ops.gsa import gsa, gsa_chunked

    xs = {n: t.double() for n, t in gsa_inputs(8).items()}
    with pytest.raises(RuntimeError, match="fp64"):
        gsa(**xs, backend="fla")
    for a, b in zip(gsa(**xs, backend="auto"), gsa_chunked(**xs)):
        assert torch.equal(a, b)
