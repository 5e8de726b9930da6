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
The variants a preset adds for a layer that needs another setting to recall on either route
(``fwpkm/token``, ``fwmlp/token``, ``fwl/narrow``, ...), and why: docs/suites/toys.md, "Variants";
the measurements behind them: docs/journal/toys.md.

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

The package, one job a module: ``settings`` (`Settings`), ``tasks`` (`MQAR`, `AssocRetrieval`),
``models`` (the toy model, its reach and state), ``training`` (one lr's training, with checkpoints),
``lr`` (the lr search), ``cell`` (a cell measured into its row), ``plan`` (the cells of a run, their
configs and costs; `run`).
"""

from .cell import measure, metrics_of, train_lrs
from .lr import MAX_BEYOND, at_chance, lr_grid, past_edge, search
from .models import check_route, reach, state_numbers, state_size, toy_config
from .plan import cell_config, cell_key, cells, models_of, parts, run, work
from .settings import NAME, SEGMENTED, TASKS, Settings
from .tasks import TASK_TYPES, MQAR, AssocRetrieval, Task, slice_name
from .training import CHECKPOINT_EVERY_S, Training, evaluate, falling, left_chance_at, solved, train_cell
from memzoo.bench.registry import Suite, register_suite
from memzoo.bench.schema import slice_order  # the order of a row's slices (the report's, torch-free)

__all__ = [
    "NAME", "TASKS", "SEGMENTED", "Settings", "Task", "MQAR", "AssocRetrieval", "TASK_TYPES", "slice_name",
    "slice_order", "toy_config", "reach", "check_route", "state_size", "state_numbers", "Training", "CHECKPOINT_EVERY_S",
    "evaluate", "falling", "solved", "left_chance_at", "train_cell", "MAX_BEYOND", "lr_grid", "past_edge",
    "at_chance", "search", "train_lrs", "metrics_of", "measure", "cell_config", "cell_key", "models_of",
    "cells", "work", "parts", "run",
]

register_suite(Suite(NAME, Settings, run, work, parts))
