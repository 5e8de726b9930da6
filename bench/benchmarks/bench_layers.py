"""Every registered memory layer's forward + write at tiny scale (torch path, CPU or CUDA).

One call of each layer on a batch of 4 sequences of 256 tokens at d_model 128, with the tiny
bench preset's options for that layer (``zoo_configs/bench/tiny.yaml``, ``layers:``): forward
is the layer's causal mixing, i.e. per chunk (or token) read with the memory so far and write,
under no_grad as at inference. Per-sequence layers start a new sequence each call; shared
persistent ones (FwPKM, FwMLP as the paper trains them) carry their memory on, as the backbone
does. FWL also gets next-token targets and an LM head (d_model -> the preset's vocabulary),
since its write is the gradient of each position's loss.

    pytest bench/benchmarks/bench_layers.py --benchmark-enable      # pytest-benchmark table
    python -m memzoo.bench.benchmarks.bench_layers                  # median ms per call and tokens/s
"""

from __future__ import annotations

import pytest
import torch

from memzoo.bench.common import device_name, load_preset
from memzoo.registry import build_layer
from memzoo.registry import layer_names
from memzoo.timing import time_fn

D_MODEL, BATCH, TOKENS = 128, 4, 256


def make(name: str, device: str = "cpu"):
    """The layer with the tiny preset's options, its input and the step to time."""
    preset = load_preset("tiny")
    spec = preset.layers.get(name)
    torch.manual_seed(0)
    layer = build_layer(name, D_MODEL, **(spec.options if spec else {})).to(device).eval()
    x = torch.randn(BATCH, TOKENS, D_MODEL, device=device)
    kw = {}
    if layer.needs_targets:
        vocab = preset.backbone.get("vocab_size", 257)
        kw["targets"] = torch.randint(0, vocab, (BATCH, TOKENS), device=device)
        if layer.needs_head:
            head = torch.nn.Linear(D_MODEL, vocab, bias=False).to(device)
            kw["head"] = head

    def step():
        if layer.per_sequence:
            layer.reset(BATCH)  # a new sequence
        with torch.no_grad():
            layer(x, **kw)

    return layer, step


@pytest.mark.parametrize("name", layer_names())
def test_layer_forward_write(benchmark, name):
    layer, step = make(name)
    step()  # warm-up
    benchmark.extra_info.update(layer=name, tokens=BATCH * TOKENS, d_model=D_MODEL)
    benchmark(step)


def median_ms(name: str, device: str = "cpu", repeats: int = 5) -> float:
    _, step = make(name, device)
    return 1e3 * time_fn(step, warmup=1, reps=repeats, device=device).median


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"forward + write, d_model {D_MODEL}, {BATCH} x {TOKENS} tokens, tiny preset options, median of ~5 runs, "
          f"on {device_name(device)}")
    for name in layer_names():
        ms = median_ms(name, device)
        print(f"  {name:<8} {ms:9.2f} ms   {BATCH * TOKENS / ms * 1e3:>10,.0f} tokens/s")


if __name__ == "__main__":
    main()
