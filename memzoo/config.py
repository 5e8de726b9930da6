"""Configs: strict dataclasses (unknown keys are errors, with a suggestion) and their YAML form.

A YAML file has up to three sections, and optionally a base:

    base:    another file, e.g. `_base` (`_base.yaml` beside this one), whose sections this
             file's extend: a key here replaces the base's; a mapping (`model.memory`, one
             layer's options) is merged key by key. A base may have a base; cycles are errors.
    model:   ModelConfig fields (layout, sizes, per-memory-layer options under `memory:`)
    train:   TrainConfig fields (data, optimiser, schedule, checkpoints)
    paper:   the published figures a paper config reproduces (e.g. params_m), for comparison

Bench presets (`zoo_configs/bench/*.yaml`) use the same `model:` and `train:` sections (and
`base:`), plus their own (see memzoo.bench.common).

`zoo_configs/paper/*.yaml` are the paper's Table 2 rows; `zoo_configs/tiny/*.yaml` are CPU
presets; each states what differs from its directory's `_base.yaml`. A memory layer's options may be
the name of a column of `zoo_configs/sizes.yaml` (``memory: {mom: cpu}``): the layer's row there
(`layer_sizes`), the one place a built-in layer's CPU sizes are written. A config name without a
path (e.g. "paper/gdn") is looked up among them; files named `_*.yaml` are bases, not listed.

Every field is checked when a config is loaded: its type (an int is not 1.5, "768" or true; a
number may be written 1e-3, which YAML 1.1 reads as a string), its range, the layout, and each
memory layer's options (the layer is built once on the meta device). A fault is one ConfigError
line naming the key, e.g. `train.lr must be a number > 0, got 'abc' (str)`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from memzoo.registration import did_you_mean


class ConfigError(ValueError):
    pass


def parse_strict(cls, d: dict | None, where: str):
    """Build dataclass `cls` from mapping `d`; an unknown key is an error naming the valid
    ones (and the closest match). `where` prefixes the message."""
    d = {} if d is None else d
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(d).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    for k in d:
        if k not in names:
            raise ConfigError(f"{where}: unknown key {k!r}{did_you_mean(k, names)}; valid keys: {', '.join(names)}")
    return cls(**d)


# ---- the typed-field checker -----------------------------------------------------------------

_KIND = {int: "an int", float: "a number", str: "a string", bool: "true or false", dict: "a mapping", tuple: "a list of numbers"}


def _ge(low):
    return lambda v: v >= low, f">= {low}"


def _gt(low):
    return lambda v: v > low, f"> {low}"


def _number(v):
    """`v` as a finite int/float, reading numeric strings (YAML 1.1 reads 1e-3 as one); else None."""
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return None
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _typed(v, kind):
    """`v` as a value of `kind` (ints stay ints in float fields, so hashes do not move), or None."""
    if kind is float:
        return _number(v)
    if kind is tuple:
        nums = [_number(x) for x in v] if isinstance(v, (list, tuple)) else [None]
        return None if None in nums else tuple(nums)
    if kind is int:
        return v if type(v) is int else None  # not 1.5, "768" or True
    return v if isinstance(v, kind) else None


def _check_fields(obj, where: str, ranges: dict) -> None:
    """Check (and normalise) every field of dataclass `obj` against its type and `ranges`
    ({field: (test, text)}); the first fault is one ConfigError line naming `where.field`."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        v, kind = getattr(obj, f.name), hints[f.name]
        test, text = ranges.get(f.name, (None, ""))
        t = _typed(v, kind)
        if t is None:
            want = _KIND.get(kind, f"a {kind.__name__}")
            raise ConfigError(f"{where}.{f.name} must be {' '.join(filter(None, (want, text)))}, "
                              f"got {v!r} ({type(v).__name__})")
        if test is not None and not test(t):
            raise ConfigError(f"{where}.{f.name} must be {text}, got {t!r}")
        setattr(obj, f.name, t)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def check_layer_options(name: str, options, d_model: int, where: str) -> str:
    """Check one memory layer's options by building it once on the meta device (no memory,
    no draw from torch's RNG); returns the layer's registered name. `where` names the key."""
    import torch

    from memzoo.registry import build_layer, get_layer, layer_names

    try:
        cls = get_layer(str(name))
    except ValueError:
        raise ConfigError(f"{where}: unknown memory layer {name!r}{did_you_mean(name, layer_names())}; "
                          f"registered layers: {', '.join(layer_names())}") from None
    if not isinstance(options, dict):
        raise ConfigError(f"{where} must be a mapping of layer options, got {options!r} ({type(options).__name__})")
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            build_layer(cls.name, d_model, **options)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {_one_line(e).removeprefix(cls.name + ': ')}") from None
    return cls.name


# ---- the layers' sizes table ------------------------------------------------------------------

#: the columns of zoo_configs/sizes.yaml (its header says who reads which)
SIZE_COLUMNS = ("at", "cpu", "test", "toys")


@functools.cache
def _sizes_table() -> dict:
    path = config_dir() / "sizes.yaml"
    rows = yaml.safe_load(path.read_text()) or {}
    for name, row in rows.items():
        if not isinstance(row, dict) or set(row) - set(SIZE_COLUMNS) or any(
                not isinstance(row[c], dict) for c in row if c != "at"):
            raise ConfigError(f"{path}: {name}: expected a mapping of {', '.join(SIZE_COLUMNS)} (each but `at` a "
                              f"mapping of options), got {row!r}")
    return rows


def layer_sizes(column: str) -> dict:
    """Column `column` of zoo_configs/sizes.yaml, the built-in layers' CPU sizes: {layer: value} for
    every row (a fresh copy); a row without the column gets its class defaults ({} options, `at` None)."""
    if column not in SIZE_COLUMNS:
        raise ConfigError(f"no column {column!r} in zoo_configs/sizes.yaml; its columns: {', '.join(SIZE_COLUMNS)}")
    return {name: copy.deepcopy(row.get(column, None if column == "at" else {})) for name, row in _sizes_table().items()}


def sized_options(name: str, column: str, where: str):
    """A memory layer's options given as a column of the sizes table: its row's (the name as given
    where it names no registered layer, for `check_layer_options` to report)."""
    from memzoo.registry import get_layer

    try:
        key = get_layer(str(name)).name
    except ValueError:
        return column
    if column == "at" or column not in SIZE_COLUMNS or key not in _sizes_table():
        raise ConfigError(f"{where}: {column!r} names no options of layer {key!r} in zoo_configs/sizes.yaml "
                          f"(its option columns: {', '.join(c for c in SIZE_COLUMNS if c != 'at')}; rows: the "
                          f"built-in layers)")
    return layer_sizes(column)[key]


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
    attn_conv: int = 0  # short convolution on attention's q, k, v (0: none, as in the paper)
    # gated DeltaNet
    gdn_heads: int = 8
    gdn_head_dim: int = 64
    gdn_conv: int = 4
    gdn_chunk: int = 64
    # options per memory layer name, e.g. {"fwpkm": {"topk": 8}}; checked by building the layer
    memory: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict | None, where: str = "model") -> "ModelConfig":
        cfg = parse_strict(cls, d, where)
        cfg.validate(where)
        return cfg

    def validate(self, where: str = "model") -> None:
        from memzoo.layout import parse_layout

        _check_fields(self, where, _MODEL_RANGES)
        try:
            layout = parse_layout(self.layout, self.n_layers)
        except ValueError as e:
            raise ConfigError(f"{where}.layout: {_one_line(e)}") from None
        if self.attn_head_dim % 2 and any(m in ("SWA", "FA", "FA-pSWA") for m in layout.mixers):
            raise ConfigError(f"{where}.attn_head_dim: {self.attn_head_dim} is odd; the attention's rotary embedding "
                              "turns pairs of dimensions, so give an even head size (or other attn_heads for this width)")
        placed = [name for name, _ in layout.memories]
        memory = {}
        for name, opts in self.memory.items():
            if isinstance(opts, str):  # a column of zoo_configs/sizes.yaml: the layer's row there
                opts = sized_options(name, opts, f"{where}.memory.{name}")
            key = check_layer_options(name, opts, self.d_model, f"{where}.memory.{name}")
            if key in memory:  # e.g. `fwpkm` in a base and `FwPKM` in the file: say so, do not drop one
                raise ConfigError(f"{where}.memory names layer {key!r} twice (as {name!r} too)")
            if key not in placed:  # options nothing reads are a mistake, not a default
                raise ConfigError(f"{where}.memory.{name}: options for layer {key!r}, which the layout {self.layout!r} "
                                  f"does not place ({'its memory layers: ' + ', '.join(placed) if placed else 'it has no memory layer'}); "
                                  f"add it to the layout (e.g. '{self.layout.split('|')[0].strip()} | {key}@0') or drop the options")
            memory[key] = opts
        self.memory = memory

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# {field: (test, text)}; other fields are checked for their type only
_MODEL_RANGES = {
    **dict.fromkeys(("d_model", "n_layers", "ffn_dim", "attn_heads", "attn_kv_heads", "attn_head_dim",
                     "window", "gdn_heads", "gdn_head_dim", "gdn_conv", "gdn_chunk"), _ge(1)),
    "vocab_size": _ge(2),
    "attn_conv": _ge(0),
    "norm_eps": _gt(0),
    "rope_theta": _gt(0),
    "p_window": (lambda v: 0 < v <= 1, "in (0, 1]"),
}


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
    precision: str = "auto"  # fp32, bf16 (autocast), or auto: bf16 on CUDA, fp32 on CPU
    compile: bool = False  # torch.compile the model's forward
    out_dir: str = "runs/default"

    @classmethod
    def from_dict(cls, d: dict | None, where: str = "train") -> "TrainConfig":
        cfg = parse_strict(cls, d, where)
        cfg.validate(where)
        return cfg

    def validate(self, where: str = "train") -> None:
        import torch

        from memzoo.data.corpora import corpus_names

        _check_fields(self, where, _TRAIN_RANGES)
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ConfigError(f"{where}.precision must be 'auto', 'fp32' or 'bf16', got {self.precision!r}")
        if self.min_lr > self.lr:
            raise ConfigError(f"{where}.min_lr must be <= {where}.lr ({self.lr}), got {self.min_lr}")
        if self.corpus not in corpus_names() and not (self.corpus.startswith("hf:") and len(self.corpus) > 3):
            raise ConfigError(f"{where}.corpus must be one of {', '.join(corpus_names())}, or hf:PATH[:NAME] (a "
                              f"dataset streamed by `datasets`), got {self.corpus!r}"
                              f"{did_you_mean(self.corpus, corpus_names())}")
        tok = self.tokenizer  # a Hub id (org/name) or a local directory is loaded by transformers
        if tok not in ("byte", "mistral") and not re.fullmatch(r"([\w-]+/)?[\w.-]+", tok) and not Path(tok).is_dir():
            raise ConfigError(f"{where}.tokenizer must be 'byte', 'mistral', a Hugging Face model id or a local "
                              f"directory, got {tok!r}")
        try:
            self.device == "auto" or torch.device(self.device)  # auto: cuda if available, else cpu
        except (RuntimeError, ValueError):
            raise ConfigError(f"{where}.device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', "
                              f"got {self.device!r}") from None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d


_TRAIN_RANGES = {
    **dict.fromkeys(("seq_len", "batch_size", "steps", "grad_accum", "eval_every", "eval_batches",
                     "ckpt_every"), _ge(1)),
    **dict.fromkeys(("warmup", "threads", "min_lr", "weight_decay", "grad_clip"), _ge(0)),
    "lr": _gt(0),
    "betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "[beta1, beta2], each in [0, 1)"),
}


@dataclass
class RunConfig:
    model: ModelConfig
    train: TrainConfig
    source: str = ""
    paper: dict = field(default_factory=dict)  # published reference figures (e.g. params_m)

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "train": self.train.to_dict()}


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
    known = sorted(str(q.relative_to(config_dir()).with_suffix("")) for q in config_dir().glob("*/*.yaml")
                   if not q.name.startswith("_"))  # _*.yaml: bases, not configs
    raise ConfigError(f"no config {str(name)!r}: not a file, and not one of the shipped configs: {', '.join(known)}")


def read_yaml(path: Path, sections: tuple[str, ...]) -> dict:
    """The mapping in YAML file `path`, whose keys must be among `sections`; a syntax error is
    one ConfigError line naming the file and line."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}{at}: invalid YAML: {_one_line(getattr(e, 'problem', None) or e)}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with the sections {', '.join(sections)}, "
                          f"got {type(data).__name__}")
    bad = [k for k in data if k not in sections]
    if bad:
        raise ConfigError(f"{path}: unknown section {bad[0]!r}{did_you_mean(bad[0], list(sections))}; "
                          f"valid sections: {', '.join(sections)}")
    return data


def merge_config(base: dict, over: dict) -> dict:
    """`base` with `over`'s keys on top; mappings under the same key merge key by key (an empty
    value, e.g. a bare `model:`, changes nothing)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(out.get(k), dict) and (v is None or isinstance(v, dict)):
            out[k] = merge_config(out[k], v or {})
        else:
            out[k] = v
    return out


def read_config(path: Path, sections: tuple[str, ...], _seen: tuple[Path, ...] = (),
                shipped: Path | None = None) -> tuple[dict, list[Path]]:
    """The sections of YAML file `path` merged over those of its `base:` (and its base's...),
    and the base files used, nearest first. A base is a file beside `path`, else one of the
    `shipped` folder's (a user's preset anywhere may say ``base: recall``). A missing base or a
    cycle is one ConfigError line."""
    data = read_yaml(path, (*sections, "base"))
    if "base" not in data:
        return data, []
    name = data.pop("base")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{path}: base must be the name of a YAML file beside it (e.g. _base), got {name!r}")
    file = name if name.endswith(".yaml") else f"{name}.yaml"
    base = path.parent / file
    if not base.is_file() and shipped is not None and (shipped / file).is_file():
        base = shipped / file
    seen = (*_seen, path.resolve())
    if base.resolve() in seen:
        raise ConfigError(f"{path}: base cycle: {' -> '.join(q.name for q in (*seen, base))}")
    if not base.is_file():
        where = f" beside it or among the shipped ones in {shipped}" if shipped is not None else ""
        raise ConfigError(f"{path}: base {name!r}: no such file {base}{where}")
    under, bases = read_config(base, sections, seen, shipped)
    for k, v in under.items():
        if v is not None and not isinstance(v, dict):
            raise ConfigError(f"{base}: {k}: expected a mapping, got {type(v).__name__}")
    return merge_config(under, data), [base, *bases]


def load_config(name: str | Path) -> RunConfig:
    path = resolve_config_path(name)
    data, bases = read_config(path, ("model", "train", "paper"))
    try:
        if not isinstance(data.get("paper") or {}, dict):
            raise ConfigError(f"paper: expected a mapping, got {type(data['paper']).__name__}")
        return RunConfig(
            ModelConfig.from_dict(data.get("model")),
            TrainConfig.from_dict(data.get("train")),
            str(path),
            dict(data.get("paper") or {}),
        )
    except ConfigError as e:  # a key may come from a base: name them
        on = f" (with base {', '.join(map(str, bases))})" if bases else ""
        raise ConfigError(f"{path}{on}: {e}") from None


def add_train_arguments(p) -> None:
    """The options of `memzoo train` and of ``torchrun ... -m memzoo.train`` on an argparse parser:
    the config and what overrides it (here, beside the config, so that neither command line imports
    torch to build its help)."""
    p.add_argument("config")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue exactly from the last checkpoint in the out dir")
    again.add_argument("--overwrite", action="store_true", help="delete the run already in the out dir, then train")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--out", help="override train.out_dir")
    p.add_argument("--seed", type=int, help="override train.seed")
    p.add_argument("--device", help="override train.device: cpu, cuda, cuda:N, or auto (cuda if available)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"),
                   help="override train.precision (auto: bf16 autocast on CUDA, fp32 on CPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model's forward (train.compile)")
    p.add_argument("--from", dest="from_", metavar="PATH",
                   help="train memories attached to this Hugging Face causal LM (a local directory or a Hub name) "
                        "instead of the config's model; the config's train section still applies")
    p.add_argument("--attach", action="append", metavar="LAYER[@AT][:OPTIONS]",
                   help="with --from: a memory to attach (repeatable), e.g. fwpkm@1:cpu or gated_deltanet@all:num_heads=2; "
                        "AT: all, last, an index or 0,2 (default: the layer's place); OPTIONS: a column of "
                        "zoo_configs/sizes.yaml or key=value,...")
    p.add_argument("--train-base", action="store_true",
                   help="with --from: train the pretrained weights too (default: only the memories and their gates); "
                        "without --attach: fine-tune the model itself")
    p.add_argument("--lora", type=int, metavar="RANK",
                   help="with --from: train LoRA adapters of this rank on the base's attention (peft) beside the "
                        "memories, the base frozen; saved merged into the weights")
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                   help="under torchrun: DDP (a model per process) or FSDP2 (parameters sharded); see memzoo.distributed")
