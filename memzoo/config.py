"""Configs: strict dataclasses (unknown keys are errors, with a suggestion) and their YAML form.

A YAML file has up to two sections:

    model:   ModelConfig fields (layout, sizes, per-memory-layer options under `memory:`)
    train:   TrainConfig fields (data, optimiser, schedule, checkpoints)
    paper:   the published figures a paper config reproduces (e.g. params_m), for comparison

`zoo_configs/paper/*.yaml` are the paper's Table 2 rows; `zoo_configs/tiny/*.yaml` are CPU
presets. A config name without a path (e.g. "paper/gdn") is looked up among them.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class ConfigError(ValueError):
    pass


def _strict(cls, d: dict, where: str):
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(d).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    for k in d:
        if k not in names:
            close = difflib.get_close_matches(k, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown key {k!r}{hint}; valid keys: {', '.join(names)}")
    return cls(**d)


def parse_strict(cls, d: dict | None, where: str):
    """Build dataclass `cls` from mapping `d`; an unknown key is an error naming the valid
    ones (and the closest match). `where` prefixes the message."""
    return _strict(cls, d, where)


@dataclass
class ModelConfig:
    """The hybrid backbone (paper defaults: Table 3)."""

    layout: str = "GDN"
    vocab_size: int = 32000
    d_model: int = 768
    n_layers: int = 12
    ffn_dim: int = 2304
    norm_eps: float = 1e-5
    # gated softmax attention (FA / SWA)
    attn_heads: int = 12
    attn_kv_heads: int = 4
    attn_head_dim: int = 64
    window: int = 512
    p_window: float = 0.9  # pSWA: probability of the window during training
    rope_theta: float = 10000.0
    # gated DeltaNet
    gdn_heads: int = 8
    gdn_head_dim: int = 64
    gdn_conv: int = 4
    gdn_chunk: int = 64
    # options per memory layer name, e.g. {"fwpkm": {"topk": 8}}; checked by the layer itself
    memory: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict | None) -> "ModelConfig":
        return _strict(cls, d, "model")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class TrainConfig:
    """Training on real text (the paper's schedule shape: warmup, cosine to min lr; Table 3)."""

    corpus: str = "shakespeare"
    tokenizer: str = "byte"
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 500
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 50
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    grad_accum: int = 1  # micro-batches per optimizer step
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    ckpt_every: int = 100
    seed: int = 0
    device: str = "cpu"
    threads: int = 0  # torch CPU threads; 0 = torch's default
    out_dir: str = "runs/default"

    @classmethod
    def from_dict(cls, d: dict | None) -> "TrainConfig":
        cfg = _strict(cls, d, "train")
        cfg.betas = tuple(cfg.betas)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name, low in (("steps", 1), ("batch_size", 1), ("seq_len", 1), ("grad_accum", 1),
                          ("eval_every", 1), ("eval_batches", 1), ("ckpt_every", 1), ("warmup", 0)):
            if getattr(self, name) < low:
                raise ConfigError(f"train.{name} must be >= {low}, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d


@dataclass
class RunConfig:
    model: ModelConfig
    train: TrainConfig
    source: str = ""
    paper: dict = field(default_factory=dict)  # published reference figures (e.g. params_m)

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "train": self.train.to_dict()}

    def hash(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def config_dir() -> Path:
    import memzoo.zoo_configs as zc

    return Path(zc.__file__).parent


def resolve_config_path(name: str | Path) -> Path:
    p = Path(name)
    if p.is_file():
        return p
    for cand in (config_dir() / f"{name}.yaml", config_dir() / str(name)):
        if cand.is_file():
            return cand
    known = sorted(str(q.relative_to(config_dir()).with_suffix("")) for q in config_dir().glob("*/*.yaml"))
    raise ConfigError(f"no config {str(name)!r}: not a file, and not one of the shipped configs: {', '.join(known)}")


def load_config(name: str | Path) -> RunConfig:
    path = resolve_config_path(name)
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with 'model' and/or 'train'")
    bad = set(data) - {"model", "train", "paper"}
    if bad:
        raise ConfigError(f"{path}: unknown top-level key(s) {sorted(bad)}; valid: model, train, paper")
    return RunConfig(
        ModelConfig.from_dict(data.get("model")),
        TrainConfig.from_dict(data.get("train")),
        str(path),
        dict(data.get("paper") or {}),
    )
