"""The overview's headlines: each suite declares its columns as data (`HEADLINES`: which table, which
column, which section ranks first and why), and the overview picks each layer's cell by that rank."""

from __future__ import annotations

import pandas as pd
import pytest

from memzoo.bench.common import published_rows, read_results
from memzoo.bench.report import Section, _groups, keyed, module
from memzoo.bench.report.overview import COLUMN_ORDER, RANK, overview
from memzoo.bench.suites import NAMES


def _section(suite, preset, tables, rows):
    return Section(suite=suite, preset=preset, heading=f"{suite} {preset}", lead="", provenance="", tables=tables,
                   note="", reading=[], figures=[], problems=[], rows=rows, anchor=f"{suite}-{preset}")


def _with_headline(sec):
    from memzoo.bench.report.overview import headline

    sec.headline = headline(sec, module(sec.suite).HEADLINES)
    return sec


def _rows(n_seeds, time, machine="AMD EPYC 7B13"):
    return [{"seed": s, "time": time, "hardware": {"cpu": machine}, "setting": {}, "metrics": {}} for s in range(n_seeds)]


@pytest.mark.parametrize("suite", [n for n in NAMES if hasattr(module(n), "HEADLINES")])
def test_every_headline_is_data_that_names_a_table_its_suite_tags_a_column_and_a_reason(suite):
    for h in module(suite).HEADLINES:
        assert h.column in COLUMN_ORDER and set(h.rank) <= set(RANK) and h.why and h.table and h.value


@pytest.mark.parametrize("suite", [n for n in NAMES if hasattr(module(n), "HEADLINES")])
def test_the_published_rows_give_each_headline_its_table(suite):
    """Every headline's table key is one its suite's `tables` tags, in some published section (not a title)."""
    keys = set()
    for name, preset, mod, df, shown in _groups(read_results(published_rows()), with_rows=True):
        if name == suite:
            keys |= {t.attrs.get("table") for t in mod.tables(df).values()}
    assert {h.table for h in module(suite).HEADLINES} <= keys


def test_cost_takes_the_section_that_timed_the_most_layers_and_leaves_a_noisy_timing_out():
    def sec(preset, ratios, time):
        t = keyed("layers", pd.DataFrame({"× baseline's tokens/s": ratios, "params (M)": [1.0] * len(ratios)},
                                         index=["baseline", "mom", "lact"][:len(ratios)]))
        return _with_headline(_section("cost", preset, {"Cost per layer": t}, _rows(1, time)))

    many, few = sec("tiny", [1.0, 0.5, float("nan")], "2026-01-01"), sec("standard", [1.0, 0.9], "2026-02-01")
    cells = many.headline["cost: training tokens/s × baseline's"]
    assert "lact" not in cells and cells["mom"][1].startswith("0.50× · 1.00 M params (tiny, AMD EPYC 7B13")
    col = "cost: training tokens/s × baseline's"
    ov = overview([few, many])  # 2 ratios each (lact's is noisy): the later section
    assert ov.table.set_index("layer").loc["mom", col].startswith("0.90×") and ov.links[("mom", col)] == "cost-standard"
    ov = overview([few, sec("tiny", [1.0, 0.5, 0.7], "2026-01-01")])  # 3 ratios against 2: the older section
    assert ov.table.set_index("layer").loc["mom", col].startswith("0.50×") and ov.links[("mom", col)] == "cost-tiny"


def test_niah_takes_the_section_with_the_most_seeds_before_a_published_preset():
    def sec(preset, seeds):
        t = keyed("exact", pd.DataFrame({"seeds": [seeds], "4096 x1": ["50.0 [40, 60] ▲"], "4096 x2": ["70.0"]},
                                        index=["mom"]))
        return _with_headline(_section("niah", preset, {"NIAH exact-match": t}, _rows(seeds, "2026-01-01")))

    ov = overview([sec("standard", 1), sec("tiny", 3)])
    assert ov.table.set_index("layer").loc["mom", "NIAH: exact match % by length"] == "4096: 50.0 ▲ (tiny)"


def test_ppl_takes_the_most_seeds_then_a_published_preset_for_both_of_its_columns():
    def sec(preset, seeds, gain):
        loss = keyed("loss", pd.DataFrame({"seeds": [seeds], "shakespeare gain": [gain]}, index=["mom"]))
        probe = keyed("probe", pd.DataFrame({"seeds": [seeds], "gain": [gain]}, index=["mom"]))
        return _with_headline(_section("ppl", preset, {"Loss": loss, "Repeated-passage probe": probe},
                                       _rows(seeds, "2026-01-01")))

    row = overview([sec("tiny", 3, "0.1"), sec("standard", 3, "0.2"), sec("standard", 1, "0.3")]).table.set_index("layer").loc["mom"]
    assert row["PPL: carried-state gain (nats)"] == "0.2 (shakespeare, standard)"
    assert row["PPL: re-reading gain (nats)"] == "0.2 (standard)"


def test_pairs_gives_each_layer_its_bench_size_held_per_1k_state():
    rows = [{"layer": "deltanet", "seed": 0, "time": "t", "setting": {"top": True, "condition": "random", "gates": "neutral"},
             "metrics": {"held_per_1k_state": 6.58, "held_mean": 16.0, "mem_state": 2432}},
            {"layer": "deltanet", "seed": 0, "time": "t", "setting": {"top": False, "condition": "random", "gates": "neutral"},
             "metrics": {"held_per_1k_state": 9.0, "held_mean": 2.0, "mem_state": 224}}]
    t = keyed("random-neutral", pd.DataFrame({"layer": ["deltanet", "deltanet"], "per 1k state": ["6.58", "9.00"]}))
    sec = _with_headline(_section("pairs", "pairs", {"Pairs held": t}, rows))
    (col,) = sec.headline
    assert sec.headline[col] == {"deltanet": (("t",), "6.58 (16.0 of 2,432 numbers)")}


def test_toys_behind_a_gdn_take_the_standard_section_with_the_most_seeds_at_each_layers_widest_model():
    def sec(preset, seeds, means, time="2026-01-01"):
        mqar = keyed("mqar", pd.DataFrame({"layer": ["mom", "mom"], "d_model": [256, 128], "mean": means}))
        return _with_headline(_section("toys", preset, {"MQAR": mqar}, _rows(seeds, time)))

    col = "toys behind a GDN: MQAR accuracy"
    ov = overview([sec("standard", 3, ["0.9", "0.5"]), sec("standard", 1, ["0.1", "0.2"], "2026-02-01"),
                   sec("tiny", 3, ["0.3", "0.4"])])
    assert ov.table.set_index("layer").loc["mom", col] == "0.9" and ov.links[("mom", col)] == "toys-standard"
    assert "toys behind a GDN: Ba's AR accuracy" not in ov.table  # no AR table, no column
