"""The toys suite: in-context recall on synthetic tasks, trained to convergence, with controls.

Tasks, each learned from scratch by a small LM (the preset's backbone scaled to a width, ``n_layers``
blocks, the memory layer at ``at``):

- ``mqar``: multi-query associative recall (Zoology, Arora et al. 2023, Sec. 3;
  :mod:`memzoo.data.mqar`): keys from the first half of the vocabulary, values from the second,
  queries placed with power-law spacing, accuracy on the labelled (query) positions. Training
  batches mix every count of ``mqar_kv`` in equal parts (as Zoology trains); each count is
  evaluated on its own, so a row is a capacity curve: accuracy against key-value pairs.
- ``ar``: Ba et al.'s associative retrieval (2016, Sec. 4.1; :mod:`memzoo.data.assoc_retrieval`),
  ``c9k8j3f1??c -> 9``, the prediction at the last position being the answer.

The memory the only route (``route: memory``: the default and the ``recall`` preset, the headline).
As Zoology measures a mixer behind a short convolution, the backbone's own mixing is local: sliding
windows of ``window`` tokens (4: two blocks reach 6 tokens back, `reach`), and every MQAR query lies
at least ``mqar_gap`` + 1 = 9 tokens after its pair (filler between the pairs and the queries), so a
pair reaches its query only through the memory. A window rather than a convolution: it exists in the
backbone and binds a key to its value the same way. ``check_route`` refuses a backbone whose reach is
not shorter than the gap; the backbone alone and PKM (no fast weights) are then negative controls by
construction, and the harness is invalid if either is above twice chance on any slice. With the gap
at least the chunk (8), a query lies in a later chunk than its pair, where a read-then-write layer
reads it. ``route: hybrid`` (``standard``, ``capacity``) is the second view: the memory behind a GDN.
Behind a mixer the paper's FwPKM stays at chance (its top-k read never lands on the pair's slots and
passes no gradient to slots it did not select); ``fwpkm/token`` addresses it by the token (the first
block, before its mixer) and recalls. FwMLP recalls only with all three of the token's query, the
release's gradient clamp and a 10x fast step (``fwmlp/token``). LaCT's one step per 8-token chunk
moves its fast weights ~1e-4 of a read. FWL's features (width and hidden) outnumber the 32 key tokens
at width 64, so it holds every pair; its curve falls at a narrow state (``fwl/narrow``, width 8). The
measurements: docs/toys.md.

Protocol, per cell (layer, task, width, seed):

1. *Data.* Training batches are drawn from the seed; a validation and a test set per slice (kv
   count or pairs) from generators of their own, the same for every layer and seed.
2. *Training to convergence.* AdamW, warmup then cosine to ``min_lr_ratio`` × lr at ``max_steps``
   (the cap). Every ``eval_every`` steps the validation sets are scored (the row keeps the curve);
   training stops when they reach ``target`` (*solved*; with ``solve_on: every``, every slice), or,
   from ``min_steps`` on, when the score has not gained ``min_delta`` for ``patience`` evaluations
   while the training loss no longer falls (``loss_delta``): *plateau*, or *chance* where the best
   score is within twice chance; otherwise the cap stops it (*capped*). The model kept is the best
   on validation. Why: MQAR is learned in a sudden transition after a flat phase whose length
   depends on the layer, the lr and the batch, so only *solved* and *plateau* are verdicts; a cell
   at *chance* or *capped* is a statement about its budget, "at chance through N sequences",
   until a longer training (the ``recall-10x`` preset) says otherwise.
3. *Learning rate on validation.* Each of ``lrs`` (or ``layer_lrs``) is trained; the best
   validation score picks one; if it lies at an edge of the lrs tried, the next lr beyond it (÷3
   or ×3) is trained too, up to ``MAX_BEYOND`` times, so that no lr is chosen at the edge of its
   grid; a cell at chance at every lr chooses none (nothing to extend). Only then are the test
   sets scored.
4. *Seeds.* ``seeds`` per cell, one row each; tables show the mean, a 95% t-interval, the seeds
   that left chance, and mark a layer whose interval lies wholly above (▲) or below (▼) the baseline's.
5. *Controls* (run with the baseline): ``ctrl:attention`` (positive: softmax attention in every
   block with a short convolution on q, k, v, as Zoology's ``Hybrid([BaseConv, MHA])``) and
   ``ctrl:none`` (negative: no token mixer; chance is 2/vocab on MQAR, 1/10 on Ba's task). If the
   positive control misses ``target`` on the easiest slice in any seed, or the negative one is above
   twice chance, the harness is invalid and no layer rows of that task are published.

Evaluation runs batches of ``batch_size`` sequences, as training does; persistent fast weights go
back to their trained value before every evaluation batch and to where training left them after it.
State size (the capacity figure's x axis): the recurrent state one sequence carries, in numbers
(GDN matrices, the memory's fast weights, attention's KV cache at the sequence or window length).
Variants (``variants``): extra rows of a layer with other options, another place (``at``) or widths
of their own (``widths``: a smaller state, as Zoology varies the width), run with the layer or alone
(``memzoo bench --layers fwpkm/token``). Chunk-level layers (FwPKM, FwMLP,
LaCT) read before they write a chunk, so the presets give them chunks of a few pairs; FWL keeps a
chunk as long as the sequence (the paper's plain FWL) and learns from the sequence's next tokens
(its L_t), not from the task's labels, which MQAR puts on the queries only. Training runs in bf16 autocast with
torch.compile (``precision``, ``compile``); evaluation in fp32 eager. ``python -m
memzoo.bench.reruns DIR`` reads a rerun beside the published rows. Why each choice,
with its measurements: docs/toys.md; speed: docs/performance.md.
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from memzoo.backbone.model import HybridLM
from memzoo.bench.common import (
    BASELINE, CONTROLS, NEGATIVE, POSITIVE, Context, check_backbone, check_variants, config_hash, layer_order, mean_ci,
    model_config, save_png,
)
from memzoo.config import ConfigError, ModelConfig, TrainConfig
from memzoo.data import assoc_retrieval as ar
from memzoo.data import mqar
from memzoo.registry import get_layer
from memzoo.train import lr_at, make_step, param_groups

NAME = "toys"
TASKS = ("mqar", "ar")

# shown under the suite's tables in the leaderboard
EXPLANATION = """Accuracy is on the labelled positions of the test sets (MQAR: every query; Ba's task: the answer
after the query), mean ± the half-width of a 95% t-interval over the seeds; ▲ / ▼: the layer's
interval lies wholly above / below the baseline's. Each training ran until validation accuracy
reached the target or stopped improving (*stop*: solved / plateau / chance / capped; a capped cell did not
converge; *chance*: stopped at chance, a statement about the budget), with the learning rate chosen
on the validation sets ("(edge)": chosen at the edge of the lrs tried; "none": at chance at every lr).
*Left chance at*: the sequences trained before validation accuracy first rose above twice chance
(the median over the seeds that did); *budget*: the sequences the chosen lr trained (median, max).
A layer at chance is at chance through its budget, not at chance as a property: the learning curves
show where each training stood, and the recall-10x preset retrains the negative rows of the recall
preset at ten times its budget. ctrl:attention is the positive
control (attention with a short convolution), ctrl:none the negative one (no token mixer).
State: numbers one sequence carries (GDN matrices, the memory's fast weights, attention's KV
cache); a memory shared by the batch (FwPKM as the paper trains it) is counted whole."""


#: layers whose `chunk_size` is not a read-then-write chunk: FWL reads the earlier positions of its
#: own chunk (Eq. 2); its chunk is the segment after which its update decays (module docstring)
SEGMENTED = ("fwl",)


def _toy_layer_options() -> dict:
    """Update chunks of 8 tokens (four pairs) for every chunk-level read-then-write layer: each
    registered layer whose constructor takes a `chunk_size`, that does not read its own token's
    write (not `inclusive`) and is not in SEGMENTED; FwPKM and FwMLP with a memory per sequence;
    LaCT with fast-weight heads of 32 at the default width 64 (2 heads; why: zoo_configs/bench/tiny.yaml)."""
    from memzoo.registry import get_layer, layer_names

    out = {n: {"chunk_size": 8} for n in layer_names() if n not in SEGMENTED
           and "chunk_size" in inspect.signature(get_layer(n)).parameters and not get_layer(n).inclusive}
    for n in ("fwpkm", "fwmlp"):  # shared by the batch as the paper trains them; a memory per sequence here
        if n in out:
            out[n]["per_sequence"] = True
    if "lact" in out:
        out["lact"]["num_heads"] = 2
    return out


@dataclass
class Settings:
    tasks: list = field(default_factory=lambda: ["mqar"])
    widths: list = field(default_factory=lambda: [64])  # d_model of each model; >= 2 for a state curve
    n_layers: int = 2
    at: str = "last"  # where the memory layer goes ("last" = block 1 of 2)
    # backbone fields over the preset's (gdn_head_dim: fixed); by default local mixers (route: memory)
    model: dict = field(default_factory=lambda: {"gdn_chunk": 16, "layout": "SWA", "window": 4})
    layer_options: dict = field(default_factory=_toy_layer_options)  # per layer, merged over the preset's
    variants: dict = field(default_factory=dict)  # extra rows: {name: {layer: L, options: {...}, at: A, widths: [...]}}
    seeds: int = 1
    lrs: list = field(default_factory=lambda: [3e-3])  # candidates, chosen on validation (ties: the first)
    layer_lrs: dict = field(default_factory=dict)  # a layer's (or control's) own candidates
    max_steps: int = 2500  # the cap
    eval_every: int = 50
    patience: int = 6  # evaluations without a gain of min_delta: plateau
    min_steps: int = 500  # no plateau stop before this step (the flat phase before MQAR is learned)
    min_delta: float = 0.005
    # no plateau stop while the training loss still falls: its mean over the last patience * eval_every
    # steps is more than this fraction below the mean over the steps before (a 1/n plateau whose loss falls
    # is MQAR's flat phase, not a verdict)
    loss_delta: float = 0.01
    target: float = 0.99  # validation accuracy that counts as solved
    solve_on: str = "mean"  # solved when the slices' mean reaches target ("mean") or each slice does ("every")
    batch_size: int = 32
    warmup: int = 20
    min_lr_ratio: float = 0.1  # cosine from lr down to lr * this at max_steps
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    precision: str = "fp32"  # fp32, or bf16 autocast (training only; evaluation is fp32)
    compile: bool = False  # torch.compile the training forward
    val_size: int = 256  # validation sequences per slice
    test_size: int = 512  # test sequences per slice
    controls: bool = True  # run the controls with the baseline
    run_variants: bool = True  # a layer's variants run with it (false: only a variant named in --layers)
    # MQAR (zoology's multiquery_ar)
    mqar_vocab: int = 64
    mqar_seq_len: int = 32
    mqar_kv: list = field(default_factory=lambda: [2, 4, 6])
    power_a: float = 0.01
    mqar_gap: int = 8  # filler tokens between the last pair and the first query (route: memory)
    route: str = "memory"  # the backbone's mixers are local and every query lies beyond their reach; or "hybrid"
    # Ba's associative retrieval
    ar_pairs: list = field(default_factory=lambda: [4, 8, 12])

    def check(self) -> None:
        from memzoo.registry import layer_names

        bad = sorted(set(self.tasks) - set(TASKS))
        if bad or not self.tasks:
            raise ConfigError(f"toys.tasks: unknown or empty {bad or self.tasks}; valid tasks: {', '.join(TASKS)}")
        for name in ("widths", "lrs", "mqar_kv", "ar_pairs"):
            if not getattr(self, name):
                raise ConfigError(f"toys.{name} is empty")
        for n in self.mqar_kv:
            try:
                mqar.check_sizes(n, self.mqar_seq_len, self.mqar_vocab, self.mqar_gap)
            except ValueError as e:
                raise ConfigError(f"toys.mqar_kv: {e}") from None
        for n in self.ar_pairs:
            if not 1 <= n <= ar.MAX_PAIRS:
                raise ConfigError(f"toys.ar_pairs: {n} is not in 1..{ar.MAX_PAIRS}")
        for name in ("max_steps", "batch_size", "val_size", "test_size", "n_layers", "seeds", "eval_every", "patience",
                     "min_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"toys.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.target <= 1 or self.min_delta < 0 or self.loss_delta < 0:
            raise ConfigError(f"toys.target must be in (0, 1], min_delta and loss_delta >= 0, got {self.target}, "
                              f"{self.min_delta}, {self.loss_delta}")
        if self.solve_on not in ("mean", "every"):
            raise ConfigError(f"toys.solve_on must be 'mean' or 'every', got {self.solve_on!r}")
        if self.route not in ("hybrid", "memory"):
            raise ConfigError(f"toys.route must be 'hybrid' or 'memory', got {self.route!r}")
        if self.route == "memory" and self.tasks != ["mqar"]:
            raise ConfigError(f"toys.route=memory needs toys.tasks: [mqar], got {self.tasks}: Ba's task asks its "
                              f"query right after the pairs, within any backbone's reach")
        if self.precision not in ("fp32", "bf16"):
            raise ConfigError(f"toys.precision must be 'fp32' or 'bf16', got {self.precision!r}")
        if "mqar" in self.tasks and self.batch_size < len(self.mqar_kv):
            raise ConfigError(f"toys.batch_size={self.batch_size} cannot hold one sequence of each of the "
                              f"{len(self.mqar_kv)} mqar_kv counts")
        if any(not isinstance(w, int) or w < 1 for w in self.widths):
            raise ConfigError(f"toys.widths must be positive integers, got {self.widths}")
        check_variants(self.variants, "toys.variants", ("layer", "options", "at", "widths"))
        for name, v in self.variants.items():
            if "widths" in v and (not v["widths"] or any(not isinstance(w, int) or w < 1 for w in v["widths"])):
                raise ConfigError(f"toys.variants.{name}.widths must be positive integers, got {v['widths']!r}")
        valid_lrs = [BASELINE, *CONTROLS, *layer_names(), *self.variants]
        for name, valid in (("layer_options", layer_names()), ("layer_lrs", valid_lrs)):
            unknown = sorted(set(getattr(self, name)) - set(valid))
            if unknown:
                raise ConfigError(f"toys.{name}: unknown layer(s) {unknown}; valid: {', '.join(valid)}")
        if any(not lrs for lrs in self.layer_lrs.values()):
            raise ConfigError("toys.layer_lrs: every layer needs at least one learning rate")
        if any(not isinstance(lr, (int, float)) or not 0 < lr < 1 for lr in [*self.lrs, *sum(self.layer_lrs.values(), [])]):
            raise ConfigError(f"toys.lrs and layer_lrs must be numbers in (0, 1), got {self.lrs} {self.layer_lrs}")
        check_backbone(self.model, "toys.model")

    def candidates(self, layer: str) -> list[float]:
        return list(self.layer_lrs.get(layer, self.lrs))

    def widths_of(self, model: str) -> list[int]:
        """The widths a model is trained at: a variant's own (a smaller state), else ``widths``."""
        return list(self.variants.get(model, {}).get("widths", self.widths))


# ---- models --------------------------------------------------------------------------------


def toy_config(preset, layer: str, width: int, vocab_size: int, s: Settings) -> ModelConfig:
    """The preset's backbone (with `s.model` over it) scaled to `width` and `s.n_layers` blocks,
    with `layer` at `s.at` and the preset's options for it, `s.layer_options[layer]` merged over
    them (the preset's placement, e.g. "1,3", is for its deeper backbone, so `s.at` replaces it).
    The controls replace the mixers: attention with a short convolution, or none."""
    b = {**preset.backbone, **s.model}
    ref = ModelConfig.from_dict(b)
    scale = width / ref.d_model
    base = {
        **b,
        "vocab_size": vocab_size,
        "d_model": width,
        "n_layers": s.n_layers,
        "ffn_dim": max(1, round(ref.ffn_dim * scale)),
        "gdn_head_dim": s.model.get("gdn_head_dim", max(1, width // ref.gdn_heads)),  # a set head size stays
        "attn_head_dim": max(1, width // ref.attn_heads),
    }
    if layer == BASELINE or layer in CONTROLS:
        return model_config(preset, layer, **base)
    variant = s.variants.get(layer, {})
    layer = variant.get("layer", layer)
    spec = preset.layers.get(layer)
    opts = {**(spec.options if spec else {}), **(s.layer_options.get(layer) or {}), **(variant.get("options") or {})}
    mixers = base.get("layout", "GDN").split("|")[0].strip()
    at = variant.get("at", s.at)
    return ModelConfig.from_dict({**base, "layout": f"{mixers} | {layer}@{at}", "memory": {layer: opts}})


def reach(mc: ModelConfig) -> int | None:
    """How many tokens back the backbone's own mixers carry information, stacked over its blocks
    (None: unbounded): a sliding window of w sees w - 1 tokens back, its short convolution of c
    (``attn_conv``) c - 1 more; a block without a mixer none. Memories are not counted."""
    from memzoo.backbone.layout import parse_layout

    total = 0
    for kind in parse_layout(mc.layout, mc.n_layers).mixers:
        if kind == "NONE":
            continue
        if kind != "SWA":
            return None
        total += mc.window - 1 + max(mc.attn_conv - 1, 0)
    return total


def check_route(mc: ModelConfig, layer: str, s: Settings) -> None:
    """With ``route: memory``, every model but the positive control must be unable to carry a
    pair to its query without its memory: the backbone's reach is shorter than the distance
    from the last pair's value to the first query (``mqar_gap`` + 1)."""
    if s.route != "memory" or layer == POSITIVE:
        return
    r = reach(mc)
    if r is None or r > s.mqar_gap:
        raise ConfigError(f"toys.route=memory: the backbone {mc.layout.split('|')[0].strip()!r} of {mc.n_layers} blocks "
                          f"reaches {'every token' if r is None else f'{r} tokens'} back, but a query may lie "
                          f"{s.mqar_gap + 1} tokens after its pair; use local mixers (toys.model: {{layout: SWA, window: w}}) "
                          f"and toys.mqar_gap >= n_layers * (w - 1)")


def state_size(model: HybridLM, seq_len: int) -> dict:
    """Recurrent state of one sequence, in numbers (call after a forward so every memory has
    its state): GDN matrices, memory fast weights, attention's keys and values at `seq_len` (a
    sliding window's: the last `window` tokens' at most)."""
    gdn = sum(b.mixer.h * b.mixer.d * b.mixer.d for b in model.blocks if b.kind == "GDN")
    kv = sum(2 * b.mixer.hkv * b.mixer.d * (min(seq_len, b.mixer.window) if b.kind == "SWA" else seq_len)
             for b in model.blocks if b.kind in ("FA", "SWA", "FA-pSWA"))
    mems = model.memories()
    mem = sum(m.fast_weight_numel() for m in mems)
    shared = any(not m.per_sequence and m.fast_weight_numel() > 0 for m in mems)  # (PKM: no fast weights)
    return {"gdn_state": gdn, "kv_cache": kv, "mem_state": mem, "state_size": gdn + kv + mem, "state_shared": shared}


# ---- data ----------------------------------------------------------------------------------


class Task:
    """Training batches (a pure function of the generator), and the validation and test sets of
    each slice (kv count or pairs), from generators of their own."""

    @staticmethod
    def vocab_of(name: str, s: Settings) -> int:
        return s.mqar_vocab if name == "mqar" else ar.VOCAB_SIZE

    @staticmethod
    def mean_length(name: str, s: Settings) -> float:
        """Tokens per training sequence, on average over the steps."""
        return s.mqar_seq_len if name == "mqar" else sum(2 * n + 3 for n in s.ar_pairs) / len(s.ar_pairs)

    def __init__(self, name: str, s: Settings):
        self.name, self.s = name, s
        self.vocab = self.vocab_of(name, s)
        self.slices = list(s.mqar_kv if name == "mqar" else s.ar_pairs)
        self.seq_len = s.mqar_seq_len if name == "mqar" else 2 * max(self.slices) + 3
        self.chance = 2 / s.mqar_vocab if name == "mqar" else 1 / 10
        self.val = {n: self._make(s.val_size, n, torch.Generator().manual_seed(7_919 + n)) for n in self.slices}
        self.test = {n: self._make(s.test_size, n, torch.Generator().manual_seed(10_007 + n)) for n in self.slices}

    def _make(self, size: int, n: int, g: torch.Generator):
        s = self.s
        if self.name == "mqar":
            return tuple(mqar.make_batch(size, n, s.mqar_seq_len, s.mqar_vocab, s.power_a, g, gap=s.mqar_gap))
        b = ar.make_batch(size, n, g)  # the answer is the prediction at the last position (the query)
        t = torch.full_like(b.tokens, mqar.IGNORE)
        t[:, -1] = b.answer
        return b.tokens, t

    def batch(self, step: int, g: torch.Generator):
        s = self.s
        if self.name == "mqar":  # every kv count in each batch
            return tuple(mqar.mixed_batch(s.batch_size, self.slices, s.mqar_seq_len, s.mqar_vocab, s.power_a, g,
                                          gap=s.mqar_gap))
        return self._make(s.batch_size, self.slices[step % len(self.slices)], g)  # lengths differ: cycle


# ---- training and evaluation ---------------------------------------------------------------


@torch.no_grad()
def evaluate(model: HybridLM, sets: dict, batch_size: int) -> dict[int, float]:
    """Accuracy on the labelled positions of each set, in batches of the training batch size,
    each batch starting from the model's persistent fast weights as they are now (restored
    after)."""
    was = model.training
    model.eval()
    start = model.memory_state(persistent_only=True)
    dev = model.embed.weight.device
    out = {}
    for n, (x, y) in sets.items():
        hits = total = 0
        for i in range(0, len(x), batch_size):
            model.load_memory_state(start)
            xc, yc = x[i : i + batch_size].to(dev), y[i : i + batch_size].to(dev)
            # with targets, as in training: FWL learns from the sequence's next tokens (HybridLM.forward)
            logits = model(xc, targets=yc).logits
            mask = yc != mqar.IGNORE
            hits += (logits.argmax(-1)[mask] == yc[mask]).sum().item()
            total += mask.sum().item()
        out[n] = hits / total
    model.load_memory_state(start)
    model.train(was)
    return out


@dataclass
class Fit:
    model: HybridLM
    val: float  # best validation accuracy (mean over slices)
    steps: int  # training steps taken
    stop: str  # solved | plateau | chance | capped | diverged
    train_loss: float  # mean of the last eval_every steps
    tokens_per_s: float  # training tokens over the time of the training steps alone (the first of each shape left out)
    compile_s: float = 0.0  # the first step of each input shape: compiles with `compile` (cold, or from the cache)
    eval_s: float = 0.0  # the validation evaluations
    history: list = field(default_factory=list)  # one entry per evaluation: {step, sequences, val, by_slice, train_loss}


#: seconds between a cell's checkpoints (`train_cell`)
CHECKPOINT_EVERY_S = 60.0


def falling(losses: list[float], s: Settings) -> bool:
    """Whether the training loss still falls: the mean over the last ``patience * eval_every`` steps
    is more than ``loss_delta`` (a fraction) below the mean over as many steps before them (or over
    all before, early on)."""
    w = min(s.patience * s.eval_every, len(losses) // 2)
    if w == 0:
        return True
    last, before = sum(losses[-w:]) / w, sum(losses[-2 * w : -w]) / w
    return last < before * (1 - s.loss_delta)


def train_cell(mc: ModelConfig, task: Task, lr: float, s: Settings, seed: int, device: str = "cpu",
               on_step=None, checkpoint: Path | None = None) -> Fit:
    """Train one model from seed `seed` (the same initialisation and batches for every layer and
    lr) until it converges or hits the cap (module docstring); `on_step()` after each step.
    The model returned holds the weights of its best validation score. With `checkpoint`, the
    training state (weights, optimizer, data generator, history) is saved there at evaluations,
    at most once a minute, and a training that finds it continues from it: a stopped cell
    resumes where it stopped, with the same batches (the file is removed when the cell ends)."""
    torch.manual_seed(seed)
    model = HybridLM(mc).to(device)
    tc = TrainConfig(lr=lr, min_lr=lr * s.min_lr_ratio, warmup=s.warmup, steps=s.max_steps, weight_decay=s.weight_decay,
                     betas=(0.9, 0.98), grad_clip=s.grad_clip, precision=s.precision, compile=s.compile)  # Zoology's betas
    opt = torch.optim.AdamW(param_groups(model, tc), lr=lr, betas=tc.betas)
    g = torch.Generator().manual_seed(seed)
    best, best_state, stale, stop, start = -1.0, None, 0, "capped", 0
    losses, history = [], []
    if checkpoint is not None and checkpoint.is_file():
        c = torch.load(checkpoint, map_location=device, weights_only=False)
        model.load_state_dict(c["model"])
        opt.load_state_dict(c["opt"])
        g.set_state(c["generator"])
        torch.set_rng_state(c["rng"])
        best, best_state, stale, start, losses, history = (c[k] for k in ("best", "best_state", "stale", "step", "losses",
                                                                         "history"))
    if s.compile:  # a new model: compile afresh (a worker's earlier cells would fill dynamo's per-function cache)
        torch._dynamo.reset()
    train_step = make_step(model, opt, tc.grad_clip, tc.precision, tc.compile)
    tokens, busy, first, evals, shapes, saved = 0, 0.0, 0.0, 0.0, set(), time.monotonic()
    model.train()
    step = start - 1
    for step in range(start, s.max_steps):
        x, y = (t.to(device) for t in task.batch(step, g))  # drawn on the CPU: the same data anywhere
        t0 = time.perf_counter()
        loss = train_step([(x, y)], lr_at(step, tc))
        if x.shape in shapes:  # the first step of each shape compiles (with `compile`): not in the throughput
            busy += time.perf_counter() - t0
            tokens += x.numel()
        else:
            first += time.perf_counter() - t0
        shapes.add(x.shape)
        losses.append(loss)
        if on_step is not None:
            on_step()
        if not math.isfinite(loss):
            stop = "diverged"
            break
        if (step + 1) % s.eval_every and step + 1 < s.max_steps:
            continue
        t0 = time.perf_counter()
        acc = evaluate(model, task.val, s.batch_size)
        evals += time.perf_counter() - t0
        val = sum(acc.values()) / len(acc)
        tail = losses[-s.eval_every:]
        history.append({"step": step + 1, "sequences": (step + 1) * s.batch_size, "val": round(val, 4), "by_slice": {str(n): round(a, 4) for n, a in acc.items()},
                        "train_loss": round(sum(tail) / len(tail), 4)})
        stale = 0 if val >= best + s.min_delta else stale + 1
        if val > best:
            best, best_state = val, copy.deepcopy(model.state_dict())
        if solved(acc, s):
            stop = "solved"
            break
        if step + 1 >= s.max_steps:
            break
        if stale >= s.patience and step + 1 >= s.min_steps and not falling(losses, s):
            stop = "chance" if best <= 2 * task.chance else "plateau"  # at chance: the flat phase may go on
            break
        if checkpoint is not None and time.monotonic() - saved > CHECKPOINT_EVERY_S:
            from memzoo.storage import torch_save

            torch_save({"model": model.state_dict(), "opt": opt.state_dict(), "generator": g.get_state(),
                        "rng": torch.get_rng_state(), "best": best,
                         "best_state": best_state, "stale": stale, "step": step + 1, "losses": losses,
                         "history": history}, checkpoint)
            saved = time.monotonic()
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)
    if best_state is not None:
        model.load_state_dict(best_state)
    tail = losses[-s.eval_every:]
    return Fit(model, max(best, 0.0), step + 1, stop, sum(tail) / len(tail), tokens / max(busy, 1e-9), first, evals,
               history)


def left_chance_at(history: list[dict], chance: float) -> int | None:
    """Sequences trained before the first evaluation whose validation accuracy (the slices' mean)
    is above twice chance; None if none is."""
    return next((h["sequences"] for h in history if h["val"] > 2 * chance), None)


def solved(acc: dict[int, float], s: Settings) -> bool:
    """Whether validation accuracies by slice reach the target: their mean, or each of them."""
    return (min(acc.values()) if s.solve_on == "every" else sum(acc.values()) / len(acc)) >= s.target


def cell_config(mc: ModelConfig, task: str, s: Settings, layer: str) -> dict:
    """Everything one cell's numbers depend on (its hash decides whether a resumed run skips it)."""
    data = ({"vocab": s.mqar_vocab, "seq_len": s.mqar_seq_len, "kv": s.mqar_kv, "power_a": s.power_a}
            if task == "mqar" else {"pairs": s.ar_pairs})
    if task == "mqar" and s.mqar_gap:  # left out at 0: the rows recorded before the option keep their hashes
        data["gap"] = s.mqar_gap
    keep = ("max_steps", "min_steps", "eval_every", "patience", "min_delta", "loss_delta", "target", "batch_size", "warmup",
            "min_lr_ratio", "weight_decay", "grad_clip", "precision", "compile", "val_size", "test_size")
    train = {k: getattr(s, k) for k in keep}
    if s.solve_on != "mean":  # the default is left out: the rows recorded before the option keep their hashes
        train["solve_on"] = s.solve_on
    config = {"model": mc.to_dict(), "task": task, "data": data, "lrs": s.candidates(layer), "train": train,
              "optimizer": "AdamW(0.9, 0.98), warmup + cosine", "version": 3,
              # 3: no plateau stop while the loss falls; an lr chosen at the grid's edge tries the next beyond it
              "lr_beyond_edge": MAX_BEYOND}
    if any(get_layer(name).needs_targets for name in mc.memory):  # FWL's losses against the next tokens, not the
        config["memory_targets"] = "next"  # task's labels (HybridLM.forward): rows from before have another hash
    return config


def cell_key(ctx: Context, s: Settings, name: str, task: str, width: int, seed: int) -> tuple:
    """(model config, config, setting, the row already recorded or None) of one cell."""
    mc = toy_config(ctx.preset, name, width, Task.vocab_of(task, s), s)
    check_route(mc, name, s)
    config, setting = cell_config(mc, task, s, name), {"task": task, "d_model": width}
    if s.route == "memory":  # (absent otherwise: the hybrid rows recorded before the option keep their settings)
        setting["route"] = "memory"
    return mc, config, setting, ctx.recorded(NAME, name, setting, config, seed)


def cells(layer: str, s: Settings) -> list[str]:
    """The models one layer's run trains: the layer and its variants (unless ``run_variants`` is
    off), and with the baseline the controls; a variant named alone (``--layers fwpkm/token``), only itself."""
    if layer in s.variants:
        return [layer]
    variants = sorted(n for n, v in s.variants.items() if v["layer"] == layer) if s.run_variants else []
    return [layer, *variants, *(CONTROLS if layer == BASELINE and s.controls else ())]


def work(ctx: Context, layer: str) -> int:
    """Units of work for the progress bar: the training steps of one layer at the cap (a cell
    that stops early counts the rest at once)."""
    s = ctx.preset.settings(NAME, Settings)
    per = len(s.tasks) * s.seeds * s.max_steps
    return sum(per * len(s.widths_of(m)) * len(s.candidates(m)) for m in cells(layer, s))


def _plan(ctx: Context, layers: list[str]):
    """Every cell of `layers` in run order: (model name, task, width, seed)."""
    s = ctx.preset.settings(NAME, Settings)
    for layer in layers:
        for name in cells(layer, s):
            for tname in s.tasks:
                for width in s.widths_of(name):
                    for seed in range(ctx.seed, ctx.seed + s.seeds):
                        yield name, tname, width, seed


def parts(ctx: Context, layer: str) -> list[tuple[tuple, float, tuple]]:
    """The cells of one layer's run, each a part that `run(ctx, [layer], only=[part])` measures alone
    (`memzoo bench` hands them to whichever worker is free), with its relative cost (the training
    tokens at the cap, a step's batch times the task's mean length, in steps of MQAR's batch) and
    its group: the cells of one model, task and width, which differ only in the seed and so
    compile the same graphs. A cell already recorded (with resume) compiles nothing and has no
    group, so that the first of its group still to run goes first (the later ones then load its
    graphs from the run's cache): resuming with every group's first seed recorded, two workers
    had taken MoM's seeds 1 and 2 side by side and compiled the same graphs at once."""
    s = ctx.preset.settings(NAME, Settings)
    tokens = {t: Task.mean_length(t, s) for t in s.tasks}
    return [(cell, s.max_steps * len(s.candidates(cell[0])) * tokens[cell[1]] / s.mqar_seq_len,
             None if cell_key(ctx, s, *cell)[3] is not None else cell[:3])
            for cell in _plan(ctx, [layer])]


def run(ctx: Context, layers: list[str], only: list[tuple] | None = None) -> list[dict]:
    """Train and evaluate every (layer, task, width, seed), or only the cells in `only`; one row
    each. With `ctx.resume`, a cell already recorded with the same config and seed is skipped
    (its row is returned)."""
    s = ctx.preset.settings(NAME, Settings)
    s.check()
    tasks: dict[str, Task] = {}
    rows = []
    for name, tname, width, seed in _plan(ctx, layers):
        if only is not None and (name, tname, width, seed) not in only:
            continue
        mc, config, setting, done = cell_key(ctx, s, name, tname, width, seed)
        if done is not None:
            rows.append(done)
            ctx.advance(s.max_steps * len(s.candidates(name)), f"toys {name} (recorded)")
            continue
        if tname not in tasks:  # built on first use: its validation and test sets take a moment
            tasks[tname] = Task(tname, s)
        rows.append(_cell(ctx, name, tasks[tname], width, mc, config, setting, s, seed))
    return rows


def lr_grid(fits: dict) -> tuple[float, bool]:
    """(the lr chosen on validation, whether it lies at an edge of the lrs tried): the best
    validation score (ties: the first tried); an edge is the smallest or largest lr tried."""
    lr = max(fits, key=lambda k: fits[k].val)
    return lr, lr in (min(fits), max(fits))


def beyond(lr: float, fits: dict) -> float:
    """The next lr past the edge `lr` of the grid: a third of the smallest, or three times the largest."""
    return lr / 3 if lr == min(fits) else lr * 3


#: how many lrs past an edge a cell tries before it records its choice at the edge
MAX_BEYOND = 2


def _cell(ctx: Context, layer: str, task: Task, width: int, mc, config: dict, setting: dict, s: Settings,
          seed: int) -> dict:
    """Every lr of the grid, then, while the chosen lr lies at an edge of the lrs tried and left
    chance, the next lr past it (at most MAX_BEYOND): an lr chosen at the grid's edge may have a better
    one beyond it. A cell at chance at every lr chooses none (`lr` is the best of noise) and is not
    extended. Checkpoints under the work dir make a stopped cell continue (`train_cell`)."""
    t0 = time.perf_counter()
    fits = {}
    ckpt_dir = ctx.work_dir / "cells"
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    def fit_at(lr: float) -> Fit:
        doing = f"toys {layer} {task.name} d={width} seed {seed} lr={lr:g}"
        ckpt = ckpt_dir / f"{config_hash(config)}-{layer.replace('/', '_').replace(':', '_')}-s{seed}-lr{lr:g}.pt"
        fit = train_cell(mc, task, lr, s, seed, ctx.device, lambda d=doing: ctx.advance(1, d), ckpt)
        ctx.advance(s.max_steps - fit.steps, doing)  # the steps an early stop saved
        return fit

    for lr in s.candidates(layer):
        fits[lr] = fit_at(lr)
    lr, edge = lr_grid(fits)
    extra = 0
    while edge and len(fits) > 1 and fits[lr].val > 2 * task.chance and extra < MAX_BEYOND:
        nxt = round(beyond(lr, fits), 12)
        fits[nxt] = fit_at(nxt)
        extra += 1
        lr, edge = lr_grid(fits)
    fit = fits[lr]
    at_chance = all(f.val <= 2 * task.chance for f in fits.values())
    t_test = time.perf_counter()
    acc = evaluate(fit.model, task.test, s.batch_size)
    t_test = time.perf_counter() - t_test
    x, y = task.test[task.slices[0]]
    with torch.no_grad():  # a forward, so that every memory holds its state
        fit.model.eval()(x[:2].to(ctx.device), targets=y[:2].to(ctx.device))
    left = {f"{k:g}": left_chance_at(f.history, task.chance) for k, f in fits.items()}
    metrics = {
        "accuracy": round(sum(acc.values()) / len(acc), 4),
        "acc_by_kv": {str(n): round(a, 4) for n, a in acc.items()},
        "val_accuracy": round(fit.val, 4),
        "lr": lr,
        "lr_chosen": not at_chance,  # at chance at every lr: no lr is chosen (the best of noise is kept)
        "lr_at_edge": edge and len(fits) > 1 and not at_chance,  # one lr given: a choice, not a grid
        "val_by_lr": {f"{k:g}": round(f.val, 4) for k, f in sorted(fits.items())},
        "steps": fit.steps,
        "sequences": fit.steps * s.batch_size,  # the budget the chosen lr's training used
        "left_chance_at": left[f"{lr:g}"],  # sequences trained before validation first left chance (None: never)
        "left_chance_at_by_lr": dict(sorted(left.items(), key=lambda kv: float(kv[0]))),
        "stop": fit.stop,
        "converged": fit.stop in ("solved", "plateau"),
        "train_loss": round(fit.train_loss, 4),
        # the chosen lr's validation curve; the others' means (the learning-curve figure, "left chance at")
        "history": fit.history,
        "val_history_by_lr": {f"{k:g}": [h["val"] for h in f.history] for k, f in sorted(fits.items())},
        "tokens_per_s": round(fit.tokens_per_s),
        # where the cell's wall time went (every lr candidate's training): the first step of each
        # input shape (compiles, with `compile`) and the evaluations (validation and test)
        "compile_s": round(sum(f.compile_s for f in fits.values()), 3),
        "eval_s": round(sum(f.eval_s for f in fits.values()) + t_test, 3),
        "chance": task.chance,
        **state_size(fit.model, task.seq_len),
        "params": sum(p.numel() for p in fit.model.parameters()),
    }
    row = ctx.record(NAME, layer, setting, metrics, config, time.perf_counter() - t0, seed=seed)
    if ctx.progress:
        left_at = metrics["left_chance_at"]
        tqdm.write(f"toys {layer:>14} {task.name:>4} d={width:<4} seed {seed}: test {metrics['accuracy']:.3f} "
                   f"(val {fit.val:.3f}, lr {lr:g}, {fit.steps} steps, {fit.stop}; "
                   + (f"left chance at {left_at} sequences)" if left_at else f"at chance through {fit.steps * s.batch_size} sequences)"))
    return row


# ---- what a short budget can show ------------------------------------------------------------

#: the preset that checks the recall preset's negative rows at ten times its budget
LONG = "recall-10x"


def notes(rows: list[dict], published: list[dict]) -> list[str]:
    """One line per layer that the run's MQAR rows show at chance in every seed: the budget it was
    at chance through, and the published long-budget verdict on it (the `LONG` preset's row in
    `published`), or that none is published yet. A table at a short budget shows the budget, not
    the layer, until a longer training says otherwise."""
    out = []
    mine = [r for r in rows if r["suite"] == NAME and r["setting"].get("task") == "mqar" and r["preset"] != LONG
            and r["layer"] not in CONTROLS and r["layer"] != BASELINE and "sequences" in r["metrics"]]
    long = {}
    for r in sorted(published, key=lambda r: (r["time"], r["run_id"])):
        if r["suite"] == NAME and r["preset"] == LONG and r["seed"] == 0:
            long[r["layer"]] = r
    for layer in sorted({r["layer"] for r in mine}):
        g = [r for r in mine if r["layer"] == layer]
        if any(r["metrics"]["left_chance_at"] is not None for r in g):
            continue
        line = f"{layer}: at chance through {_count(max(r['metrics']['sequences'] for r in g))} sequences here"
        ref = long.get(layer)
        if ref is None:
            out.append(f"{line}; no long-budget check of it is published yet ({LONG}: docs/toys.md)")
            continue
        m = ref["metrics"]
        verdict = (f"left chance at {_count(m['left_chance_at'])} sequences (test {m['accuracy']:.3f})"
                   if m["left_chance_at"] is not None else f"at chance through {_count(m['sequences'])} sequences")
        lrs = ", ".join(m["val_by_lr"])
        out.append(f"{line}; at the recall preset's 10x budget (lrs {lrs}): {verdict} "
                   f"(leaderboards/README.md, toys — preset {LONG})")
    return out


# ---- rendering -----------------------------------------------------------------------------

ACC = "metrics.acc_by_kv."


def _slices(df) -> list[str]:
    """The acc_by_kv columns that hold a value in df, in numeric order."""
    cols = [c for c in df.columns if c.startswith(ACC) and df[c].notna().any()]
    return sorted(cols, key=lambda c: float(c[len(ACC):]))


def _fmt(vals, ref=None) -> str:
    """'mean ± half' of a 95% t-interval; ▲/▼ where it lies wholly above/below `ref`'s."""
    m, h = mean_ci(vals)
    mark = ""
    if ref is not None and len(vals) > 1:
        rm, rh = mean_ci(ref)
        mark = " ▲" if m - h > rm + rh else " ▼" if m + h < rm - rh else ""
    return f"{m:.3f} ± {h:.3f}{mark}" if len(vals) > 1 else f"{m:.3f}"


def validity(df, task: str) -> list[str]:
    """What makes the harness invalid for `task` (empty: valid): the positive control below the
    target on the easiest slice in some seed, or the negative control above twice chance; with the
    memory the only route (``route: memory``), also any model without fast weights (the backbone
    alone, PKM) above twice chance on some slice: a negative control by construction."""
    d = df[df["setting.task"] == task]
    out = []
    pos, neg = d[d["layer"] == POSITIVE], d[d["layer"] == NEGATIVE]
    if pos.empty or neg.empty:
        missing = " and ".join(c for c, g in ((POSITIVE, pos), (NEGATIVE, neg)) if g.empty)
        return [f"no rows of {missing} (toys.controls off, or the run stopped before them)"]
    easiest = _slices(d)[0]
    for w, g in pos.groupby("setting.d_model"):
        worst = g[easiest].min()
        if worst < 0.99:
            out.append(f"the positive control reaches only {worst:.3f} at {TITLES[task][1]}={easiest[len(ACC):]}, d={w}")
    for w, g in neg.groupby("setting.d_model"):
        acc, chance = g["metrics.accuracy"].mean(), g["metrics.chance"].iloc[0]
        if acc > 2 * chance:
            out.append(f"the negative control is at {acc:.3f}, above twice chance ({chance:.3f}) at d={w}")
    if "setting.route" in d and (d["setting.route"] == "memory").any():
        slow = d[~d["layer"].isin(CONTROLS) & (d["metrics.mem_state"] == 0)]
        for (layer, w), g in slow.groupby(["layer", "setting.d_model"]):
            chance = g["metrics.chance"].iloc[0]
            for c in _slices(d):
                if g[c].mean() > 2 * chance:
                    out.append(f"{layer}, which has no fast weights, recalls {g[c].mean():.3f} at "
                               f"{TITLES[task][1]}={c[len(ACC):]}, d={w}: above twice chance ({chance:.3f}), so the "
                               f"backbone reaches past the memory")
    return out


def _task_table(df, task: str, slice_name: str):
    import pandas as pd

    d = df[df["setting.task"] == task]
    base = d[d["layer"] == BASELINE]
    recs = []
    for layer in layer_order(d["layer"]):
        for w in sorted(d["setting.d_model"].unique()):
            g = d[(d["layer"] == layer) & (d["setting.d_model"] == w)].sort_values("seed")
            if g.empty:
                continue
            b = base[base["setting.d_model"] == w]
            b = None if layer == BASELINE or b.empty else b
            ref = lambda c: None if b is None else list(b[c].dropna())  # noqa: E731
            rec = {"layer": layer, "d_model": int(w), "seeds": len(g)}
            if "preset" in g and d["preset"].nunique() > 1:
                rec["preset"] = g["preset"].iloc[0]
            for c in _slices(d):
                rec[f"{slice_name}={c[len(ACC):]}"] = _fmt(list(g[c].dropna()), ref(c))
            rec["mean"] = _fmt(list(g["metrics.accuracy"]), ref("metrics.accuracy"))
            # seeds whose mean leaves chance (twice chance): a wide interval from seeds that split shows here
            rec["left chance"] = f"{int((g['metrics.accuracy'] > 2 * g['metrics.chance']).sum())}/{len(g)}"
            if "metrics.sequences" in g and g["metrics.sequences"].notna().all():
                rec["left chance at"] = _left_at(g)
                rec["budget (max)"] = f"{_count(g['metrics.sequences'].median())} ({_count(g['metrics.sequences'].max())})"
            else:  # rows of protocol 2 and before kept no validation history
                rec["left chance at"] = ""
                rec["budget (max)"] = (f"{_count(g['metrics.steps'].median() * _batch(g))} "
                                       f"({_count(g['metrics.steps'].max() * _batch(g))})")
            stops = g["metrics.stop"].value_counts()
            rec["stop"] = ", ".join(f"{n} {k}" for k, n in sorted(stops.items()))
            rec["lr"] = _lrs(g)
            if "metrics.left_chance_at_by_lr" in g or any(c.startswith("metrics.left_chance_at_by_lr.") for c in g):
                rec["val by lr (left chance at)"] = _by_lr(g)
            rec["state"] = int(g["metrics.state_size"].iloc[0])
            recs.append(rec)
    return pd.DataFrame(recs)


def _count(n) -> str:
    """A number of sequences, short: 640 / 12.8k / 1.28M."""
    n = float(n)
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def _batch(g) -> int:
    """The training batch of a group's rows (from their config)."""
    return int(g["config.train.batch_size"].iloc[0]) if "config.train.batch_size" in g else 0


def _left_at(g) -> str:
    """When a layer's seeds first left chance on validation, in sequences trained (the median of
    those that did, and how many did); a layer that never did is "at chance through" its budget."""
    at = g["metrics.left_chance_at"].dropna() if "metrics.left_chance_at" in g else []
    if len(at) == 0:
        return f"at chance through {_count(g['metrics.sequences'].max())}"
    return _count(at.median()) + ("" if len(at) == len(g) else f" ({len(at)}/{len(g)} seeds)")


def _lrs(g) -> str:
    """The lrs chosen on validation; "none (at chance)" for a seed at chance at every lr, "(edge)"
    for an lr chosen at the edge of the lrs tried."""
    out = []
    def flag(r, key) -> bool | None:
        v = r.get(key)
        return None if v is None or v != v else bool(v)  # absent, NaN (rows of protocol 2): None

    for _, r in g.iterrows():
        tried = sum(1 for c in g.columns if c.startswith("metrics.val_by_lr.") and r[c] == r[c])  # (not NaN)
        if flag(r, "metrics.lr_chosen") is False:
            out.append("none (at chance)")
        else:
            out.append(f"{r['metrics.lr']:g}" + (" (edge)" if flag(r, "metrics.lr_at_edge") and tried > 1 else ""))
    return ", ".join(sorted(set(out)))


def _by_lr(g) -> str:
    """Each lr tried: its validation accuracy (mean over seeds) and, if it left chance, when (median)."""
    lrs = sorted(float(c[len("metrics.val_by_lr."):]) for c in g.columns
                 if c.startswith("metrics.val_by_lr.") and g[c].notna().any())
    parts = []
    for lr in lrs:
        k = f"{lr:g}"
        val = g[f"metrics.val_by_lr.{k}"].dropna()
        at = g.get(f"metrics.left_chance_at_by_lr.{k}")
        at = at.dropna() if at is not None else []
        parts.append(f"{k}: {val.mean():.3f}" + (f" @ {_count(at.median())}" if len(at) else ""))
    return "; ".join(parts)


TITLES = {"mqar": ("MQAR test accuracy by key-value pairs", "kv"),
          "ar": ("Ba's associative retrieval test accuracy by pairs", "pairs")}
MEMORY_ROUTE = (", the memory the only route (a local backbone; every query lies beyond its reach, so the backbone "
                "alone and PKM are negative controls)")


def incomplete(df) -> tuple:
    """(df without them, {task: ["layer (n of N seeds)", ...]}): the layers and variants of a task
    and width with fewer seeds than the baseline's there, such as a cell whose run was stopped
    between seeds (a resumed run adds the rest). A published cell has every seed; the controls
    stay, since the validity of the harness is judged on each of their seeds."""
    keep, out = df.index == df.index, {}
    for (task, w), d in df.groupby(["setting.task", "setting.d_model"]):
        full = d.loc[d["layer"] == BASELINE, "seed"].nunique()
        for layer, g in d.groupby("layer"):
            n = g["seed"].nunique()
            if layer != BASELINE and layer not in CONTROLS and n < full:
                keep &= ~df.index.isin(g.index)
                out.setdefault(task, []).append(f"{layer} ({n} of {full} seeds)")
    return df[keep], {k: sorted(v) for k, v in out.items()}


def tables(df) -> dict:
    """Per task: test accuracy by slice (mean ± 95% interval over seeds, ▲/▼ against the
    baseline), steps and stops, chosen lr and state size; then the state and parameters per
    model. A task whose controls fail shows the controls only, under a title that says so; a
    layer with fewer seeds than the baseline is left out and named in the title (`incomplete`)."""
    import pandas as pd

    df, partial = incomplete(df)
    out = {}
    for task in [t for t in TASKS if t in set(df["setting.task"])]:
        title, sl = TITLES[task]
        d = df[df["setting.task"] == task]
        if "setting.route" in d and (d["setting.route"] == "memory").any():
            title += MEMORY_ROUTE
        t = _task_table(df, task, sl)
        bad = validity(df, task)
        if bad:
            title = f"HARNESS INVALID for {task} ({'; '.join(bad)}): layer rows withheld; the controls"
            t = t[t["layer"].isin(CONTROLS)]
        elif task in partial:
            title += f" (withheld until every seed has run: {', '.join(partial[task])})"
        out[title] = t.reset_index(drop=True)
    first = df.sort_values("seed").groupby(["layer", "setting.task", "setting.d_model"], as_index=False).first()
    first = first[first["setting.task"] == next(t for t in TASKS if t in set(first["setting.task"]))]
    order = {n: i for i, n in enumerate(layer_order(first["layer"]))}
    first = first.assign(_k=first["layer"].map(order)).sort_values(["_k", "setting.d_model"])
    out["Recurrent state per sequence (numbers) and parameters"] = pd.DataFrame({
        "layer": first["layer"].values,
        "d_model": first["setting.d_model"].astype(int).values,
        "GDN state": first["metrics.gdn_state"].astype(int).values,
        "KV cache": first.get("metrics.kv_cache", pd.Series(0, index=first.index)).fillna(0).astype(int).values,
        "memory state": first["metrics.mem_state"].astype(int).values,
        "total": first["metrics.state_size"].astype(int).values,
        "memory shared by the batch": first["metrics.state_shared"].map(lambda x: "yes" if x else "no").values,
        f"params ({first['setting.task'].iloc[0]})": first["metrics.params"].astype(int).values,
        "train tokens/s": first["metrics.tokens_per_s"].astype(int).values,
    })
    return out


def _within_unit(stats) -> list[list[float]]:
    """Error bars of (mean, half-width) pairs as matplotlib's [below, above], cut at 0 and 1: an
    accuracy's t-interval over a few erratic seeds can reach past both."""
    return [[min(h, m) for m, h in stats], [min(h, 1 - m) for m, h in stats]]


def _curves(m, order, palette, widths, path: Path) -> Path:
    """Validation accuracy (the slices' mean) against sequences trained, log x: a line per seed of
    each model (its chosen lr's training), twice chance dotted; a panel per width."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(widths), figsize=(4.8 * len(widths) + 1.4, 4), sharey=True, squeeze=False)
    for ax, w in zip(axes[0], widths):
        chance = None
        for layer in order:
            g = m[(m["layer"] == layer) & (m["setting.d_model"] == w)].sort_values("seed")
            label = layer
            for _, r in g.iterrows():
                hist = r["metrics.history"]
                if not isinstance(hist, list) or not hist:
                    continue
                ax.plot([h["sequences"] for h in hist], [h["val"] for h in hist], color=palette[layer], lw=1, alpha=0.8,
                        linestyle="--" if layer in CONTROLS else "-", label=label)
                label, chance = None, r["metrics.chance"]
        if chance is not None:
            ax.axhline(2 * chance, color="grey", lw=0.6, ls=":")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("sequences trained (log scale)")
        ax.set_title(f"MQAR validation, d_model={w}")
    axes[0][0].set_ylabel("validation accuracy (mean over kv; a line per seed)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    return save_png(fig, path)


def figures(df, out_dir: Path) -> list[Path]:
    """toys_mqar_capacity.png: MQAR test accuracy against kv pairs, a line per model with its
    95% interval (cut at 0 and 1) and a cross per seed, a panel per width. toys_mqar_state.png:
    mean accuracy against the recurrent state per sequence (a point per width, a dotted line
    through a layer's size variants such as ``fwpkm/token`` and ``fwpkm/token-small``; the
    attention control's state is its KV cache; a model without state, ctrl:none, has no place on
    its log axis). toys_mqar_curves.png: the learning curves (`_curves`), where the rows keep them. A
task whose controls fail is not drawn, nor a layer with fewer seeds than the baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    df = incomplete(df)[0]
    m = df[df["setting.task"] == "mqar"]
    if m.empty or validity(df, "mqar"):
        return []
    order = layer_order(m["layer"])
    palette = dict(zip(order, sns.color_palette("tab10" if len(order) <= 10 else "tab20", len(order))))  # no colour twice
    widths = sorted(int(w) for w in m["setting.d_model"].unique())
    kvs = [int(c[len(ACC):]) for c in _slices(m)]
    paths = []

    fig, axes = plt.subplots(1, len(widths), figsize=(4.8 * len(widths) + 1.4, 4), sharey=True, squeeze=False)
    for ax, w in zip(axes[0], widths):
        for i, layer in enumerate(order):
            g = m[(m["layer"] == layer) & (m["setting.d_model"] == w)]
            if g.empty:
                continue
            xs = [k * 2 ** (0.05 * (i - (len(order) - 1) / 2)) for k in kvs]  # dodged, so that bars do not hide each other
            stats = [mean_ci(list(g[f"{ACC}{k}"].dropna())) for k in kvs]
            ax.errorbar(xs, [a for a, _ in stats], yerr=_within_unit(stats), label=layer, marker="o", capsize=3,
                        color=palette[layer], linestyle="--" if layer in CONTROLS else "-")
            for _, r in g.sort_values("seed").iterrows():  # each seed: erratic seeds make wide intervals
                ax.scatter(xs, [r[f"{ACC}{k}"] for k in kvs], s=16, marker="x", alpha=0.6, color=palette[layer],
                           linewidths=1)
        ax.axhline(0.5, color="grey", lw=0.6, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(kvs, [str(k) for k in kvs])
        ax.minorticks_off()
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("key-value pairs")
        ax.set_title(f"MQAR, d_model={w}")
    axes[0][0].set_ylabel("test accuracy (mean, 95% interval; x: seeds)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))  # outside: no point hidden
    fig.tight_layout()
    paths.append(save_png(fig, Path(out_dir) / "toys_mqar_capacity.png"))

    if "metrics.history" in m and m["metrics.history"].notna().any():
        paths.append(_curves(m, order, palette, widths, Path(out_dir) / "toys_mqar_curves.png"))

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for layer in order:
        g = m[(m["layer"] == layer) & (m["metrics.state_size"] > 0)]  # no state (ctrl:none): off a log axis
        pts = []
        for w in widths:
            gw = g[g["setting.d_model"] == w]
            if not gw.empty:
                pts.append((float(gw["metrics.state_size"].iloc[0]), *mean_ci(list(gw["metrics.accuracy"])), w))
        if pts:
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=_within_unit([p[1:3] for p in pts]), label=layer,
                        marker="o", capsize=3, color=palette[layer], linestyle="--" if layer in CONTROLS else "-")
            for x, y, _, w in pts:
                ax.annotate(f"d={w}", (x, y), xytext=(4, -10), textcoords="offset points", fontsize=7,
                            color=palette[layer])
    sizes: dict[str, list] = {}  # a layer's size variants (fwpkm/token, fwpkm/token-small): one curve
    for layer in order:
        g = m[(m["layer"] == layer) & (m["metrics.state_size"] > 0)]
        if not g.empty and layer not in CONTROLS:
            sizes.setdefault(layer.split("-")[0], []).append(
                (float(g["metrics.state_size"].max()), float(g["metrics.accuracy"].mean()), layer))
    for base, pts in sizes.items():
        if len(pts) > 1:
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=palette[pts[-1][2]], lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("recurrent state per sequence (numbers, log scale)")
    ax.set_ylabel("MQAR test accuracy (mean over kv counts)")
    ax.set_title("MQAR accuracy against state size")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(save_png(fig, Path(out_dir) / "toys_mqar_state.png"))
    return paths
