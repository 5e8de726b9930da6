"""Training a HybridLM on real text: AdamW, warmup then cosine to min lr (Table 3's shape).

Exact resume: batch number s is a pure function of (seed, s) (`LMStream.batch`), and a
checkpoint holds the model (whose state_dict includes the fast weights of persistent memory
layers), the optimizer and torch's RNG (pSWA draws from it). So `--resume` after a kill replays exactly what the
uninterrupted run would have done. Checkpoints are written to a temporary file and renamed,
so a kill mid-write never leaves a broken checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from memzoo.backbone.model import HybridLM, MemzooConfig
from memzoo.config import ConfigError, RunConfig

CKPT = "ckpt.pt"


def lr_at(step: int, tc) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at the last step."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    frac = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * min(frac, 1.0)))


def param_groups(model: torch.nn.Module, tc) -> list[dict]:
    """Weight decay on matrices only; norms, biases, gates and decay rates are exempt.
    A memory layer may add groups of its own (e.g. PKM's values with their own lr) by
    defining `optim_groups() -> list[dict]` (keys: params, and optionally lr_scale and
    weight_decay); those parameters leave the default groups."""
    special, claimed = [], set()
    for m in model.modules():
        if hasattr(m, "optim_groups") and m is not model:
            for g in m.optim_groups():
                special.append(g)
                claimed |= {id(p) for p in g["params"]}
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad or id(p) in claimed:
            continue
        (no_decay if p.dim() < 2 or getattr(p, "_no_weight_decay", False) else decay).append(p)
    groups = [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    for g in groups + special:
        g.setdefault("lr_scale", 1.0)
        g.setdefault("weight_decay", tc.weight_decay)
    return groups + special


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def evaluate(model: HybridLM, batches: list) -> float:
    """Mean loss over fixed validation windows; persistent fast weights are restored afterwards
    so that evaluating never changes what training does next."""
    saved = model.memory_state(persistent_only=True)
    was = model.training
    model.eval()
    losses = [model(x, targets=y).loss.item() for x, y in batches]
    model.train(was)
    model.load_memory_state(saved)
    return sum(losses) / len(losses)


def prepare_data(rc: RunConfig):
    from memzoo.data import LMStream, get_tokenizer, load_corpus, split_documents, tokenize_corpus, unigram_entropy

    tc = rc.train
    tok = get_tokenizer(tc.tokenizer)
    if rc.model.vocab_size < tok.vocab_size:
        raise ConfigError(
            f"model.vocab_size={rc.model.vocab_size} is smaller than tokenizer {tc.tokenizer!r}'s "
            f"vocabulary ({tok.vocab_size}); set model.vocab_size >= {tok.vocab_size}"
        )
    splits = split_documents(load_corpus(tc.corpus), seed=tc.seed)
    train_docs = tokenize_corpus(splits["train"], tok)
    val_docs = tokenize_corpus(splits["validation"], tok)
    stream = LMStream(train_docs, tc.seq_len, seed=tc.seed)
    val_stream = LMStream(val_docs, tc.seq_len, seed=10_000 + tc.seed)
    val_batches = [val_stream.batch(i, tc.batch_size) for i in range(tc.eval_batches)]
    h = unigram_entropy(torch.cat(val_docs), tok.vocab_size)
    return stream, val_batches, h


def train(
    rc: RunConfig, resume: bool = False, stop_after: int | None = None, progress: bool = True, data=None
) -> dict:
    """Train per `rc`; `stop_after` ends the run after that many steps *without* a final
    checkpoint, exactly like a kill (used by the resume test). `data` replaces the corpus
    named in the config: (stream with .batch(step, batch_size) -> (x, y), validation
    batches, unigram entropy), as `prepare_data` returns (the bench mixes needles in)."""
    tc = rc.train
    tc.validate()  # also after command-line overrides
    if tc.threads:
        torch.set_num_threads(tc.threads)
    # strong GDN decays make subnormal floats, which are ~10x slower on x86 CPUs; flush them
    torch.set_flush_denormal(True)
    out = Path(tc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(tc.seed)
    stream, val_batches, unigram_h = prepare_data(rc) if data is None else data

    model = HybridLM(MemzooConfig.from_model_config(rc.model)).to(tc.device)
    model.train()
    opt = torch.optim.AdamW(param_groups(model, tc), lr=tc.lr, betas=tc.betas)
    step, history = 0, []
    ckpt_path = out / CKPT
    if resume:
        if not ckpt_path.exists():
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}; train without --resume first")
        ck = torch.load(ckpt_path, map_location=tc.device, weights_only=False)
        if ck["config"] != rc.to_dict():
            raise ConfigError(f"--resume: the checkpoint in {out} was written by a different config")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        torch.set_rng_state(ck["rng"])
        step, history = ck["step"], ck["history"]
    (out / "config.json").write_text(json.dumps(rc.to_dict(), indent=1))

    def save():
        _atomic_save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "rng": torch.get_rng_state(),
                "step": step,
                "history": history,
                "config": rc.to_dict(),
            },
            ckpt_path,
        )

    n_params = sum(p.numel() for p in model.parameters())
    bar = tqdm(total=tc.steps, initial=step, disable=not progress, desc=f"train {rc.model.layout} ({n_params / 1e6:.2f}M)")
    val_loss = history[-1]["val_loss"] if history and "val_loss" in history[-1] else float("nan")
    t0, done_here = time.time(), 0
    while step < tc.steps:
        lr = lr_at(step, tc)
        for g in opt.param_groups:
            g["lr"] = lr * g["lr_scale"]
        loss_sum = 0.0
        for micro in range(tc.grad_accum):
            x, y = stream.batch(step * tc.grad_accum + micro, tc.batch_size)
            loss = model(x.to(tc.device), targets=y.to(tc.device)).loss / tc.grad_accum
            loss.backward()
            loss_sum += loss.item()
        if tc.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        done_here += 1
        rec = {"step": step, "loss": loss_sum, "lr": lr}
        if step % tc.eval_every == 0 or step == tc.steps:
            val_loss = evaluate(model, val_batches)
            rec["val_loss"] = val_loss
        history.append(rec)
        toks = done_here * tc.batch_size * tc.grad_accum * tc.seq_len / (time.time() - t0)
        bar.set_postfix(loss=f"{loss_sum:.3f}", val=f"{val_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{toks:.0f}")
        bar.update(1)
        if stop_after is not None and done_here >= stop_after:
            bar.close()
            return {"step": step, "history": history, "killed": True}
        if step % tc.ckpt_every == 0 or step == tc.steps:
            save()
    bar.close()
    with open(out / "metrics.jsonl", "w") as f:
        for r in history:
            f.write(json.dumps(r) + "\n")
    tail = [r["loss"] for r in history[-10:]]
    return {
        "step": step,
        "train_loss": sum(tail) / max(1, len(tail)),
        "val_loss": val_loss,
        "unigram_entropy": unigram_h,
        "checkpoint": str(ckpt_path),
        "history": history,
        "model": model,
    }
