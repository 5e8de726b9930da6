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
from memzoo.bench.common import Context, config_hash, lm_train_config, model_config
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


def models(ctx: Context, layer: str, suite: str = "ppl") -> list[str]:
    """The LMs `suite` evaluates for `layer`: the layer's, the niah suite's variants of it
    (`niah.variants`), and with the baseline the controls' where the niah suite's `controls` is on."""
    from memzoo.bench.common import BASELINE, CONTROLS

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
    variant = _niah(ctx).variants.get(layer) if suite == "niah" else None
    rc = RunConfig(model_config(ctx.preset, layer, variant, **backbone(ctx, suite)), tc)
    if suite == "ppl" and _settings(ctx, "ppl").document_order and persistent(rc):
        mix["document_order"] = True
    key = config_hash({**rc.to_dict(), **mix, "held_out": HELD_OUT_TITLES, "version": 1})
    rc.train.out_dir = str(Path(ctx.work_dir) / "lm" / f"{layer.replace('/', '-')}-{key}")
    return rc, mix, key


def recorded(ctx: Context, suite: str, layer: str, settings: list[dict], own: dict) -> list[dict] | None:
    """With `ctx.resume` (a dry run's too), the rows `suite` already recorded for `layer`'s
    LM at every one of `settings` (same config hash and seed: the LM's config, as `shared_lm` records it,
    plus `own`, the suite's settings), which a resumed run then neither trains nor evaluates again;
    None where one is missing."""
    if not ctx.resume:
        return None
    rc, mix, _ = lm_config(ctx, layer, suite)
    config = {"lm": {**rc.to_dict(), **mix}, **own}
    rows = [ctx.recorded(suite, layer, setting, config) for setting in settings]
    return rows if all(rows) else None


def untrained_steps(ctx: Context, layer: str, suites: list[str]) -> int:
    """The training steps `shared_lm` will run for `layer`'s LMs (see `models`) in `suites`:
    none for one that is cached, and each LM once."""
    steps = {}
    for suite in suites:
        for name in models(ctx, layer, suite):
            rc, _, _ = lm_config(ctx, name, suite)
            done = str(rc.train.out_dir) in _loaded or (Path(rc.train.out_dir) / "lm.json").exists()
            steps[str(rc.train.out_dir)] = 0 if done else rc.train.steps
    return sum(steps.values())


def _cached(out: Path, rc, device: str) -> HybridLM | None:
    """The LM cached in `out`, or None when its files do not load (truncated by a kill or a full
    disk, or damaged): they are moved aside to ``<out>.damaged-N`` with a warning, and the LM is
    trained again."""
    import warnings

    try:
        info = json.loads((out / "lm.json").read_text())
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
        doing = lambda r: f"lm {layer} step {r['step']}/{rc.train.steps} loss {r['loss']:.3f}"  # noqa: E731
        result = train(rc, data=data, progress=False, overwrite=True, on_step=lambda r: ctx.advance(1, doing(r)))
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
            "config": {**rc.to_dict(), **mix},
        }
        torch_save(model.state_dict(), out / "model.pt")
        (out / "ckpt.pt").unlink(missing_ok=True)  # the optimizer state is not needed again
        write_text(done, json.dumps(info, indent=1))
    model.eval()
    _loaded[str(out)] = (model, info)
    return model, info
