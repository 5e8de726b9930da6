"""Plugins: a layer written outside memzoo, registered with @memzoo.register_layer in a module
memzoo imports by name (`memzoo --plugin MODULE`, MEMZOO_PLUGINS, `pytest -p MODULE`), is tested
by the shared property suite, counted and benched like a built-in one. The layer is written by
the test into a temporary folder; no file of the project is touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import layer_options, layer_test
from memzoo import registry

MOD, NAME = "memzoo_throwaway_plugin", "throwaway_ema"
REPO = Path(__file__).resolve().parents[1]

PLUGIN = textwrap.dedent('''
    """A throwaway memory: an exponential moving average of key-value outer products."""

    import torch
    import torch.nn.functional as F
    from torch import nn

    from memzoo import MemoryLayer, register_layer

    MEMZOO_TESTS = {"throwaway_ema": {"options": {"key_dim": 16}}}  # read by tests/conftest.py


    @register_layer("throwaway_ema")
    class ThrowawayEMA(MemoryLayer):
        """An exponential moving average of key-value outer products, written chunk by chunk:
        M <- a^C M + sum_t a^(C-1-t) k_t v_t^T (a learned decay a); read W_o(q^T M). Per sequence;
        forward is the base class's definition (per chunk: read with the memory so far, then write)."""

        chunk_size = 16  # no default_where: the bench places a layer its preset does not list "last"

        def __init__(self, d_model: int, key_dim: int = 64):
            super().__init__(d_model)
            self.key_dim = key_dim
            self.q = nn.Linear(d_model, key_dim, bias=False)
            self.k = nn.Linear(d_model, key_dim, bias=False)
            self.v = nn.Linear(d_model, d_model, bias=False)
            self.o = nn.Linear(d_model, d_model, bias=False)
            self.decay_logit = nn.Parameter(torch.tensor(3.0))

        def init_state(self, batch_size):
            w = self.q.weight
            return {"M": torch.zeros(batch_size, self.key_dim, self.d_model, dtype=w.dtype, device=w.device)}

        def read_state(self, x, state):
            return self.o(F.normalize(self.q(x), dim=-1) @ state["M"])

        def write_state(self, x, state):
            a, T = torch.sigmoid(self.decay_logit), x.shape[1]
            w = a ** torch.arange(T - 1, -1, -1, dtype=x.dtype, device=x.device)
            k, v = F.normalize(self.k(x), dim=-1), self.v(x)
            return {"M": a**T * state["M"] + torch.einsum("btk,btd->bkd", k * w[:, None], v)}
''')


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """The plugin module in a folder of its own, importable in this process and in children."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / f"{MOD}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv(registry.PLUGINS_ENV, "")  # restored afterwards, whatever a test adds
    yield folder
    registry._LAYERS.pop(NAME, None)  # later tests see the built-in registry again
    registry._PLUGINS.discard(MOD)
    sys.modules.pop(MOD, None)


def _env(folder: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != registry.PLUGINS_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH")) if p)
    return {**env, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}


def test_the_property_suite_runs_on_a_plugin_layer(plugin_dir):
    """`pytest -p MODULE` imports the plugin before collection: the suite is parametrised over it."""
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", MOD, "-p", "no:cacheprovider", "-q", "-k", NAME,
         "tests/test_layer_properties.py"],
        cwd=REPO, env=_env(plugin_dir), capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    summary = r.stdout.strip().splitlines()[-1]
    assert " passed" in summary and int(summary.split(" passed")[0].split()[-1]) >= 10, summary


def test_a_plugin_from_the_environment_is_counted_and_gives_its_test_options(plugin_dir, monkeypatch):
    from memzoo.config import ModelConfig
    from memzoo.flops import step_flops

    monkeypatch.setenv(registry.PLUGINS_ENV, MOD)  # the registry imports it at its next lookup
    assert NAME in registry.layer_names()
    assert layer_options(NAME) == {"key_dim": 16} and not layer_test(NAME)["iterative"]  # its MEMZOO_TESTS

    tiny = dict(vocab_size=67, d_model=32, n_layers=2, ffn_dim=64, gdn_heads=2, gdn_head_dim=16, gdn_chunk=8)
    base = step_flops(ModelConfig(layout="GDN", **tiny), 2, 16)
    mem = step_flops(ModelConfig(layout=f"GDN | {NAME}@1", **tiny, memory={NAME: layer_options(NAME)}), 2, 16)
    # four projections (dense) and the reads q·M and writes (contractions), forward and backward
    assert mem.dense > base.dense and mem.contractions > base.contractions


# a micro bench preset: the tiny backbone shrunk, a few training steps per suite
MICRO = {
    "model": {"layout": "GDN", "vocab_size": 257, "d_model": 32, "n_layers": 2, "ffn_dim": 64, "gdn_heads": 2,
              "gdn_head_dim": 16, "attn_heads": 2, "attn_kv_heads": 2, "attn_head_dim": 16},  # the toys' windows
    "train": {"seq_len": 64, "batch_size": 2, "steps": 2, "warmup": 1, "eval_every": 2, "eval_batches": 1},
    "toys": {"tasks": ["mqar"], "widths": [16, 32], "max_steps": 3, "eval_every": 3, "seeds": 1, "lrs": [0.01],
             "batch_size": 4, "warmup": 1, "val_size": 8, "test_size": 8, "mqar_seq_len": 16, "mqar_vocab": 32,
             "mqar_kv": [1], "controls": False},
    "ppl": {"seq_len": 32, "max_tokens": 64},
    "cost": {"batch": 2, "seq_len": 32, "warmup": 1, "steps": 1},
}


def test_memzoo_bench_runs_a_plugin_layer_in_its_workers(plugin_dir, tmp_path):
    """`--plugin` before the verb; two workers (baseline | plugin layer) are spawned processes,
    which import the plugin from MEMZOO_PLUGINS. The preset does not list the layer: it goes in
    the last block."""
    out, run = tmp_path / "bench", tmp_path / "run"
    run.mkdir()
    (run / "micro.yaml").write_text(json.dumps(MICRO))  # JSON is YAML
    r = subprocess.run(
        [sys.executable, "-m", "memzoo.bench.cli", "--plugin", MOD, "bench", "--suite", "cost,toys,ppl", "--layers", NAME,
         "--preset", "micro.yaml", "--out", str(out), "--work-dir", str(out), "--jobs", "2", "--quiet"],
        cwd=run, env=_env(plugin_dir), capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    mine = [row for row in rows if row["layer"] == NAME]
    assert {row["suite"] for row in mine} == {"cost", "toys", "ppl"}, sorted({(r["layer"], r["suite"]) for r in rows})
    assert all(f"{NAME}@last" in json.dumps(row["config"]) for row in mine)


def test_a_plugin_that_cannot_be_imported_is_one_error_line(plugin_dir, capsys):
    from memzoo.bench.cli import main

    assert main(["--plugin", "memzoo_no_such_plugin", "params", "tiny/gdn"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'memzoo_no_such_plugin'" in err and "PYTHONPATH" in err, err
