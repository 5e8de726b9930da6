"""Faults survived, nothing lost (issue 56): a full disk during a row's append or a checkpoint's
write, a damaged LM cache, two bench processes appending to one results.jsonl at once. Each fault
is injected; each test was seen failing before its fix (the note of issue 56 says how)."""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import warnings

import pytest
import yaml

from memzoo.bench.common import Context, Recorder, load_preset, read_results

from test_bench import MICRO


def _enospc(*a, **kw):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_during_an_append_leaves_results_as_they_were(tmp_path, monkeypatch):
    rec = Recorder(tmp_path, "tiny", 0)
    rec.add("cost", "baseline", {"b": 1}, {"x": 1.0}, {"c": 1}, 0.1)
    before = (tmp_path / "results.jsonl").read_bytes()
    monkeypatch.setattr(os, "fsync", _enospc)  # the row's bytes are written, then the disk is full
    with pytest.raises(OSError, match="No space left"):
        rec.add("cost", "fwpkm", {"b": 2}, {"x": 2.0}, {"c": 1}, 0.1)
    assert (tmp_path / "results.jsonl").read_bytes() == before  # no torn row
    monkeypatch.undo()
    rec.add("cost", "mom", {"b": 3}, {"x": 3.0}, {"c": 1}, 0.1)
    assert [r["layer"] for r in read_results(tmp_path / "results.jsonl")] == ["baseline", "mom"]


def test_a_cell_whose_row_cannot_be_written_is_reported_failed_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """A measurement that raises on a full disk becomes a failed cell (a line on stderr), even when
    its failure row cannot be written either; the results file stays whole and --resume measures
    the cell again."""
    from memzoo.bench.run import Job

    ctx = Context(load_preset("tiny"), 0, Recorder(tmp_path, "tiny", 0), tmp_path / "work", progress=False)
    monkeypatch.setattr(os, "fsync", _enospc)

    class Suite:
        @staticmethod
        def run(ctx, layers):
            ctx.record("cost", layers[0], {}, {"x": 1.0}, {}, 0.0)

    monkeypatch.setattr("memzoo.bench.run.suite", lambda name: Suite)
    Job("baseline", ("cost",)).run(ctx)  # does not raise
    err = capsys.readouterr().err
    assert "FAILED cost baseline" in err and "No space left" in err and "the failure could not be recorded" in err
    assert not (tmp_path / "results.jsonl").exists() or read_results(tmp_path / "results.jsonl") == []


def test_a_full_disk_during_a_checkpoint_write_leaves_the_last_checkpoint(tmp_path, monkeypatch):
    import torch

    from memzoo.storage import torch_save

    path = tmp_path / "ckpt.pt"
    torch_save({"step": 1}, path)
    monkeypatch.setattr(os, "fsync", _enospc)
    with pytest.raises(OSError):
        torch_save({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"step": 1} and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_a_truncated_lm_cache_is_moved_aside_and_the_lm_trained_again(tmp_path):
    from memzoo.bench import lm

    preset_path = tmp_path / "micro.yaml"
    preset_path.write_text(yaml.safe_dump(MICRO))
    ctx = Context(load_preset(str(preset_path)), 0, Recorder(tmp_path, "micro", 0), tmp_path / "work", progress=False)
    lm.shared_lm(ctx, "baseline")
    out = lm.Path(lm.lm_config(ctx, "baseline")[0].train.out_dir)
    model_pt = out / "model.pt"
    model_pt.write_bytes(model_pt.read_bytes()[:100])  # a kill or a full disk cut it short
    lm._loaded.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, info = lm.shared_lm(ctx, "baseline")
    assert any("does not load" in str(w.message) and "training it again" in str(w.message) for w in caught)
    assert (out.parent / f"{out.name}.damaged-0" / "model.pt").stat().st_size == 100  # kept for a look
    assert model_pt.stat().st_size > 100 and info["steps"] == MICRO["train"]["steps"]
    lm._loaded.clear()
    lm.shared_lm(ctx, "baseline")  # and loads from the cache again, silently
    assert not (out.parent / f"{out.name}.damaged-1").exists()


def _append_rows(path: str, tag: str, n: int) -> None:
    rec = Recorder(path, "tiny", 0, run_id=tag)
    for i in range(n):
        rec.add("cost", tag, {"i": i}, {"x": float(i), "pad": "y" * 2000}, {"c": i}, 0.0)


def test_two_bench_processes_appending_at_once_interleave_no_bytes(tmp_path):
    """Hundreds of rows of 2 KB from two processes at once: every line parses and every row is there."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_append_rows, args=(str(tmp_path), tag, 300)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 600 and sorted((r["run_id"], r["setting"]["i"]) for r in rows) == sorted(
        (t, i) for t in ("a", "b") for i in range(300))
