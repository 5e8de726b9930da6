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
moves its fast weights ~1e-4 of a read, so it learns the pairs slowly: at a small lr and beyond the
recall preset's budget (``recall-10x-seeds``). ``fwpkm/token`` peaks early and then wears down (its
addressing loss moves the sub-keys it wrote under); a row reads the peak. FWL's features (width and
hidden) outnumber the 32 key tokens at width 64, so it holds every pair; its curve falls at a narrow
state (``fwl/narrow``, width 8). The measurements: docs/journal/toys.md.

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
   grid. A cell at chance at every lr of its grid first tries one lr past each edge, since the lr
   that trains within the budget may lie outside the grid (docs/journal/toys.md, "A grid at chance tries
   past both edges"); at chance there too, it chooses none. Only then are the test sets scored.
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
memzoo.bench.report.reruns DIR`` reads a rerun beside the published rows. Why each choice,
with its measurements: docs/journal/toys.md; speed: docs/journal/performance.md.
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
    BASELINE, CONTROLS, POSITIVE, Context, check_backbone, check_variants, config_hash, model_config,
)
from memzoo.bench.schema import TOYS_TASKS, slice_order  # noqa: F401  (slice_order: the suite's name for it)
from memzoo.config import ConfigError, ModelConfig, TrainConfig
from memzoo.data import assoc_retrieval as ar
from memzoo.data import mqar
from memzoo.registry import get_layer
from memzoo.storage import torch_save
from memzoo.train import fit, lr_at, make_step, param_groups

NAME = "toys"
TASKS = TOYS_TASKS

# shown under the suite's tables in the leaderboard


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
    # why a layer's lrs are what they are, shown beside its row ("lr from"): e.g. the published row
    # whose validation chose it; "*": the layers given `lrs`; otherwise "chosen on validation" (a grid)
    # or "one lr given"
    lr_from: dict = field(default_factory=dict)
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
    # MQAR at several lengths, as Zoology trains it: [seq_len, kv] slices (each evaluated on its own; a
    # training batch holds one length, the lengths in turn, its kv counts in equal parts); empty: the
    # mqar_kv counts at mqar_seq_len
    mqar_slices: list = field(default_factory=list)
    batch_by_length: dict = field(default_factory=dict)  # {seq_len: batch} over batch_size: long sequences, smaller batches
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
        self._check_slices()
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
        if any(not isinstance(w, int) or w < 1 for w in self.widths):
            raise ConfigError(f"toys.widths must be positive integers, got {self.widths}")
        check_variants(self.variants, "toys.variants", ("layer", "options", "at", "widths"))
        for name, v in self.variants.items():
            if "widths" in v and (not v["widths"] or any(not isinstance(w, int) or w < 1 for w in v["widths"])):
                raise ConfigError(f"toys.variants.{name}.widths must be positive integers, got {v['widths']!r}")
        valid_lrs = [BASELINE, *CONTROLS, *layer_names(), *self.variants]
        for name, valid in (("layer_options", layer_names()), ("layer_lrs", valid_lrs), ("lr_from", [*valid_lrs, "*"])):
            unknown = sorted(set(getattr(self, name)) - set(valid))
            if unknown:
                raise ConfigError(f"toys.{name}: unknown layer(s) {unknown}; valid: {', '.join(valid)}")
        if any(not lrs for lrs in self.layer_lrs.values()):
            raise ConfigError("toys.layer_lrs: every layer needs at least one learning rate")
        if any(not isinstance(lr, (int, float)) or not 0 < lr < 1 for lr in [*self.lrs, *sum(self.layer_lrs.values(), [])]):
            raise ConfigError(f"toys.lrs and layer_lrs must be numbers in (0, 1), got {self.lrs} {self.layer_lrs}")
        check_backbone(self.model, "toys.model")

    def _check_slices(self) -> None:
        if not isinstance(self.mqar_slices, list) or not isinstance(self.batch_by_length, dict):
            raise ConfigError(f"toys.mqar_slices must be a list of [seq_len, kv] and toys.batch_by_length a mapping, got "
                              f"{self.mqar_slices!r} and {self.batch_by_length!r}")
        for sl in self.mqar_slices:
            if not (isinstance(sl, (list, tuple)) and len(sl) == 2 and all(isinstance(v, int) for v in sl)):
                raise ConfigError(f"toys.mqar_slices: each slice is [seq_len, kv], got {sl!r}")
            try:
                mqar.check_sizes(sl[1], sl[0], self.mqar_vocab, self.mqar_gap)
            except ValueError as e:
                raise ConfigError(f"toys.mqar_slices: {list(sl)}: {e}") from None
        if len({tuple(sl) for sl in self.mqar_slices}) < len(self.mqar_slices):
            raise ConfigError(f"toys.mqar_slices: a slice is given twice in {self.mqar_slices}")
        lengths = {sl[0] for sl in self.mqar_slices} or {self.mqar_seq_len}
        for length, b in self.batch_by_length.items():
            if length not in lengths or not isinstance(b, int) or b < 1:
                raise ConfigError(f"toys.batch_by_length: {length}: {b!r}: a length of toys.mqar_slices "
                                  f"({', '.join(map(str, sorted(lengths)))}) and a batch >= 1")
        for length in lengths:
            kvs = [n for n_len, n in self.mqar_slices if n_len == length] or self.mqar_kv
            if "mqar" in self.tasks and self.batch_of(length) < len(kvs):
                raise ConfigError(f"toys: a batch of {self.batch_of(length)} sequences of {length} tokens cannot hold one "
                                  f"of each of its {len(kvs)} kv counts")

    def batch_of(self, seq_len: int) -> int:
        """Training (and evaluation) batch of sequences of `seq_len` tokens."""
        return self.batch_by_length.get(seq_len, self.batch_size)

    def candidates(self, layer: str) -> list[float]:
        return list(self.layer_lrs.get(layer, self.lrs))

    def origin(self, layer: str) -> str:
        """Where a layer's lr comes from (`lr_from`), else how it was chosen."""
        n = len(self.candidates(layer))
        given = self.lr_from.get(layer) or (self.lr_from.get("*") if layer not in self.layer_lrs else None)
        return given or (f"chosen on validation among {n}" if n > 1 else "one lr given")

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


def slice_name(key) -> str:
    """A slice's name in a row: its kv count or pairs ("8"), or kv count and length ("32@256")."""
    return f"{key[1]}@{key[0]}" if isinstance(key, tuple) else str(key)


class Task:
    """A toys task: training batches (a pure function of the generator), and the validation and
    test sets of each slice, from generators of their own. One class per task (`TASK_TYPES`, by
    name); the suite asks a task, it never branches on the task's name. A subclass gives ``name``,
    ``vocab_of(s)``, ``mean_length(s)``, ``data(s)`` (what a row's config records of it), and sets
    ``slices``, ``lengths``, ``seq_len`` and ``chance`` before calling this ``__init__``, with
    ``_make`` (a set of sequences) and ``batch`` (a training batch)."""

    name: str = ""
    slices: list
    lengths: list  # the training lengths, in turn (one length: [None])

    def __init__(self, s: Settings):
        self.s, self.vocab = s, self.vocab_of(s)
        self.val = {k: self._make(s.val_size, k, torch.Generator().manual_seed(7_919 + self._offset(k))) for k in self.slices}
        self.test = {k: self._make(s.test_size, k, torch.Generator().manual_seed(10_007 + self._offset(k)))
                     for k in self.slices}

    @staticmethod
    def _offset(key) -> int:
        return key[1] + 1_000 * key[0] if isinstance(key, tuple) else key

    def eval_batch(self, key) -> int:
        """The batch a slice is evaluated in: its length's training batch."""
        return self.s.batch_of(key[0]) if isinstance(key, tuple) else self.s.batch_size

    def sequences(self, steps: int) -> int:
        """Training sequences in the first `steps` steps."""
        if self.lengths == [None]:
            return steps * self.s.batch_size
        per = [self.s.batch_of(n) for n in self.lengths]
        full, part = divmod(steps, len(per))
        return full * sum(per) + sum(per[:part])


class MQAR(Task):
    """Multi-query associative recall (Zoology): each slice a kv count (with ``mqar_slices``,
    (seq_len, kv)); a training batch mixes every kv count of its length in equal parts."""

    name = "mqar"

    @staticmethod
    def vocab_of(s: Settings) -> int:
        return s.mqar_vocab

    @staticmethod
    def mean_length(s: Settings) -> float:
        """Tokens per training sequence, on average over the steps (with several lengths, weighted
        by their batches, in sequences of ``batch_size``)."""
        if not s.mqar_slices:
            return s.mqar_seq_len
        lengths = sorted({sl[0] for sl in s.mqar_slices})
        return sum(n * s.batch_of(n) for n in lengths) / len(lengths) / s.batch_size

    @staticmethod
    def data(s: Settings) -> dict:
        if s.mqar_slices:  # several lengths: the slices and their batches replace seq_len and kv
            return {"vocab": s.mqar_vocab, "slices": [list(sl) for sl in s.mqar_slices], "power_a": s.power_a,
                    "gap": s.mqar_gap, "batch_by_length": {str(k): v for k, v in sorted(s.batch_by_length.items())}}
        return {"vocab": s.mqar_vocab, "seq_len": s.mqar_seq_len, "kv": s.mqar_kv, "power_a": s.power_a, "gap": s.mqar_gap}

    def __init__(self, s: Settings):
        several = bool(s.mqar_slices)
        self.slices = [tuple(sl) for sl in s.mqar_slices] if several else list(s.mqar_kv)
        self.lengths = sorted({sl[0] for sl in self.slices}) if several else [None]
        self.seq_len = max(self.lengths) if several else s.mqar_seq_len
        self.chance = 2 / s.mqar_vocab
        super().__init__(s)

    def _make(self, size: int, key, g: torch.Generator):
        s = self.s
        length, n = key if isinstance(key, tuple) else (s.mqar_seq_len, key)
        return tuple(mqar.make_batch(size, n, length, s.mqar_vocab, s.power_a, g, gap=s.mqar_gap))

    def batch(self, step: int, g: torch.Generator):
        s = self.s
        if self.lengths == [None]:  # every kv count in each batch
            return tuple(mqar.mixed_batch(s.batch_size, self.slices, s.mqar_seq_len, s.mqar_vocab, s.power_a, g,
                                          gap=s.mqar_gap))
        length = self.lengths[step % len(self.lengths)]  # one length a step, in turn; its kv counts in each batch
        kvs = [n for n_len, n in self.slices if n_len == length]
        return tuple(mqar.mixed_batch(s.batch_of(length), kvs, length, s.mqar_vocab, s.power_a, g, gap=s.mqar_gap))


class AssocRetrieval(Task):
    """Ba et al.'s associative retrieval (``c9k8j3f1??c -> 9``): each slice a count of pairs, the
    answer the prediction at the last position; a training batch holds one count, in turn."""

    name = "ar"

    @staticmethod
    def vocab_of(s: Settings) -> int:
        return ar.VOCAB_SIZE

    @staticmethod
    def mean_length(s: Settings) -> float:
        return sum(2 * n + 3 for n in s.ar_pairs) / len(s.ar_pairs)

    @staticmethod
    def data(s: Settings) -> dict:
        return {"pairs": s.ar_pairs}

    def __init__(self, s: Settings):
        self.slices, self.lengths = list(s.ar_pairs), [None]
        self.seq_len = 2 * max(self.slices) + 3
        self.chance = 1 / 10
        super().__init__(s)

    def _make(self, size: int, key, g: torch.Generator):
        b = ar.make_batch(size, key, g)
        t = torch.full_like(b.tokens, mqar.IGNORE)
        t[:, -1] = b.answer
        return b.tokens, t

    def batch(self, step: int, g: torch.Generator):
        return self._make(self.s.batch_size, self.slices[step % len(self.slices)], g)  # lengths differ: cycle


#: the tasks by name (`Settings.tasks`, a row's ``setting.task``)
TASK_TYPES = {t.name: t for t in (MQAR, AssocRetrieval)}
assert tuple(TASK_TYPES) == TASKS


# ---- training and evaluation ---------------------------------------------------------------


@torch.no_grad()
def evaluate(model: HybridLM, sets: dict, batch_size) -> dict:
    """Accuracy on the labelled positions of each set, in batches of the training batch size
    (an int, or a function of the set's key), each batch starting from the model's persistent
    fast weights as they are now (restored after)."""
    was = model.training
    model.eval()
    start = model.memory_state(persistent_only=True)
    dev = model.embed.weight.device
    out = {}
    for n, (x, y) in sets.items():
        hits = total = 0
        bs = batch_size(n) if callable(batch_size) else batch_size
        for i in range(0, len(x), bs):
            model.load_memory_state(start)
            xc, yc = x[i : i + bs].to(dev), y[i : i + bs].to(dev)
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
    best, best_state, stale, start = -1.0, None, 0, 0
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

    def one_step(i: int) -> float:
        nonlocal tokens, busy, first
        x, y = (t.to(device) for t in task.batch(i, g))  # drawn on the CPU: the same data anywhere
        t0 = time.perf_counter()
        loss = train_step([(x, y)], lr_at(i, tc))
        if x.shape in shapes:  # the first step of each shape compiles (with `compile`): not in the throughput
            busy += time.perf_counter() - t0
            tokens += x.numel()
        else:
            first += time.perf_counter() - t0
        shapes.add(x.shape)
        losses.append(loss)
        return loss

    def after_step(n: int, loss: float) -> str | None:
        if on_step is not None:
            on_step()
        return None if math.isfinite(loss) else "diverged"

    def validate(n: int) -> str | None:
        nonlocal evals, best, best_state, stale
        t0 = time.perf_counter()
        acc = evaluate(model, task.val, task.eval_batch)
        evals += time.perf_counter() - t0
        val = sum(acc.values()) / len(acc)
        tail = losses[-s.eval_every:]
        history.append({"step": n, "sequences": task.sequences(n), "val": round(val, 4),
                        "by_slice": {slice_name(k): round(a, 4) for k, a in acc.items()},
                        "train_loss": round(sum(tail) / len(tail), 4)})
        stale = 0 if val >= best + s.min_delta else stale + 1
        if val > best:
            best, best_state = val, copy.deepcopy(model.state_dict())
        if solved(acc, s):
            return "solved"
        if n < s.max_steps and stale >= s.patience and n >= s.min_steps and not falling(losses, s):
            return "chance" if best <= 2 * task.chance else "plateau"  # at chance: the flat phase may go on
        return None

    def end_step(n: int, evaluated: bool) -> None:
        nonlocal saved
        if checkpoint is not None and evaluated and n < s.max_steps and time.monotonic() - saved > CHECKPOINT_EVERY_S:
            torch_save({"model": model.state_dict(), "opt": opt.state_dict(), "generator": g.get_state(),
                        "rng": torch.get_rng_state(), "best": best, "best_state": best_state, "stale": stale, "step": n,
                        "losses": losses, "history": history}, checkpoint)
            saved = time.monotonic()

    model.train()
    steps, stop = fit(one_step, s.max_steps, start=start, every=s.eval_every, after_step=after_step, evaluate=validate,
                      end_step=end_step)
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)
    if best_state is not None:
        model.load_state_dict(best_state)
    tail = losses[-s.eval_every:]
    return Fit(model, max(best, 0.0), steps, stop or "capped", sum(tail) / len(tail), tokens / max(busy, 1e-9), first,
               evals, history)

def left_chance_at(history: list[dict], chance: float) -> int | None:
    """Sequences trained before the first evaluation whose validation accuracy (the slices' mean)
    is above twice chance; None if none is."""
    return next((h["sequences"] for h in history if h["val"] > 2 * chance), None)


def solved(acc: dict[int, float], s: Settings) -> bool:
    """Whether validation accuracies by slice reach the target: their mean, or each of them."""
    return (min(acc.values()) if s.solve_on == "every" else sum(acc.values()) / len(acc)) >= s.target


def cell_config(mc: ModelConfig, task: str, s: Settings, layer: str) -> dict:
    """Everything one cell's numbers depend on (its hash decides whether a resumed run skips it)."""
    data = TASK_TYPES[task].data(s)
    keep = ("max_steps", "min_steps", "eval_every", "patience", "min_delta", "loss_delta", "target", "batch_size", "warmup",
            "min_lr_ratio", "weight_decay", "grad_clip", "precision", "compile", "val_size", "test_size", "solve_on")
    train = {k: getattr(s, k) for k in keep}
    config = {"model": mc.to_dict(), "task": task, "data": data, "lrs": s.candidates(layer), "train": train,
              "optimizer": "AdamW(0.9, 0.98), warmup + cosine", "version": 3,
              # 3: no plateau stop while the loss falls; an lr chosen at the grid's edge tries the next beyond it
              "lr_beyond_edge": MAX_BEYOND}
    if len(s.candidates(layer)) > 1:  # a grid at chance at every lr tries one lr past each edge (`search`);
        config["lr_beyond_chance"] = 1  # one lr given is never extended, so its config (and hash) has no such key
    if any(get_layer(name).needs_targets for name in mc.memory):  # FWL learns from the next tokens, not the
        config["memory_targets"] = "next"  # task's labels (HybridLM.forward)
    return config


def cell_key(ctx: Context, s: Settings, name: str, task: str, width: int, seed: int) -> tuple:
    """(model config, config, setting, the row already recorded or None) of one cell."""
    mc = toy_config(ctx.preset, name, width, TASK_TYPES[task].vocab_of(s), s)
    check_route(mc, name, s)
    config, setting = cell_config(mc, task, s, name), {"task": task, "d_model": width, "route": s.route}
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
    tokens = {t: TASK_TYPES[t].mean_length(s) for t in s.tasks}
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
            tasks[tname] = TASK_TYPES[tname](s)
        rows.append(_cell(ctx, name, tasks[tname], width, mc, config, setting, s, seed))
    return rows


def lr_grid(fits: dict) -> tuple[float, bool]:
    """(the lr chosen on validation, whether it lies at an edge of the lrs tried): the best
    validation score (ties: the first tried); an edge is the smallest or largest lr tried."""
    lr = max(fits, key=lambda k: fits[k].val)
    return lr, lr in (min(fits), max(fits))


def beyond(lr: float, fits: dict) -> float:
    """The next lr past the edge `lr` of the grid: a third of the smallest, or three times the largest."""
    return round(lr / 3 if lr == min(fits) else lr * 3, 12)


def at_chance(fits: dict, chance: float) -> bool:
    """Whether no lr tried left chance (its best validation score within twice chance)."""
    return all(f.val <= 2 * chance for f in fits.values())


#: how many lrs past an edge a cell tries before it records its choice at the edge
MAX_BEYOND = 2


def search(lrs: list[float], fit_at, chance: float) -> dict:
    """{lr: Fit} of the lrs a cell trains, `fit_at(lr)` training one: every lr of the grid; if none
    left chance, one past each edge (the lr that trains within the budget may lie outside the
    grid); then, while the chosen lr lies at an edge of the lrs tried and left chance, the next lr
    past it, at most MAX_BEYOND times (a better one may lie beyond it). One lr given is a choice,
    not a grid: it is never extended."""
    fits = {lr: fit_at(lr) for lr in lrs}
    if len(fits) > 1 and at_chance(fits, chance):
        for nxt in [beyond(min(fits), fits), beyond(max(fits), fits)]:
            fits[nxt] = fit_at(nxt)
    lr, edge = lr_grid(fits)
    extra = 0
    while edge and len(fits) > 1 and fits[lr].val > 2 * chance and extra < MAX_BEYOND:
        nxt = beyond(lr, fits)
        fits[nxt] = fit_at(nxt)
        extra += 1
        lr, edge = lr_grid(fits)
    return fits


def _cell(ctx: Context, layer: str, task: Task, width: int, mc, config: dict, setting: dict, s: Settings,
          seed: int) -> dict:
    """Every lr `search` asks for; a cell at chance at every lr it tried chooses none (`lr` is the
    best of noise). Under the work dir, each lr's finished training is kept until the row is recorded and the
    one in progress is checkpointed (`train_cell`), so a stopped cell continues where it stopped."""
    t0 = time.perf_counter()
    ckpt_dir = ctx.work_dir / "cells"
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    stem = f"{config_hash(config)}-{layer.replace('/', '_').replace(':', '_')}-s{seed}"

    def fit_at(lr: float) -> Fit:
        doing = f"toys {layer} {task.name} d={width} seed {seed} lr={lr:g}"
        done = ckpt_dir / f"{stem}-lr{lr:g}.done.pt"  # an lr this cell trained already (a resumed cell skips it)
        if done.is_file():
            d = torch.load(done, map_location=ctx.device, weights_only=False)
            model = HybridLM(mc).to(ctx.device)
            model.load_state_dict(d.pop("model"))
            fit = Fit(model, **d)
        else:
            fit = train_cell(mc, task, lr, s, seed, ctx.device, lambda d=doing: ctx.advance(1, d),
                             ckpt_dir / f"{stem}-lr{lr:g}.pt")
            torch_save({"model": fit.model.state_dict(), **{k: v for k, v in vars(fit).items() if k != "model"}}, done)
        ctx.advance(s.max_steps - fit.steps, doing)  # the steps an early stop saved
        return fit

    fits = search(s.candidates(layer), fit_at, task.chance)
    lr, edge = lr_grid(fits)
    fit = fits[lr]
    none_left = at_chance(fits, task.chance)
    t_test = time.perf_counter()
    acc = evaluate(fit.model, task.test, task.eval_batch)
    t_test = time.perf_counter() - t_test
    x, y = task.test[task.slices[0]]
    with torch.no_grad():  # a forward, so that every memory holds its state
        fit.model.eval()(x[:2].to(ctx.device), targets=y[:2].to(ctx.device))
    left = {f"{k:g}": left_chance_at(f.history, task.chance) for k, f in fits.items()}
    metrics = {
        "accuracy": round(sum(acc.values()) / len(acc), 4),
        "acc_by_kv": {slice_name(n): round(a, 4) for n, a in acc.items()},
        "val_accuracy": round(fit.val, 4),
        "lr": lr,
        "lr_from": s.origin(layer),
        "lr_chosen": not none_left,  # at chance at every lr: no lr is chosen (the best of noise is kept)
        "lr_at_edge": edge and len(fits) > 1 and not none_left,  # one lr given: a choice, not a grid
        "val_by_lr": {f"{k:g}": round(f.val, 4) for k, f in sorted(fits.items())},
        "steps": fit.steps,
        "sequences": task.sequences(fit.steps),  # the budget the chosen lr's training used
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
    for done in ckpt_dir.glob(f"{stem}-lr*.done.pt"):  # the row holds them now
        done.unlink()
    if ctx.progress:
        left_at = metrics["left_chance_at"]
        tqdm.write(f"toys {layer:>14} {task.name:>4} d={width:<4} seed {seed}: test {metrics['accuracy']:.3f} "
                   f"(val {fit.val:.3f}, lr {lr:g}, {fit.steps} steps, {fit.stop}; "
                   + (f"left chance at {left_at} sequences)" if left_at else f"at chance through {task.sequences(fit.steps)} sequences)"))
    return row
