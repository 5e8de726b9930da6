"""The toys suite's plan: the cells a run trains (layer and its variants, task, width, seed), their configs
(whose hash a resumed run matches), their cost for the engines, and the run that measures them."""

from __future__ import annotations

from memzoo.bench.common import BASELINE, CONTROLS, Context
from memzoo.config import ModelConfig
from memzoo.registry import get_layer

from .cell import measure
from .lr import MAX_BEYOND
from .models import check_route, toy_config
from .settings import BETAS, NAME, Settings
from .tasks import TASK_TYPES, Task


def cell_config(mc: ModelConfig, task: str, s: Settings, layer: str) -> dict:
    """Everything one cell's numbers depend on (its hash decides whether a resumed run skips it)."""
    data = TASK_TYPES[task].data(s)
    keep = ("max_steps", "min_steps", "eval_every", "patience", "min_delta", "loss_delta", "target", "batch_size", "warmup",
            "min_lr_ratio", "weight_decay", "grad_clip", "precision", "compile", "val_size", "test_size", "solve_on")
    train = {k: getattr(s, k) for k in keep}
    config = {"model": mc.to_dict(), "task": task, "data": data, "lrs": s.candidates(layer), "train": train,
              "optimizer": f"AdamW({BETAS[0]}, {BETAS[1]}), warmup + cosine", "version": 3,
              # 3: no plateau stop while the loss falls; an lr chosen at the grid's edge tries the next beyond it
              "lr_beyond_edge": MAX_BEYOND}
    if len(s.candidates(layer)) > 1:  # a grid at chance at every lr tries one lr past each edge (`search`);
        config["lr_beyond_chance"] = 1  # one lr given is never extended, so its config (and hash) has no such key
    if any(get_layer(name).needs_targets for name in mc.memory):  # FWL learns from the next tokens, not the
        config["memory_targets"] = "next"  # task's labels (HybridLM.forward)
    return config


def cell_key(ctx: Context, s: Settings, name: str, task: str, width: int, seed: int) -> tuple:
    """(model config, config, setting, the row already recorded or None) of one cell."""
    mc = toy_config(ctx.preset, name, width, TASK_TYPES[task].vocab_of(s), s)
    check_route(mc, name, s)
    config, setting = cell_config(mc, task, s, name), {"task": task, "d_model": width, "route": s.route}
    done = ctx.recorded(NAME, name, setting, config, seed)
    for preset in s.reuse if ctx.resume else ():  # the same cell measured under another preset
        done = done or ctx.recorder.find(NAME, name, setting, config, seed, preset=preset)
    return mc, config, setting, done


def models_of(layer: str, s: Settings) -> list[str]:
    """The models one layer's run trains: the layer and its variants (unless ``run_variants`` is
    off), and with the baseline the controls; a variant named alone (``--layers fwpkm/token``), only itself."""
    if layer in s.variants:
        return [layer]
    variants = sorted(n for n, v in s.variants.items() if v["layer"] == layer) if s.run_variants else []
    return [layer, *variants, *(CONTROLS if layer == BASELINE and s.controls else ())]


def work(ctx: Context, layer: str) -> int:
    """Units of work for the progress bar: the training steps of one layer at the cap (a cell
    that stops early counts the rest at once)."""
    s = ctx.preset.settings(NAME, Settings)
    per = len(s.tasks) * s.seeds * s.max_steps
    return sum(per * len(s.widths_of(m)) * len(s.candidates(m)) for m in models_of(layer, s))


def cells(ctx: Context, layers: list[str]):
    """Every cell of `layers` in run order: (model name, task, width, seed)."""
    s = ctx.preset.settings(NAME, Settings)
    for layer in layers:
        for name in models_of(layer, s):
            for tname in s.tasks:
                for width in s.widths_of(name):
                    for seed in range(ctx.seed, ctx.seed + s.seeds):
                        yield name, tname, width, seed


def parts(ctx: Context, layer: str) -> list[tuple[tuple, float, tuple]]:
    """The cells of one layer's run, each a part that `run(ctx, [layer], only=[part])` measures alone
    (`memzoo bench` hands them to whichever worker is free), with its relative cost (the training
    tokens at the cap, a step's batch times the task's mean length, in steps of MQAR's batch) and
    its group: the cells of one model, task and width, which differ only in the seed and so
    compile the same graphs. A cell already recorded (with resume) compiles nothing and has no
    group, so that the first of its group still to run goes first and the later ones load its
    graphs from the run's cache (docs/journal/bench.md: two workers had compiled the same graphs at once)."""
    s = ctx.preset.settings(NAME, Settings)
    tokens = {t: TASK_TYPES[t].mean_length(s) for t in s.tasks}
    return [(cell, s.max_steps * len(s.candidates(cell[0])) * tokens[cell[1]] / s.mqar_seq_len,
             None if cell_key(ctx, s, *cell)[3] is not None else cell[:3])
            for cell in cells(ctx, [layer])]


def run(ctx: Context, layers: list[str], only: list[tuple] | None = None) -> list[dict]:
    """Train and evaluate every (layer, task, width, seed), or only the cells in `only`; one row
    each. With `ctx.resume`, a cell already recorded with the same config and seed is skipped
    (its row is returned)."""
    s = ctx.preset.settings(NAME, Settings)
    s.check()
    tasks: dict[str, Task] = {}
    rows = []
    for name, tname, width, seed in cells(ctx, layers):
        if only is not None and (name, tname, width, seed) not in only:
            continue
        mc, config, setting, done = cell_key(ctx, s, name, tname, width, seed)
        if done is not None:
            rows.append(done)
            ctx.advance(s.max_steps * len(s.candidates(name)), f"toys {name} (recorded)")
            continue
        if tname not in tasks:  # built on first use: its validation and test sets take a moment
            tasks[tname] = TASK_TYPES[tname](s)
        rows.append(measure(ctx, name, tasks[tname], width, mc, config, setting, s, seed))
    return rows

