"""Where one FwPKM layer step spends its time: a torch.profiler table of its operations.

The step is bench_kernels' ``layer`` (the FwPKM layer at Table 3's sizes, one 512-token chunk of 8
sequences: forward with its read and write, then backward, in bf16 autocast on CUDA), with the
Triton kernels off (the torch path) and on. After warm-up, ``steps`` steps are profiled; the table
lists the operations with the most self time on the device (CUDA kernels; on a CPU, operators),
per step and as a share of the step, and counts what is not math: kernel launches, host syncs
(``aten::item`` / ``aten::_local_scalar_dense``, each waits for the device) and copies. ::

    python -m memzoo.bench.benchmarks.profile_fwpkm --out DIR        # CUDA: DIR/profile_fwpkm.md
    python -m memzoo.bench.benchmarks.profile_fwpkm --device cpu --small --out DIR   # a small check
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

#: operators that make the host wait for the device
SYNCS = ("aten::item", "aten::_local_scalar_dense")


def layer_step(kernel: bool, device: str, small: bool = False):
    """The step to profile (bench_kernels' layer op; `small`: a layer and chunk a CPU runs in a blink)."""
    from memzoo.bench.benchmarks import bench_kernels as bk
    from memzoo.registry import build_layer

    if not small:
        return bk._layer(kernel, device)
    torch.manual_seed(0)
    layer = build_layer("fwpkm", 64, triton=kernel, key_dim=32, value_dim=32, n_subkeys=16, topk=4, chunk_size=16).to(device)
    x = torch.randn(2, 32, 64, device=device, requires_grad=True)
    return lambda: layer(x).float().pow(2).mean().backward()


def profile(step, device: str, steps: int = 5, warmup: int = 3, top: int = 15) -> dict:
    """Profile `steps` calls of `step`: the top operations by self device time, and the counts."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.startswith("cuda")
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with torch_profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"

    def self_us(e) -> float:
        return float(getattr(e, key, 0.0) or 0.0)

    total = sum(self_us(e) for e in events if (e.device_type.name == "CUDA") == cuda or not cuda) or 1.0
    ops = sorted((e for e in events if self_us(e) > 0), key=self_us, reverse=True)[:top]
    count = {e.key: e.count for e in events}
    return {
        "device_time_ms_per_step": total / 1e3 / steps,
        "top": [{"name": e.key, "calls_per_step": e.count / steps, "ms_per_step": self_us(e) / 1e3 / steps,
                 "share": self_us(e) / total} for e in ops],
        "launches_per_step": sum(n for k, n in count.items() if k in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                       "cudaLaunchKernelExC")) / steps,
        "syncs_per_step": sum(count.get(k, 0) for k in SYNCS) / steps,
        "copies_per_step": sum(n for k, n in count.items() if k in ("aten::copy_", "aten::to", "aten::clone")) / steps,
    }


def markdown(results: dict[str, dict], device: str) -> str:
    from memzoo.bench.common import device_name

    lines = [f"# One FwPKM layer step (fwd + bwd), {device_name(device)}, torch {torch.__version__}", ""]
    for path, r in results.items():
        lines += [f"## {path}: {r['device_time_ms_per_step']:.3f} ms of {'device' if device.startswith('cuda') else 'CPU'} "
                  f"time a step; {r['launches_per_step']:.0f} kernel launches, {r['syncs_per_step']:.0f} host syncs, "
                  f"{r['copies_per_step']:.0f} copies a step", "",
                  "| operation | calls/step | ms/step | share |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| `{o['name'][:80]}` | {o['calls_per_step']:g} | {o['ms_per_step']:.3f} | {100 * o['share']:.1f}% |"
                  for o in r["top"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memzoo.bench.benchmarks.profile_fwpkm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a small layer and chunk (a check on a CPU)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("."), help="writes OUT/profile_fwpkm.md")
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("profile_fwpkm: no CUDA device here; --device cpu --small checks it on the CPU")
    results = {}
    for kernel in (False, True):
        if kernel and not a.device.startswith("cuda"):
            continue  # the Triton kernels run on CUDA (the interpreter is a test, not a profile)
        results["kernels on" if kernel else "torch path"] = profile(layer_step(kernel, a.device, a.small), a.device, a.steps)
    text = markdown(results, a.device)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "profile_fwpkm.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
