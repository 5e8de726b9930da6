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


def test_a_write_that_fails_mid_line_leaves_every_other_row_and_the_leaderboard_renders(tmp_path, monkeypatch):
    """A full disk that takes half a row's bytes and then refuses the rest (as a small tmpfs does):
    the file goes back to what it was, the error names the file, and once space is freed the next
    rows append on lines of their own; every row but the failed one reads back and the leaderboard
    renders from the file (issue 79: the buffered write had left its rest to be flushed on close, a
    torn line that the next append then ran into)."""
    from memzoo.bench.report import render

    rec = Recorder(tmp_path, "tiny", 0)
    for i in range(3):
        rec.add("cost", "baseline", {"b": i}, {"params": 1, "flops_table2": 1.0}, {"c": 1}, 0.1)
    before = (tmp_path / "results.jsonl").read_bytes()
    write = os.write

    def half_then_full(fd, data):
        if len(data) > 8:
            return write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError, match=r"results.jsonl: a row could not be appended \(No space left on device\)"):
        rec.add("cost", "fwpkm", {"b": 9}, {"params": 1}, {"c": 1}, 0.1)
    assert (tmp_path / "results.jsonl").read_bytes() == before
    monkeypatch.undo()  # space freed
    for i in range(3, 5):
        rec.add("cost", "baseline", {"b": i}, {"params": 1, "flops_table2": 1.0}, {"c": 1}, 0.1)
    assert [r["setting"]["b"] for r in read_results(tmp_path / "results.jsonl")] == [0, 1, 2, 3, 4]
    assert render(tmp_path / "results.jsonl")  # the leaderboard reads the file


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

    monkeypatch.setattr("memzoo.bench.run.get_suite", lambda name: Suite)
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


KILLER = '''
import os, pathlib, signal
from memzoo.layers.linear_attention import LinearAttentionMemory
from memzoo.registry import register_layer

@register_layer("killer")
class Killer(LinearAttentionMemory):
    """Linear attention whose first training step kills its process (once: a marker file)."""
    def forward(self, x, *args, **kwargs):
        mark = pathlib.Path(os.environ["KILLER_MARK"])
        if self.training and not mark.exists():
            mark.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x, *args, **kwargs)
'''


def test_a_worker_killed_mid_cell_leaves_that_cell_failed_and_the_run_going(tmp_path, monkeypatch):
    """A bench worker SIGKILLed in the middle of a cell (as the kernel's OOM killer would): the run
    finishes the other cells on a new worker, records the cell failed, and --resume measures it."""
    import importlib
    import sys

    from memzoo import registry
    from memzoo.bench.run import run_bench

    from test_toys import MICRO as TOYS

    (tmp_path / "killer_plugin.py").write_text(KILLER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("MEMZOO_PLUGINS", "killer_plugin")
    monkeypatch.setenv("KILLER_MARK", str(tmp_path / "killed"))
    monkeypatch.setattr(registry, "_PLUGINS", {"killer_plugin"})  # imported below; taken out after
    try:
        importlib.import_module("killer_plugin")
        preset = tmp_path / "p.yaml"
        preset.write_text(yaml.safe_dump({"base": "_base", "toys": {**TOYS, "tasks": ["mqar"], "widths": [16], "seeds": 1,
                                                                  "lrs": [1e-2]}}))
        kw = dict(suites="toys", preset=str(preset), out=tmp_path / "out", work_dir=tmp_path / "work", progress=False,
                  jobs=2)
        rows = run_bench("killer,linear", **kw)
        failed = [r for r in rows if r["suite"] == "failed"]
        assert [r["layer"] for r in failed] == ["killer"] and "worker running it died" in failed[0]["metrics"]["error"]
        assert {r["layer"] for r in rows if r["suite"] == "toys"} == {"baseline", "linear", "ctrl:attention", "ctrl:none"}
        again = run_bench("killer,linear", **kw, resume=True)
        assert not [r for r in again if r["suite"] == "failed"]
        done = [r for r in read_results(tmp_path / "out" / "results.jsonl") if r["suite"] == "toys"]
        assert sorted(r["layer"] for r in done) == ["baseline", "ctrl:attention", "ctrl:none", "killer", "linear"]
    finally:
        registry._LAYERS.pop("killer", None)
        sys.modules.pop("killer_plugin", None)
