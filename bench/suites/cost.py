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
and moved 25% between two runs, paired both models take it (docs/performance.md).

    memzoo bench --suite cost --layers fwpkm,mom,lact          # tiny: 8 × 256 tokens on this CPU
    memzoo bench --suite cost --preset paper                   # Table 2's 16 rows beside the paper
    memzoo bench --suite cost --preset paper --device cuda     # ... and measured at 8 × 4096
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memzoo.bench.common import BASELINE, Context, device_name, lm_train_config, model_config, save_png
from memzoo.timing import Timing, time_fn
from memzoo.train import resolve_precision

NAME = "cost"

EXPLANATION = """\
**The two FLOPs columns.** *Table-2 style* is the paper's accounting, which we reconstructed and
checked against all 16 rows of its Table 2: 6 × (counted parameters) × tokens for one step of
8 × 4096 tokens, where every slow parameter counts once per token (2 FLOPs per multiply-add
forward, 4 backward) except PKM's value tables, which a token reads only k rows of; FwPKM's
sub-keys and values are fast weights and are not counted, PKM's sub-keys are (scoring them is a
dense product). Nothing else is in it: not the softmax-attention scores, not the gated delta
rule's recurrence, not FwPKM's lookup and write. *Full* counts what one training step computes:
the same step run on the meta device under torch's FlopCounterMode (every matmul, the GDN chunked
recurrence's products and triangular solves, product-key scoring, the fast-weight updates) plus
formulas for what it misses: attention over exactly the (query, key) pairs the causal or
sliding-window mask keeps, embedding-bag sums, index_add / scatter_add writes, and grouped
convolutions' backward. Full exceeds Table-2 style by the attention (large for FA layers at 4096
tokens, small for SWA's 512 window), the GDN recurrence and the memory layers' own work
(lookups, fast-weight updates, FWL's per-position loss gradients through the LM head); for a
routed layer (MoM) Table-2 style charges every memory's projections to every token, while the
full count runs each memory on its routed tokens only (counted at balanced routing).
Elementwise ops, top-k and the optimizer are in neither. Achieved FLOP/s and MFU use the full
count; the paper's FLOPS column is its FLOPs over its step time, i.e. Table-2 style."""


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
    from memzoo.train import make_step, param_groups

    torch.manual_seed(seed)
    model = HybridLM(mc).to(device).train()
    opt = torch.optim.AdamW(param_groups(model, tc), lr=tc.lr, betas=tuple(tc.betas))
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
        try:
            cpu = not device.startswith("cuda")
            t = time_training_step(mc, tc, s.batch, s.seq_len, device, s.warmup, s.steps, resolve_precision(tc.precision, device),
                                   seed, rounds=s.rounds if cpu else 1, beside=beside if cpu else None)
        except torch.OutOfMemoryError:
            t = None
        if t is None:  # recorded as such; the counts still stand
            m["throughput_error"] = "out of memory"
            torch.cuda.empty_cache()
        else:
            peak = matmul_peak(device)
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
            )
            if "beside_step_s" in t:  # the baseline, timed in the same rounds
                m["baseline_step_s_beside"] = t["beside_step_s"]
                m["baseline_flops_per_s_beside"] = step_flops(beside[0], s.batch, s.seq_len, seed=seed).total / t["beside_step_s"]
            if "peak_mem_gb" in t:
                from memzoo.ops.gated_delta_rule import fla_unusable

                m["peak_mem_gb"] = t["peak_mem_gb"]
                why = fla_unusable(torch.device(device).index)
                m["gdn_op"] = f"torch ({why})" if why else "fla"  # which gated delta rule was timed
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


# ---- rendering --------------------------------------------------------------------------------


def _col(df, key):
    import pandas as pd

    c = f"metrics.{key}"
    return df[c] if c in df else pd.Series([float("nan")] * len(df), index=df.index)


def _unit(df) -> tuple[str, float]:
    top = _col(df, "flops_full").max()
    return ("T", 1e12) if top >= 1e12 else ("G", 1e9)


def _sorted(df):
    """Rows in a fixed order: baseline first, then layers by name; Table 2's configs in the
    paper's order (backbone, then plain, PKM, FwPKM, mixed); then by step shape."""
    shape = [df[f"setting.{k}"].fillna(0).tolist() if f"setting.{k}" in df else [0] * len(df) for k in ("batch", "seq_len")]
    keys = [(_order_key(n), b, t) for n, b, t in zip(df["layer"], *shape)]
    return df.iloc[sorted(range(len(df)), key=keys.__getitem__)]


def _order_key(name: str) -> tuple:
    if name == BASELINE:
        return (0, "", 0)
    stem = name.split("/")[-1]
    tails = ("-pkm2-6-10", "-fwpkm2-6-10", "-pkm6-fwpkm2-10")
    i = next((i + 1 for i, tail in enumerate(tails) if stem.endswith(tail)), 0)
    stem = stem[: -len(tails[i - 1])] if i else stem
    rank = {"gdn": "0", "gdn-swa": "1", "gdn-fa": "2", "fa": "3"}  # Table 2's order
    return (1, rank.get(stem, "9" + stem), i)


def _table2(df):
    import pandas as pd

    u, sc = _unit(df)
    df = _sorted(df)
    t = pd.DataFrame({"config": [n.split("/")[-1] for n in df["layer"]]}, index=df.index)
    t["params (M)"] = (_col(df, "params") / 1e6).round(2)
    t["paper (M)"] = (_col(df, "params_paper") / 1e6).round(2)
    t["Δ params %"] = _col(df, "params_diff_pct").round(3) + 0.0  # + 0.0: no "-0"
    t[f"FLOPs Table-2 style ({u})"] = (_col(df, "flops_table2") / sc).round(2)
    t[f"paper ({u})"] = (_col(df, "flops_table2_paper") / sc).round(2)
    t["Δ FLOPs %"] = _col(df, "flops_table2_diff_pct").round(3) + 0.0
    t[f"FLOPs full ({u})"] = (_col(df, "flops_full") / sc).round(2)
    t["full / Table-2"] = (_col(df, "flops_full") / _col(df, "flops_table2")).round(3)
    if _col(df, "step_s").notna().any():
        t["samples/s"] = _col(df, "samples_per_s").round(2)
        t["paper samples/s"] = _col(df, "samples_per_s_paper").round(2)
        t[f"FLOPS Table-2 style ({u}/s)"] = (_col(df, "flops_per_s_table2") / sc).round(2)
        t[f"paper FLOPS ({u}/s)"] = (_col(df, "flops_per_s_table2_paper") / sc).round(2)
        t[f"FLOPS full ({u}/s)"] = (_col(df, "flops_per_s") / sc).round(2)
        t["MFU %"] = (100 * _col(df, "mfu")).round(1)
        t["device"] = _col(df, "device")
    return t.set_index("config")


def _layers(df):
    import pandas as pd

    u, sc = _unit(df)
    df = _sorted(df)
    t = pd.DataFrame({"layer": df["layer"]}, index=df.index)
    t["params (M)"] = (_col(df, "params") / 1e6).round(3)
    t[f"FLOPs Table-2 style ({u})"] = (_col(df, "flops_table2") / sc).round(2)
    t[f"FLOPs full ({u})"] = (_col(df, "flops_full") / sc).round(2)
    for k, name in (("attention", "attention"), ("contractions", "other matmuls"), ("sparse", "sparse")):
        t[f"of which {name} ({u})"] = (_col(df, f"flops_{k}") / sc).round(3)
    t["step (B x T)"] = _col(df, "step_shape")
    if _col(df, "step_s").notna().any():
        t["samples/s"] = _col(df, "samples_per_s").round(2)
        t["tokens/s"] = _col(df, "tokens_per_s").round(0)
        if _col(df, "step_spread").notna().any():  # the timed steps' 10-90% range over their median
            t["step spread %"] = (100 * _col(df, "step_spread")).round(1)
        t[f"achieved {u}FLOP/s"] = (_col(df, "flops_per_s") / sc).round(2)
        # against the baseline timed in the same rounds where the row has it (paired), else its row
        base = _col(df, "baseline_flops_per_s_beside").fillna(_col(df, "flops_per_s")[df["layer"] == BASELINE].max())
        t[f"× baseline's {u}FLOP/s"] = (_col(df, "flops_per_s") / base).round(2)
        t[f"peak {u}FLOP/s"] = (_col(df, "peak_flops_per_s") / sc).round(1)
        t["MFU %"] = (100 * _col(df, "mfu")).round(2)
        t["device"] = _col(df, "device")
    return t.set_index("layer")


def tables(df) -> dict:
    """The Table 2 comparison (configs beside the paper) and the per-layer cost table."""
    import pandas as pd

    out = {}
    cfg = df.get("setting.config", pd.Series(None, index=df.index, dtype=object)).notna()
    if cfg.any():
        out["Table 2 beside the paper: parameters, FLOPs of one training step, throughput"] = _table2(df[cfg])
    if (~cfg).any():
        out["Cost per layer: parameters, FLOPs of one training step, measured throughput"] = _layers(df[~cfg])
    return out


def figures(df, out_dir: Path) -> list[Path]:
    """cost.png: parameters and FLOPs per model (both counts, and the paper's where known)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    if df.empty:
        return []
    u, sc = _unit(df)
    df = _sorted(df).drop_duplicates("layer", keep="last")  # one bar per model: its largest step
    short = [n.split("/")[-1] for n in df["layer"]]
    def long(keys, value):  # one row per (model, what) with a value
        parts = [pd.DataFrame({"model": short, value: (_col(df, k) / scale).values, "count": label})
                 for k, label, scale in keys]
        return pd.concat(parts).dropna()

    params = long((("params", "memzoo", 1e6), ("params_paper", "paper", 1e6)), "params (M)")
    flops = long((("flops_table2", "Table-2 style", sc), ("flops_full", "full count", sc),
                  ("flops_table2_paper", "paper (Table 2)", sc)), f"FLOPs ({u})")
    with matplotlib.rc_context():  # the theme stays with this figure: the others keep theirs
        sns.set_theme(style="whitegrid")
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, max(3.5, 0.45 * len(short) + 1.8)), sharey=True)
        for ax, data, x, palette in ((a, params, "params (M)", ["#4C72B0", "#55A868"]),
                                     (b, flops, f"FLOPs ({u})", ["#4C72B0", "#DD8452", "#55A868"])):
            hues = list(dict.fromkeys(data["count"]))  # first-seen order: ours, then the paper's
            sns.barplot(data=data, y="model", x=x, hue="count", order=short, hue_order=hues,
                        palette=palette[: len(hues)], ax=ax)
            ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=8, frameon=False)
        shape = _col(df, "step_shape").dropna()
        a.set_title("parameters", pad=20)
        b.set_title(f"FLOPs of one training step ({shape.iloc[0] if len(shape) else ''} tokens)", pad=20)
        fig.tight_layout()
        return [save_png(fig, Path(out_dir) / "cost.png")]
