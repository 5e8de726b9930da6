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

A capacity pilot (issue 12, 2026-11-25, one seed, AMD EPYC, one thread): the standard MQAR cell with
a narrow GDN state (``toys.model: {gdn_heads: 32}``, head size 4 at width 128: 512 numbers per layer),
so that 16 pairs exceed it. Every model was still capped at 2000 steps, test accuracy at 4 / 8 / 16
pairs:

    baseline (GDN)        0.456 0.340 0.219   train loss 2.19
    fwpkm (per sequence)  0.592 0.399 0.206   train loss 2.13
    fwpkm/shared          0.498 0.345 0.192   train loss 2.42

So the narrow GDN does fall below 0.5, but within this budget nothing converged, and FwPKM adds
little (+0.14 at 4 pairs, nothing at 16). Trained on to 6000 steps (the next session, same cell,
seed 0, one thread, ~0.33 s a step), the narrow GDN was still learning, not at a capacity limit
(validation accuracy at 4 / 8 / 16 pairs):

    step 1000  0.074 0.070 0.052      step 4000  0.931 0.827 0.635
    step 2000  0.185 0.128 0.106      step 5000  0.977 0.926 0.812
    step 3000  0.600 0.387 0.225      step 6000  0.983 0.957 0.882   test 0.980 0.961 0.890

So 16 pairs in 64 tokens do not exceed even 512 numbers of GDN state per layer once trained long
enough: at this length shrinking the state only slows learning, and a capacity curve that reaches
the baseline's 0.5 needs more pairs, hence longer sequences.

Longer sequences (the same session, seed 0, 128 tokens, vocabulary 128 so that 32 keys can be
distinct, 8 / 16 / 32 pairs, validation accuracy; both runs stopped by hand):

    GDN of the standard cell (4 heads of 32)   step 1300: 0.973 0.986 0.960, still rising
    narrow GDN (32 heads of 4)                 step 1800: 0.061 0.038 0.031, still at chance

    GDN of the standard cell, 256 tokens, vocabulary 256, 16 / 32 / 64 pairs
                                               step 2300: 0.042 0.027 0.018, still in the flat phase
                                               (~1 s a step with another process on the second core)

So at width 128 the GDN holds 32 pairs in 128 tokens, and the narrow one does not learn the longer
task within a budget of this size. Where the baseline falls below 0.5 is past 32 pairs: 256 or more
tokens (64+ pairs), about 4x the standard cell's step time, some 30 min a cell on one thread.

Capacity: the ``capacity`` preset (zoo_configs/bench/capacity.yaml). Rather than lengthen the
sequences past what a CPU trains, it keeps 128 tokens (8 / 16 / 32 pairs, vocabulary 128) and
shrinks the GDN's state at the same width: 4 heads of 16 (``toys.model: {gdn_head_dim: 16}``; a
set head size is kept, not scaled with the width), 2048 numbers over the 2 layers instead of 8192.
Pilots (the next session, seed 0, lr 3e-3, AMD EPYC, one thread, two pilots at a time; validation
accuracy unless marked *test*):

    64 tokens, vocab 64, 4 / 8 / 16 pairs   1 head of 8     step 4000: 0.063 0.047 0.042 (chance is 0.031)
                                            2 heads of 8    step 4000: 0.238 0.124 0.076, test 0.240 0.130 0.074
    128 tokens, vocab 128, 8 / 16 / 32      4 heads of 8    step 2400: 0.040 0.032 0.022, still at chance
                                            4 heads of 16   step 1000: 0.038 0.034 0.027
                                                            step 1600: 0.538 0.327 0.154
                                                            step 2200: 0.664 0.480 0.260
                                                            step 3000: 0.720 0.560 0.332
                                                            step 4000: 0.756 0.616 0.402 (the lr at its floor),
                                                            test 0.767 0.606 0.395 (27,000 tokens/s)

So the smallest GDN states do not learn MQAR within a CPU budget at all, and 4 heads of 16 learn it
and then climb slowly, further the fewer pairs a sequence holds: a capacity slope, below 0.5 at 32
pairs. Whether that slope is the state's limit or the budget's is what the cap marks: a capped
cell says the budget stopped it. FwPKM per sequence on the same backbone was still at chance at
1600 steps (stopped by hand), later than the GDN alone (which left chance at 1200-1400).

The preset's first run (2026-11-25, AMD EPYC, 2 workers of one thread; the standard rule then:
solved when the slices' mean reached 0.99), test accuracy at 8 / 16 / 32 pairs:

    baseline        seed 0  0.757 0.592 0.385   3700 steps, plateau
                    seed 1  0.161 0.098 0.054   3100, plateau (never left the flat phase for good)
                    seed 2  0.556 0.344 0.187   3200, plateau
    fwpkm           seed 0  0.571 0.356 0.185   4000, capped
                    seed 1  0.957 0.944 0.886   4000, capped
    ctrl:attention  seeds 0 / 1 / 2 at 8 pairs: 0.988 / 0.993 / 0.988 (at 32: 0.999-1.000), solved at 300

So the baseline is below 0.5 at 32 pairs in every seed, but how far it gets first is again
seed-dependent: a small state makes MQAR's transition late and erratic (seed 1). And the positive
control, stopped at the first evaluation whose mean crossed 0.99, sat at the threshold on its
weakest slice, which is the *fewest* pairs for attention (a mixed batch holds 4x more queries of 32
pairs than of 8): below the 0.99 at the easiest slice that makes the harness valid, in two seeds of
three. The preset therefore solves on every slice at 0.995 (``solve_on: every``, ``target: 0.995``),
a new config for every cell, and the rows above are superseded as the run under it records its own.

The run under that rule (2026-11-25, AMD EPYC, 2 workers of one thread; the baseline's and FwPKM's
seeds 0-1 were recorded by the session before, each the same number as in the first run: training
is deterministic here), test accuracy at 8 / 16 / 32 pairs:

    ctrl:attention  seed 0  0.993 0.999 1.000   2000 steps, plateau (validation mean 0.998, a slice below 0.995)
                    seed 1  0.995 0.999 1.000    500, solved
                    seed 2  0.995 0.999 1.000    400, solved
    ctrl:none       seeds 0-2: 0.014-0.016 at every count (chance 2/128 = 0.016), 2000, plateau
    baseline        seed 0  0.757 0.592 0.385   3700, plateau
                    seed 1  0.161 0.098 0.054   3100, plateau
                    seed 2  0.556 0.344 0.187   3200, plateau
    fwpkm           seed 0  0.571 0.356 0.185   4000, capped
                    seed 1  0.957 0.944 0.886   4000, capped
                    seed 2  0.549 0.545 0.533   4000, capped
    fwpkm/shared    seed 0  0.019 0.020 0.018   2000, plateau
                    seed 1  0.982 0.941 0.757   3900, plateau
                    seed 2  0.685 0.519 0.324   4000, capped

So the harness is valid (the positive control at 0.993 or more on 8 pairs in every seed, the negative
one at chance), and the baseline is below 0.5 in the mean at every count (0.491 / 0.345 / 0.208) and
at 32 pairs in every seed. What the curve measures is not yet the state's capacity alone: the
baseline stopped on a plateau in every seed but at levels that differ by seed more than by pairs
(seed 1 never left the flat phase), and FwPKM was capped in every seed, so its numbers are lower
bounds set by the budget. FwPKM per sequence is above the baseline in the mean at every count, most
at 32 pairs (0.535 against 0.208), but the intervals over three such seeds are wider than the gap
(no ▲); paired by seed (the same initial backbone and batches), FwPKM minus the baseline at 32
pairs is -0.200, +0.832, +0.346. The shared memory's mean (0.562 / 0.493 / 0.366) lies between the two,
its seeds spread from chance to 0.982. FwPKM's memory (266,240 numbers per sequence) is far from full at 32
pairs: what limits it here is learning to use it within 4000 steps, not its size.

Why ``fwpkm/shared`` seed 0 sits at chance, below the baseline's same seed (0.757 at 8 pairs).
``python -m memzoo.bench.experiments.fwpkm_sharing --capacity 0`` retrains that cell (the same
2000 steps, plateau and test accuracy as its row) and reads the test set three ways with the same
slow weights: as trained 0.019 / 0.020 / 0.018; with a memory per sequence at test time 0.019 /
0.020 / 0.018; with the memory's output removed (the GDN alone) 0.017 / 0.019 / 0.018; mean write
gate 0.90. So no read of the shared memory hides recall that the GDN learned: the whole model is
still in MQAR's flat phase when the plateau rule stops it at ``min_steps``, which is how seed 1 of
the baseline ends too (0.161). The shared memory can delay that transition (the 64-token diagnosis
above: its batch-mixed reads are noise in the residual stream), but it does not prevent it: seed 1
of ``fwpkm/shared`` learned and ends far above the baseline's seed 1 (0.982 against 0.161 at 8 pairs).
At this state size whether a seed leaves the flat phase within the budget decides a cell, for
every model; more seeds or a longer ``min_steps`` would narrow the intervals, at 17-37 min a cell (the rows' wall times).

Reproducibility (issue 12). PKM's standard cells re-run with a fresh seed set (seeds 100-102, the
toys suite called for PKM alone, same config hashes; AMD EPYC, one thread, 2026-11-25), beside the
published seeds 0-2 (mean ± 95% t half-width):

    cell        published (0-2)   fresh (100-102)   fresh mean inside the published interval
    MQAR kv=4   0.990 ± 0.007     0.989 ± 0.004     yes
    MQAR kv=8   0.991 ± 0.002     0.992 ± 0.000     yes
    MQAR kv=16  0.995 ± 0.004     0.996 ± 0.004     yes
    AR 4 pairs  1.000 ± 0.000     1.000 ± 0.000     yes
    AR 8        0.997 ± 0.011     0.996 ± 0.010     yes
    AR 12       0.977 ± 0.013     0.971 ± 0.044     yes

All six fresh cells were solved (MQAR in 500-1500 steps, AR in 700-1600). This was the same processor
as the published rows, so it checks the seed spread, not portability to another CPU.

Portability: the standard toys re-run on another processor (Intel Xeon with AMX bf16; the published
rows are AMD EPYC), the same configs and seeds, ``memzoo bench --preset standard --layers all --suite
toys --resume --jobs 2 --out leaderboards/reruns/standard-toys-2026-11-25``, read with
``python -m memzoo.bench.experiments.reruns leaderboards/reruns/standard-toys-2026-11-25``. The first
segment (62 min) recorded the baseline, both controls and MoM's MQAR cells (21 rows): 20 of 21 slice
means lie inside the published 95% intervals (the exception: ctrl:attention at 8 pairs, 0.997 against
0.998 ± 0.001), but only 8 of the 21 cells came out identical (same test accuracy to 3 decimals,
steps and stop), the controls among them. The others took other paths: the baseline's MQAR seed 0,
capped at 2000 steps at 0.900 on EPYC, was solved at 1500 steps (0.993) on the Xeon. Training is
deterministic on one machine, not across processors (bf16 matmuls round differently), and the
intervals, not single seeds, are what carries over. Two later segments (2026-11-25, codes 0b72ca1
and d6c00cf) added 21 cells, each layer's first seed of both tasks and FWL's three MQAR seeds:
42 of the 78 cells in 4.85 thread-hours and 2.66 h of the three segments' spans. Seeds again
took other paths: Ba's MQAR seed 0, at chance on EPYC (capped), was solved on the Xeon (0.99 at
1000 steps); FWL with its one segment solved all three MQAR seeds (0.990-0.991 at 600-1800 steps).
The 36 cells left took 2.65 thread-hours on EPYC, so the whole preset is ~7.5 thread-hours on this
Xeon: ~3.8 h on two workers, not yet the 3 h the preset is meant for.

Speed. Toy training runs in bf16 autocast with torch.compile (``precision``, ``compile``; the
losses of fp32 eager within 0.01 after 40 steps for every layer; evaluation stays fp32 eager),
GDN chunks of 16 (``model.gdn_chunk``) and FwPKM's faster layer code. Memory layers whose forward
is a Python loop over tokens (Ba) or takes gradients inside (FWL) run eager inside the compiled
model. ``python -m memzoo.bench.benchmarks.bench_toys`` times one step per setting, and with
``--before 279a062`` the standard MQAR cell's step as the code trained it when issue 12 asked for
2x (fp32 eager, GDN chunk 64), against this code, alternating (AMD EPYC, one thread a side,
nothing else running; 2026-11-25):

    model      279a062 (tokens/s)   this code (tokens/s)   ratio (3 runs)      median
    baseline   11,054-11,375        22,694-22,925          2.04 2.07 2.00      2.04x
    fwpkm       7,966- 8,367        18,821-19,208          2.27 2.30 2.41      2.30x

(An earlier run of the same command with a one-thread pilot busy on the other core: 2.01x and
2.41x, the baseline's three runs 1.93-2.06x.)

Three profiled changes made the last part of it: GDN's chunk algebra solves for (I + A)⁻¹
(C right-hand sides) and multiplies once, instead of solving for V + K of them; a non-finite
token is zeroed on entry and its outputs set to NaN on exit (``gated_delta_rule_chunked``), where
NaN-safe masked matmuls (isfinite, where and a cumulative sum around every matmul) had cost about
20 ms of a 200 ms step; and FwPKM's reset runs outside compiled graphs, where the in-place refill
of its per-sequence values (64 × 4096 × 64 numbers) had become a fresh clone, 35 ms a step. Same
accuracy: over the first 60 steps (same seed and batches) the losses of the two versions agree
within 0.006 for both models; the baseline's seed-0 cell retrained by this code ends where its
published row did (test 0.856 / 0.913 / 0.924, mean 0.898, capped at 2000 steps; published
0.883 / 0.923 / 0.893, mean 0.900, capped at 2000). FwPKM's seed-0 cell did not: published capped
at 2000 steps still low (mean 0.153), retrained it was solved at 1500 (0.990). The arithmetic is the
same to rounding (the loss curves above), and that is the chaos the seeds measure: whether a seed
leaves the flat phase within the cap moves with rounding-level changes (its published seeds 1-2
reached 0.980 and 0.933), which is why the published rows are means with intervals over seeds.

The costliest layers of the standard preset (2026-11-25; the published rows' wall times summed
7.1 thread-hours: MoM 1.39, FwMLP/clip 1.03, FWL 0.92, Ba 0.86). Measured on an Intel Xeon, one
thread a process, before and after in one run:

- MoM, compiled, padded its memories' token lists to the busiest memory's count: a data-dependent
  size, so a recompilation at every new value until dynamo's limit (8), then eager. Compiled it
  now pads to T (the same function: ``test_compiled_path_pads_every_memory_to_the_sequence_and_agrees``).
  Its three standard MQAR cells, re-run on the Xeon: 7.2-7.3k tokens/s and 2,124 thread-seconds,
  against 3.9-5.2k and 3,160 in the published rows (EPYC: indicative only).
- FWL ran its whole forward eager, because one part (the gradient of the head's loss with
  ``create_graph``) cannot be compiled; now only that part is eager: the MQAR step 2,783 -> 4,776
  tokens/s (1.72x), AR 2,883 -> 3,942 (1.37x). In fp32 the compiled and eager models' gradients
  agree within 1e-4 (relative); in bf16 the first losses agree to 0.001.
- FwMLP's write takes its gradient by hand (``swiglu_grads``, tested against autograd to first and
  second order) instead of ``autograd.grad``, so the layer compiles whole: fwmlp/clip's MQAR step
  7,522 -> 9,364 tokens/s (1.24x), the first losses within 0.0013.
- Every memory model compiled twice: an attribute (``_held``) that appeared after the first
  forward changed a guard. It is set in ``MemoryLayer.__init__`` now.
- ``memzoo bench`` gives each toy cell to whichever worker is free (the static share of layers
  per worker it replaces gave its two workers 3.25 and 3.87 hours of the recorded cells), and its
  workers share one compile cache. The first seed of every cell goes before the second seed of
  any: queued side by side, two workers compiled the same graphs at once.
- FWL keeps its 256-token segment (see "Update chunks"): the layer's forward and backward 3x
  faster than with chunks of 8. Its published rows are the six cells of this config from the
  rerun of "Portability" (Intel Xeon; all six solved: MQAR 0.990 ± 0.002 in 600-1800 steps, AR
  0.994 ± 0.001 in 800-1100), which replaced the chunk-8 rows (EPYC: MQAR 0.981 ± 0.047 with one
  seed capped, AR 0.988 ± 0.006; still in results.jsonl). Compiled in bf16 with
  its state update inside the graph, its input gradients came out NaN (the first cell diverged
  at step 2); the update now runs eager (``test_compiled_bf16_gradients_are_finite_and_agree``),
  and the first MQAR cell solved in 600 steps (0.991).
- The short convolutions (GDN's q, k and v, the attention control's, MoM's k and v) run as four
  shifted multiply-adds (:mod:`memzoo.ops.short_conv`, tested against conv1d) that torch.compile
  fuses with the SiLU, not as a grouped conv1d, whose backward is a slow path of its own on a CPU
  (6 ms for each [64, 67, 128] convolution, six a step). The baseline's standard MQAR step:
  334 -> 289 ms (one thread, the two versions alternating in one process beside another busy
  process; Intel Xeon, Cooper Lake; the losses at step 40: 3.4823 and 3.4832).
- MoM's delta rule in chunks of 16 instead of 64: its standard MQAR step 558 -> 500 ms.
- Training processes (a bench worker, ``memzoo train``) keep freed blocks of up to 32 MiB in the
  heap (``memzoo.train.tune_cpu``, glibc's ``mallopt``): a fresh process's step had faulted in its
  activations' pages afresh every time, 6,453 page faults in the baseline's standard MQAR step
  (264 -> 255 ms) and 17,564 in MoM's (450 -> 416 ms; Intel Xeon, Cooper Lake, 2026-11-26). A
  long-lived worker got part of the way alone (glibc raises its threshold as large blocks are freed).
- FWL takes each fast matrix's in-chunk sum and its bias's (an exclusive cumsum) in one strictly
  causal matmul, and a non-finite position is zeroed on entry and the outputs after it set to NaN,
  instead of a NaN-safe masked matmul and two exclusive cumsums per matrix (aten's CPU cumsum along
  dim 1 of [64, 64, 512]: ~9 ms, four a step). The layer alone at the toy size (64 x 64 tokens,
  forward and backward): fp32 eager 471 -> 277 ms, compiled bf16 426 -> 359 ms; float64 outputs and
  input gradients equal to 1e-12. The whole standard MQAR step: 588-616 -> 557-571 ms (fresh
  one-thread processes alternating, nothing else running; Intel Xeon, Cooper Lake, 2026-11-26).

Where the rest of a step goes (Intel Xeon, Cooper Lake: avx512_bf16, no AMX; 2026-11-26). Matmuls
are half of the baseline's step, and here they run in bf16 at ~82 GFLOPS against 110-164 in fp32
(one thread, 4096 x 128 x 384; oneDNN's brg_matmul:avx512_core_bf16): bf16 autocast, chosen on a
processor where it was faster, costs on this one, but the precision is part of every cell's config
and stays. How much it costs, the standard MQAR step compiled in fp32 against bf16 (one process,
nothing else running, 2026-11-26): baseline 219 / 271 ms, FWL 565 / 655, MoM 423 / 425, LaCT
370 / 419, Ba 344 / 435, PKM 282 / 325, FwPKM 302 / 329, fwpkm/shared 264 / 311, fwmlp/clip
335 / 354, linear 239 / 283, ctrl:attention 151 / 264. Applied to the training part (~3/4) of the
published rows' 7.55 thread-hours, fp32 would make the preset ~6.8 thread-hours here: ~3.4 h on
two workers, still over 3 h, so the precision alone does not decide the budget. Inductor's C++
GEMM templates (max-autotune) did not speed the step (342 against 349 ms). A group's first cell
compiles cold: 45-120 s per input shape (Ba's task has three: 160 s for the baseline, 254 s for
MoM, 317 s for LaCT); compiling it with a symbolic length was slower still
(over 6 min for the baseline; stopped), and g++ at -O1 or -O2 instead of -O3 did not shorten a
compile (78 and 77 s against 73). Compiling each block on its own (regional compilation: the
baseline's two GDN blocks share one graph, and every model's first block is the baseline's, from
the run's compile cache) cut cold compiles of the MQAR cell (baseline 98 -> 69 s, PKM 67 -> 39 s,
LaCT 235 -> 185 s, FWL 47 -> 45 s) but slowed every step by 3-4% (baseline 254-258 -> 262-266 ms,
PKM 299-316 -> 317-325 ms: the embedding, final norm, head and loss ran eager), a wash over a cell's
~1000 steps; not done. Evaluation (fp32 eager, every 100 steps) costs 4-8% of training.

Since a3736a1 a compiled bf16 step on a CPU whose bf16 GEMM is the slower (timed at the start of
each process, ``memzoo.train.cpu_bf16_gemm_is_slow``; this Xeon, one thread: 1.4-3.4x slower than
fp32 at the toys' shapes) multiplies the same bf16 operands in fp32 (an inductor post-grad pass,
``Bf16GemmsInFp32``): oneDNN's bf16 GEMM sums in fp32 too, so the configs and their hashes stay
and the rows stay comparable (where an operand or product is computed in the same fused kernel,
inductor then keeps it in fp32 instead of rounding it to bf16, as it does between any two fused
ops). The standard MQAR step, both versions compiled in one process and alternating (Intel Xeon,
one thread, 2026-11-26), in ms: baseline 246 -> 206 (1.19x), FwPKM 316 -> 287 (1.10x), LaCT
386 -> 357 (1.08x); with the pass's first version (an fp32 copy per product, not per operand):
linear 1.16x, ctrl:attention 1.17x, Ba, PKM 1.10x, MoM 1.06x. Those figures rewrote the batched
products (bmm, baddbmm) too; since 9defac7 the pass rewrites mm and addmm only: the batched ones
gained nothing (MQAR step, mm/addmm only against all four: baseline 206 vs 213 ms, LaCT 350 vs
371, FwPKM 300 vs 315, MoM 384 vs 388), and rewriting them made FwMLP's Ba-task gradients NaN
from the first step at 27 tokens (inductor saved two bf16 copies of its per-sequence fast weights
for the backward as garbage; it took bmm and baddbmm rewritten together, and no fusion or
buffer-reuse setting changed it). With mm/addmm only its losses match the plain bf16 step's
(3.663, 3.591, 3.542, 3.321, 3.192, 3.044 against 3.664, 3.587, 3.540, 3.309, 3.190, 3.022). The
probe now times the thread's CPU time: in wall time a busy neighbour's ~4 ms time slices flipped
it (one call in four said "not slow" on this Xeon while a bench ran). Rows record its answer
(``hardware.bf16_gemm_in_fp32``).

In a whole run the short-convolution and MoM changes above did not show. A fresh timed run of this code (2026-11-26,
``--jobs 2``, a new compile cache, nothing else on the cores; ``--out
leaderboards/reruns/standard-toys-2026-11-26``) recorded the baseline's, the controls' and the
first MQAR cells of FWL and MoM, 20 cells, in 43 min: 1.26 thread-hours, 0.278 s per step
(evaluations and compiles included), against 1.20 thread-hours and 0.282 s per step for the
same 20 cells in the rerun of 2026-11-25 on a Xeon of the same name. Two workers and their
compiles share the two cores, and a machine lent on another day is not the same machine: a
13% faster step measured alone is within that spread. On this Xeon the toys' step is also only
1.33x (GDN) and 1.51x (FwPKM) faster than the fp32 eager step of 279a062 (``bench_toys --before
279a062``; 2.04x and 2.30x on EPYC): its bf16 matmuls are slower than its fp32 ones. The whole
preset remains ~7.5 thread-hours here, ~3.8 h on two workers.

The same run resumed once more (2026-11-26, 07:06-08:43, nothing else on the cores; ``fwmlp/clip``
now out of the preset; each group's first cell still to run queued first, see ``parts``): 22 more
cells in 1.60 h, 58 of the preset's 72 in 6.56 thread-hours. The 14 left (seed 2 of nine groups),
counted at their seed-1 cells' wall time, add ~1.7: ~8.2 thread-hours, ~4 h on two workers on this
Xeon, where the published rows (AMD EPYC; MoM at its current speed, FWL at its Xeon rows') come to
~5.6 without ``fwmlp/clip``, ~2.8 h. So the 3-hour budget holds on the EPYC the rows were measured
on, by that estimate, and not on this Xeon, whose bf16 matmuls are slow: the precision is part of
every cell's config, and fp32 (~12% faster here, 1.3x slower on EPYC) would not close the gap.
Of the rerun's slice means, 64 of 78 lie inside the published 95% intervals (the 14 outside are
mostly cells with one or two rerun seeds against a zero-width published interval).

That run, finished (2026-11-26, 09:28-09:56: the last nine cells), holds all 72 cells of the
preset in 8.18 thread-hours, but it ran in seven segments, each with a compile cache of its own, so
most groups compiled their graphs cold once per segment: counted with one cold compile per group
(as one uninterrupted run pays), ~7.0-7.2 thread-hours. Bench runs now keep their compile cache in
the work dir (``memzoo.bench.run.compile_cache``), so a resumed run pays what one run pays. A new
timed run of this code with the bf16 products in fp32 (above; ``--out
leaderboards/reruns/standard-toys-2026-11-26-fp32gemm``, one uninterrupted segment from 10:25,
nothing else on the cores but the commands of this session's work) recorded its first 32 cells
(every MQAR group's first seed, the baseline's and the controls' six cells each, and the first AR
cells) in 2.51 thread-hours, where the same cells of the finished run took 3.13 (training alone:
1.83 against 2.39); their cold compiles averaged 116 s a cell, a warm cell's start and
evaluations 10 s. Counted at that training ratio (0.77) and those overheads, the 40 cells left
bring the preset to ~5.4 thread-hours, ~2.7 h on two workers: within the 3-hour budget on this
Xeon by that estimate, which its finished run will have to confirm. It did not: the same run
resumed after 9defac7 (its two fwmlp cells, made by the pass that broke FwMLP, dropped; 13:27-14:43,
every group compiling cold once more, the pass's cache key having changed) holds 56 cells in 5.53
thread-hours, 0.86 of the same cells' time in the finished run (training alone 0.80). The later
cells ran slower than the first 32 had (several trained to their caps where the finished run's
stopped early: cells train to convergence, so a cell's wall time follows its trajectory), and the
16 cells left project the preset to ~6.6-7.2 thread-hours, ~3.3-3.6 h on two workers: over the
3-hour budget on this Xeon, within it (~2.8 h) on the EPYC of the published rows.

Where that run's time went, counted as one uninterrupted run would pay (its 62 cells; the 10 it
lacks at the finished run's training time x 0.82; each group's first cell compiling cold once, a
simulation of the bench's queue on two workers): ~6.3 thread-hours, a 3.15-hour makespan. Of it
training 4.8 (77%), cold compiles 0.95 (15%: 12-360 s a group, Ba's task's three input shapes the
costliest, LaCT 356 s, MoM 361 s), evaluations ~0.35 (6%: fp32 eager, 1.3-2.9 s per validation of
an MQAR cell here). Since then the bf16-products pass widens a tensor once for all its views
(``Bf16GemmsInFp32``): 1.4-2.9% off the MQAR step, bit-identical losses; counted the same way,
~3.1 h, still over 3 h on this Xeon. Tried and not kept (one process at a time, fresh compile
cache; Intel Xeon, 2026-11-26): inductor's C++ wrapper (``cpp_wrapper``) was mixed (MoM's MQAR
step 410 -> 377 ms and LaCT's cold compile 223 -> 167 s, but FwPKM's compile 86 -> 108 s, Ba's
step 376 -> 405 ms, FWL's 508 -> 520); Ba's per-token step compiled as a graph of its own (the
rest of the layer's loop eager) made its step ~10% faster (385 -> 344 ms, another process
running) but added ~45 s to each cold compile: ~0.03 h off the preset. The toys' step on this
Xeon against the fp32 eager step of 279a062, with the pass (``bench_toys --before 279a062 --reps
2``, one thread per process, 2026-11-26): baseline 11,158-11,555 -> 17,767-18,441 tokens/s
(1.59x, 1.60x), FwPKM 7,853-7,931 -> 13,243-14,079 (1.69x, 1.78x): short of 2x here, where it
holds on EPYC (2.04x, 2.30x above). Rows now record ``compile_s`` (the first step of each input
shape) and ``eval_s`` (validation and test), and ``python -m memzoo.bench.experiments.reruns``
counts a run recorded in segments as one uninterrupted run on ``--jobs`` workers from them.
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


def _short_chunks() -> dict:
    """Update chunks of 8 tokens (four pairs) for every chunk-level read-then-write layer: each
    registered layer whose constructor takes a `chunk_size`, that does not read its own token's
    write (not `inclusive`) and is not in SEGMENTED; FwPKM and FwMLP with a memory per sequence."""
    from memzoo.registry import get_layer, layer_names

    out = {n: {"chunk_size": 8} for n in layer_names() if n not in SEGMENTED
           and "chunk_size" in inspect.signature(get_layer(n)).parameters and not get_layer(n).inclusive}
    for n in ("fwpkm", "fwmlp"):  # shared by the batch as the paper trains them; a memory per sequence here
        if n in out:
            out[n]["per_sequence"] = True
    return out


@dataclass
class Settings:
    tasks: list = field(default_factory=lambda: ["mqar"])
    widths: list = field(default_factory=lambda: [64])  # d_model of each model; >= 2 for a state curve
    n_layers: int = 2
    at: str = "last"  # where the memory layer goes ("last" = block 1 of 2)
    model: dict = field(default_factory=lambda: {"gdn_chunk": 16})  # backbone fields over the preset's; gdn_head_dim: fixed
    layer_options: dict = field(default_factory=_short_chunks)  # per layer, merged over the preset's
    variants: dict = field(default_factory=dict)  # extra rows: {name: {layer: L, options: {...}}}, run with L
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
    mqar_kv: list = field(default_factory=lambda: [2, 4, 8])
    power_a: float = 0.01
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
                mqar.check_sizes(n, self.mqar_seq_len, self.mqar_vocab)
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
        if self.precision not in ("fp32", "bf16"):
            raise ConfigError(f"toys.precision must be 'fp32' or 'bf16', got {self.precision!r}")
        if "mqar" in self.tasks and self.batch_size < len(self.mqar_kv):
            raise ConfigError(f"toys.batch_size={self.batch_size} cannot hold one sequence of each of the "
                              f"{len(self.mqar_kv)} mqar_kv counts")
        if any(not isinstance(w, int) or w < 1 for w in self.widths):
            raise ConfigError(f"toys.widths must be positive integers, got {self.widths}")
        for name, v in self.variants.items():
            if not isinstance(v, dict) or set(v) - {"layer", "options"} or v.get("layer") not in layer_names():
                raise ConfigError(f"toys.variants.{name} must be {{layer: <a registered layer>, options: {{...}}}}, got {v!r}")
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
    return ModelConfig.from_dict({**base, "layout": f"{mixers} | {layer}@{s.at}", "memory": {layer: opts}})


def state_size(model: HybridLM, seq_len: int) -> dict:
    """Recurrent state of one sequence, in numbers (call after a forward so every memory has
    its state): GDN matrices, memory fast weights, attention's keys and values at `seq_len`."""
    gdn = sum(b.mixer.h * b.mixer.d * b.mixer.d for b in model.blocks if b.kind == "GDN")
    kv = sum(2 * b.mixer.hkv * b.mixer.d * seq_len for b in model.blocks if b.kind in ("FA", "SWA", "FA-pSWA"))
    mem = sum(m.fast_weight_numel() for m in model.memories())
    shared = any(not m.per_sequence for m in model.memories())
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
            return tuple(mqar.make_batch(size, n, s.mqar_seq_len, s.mqar_vocab, s.power_a, g))
        b = ar.make_batch(size, n, g)  # the answer is the prediction at the last position (the query)
        t = torch.full_like(b.tokens, mqar.IGNORE)
        t[:, -1] = b.answer
        return b.tokens, t

    def batch(self, step: int, g: torch.Generator):
        s = self.s
        if self.name == "mqar":  # every kv count in each batch
            return tuple(mqar.mixed_batch(s.batch_size, self.slices, s.mqar_seq_len, s.mqar_vocab, s.power_a, g))
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
    config, setting = cell_config(mc, task, s, name), {"task": task, "d_model": width}
    return mc, config, setting, ctx.recorded(NAME, name, setting, config, seed)


def cells(layer: str, s: Settings) -> list[str]:
    """The models one layer's run trains: the layer and its variants, and with the baseline the
    controls."""
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
    target on the easiest slice in some seed, or the negative control above twice chance."""
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
            rec["steps (max)"] = f"{int(g['metrics.steps'].median())} ({int(g['metrics.steps'].max())})"
            stops = g["metrics.stop"].value_counts()
            rec["stop"] = ", ".join(f"{n} {k}" for k, n in sorted(stops.items()))
            rec["lr"] = ", ".join(sorted({f"{v:g}" for v in g["metrics.lr"]}))
            rec["state"] = int(g["metrics.state_size"].iloc[0])
            recs.append(rec)
    return pd.DataFrame(recs)


TITLES = {"mqar": ("MQAR test accuracy by key-value pairs", "kv"),
          "ar": ("Ba's associative retrieval test accuracy by pairs", "pairs")}


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
