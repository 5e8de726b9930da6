"""PKM (memzoo.layers.pkm) and the product-key ops it uses (memzoo.ops.product_key).

The shared property suite (tests/test_layer_properties.py) also runs on "pkm"; here: the product
top-k against brute force, the layer against an explicit O(N) computation, the paper's parameter
counts (Table 2), the values' optimizer group, BatchNorm train/eval behaviour, and the backbone.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_LM, layer_options, tiny_layer
from memzoo.registry import build_layer
from memzoo.layers.pkm import PKM
from memzoo.ops.product_key import brute_force_topk, candidate_pairs, gather_values, lookup, product_topk, subkey_scores

F64 = dict(rtol=1e-10, atol=1e-12)


def tiny(seed: int = 0, perturb: bool = True, **over) -> PKM:
    # perturb: move the zero-initialised biases / unit norm weights off their init
    return tiny_layer("pkm", seed=seed, noise=0.05 if perturb else 0.0, **over)


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---- 1. product top-k == brute-force top-k over all N slots -----------------------------------
CASES = [  # (query leading shape, heads, key dim, n sub-keys, k)
    ((7,), 1, 8, 5, 3),
    ((2, 5), 3, 12, 16, 4),
    ((3, 4), 2, 6, 7, 7),  # k = n: the whole row of each half
    ((2, 3), 4, 16, 32, 1),
    ((1, 9), 2, 10, 11, 8),
]


def _as_sets(scores, index):
    """Sort by index so that two top-k results compare as sets (of slots, with their scores)."""
    idx, order = index.sort(dim=-1)
    return idx, scores.gather(-1, order)


# per-sequence sub-keys [B, H, 2, n, Dk/2] take queries [B, T, H, Dk]
TOPK_CASES = [(*c, False) for c in CASES] + [(*c, True) for c in CASES if len(c[0]) == 2]


def test_candidate_pairs_are_the_cells_that_can_place():
    """Cell (a, b) of the sorted k × k grid is beaten or tied by the (a+1)(b+1) − 1 cells above and
    left of it: at k = 4 the cells with (a+1)(b+1) <= 4 are row 0, (1, 0), (1, 1), (2, 0), (3, 0)."""
    assert candidate_pairs(4).tolist() == [0, 1, 2, 3, 4, 5, 8, 12]
    assert candidate_pairs(8).numel() == 8 + 4 + 2 + 2 + 1 + 1 + 1 + 1  # Σ_a ⌊8 / (a+1)⌋
    assert candidate_pairs(1).tolist() == [0]


@pytest.mark.parametrize("score", ["dot", "idw"])
@pytest.mark.parametrize("lead,H,Dk,n,k,per_seq", TOPK_CASES)
def test_product_topk_equals_brute_force(lead, H, Dk, n, k, per_seq, score):
    q = rand(*lead, H, Dk, seed=1)
    keys = rand(*((lead[0],) if per_seq else ()), H, 2, n, Dk // 2, seed=2)
    fast = lookup(q, keys, k, score=score)
    ref_s, ref_i = brute_force_topk(q, keys, k, score=score)
    assert fast.index.shape == fast.scores.shape == (*lead, H, k)
    assert (fast.index >= 0).all() and (fast.index < n * n).all()
    i_fast, s_fast = _as_sets(fast.scores, fast.index)
    i_ref, s_ref = _as_sets(ref_s, ref_i)
    assert torch.equal(i_fast, i_ref), "product top-k retrieved different slots than brute force"
    torch.testing.assert_close(s_fast, s_ref, **F64)
    torch.testing.assert_close(fast.scores, ref_s, **F64)  # both best first
    # the scores are the scores of the slots they name: s¹_row + s²_col (Eq. 8)
    sub = subkey_scores(q, keys, score)
    row, col = fast.index // n, fast.index % n
    torch.testing.assert_close(fast.scores, sub[..., 0, :].gather(-1, row) + sub[..., 1, :].gather(-1, col), **F64)


@pytest.mark.parametrize("lead,H,Dk,n,k", CASES)
def test_product_topk_dot_equals_explicit_full_keys(lead, H, Dk, n, k):
    """Independent of subkey_scores: build the N = n² full keys [K¹_i; K²_j] explicitly and take
    the top-k of q·K over all of them (Eqs. 1-2 vs Eqs. 5-8)."""
    q = rand(*lead, H, Dk, seed=3)
    keys = rand(H, 2, n, Dk // 2, seed=4)
    full = torch.cat(
        [keys[:, 0, :, None, :].expand(H, n, n, Dk // 2), keys[:, 1, None, :, :].expand(H, n, n, Dk // 2)], dim=-1
    ).reshape(H, n * n, Dk)  # slot i·n + j
    ref_s, ref_i = torch.einsum("...hd,hnd->...hn", q, full).topk(k, dim=-1)
    fast = product_topk(subkey_scores(q, keys, "dot"), k)
    i_fast, s_fast = _as_sets(fast.scores, fast.index)
    i_ref, s_ref = _as_sets(ref_s, ref_i)
    assert torch.equal(i_fast, i_ref)
    torch.testing.assert_close(s_fast, s_ref, **F64)


# ---- 2. the layer == an explicit naive computation ------------------------------------------
def naive_pkm(layer: PKM, x: torch.Tensor) -> torch.Tensor:
    """Score all N slots with explicit full keys, top-k and softmax per head, weighted sum of the
    values, summed over heads, gated output projection. Only the query norm is taken from the layer."""
    H, Dk, n, k = layer.heads, layer.key_dim, layer.n_subkeys, layer.topk
    q = x @ layer.query_proj.weight.T + layer.query_proj.bias
    if layer.query_norm_kind == "rmsnorm":
        q = q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + layer.query_norm.eps) * layer.query_norm.weight
    elif layer.query_norm_kind == "batchnorm":
        bn = layer.query_norm
        assert not bn.training
        q = (q - bn.running_mean) / torch.sqrt(bn.running_var + bn.eps) * bn.weight + bn.bias
    q = q.reshape(*x.shape[:-1], H, Dk)
    K = layer.subkeys
    out = torch.zeros(*x.shape[:-1], layer.value_dim, dtype=x.dtype)
    for h in range(H):
        full = torch.stack(
            [torch.cat([K[h, 0, i], K[h, 1, j]]) for i in range(n) for j in range(n)]
        )  # [N, Dk], slot i·n + j
        s = q[..., h, :] @ full.T  # [B, T, N] (Eq. 1)
        top, idx = s.topk(k, dim=-1)  # Eq. 2
        w = torch.softmax(top, dim=-1)  # Eq. 3
        out = out + (w[..., None] * layer.values[idx]).sum(-2)  # Eq. 4, summed over heads
    if layer.gate_proj is not None:
        out = out * F.silu(x @ layer.gate_proj.weight.T + layer.gate_proj.bias)
    return out @ layer.out_proj.weight.T + layer.out_proj.bias


@pytest.mark.parametrize("over", [{}, {"query_norm": "none"}, {"output_gate": False}, {"heads": 3, "topk": 8}])
def test_layer_equals_naive(over):
    layer = tiny(**over)
    x = rand(2, 6, 32, seed=5)
    y = layer(x)
    torch.testing.assert_close(y, naive_pkm(layer, x), **F64)
    torch.testing.assert_close(layer.read(x), y, rtol=0, atol=0)  # read == forward
    assert layer.state == {}
    # same gradients for every slow weight (the embedding bag's backward included)
    r = rand(*y.shape, seed=6)
    params = [p for _, p in layer.named_parameters()]
    g_layer = torch.autograd.grad((layer(x) * r).sum(), params)
    g_naive = torch.autograd.grad((naive_pkm(layer, x) * r).sum(), params)
    for (name, _), a, b in zip(layer.named_parameters(), g_layer, g_naive):
        torch.testing.assert_close(a, b, **F64, msg=lambda m, name=name: f"grad of {name}: {m}")


def test_layer_equals_naive_batchnorm_eval():
    layer = tiny(query_norm="batchnorm")
    layer.train()
    layer(rand(4, 8, 32, seed=6))  # move the running statistics off (0, 1)
    layer.eval()
    x = rand(2, 6, 32, seed=7)
    torch.testing.assert_close(layer(x), naive_pkm(layer, x), **F64)


def test_embedding_bag_read_equals_gather_values():
    """The layer's embedding bag is the math of the shared op gather_values (Eq. 9, heads summed)."""
    layer = tiny()
    x = rand(2, 5, 32, seed=8)
    look, w = layer.address(x)
    v = gather_values(layer.values, look.index.flatten(-2), w.flatten(-2))
    v = v * F.silu(layer.gate_proj(x))
    torch.testing.assert_close(layer(x), layer.out_proj(v), **F64)


def test_write_is_a_noop_and_any_batch_size():
    layer = tiny()
    x = rand(2, 6, 32, seed=9)
    y0 = layer(x)
    layer.write(rand(5, 4, 32, seed=10))
    assert layer.state == {} and layer.fast_weight_numel() == 0
    torch.testing.assert_close(layer(x), y0, rtol=0, atol=0)
    assert layer(rand(3, 2, 32)).shape == (3, 2, 32)  # no per-sequence state: any batch size
    assert layer(rand(2, 0, 32)).shape == (2, 0, 32)


def test_stats_slot_usage():
    layer = tiny()
    assert "usage/slots" not in layer.stats()
    x = rand(3, 7, 32, seed=11)
    layer(x)
    st = layer.stats()
    look, _ = layer.address(x)
    n_hit = look.index.unique().numel()
    assert st["usage/slots_hit"] == n_hit
    assert st["usage/slots"] == pytest.approx(n_hit / layer.n_slots)
    assert st["usage/reads"] == 3 * 7 * layer.heads * layer.topk
    assert 0 <= st["usage/kl_uniform"] <= math.log(layer.n_slots) + 1e-9


def test_bad_options_are_explained():
    with pytest.raises(ValueError, match="topk=9 exceeds n_subkeys=8"):
        PKM(32, topk=9, n_subkeys=8)
    with pytest.raises(ValueError, match="key_dim must be even"):
        PKM(32, key_dim=15, n_subkeys=8, topk=4)
    with pytest.raises(ValueError, match="unknown query_norm"):
        PKM(32, query_norm="layernorm", n_subkeys=8, topk=4)
    with pytest.raises(ValueError, match="unknown option"):
        build_layer("pkm", 32, mem_knn=4)


# ---- 3. parameters: Table 2 ---------------------------------------------------------------
SWIGLU_FFN = 3 * 768 * 2304  # 5,308,416: what one PKM replaces


def test_param_count_paper_size():
    with torch.device("meta"):
        layer = PKM(768)  # Table 3: key dim 512, value dim 512, 4 heads, top-32, 512² slots
    n = sum(p.numel() for p in layer.parameters())
    target = (509.08 - 112.11) / 3 * 1e6 + SWIGLU_FFN  # Table 2: GDN | PKM@2,6,10 vs GDN
    assert abs(n - target) < 0.1e6, n
    assert n == 512**2 * 512 + 4 * 2 * 512 * 256 + (768 * 2048 + 2048) + 2048 + (768 * 512 + 512) + (512 * 768 + 768)
    assert n == 137_630_976


@pytest.mark.parametrize(
    "name,layout,table2",
    [("paper/gdn", "GDN", 509.08), ("paper/gdn-swa", "GDN+SWA", 509.61), ("paper/gdn-fa", "GDN+FA", 509.61),
     ("paper/fa", "FA", 511.22)],
)
def test_paper_model_with_pkm_matches_table2(name, layout, table2):
    """Every `| PKM@2,6,10` row of Table 2 to the published two decimals (built on meta)."""
    from memzoo.backbone import count_params
    from memzoo.config import ModelConfig, load_config

    mc = load_config(name).model
    assert mc.layout == layout
    mc = ModelConfig.from_dict({**mc.to_dict(), "layout": f"{layout} | PKM@2,6,10"})
    assert round(count_params(mc) / 1e6, 2) == table2


# ---- 4. optimizer group of the values -----------------------------------------------------
def test_optim_groups_values_only():
    layer = PKM(32, **layer_options("pkm"))
    (g,) = layer.optim_groups()
    assert len(g["params"]) == 1 and g["params"][0] is layer.values
    assert g["lr_scale"] == 1.0 and g["weight_decay"] == 0.0
    (g,) = PKM(32, **layer_options("pkm"), value_lr_scale=3.0).optim_groups()
    assert g["lr_scale"] == 3.0


def test_trainer_param_groups_take_values_out_of_decay():
    from memzoo.backbone.model import HybridLM
    from memzoo.train import param_groups

    model = HybridLM.from_layout("GDN | PKM@1", **PKM_LM)
    pkm = model.blocks[1].ffn
    groups = param_groups(model, SimpleNamespace(weight_decay=0.1))
    holding = [g for g in groups if any(p is pkm.values for p in g["params"])]
    assert len(holding) == 1 and holding[0]["params"] == [pkm.values]
    assert holding[0]["weight_decay"] == 0.0 and holding[0]["lr_scale"] == 1.0
    n_all = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for g in groups for p in g["params"]) == n_all  # every parameter once


# ---- 5. BatchNorm queries: train vs eval ----------------------------------------------------
def test_batchnorm_train_is_not_causal_eval_is_per_token():
    layer = tiny(query_norm="batchnorm")
    bn = layer.query_norm
    x = rand(2, 6, 32, seed=12)
    x2 = x.clone()
    x2[:, -1] += 3.0  # change only the last token

    layer.train()
    mean0 = bn.running_mean.clone()
    y_train = layer(x)
    assert not torch.equal(bn.running_mean, mean0), "training mode must update the running statistics"
    assert bn.num_batches_tracked.item() == 1
    # batch statistics over all B·T positions: earlier tokens see the change of a later one
    assert not torch.allclose(layer(x2)[:, 0], y_train[:, 0])
    # and the queries are normalised per feature over the batch
    q = layer.queries(x).flatten(0, 1).flatten(1)
    torch.testing.assert_close(q.mean(0), bn.bias.detach(), rtol=0, atol=1e-9)

    layer.eval()
    stats = (bn.running_mean.clone(), bn.running_var.clone())
    y_eval = layer(x)
    assert torch.equal(bn.running_mean, stats[0]) and torch.equal(bn.running_var, stats[1])
    assert not torch.allclose(y_eval, y_train)
    torch.testing.assert_close(layer(x2)[:, :-1], y_eval[:, :-1], **F64)  # causal again
    per_token = torch.cat([layer(x[:, t : t + 1]) for t in range(x.shape[1])], dim=1)
    torch.testing.assert_close(per_token, y_eval, **F64)
    y_eval.sum().backward()  # gradients flow in eval mode too
    assert layer.query_proj.weight.grad is not None


def test_rmsnorm_queries_are_causal_in_training():
    layer = tiny().train()
    x = rand(2, 6, 32, seed=13)
    x2 = x.clone()
    x2[:, -1] += 3.0
    torch.testing.assert_close(layer(x2)[:, :-1], layer(x)[:, :-1], rtol=0, atol=0)


# ---- 6. in the backbone --------------------------------------------------------------------
PKM_LM = dict(**TINY_LM, memory={"pkm": layer_options("pkm")})


def test_backbone_builds_and_trains_a_step():
    from memzoo.backbone.ffn import SwiGLU
    from memzoo.backbone.model import HybridLM
    from memzoo.train import param_groups

    torch.manual_seed(0)
    model = HybridLM.from_layout("GDN | PKM@1", **PKM_LM)
    assert isinstance(model.blocks[1].ffn, PKM) and isinstance(model.blocks[0].ffn, SwiGLU)
    assert len(model.blocks[1].mems) == 0 and model.memories() == [model.blocks[1].ffn]
    pkm = model.blocks[1].ffn
    assert (pkm.key_dim, pkm.value_dim, pkm.heads, pkm.topk, pkm.n_subkeys) == (16, 16, 2, 4, 8)

    groups = param_groups(model, SimpleNamespace(weight_decay=0.1))
    opt = torch.optim.AdamW(groups, lr=1e-2)
    for g in opt.param_groups:
        g["lr"] = 1e-2 * g["lr_scale"]
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for _ in range(3):
        model.train()
        loss = model(x, targets=y).loss
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        assert pkm.values.grad is not None and pkm.values.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for n, p in model.named_parameters():
        if n.startswith("blocks.1.ffn."):
            assert not torch.equal(p, before[n]), f"{n} did not train"
    assert 0 < pkm.stats()["usage/slots"] <= 1
