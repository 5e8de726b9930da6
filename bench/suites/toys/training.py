"""One training of a toys cell at one lr: to convergence or the cap, with checkpoints (protocol step 2)."""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memzoo.backbone.model import HybridLM
from memzoo.config import ModelConfig, TrainConfig
from memzoo.data import mqar
from memzoo.storage import torch_save
from memzoo.train import fit, lr_at, make_step, optimizer

from .settings import BETAS, Settings
from .tasks import Task, slice_name


@torch.no_grad()
def evaluate(model: HybridLM, sets: dict, batch_size) -> dict:
    """Accuracy on the labelled positions of each set, in batches of the training batch size
    (an int, or a function of the set's key), each batch starting from the model's persistent
    fast weights as they are now (restored after)."""
    was = model.training
    model.eval()
    start = model.memory_state(persistent_only=True)
    dev = model.embed.weight.device
    out = {}
    for n, (x, y) in sets.items():
        hits = total = 0
        bs = batch_size(n) if callable(batch_size) else batch_size
        for i in range(0, len(x), bs):
            model.load_memory_state(start)
            xc, yc = x[i : i + bs].to(dev), y[i : i + bs].to(dev)
            # with targets, as in training: FWL learns from the sequence's next tokens (HybridLM.forward)
            logits = model(xc, targets=yc).logits
            mask = yc != mqar.IGNORE
            hits += (logits.argmax(-1)[mask] == yc[mask]).sum().item()
            total += mask.sum().item()
        out[n] = hits / total
    model.load_memory_state(start)
    model.train(was)
    return out


@dataclass
class Training:
    """One lr's training of a cell: the model at its best validation score, and how the training went."""

    model: HybridLM
    val: float  # best validation accuracy (mean over slices)
    steps: int  # training steps taken
    stop: str  # solved | plateau | chance | capped | diverged
    train_loss: float  # mean of the last eval_every steps
    tokens_per_s: float  # training tokens over the time of the training steps alone (the first of each shape left out)
    compile_s: float = 0.0  # the first step of each input shape: compiles with `compile` (cold, or from the cache)
    eval_s: float = 0.0  # the validation evaluations
    history: list = field(default_factory=list)  # one entry per evaluation: {step, sequences, val, by_slice, train_loss}


#: seconds between a cell's checkpoints (`train_cell`)
CHECKPOINT_EVERY_S = 60.0


def falling(losses: list[float], s: Settings) -> bool:
    """Whether the training loss still falls: the mean over the last ``patience * eval_every`` steps
    is more than ``loss_delta`` (a fraction) below the mean over as many steps before them (or over
    all before, early on)."""
    w = min(s.patience * s.eval_every, len(losses) // 2)
    if w == 0:
        return True
    last, before = sum(losses[-w:]) / w, sum(losses[-2 * w : -w]) / w
    return last < before * (1 - s.loss_delta)


def train_cell(mc: ModelConfig, task: Task, lr: float, s: Settings, seed: int, device: str = "cpu",
               on_step=None, checkpoint: Path | None = None) -> Training:
    """Train one model from seed `seed` (the same initialisation and batches for every layer and
    lr) until it converges or hits the cap (the suite's docstring, step 2); `on_step()` after each step.
    The model returned holds the weights of its best validation score. With `checkpoint`, the
    training state (weights, optimizer, data generator, history) is saved there at evaluations,
    at most once a minute, and a training that finds it continues from it: a stopped cell
    resumes where it stopped, with the same batches (the file is removed when the cell ends)."""
    torch.manual_seed(seed)
    model = HybridLM(mc).to(device)
    tc = TrainConfig(lr=lr, min_lr=lr * s.min_lr_ratio, warmup=s.warmup, steps=s.max_steps, weight_decay=s.weight_decay,
                     betas=BETAS, grad_clip=s.grad_clip, precision=s.precision, compile=s.compile)
    opt = optimizer(model, tc)
    g = torch.Generator().manual_seed(seed)
    best, best_state, stale, start = -1.0, None, 0, 0
    losses, history = [], []
    if checkpoint is not None and checkpoint.is_file():
        c = torch.load(checkpoint, map_location=device, weights_only=False)
        model.load_state_dict(c["model"])
        opt.load_state_dict(c["opt"])
        g.set_state(c["generator"])
        torch.set_rng_state(c["rng"])
        best, best_state, stale, start, losses, history = (c[k] for k in ("best", "best_state", "stale", "step", "losses",
                                                                         "history"))
    if s.compile:  # a new model: compile afresh (a worker's earlier cells would fill dynamo's per-function cache)
        torch._dynamo.reset()
    train_step = make_step(model, opt, tc.grad_clip, tc.precision, tc.compile)
    tokens, busy, first, evals, shapes, saved = 0, 0.0, 0.0, 0.0, set(), time.monotonic()

    def one_step(i: int) -> float:
        nonlocal tokens, busy, first
        x, y = (t.to(device) for t in task.batch(i, g))  # drawn on the CPU: the same data anywhere
        t0 = time.perf_counter()
        loss = train_step([(x, y)], lr_at(i, tc))
        if x.shape in shapes:  # the first step of each shape compiles (with `compile`): not in the throughput
            busy += time.perf_counter() - t0
            tokens += x.numel()
        else:
            first += time.perf_counter() - t0
        shapes.add(x.shape)
        losses.append(loss)
        return loss

    def after_step(n: int, loss: float) -> str | None:
        if on_step is not None:
            on_step()
        return None if math.isfinite(loss) else "diverged"

    def validate(n: int) -> str | None:
        nonlocal evals, best, best_state, stale
        t0 = time.perf_counter()
        acc = evaluate(model, task.val, task.eval_batch)
        evals += time.perf_counter() - t0
        val = sum(acc.values()) / len(acc)
        tail = losses[-s.eval_every:]
        history.append({"step": n, "sequences": task.sequences(n), "val": round(val, 4),
                        "by_slice": {slice_name(k): round(a, 4) for k, a in acc.items()},
                        "train_loss": round(sum(tail) / len(tail), 4)})
        stale = 0 if val >= best + s.min_delta else stale + 1
        if val > best:
            best, best_state = val, copy.deepcopy(model.state_dict())
        if solved(acc, s):
            return "solved"
        if n < s.max_steps and stale >= s.patience and n >= s.min_steps and not falling(losses, s):
            return "chance" if best <= 2 * task.chance else "plateau"  # at chance: the flat phase may go on
        return None

    def end_step(n: int, evaluated: bool) -> None:
        nonlocal saved
        if checkpoint is not None and evaluated and n < s.max_steps and time.monotonic() - saved > CHECKPOINT_EVERY_S:
            torch_save({"model": model.state_dict(), "opt": opt.state_dict(), "generator": g.get_state(),
                        "rng": torch.get_rng_state(), "best": best, "best_state": best_state, "stale": stale, "step": n,
                        "losses": losses, "history": history}, checkpoint)
            saved = time.monotonic()

    model.train()
    steps, stop = fit(one_step, s.max_steps, start=start, every=s.eval_every, after_step=after_step, evaluate=validate,
                      end_step=end_step)
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)
    if best_state is not None:
        model.load_state_dict(best_state)
    tail = losses[-s.eval_every:]
    return Training(model, max(best, 0.0), steps, stop or "capped", sum(tail) / len(tail), tokens / max(busy, 1e-9),
                    first, evals, history)


def left_chance_at(history: list[dict], chance: float) -> int | None:
    """Sequences trained before the first evaluation whose validation accuracy (the slices' mean)
    is above twice chance; None if none is."""
    return next((h["sequences"] for h in history if h["val"] > 2 * chance), None)


def solved(acc: dict[int, float], s: Settings) -> bool:
    """Whether validation accuracies by slice reach the target: their mean, or each of them."""
    return (min(acc.values()) if s.solve_on == "every" else sum(acc.values()) / len(acc)) >= s.target

