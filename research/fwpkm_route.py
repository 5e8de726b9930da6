"""Why FwPKM does not recall when its memory is the only route, and what does.
Finding: docs/journal/toys.md, "FwPKM through the memory alone, one change at a time".

The recall preset's FwPKM cell (zoo_configs/bench/recall.yaml: MQAR of 64 tokens, vocabulary 64,
4 / 8 / 12 pairs, every query at least 9 tokens after its pair; 2 blocks whose mixers are 4-token
sliding windows; FwPKM with 64² slots of dim 64, top-8, chunk 8, a memory per sequence; the
preset's precision, compile, lr 3e-3, seed 0) at the standard toys' width and batch (128, 64; ``--width``, ``--batch``),
trained in the forms below, one change each. Every ``--every`` steps it prints the validation
accuracy per slice and two of the paper's diagnostics on 64 validation sequences of 4 pairs, read
in fp32 eager:

- ``hit``: at the query positions, the share of the read's top-k weight on slots whose last
  writer is the queried pair's value token in the same sequence (the paper's [HIT], Fig. 5);
- ``gate_q``: the mean gate g_t at the query positions (Fig. 3), ``gate_all`` over all tokens.

::

    python -m research.fwpkm_route                 # every form, 800 steps each
    python -m research.fwpkm_route token paper --steps 400

One form is about 4-7 minutes on one thread (``release`` ~3x: its writes keep their graph).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

#: form -> (where FwPKM sits, its options over the preset's); one change from "paper" each
FORMS = {
    "paper": ("last", {}),  # the paper's FwPKM, between the last block's mixer and FFN
    "release": ("last", {"variant": "release"}),  # the authors' release (before the mixer, addr. weight 1, ...)
    "addr1": ("last", {"addr_loss_weight": 1.0}),  # the release's addressing-loss weight
    "small": ("last", {"n_subkeys": 8}),  # 64 slots instead of 4096
    "first": ("0", {}),  # the first block, after its mixer
    "token": ("0", {"before_mixer": True}),  # the first block, before its mixer: the query sees the token alone
    "token_addr1": ("0", {"before_mixer": True, "addr_loss_weight": 1.0}),  # the recall preset's fwpkm/token
    "token_addr0": ("0", {"before_mixer": True, "addr_loss_weight": 0.0}),  # sub-keys never move: is the wear their drift?
}


@torch.no_grad()
def diagnostics(model, x, y, n_pairs: int) -> dict:
    """hit, gate_q and gate_all of one fp32 eager forward (module docstring)."""
    from memzoo.data import mqar

    (mem,) = model.memories()
    was, start = model.training, model.memory_state(persistent_only=True)
    model.eval()(x, targets=y)
    model.train(was)
    st = mem.stats()
    model.load_memory_state(start)
    tr, q = st["trace"], y != mqar.IGNORE
    b, t = q.nonzero(as_tuple=True)
    keys = x[:, : 2 * n_pairs : 2]  # [B, n]
    pair = (keys[b] == x[b, t].unsqueeze(-1)).float().argmax(-1)  # which pair each query asks
    mine = (tr["writer_pos"][b, t] == (2 * pair + 1).unsqueeze(-1)) & (tr["writer_seq"][b, t] == b.unsqueeze(-1))
    out = {"hit": (tr["weights"][b, t] * mine).sum(-1).mean().item()}
    if st.get("gates") is not None:
        out["gate_q"], out["gate_all"] = st["gates"][q].mean().item(), st["gates"].mean().item()
    return out


def run(form: str, steps: int, every: int, seed: int = 0, width: int = 128, batch: int = 64) -> dict:
    from memzoo.bench.common import load_preset
    from memzoo.bench.suites import toys

    at, opts = FORMS[form]
    preset = load_preset("recall")
    s = preset.settings(toys.NAME, toys.Settings)
    s.max_steps, s.min_steps, s.eval_every, s.patience, s.val_size = steps, steps, every, steps, 128
    s.widths, s.batch_size = [width], batch
    s.variants = {"fwpkm/probe": {"layer": "fwpkm", "at": at, "options": opts}}
    task = toys.MQAR(s)
    mc = toys.toy_config(preset, "fwpkm/probe", s.widths[0], task.vocab, s)
    n = s.mqar_kv[0]
    x, y = (t[:64] for t in task.val[n])
    trace, t0, evaluate = [], time.perf_counter(), toys.evaluate

    def watched(model, sets, batch_size):  # every validation, with the diagnostics
        acc = evaluate(model, sets, batch_size)
        if sets is task.val:
            rec = {"s": round(time.perf_counter() - t0), **{f"val{k}": round(v, 3) for k, v in acc.items()},
                   **{k: round(v, 3) for k, v in diagnostics(model, x, y, n).items()}}
            trace.append(rec)
            print(json.dumps({"form": form, **rec}), flush=True)
        return acc

    toys.evaluate = watched
    try:
        fit = toys.train_cell(mc, task, 3e-3, s, seed)  # the standard toys' lr, in the middle of the sweep
    finally:
        toys.evaluate = evaluate
    return {"form": form, "at": at, "options": opts, "best_val": round(fit.val, 3), "steps": fit.steps,
            "train_loss": round(fit.train_loss, 3), "trace": trace}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("forms", nargs="*", help=f"forms to train (default: all): {', '.join(FORMS)}")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args(argv)
    unknown = [f for f in a.forms if f not in FORMS]
    if unknown:
        ap.error(f"unknown form(s) {unknown}; forms: {', '.join(FORMS)}")
    torch.set_num_threads(1)
    from memzoo.cpu import tune_cpu

    tune_cpu()
    for f in a.forms or list(FORMS):
        r = run(f, a.steps, a.every, a.seed, a.width, a.batch)
        print(json.dumps({k: v for k, v in r.items() if k != "trace"}), flush=True)


if __name__ == "__main__":
    main()
