"""Why the NIAH suite's LMs stay at chance, and what a positive control needs (issue 13, step 1).
Finding: docs/journal/niah.md, "The positive control (issue 13)".

The learning curve of one NIAH LM of the bench (the `standard` preset's by default: the tiny
preset's backbone, 4 blocks, d=128, byte tokens, AdamW lr 3e-3, batch 16, bf16 autocast,
torch.compile, the train: section changed by `niah.lm`), trained on the suite's data
(:class:`memzoo.data.niah.NeedleMix`: a fraction `train_mix` of the windows are needle samples
whose answer tokens weigh `answer_weight`), and every `eval_every` steps scored on

- training-format windows from the validation split: answer digits right (teacher-forced
  argmax), windows with every answer exact, and the answers' cross-entropy (chance: ln 10 =
  2.303 nats per digit);
- the suite's NIAH samples at haystack lengths inside the training length: exact match, as the
  suite scores it.

What it found (the table and the conclusions are in the suite's docstring,
bench/suites/niah.py, "The positive control"): with the plain LM loss attention never learns to
copy the answer; with the answer tokens weighted 20x it does, but text windows beside the needle
windows and 256-token windows each delay that beyond a CPU budget, and Adam's beta2 = 0.95 slows
it; all-needle 128-token windows with beta2 0.98 are the standard preset's recipe.

    python -m research.niah_control          # the standard preset's NIAH LM
    python -m research.niah_control --seq-len 256 --train-mix 0.5 --beta2 0.95 --lengths 192 --needles 5
    python -m research.niah_control --seq-len 256 --train-mix 1.0 --beta2 0.95 --min-needles 5 ...
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def probe_windows(mix, n: int, seed: int = 1):
    """n training-format needle windows (inputs, targets, answer mask) from `mix`'s texts."""
    rng = random.Random(seed)
    ws = [mix.window(rng) for _ in range(n)]
    w, m = torch.stack([x for x, _ in ws]), torch.stack([a for _, a in ws])
    return w[:, :-1], w[:, 1:], m[:, 1:]


def score(model, windows) -> dict:
    x, y, m = windows
    with torch.no_grad():
        logits = model(x).logits.float()
    hit = logits.argmax(-1) == y
    return {"digits": round(hit[m].float().mean().item(), 3),
            "windows_exact": round((hit | ~m).all(-1).float().mean().item(), 3),
            "answer_nll": round(torch.nn.functional.cross_entropy(logits[m], y[m]).item(), 3)}


class AtLeast:
    """A random.Random whose randint(lo, hi) draws from [max(lo, k), hi]: NeedleMix windows with
    at least k needles (as many as fit), for the experiment's dense-window rows."""

    def __init__(self, rng: random.Random, k: int):
        self.rng, self.k = rng, k

    def randint(self, lo: int, hi: int) -> int:
        return self.rng.randint(max(lo, self.k), hi)

    def __getattr__(self, name):
        return getattr(self.rng, name)


def run(layer: str, preset: str = "standard", eval_every: int = 250, lengths=(96,), samples: int = 24,
        needles: int | None = None, min_needles: int = 1, **overrides) -> list[dict]:
    """Train `layer`'s NIAH LM of `preset` (its train:, niah.lm and niah: settings, with
    `overrides` of steps, seq_len, batch_size, betas, lr, train_mix, answer_weight), scoring it
    every `eval_every` steps on NIAH samples of `needles` needles (default: the preset's)."""
    from memzoo.backbone.model import HybridLM
    from memzoo.bench.common import load_preset, lm_train_config, model_config
    from memzoo.bench.lm import HELD_OUT_TITLES
    from memzoo.bench.suites import niah
    from memzoo.config import RunConfig
    from memzoo.data import get_tokenizer
    from memzoo.data.niah import NeedleMix, TextSource
    from memzoo.train import lr_at, make_step, param_groups, prepare_data, resolve_precision, to_device

    p = load_preset(preset)
    s = p.settings(niah.NAME, niah.Settings)
    mix = {"train_mix": overrides.pop("train_mix", s.train_mix), "answer_weight": overrides.pop("answer_weight", s.answer_weight)}
    tc = lm_train_config(p, **{**s.lm, **overrides})
    rc = RunConfig(model_config(p, layer), tc)
    data, _, _ = prepare_data(rc, leave_out=HELD_OUT_TITLES, needle_mix=mix["train_mix"], answer_weight=mix["answer_weight"])
    if min_needles > 1:
        window = data.window
        data.window = lambda rng: window(AtLeast(rng, min_needles))
    tok = get_tokenizer(tc.tokenizer)
    val = niah.eval_texts(tc.corpus, tc.seed)
    windows = probe_windows(NeedleMix(None, val, tok, tc.seq_len, mix=1.0), 64)
    source = TextSource(val, tok)
    ns = niah.Settings(lengths=list(lengths), iters=[1], samples=samples, depth_buckets=1, needles=needles or s.needles)

    torch.manual_seed(tc.seed)
    model = HybridLM(rc.model).train()
    opt = torch.optim.AdamW(param_groups(model, tc), lr=tc.lr, betas=tuple(tc.betas))
    step = make_step(model, opt, tc.grad_clip, resolve_precision(tc.precision, "cpu"), compile=tc.compile)
    out, t0 = [], time.time()
    for i in range(tc.steps):
        loss = step([to_device(data.batch(i, tc.batch_size), "cpu")], lr_at(i, tc))
        if (i + 1) % eval_every == 0 or i + 1 == tc.steps:
            model.eval()
            rec = {"layer": layer, **mix, "seq_len": tc.seq_len, "step": i + 1, "loss": round(loss, 3), **score(model, windows)}
            for r in niah.evaluate_niah(model, source, tok, ns):
                rec[f"niah{r['setting']['length']}"] = round(r["metrics"]["accuracy"], 3)
            rec["seconds"] = round(time.time() - t0)
            model.train()
            print(rec, flush=True)
            out.append(rec)
    return out


if __name__ == "__main__":
    from memzoo.bench.common import POSITIVE

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layer", default=POSITIVE)
    ap.add_argument("--preset", default="standard")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--train-mix", type=float)
    ap.add_argument("--answer-weight", type=float)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--beta2", type=float)
    ap.add_argument("--needles", type=int, help="needles per NIAH sample (default: the preset's)")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--lengths", default="96", help="NIAH haystack lengths (inside the training length)")
    ap.add_argument("--min-needles", type=int, default=1, help="needle windows with at least this many needles")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from memzoo.cpu import tune_cpu

    tune_cpu()  # subnormals flushed, freed activations kept in the heap
    over = {k: v for k, v in {"steps": a.steps, "seq_len": a.seq_len, "train_mix": a.train_mix,
                              "answer_weight": a.answer_weight, "lr": a.lr, "batch_size": a.batch_size,
                              "betas": None if a.beta2 is None else [0.9, a.beta2]}.items() if v is not None}
    run(a.layer, a.preset, a.eval_every, [int(n) for n in a.lengths.split(",")], needles=a.needles, min_needles=a.min_needles, **over)
