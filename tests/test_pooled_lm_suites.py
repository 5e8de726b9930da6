"""The LM suites' accuracy tables (niah, ppl) pool processors by protocol: a preset's rows of one protocol
are one section whatever processor measured them, each training seed counted once; the controls must hold
on every processor that contributed rows (a run on a new one measures its own); timings stay per processor;
and a preset's rows of another protocol are a section of their own that says what differs."""

from __future__ import annotations

import json

import pytest

import memzoo.bench.suites  # noqa: F401  (registers the suites)
import memzoo.layers  # noqa: F401  (registers the layers)
from memzoo.bench.common import (
    BASELINE, LM_LAYER_KEYS, NEGATIVE, POSITIVE, Context, Recorder, hardware, load_preset, processor, protocol_hash,
)
from memzoo.bench.report import _groups, frame, latest, niah, ppl, section_name, sections
from memzoo.registry import layer_names


def _config(layer: str, seed: int, steps: int) -> dict:
    model = {"layout": "FA" if layer == POSITIVE else "SWA" + (f" | {layer}@1" if layer not in (BASELINE, NEGATIVE, POSITIVE) else ""),
             "memory": {layer: {"size": 8}} if layer not in (BASELINE, NEGATIVE, POSITIVE) else {}, "d_model": 32}
    return {"lm": {"model": model, "train": {"seed": seed, "steps": steps, "lr": 3e-3}}, "niah": {"seed": 1234, "lm": {"steps": steps}}}


def _niah(layer, seed, acc, cpu, steps=3000, t="2026-12-04T00:00:00Z", tps=1000.0, digits=None):
    rows = []
    for length in (96, 1024):
        for n_iter in ((1,) if layer in (POSITIVE, NEGATIVE) else (1, 2)):
            m = {"accuracy": acc, "accuracy_lo": max(0.0, acc - 0.1), "accuracy_hi": min(1.0, acc + 0.1),
                 "digit_accuracy": acc if digits is None else digits, "digit_accuracy_half": 0.02, "answer_nll": 1.0,
                 "n_samples": 48, "tokens_per_s": tps, "peak_rss_gib": 1.0, "inside_training": length == 96,
                 "lm_steps": steps}
            rows.append({"suite": "niah", "preset": "standard", "layer": layer, "seed": seed,
                         "setting": {"length": length, "n_iter": n_iter}, "metrics": m, "config": _config(layer, seed, steps),
                         "config_hash": "h", "hardware": {"cpu": cpu, "cores": 2, "threads": 1}, "git_sha": "a" * 40,
                         "run_id": t + cpu, "time": t, "versions": {}, "wall_s": 1.0})
    return rows


def _controls(cpu, seeds=(0, 1, 2), ok=True, t="2026-12-04T00:00:00Z", steps=3000):
    return [r for s in seeds for r in (_niah(BASELINE, s, 0.0, cpu, steps, t, digits=0.1) + _niah(NEGATIVE, s, 0.0, cpu, steps, t, digits=0.1)
                                       + _niah(POSITIVE, s, 1.0 if ok else 0.5, cpu, steps, t))]


def _table(df, start: str):
    return next(t for title, t in niah.tables(df).items() if title.startswith(start))


def test_niah_rows_of_one_protocol_are_one_section_each_training_seed_once_timings_per_processor():
    early = "2026-12-01T00:00:00Z"
    rows = _controls("AMD EPYC") + _controls("Intel Xeon", seeds=(0, 2), t=early)  # seed 0's and 2's controls on both
    rows += [r for s in (0, 1) for r in _niah("fwl", s, 0.8, "AMD EPYC", tps=500.0)]
    rows += _niah("fwl", 2, 0.7, "Intel Xeon", t=early, tps=900.0)
    groups = [(section_name(n, p, shown, rows), df) for n, p, _, df, shown in _groups(rows, with_rows=True)]
    assert [h for h, _ in groups] == ["niah — preset `standard`"]  # one section, no processor in its name
    df = groups[0][1]
    exact = _table(df, "NIAH exact-match")
    assert exact.loc["fwl", "seeds"] == 3 and exact.loc[BASELINE, "seeds"] == 3  # seeds 0, 2 trained twice count once
    assert "(withheld" not in next(iter(niah.tables(df)))
    speeds = {t: x for t, x in niah.tables(df).items() if t.startswith("NIAH throughput")}
    assert sorted(speeds) == ["NIAH throughput and memory on AMD EPYC (tokens/s: the seeds' mean; peak RSS: their highest)",
                              "NIAH throughput and memory on Intel Xeon (tokens/s: the seeds' mean; peak RSS: their highest)"]
    amd = next(x for t, x in speeds.items() if "AMD" in t).set_index(["layer", "length"])
    intel = next(x for t, x in speeds.items() if "Intel" in t).set_index(["layer", "length"])
    assert amd.loc[("fwl", 96), "tokens/s"] == 500 and intel.loc[("fwl", 96), "tokens/s"] == 900  # never mixed
    assert niah.problems(df) == []


def test_a_processor_whose_niah_controls_fail_has_only_its_rows_withheld():
    rows = _controls("AMD EPYC") + _controls("Intel Xeon", ok=False)
    rows += [r for s in range(3) for r in _niah("fwl", s, 0.8, "AMD EPYC") + _niah("ba", s, 0.9, "Intel Xeon")]
    df = frame(latest(rows, pooled=True))
    title, t = next(iter(niah.tables(df).items()))
    assert "withheld, the controls failing there: the rows measured on Intel Xeon: the positive control" in title
    assert "fwl" in t.index and "ba" not in t.index
    assert niah.problems(df) == []  # the AMD rows stand: the section is valid
    assert all(m == "AMD EPYC" for m in niah.withheld(df)[0]["machine"])


def test_a_presets_lm_protocols_are_sections_of_their_own_each_saying_what_differs(tmp_path, monkeypatch):
    monkeypatch.setattr(niah, "figures", lambda df, out: [])  # these rows have no depth buckets to draw
    old = "2026-11-27T00:00:00Z"
    rows = _controls("Intel Xeon", seeds=(0,), t=old, steps=2000) + _niah("ba", 0, 0.9, "Intel Xeon", steps=2000, t=old)
    rows += _controls("AMD EPYC") + [r for s in range(3) for r in _niah("fwl", s, 0.8, "AMD EPYC")]
    secs = {s.heading: s for s in sections(rows, tmp_path) if s.suite == "niah"}
    assert len(secs) == 2 and all(h.startswith("niah — preset `standard`, protocol ") for h in secs)
    older = next(s for s in secs.values() if "ba" in {r["layer"] for r in s.rows})
    assert {r["hardware"]["cpu"] for r in older.rows} == {"Intel Xeon"} and older.problems == []  # with its own controls
    assert "sets lm.train.steps 2000, niah.lm.steps 2000 (" in older.provenance and ": 3000, 3000)" in older.provenance


def test_a_resumed_run_measures_the_controls_again_on_a_processor_that_has_none_of_its_own(tmp_path):
    rec = Recorder(tmp_path, "standard", 0)
    for layer in (POSITIVE, BASELINE, "fwl"):
        rec.add("niah", layer, {"length": 96}, {"accuracy": 1.0}, {"c": 1}, 1.0)
    again = Recorder(tmp_path, "standard", 0)
    assert all(again.find("niah", layer, {"length": 96}, {"c": 1}) for layer in (POSITIVE, BASELINE, "fwl"))
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    for r in rows:
        r["hardware"] = {**r["hardware"], "cpu": "Another CPU"}
    assert processor(rows[0]["hardware"]) != processor(hardware())
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    elsewhere = Recorder(tmp_path, "standard", 0)
    assert elsewhere.find("niah", "fwl", {"length": 96}, {"c": 1}) is not None  # an accuracy is the protocol's
    assert elsewhere.find("niah", POSITIVE, {"length": 96}, {"c": 1}) is None  # the controls hold here too: run them
    assert elsewhere.find("niah", BASELINE, {"length": 96}, {"c": 1}) is None


@pytest.mark.parametrize("preset", ["standard", "attach"])
def test_what_differs_between_a_presets_lms_is_a_layers_own(preset, tmp_path):
    """LM_LAYER_KEYS names every part of an LM's config that its layer sets: without them, the LMs of the
    baseline, the controls and every layer (and niah's variants) of a preset share one protocol, so that a
    section of a pooled LM suite holds them all."""
    from memzoo.bench.lm import _niah, identity, lm_config

    p = load_preset(preset)
    ctx = Context(p, 0, Recorder(tmp_path, preset, 0), tmp_path / "work", progress=False)
    for suite in ("ppl", "niah"):
        names = [BASELINE, POSITIVE, NEGATIVE, *layer_names()]
        if suite == "niah":
            names += list(_niah(ctx).variants)
        if preset == "attach":
            names = [n for n in names if n in (BASELINE, POSITIVE) or n in p.layers]
        hashes = {n: protocol_hash({"lm": identity(*lm_config(ctx, n, suite)[:2])}, any_seed=True, without=LM_LAYER_KEYS)
                  for n in names}
        assert len(set(hashes.values())) == 1, (suite, hashes)


def test_ppl_lm_training_time_is_a_column_per_processor():
    def row(layer, seed, cpu, wall, mode, corpus="shakespeare"):
        return {"suite": "ppl", "preset": "standard", "layer": layer, "seed": seed, "setting": {"corpus": corpus, "mode": mode},
                "metrics": {"loss": 1.5, "gain": 0.0, "gain_half": 0.01, "params": 1e6, "lm_steps": 1500,
                            "lm_val_loss": 1.5, "lm_train_wall_s": wall},
                "config": {"lm": {"train": {"seed": seed, "steps": 1500}}}, "config_hash": "h",
                "hardware": {"cpu": cpu, "cores": 2, "threads": 1}, "git_sha": "a" * 40, "run_id": cpu,
                "time": "2026-12-04T00:00:00Z" if cpu == "AMD EPYC" else "2026-12-01T00:00:00Z", "versions": {}, "wall_s": 1.0}

    rows = [row(layer, s, cpu, wall, mode) for mode in ("carry", "reset") for layer, s, cpu, wall in
            [(BASELINE, 0, "AMD EPYC", 700.0), (BASELINE, 1, "AMD EPYC", 710.0), (BASELINE, 0, "Intel Xeon", 360.0),
             ("fwl", 0, "Intel Xeon", 600.0)]]
    df = frame(latest(rows, pooled=True))
    lms = next(t for title, t in ppl.tables(df).items() if title.startswith("The LMs"))
    assert lms.loc[BASELINE, "seeds"] == 2  # seed 0 trained on both counts once
    assert lms.loc[BASELINE, "LM train s on AMD EPYC"] == 705.0 and lms.loc[BASELINE, "LM train s on Intel Xeon"] == 360.0
    assert lms.loc["fwl", "LM train s on AMD EPYC"] == "" and "LM train s" not in lms.columns
