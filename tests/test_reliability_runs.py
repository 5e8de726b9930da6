"""Reliability of `memzoo train`, `inspect`, `params` and `bench` runs: untrusted checkpoints
never run code, a run never silently replaces another, divergence stops with the last good
checkpoint kept, every file is written atomically, and bad settings fail early in one line."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import yaml

from conftest import layer_options
from memzoo.bench.cli import main
from memzoo.config import load_config
from memzoo.storage import atomic_open, load_tensors

MODEL = {"layout": "GDN", "vocab_size": 257, "d_model": 32, "n_layers": 2, "ffn_dim": 64,
         "gdn_heads": 2, "gdn_head_dim": 16, "gdn_chunk": 16}
TRAIN = {"seq_len": 32, "batch_size": 2, "steps": 3, "warmup": 1, "lr": 3e-3, "min_lr": 3e-4,
         "eval_every": 2, "eval_batches": 1, "ckpt_every": 1}


def _cfg(tmp_path, name="run.yaml", model=None, **train) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"model": {**MODEL, **(model or {})}, "train": {**TRAIN, **train}}))
    return str(path)


def _err_line(capsys) -> str:
    """The one error line on stderr (progress bars aside), with no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("memzoo")]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def _strict_jsonl(path) -> list[dict]:
    def no_constant(c):
        raise ValueError(f"bare {c} in {path}")

    return [json.loads(line, parse_constant=no_constant) for line in path.read_text().splitlines()]


class _Evil:
    """Unpickling this creates the marker file: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_untrusted_checkpoints_are_refused_and_never_run(tmp_path, capsys):
    marker = tmp_path / "pwned"
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"model": _Evil(marker), "config": {}}, run / "ckpt.pt")
    assert main(["inspect", str(run), "--text", "hello world"]) == 2
    err = _err_line(capsys)
    assert f"refusing to load {run / 'ckpt.pt'}: it is not a plain-tensor checkpoint" in err, err
    assert main(["train", _cfg(tmp_path), "--resume", "--out", str(run)]) == 2
    assert "refusing to load" in _err_line(capsys)
    lm = tmp_path / "lm"  # a bench LM: lm.json + model.pt
    lm.mkdir()
    (lm / "lm.json").write_text(json.dumps({"config": load_config(_cfg(tmp_path)).to_dict()}))
    torch.save({"w": _Evil(marker)}, lm / "model.pt")
    assert main(["inspect", str(lm), "--text", "hello world"]) == 2
    assert "refusing to load" in _err_line(capsys)
    assert not marker.exists()


def test_a_run_is_never_silently_replaced(tmp_path, capsys):
    cfg, out = _cfg(tmp_path, steps=2), tmp_path / "out"
    assert main(["train", cfg, "--out", str(out)]) == 0
    ck = load_tensors(out / "ckpt.pt")  # what save() writes is plain tensors and containers
    assert ck["step"] == 2
    capsys.readouterr()
    assert main(["train", cfg, "--out", str(out)]) == 2
    err = _err_line(capsys)
    assert "holds another run" in err and "--resume" in err and "--overwrite" in err
    kept = load_tensors(out / "ckpt.pt")["model"]
    assert all(torch.equal(kept[k], v) for k, v in ck["model"].items())
    assert main(["train", cfg, "--out", str(out), "--steps", "3", "--overwrite"]) == 0
    assert [r["step"] for r in _strict_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    assert main(["train", cfg, "--out", str(out), "--steps", "3", "--resume"]) == 0  # already done: a no-op
    with pytest.raises(SystemExit):
        main(["train", cfg, "--out", str(out), "--resume", "--overwrite"])
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_divergence_stops_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train", _cfg(tmp_path, lr=1e4, min_lr=0.0, steps=6), "--out", str(out)]) == 2
    err = _err_line(capsys)
    m = re.search(r"loss is nan at step (\d+) \(lr 1\.0e\+04\); the last good checkpoint \(step (\d+)\)", err)
    assert m and "lower train.lr" in err, err
    bad, good = int(m[1]), int(m[2])
    assert good == bad - 1
    ck = load_tensors(out / "ckpt.pt")
    assert ck["step"] == good
    assert all(torch.isfinite(v).all() for v in ck["model"].values() if v.is_floating_point())
    metrics = _strict_jsonl(out / "metrics.jsonl")  # strict JSON, up to the last good checkpoint
    assert metrics == ck["history"] and [r["step"] for r in metrics] == list(range(1, good + 1))
    # the kept checkpoint is the one an uninterrupted run writes at that step: resuming replays
    # the same divergence at the same step
    assert main(["train", _cfg(tmp_path, lr=1e4, min_lr=0.0, steps=6), "--out", str(out), "--resume"]) == 2
    assert f"at step {bad} " in _err_line(capsys)
    assert torch.equal(load_tensors(out / "ckpt.pt")["rng"], ck["rng"])


def test_nonfinite_weights_or_validation_loss_are_never_checkpointed(tmp_path, monkeypatch, capsys):
    from memzoo import train as train_mod

    # an infinite lr makes the weights infinite after step 1, before any checkpoint
    with monkeypatch.context() as m:
        m.setattr(train_mod, "lr_at", lambda step, tc: float("inf"))
        assert main(["train", _cfg(tmp_path), "--out", str(tmp_path / "a")]) == 2
    err = _err_line(capsys)
    assert "the weights are not finite at step 1" in err and "no checkpoint was written" in err
    assert not (tmp_path / "a" / "ckpt.pt").exists()
    monkeypatch.setattr(train_mod, "evaluate", lambda model, batches: float("nan"))
    assert main(["train", _cfg(tmp_path), "--out", str(tmp_path / "b")]) == 2
    assert "validation loss is nan at step 2" in _err_line(capsys)
    ck = load_tensors(tmp_path / "b" / "ckpt.pt")
    assert ck["step"] == 1 and _strict_jsonl(tmp_path / "b" / "metrics.jsonl") == ck["history"]


def test_bad_settings_fail_early_in_one_line(tmp_path, monkeypatch, capsys):
    from memzoo import train as train_mod

    cfg = _cfg(tmp_path, steps=2)
    assert main(["train", cfg, "--out", str(tmp_path / "ok")]) == 0
    capsys.readouterr()

    def no_data(rc):
        raise AssertionError("data was prepared before the settings were checked")

    monkeypatch.setattr(train_mod, "prepare_data", no_data)
    (tmp_path / "afile").write_text("")  # a path under a regular file is unwritable, for root too
    assert main(["train", cfg, "--out", str(tmp_path / "afile" / "out")]) == 2
    assert "cannot write to" in _err_line(capsys)
    changed = _cfg(tmp_path, "changed.yaml", model={"d_model": 64}, steps=2, lr=2e-3)
    assert main(["train", changed, "--out", str(tmp_path / "ok"), "--resume"]) == 2
    err = _err_line(capsys)
    assert "model.d_model 32 -> 64" in err and "train.lr 0.003 -> 0.002" in err and "train.steps" not in err
    assert main(["train", cfg, "--out", str(tmp_path / "x"), "--device", "nonsense"]) == 2
    assert "unknown device 'nonsense'" in _err_line(capsys)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train_mod.resolve_device("auto") == "cpu"
    assert main(["train", cfg, "--out", str(tmp_path / "x"), "--device", "cuda"]) == 2
    assert "device 'cuda' is not available: torch.cuda.is_available() is False; use --device cpu" in _err_line(capsys)
    bench = ["bench", "--suite", "cost", "--out", str(tmp_path / "lb"), "--work-dir", str(tmp_path / "w"), "--quiet"]
    assert main([*bench, "--device", "cuda:1"]) == 2
    assert "device 'cuda:1' is not available" in _err_line(capsys)
    for bad in ("-1", "0"):
        assert main([*bench, "--jobs", bad]) == 2
        assert f"--jobs must be >= 1 (leave it out: one per CPU core on CPU, 1 on CUDA), got {bad}" in _err_line(capsys)
    assert main([*bench, "--seed", "-1"]) == 2
    assert "--seed must be >= 0 (seeds N, N+1, ... are used), got -1" in _err_line(capsys)
    assert main([*bench[:4], str(tmp_path / "afile" / "lb"), *bench[5:]]) == 2
    assert "cannot write to" in _err_line(capsys)


def test_params_reports_a_bad_file_and_counts_the_rest(tmp_path, capsys):
    d = tmp_path / "cfgs"
    d.mkdir()
    _cfg(d, "good.yaml")
    (d / "typo.yaml").write_text(yaml.safe_dump({"model": {**MODEL, "d_modle": 8}}))
    (d / "broken.yaml").write_text("model:\n  layout: [GDN\n")
    assert main(["params", str(d)]) == 1
    out, err = capsys.readouterr()
    assert "good" in out and "typo" not in out
    assert len(err.strip().splitlines()) == 2 and "typo.yaml" in err and "broken.yaml" in err and "Traceback" not in err


def test_atomic_write_leaves_the_old_file_when_interrupted(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_open(path) as f:
            f.write("half of the new")
            raise KeyboardInterrupt
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_checkpoints_of_every_layer_load_weights_only(tmp_path):
    """What `train` saves (model with its memory state, optimizer) needs no pickled code."""
    from memzoo.backbone.model import HybridLM, MemzooConfig
    from memzoo.config import ModelConfig, TrainConfig
    from memzoo.registry import layer_names
    from memzoo.train import param_groups

    for name in layer_names():
        mem = {name: layer_options(name)}
        model = HybridLM(MemzooConfig.from_model_config(ModelConfig(**{**MODEL, "layout": f"GDN | {name}@1"},
                                                                    memory=mem)))
        opt = torch.optim.AdamW(param_groups(model, TrainConfig()), lr=1e-3)
        model(torch.randint(0, 257, (1, 16)), targets=torch.randint(0, 257, (1, 16))).loss.backward()
        opt.step()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()},
                   tmp_path / f"{name}.pt")
        ck = load_tensors(tmp_path / f"{name}.pt")
        assert math.isfinite(sum(float(v.float().sum()) for v in ck["model"].values())), name
