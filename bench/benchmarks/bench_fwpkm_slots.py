"""FwPKM's cost vs. its number of slots (torch path, CPU or CUDA).

A product-key memory of N = n² slots costs O(n·Dk + k·Dv) per token to read and O(k·(Dk + Dv))
more to write (only the selected rows and sub-keys change), so going from 128² to 1024² slots
(64x the memory) should cost little more per token. Paper sizes otherwise: d_model 768, key and
value dim 512, 1 head, top-8, one 512-token chunk per call (read, then write).

    pytest bench/benchmarks/bench_fwpkm_slots.py --benchmark-enable          # pytest-benchmark table
    python -m memzoo.bench.benchmarks.bench_fwpkm_slots                       # per-token times and the ratio
"""

from __future__ import annotations

import pytest
import torch

from memzoo.bench.common import device_name
from memzoo.layers.fwpkm import FwPKM
from memzoo.timing import time_fn

SLOTS = (128, 256, 512, 1024)
CHUNK = 512


def make(n: int, device: str = "cpu") -> tuple[FwPKM, torch.Tensor]:
    torch.manual_seed(0)
    layer = FwPKM(768, n_subkeys=n, chunk_size=CHUNK).to(device).eval()
    x = torch.randn(1, CHUNK, 768, device=device)
    return layer, x


def step(layer: FwPKM, x: torch.Tensor) -> None:
    with torch.no_grad():
        layer(x)  # read the chunk with the memory so far, then write it


@pytest.mark.parametrize("n", SLOTS)
def test_fwpkm_forward_write(benchmark, n):
    layer, x = make(n)
    step(layer, x)  # warm-up
    benchmark.extra_info["slots"] = n * n
    benchmark(step, layer, x)


def per_token_ms(n: int, device: str = "cpu", repeats: int = 10) -> float:
    layer, x = make(n, device)
    return 1e3 * time_fn(lambda: step(layer, x), warmup=2, reps=repeats, device=device).median / CHUNK


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"FwPKM read+write, paper sizes, {CHUNK}-token chunk, median of ~10 runs, on {device_name(device)}")
    res = {}
    for n in SLOTS:
        res[n] = per_token_ms(n, device)
        print(f"  {n:>5}² = {n * n:>9,} slots: {1e3 * res[n]:8.2f} µs/token")
    print(f"ratio {SLOTS[-1]}² / {SLOTS[0]}²: {res[SLOTS[-1]] / res[SLOTS[0]]:.2f}x")


if __name__ == "__main__":
    main()
