"""How long a call takes: every timed measurement in memzoo (the cost suite's training step and
matmul peak, the layer benchmarks) goes through `time_fn`.

`time_fn(fn, warmup, reps, device)` calls `fn` `warmup` times untimed, then times about `reps`
more runs of it:

* on CPU with ``torch.utils.benchmark`` (at torch's current thread count; a call too short for
  the timer to resolve runs in blocks, and its time is the block's over its calls);
* on CUDA with ``triton.testing.do_bench`` (CUDA events around each run, the L2 cache cleared
  before each; triton is imported only there, a CPU run never needs it).

Both measure for a time budget rather than a count: `reps` times the last warm-up call's
duration, so a call that keeps its speed is timed `reps` times (do_bench adds untimed calls of
its own to estimate it and warm up).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Seconds per call of each timed run."""

    times: tuple[float, ...]

    def quantile(self, q: float) -> float:
        """The q-quantile of the run times (linear between the two nearest, as numpy's default)."""
        t = sorted(self.times)
        i = q * (len(t) - 1)
        lo = int(i)
        return t[lo] if lo == len(t) - 1 else t[lo] + (i - lo) * (t[lo + 1] - t[lo])

    @property
    def median(self) -> float:
        return self.quantile(0.5)

    @property
    def mean(self) -> float:
        return sum(self.times) / len(self.times)

    @property
    def min(self) -> float:
        return min(self.times)


def time_fn(fn: Callable[[], object], warmup: int = 1, reps: int = 5, device: str | torch.device = "cpu") -> Timing:
    """Time `fn()` on `device` (the device it computes on): `warmup` untimed calls (at least one:
    the last sets the time budget), then about `reps` timed ones (at least one)."""
    cuda = torch.device(device).type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(max(1, warmup)):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        last = time.perf_counter() - t0
    reps = max(1, reps)
    if cuda:
        from triton.testing import do_bench

        with torch.cuda.device(device):
            ms = do_bench(fn, warmup=0, rep=(reps + 0.5) * last * 1e3, return_mode="all")
        return Timing(tuple(t / 1e3 for t in ms))
    from torch.utils.benchmark import Timer

    timer = Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return Timing(tuple(timer.blocked_autorange(min_run_time=(reps - 0.5) * last).times))
