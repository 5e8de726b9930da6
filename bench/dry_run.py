"""`memzoo bench --dry-run`: what a run would do, and about how long, without running it.

    memzoo bench --preset recall-gpu --layers all --suite toys --device cuda --dry-run   # on any machine

It prints the run's jobs in the order the bench takes them: each toys cell (model, task, width,
seed) with its learning rates and its training steps at the cap, marked where results.jsonl already
holds it (what ``--resume`` skips), and each LM job (ppl, niah) marked recorded or with its LM training
steps (`_LMEstimate`). Then the totals at the cap and an estimate of the time on the target device.

The estimate is read from the rows: the seconds per training step of the preset's toys cells (and of
the presets whose cells it reuses or whose lrs it takes, ``toys.reuse`` and ``toys.lr_of``) recorded
on that kind of device (a cell's wall time over the steps it trained at all its lrs: compiling and
evaluating included), the same model and width where recorded, else the median of
the device's cells. It is an upper bound in steps (every lr to the cap; an early stop saves the
rest, an lr tried past the grid's edge adds one, a grid at chance two) and it knows only devices the preset has run
on: with no cell recorded there it says so and prints the figure at an assumed seconds per step
(``ASSUMED_STEP_S``), until the first slice's rows calibrate it. A GPU row is one whose machine
had a GPU (rows record the machine, ``hardware``, not the device a run chose).
"""

from __future__ import annotations

import statistics

from memzoo.bench.common import read_results

#: the seconds per training step assumed for a device on which the preset has recorded no cell
#: (a round figure, not a measurement: the estimate says when it uses it)
ASSUMED_STEP_S = 0.01


def step_seconds(row: dict) -> float | None:
    """A toys row's wall seconds per training step: its wall time over the steps its lrs trained
    (each lr's evaluations times ``eval_every``; the last evaluation of each may follow a partial
    interval, so this is a slight overestimate of the steps and an underestimate of the seconds)."""
    every = row.get("config", {}).get("train", {}).get("eval_every")
    curves = row.get("metrics", {}).get("val_history_by_lr")
    if not every or not curves:
        return None
    steps = sum(len(c) for c in curves.values()) * every
    return row["wall_s"] / steps if steps else None


def on_device(row: dict, device: str, gpu_name: str | None) -> bool:
    """Whether a row was measured on the kind of device `device` names: with CUDA, a machine with
    that GPU (any GPU when its name is not known here); on a CPU, this processor model."""
    from memzoo.bench.common import hardware

    hw = row.get("hardware", {})
    if device.startswith("cuda"):
        return "gpu" in hw and (gpu_name is None or hw["gpu"] == gpu_name)
    return "gpu" not in hw and hw.get("cpu") == hardware()["cpu"]


def print_plan(ctx, queued: list, device: str, jobs: int | None) -> None:
    """Print the run's jobs, its size at the cap and the estimate (module docstring)."""
    import torch

    from memzoo.bench.suites import toys

    gpu = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else None
    s = ctx.preset.settings(toys.NAME, toys.Settings)
    rows = [r for r in read_results(ctx.recorder.path)
            if r["suite"] == toys.NAME and r["preset"] in (ctx.preset.name, *s.reuse, *s.lr_of) and on_device(r, device, gpu)]
    per_model: dict = {}
    for r in rows:
        if (sec := step_seconds(r)) is not None:
            per_model.setdefault((r["layer"], r["setting"]["d_model"]), []).append(sec)
    pooled = [x for v in per_model.values() for x in v]
    where = gpu or ("a GPU" if device.startswith("cuda") else f"this CPU ({rows[0]['hardware']['cpu']})" if rows else "this CPU")
    total_steps, total_s, recorded, cells = 0, 0.0, 0, 0
    states: dict = {}  # (model, width): the memory's state numbers per sequence
    print(f"{'job':52s} {'lrs':>4s} {'steps at the cap':>17s} {'estimate':>10s} {'state':>8s}")
    lm = _LMEstimate(ctx, device, gpu)
    for job in queued:
        if job.part is None or job.suites != (toys.NAME,):
            lm.job(job)
            continue
        name, task, width, seed = job.part
        done = toys.cell_key(ctx, s, name, task, width, seed)[3] is not None
        lrs = len(s.candidates(name))
        steps = 0 if done else lrs * s.max_steps
        sec = statistics.median(per_model.get((name, width)) or pooled or [ASSUMED_STEP_S])
        cells += 1
        recorded += done
        total_steps += steps
        total_s += steps * sec
        if (name, width) not in states:
            mc = toys.cell_key(ctx, s, name, task, width, seed)[0]
            states[name, width] = toys.state_numbers(mc, toys.TASK_TYPES[task].seq_len_of(s))
        what = f"toys {name} {task} d={width} seed {seed}"
        print(f"{what:52s} {lrs:>4d} {'recorded' if done else f'{steps:,}':>17s} "
              f"{'' if done else _minutes(steps * sec):>10s} {states[name, width]:>8,}")
    lm.summary()
    if not cells:
        return
    _print_sizes(s, states)
    basis = (f"from {len(pooled)} cells of this preset recorded on {where}" if pooled else
             f"no cell of preset {ctx.preset.name} is recorded on {where} yet: at an assumed {ASSUMED_STEP_S * 1000:g} ms "
             f"a step, a round figure (the first slice's rows calibrate it)")
    packed = f"; --jobs {jobs} runs {jobs} cells at once (at most {jobs}x faster)" if jobs and jobs > 1 else ""
    print(f"\n{cells} toys cells, {recorded} recorded (--resume skips them); {cells - recorded} to train: "
          f"{total_steps:,} training steps at the cap (every lr to {s.max_steps:,}; an early stop saves steps, lrs past "
          f"the grid's edges add up to {toys.MAX_BEYOND + 2}). Estimate: {_minutes(total_s)} on {where}, one cell at a time "
          f"({basis}){packed}.")


class _LMEstimate:
    """The LM suites' jobs (ppl, niah: a job trains the layer's LMs once, then evaluates them): each marked
    recorded where every one of its LMs' rows is (what ``--resume`` skips), else its training steps
    (`lm.untrained_steps`: none for an LM cached in the work dir) and an estimate from the preset's LM rows
    on this kind of device: the median seconds per training step (``lm_train_wall_s / lm_steps``) and, per
    suite, the median seconds one LM's evaluation took (the sum of its rows' wall times)."""

    def __init__(self, ctx, device: str, gpu: str | None):
        from memzoo.bench.registry import SUITES

        self.ctx, self.jobs, self.recorded, self.steps, self.seconds = ctx, 0, 0, 0, 0.0
        rows = [r for r in read_results(ctx.recorder.path)
                if r["preset"] == ctx.preset.name and SUITES.get(r["suite"]) and SUITES[r["suite"]].uses_lm
                and on_device(r, device, gpu)]
        per_step = [r["metrics"]["lm_train_wall_s"] / r["metrics"]["lm_steps"] for r in rows
                    if r["metrics"].get("lm_steps") and r["metrics"].get("lm_train_wall_s")]
        self.step_s = statistics.median(per_step) if per_step else None
        groups: dict = {}
        for r in rows:
            groups.setdefault((r["suite"], r["layer"], r["seed"]), []).append(r["wall_s"])
        self.eval_s = {su: statistics.median(sum(w) for (g, _, _), w in groups.items() if g == su)
                       for su in {g for g, _, _ in groups}}

    def job(self, job) -> None:
        from memzoo.bench.lm import models, untrained_steps
        from memzoo.bench.registry import get_suite

        what = " ".join(job.suites) + " " + job.layer
        suites = [get_suite(su) for su in job.suites]
        lms = [(su, m) for su in suites for m in models(self.ctx, job.layer, su.name)]
        self.jobs += 1
        if lms and all(su.recorded is not None and su.recorded(self.ctx, m) for su, m in lms):
            self.recorded += 1
            print(f"{what:52s} {'':>4s} {'recorded':>17s}")
            return
        steps = untrained_steps(self.ctx, job.layer, list(job.suites))
        sec = None if self.step_s is None else steps * self.step_s + sum(self.eval_s.get(su.name, 0.0) for su, _ in lms)
        self.steps += steps
        self.seconds += sec or 0.0
        print(f"{what:52s} {'':>4s} {f'{steps:,} LM steps':>17s} {'' if sec is None else _minutes(sec):>10s}")

    def summary(self) -> None:
        if not self.jobs:
            return
        how = (f"Estimate: {_minutes(self.seconds)}, from this preset's LM rows on this device" if self.step_s is not None
               else "not estimated: no LM row of this preset was recorded on this device yet")
        print(f"\n{self.jobs} LM jobs (ppl, niah), {self.recorded} recorded (--resume skips them); "
              f"{self.steps:,} LM training steps to run. {how}.")


def _print_sizes(s, states: dict) -> None:
    """Each model with sizes (`toys.sizes`): its state numbers at every size and their span."""
    for model in s.sizes:
        points = {m: n for (m, _), n in states.items() if m == model or s.size_of(m) and s.size_of(m)[0] == model}
        if points:
            span = max(points.values()) / max(min(points.values()), 1)
            print(f"state sizes of {model}: " + ", ".join(f"{m} {n:,}" for m, n in sorted(points.items(), key=lambda kv: -kv[1]))
                  + f" ({len(points)} sizes, {span:.0f}x)")


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:,.0f} min" if seconds < 100 * 3600 else f"{seconds / 3600:,.0f} h"
