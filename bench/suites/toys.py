"""The toys suite: in-context recall on synthetic tasks, trained to convergence, with controls.

Tasks, each learned from scratch by a small LM (the preset's backbone scaled to a width, ``n_layers``
blocks, the memory layer at ``at``):

- ``mqar``: multi-query associative recall (Zoology, Arora et al. 2023, Sec. 3;
  :mod:`memzoo.data.mqar`): keys from the first half of the vocabulary, values from the second,
  queries placed with power-law spacing, accuracy on the labelled (query) positions. Training
  batches mix every count of ``mqar_kv`` in equal parts (as Zoology trains); each count is
  evaluated on its own, so a row is a capacity curve: accuracy against key-value pairs.
- ``ar``: Ba et al.'s associative retrieval (2016, Sec. 4.1; :mod:`memzoo.data.assoc_retrieval`),
  ``c9k8j3f1??c -> 9``, the prediction at the last position being the answer. Training steps
  cycle through ``ar_pairs``; each is evaluated on its own.

The memory the only route (``route: memory``, the default and the ``recall`` preset; the headline).
As Zoology measures a mixer behind a short convolution, the backbone's own token mixing is local:
sliding windows of ``window`` tokens (4: the 2 blocks reach 2 × 3 = 6 tokens back, `reach`), and
every MQAR query lies at least ``mqar_gap`` + 1 = 9 tokens after its pair's value (the gap's
filler sits between the pairs and the queries), so a pair reaches its query only through the
memory. A window rather than a convolution because it exists in the backbone already and binds a
key to its value (the pair's two tokens) the same way. ``check_route`` refuses a backbone whose reach
is not shorter than the gap; the backbone alone and PKM (no fast weights) are negative controls by
construction, and the harness is invalid if either is above twice chance on any slice. With the
gap ≥ the chunk (8), every query lies in a later chunk than its pair, so a read-then-write layer
can read it. MQAR only: Ba's task asks its query right after the pairs. ``route: hybrid`` (the
``standard`` and ``capacity`` presets) is the second view: the memory behind a GDN, which recalls
by itself.

Why the paper's FwPKM stays at chance there, and ``fwpkm/token``. A pair is recalled only if the
read at its query lands on the slots the key wrote (the paper's [HIT], Fig. 5). Behind a mixer the
query vector mixes the key with its neighbours, which differ between the pair and the query, so
the read hits 0-2% of the pair's slots; and a top-k read passes no gradient to a slot it did not
select, so training cannot pull the two queries together (a dense read, linear attention, can).
Where the query sees the token alone (the first block, before its mixer: the release's site), it
hits the pair's slots and recalls; the addressing loss then moves the fast sub-keys between
write and read and wears the recall down as training goes on, fast at the paper's weight 10,
slowly at the release's 1, not at all at 0 (the sub-keys fixed). ``fwpkm/token`` is that form,
an extra row beside the paper's ``fwpkm``; its site is our choice (the release puts FwPKM before
the mixers of later blocks). The forms, one change each: ``python -m
memzoo.bench.experiments.fwpkm_route``; the runs: docs/toys.md.

Protocol, per cell (layer, task, width, seed):

1. *Data.* Training batches are drawn from the seed; a validation set and a test set per slice
   (kv count or pairs) come from generators of their own, the same for every layer and seed.
2. *Training to convergence.* AdamW, warmup then cosine to ``min_lr_ratio`` × lr at
   ``max_steps`` (the cap). Every ``eval_every`` steps the model is scored on the validation
   sets (mean over slices); training stops when that reaches ``target`` (*solved*; with
   ``solve_on: every``, when every slice reaches it) or, from ``min_steps`` on, has not gained
   ``min_delta`` for ``patience`` evaluations (*plateau*);
   otherwise the cap stops it (*capped*: marked in every table, such a cell did not converge).
   The model kept is the one of the best validation score. ``min_steps`` is there because MQAR
   is learned in a sudden transition after a long flat phase at chance: the 2-layer GDN of
   width 64 sat at chance for 450-1800 steps depending on the seed in our runs, and a plateau
   rule alone stopped one seed at 650 steps that another seed learned at 1800.
3. *Learning rate on validation.* Each candidate of ``lrs`` (or the layer's own list in
   ``layer_lrs``: tuned once, recorded in the preset) is trained; the best validation score picks
   one; only then are the test sets scored. No test number ever chooses anything.
4. *Seeds.* ``seeds`` seeds per cell (the bench's ``--seed``, +1, ...), one row each; tables show
   the mean and a 95% t-interval over them, and mark a layer whose interval lies wholly above
   (▲) or below (▼) the baseline's.
5. *Controls* (run with the baseline): ``ctrl:attention``, the positive control: full softmax
   attention in every block with a short convolution on q, k and v (``attn_conv``; Zoology's
   attention is ``Hybrid([BaseConv, MHA])`` for the same reason), same width and budget; and
   ``ctrl:none``, the negative control: blocks with no token mixer, which cannot recall
   (chance: 2/vocab on MQAR for a model that knows the answer is a value, 1/10 on Ba's task).
   If the positive control misses ``target`` on the easiest slice of a task in any seed, or the
   negative control is above twice chance, the suite reports the harness as invalid and
   publishes no layer rows for that task.

Evaluation runs batches of ``batch_size`` sequences, as in training: a memory shared by the batch
(FwPKM as the paper trains it) then holds as many sequences as it did while learning. Before
every evaluation batch the persistent fast weights go back to their trained value, and after
validation to where training left them, so evaluating never changes training and batches never
leak into each other.

State size (the x axis of the capacity plot) is the recurrent state one sequence carries, in
numbers: every GDN mixer's matrix (heads × head_dim²), the memory layer's fast weights
(`fast_weight_numel()`), and for attention its KV cache at the sequence length. A memory shared
by the batch (FwPKM, FwMLP as the paper trains them) is counted whole, which overstates what one
sequence can use of it. Short-convolution caches are not counted.

Variants (``variants``): extra rows of a layer with other options, run with it, e.g. FwPKM with
its memory shared by the batch as the paper trains it on text, beside the per-sequence memory
that in-context recall calls for.

Why FwPKM's memory is per sequence here. As the paper trains it on text, FwPKM's fast weights are
shared by the sequences of a batch and kept across steps, and with them FwPKM made MQAR recall
*worse* than the GDN alone (the reason this suite was rebuilt). The cause is the sharing: MQAR
draws every sequence's keys from the same few tokens and binds them to other values in each
sequence, and a content-addressed memory sends a key token to the same slots whichever sequence
it comes from, so the batch's sequences overwrite each other's pairs in the same chunk and a
later read returns a mixture of the batch's values: noise, added to the residual stream the GDN
reads too. ``python -m memzoo.bench.experiments.fwpkm_sharing`` (64 tokens, vocabulary 256, 4/8/16
pairs, batch 64, width 64, 800 steps, seed 0; FwPKM with 64² slots of dim 64, chunk 8), test
accuracy at 4 / 8 / 16 pairs:

    GDN alone                                   0.537  0.341  0.142
    + FwPKM shared by the batch (the paper's)   0.043  0.036  0.021
    + FwPKM per sequence                        0.688  0.457  0.204
    + per sequence, addressing loss weight 1    0.731  0.547  0.288
    + per sequence, no addressing loss          0.219  0.095  0.046

The same init, gate and output scale help per sequence and hurt when shared, so they are not the
cause; the chunk (8 = four pairs) is what lets a query read its own sequence's earlier pairs at
all. Per sequence the addressing loss matters (without it the keys follow the memorisation loss
and recall collapses). That the per-sequence memory *beats* the GDN is not settled: these are one
seed at a fixed budget, and MQAR training is chaotic (whether and when a seed leaves chance moves
by hundreds of steps with tiny numeric changes); in other single-seed runs it was level with the
GDN (tiny preset) or below it when capped. That is what the seeds and intervals of the tables
are for. The standard preset publishes both forms (``fwpkm`` per sequence, ``fwpkm/shared``).

Why FwMLP diverges, and ``fwmlp/clip``. FwMLP's write is one plain SGD step (η = 0.1) on the
memorisation MSE, stable only while η·λ < 2 for the loss's largest curvature λ in the fast weights;
h = silu(W_gate q) ⊙ W_up q is quadratic in q, so λ grows as ‖q‖⁴ (the layer's docstring,
"Stability"). Nothing bounds ‖q‖: on MQAR (per-sequence memory, chunk 8, slow lr 3e-3, seed 0)
the mean query norm grew from 4.6 to 10.4 in 177 steps and at step 177 a write's gradient was
non-finite, in fp32 eager and in bf16 alike, at the same step (the trajectory, not the
precision); all six standard cells stopped as *diverged* within 161-462 steps. The paper's
FwMLP (and the released run's config, ``fwpkm_grad_clip: false``) has no clipping; the release's
``FastWeightMLP`` class clips each gradient entry to [-1, 1] by default. The standard table
holds both: ``fwmlp`` as the paper gives it, and the variant ``fwmlp/clip`` (``grad_clip: true``),
which trained past that point (MQAR loss below chance by step 400; its seeds: MQAR solved at 1000
steps, capped at 2000, plateau at 1900; AR solved in 700-1000). The variant's rows were recorded by
the standard preset until 2026-11-26; the preset leaves it out since (its six published cells took 1.03
thread-hours on AMD EPYC, the most of any group that no registered layer needs, and the preset
is held to 3 hours on two cores). zoo_configs/bench/standard.yaml says how to re-run it.

Update chunks. A chunk-level layer (FwPKM, FwMLP, LaCT) reads its memory before it writes
the chunk, so with the preset's chunks (32-256 tokens) a toy sequence would be a single chunk and
no pair of it could ever be recalled from the memory. The presets give them chunks of a few pairs
(``layer_options``): pairs start at even positions, so with an even chunk a pair never straddles
two chunks (FwPKM's and FwMLP's lookahead binds a key to the next token inside a chunk), and a
query reads every pair written in earlier chunks. A query inside its own pair's chunk is left to
the GDN mixers. FWL is not such a layer: inside its chunk, position t reads the loss gradients
of every earlier position (Eq. 2, causal linear attention), and its chunk is Sec. 3's segment,
after which the carried update decays. It keeps the preset's chunk (256 tokens), so a toy
sequence is one segment: the paper's plain FWL. With chunks of 8 its earlier pairs decayed every
8 tokens and each step updated the per-sequence fast weights (2 × 128 × 512 numbers) 8 times,
3x the layer's time (forward and backward, batch 64 × 64 tokens, fp32 eager, one thread on an
Intel Xeon beside a running bench: 1.40 s against 0.47 s).

Calibration (why the standard preset is 2 layers of width 128, batches of 64). MQAR is learned in
a sudden transition after a flat phase, and whether a seed gets there within a CPU budget depends
on the model's width far more than on steps. GDN baseline, vocabulary 64, lr 3e-3, test accuracy
at 4 / 8 / 16 pairs (64 tokens) or 8 / 16 / 32 pairs (128 tokens):

    width  tokens  batch  seed  steps (stop)      accuracy
    64     64      32     0     ~1800 (plateau)   0.98 0.99 0.97
    64     64      32     1     2000 (capped)     chance; lr 1e-3: 0.24 0.13 0.08; lr 1e-2: chance
    64     64      64     0     1600 (plateau)    0.985 0.980 0.931
    64     64      64     1     1500 (plateau)    0.237 0.127 0.077; with a cap of 4000: 0.254 0.145 0.101 (3300)
    64     64      64     2     2000 (capped)     0.704 0.571 0.397, still rising
    64     128     16     0     2000 (plateau)    0.038 0.032 0.026 (vocabulary 80)
    128    128     16     1     2400 (plateau)    0.067 0.056 0.043 (vocabulary 80)
    128    64      32     1     2000 (capped)     0.169 0.120 0.085
    128    64      32     2     1300 (solved)     0.989 0.992 0.995
    128    64      64     1     1000 (solved)     0.988 0.992 0.997
    128*   64      32     1     3000 (capped)     0.892 0.834 0.643, still rising (*16 GDN heads of 8)

So at width 64 a cell's mean measures whether the seeds happened to learn, not the layer. Width 128
with batches of 64 learned the seed that failed every smaller setting; what that costs is capacity: 16 pairs (the most
64 tokens hold) do not fill the GDN's state, and 128-token sequences, where they would, were not
learned within the budget. The capacity curve therefore stays above 0.5 for the baseline.

Capacity: the ``capacity`` preset (zoo_configs/bench/capacity.yaml). At 64 tokens the standard
GDN recalls all 16 pairs a sequence holds, and so does a GDN of 32 heads of 4 trained long enough
(0.98 / 0.96 / 0.89 at 4 / 8 / 16 pairs after 6000 steps); at 128 tokens the standard GDN holds 32
pairs; it would fall below 0.5 only past 32 pairs, at 256+ tokens, ~4x the standard cell's step.
So the preset keeps 128 tokens (8 / 16 / 32 pairs, vocabulary 128) and shrinks the GDN's state at
the same width: 4 heads of 16 (``toys.model: {gdn_head_dim: 16}``), 2048 numbers over the 2 layers
instead of 8192; smaller states (heads of 8) stayed near chance for 2400-4000 steps. It solves on
every slice at 0.995 (``solve_on: every``): at this length attention's weakest slice is the fewest
pairs, and the mean at 0.99 stopped it below 0.99 there. Its rows: the harness is valid, the baseline
is below 0.5 at 32 pairs in every seed (mean 0.491 / 0.345 / 0.208 at 8 / 16 / 32), FwPKM per
sequence is above it in the mean at every count (0.535 against 0.208 at 32 pairs) but capped in
every seed, with intervals wider than the gap. At this state size whether a seed leaves MQAR's flat
phase within the budget decides a cell, for every model: ``fwpkm/shared``'s seed 0 at chance is the
whole model still in the flat phase, not a read of the shared memory hiding recall (``python -m
memzoo.bench.experiments.fwpkm_sharing --capacity 0``). The pilots and the runs, with their numbers:
bench/experiments/toys_log.md, "Capacity".

Reproducibility. ``python -m memzoo.bench.experiments.reruns DIR`` reads a rerun (``memzoo bench
--suite toys --out DIR``, the same configs and seeds) beside the published rows: each slice's mean
against the published 95% interval, the model pairs the published intervals separate and whether
the rerun keeps their order, and what the rerun cost. Training is deterministic on one machine, not
across processors (matmuls round differently), and MQAR training is chaotic: on another processor
single seeds take other paths (a seed capped at chance on one was solved on the other), and the
intervals over seeds are what carries over. PKM's cells with a fresh seed set (seeds 100-102, AMD
EPYC, as published): all six slice means inside the published intervals; run again with the
baseline and the controls (``leaderboards/reruns/standard-toys-pkm-seeds-100-102``, read with
``reruns --fresh-seeds``), PKM five of six (AR at 4 pairs 0.999 against a published 1.000 ± 0.000)
and the baseline six of six. The whole preset re-run on
an Intel Xeon (``leaderboards/reruns/standard-toys-2026-11-26``): 64 of 78 slice means inside (the
others mostly single rerun seeds against a zero-width published interval), and of the 36 model pairs
whose published intervals are disjoint, 35 in the same order and none separated the other way. The
runs: bench/experiments/toys_log.md, "Reproducibility".

Speed. Toy training runs in bf16 autocast with torch.compile (``precision``, ``compile``; the
losses of fp32 eager within 0.01 after 40 steps for every layer; evaluation stays fp32 eager), with
GDN chunks of 16 (``model.gdn_chunk``). Memory layers whose forward is a Python loop over tokens
(Ba) or takes gradients inside (FWL's head loss) run that part eager inside the compiled model. On
a CPU whose bf16 GEMM is the slower (``memzoo.train.cpu_bf16_gemm_is_slow``, timed at the start of
each process; rows record it as ``hardware.bf16_gemm_in_fp32``) the compiled step multiplies the
same bf16 operands in fp32 (``memzoo.train.Bf16GemmsInFp32``), as oneDNN's bf16 GEMM sums in fp32:
configs and hashes stay. ``python -m memzoo.bench.benchmarks.bench_toys --before 279a062`` times the
standard MQAR cell's step as the code trained it when issue 12 asked for 2x (fp32 eager, GDN chunk
64) against this code, alternating, one thread a side:

    processor, code                              baseline (GDN)   FwPKM
    AMD EPYC, 2026-11-25                         2.04x            2.30x    (22.7-22.9k, 18.8-19.2k tokens/s)
    Intel Xeon, avx512_bf16, no AMX, dfe1f3c     1.59x            1.73x    (17.8-18.4k, 13.2-14.1k tokens/s)
    the same Xeon, 4e287eb (weights laid out     1.71x            1.84x    (18.9-21.8k, 14.3-15.5k tokens/s;
      for vectorized code, below)                                            runs 1.55x 1.87x; 1.88x 1.80x)
    AMD EPYC (family 25 model 17), 823c91b       2.70x            2.82x    (24.4-28.8k, 20.4-21.5k tokens/s;
      2026-11-26, --reps 3                                                   runs 2.59x 3.24x 2.70x; 3.21x 2.82x 2.66x)
    the same model of EPYC, 003b3aa, 2026-11-27  2.68x            2.77x    (28.5-30.5k, 20.9-22.5k tokens/s;
                                                                             runs 2.58x 2.68x 2.74x; 2.64x 2.77x 2.80x)

On the Xeon, fp32 GEMMs run at ~170 GFLOPS on one thread and bf16 ones at half of it (4096 x 128 x
384, 2026-11-26), so the fp32 eager step of 279a062 is relatively fast there, and the GEMMs of the
compiled step, in fp32, are near that peak already: ~80 ms of the baseline's ~210 ms (torch.profiler). Counted as one uninterrupted run on two workers
(``reruns``), the standard toys took ~2.8 h on the EPYC of the published rows and ~3.1 h on that
Xeon at dfe1f3c, where training is ~77% of the time, cold compiles ~15% (12-360 s a group; Ba's
task, three input shapes, the costliest) and evaluations ~6%. Compiled CPU code vectorizes a loop
only where every tensor it reads runs contiguously along the channels: the short convolutions'
weights are therefore stored taps first and LaCT's q/k affine as rows (4e287eb; 4-8% off the step
of the models measured, the same losses). What each change gained and what was tried and
not kept, measured: bench/experiments/toys_log.md, "Speed" and "The standard preset's budget".
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm.auto import tqdm

from memzoo.backbone.model import HybridLM
from memzoo.bench.common import BASELINE, CONTROLS, NEGATIVE, POSITIVE, Context, layer_order, mean_ci, model_config, save_png
from memzoo.config import ConfigError, ModelConfig
from memzoo.data import assoc_retrieval as ar
from memzoo.data import mqar
from memzoo.train import lr_at, make_step, param_groups

NAME = "toys"
TASKS = ("mqar", "ar")

# shown under the suite's tables in the leaderboard
EXPLANATION = """Accuracy is on the labelled positions of the test sets (MQAR: every query; Ba's task: the answer
after the query), mean ± the half-width of a 95% t-interval over the seeds; ▲ / ▼: the layer's
interval lies wholly above / below the baseline's. Each training ran until validation accuracy
reached the target or stopped improving (*stop*: solved / plateau / capped; a capped cell did not
converge), with the learning rate chosen on the validation sets. ctrl:attention is the positive
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
    variants: dict = field(default_factory=dict)  # extra rows: {name: {layer: L, options: {...}, at: A}}, run with L
    seeds: int = 1
    lrs: list = field(default_factory=lambda: [3e-3])  # candidates, chosen on validation (ties: the first)
    layer_lrs: dict = field(default_factory=dict)  # a layer's (or control's) own candidates
    max_steps: int = 2500  # the cap
    eval_every: int = 50
    patience: int = 6  # evaluations without a gain of min_delta: plateau
    min_steps: int = 500  # no plateau stop before this step (the flat phase before MQAR is learned)
    min_delta: float = 0.005
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
        if not 0 < self.target <= 1 or self.min_delta < 0:
            raise ConfigError(f"toys.target must be in (0, 1] and min_delta >= 0, got {self.target}, {self.min_delta}")
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
        for name, v in self.variants.items():
            if not isinstance(v, dict) or set(v) - {"layer", "options", "at"} or v.get("layer") not in layer_names():
                raise ConfigError(f"toys.variants.{name} must be {{layer: <a registered layer>, options: {{...}}, at: <where, "
                                  f"optional>}}, got {v!r}")
            if name in layer_names() or name in CONTROLS or name == BASELINE:
                raise ConfigError(f"toys.variants: {name!r} is already a layer's or a control's name")
        valid_lrs = [BASELINE, *CONTROLS, *layer_names(), *self.variants]
        for name, valid in (("layer_options", layer_names()), ("layer_lrs", valid_lrs)):
            unknown = sorted(set(getattr(self, name)) - set(valid))
            if unknown:
                raise ConfigError(f"toys.{name}: unknown layer(s) {unknown}; valid: {', '.join(valid)}")
        if any(not lrs for lrs in self.layer_lrs.values()):
            raise ConfigError("toys.layer_lrs: every layer needs at least one learning rate")
        unknown = sorted(set(self.model) - set(ModelConfig.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"toys.model: unknown backbone field(s) {unknown}")

    def candidates(self, layer: str) -> list[float]:
        return list(self.layer_lrs.get(layer, self.lrs))


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
            # targets as in training: layers that learn from them (FWL) see only earlier ones
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
    stop: str  # solved | plateau | capped | diverged
    train_loss: float  # mean of the last eval_every steps
    tokens_per_s: float  # training tokens over the time of the training steps alone (the first of each shape left out)
    compile_s: float = 0.0  # the first step of each input shape: compiles with `compile` (cold, or from the cache)
    eval_s: float = 0.0  # the validation evaluations


def train_cell(mc: ModelConfig, task: Task, lr: float, s: Settings, seed: int, device: str = "cpu",
               on_step=None) -> Fit:
    """Train one model from seed `seed` (the same initialisation and batches for every layer and
    lr) until it converges or hits the cap (module docstring); `on_step()` after each step.
    The model returned holds the weights of its best validation score."""
    torch.manual_seed(seed)
    model = HybridLM(mc).to(device)
    tc = SimpleNamespace(lr=lr, min_lr=lr * s.min_lr_ratio, warmup=s.warmup, steps=s.max_steps,
                         weight_decay=s.weight_decay)
    opt = torch.optim.AdamW(param_groups(model, tc), lr=lr, betas=(0.9, 0.98))
    if s.compile:  # a new model: compile afresh (a worker's earlier cells would fill dynamo's per-function cache)
        torch._dynamo.reset()
    train_step = make_step(model, opt, s.grad_clip, s.precision, s.compile)
    g = torch.Generator().manual_seed(seed)
    best, best_state, stale, stop = -1.0, None, 0, "capped"
    losses, tokens, busy, first, evals, shapes = [], 0, 0.0, 0.0, 0.0, set()
    model.train()
    for step in range(s.max_steps):
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
        stale = 0 if val >= best + s.min_delta else stale + 1
        if val > best:
            best, best_state = val, copy.deepcopy(model.state_dict())
        if solved(acc, s):
            stop = "solved"
            break
        if stale >= s.patience and step + 1 >= s.min_steps:
            stop = "plateau"
            break
    if best_state is not None:
        model.load_state_dict(best_state)
    tail = losses[-s.eval_every:]
    return Fit(model, max(best, 0.0), step + 1, stop, sum(tail) / len(tail), tokens / max(busy, 1e-9), first, evals)


def solved(acc: dict[int, float], s: Settings) -> bool:
    """Whether validation accuracies by slice reach the target: their mean, or each of them."""
    return (min(acc.values()) if s.solve_on == "every" else sum(acc.values()) / len(acc)) >= s.target


def cell_config(mc: ModelConfig, task: str, s: Settings, layer: str) -> dict:
    """Everything one cell's numbers depend on (its hash decides whether a resumed run skips it)."""
    data = ({"vocab": s.mqar_vocab, "seq_len": s.mqar_seq_len, "kv": s.mqar_kv, "power_a": s.power_a}
            if task == "mqar" else {"pairs": s.ar_pairs})
    if task == "mqar" and s.mqar_gap:  # left out at 0: the rows recorded before the option keep their hashes
        data["gap"] = s.mqar_gap
    keep = ("max_steps", "min_steps", "eval_every", "patience", "min_delta", "target", "batch_size", "warmup", "min_lr_ratio",
            "weight_decay", "grad_clip", "precision", "compile", "val_size", "test_size")
    train = {k: getattr(s, k) for k in keep}
    if s.solve_on != "mean":  # the default is left out: the rows recorded before the option keep their hashes
        train["solve_on"] = s.solve_on
    return {"model": mc.to_dict(), "task": task, "data": data, "lrs": s.candidates(layer), "train": train,
            "optimizer": "AdamW(0.9, 0.98), warmup + cosine", "version": 2}


def cell_key(ctx: Context, s: Settings, name: str, task: str, width: int, seed: int) -> tuple:
    """(model config, config, setting, the row already recorded or None) of one cell."""
    mc = toy_config(ctx.preset, name, width, Task.vocab_of(task, s), s)
    check_route(mc, name, s)
    config, setting = cell_config(mc, task, s, name), {"task": task, "d_model": width}
    if s.route == "memory":  # (absent otherwise: the hybrid rows recorded before the option keep their settings)
        setting["route"] = "memory"
    return mc, config, setting, ctx.recorded(NAME, name, setting, config, seed)


def cells(layer: str, s: Settings) -> list[str]:
    """The models one layer's run trains: the layer and its variants, and with the baseline the
    controls; a variant named alone (``--layers fwpkm/token``), only itself."""
    if layer in s.variants:
        return [layer]
    variants = sorted(n for n, v in s.variants.items() if v["layer"] == layer)
    return [layer, *variants, *(CONTROLS if layer == BASELINE and s.controls else ())]


def work(ctx: Context, layer: str) -> int:
    """Units of work for the progress bar: the training steps of one layer at the cap (a cell
    that stops early counts the rest at once)."""
    s = ctx.preset.settings(NAME, Settings)
    per = len(s.tasks) * len(s.widths) * s.seeds * s.max_steps
    return sum(per * len(s.candidates(m)) for m in cells(layer, s))


def _plan(ctx: Context, layers: list[str]):
    """Every cell of `layers` in run order: (model name, task, width, seed)."""
    s = ctx.preset.settings(NAME, Settings)
    for layer in layers:
        for name in cells(layer, s):
            for tname in s.tasks:
                for width in s.widths:
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


def _cell(ctx: Context, layer: str, task: Task, width: int, mc, config: dict, setting: dict, s: Settings,
          seed: int) -> dict:
    t0 = time.perf_counter()
    fits = {}
    for lr in s.candidates(layer):
        doing = f"toys {layer} {task.name} d={width} seed {seed} lr={lr:g}"
        fits[lr] = fit = train_cell(mc, task, lr, s, seed, ctx.device, lambda d=doing: ctx.advance(1, d))
        ctx.advance(s.max_steps - fit.steps, doing)  # the steps an early stop saved
    lr = max(fits, key=lambda k: fits[k].val)  # ties: the first candidate
    fit = fits[lr]
    t_test = time.perf_counter()
    acc = evaluate(fit.model, task.test, s.batch_size)
    t_test = time.perf_counter() - t_test
    x, y = task.test[task.slices[0]]
    with torch.no_grad():  # a forward, so that every memory holds its state
        fit.model.eval()(x[:2].to(ctx.device), targets=y[:2].to(ctx.device))
    metrics = {
        "accuracy": round(sum(acc.values()) / len(acc), 4),
        "acc_by_kv": {str(n): round(a, 4) for n, a in acc.items()},
        "val_accuracy": round(fit.val, 4),
        "lr": lr,
        "val_by_lr": {f"{k:g}": round(f.val, 4) for k, f in fits.items()},
        "steps": fit.steps,
        "stop": fit.stop,
        "converged": fit.stop in ("solved", "plateau"),
        "train_loss": round(fit.train_loss, 4),
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
        tqdm.write(f"toys {layer:>14} {task.name:>4} d={width:<4} seed {seed}: test {metrics['accuracy']:.3f} "
                   f"(val {fit.val:.3f}, lr {lr:g}, {fit.steps} steps, {fit.stop})")
    return row


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
            rec["steps (max)"] = f"{int(g['metrics.steps'].median())} ({int(g['metrics.steps'].max())})"
            stops = g["metrics.stop"].value_counts()
            rec["stop"] = ", ".join(f"{n} {k}" for k, n in sorted(stops.items()))
            rec["lr"] = ", ".join(sorted({f"{v:g}" for v in g["metrics.lr"]}))
            rec["state"] = int(g["metrics.state_size"].iloc[0])
            recs.append(rec)
    return pd.DataFrame(recs)


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


def figures(df, out_dir: Path) -> list[Path]:
    """toys_mqar_capacity.png: MQAR test accuracy against kv pairs, a line per model with its
    95% interval (cut at 0 and 1) and a cross per seed, a panel per width. toys_mqar_state.png:
    mean accuracy against the recurrent state per sequence (a point per width; the attention
    control's state is its KV cache; a model without state, ctrl:none, has no place on its log
    axis). A task whose controls fail is not drawn, nor a layer with fewer seeds than the baseline."""
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
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("recurrent state per sequence (numbers, log scale)")
    ax.set_ylabel("MQAR test accuracy (mean over kv counts)")
    ax.set_title("MQAR accuracy against state size")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(save_png(fig, Path(out_dir) / "toys_mqar_state.png"))
    return paths
