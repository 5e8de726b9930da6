"""One toys cell measured into its row: the lrs `search` asks for, the test sets, the state and the metrics."""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from memzoo.backbone.model import HybridLM
from memzoo.bench.common import Context, config_hash
from memzoo.storage import torch_save

from .lr import at_chance, lr_grid, search
from .models import state_size
from .settings import NAME, Settings
from .tasks import Task, slice_name
from .training import Training, evaluate, left_chance_at, train_cell


def train_lrs(ctx: Context, layer: str, task: Task, width: int, mc, s: Settings, seed: int, stem: str) -> dict:
    """{lr: Training} of every lr `search` asks for. Under the work dir, each lr's finished training
    is kept (``STEM-lrLR.done.pt``) until the row is recorded and the one in progress is
    checkpointed (`train_cell`), so a stopped cell continues where it stopped."""
    ckpt_dir = ctx.work_dir / "cells"
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    def train_at(lr: float) -> Training:
        doing = f"toys {layer} {task.name} d={width} seed {seed} lr={lr:g}"
        done = ckpt_dir / f"{stem}-lr{lr:g}.done.pt"  # an lr this cell trained already (a resumed cell skips it)
        if done.is_file():
            d = torch.load(done, map_location=ctx.device, weights_only=False)
            model = HybridLM(mc).to(ctx.device)
            model.load_state_dict(d.pop("model"))
            tr = Training(model, **d)
        else:
            tr = train_cell(mc, task, lr, s, seed, ctx.device, lambda d=doing: ctx.advance(1, d),
                            ckpt_dir / f"{stem}-lr{lr:g}.pt")
            torch_save({"model": tr.model.state_dict(), **{k: v for k, v in vars(tr).items() if k != "model"}}, done)
        ctx.advance(s.max_steps - tr.steps, doing)  # the steps an early stop saved
        return tr

    return search(s.candidates(layer), train_at, task.chance)


def metrics_of(trainings: dict, acc: dict, test_s: float, task: Task, origin: str) -> dict:
    """A cell's metrics from its trainings by lr and the chosen model's test accuracy by slice (scored in
    `test_s` seconds); a cell
    at chance at every lr it tried chooses none (`lr` is then the best of noise)."""
    lr, edge = lr_grid(trainings)
    tr = trainings[lr]
    none_left = at_chance(trainings, task.chance)
    left = {f"{k:g}": left_chance_at(t.history, task.chance) for k, t in trainings.items()}
    return {
        "accuracy": round(sum(acc.values()) / len(acc), 4),
        "acc_by_kv": {slice_name(n): round(a, 4) for n, a in acc.items()},
        "val_accuracy": round(tr.val, 4),
        "lr": lr,
        "lr_from": origin,
        "lr_chosen": not none_left,  # at chance at every lr: no lr is chosen (the best of noise is kept)
        "lr_at_edge": edge and len(trainings) > 1 and not none_left,  # one lr given: a choice, not a grid
        "val_by_lr": {f"{k:g}": round(t.val, 4) for k, t in sorted(trainings.items())},
        "steps": tr.steps,
        "sequences": task.sequences(tr.steps),  # the budget the chosen lr's training used
        "left_chance_at": left[f"{lr:g}"],  # sequences trained before validation first left chance (None: never)
        "left_chance_at_by_lr": dict(sorted(left.items(), key=lambda kv: float(kv[0]))),
        "stop": tr.stop,
        "converged": tr.stop in ("solved", "plateau"),
        "train_loss": round(tr.train_loss, 4),
        # the chosen lr's validation curve; the others' means (the learning-curve figure, "left chance at")
        "history": tr.history,
        "val_history_by_lr": {f"{k:g}": [h["val"] for h in t.history] for k, t in sorted(trainings.items())},
        "tokens_per_s": round(tr.tokens_per_s),
        # where the cell's wall time went (every lr candidate's training): the first step of each
        # input shape (compiles, with `compile`) and the evaluations (validation and test)
        "compile_s": round(sum(t.compile_s for t in trainings.values()), 3),
        "eval_s": round(sum(t.eval_s for t in trainings.values()) + test_s, 3),
        "chance": task.chance,
    }


def measure(ctx: Context, layer: str, task: Task, width: int, mc, config: dict, setting: dict, s: Settings,
            seed: int) -> dict:
    """Train the cell at its lrs (`train_lrs`), score the chosen model on the test sets, record its row."""
    t0 = time.perf_counter()
    stem = f"{config_hash(config)}-{layer.replace('/', '_').replace(':', '_')}-s{seed}"
    trainings = train_lrs(ctx, layer, task, width, mc, s, seed, stem)
    model = trainings[lr_grid(trainings)[0]].model
    t_test = time.perf_counter()
    acc = evaluate(model, task.test, task.eval_batch)
    t_test = time.perf_counter() - t_test
    x, y = task.test[task.slices[0]]
    with torch.no_grad():  # a forward, so that every memory holds its state
        model.eval()(x[:2].to(ctx.device), targets=y[:2].to(ctx.device))
    metrics = metrics_of(trainings, acc, t_test, task, s.origin(layer))
    metrics.update(**state_size(model, task.seq_len), params=sum(p.numel() for p in model.parameters()))
    row = ctx.record(NAME, layer, setting, metrics, config, time.perf_counter() - t0, seed=seed)
    for done in (ctx.work_dir / "cells").glob(f"{stem}-lr*.done.pt"):  # the row holds them now
        done.unlink()
    if ctx.progress:
        m, left_at = metrics, metrics["left_chance_at"]
        tqdm.write(f"toys {layer:>14} {task.name:>4} d={width:<4} seed {seed}: test {m['accuracy']:.3f} "
                   f"(val {m['val_accuracy']:.3f}, lr {m['lr']:g}, {m['steps']} steps, {m['stop']}; "
                   + (f"left chance at {left_at} sequences)" if left_at else f"at chance through {m['sequences']} sequences)"))
    return row
