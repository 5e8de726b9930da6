"""Training a HybridLM on real text: AdamW, warmup then cosine to min lr (Table 3's shape).

Exact resume: batch number s is a pure function of (seed, s) (`LMStream.batch`), and a
checkpoint holds the model (whose state_dict includes the fast weights of persistent memory
layers), the optimizer and torch's RNG (pSWA draws from it). So `--resume` after a kill replays exactly what the
uninterrupted run would have done.

What a run guarantees:

* Every file it writes (ckpt.pt, config.json, metrics.jsonl) is written atomically
  (`memzoo.storage`), so a kill mid-write never leaves a broken file; metrics.jsonl is rewritten
  at every checkpoint, so a killed or diverged run keeps its metrics up to its last checkpoint.
* A checkpoint is loaded with ``weights_only=True``: a file holding anything but tensors and
  plain containers is refused and nothing in it runs.
* An out dir holding another run is refused unless the run is resumed or overwritten.
* A non-finite loss (training or validation) or non-finite weights stop the run with
  `Diverged`, naming the step; no checkpoint of broken weights is written, the last good one is
  kept, and metrics.jsonl is strict JSON (no NaN).
* Bad settings fail before any data is prepared: an unwritable out dir, an unavailable device,
  a resume with a changed config (the message lists the changed fields).

Several processes (``torchrun --nproc_per_node N -m memzoo.train CONFIG [--parallel fsdp]``): DDP
or FSDP2 with the global batch fixed across world sizes, and checkpoints that resume on any world
size (:mod:`memzoo.distributed`).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from memzoo.attach import SAVED
from memzoo.backbone.model import HybridLM, MemzooConfig
from memzoo.cpu import _bf16_gemms_in_fp32_pass, cpu_bf16_gemm_is_slow, tune_cpu
from memzoo.config import ConfigError, RunConfig, TrainConfig
from memzoo.distributed import World, full_state, load_full_state, no_sync
from memzoo.storage import ensure_writable_dir, load_tensors, torch_save, write_text

CKPT = "ckpt.pt"
HUB = "hf:"  # train.corpus "hf:PATH[:NAME]": a dataset streamed by `datasets` (prepare_data)
HUB_VAL_DOCS = 64  # a streamed corpus's first documents, held out for validation
RUN_FILES = (CKPT, "config.json", "metrics.jsonl")  # what makes a directory hold a run


class Diverged(RuntimeError):
    """Training stopped on a non-finite loss or weights; the last good checkpoint is kept."""


def resolve_device(spec: str) -> str:
    """cpu, cuda, cuda:N (checked to be present), or auto: cuda if available, else cpu."""
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"unknown device {spec!r}: use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {spec!r} is not available: torch.cuda.is_available() is False; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {spec!r} is not available: {torch.cuda.device_count()} CUDA device(s) present")
    return spec


def config_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """'train.lr 0.001 -> 0.002' for every leaf that differs between two config dicts."""
    out = []
    for k in sorted(set(old) | set(new), key=str):
        a, b = old.get(k, "(unset)"), new.get(k, "(unset)")
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k} {a!r} -> {b!r}")
    return out


def lr_at(step: int, tc) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at the last step."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    frac = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * min(frac, 1.0)))


def optimizer(model: torch.nn.Module, tc) -> torch.optim.AdamW:
    """The optimizer of every training here (memzoo train, the toys, the cost suite's timed step): AdamW
    over `param_groups` with tc's betas, at tc.lr, the lr of a step given none (a `make_step` step given
    one, as a schedule does, sets every group's lr to it times the group's ``lr_scale``)."""
    return torch.optim.AdamW(param_groups(model, tc), lr=tc.lr, betas=tuple(tc.betas))


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


@torch.no_grad()
def evaluate(model: HybridLM, batches: list) -> float:
    """Mean loss over fixed validation windows; persistent fast weights are restored afterwards
    so that evaluating never changes what training does next."""
    saved = model.memory_state(persistent_only=True)
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    losses = [model(x.to(device), targets=y.to(device)).loss.item() for x, y in batches]
    model.train(was)
    model.load_memory_state(saved)
    return sum(losses) / len(losses)


def prepare_data(rc: RunConfig, leave_out: tuple[str, ...] = (), needle_mix: float = 0.0, answer_weight: float = 1.0,
                 repeat_mix: float = 0.0, document_order: bool = False):
    """(training stream, validation batches, unigram entropy of the validation text) of
    `rc.train`'s corpus: its documents split into training and validation by the seed, tokenized.
    `leave_out`: titles of training documents to drop (a corpus kept unseen for evaluation);
    `document_order`: each batch row continues its documents where the previous batch's row
    ended (:class:`memzoo.data.DocumentStream`; else random windows, :class:`memzoo.data.LMStream`);
    `repeat_mix`: the fraction of training windows that read a passage twice
    (:class:`memzoo.data.RepeatMix`); `needle_mix`: the fraction replaced by needle samples, whose
    answer tokens weigh `answer_weight` in the loss (:class:`memzoo.data.niah.NeedleMix`).

    A corpus ``hf:PATH[:NAME]`` is streamed by ``datasets.load_dataset(PATH, NAME, split="train",
    streaming=True)``: a Hub dataset when online (``hf:HuggingFaceFW/fineweb-edu:sample-10BT``) or a
    local dataset directory. Its first `HUB_VAL_DOCS` documents are the validation text; the rest
    train in document order (:class:`memzoo.data.HubStream`)."""
    from memzoo.data import DocumentStream, LMStream, RepeatMix, get_tokenizer, load_corpus, split_documents, tokenize_corpus, unigram_entropy

    tc = rc.train
    tok = get_tokenizer(tc.tokenizer)
    if rc.model.vocab_size < tok.vocab_size:
        raise ConfigError(
            f"model.vocab_size={rc.model.vocab_size} is smaller than tokenizer {tc.tokenizer!r}'s "
            f"vocabulary ({tok.vocab_size}); set model.vocab_size >= {tok.vocab_size}"
        )
    if tc.corpus.startswith(HUB):
        if leave_out or needle_mix or repeat_mix:
            raise ConfigError("a streamed (hf:) corpus trains on its documents in order; it has no leave_out, "
                              "needle_mix or repeat_mix")
        import datasets

        from memzoo.data import HubStream

        path, _, name = tc.corpus[len(HUB):].partition(":")
        ds = datasets.load_dataset(path, name or None, split="train", streaming=True)
        eos = torch.tensor([tok.eos_id])
        val_docs = [torch.cat([tok.encode_tensor(r["text"]), eos]) for r in ds.take(HUB_VAL_DOCS)]
        val_stream = LMStream(val_docs, tc.seq_len, seed=10_000 + tc.seed)
        val_batches = [val_stream.batch(i, tc.batch_size) for i in range(tc.eval_batches)]
        stream = HubStream(ds.skip(HUB_VAL_DOCS), tok, tc.seq_len, tc.batch_size)
        return stream, val_batches, unigram_entropy(torch.cat(val_docs), tok.vocab_size)
    splits = split_documents(load_corpus(tc.corpus), seed=tc.seed)
    train_ds = splits["train"]
    if leave_out:
        train_ds = train_ds.filter(lambda r: r["title"] not in leave_out)
    train_docs = tokenize_corpus(train_ds, tok)
    val_docs = tokenize_corpus(splits["validation"], tok)
    if document_order:
        stream = DocumentStream(train_docs, tc.seq_len, tc.batch_size, seed=tc.seed)
    else:
        stream = LMStream(train_docs, tc.seq_len, seed=tc.seed)
    if repeat_mix > 0:
        stream = RepeatMix(stream, tc.seq_len, repeat_mix, seed=tc.seed)
    if needle_mix > 0:
        from memzoo.data.niah import NeedleMix

        stream = NeedleMix(stream, list(train_ds["text"]), tok, tc.seq_len, mix=needle_mix, seed=tc.seed,
                           answer_weight=answer_weight)
    val_stream = LMStream(val_docs, tc.seq_len, seed=10_000 + tc.seed)
    val_batches = [val_stream.batch(i, tc.batch_size) for i in range(tc.eval_batches)]
    h = unigram_entropy(torch.cat(val_docs), tok.vocab_size)
    return stream, val_batches, h


def lm_loss(model, x: torch.Tensor, y) -> torch.Tensor:
    """A HybridLM's training loss: next-token cross-entropy plus its memories' auxiliary losses.
    `y`: the targets, or ``(targets, weights)``: then the cross-entropy is the weighted mean
    sum(w * ce) / sum(w) over the targets that are not ignored (-100), as
    :class:`memzoo.data.niah.NeedleMix` weights the answer tokens."""
    if not isinstance(y, tuple):
        return model(x, targets=y).loss
    y, w = y
    out = model(x, targets=y)
    ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100, reduction="none")
    w = w.flatten().float() * (y.flatten() != -100)
    loss = (ce * w).sum() / w.sum()
    return loss if out.aux_loss is None else loss + out.aux_loss


def to_device(batch, device: str):
    """A batch (tensors, and tuples of them) on `device`."""
    if isinstance(batch, tuple):
        return tuple(to_device(b, device) for b in batch)
    return batch.to(device)


PRECISIONS = ("fp32", "bf16")


def resolve_precision(precision: str, device: str) -> str:
    """train.precision "auto": bf16 autocast on CUDA (as the paper trains), fp32 on CPU."""
    if precision == "auto":
        return "bf16" if str(device).startswith("cuda") else "fp32"
    return precision


def make_step(model: torch.nn.Module, opt: torch.optim.Optimizer, grad_clip: float = 0.0, precision: str = "fp32",
              compile: bool = False, loss_fn=lm_loss):
    """The training step of memzoo: `memzoo train`, the toys, the cost suite's timed step and the
    Ba experiment all run it. Returns ``step(batches, lr=None) -> loss``, which

    1. sets every parameter group's lr to ``lr * lr_scale`` (when `lr` is given),
    2. per micro-batch ``(x, y)`` of `batches`: forward, ``loss_fn(model, x, y) / len(batches)``
       and backward (gradients accumulate over the micro-batches),
    3. clips the gradients' global norm to `grad_clip` (0: no clipping),
    4. takes the optimizer step and sets the gradients to None,

    and returns the summed loss as a float, non-finite ones included (the caller decides).
    `precision`: "fp32", or "bf16" (forward and loss under bf16 autocast, weights and optimizer
    in fp32). `compile`: run the forward through ``torch.compile(model, dynamic=False)`` (one graph
    per input shape: a batch of another length compiles anew instead of turning every length
    symbolic, which some mixers' compiled code does not support). Compiled bf16 on a CPU whose bf16
    GEMM is the slower (:func:`cpu_bf16_gemm_is_slow`) multiplies in fp32 (``Bf16GemmsInFp32``;
    what it gained: docs/journal/performance.md)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    fwd = model
    if compile:
        cpu = next(model.parameters()).device.type == "cpu"
        options = ({"post_grad_custom_post_pass": _bf16_gemms_in_fp32_pass()}
                   if precision == "bf16" and cpu and cpu_bf16_gemm_is_slow() else None)
        fwd = torch.compile(model, dynamic=False, options=options)

    def step(batches, lr: float | None = None) -> float:
        if lr is not None:
            for g in opt.param_groups:
                g["lr"] = lr * g["lr_scale"]
        total = 0.0
        for i, (x, y) in enumerate(batches):
            with torch.autocast(x.device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext():
                loss = loss_fn(fwd, x, y) / len(batches)
            with no_sync(model, last=i == len(batches) - 1):  # DDP: average the gradients once per step
                loss.backward()
            total += loss.item()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step


def fit(step, steps: int, *, start: int = 0, every: int = 0, after_step=None, evaluate=None, end_step=None) -> tuple[int, str]:
    """The one outer training loop of memzoo (`train`, the bench's toy cells and LMs): for each
    step i from `start` to `steps`, with n = i + 1 steps then done,

    1. ``loss = step(i)`` (the batch of step i at its lr: a `make_step` step),
    2. ``after_step(n, loss)``: divergence, progress,
    3. every `every` steps and at the last, ``evaluate(n)``: validation, early stopping,
    4. ``end_step(n, evaluated)``: records and checkpoints (after the evaluation they may hold).

    A hook that returns a reason (a non-empty string: diverged, solved, ...) ends the loop there,
    the step's later hooks unrun; returns (steps done, reason), the reason "" when the loop ran to
    `steps`."""
    for i in range(start, steps):
        n = i + 1
        loss = step(i)
        if why := (after_step(n, loss) if after_step is not None else None):
            return n, why
        evaluated = evaluate is not None and bool(every) and (n % every == 0 or n == steps)
        if evaluated and (why := evaluate(n)):
            return n, why
        if why := (end_step(n, evaluated) if end_step is not None else None):
            return n, why
    return max(start, steps), ""


def _out_dir(tc: TrainConfig, world: World, resume: bool, overwrite: bool) -> tuple[Path, str]:
    """The run's out dir and this rank's device (cuda:LOCAL_RANK under torchrun): a dir holding
    another run is refused unless `resume` or `overwrite` (its files deleted, by rank 0 once every
    rank has looked)."""
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    if tc.grad_accum % world.size:
        raise ConfigError(f"train.grad_accum={tc.grad_accum} must be a multiple of the {world.size} processes: the "
                          f"global batch (batch_size x grad_accum) is the same on every world size")
    out = ensure_writable_dir(tc.out_dir)
    found = [n for n in RUN_FILES if (out / n).exists()]
    if found and not (resume or overwrite):
        raise FileExistsError(f"{out} holds another run ({', '.join(found)}); "
                              "pass --resume to continue it or --overwrite to replace it")
    device = world.join(tc.device)
    world.barrier()  # every rank has looked at the out dir before rank 0 changes it
    if overwrite and world.main:
        for n in RUN_FILES:
            (out / n).unlink(missing_ok=True)
        shutil.rmtree(out / SAVED, ignore_errors=True)
    return out, device


def _checkpoint(ckpt_path: "Path", config: dict) -> dict:
    """The checkpoint a resumed run continues from, refused if another config wrote it (where the
    run is written and what it runs on may change: a moved dir, CPU -> GPU)."""
    if not ckpt_path.exists():
        raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}; train without --resume first")
    ck = load_tensors(ckpt_path)  # on the CPU: torch's RNG state must stay a CPU tensor
    changes = [c for c in config_changes(ck["config"], config)
               if not c.startswith(("train.out_dir ", "train.device ", "train.threads "))]
    if changes:
        raise ConfigError(f"--resume: the checkpoint in {ckpt_path.parent} was written by a different config: "
                          f"{', '.join(changes)}")
    return ck


def train(
    rc: RunConfig, resume: bool = False, stop_after: int | None = None, progress: bool = True, data=None,
    overwrite: bool = False, on_step=None, parallel: str = "ddp", base: dict | None = None,
) -> dict:
    """Train per `rc`; `stop_after` ends the run after that many steps *without* a final
    checkpoint, exactly like a kill (used by the resume test). `data` replaces the corpus
    named in the config: (stream with .batch(step, batch_size) -> (x, y), validation
    batches, unigram entropy), as `prepare_data` returns (the bench leaves a corpus out and
    mixes needles in). `on_step(record)` is called after every step with its metrics record
    (step, loss, lr; val_loss where evaluated): the bench counts its progress with it.
    An out dir that holds another run is an error unless `resume` (continue it) or
    `overwrite` (delete its files first). Under torchrun, `parallel` ("ddp" or "fsdp") says how
    the processes share the model (:mod:`memzoo.distributed`).

    `base`: train memories attached to a Hugging Face causal LM instead of a HybridLM, as
    ``{"from": PATH, "attach": [SPEC, ...], "train_base": bool, "lora": rank}`` (:func:`memzoo.attach.for_training`; the
    config's `model` section is not used, its `train` section is). Each checkpoint also writes the model
    to ``out/hf`` (`save_pretrained`), which ``memzoo.attach.from_pretrained`` reloads."""
    tc = rc.train
    world = World.from_env()
    tc.device = resolve_device(tc.device)  # "auto" becomes a device here
    tc.validate()  # also after command-line overrides
    out, device = _out_dir(tc, world, resume, overwrite)
    ckpt_path = out / CKPT
    config = rc.to_dict()
    if base is not None:  # the memories' host is the pretrained model, not the config's backbone
        config.pop("model")
        config["base"] = base
    ck = _checkpoint(ckpt_path, config) if resume else None
    if tc.threads:
        torch.set_num_threads(tc.threads)
    tune_cpu()
    torch.manual_seed(tc.seed)
    stream, val_batches, unigram_h = prepare_data(rc) if data is None else data

    if base is None:
        model = HybridLM(MemzooConfig.from_model_config(rc.model)).to(device)
        what = rc.model.layout
    else:
        from memzoo.attach import for_training

        model = for_training(base["from"], base["attach"], base.get("train_base", False), base.get("lora")).to(device)
        what = f"{base['from']} + {', '.join(base['attach'])}"
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    net = world.wrap(model, parallel, device)  # the module a step runs (DDP, or model sharded in place)
    opt = optimizer(model, tc)
    train_step = make_step(net, opt, tc.grad_clip, resolve_precision(tc.precision, device), tc.compile)
    step, history, saved = 0, [], None
    if ck is not None:
        load_full_state(model, opt, ck["model"], ck["opt"])
        torch.set_rng_state(ck["rng"])
        step, history, saved = ck["step"], ck["history"], ck["step"]
    if world.main:
        write_text(out / "config.json", json.dumps(config, indent=1))

    def write_metrics():
        if world.main:
            write_text(out / "metrics.jsonl", "".join(json.dumps(r, allow_nan=False) + "\n" for r in history))

    def stop(what: str, at: int, lr: float):
        bar.close()
        world.close()
        kept = f"the last good checkpoint (step {saved}) in {out} is kept" if saved else "no checkpoint was written"
        raise Diverged(f"{what} at step {at} (lr {lr:.1e}); {kept}; "
                       "lower train.lr or raise train.warmup")

    def save():
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        if not world.all(all(bool(torch.isfinite(p).all()) for p in local)):
            stop("the weights are not finite", step, lr)
        model_state, opt_state = full_state(model, opt)  # every rank takes part; rank 0 writes
        if world.main:
            torch_save({"model": model_state, "opt": opt_state, "rng": torch.get_rng_state(), "step": step,
                        "history": history, "config": config}, ckpt_path)
            if base is not None:
                from memzoo.attach import save_trained

                save_trained(model, base["from"], out)
        write_metrics()
        world.barrier()

    bar = tqdm(total=tc.steps, initial=step, disable=not (progress and world.main),
               desc=f"train {what} ({n_params / 1e6:.2f}M)")
    val_loss = history[-1]["val_loss"] if history and "val_loss" in history[-1] else float("nan")
    t0, start = time.time(), step
    rec: dict = {}

    def one_step(i: int) -> float:
        nonlocal lr
        lr = lr_at(i, tc)
        # this rank's share of the step's micro-batches (all of them on one process)
        micro = (stream.batch(i * tc.grad_accum + j, tc.batch_size) for j in range(world.rank, tc.grad_accum, world.size))
        return world.mean(train_step([to_device(b, device) for b in micro], lr))

    def after_step(n: int, loss: float) -> None:
        nonlocal step, rec
        if not math.isfinite(loss):
            stop(f"loss is {loss}", n, lr)
        step, rec = n, {"step": n, "loss": loss, "lr": lr}

    def validate(n: int) -> None:
        nonlocal val_loss
        val_loss = world.mean(evaluate(model, val_batches))
        if not math.isfinite(val_loss):
            stop(f"validation loss is {val_loss}", n, lr)
        rec["val_loss"] = val_loss

    def end_step(n: int, evaluated: bool) -> str | None:
        nonlocal saved
        history.append(rec)
        if on_step is not None:
            on_step(rec)
        toks = (n - start) * tc.batch_size * tc.grad_accum * tc.seq_len / (time.time() - t0)  # global
        bar.set_postfix(loss=f"{rec['loss']:.3f}", val=f"{val_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{toks:.0f}")
        bar.update(1)
        if stop_after is not None and n - start >= stop_after:
            return "killed"  # as a kill: no checkpoint of this step
        if n % tc.ckpt_every == 0 or n == tc.steps:
            save()
            saved = n
        return None

    lr = lr_at(step, tc)
    _, why = fit(one_step, tc.steps, start=step, every=tc.eval_every, after_step=after_step, evaluate=validate,
                 end_step=end_step)
    bar.close()
    world.close()
    if why == "killed":
        return {"step": step, "history": history, "killed": True}
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


# ---- the command line: `memzoo train` (memzoo.cli) and `torchrun ... -m memzoo.train` -------------


def _base_of(args, rc: RunConfig) -> dict | None:
    """`--from PATH --attach SPEC...`: the pretrained host of the memories (`train`'s `base`). Its text is
    tokenized by its own tokenizer where PATH holds one (else the config's, which must fit its vocabulary)."""
    if not args.from_:
        if args.attach or args.train_base or args.lora:
            raise ConfigError("--attach, --train-base and --lora train a pretrained model: give it with --from PATH")
        return None
    from transformers import AutoConfig

    path = Path(args.from_)
    if path.is_dir() and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        rc.train.tokenizer = str(path)
    cfg = AutoConfig.from_pretrained(args.from_)
    rc.model.vocab_size = getattr(cfg.get_text_config(), "vocab_size", rc.model.vocab_size)  # prepare_data checks it
    base = {"from": args.from_, "attach": list(args.attach or []), "train_base": bool(args.train_base)}
    return base | ({"lora": args.lora} if args.lora else {})  # runs without LoRA keep the config they had


def cmd_train(args) -> int:
    import os

    from memzoo.config import load_config

    rc = load_config(args.config)
    overrides = (("steps", args.steps), ("out_dir", args.out), ("seed", args.seed), ("device", args.device),
                 ("precision", args.precision), ("compile", args.compile or None))
    for k, v in overrides:
        if v is not None:
            setattr(rc.train, k, v)
    base = _base_of(args, rc)
    result = train(rc, resume=args.resume, overwrite=args.overwrite, parallel=args.parallel, base=base)
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 reports
        return 0
    print(
        f"done: step {result['step']}, train loss {result['train_loss']:.4f}, val loss {result['val_loss']:.4f} "
        f"(unigram entropy {result['unigram_entropy']:.4f} nats/token), checkpoint {result['checkpoint']}"
    )
    return 0


if __name__ == "__main__":  # torchrun --nproc_per_node N -m memzoo.train CONFIG [memzoo train's options]
    import argparse
    import sys

    from memzoo.config import add_train_arguments

    ap = argparse.ArgumentParser(prog="python -m memzoo.train")
    add_train_arguments(ap)
    sys.exit(cmd_train(ap.parse_args()))
