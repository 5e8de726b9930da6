"""The language models of the ppl and niah suites: one per (preset, layer, seed), shared by the
two suites unless the niah suite trains its own (`niah.lm`).

Every layer's LM is the preset's backbone with that layer plugged in, trained with the
preset's `lm:` settings on the same batches: the training split of the corpus, without
Shakespeare's Sonnets (the ppl suite's short-document corpus, so it stays unseen). For the
CPU presets a fraction `niah.train_mix` of the training windows are needle samples (a short
haystack with key-value needles and a question, `memzoo.data.niah.NeedleMix`), their answer
tokens weighted `niah.answer_weight` in the loss: a 1M-parameter model trained for minutes
never meets the question format in plain text, and with the plain loss it does not learn to
copy the answer, so without them the NIAH numbers would measure nothing. The paper preset
trains on plain text (train_mix 0). With the baseline come the controls' LMs (`models`: full
attention with a short convolution, and no token mixer) where `niah.controls` is on.

`niah.lm` (the standard preset): the niah suite's LMs are trained apart, with the preset's
`train:` section changed by it (shorter windows, more steps) and the needle mixture, and the
ppl suite's LMs read plain text: at this scale an LM that must both model text and learn to
copy needles learnt neither well enough (bench/suites/niah.py, "The positive control").

`ppl.repeat_mix` (the standard preset): a fraction of the ppl LMs' training windows read a
passage twice (:class:`memzoo.data.RepeatMix`), so that they learn to copy, which the ppl suite's
repeated-passage probe needs (bench/suites/ppl.py).

`ppl.document_order` (the standard preset): the ppl LMs of layers whose fast weights persist
across sequences (FwPKM's) read their documents in order, each batch row continuing where it
ended in the previous batch (:class:`memzoo.data.DocumentStream`), as the paper trains them, so
the fast weights a step starts from hold the preceding text of the same documents. The other
LMs read random windows: they carry nothing from one step to the next.

`ppl.host` (the attach preset): the LMs are not memzoo's backbone but a Hugging Face causal LM, the
model a user already has (:mod:`memzoo.attach`). The host (random-init from `host.config`, e.g. a
Llama) is pretrained `host.steps` steps on the recipe below, once per seed; then every LM trains the
preset's `train.steps` further, everything trainable: the baseline is the host itself, a layer's LM
the host with that layer attached where the preset places it (`layers:`, its options), so that each
memory is compared with the same model trained equally long without one. Where the ppl suite's probe
runs, its positive control is the baseline's LM reading with its KV cache carried.

A trained LM is cached under ``<work_dir>/lm/<layer>-<hash>/`` (the hash covers the model,
the training settings, the mixture and the seed), so the suites of one run, and later runs
with the same settings, train it once. Its files (model.pt, lm.json) are written atomically,
lm.json last: a directory with lm.json holds a complete LM; one without is trained again
from scratch (over any checkpoint a killed training left).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from memzoo.backbone.model import HybridLM
from memzoo.bench.common import BASELINE, Context, config_hash, lm_train_config, model_config
from memzoo.bench.registry import get_suite
from memzoo.config import RunConfig
from memzoo.storage import load_tensors, torch_save, write_text

HELD_OUT_TITLES = ("Sonnets",)  # the ppl suite's short-document corpus comes from these
_loaded: dict[str, tuple[HybridLM, dict]] = {}


def _settings(ctx: Context, suite: str):
    """The preset's settings of `suite` (niah or ppl, whose sections set the LMs' mixture and backbone), by
    the suites' registry: those suites import this module, so it imports neither."""
    return ctx.preset.settings(suite, get_suite(suite).settings)


def _niah(ctx: Context):
    return _settings(ctx, "niah")


def _mixture(ctx: Context, suite: str) -> dict:
    """The training mixture of `suite`'s LMs: the niah suite's needle windows, for the LMs the
    suites share, or only for niah's own where it has them (`niah.lm`; ppl's LMs then read
    plain text); and the ppl suite's repeated passages (`ppl.repeat_mix`) for ppl's LMs."""
    s = _niah(ctx)
    rep = _settings(ctx, "ppl").repeat_mix
    rep = {"repeat_mix": rep} if rep and not (s.lm and suite == "niah") else {}
    if s.lm and suite != "niah":
        return {"train_mix": 0.0, **rep}
    return {"train_mix": s.train_mix, **({"answer_weight": s.answer_weight} if s.answer_weight != 1 else {}), **rep}


def persistent(rc: RunConfig) -> bool:
    """Whether the model of `rc` has a memory whose fast weights outlive a sequence (FwPKM's,
    shared by the batch and kept across steps, as the paper trains it; PKM's slow memory has none)."""
    with torch.device("meta"):
        return any(not m.per_sequence and len(m.state) > 0 for m in HybridLM(rc.model).memories())


def host(ctx: Context, suite: str) -> dict:
    """`ppl.host` of the ppl suite's LMs ({} where they are memzoo's backbone)."""
    return _settings(ctx, "ppl").host if suite == "ppl" else {}


def models(ctx: Context, layer: str, suite: str = "ppl") -> list[str]:
    """The LMs `suite` evaluates for `layer`: the layer's, the niah suite's variants of it
    (`niah.variants`), and with the baseline the controls' where the niah suite's `controls` is on
    (with a host: the positive control, the host reading with its KV cache)."""
    from memzoo.bench.common import BASELINE, CONTROLS, POSITIVE

    if host(ctx, suite):  # the positive control reads the probe, where there is one
        return [layer, *((POSITIVE,) if layer == BASELINE and _settings(ctx, "ppl").passages else ())]
    s = _niah(ctx)
    variants = sorted(n for n, v in s.variants.items() if v["layer"] == layer) if suite == "niah" else []
    controls = layer == BASELINE and s.controls
    return [layer, *variants, *(CONTROLS if controls else ())]


def backbone(ctx: Context, suite: str) -> dict:
    """The backbone changes of `suite`'s LMs (`<suite>.model`): ppl's, and niah's own where it
    trains its own LMs (`niah.lm`); without them niah evaluates ppl's LMs, so it takes ppl's."""
    from memzoo.config import ConfigError

    s = _niah(ctx)
    if s.model and not s.lm:
        raise ConfigError("niah.model needs niah.lm: without LMs of its own the niah suite evaluates the ppl suite's")
    return s.model if suite == "niah" and s.lm else _settings(ctx, "ppl").model


def lm_config(ctx: Context, layer: str, suite: str = "ppl") -> tuple[RunConfig, dict, str]:
    """The run config of `layer`'s LM for `suite` (a layer, a niah variant or a control), its
    needle mixture, and the cache key."""
    mix = _mixture(ctx, suite)
    own = _niah(ctx).lm if suite == "niah" else {}
    tc = lm_train_config(ctx.preset, seed=ctx.seed, device=ctx.device, **own)
    if h := host(ctx, suite):
        from memzoo.bench.common import POSITIVE

        name = BASELINE if layer == POSITIVE else layer  # the control is the baseline's LM, read with its cache
        rc = RunConfig(model_config(ctx.preset, BASELINE), tc)  # the corpus's vocabulary; the host is the model
        mix = {**mix, "host": h, "attach": attach_specs(ctx, name)}
        key = config_hash({**identity(rc, mix), "held_out": HELD_OUT_TITLES, "version": 1})
        rc.train.out_dir = str(Path(ctx.work_dir) / "lm" / f"host-{name.replace('/', '-')}-{key}")
        return rc, mix, key
    variant = _niah(ctx).variants.get(layer) if suite == "niah" else None
    rc = RunConfig(model_config(ctx.preset, layer, variant, **backbone(ctx, suite)), tc)
    if suite == "ppl" and _settings(ctx, "ppl").document_order and persistent(rc):
        mix["document_order"] = True
    key = config_hash({**rc.to_dict(), **mix, "held_out": HELD_OUT_TITLES, "version": 1})
    rc.train.out_dir = str(Path(ctx.work_dir) / "lm" / f"{layer.replace('/', '-')}-{key}")
    return rc, mix, key


def attach_specs(ctx: Context, layer: str) -> list[str]:
    """`layer` as `memzoo train --attach` specs: where the preset places it, with its options (none for
    the baseline)."""
    from memzoo.bench.common import LayerSpec
    from memzoo.config import ConfigError

    if layer == BASELINE:
        return []
    spec = ctx.preset.layers.get(layer, LayerSpec())
    bad = sorted(k for k, v in spec.options.items() if isinstance(v, (list, dict)) or (isinstance(v, str) and "," in v))
    if bad:
        raise ConfigError(f"ppl.host: {layer}'s options {bad} are not scalars, which an --attach spec cannot carry")
    opts = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(spec.options.items()))
    return [f"{layer}{'@' + spec.at if spec.at else ''}{':' + opts if opts else ''}"]


def identity(rc: RunConfig, mix: dict) -> dict:
    """What an LM is, as its rows record it (`lm` in their config): its run config and its mixture; with a
    host, the host and the attached specs in place of the backbone's model section."""
    d = rc.to_dict()
    d["train"].pop("out_dir")  # where it is kept, not what it is (common.LOCATIONS)
    if "host" in mix:
        d.pop("model")
    return {**d, **mix}


def recorded(ctx: Context, suite: str, layer: str, settings: list[dict], own: dict) -> list[dict] | None:
    """With `ctx.resume` (a dry run's too), the rows `suite` already recorded for `layer`'s
    LM at every one of `settings` (same `protocol_hash` and seed: the LM's config, as `shared_lm` records it,
    plus `own`, the suite's settings), which a resumed run then neither trains nor evaluates again;
    None where one is missing."""
    if not ctx.resume:
        return None
    rc, mix, _ = lm_config(ctx, layer, suite)
    config = {"lm": identity(rc, mix), **own}
    rows = [ctx.recorded(suite, layer, setting, config) for setting in settings]
    return rows if all(rows) else None


def untrained_steps(ctx: Context, layer: str, suites: list[str]) -> int:
    """The training steps `shared_lm` will run for `layer`'s LMs (see `models`) in `suites`:
    none for one that is cached, and each LM once."""
    steps = {}
    for suite in suites:
        for name in models(ctx, layer, suite):
            rc, mix, _ = lm_config(ctx, name, suite)
            done = str(rc.train.out_dir) in _loaded or (Path(rc.train.out_dir) / "lm.json").exists()
            steps[str(rc.train.out_dir)] = 0 if done else rc.train.steps
            if "host" in mix and not done:  # its pretraining, once for every LM of the seed
                pre = _host_dir(ctx, rc, mix)
                steps[str(pre)] = 0 if (pre / "lm.json").exists() else mix["host"]["steps"]
    return sum(steps.values())


def _host_dir(ctx: Context, rc: RunConfig, mix: dict) -> Path:
    """Where the seed's pretrained host is cached: the hash of its recipe (the host, the training settings
    but its steps and out dir, the data mixture), which every LM of the seed shares."""
    tc = {k: v for k, v in rc.train.to_dict().items() if k not in ("out_dir", "steps")}
    data = {k: v for k, v in mix.items() if k != "attach"}
    return Path(ctx.work_dir) / "lm" / f"host-{config_hash({'train': tc, **data, 'version': 1})}"


class _Later:
    """A training stream `offset` steps on: the arms train on the batches after the host's pretraining."""

    def __init__(self, stream, offset: int):
        self.stream, self.offset = stream, offset

    def batch(self, step: int, batch_size: int):
        return self.stream.batch(step + self.offset, batch_size)


def _pretrained_host(ctx: Context, rc: RunConfig, mix: dict, data, progress) -> str:
    """The seed's host (`ppl.host`), random-init from its config and pretrained `h["steps"]` steps on the
    recipe and `data` (the mixture `mix` names), trained on first use and cached: its `save_pretrained`
    directory. The seed's LMs train in parallel workers: a lock lets one pretrain while the others wait."""
    import fcntl

    import transformers as tf

    from memzoo.train import train

    h = mix["host"]
    out = _host_dir(ctx, rc, mix)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "lm.json").exists():
            torch.manual_seed(ctx.seed)
            cfg = tf.AutoConfig.for_model(**h["config"], vocab_size=rc.model.vocab_size)
            tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(out / "init")
            pre = RunConfig(rc.model, type(rc.train).from_dict({**rc.train.to_dict(), "steps": h["steps"], "out_dir": str(out)}))
            result = train(pre, data=data, progress=False, overwrite=True, on_step=progress("host"),
                           base={"from": str(out / "init"), "attach": [], "train_base": True})
            (out / "ckpt.pt").unlink(missing_ok=True)
            write_text(out / "lm.json", json.dumps({"val_loss": result["val_loss"], "steps": result["step"]}, indent=1))
    return str(out / "hf")


def _cached(out: Path, rc, device: str) -> HybridLM | None:
    """The LM cached in `out`, or None when its files do not load (truncated by a kill or a full
    disk, or damaged): they are moved aside to ``<out>.damaged-N`` with a warning, and the LM is
    trained again."""
    import warnings

    try:
        info = json.loads((out / "lm.json").read_text())
        if (out / "hf").is_dir():  # a host's LM (ppl.host): with its memory attached, or the host alone
            import transformers as tf

            from memzoo.attach import TrainingView, from_pretrained, saved_model_dir

            hf = str(out / "hf")
            model = TrainingView(from_pretrained(hf) if saved_model_dir(hf) else tf.AutoModelForCausalLM.from_pretrained(hf))
            model = model.to(device)
        else:
            model = HybridLM(rc.model).to(device)
            model.load_state_dict(load_tensors(out / "model.pt", map_location=device))
        if not isinstance(info, dict):
            raise ValueError("lm.json is not a mapping")
        return model
    except (OSError, ValueError, RuntimeError) as e:  # json errors are ValueErrors
        n = 0
        while (aside := out.with_name(f"{out.name}.damaged-{n}")).exists():
            n += 1
        out.rename(aside)
        out.mkdir(parents=True)
        warnings.warn(f"the cached LM in {out} does not load ({' '.join(str(e).split())[:200]}); moved to {aside}, "
                      "training it again", stacklevel=3)
        return None


def shared_lm(ctx: Context, layer: str, suite: str = "ppl") -> tuple[HybridLM, dict]:
    """`layer`'s trained LM for `suite` (eval mode) and what its training did (losses, steps,
    wall time); the ppl and niah suites share one unless the niah suite has its own (`niah.lm`).
    Persistent fast weights (FwPKM's) are those at the end of training; callers that change
    them restore a snapshot."""
    from memzoo.train import prepare_data, train

    rc, mix, _ = lm_config(ctx, layer, suite)
    out = Path(rc.train.out_dir)
    if str(out) in _loaded:
        return _loaded[str(out)]
    done = out / "lm.json"
    model = _cached(out, rc, ctx.device) if done.exists() else None
    if model is not None:
        info = json.loads(done.read_text())
    else:
        t0 = time.time()
        data = prepare_data(rc, leave_out=HELD_OUT_TITLES, needle_mix=mix["train_mix"], answer_weight=mix.get("answer_weight", 1.0),
                            repeat_mix=mix.get("repeat_mix", 0.0), document_order=mix.get("document_order", False))

        def progress(what):
            return lambda r: ctx.advance(1, f"lm {what} step {r['step']} loss {r['loss']:.3f}")

        base = None
        if "host" in mix:  # the seed's pretrained host, then this LM's further training on the batches after it
            base = {"from": _pretrained_host(ctx, rc, mix, data, progress), "attach": mix["attach"], "train_base": True}
            data = (_Later(data[0], mix["host"]["steps"]), *data[1:])
        result = train(rc, data=data, progress=False, overwrite=True, on_step=progress(layer),
                       base=base)
        model = result["model"]
        info = {
            "train_loss": result["train_loss"],
            "val_loss": result["val_loss"],
            "unigram_entropy": result["unigram_entropy"],
            "steps": result["step"],
            "train_wall_s": round(time.time() - t0, 1),
            "params": sum(p.numel() for p in model.parameters()),
            "tokens": result["step"] * rc.train.batch_size * rc.train.grad_accum * rc.train.seq_len,
            **mix,
            "config": identity(rc, mix),
        }
        if base is None:  # a host's LM is in out/hf (save_pretrained)
            torch_save(model.state_dict(), out / "model.pt")
        (out / "ckpt.pt").unlink(missing_ok=True)  # the optimizer state is not needed again
        write_text(done, json.dumps(info, indent=1))
    model.eval()
    _loaded[str(out)] = (model, info)
    return model, info
