"""One table of the built-in layers' CPU sizes (zoo_configs/sizes.yaml, issue 80): the bench presets,
the tiny configs, the toys and the property suite read it, and no other file states a layer's sizes."""

from __future__ import annotations

import yaml

from conftest import LAYER_TESTS, layer_options
from memzoo.bench.common import LayerSpec, load_preset
from memzoo.bench.suites.toys.settings import Settings, _toy_layer_options
from memzoo.config import SIZE_COLUMNS, config_dir, layer_sizes, load_config
from memzoo.layout import parse_layout
from memzoo.registry import builtin_families, layer_names

CPU_PRESETS = ("tiny", "standard", "recall", "recall-state", "capacity", "gpu")


def test_every_built_in_layer_has_its_row():
    rows = yaml.safe_load((config_dir() / "sizes.yaml").read_text())
    assert set(rows) == set(builtin_families()) <= set(layer_names())
    assert all(set(row) <= set(SIZE_COLUMNS) and "at" in row for row in rows.values())


def test_the_cpu_presets_read_the_table_and_state_no_layer_of_their_own():
    at, cpu = layer_sizes("at"), layer_sizes("cpu")
    for name in CPU_PRESETS:
        assert load_preset(name).layers == {n: LayerSpec(at[n], cpu[n]) for n in at}, name
    for path in (config_dir() / "bench").glob("*.yaml"):
        data = yaml.safe_load(path.read_text())
        if path.stem != "paper":  # the paper's sizes are the class defaults; it states its own placement
            assert "layers" not in data, path
        assert "layer_options" not in (data.get("toys") or {}) or path.stem == "paper", path


def test_the_tiny_configs_read_the_table():
    """Each tiny/gdn-<layer>.yaml gives its layer's options as the table's `cpu` column and places it
    where the table's `at` says (FWL's bare name: its class's place, the table's `last`)."""
    at, cpu = layer_sizes("at"), layer_sizes("cpu")
    configs = {p.stem: p for p in (config_dir() / "tiny").glob("*.yaml")
               if "memory" in yaml.safe_load(p.read_text())["model"]}
    assert len(configs) >= 20
    for stem, path in configs.items():
        memory = yaml.safe_load(path.read_text())["model"]["memory"]
        (layer, given), = memory.items()
        assert given == "cpu", path
        model = load_config(f"tiny/{stem}").model
        assert model.memory == {layer: cpu[layer]}, path
        if stem.startswith("gdn-"):
            assert stem == f"gdn-{layer}"
            placed = parse_layout(model.layout, model.n_layers).memories
            assert placed == parse_layout(f"GDN | {layer}@{at[layer]}", model.n_layers).memories, path


def test_the_toys_and_the_property_suite_read_the_table():
    toys = layer_sizes("toys")
    rule = _toy_layer_options()
    for n, options in toys.items():
        assert rule.get(n, {}).items() >= options.items(), n
    assert Settings().layer_options == rule == load_preset("tiny").settings("toys", Settings).layer_options
    # a preset's layer_options extend the rule key by key
    assert Settings(layer_options={"lact": {"num_heads": 4}}).layer_options["lact"] == {**rule["lact"], "num_heads": 4}
    test = layer_sizes("test")
    for n in test:
        assert layer_options(n) == test[n], n
    assert not any("options" in entry for entry in LAYER_TESTS.values())
