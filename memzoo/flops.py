"""FLOPs of one training step, two ways (FwPKM paper Sec. 6, Table 2).

**Table-2 accounting.** The paper's FLOPs column is 6 × (counted parameters) × tokens for one
step of 8 × 4096 tokens (forward 2, backward 4 FLOPs per multiply-accumulate of each weight,
once per token), where the counted parameters are every slow parameter *except PKM's value
tables*: a token reads k rows of a PKM table, not all N. FwPKM's sub-keys and values are fast
weights (buffers, written by the layer itself), so they are not counted either; PKM's sub-keys
are (their scoring is a dense q·K product). The attention and gated-delta-rule kernels are not
in it. Checked against all 16 rows of Table 2 (tests/test_cost.py): the rule reproduces every
row within 0.1% (the same rule with FwPKM's sub-keys counted is 0.4-0.7% high on the FwPKM
rows, and counting the PKM values would make the PKM rows 4 x larger). :func:`table2_flops`.

**Full count.** One training step (forward and backward of the LM loss, FwPKM's local
fast-weight update included, since it runs inside the forward) of a model built on the meta
device, run under ``torch.utils.flop_counter.FlopCounterMode``: no memory is allocated and
nothing is computed, so the paper's 500 M-parameter models at 8 × 4096 tokens count in seconds
on any machine. FlopCounterMode counts matmuls (2 FLOPs per multiply-add); what it misses or
gets wrong is registered here (:func:`step_flops`):

- softmax attention: on meta, SDPA runs its math path and would be counted as a full T × T
  product whatever the mask. It is replaced during counting by a stand-in that keeps shapes and
  autograd edges, and the cost is counted exactly: 4 · heads · head_dim FLOPs per (query, key)
  pair the mask lets through (causal, or within the window: SWA's 512), and twice that in the
  backward (FlashAttention's backward recomputation is not counted, as FlopCounterMode does for
  its own attention formulas);
- the gated delta rule: the chunked torch algorithm (memzoo.ops.gated_delta_rule, the same
  chunk/WY form fla's kernels compute) runs on meta; its batched matmuls are counted by
  FlopCounterMode, its triangular solves by the formula registered here;
- depthwise convolutions' backward (FlopCounterMode ignores `groups` there and overcounts the
  GDN short convolutions' backward by a factor of the channel count). The short convolutions run
  as shifted multiply-adds (:mod:`memzoo.modules.conv`), which the counter would not see; on
  meta they run as the grouped conv1d they equal, and are counted as convolutions;
- sparse gathers and scatters with arithmetic: embedding bags (PKM's weighted value sum and its
  two backward halves), index_add (FwPKM's value write), scatter_add and accumulating index_put
  (backward of gathers, FwPKM's sub-key statistics), the token embedding's backward. A plain
  gather moves memory and costs no FLOPs; top-k, softmax, norms and other elementwise ops are
  not counted (FlopCounterMode's convention, and the usual one for MFU).

Data-dependent results have no meta kernel (FwPKM's torch.unique over the rows it writes, PKM's
slot-usage bincount, a diagnostic `.item()` or `.cpu()`); while counting they get an answer
(sizes at their upper bound, statistics 0): only bookkeeping depends on them. One layer sizes its
work by the data: MoM runs each memory over the tokens routed to it, padded to the busiest
memory's count; it is counted at perfectly balanced routing (T · top-k / M tokens per memory,
what its load-balancing loss aims at). A layer states such a value with its `meta_scalar(x)`
method (memzoo.layers.base.MemoryLayer); any other integer read on meta is an error.

The optimizer step (AdamW: elementwise) is not counted.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from math import prod

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

aten = torch.ops.aten

TABLE2_BATCH, TABLE2_SEQ_LEN = 8, 4096  # Table 2: one step of 8 × 4096 tokens


# ---- Table 2's accounting -------------------------------------------------------------------


def sparse_table_params(model: torch.nn.Module) -> int:
    """Slow parameters a token reads only k rows of (a layer's `sparse_params`: PKM's value tables)."""
    from memzoo.layers.base import MemoryLayer

    return sum(m.get_parameter(n).numel() for m in model.modules() if isinstance(m, MemoryLayer)
               for n in m.sparse_params)


def table2_params(model: torch.nn.Module) -> int:
    """The parameters Table 2's FLOPs count: every slow parameter but PKM's value tables (fast
    weights are buffers, not parameters, so FwPKM's keys and values are out as well)."""
    return sum(p.numel() for p in model.parameters()) - sparse_table_params(model)


def table2_flops(model, batch: int = TABLE2_BATCH, seq_len: int = TABLE2_SEQ_LEN) -> int:
    """6 × counted parameters × tokens: Table 2's FLOPs of one training step. `model` is a
    HybridLM or a ModelConfig (then built on the meta device)."""
    return 6 * table2_params(_meta_model(model)) * batch * seq_len


def _meta_model(model):
    from memzoo.backbone.model import HybridLM
    from memzoo.config import ModelConfig

    if isinstance(model, ModelConfig):
        with torch.device("meta"):
            return HybridLM(model)
    return model


# ---- the full count ---------------------------------------------------------------------------


@dataclass
class StepFlops:
    """FLOPs of one training step (forward + backward), by kind of work."""

    dense: int  # linear layers, the LM head, short convolutions
    attention: int  # softmax attention over the pairs the mask keeps
    contractions: int  # other matmuls: GDN's chunked recurrence, product-key scoring, fast-weight math
    sparse: int  # gathers and scatters with arithmetic (embedding bags, index_add, scatter_add)
    table2: int  # the Table-2 accounting of the same step, for comparison
    tokens: int

    @property
    def total(self) -> int:
        return self.dense + self.attention + self.contractions + self.sparse

    def as_dict(self) -> dict:
        return {
            "flops_full": self.total,
            "flops_table2": self.table2,
            "flops_dense": self.dense,
            "flops_attention": self.attention,
            "flops_contractions": self.contractions,
            "flops_sparse": self.sparse,
        }


_DENSE = {aten.mm, aten.addmm, aten.convolution, aten._convolution, aten.convolution_backward}


def _conv_backward(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                   _output_padding, groups, output_mask, out_shape=None, **kw) -> int:
    """Each of grad_input and grad_weight costs what the forward does: 2 · batch · out positions
    · C_out · (C_in / groups) · kernel (w_shape already holds C_in / groups)."""
    spatial = prod((x_shape if transposed else grad_out_shape)[2:])
    fwd = 2 * grad_out_shape[0] * spatial * prod(w_shape)
    return fwd * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def _solve_triangular(a_shape, b_shape, *args, out_shape=None, upper=None, left=True, unitriangular=False, **kw) -> int:
    """n × n triangular system, m right-hand sides: n(n-1)/2 multiply-adds per column, plus n
    divisions per column unless the diagonal is one."""
    if len(args) >= 3:
        unitriangular = args[2]
    n = a_shape[-1]
    m = b_shape[-1] if left else b_shape[-2]
    return prod(out_shape[:-2]) * m * (n * (n - 1) + (0 if unitriangular else n))


def _embedding_bag(weight_shape, indices_shape, *args, out_shape=None, **kw) -> int:
    """Weighted sum of the bag's rows: a multiply and an add per index and feature."""
    return 2 * prod(indices_shape) * weight_shape[-1]


def _embedding_bag_backward(grad_shape, indices_shape, *args, out_shape=None, **kw) -> int:
    """Scatter of grad × per-sample weight into the rows: 2 FLOPs per index and feature."""
    return 2 * prod(indices_shape) * grad_shape[-1]


def _per_sample_weights_backward(grad_shape, weight_shape, indices_shape, *args, out_shape=None, **kw) -> int:
    """d(bag)/d(weight_i) = <grad_bag, row_i>: a dot product per index."""
    return 2 * prod(indices_shape) * grad_shape[-1]


def _index_add(self_shape, dim, index_shape, source_shape, *args, out_shape=None, **kw) -> int:
    return prod(source_shape)


def _scatter_add(self_shape, dim, index_shape, src_shape, *args, out_shape=None, **kw) -> int:
    return prod(index_shape)


def _index_put(self_shape, indices, values_shape, accumulate=False, *args, out_shape=None, **kw) -> int:
    if not accumulate:
        return 0  # an assignment moves memory
    n_index = max((prod(s) for s in indices if s is not None), default=1)
    return max(prod(values_shape), n_index)


def _embedding_backward(grad_shape, *args, out_shape=None, **kw) -> int:
    return prod(grad_shape)  # one add per token and feature into the table's gradient


def _mapping() -> dict:
    """Formulas for what FlopCounterMode misses (or, for grouped conv backward, gets wrong)."""
    return {
        aten.convolution_backward: _conv_backward,
        aten.linalg_solve_triangular: _solve_triangular,
        aten._embedding_bag: _embedding_bag,
        aten._embedding_bag_forward_only: _embedding_bag,
        aten._embedding_bag_backward: _embedding_bag_backward,
        aten._embedding_bag_dense_backward: _embedding_bag_backward,
        aten._embedding_bag_per_sample_weights_backward: _per_sample_weights_backward,
        aten.index_add: _index_add,
        aten.index_add_: _index_add,
        aten.scatter_add: _scatter_add,
        aten.scatter_add_: _scatter_add,
        aten.index_put: _index_put,
        aten.index_put_: _index_put,
        aten._index_put_impl_: _index_put,
        aten.embedding_dense_backward: _embedding_backward,
    }


_SPARSE = set(_mapping()) - {aten.convolution_backward, aten.linalg_solve_triangular}  # gathers and scatters


def attention_pairs(n_queries: int, n_keys: int, window: int | None) -> int:
    """(query, key) pairs a causal mask keeps when the n_queries queries are the last of n_keys
    positions; with a window w a query sees at most its w latest keys (itself included)."""
    first = n_keys - n_queries  # keys visible to the first query: first + 1
    seen = torch.arange(first + 1, n_keys + 1, dtype=torch.float64)
    if window is not None:
        seen = seen.clamp(max=window)
    return int(seen.sum().item())


def attention_flops(batch: int, heads: int, n_queries: int, n_keys: int, head_dim: int, value_dim: int,
                    window: int | None, backward: bool = True) -> int:
    """Scores q·k and the weighted value sum, 2 FLOPs per multiply-add, over the kept pairs;
    the backward costs twice the forward (dq, dk from the scores, dv and dp from the values)."""
    fwd = 2 * batch * heads * attention_pairs(n_queries, n_keys, window) * (head_dim + value_dim)
    return fwd * (3 if backward else 1)


class _AttentionStandIn(torch.autograd.Function):
    """Shape-correct, cost-free SDPA for counting: its FLOPs are added analytically."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ctx.shapes = (q.shape, k.shape, v.shape)
        ctx.dev = (q.dtype, q.device)
        return q.new_empty(*q.shape[:-1], v.shape[-1])

    @staticmethod
    def backward(ctx, grad: Tensor):
        (dt, dev), shapes = ctx.dev, ctx.shapes
        return tuple(torch.empty(s, dtype=dt, device=dev) for s in shapes)


@contextlib.contextmanager
def _count_attention(model: torch.nn.Module, tally: list):
    """While counting: each GatedAttention call appends its exact cost to `tally`, and SDPA (and the
    block-local windows, `local_attention`) is the cost-free stand-in. The window a call uses is the one
    its module picked (`_window_now`,
    so FA-pSWA's random choice per call is honoured)."""
    from memzoo.backbone.attention import GatedAttention

    current: dict = {}
    patched = []
    for mod in model.modules():
        if isinstance(mod, GatedAttention):
            def window_now(m=mod, f=mod._window_now):
                current["window"] = w = f()
                return w

            mod._window_now = window_now
            patched.append(mod)
    import memzoo.backbone.attention as attention

    real, real_local = F.scaled_dot_product_attention, attention.local_attention

    def counted(q, k, v, window):
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        tally.append(attention_flops(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3],
                                     window, backward=grad))
        return _AttentionStandIn.apply(q, k, v)

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return counted(q, k, v, current.get("window"))

    F.scaled_dot_product_attention, attention.local_attention = sdpa, counted  # the block-local windows too
    try:
        yield
    finally:
        F.scaled_dot_product_attention, attention.local_attention = real, real_local
        for mod in patched:
            del mod._window_now


class _MetaDataDependent(TorchDispatchMode):
    """While counting on meta: the ops whose output depends on data values get an answer.
    Sizes take their upper bound (FwPKM's torch.unique over the rows it writes: every row
    distinct; PKM's slot-usage bincount: one bin per index); a copy off the meta device (MoM's
    routing statistics `.cpu()`) holds zeros; a floating-point `.item()` (a diagnostic: FwMLP's
    mean gate) reads 0. An integer or boolean `.item()` can decide sizes and control flow, so
    it takes the value the running memory layer's `meta_scalar(x)` gives (`hints`, pushed by
    `step_flops` around every memory layer's forward) and is an error anywhere else."""

    def __init__(self):
        super().__init__()
        self.hints: list[tuple[str, int | None]] = []  # (layer name, value), innermost last

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if isinstance(x, Tensor) and x.device.type == "meta":
            if func is aten._local_scalar_dense.default:
                if x.dtype.is_floating_point or x.dtype.is_complex:
                    return 0.0
                if not self.hints or self.hints[-1][1] is None:
                    where = f"memory layer {self.hints[-1][0]!r}" if self.hints else "the model"
                    raise RuntimeError(
                        f"step_flops: {where} reads an integer value from a tensor (.item()) on the meta device, "
                        "which a count cannot know; give the value to assume from the layer's meta_scalar(x) method"
                    )
                return self.hints[-1][1]
            to = kwargs.get("device")
            if func is aten._to_copy.default and to is not None and torch.device(to).type != "meta":
                return torch.zeros(x.shape, dtype=kwargs.get("dtype") or x.dtype, device=to)
            if func is aten.bincount.default:
                weights = args[1] if len(args) > 1 else kwargs.get("weights")
                minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
                dt = torch.long if weights is None else weights.dtype
                return x.new_empty(max(minlength, x.numel()), dtype=dt)
            if func is aten._unique2.default:
                flags = dict(zip(("sorted", "return_inverse", "return_counts"), args[1:]), **kwargs)
                inverse, counts = flags.get("return_inverse", False), flags.get("return_counts", False)
                n = x.numel()
                return (x.new_empty(n), x.new_empty(x.shape if inverse else (0,), dtype=torch.long),
                        x.new_empty(n if counts else 0, dtype=torch.long))
        return func(*args, **kwargs)


@contextlib.contextmanager
def _scalar_hints(model: torch.nn.Module, mode: _MetaDataDependent):
    """Push each memory layer's `meta_scalar(x)` (None: it reads no integer) while its forward runs."""
    from memzoo.layers.base import MemoryLayer

    def push(m, args):
        mode.hints.append((m.name, m.meta_scalar(args[0])))

    def pop(m, args, out):
        mode.hints.pop()  # returns None: the layer's output stays as it is

    handles = [h for m in model.modules() if isinstance(m, MemoryLayer)
               for h in (m.register_forward_pre_hook(push), m.register_forward_hook(pop))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def count_flops(fn, *args, **kwargs) -> tuple[dict, object]:
    """Run fn(*args, **kwargs) under FlopCounterMode with the formulas above registered;
    return ({op: flops}, fn's result). Attention is not replaced here (see `step_flops`)."""
    return _count(fn, _MetaDataDependent(), *args, **kwargs)


def _count(fn, meta: _MetaDataDependent, *args, **kwargs) -> tuple[dict, object]:
    fc = FlopCounterMode(display=False, custom_mapping=_mapping())
    with fc, meta:
        out = fn(*args, **kwargs)
    return fc.get_flop_counts().get("Global", {}), out


def step_flops(model, batch: int, seq_len: int, seed: int = 0) -> StepFlops:
    """FLOPs of one training step (forward + backward of the LM loss) on `batch` sequences of
    `seq_len` tokens, counted on the meta device. `model` is a ModelConfig (built on meta) or a
    HybridLM already on meta; it is put in training mode. `seed` fixes the draws a step makes
    (FA-pSWA's window)."""
    model = _meta_model(model)
    if next(model.parameters()).device.type != "meta":
        raise ValueError("step_flops counts a model on the meta device; pass its ModelConfig instead")
    model.train()
    x = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    tally: list[int] = []

    def step():
        model(x, targets=x).loss.backward()

    meta = _MetaDataDependent()
    with torch.random.fork_rng(devices=[]), _count_attention(model, tally), _scalar_hints(model, meta):
        torch.manual_seed(seed)
        ops, _ = _count(step, meta)
    dense = sum(v for op, v in ops.items() if op in _DENSE)
    sparse = sum(v for op, v in ops.items() if op in _SPARSE)
    other = sum(ops.values()) - dense - sparse
    return StepFlops(dense=dense, attention=sum(tally), contractions=other, sparse=sparse,
                     table2=6 * table2_params(model) * batch * seq_len, tokens=batch * seq_len)
