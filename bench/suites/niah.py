"""niah: needle in a haystack with n-iter memorization (FwPKM Sec. 4.3, Figure 4).

Samples (:mod:`memzoo.data.niah`): a haystack of held-out text (the validation documents of the
LM's corpus) of ``length`` tokens with 5 needles "Remember qzfa=481273." at random line
starts, then a question for one key; exact match on the 6 answer digits.

n-iter NIAH: "the model forwards the same haystack context n times before answering", and
"FwPKM's process chunk size C is accordingly changed to the length of each haystack context
such that it updates its memory once after reading an entire haystack". Per sample and n the
model reads one stream

    haystack, haystack, ..., haystack (n times), question, answer

with batch 1. The haystack is streamed in calls of ``piece`` tokens with the cache carried (so
activations stay bounded at 128K tokens); each pass runs inside ``one_chunk()`` of every
chunk-level read-then-write memory (FwPKM, FwMLP, LaCT): the pieces only read, and leaving the
pass writes the whole haystack as one chunk (C = haystack length). Token-recurrent and
inclusive layers (MoM, linear attention, Ba) and the GDN backbone just carry their state
across the passes. The question and answer are one teacher-forced call with the layers' own
chunk sizes; the answer counts as correct when the argmax at every answer position is its
digit (the same as greedy decoding of the 6 digits).

The n passes of a sample are shared by its n-iter evaluations: after pass n the model's state
(backbone cache and every memory's fast weights) is copied, the question asked, and the copy
put back before pass n+1, so n = 1..4 cost 4 haystack reads, not 10. Before each sample,
persistent memories (FwPKM's fast weights, shared across sequences) go back to their trained
value, so samples never leak into each other, and they are left as trained at the end.
`needs_targets` layers (FWL) get the next tokens of the stream as targets, except at the last
token of a pass, whose successor (another pass or the question) is left unknown (-100) so the
shared passes are exact for every n.

Metrics per (layer, length, n_iter): ``accuracy`` (exact match), ``digit_accuracy`` (answer
digits right), ``answer_nll`` (mean cross-entropy of the answer tokens, nats: a graded signal
where exact matches are rare, as for minutes-trained tiny models; chance is ln 10 = 2.30 per
digit), ``by_depth`` (accuracy per depth bucket of the queried needle; the queried
needle's bucket is stratified over the samples so every bucket is filled), ``tokens_per_s``
(every token read for that length, all passes and questions, over the wall time) and
``peak_rss_gib`` (the process's peak resident memory so far).

The LMs. The tiny preset's LM (shared with the ppl suite) is trained with needle windows mixed
into its text (``train_mix``, :class:`memzoo.data.niah.NeedleMix`); at its 200 steps every model
answers at chance, so there the graded ``answer_nll`` and ``digit_accuracy`` are what to compare.
The standard preset trains the suite's LMs apart (``lm``: the preset's train: section changed for
them; :mod:`memzoo.bench.lm`): 128-token windows that are all needle samples, the answer tokens
weighted ``answer_weight`` = 20 in the loss, and asks one needle per haystack (``needles``), at
96 tokens (inside the training length) and beyond. The paper preset uses plain text and 5
needles, as the paper does.

The positive control. Full attention with a short convolution (``ctrl:attention``) must copy a
needle it can see before any layer row means something. With the plain LM loss it never did (the
answer digits are 2-5% of a needle window); weighting the answer tokens (``answer_weight``) in
all-needle 128-token windows forms the copy circuit within a CPU budget, hence the standard
preset's NIAH LMs. One needle per haystack: telling two needles apart is a matter of the LM's
budget (an induction copy comes before a key-bound one), not of its memory. The calibration runs:
docs/journal/niah.md.

The memory the only route (issue 39; the pilots: docs/journal/niah.md). The standard preset's NIAH LMs
(``model``: the preset's backbone with these changes, for the suite's own LMs) have every mixer a
4-token sliding window: 4 blocks reach 12 tokens back, and from any answer position the needle's
digits are at least 22 tokens away, so the backbone alone cannot copy a needle and a row above it
got the needle through its memory; `validity` holds the backbone alone to chance, as the negative
control. The controls read each haystack once (``n_iter`` 1): n-iter is a memory's, and full
attention over four 4K-token passes cost two hours. Why the paper's FwPKM stays at chance here
(its row shares one memory across the batch, as the paper trains it): in training a question's read
lands on its needle's slots for 1-2% of its weight, the batch's other sequences having overwritten
them (16-26% for the same windows read one at a time), the paper's gate (Fig. 3) and [HIT] (Fig. 5)
measured by ``python -m research.niah_fwpkm LM_DIR``. Of the changes measured one
at a time (the memory in block 0 where the query at the needle and the question is computed from
the same 4 tokens; chunk 16; ``variant: release``; its addressing loss alone; a memory per
sequence), only the last made FwPKM carry needles, hence the variant ``fwpkm/seq`` (``variants``:
extra LMs of a layer with another place or options, rows of their own). Its n-iter gain at 4K
comes from the needle's own slots written again, not from reads that find them more often (their
share of the read falls with each pass).

The 128K-token check (not in the default run; peak RSS and speed of untrained models, one layer
per process: docs/journal/niah.md holds the figures)::

    python -m memzoo.bench.suites.niah --preset standard --layers fwpkm --lengths 131072 --iters 1 --samples 1 --untrained
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from memzoo.bench.common import BASELINE, CONTROLS, Context, check_backbone, check_variants, mean_ci, wilson
from memzoo.bench.registry import Suite, register_suite
from memzoo.data.niah import NiahSample, TextSource, _question, depth_bins, depth_label, niah_samples

NAME = "niah"



@dataclass
class Settings:
    lengths: list = field(default_factory=lambda: [1024, 4096])  # haystack tokens (paper: 4K, 8K, 32K, 128K); add 131072 for the 128K run
    iters: list = field(default_factory=lambda: [1, 2, 3, 4])  # n of n-iter NIAH
    samples: int = 12  # per length (paper: 500)
    needles: int = 5
    depth_buckets: int = 4  # rows of the depth x length heatmap
    piece: int = 1024  # tokens per streamed call; a multiple of every unstretched layer's chunk (FWL's 256) streams exactly
    stretch_chunk: bool = True  # one memory update per pass for chunk-level layers (C = haystack length)
    train_mix: float = 0.3  # fraction of needle windows in the shared LM's training (memzoo.bench.lm)
    answer_weight: float = 1.0  # weight of the needle windows' answer tokens in the LM loss (NeedleMix)
    controls: bool = False  # with the baseline, the controls' LMs: attention + short conv (positive), no mixer (negative)
    lm: dict = field(default_factory=dict)  # LMs of the suite's own: the preset's train: section with these changes ({}: share ppl's)
    model: dict = field(default_factory=dict)  # their backbone: the preset's model: section with these changes (needs lm)
    variants: dict = field(default_factory=dict)  # extra LMs of a layer: {name: {layer: L, options: {...}, at: A}}
    seed: int = 1234  # the eval samples' seed (the same haystacks for every layer)

    def __post_init__(self):
        from memzoo.config import ConfigError

        if not self.lengths or any(int(n) < 1 for n in self.lengths):
            raise ConfigError(f"niah.lengths must be positive token counts, got {self.lengths}")
        if not self.iters or any(int(n) < 1 for n in self.iters):
            raise ConfigError(f"niah.iters must be integers >= 1, got {self.iters}")
        for name in ("samples", "needles", "depth_buckets", "piece"):
            if getattr(self, name) < 1:
                raise ConfigError(f"niah.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.train_mix <= 1.0:
            raise ConfigError(f"niah.train_mix must be in [0, 1], got {self.train_mix}")
        if not self.answer_weight > 0:
            raise ConfigError(f"niah.answer_weight must be > 0, got {self.answer_weight}")
        if self.lm:
            from memzoo.config import TrainConfig

            try:
                TrainConfig.from_dict(dict(self.lm))
            except ConfigError as e:
                raise ConfigError(f"niah.lm: {e}") from None
        check_backbone(self.model, "niah.model")
        check_variants(self.variants, "niah.variants")
        self.lengths = sorted({int(n) for n in self.lengths})
        self.iters = sorted({int(n) for n in self.iters})


# ---- the protocol -------------------------------------------------------------------------------


def stretchable(m) -> bool:
    """A chunk-level read-then-write memory: its update chunk can span a whole pass."""
    return m.chunk_size is not None and not m.inclusive and not m.needs_targets


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


@torch.no_grad()
def read_and_ask(
    model, sample: NiahSample, iters: list[int], piece: int, stretch_chunk: bool = True, device: str = "cpu"
) -> dict[int, torch.Tensor]:
    """The answer logits [len(answer), V] after reading the haystack n times, for each n in
    `iters` (one stream per sample; see the module docstring). Starts new sequences (cache
    None); persistent memories start from whatever fast weights they hold now."""
    mems = model.memories()
    stretch = [m for m in mems if stretch_chunk and stretchable(m)]
    needs_t = any(m.needs_targets for m in mems)
    hay = sample.haystack.to(device)
    L = hay.numel()
    hay_t = torch.cat([hay[1:], hay.new_full((1,), -100)])  # the pass's last successor is unknown
    q, a = sample.question.to(device), sample.answer.to(device)
    tail = torch.cat([q, a])
    tail_in, tail_t = tail[None, :-1], tail[None, 1:]
    cache, out = None, {}
    for n in range(1, max(iters) + 1):
        with contextlib.ExitStack() as stack:
            for m in stretch:
                stack.enter_context(m.one_chunk())
            for s in range(0, L, piece):
                t = hay_t[None, s : s + piece] if needs_t else None
                cache = model(hay[None, s : s + piece], targets=t, cache=cache, use_cache=True).cache
        if n in iters:
            last = n == max(iters)
            saved = None if last else (model.memory_state(), _clone(cache))
            res = model(tail_in, targets=tail_t if needs_t else None, cache=cache, use_cache=not last)
            out[n] = res.logits[0, q.numel() - 1 :].float()
            if saved is not None:
                model.load_memory_state(saved[0])
                cache = saved[1]
    return out


def peak_rss_gib() -> float:
    """Peak resident memory of this process so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**30 if sys.platform == "darwin" else r / 2**20


def evaluate_niah(
    model,
    texts: list[str] | TextSource,
    tokenizer,
    s: Settings,
    device: str = "cpu",
    on_sample=None,
) -> list[dict]:
    """n-iter NIAH of `model` on haystacks from `texts` (held-out text). Returns one
    ``{"setting": {length, n_iter}, "metrics": {...}, "wall_s"}`` per (length, n_iter).
    `on_sample(length)` is called after each sample (its haystack length)."""
    source = texts if isinstance(texts, TextSource) else TextSource(texts, tokenizer)
    mems = model.memories()
    for m in mems:
        if m.chunk_size and not (s.stretch_chunk and stretchable(m)) and s.piece % m.chunk_size:
            warnings.warn(f"niah.piece={s.piece} is not a multiple of {m.name}'s chunk size {m.chunk_size}: "
                          "its updates then follow the piece boundaries, not its chunks", stacklevel=2)
    trained = model.memory_state(persistent_only=True)  # the trained fast weights
    bins = depth_bins(s.depth_buckets)
    rows = []
    try:
        for length in s.lengths:
            samples = niah_samples(source, tokenizer, length, s.samples, s.seed, s.needles, s.depth_buckets)
            hits = {n: [] for n in s.iters}
            digits = {n: [] for n in s.iters}
            nll = {n: [] for n in s.iters}
            tokens, t0 = 0, time.time()
            for smp in samples:
                model.load_memory_state(trained)
                logits = read_and_ask(model, smp, s.iters, s.piece, s.stretch_chunk, device)
                tokens += max(s.iters) * length + len(s.iters) * (smp.question.numel() + smp.answer.numel() - 1)
                for n, lg in logits.items():
                    ok = lg.argmax(-1).cpu() == smp.answer
                    hits[n].append(bool(ok.all()))
                    digits[n].append(ok.float().mean().item())
                    nll[n].append(torch.nn.functional.cross_entropy(lg.cpu(), smp.answer).item())
                if on_sample is not None:
                    on_sample(length)
            wall = time.time() - t0
            depths = [min(int(smp.depth * s.depth_buckets), s.depth_buckets - 1) for smp in samples]
            for n in s.iters:
                by_depth = {}
                for b, (lo, hi) in enumerate(bins):
                    sel = [h for h, d in zip(hits[n], depths) if d == b]
                    if sel:
                        by_depth[depth_label(lo, hi)] = sum(sel) / len(sel)
                lo, hi = wilson(sum(hits[n]), len(hits[n]))
                metrics = {
                    "accuracy": sum(hits[n]) / len(hits[n]),
                    "accuracy_lo": lo,
                    "accuracy_hi": hi,
                    "digit_accuracy": sum(digits[n]) / len(digits[n]),
                    "digit_accuracy_half": mean_ci(digits[n])[1],
                    "answer_nll": sum(nll[n]) / len(nll[n]),
                    "n_samples": len(samples),
                    "by_depth": by_depth,
                    "tokens_per_s": tokens / wall,
                    "peak_rss_gib": peak_rss_gib(),
                }
                rows.append({"setting": {"length": length, "n_iter": n}, "metrics": metrics, "wall_s": wall})
    finally:
        model.load_memory_state(trained)  # leave the model's memories as they were trained
    return rows


def eval_texts(corpus: str, seed: int) -> list[str]:
    """The held-out documents of the LM's corpus (the same split `memzoo.bench.lm` trains on)."""
    from memzoo.data import load_corpus, split_documents

    return list(split_documents(load_corpus(corpus), seed=seed)["validation"]["text"])


def work(ctx: Context, layer: str) -> int:
    """Units of work for the progress bar: the samples of one layer's LMs (every length)."""
    from memzoo.bench.lm import models

    s = ctx.preset.settings(NAME, Settings)
    return len(models(ctx, layer, NAME)) * len(s.lengths) * s.samples


def recorded_rows(ctx: Context, layer: str) -> list[dict] | None:
    """The rows of `layer`'s LM (a model of `lm.models`) already recorded at every cell, as `lm.recorded`."""
    from memzoo.bench.lm import recorded

    s = ctx.preset.settings(NAME, Settings)
    asked = replace(s, iters=[1]) if layer in CONTROLS else s  # n-iter is a memory's; a control reads once
    return recorded(ctx, NAME, layer, [{"length": n, "n_iter": i} for n in s.lengths for i in asked.iters],
                    {"niah": asdict(s)})


def run(ctx: Context, layers: list[str]) -> list[dict]:
    from memzoo.bench.lm import models, shared_lm
    from memzoo.data import get_tokenizer

    s = ctx.preset.settings(NAME, Settings)
    rows, sources = [], {}
    for layer in [m for name in layers for m in models(ctx, name, NAME)]:
        asked = replace(s, iters=[1]) if layer in CONTROLS else s  # n-iter is a memory's; a control reads once
        done = recorded_rows(ctx, layer)
        if done:  # a resumed run: every cell of this LM is recorded
            rows += done
            ctx.advance(len(s.lengths) * s.samples, f"niah {layer} (recorded)")
            continue
        model, info = shared_lm(ctx, layer, NAME)
        tc = info["config"]["train"]
        tok = get_tokenizer(tc["tokenizer"])
        key = (tc["corpus"], tc["tokenizer"], tc["seed"])
        if key not in sources:
            sources[key] = TextSource(eval_texts(tc["corpus"], tc["seed"]), tok)
        config = {"lm": info["config"], "niah": asdict(s)}
        q, a = _question(tok, "qzfa", "4" * 6)
        qa = q.numel() + a.numel() - 1  # the question and the answer but its last token are inputs
        def on_sample(length: int, layer=layer) -> None:
            ctx.advance(1, f"niah {layer} {length} tokens")

        for r in evaluate_niah(model, sources[key], tok, asked, ctx.device, on_sample):
            r["metrics"].update(lm_val_loss=info["val_loss"], lm_steps=info["steps"], lm_tokens=info.get("tokens"),
                                inside_training=r["setting"]["length"] + qa <= tc["seq_len"], params=info["params"])
            rows.append(ctx.record(NAME, layer, r["setting"], r["metrics"], config, r["wall_s"]))
    return rows


# ---- the 128K check -----------------------------------------------------------------------------


def main(argv=None) -> None:
    """Run n-iter NIAH on the preset's models outside the bench (e.g. the 128K-token check)
    and print accuracy, throughput and peak RSS per layer and length. Each layer runs in the
    process this is called from, so run one layer per process to read its own peak RSS."""
    import json

    from tqdm.auto import tqdm

    from memzoo.backbone.model import HybridLM
    from memzoo.bench.common import check_layers, lm_train_config, load_preset, model_config
    from memzoo.data import get_tokenizer

    ap = argparse.ArgumentParser(prog="python -m memzoo.bench.suites.niah", description=main.__doc__)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--layers", default="baseline", help="comma-separated; 'baseline' = the backbone alone")
    ap.add_argument("--lengths", default=None, help="comma-separated haystack lengths in tokens (default: the preset's)")
    ap.add_argument("--iters", default=None, help="comma-separated n of n-iter (default: the preset's)")
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--piece", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--untrained", action="store_true", help="randomly initialised models (no LM training): for cost/RSS checks")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    from memzoo.cpu import tune_cpu

    tune_cpu()  # subnormals flushed, freed activations kept in the heap
    preset = load_preset(a.preset)
    s = preset.settings(NAME, Settings)
    over = {"lengths": a.lengths, "iters": a.iters}
    kw = {k: [int(v) for v in val.split(",")] for k, val in over.items() if val}
    kw.update({k: v for k, v in (("samples", a.samples), ("piece", a.piece)) if v is not None})
    s = Settings(**{**asdict(s), **kw})
    tc = lm_train_config(preset, seed=a.seed, **s.lm)
    tok = get_tokenizer(tc.tokenizer)
    source = TextSource(eval_texts(tc.corpus, a.seed), tok)
    names = [BASELINE] if BASELINE in a.layers.split(",") else []
    names += check_layers(a.layers.split(","))
    for layer in names:
        if a.untrained:
            torch.manual_seed(a.seed)
            model = HybridLM(model_config(preset, layer)).to(a.device).eval()
        else:
            from memzoo.bench.common import Context, Recorder
            from memzoo.bench.lm import shared_lm

            with tqdm(desc=f"lm {layer}", unit="step") as bar:  # trained unless cached
                ctx = Context(preset, a.seed, Recorder("/dev/null", preset.name, a.seed),
                              Path("runs") / "bench" / preset.name, a.device, True, lambda n, doing: bar.update(n))
                model, _ = shared_lm(ctx, layer, NAME)
        with tqdm(total=len(s.lengths) * s.samples, desc=f"niah {layer}", unit="sample") as bar:
            rows = evaluate_niah(model, source, tok, s, a.device, lambda length: bar.update(1))
        for r in rows:
            m = r["metrics"]
            print(json.dumps({"layer": layer, **r["setting"], "accuracy": m["accuracy"],
                              "digit_accuracy": round(m["digit_accuracy"], 3),
                              "answer_nll": round(m["answer_nll"], 3), "tokens_per_s": round(m["tokens_per_s"]),
                              "peak_rss_gib": round(m["peak_rss_gib"], 3), "wall_s": round(r["wall_s"], 1)}), flush=True)


if __name__ == "__main__":
    main()


register_suite(Suite(NAME, Settings, run, work, uses_lm=True, recorded=recorded_rows))
