"""Does a memory recall the queried pair, or only which values the sequence holds?
Finding: docs/journal/toys.md, "The recall preset finished, and what the dense memories learn" (the 1/n
plateau; corrected by "The long-budget check" in the same file).

The recall preset's MQAR cell (zoo_configs/bench/recall.yaml: 64 tokens, vocabulary 64, every
query at least 9 tokens after its pair, 2 blocks of 4-token windows, width 64, batch 32, the
preset's precision, compile), one layer or variant, trained at one learning rate to a fixed step count; then, on the
test set of each pair count n, at the query positions:

- ``acc``: the prediction is the queried pair's value (the table's accuracy);
- ``in_set``: the prediction is one of the n values of the sequence, whichever;
- ``by_pair``: accuracy by the queried pair's place in the sequence (first .. last written).

A memory that stores the set of the sequence's values but cannot address them by their key answers
with one of them: ``in_set`` near 1 and ``acc`` near 1/n, the same for every pair's place. One that
keeps only the latest pair has ``by_pair`` high at the last place only. ::

    python -m research.value_set linear --steps 1000 --lr 1e-3
    python -m research.value_set fwmlp --lr 3e-3 --at 0 --options '{"before_mixer": true}'
"""

from __future__ import annotations

import argparse
import json

import torch


@torch.no_grad()
def value_set(model, task, device: str = "cpu") -> dict:
    """acc, in_set and by_pair (module docstring) per pair count of the task's test sets."""
    from memzoo.data import mqar

    model.eval()
    out = {}
    for n, (x, y) in task.test.items():
        x, y = x.to(device), y.to(device)
        pred = model(x, targets=y).logits.argmax(-1)  # as the bench scores: FWL then learns from the next tokens
        b, t = (y != mqar.IGNORE).nonzero(as_tuple=True)
        keys, values = x[:, : 2 * n : 2], x[:, 1 : 2 * n : 2]  # [B, n] each
        pair = (keys[b] == x[b, t].unsqueeze(-1)).float().argmax(-1)  # the queried pair's place
        hit = pred[b, t] == y[b, t]
        in_set = (values[b] == pred[b, t].unsqueeze(-1)).any(-1)
        by_pair = [round(hit[pair == i].float().mean().item(), 3) for i in range(n)]
        out[n] = {"acc": round(hit.float().mean().item(), 3), "in_set": round(in_set.float().mean().item(), 3),
                  "one_in_n": round(1 / n, 3), "by_pair": by_pair}
    return out


def run(layer: str, steps: int, lr: float, seed: int = 0, options: dict | None = None, at: str | None = None) -> dict:
    """Train the recall cell of `layer` (or, with `options` / `at`, of the layer changed so) and score it."""
    from memzoo.bench.common import load_preset
    from memzoo.bench.suites import toys

    preset = load_preset("recall")
    s = preset.settings(toys.NAME, toys.Settings)
    s.max_steps = s.min_steps = s.patience = steps
    if options or at:
        base = s.variants.get(layer, {"layer": layer})
        probe = {**base, "options": {**base.get("options", {}), **(options or {})}}
        if at:
            probe["at"] = at
        layer = f"{layer}+{json.dumps(options or {}, sort_keys=True)}" + (f"@{at}" if at else "")
        s.variants = {**s.variants, layer: probe}
    task = toys.MQAR(s)
    mc = toys.toy_config(preset, layer, s.widths_of(layer)[0], task.vocab, s)
    fit = toys.train_cell(mc, task, lr, s, seed)
    return {"layer": layer, "lr": lr, "steps": fit.steps, "best_val": round(fit.val, 3), "stop": fit.stop,
            "test": value_set(fit.model, task)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("layers", nargs="+", help="layers or recall-preset variants, e.g. linear ba fwpkm/token")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--options", type=json.loads, default=None, help='layer options over the preset\'s, as JSON: \'{"lr": 1.0}\'')
    ap.add_argument("--at", default=None, help="the block the memory sits in (the layout's @), e.g. 0")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from memzoo.cpu import tune_cpu

    tune_cpu()
    for layer in a.layers:
        print(json.dumps(run(layer, a.steps, a.lr, a.seed, a.options, a.at)), flush=True)


if __name__ == "__main__":
    main()
