"""Configs are checked when they are loaded: every bad value is one ConfigError line naming the
key (and, for YAML syntax, the file and line), before any data is prepared or model built."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from memzoo.bench.common import load_preset, preset_names
from memzoo.cli import _expand
from memzoo.config import ConfigError, ModelConfig, TrainConfig, load_config, resolve_config_path

CONFIGS = Path(__file__).resolve().parents[1] / "zoo_configs"  # this checkout's, whatever is installed

GOOD = """\
model:
  layout: "GDN | FwPKM@1"
  vocab_size: 257
  d_model: 32
  n_layers: 2
  memory: {fwpkm: {key_dim: 16, value_dim: 16, n_subkeys: 8, topk: 2, chunk_size: 16}}
train:
  lr: 1e-3
  min_lr: 1e-4
"""


def _with(section: str, line: str) -> str:
    """GOOD with `line` in `section`, in place of the line of the same key if there is one."""
    lines = [ln for ln in GOOD.splitlines() if ln.split(":")[0] != "  " + line.split(":")[0]]
    i = lines.index(f"{section}:") + 1
    return "\n".join([*lines[:i], f"  {line}", *lines[i:]]) + "\n"


# (id, YAML text, substrings the one-line message must contain)
BAD = [
    ("lr-abc", _with("train", "lr: abc"), ["train.lr", "number > 0", "'abc' (str)"]),
    ("lr-negative", _with("train", "lr: -1"), ["train.lr must be > 0", "-1"]),
    ("min_lr-above-lr", _with("train", "min_lr: 1e-2"), ["train.min_lr must be <= train.lr"]),
    ("d_model-quoted", _with("model", 'd_model: "768"'), ["model.d_model must be an int", "'768' (str)"]),
    ("d_model-float", _with("model", "d_model: 1.5"), ["model.d_model must be an int", "1.5 (float)"]),
    ("n_layers-negative", _with("model", "n_layers: -3"), ["model.n_layers must be >= 1", "-3"]),
    ("n_layers-zero", _with("model", "n_layers: 0"), ["model.n_layers must be >= 1", "got 0"]),
    ("vocab-1", _with("model", "vocab_size: 1"), ["model.vocab_size must be >= 2"]),
    ("batch_size-zero", _with("train", "batch_size: 0"), ["train.batch_size must be >= 1"]),
    ("steps-bool", _with("train", "steps: true"), ["train.steps must be an int", "True (bool)"]),
    ("p_window-1.5", _with("model", "p_window: 1.5"), ["model.p_window must be in (0, 1]", "1.5"]),
    ("norm_eps-nan", _with("model", "norm_eps: .nan"), ["model.norm_eps must be a number > 0"]),
    ("betas-one", _with("train", "betas: [0.9]"), ["train.betas", "each in [0, 1)", "(0.9,)"]),
    ("betas-1.5", _with("train", "betas: [0.9, 1.5]"), ["train.betas", "(0.9, 1.5)"]),
    ("betas-text", _with("train", "betas: fast"), ["train.betas must be a list of numbers", "(str)"]),
    ("grad_clip-negative", _with("train", "grad_clip: -1"), ["train.grad_clip must be >= 0"]),
    ("unknown-key", _with("train", "stpes: 3"), ["train: unknown key 'stpes'", "did you mean 'steps'"]),
    ("unknown-section", GOOD + "optim: {lr: 1}\n", ["unknown section 'optim'", "valid sections: model, train"]),
    ("yaml-tab", GOOD + "\tseed: 1\n", ["bad.yaml:10:1: invalid YAML", "'\\t'"]),
    ("yaml-colon", GOOD.replace("vocab_size: 257", "vocab_size: 257: 3"), ["bad.yaml:3:", "invalid YAML"]),
    ("list-not-mapping", "- model\n- train\n", ["bad.yaml", "expected a mapping", "got list"]),
    ("section-not-mapping", "model: [1, 2]\n", ["model: expected a mapping, got list"]),
    ("memory-unknown-layer", _with("model", "memory: {fwpk: {topk: 2}}"),
     ["model.memory.fwpk: unknown memory layer 'fwpk'", "did you mean 'fwpkm'"]),
    ("memory-unknown-option", _with("model", "memory: {fwpkm: {tpok: 2}}"),
     ["model.memory.fwpkm", "unknown option", "tpok"]),
    ("memory-odd-key_dim", _with("model", "memory: {fwpkm: {key_dim: 3}}"), ["model.memory.fwpkm", "key_dim"]),
    ("memory-topk-above-subkeys", _with("model", "memory: {fwpkm: {topk: 600, n_subkeys: 512}}"),
     ["model.memory.fwpkm", "topk"]),
    ("memory-not-mapping", _with("model", "memory: {fwpkm: 8}"), ["model.memory.fwpkm must be a mapping", "8 (int)"]),
    ("layout-bad", _with("model", 'layout: "GDN+XYZ"'), ["model.layout", "unknown token mixer 'XYZ'"]),
    ("layout-out-of-range", _with("model", 'layout: "GDN | FwPKM@5"'), ["model.layout", "out of range"]),
    ("device-bad", _with("train", "device: gpu"), ["train.device must be a torch device", "'gpu'"]),
    ("tokenizer-bad", _with("train", "tokenizer: ./no/such/tokenizer"), ["train.tokenizer must be 'byte'"]),
    ("corpus-unknown", _with("train", "corpus: shakespear"), ["train.corpus", "did you mean 'shakespeare'"]),
    ("lr-empty", _with("train", "lr:"), ["train.lr must be a number > 0", "None (NoneType)"]),
]


def _assert_one_line(load, path, needles):
    """`load(path)` fails with one ConfigError line that starts with the file and names `needles`."""
    with pytest.raises(ConfigError) as e:
        load(path)
    msg = str(e.value)
    print(msg)
    assert "\n" not in msg and msg.startswith(str(path))
    for n in needles:
        assert n in msg, (n, msg)


@pytest.mark.parametrize("text, needles", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_is_one_line_naming_the_key(tmp_path, text, needles):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    _assert_one_line(load_config, path, needles)


def test_good_config_reads_numbers_in_scientific_notation(tmp_path):
    path = tmp_path / "good.yaml"
    path.write_text(GOOD.replace("{fwpkm:", "{FwPKM:"))  # the paper's spelling of the layer name
    rc = load_config(path)
    assert rc.train.lr == 0.001 and isinstance(rc.train.lr, float)  # YAML 1.1 reads 1e-3 as a string
    assert rc.train.min_lr == 1e-4 and rc.train.betas == (0.9, 0.95)
    assert rc.model.memory["fwpkm"]["topk"] == 2  # under the registered name, where the model looks


def test_every_shipped_config_loads():
    paths = [p for p in sorted(CONFIGS.glob("*/*.yaml")) if p.parent.name != "bench"]
    assert len(paths) >= 20 and {"paper/_base.yaml", "tiny/_base.yaml"} <= {f"{p.parent.name}/{p.name}" for p in paths}
    for p in paths:
        load_config(p)
    for p in sorted(CONFIGS.glob("bench/*.yaml")):
        load_preset(p)


def _preset(tmp_path, **changes) -> str:
    data = yaml.safe_load((CONFIGS / "bench" / "_base.yaml").read_text())  # the full sections
    for key, value in changes.items():
        section, _, name = key.partition("__")
        data.setdefault(section, {})[name] = value
    path = tmp_path / "preset.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("changes, needles", [
    ({"train__lr": "abc"}, ["train.lr must be a number > 0", "'abc' (str)"]),
    ({"model__d_model": "128"}, ["model.d_model must be an int", "'128' (str)"]),
    ({"layers__fwpkm": {"at": "1,3", "options": {"tpok": 2}}}, ["layers.fwpkm: unknown option(s) ['tpok']"]),
    ({"layers__fwpkm": {"at": "9"}}, ["layers.fwpkm.at", "out of range"]),
    ({"layers__nope": {"at": "1"}}, ["layers.nope: unknown memory layer 'nope'"]),
], ids=["train-lr", "model-d_model", "layer-option", "layer-at", "layer-name"])
def test_bad_preset_is_one_line_naming_the_key(tmp_path, changes, needles):
    path = _preset(tmp_path, **changes)
    _assert_one_line(load_preset, path, needles)


def test_malformed_preset_names_file_and_line(tmp_path):
    path = tmp_path / "preset.yaml"
    path.write_text("model:\n  d_model: 128\n\tn_layers: 2\n")
    with pytest.raises(ConfigError, match=r"preset\.yaml:3:1: invalid YAML"):
        load_preset(path)


@pytest.mark.parametrize("old", ["backbone", "lm"])
def test_preset_unknown_section_is_named(tmp_path, old):
    data = yaml.safe_load((CONFIGS / "bench" / "_base.yaml").read_text())  # the full sections
    data[old] = data.pop({"backbone": "model", "lm": "train"}[old])
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=f"^{path}: unknown section {old!r}.*valid sections: model, layers, train"):
        load_preset(path)


# ---- `base:` --------------------------------------------------------------------------------

BASE = """\
model:
  layout: "GDN | FwPKM@1"
  vocab_size: 257
  d_model: 32
  n_layers: 2
  memory: {fwpkm: {key_dim: 16, value_dim: 16, n_subkeys: 8, topk: 2, chunk_size: 16}}
train: {lr: 1e-3, min_lr: 1e-4, steps: 7, seed: 3}
"""


def _files(tmp_path, **files) -> Path:
    for name, text in files.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    return tmp_path / f"{list(files)[-1]}.yaml"


def test_base_is_merged_section_by_section(tmp_path):
    child = _files(tmp_path, _base=BASE, run="""\
base: _base
model: {layout: "GDN | FwPKM@1", memory: {fwpkm: {topk: 4}}}
train: {steps: 9}
paper: {params_m: 1.5}
""")
    rc = load_config(child)
    assert rc.model.layout == "GDN | FwPKM@1" and (rc.model.d_model, rc.model.n_layers) == (32, 2)
    assert rc.model.memory == {"fwpkm": {"key_dim": 16, "value_dim": 16, "n_subkeys": 8, "topk": 4, "chunk_size": 16}}
    assert (rc.train.steps, rc.train.seed, rc.train.lr) == (9, 3, 1e-3) and rc.paper == {"params_m": 1.5}
    flat = BASE.replace("topk: 2", "topk: 4").replace("steps: 7", "steps: 9")  # the same, written out
    assert load_config(_files(tmp_path, flat=flat)).to_dict() == rc.to_dict()
    # a base may have a base; the nearest wins; a bare section changes nothing
    grand = _files(tmp_path, more="base: run.yaml\nmodel:\ntrain: {seed: 5}\n")
    rc2 = load_config(grand)
    assert (rc2.train.seed, rc2.train.steps, rc2.model.memory["fwpkm"]["topk"]) == (5, 9, 4)


@pytest.mark.parametrize("files, needles", [
    ({"_base": BASE.replace("seed: 3", "sed: 3"), "run": "base: _base\n"},
     ["run.yaml (with base ", "_base.yaml): train: unknown key 'sed'", "did you mean 'seed'"]),
    ({"run": "base: _base\nmodel: {d_modle: 8}\n"}, ["run.yaml: base '_base': no such file", "_base.yaml"]),
    ({"_base": BASE, "run": "base: _base\nmodel: {d_modle: 8}\n"}, ["model: unknown key 'd_modle'"]),
    ({"a": "base: b\n", "b": "base: a\n", "run": "base: a\n"}, ["base cycle: run.yaml -> a.yaml -> b.yaml -> a.yaml"]),
    ({"run": "base: run\n"}, ["run.yaml: base cycle: run.yaml -> run.yaml"]),
    ({"_base": "model: [1]\n", "run": "base: _base\n"}, ["_base.yaml: model: expected a mapping, got list"]),
    ({"_base": "optim: {}\n", "run": "base: _base\n"}, ["_base.yaml: unknown section 'optim'"]),
    ({"run": "base: [a]\n"}, ["base must be the name of a YAML file", "['a']"]),
    ({"_base": BASE, "run": 'base: _base\nmodel: {layout: "GDN | FwPKM@1", memory: {FwPKM: {topk: 4}}}\n'},
     ["model.memory names layer 'fwpkm' twice (as 'FwPKM' too)"]),
], ids=["unknown-key-in-base", "missing-base", "unknown-key-in-child", "cycle", "self", "base-section-list",
        "base-unknown-section", "base-not-a-name", "memory-twice"])
def test_bad_base_is_one_line(tmp_path, files, needles):
    path = _files(tmp_path, **files)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    print(msg)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)


def test_preset_may_have_a_base(tmp_path):
    mc = {"layout": "GDN", "vocab_size": 257, "d_model": 32, "n_layers": 2, "ffn_dim": 64}
    _files(tmp_path, _base=yaml.safe_dump({"model": mc, "train": {"steps": 3}}))
    p = load_preset(_files(tmp_path, micro="base: _base\nlayers: {linear: {at: '1'}}\ntrain: {seed: 1}\n"))
    assert p.backbone == mc and p.lm == {"steps": 3, "seed": 1} and list(p.layers) == ["linear"]


def test_a_preset_anywhere_may_build_on_a_shipped_one(tmp_path):
    """A user's preset outside the project says `base: recall` and gets the shipped preset (and
    its own bases), with its changes over them; a file beside it of the same name comes first."""
    from memzoo.bench.suites import toys

    user = tmp_path / "mine"
    user.mkdir()
    (user / "few.yaml").write_text("base: recall\ntoys: {seeds: 1}\n")
    p, shipped = load_preset(str(user / "few.yaml")), load_preset("recall")
    assert p.settings("toys", toys.Settings) == dataclasses.replace(shipped.settings("toys", toys.Settings), seeds=1)
    assert p.backbone == shipped.backbone and p.lm == shipped.lm
    (user / "recall.yaml").write_text("base: tiny\ntoys: {seeds: 5}\n")  # beside it: its own recall
    assert load_preset(str(user / "few.yaml")).settings("toys", toys.Settings).widths == [64]
    (user / "bad.yaml").write_text("base: recal\n")
    with pytest.raises(ConfigError, match="base 'recal': no such file .* among the shipped ones"):
        load_preset(str(user / "bad.yaml"))


def test_every_shipped_preset_says_what_it_is_for():
    from memzoo.bench.common import preset_summaries
    from memzoo.bench.cli import main

    assert set(preset_summaries()) == set(preset_names()) and all(preset_summaries().values())
    with pytest.raises(SystemExit):
        main(["bench", "--help"])


def test_bases_are_not_listed(tmp_path):
    _files(tmp_path, _base=BASE, a="base: _base\n")
    assert _expand([str(tmp_path)]) == [str(tmp_path / "a.yaml")]
    paper = _expand(["paper"])
    assert len(paper) == 17 and not any(Path(p).name.startswith("_") for p in paper)
    with pytest.raises(ConfigError) as e:
        resolve_config_path("paper/nope")
    assert "paper/gdn" in str(e.value) and "_base" not in str(e.value)
    assert preset_names() == ["attach", "capacity", "gpu", "paper", "recall", "recall-10x", "recall-10x-seeds", "recall-gpu",
                              "recall-state", "recall-state-10x", "standard",
                              "tiny"]


def test_shipped_configs_state_only_what_differs_from_their_base():
    """Every Table 2 row is the paper base (Table 3: ModelConfig's defaults, the paper's recipe)
    with its own layout; every tiny config trains with the tiny recipe into its own out_dir."""
    recipe = TrainConfig(corpus="hf:HuggingFaceFW/fineweb-edu:sample-10BT", tokenizer="mistral", seq_len=4096,
                         batch_size=8, grad_accum=16, steps=20000, lr=1e-3, min_lr=1e-4, warmup=100).to_dict()
    rows = [p for p in sorted((CONFIGS / "paper").glob("[!_]*.yaml")) if p.stem != "lact"]
    assert len(rows) == 16
    for p in rows:
        rc = load_config(p)
        assert rc.model.to_dict() == ModelConfig(layout=rc.model.layout).to_dict(), p.name
        assert rc.train.to_dict() == recipe and set(rc.paper) == {"params_m", "flops_t", "flops_per_s_t", "samples_per_s"}
        assert len(p.read_text().split("\nbase: _base\n")[1].splitlines()) == 2, p.name  # model: and paper: lines
    lact = load_config("paper/lact")
    assert lact.train.to_dict() == recipe and lact.model.window == 2048 and lact.model.memory["lact"]["chunk_size"] == 512
    tiny = [p for p in sorted((CONFIGS / "tiny").glob("[!_]*.yaml"))]
    assert len(tiny) >= 9
    for p in tiny:
        rc = load_config(p)
        assert rc.train.to_dict() == TrainConfig(lr=3e-3, min_lr=3e-4, out_dir=f"runs/tiny-{p.stem}").to_dict(), p.name
        assert (rc.model.vocab_size, rc.model.d_model, rc.model.n_layers, rc.model.ffn_dim) == (257, 128, 4, 384)


@pytest.mark.parametrize("layout,placed", [("GDN", "it has no memory layer"), ("GDN | linear@1", "its memory layers: linear")])
def test_options_for_a_layer_the_layout_does_not_place_are_one_error(layout, placed):
    # they were silently ignored: a config that meant to set FwPKM's options trained without them
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict({"layout": layout, "d_model": 32, "n_layers": 2, "memory": {"fwpkm": {"topk": 4}}})
    msg = str(e.value)
    assert "\n" not in msg and "model.memory.fwpkm" in msg and repr(layout) in msg and placed in msg


def test_an_odd_attention_head_size_is_one_error_where_attention_is_used():
    # it failed at the first forward, inside RoPE ("size of tensor a (5) must match ... (6)"): a toy width of
    # 64 over the default 12 attention heads
    with pytest.raises(ConfigError, match=r"model.attn_head_dim: 5 is odd; the attention's rotary embedding"):
        ModelConfig.from_dict({"layout": "SWA", "d_model": 64, "n_layers": 2, "attn_head_dim": 5})
    ModelConfig.from_dict({"layout": "GDN", "d_model": 64, "n_layers": 2, "attn_head_dim": 5})  # no attention: no matter


def test_a_flag_of_the_wrong_type_is_one_error():
    # hypothesis found it: `compile: null` raised KeyError(<class 'bool'>) from the error message itself
    with pytest.raises(ConfigError, match=r"train.compile must be true or false, got None"):
        TrainConfig.from_dict({"compile": None})
