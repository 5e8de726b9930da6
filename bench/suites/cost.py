"""cost: parameters, FLOPs of one training step and measured throughput, as in the FwPKM paper's
Table 2 (Sec. 6), for the baseline and every layer on the preset's backbone; with the paper
preset also for the 16 Table 2 configs beside the paper's own figures.

Per model: parameters (as Table 2 counts them: FwPKM's shared fast weights included), FLOPs of
one training step of `batch` × `seq_len` tokens counted two ways on the meta device
(:mod:`memzoo.flops`: the Table-2 accounting and the full count), and, where measured, the
throughput of real training steps (forward, backward, AdamW) on the machine it runs on:
samples/s, tokens/s, achieved FLOP/s (full count / step time) and that as a fraction of the
machine's measured dense-matmul peak (fp32 on CPU, bf16 on CUDA). The timed step is memzoo
train's own (`memzoo.train.make_step`) in the LM config's `train.precision` (auto: bf16 autocast
on CUDA, as the paper trains, fp32 on CPU). At the paper preset throughput is measured on CUDA only (8 × 4096
tokens of a 500 M-parameter model is no CPU job); on CPU the paper rows are counted only.

On a CPU each layer's model is timed paired with the baseline's: `rounds` rounds of `steps` steps,
the two models in turn, and its "× baseline's FLOP/s" is against the baseline's steps of those same
rounds. A shared machine has slow phases of seconds; timed one after the other, one row took one
and moved 25% between two runs, paired both models take it (docs/journal/performance.md). A timing that
is noisy all the same (its steps' 10-90% spread above NOISY_SPREAD of their median, or the matmul
peak beside it below half the run's median peak: a busy machine) is taken again, RETIMES times at
most, the least spread kept; still noisy, the row says why (``noisy``) and the tables leave it out
of their ratio columns.

    memzoo bench --suite cost --layers fwpkm,mom,lact          # tiny: 8 × 256 tokens on this CPU
    memzoo bench --suite cost --preset paper                   # Table 2's 16 rows beside the paper
    memzoo bench --suite cost --preset paper --device cuda     # ... and measured at 8 × 4096
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from memzoo.bench.common import BASELINE, Context, device_name, lm_train_config, model_config
from memzoo.bench.registry import Suite, register_suite
from memzoo.timing import Timing, time_fn
from memzoo.train import resolve_precision

NAME = "cost"



@dataclass
class Settings:
    batch: int = 8  # sequences per training step (Table 2: 8)
    seq_len: int = 256  # tokens per sequence (Table 2: 4096)
    warmup: int = 2  # untimed training steps before the timed ones
    steps: int = 10  # about this many timed training steps a round (memzoo.timing.time_fn)
    # on a CPU: rounds of `steps` steps, the layer's model and the baseline's in turn (paired, below);
    # the row's figure is the median of all its timed steps, its spread their 10-90% range
    rounds: int = 3
    cpu_throughput: bool = True  # time steps on CPU too (off for the paper preset: count only)
    configs: list = field(default_factory=list)  # shipped configs with `paper:` figures (Table 2's rows)

    def __post_init__(self):
        for k in ("batch", "seq_len", "steps", "rounds"):
            if getattr(self, k) < 1:
                raise ValueError(f"cost.{k} must be >= 1, got {getattr(self, k)}")
        if self.warmup < 0:
            raise ValueError(f"cost.warmup must be >= 0, got {self.warmup}")


# ---- measuring ------------------------------------------------------------------------------


def matmul_peak(device: str = "cpu", repeats: int = 5) -> float:
    """Measured dense-matmul throughput (FLOP/s) of this machine now, at torch's thread count: the
    best of `repeats` square matmuls of each of a few sizes, in the dtype training runs in (fp32 on
    CPU, n = 512-2048; bf16 on CUDA, n = 4096-8192). Measured beside each timed model, in the same
    conditions, so that a busy or throttled machine lowers both."""
    cuda = device.startswith("cuda")
    dt = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator().manual_seed(0)
    best = 0.0
    for n in (4096, 8192) if cuda else (512, 1024, 2048):
        a, b = (torch.randn(n, n, generator=gen).to(device, dt) for _ in range(2))
        best = max(best, 2 * n**3 / time_fn(lambda: a @ b, warmup=1, reps=repeats, device=device).min)
    return best


def training_step(mc, tc, batch: int, seq_len: int, device: str, precision: str = "fp32", seed: int = 0):
    """memzoo train's step (`memzoo.train.make_step`: forward and backward of the LM loss, gradient
    clipping, AdamW) of a fresh model on fixed random tokens, as a call with no arguments."""
    from memzoo.backbone.model import HybridLM
    from memzoo.train import make_step, optimizer

    torch.manual_seed(seed)
    model = HybridLM(mc).to(device).train()
    opt = optimizer(model, tc)
    gen = torch.Generator().manual_seed(seed)
    x, y = (torch.randint(0, mc.vocab_size, (batch, seq_len), generator=gen).to(device) for _ in range(2))
    train_step = make_step(model, opt, tc.grad_clip, precision)
    return lambda: train_step([(x, y)], tc.lr)


def time_training_step(mc, tc, batch: int, seq_len: int, device: str, warmup: int, steps: int,
                       precision: str = "fp32", seed: int = 0, rounds: int = 1, beside=None) -> dict:
    """Seconds per training step (:func:`training_step`): the median of about `steps` timed steps
    in each of `rounds` rounds after `warmup` untimed ones (`memzoo.timing.time_fn`), with their
    10-90% spread; with the peak memory on CUDA. `beside`, a second model's (mc, tc): its steps
    are timed in the same rounds, the two models in turn, so that a slow phase of the machine lands
    on both (its median is returned as `beside_step_s`)."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    fns = [training_step(mc, tc, batch, seq_len, device, precision, seed)]
    if beside is not None:
        fns.append(training_step(*beside, batch, seq_len, device, precision, seed))
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for fn, ts in zip(fns, times):
            ts.extend(time_fn(fn, 1, steps, device).times)  # each round's first step untimed: the budget
    t = Timing(tuple(times[0]))
    out = {"step_s": t.median, "step_spread": (t.quantile(0.9) - t.quantile(0.1)) / t.median, "timed_steps": len(t.times)}
    if beside is not None:
        out["beside_step_s"] = Timing(tuple(times[1])).median
    if cuda:
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        del fns
        torch.cuda.empty_cache()  # the next model starts from an empty cache
    return out


#: a timing is noisy when its steps' 10-90% spread exceeds this fraction of their median, or when the
#: matmul peak measured beside it is below half the median peak of the run so far (the machine was busy)
NOISY_SPREAD, NOISY_PEAK = 0.25, 0.5
RETIMES = 2  # a noisy timing is taken again this many times; the least spread one is kept
_PEAKS: list[float] = []  # the matmul peaks measured in this run (process)


def noise(step_spread: float, peak: float, peaks: list[float]) -> str:
    """Why a timing is noisy ("" when it is not): its spread, or its peak against the run's median."""
    why = []
    if step_spread > NOISY_SPREAD:
        why.append(f"step spread {100 * step_spread:.0f}% > {100 * NOISY_SPREAD:.0f}%")
    if peaks:
        med = sorted(peaks)[len(peaks) // 2]
        if peak < NOISY_PEAK * med:
            why.append(f"matmul peak {peak / 1e9:.0f} < half the run's median {med / 1e9:.0f} GFLOP/s")
    return "; ".join(why)


def measure(mc, tc, s: Settings, device: str, seed: int, with_time: bool, paper: dict | None = None,
            beside=None) -> dict:
    """The metrics of one model: parameters, both FLOPs counts, throughput when `with_time`,
    and the paper's figures beside ours when `paper` (a config's `paper:` section) is given.
    `beside`: the baseline's (mc, tc), on a CPU timed in the same rounds as this model (paired:
    the row's ratio to the baseline then holds whatever the machine did meanwhile); on CUDA
    models are timed one at a time (two of the paper's do not fit beside each other)."""
    from memzoo.backbone.model import count_params
    from memzoo.flops import TABLE2_BATCH, TABLE2_SEQ_LEN, step_flops

    fl = step_flops(mc, s.batch, s.seq_len, seed=seed)
    m = {"params": count_params(mc), **fl.as_dict(), "step_shape": f"{s.batch}x{s.seq_len}", "tokens": fl.tokens}
    if with_time:
        cpu = not device.startswith("cuda")
        t, peak, noisy, tries = None, 0.0, "", 0
        try:
            for tries in range(1, RETIMES + 2):  # a noisy timing is taken again (the least spread kept)
                got = time_training_step(mc, tc, s.batch, s.seq_len, device, s.warmup, s.steps,
                                         resolve_precision(tc.precision, device), seed, rounds=s.rounds if cpu else 1,
                                         beside=beside if cpu else None)
                got_peak = matmul_peak(device)
                why = noise(got["step_spread"], got_peak, _PEAKS)
                if t is None or got["step_spread"] < t["step_spread"]:
                    t, peak, noisy = got, got_peak, why
                _PEAKS.append(got_peak)
                if not why:
                    break
        except torch.OutOfMemoryError:
            t = None
        if t is None:  # recorded as such; the counts still stand
            m["throughput_error"] = "out of memory"
            torch.cuda.empty_cache()
        else:
            if fl.total / t["step_s"] > peak:  # the step cannot outrun the machine's best matmul
                raise RuntimeError(f"cost: the step's achieved {fl.total / t['step_s'] / 1e9:.1f} GFLOP/s exceed the "
                                   f"matmul peak measured beside it ({peak / 1e9:.1f}): the machine was busy; "
                                   "time it alone (nothing else running)")
            m.update(
                step_s=t["step_s"],
                step_spread=t["step_spread"],
                timed_steps=t["timed_steps"],
                threads=torch.get_num_threads(),
                samples_per_s=s.batch / t["step_s"],
                tokens_per_s=fl.tokens / t["step_s"],
                flops_per_s=fl.total / t["step_s"],
                flops_per_s_table2=fl.table2 / t["step_s"],
                peak_flops_per_s=peak,
                mfu=fl.total / t["step_s"] / peak,
                device=device_name(device),
                precision=resolve_precision(tc.precision, device),
                timings=tries,  # 1, or more where a noisy timing was taken again
            )
            if noisy:  # still noisy after the retimes: marked, and left out of the tables' ratios
                m["noisy"] = noisy
            if "beside_step_s" in t:  # the baseline, timed in the same rounds
                m["baseline_step_s_beside"] = t["beside_step_s"]
                m["baseline_flops_per_s_beside"] = step_flops(beside[0], s.batch, s.seq_len, seed=seed).total / t["beside_step_s"]
            if "peak_mem_gb" in t:
                from memzoo.ops.gated_delta_rule import gdn_op

                m["peak_mem_gb"] = t["peak_mem_gb"]
                m["gdn_op"] = gdn_op(device)  # which gated delta rule was timed
    if paper:
        at_table2 = (s.batch, s.seq_len) == (TABLE2_BATCH, TABLE2_SEQ_LEN)
        for ours, key, scale in (("params", "params_m", 1e6), ("flops_table2", "flops_t", 1e12),
                                 ("flops_per_s_table2", "flops_per_s_t", 1e12), ("samples_per_s", "samples_per_s", 1)):
            if key not in paper or (ours != "params" and not at_table2):
                continue  # the paper's step is 8 × 4096 tokens: other shapes are not comparable
            m[f"{ours}_paper"] = paper[key] * scale
            if ours in m:
                m[f"{ours}_diff_pct"] = 100 * (m[ours] - m[f"{ours}_paper"]) / m[f"{ours}_paper"]
    return m


def work(ctx: Context, layer: str) -> int:
    """Units of work for the progress bar: the models measured (the baseline's run adds `configs`)."""
    return 1 + (len(ctx.preset.settings(NAME, Settings).configs) if layer == BASELINE else 0)


def run(ctx: Context, layers: list[str]) -> list[dict]:
    """One row per layer on the preset's backbone (setting: the step shape), then, with the
    baseline (the harness calls suites layer by layer), one per config in `configs`
    (setting: the config name and the step shape)."""
    from memzoo.config import load_config

    s = ctx.preset.settings(NAME, Settings)
    cuda = ctx.device.startswith("cuda")
    timed = cuda or s.cpu_throughput
    if not timed:
        print(f"cost: counting only; throughput at {s.batch} x {s.seq_len} tokens is measured on CUDA "
              "(--device cuda), or set cost.cpu_throughput: true in the preset")
    configs = s.configs if BASELINE in layers else []
    jobs = [(layer, None) for layer in layers] + [(c, load_config(c)) for c in configs]
    shape = {"batch": s.batch, "seq_len": s.seq_len}
    rows = []
    for name, rc in jobs:
        t0 = time.time()
        if rc is None:
            mc, tc, setting, paper = model_config(ctx.preset, name), lm_train_config(ctx.preset), dict(shape), None
        else:
            mc, tc, setting, paper = rc.model, rc.train, {"config": name, **shape}, rc.paper
        beside = (model_config(ctx.preset, BASELINE), lm_train_config(ctx.preset)) if rc is None and name != BASELINE else None
        metrics = measure(mc, tc, s, ctx.device, ctx.seed, timed, paper, beside)
        config = {"model": mc.to_dict(), "settings": dataclasses.asdict(s), "train": tc.to_dict(),
                  "device": ctx.device, "config": None if rc is None else name}
        rows.append(ctx.record(NAME, name, setting, metrics, config, time.time() - t0))
        ctx.advance(1, f"cost {name}")
    return rows


register_suite(Suite(NAME, Settings, run, work))
