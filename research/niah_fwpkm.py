"""Why FwPKM does not carry a needle where its memory is the only route (issue 39, item 2): the
paper's gate (Fig. 3) and [HIT] (Fig. 5) measurements on trained NIAH LMs.
Finding: docs/journal/niah.md, "Gate and [HIT]: in training the batch's shared memory buries the needle".

Each LM (a bench LM directory: model.pt + lm.json) reads the NIAH suite's haystacks as the suite
does (:func:`memzoo.bench.suites.niah.read_and_ask`: n passes, each written as one chunk, then the
question and answer teacher-forced), one n at a time so that stream positions are exact, and for
every FwPKM layer this reports, over the samples:

- ``gate_needle``: the mean gate g_t (Eq. 33) at the positions that write the queried needle's
  value, i.e. the "=" and the first five digits (with lookahead q_t stores v_{t+1}, Eq. 22), in
  every pass; ``gate_hay``: at the other haystack positions; ``gate_answer``: at the question's
  answer positions (the "=" and the first five answer digits, whose next tokens are scored);
- at the answer positions, the share of the read's top-k weight on slots whose last write
  (since the sample began) stored the ground-truth next token (``hit``, the paper's [HIT]), on
  slots the queried needle's matching digit wrote in some pass (``needle``), on slots that stored
  any digit (``digit``), and on slots this sample wrote at all (``written``; the rest still hold
  what training left there);
- ``value_cos``: the mean |cosine| between the values the needle stored for its different digits
  (Eq. 26's v_{t+1}): near 1, a read cannot tell the digits apart even where it hits;
- the answer's digits right and exact match from the same logits (the suite's metrics).

With ``--windows N`` it also reads N needle windows of the LM's training format (the haystack's
1-5 needles, then a question for each) as training reads them: ``--batches`` sequences per call
(16, the training batch, and 1), the layer's own chunks, the shared memory written by the whole
batch: the reads the LM learned from, against the evaluation's clean ones.

::

    python -m research.niah_fwpkm WORK/lm/fwpkm-* --lengths 96 256 --iters 1 2
    python -m research.niah_fwpkm WORK/lm/fwpkm-* --lengths 96 --iters 1 --windows 64

The figures and what they say: docs/journal/niah.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from memzoo.layers.fwpkm import FwPKM

KEYS = ("gate_needle", "gate_hay", "gate_answer", "hit", "needle", "digit", "written", "value_cos", "digits", "exact")


def value_span(hay: torch.Tensor, start: int, answer: torch.Tensor) -> int:
    """Position in `hay` of the first answer token, the needle's value, at or after the needle's
    first token `start`."""
    n = answer.numel()
    for p in range(start, hay.numel() - n + 1):
        if torch.equal(hay[p : p + n], answer):
            return p
    raise ValueError("the needle's value is not in the haystack")


def digit_tokens(tok) -> torch.Tensor:
    """Token ids of the digits 0-9."""
    return torch.tensor([tok.encode(str(d))[0] for d in range(10)])


def read_metrics(w, wp, stored, truth, from_needle, v_digit, answer, digit_ids) -> dict:
    """The read at the answer positions of one question: top-k weights `w`, writer positions `wp`
    (-1: not written since the sample began) and stored tokens `stored` [6, H·k]; `truth` [6] the
    next tokens; `from_needle` [6, H·k] whether the slot's writer is the needle's matching digit;
    `v_digit` [6, Dv] the values the needle's digits stored (Eq. 26's v_{t+1})."""
    F = torch.nn.functional
    hit = (wp >= 0) & (stored == truth.unsqueeze(-1))
    cos = F.normalize(v_digit, dim=-1) @ F.normalize(v_digit, dim=-1).t()  # [6, 6]
    other = answer.view(-1, 1) != answer.view(1, -1)  # a different digit
    return {
        "hit": (w * hit).sum(-1).mean().item(),
        "needle": (w * from_needle).sum(-1).mean().item(),
        "digit": (w * ((wp >= 0) & torch.isin(stored, digit_ids))).sum(-1).mean().item(),
        "written": (w * (wp >= 0)).sum(-1).mean().item(),
        "value_cos": cos[other].abs().mean().item() if other.any() else float("nan"),
    }


def _capture(mems) -> list[list[torch.Tensor]]:
    """Record the values v of every call as Eqs. 33-34 get them, per layer (undo with `_release`)."""
    reads: list[list[torch.Tensor]] = [[] for _ in mems]
    for m, r in zip(mems, reads):
        m.io.output = lambda v_hat, v, g, io=m.io, r=r: r.append(v.float()) or type(io).output(io, v_hat, v, g)
    return reads


def _release(mems) -> None:
    for m in mems:
        del m.io.output


def _writers(tr: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(writer position, writer batch row) of a trace; -1 where nothing was written since the
    trace began (a read before any write has no writers at all)."""
    if "writer_pos" in tr:
        return tr["writer_pos"], tr["writer_seq"]
    none = torch.full(tr["slots"].shape, -1)
    return none, none


@torch.no_grad()
def measure_sample(model, smp, n: int, piece: int, digit_ids: torch.Tensor) -> list[dict]:
    """The measurements of one sample at n-iter `n`, one dict per FwPKM layer."""
    from memzoo.bench.suites.niah import read_and_ask
    from memzoo.inspection import restart_traces

    mems = [m for m in model.memories() if isinstance(m, FwPKM)]
    calls: list[list[dict]] = []
    reads = _capture(mems)
    hook = model.register_forward_hook(lambda *_: calls.append([m.stats() for m in mems]))
    try:
        restart_traces(model)
        logits = read_and_ask(model, smp, [n], piece)[n]
    finally:
        hook.remove()
        _release(mems)
    hay, q, a = smp.haystack, smp.question, smp.answer
    L, nq = hay.numel(), q.numel()
    stream = torch.cat([hay.repeat(n), q, a])  # the tokens read, and the last answer token
    d0 = value_span(hay, smp.needles[smp.query].position, a)
    writes = torch.arange(d0 - 1, d0 + a.numel() - 1)  # the "=" and the digits but the last
    needle_pos = (torch.arange(n).view(n, 1) * L + writes.view(1, -1) + 1)  # [n, 6]: where each digit was stored
    ans = n * L + nq - 1 + torch.arange(a.numel())  # stream positions whose next token is an answer digit
    at_needle = torch.zeros(L, dtype=torch.bool)
    at_needle[writes] = True
    ok = logits.argmax(-1) == a
    out = []
    for k in range(len(mems)):
        gates = torch.cat([c[k]["gates"][0] for c in calls]).float()  # [stream length - 1]
        w = torch.cat([c[k]["trace"]["weights"][0] for c in calls])[ans].float()  # [6, H·k]
        wp = torch.cat([_writers(c[k]["trace"])[0][0] for c in calls])[ans]
        from_needle = (wp.unsqueeze(-1) == needle_pos.t().unsqueeze(1)).any(-1)  # digit i's write, any pass
        v_digit = torch.cat([r[0] for r in reads[k]])[d0 + torch.arange(a.numel())]  # the needle's digits' values (pass 1)
        hay_gates = gates[: n * L].view(n, L)
        out.append({
            "gate_needle": hay_gates[:, at_needle].mean().item(),
            "gate_hay": hay_gates[:, ~at_needle].mean().item(),
            "gate_answer": gates[ans].mean().item(),
            **read_metrics(w, wp, stream[wp.clamp(min=0)], stream[ans + 1], from_needle, v_digit, a, digit_ids),
            "digits": ok.float().mean().item(),
            "exact": float(ok.all()),
        })
    return out


@torch.no_grad()
def measure_windows(model, windows: torch.Tensor, answers: torch.Tensor, batch: int, digit_ids: torch.Tensor) -> list[dict]:
    """Training-format needle windows (:meth:`memzoo.data.niah.NeedleMix.window`: `windows`
    [N, seq_len + 1], `answers` their answer-token masks) read as training reads them: `batch`
    sequences per call, the layers' own chunks, a shared memory written by the whole batch
    (from its trained fast weights for every call). Per FwPKM layer, the read metrics at every
    question's answer positions and the gates there, averaged over the questions."""
    from memzoo.inspection import restart_traces

    mems = [m for m in model.memories() if isinstance(m, FwPKM)]
    trained = model.memory_state(persistent_only=True)
    per: list[list[dict]] = [[] for _ in mems]
    try:
        for s in range(0, len(windows), batch):
            full, mask = windows[s : s + batch], answers[s : s + batch]
            model.load_memory_state(trained)
            restart_traces(model)
            reads = _capture(mems)
            try:
                logits = model(full[:, :-1]).logits
            finally:
                _release(mems)
            for k, m in enumerate(mems):
                st = m.stats()
                wp, ws = _writers(st["trace"])
                stored = full[ws.clamp(min=0), wp.clamp(min=0)]
                (v,) = reads[k]
                for b in range(full.shape[0]):
                    pos = (mask[b, 1:]).nonzero().squeeze(1)  # inputs whose next token is an answer digit
                    for ans in pos.view(-1, 6):  # one question's six
                        a = full[b, ans + 1]
                        d0 = value_span(full[b], 0, a)
                        digits = d0 + torch.arange(6)
                        from_needle = (wp[b, ans] == digits.unsqueeze(-1)) & (ws[b, ans] == b)
                        ok = logits[b, ans].argmax(-1) == a
                        per[k].append({
                            "gate_needle": st["gates"][b, digits - 1].float().mean().item(),
                            "gate_answer": st["gates"][b, ans].float().mean().item(),
                            **read_metrics(st["trace"]["weights"][b, ans].float(), wp[b, ans], stored[b, ans], a,
                                           from_needle, v[b, digits], a, digit_ids),
                            "digits": ok.float().mean().item(),
                            "exact": float(ok.all()),
                        })
    finally:
        model.load_memory_state(trained)
    return [{f: round(sum(r[f] for r in rs) / len(rs), 4) for f in rs[0]} | {"questions": len(rs)} for rs in per]


def measure(lm_dir: str | Path, lengths: list[int], iters: list[int], samples: int, preset: str = "standard") -> list[dict]:
    """One row per (FwPKM layer, length, n) of the LM in `lm_dir`: the means over `samples`."""
    from memzoo.bench.common import load_preset
    from memzoo.bench.suites import niah
    from memzoo.data import get_tokenizer
    from memzoo.data.niah import TextSource, niah_samples
    from memzoo.inspection import load_model

    model, tok_name, _ = load_model(lm_dir)
    n_mem = sum(isinstance(m, FwPKM) for m in model.memories())
    if not n_mem:
        raise SystemExit(f"{lm_dir}: no FwPKM layer")
    tc = json.loads((Path(lm_dir) / "lm.json").read_text())["config"]["train"]
    s = load_preset(preset).settings(niah.NAME, niah.Settings)
    tok = get_tokenizer(tok_name)
    source = TextSource(niah.eval_texts(tc["corpus"], tc["seed"]), tok)
    ids = digit_tokens(tok)
    trained = model.memory_state(persistent_only=True)
    rows = []
    try:
        for length in lengths:
            smps = niah_samples(source, tok, length, samples, s.seed, s.needles, s.depth_buckets)
            for n in iters:
                per = [[] for _ in range(n_mem)]
                for smp in smps:
                    model.load_memory_state(trained)
                    for k, r in enumerate(measure_sample(model, smp, n, s.piece, ids)):
                        per[k].append(r)
                for k, rs in enumerate(per):
                    rows.append({"lm": Path(lm_dir).name, "layer": k, "length": length, "n_iter": n,
                                 **{f: round(sum(r[f] for r in rs) / len(rs), 4) for f in KEYS}})
    finally:
        model.load_memory_state(trained)
    return rows


def measure_training_format(lm_dir: str | Path, windows: int, batches: list[int], seed: int = 1) -> list[dict]:
    """One row per (FwPKM layer, batch) of the LM in `lm_dir`: `windows` needle windows of its
    training format (from the held-out text) read `batch` at a time (:func:`measure_windows`)."""
    import random

    from memzoo.bench.suites import niah
    from memzoo.data import get_tokenizer
    from memzoo.data.niah import NeedleMix
    from memzoo.inspection import load_model

    model, tok_name, seq_len = load_model(lm_dir)
    tc = json.loads((Path(lm_dir) / "lm.json").read_text())["config"]["train"]
    tok = get_tokenizer(tok_name)
    mix = NeedleMix(None, niah.eval_texts(tc["corpus"], tc["seed"]), tok, seq_len, mix=1.0)
    rng = random.Random(seed)
    ws = [mix.window(rng) for _ in range(windows)]
    full, answers = torch.stack([w for w, _ in ws]), torch.stack([a for _, a in ws])
    ids = digit_tokens(tok)
    return [{"lm": Path(lm_dir).name, "layer": k, "format": "training", "batch": b, **r}
            for b in batches for k, r in enumerate(measure_windows(model, full, answers, b, ids))]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lms", nargs="+", help="bench LM directories (model.pt + lm.json) with FwPKM layers")
    ap.add_argument("--lengths", type=int, nargs="+", default=[96, 256])
    ap.add_argument("--iters", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--preset", default="standard", help="whose niah settings make the samples (default standard)")
    ap.add_argument("--windows", type=int, default=0,
                    help="also read this many training-format needle windows, --batches sequences at a time")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 1],
                    help="sequences per call for --windows (16: the standard NIAH LMs' training batch)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    for lm in a.lms:
        if a.windows:
            for r in measure_training_format(lm, a.windows, a.batches):
                print(json.dumps(r), flush=True)
        for r in measure(lm, a.lengths, a.iters, a.samples, a.preset):
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
