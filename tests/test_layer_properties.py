"""The shared property suite: every registered MemoryLayer must pass it (DESIGN.md, "Properties
every layer must pass"). It is parametrised over ``memzoo.registry.layer_names()`` when it is
collected, so a layer registered before that is tested without editing this file: one of the
package, or a plugin's (``pytest -p MODULE`` imports MODULE before collection; MEMZOO_PLUGINS
works too).

Properties:
  1. Streaming: forward(x) == forward(x[:, :a]) then forward(x[:, a:]) for a on chunk
     boundaries (any a for token-recurrent layers); also forward == its own definition
     from read_state/write_state (per chunk, or per token when chunk_size is None).
  2. read leaves the state untouched; reset restores the initial state exactly.
  3. Memorization: after write of key/value pairs, read at the keys recovers the values
     (trained briefly, then evaluated on fresh pairs), better than chance and better than
     reading without writing; for iterative layers, better after a second write.
  4. Gradients reach every slow weight; no fast weight is a slow parameter.
  5. Causality under non-finite input: a NaN/inf token at position t leaves every output
     before t finite; an empty sequence (T = 0) gives an empty output and changes no state.
  Plus: load_state round trip, clear errors for bad shapes / batch size / bad options, detach_state.

What the suite needs beyond the layer (small options, `iterative`, targets for needs_targets
layers, gradient exemptions) is the layer's test entry in tests/conftest.py (LAYER_TESTS, or a
plugin module's MEMZOO_TESTS); without one a layer is built with its defaults. From the layer
it reads the MemoryLayer attributes (inclusive, chunk_size, per_sequence, lookahead, site,
needs_targets) and, if present, ``parallel_chunk``: the chunk length of a token-recurrent
layer's parallel form; the non-finite-input test spans three of them (three chunk_size chunks
for chunk-level layers, 48 tokens otherwise).

Parameters are perturbed by small noise before the structural tests, so that a zero-init
(e.g. an output projection or gate initialised to 0) cannot make a property hold vacuously.
"""

from __future__ import annotations

import fnmatch
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import D, layer_options, layer_test, rand_x, tiny_layer
from memzoo.layers.base import MemoryLayer
from memzoo.registry import build_layer
from memzoo.registry import layer_names

NAMES = layer_names()  # at collection: plugins given with -p (or MEMZOO_PLUGINS) are registered by now
F64 = dict(rtol=1e-8, atol=1e-10)


# ---- helpers ---------------------------------------------------------------------------------
def make_layer(name: str, *, seed: int = 0, dtype=torch.float64, perturb: bool = True) -> MemoryLayer:
    return tiny_layer(name, seed=seed, dtype=dtype, noise=0.02 if perturb else 0.0).eval()


def batch(layer: MemoryLayer, b: int) -> int:
    """The batch size of the layer's state: b for per-sequence state, 1 for shared state."""
    return b if layer.per_sequence else 1


def seq_plan(layer: MemoryLayer) -> tuple[int, list[int]]:
    """A length T and split points: any token for token-recurrent layers, chunk boundaries otherwise."""
    C = layer.chunk_size
    if C is None:
        return 24, [1, 5, 13, 23]
    return 4 * C, [C, 2 * C, 3 * C]


def targets_for(layer: MemoryLayer, x: torch.Tensor):
    if not layer.needs_targets:
        return None
    hook = layer_test(layer.name)["targets"]
    if hook is None:
        pytest.fail(f"{layer.name} has needs_targets=True but its test entry gives no targets (tests/conftest.py)")
    return hook(x)


def fwd(layer: MemoryLayer, x: torch.Tensor, targets=None) -> torch.Tensor:
    return layer(x) if targets is None else layer(x, targets=targets)


def wr(layer: MemoryLayer, x: torch.Tensor) -> None:
    """write(x), with targets_for(layer, x) for needs_targets layers."""
    targets = targets_for(layer, x)
    layer.write(x) if targets is None else layer.write(x, targets=targets)


def clone_state(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


def assert_states_equal(a: dict, b: dict, exact: bool = True, **tol):
    assert set(a) == set(b), f"state keys differ: {sorted(a)} vs {sorted(b)}"
    for k in a:
        assert a[k].shape == b[k].shape, f"state[{k!r}] shape {tuple(a[k].shape)} vs {tuple(b[k].shape)}"
        if exact:
            assert torch.equal(a[k], b[k]), f"state[{k!r}] differs (max {(a[k] - b[k]).abs().max().item():.3g})"
        else:
            torch.testing.assert_close(a[k], b[k], **tol, msg=lambda m, k=k: f"state[{k!r}]: {m}")


# ---- 1. streaming --------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_streaming(name):
    layer = make_layer(name)
    T, splits = seq_plan(layer)
    x = rand_x(2, T)
    tg = targets_for(layer, x)
    sl = lambda a, b: None if tg is None else tg[:, a:b]  # noqa: E731

    layer.reset(batch(layer, 2))
    y_full = fwd(layer, x, tg).detach()
    s_full = clone_state(layer.state)

    for a in splits:  # one split
        layer.reset(batch(layer, 2))
        y = torch.cat([fwd(layer, x[:, :a], sl(0, a)), fwd(layer, x[:, a:], sl(a, T))], dim=1).detach()
        torch.testing.assert_close(y, y_full, **F64, msg=lambda m, a=a: f"split at {a}: {m}")
        assert_states_equal(clone_state(layer.state), s_full, exact=False, **F64)

    layer.reset(batch(layer, 2))  # piece by piece at every split point
    bounds = [0, *splits, T]
    y = torch.cat([fwd(layer, x[:, a:b], sl(a, b)) for a, b in zip(bounds[:-1], bounds[1:])], dim=1).detach()
    torch.testing.assert_close(y, y_full, **F64, msg=lambda m: f"pieces {bounds}: {m}")
    assert_states_equal(clone_state(layer.state), s_full, exact=False, **F64)


@pytest.mark.parametrize("name", NAMES)
def test_holding_streams_at_any_split(name):
    """hold(True), generation's mode: a prompt that ends inside a chunk, then one token per call,
    gives the outputs of one call; hold(False) writes what was held, leaving one call's state."""
    layer = make_layer(name)
    if layer.needs_targets:
        pytest.skip("writes from the next tokens, which decoding does not have: holding does not apply")
    C = layer.chunk_size or 4
    T, a = 2 * C + 3, max(1, C - 1)  # the prompt ends one token short of a chunk boundary
    x = rand_x(2, T)
    layer.reset(batch(layer, 2))
    y_full = layer(x).detach()
    s_full = clone_state(layer.state)
    layer.reset(batch(layer, 2))
    layer.hold(True)
    y = torch.cat([layer(x[:, :a])] + [layer(x[:, t : t + 1]) for t in range(a, T)], dim=1).detach()
    torch.testing.assert_close(y, y_full, **F64)
    layer.hold(False)
    assert_states_equal(clone_state(layer.state), s_full, exact=False, **F64)


@pytest.mark.parametrize("name", NAMES)
def test_forward_matches_read_write_definition(name):
    """forward_state (usually a parallel form) == the loop over chunks (tokens when chunk_size is
    None) of read_state/write_state: read then write, or write then read if `inclusive`."""
    layer = make_layer(name)
    if layer.needs_targets:
        pytest.skip("forward needs targets; its definition is not read/write alone")
    T, _ = seq_plan(layer)
    x = rand_x(2, T)
    B = batch(layer, 2)
    y, s = layer.forward_state(x, layer.init_state(B))

    C = layer.chunk_size or 1
    inclusive = layer.inclusive
    state, ys = layer.init_state(B), []
    for a in range(0, T, C):
        xc = x[:, a : a + C]
        if inclusive:
            state = layer.write_state(xc, state)
            ys.append(layer.read_state(xc, state))
        else:
            ys.append(layer.read_state(xc, state))
            state = layer.write_state(xc, state)
    what = "write-then-read" if inclusive else "read-then-write"
    torch.testing.assert_close(y, torch.cat(ys, dim=1), **F64, msg=lambda m: f"forward vs per-step {what}: {m}")
    assert_states_equal(clone_state(s), clone_state(state), exact=False, **F64)


# ---- 2. read is pure, reset restores --------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_read_is_pure_and_reset_restores(name):
    layer = make_layer(name)
    T, _ = seq_plan(layer)
    B = batch(layer, 2)
    layer.reset(B)
    init = clone_state(layer.state)
    assert_states_equal(init, clone_state(layer.init_state(B)))

    wr(layer, rand_x(2, T, seed=2))
    fwd(layer, rand_x(2, T, seed=3), targets_for(layer, rand_x(2, T, seed=3)))
    before = clone_state(layer.state)
    if layer.site != "ffn":
        assert any(not torch.equal(before[k], init[k]) for k in init), "write/forward left the state unchanged"

    y = layer.read(rand_x(2, T, seed=4))
    assert y.shape == (2, T, D)
    assert_states_equal(clone_state(layer.state), before)  # exact

    layer.reset(B)
    assert_states_equal(clone_state(layer.state), init)  # exact
    assert_states_equal(clone_state(layer.state), clone_state(layer.init_state(B)))


@pytest.mark.parametrize("name", NAMES)
def test_load_state_round_trip(name):
    layer = make_layer(name)
    T, _ = seq_plan(layer)
    B = batch(layer, 2)
    x1, x2 = rand_x(2, T, seed=5), rand_x(2, T, seed=6)
    t2 = targets_for(layer, x2)
    layer.reset(B)
    fwd(layer, x1, targets_for(layer, x1))
    # a loaded state carries no autograd graph, so the reference run starts from one without it:
    # with it, autograd changes how some products are dispatched (FwMLP's, grad_through_update),
    # and on an AMD EPYC (family 25, model 17) that moved its outputs by 7e-16 in float64
    layer.detach_state()
    saved = clone_state(layer.state)
    y_a = fwd(layer, x2, t2).detach()
    s_a = clone_state(layer.state)

    layer.load_state(saved)
    assert_states_equal(clone_state(layer.state), saved)
    torch.testing.assert_close(fwd(layer, x2, t2).detach(), y_a, rtol=0, atol=0)
    assert_states_equal(clone_state(layer.state), s_a)

    other = make_layer(name)  # same seed: same slow weights, fresh module
    other.load_state(saved)
    torch.testing.assert_close(fwd(other, x2, t2).detach(), y_a, rtol=0, atol=0)

    if saved:
        with pytest.raises(KeyError):
            layer.load_state({**saved, "not_a_key": next(iter(saved.values()))})
        k0 = next(iter(saved))
        with pytest.raises(ValueError):
            layer.load_state({**saved, k0: saved[k0].unsqueeze(-1)})


# ---- errors a user can cause ----------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_bad_input_raises_clearly(name):
    layer = make_layer(name)
    T, _ = seq_plan(layer)
    layer.reset(batch(layer, 2))
    for bad in (torch.randn(2, T, D + 1, dtype=torch.float64), torch.randn(T, D, dtype=torch.float64)):
        for verb in (layer.forward, layer.read, layer.write):
            with pytest.raises(ValueError, match=r"expects x of shape \[batch, time, 32\]"):
                verb(bad)
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.zeros(2, T, D, dtype=torch.long))
    if layer.per_sequence:
        x3 = rand_x(3, T)
        for verb in (layer.forward, layer.read, layer.write):
            with pytest.raises(ValueError, match=r"reset\(batch_size=3\)"):
                verb(x3)


BAD_OPTIONS = [  # (layer, bad option on top of its test options, the option the error must name)
    ("linear", {"num_heads": 0}, "num_heads"),
    ("linear", {"eps": -1.0}, "eps"),
    ("mom", {"topk": 5}, "topk"),
    ("mom", {"aux_loss_weight": -0.1}, "aux_loss_weight"),
    ("mom", {"norm_eps": 0.0}, "norm_eps"),
    ("lact", {"chunk_size": 0}, "chunk_size"),
    ("lact", {"rope_theta": 0.0}, "rope_theta"),
    ("lact", {"norm_eps": -1e-5}, "norm_eps"),
    ("lact", {"init_std": -0.02}, "init_std"),
    ("pkm", {"topk": 9}, "topk"),
    ("pkm", {"norm_eps": 0.0}, "norm_eps"),
    ("ba", {"decay": 1.5}, "decay"),
    ("ba", {"activation": "gelu"}, "activation"),
    ("fwl", {"decay": 1.0}, "decay"),
    ("fwl", {"step_size": -1e-3}, "step_size"),
    ("fwl", {"eps": 0.0}, "eps"),
]


@pytest.mark.parametrize("name, bad, option", BAD_OPTIONS)
def test_bad_options_raise_clearly(name, bad, option):
    """A bad constructor option is a one-line ValueError that names it."""
    with pytest.raises(ValueError, match=re.escape(option)) as err:
        build_layer(name, d_model=D, **{**layer_options(name), **bad})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", NAMES)
def test_zero_d_model_raises(name):
    with pytest.raises(ValueError, match="d_model"):
        build_layer(name, d_model=0, **layer_options(name))


@pytest.mark.parametrize("name", NAMES)
def test_detach_state_cuts_grad(name):
    layer = make_layer(name)
    T, _ = seq_plan(layer)
    layer.reset(batch(layer, 2))
    x = rand_x(2, T)
    fwd(layer, x, targets_for(layer, x))
    layer.detach_state()
    assert all(not v.requires_grad for v in layer.state.values())
    y = fwd(layer, x, targets_for(layer, x))  # the next sequence trains on its own graph
    y.sum().backward()
    layer.detach_state()
    assert all(v.grad_fn is None for v in layer.state.values())


@pytest.mark.parametrize("name", NAMES)
def test_state_keeps_its_dtype_under_autocast(name):
    """Under bf16 autocast (how the bench and the trainer run on CPU) the fast weights stay in the
    dtype the layer keeps them in: a matmul of fp32 state would otherwise come back bf16."""
    layer = make_layer(name, dtype=torch.float32)
    T, _ = seq_plan(layer)
    layer.reset(batch(layer, 2))
    kept = {k: v.dtype for k, v in layer.state.items()}
    x = rand_x(2, T).float()
    with torch.autocast("cpu", torch.bfloat16):
        fwd(layer, x, targets_for(layer, x))
        fwd(layer, x, targets_for(layer, x))
    assert {k: v.dtype for k, v in layer.state.items()} == kept


# ---- 5. non-finite input and empty sequences ---------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_input_stays_causal(name, bad):
    """A NaN/inf token at position t (mid-chunk, in one sequence of two) leaves every output
    before t finite, in both sequences. A chunked parallel form that masks the future by
    multiplying with 0 fails this: 0 × NaN = NaN carries the token back to earlier positions.
    (Chunk-level read-then-write layers too: positions of t's chunk before t read the memory
    written before the chunk.)"""
    layer = make_layer(name)
    C = layer.chunk_size or getattr(layer, "parallel_chunk", 16)
    T, t = 3 * C, C + C // 2 + 1
    x = rand_x(2, T)
    tg = targets_for(layer, x)
    x[1, t] = bad
    layer.reset(batch(layer, 2))
    y = fwd(layer, x, tg).detach()
    assert y.shape == (2, T, D)
    leaked = (~y[:, :t].isfinite()).any(-1).nonzero()
    assert not len(leaked), f"{bad} at t={t} (T={T}) reached earlier (sequence, position)s: {leaked.tolist()[:8]}"


@pytest.mark.parametrize("name", NAMES)
def test_empty_sequence(name):
    """T = 0: forward and read return [B, 0, D]; forward, read and write leave the state as it was."""
    layer = make_layer(name)
    T, _ = seq_plan(layer)
    layer.reset(batch(layer, 2))
    wr(layer, rand_x(2, T))  # a written state, not the initial one
    before = clone_state(layer.state)
    x0 = rand_x(2, 0)
    assert fwd(layer, x0, targets_for(layer, x0)).shape == (2, 0, D)
    assert_states_equal(clone_state(layer.state), before)
    assert layer.read(x0).shape == (2, 0, D)
    wr(layer, x0)
    assert_states_equal(clone_state(layer.state), before)


# ---- 4. gradients and slow/fast separation --------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_gradients_reach_every_slow_weight(name):
    """loss = <forward(x), r> with a fixed random r (a plain .sum() can give exact-zero grads
    behind an output normalisation); every trainable parameter gets a finite, nonzero grad."""
    layer = make_layer(name)
    T, _ = seq_plan(layer)
    x = rand_x(2, T)
    layer.reset(batch(layer, 2))
    y = fwd(layer, x, targets_for(layer, x))
    r = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=y.dtype)
    (y * r).sum().backward()
    exempt = tuple(layer_test(name)["grad_exempt"])
    params = [(n, p) for n, p in layer.named_parameters() if p.requires_grad]
    assert params, "layer has no trainable slow weights"
    for n, p in params:
        ok_zero = any(fnmatch.fnmatch(n, pat) for pat in exempt)
        if p.grad is None:
            assert ok_zero, f"no gradient reached {n}"
            continue
        assert torch.isfinite(p.grad).all(), f"non-finite gradient in {n}"
        assert ok_zero or p.grad.abs().sum() > 0, f"all-zero gradient in {n}"


@pytest.mark.parametrize("name", NAMES)
def test_fast_weights_are_not_slow_parameters(name):
    layer = make_layer(name)
    T, _ = seq_plan(layer)
    params = list(layer.parameters())
    ids = {id(p) for p in params}
    storages = {p.untyped_storage().data_ptr() for p in params}

    def check(state, where, init=None):
        for k, v in state.items():
            assert not isinstance(v, nn.Parameter) and id(v) not in ids, f"state[{k!r}] is a slow parameter ({where})"
            changed = init is None or not torch.equal(v, init[k])
            if init is not None and changed and v.numel():
                assert v.untyped_storage().data_ptr() not in storages, (
                    f"state[{k!r}] shares storage with a slow parameter after {where}; "
                    "an optimizer step would modify the fast weights"
                )

    layer.reset(batch(layer, 2))
    init = clone_state(layer.state)
    check(layer.state, "reset")
    wr(layer, rand_x(2, T))
    check(layer.state, "write", init)
    x = rand_x(2, T, seed=3)
    fwd(layer, x, targets_for(layer, x))
    check(layer.state, "forward", init)


# ---- 3. memorization ------------------------------------------------------------------------
N_PAIRS = 8
TRAIN_BATCH = 32


def make_pairs(layer: MemoryLayer, b: int, gen: torch.Generator):
    """Keys: random unit vectors in the first half of the dims; values: in the second half.
    Lookahead layers get interleaved tokens key_1, value_1, key_2, ...; others key_i + value_i."""
    h = D // 2
    keys = F.normalize(torch.randn(b, N_PAIRS, h, generator=gen), dim=-1)
    vals = F.normalize(torch.randn(b, N_PAIRS, h, generator=gen), dim=-1)
    zeros = torch.zeros(b, N_PAIRS, h)
    key_tok = torch.cat([keys, zeros], dim=-1)
    val_tok = torch.cat([zeros, vals], dim=-1)
    if layer.lookahead:
        x_write = torch.stack([key_tok, val_tok], dim=2).reshape(b, 2 * N_PAIRS, D)
    else:
        x_write = key_tok + val_tok
    return x_write, key_tok, vals


def recall(layer: MemoryLayer, x_write, x_query, n_writes: int = 1):
    """reset, write n_writes times, read at the keys. Shared-state layers go one sequence at a time."""
    if layer.per_sequence:
        layer.reset(x_write.shape[0])
        for _ in range(n_writes):
            wr(layer, x_write)
        return layer.read(x_query)
    outs = []
    for b in range(x_write.shape[0]):
        layer.reset(1)
        for _ in range(n_writes):
            wr(layer, x_write[b : b + 1])
        outs.append(layer.read(x_query[b : b + 1]))
    return torch.cat(outs, dim=0)


def retrieval(out, vals):
    """(MSE of the value half, accuracy of picking the right value among the N by cosine)."""
    pred = out[..., D // 2 :]
    mse = F.mse_loss(pred, vals).item()
    sims = F.normalize(pred, dim=-1) @ F.normalize(vals, dim=-1).transpose(1, 2)  # [B, N, N]
    acc = (sims.argmax(-1) == torch.arange(N_PAIRS)).float().mean().item()
    return mse, acc


@pytest.mark.parametrize("name", NAMES)
def test_memorization(name):
    layer = make_layer(name, dtype=torch.float32, perturb=False).train()
    if layer.site == "ffn":
        pytest.skip(f"{name}: write is a no-op (it replaces the FFN; its memory is slow weights), nothing to memorize")
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    b_train = TRAIN_BATCH if layer.per_sequence else 8
    for _ in range(layer_test(name)["train_steps"]):
        x_write, x_query, vals = make_pairs(layer, b_train, gen)
        out = recall(layer, x_write, x_query)
        loss = F.mse_loss(out[..., D // 2 :], vals)
        opt.zero_grad()
        loss.backward()
        opt.step()
    layer.detach_state()

    layer.eval()
    x_write, x_query, vals = make_pairs(layer, 64, torch.Generator().manual_seed(123))
    mse1, acc1 = retrieval(recall(layer, x_write, x_query).detach(), vals)
    layer.reset(batch(layer, 64))
    if layer.per_sequence:
        out0 = layer.read(x_query)
    else:
        out0 = torch.cat([layer.read(x_query[b : b + 1]) for b in range(64)])
    mse0, acc0 = retrieval(out0.detach(), vals)
    chance = 1.0 / N_PAIRS
    msg = (
        f"{name}: acc after write {acc1:.3f} (mse {mse1:.4f}), "
        f"without write {acc0:.3f} (mse {mse0:.4f}), chance {chance:.3f}"
    )
    print(msg)
    # "clearly above chance": at n=8 with 512 eval queries chance is 0.125 ± 0.015. The bar is
    # deliberately modest: linear attention's default elu+1 kernel reaches only ~0.44 in this
    # budget (an l2 or identity feature map ~0.98), and the suite must judge every layer fairly.
    assert acc1 >= 2 * chance, msg
    assert acc1 >= acc0 + 0.15, msg
    assert mse1 < mse0, msg
    if layer_test(name)["iterative"]:
        mse2, acc2 = retrieval(recall(layer, x_write, x_query, n_writes=2).detach(), vals)
        assert mse2 < mse1, f"{msg}; iterative layer: mse after two writes {mse2:.4f} is not below one write"


# ---- one_chunk: the update chunk stretched over streamed calls (n-iter NIAH) ------------------
@pytest.mark.parametrize("name", NAMES)
def test_one_chunk_equals_one_long_chunk(name):
    """Inside `one_chunk`, calls of any lengths read with the entry state and the exit writes
    everything as one chunk: equal to one forward with chunk_size = the total length."""
    layer = make_layer(name)
    if layer.inclusive or layer.chunk_size is None or layer.needs_targets:
        with pytest.raises(TypeError, match="one_chunk"):
            with layer.one_chunk():
                pass
        return
    b = batch(layer, 2)
    T = 3 * layer.chunk_size + 5
    x = torch.randn(b, T, D, dtype=torch.float64)
    layer.reset(b)
    start = {k: v.clone() for k, v in layer.state.items()}
    C = layer.chunk_size
    layer.chunk_size = T
    y_ref = layer(x)
    end_ref = {k: v.clone() for k, v in layer.state.items()}
    layer.chunk_size = C
    layer.load_state(start)
    with layer.one_chunk():
        y = torch.cat([layer(x[:, :7]), layer(x[:, 7 : C + 9]), layer(x[:, C + 9 :])], dim=1)
    assert layer.chunk_size == C
    torch.testing.assert_close(y, y_ref, **F64)
    for k in end_ref:
        torch.testing.assert_close(layer.state[k].double(), end_ref[k].double(), **F64)
