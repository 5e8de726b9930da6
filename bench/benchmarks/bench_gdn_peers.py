"""The gated delta rule's torch path against its peers, forward and backward, on this CPU.

Peers, same inputs (q, k L2-normalised; g <= 0; beta in (0, 1)), fp32, one thread:

    memzoo     memzoo.ops.gated_delta_rule.gated_delta_rule_chunked (chunk 64)
    hf         transformers' Qwen3-Next torch fallback, torch_chunk_gated_delta_rule (chunk 64)
    fla-naive  fla.ops.gated_delta_rule.naive.naive_recurrent_gated_delta_rule (token by token; the
               short shape only)

Shapes (B, T, H, D): the toys' (8, 256, 4, 32) and a long one (1, 4096, 8, 64). Each op is timed in
rounds that alternate the peers (`memzoo.timing.time_fn`: median of its runs), and a ratio is the
median over rounds of peer time / memzoo time (> 1: memzoo is faster). The outputs are checked to
agree first. ::

    python -m memzoo.bench.benchmarks.bench_gdn_peers                 # the table
    pytest bench/benchmarks/bench_gdn_peers.py --benchmark-enable     # pytest-benchmark rows
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

SHAPES = {"toys": (8, 256, 4, 32), "long": (1, 4096, 8, 64)}


def inputs(B: int, T: int, H: int, D: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(B, T, H, D, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, D, generator=g)
    decay = -F.softplus(torch.randn(B, T, H, generator=g))  # log decay, <= 0
    beta = torch.rand(B, T, H, generator=g).sigmoid()
    return q, k, v, decay, beta


def peers() -> dict[str, Callable]:
    from memzoo.ops.gated_delta_rule import gated_delta_rule_chunked

    out = {"memzoo": lambda q, k, v, g, b: gated_delta_rule_chunked(q, k, v, g, b, chunk_size=64)[0]}
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

        hf = getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule)  # the torch code itself,
        out["hf"] = lambda q, k, v, g, b: hf(q, k, v, g, b, chunk_size=64)[0]  # not the hub/fla kernel it dispatches to
    except ImportError:
        pass
    try:
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

        out["fla-naive"] = lambda q, k, v, g, b: naive_recurrent_gated_delta_rule(q, k, v, b, g)[0]
    except ImportError:
        pass
    return out


def step(fn: Callable, xs: tuple[torch.Tensor, ...]) -> Callable[[], None]:
    """Forward and backward (to q, k, v, g, beta) of `fn` on fresh leaves of `xs`."""
    leaves = [x.clone().requires_grad_() for x in xs]
    go = torch.randn_like(xs[2])

    def run() -> None:
        torch.autograd.grad(fn(*leaves), leaves, go)

    return run


def compare(shape: str, rounds: int = 5) -> dict[str, float]:
    """{peer: median over rounds of peer time / memzoo time}, after checking the outputs agree."""
    from memzoo.timing import time_fn

    xs = inputs(*SHAPES[shape])
    ops = {n: f for n, f in peers().items() if not (n == "fla-naive" and shape == "long")}
    ref = ops["memzoo"](*xs)
    for name, f in ops.items():
        err = (f(*xs) - ref).abs().max().item()
        assert err < 1e-3, f"{name} disagrees with memzoo by {err:.2e} at {shape}"
    runs = {n: step(f, xs) for n, f in ops.items()}
    times: dict[str, list[float]] = {n: [] for n in ops}
    for _ in range(rounds):
        for n, run in runs.items():
            times[n].append(time_fn(run, warmup=1, reps=3).median)
    ratios = {n: statistics.median(t / m for t, m in zip(times[n], times["memzoo"])) for n in ops if n != "memzoo"}
    return {"memzoo_ms": 1e3 * statistics.median(times["memzoo"]), **{f"{n}_ms": 1e3 * statistics.median(t) for n, t in times.items() if n != "memzoo"},
            **{f"{n}/memzoo": r for n, r in ratios.items()}}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("peer", ["memzoo", "hf"])
def test_gdn_peer(benchmark, shape, peer):
    fn = peers()[peer]
    torch.set_num_threads(1)
    run = step(fn, inputs(*SHAPES[shape]))
    benchmark.extra_info.update(shape=shape, peer=peer)
    benchmark(run)


if __name__ == "__main__":
    from memzoo.bench.common import hardware

    torch.set_num_threads(1)
    print(f"# gated delta rule, fwd + bwd, fp32, one thread, {hardware()['cpu']}, torch {torch.__version__}")
    for shape, dims in SHAPES.items():
        r = compare(shape)
        print(f"{shape:5s} B,T,H,D={dims}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))
