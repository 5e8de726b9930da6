"""One toy training step (forward, backward, clip, AdamW) on the standard preset's MQAR cell.

The step of `memzoo.bench.suites.toys.train_cell` for the 2-layer model of width 64 on a batch
of 32 sequences of 64 tokens, the GDN baseline and FwPKM (a memory per sequence, chunk 8), in
the settings that decide toy-training speed: GDN's chunk (64, the LM's; 16, the toys'), the
precision (fp32; bf16 autocast) and torch.compile. Compare ratios measured in one run only.

    pytest bench/benchmarks/bench_toys.py --benchmark-enable      # pytest-benchmark table
    python -m memzoo.bench.benchmarks.bench_toys                  # tokens/s per setting
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from memzoo.bench.common import device_name, load_preset
from memzoo.timing import time_fn

SETTINGS = {  # name: (GDN chunk, precision, compile)
    "chunk64-fp32": (64, "fp32", False),  # before: the LM's GDN chunk
    "chunk16-fp32": (16, "fp32", False),
    "chunk16-bf16": (16, "bf16", False),
    "chunk16-bf16-compile": (16, "bf16", True),  # after: the toys' presets
}


def make(layer: str, setting: str):
    """The step to time (a closure over a fresh model, optimizer and one fixed batch) and its tokens."""
    from memzoo.backbone.model import HybridLM
    from memzoo.bench.suites import toys
    from memzoo.train import make_step, param_groups

    chunk, precision, compile_ = SETTINGS[setting]
    preset = load_preset("standard")
    s = preset.settings("toys", toys.Settings)
    task = toys.Task("mqar", s)
    mc = dataclasses.replace(toys.toy_config(preset, layer, 64, task.vocab, s), gdn_chunk=chunk)
    torch.manual_seed(0)
    model = HybridLM(mc).train()
    tc = SimpleNamespace(lr=3e-3, weight_decay=s.weight_decay)
    opt = torch.optim.AdamW(param_groups(model, tc), lr=3e-3, betas=(0.9, 0.98))
    train_step = make_step(model, opt, s.grad_clip, precision, compile_)
    x, y = task.batch(0, torch.Generator().manual_seed(0))
    return (lambda: train_step([(x, y)], 3e-3)), x.numel()


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("layer", ["baseline", "fwpkm"])
def test_toy_training_step(benchmark, layer, setting):
    step, tokens = make(layer, setting)
    for _ in range(3):  # warm-up (and compilation)
        step()
    benchmark.extra_info.update(layer=layer, setting=setting, tokens=tokens)
    benchmark(step)


def main() -> None:
    torch.set_flush_denormal(True)
    print(f"toy training step, standard MQAR cell, {device_name('cpu')}")
    for layer in ("baseline", "fwpkm"):
        for setting in SETTINGS:
            step, tokens = make(layer, setting)
            t = time_fn(step, warmup=5, reps=30)
            print(f"{layer:9} {setting:22} {tokens / t.median:9.0f} tokens/s", flush=True)


if __name__ == "__main__":
    main()
