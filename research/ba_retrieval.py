"""Ba et al.'s associative-retrieval toy (Sec. 4.1) with the paper's fast-weights RNN, on CPU.
Finding: memzoo/layers/ba.py's docstring (the paper's retrieval network, ReLU against tanh).

Trains :class:`memzoo.layers.ba.FastWeightsRNN` on ``k1 v1 … kn vn ? ? q`` -> v
(:mod:`memzoo.data.assoc_retrieval`) with Adam, evaluates a fixed held-out set every
``--eval-every`` steps, prints the accuracy curve (step, minutes, accuracy), and stops at the
target accuracy or the time budget, whichever comes first::

    python -m research.ba_retrieval --n-pairs 4 --activation tanh --minutes 15
    python -m research.ba_retrieval --sweep --minutes 3          # n_pairs = 1..8
    python -m research.ba_retrieval --n-pairs 4 --json out.json  # the result as JSON

Defaults: R = 50 hidden units, S = 1 inner step, λ = 0.95, η = 0.5, W = 0.05·I, LayerNorm,
Adam lr 1e-3, batch 128 (Sec. 4.1's setting, with Adam). The goal: >= 98% at n_pairs = 4 in
<= 15 CPU-minutes of training on one thread; with tanh seeds 0-2 reach it in 6000-6500 steps
(1.4-1.9 min on a shared core). When changing R keep η·R about fixed (R = 100: η ≈ 0.25).
ReLU (the paper's f) plateaus near 38% at n_pairs = 4: the net learns which digits occur in the
sequence but not which letter owns each; the ``in_seq`` column (fraction of predictions that
are one of the sequence's digits) shows that failure mode. Non-negative states all look alike
to the Hebbian read (see :mod:`memzoo.layers.ba`); a small η shortens the plateau:
``--activation relu --eta 0.05`` reaches 98% at step 26000 (~5 min), η = 0.5 is at 59% after
30000 steps and R = 100, η = 0.25 at 38% after 11000.

Determinism: the model's init and every training batch are functions of ``--seed`` alone and the
held-out set of ``--eval-seed``, so the curve is identical step for step across runs and
machines with the same torch build; only how many steps fit in the time budget depends on the
machine (and its load). "Minutes" count training only, not evaluation.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from memzoo.data.assoc_retrieval import DIGIT_OFFSET, VOCAB_SIZE, AssocBatch, eval_set, make_batch
from memzoo.layers.ba import ACTIVATIONS, FastWeightsRNN
from memzoo.train import make_step


@dataclass
class RetrievalConfig:
    n_pairs: int = 4
    hidden_size: int = 50  # R
    inner_steps: int = 1  # S
    decay: float = 0.95  # λ
    eta: float = 0.5  # η
    activation: str = "tanh"
    w_init: float = 0.05  # W = w_init · I
    trailing_read: bool = False  # append a '?' after the query (k1 v1 … ? ? q ?)
    lr: float = 1e-3
    batch_size: int = 128
    grad_clip: float = 0.0  # global-norm clip; 0 = off
    seed: int = 0
    minutes: float = 15.0  # training-time budget
    max_steps: int = 0  # 0 = no step limit
    target: float = 0.98  # stop once held-out accuracy reaches this
    eval_every: int = 250
    eval_size: int = 2000
    eval_seed: int = 1234


@dataclass
class RetrievalResult:
    config: dict
    accuracy: float  # held-out accuracy at the end
    best_accuracy: float
    reached_target: bool
    steps: int
    train_seconds: float
    wall_seconds: float
    ms_per_step: float
    per_slot: list = field(default_factory=list)  # accuracy by queried pair (0 = first)
    in_seq: float = 0.0  # fraction of predictions that are a digit of the sequence
    # [{"step", "minutes" (training), "accuracy", "loss" (held-out), "train_loss" (EMA), "in_seq"}]
    curve: list = field(default_factory=list)


@torch.no_grad()
def evaluate(model: FastWeightsRNN, data: AssocBatch, n_pairs: int, chunk: int = 1000) -> dict:
    """Accuracy, cross-entropy, per-slot accuracy and the in-sequence rate on a fixed set."""
    was_training = model.training
    model.eval()
    logits = torch.cat([model(data.tokens[i : i + chunk]) for i in range(0, len(data.answer), chunk)])
    model.train(was_training)
    pred = logits.argmax(-1)
    correct = (pred == data.answer).float()
    n = n_pairs
    values = data.tokens[:, 1 : 2 * n : 2]  # the sequence's digits
    return {
        "accuracy": correct.mean().item(),
        "loss": F.cross_entropy(logits, data.answer).item(),
        "per_slot": [correct[data.slot == s].mean().item() for s in range(n)],
        "in_seq": (pred[:, None] == values).any(dim=1).float().mean().item(),
    }


def train_retrieval(cfg: RetrievalConfig, progress: bool = True) -> RetrievalResult:
    """Train until ``cfg.target`` held-out accuracy, ``cfg.minutes`` of training or ``cfg.max_steps``."""
    if cfg.activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {cfg.activation!r}; choose one of {list(ACTIVATIONS)}")
    if cfg.minutes <= 0 and cfg.max_steps <= 0:
        raise ValueError("give a time budget (minutes > 0) or a step limit (max_steps > 0)")
    if cfg.eval_every < 1:
        raise ValueError(f"eval_every must be >= 1, got {cfg.eval_every}")
    torch.manual_seed(cfg.seed)
    model = FastWeightsRNN(
        VOCAB_SIZE, cfg.hidden_size, cfg.inner_steps, cfg.decay, cfg.eta, cfg.activation, cfg.w_init
    )
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    train_step = make_step(model, opt, cfg.grad_clip, loss_fn=lambda m, x, y: F.cross_entropy(m(x), y))
    gen = torch.Generator().manual_seed(cfg.seed)
    held_out = eval_set(cfg.eval_size, cfg.n_pairs, cfg.eval_seed, trailing_read=cfg.trailing_read)
    budget = cfg.minutes * 60 if cfg.minutes > 0 else math.inf
    max_steps = cfg.max_steps if cfg.max_steps > 0 else None

    curve: list[dict] = []
    train_s, step, t_wall = 0.0, 0, time.perf_counter()
    by_steps = max_steps is not None and budget == math.inf
    bar = tqdm(
        total=max_steps if by_steps else round(budget),
        unit="step" if by_steps else "s",
        disable=not progress,
        desc=f"ba n_pairs={cfg.n_pairs} {cfg.activation}",
        dynamic_ncols=True,
        # a time budget advances by fractional seconds: show them rounded
        bar_format=None if by_steps else "{l_bar}{bar}| {n:.0f}/{total:.0f} s of training [{elapsed}{postfix}]",
    )

    def record(loss: float) -> dict:
        ev = evaluate(model, held_out, cfg.n_pairs)
        row = {"step": step, "minutes": train_s / 60, "accuracy": ev["accuracy"], "loss": ev["loss"],
               "train_loss": loss, "in_seq": ev["in_seq"]}
        curve.append(row)
        bar.set_postfix(step=step, acc=f"{ev['accuracy']:.3f}")
        line = (
            f"step {step:7d}  {row['minutes']:6.2f} min  acc {ev['accuracy']:.4f}  "
            f"loss {ev['loss']:.4f}  in_seq {ev['in_seq']:.3f}"
        )
        (tqdm.write if progress else print)(line)
        return ev

    ev = record(float("nan"))
    loss_avg = float("nan")
    while True:
        if ev["accuracy"] >= cfg.target or train_s >= budget or (max_steps is not None and step >= max_steps):
            break
        t0 = time.perf_counter()
        batch = make_batch(cfg.batch_size, cfg.n_pairs, gen, trailing_read=cfg.trailing_read)
        li = train_step([(batch.tokens, batch.answer)])
        dt = time.perf_counter() - t0
        train_s += dt
        step += 1
        loss_avg = li if math.isnan(loss_avg) else 0.98 * loss_avg + 0.02 * li
        bar.update(1 if by_steps else min(dt, max(0.0, bar.total - bar.n)))
        if step % cfg.eval_every == 0 or train_s >= budget or (max_steps is not None and step >= max_steps):
            ev = record(loss_avg)
    bar.close()
    return RetrievalResult(
        config=asdict(cfg),
        accuracy=ev["accuracy"],
        best_accuracy=max(r["accuracy"] for r in curve),
        reached_target=ev["accuracy"] >= cfg.target,
        steps=step,
        train_seconds=train_s,
        wall_seconds=time.perf_counter() - t_wall,
        ms_per_step=1e3 * train_s / max(step, 1),
        per_slot=ev["per_slot"],
        in_seq=ev["in_seq"],
        curve=curve,
    )


def format_result(r: RetrievalResult) -> str:
    c = r.config
    head = (
        f"n_pairs={c['n_pairs']} {c['activation']} R={c['hidden_size']} S={c['inner_steps']} "
        f"λ={c['decay']} η={c['eta']} seed={c['seed']}: accuracy {r.accuracy:.4f} "
        f"({'reached' if r.reached_target else 'below'} target {c['target']}) after {r.steps} steps, "
        f"{r.train_seconds / 60:.2f} min training ({r.ms_per_step:.1f} ms/step), {r.wall_seconds / 60:.2f} min wall"
    )
    slots = "per-slot accuracy: " + " ".join(f"{a:.3f}" for a in r.per_slot) + f"; in-sequence digit {r.in_seq:.3f}"
    return head + "\n" + slots


def _parse_pairs(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


# the command line: one flag per RetrievalConfig field, with these help texts and short forms
_HELP = {"hidden_size": "R", "inner_steps": "S", "decay": "λ", "eta": "η", "w_init": "W = w_init · I",
         "trailing_read": "append a '?' after the query", "grad_clip": "0 = off",
         "minutes": "training-time budget per run", "max_steps": "0 = no step limit"}
_SHORT = {"hidden_size": "-R", "inner_steps": "-S"}


def main(argv: list[str] | None = None) -> list[RetrievalResult]:
    d = RetrievalConfig()
    p = argparse.ArgumentParser(prog="python -m research.ba_retrieval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(d):  # a flag per RetrievalConfig field: --n-pairs, --hidden-size (-R), ...
        flags = ["--" + f.name.replace("_", "-"), *([_SHORT[f.name]] if f.name in _SHORT else [])]
        if isinstance(f.default, bool):
            p.add_argument(*flags, action="store_true", help=_HELP.get(f.name))
        else:
            p.add_argument(*flags, type=type(f.default), default=f.default, help=_HELP.get(f.name),
                           choices=list(ACTIVATIONS) if f.name == "activation" else None)
    p.add_argument("--sweep", nargs="?", const="1-8", default=None, metavar="PAIRS",
                   help="run several n_pairs (e.g. '1-8', '2,4,6'; bare --sweep = 1-8), each with the full budget")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--json", default=None, metavar="PATH", help="write the result(s) as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    if a.threads > 0:
        torch.set_num_threads(a.threads)

    base = {k: getattr(a, k) for k in asdict(d)}
    pairs = _parse_pairs(a.sweep) if a.sweep else [a.n_pairs]
    results = []
    for n in pairs:
        r = train_retrieval(RetrievalConfig(**{**base, "n_pairs": n}), progress=not a.quiet)
        print(format_result(r), flush=True)
        results.append(r)
    if len(results) > 1:
        print("\nn_pairs  accuracy  steps  train_min  ms/step")
        for r in results:
            n, minutes = r.config["n_pairs"], r.train_seconds / 60
            print(f"{n:7d}  {r.accuracy:8.4f}  {r.steps:5d}  {minutes:9.2f}  {r.ms_per_step:7.1f}")
    if a.json:
        from memzoo.storage import write_text

        write_text(a.json, json.dumps([asdict(r) for r in results] if len(results) > 1 else asdict(results[0]), indent=1))
    return results


if __name__ == "__main__":
    main()
