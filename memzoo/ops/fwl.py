"""The math of Fast Weight Layers (Clark et al. 2022, Sec. 2-3) as pure functions; the layer
(:mod:`memzoo.layers.fwl`, whose docstring states the equations) holds θ, α, γ and the chunk loop.

θ is a dict of the six slow weights (`FAST`): U [D, H], a [H], W [H, D], b [D], and the LayerNorm's
gain g and bias β [D]; α and γ dicts of scalars by the same names. The state ΔΘ is a dict of
``d`` + name, each [B, *shape]. Torch only: every op is a few matmuls, cumsums and one autograd call.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

#: the fast weights, in the order of the step-size and decay vectors
FAST = ("U", "a", "W", "b", "g", "beta")

Head = Callable[[Tensor], Tensor]


def layer_norm(z: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """LayerNorm without affine: (ẑ, 1/σ)."""
    zc = z - z.mean(-1, keepdim=True)
    rstd = torch.rsqrt(zc.square().mean(-1, keepdim=True) + eps)  # (var warns when T = 0)
    return zc * rstd, rstd


def slow_pass(theta: dict[str, Tensor], x: Tensor, targets: Tensor, head: Head | None, eps: float) -> dict[str, Tensor]:
    """Activations of f_θ at every position (the keys of Eq. 2) and the per-position gradients
    ∇ L_t w.r.t. every pre-activation (its values), by hand below the head."""
    U, a, W, b, g, beta = (theta[n] for n in FAST)
    pre = x @ U + a
    r = F.relu(pre).square()
    zhat, rstd = layer_norm(r @ W + b, eps)
    o = g * zhat + beta
    g_o = output_grad(o, targets, head)  # ∇_{o_t} L_t
    g_zhat = g_o * g  # LayerNorm backward
    g_z = rstd * (g_zhat - g_zhat.mean(-1, keepdim=True) - zhat * (g_zhat * zhat).mean(-1, keepdim=True))
    g_pre = (g_z @ W.t()) * 2.0 * F.relu(pre)  # ReLU² backward
    # per-position gradients: ∇U_t = x_tᵀ g_pre_t, ∇a_t = g_pre_t, ∇W_t = r_tᵀ g_z_t,
    # ∇b_t = g_z_t, ∇g_t = g_o_t ⊙ ẑ_t, ∇β_t = g_o_t
    return {"x": x, "r": r, "g_pre": g_pre, "g_z": g_z, "g_g": g_o * zhat, "g_beta": g_o}


@torch.compiler.disable  # eager inside a compiled model: a compiled graph cannot take a gradient with create_graph
def output_grad(o: Tensor, targets: Tensor, head: Head | None) -> Tensor:
    """∇_{o_t} Σ_t CE(head(o)_t, targets_t) = ∇_{o_t} L_t (the head is position-wise).
    Differentiable (create_graph) when autograd records; works under torch.no_grad too.
    The rest of the layer compiles around it (the outer backward runs through this eager
    gradient's graph once, and through the compiled graphs before and after it once)."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError("FWL computes gradients in its forward; use torch.no_grad(), not torch.inference_mode()")
    record = torch.is_grad_enabled() and o.requires_grad
    with torch.enable_grad():
        o_in = o if record else o.detach().requires_grad_()
        logits = o_in if head is None else head(o_in)
        if logits.shape[:2] != o.shape[:2]:
            raise ValueError(
                f"FWL: head returned logits of shape {tuple(logits.shape)} for outputs {tuple(o.shape)}"
            )
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
        (g,) = torch.autograd.grad(loss, o_in, create_graph=record)
    return g.to(o.dtype)


def finite_slow(slow: dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor]:
    """The slow pass's tensors with every non-finite position zeroed, and `later` [B, c, 1]: the
    positions of the chunk after a non-finite one. The fast pass sums over i < t with plain
    triangular matmuls on the zeroed tensors (finite: 0 × NaN never reaches an earlier row) and
    sets the `later` outputs to NaN, as a non-finite term in their sums would have made them."""
    bad = torch.stack([(~v.isfinite()).any(-1) for v in slow.values()]).any(0)  # [B, c]
    ok = ~bad[..., None]
    later = (bad.cumsum(1) - bad.int()) > 0
    return {k: v.where(ok, 0) for k, v in slow.items()}, later[..., None]


def fast(theta: dict[str, Tensor], x: Tensor, state: dict[str, Tensor], slow: dict[str, Tensor] | None,
         alpha: dict[str, Tensor], eps: float) -> Tensor:
    """f_θ'(x_t) for every position of one chunk: θ' = θ - α ∘ (ΔΘ + Σ_{i<t in chunk} ∇θ L_i).
    Without `slow` (a read) only the carried ΔΘ is used. A matrix and its bias take their
    in-chunk sums in one strictly causal matmul: Σ_{i<t} (α_U (v'_t · v_i) + α_a) ∇_{o_i} L_i,
    the bias's term (Σ_{i<t} ∇a_i, an exclusive cumsum) folded into the scores; the LayerNorm
    vectors' exclusive cumsums are a matmul with the strictly lower-triangular ones. A NaN/inf
    at position t leaves every earlier output of the chunk finite (`finite_slow`)."""
    dt = state["dU"].dtype
    x = x.to(dt)
    U, a, W, b, g, beta = (theta[n].to(dt) for n in FAST)
    if slow is not None:
        s, later = finite_slow({k: v.to(dt) for k, v in slow.items()})
    # layer 1: query x'_t = x_t (the input is the same in both passes)
    pre = x @ U + a - alpha["U"] * (x @ state["dU"]) - alpha["a"] * state["da"][:, None]
    if slow is not None:  # Eq. 2: (v'_t · v_i) with keys v_i = x_i
        pre = pre - (alpha["U"] * (x @ s["x"].mT) + alpha["a"]).tril(-1) @ s["g_pre"]
    r = F.relu(pre).square()
    # layer 2: query r'_t (fast), keys r_i (slow)
    z = r @ W + b - alpha["W"] * (r @ state["dW"]) - alpha["b"] * state["db"][:, None]
    if slow is not None:
        z = z - (alpha["W"] * (r @ s["r"].mT) + alpha["b"]).tril(-1) @ s["g_z"]
    zhat, _ = layer_norm(z, eps)
    # LayerNorm's gain and bias: vectors, an exclusive cumsum of their gradients
    gain = g - alpha["g"] * state["dg"][:, None]
    bias = beta - alpha["beta"] * state["dbeta"][:, None]
    if slow is not None:
        c, D = x.shape[1], g.shape[-1]
        before = torch.ones(c, c, dtype=dt, device=x.device).tril(-1)  # [t, i] = 1 for i < t
        sums = before @ torch.cat([s["g_g"], s["g_beta"]], dim=-1)
        gain = gain - alpha["g"] * sums[..., :D]
        bias = bias - alpha["beta"] * sums[..., D:]
    y = gain * zhat + bias
    return y if slow is None else y.masked_fill(later, float("nan"))


# eager inside a compiled model: compiled with the rest, in bf16 autocast, this update gave NaN
# input gradients on an Intel Xeon (batch 64 x 64 tokens, width 128, one chunk, whose update the
# loss does not read: a zero gradient through it came out NaN). Eager, the compiled layer's
# gradients agree with the eager layer's (test_compiled_bf16_gradients_are_finite_and_agree)
@torch.compiler.disable
def accumulate(state: dict[str, Tensor], slow: dict[str, Tensor], gamma: dict[str, Tensor]) -> dict[str, Tensor]:
    """ΔΘ ← γ ∘ ΔΘ + Σ_{i in chunk} ∇θ L_i (Sec. 3), the outer products summed over the chunk."""
    dt = state["dU"].dtype
    s = {k: v.to(dt) for k, v in slow.items()}
    new = {
        "dU": torch.einsum("btd,bth->bdh", s["x"], s["g_pre"]),
        "da": s["g_pre"].sum(1),
        "dW": torch.einsum("bth,btd->bhd", s["r"], s["g_z"]),
        "db": s["g_z"].sum(1),
        "dg": s["g_g"].sum(1),
        "dbeta": s["g_beta"].sum(1),
    }
    return {"d" + n: gamma[n] * state["d" + n] + new["d" + n] for n in FAST}
