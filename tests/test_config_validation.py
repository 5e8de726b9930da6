"""Configs are checked when they are loaded: every bad value is one ConfigError line naming the
key (and, for YAML syntax, the file and line), before any data is prepared or model built."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from memzoo.bench.common import load_preset
from memzoo.config import ConfigError, load_config

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


@pytest.mark.parametrize("text, needles", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_is_one_line_naming_the_key(tmp_path, text, needles):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    print(msg)
    assert "\n" not in msg and msg.startswith(str(path))
    for n in needles:
        assert n in msg, (n, msg)


def test_good_config_reads_numbers_in_scientific_notation(tmp_path):
    path = tmp_path / "good.yaml"
    path.write_text(GOOD.replace("{fwpkm:", "{FwPKM:"))  # the paper's spelling of the layer name
    rc = load_config(path)
    assert rc.train.lr == 0.001 and isinstance(rc.train.lr, float)  # YAML 1.1 reads 1e-3 as a string
    assert rc.train.min_lr == 1e-4 and rc.train.betas == (0.9, 0.95)
    assert rc.model.memory["fwpkm"]["topk"] == 2  # under the registered name, where the model looks


def test_every_shipped_config_loads():
    paths = [p for p in sorted(CONFIGS.glob("*/*.yaml")) if p.parent.name != "bench"]
    assert len(paths) >= 20
    for p in paths:
        load_config(p)
    for p in sorted(CONFIGS.glob("bench/*.yaml")):
        load_preset(p)


def _preset(tmp_path, **changes) -> str:
    data = yaml.safe_load((CONFIGS / "bench" / "tiny.yaml").read_text())
    for key, value in changes.items():
        section, _, name = key.partition("__")
        data[section][name] = value
    path = tmp_path / "preset.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("changes, needles", [
    ({"lm__lr": "abc"}, ["lm.lr must be a number > 0", "'abc' (str)"]),
    ({"backbone__d_model": "128"}, ["backbone.d_model must be an int", "'128' (str)"]),
    ({"layers__fwpkm": {"at": "1,3", "options": {"tpok": 2}}}, ["layers.fwpkm: unknown option(s) ['tpok']"]),
    ({"layers__fwpkm": {"at": "9"}}, ["layers.fwpkm.at", "out of range"]),
    ({"layers__nope": {"at": "1"}}, ["layers.nope: unknown memory layer 'nope'"]),
], ids=["lm-lr", "backbone-d_model", "layer-option", "layer-at", "layer-name"])
def test_bad_preset_is_one_line_naming_the_key(tmp_path, changes, needles):
    path = _preset(tmp_path, **changes)
    with pytest.raises(ConfigError) as e:
        load_preset(path)
    msg = str(e.value)
    print(msg)
    assert "\n" not in msg and msg.startswith(str(path))
    for n in needles:
        assert n in msg, (n, msg)


def test_malformed_preset_names_file_and_line(tmp_path):
    path = tmp_path / "preset.yaml"
    path.write_text("backbone:\n  d_model: 128\n\tn_layers: 2\n")
    with pytest.raises(ConfigError, match=r"preset\.yaml:3:1: invalid YAML"):
        load_preset(path)
