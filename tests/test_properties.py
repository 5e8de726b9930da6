"""Property-based tests (hypothesis): whatever a user writes, the layout parser and the config
loader answer with a result or one ConfigError / LayoutError line, never another exception; the
lm-eval entry point answers a wrong path or task with one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memzoo.layout import LayoutError, parse_layout
from memzoo.config import ConfigError, ModelConfig, TrainConfig, load_config
from memzoo.registry import layer_names

# no subnormal floats: training tests in the same process flush them to zero (memzoo.cpu.tune_cpu),
# and hypothesis refuses to draw them then

# layout-like text: mixer and layer names, their pieces, the notation's punctuation, and noise
WORDS = ["GDN", "SWA", "FA", "FA-pSWA", "NONE", "fwpkm", "FwPKM", "pkm", "linear", "lact", "mom", "fwl", "ba",
         "nope", "all", "last", "@", "|", "+", ",", " ", "0", "1", "2", "6", "10", "99", "-1", "@@", "||", "é", "\n"]
layouts = st.one_of(st.lists(st.sampled_from(WORDS), max_size=12).map("".join), st.text(max_size=30))


@settings(max_examples=300, deadline=None)
@given(layouts, st.integers(min_value=-2, max_value=16))
def test_the_layout_parser_answers_any_text_with_a_layout_or_a_layout_error(text, n_layers):
    try:
        layout = parse_layout(text, n_layers)
    except LayoutError as e:
        assert "\n" not in str(e).strip() or "\n" in text  # one line (unless the text itself has one)
        return
    assert len(layout.mixers) == max(n_layers, 0)


FIELDS = [f for f in ModelConfig.__dataclass_fields__] + [f for f in TrainConfig.__dataclass_fields__] + ["nope", "d_modle"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False),
                    st.text(max_size=12), st.sampled_from(["1e-3", "GDN | fwpkm@1", "auto", "cuda", "bf16", "byte"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.sampled_from(FIELDS + WORDS), inner, max_size=3)),
                      max_leaves=6)
sections = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6)
documents = st.one_of(st.fixed_dictionaries({}, optional={"model": sections, "train": sections, "paper": values,
                                                          "base": values, "extra": values}), values)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(documents)
def test_the_config_loader_answers_any_yaml_with_a_config_or_a_config_error(tmp_path, doc):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    try:
        load_config(path)
    except ConfigError as e:
        assert str(e).strip()


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=200))
def test_the_config_loader_answers_any_text_with_a_config_or_a_config_error(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    try:
        load_config(path)
    except ConfigError as e:
        assert str(e).strip()


@pytest.mark.parametrize("args,needle", [
    (["--model_args", "pretrained=/no/such/run", "--tasks", "wikitext"], "/no/such/run is not a memzoo run"),
    (["--model_args", "pretrained=/no/such/run", "--tasks", "no_such_task_xyz"], "no_such_task_xyz"),
])
def test_the_harness_entry_point_answers_a_wrong_path_or_task_with_one_line(args, needle):
    r = subprocess.run([sys.executable, "-m", "memzoo.harness", "--model", "memzoo", *args], capture_output=True,
                       text=True, timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "Warning" not in ln and not ln.startswith(" ")]
    assert r.returncode == 2 and lines[-1].startswith("memzoo.harness: error: ") and needle in lines[-1], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def _options_of(name: str) -> list[str]:
    import inspect

    from memzoo.registry import get_layer

    return [p for p in inspect.signature(get_layer(name).__init__).parameters if p not in ("self", "d_model")]


LAYERS = layer_names()  # every registered layer
option_values = st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.floats(-2, 2, allow_subnormal=False), st.just(float("nan")),
                          st.text(max_size=6), st.lists(st.integers(0, 4), max_size=2))


@st.composite
def memory_configs(draw):
    name = draw(st.sampled_from(LAYERS))
    opts = draw(st.dictionaries(st.sampled_from(_options_of(name) + ["nope"]), option_values, max_size=3))
    return {"model": {"layout": f"GDN | {name}@1", "d_model": draw(st.sampled_from([16, 32, 48])), "n_layers": 2,
                      "gdn_heads": 2, "gdn_head_dim": 8, "memory": {name: opts}}}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(memory_configs())
def test_any_memory_layer_options_give_a_config_or_a_config_error(tmp_path, doc):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    try:
        load_config(path)
    except ConfigError as e:
        assert "\n" not in str(e).strip()
