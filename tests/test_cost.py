"""The cost suite (bench/suites/cost.py) and its FLOP counts (memzoo/flops.py).

Table 2's accounting against all 16 published rows; the full count's parts against explicit
counts: dense layers by hand, attention over an explicit mask, the chunked gated delta rule
matmul by matmul, the sparse gathers and scatters; and a micro run of the suite end to end.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import yaml

from memzoo.layout import parse_layout
import memzoo.backbone.attention as attention
from memzoo.backbone.attention import local_attention
from memzoo.backbone.model import HybridLM
from memzoo.bench.report import cost as cost_report
from memzoo.config import ModelConfig, load_config
from memzoo.flops import TABLE2_BATCH, TABLE2_SEQ_LEN, count_flops, step_flops, table2_flops, table2_params
from memzoo.ops.gated_delta_rule import gated_delta_rule_chunked
from memzoo.timing import Timing

TABLE2 = [b + t for b in ("gdn", "gdn-swa", "gdn-fa", "fa") for t in ("", "-pkm2-6-10", "-fwpkm2-6-10", "-pkm6-fwpkm2-10")]
TINY = dict(vocab_size=50, d_model=32, n_layers=2, ffn_dim=64, attn_heads=4, attn_kv_heads=2, attn_head_dim=8,
            gdn_heads=2, gdn_head_dim=16, gdn_chunk=16)


# ---- Table 2's accounting: 6 × (parameters but PKM's values) × 8 × 4096 tokens -----------------


@pytest.mark.parametrize("name", TABLE2)
def test_table2_flops_match_the_paper(name):
    rc = load_config(f"paper/{name}")
    ours = table2_flops(rc.model)
    paper = rc.paper["flops_t"] * 1e12
    assert abs(ours - paper) / paper < 0.05  # the acceptance bound
    assert abs(ours - paper) / paper < 0.0025  # what the accounting actually achieves (<= 0.07%)


def test_table2_counts_slow_weights_but_not_sparse_tables():
    """PKM's values are out, its sub-keys in; FwPKM's fast weights are buffers, not counted."""
    mc = ModelConfig(layout="GDN | PKM@0 + FwPKM@1", **TINY,
                     memory={"pkm": dict(key_dim=8, value_dim=8, heads=2, topk=2, n_subkeys=4),
                             "fwpkm": dict(key_dim=8, value_dim=8, topk=2, n_subkeys=4, chunk_size=8)})
    with torch.device("meta"):
        model = HybridLM(mc)
    pkm, fwpkm = model.memories()
    slow = sum(p.numel() for p in model.parameters())
    assert table2_params(model) == slow - pkm.values.numel()
    assert all(not any(b is p for p in model.parameters()) for b in fwpkm.state.values())
    assert table2_flops(mc, 2, 16) == 6 * (slow - pkm.values.numel()) * 32


# ---- the full count, part by part ------------------------------------------------------------


def test_dense_part_equals_a_hand_count():
    """Linear layers and the tied head cost 6 FLOPs per weight and token (forward 2, backward 4);
    the depthwise short convolutions 6 per weight and output position (FlopCounterMode's own
    conv backward formula ignores groups; ours does not)."""
    mc = ModelConfig(layout="GDN", **TINY)
    B, T = 2, 32
    with torch.device("meta"):
        model = HybridLM(mc)
    lin = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head = model.embed.weight.numel()
    conv = sum(p.numel() for n, p in model.named_parameters() if n.endswith("_conv"))
    f = step_flops(mc, B, T)
    assert f.dense == 6 * B * T * (lin + head + conv)
    assert f.attention == 0 and f.table2 == 6 * B * T * table2_params(model)
    assert f.sparse == B * T * mc.d_model  # the token embedding's backward scatter


def test_flop_counter_on_a_dense_model_equals_a_hand_count():
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(5, 7, 16, requires_grad=True)
    ops, _ = count_flops(lambda: net(x).sum().backward())
    weights = 16 * 32 + 32 * 8
    assert sum(ops.values()) == 6 * 5 * 7 * weights


def _pairs(T: int, window: int | None) -> int:
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    mask = k <= q
    if window is not None:
        mask &= q - k < window
    return int(mask.sum())


@pytest.mark.parametrize("layout, window", [("FA", None), ("SWA", 12), ("GDN+SWA", 12)])
def test_attention_counts_the_pairs_the_mask_keeps(layout, window):
    """Attention = 3 × (2 · B · query heads · (d_qk + d_v)) per kept (query, key) pair, the
    pairs counted from an explicit causal / sliding-window mask; the SDPA math path that runs
    on meta (a full T × T product) is not counted on top."""
    B, T = 2, 40
    mc = ModelConfig(layout=layout, **{**TINY, "n_layers": 4}, window=window or 512)
    f = step_flops(mc, B, T)
    n_attn = sum(1 for k in parse_layout(mc.layout, mc.n_layers).mixers if k != "GDN")
    d = mc.attn_head_dim
    assert f.attention == n_attn * 3 * 2 * B * mc.attn_heads * _pairs(T, window) * (d + d)
    if layout != "GDN+SWA":
        assert f.contractions == 0  # nothing else in an attention-only model is a batched matmul


def _gdn_hand_count(Bh: int, T: int, C: int, K: int, V: int, backward: bool) -> int:
    """The chunked algorithm's products per chunk (memzoo.ops.gated_delta_rule): k kᵀ and q kᵀ
    (C × C × K each), the unit-triangular solve for (I + A)⁻¹ (C(C-1) per right-hand side, C of
    them) and its product with [V | K] (C × C × (V+K)), W h and kᵀ u in the state loop, q h and
    P U for the outputs. Backward: two products per product, and for the solve another solve
    plus a C × C × C product."""
    fwd = 4 * C * C * K + C * (C - 1) * C + 2 * C * C * (V + K) + 6 * C * K * V + 2 * C * C * V
    bwd = 8 * C * C * K + C * (C - 1) * C + 2 * C * C * C + 4 * C * C * (V + K) + 12 * C * K * V + 4 * C * C * V
    return Bh * (T // C) * (fwd + (bwd if backward else 0))


def test_gdn_recurrence_count_matches_the_algorithm():
    B, T, H, K, V, C = 2, 32, 3, 4, 6, 8
    gen = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g, beta = -torch.rand(B, T, H, generator=gen), torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen)
    with torch.no_grad():
        ops, _ = count_flops(gated_delta_rule_chunked, q, k, v, g, beta, initial_state=h0, chunk_size=C)
    assert sum(ops.values()) == _gdn_hand_count(B * H, T, C, K, V, backward=False)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]

    def step():
        o, S = gated_delta_rule_chunked(*leaves[:5], initial_state=leaves[5], output_final_state=True, chunk_size=C)
        (o.sum() + S.sum()).backward()

    ops, _ = count_flops(step)
    assert sum(ops.values()) == _gdn_hand_count(B * H, T, C, K, V, backward=True)


def test_sparse_formulas():
    """Embedding bag: 2 FLOPs per index and feature forward, and again for each backward half;
    index_add: one add per source element."""
    w = torch.randn(100, 16, requires_grad=True)
    idx = torch.randint(0, 100, (10, 4))
    psw = torch.rand(10, 4, requires_grad=True)
    ops, _ = count_flops(lambda: F.embedding_bag(idx, w, per_sample_weights=psw, mode="sum").sum().backward())
    assert sum(ops.values()) == 3 * 2 * 40 * 16
    ops, _ = count_flops(lambda: torch.zeros(100, 16).index_add_(0, idx.flatten(), torch.randn(40, 16)))
    assert sum(ops.values()) == 40 * 16


def test_memory_layers_count_on_meta_and_leave_nothing_patched():
    """PKM and FwPKM use data-dependent ops (bincount, unique) that have no meta kernel; they
    count anyway, their sparse reads and writes included, and the counting leaves torch as it was."""
    sdpa = F.scaled_dot_product_attention
    mc = ModelConfig(layout="GDN+SWA | PKM@0 + FwPKM@1", **{**TINY, "n_layers": 4}, window=8,
                     memory={"pkm": dict(key_dim=8, value_dim=8, heads=2, topk=2, n_subkeys=4),
                             "fwpkm": dict(key_dim=8, value_dim=8, topk=2, n_subkeys=4, chunk_size=8)})
    f = step_flops(mc, 2, 16)
    assert f.sparse > 2 * 16 * mc.d_model and f.contractions > 0 and f.attention > 0
    assert f.total > f.table2
    assert F.scaled_dot_product_attention is sdpa and attention.local_attention is local_attention
    with pytest.raises(NotImplementedError):
        torch.bincount(torch.zeros(3, dtype=torch.long, device="meta"))


# ---- the suite ---------------------------------------------------------------------------------


def test_run_records_rows_tables_and_figure(tmp_path):
    from memzoo.bench.suites import cost
    from memzoo.bench.common import BASELINE, Context, Recorder, load_preset
    from memzoo.bench.report import frame

    mc = {"layout": "GDN", "vocab_size": 50, "d_model": 32, "n_layers": 2, "ffn_dim": 64,
          "gdn_heads": 2, "gdn_head_dim": 16}
    cfg = tmp_path / "mini.yaml"
    cfg.write_text(yaml.safe_dump({"paper": {"params_m": 0.05, "flops_t": 1.0}, "model": mc}))
    preset = tmp_path / "micro.yaml"
    preset.write_text(yaml.safe_dump({
        "model": mc,
        "layers": {"fwpkm": {"at": "1", "options": {"key_dim": 8, "value_dim": 8, "n_subkeys": 4, "topk": 2,
                                                    "chunk_size": 8}}},
        "cost": {"batch": 2, "seq_len": 16, "warmup": 0, "steps": 1, "configs": [str(cfg)]},
    }))
    ctx = Context(load_preset(preset), 0, Recorder(tmp_path, "micro", 0), tmp_path / "work", progress=False)
    rows = cost.run(ctx, [BASELINE, "fwpkm"])
    assert [r["layer"] for r in rows] == [BASELINE, "fwpkm", str(cfg)]
    for r in rows:
        m = r["metrics"]
        assert m["flops_full"] > m["flops_table2"] > 0 and m["step_shape"] == "2x16"
        assert m["samples_per_s"] > 0 and 0 < m["mfu"] <= 1 and math.isclose(m["tokens_per_s"], 16 * m["samples_per_s"])
        assert m["step_spread"] >= 0 and m["threads"] == torch.get_num_threads()
    paper = rows[-1]["metrics"]
    assert rows[-1]["setting"] == {"config": str(cfg), "batch": 2, "seq_len": 16}
    assert paper["params_paper"] == 0.05e6 and "params_diff_pct" in paper
    assert "flops_table2_paper" not in paper  # the paper's FLOPs are for 8 × 4096 tokens only
    df = frame(rows)
    tabs = cost_report.tables(df)
    assert len(tabs) == 2
    layer_table = tabs[next(t for t in tabs if t.startswith("Cost per layer"))]
    assert list(layer_table.index) == [BASELINE, "fwpkm"]
    paths = cost_report.figures(df, tmp_path / "fig")
    assert [p.name for p in paths] == ["cost.png"]
    first = paths[0].read_bytes()
    assert cost_report.figures(df, tmp_path / "fig")[0].read_bytes() == first  # deterministic


def test_settings_reject_unknown_keys_and_paper_preset_lists_table2():
    from memzoo.bench.suites import cost
    from memzoo.bench.common import load_preset
    from memzoo.config import ConfigError

    s = load_preset("paper").settings(cost.NAME, cost.Settings)
    assert (s.batch, s.seq_len) == (TABLE2_BATCH, TABLE2_SEQ_LEN) and not s.cpu_throughput
    assert s.configs == [f"paper/{n}" for n in TABLE2]
    assert load_preset("tiny").settings(cost.NAME, cost.Settings) == cost.Settings()
    with pytest.raises(ConfigError, match="unknown key 'tokens'"):
        from memzoo.config import parse_strict

        parse_strict(cost.Settings, {"tokens": 3}, "cost")


def test_an_unknown_integer_read_on_meta_is_a_clear_error():
    with pytest.raises(RuntimeError, match="meta_scalar"):
        count_flops(lambda: int(torch.ones(3, dtype=torch.long, device="meta").sum()))
    ops, value = count_flops(lambda: torch.ones(3, device="meta").mean().item())  # a statistic: 0
    assert value == 0.0


def test_time_fn_times_about_reps_calls_after_the_warmup():
    import time

    from memzoo.timing import Timing, time_fn

    calls = []
    t = time_fn(lambda: (calls.append(1), time.sleep(0.02)), warmup=2, reps=3)
    # 2 warm-up calls, torch.utils.benchmark's own untimed one, then ~3 timed runs (blocks of
    # calls where the timer's overhead would show: not for 20 ms sleeps on an idle machine)
    assert t.times and len(calls) >= 3 + len(t.times)
    assert 0.019 < t.min <= t.median <= max(t.times)
    q = Timing((4.0, 1.0, 3.0, 2.0))
    assert (q.median, q.mean, q.min, q.quantile(0.0), q.quantile(1.0), q.quantile(1 / 3)) == (2.5, 2.5, 1.0, 1.0, 4.0, 2.0)


def test_a_step_faster_than_the_measured_peak_is_an_error_not_an_mfu_above_one(monkeypatch):
    # a row timed beside a busy worker published 113.6% MFU: the peak and the step must share conditions
    from memzoo.bench.suites import cost
    from memzoo.config import ModelConfig, TrainConfig

    monkeypatch.setattr(cost, "matmul_peak", lambda device="cpu", repeats=5: 1.0)  # 1 FLOP/s: any step outruns it
    mc = ModelConfig.from_dict({"layout": "GDN", "vocab_size": 50, "d_model": 32, "n_layers": 2, "ffn_dim": 64,
                                "gdn_heads": 2, "gdn_head_dim": 16})
    with pytest.raises(RuntimeError, match="exceed the matmul peak measured beside it"):
        cost.measure(mc, TrainConfig(), cost.Settings(batch=2, seq_len=16, warmup=0, steps=1), "cpu", 0, True)


def test_a_layer_is_timed_in_rounds_paired_with_the_baseline(monkeypatch):
    """On a CPU the layer's model and the baseline's take turns, round by round, and the row's ratio
    to the baseline is against the baseline's steps of those rounds."""
    from memzoo.bench.suites import cost
    from memzoo.config import TrainConfig

    order = []
    real = cost.training_step

    def traced(mc, *a, **kw):
        step, name = real(mc, *a, **kw), "layer" if "linear" in mc.layout else "baseline"
        return lambda: (order.append(name), step())[1]

    monkeypatch.setattr(cost, "training_step", traced)
    monkeypatch.setattr(cost, "time_fn", lambda fn, warmup, reps, device: (fn(), fn(), Timing((0.5, 0.5)))[2])
    monkeypatch.setattr(cost, "matmul_peak", lambda device="cpu", repeats=5: 1e18)
    base = ModelConfig.from_dict({"layout": "GDN", "vocab_size": 50, "d_model": 32, "n_layers": 2, "ffn_dim": 64,
                                  "gdn_heads": 2, "gdn_head_dim": 16})
    mc = ModelConfig.from_dict({**base.to_dict(), "layout": "GDN | linear@1"})
    s = cost.Settings(batch=2, seq_len=16, warmup=1, steps=1, rounds=3)
    m = cost.measure(mc, TrainConfig(), s, "cpu", 0, True, beside=(base, TrainConfig()))
    assert order == ["layer", "baseline"] + ["layer", "layer", "baseline", "baseline"] * 3  # warm-up, then rounds in turn
    assert m["timed_steps"] == 6 and m["step_s"] == m["baseline_step_s_beside"] == 0.5
    assert m["baseline_flops_per_s_beside"] == pytest.approx(step_flops(base, 2, 16).total / 0.5)


def test_a_noisy_timing_is_retimed_then_marked_and_kept_out_of_the_ratios(monkeypatch):
    """Noise injected: a busy core beside the timing (a spread of
    the steps far above the threshold) makes the row retimed RETIMES times and, still noisy, marked; its ratio columns
    are blank and the reading note names it. A quiet timing is taken once and marks nothing; a
    peak below half the run's median peak is noise too."""
    from memzoo.bench.report import cost as report
    from memzoo.bench.report import frame
    from memzoo.bench.suites import cost
    from memzoo.config import TrainConfig

    mc = ModelConfig.from_dict({"layout": "GDN", "vocab_size": 50, "d_model": 32, "n_layers": 2, "ffn_dim": 64,
                                "gdn_heads": 2, "gdn_head_dim": 16})
    s = cost.Settings(batch=2, seq_len=16, warmup=0, steps=1)
    calls = []

    def timed(spread):
        def fake(*a, **kw):
            calls.append(spread)
            return {"step_s": 0.5, "step_spread": spread, "timed_steps": 3}
        return fake

    monkeypatch.setattr(cost, "matmul_peak", lambda device="cpu", repeats=5: 1e18)
    monkeypatch.setattr(cost, "_PEAKS", [])
    monkeypatch.setattr(cost, "time_training_step", timed(1.295))
    busy = cost.measure(mc, TrainConfig(), s, "cpu", 0, True)
    assert len(calls) == 1 + cost.RETIMES and busy["timings"] == 3 and busy["noisy"] == "step spread 130% > 25%"
    calls.clear()
    monkeypatch.setattr(cost, "time_training_step", timed(0.05))
    quiet = cost.measure(mc, TrainConfig(), s, "cpu", 0, True)
    assert len(calls) == 1 and quiet["timings"] == 1 and "noisy" not in quiet
    assert cost.noise(0.05, 1e11, [4e11, 4e11, 3.9e11]) == "matmul peak 100 < half the run's median 400 GFLOP/s"
    assert cost.noise(0.05, 3.5e11, [4e11, 4e11, 3.9e11]) == ""

    rows = [{"suite": "cost", "preset": "tiny", "layer": name, "setting": {}, "seed": 0, "metrics": m}
            for name, m in (("baseline", quiet), ("fwpkm", busy), ("mom", quiet))]
    t = report.tables(frame(rows))["Cost per layer: parameters, FLOPs of one training step, measured throughput"]
    ratio = next(c for c in t.columns if c.startswith("× baseline"))
    assert t.loc["fwpkm", ratio] != t.loc["fwpkm", ratio] and t.loc["mom", ratio] == 1.0  # NaN: left out
    assert t.loc["fwpkm", "timing"] == "noisy: step spread 130% > 25%" and t.loc["mom", "timing"] == ""
    assert report.reading(frame(rows)) == ["fwpkm: a noisy timing (step spread 130% > 25%), kept out of the ratio columns"]


def test_the_bench_times_cost_rows_alone_before_any_worker(tmp_path):
    from memzoo.bench.common import Context, Recorder, load_preset
    from memzoo.bench.run import ALONE, plan

    ctx = Context(load_preset("tiny"), 0, Recorder(tmp_path, "tiny", 0), tmp_path / "work", progress=False)
    jobs = plan(ctx, ["baseline", "fwpkm"], ["cost", "ppl", "niah"])
    assert ALONE == ("cost",) and sorted(j.layer for j in jobs if j.suites == ("cost",)) == ["baseline", "fwpkm"]
    assert all("cost" not in j.suites for j in jobs if j.suites != ("cost",))  # never bundled with a training job
