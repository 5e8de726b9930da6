"""Why the recall preset's ``fwpkm/token`` cell recalls within its first steps and then wears down.
Finding: docs/journal/toys.md, "Why fwpkm/token collapses".

The recall preset's cell (zoo_configs/bench/recall.yaml: FwPKM in block 0 before the mixer, a
memory per sequence, addressing-loss weight 1) trained exactly as the bench trains it (same
settings, seed, batches, schedule; `toys.train_cell`), probed every ``--every`` steps on a fixed
batch of validation sequences (12 pairs). The memory sits before block 0's mixer, so its input
is the token's embedding alone: its query, value and gate are functions of the token. Probes:

- ``acc``: the model's accuracy on the probe batch.
- ``mem_acc``: the memory's own answer at each query: the read v̂ decoded to the nearest (cosine)
  of the sequence's value tokens' values v(u); right when that is the query's value.
- ``fill_acc``: the same, for the queries whose key occurs as filler between its pair and its
  query (a filler key followed by a filler token writes a wrong pair for that key); ``fill_frac``
  their share of the queries.
- ``v_cos``: mean |cosine| between distinct value tokens' values v(u), over the whole value half of
  the vocabulary; ``v_cos_max`` the largest (two value tokens the memory cannot tell apart).
- ``g_key`` / ``g_val`` / ``g_fill``: the mean write gate of key tokens, value tokens, and of the
  key tokens at filler positions.
- ``slot_overlap``: the share of a query's read weight on slots its pair's key token wrote (the
  key's own lookup, in its chunk); ``q_norm`` the mean query norm of the key tokens; ``key_drift``
  how far the addressing loss moved the fast sub-keys by the sequence's end (relative norm).
- ``emb_norm``: the mean norm of the (tied) embedding's value rows.

    python -m research.fwpkm_token_collapse --seed 1 --lr 1e-3 --steps 400
    python -m research.fwpkm_token_collapse --seed 1 --lr 1e-3 --steps 400 --option addr_loss_weight=0.0
"""

from __future__ import annotations

import argparse
import ast
import json

import torch
import torch.nn.functional as F


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=600, help="stop after this many steps (the schedule stays the preset's)")
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--layer", default="fwpkm/token", choices=["fwpkm/token", "fwpkm/token-small"])
    ap.add_argument("--option", action="append", default=[], metavar="K=V",
                    help="a layer option over the variant's (a Python literal), e.g. addr_loss_weight=0.0")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from memzoo.bench.common import load_preset
    from memzoo.bench.suites import toys
    from memzoo.cpu import tune_cpu
    from memzoo.data import mqar

    tune_cpu()
    preset = load_preset("recall")
    s = preset.settings(toys.NAME, toys.Settings)
    task = toys.MQAR(s)
    for kv in a.option:
        k, v = kv.split("=", 1)
        s.variants[a.layer]["options"][k] = ast.literal_eval(v)
    mc = toys.toy_config(preset, a.layer, s.widths[0], task.vocab, s)
    made = []

    class Grab(toys.training.HybridLM):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(self)

    toys.training.HybridLM = Grab  # the model train_cell builds
    key12 = max(task.val)
    x, y = (t[:32] for t in task.val[key12])  # one evaluation batch
    half = task.vocab // 2
    step = [0]

    class Stop(Exception):
        pass

    @torch.no_grad()
    def probe():
        model = made[-1]
        (mem,) = model.memories()
        was = model.training
        model.eval()
        rec = {}

        def output(v_hat, v, g, _orig=mem.io.output):
            rec.update(v_hat=v_hat.float(), v=v.float(), g=g.float())
            return _orig(v_hat, v, g)

        mem.io.output = output
        try:
            logits = model(x, targets=y).logits
        finally:
            del mem.io.output
        mask = y != mqar.IGNORE
        acc = (logits.argmax(-1)[mask] == y[mask]).float().mean().item()
        v_hat, v, g = rec["v_hat"], rec["v"], rec["g"]
        tr = mem._trace()  # the slots each position read (its chunk's lookup, which its write also uses)
        idx, w = tr["index"], tr["weights"]
        keys_now, keys_init = mem._state["keys"], mem._init[1]
        drift = ((keys_now - keys_init).norm() / keys_init.expand_as(keys_now).norm()).item()
        qn = mem.io.q_proj(mem.io.q_norm(model.embed.weight[1:half])).norm(dim=-1).mean().item()
        overlap = []
        # v(u) for every token u, read off the batch (the memory's input is the token's embedding)
        vt = torch.zeros(task.vocab, v.shape[-1])
        vt[x.reshape(-1)] = v.reshape(-1, v.shape[-1])
        seen = torch.zeros(task.vocab, dtype=torch.bool)
        seen[x.reshape(-1)] = True
        vu = F.normalize(vt[half:][seen[half:]], dim=-1)
        c = (vu @ vu.T).abs()
        off = ~torch.eye(len(vu), dtype=torch.bool)
        hits, fill_hits, n_fill, n = 0, 0, 0, 0
        gk, gf = [], []
        for b in range(x.shape[0]):
            vals = x[b, 1:24:2]  # the 12 pairs' value tokens
            cand = F.normalize(vt[vals], dim=-1)
            for t in mask[b].nonzero().flatten().tolist():
                k = x[b, t].item()
                pred = vals[(cand @ F.normalize(v_hat[b, t], dim=0)).argmax()].item()
                ok = pred == y[b, t].item()
                filler = (x[b, 24:t] == k).any().item()
                p = (x[b, :24:2] == k).nonzero().item() * 2  # the pair's key position
                overlap.append(w[b, t][torch.isin(idx[b, t], idx[b, p])].sum().item())
                hits += ok
                n += 1
                if filler:
                    fill_hits += ok
                    n_fill += 1
            keys = (x[b] >= 1) & (x[b] < half)
            gk.append(g[b, :24:2])
            fmask = keys.clone()
            fmask[:24] = False
            fmask[mask[b]] = False
            gf.append(g[b][fmask])
        out = {"step": step[0], "acc": round(acc, 4), "mem_acc": round(hits / n, 4),
               "fill_acc": round(fill_hits / max(n_fill, 1), 4), "fill_frac": round(n_fill / n, 3),
               "v_cos": round(c[off].mean().item(), 4), "v_cos_max": round(c[off].max().item(), 4),
               "g_key": round(torch.cat(gk).mean().item(), 4), "g_val": round(g[:, 1:24:2].mean().item(), 4),
               "g_fill": round(torch.cat(gf).mean().item(), 4),
               "slot_overlap": round(sum(overlap) / len(overlap), 4), "key_drift": round(drift, 4),
               "q_norm": round(qn, 3), "emb_norm": round(model.embed.weight[half:].norm(dim=-1).mean().item(), 4)}
        print(json.dumps(out), flush=True)
        model.train(was)

    def on_step():
        step[0] += 1
        if step[0] % a.every == 0:
            probe()
        if step[0] >= a.steps:
            raise Stop

    assert x.shape[1] >= 24 and (y[:, :24] == mqar.IGNORE).all(), "the probe expects 12 pairs first"
    try:
        toys.train_cell(mc, task, a.lr, s, a.seed, on_step=on_step)
    except Stop:
        pass


if __name__ == "__main__":
    main()
