"""What every bench suite shares: presets, the models they compare, provenance, recording.

A *preset* (``zoo_configs/bench/<name>.yaml``) fixes everything a comparison depends on:

    model:     ModelConfig fields of the plain backbone every layer is plugged into
    sizes:     ``{column: cpu}``: every layer of ``zoo_configs/sizes.yaml`` where that table places it
               and with that column's options (the CPU presets' base says so; the paper preset does not)
    layers:    per memory layer, where it goes (``at``: "1,3", "all", "last") and its options: what the
               preset changes over ``sizes`` (options key by key)
    train:     TrainConfig fields of the language model that the ppl and niah suites train
    toys / ppl / niah / cost:   each suite's settings (checked by that suite's Settings class)

Each layer is compared on the same backbone, data and budget: ``model_config(preset, layer)``
is the backbone with only that layer added (``BASELINE`` is the backbone alone). A registered
layer the preset does not list goes where its class says (`default_where`) with its defaults.

Every measurement becomes one row of ``leaderboards/results.jsonl`` (see :class:`Recorder`):
the layer, suite, setting and metrics, plus the provenance a reader needs to trust and redo
it: the full config and its hash, seed, git sha, package versions, hardware and wall time.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import json
import math
import os
import platform
import subprocess
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from memzoo.bench.schema import BASELINE, CONTROLS, NEGATIVE, POSITIVE, SUITE_NAMES as SUITES  # noqa: F401
from memzoo.config import (
    ConfigError, ModelConfig, TrainConfig, check_layer_options, config_dir, layer_sizes, merge_config, parse_strict,
    read_config,
)

RESULTS = "results.jsonl"


# ---- presets -----------------------------------------------------------------------------


@dataclass
class LayerSpec:
    """Where a memory layer goes in the backbone and the options it is built with."""

    at: str | None = None  # "1,3" | "all" | "last"; None = the layer's default_where, else "last"
    options: dict = field(default_factory=dict)


@dataclass
class Preset:
    name: str
    backbone: dict  # the preset's `model:` section
    layers: dict[str, LayerSpec]
    lm: dict  # the preset's `train:` section
    suites: dict[str, dict]
    source: str = ""
    default_suites: tuple[str, ...] = ()  # the `run:` section's suites: what a bench without --suite runs (all)
    _parsed: dict = field(default_factory=dict, repr=False, compare=False)  # `settings`' cache

    def settings(self, suite: str, cls):
        """The suite's section parsed by its Settings dataclass (unknown keys are errors), once per
        process and section: a later call returns the same object (treat it as read-only) until the
        section itself changes."""
        section = self.suites.get(suite) or {}
        key = (suite, cls, json.dumps(section, sort_keys=True, default=str))
        if key not in self._parsed:
            self._parsed[key] = parse_strict(cls, section, f"{self.source}: {suite}")
        return self._parsed[key]


def preset_names() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "bench").glob("*.yaml") if not p.name.startswith("_"))


def preset_summaries() -> dict[str, str]:
    """Each shipped preset's name and its one-line summary: the first line of its file,
    ``# <name>: <what it is for>``."""
    out = {}
    for name in preset_names():
        first = (config_dir() / "bench" / f"{name}.yaml").read_text().split("\n", 1)[0]
        out[name] = first.removeprefix(f"# {name}:").strip() if first.startswith(f"# {name}:") else ""
    return out


def load_preset(name: str) -> Preset:
    """A shipped preset by name ("tiny", "paper") or a YAML file path."""
    path = Path(name)
    if not path.is_file():
        path = config_dir() / "bench" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"no bench preset {name!r}; shipped presets: {', '.join(preset_names())}, or give a YAML path")
    data, bases = read_config(path, ("model", "layers", "train", "run", *SUITES, "sizes"), shipped=config_dir() / "bench")
    try:  # check the backbone, the layers and the LM now, not at the first model
        backbone = ModelConfig.from_dict(data.get("model"), "model")
        TrainConfig.from_dict(data.get("train"), "train")
        if not isinstance(data.get("layers") or {}, dict):
            raise ConfigError(f"layers: expected a mapping, got {type(data['layers']).__name__}")
        layers = {}
        for k, v in merge_config(_sized_layers(data.get("sizes")), data.get("layers") or {}).items():
            spec = parse_strict(LayerSpec, v, f"layers.{k}")
            k = check_layer_options(k, spec.options, backbone.d_model, f"layers.{k}")
            try:
                from memzoo.layout import parse_layout

                parse_layout(f"{backbone.layout} | {k}" + ("" if spec.at is None else f"@{spec.at}"), backbone.n_layers)
            except ValueError as e:
                raise ConfigError(f"layers.{k}.at: {' '.join(str(e).split())}") from None
            layers[k] = spec
    except ConfigError as e:
        on = f" (with base {', '.join(map(str, bases))})" if bases else ""
        raise ConfigError(f"{path}{on}: {e}") from None
    run = data.get("run") or {}
    if not isinstance(run, dict) or set(run) - {"suites"} or not all(s in SUITES for s in run.get("suites", [])):
        raise ConfigError(f"{path}: run: expected {{suites: [...]}} with suites among {', '.join(SUITES)}, got {run!r}")
    return Preset(
        name=path.stem,
        backbone=dict(data.get("model") or {}),
        layers=layers,
        lm=dict(data.get("train") or {}),
        suites={s: dict(data.get(s) or {}) for s in SUITES},
        source=str(path),
        default_suites=tuple(run.get("suites", ())),
    )


def _sized_layers(sizes) -> dict:
    """A preset's ``sizes: {column: C}``: each row of zoo_configs/sizes.yaml as a `layers:` entry, its
    `at` and its column C's options; no `sizes:`, none (each layer at its class defaults)."""
    if not sizes:
        return {}
    if not isinstance(sizes, dict) or set(sizes) != {"column"} or sizes["column"] == "at":
        raise ConfigError(f"sizes: expected {{column: NAME}}, a column of zoo_configs/sizes.yaml (e.g. cpu), got {sizes!r}")
    options = layer_sizes(sizes["column"])
    return {name: {"at": at, "options": options[name]} for name, at in layer_sizes("at").items()}


def check_layers(names: list[str]) -> list[str]:
    """Lower-cased, deduplicated layer names; unknown ones are one error naming the valid ones. A
    name `layer/variant` (a toys variant, run alone) passes here where its layer is registered;
    the toys suite checks that the preset defines it."""
    from memzoo.registry import layer_names

    valid = layer_names()
    out = []
    for n in names:
        n = n.strip().lower()
        if not n or n == BASELINE or n in out:
            continue
        if n.split("/")[0] not in valid:
            raise ConfigError(f"unknown layer {n!r}; valid layers: {', '.join(valid)} (the baseline is always included)")
        out.append(n)
    return out


def model_config(preset: Preset, layer: str, variant: dict | None = None, **backbone_overrides) -> ModelConfig:
    """The preset's backbone with `layer` plugged in (the backbone alone for BASELINE).
    `backbone_overrides` replace backbone fields (a suite's own sizes, e.g. the toys' vocab);
    the layer's options are the preset's, with a `variant`'s (``{layer, at, options}``, see
    `check_variants`) place and options over them. The controls replace the backbone's mixers:
    attention with a short convolution (the GDN's width), or none."""
    base = {**preset.backbone, **backbone_overrides}
    if layer == BASELINE:
        return ModelConfig.from_dict(base)
    if layer == POSITIVE:
        return ModelConfig.from_dict({**base, "layout": "FA", "attn_conv": ModelConfig.from_dict(base).gdn_conv})
    if layer == NEGATIVE:
        return ModelConfig.from_dict({**base, "layout": "NONE"})
    from memzoo.registry import get_layer

    variant = variant or {}
    layer = variant.get("layer", layer)
    spec = preset.layers.get(layer, LayerSpec())
    at = variant.get("at", spec.at)
    if at is None and getattr(get_layer(layer), "default_where", None) is None:
        at = "last"  # a layer the preset does not list (a plugin's) and that names no place
    item = layer if at is None else f"{layer}@{at}"
    options = {**spec.options, **(variant.get("options") or {})}
    return ModelConfig.from_dict({**base, "layout": f"{base.get('layout', 'GDN')} | {item}", "memory": {layer: options}})


def check_backbone(fields: dict, where: str) -> None:
    """A suite's backbone changes (``<suite>.model``): ModelConfig fields only."""
    unknown = sorted(set(fields) - set(ModelConfig.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"{where}: unknown backbone field(s) {unknown}")


def check_variants(variants: dict, where: str, keys: tuple[str, ...] = ("layer", "options", "at")) -> None:
    """A suite's variants: extra rows of a registered layer with other options or another place,
    ``{name: {layer: L, options: {...}, at: A}}`` (`keys`: the fields the suite takes), named
    apart from every layer and control."""
    from memzoo.registry import layer_names

    for name, v in variants.items():
        if not isinstance(v, dict) or set(v) - set(keys) or v.get("layer") not in layer_names():
            fields = ", ".join(f"{k}: ..." for k in keys)
            raise ConfigError(f"{where}.{name} must be {{{fields}}} with a registered layer, got {v!r}")
        if name in layer_names() or name in CONTROLS or name == BASELINE:
            raise ConfigError(f"{where}: {name!r} is already a layer's or a control's name")


def lm_train_config(preset: Preset, **overrides) -> TrainConfig:
    return TrainConfig.from_dict({**preset.lm, **overrides})


# ---- provenance ----------------------------------------------------------------------------


def config_hash(cfg: dict) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:12]


#: where a measurement kept its files, which older rows record in their config (an LM's ``train.out_dir``,
#: under the run's work dir) and which is no part of what was measured
LOCATIONS = (("lm", "train", "out_dir"),)

#: where a config names its training seed (an LM's), which the row's ``seed`` names too: one protocol at every seed
SEEDS = (("lm", "train", "seed"),)

#: what of an LM row's config is its layer's own (`bench.lm.lm_config`: the layout and memory it plugs in,
#: the controls' mixers, the attached specs, documents in order for fast weights that persist; the lr a
#: layer may train at): the rest is the protocol that a preset's LMs share
LM_LAYER_KEYS = (("lm", "model", "layout"), ("lm", "model", "memory"), ("lm", "model", "attn_conv"), ("lm", "attach"),
                 ("lm", "document_order"), ("lm", "train", "lr"))


def protocol(cfg: dict, any_seed: bool = False, without: tuple = ()) -> dict:
    """What a row measured: a copy of its config without `LOCATIONS`; `any_seed`: without `SEEDS` too,
    the protocol that a cell's seeds share; `without`: other paths left out (a layer's own options,
    `LM_LAYER_KEYS`: the protocol that a preset's layers share)."""
    measured = json.loads(json.dumps(cfg, default=str))  # a copy, as config_hash hashes it
    for *parents, leaf in LOCATIONS + (SEEDS if any_seed else ()) + tuple(without):
        inner = measured
        for k in parents:
            inner = inner.get(k) if isinstance(inner, dict) else None
        if isinstance(inner, dict):
            inner.pop(leaf, None)
    return measured


def protocol_hash(cfg: dict, any_seed: bool = False, without: tuple = ()) -> str:
    """`config_hash` of the `protocol` of a config, so that one measurement made in two work dirs is one
    cell (a resumed run finds it, a pooled table pools it). Rows record no location since, so for them
    this is their ``config_hash``."""
    return config_hash(protocol(cfg, any_seed, without))


def published_rows() -> Path | None:
    """leaderboards/results.jsonl of the checkout (the working directory's), if any."""
    path = Path.cwd() / "leaderboards" / "results.jsonl"
    return path if path.is_file() else None


@functools.cache
def git_sha() -> str:
    """The commit of the memzoo checkout this runs from, '+dirty' if it has local changes other
    than the published results (a bench run appends to leaderboards/results.jsonl itself)."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)leaderboards"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


@functools.cache
def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("memzoo", "torch", "triton", "flash-linear-attention", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


@functools.cache
def hardware() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    hw = {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        hw["gpu"] = torch.cuda.get_device_name()
    else:  # whether compiled bf16 steps multiply in fp32 here (memzoo.train.make_step)
        from memzoo.cpu import cpu_bf16_gemm_is_slow

        hw["bf16_gemm_in_fp32"] = cpu_bf16_gemm_is_slow()
    return hw


def processor(hw: dict) -> str:
    """The processor model of a row's ``hardware`` (the GPU's name, else the CPU's): what a timing
    belongs to and what a pooled table names for each row."""
    return hw.get("gpu") or hw["cpu"]


def device_name(device: str) -> str:
    """The machine a measurement ran on, in words (the GPU's name on CUDA)."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    h = hardware()
    return f"{h['cpu']} ({torch.get_num_threads()} threads)"


# ---- the run's torch.compile cache ------------------------------------------------------------


def compile_cache(work_dir: Path) -> Path:
    """Point torch.compile's on-disk cache at ``<work dir>/compile-cache`` for this run and its
    workers (they inherit the environment and share it: a graph one worker compiled, the other
    loads; inductor locks what it writes against concurrent compiles). It outlives the run, so
    a resumed run loads what the killed one compiled (a cache of each run's own made a resumed
    run compile everything again: docs/journal/performance.md).

    Inductor builds each kernel library with g++ straight to its final path, in a scratch dir
    ``<name>_CxxBuild`` beside it that it removes when the build ends, and later loads any
    library that exists: a run killed mid-build leaves a truncated one that every later compile
    of that kernel fails to load ("file too short"). So a scratch dir whose lock no live process
    holds marks a killed build, and its outputs go with it here; the next compile rebuilds them.
    The same holds for inductor's precompiled headers, which it keeps in its default dir."""
    import os
    import shutil

    path = work_dir / "compile-cache"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    from torch._inductor.codecache import _HEADER_DIR, _HEADER_LOCK_DIR  # where inductor keeps its headers
    from filelock import FileLock, Timeout  # what inductor locks its builds with

    for builds, locks in ((path.glob("*/*_CxxBuild"), path / "locks"),
                          (Path(_HEADER_DIR).glob("*_CxxBuild"), Path(_HEADER_LOCK_DIR))):
        for scratch in builds:
            key = scratch.name.split(".")[0]
            locks.mkdir(parents=True, exist_ok=True)
            try:
                with FileLock(str(locks / f"{key}.lock"), timeout=0):
                    for f in scratch.parent.glob(f"{key}*"):
                        if f.suffix in (".so", ".o", ".gch"):
                            f.unlink(missing_ok=True)
                    shutil.rmtree(scratch, ignore_errors=True)
            except Timeout:  # a live build: another run compiles it now
                pass
    return path


# ---- recording -----------------------------------------------------------------------------


class Recorder:
    """Appends result rows to ``<out>/results.jsonl``: each row is one `write` of one line to
    a file opened in append mode under an exclusive lock, so concurrent runs never interleave
    and a killed run never leaves half a row."""

    def __init__(self, out_dir: str | Path, preset: str, seed: int, run_id: str | None = None):
        self.path = Path(out_dir) / RESULTS
        self.preset, self.seed = preset, seed
        self.run_id = run_id or time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
        self.rows: list[dict] = []
        self._done: dict | None = None  # rows already in the file, a list by _key (read on first lookup)
        self.git_sha = git_sha()  # the code this run started with (a later commit does not change it)

    @staticmethod
    def _key(suite, preset, layer, setting, seed, protocol) -> str:
        return json.dumps([suite, preset, layer, setting, seed, protocol], sort_keys=True)

    @classmethod
    def _row_key(cls, r: dict) -> str:
        return cls._key(r["suite"], r["preset"], r["layer"], r["setting"], r["seed"], protocol_hash(r["config"]))

    def find(self, suite: str, layer: str, setting: dict, config: dict, seed: int | None = None,
             preset: str | None = None) -> dict | None:
        """The row already recorded in the file for this suite, preset (this run's, or `preset`), layer,
        setting, seed and config (`protocol_hash`: its hash, the locations left out), if any: what a resumed
        run skips. The controls and the backbone alone count only where measured on this processor model:
        a table asks them to hold on every processor that contributed rows, so a run on a new one
        measures its own."""
        if self._done is None:
            self._done = self._index(read_results(self.path))
        seed = self.seed if seed is None else seed
        rows = self._done.get(self._key(suite, preset or self.preset, layer, setting, seed, protocol_hash(config)), [])
        if layer in CONTROLS or layer == BASELINE:
            rows = [r for r in rows if processor(r["hardware"]) == processor(hardware())]
        return rows[-1] if rows else None

    def add(self, suite: str, layer: str, setting: dict, metrics: dict, config: dict, wall_s: float,
            seed: int | None = None) -> dict:
        """Append one row; `seed` is the row's own seed where a suite runs several (default: the run's)."""
        return self.append(self.row(suite, layer, setting, metrics, config, wall_s, seed))

    def row(self, suite: str, layer: str, setting: dict, metrics: dict, config: dict, wall_s: float,
            seed: int | None = None) -> dict:
        """The row of one measurement, with its provenance (code, versions, this machine)."""
        return {
            "suite": suite,
            "layer": layer,
            "setting": setting,
            "metrics": metrics,
            "preset": self.preset,
            "seed": self.seed if seed is None else seed,
            "config": config,
            "config_hash": config_hash(config),
            "git_sha": self.git_sha,
            "versions": versions(),
            "hardware": hardware(),
            "wall_s": round(wall_s, 3),
            "run_id": self.run_id,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    def append(self, row: dict) -> dict:
        """Append a whole row to the file (one locked write of one line), as measured here or
        returned by a Ray task (`memzoo.bench.ray_engine`)."""
        body = json.loads(json.dumps(_finite_or_null(row), sort_keys=True, default=_jsonable, allow_nan=False))
        row["digest"] = body["digest"] = row_digest(body)  # the row as the file holds it, sealed
        line = json.dumps(body, sort_keys=True, allow_nan=False) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab+", buffering=0) as f:  # unbuffered: no bytes left to flush after a failure
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                end = self._set_aside_torn_tail(f)
                try:
                    data = memoryview(line.encode())
                    while data:  # a write may be partial
                        data = data[os.write(f.fileno(), data):]
                    os.fsync(f.fileno())
                except OSError as e:  # a full disk (ENOSPC) mid-row: the file goes back to what it was
                    os.ftruncate(f.fileno(), end)
                    raise OSError(e.errno, f"{self.path}: a row could not be appended ({e.strerror}); the file is "
                                           f"as it was, with every row before it") from e
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return self._keep(row)

    def _set_aside_torn_tail(self, f) -> int:
        """The file's length once a torn last line (a write cut short by a kill: no newline) is moved
        to ``results.jsonl.torn`` beside it, so that the next row starts a line of its own and no torn
        line is left inside the file (which `read_results` could not read past)."""
        end = f.seek(0, os.SEEK_END)
        if not end:
            return 0
        f.seek(max(0, end - (1 << 20)))
        tail = f.read()
        if tail.endswith(b"\n"):
            return end
        cut = tail.rfind(b"\n") + 1  # where the last line starts within the tail (0: the tail is one line)
        if not cut and end > len(tail):
            return end  # a last line over a MiB long is no torn row of ours: leave it for read_results to name
        keep = end - len(tail) + cut
        with open(f"{self.path}.torn", "ab") as aside:
            aside.write(tail[cut:] + b"\n")
        warnings.warn(f"{self.path}: its last line was torn (a write cut short); set aside in {self.path.name}.torn",
                      stacklevel=3)
        os.ftruncate(f.fileno(), keep)
        return keep

    @classmethod
    def _index(cls, rows: list[dict]) -> dict:
        """{_row_key: its rows, oldest first}."""
        out: dict = {}
        for r in rows:
            out.setdefault(cls._row_key(r), []).append(r)
        return out

    def _keep(self, row: dict) -> dict:
        self.rows.append(row)
        if self._done is not None:
            self._done.setdefault(self._row_key(row), []).append(row)
        return row


class Collector(Recorder):
    """A Recorder that writes no file: a Ray task's rows, which it returns to the driver, the one
    process that appends to results.jsonl (a cluster's nodes need not share a file system).
    `done`: the rows the file held when the run started (what a resumed run skips)."""

    def __init__(self, preset: str, seed: int, run_id: str, done: list[dict]):
        super().__init__(".", preset, seed, run_id)
        self.path = None
        self._done = self._index(done)

    def append(self, row: dict) -> dict:
        return self._keep(row)


def row_digest(row: dict) -> str:
    """The content digest of a row: sha256 over its JSON as results.jsonl holds it (sorted keys),
    without the digest itself. Recorded when the row is written, so a row edited afterwards (its
    metrics, config or provenance) no longer matches it (`memzoo verify`)."""
    body = {k: v for k, v in row.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=False).encode()).hexdigest()


def _finite_or_null(x):
    """The row with every non-finite float as None: results.jsonl stays strict JSON (no NaN)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite_or_null(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_null(v) for v in x]
    return x


def _jsonable(x):
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    if isinstance(x, (tuple, set)):
        return list(x)
    if hasattr(x, "tolist"):  # a tensor or an array
        return x.tolist()
    return str(x)


class ResultsError(ValueError):
    """A line of results.jsonl that is not a result row; the message names file:line."""


_ROW_KEYS = ("suite", "preset", "layer", "setting", "seed", "metrics", "config_hash", "run_id", "time")


def read_results(path: str | Path) -> list[dict]:
    """The rows of a results.jsonl. A torn last line (a write cut short) is skipped with a
    warning; any other line that is not a row is a ResultsError naming file:line."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == last:
                warnings.warn(f"{path}:{i + 1}: the last line is not a whole row (a write cut short?); skipped", stacklevel=2)
                continue
            raise ResultsError(f"{path}:{i + 1}: not a JSON row ({e.msg}, column {e.colno}); repair or delete that line") from None
        if not isinstance(row, dict) or (missing := [k for k in _ROW_KEYS if k not in row]):
            what = f"lacks {', '.join(missing)}" if isinstance(row, dict) else f"is a JSON {type(row).__name__}"
            raise ResultsError(f"{path}:{i + 1}: not a result row (it {what}); repair or delete that line")
        rows.append(row)
    return rows


# ---- the run context handed to every suite ---------------------------------------------------


@dataclass
class Context:
    """What a suite's `run(ctx, layers)` gets: the preset, the seed, where to record, where
    to cache trained models, the device, whether to print what it measures, and where to
    report its progress (`advance`, one call per unit of work its `work(ctx, layer)` counts)."""

    preset: Preset
    seed: int
    recorder: Recorder
    work_dir: Path  # trained models and other caches of this preset live here
    device: str = "cpu"
    progress: bool = True
    on_work: Callable[[int, str], None] | None = None  # (units done, what runs now): the bench's progress bar
    resume: bool = False  # skip what is already recorded with the same config and seed
    _doing: str = field(default="", init=False, repr=False)  # what runs now and its units done (a toy cell's
    _step: int = field(default=0, init=False, repr=False)  # steps): where a failure happened

    def record(self, suite: str, layer: str, setting: dict, metrics: dict, config: dict, wall_s: float,
               seed: int | None = None) -> dict:
        return self.recorder.add(suite, layer, setting, metrics, config, wall_s, seed)

    def recorded(self, suite: str, layer: str, setting: dict, config: dict, seed: int | None = None) -> dict | None:
        """With `resume`, the row already recorded for this measurement (same `protocol_hash` and
        seed), which the suite then skips; None otherwise."""
        return self.recorder.find(suite, layer, setting, config, seed) if self.resume else None

    def advance(self, units: int, doing: str) -> None:
        """`units` units of work are done; `doing` says what runs now."""
        self._step = self._step + units if doing == self._doing else units
        self._doing = doing
        if self.on_work is not None:
            self.on_work(units, doing)

    def fail(self, suite: str, layer: str, part, exc: BaseException) -> dict:
        """A measurement that raised: its traceback appended to ``<work dir>/logs/<run id>.log``, one
        line saying which and where on stderr, and a row of suite ``failed`` (no table reads it;
        ``--resume`` measures the cell again)."""
        import sys
        import traceback

        log = self.work_dir / "logs" / f"{self.recorder.run_id}.log"
        what = " ".join(map(str, part)) if part else "(all of it)"
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "a") as f:
                f.write(f"== {suite} {layer} {what}, in {self._doing!r} at unit {self._step}\n")
                f.write("".join(traceback.format_exception(exc)) + "\n")
        except OSError:  # a full disk: the line on stderr below still says which and why
            log = "(not written: the disk is full?)"
        error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
        print(f"memzoo bench: FAILED {suite} {layer} {what} in {self._doing or suite!r} at step {self._step}: "
              f"{error} (traceback: {log})", file=sys.stderr, flush=True)
        setting = {"suite": suite, "part": list(part) if part else None}
        metrics = {"error": error, "where": self._doing, "step": self._step, "log": str(log)}
        try:
            return self.recorder.add("failed", layer, setting, metrics, setting, 0.0)
        except OSError as e:  # the failure row cannot be written either (the disk is full): said, not raised
            print(f"memzoo bench: the failure could not be recorded ({e}); --resume measures the cell again",
                  file=sys.stderr, flush=True)
            return {"suite": "failed", "layer": layer, "setting": setting, "metrics": metrics}


# ---- intervals, shared by measuring (a row's own interval) and the report -----------------------


# t_{0.975, n-1} for 95% intervals over n = 2..11 values (above: the normal 1.96)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def mean_ci(values) -> tuple[float, float]:
    """(mean, half-width of its 95% t-interval) of a few values (seeds, samples); half-width 0
    for a single value, NaN mean for none."""
    vals = [float(v) for v in values]
    n = len(vals)
    if n == 0:
        return float("nan"), float("nan")
    m = sum(vals) / n
    if n == 1:
        return m, 0.0
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (n - 1))
    return m, (_T975[n - 2] if n - 2 < len(_T975) else 1.96) * sd / math.sqrt(n)


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval (lo, hi) of a proportion, hits out of n (exact-match
    accuracy over samples): unlike mean ± t it stays inside [0, 1] and is not empty at 0 or n."""
    if n == 0:
        return float("nan"), float("nan")
    p = hits / n
    mid, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (mid - half) / (1 + z * z / n)), min(1.0, (mid + half) / (1 + z * z / n))


def logit_ci(values, ns=None) -> tuple[float, float, float]:
    """(mean, lo, hi) of a few proportions, one per training seed: their mean and the 95%
    t-interval (`mean_ci`) of their logits mapped back, each value first clipped to
    [0.5/n, 1 - 0.5/n] (n: its row's sample count in `ns`; 1e-3 and 1 - 1e-3 where unknown) so
    that 0 and 1 have a logit, and widened to hold the mean where that clip leaves it out (seeds
    that agree at 0 or 1). Unlike mean ± t over so few values it stays inside [0, 1]."""
    vals = [float(v) for v in values]
    if not vals:
        return float("nan"), float("nan"), float("nan")
    ns = [None] * len(vals) if ns is None else list(ns)
    logits = []
    for v, n in zip(vals, ns):
        eps = 0.5 / float(n) if n is not None and not math.isnan(float(n)) and n > 0 else 1e-3
        p = min(max(v, eps), 1 - eps)
        logits.append(math.log(p / (1 - p)))
    m, h = mean_ci(logits)
    mean = sum(vals) / len(vals)
    lo, hi = _sigmoid(m - h), _sigmoid(m + h)
    return mean, min(lo, mean), max(hi, mean)


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))
