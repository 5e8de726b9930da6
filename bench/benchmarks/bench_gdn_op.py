"""The gated delta rule's paths on one device, forward and backward, at the FwPKM paper's shape.

One GDN op as a layer of the paper's model runs it: B8 T4096, 8 heads of 64 (Table 3), q, k, v in
bf16 (the mixer's autocast), g and beta in fp32, the chunk of 64. Paths:

    torch      memzoo.ops.gated_delta_rule_chunked, eager (the library reference)
    compiled   the same under torch.compile (what the GDN mixer runs on CUDA where fla cannot)
    fla        flash-linear-attention's chunk kernel, where installed and not refused (fla #640:
               its gated backward on Hopper with Triton < 3.7.1), else the reason it is not timed

Each path's output and input gradients are checked against the eager torch path first (their
largest difference relative to the reference's largest magnitude), then timed by
`memzoo.timing.time_fn` (median of `reps` runs after warm-up; compiling is timed apart, once). ::

    python -m memzoo.bench.benchmarks.bench_gdn_op                     # CUDA, the paper's shape
    python -m memzoo.bench.benchmarks.bench_gdn_op --device cpu --shape 1,128,2,16   # a small check
    pytest bench/benchmarks/bench_gdn_op.py --benchmark-enable            # pytest-benchmark rows (CUDA)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

PAPER = (8, 4096, 8, 64)  # B, T, H, D


def inputs(shape: tuple[int, int, int, int], device: str, seed: int = 0) -> list[torch.Tensor]:
    """q, k (L2-normalised), v in bf16 on CUDA (fp32 on a CPU), g <= 0 and beta in (0, 1) in fp32."""
    B, T, H, D = shape
    g = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16 if device.startswith("cuda") else torch.float32
    q, k = (F.normalize(torch.randn(B, T, H, D, generator=g), dim=-1).to(device, dt) for _ in range(2))
    v = torch.randn(B, T, H, D, generator=g).to(device, dt)
    decay = F.logsigmoid(torch.randn(B, T, H, generator=g) + 2).to(device)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g)).to(device)
    return [q, k, v, decay, beta]


def paths(device: str) -> dict[str, object]:
    """name -> a function of (q, k, v, g, beta) returning o, or a string: why it is not run here."""
    from memzoo.ops import gated_delta_rule as gdr

    out: dict[str, object] = {
        "torch": lambda *xs: gdr.gated_delta_rule(*xs, backend="torch")[0],
        "compiled": lambda *xs: gdr.gated_delta_rule(*xs, backend="compiled")[0],
    }
    if not device.startswith("cuda"):
        out["fla"] = "needs CUDA"
    elif why := gdr.fla_unusable(torch.device(device).index):
        out["fla"] = why
    else:
        out["fla"] = lambda *xs: gdr.gated_delta_rule(*xs, backend="fla")[0]
    return out


def step(fn, xs: list[torch.Tensor], do: torch.Tensor):
    """One forward and backward of `fn`; returns (o, input gradients)."""
    xs = [x.detach().requires_grad_(True) for x in xs]
    o = fn(*xs)
    torch.autograd.backward(o, do)
    return o.detach(), [x.grad for x in xs]


def agreement(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest |a - b| over each tensor pair, relative to the reference's largest magnitude."""
    return max(float((x.float() - y.float()).abs().max() / y.float().abs().max().clamp(min=1e-12)) for x, y in zip(a, b))


def run(device: str = "cuda", shape: tuple[int, int, int, int] = PAPER, reps: int = 10) -> list[dict]:
    from memzoo.bench.common import device_name
    from memzoo.timing import time_fn

    xs = inputs(shape, device)
    do = torch.randn(xs[2].shape, generator=torch.Generator().manual_seed(1)).to(device, xs[2].dtype)
    ref = None
    rows = []
    print(f"# the gated delta rule, fwd + bwd, B{shape[0]} T{shape[1]} H{shape[2]} D{shape[3]}, {device_name(device)}, "
          f"torch {torch.__version__}")
    print(f"{'path':<10} {'ms':>9} {'vs torch':>9} {'first call s':>13} {'max rel diff':>13}")
    for name, fn in paths(device).items():
        if isinstance(fn, str):
            rows.append({"path": name, "skipped": fn})
            print(f"{name:<10} not timed: {fn}")
            continue
        t0 = time.perf_counter()
        o, grads = step(fn, xs, do)  # the first call compiles (compiled, fla's autotuning)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        first = time.perf_counter() - t0
        got = [o, *grads]
        ref = got if ref is None else ref
        t = time_fn(lambda: step(fn, xs, do), warmup=2, reps=reps, device=device)
        row = {"path": name, "ms": t.median * 1e3, "first_call_s": first, "max_rel_diff": agreement(got, ref)}
        row["vs_torch"] = rows[0]["ms"] / row["ms"] if rows else 1.0
        rows.append(row)
        print(f"{name:<10} {row['ms']:>9.2f} {row['vs_torch']:>8.2f}x {first:>13.1f} {row['max_rel_diff']:>13.2e}")
    return rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GDN op's benchmark runs at the paper's shape on CUDA")
@pytest.mark.parametrize("path", ["torch", "compiled"])
def test_gdn_op(benchmark, path):
    xs = inputs(PAPER, "cuda")
    do = torch.randn_like(xs[2])
    fn = paths("cuda")[path]
    step(fn, xs, do)  # compiled: compile first
    benchmark.extra_info.update(path=path, shape=PAPER)
    benchmark(lambda: (step(fn, xs, do), torch.cuda.synchronize()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memzoo.bench.benchmarks.bench_gdn_op", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default=",".join(map(str, PAPER)), help="B,T,H,D (default the paper's)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench_gdn_op: no CUDA device here; --device cpu --shape 1,128,2,16 checks it on the CPU")
    rows = run(a.device, tuple(int(n) for n in a.shape.split(",")), a.reps)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
