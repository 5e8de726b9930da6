"""FwPKM's fast-weight ops (Zhao & Jones 2026, Sec. 3): the lookup and read (Eqs. 27-32), the value
step (Eqs. 35-36) and the key gradient (Eqs. 37-39, or App. B's memorisation loss), as pure
functions of tensors; the layer (:mod:`memzoo.layers.fwpkm`) calls them.

Each op has a torch reference (``*_reference``, or the product-key ops of
:mod:`memzoo.ops.product_key`) and, where one exists, the Triton path of :mod:`memzoo.kernels.fwpkm`,
behind one dispatch: `product_key.kernels` (CUDA tensors and ``triton=True``; the CPU path never
imports the kernels). A step whose outer gradients must flow through it (``outer`` /
``functional``) takes the torch path, whose graph autograd keeps.

Shapes: queries q [B, T, H·Dk]; sub-keys [H, 2, n, Dk/2] (one memory shared by the batch) or
[B, H, 2, n, Dk/2] (one per sequence); values flat [R, Dv], the rows of every memory (R = n² or B·n²);
a token's reads idx, w [B, T, m] with m = H·k, idx the rows into the flat values (`slot_rows`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from memzoo.modules.precision import compute_dtype
from memzoo.ops import product_key as pk
from memzoo.ops.product_key import Lookup, gather_rows, gather_values, pair_scores, selected_subkey_scores, subkey_rows


def fp32(x: Tensor) -> Tensor:
    """Fast-weight math runs in at least fp32 (the release's fp32_fw)."""
    return x.to(compute_dtype(x))


@torch.compiler.disable
def add_rows(table: Tensor, rows: Tensor, delta: Tensor) -> None:
    """table[rows] += delta in place, outside any torch.compile graph: traced, the in-place
    write to a large memory is functionalised into a copy of the whole table per chunk."""
    table.index_add_(0, rows, delta)


def slot_rows(index: Tensor, n_slots: int, per_sequence: bool) -> Tensor:
    """Rows into the flat values of slot ids `index` [B, T, m]: with a memory per sequence,
    sequence b addresses its own block of `n_slots` rows."""
    if per_sequence:
        index = index + torch.arange(index.shape[0], device=index.device).view(-1, 1, 1) * n_slots
    return index


# ---- lookup and read (Eqs. 27-32) ------------------------------------------------------------


def lookup(q: Tensor, keys: Tensor, topk: int, score: str, eps: float, triton: bool = True) -> tuple[Lookup, Tensor]:
    """Top-k slots of queries q [B, T, H, Dk] (fp32) and their softmax weights [B, T, H·k] over
    heads × top-k jointly (the release). Selection needs no gradient (the fused kernel, or the
    torch lookup); the k selected scores are then recomputed differentiably (O(k·d) per query, not
    O(n·d)) for the weights' gradient to q, and returned in the lookup as ``sub_scores`` (exact
    ||q - K||², which the kernel path's key gradient reads)."""
    with torch.no_grad():
        kern = pk.kernels(q, triton)
        lk = (kern.lookup if kern else pk.lookup)(q, keys, topk, score, eps)
    top = selected_subkey_scores(q, keys, lk.sub_index, score, eps)
    w = torch.softmax(pair_scores(top, lk.pair).flatten(-2), dim=-1)
    return lk._replace(sub_scores=top.detach()), w


def read(values: Tensor, idx: Tensor, w: Tensor, triton: bool = True) -> Tensor:
    """v̂ = Σ s'_i V_i (Eq. 32) from the flat values: the embedding-bag kernel, else the torch gather."""
    kern = pk.kernels(w, triton)
    if kern is None:
        return gather_values(values, idx, w)
    return kern.embedding_bag(values, idx, w, snapshot=not values.requires_grad)  # written in place next


# ---- the value step (Eqs. 35-36) -------------------------------------------------------------


def value_step(values: Tensor, idx: Tensor, w: Tensor, err: Tensor, ok: Tensor, scale: float, *,
               functional: bool, triton: bool = True) -> Tensor:
    """V_i <- V_i - scale / N_i^read · Σ_t w_{t,i} err_t (Eqs. 35-36) on the flat values [R, Dv].

    idx, w [B, T, m]: every token's reads (N_i^read counts them all, the chunk's last token
    included, though it writes nothing); err [B, Tw, Dv]: ∇_{v̂} of the writing tokens' loss (the
    first Tw tokens); ok [B, T]: the tokens that count (a non-finite token's reads count 0).
    `functional`: a new tensor whose graph outer gradients flow through; else in place (the same
    tensor returned): one deterministic segment sum per touched row on the kernels."""
    kern = None if functional else pk.kernels(w, triton)
    if kern is None:
        return value_step_reference(values, idx, w, err, ok, scale, functional=functional)
    B, T, _ = idx.shape
    err_all = err.new_zeros(B, T, values.shape[-1])
    err_all[:, : err.shape[1]] = err  # the chunk's last token reads (N_i^read) but writes nothing
    kern.segment_sum(values, kern.Segments(idx), w.reshape(-1), err_all.view(-1, values.shape[-1]),
                     per_token=idx.shape[-1], alpha=-scale, count=ok.to(values.dtype).reshape(-1), accumulate=True)
    return values


def value_step_reference(values: Tensor, idx: Tensor, w: Tensor, err: Tensor, ok: Tensor, scale: float, *,
                         functional: bool) -> Tensor:
    """`value_step` in torch: index_add, in place (O(rows touched), not O(R)) or functional."""
    Tw, Dv = err.shape[1], values.shape[-1]
    n_read = values.new_zeros(values.shape[0]).index_add_(
        0, idx.reshape(-1), ok[..., None].expand_as(idx).reshape(-1).to(values.dtype))
    rows = idx[:, :Tw].reshape(-1)
    n_w = n_read[rows].clamp(min=1)  # (a row only a non-finite token read gets a zero step)
    # each entry's share of its row's gradient, divided by the row's N_i^read
    delta = (w[:, :Tw].unsqueeze(-1) * err.unsqueeze(-2)).reshape(-1, Dv)
    delta = delta * (-scale / n_w).unsqueeze(-1)
    if functional:
        return values.index_add(0, rows, delta)
    add_rows(values, rows, delta)
    return values


# ---- the key gradient (Eqs. 37-39; App. B) ---------------------------------------------------


def addressing_key_grad(q: Tensor, ok: Tensor, lk: Lookup, keys: Tensor, *, weight: float, score: str, eps: float,
                        pooled_entropy: bool, outer: bool = False, triton: bool = True) -> Tensor:
    """∇_K of the addressing loss L = -weight · Σ_sets H(p̄) (Eqs. 37-39), [*keys.shape]. Only the
    selected sub-keys get gradient: O(k·d) per token. `ok` [B, T] marks the tokens that count;
    `outer`: keep the graph (outer gradients through the update; the torch path).

    Written out, no autograd call (cheaper, and the same expression keeps its graph when asked).
    For each counted token and sub-key set, with s_j its k selected scores (IDW, Eq. 28),
    p = softmax(s) (Eq. 30) and p̄ the set's mean of the scattered p (Eq. 37):
        H(p̄) = -Σ_i p̄_i log(p̄_i + 1e-8)                                       (Eq. 38)
        ∂L/∂p̄_i = weight (log(p̄_i + 1e-8) + p̄_i / (p̄_i + 1e-8))
        ∂L/∂p_j = ∂L/∂p̄_{i_j} / n_set,  ∂L/∂s_j = p_j (∂L/∂p_j - Σ_l p_l ∂L/∂p_l)
        ∂s_j/∂K_{i_j} = 2 (q - K_{i_j}) / (ε + ||q - K_{i_j}||²)   (IDW; dot: q)
    and each ∂L/∂K_i sums the tokens that selected sub-key i. A set is a sequence's (a memory per
    sequence), head's (unless `pooled_entropy`) and half's sub-keys."""
    kern = None if outer else pk.kernels(q, triton)
    B, T, _ = q.shape
    d = keys.shape[-1]
    with torch.set_grad_enabled(outer):
        qh = fp32(q).view(B, T, keys.shape[-4], 2, 1, d)
        rows = subkey_rows(keys, lk.sub_index)  # [B, T, H, 2, k] into keys.reshape(-1, d)
        if kern is not None:  # the selected scores as `lookup` recomputed them (0 for a token that counts nowhere)
            s = lk.sub_scores.where(ok[:, :, None, None, None], 0)
            ds = _entropy_score_grad(s, ok, lk.sub_index, keys, weight, pooled_entropy, kern)
            c = 2 * ds * torch.exp(s) if score == "idw" else ds  # IDW: Σ_j c_j (q - K_i), as Σ c_j q - (Σ c_j) K_i
            grad = keys.new_zeros(keys.numel() // d, d)
            kern.segment_sum(grad, kern.Segments(rows), c.reshape(-1), qh.reshape(-1, d), per_token=rows.shape[-1],
                             table=keys.reshape(-1, d) if score == "idw" else None)
            return grad.view_as(keys)
        K = gather_rows(keys, rows)  # [B, T, H, 2, k, d]
        if score == "idw":
            diff = qh - K
            dist = eps + diff.pow(2).sum(-1)
            s, ds_dK = -torch.log(dist), 2 * diff / dist[..., None]
        else:
            s, ds_dK = (qh * K).sum(-1), qh.expand_as(K)
        ds = _entropy_score_grad(s, ok, lk.sub_index, keys, weight, pooled_entropy, None)
        grad = keys.new_zeros(keys.numel() // d, d).index_add(0, rows.reshape(-1), (ds[..., None] * ds_dK).reshape(-1, d))
        return grad.view_as(keys)


def _entropy_score_grad(s: Tensor, ok: Tensor, sub_index: Tensor, keys: Tensor, weight: float, pooled: bool,
                        kern) -> Tensor:
    """∂L/∂s [B, T, H, 2, k] of the addressing loss for the selected scores s (the steps from p to
    ∂L/∂s in `addressing_key_grad`); p̄ summed by the kernels' segment sum, or by index_add."""
    B, T, H = s.shape[:3]
    n, dev = keys.shape[-2], s.device
    per_sequence = keys.dim() == 5
    okf = ok[:, :, None, None, None].to(s.dtype)
    p = torch.softmax(s, -1) * okf  # s' over each half's top-k (Eq. 30), counted tokens only
    # p̄ (Eq. 37) per sub-key set: the mean over the set's counted tokens (and heads, if pooled)
    n_h = 1 if pooled else H
    b_set = torch.arange(B, device=dev).view(B, 1, 1, 1) if per_sequence else torch.zeros((), dtype=torch.long)
    h_set = torch.zeros((), dtype=torch.long) if pooled else torch.arange(H, device=dev).view(H, 1)
    set_id = ((b_set * n_h + h_set) * 2 + torch.arange(2, device=dev)).expand(B, T, H, 2)
    n_sets = (B if per_sequence else 1) * n_h * 2
    n_tok = okf.new_zeros(n_sets).index_add_(0, set_id.reshape(-1), okf.expand(B, T, H, 2, 1).reshape(-1))
    n_tok = n_tok.clamp(min=1).take(set_id)[..., None]  # [B, T, H, 2, 1]
    bucket = set_id[..., None] * n + sub_index  # [B, T, H, 2, k]: sub-key i of its set
    if kern is not None:
        p_bar = kern.segment_sum(p.new_zeros(n_sets * n, 1), kern.Segments(bucket), (p / n_tok).reshape(-1))[:, 0]
    else:
        p_bar = p.new_zeros(n_sets * n).index_add(0, bucket.reshape(-1), (p / n_tok).reshape(-1))
    dp_bar = weight * (torch.log(p_bar + 1e-8) + p_bar / (p_bar + 1e-8))
    dp = dp_bar.take(bucket) / n_tok * okf
    return p * (dp - (p * dp).sum(-1, keepdim=True))  # softmax backward


def memorisation_key_grad(q: Tensor, lk: Lookup, keys: Tensor, values: Tensor, tgt: Tensor, lw: Tensor, *, score: str,
                          eps: float, outer: bool = False) -> Tensor:
    """App. B "w/o addr loss": ∇_K of ½·mean over the chunk's pairs and features of the gate-weighted
    MSE (the release's `no_addr_loss`), by autograd; the first Tw = tgt.shape[1] tokens write.
    values [R, Dv] flat (held fixed); `outer`: keep the graph (the release)."""
    Tw = tgt.shape[1]
    if Tw == 0:
        return torch.zeros_like(keys)
    B, T, _ = q.shape
    H, n = keys.shape[-4], keys.shape[-2]
    per_sequence = keys.dim() == 5
    with torch.enable_grad():
        K = keys if keys.requires_grad else keys.detach().requires_grad_()
        qh = fp32(q).view(B, T, H, 2 * keys.shape[-1])
        top = selected_subkey_scores(qh[:, :Tw], K, lk.sub_index[:, :Tw], score, eps)
        w = torch.softmax(pair_scores(top, lk.pair[:, :Tw]).flatten(-2), -1)
        idx = slot_rows(lk.index[:, :Tw].flatten(-2), n * n, per_sequence)
        v_hat = gather_values(values.detach(), idx, w)
        pairs = Tw if per_sequence else B * Tw  # pairs behind each memory
        loss = 0.5 * (fp32(lw).unsqueeze(-1) * (fp32(tgt) - v_hat).pow(2)).sum() / (pairs * values.shape[-1])
        (grad,) = torch.autograd.grad(loss, K, create_graph=outer)
    return grad
