"""The toys suite's settings: one dataclass, its checks, and the options the suite gives the layers."""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass, field

from memzoo.bench.common import BASELINE, CONTROLS, check_backbone, check_variants, load_preset, published_rows
from memzoo.bench.schema import TOYS_TASKS
from memzoo.config import ConfigError
from memzoo.data import assoc_retrieval as ar
from memzoo.data import mqar

from .lr import around, most_chosen, published_choice

NAME = "toys"
TASKS = TOYS_TASKS


@functools.cache
def route_of(preset: str) -> str:
    """The toys route of a preset (`Settings.route`)."""
    return load_preset(preset).settings(NAME, Settings).route


#: AdamW's betas in every toys training: Zoology's (they are in each cell's config, and so in its hash)
BETAS = (0.9, 0.98)

#: layers whose `chunk_size` is not a read-then-write chunk: FWL reads the earlier positions of its
#: own chunk (Eq. 2); its chunk is the segment after which its update decays (the suite's docstring)
SEGMENTED = ("fwl",)


def _toy_layer_options() -> dict:
    """The options the toys give the layers over the preset's, one rule for every layer: update chunks
    of 8 tokens (four pairs) for every chunk-level read-then-write layer (a registered layer whose
    constructor takes a `chunk_size`, that does not read its own token's write, not `inclusive`, and is
    not in SEGMENTED), and FwPKM and FwMLP with a memory per sequence (in-context recall; the paper trains
    them shared by the batch); then each layer's `toys` column of zoo_configs/sizes.yaml over that (what
    the toys change for that layer alone)."""
    from memzoo.config import layer_sizes
    from memzoo.registry import get_layer, layer_names

    out = {n: {"chunk_size": 8} for n in layer_names() if n not in SEGMENTED
           and "chunk_size" in inspect.signature(get_layer(n)).parameters and not get_layer(n).inclusive}
    for n in ("fwpkm", "fwmlp"):
        if n in out:
            out[n]["per_sequence"] = True
    for n, options in layer_sizes("toys").items():
        if options:
            out[n] = {**out.get(n, {}), **options}
    return out


@dataclass
class Settings:
    tasks: list = field(default_factory=lambda: ["mqar"])
    widths: list = field(default_factory=lambda: [64])  # d_model of each model; >= 2 for a state curve
    n_layers: int = 2
    # where the memory goes in every toy model ("last" = block 1 of 2): the toys' own rule, never the preset's
    # placement (`at` of zoo_configs/sizes.yaml places it in the preset's deeper backbone); a variant's `at` over it
    at: str = "last"
    # backbone fields over the preset's (gdn_head_dim: fixed); by default local mixers (route: memory)
    model: dict = field(default_factory=lambda: {"gdn_chunk": 16, "layout": "SWA", "window": 4})
    # per layer, options over the preset's: a preset's merged key by key over `_toy_layer_options()`'s
    layer_options: dict = field(default_factory=dict)
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
    # the state sweep (recall-state.yaml): a model's smaller states, {model: {size: {options: {...}, widths: [...]}}},
    # each run as the variant MODEL/SIZE of the model's layer (a variant's own options under the size's)
    sizes: dict = field(default_factory=dict)
    # a preset whose published choice of a model's lr centres its sizes' lrs: [c / 3, c, 3c] (`lr.around`)
    lrs_around: str = ""
    # presets whose rows of the same cell (config hash, layer, setting, seed) count as recorded here
    reuse: list = field(default_factory=list)
    # presets whose published choice of a model's lr is its one lr here, the first that has one (a long-budget
    # check at the lr a shorter budget chose: recall-state-10x.yaml; the main job: tiny.yaml); a model that none
    # of them chose one for takes the lr the first of them chose most often (`lr.most_chosen`), else `lrs`
    lr_of: list = field(default_factory=list)
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

    def __post_init__(self) -> None:
        if not isinstance(self.layer_options, dict) or not all(isinstance(v, dict) for v in self.layer_options.values()):
            raise ConfigError(f"toys.layer_options must be a mapping {{layer: {{option: value}}}}, got {self.layer_options!r}")
        rule = _toy_layer_options()
        self.layer_options = {n: {**rule.get(n, {}), **self.layer_options.get(n, {})} for n in {**rule, **self.layer_options}}
        self.variants = {**self.variants, **self._sized()}

    def _sized(self) -> dict:
        """The variants MODEL/SIZE of `sizes`: the model's layer, its placement and options, the size's over them."""
        from memzoo.registry import layer_names

        if not isinstance(self.sizes, dict):
            raise ConfigError(f"toys.sizes must be a mapping {{model: {{size: {{options: ..., widths: ...}}}}}}, got {self.sizes!r}")
        out = {}
        for model, sizes in self.sizes.items():
            base = self.variants.get(model) or ({"layer": model} if model in layer_names() else None)
            if base is None or not isinstance(sizes, dict) or not sizes:
                raise ConfigError(f"toys.sizes.{model}: a registered layer or a variant, with a mapping of sizes; "
                                  f"valid: {', '.join([*layer_names(), *self.variants])}")
            for size, spec in sizes.items():
                if not isinstance(spec, dict) or set(spec) - {"options", "widths"}:
                    raise ConfigError(f"toys.sizes.{model}.{size} must be {{options: ..., widths: ...}}, got {spec!r}")
                out[f"{model}/{size}"] = {**base, **({"widths": spec["widths"]} if "widths" in spec else {}),
                                          "options": {**base.get("options", {}), **spec.get("options", {})}}
        return out

    def size_of(self, model: str) -> tuple[str, str] | None:
        """(the model, the size) of a variant of `sizes`, else None."""
        head, _, size = model.rpartition("/")
        return (head, size) if size in self.sizes.get(head, {}) else None

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
        if layer in self.layer_lrs:
            return list(self.layer_lrs[layer])
        if (chosen := self._chosen(layer)) is not None:
            return [chosen[1]]
        if (common := self._most_chosen(layer)) is not None:
            return [common[1]]
        centre = self._centre(layer)
        return around(centre) if centre else list(self.lrs)

    def _borrows(self, layer: str) -> bool:
        """Whether `layer` takes its lr from `lr_of`'s rows: a memory does; the baseline and the controls only
        from presets of this preset's route, since what they train is the backbone, which the route sets."""
        return layer not in (BASELINE, *CONTROLS) or all(route_of(p) == self.route for p in self.lr_of)

    def _most_chosen(self, layer: str) -> tuple[str, float] | None:
        """(the preset, its lr chosen most often) of the first preset of `lr_of` that chose any, for a
        `layer` that takes its lr from there."""
        if not self._borrows(layer):
            return None
        if self.lr_of and published_rows() is None:
            warnings.warn(f"toys.lr_of {self.lr_of}: no leaderboards/results.jsonl in the working directory, so no "
                          f"published lr to look up: every layer takes toys.lrs {self.lrs} (run from the memzoo checkout)",
                          stacklevel=2)
        return next(((p, lr) for p in self.lr_of if (lr := most_chosen(p)) is not None), None)

    def _chosen(self, layer: str) -> tuple[str, float] | None:
        """(the preset, its published lr) of `lr_of` that chose the model's lr, if any."""
        if not self._borrows(layer):
            return None
        return next(((p, lr) for p in self.lr_of if (lr := published_choice(p, layer)) is not None), None)

    def _centre(self, layer: str) -> float | None:
        """The published lr that centres a size's lrs (`lrs_around`), if any."""
        sized = self.size_of(layer)
        return published_choice(self.lrs_around, sized[0]) if sized and self.lrs_around else None

    def origin(self, layer: str) -> str:
        """Where a layer's lr comes from (`lr_from`), else how it was chosen."""
        n = len(self.candidates(layer))
        if layer not in self.layer_lrs and (chosen := self._chosen(layer)):
            return f"the lr {chosen[0]}'s rows chose ({chosen[1]:g})"
        if layer not in self.layer_lrs and (common := self._most_chosen(layer)):
            return f"the lr {common[0]}'s rows chose most often ({common[1]:g}; none chose one for {layer})"
        if layer not in self.layer_lrs and (centre := self._centre(layer)):
            return f"chosen on validation among {n} around {self.lrs_around}'s {centre:g} ({self.size_of(layer)[0]})"
        given = self.lr_from.get(layer) or (self.lr_from.get("*") if layer not in self.layer_lrs else None)
        return given or (f"chosen on validation among {n}" if n > 1 else "one lr given")

    def widths_of(self, model: str) -> list[int]:
        """The widths a model is trained at: a variant's own (a smaller state), else ``widths``."""
        return list(self.variants.get(model, {}).get("widths", self.widths))

