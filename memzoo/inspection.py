"""`memzoo inspect`: what each memory layer of a trained model does on a text.

For every memory layer it prints, per token, the gate value (how much of the memory's
prediction the layer lets through: the FwPKM paper's Figure 6) and, where the layer reports a
retrieval trace, the slots its read hit with their weights and what wrote them: the token
whose value was stored there and its context (Figure 5). Layers without gates or traces
show what their `stats()` report.

The text is read as the model was trained to read: in calls of the training sequence length,
fast weights carried from call to call (``keep_memory``), the backbone's state too (cache).

Model files are read with ``weights_only=True`` (`memzoo.storage.load_tensors`): a file that
holds anything but tensors and plain containers is refused, and nothing in it runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from memzoo.backbone.model import HybridLM
from memzoo.storage import load_tensors


def load_model(path: str | Path) -> tuple[HybridLM, str, int]:
    """(model in eval mode, tokenizer name, sequence length) from a `memzoo train` out dir or its
    ckpt.pt, or a bench LM dir (model.pt + lm.json): both record the tokenizer and the training
    sequence length the text must be read with."""
    from memzoo.config import ModelConfig

    p = Path(path)
    d = p.parent if p.is_file() else p
    if (d / "lm.json").exists():  # a bench LM
        cfg = json.loads((d / "lm.json").read_text())["config"]
        model = HybridLM(ModelConfig.from_dict(cfg["model"]))
        model.load_state_dict(load_tensors(d / "model.pt"))
        return model.eval(), cfg["train"]["tokenizer"], cfg["train"]["seq_len"]
    ckpt = p if p.is_file() else d / "ckpt.pt"
    if ckpt.exists():
        ck = load_tensors(ckpt)
        if "base" in ck["config"]:  # `memzoo train --from PATH --attach ...`
            raise ValueError(f"{path} holds memories attached to the Hugging Face model {ck['config']['base']['from']}, "
                             f"not a memzoo model: load it with memzoo.attach.from_pretrained('{d / 'hf'}')")
        model = HybridLM(ModelConfig.from_dict(ck["config"]["model"]))
        model.load_state_dict(ck["model"])
        return model.eval(), ck["config"]["train"]["tokenizer"], ck["config"]["train"]["seq_len"]
    raise FileNotFoundError(f"{path}: neither a `memzoo train` checkpoint (ckpt.pt) nor a bench LM (lm.json + model.pt)")


def load_any(pretrained: str, tokenizer: str | None = None) -> tuple[torch.nn.Module, str, int | None]:
    """(model, tokenizer name, training sequence length or None) from a memzoo run, bench LM or
    save_pretrained directory, or a Hugging Face model with memories attached (`memzoo train --from ...
    --attach ...`'s out dir, or its hf/ directory: the tokenizer its run read the corpus with)."""
    from memzoo import attach

    if (hf := attach.saved_model_dir(pretrained)) is not None:
        run = Path(pretrained) / "config.json"
        train = json.loads(run.read_text()).get("train", {}) if run.is_file() and Path(hf) != Path(pretrained) else {}
        tok = tokenizer or train.get("tokenizer")
        if tok is None:
            raise ValueError(f"{pretrained} holds an attached model but no run config naming its tokenizer; give "
                             "its tokenizer (a memzoo tokenizer name or a tokenizer directory)")
        return attach.from_pretrained(hf), tok, train.get("seq_len")

    try:
        model, tok, seq_len = load_model(pretrained)
    except FileNotFoundError:  # not a memzoo run or bench LM: a save_pretrained directory
        if tokenizer is None:
            raise ValueError(f"{pretrained} is not a memzoo run or bench LM; as a save_pretrained directory it "
                             "needs its tokenizer (a memzoo tokenizer name: byte, mistral, or a tokenizer directory)") from None
        return HybridLM.from_pretrained(pretrained), tokenizer, None
    return model, tokenizer or tok, seq_len


def _show(tok, ids: list[int], i: int, width: int = 12) -> str:
    """Token i with `width` tokens of context on each side: '…before[TOKEN]after…'."""
    lo, hi = max(0, i - width), min(len(ids), i + width + 1)
    piece = lambda a, b: tok.decode(ids[a:b]).replace("\n", "⏎")  # noqa: E731
    return f"{piece(lo, i)}[{piece(i, i + 1)}]{piece(i + 1, hi)}"


def restart_traces(model: HybridLM) -> None:
    """Fresh retrieval traces (stream positions from 0, no slot written yet) for a new sequence of
    batch 1: per-sequence memories start empty, persistent ones keep the fast weights they hold."""
    for m in model.memories():
        kept = None if m.per_sequence else {k: v.clone() for k, v in m.state.items()}
        m.reset(1)
        if kept is not None:
            m.load_state(kept)


@torch.no_grad()
def trace(model: HybridLM, ids: torch.Tensor, seq_len: int) -> list[list[dict]]:
    """Read `ids` [T]; per memory layer, per call: the stats() of that call."""
    per_layer: list[list[dict]] = [[] for _ in model.memories()]
    restart_traces(model)  # persistent memories keep what training wrote
    cache = None
    for s in range(0, ids.numel(), seq_len):
        x = ids[s : s + seq_len][None]
        y = torch.full_like(x, -100)
        y[0, : x.shape[1] - 1] = x[0, 1:]  # next tokens, for layers that learn from them (FWL)
        out = model(x, targets=y, cache=cache, use_cache=True, keep_memory=True)
        cache = out.cache
        for k, m in enumerate(model.memories()):
            per_layer[k].append({"start": s, "len": x.shape[1], **m.stats()})
    return per_layer


def inspect_text(model_path: str | Path, text: str, top: int = 4, max_tokens: int = 4096) -> str:
    from memzoo.data import get_tokenizer

    model, tok_name, seq_len = load_model(model_path)
    tok = get_tokenizer(tok_name)
    ids = tok.encode_tensor(text)[:max_tokens]
    if ids.numel() < 2:
        raise ValueError("the text is shorter than two tokens")
    idl = ids.tolist()
    lines = [f"model {model.config.layout}: {ids.numel()} tokens read in calls of {seq_len}"]
    names = [f"{type(m).__name__}" for m in model.memories()]
    if not names:
        return lines[0] + "\n(no memory layers in this layout)"
    for k, calls in enumerate(trace(model, ids, seq_len)):
        lines.append(f"\n== memory {k}: {names[k]} ==")
        has_gates = any("gates" in c for c in calls)
        has_trace = any("trace" in c for c in calls)
        if not (has_gates or has_trace):
            last = {a: b for a, b in calls[-1].items() if isinstance(b, (int, float))}
            lines.append("no per-token gates or trace; stats after the text: " + json.dumps(last, default=float))
            continue
        for c in calls:
            g = c.get("gates")
            tr = c.get("trace")
            for t in range(c["len"]):
                pos = c["start"] + t
                row = f"{pos:6d} {tok.decode(idl[pos:pos + 1])!r:>8}"
                if g is not None:
                    row += f"  gate {g[0, t].item():.2f} " + "█" * round(10 * g[0, t].item())
                lines.append(row)
                if tr is None:
                    continue
                w = tr["weights"][0, t].reshape(-1)
                slots = tr["slots"][0, t].reshape(-1)
                order = torch.argsort(w, descending=True)[:top]
                for j in order.tolist():
                    desc = f"         slot {slots[j].item():7d} w {w[j].item():.2f}"
                    if "writer_pos" in tr:
                        wp = tr["writer_pos"][0, t].reshape(-1)[j].item()
                        desc += "  not written in this text" if wp < 0 else f"  written by token {wp}: {_show(tok, idl, wp)}"
                        if 0 <= wp < len(idl) and pos + 1 < len(idl) and idl[wp] == idl[pos + 1]:
                            desc += " [HIT]"  # the slot stores the token that comes next (Fig. 5)
                    lines.append(desc)
    return "\n".join(lines)
