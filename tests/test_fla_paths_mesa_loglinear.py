"""The fla paths of MesaNet's op (:func:`memzoo.ops.mesa.mesa_chunked`, fla's ``chunk_mesa_net``) and of
log-linear attention (:func:`memzoo.ops.log_linear_attention.log_linear_attention`, fla's
``chunk_log_linear_attn``), run on the CPU through Triton's interpreter against the torch paths, as
tests/test_fla_paths.py does for the other ops: outputs, the state after the call and every input's gradient.
The calls fla does not cover keep the torch path under "auto" and raise under "fla".

    python -m pytest -q -s tests/test_fla_paths_mesa_loglinear.py      # -s shows each op's largest error
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests import fla_interpret, test_fla_paths
from tests.test_fla_paths import compare, randn

WHY = fla_interpret.apply()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"fla under Triton's interpreter: {WHY}")

B, T, H, K = 2, 48, 2, 16
#: fla's MesaNet computes at a fixed precision (q and k in fp16, the chunks' G states in bf16, the
#: backward's solve returned in fp16: mesa_chunked's docstring), so its tolerance is fp16's, not fp32's
MESA_TOL = 1e-2


# ---- MesaNet ---------------------------------------------------------------------------------------------------

def mesa_inputs(T: int) -> dict:
    A = randn(B, H, K, K, seed=6) * 0.2
    return {"q": F.normalize(randn(B, T, H, K, seed=1), dim=-1), "k": F.normalize(randn(B, T, H, K, seed=2), dim=-1),
            "v": randn(B, T, H, K, seed=3), "beta": torch.sigmoid(randn(B, T, H, seed=5)),
            "log_gamma": F.logsigmoid(randn(B, T, H, seed=4) + 3), "lam": F.softplus(randn(H, K, seed=7)) + 0.25,
            "H0": A @ A.mT, "G0": randn(B, H, K, K, seed=8) * 0.1}  # H_0 symmetric, as every write builds it


@pytest.mark.parametrize("T_", [T, 100])
def test_fla_path_mesa(T_, monkeypatch):
    """MesaNet's forward (the layer's forward_state): from a held (H_0, G_0), one partial fla chunk and two."""
    from memzoo.ops.mesa import mesa_chunked

    monkeypatch.setattr(test_fla_paths, "TOL", MESA_TOL)

    def run(backend, q, k, v, beta, log_gamma, lam, H0, G0):
        o, Hs, G = mesa_chunked(q, k, v, beta, log_gamma, lam, H0, G0, steps=30, chunk_size=16, backend=backend)
        return o, torch.cat([Hs, G], dim=-1)

    compare(f"mesa_chunked (T={T_})", run, mesa_inputs(T_))


def test_mesa_calls_fla_does_not_cover_keep_the_torch_path():
    """Another stabiliser ε than fla's fixed 1e-5, or K ≠ V: "fla" says why, "auto" runs the torch path."""
    from memzoo.ops.mesa import mesa_chunked

    x = mesa_inputs(8)
    args = [x[n] for n in ("q", "k", "v", "beta", "log_gamma", "lam", "H0", "G0")]
    with pytest.raises(RuntimeError, match="stabiliser"):
        mesa_chunked(*args, steps=4, eps=0.0, backend="fla")
    o, *_ = mesa_chunked(*args, steps=4, eps=0.0, backend="auto")
    assert torch.equal(o, mesa_chunked(*args, steps=4, eps=0.0, backend="torch")[0])
    v2 = torch.cat([x["v"], x["v"]], dim=-1)
    G2 = torch.cat([x["G0"], x["G0"]], dim=-1)
    with pytest.raises(RuntimeError, match="K = V"):
        mesa_chunked(*args[:2], v2, *args[3:7], G2, steps=4, backend="fla")


# ---- log-linear attention ---------------------------------------------------------------------------------------

N, P, L = 64, 16, 15  # N: fla's state dimension comes in blocks of 64; L: the layer's num_levels


def loglinear_inputs(T: int, held: bool) -> tuple[dict, torch.Tensor]:
    """q, k, v, log a, λ and the levels S held at pos: zero at pos 0, else written by the op from 64 and 128
    random tokens (positions the call's levels are fla's at: multiples of 64 >= T for T = 48)."""
    from memzoo.ops.log_linear_attention import log_linear_chunk

    S = torch.zeros(B, H, L - 1, N, P)
    pos = torch.zeros(B, dtype=torch.long)
    if held:
        levels = []
        for b, n in enumerate((64, 128)):
            k0, v0 = randn(1, n, H, N, seed=20 + b) * 0.2, randn(1, n, H, P, seed=30 + b)
            la0 = F.logsigmoid(randn(1, n, H, seed=40 + b) + 3)
            levels.append(log_linear_chunk(None, k0, v0, la0, None, S[:1], pos[:1])[1])
        S, pos = torch.cat(levels), torch.tensor([64, 128])
    return {"q": randn(B, T, H, N, seed=1) * 0.2, "k": randn(B, T, H, N, seed=2) * 0.2, "v": randn(B, T, H, P, seed=3),
            "log_a": F.logsigmoid(randn(B, T, H, seed=4) + 3), "lam": F.softplus(randn(B, T, H, L, seed=5)),
            "S": S}, pos


@pytest.mark.parametrize(("T_", "held"), [(T, False), (150, False), (T, True)])
def test_fla_path_log_linear_attention(T_, held):
    """Log-linear Mamba-2's forward: from the empty state (one partial fla chunk; three, with chunk levels) and
    from levels held at positions 64 and 128 (their read and the write after the call in torch)."""
    from memzoo.ops.log_linear_attention import log_linear_attention

    inputs, pos = loglinear_inputs(T_, held)

    def run(backend, q, k, v, log_a, lam, S):
        return log_linear_attention(q, k, v, log_a, lam, S, pos, chunk_size=16, backend=backend)

    compare(f"log_linear_attention (T={T_}, {'held levels' if held else 'empty state'})", run, inputs)


def test_log_linear_calls_fla_does_not_cover_keep_the_torch_path():
    """A position the call's levels are not fla's at, more levels than λ has, N not a multiple of 64: "fla"
    says why, "auto" runs the torch path."""
    from memzoo.ops.log_linear_attention import log_linear_attention

    x, _ = loglinear_inputs(T, held=False)
    args = [x[n] for n in ("q", "k", "v", "log_a", "lam", "S")]
    with pytest.raises(RuntimeError, match="not a multiple of 2"):
        log_linear_attention(*args, torch.tensor([32, 64]), backend="fla")
    o, S = log_linear_attention(*args, torch.tensor([32, 64]), backend="auto")
    o_t, S_t = log_linear_attention(*args, torch.tensor([32, 64]), backend="torch")
    assert torch.equal(o, o_t) and torch.equal(S, S_t)
    short = args[:4] + [args[4][..., :6], args[5][:, :, :5]]  # 6 levels: 48 tokens reach level 6
    with pytest.raises(RuntimeError, match="past the 6 levels"):
        log_linear_attention(*short, torch.zeros(B, dtype=torch.long), backend="fla")
    narrow = [args[0][..., :16], args[1][..., :16], *args[2:5], args[5][..., :16, :]]
    with pytest.raises(RuntimeError, match="multiples of 64"):
        log_linear_attention(*narrow, torch.zeros(B, dtype=torch.long), backend="fla")
