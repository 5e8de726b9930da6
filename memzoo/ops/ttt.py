"""TTT's mini-batch gradient descent in its dual form (Sun et al. 2024, arXiv 2407.04620, Sec. 2.5-2.7).

The hidden state is a model f(x; W) = x + LN(f_res(x; W)) (f_res linear: TTT-Linear; a 2-layer MLP
with GELU: TTT-MLP), trained as the sequence streams on ℓ(W; x_t) = ½‖f_res-part − (v_t − k_t)‖², i.e.

    ℓ_t(W) = ½ ‖LN(f_res(k_t; W)) − (v_t − k_t)‖²                  (Eq. 4 with the residual of Sec. 2.7)

in mini-batches of b tokens: every gradient of a mini-batch is taken at the weights W_0 it started
from, and token i of it reads with the weights moved by the gradients of the tokens up to itself:

    W_i = W_0 − c_i Σ_{j≤i} lr_j ∇ℓ_j(W_0)                            (Sec. 2.5-2.7; the release's η[i, j] = c_i lr_j)
    z_i = f(q_i; W_i) = q_i + LN(f_res(q_i; W_i))

c_i (a learnable 1/(i+1), per position in the mini-batch) and lr_j (per source token) are the
caller's; the next mini-batch starts from W_b. The dual form computes every z_i without forming a
W_i: for f_res(x) = x W + b, q_i W_i + b_i = q_i W_0 + b_0 − c_i Σ_{j≤i} lr_j (q_i·k_j + 1) g_j with
g_j = ∂ℓ_j/∂f_res; for the MLP the same holds layer by layer (the second layer's with the query's
hidden state under its own first layer, dotted with the keys' hidden states under W_0).

Streaming. The state is the weights W_0 of the current mini-batch, the sums G = Σ_j lr_j ∇ℓ_j(W_0)
of its tokens so far and their count `pos`; a call continues the mini-batch it finds (the weights
a token reads are W_0 − c_{pos} G), so a sequence split at any token gives what one call gives. (The
release runs a call's last partial mini-batch as a mini-batch of its own and commits it; the
weights that token reads are the same, and the next call here continues the mini-batch instead.)

No fla path: fla's ``chunk_ttt_linear`` (and its reference ``fla.ops.ttt.naive.ttt_linear``) moves token i's
weights at the rate η_i of the reading token, where TTT's release and this op use η[i, j] = c_i lr_j, set by
each source token's lr; the two agree only for an lr constant over a call, which no layer's call has.

Non-finite input: a token whose q, k, v or lr is not finite is zeroed, and its output, every later
one and the state are NaN (as the chunked delta-rule ops: 0 × NaN in the dual form's masked matmuls
would reach the earlier outputs).
"""

from __future__ import annotations

import torch
from torch import Tensor

from memzoo.ops.inner_loop import ACTIVATIONS, layer_norm, layer_norm_backward, mlp_backward, mlp_forward

#: the fast weights of each inner model (the sums G have the same keys)
KEYS = {"linear": ("W1", "b1"), "mlp": ("W1", "b1", "W2", "b2")}


def effective(fast: dict, acc: dict, c: Tensor | float) -> dict:
    """The weights a token reads: W_0 − c G."""
    return {n: fast[n] - c * acc[n] for n in fast}


def f_res(x: Tensor, w: dict, act: str | None) -> Tensor:
    """The inner model's f_res: x W1 + b1 (linear) or act(x W1 + b1) W2 + b2 (mlp)."""
    if "W2" not in w:
        return x @ w["W1"] + w["b1"]
    return mlp_forward(x, w["W1"], w["b1"], w["W2"], w["b2"], act)[0]


def _segment(q, k, v, lr, c, fast, acc, ln_w, ln_b, eps, act):
    """Tokens of one mini-batch (all at W_0 = fast, after the sums acc); c: [L] their positions' c.
    Returns (f_res(q_i; W_i) [.., L, d], the sums after them)."""
    tri = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool, device=q.device).tril()
    cc = c[:, None]
    target = v - k
    if "W2" not in fast:  # TTT-Linear
        out, zhat, rstd = layer_norm(k @ fast["W1"] + fast["b1"], ln_w, ln_b, eps)
        lg = lr[..., None] * layer_norm_backward(out - target, zhat, rstd, ln_w)      # lr_j g_j
        A = (q @ k.transpose(-1, -2) + 1).where(tri, 0)
        zq = q @ fast["W1"] + fast["b1"] - cc * (q @ acc["W1"] + acc["b1"] + A @ lg)
        new = {"W1": acc["W1"] + k.transpose(-1, -2) @ lg, "b1": acc["b1"] + lg.sum(-2, keepdim=True)}
    else:  # TTT-MLP
        y, z1, h = mlp_forward(k, fast["W1"], fast["b1"], fast["W2"], fast["b2"], act)
        out, zhat, rstd = layer_norm(y, ln_w, ln_b, eps)
        g2 = layer_norm_backward(out - target, zhat, rstd, ln_w)
        lg1, lg2 = lr[..., None] * mlp_backward(g2, z1, fast["W2"], act), lr[..., None] * g2
        A1 = (q @ k.transpose(-1, -2) + 1).where(tri, 0)
        z1q = q @ fast["W1"] + fast["b1"] - cc * (q @ acc["W1"] + acc["b1"] + A1 @ lg1)
        hq = ACTIVATIONS[act][0](z1q)
        A2 = (hq @ h.transpose(-1, -2) + 1).where(tri, 0)
        zq = hq @ fast["W2"] + fast["b2"] - cc * (hq @ acc["W2"] + acc["b2"] + A2 @ lg2)
        new = {"W1": acc["W1"] + k.transpose(-1, -2) @ lg1, "b1": acc["b1"] + lg1.sum(-2, keepdim=True),
               "W2": acc["W2"] + h.transpose(-1, -2) @ lg2, "b2": acc["b2"] + lg2.sum(-2, keepdim=True)}
    return zq, new


def ttt_scan(q: Tensor, k: Tensor, v: Tensor, lr: Tensor, c: Tensor, fast: dict, acc: dict, pos: int,
             ln_w: Tensor, ln_b: Tensor, eps: float = 1e-6, act: str | None = "gelu") -> tuple[Tensor, dict, dict, int]:
    """Run the tokens of q, k, v [B, H, T, d] (lr [B, H, T]) through TTT's mini-batch GD.

    Args:
        c: [b] the learnable position factor of each place of a mini-batch (b = its length).
        fast: the weights W_0 of the current mini-batch (KEYS: W1 [B, H, d, d'], b1 [B, H, 1, d'], ...).
        acc: the sums G of the current mini-batch's tokens so far (same shapes); pos: their count.
        ln_w, ln_b: the inner LayerNorm's weight and bias [H, 1, d].

    Returns:
        (f_res(q_i; W_i) [B, H, T, d] for every token (the output is q_i + LN of it), and fast, acc,
        pos after the last token).
    """
    b, T = c.shape[0], q.shape[-2]
    if not 0 <= pos < b:
        raise ValueError(f"pos must be in [0, {b}), got {pos}")
    bad = ~(q.sum(-1) + k.sum(-1) + v.sum(-1) + lr).isfinite()                     # [B, H, T]
    masked = bad.device.type != "cpu" or torch.compiler.is_compiling() or bool(bad.any())
    if masked:
        q, k, v = (x.where(~bad[..., None], 0) for x in (q, k, v))
        lr = lr.where(~bad, 0)
    outs, s = [], 0
    while s < T:
        L = min(b - pos, T - s)
        z, acc = _segment(q[..., s:s + L, :], k[..., s:s + L, :], v[..., s:s + L, :], lr[..., s:s + L],
                          c[pos:pos + L], fast, acc, ln_w, ln_b, eps, act)
        outs.append(z)
        s, pos = s + L, pos + L
        if pos == b:  # the mini-batch is whole: W_b = W_0 − c_b G, and a new one starts
            fast, acc, pos = effective(fast, acc, c[b - 1]), {n: torch.zeros_like(a) for n, a in acc.items()}, 0
    z = torch.cat(outs, dim=-2) if outs else q.new_zeros(q.shape)
    if masked:
        seen = bad.cumsum(-1) > 0
        z = z.where(~seen[..., None], float("nan"))
        poison = seen[..., -1, None, None] if T else torch.zeros_like(bad[..., :1, None])
        fast = {n: w.where(~poison, float("nan")) for n, w in fast.items()}
        acc = {n: w.where(~poison, float("nan")) for n, w in acc.items()}
    return z, fast, acc, pos
