"""Toy training speed: one step (forward, backward, clip, AdamW) of the standard preset's MQAR cell.

The step of `memzoo.bench.suites.toys.train_cell` for the 2-layer model of the standard preset's
width (128) on a batch of its size (64 sequences of 64 tokens), the GDN baseline and FwPKM (a
memory per sequence, chunk 8), in the settings that decide toy-training speed: GDN's chunk (64,
the LM's; 16, the toys'), the precision (fp32; bf16 autocast) and torch.compile. Compare ratios
measured in one run only.

    python -m memzoo.bench.benchmarks.bench_toys                    # tokens/s per setting
    python -m memzoo.bench.benchmarks.bench_toys --before 279a062   # this code against a git ref's
    pytest bench/benchmarks/bench_toys.py --benchmark-enable        # pytest-benchmark table

``--before REF`` times the same cell as the code at REF trained it (fp32, eager, GDN chunk 64, a
plain backward / clip / AdamW loop) in a `git worktree` of REF, against this code with the
standard preset's settings, alternating the two, and prints the ratio. 279a062 is the code when
issue 12 asked for 2x faster toy training. Both sides run the same script in a fresh one-thread
process and use only what both versions have (``ModelConfig.from_dict``, ``HybridLM``,
``mqar.mixed_batch``); a step's time is the fastest of 8 blocks of 6 steps (the least disturbed
by other processes).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from memzoo.bench.common import device_name, load_preset
from memzoo.timing import time_fn

SETTINGS = {  # name: (GDN chunk, precision, compile)
    "chunk64-fp32": (64, "fp32", False),  # the LM's GDN chunk
    "chunk16-fp32": (16, "fp32", False),
    "chunk16-bf16": (16, "bf16", False),
    "chunk16-bf16-compile": (16, "bf16", True),  # the toys' presets
}
LAYERS = ("baseline", "fwpkm")


def cell(layer: str):
    """The standard preset's MQAR cell for `layer`: (model config, task, toys settings)."""
    from memzoo.bench.suites import toys

    preset = load_preset("standard")
    s = preset.settings("toys", toys.Settings)
    task = toys.MQAR(s)
    return toys.toy_config(preset, layer, s.widths[0], task.vocab, s), task, s


def make(layer: str, setting: str):
    """The step to time (a closure over a fresh model, optimizer and one fixed batch) and its tokens."""
    from memzoo.backbone.model import HybridLM
    from memzoo.config import TrainConfig
    from memzoo.train import make_step, param_groups

    chunk, precision, compile_ = SETTINGS[setting]
    mc, task, s = cell(layer)
    mc = dataclasses.replace(mc, gdn_chunk=chunk)
    torch.manual_seed(0)
    model = HybridLM(mc).train()
    tc = TrainConfig(lr=3e-3, weight_decay=s.weight_decay)
    opt = torch.optim.AdamW(param_groups(model, tc), lr=3e-3, betas=(0.9, 0.98))
    train_step = make_step(model, opt, s.grad_clip, precision, compile_)
    x, y = task.batch(0, torch.Generator().manual_seed(0))
    return (lambda: train_step([(x, y)], 3e-3)), x.numel()


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("layer", LAYERS)
def test_toy_training_step(benchmark, layer, setting):
    step, tokens = make(layer, setting)
    for _ in range(3):  # warm-up (and compilation)
        step()
    benchmark.extra_info.update(layer=layer, setting=setting, tokens=tokens)
    benchmark(step)


# ---- this code against another version's ----------------------------------------------------

# Run in a fresh process with the version to time first on sys.path. argv: a JSON job.
_STEP = r"""
import json, sys, time, torch
job = json.loads(sys.argv[1])
torch.set_num_threads(1); torch.set_flush_denormal(True)
from memzoo.backbone.model import HybridLM
from memzoo.config import ModelConfig
from memzoo.data import mqar
known = ModelConfig.__dataclass_fields__
mc = ModelConfig.from_dict({k: v for k, v in job["model"].items() if k in known})
torch.manual_seed(0)
model = HybridLM(mc).train()
if job["preset_step"]:  # this code, as the toys suite trains
    from memzoo.config import TrainConfig
    from memzoo.train import make_step, param_groups
    groups = param_groups(model, TrainConfig(lr=3e-3, weight_decay=job["weight_decay"]))
    opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.98))
    step = make_step(model, opt, job["grad_clip"], job["precision"], job["compile"])
    run = lambda x, y: step([(x, y)], 3e-3)
else:  # fp32 eager, as toys trained before the speed settings
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), weight_decay=job["weight_decay"])
    def run(x, y):
        model(x, targets=y).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
x, y = mqar.mixed_batch(job["batch"], job["kv"], job["seq_len"], job["vocab"], 0.01, torch.Generator().manual_seed(0))
for _ in range(5):
    run(x, y)
best = float("inf")
for _ in range(8):
    t = time.perf_counter()
    for _ in range(6):
        run(x, y)
    best = min(best, (time.perf_counter() - t) / 6)
print(json.dumps({"tokens_per_s": x.numel() / best}))
"""


def _job(layer: str, before: bool) -> dict:
    mc, _, s = cell(layer)
    model = mc.to_dict()
    if before:
        model["gdn_chunk"] = 64
    return {"model": model, "preset_step": not before, "precision": s.precision, "compile": s.compile,
            "weight_decay": s.weight_decay, "grad_clip": s.grad_clip, "batch": s.batch_size, "kv": s.mqar_kv,
            "seq_len": s.mqar_seq_len, "vocab": s.mqar_vocab}


def _tokens_per_s(tree: Path, job: dict) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _STEP, json.dumps(job)], cwd=tree, env=env, capture_output=True,
                         text=True)
    if out.returncode:
        raise RuntimeError(f"the toy step failed in {tree}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]


def compare(ref: str, reps: int = 3) -> None:
    """Tokens/s of the code at git `ref` (as it trained toys) and of this code (the standard
    preset's settings), alternating, `reps` times each; the median ratio per layer."""
    here = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(here), "worktree", "add", "--detach", str(tree), ref], check=True,
                       capture_output=True)
        try:
            for layer in LAYERS:
                runs = [(_tokens_per_s(tree, _job(layer, True)), _tokens_per_s(here, _job(layer, False)))
                        for _ in range(reps)]
                for b, a in runs:
                    print(f"{layer:9} {ref}: {b:7.0f} tokens/s   this code: {a:7.0f} tokens/s   {a / b:.2f}x", flush=True)
                print(f"{layer:9} median ratio {statistics.median(a / b for b, a in runs):.2f}x", flush=True)
        finally:
            subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(tree)], capture_output=True)


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", metavar="REF", help="also time the code at this git ref, side by side")
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    torch.set_flush_denormal(True)
    if a.before:
        print(f"toy training step, standard MQAR cell, {device_name('cpu')}, one thread per process")
        compare(a.before, a.reps)
        return
    print(f"toy training step, standard MQAR cell, {device_name('cpu')}, {torch.get_num_threads()} threads")
    for layer in LAYERS:
        for setting in SETTINGS:
            step, tokens = make(layer, setting)
            t = time_fn(step, warmup=5, reps=30)
            print(f"{layer:9} {setting:22} {tokens / t.median:9.0f} tokens/s", flush=True)


if __name__ == "__main__":
    main()
