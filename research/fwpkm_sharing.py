"""Why FwPKM made MQAR recall worse than no memory: its memory shared by the batch.
Finding: docs/journal/toys.md, "Why FwPKM's memory is per sequence here".

The diagnosis behind the toys suite's FwPKM setting (see bench/suites/toys/): MQAR at a
CPU-sized Zoology scale (64 tokens, vocabulary 256, 4/8/16 pairs, batch 64, width 64, lr 3e-3,
800 steps, seed 0, GDN chunk 64, validation-free: the model after the last step), the 2-layer GDN alone and
with FwPKM (64² slots of dim 64, top-8, chunk 8) in its last block, in the forms below. Each
form is one training on one thread (about 5 minutes)::

    python -m research.fwpkm_sharing              # all forms
    python -m research.fwpkm_sharing shared gdn   # some

``--capacity SEED``: the capacity preset's ``fwpkm/shared`` cell (zoo_configs/bench/capacity.yaml),
trained exactly as the bench trains it (the same steps, stop and test accuracy as its row), then
its test accuracy read three ways with the same slow weights: as trained (the memory shared by
the batch of 64), with the memory per sequence (each test sequence reads only its own writes,
from the initial fast weights), and with the memory's output removed (the GDN alone); and the
mean write gate g on the test set. About 20 minutes on one thread::

    python -m research.fwpkm_sharing --capacity 0
"""

from __future__ import annotations

import json
import sys

import torch

FORMS = {
    "gdn": None,  # no memory
    "per_sequence": {"per_sequence": True},  # the paper's addressing loss, weight 10
    "per_sequence_addr1": {"per_sequence": True, "addr_loss_weight": 1.0},
    "per_sequence_no_addr": {"per_sequence": True, "addr_loss": False},
    "shared": {"per_sequence": False},  # as the paper trains FwPKM on text
}


def run(form: str) -> dict:
    from memzoo.bench.common import load_preset
    from memzoo.bench.suites import toys

    opts = FORMS[form]
    layer = "baseline" if opts is None else "fwpkm"
    fw = {"key_dim": 64, "value_dim": 64, "n_subkeys": 64, "chunk_size": 8, **(opts or {})}
    s = toys.Settings(mqar_vocab=256, mqar_seq_len=64, mqar_kv=[4, 8, 16], batch_size=64, max_steps=800,
                      eval_every=800, warmup=50, lrs=[3e-3], val_size=256, test_size=256, layer_options={"fwpkm": fw},
                      model={"gdn_chunk": 64})
    task = toys.MQAR(s)
    mc = toys.toy_config(load_preset("tiny"), layer, 64, task.vocab, s)
    fit = toys.train_cell(mc, task, 3e-3, s, seed=0)
    acc = toys.evaluate(fit.model, task.test, s.batch_size)
    return {"form": form, "test_acc_by_kv": {k: round(v, 3) for k, v in acc.items()},
            "train_loss": round(fit.train_loss, 3)}


def capacity_probe(seed: int) -> dict:
    """The capacity preset's fwpkm/shared cell, its test accuracy as trained, with a memory per
    sequence, and without the memory's output (module docstring)."""
    from memzoo.bench.common import load_preset
    from memzoo.bench.suites import toys

    preset = load_preset("capacity")
    s = preset.settings(toys.NAME, toys.Settings)
    task = toys.MQAR(s)
    name = "fwpkm/shared"
    mc = toys.toy_config(preset, name, s.widths[0], task.vocab, s)
    fit = toys.train_cell(mc, task, s.candidates(name)[0], s, seed)
    model, (mem,) = fit.model, fit.model.memories()

    def acc():
        return {k: round(v, 4) for k, v in toys.evaluate(model, task.test, s.batch_size).items()}

    gates = []
    hook = mem.io.g_proj.register_forward_hook(lambda m, i, o: gates.append(torch.sigmoid(o).float().mean().item()))
    out = {"seed": seed, "steps": fit.steps, "stop": fit.stop, "as_trained": acc(),
           "gate_mean": round(sum(gates) / len(gates), 4)}
    hook.remove()
    mem.per_sequence = True  # the same slow weights; each sequence's memory starts from the initial fast weights
    out["per_sequence_at_test"] = acc()
    mem.per_sequence = False
    hook = mem.register_forward_hook(lambda m, i, o: torch.zeros_like(o))
    out["memory_output_removed"] = acc()
    hook.remove()
    return out


def main(argv=None) -> None:
    argv = list(argv if argv is not None else sys.argv[1:])
    if argv[:1] == ["--capacity"]:
        torch.set_num_threads(1)
        for seed in argv[1:] or ["0"]:
            print(json.dumps(capacity_probe(int(seed))), flush=True)
        return
    forms = argv or list(FORMS)
    unknown = [f for f in forms if f not in FORMS]
    if unknown:
        raise SystemExit(f"unknown form(s) {unknown}; forms: {', '.join(FORMS)}")
    torch.set_num_threads(1)
    from memzoo.cpu import tune_cpu

    tune_cpu()  # subnormals flushed, freed activations kept in the heap
    for f in forms:
        print(json.dumps(run(f)), flush=True)


if __name__ == "__main__":
    main()
