"""The state sweep (zoo_configs/bench/recall-state.yaml): sizes as variants, lrs around a published
choice, the recall preset's cells reused, and its report: tables pooled across processors with the
controls checked on each, the state table, the figure above the overview and the overview's recall
column from this one preset."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

import memzoo.layers  # noqa: F401  (registers the layers)
from memzoo.bench.common import BASELINE, CONTROLS, NEGATIVE, POSITIVE, Recorder, load_preset
from memzoo.bench.report import toys as toys_report
from memzoo.bench.suites import toys
from memzoo.bench.suites.toys import lr as toys_lr
from memzoo.config import ConfigError
from memzoo.registry import layer_names


def test_sizes_are_variants_of_their_model_with_the_sizes_options_over_its_own():
    s = toys.Settings(variants={"fwpkm/token": {"layer": "fwpkm", "at": "0", "options": {"before_mixer": True}}},
                      sizes={"deltanet": {"hd8": {"options": {"head_dim": 8}}},
                             "fwpkm/token": {"s8": {"options": {"n_subkeys": 8}}},
                             "fwl": {"w16": {"widths": [16], "options": {"expansion": 1}}}})
    assert s.variants["deltanet/hd8"] == {"layer": "deltanet", "options": {"head_dim": 8}}
    assert s.variants["fwpkm/token/s8"] == {"layer": "fwpkm", "at": "0", "options": {"before_mixer": True, "n_subkeys": 8}}
    assert s.widths_of("fwl/w16") == [16] and s.widths_of("deltanet/hd8") == [64]
    assert s.size_of("fwpkm/token/s8") == ("fwpkm/token", "s8") and s.size_of("fwpkm/token") is None
    assert toys.models_of("deltanet", s) == ["deltanet", "deltanet/hd8"]
    s.check()
    with pytest.raises(ConfigError, match="toys.sizes.deltanett: a registered layer or a variant"):
        toys.Settings(sizes={"deltanett": {"hd8": {"options": {}}}})
    with pytest.raises(ConfigError, match=r"toys.sizes.deltanet.hd8 must be \{options: ..., widths: ...\}"):
        toys.Settings(sizes={"deltanet": {"hd8": {"head_dim": 8}}})


def _published(tmp_path, monkeypatch, rows):
    (tmp_path / "leaderboards").mkdir()
    (tmp_path / "leaderboards" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    toys_lr.published_choice.cache_clear()


def _choice_row(layer, seed, lr, acc=0.9, preset="recall", t="2026-12-01T00:00:00Z", chosen=True):
    return {"suite": "toys", "preset": preset, "layer": layer, "seed": seed, "setting": {"task": "mqar", "d_model": 64},
            "metrics": {"lr": lr, "accuracy": acc, "chance": 0.03, "lr_chosen": chosen, "stop": "capped"},
            "config": {}, "config_hash": "h", "run_id": t, "time": t}


def test_a_sizes_lrs_centre_on_the_lr_its_models_published_rows_chose(tmp_path, monkeypatch):
    """The median over seeds of the latest row of each that chose an lr (left chance): a row at
    chance chose none, a later row of a seed replaces its earlier one."""
    _published(tmp_path, monkeypatch, [
        _choice_row("deltanet", 0, 1e-2), _choice_row("deltanet", 0, 1e-3, t="2026-12-02T00:00:00Z"),
        _choice_row("deltanet", 1, 3e-3), _choice_row("deltanet", 2, 1e-3),
        _choice_row("linear", 0, 3e-2, acc=0.03, chosen=False), _choice_row("deltanet", 0, 0.3, preset="other")])
    assert toys_lr.published_choice("recall", "deltanet") == 1e-3
    assert toys_lr.published_choice("recall", "linear") is None
    assert toys_lr.around(1e-3) == [pytest.approx(3.33333e-4), 1e-3, 3e-3]
    s = toys.Settings(lrs=[1e-3, 3e-3], lrs_around="recall", sizes={"deltanet": {"hd8": {"options": {"head_dim": 8}}},
                                                                    "linear": {"hd4": {"options": {"head_dim": 4}}}})
    assert s.candidates("deltanet/hd8") == toys_lr.around(1e-3)
    assert "around recall's 0.001 (deltanet)" in s.origin("deltanet/hd8")
    assert s.candidates("linear/hd4") == [1e-3, 3e-3] and s.candidates("deltanet") == [1e-3, 3e-3]  # no choice; the top
    # a long-budget check takes the one lr the first preset of `lr_of` chose
    s = toys.Settings(lr_of=["recall-state", "recall"], sizes={"deltanet": {"hd8": {"options": {"head_dim": 8}}}})
    assert s.candidates("deltanet") == [1e-3] and s.origin("deltanet") == "the lr recall's rows chose (0.001)"


def test_a_cell_recorded_under_a_reused_preset_counts_as_recorded(tmp_path):
    rec = Recorder(tmp_path, "recall", 0)
    rec.add("toys", "deltanet", {"task": "mqar"}, {"accuracy": 0.9}, {"c": 1}, 1.0)
    other = Recorder(tmp_path, "recall-state", 0)
    assert other.find("toys", "deltanet", {"task": "mqar"}, {"c": 1}) is None
    assert other.find("toys", "deltanet", {"task": "mqar"}, {"c": 1}, preset="recall")["metrics"] == {"accuracy": 0.9}
    assert other.find("toys", "deltanet", {"task": "mqar"}, {"c": 2}, preset="recall") is None  # another config


def test_a_sections_borrowed_presets_are_the_presets_it_reuses():
    """The report reads rows alone, so it names the presets a section shows cells of (`BORROWS`); they are
    each shipped preset's `toys.reuse`, whose cells its resumed runs skip."""
    from memzoo.bench.common import preset_names

    reuse = {name: tuple(s.reuse) for name in preset_names()
             if (s := load_preset(name).settings("toys", toys.Settings)).reuse}
    assert reuse == toys_report.BORROWS


def test_the_sweep_sizes_every_memory_at_three_states_over_16x():
    """recall-state.yaml: every built-in layer with a per-sequence state (all but PKM, whose memory is
    slow weights) at its recall size and two smaller ones, spanning >= 16x in state numbers."""
    p = load_preset("recall-state")
    s = p.settings("toys", toys.Settings)
    s.check()
    builtin = [n for n in layer_names() if n != "pkm"]
    assert set(builtin) | {"fwpkm/token", "fwmlp/token"} <= set(s.sizes)
    for model in ("deltanet", "fwl", "fwpkm/token"):
        task = toys.TASK_TYPES["mqar"]
        states = []
        for name in [model, *(f"{model}/{z}" for z in s.sizes[model])]:
            w = s.widths_of(name)[0]
            mc = toys.toy_config(p, name, w, task.vocab_of(s), s)
            states.append(toys.state_numbers(mc, s.mqar_seq_len))
        assert len(states) >= 3 and max(states) / min(states) >= 16, (model, states)
    assert s.reuse == ["recall"] and s.lrs_around == "recall"


# ---- the report ---------------------------------------------------------------------------------------


def _row(layer, seed, acc, cpu="AMD EPYC", preset="recall-state", mem=100, stop="solved", h=None, t="2026-12-04T00:00:00Z",
         version=3):
    m = {"acc_by_kv": {"4": acc, "12": acc}, "accuracy": acc, "steps": 100, "stop": stop, "lr": 1e-3, "chance": 0.03,
         "state_size": mem + 64, "gdn_state": 0, "kv_cache": 64, "mem_state": mem, "state_shared": False, "params": 10,
         "tokens_per_s": 1, "sequences": 64000, "left_chance_at": 3200 if acc > 0.06 else None,
         "history": [{"sequences": 3200, "val": acc}]}
    return {"suite": "toys", "preset": preset, "layer": layer, "seed": seed, "setting": {"task": "mqar", "d_model": 64,
            "route": "memory"}, "metrics": m, "config": {"version": version, "train": {"max_steps": 2000, "batch_size": 32}, "cell": h or layer},
            "config_hash": h or layer, "hardware": {"cpu": cpu, "cores": 2, "threads": 1}, "git_sha": "a" * 40, "run_id": t + cpu, "time": t, "versions": {"torch": "2.13.0"},
            "wall_s": 1.0}


def _controls(cpu, preset="recall", ok=True):
    return [r for s in range(3) for r in (_row(BASELINE, s, 0.03, cpu, preset, mem=0, stop="chance"),
                                           _row(POSITIVE, s, 0.999 if ok else 0.5, cpu, preset, mem=0),
                                           _row(NEGATIVE, s, 0.03, cpu, preset, mem=0, stop="chance"))]


def _sweep(cpu="AMD EPYC"):
    rows = _controls("Intel Xeon") + _controls("AMD EPYC")
    rows += [_row("deltanet", s, 0.995, "Intel Xeon", "recall", mem=2432) for s in range(3)]
    rows += [_row("deltanet/hd8", s, 0.6, cpu, mem=224, stop="capped") for s in range(3)]
    rows += [_row("deltanet/hd4", s, 0.15, cpu, mem=80, stop="capped") for s in range(3)]
    rows += [_row("linear", s, 0.15, "Intel Xeon", "recall", mem=1088, stop="plateau") for s in range(3)]
    rows += [_row("linear/h1hd4", s, 0.05, cpu, mem=20, stop="plateau") for s in range(3)]
    return rows


def test_accuracy_rows_of_one_config_pool_across_processors_each_named():
    from memzoo.bench.report import _groups, latest, section_name

    rows = _sweep()
    heads = {section_name(n, p, shown, rows): sorted(set(df["layer"])) for n, p, _, df, shown in _groups(rows, with_rows=True)}
    assert "toys — preset `recall`" in heads and "toys — preset `recall-state`" in heads  # no processor in the name
    state = heads["toys — preset `recall-state`"]
    assert {"deltanet", "deltanet/hd8", "linear/h1hd4", POSITIVE} <= set(state)  # the reused preset's rows shown too
    pooled = latest(_controls("Intel Xeon") + _controls("AMD EPYC"), pooled=True)
    assert len([r for r in pooled if r["layer"] == POSITIVE]) == 6  # three seeds on each processor
    from memzoo.bench.report import frame

    table = next(t for title, t in toys_report.tables(frame(latest(rows, pooled=True))).items()
                 if title.startswith("MQAR test accuracy"))
    assert table.set_index("layer").loc[POSITIVE, "seeds"] == 3  # a seed trained on both processors counts once
    old = dict(_row(POSITIVE, 0, 0.2, "Intel Xeon", "recall", h="older", t="2026-11-01T00:00:00Z"))
    again = latest([old, *_controls("AMD EPYC")], pooled=True)
    assert [r["hardware"]["cpu"] for r in again if r["layer"] == POSITIVE] == ["AMD EPYC"] * 3  # another config: retired


def test_a_processor_whose_controls_fail_has_only_its_rows_withheld():
    rows = [r for r in _sweep() if r["hardware"]["cpu"] != "AMD EPYC" or r["layer"] not in CONTROLS]
    rows += _controls("AMD EPYC", ok=False)
    from memzoo.bench.report import frame, latest

    df = frame(latest(rows, pooled=True))
    kept, gone = toys_report.withheld(df)
    assert "AMD EPYC" not in set(kept["machine"]) and list(gone) == ["mqar"] and gone["mqar"][0].startswith("AMD EPYC: ")
    title = next(t for t in toys_report.tables(df) if t.startswith("MQAR test accuracy"))
    assert "withheld, the controls failing there: the rows measured on AMD EPYC" in title
    assert toys_report.problems(df) == []  # the Intel rows stand: the section is valid
    assert toys_report.withheld(frame(latest(_sweep(), pooled=True)))[1] == {}


def test_the_state_table_reads_each_models_curve_budget_honestly(tmp_path):
    from memzoo.bench.report import frame, latest

    df = frame(latest(_sweep(), pooled=True))
    assert toys_report.model_of(df)["deltanet/hd8"] == "deltanet" and toys_report.model_of(df)["deltanet"] == "deltanet"
    t = toys_report.tables(df)[toys_report.STATE_TITLE].set_index("layer")
    assert t.loc["deltanet", "smallest state at 0.9"] == "2.43k"
    assert t.loc["deltanet", "sizes (memory state: mean, stops)"] == ("80: 0.150 (3 capped through 64k); 224: 0.600 "
                                                                       "(3 capped through 64k); 2.43k: 0.995")
    assert t.loc["linear", "smallest state at 0.9"] == "not reached at <= 1.09k (through 64k sequences)"
    frac = (math.log(1024) - math.log(224)) / (math.log(2432) - math.log(224))  # log-linear between the sizes around 1k
    assert t.loc["deltanet", "accuracy at 1.02k state"] == f"{0.6 + (0.995 - 0.6) * frac:.3f}"
    assert t.loc["linear", "span"] == "54x" and "deltanet/hd8" not in t.index
    assert t.loc["deltanet", "span"] == "30x" and t.loc["deltanet", "family"] == "delta rule"
    paths = toys_report.figures(df, tmp_path)
    assert paths[0].name == "toys_mqar_state.png"


def test_the_overview_recall_column_comes_from_the_state_sweep_alone_with_its_figure_above(tmp_path):
    from memzoo.bench.report import render

    rows = _sweep() + [_row("ba", s, 0.99, "Intel Xeon", "recall-10x", mem=4160) for s in range(3)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    render(tmp_path / "results.jsonl")
    text = (tmp_path / "README.md").read_text()
    overview = text.split("## Overview", 1)[1].split('<a id="', 1)[0]
    assert overview.lstrip().startswith("![toys_mqar_state](figures/recall-state/toys_mqar_state.png)")
    lines = {line.split(" | ")[0].strip("| "): line for line in overview.splitlines() if line.startswith("| ")}
    assert "(recall-state)" in lines["deltanet"] and "2.43k" in lines["deltanet"]
    assert "deltanet/hd8" not in lines  # a size is a point of its model, not a row of its own
    assert "ba" not in lines  # measured by another preset only: no recall cell
    page = (tmp_path / "site" / "index.html").read_text()
    head = page.split('<section id="overview">', 1)[1].split("</section>", 1)[0]
    assert '<img class="lead-figure" alt="toys_mqar_state" src="../figures/recall-state/toys_mqar_state.png">' in head
