"""Why the NIAH suite's LMs stay at chance, and what a positive control needs (issue 13, step 1).

The learning curve of one LM of the bench (the `standard` preset's recipe by default: the tiny
preset's backbone, 4 blocks, d=128, byte tokens, AdamW lr 3e-3, batch 16 x 256, bf16 autocast,
torch.compile), trained on the suite's data (:class:`memzoo.data.niah.NeedleMix`: a fraction
`train_mix` of the windows are needle samples whose answer tokens weigh `answer_weight`), and
every `eval_every` steps scored on

- training-format windows from the validation split: answer digits right (teacher-forced
  argmax), windows with every answer exact, and the answers' cross-entropy (chance: ln 10 =
  2.303 nats per digit);
- the suite's NIAH samples (5 needles) at haystack lengths inside the training length: exact
  match, as the suite scores it.

Findings (AMD EPYC, one thread; ``ctrl:attention`` is full attention with a short convolution on
q, k, v, the toys' positive control):

1. With the plain LM loss the answer digits are targets like every token, so they are trained,
   but they are 2-5% of a needle window and give no signal until a copy circuit exists. An
   earlier version of this experiment (needle windows only, 128 tokens, 2-3 needles; commit
   2c34572) measured: attention with answer weight 1 at 1500 steps, digits 0.101, windows exact
   0.000, answer NLL 2.292; with weight 20 at 750 steps 0.778 / 0.039 / 0.625 and at 2000 steps
   0.998 / 0.977 / 0.011; the 4-layer GDN with weight 20 at 2000 steps 0.096 / 0.000 / 2.286.
2. Weighting alone does not carry over to the suite's LM (the table below, from this script).

    python -m memzoo.bench.experiments.niah_control                       # ctrl:attention, standard recipe
    python -m memzoo.bench.experiments.niah_control --steps 3000 --train-mix 1.0
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


def run(layer: str, preset: str = "standard", eval_every: int = 250, lengths=(192,), samples: int = 24,
        needles: int = 5, **overrides) -> list[dict]:
    """Train `layer`'s LM of `preset` (its train: and niah: settings, with `overrides` of
    steps, seq_len, train_mix, answer_weight, lr), scoring it every `eval_every` steps."""
    from memzoo.backbone.model import HybridLM
    from memzoo.bench.common import load_preset, lm_train_config, model_config
    from memzoo.bench.suites import niah
    from memzoo.config import RunConfig
    from memzoo.data import get_tokenizer
    from memzoo.data.niah import NeedleMix, TextSource
    from memzoo.train import lr_at, make_step, param_groups, prepare_data, to_device

    p = load_preset(preset)
    s = p.settings(niah.NAME, niah.Settings)
    mix = {"train_mix": overrides.pop("train_mix", s.train_mix), "answer_weight": overrides.pop("answer_weight", s.answer_weight)}
    tc = lm_train_config(p, **overrides)
    rc = RunConfig(model_config(p, layer), tc)
    data, _, _ = prepare_data(rc, leave_out=("Sonnets",), needle_mix=mix["train_mix"], answer_weight=mix["answer_weight"])
    tok = get_tokenizer(tc.tokenizer)
    val = niah.eval_texts(tc.corpus, tc.seed)
    windows = probe_windows(NeedleMix(None, val, tok, tc.seq_len, mix=1.0), 64)
    source = TextSource(val, tok)
    ns = niah.Settings(lengths=list(lengths), iters=[1], samples=samples, depth_buckets=1, needles=needles)

    torch.manual_seed(tc.seed)
    model = HybridLM(rc.model).train()
    opt = torch.optim.AdamW(param_groups(model, tc), lr=tc.lr, betas=tuple(tc.betas))
    step = make_step(model, opt, tc.grad_clip, tc.precision, compile=tc.compile)
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
    ap.add_argument("--needles", type=int, default=5, help="needles per NIAH eval sample")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--lengths", default="192")
    ap.add_argument("--min-needles", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    over = {k: v for k, v in {"steps": a.steps, "seq_len": a.seq_len, "train_mix": a.train_mix,
                              "answer_weight": a.answer_weight, "lr": a.lr, "batch_size": a.batch_size,
                              "betas": None if a.beta2 is None else [0.9, a.beta2]}.items() if v is not None}
    if a.min_needles > 1:  # experiment: denser needle windows
        import memzoo.data.niah as nm
        orig = nm.NeedleMix.window
        def window(self, rng, _k=a.min_needles):
            r = random.Random(rng.random())
            class R(random.Random):
                pass
            return orig(self, _Dense(rng, _k))
        class _Dense:
            def __init__(self, rng, k): self.rng, self.k = rng, k
            def randint(self, lo, hi): return self.rng.randint(max(lo, self.k), hi)
            def __getattr__(self, n): return getattr(self.rng, n)
        nm.NeedleMix.window = window
    run(a.layer, a.preset, a.eval_every, [int(n) for n in a.lengths.split(",")], needles=a.needles, **over)
