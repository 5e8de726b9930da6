"""The FwPKM Triton kernels against the torch path they replace, at the paper's sizes (CUDA only).

fla's op-benchmark convention: a registry of ops, each timed by ``triton.testing.do_bench``
(through :func:`memzoo.timing.time_fn`: warm-up, then runs for a time budget, the L2 cache cleared
before each), median and 20/80% quantiles in ms, a header naming the machine. Every op is the
same call with the kernels on (``memzoo.kernels.fwpkm``) and off (``memzoo.ops.product_key`` and
the layer's torch path):

    lookup        FwPKM's IDW lookup: 8 x 512 tokens, 1 head, key 512, 512 sub-keys per half, top-8
    bag           the read (fwd + bwd to the weights): 4096 tokens x 8 slots of 512² x 512 values
    bag/pkm       PKM's read, fwd + bwd to weights and values: 4 heads x top-32
    layer         the FwPKM layer at Table 3's sizes, one 512-token chunk of 8 sequences:
                  forward (read, write) + backward, the step whose target is >= 5x the torch path
    lookup/pkm    PKM's dot lookup: 8 x 512 tokens, 4 heads, top-32 (last; the PKM layer takes the
                  torch lookup above ``LOOKUP_MAX_K``, as this one stalled on the H200)

    python -m memzoo.bench.benchmarks.bench_kernels            # the table (CUDA)
    pytest bench/benchmarks/bench_kernels.py --benchmark-enable # the same, as pytest-benchmark rows
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from memzoo.ops import product_key as pk

B, C, D = 8, 512, 768  # sequences, chunk tokens, model width (Table 3)


def _lookup(kernel: bool, heads: int, k: int, score: str, device: str) -> Callable[[], object]:
    g = torch.Generator(device).manual_seed(0)
    q = torch.randn(B, C, heads, 512, device=device, generator=g)
    keys = torch.randn(heads, 2, 512, 256, device=device, generator=g) / 16
    if kernel:
        from memzoo.kernels import fwpkm

        return lambda: fwpkm.lookup(q, keys, k, score)
    return lambda: pk.lookup(q, keys, k, score)


def _bag(kernel: bool, heads: int, k: int, values_grad: bool, device: str) -> Callable[[], object]:
    g = torch.Generator(device).manual_seed(0)
    V = torch.randn(512 * 512, 512, device=device, generator=g, requires_grad=values_grad)
    idx = torch.randint(0, 512 * 512, (B * C, heads * k), device=device, generator=g)
    w = torch.softmax(torch.randn(B * C, heads * k, device=device, generator=g), -1).requires_grad_()
    go = torch.randn(B * C, 512, device=device, generator=g)
    if kernel:
        from memzoo.kernels import fwpkm

        read = fwpkm.embedding_bag
    else:
        read = pk.gather_values
    return lambda: torch.autograd.backward(read(V, idx, w), go)


def _layer(kernel: bool, device: str) -> Callable[[], object]:
    from memzoo.registry import build_layer

    torch.manual_seed(0)
    layer = build_layer("fwpkm", D, triton=kernel).to(device)  # the paper's defaults (Table 3)
    x = torch.randn(B, C, D, device=device, requires_grad=True)

    def step():
        with torch.autocast("cuda", torch.bfloat16, enabled=device.startswith("cuda")):
            y = layer(x)
        y.float().pow(2).mean().backward()

    return step


OPS: dict[str, Callable[[bool, str], Callable[[], object]]] = {
    "lookup": lambda kern, dev: _lookup(kern, 1, 8, "idw", dev),
    "bag": lambda kern, dev: _bag(kern, 1, 8, False, dev),
    "bag/pkm": lambda kern, dev: _bag(kern, 4, 32, True, dev),
    "layer": _layer,
    "lookup/pkm": lambda kern, dev: _lookup(kern, 4, 32, "dot", dev),  # last: it stalled on the H200
}


def run(device: str = "cuda") -> list[dict]:
    from memzoo.bench.common import device_name
    from memzoo.timing import time_fn

    rows = []
    print(f"# memzoo.kernels.fwpkm vs torch, {device_name(device)}, torch {torch.__version__}")
    print(f"{'op':<12} {'torch ms':>10} {'kernel ms':>10} {'speedup':>8}   (median; kernel 20-80%)")
    for name, make in OPS.items():
        t_ref = time_fn(make(False, device), warmup=3, reps=20, device=device)
        t_k = time_fn(make(True, device), warmup=3, reps=20, device=device)
        row = {"op": name, "torch_ms": t_ref.median * 1e3, "kernel_ms": t_k.median * 1e3,
               "speedup": t_ref.median / t_k.median}
        rows.append(row)
        print(f"{name:<12} {row['torch_ms']:>10.3f} {row['kernel_ms']:>10.3f} {row['speedup']:>7.2f}x"
              f"   ({t_k.quantile(0.2) * 1e3:.3f}-{t_k.quantile(0.8) * 1e3:.3f})")
    return rows


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels' benchmark needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("name", list(OPS))
def test_kernel_op(benchmark, name, kernel):
    fn = OPS[name](kernel, "cuda")
    fn()
    benchmark.extra_info.update(op=name, path="kernel" if kernel else "torch")
    benchmark(lambda: (fn(), torch.cuda.synchronize()))


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels times Triton kernels against torch on a CUDA device; none is available here")
    run()
