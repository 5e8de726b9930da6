"""The state column counted right (issue 76, item 3): for every registered layer, at two sizes,
``fast_weight_numel()`` (what the bench's state column sums, bench/suites/toys/models.py
``state_size``) equals the numbers per sequence that the layer's equations say the memory carries
from one chunk (or token) to the next, written out below as a formula. The class of error this
guards against is zoology#34: zoology's RWKV-7 state count was 4-16x off.

What counts: everything a sequence's memory carries across a split of the stream, and nothing
else. The fast weights themselves; the short convolutions' histories (the last c-1 pre-conv inputs
of each convolved projection: a split stream continues from them); per-sequence optimiser state
(momentum buffers, a mini-batch's gradient sum); the counters a split stream continues from (the
RoPE position, the place in a mini-batch: one integer each). Not counted: slow weights (PKM's
memory), what is recomputed every chunk (FwPKM's N^read, the lookups), diagnostics.
A layer shared by the batch (per_sequence=False) carries one memory for all sequences, counted
whole. Each formula is written from the layer's equations (the module docstring of its file and
the paper it cites), never from the code under test.

A layer registered without an entry here fails its test: add its count.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from conftest import layer_options
from memzoo.registry import build_layer, get_layer, layer_names

NAMES = layer_names()


def conv_cache(c: int, *channels: int) -> int:
    """The histories of short convolutions of width c on projections of these widths: the last
    c-1 inputs of each (none without a convolution, c <= 1)."""
    return (c - 1) * sum(channels) if c > 1 else 0


# ---- the counts, from the equations ----------------------------------------------------------------
def delta_rule(o: dict) -> int:
    """DeltaNet (Yang et al. 2024, Eq. 1-2), Gated DeltaNet (Eq. 10: α_t is a scalar a token, no
    state) and KDA (Kimi Linear Eq. 1: α_t is a vector a token, no state): one S ∈ R^{K×V} per head;
    plus the short convolutions (size c) on k and v (DeltaNet Sec. 4; the query has none,
    memzoo/layers/_delta.py)."""
    H, K = o["num_heads"], o["head_dim"]
    V = int(K * o["expand_v"])
    return H * K * V + conv_cache(o["conv_size"], H * K, H * V)


def deltaproduct(o: dict) -> int:
    """DeltaProduct (Siems et al. 2025, Sec. 3, Eq. 4-5): the n_h Householder steps of a token
    rewrite the same S ∈ R^{K×V} per head (H_{t,j} are intermediates inside a token, not carried);
    the k and v projections are n_h times as wide, so are their convolutions' histories."""
    H, K, n = o["num_heads"], o["head_dim"], o["num_householder"]
    V = int(K * o["expand_v"])
    return H * K * V + conv_cache(o["conv_size"], n * H * K, n * H * V)


def rwkv7(o: dict) -> int:
    """RWKV-7 (Peng et al. 2025, Eq. 17): S ∈ R^{V×K} per head, nothing else (w_t, a_t, κ̂_t, k̃_t
    are per token; no token shift here, so no x_{t-1} to carry: memzoo/layers/rwkv7.py)."""
    H, K = o["num_heads"], o["head_dim"]
    return H * K * int(K * o["expand_v"])


def linear(o: dict) -> int:
    """Linear attention (Schlag et al. 2021, Eq. 4-5): S ∈ R^{K×V} per head, K = V = head_dim; with
    normalize (the default for the "elu" map), Katharopoulos et al.'s normaliser z ∈ R^K per head."""
    H, K = o["num_heads"], o["head_dim"]
    normalize = o.get("normalize", o["feature_map"] == "elu")
    return H * K * K + (H * K if normalize else 0)


def mamba2(o: dict, d_model: int) -> int:
    """Mamba-2 (Dao & Gu 2024, Eq. 1a with the SSD layer's scalar A): one h ∈ R^{N×P} per head, H = E·D / P
    heads (a_t, Δ_t, B_t, C_t are per token, no state); plus the history of the block's short
    convolution (size c) on [x, B, C], of width E·D + 2N (one group of B and C, Sec. 7.1-7.2)."""
    E, N, P = o["expand"], o["d_state"], o["head_dim"]
    H = E * d_model // P
    return H * N * P + conv_cache(o["conv_size"], E * d_model + 2 * N)


def loglinear_mamba2(o: dict, d_model: int) -> int:
    """Log-linear Mamba-2 (Guo et al. 2025, Sec. 3, the Fenwick recurrence): one h ∈ R^{N×P} per head (Mamba-2's) per Fenwick level a
    stream of n tokens has filled, bit_length(n) of them, at run_forward's n = 8 tokens: 4 (levels 1-4: the
    buckets of sizes 1, 2, 4 and then the merged 8); plus the position n (one integer: the levels are a
    function of it) and Mamba-2's short-convolution history on [x, B, C]."""
    E, N, P = o["expand"], o["d_state"], o["head_dim"]
    H = E * d_model // P
    levels = (8).bit_length()
    return levels * H * N * P + 1 + conv_cache(o["conv_size"], E * d_model + 2 * N)


def gla(o: dict, d_model: int) -> int:
    """GLA (Yang et al. 2024, Sec. 4.1): one S ∈ R^{K×V} per head, K = expand_k·D/H, V = expand_v·D/H (α_t is
    a vector a token, no state; no short convolution)."""
    H = o["num_heads"]
    return H * int(o["expand_k"] * d_model // H) * int(o["expand_v"] * d_model // H)


def retnet(o: dict, d_model: int) -> int:
    """RetNet (Sun et al. 2023, Eq. 6): one S ∈ R^{K×V} per head, K = expand_k·D/H, V = expand_v·D/H (γ is
    fixed, no state); plus the position n the rotation Θ_n continues from (one integer)."""
    H = o["num_heads"]
    return H * int(o["expand_k"] * d_model // H) * int(o["expand_v"] * d_model // H) + 1


def hgrn2(o: dict, d_model: int) -> int:
    """HGRN-2 (Qin et al. 2024, Eq. 3): one h ∈ R^{K×V} per head, K = expand_ratio, H = num_heads (or D / K),
    V = D / H (the input i_t is D wide); f_t, o_t, i_t are per token, no state."""
    K = o["expand_ratio"]
    H = o["num_heads"] or d_model // K
    return H * K * (d_model // H)


def gsa(o: dict, d_model: int) -> int:
    """GSA (Zhang et al. 2024, Sec. 3): per head the m slots' keys K̃ ∈ R^{m×K} and values Ṽ ∈ R^{m×V}, K =
    expand_k·D/H, V = expand_v·D/H; α_t is per token, no state."""
    H, m = o["num_heads"], o["num_slots"]
    return H * m * (int(o["expand_k"] * d_model // H) + int(o["expand_v"] * d_model // H))
def mesanet(o: dict) -> int:
    """MesaNet (von Oswald et al. 2025, Eq. 5): per head, the two sums H_t ∈ R^{K×K} and G_t ∈ R^{K×V}, K = V =
    head_dim (β_t, γ_t and the solve's q*_t are per token; λ is a slow weight); plus the short convolutions'
    histories on q and k (fla's layer; none on v)."""
    H, K = o["num_heads"], o["head_dim"]
    return H * (K * K + K * K) + conv_cache(o["conv_size"], H * K, H * K)


def mom(o: dict) -> int:
    """MoM (Du et al. 2025, Eq. 6-7, 11-12): M routed gated-delta-rule memories S^m ∈ R^{K×V} per
    head, and the shared one S^s; the k and v short convolutions of each memory run along its own
    routed tokens (one history per memory) and the shared memory's along the whole sequence."""
    M, H, K, c = o["num_memories"], o["num_heads"], o["head_dim"], o["conv_size"]
    V = int(K * o["expand_v"])
    memories = M + (1 if o["shared_memory"] else 0)
    return memories * (H * K * V + conv_cache(c, H * K, H * V))


def titans(o: dict) -> int:
    """Titans' LMM (Behrouz et al. 2025, Eq. 13): the memory M = (W1 ∈ R^{d×h}, W2 ∈ R^{h×d}) per
    head, h = expansion·d, and the momentum ("past surprise") S of the same shape; plus the short
    convolutions on k and v (Sec. 4.4)."""
    H, d = o["num_heads"], o["head_dim"]
    h = o["expansion"] * d
    memory = H * (d * h + h * d)
    return 2 * memory + conv_cache(o["conv_size"], H * d, H * d)


def ttt(o: dict, mlp: bool) -> int:
    """TTT (Sun et al. 2024, Sec. 2.5-2.7): the inner model's weights at the start of the current
    mini-batch, W_{t'} (TTT-Linear: W ∈ R^{d×d}, b ∈ R^d per head; TTT-MLP: W1 ∈ R^{d×h}, b1 ∈ R^h,
    W2 ∈ R^{h×d}, b2 ∈ R^d, h = expansion·d), and the sum G = Σ_{s=t'+1..t} lr_s ∇ℓ_s(W_{t'}) of the
    mini-batch so far, of the same shape: W_t = W_{t'} − c_t G, and the next token needs both (its
    gradient is taken at W_{t'}, its c differs); the release's decode cache keeps the same pair
    (``{name}_states``, ``{name}_grad``). Plus the place in the mini-batch (one integer)."""
    H, d = o["num_heads"], o["head_dim"]
    if mlp:
        h = o["expansion"] * d
        inner = d * h + h + h * d + d
    else:
        inner = d * d + d
    return 2 * H * inner + 1


def lact(o: dict, d_model: int) -> int:
    """LaCT (Zhang et al. 2025; the FwPKM paper's App. A): the fast SwiGLU W0, W2 ∈ R^{d_h×d},
    W1 ∈ R^{d×d_h} per head (d = D/H, d_h = d·inter_multi; full matrices per sequence, also when their
    initial value is low-rank); with use_momentum the momentum buffers M0, M1, M2 of the same shapes
    (SGD with momentum, M_i ← G_i + μ̄ M_i: per-sequence optimiser state carried chunk to chunk);
    with RoPE the position of the next token (one integer)."""
    H = o["num_heads"]
    d = d_model // H
    d_h = int(d * o["inter_multi"])
    fast = 3 * H * d_h * d
    return fast * (2 if o["use_momentum"] else 1) + (1 if o["rope_head_dim"] is not None else 0)


def fwpkm(o: dict) -> int:
    """FwPKM (Zhao & Jones 2026, Sec. 3.1: θ = {K, V}): the value table V ∈ R^{n²×D_v} and the
    sub-keys K^{1,2} ∈ R^{n×D_k/2} of each head, both fast (Eqs. 35-39). N^read and p̄ are per
    chunk (recomputed at each write), the step is plain SGD (η = 1): no other per-slot state."""
    n = o["n_subkeys"]
    return n * n * o["value_dim"] + o["heads"] * 2 * n * (o["key_dim"] // 2)


def fwmlp(o: dict) -> int:
    """FwMLP (FwPKM paper, App. A): θ = {W_up, b_up, W_gate, b_gate, W_down, b_down} of the SwiGLU
    D_in -> h -> D_out; plain SGD (no optimiser state)."""
    i, h, out = o["input_dim"], o["intermediate_dim"], o["output_dim"]
    return (h * i + h) + (h * i + h) + (out * h + out)


def fwl(o: dict, d_model: int) -> int:
    """FWL (Clark et al. 2022, Sec. 3): the running update ΔΘ of θ = {U ∈ R^{D×H}, a ∈ R^H,
    W ∈ R^{H×D}, b, g, β ∈ R^D}, H = expansion·D (the fast weights are θ − α ∘ ΔΘ)."""
    D = d_model
    H = o["expansion"] * D
    return D * H + H + H * D + 3 * D


def ba(o: dict) -> int:
    """Ba et al. 2016 (Eq. 1-2): the fast matrix A ∈ R^{R×R} and the hidden state h ∈ R^R (W h(t)
    enters the next step, so a split stream continues from it)."""
    R = o["hidden_size"]
    return R * R + R


#: name -> (cases: build options at two sizes or more, each with "d_model"; count(options, d_model))
COUNTS: dict[str, tuple[list[dict], Callable[[dict, int], int]]] = {
    "deltanet": ([dict(num_heads=2, head_dim=16, expand_v=1.0, conv_size=4),
                  dict(num_heads=4, head_dim=8, expand_v=2.0, conv_size=2)], lambda o, D: delta_rule(o)),
    "gated_deltanet": ([dict(num_heads=2, head_dim=16, expand_v=1.0, conv_size=4),
                        dict(num_heads=4, head_dim=8, expand_v=2.0, conv_size=0)], lambda o, D: delta_rule(o)),
    "kda": ([dict(num_heads=2, head_dim=16, expand_v=1.0, conv_size=4),
             dict(num_heads=4, head_dim=8, expand_v=2.0, conv_size=5)], lambda o, D: delta_rule(o)),
    "deltaproduct": ([dict(num_heads=2, head_dim=16, expand_v=1.0, conv_size=4, num_householder=2, forget_gate=True),
                      dict(num_heads=4, head_dim=8, expand_v=2.0, conv_size=3, num_householder=3)],
                     lambda o, D: deltaproduct(o)),
    "rwkv7": ([dict(num_heads=2, head_dim=16, expand_v=1.0), dict(num_heads=2, head_dim=8, expand_v=3.0)],
              lambda o, D: rwkv7(o)),
    "linear": ([dict(num_heads=2, head_dim=16, feature_map="elu"),
                dict(num_heads=4, head_dim=8, feature_map="l2"),
                dict(num_heads=1, head_dim=24, feature_map="elu", decay=True)], lambda o, D: linear(o)),
    "mamba2": ([dict(d_state=16, head_dim=16, expand=1, conv_size=4),
                dict(d_state=8, head_dim=8, expand=2, conv_size=0),
                dict(d_model=64, d_state=32, head_dim=32, expand=2, conv_size=3)], mamba2),
    "loglinear_mamba2": ([dict(d_state=16, head_dim=16, expand=1, conv_size=4),
                          dict(d_model=64, d_state=8, head_dim=32, expand=2, conv_size=0)], loglinear_mamba2),
    "gla": ([dict(num_heads=2, expand_k=1.0, expand_v=1.0),
             dict(num_heads=4, expand_k=0.5, expand_v=2.0),
             dict(d_model=64, num_heads=2, expand_k=0.5, expand_v=1.0)], gla),
    "retnet": ([dict(num_heads=2, expand_k=1.0, expand_v=2.0),
                dict(num_heads=4, expand_k=0.5, expand_v=1.0),
                dict(d_model=64, num_heads=2, expand_k=1.0, expand_v=1.0)], retnet),
    "hgrn2": ([dict(expand_ratio=16, num_heads=None),
               dict(expand_ratio=4, num_heads=2),
               dict(d_model=64, expand_ratio=4, num_heads=None)], hgrn2),
    "gsa": ([dict(num_heads=2, num_slots=8, expand_k=1.0, expand_v=1.0),
             dict(num_heads=4, num_slots=3, expand_k=0.5, expand_v=2.0),
             dict(d_model=64, num_heads=2, num_slots=16, expand_k=0.25, expand_v=1.0)], gsa),
    "mesanet": ([dict(num_heads=2, head_dim=16, conv_size=4), dict(num_heads=4, head_dim=8, conv_size=0),
                 dict(d_model=64, num_heads=1, head_dim=12, conv_size=2)], lambda o, D: mesanet(o)),
    "mom": ([dict(num_memories=4, topk=2, shared_memory=True, num_heads=2, head_dim=16, expand_v=1.0, conv_size=4),
             dict(num_memories=3, topk=1, shared_memory=False, num_heads=4, head_dim=8, expand_v=2.0, conv_size=3)],
            lambda o, D: mom(o)),
    "titans": ([dict(num_heads=2, head_dim=16, chunk_size=4, expansion=2, conv_size=4),
                dict(num_heads=4, head_dim=8, chunk_size=4, expansion=3, conv_size=0)], lambda o, D: titans(o)),
    "ttt_linear": ([dict(num_heads=2, head_dim=16, mini_batch_size=4),
                    dict(num_heads=4, head_dim=8, mini_batch_size=4)], lambda o, D: ttt(o, mlp=False)),
    "ttt_mlp": ([dict(num_heads=2, head_dim=16, mini_batch_size=4, expansion=2),
                 dict(num_heads=4, head_dim=8, mini_batch_size=4, expansion=3)], lambda o, D: ttt(o, mlp=True)),
    "lact": ([dict(num_heads=2, inter_multi=1.0, chunk_size=8, use_momentum=True, rope_head_dim=16),
              dict(num_heads=4, inter_multi=2.0, chunk_size=8, use_momentum=False, rope_head_dim=None,
                   w0_w2_low_rank=4),
              dict(d_model=64, num_heads=4, inter_multi=1.0, chunk_size=8, use_momentum=True, rope_head_dim=None)],
             lact),
    "fwpkm": ([dict(key_dim=16, value_dim=16, heads=1, topk=2, n_subkeys=16, chunk_size=8),
               dict(key_dim=8, value_dim=24, heads=2, topk=2, n_subkeys=8, chunk_size=8, per_sequence=True)],
              lambda o, D: fwpkm(o)),
    "fwmlp": ([dict(input_dim=16, intermediate_dim=32, output_dim=16, chunk_size=8),
               dict(input_dim=8, intermediate_dim=24, output_dim=12, chunk_size=8, per_sequence=True)],
              lambda o, D: fwmlp(o)),
    # PKM (Lample et al. 2019): its keys and values are slow weights trained by the outer optimiser;
    # nothing is written from the sequence
    "pkm": ([dict(key_dim=16, value_dim=16, heads=2, topk=4, n_subkeys=8),
             dict(key_dim=8, value_dim=24, heads=1, topk=2, n_subkeys=4)], lambda o, D: 0),
    "fwl": ([dict(expansion=2, chunk_size=4), dict(d_model=16, expansion=3, chunk_size=4)], fwl),
    "ba": ([dict(hidden_size=32), dict(hidden_size=12)], lambda o, D: ba(o)),
}


def run_forward(layer, batch: int, d_model: int) -> None:
    """A forward of `batch` sequences (several chunks, a multiple of the chunk size), so that the
    layer holds its state as training leaves it."""
    T = 2 * layer.chunk_size if layer.chunk_size else 8
    x = torch.randn(batch, T, d_model, generator=torch.Generator().manual_seed(batch))
    layer.reset(batch)
    with torch.no_grad():
        if layer.needs_targets:
            layer(x, targets=torch.randint(0, d_model, (batch, T), generator=torch.Generator().manual_seed(0)))
        else:
            layer(x)


@pytest.mark.parametrize("name", NAMES)
def test_state_count_matches_the_equations(name):
    if name not in COUNTS:
        pytest.fail(f"layer {name!r} ({get_layer(name).__module__}) has no state count in tests/test_state_count.py: "
                    "add its count, written from its equations, to COUNTS")
    cases, count = COUNTS[name]
    assert len(cases) >= 2, f"{name}: give its count at two sizes at least"
    counts = []
    for case in cases:
        opts = dict(case)
        D = opts.pop("d_model", 32)
        torch.manual_seed(0)
        layer = build_layer(name, D, **{**layer_options(name), **opts})
        expected = count(opts, D)
        run_forward(layer, 2, D)
        got = layer.fast_weight_numel()
        assert isinstance(got, int) and got == expected, (
            f"{name} {case}: fast_weight_numel() = {got}, the equations give {expected} "
            f"(state: { {k: tuple(v.shape) for k, v in layer.state.items()} })")
        # per sequence, or the shared memory whole: the batch size is in neither
        run_forward(layer, 3, D)
        assert layer.fast_weight_numel() == expected, f"{name} {case}: the count changes with the batch size"
        counts.append(expected)
    if name != "pkm":
        assert len(set(counts)) == len(counts), f"{name}: the sizes should give different counts, {counts}"
