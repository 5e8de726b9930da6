"""Tests for the toys suite: the MQAR generator (zoology's multiquery_ar semantics) and a
micro run of bench/suites/toys/ (training, rows, tables, figures)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

import memzoo.layers  # noqa: F401  (registers the layers)
from memzoo.bench.suites import toys
from memzoo.bench.report import toys as toys_report
from memzoo.backbone.model import HybridLM
from memzoo.bench.common import BASELINE, CONTROLS, POSITIVE, Context, Recorder, load_preset, mean_ci
from memzoo.config import ConfigError
from memzoo.data import mqar


def _batch(seed=0, B=64, n=4, T=32, V=64, **kw):
    return mqar.make_batch(B, n, T, V, generator=torch.Generator().manual_seed(seed), **kw)


# ---- MQAR data -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3, 8])
def test_mqar_labels_are_the_queried_keys_values(n):
    b = _batch(n=n, T=32, V=64)
    assert b.inputs.shape == b.targets.shape == (64, 32)
    for x, y in zip(b.inputs.tolist(), b.targets.tolist()):
        pairs = dict(zip(x[0 : 2 * n : 2], x[1 : 2 * n : 2]))
        labelled = [t for t, v in enumerate(y) if v != mqar.IGNORE]
        assert len(labelled) == n  # every key is asked exactly once
        assert sorted(x[t] for t in labelled) == sorted(pairs)
        for t in labelled:
            assert t >= 2 * n and (t - 2 * n) % 2 == 0  # after the pairs, at even offsets
            assert y[t] == pairs[x[t]]  # the value of the queried key
        assert all(v == mqar.IGNORE for v in y[: 2 * n])


def test_mqar_keys_and_values_come_from_the_two_halves():
    n, V = 6, 64
    b = _batch(n=n, T=32, V=V, B=128)
    keys, values = b.inputs[:, 0 : 2 * n : 2], b.inputs[:, 1 : 2 * n : 2]
    assert keys.min() >= 1 and keys.max() < V // 2  # 0 is zoology's placeholder, never a key
    assert values.min() >= V // 2 and values.max() < V
    for row in (keys, values):
        assert all(len(set(r)) == n for r in row.tolist())  # distinct within a sequence
    # filler: random tokens from the whole vocabulary; zeros only with random_fill=False
    assert b.inputs.min() >= 0 and b.inputs.max() < V
    plain = _batch(n=n, T=32, V=V, B=128, random_fill=False)
    free = (plain.targets == mqar.IGNORE) & (torch.arange(32) >= 2 * n)
    assert (plain.inputs[free] == 0).all() and (b.inputs[free] != 0).any()
    assert torch.equal(plain.targets, b.targets)


def test_mqar_is_deterministic_given_the_generator():
    a, b, c = _batch(seed=3), _batch(seed=3), _batch(seed=4)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, c.inputs)


def test_mqar_power_law_spacing():
    """a = 0.01 puts most queries right after the pairs; a = 1 spreads them uniformly."""
    p = mqar.power_law(16, 0.01)
    assert p.sum().item() == pytest.approx(1.0) and (p[:-1] > p[1:]).all()
    assert torch.allclose(mqar.power_law(8, 1.0), torch.full((8,), 1 / 8, dtype=torch.float64))

    def first_gap(a):
        b = mqar.make_batch(512, 1, 64, 256, a, torch.Generator().manual_seed(0))
        return ((b.targets != mqar.IGNORE).float().argmax(1) - 2).float() / 2

    assert first_gap(0.01).mean() < 0.6 * first_gap(1.0).mean()
    assert first_gap(1.0).mean().item() == pytest.approx(15, abs=2)  # uniform on 0..30


def test_mqar_sizes_are_checked():
    with pytest.raises(ValueError, match="seq_len >= 4"):
        mqar.make_batch(2, 9, 32, 64)
    with pytest.raises(ValueError, match="even"):
        mqar.make_batch(2, 2, 31, 64)
    with pytest.raises(ValueError, match="key tokens"):
        mqar.make_batch(2, 8, 64, 16)
    with pytest.raises(ValueError, match="power_a"):
        mqar.make_batch(2, 2, 16, 32, power_a=0.0)


def test_mqar_gap_puts_every_query_beyond_it():
    """With gap g every query sits at 2n + g or later, at an even position, so it lies at least
    g + 1 tokens after its pair's value; gap 0 is zoology's generator, draw for draw."""
    n, g = 4, 8
    b = _batch(n=n, T=40, V=64, gap=g)
    for x, y in zip(b.inputs, b.targets):
        q = (y != mqar.IGNORE).nonzero().flatten()
        assert len(q) == n and (q >= 2 * n + g).all() and (q % 2 == 0).all()
        for t in q.tolist():
            (k,) = (x[: 2 * n : 2] == x[t]).nonzero().flatten().tolist()
            assert x[2 * k + 1] == y[t] and t - (2 * k + 1) >= g + 1
    assert torch.equal(_batch(gap=0).inputs, _batch().inputs) and torch.equal(_batch(gap=0).targets, _batch().targets)
    with pytest.raises(ValueError, match="gap must be an even int"):
        mqar.make_batch(2, 4, 32, 64, gap=3)
    with pytest.raises(ValueError, match=r"4 \* n_kv \+ gap = 24"):
        mqar.make_batch(2, 4, 22, 64, gap=8)
    m = mqar.mixed_batch(6, [1, 2], 20, 32, generator=torch.Generator().manual_seed(0), gap=8)
    assert ((m.targets != mqar.IGNORE).nonzero()[:, 1] >= 10).all()


def test_mqar_mixed_batch_and_accuracy():
    b = mqar.mixed_batch(10, [1, 2, 4], 16, 32, generator=torch.Generator().manual_seed(0))
    counts = (b.targets != mqar.IGNORE).sum(1).tolist()
    assert counts == [1] * 4 + [2] * 3 + [4] * 3
    logits = torch.nn.functional.one_hot(b.targets.clamp(min=0), 32).float()
    assert mqar.accuracy(logits, b.targets) == 1.0
    logits[0, :, :] = 0.0  # row 0's single query now predicts token 0
    assert mqar.accuracy(logits, b.targets) == pytest.approx(1 - 1 / sum(counts))


# ---- the suite -----------------------------------------------------------------------------

MICRO = {
    "tasks": ["mqar", "ar"],
    "widths": [16, 24],
    "seeds": 2,
    "lrs": [1e-2, 3e-2],
    "max_steps": 6,
    "eval_every": 3,
    "warmup": 1,
    "batch_size": 6,
    "val_size": 12,
    "test_size": 12,
    "mqar_kv": [1, 2],
    "mqar_seq_len": 16,
    "mqar_vocab": 32,
    "ar_pairs": [2],
    "route": "hybrid",  # with Ba's task: the memory-only route is MQAR's
    "model": {"gdn_chunk": 16, "layout": "GDN"},
    "mqar_gap": 0,
}


def _ctx(tmp_path, resume=False, **over):
    preset = load_preset("tiny")
    preset.suites["toys"] = {**MICRO, **over}
    rec = Recorder(tmp_path, preset.name, 0, run_id="test")
    return Context(preset=preset, seed=0, recorder=rec, work_dir=tmp_path / "work", progress=False, resume=resume)


def test_defaults_are_the_common_base_and_the_main_job_looks_its_lrs_up():
    assert load_preset("_base").settings("toys", toys.Settings) == toys.Settings()
    load_preset("paper").settings("toys", toys.Settings).check()
    tiny = load_preset("tiny").settings("toys", toys.Settings)
    tiny.check()
    # the main job copies no lr from a row: it names the preset whose rows it looks them up in
    assert tiny.lr_of == ["recall"] and not tiny.layer_lrs and not tiny.lr_from
    assert toys.Settings().origin("mom") == "one lr given"
    assert toys.Settings(lrs=[1e-3, 3e-3]).origin("mom") == "chosen on validation among 2"
    # what the main job chooses for itself stays out of the presets based on the common base
    for name in ("recall", "capacity"):
        s = load_preset(name).settings("toys", toys.Settings)
        assert not s.lr_from and not s.lr_of and "mom" not in s.layer_lrs, name
    # the standard preset's memories look theirs up in the recall rows; its baseline and controls are this
    # backbone, not recall's (another route), so they keep the preset's lrs
    std = load_preset("standard").settings("toys", toys.Settings)
    assert std.lr_of == ["recall"] and not std.layer_lrs and std.route == "hybrid"
    assert all(std.candidates(c) == std.lrs for c in (BASELINE, *CONTROLS))
    assert std.origin("mom").startswith("the lr recall's rows chose")
    assert tiny.origin(POSITIVE).startswith("the lr recall's rows chose")  # the main job: recall's route
    with pytest.raises(ConfigError, match="lr_from: unknown layer"):
        toys.Settings(lr_from={"nosuch": "x"}).check()


def test_the_main_job_plans_the_lr_its_published_rows_chose_and_follows_a_new_row(tmp_path, monkeypatch):
    """A row changed in the results file changes the lr the main job's plan trains a layer at, and the
    cell's config (and hash) with it; a layer whose rows chose none takes the lr chosen most often."""
    from memzoo.bench.suites.toys import lr as toys_lr
    from memzoo.bench.suites.toys.plan import cell_config
    from memzoo.bench.suites.toys.models import toy_config

    def publish(mom_lr):
        rows = [_recall_row("mom", seed, mom_lr) for seed in range(3)]
        rows += [_recall_row(m, seed, 1e-3) for m in ("deltanet", "linear") for seed in range(3)]
        rows += [_recall_row("fwpkm", seed, 3e-2, acc=0.03) for seed in range(3)]  # at chance: chose none
        (tmp_path / "leaderboards").mkdir(exist_ok=True)
        (tmp_path / "leaderboards" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        toys_lr.published_choice.cache_clear()
        toys_lr.most_chosen.cache_clear()

    def planned(layer):
        s = load_preset("tiny").settings("toys", toys.Settings)
        mc = toy_config(load_preset("tiny"), layer, 64, toys.TASK_TYPES["mqar"].vocab_of(s), s)
        return cell_config(mc, "mqar", s, layer)["lrs"], s.origin(layer)

    monkeypatch.chdir(tmp_path)
    try:
        publish(3e-4)
        assert planned("mom") == ([3e-4], "the lr recall's rows chose (0.0003)")
        assert planned("fwpkm") == ([1e-3], "the lr recall's rows chose most often (0.001; none chose one for fwpkm)")
        publish(1e-2)  # a new row of each seed: the plan follows it
        assert planned("mom") == ([1e-2], "the lr recall's rows chose (0.01)")
    finally:
        toys_lr.published_choice.cache_clear()
        toys_lr.most_chosen.cache_clear()


def _recall_row(layer, seed, lr, acc=0.9):
    return {"suite": "toys", "preset": "recall", "layer": layer, "seed": seed, "setting": {"task": "mqar", "d_model": 64},
            "metrics": {"lr": lr, "accuracy": acc, "chance": 0.03, "lr_chosen": acc > 0.06, "stop": "capped"},
            "config": {}, "config_hash": "h", "run_id": "r", "time": "2026-12-01T00:00:00Z"}


def test_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'speed'"):
        _ctx(tmp_path, speed=1).preset.settings("toys", toys.Settings)
    with pytest.raises(ConfigError, match="mqar_kv"):
        toys.Settings(mqar_kv=[5], mqar_seq_len=16).check()
    with pytest.raises(ConfigError, match="unknown layer"):
        toys.Settings(layer_options={"fwpmk": {}}).check()
    with pytest.raises(ConfigError, match="variants.x must be"):
        toys.Settings(variants={"x": {"layer": "nope"}}).check()
    with pytest.raises(ConfigError, match="variants.x.widths must be positive integers"):
        toys.Settings(variants={"x": {"layer": "fwl", "widths": [0]}}).check()
    with pytest.raises(ConfigError, match="layer_lrs: unknown layer"):
        toys.Settings(layer_lrs={"fwpmk": [1e-3]}).check()
    with pytest.raises(ConfigError, match="toys.model: unknown backbone field"):
        toys.Settings(model={"d_modle": 3}).check()
    with pytest.raises(ConfigError, match="precision"):
        toys.Settings(precision="fp16").check()


def test_toy_config_places_the_layer_and_merges_options():
    preset, s = load_preset("tiny"), toys.Settings(variants={"fwpkm/seq": {"layer": "fwpkm", "options": {"per_sequence": True}}})
    mc = toys.toy_config(preset, "fwpkm", 64, 32, s)
    assert (mc.d_model, mc.n_layers, mc.vocab_size, mc.gdn_head_dim, mc.ffn_dim, mc.gdn_chunk) == (64, 2, 32, 16, 192, 16)
    assert mc.layout == "SWA | fwpkm@last" and mc.window == 4  # the default: the memory the only route
    assert mc.memory["fwpkm"] == {**preset.layers["fwpkm"].options, "chunk_size": 8, "per_sequence": True}
    assert toys.toy_config(preset, BASELINE, 32, 37, s).memory == {}
    v = toys.toy_config(preset, "fwpkm/seq", 64, 32, s)
    assert v.layout == "SWA | fwpkm@last" and v.memory["fwpkm"] == {**mc.memory["fwpkm"], "per_sequence": True}
    at0 = toys.Settings(variants={"fwpkm/first": {"layer": "fwpkm", "at": "0", "options": {"before_mixer": True}}})
    first = toys.toy_config(preset, "fwpkm/first", 64, 32, at0)
    assert first.layout == "SWA | fwpkm@0" and first.memory["fwpkm"]["before_mixer"] is True
    pos, neg = toys.toy_config(preset, POSITIVE, 32, 37, s), toys.toy_config(preset, toys_report.NEGATIVE, 32, 37, s)
    assert (pos.layout, pos.attn_conv, pos.memory) == ("FA", preset.backbone.get("gdn_conv", 4), {})
    assert (neg.layout, neg.memory) == ("NONE", {})


def test_fwl_keeps_a_segment_longer_than_the_toy_sequences():
    """The chunk-level layers get chunks of four pairs; FWL, which reads the earlier positions of
    its own chunk (Eq. 2), keeps a chunk that holds a whole toy sequence (one segment). LaCT keeps
    fast-weight heads of 32 at the default width 64 (2 heads)."""
    default = toys.Settings().layer_options
    assert default["lact"] == {"chunk_size": 8, "num_heads": 2} and "fwl" not in default
    for name in ("tiny", "standard", "paper"):
        preset = load_preset(name)
        s = preset.settings(toys.NAME, toys.Settings)
        assert s.layer_options["lact"]["chunk_size"] == 8
        longest = max(s.mqar_seq_len, 2 * max(s.ar_pairs) + 3)
        assert toys.toy_config(preset, "fwl", s.widths[0], 64, s).memory["fwl"]["chunk_size"] >= longest, name


def test_reach_of_a_backbone_by_hand():
    """Stacked sliding windows of 4 reach 3 tokens back per block; a short convolution of 4 on
    q, k, v three more; no mixer none; a GDN or full attention every token."""
    from memzoo.config import ModelConfig

    def mc(**kw):
        return ModelConfig.from_dict({"d_model": 16, "n_layers": 2, "attn_heads": 2, "attn_kv_heads": 2,
                                      "attn_head_dim": 8, **kw})

    assert toys.reach(mc(layout="SWA", window=4)) == 6
    assert toys.reach(mc(layout="SWA", window=4, attn_conv=4)) == 12
    assert toys.reach(mc(layout="NONE")) == 0
    assert toys.reach(mc(layout="GDN")) is None and toys.reach(mc(layout="FA")) is None


def test_state_of_a_sliding_window_is_its_window():
    """A window of 4 keeps the keys and values of its last 4 tokens, whatever the length: 2 blocks
    x (k, v) x 2 kv heads x head 16 x 4; PKM has no fast weights, so nothing of it is shared."""
    preset, s = load_preset("tiny"), toys.Settings()
    for name, mem in ((BASELINE, 0), ("pkm", 0)):
        model = HybridLM(toys.toy_config(preset, name, 64, 64, s))
        model(torch.zeros(2, 32, dtype=torch.long))
        st = toys.state_size(model, 32)
        assert (st["kv_cache"], st["mem_state"], st["state_shared"]) == (2 * 2 * 2 * 16 * 4, mem, False)


def test_memory_route_is_checked_against_the_backbones_reach():
    """route: memory refuses a backbone that reaches a query's pair without the memory; the tiny
    preset's cells (windows of 4 in 2 blocks, reach 6; gap 8) pass, the attention control is exempt."""
    preset = load_preset("tiny")
    s = preset.settings(toys.NAME, toys.Settings)
    assert s.route == "memory" and s.mqar_gap == 8
    for name in ("fwpkm", "pkm", "mom", BASELINE, *CONTROLS):
        toys.check_route(toys.toy_config(preset, name, 64, 64, s), name, s)
    short = toys.Settings(mqar_gap=4)
    with pytest.raises(ConfigError, match="reaches 6 tokens back, but a query may lie 5 tokens after its pair"):
        toys.check_route(toys.toy_config(preset, "fwpkm", 64, 64, short), "fwpkm", short)
    gdn = toys.Settings(model={"gdn_chunk": 16, "layout": "GDN"})
    with pytest.raises(ConfigError, match="reaches every token back"):
        toys.check_route(toys.toy_config(preset, BASELINE, 64, 64, gdn), BASELINE, gdn)
    with pytest.raises(ConfigError, match="route=memory needs toys.tasks"):
        toys.Settings(tasks=["mqar", "ar"]).check()
    hybrid = toys.Settings(route="hybrid", model={"gdn_chunk": 16, "layout": "GDN"})
    toys.check_route(toys.toy_config(preset, BASELINE, 64, 64, hybrid), BASELINE, hybrid)  # no limit on the hybrid


def test_memory_route_makes_models_without_fast_weights_negative_controls():
    """Under route: memory the backbone alone and PKM (no fast weights: mem_state 0) must stay
    within twice chance on every slice, else the harness is invalid; a fast-weight memory may
    recall. Seeds that leave chance are counted beside each mean."""
    def rows(base_acc):
        out = []
        for layer, acc, mem in ((BASELINE, base_acc, 0), ("pkm", 0.25, 0), ("fwpkm", 0.9, 64), (POSITIVE, 1.0, 0),
                                (toys_report.NEGATIVE, 0.25, 0)):
            for seed in range(3):
                r = _row(layer, seed, acc if layer != "fwpkm" or seed else 0.25)
                r["setting"]["route"] = "memory"
                r["metrics"]["mem_state"] = mem
                out.append(r)
        return pd.json_normalize(out)

    ok = rows(0.25)
    assert toys_report.validity(ok, "mqar") == []
    title, table = next(iter(toys_report.tables(ok).items()))
    assert title == "MQAR test accuracy by key-value pairs" + toys_report.MEMORY_ROUTE
    left = dict(zip(table["layer"], table["left chance"]))
    assert left == {BASELINE: "0/3", "fwpkm": "2/3", "pkm": "0/3", POSITIVE: "3/3", toys_report.NEGATIVE: "0/3"}
    bad = rows(0.6)  # the backbone recalls: it reaches past the memory
    assert toys_report.validity(bad, "mqar") == [
        f"{BASELINE}, which has no fast weights, recalls 0.600 at kv={k}, d=16: above twice chance (0.250), so the "
        f"backbone reaches past the memory" for k in (2, 4)]
    assert next(iter(toys_report.tables(bad))).startswith("HARNESS INVALID for mqar")
    hybrid = bad.drop(columns=["setting.route"])  # the hybrid view: the backbone may recall
    assert toys_report.validity(hybrid, "mqar") == []


def test_toy_config_keeps_a_set_gdn_head_size():
    """The backbone's head size scales with the width unless `toys.model` sets one (the capacity
    preset's small GDN state: 4 heads of 16 at width 128, 2 x 4 x 16² = 2048 numbers)."""
    preset = load_preset("tiny")
    assert toys.toy_config(preset, BASELINE, 128, 64, toys.Settings()).gdn_head_dim == 128 // 4
    s = toys.Settings(model={"gdn_chunk": 16, "gdn_head_dim": 16})
    mc = toys.toy_config(preset, BASELINE, 128, 64, s)
    assert (mc.gdn_heads, mc.gdn_head_dim) == (4, 16)
    model = HybridLM(mc)
    model(torch.zeros(2, 16, dtype=torch.long))
    assert toys.state_size(model, 16)["gdn_state"] == 2 * 4 * 16 * 16


def test_shipped_presets_toys_settings_are_valid():
    from memzoo.bench.common import preset_names

    for name in preset_names():
        load_preset(name).settings("toys", toys.Settings).check()
    cap = load_preset("capacity").settings("toys", toys.Settings)
    assert cap.tasks == ["mqar"] and max(cap.mqar_kv) * 4 == cap.mqar_seq_len  # as many pairs as the length holds


def test_solved_on_the_mean_or_on_every_slice():
    """The capacity preset's attention control by hand: validation 0.988 / 0.996 / 0.9997 at
    8 / 16 / 32 pairs has a mean of 0.9946, solved by the mean, not by every slice."""
    acc = {8: 0.988, 16: 0.996, 32: 0.9997}
    assert toys.solved(acc, toys.Settings(target=0.99))
    assert not toys.solved(acc, toys.Settings(target=0.99, solve_on="every"))
    assert toys.solved({8: 0.99, 16: 0.995}, toys.Settings(target=0.99, solve_on="every"))
    with pytest.raises(ConfigError, match="solve_on"):
        toys.Settings(solve_on="min").check()
    task = toys.MQAR(toys.Settings(val_size=2, test_size=2))
    mc = toys.toy_config(load_preset("tiny"), BASELINE, 16, task.vocab, toys.Settings())
    assert toys.cell_config(mc, task.name, toys.Settings(), BASELINE)["train"]["solve_on"] == "mean"
    assert toys.cell_config(mc, task.name, toys.Settings(solve_on="every"), BASELINE)["train"]["solve_on"] == "every"


def test_mean_ci_by_hand():
    m, h = mean_ci([1.0, 2.0, 3.0])  # sd 1, t(0.975, 2) = 4.303
    assert m == 2.0 and h == pytest.approx(4.303 / 3**0.5)
    assert mean_ci([0.5]) == (0.5, 0.0)


def test_micro_run_records_rows_resumes_and_renders(tmp_path):
    ctx = _ctx(tmp_path, resume=True)
    rows = toys.run(ctx, [BASELINE, "fwpkm"])
    models = [BASELINE, "fwpkm", *CONTROLS]
    assert len(rows) == len(models) * 2 * 2 * 2  # models x tasks x widths x seeds
    saved = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(saved) == len(rows)
    assert {(r["layer"], r["seed"]) for r in saved} == {(m, s) for m in models for s in (0, 1)}
    for r in rows:
        m = r["metrics"]
        assert r["suite"] == "toys" and r["setting"] == {"task": r["setting"]["task"], "d_model": r["setting"]["d_model"],
                                                          "route": "hybrid"}
        assert 0.0 <= m["accuracy"] <= 1.0 and f"{m['lr']:g}" in m["val_by_lr"]
        # the grid; past both edges where it is at chance; past the chosen lr's edge where it left chance
        assert {"0.01", "0.03"} <= set(m["val_by_lr"]) <= {"0.01", "0.03", "0.09", "0.27", "0.81", "0.00333333",
                                                            "0.00111111", "0.00037037"}
        assert m["val_accuracy"] == max(m["val_by_lr"].values())
        grid_left = max(m["val_by_lr"]["0.01"], m["val_by_lr"]["0.03"]) > 2 * m["chance"]
        assert grid_left or {"0.00333333", "0.09"} <= set(m["val_by_lr"])
        assert m["lr_chosen"] == (max(m["val_by_lr"].values()) > 2 * m["chance"])
        assert len(m["history"]) == -(-m["steps"] // MICRO["eval_every"]) and m["history"][-1]["step"] == m["steps"]
        assert m["sequences"] == m["steps"] * MICRO["batch_size"]
        assert set(m["left_chance_at_by_lr"]) == set(m["val_by_lr"])
        kv = MICRO["mqar_kv"] if r["setting"]["task"] == "mqar" else MICRO["ar_pairs"]
        assert set(m["acc_by_kv"]) == {str(n) for n in kv}
        assert m["state_size"] == m["gdn_state"] + m["mem_state"] + m["kv_cache"]
        assert 1 <= m["steps"] <= MICRO["max_steps"] and m["stop"] in ("solved", "plateau", "chance", "capped")
        assert m["converged"] == (m["stop"] in ("solved", "plateau"))
        assert m["compile_s"] > 0 and m["eval_s"] > 0 and m["compile_s"] + m["eval_s"] < r["wall_s"]  # parts of its wall time
    base = {(r["setting"]["task"], r["setting"]["d_model"]): r["metrics"] for r in rows if r["layer"] == BASELINE}
    assert base[("mqar", 16)]["gdn_state"] == 2 * 4 * 4 * 4  # 2 GDN layers x 4 heads x 4^2
    assert base[("mqar", 16)]["mem_state"] == 0
    att = [r["metrics"] for r in rows if r["layer"] == POSITIVE and r["setting"] == {"task": "mqar", "d_model": 16, "route": "hybrid"}]
    assert att[0]["kv_cache"] == 2 * 2 * 2 * 4 * 16  # 2 layers x (k, v) x 2 kv heads x head 4 x 16 tokens
    fw = [r["metrics"] for r in rows if r["layer"] == "fwpkm"]  # a memory per sequence (tiny's toys)
    assert all(not m["state_shared"] and m["mem_state"] == 64 * 64 * 64 + 2 * 64 * 32 for m in fw)

    # resumed: every cell is recorded with the same config and seed, so nothing is trained again
    again = toys.run(_ctx(tmp_path, resume=True), [BASELINE, "fwpkm"])
    assert [r["run_id"] for r in again] == ["test"] * len(rows)
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == len(rows)

    # a part (one cell, as a bench worker takes it) measures what the whole run measured there
    parts = toys.parts(ctx, "fwpkm")
    assert [p for p, _, _ in parts] == [("fwpkm", t, w, s) for t in ("mqar", "ar") for w in (16, 24) for s in (0, 1)]
    assert parts[0][1] > parts[-1][1] > 0  # a cell's cost: MQAR's sequences are longer than AR's
    assert [g for _, _, g in parts] == [None] * 8  # all recorded: nothing to compile, no group
    fresh = toys.parts(_ctx(tmp_path / "fresh", resume=True), "fwpkm")  # nothing recorded there
    assert [g for _, _, g in fresh] == [("fwpkm", t, w) for t in ("mqar", "ar") for w in (16, 24) for _ in (0, 1)]
    # seed 0 of one group recorded: its seed 1 is now the group's first (bench's plan queues it before the
    # second of any group), not a second cell queued beside another
    one = tmp_path / "one"
    one.mkdir()
    (one / "results.jsonl").write_text("".join(
        json.dumps(r) + "\n" for r in rows if r["layer"] == "fwpkm" and r["seed"] == 0
        and r["setting"] == {"task": "mqar", "d_model": 16, "route": "hybrid"}))
    half = {p: g for p, _, g in toys.parts(_ctx(one, resume=True), "fwpkm")}
    assert half[("fwpkm", "mqar", 16, 0)] is None and half[("fwpkm", "mqar", 16, 1)] == ("fwpkm", "mqar", 16)
    alone = toys.run(_ctx(tmp_path / "part"), ["fwpkm"], only=[parts[-1][0]])
    same = [r for r in rows if r["layer"] == "fwpkm" and r["setting"] == alone[0]["setting"] and r["seed"] == 1]
    assert len(alone) == 1 and alone[0]["metrics"]["accuracy"] == same[0]["metrics"]["accuracy"]

    df = pd.json_normalize([{k: v for k, v in r.items() if k != "config"} for r in saved])
    tabs = toys_report.tables(df)  # 6 steps cannot solve anything: both tasks' harness is invalid
    titles = list(tabs)
    assert titles[0].startswith("HARNESS INVALID for mqar (the positive control reaches only")
    assert titles[1].startswith("HARNESS INVALID for ar")
    assert set(tabs[titles[0]]["layer"]) == set(CONTROLS)  # no layer rows beside a failed control
    assert toys_report.figures(df, tmp_path / "none") == []

    # make the controls pass: the positive one solves the easiest slice, the negative one is at chance
    pos, neg = df["layer"] == POSITIVE, df["layer"] == toys_report.NEGATIVE
    df.loc[pos, "metrics.acc_by_kv.1"] = df.loc[pos, "metrics.acc_by_kv.2"] = df.loc[pos, "metrics.accuracy"] = 1.0
    df.loc[neg, "metrics.accuracy"] = df.loc[neg, "metrics.chance"]
    assert toys_report.validity(df, "mqar") == [] and toys_report.validity(df, "ar") == []
    assert toys_report.validity(df[~neg], "mqar") == [f"no rows of {toys_report.NEGATIVE} (toys.controls off, or the run stopped before them)"]
    tabs = toys_report.tables(df)
    mq = tabs["MQAR test accuracy by key-value pairs"]
    assert list(mq["layer"]) == [BASELINE, BASELINE, "fwpkm", "fwpkm", *[c for c in CONTROLS for _ in (16, 24)]]
    assert {"kv=1", "kv=2", "mean", "budget (max)", "left chance at", "stop", "lr", "state", "seeds"} <= set(mq.columns)
    assert mq.loc[mq["layer"] == POSITIVE, "kv=1"].str.startswith("1.000 [").all()
    for t in tabs.values():
        assert t.to_markdown()
    paths = toys_report.figures(df, tmp_path / "a")
    # the state figure first: fwpkm at two widths is one model at two states
    assert [p.name for p in paths] == ["toys_mqar_state.png", "toys_mqar_capacity.png", "toys_mqar_curves.png"]
    again = toys_report.figures(df.iloc[::-1], tmp_path / "b")  # row order does not change the bytes
    assert [p.read_bytes() for p in paths] == [p.read_bytes() for p in again]


def _row(layer, seed, acc, chance=0.25):
    m = {"acc_by_kv": {"2": acc, "4": acc}, "accuracy": acc, "steps": 100, "stop": "solved", "lr": 3e-3, "chance": chance,
         "state_size": 8, "gdn_state": 8, "kv_cache": 0, "mem_state": 0, "state_shared": False, "params": 10,
         "tokens_per_s": 1}
    return {"layer": layer, "seed": seed, "setting": {"task": "mqar", "d_model": 16}, "metrics": m}


def test_a_layer_short_of_the_baselines_seeds_is_withheld(tmp_path):
    rows = [_row(n, s, a) for n, a in ((BASELINE, 0.6), (POSITIVE, 1.0), (toys_report.NEGATIVE, 0.25), ("pkm", 0.8))
            for s in range(3)]
    rows += [_row("linear", 0, 0.9)]  # a run stopped after its first seed
    df = pd.json_normalize(rows)
    kept, partial = toys_report.incomplete(df)
    assert partial == {"mqar": ["linear (1 of 3 seeds)"]} and "linear" not in set(kept["layer"]) and len(kept) == 12
    title, table = next(iter(toys_report.tables(df).items()))
    assert title == "MQAR test accuracy by key-value pairs (withheld until every seed has run: linear (1 of 3 seeds))"
    assert list(table["layer"]) == [BASELINE, "pkm", *CONTROLS]
    assert "linear" not in set(toys_report.tables(df)["Recurrent state per sequence (numbers) and parameters"]["layer"])
    assert toys_report.incomplete(df[df["layer"] != "linear"])[1] == {}  # nothing short: nothing withheld
    capped = {**rows[-1], "metrics": {**rows[-1]["metrics"], "stop": "capped", "sequences": 640}}
    assert toys_report.reading(pd.json_normalize(rows[:-1] + [capped])) == ["Stops: 12 solved."]  # nor read
    narrow = dict(_row("fwl/narrow", 0, 0.7), setting={"task": "mqar", "d_model": 8})  # no baseline at its width
    assert toys_report.incomplete(pd.json_normalize(rows + [narrow]))[1] == {
        "mqar": ["fwl/narrow (1 of 3 seeds)", "linear (1 of 3 seeds)"]}
    # no model with state at two sizes: no state figure
    assert [p.name for p in toys_report.figures(df, tmp_path)] == ["toys_mqar_capacity.png"]


def test_figure_intervals_stay_within_0_and_1():
    """Three bimodal seeds (the capacity baseline's kind: 0.97, 0.04, 0.03) and three agreeing ones:
    the bars (logit intervals) never reach past 0 or 1."""
    means, (below, above) = toys_report._bars([[0.97, 0.04, 0.03], [0.998, 0.999, 0.997], [0.5, 0.6, 0.4]])
    for m, b, a in zip(means, below, above):
        assert 0 <= m - b <= m <= m + a <= 1
    assert means[0] == pytest.approx(1.04 / 3)


def test_bimodal_seeds_are_shown_as_two_groups_and_capped_ones_unmarked():
    assert toys_report._fmt([0.97, 0.04, 0.03]) == "1/3 at 0.970, 2 at 0.035"
    assert toys_report._fmt([0.96, 0.98, 0.03]) == "2/3 at 0.970, 1 at 0.030"
    text = toys_report._fmt([0.90, 0.91, 0.92])
    lo, hi = (float(x) for x in text[text.index("[") + 1 : text.index("]")].split(", "))
    assert text.startswith("0.910 [") and 0 <= lo < 0.91 < hi <= 1
    ref = [0.5, 0.51, 0.52]
    assert toys_report._fmt([0.90, 0.91, 0.92], ref).endswith(" ▲")
    assert not toys_report._fmt([0.90, 0.91, 0.92], ref, marked=False).endswith("▲")  # a capped seed: no mark


def test_interval_marks_against_the_baseline():
    assert toys_report._fmt([0.9, 0.91, 0.92], ref=[0.5, 0.51, 0.52]).endswith(" ▲")
    assert toys_report._fmt([0.1, 0.11, 0.12], ref=[0.5, 0.51, 0.52]).endswith(" ▼")
    assert "▲" not in toys_report._fmt([0.5, 0.6, 0.4], ref=[0.5, 0.51, 0.52])  # the intervals overlap


def test_evaluation_leaves_persistent_memories_as_they_were(tmp_path):
    s = toys.Settings(**{k: v for k, v in MICRO.items() if k != "tasks"}, layer_options={"fwpkm": {"per_sequence": False}})
    task = toys.MQAR(s)
    mc = toys.toy_config(load_preset("tiny"), "fwpkm", 16, task.vocab, s)
    torch.manual_seed(0)
    model = HybridLM(mc)
    before = [{k: v.clone() for k, v in st.items()} for st in model.memory_state(persistent_only=True)]
    assert before and all(before)  # FwPKM shared by the batch: a persistent memory
    a = toys.evaluate(model, task.val, s.batch_size)
    after = model.memory_state(persistent_only=True)
    assert all(torch.equal(x[k], y[k]) for x, y in zip(before, after) for k in x)
    assert toys.evaluate(model, task.val, s.batch_size) == a  # and so it is repeatable


def test_fwpkm_sharing_experiment_names_its_forms():
    from research import fwpkm_sharing

    assert set(fwpkm_sharing.FORMS) >= {"gdn", "per_sequence", "shared"}
    with pytest.raises(SystemExit, match="unknown form"):
        fwpkm_sharing.main(["sharde"])


def test_fwpkm_route_hit_and_gate_by_hand():
    """[HIT] by hand: x = k1 v1 k2 v2 k2 f asks k2 at position 4, whose value v2 sits at 3; the read
    there puts weights 0.5 / 0.2 / 0.2 / 0.1 on slots last written by position 3, position 3,
    position 3 of another sequence (batch row 1) and never, so 0.7 of it lands on the pair's
    slots. The gate at the query is 0.9."""
    from research import fwpkm_route

    class Mem:
        def stats(self):
            return {"trace": {"weights": torch.tensor([[[0.0] * 4] * 4 + [[0.5, 0.2, 0.2, 0.1]] + [[0.0] * 4]]),
                              "writer_pos": torch.tensor([[[-1] * 4] * 4 + [[3, 3, 3, -1]] + [[-1] * 4]]),
                              "writer_seq": torch.tensor([[[0] * 4] * 4 + [[0, 0, 1, 0]] + [[0] * 4]])},
                    "gates": torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.9, 0.5]])}

    class Model:
        training = True

        def memories(self):
            return [Mem()]

        def memory_state(self, persistent_only):
            return {}

        def load_memory_state(self, state):
            pass

        def eval(self):
            return lambda x, targets: None

        def train(self, mode):
            pass

    x = torch.tensor([[1, 5, 2, 6, 2, 3]])
    y = torch.full_like(x, mqar.IGNORE)
    y[0, 4] = 6
    d = fwpkm_route.diagnostics(Model(), x, y, n_pairs=2)
    assert d["hit"] == pytest.approx(0.7) and d["gate_q"] == pytest.approx(0.9)
    assert d["gate_all"] == pytest.approx(2.4 / 6)
    with pytest.raises(SystemExit):
        fwpkm_route.main(["toekn"])


def test_rerun_comparison_by_hand():
    """bench/report/reruns.py: means and t-intervals over the seeds both runs hold, identical
    cells counted, wall time per model and per run id."""
    from memzoo.bench.report.reruns import compare, cost

    def row(seed, acc, steps=100, run="a", wall=10.0, at="2026-11-25T10:00:00Z", h="h1"):
        return {"suite": "toys", "preset": "standard", "layer": "pkm", "setting": {"task": "mqar", "d_model": 128},
                "seed": seed, "config_hash": h, "metrics": {"accuracy": acc, "acc_by_kv": {"4": acc}, "steps": steps,
                                                            "stop": "solved"}, "run_id": run, "wall_s": wall, "time": at}

    published = [row(0, 0.5), row(1, 0.6), row(2, 0.7), row(2, 0.9, h="other")]  # another config: not compared
    rerun = [row(0, 0.5), row(1, 0.6, steps=200), row(2, 0.8, run="b", wall=30.0, at="2026-11-25T11:00:00Z")]
    lines, same = compare(rerun, published)
    assert len(lines) == 1 and lines[0]["seeds"] == 3
    (pm, ph), (rm, rh) = lines[0]["published"], lines[0]["rerun"]
    assert pm == pytest.approx(0.6) and ph == pytest.approx(4.303 * 0.1 / 3**0.5, rel=1e-3)  # t(0.975, 2) = 4.303
    assert rm == pytest.approx(0.6333, abs=1e-4) and lines[0]["inside"]
    assert same == {"cells": 3, "same": 1}  # seed 1 took other steps, seed 2 another accuracy
    per_model, spans = cost(rerun)
    assert per_model == {"pkm": 50.0} and spans == {"a": (10.0, 2), "b": (30.0, 1)}


def test_rerun_with_fresh_seeds_by_hand():
    """bench/report/reruns.py --fresh-seeds: a rerun's own seeds against every published seed
    of the same config (seed by seed there is nothing to pair, so no identical cells are counted)."""
    from memzoo.bench.report.reruns import compare, orders

    def row(layer, seed, acc, h="h1"):
        return {"suite": "toys", "preset": "standard", "layer": layer, "setting": {"task": "mqar", "d_model": 128},
                "seed": seed, "config_hash": h, "metrics": {"accuracy": acc, "acc_by_kv": {"4": acc}, "steps": 100,
                                                            "stop": "solved"}}

    published = ([row("pkm", i, a) for i, a in enumerate([0.5, 0.6, 0.7])] + [row("pkm", 3, 0.1, h="other")]
                 + [row("baseline", i, a) for i, a in enumerate([0.1, 0.1, 0.1])])
    rerun = [row("pkm", 100 + i, a) for i, a in enumerate([0.6, 0.7])] + [row("baseline", 100 + i, 0.3) for i in range(2)]
    assert compare(rerun, published) == ([], {"cells": 0, "same": 0})  # no seed in common
    lines, same = compare(rerun, published, fresh=True)
    pkm = next(ln for ln in lines if ln["layer"] == "pkm")
    assert pkm["seeds"] == 2 and pkm["published"][0] == pytest.approx(0.6) and pkm["rerun"][0] == pytest.approx(0.65)
    assert pkm["published"][1] == pytest.approx(4.303 * 0.1 / 3**0.5, rel=1e-3) and pkm["inside"]
    baseline = next(ln for ln in lines if ln["layer"] == "baseline")
    assert baseline["published"] == (pytest.approx(0.1), pytest.approx(0.0)) and not baseline["inside"]
    assert same == {"cells": 0, "same": 0}
    # pkm 0.6 ± 0.248 over baseline 0.1 ± 0: separated; the rerun's 0.65 > 0.3 keeps the order
    assert [(p["above"], p["below"], p["same"]) for p in orders(rerun, published, fresh=True)] == [("pkm", "baseline", True)]


def test_rerun_orders_by_hand():
    """bench/report/reruns.py: the model pairs the published rows separate (disjoint 95%
    t-intervals over at least two shared seeds), whether the rerun keeps their order, and whether
    its own intervals separate them the other way."""
    from memzoo.bench.report.reruns import orders

    def rows(layer, accs):
        return [{"suite": "toys", "preset": "standard", "layer": layer, "setting": {"task": "mqar", "d_model": 128},
                 "seed": i, "config_hash": "h", "metrics": {"accuracy": a}} for i, a in enumerate(accs)]

    # half-width of 3 seeds 0.01 apart: t(0.975, 2) * 0.01 / sqrt(3) = 0.0248
    published = (rows("baseline", [0.50, 0.51, 0.52]) + rows("pkm", [0.90, 0.91, 0.92]) + rows("lact", [0.89, 0.90, 0.91])
                 + rows("fwl", [0.1]))
    rerun = (rows("baseline", [0.90, 0.91, 0.92]) + rows("pkm", [0.50, 0.51, 0.52]) + rows("lact", [0.6, 0.7, 0.8])
             + rows("fwl", [0.9]))
    got = {(p["above"], p["below"]): (p["same"], p["contradicts"]) for p in orders(rerun, published)}
    # pkm/lact overlap (0.91 ± 0.025 and 0.90 ± 0.025); fwl has one seed: neither is a pair
    # lact over baseline flips, but the rerun's lact (0.70 ± 0.248) overlaps its baseline (0.91 ± 0.025)
    assert got == {("pkm", "baseline"): (False, True), ("lact", "baseline"): (False, False)}
    assert all(p["same"] for p in orders(published, published))


def test_uninterrupted_run_counted_by_hand():
    """bench/report/reruns.py: a run in segments counted as one: each group's costliest
    compile_s once (its first cell), its cheapest for the others, on workers taking the first cell
    of every group first; a row without compile_s counts its wall time."""
    from memzoo.bench.report.reruns import uninterrupted

    def row(layer, seed, wall, at, compile_s=None):
        m = {} if compile_s is None else {"compile_s": compile_s}
        return {"suite": "toys", "preset": "standard", "layer": layer, "setting": {"task": "mqar", "d_model": 128},
                "seed": seed, "config_hash": "h", "metrics": m, "wall_s": wall, "time": f"2026-11-26T{at}:00Z"}

    rows = [row("pkm", 0, 300.0, "10:00", 100.0), row("pkm", 1, 150.0, "10:05", 5.0), row("lact", 0, 200.0, "10:06", 50.0),
            row("pkm", 2, 280.0, "11:00", 90.0),  # a second segment compiled the group cold again
            row("lact", 1, 40.0, "11:01")]  # recorded before compile_s
    total, span, lacking = uninterrupted(rows, jobs=2)
    # pkm: 300 (cold), 150, 280 - 90 + 5 = 195 (warm); lact: 200 (cold), 40 (as recorded)
    assert total == pytest.approx(300 + 150 + 195 + 200 + 40) and lacking == 1
    # queue pkm0, lact0, pkm1, pkm2, lact1 -> workers [300, 0] [300, 200] [300, 350] [495, 350] [495, 390]
    assert span == pytest.approx(495)
    assert uninterrupted(rows, jobs=1)[1] == pytest.approx(total)


def test_value_set_scores_the_queried_value_any_value_of_the_sequence_and_by_place():
    from types import SimpleNamespace

    from research.value_set import value_set
    from memzoo.data import mqar

    # one sequence of 2 pairs (k1 v1 k2 v2), then queries of k2 and k1 at positions 5 and 7
    x = torch.tensor([[10, 20, 11, 21, 0, 11, 0, 10]])
    y = torch.full_like(x, mqar.IGNORE)
    y[0, 5], y[0, 7] = 21, 20

    class Answers(torch.nn.Module):  # answers 21 everywhere: the value of k2, wrong for k1 but in the set
        def forward(self, ids, targets=None):
            logits = torch.zeros(*ids.shape, 32)
            logits[..., 21] = 1.0
            return SimpleNamespace(logits=logits)

    out = value_set(Answers(), SimpleNamespace(test={2: (x, y)}))
    assert out[2] == {"acc": 0.5, "in_set": 1.0, "one_in_n": 0.5, "by_pair": [0.0, 1.0]}


def test_a_variant_with_widths_of_its_own_trains_only_at_them(tmp_path):
    """A size variant (``widths``) adds cells at its widths alone; the layer keeps the preset's."""
    ctx = _ctx(tmp_path, widths=[64], seeds=2, variants={"fwl/narrow": {"layer": "fwl", "widths": [8, 16]}})
    s = ctx.preset.settings(toys.NAME, toys.Settings)
    plan = list(toys.cells(ctx, ["fwl"]))
    assert sorted({(m, w) for m, _, w, _ in plan}) == [("fwl", 64), ("fwl/narrow", 8), ("fwl/narrow", 16)]
    assert len(plan) == len(s.tasks) * 2 * 3  # two seeds of each
    assert toys.work(ctx, "fwl") == len(s.tasks) * s.seeds * s.max_steps * len(s.lrs) * 3


# ---- protocol 3: the stopping rule, the lr grid's edges, learning curves, resumable cells ------


def test_a_falling_loss_is_no_plateau_by_hand():
    """patience 2 x eval_every 5 = windows of 10 steps: a loss 2% lower than the 10 steps before
    still falls (loss_delta 1%), 0.5% lower does not; early on, half the steps against the other half."""
    s = toys.Settings(patience=2, eval_every=5, loss_delta=0.01)
    assert toys.falling([2.0] * 10 + [1.96] * 10, s)
    assert not toys.falling([2.0] * 10 + [1.99] * 10, s)
    assert not toys.falling([3.0] * 5 + [2.0] * 10 + [2.0] * 10, s)  # only the last 20 steps count
    assert toys.falling([2.0] * 3 + [1.9] * 3, s)  # 6 steps: 3 against 3
    assert toys.falling([], s)  # nothing to judge: it may still fall


def test_left_chance_at_is_the_first_evaluation_above_twice_chance():
    hist = [{"step": 100, "sequences": 3200, "val": 0.03}, {"step": 200, "sequences": 6400, "val": 0.07},
            {"step": 300, "sequences": 9600, "val": 0.5}]
    assert toys.left_chance_at(hist, 0.031) == 6400  # 0.07 > 0.062
    assert toys.left_chance_at(hist, 0.04) == 9600
    assert toys.left_chance_at(hist[:2], 0.04) is None


def test_an_lr_chosen_at_the_grids_edge_is_found_by_hand():
    tr = lambda v: toys.Training(None, v, 1, "plateau", 0.0, 0.0)  # noqa: E731
    assert toys.lr_grid({1e-3: tr(0.5), 3e-3: tr(0.4), 1e-2: tr(0.1)}) == (1e-3, True)
    assert toys.lr_grid({1e-3: tr(0.4), 3e-3: tr(0.5), 1e-2: tr(0.1)}) == (3e-3, False)
    assert toys.lr_grid({1e-3: tr(0.1), 3e-3: tr(0.4), 1e-2: tr(0.5)}) == (1e-2, True)
    assert toys.lr_grid({3e-3: tr(0.5), 1e-3: tr(0.5)}) == (3e-3, True)  # ties: the first tried
    grid = {1e-3: tr(0.5), 3e-3: tr(0.4)}
    assert toys.past_edge(1e-3, grid) == pytest.approx(1e-3 / 3) and toys.past_edge(3e-3, grid) == pytest.approx(9e-3)


def test_the_lrs_a_cell_trains_by_hand():
    """The grid; at chance everywhere, one lr past each edge; an lr chosen at an edge, the next
    beyond it (twice at most); one lr given, nothing more. Chance 0.03: left it above 0.06."""
    tr = lambda v: toys.Training(None, v, 1, "plateau", 0.0, 0.0)  # noqa: E731
    grid = [1e-3, 3e-3, 1e-2, 3e-2]

    def tried(vals: dict, lrs=grid) -> list[float]:
        return list(toys.search(lrs, lambda lr: tr(vals.get(f"{lr:.3g}", 0.03)), 0.03))

    assert tried({"0.003": 0.5}) == grid  # interior: nothing more
    assert tried({}) == grid + [pytest.approx(1e-3 / 3), pytest.approx(9e-2)]  # none chosen
    # MoM's recall cell: at chance on the grid, solved below it; 1e-3 / 9 is worse, so 1e-3 / 3 is interior
    assert tried({"0.000333": 0.98, "0.000111": 0.6}) == grid + [pytest.approx(1e-3 / 3), pytest.approx(9e-2),
                                                                  pytest.approx(1e-3 / 9)]
    assert tried({"0.03": 0.5, "0.09": 0.6, "0.27": 0.7}) == grid + [pytest.approx(9e-2), pytest.approx(0.27)]  # 2 at most
    assert tried({}, [1e-3]) == [1e-3]  # a choice, not a grid


def test_left_chance_at_and_lr_columns_by_hand():
    import pandas as pd

    g = pd.DataFrame({"metrics.left_chance_at": [6400.0, None, 12800.0], "metrics.sequences": [64000, 64000, 32000],
                      "metrics.lr": [1e-3, 3e-3, 1e-3], "metrics.lr_chosen": [True, False, True],
                      "metrics.lr_at_edge": [True, False, False], "metrics.val_by_lr.0.001": [0.5, 0.03, 0.4],
                      "metrics.val_by_lr.0.003": [0.4, 0.03, 0.5]})
    assert toys_report._left_at(g) == "9.6k (2/3 seeds)"
    assert toys_report._left_at(g.assign(**{"metrics.left_chance_at": [None] * 3})) == "at chance through 64k"
    assert toys_report._lrs(g) == "0.001, 0.001 (edge), none (at chance)"
    assert toys_report._count(640000) == "640k" and toys_report._count(1_280_000) == "1.28M" and toys_report._count(640) == "640"


def test_a_stopped_cell_continues_from_its_checkpoint(tmp_path, monkeypatch):
    """A cell stopped mid-training (here: an exception after step 7) continues from its last
    checkpoint and ends exactly as the training that was never stopped: the same curve, loss
    and weights; the checkpoint is gone once the cell ends."""
    s = toys.Settings(**{**MICRO, "tasks": ["mqar"], "max_steps": 12, "lrs": [1e-2]})
    task = toys.MQAR(s)
    mc = toys.toy_config(load_preset("tiny"), "linear", 16, task.vocab, s)
    whole = toys.train_cell(mc, task, 1e-2, s, seed=0)
    monkeypatch.setattr(toys.training, "CHECKPOINT_EVERY_S", 0.0)
    ckpt = tmp_path / "cell.pt"
    steps = []

    def stop_at_7():
        steps.append(1)
        if len(steps) == 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        toys.train_cell(mc, task, 1e-2, s, seed=0, on_step=stop_at_7, checkpoint=ckpt)
    assert ckpt.is_file() and torch.load(ckpt, weights_only=False)["step"] == 6  # the evaluation at step 6
    steps.clear()
    resumed = toys.train_cell(mc, task, 1e-2, s, seed=0, on_step=lambda: steps.append(1), checkpoint=ckpt)
    assert len(steps) == 6 and not ckpt.exists()  # steps 7..12 only
    assert resumed.history == whole.history and resumed.steps == whole.steps == 12
    assert resumed.train_loss == whole.train_loss
    for a, b in zip(resumed.model.state_dict().values(), whole.model.state_dict().values()):
        assert torch.equal(a, b)


def test_a_layer_at_chance_points_to_its_long_budget_verdict():
    def row(layer, preset, left, seqs, t="2026-11-28T00:00:00Z", acc=0.03, seed=0, lr=0.001, model=None, **more):
        return {"suite": "toys", "preset": preset, "layer": layer, "seed": seed, "setting": {"task": "mqar", "d_model": 64},
                "time": t, "run_id": t, "config": {"model": model or {"memory": {layer.split("/")[0]: {}}}},
                "metrics": {"left_chance_at": left, "sequences": seqs, "accuracy": acc,
                            "val_by_lr": {"0.001": 0.5, "0.003": 0.03}, "lr": lr, **more}}

    pkm = row("pkm", "tiny", None, 16000, mem_state=0)
    pkm["setting"]["route"] = "memory"  # no fast weights on the memory-only route: a control by construction
    run = [row("fwpkm", "tiny", None, 16000), row("lact", "tiny", None, 16000), row("linear", "tiny", 3200, 16000),
           row("mom", "tiny", None, 16000), row("fwmlp", "tiny", None, 16000), pkm,
           row(BASELINE, "tiny", None, 16000), row(toys_report.NEGATIVE, "tiny", None, 16000)]
    published = [row("fwpkm", toys_report.LONG, None, 640000), row("fwpkm", toys_report.LONG, 192000, 640000, "2026-11-29T00:00:00Z", 0.98),
                 row("fwmlp", toys_report.LONG, None, 99200, stop="diverged"),
                 row("mom", toys_report.LONG, 16000, 640000, acc=0.99),
                 *(row("mom", toys_report.LONG_SEEDS, left, 640000, seed=s) for s, left in enumerate([16000, None, 32000])),
                 # the same model at another lr counts with it; another model under the layer's name does not
                 *(row("mom/lr3e-4", toys_report.LONG_SEEDS, left, 640000, seed=s, lr=3e-4, acc=a)
                   for s, (left, a) in enumerate([(None, 0.5), (8000, 0.9)])),
                 row("mom/wide", toys_report.LONG_SEEDS, 8000, 640000, model={"memory": {"mom": {"width": 2}}})]
    lines = toys_report.notes(run, published)
    assert lines == [
        "fwmlp: at chance through 16k sequences here; at the recall preset's 10x budget (lrs 0.001, 0.003): at chance "
        f"through 99.2k sequences, where its training diverged (leaderboards/README.md, toys — preset {toys_report.LONG})",
        "fwpkm: at chance through 16k sequences here; at the recall preset's 10x budget (lrs 0.001, 0.003): left chance "
        f"at 192k sequences (test 0.980) (leaderboards/README.md, toys — preset {toys_report.LONG})",  # the latest row
        f"lact: at chance through 16k sequences here; no long-budget check of it is published yet ({toys_report.LONG}: docs/journal/toys.md)",
        "mom: at chance through 16k sequences here; at the recall preset's 10x budget (lrs 0.001, 0.003): left chance "
        "at 16k sequences (test 0.990); 2 of 3 seeds left chance at lr 0.001 (test 0.030, their mean), 1 of 2 at lr 0.0003 "
        "(test 0.700, their mean) (leaderboards/README.md, toys — presets "
        f"{toys_report.LONG} and {toys_report.LONG_SEEDS})",
        "pkm: at chance through 16k sequences here; it has no fast weights, so with the memory the only route it is a "
        "negative control by construction, not a verdict a longer budget could change",
    ]


def test_the_figures_legend_names_a_model_drawn_in_one_panel_only_and_no_colour_repeats():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2)
    axes[0].plot([1, 2], [0, 1], label="fwl/narrow")  # drawn at one width only
    axes[1].plot([1, 2], [0, 1], label="fwl")
    axes[1].plot([1, 2], [1, 0], label="fwpkm")
    axes[0].plot([1, 2], [1, 1], label="fwl")  # at both widths: named once
    toys_report._legend(axes, ["fwl", "fwl/narrow", "fwpkm"])
    assert [t.get_text() for t in axes[1].get_legend().get_texts()] == ["fwl", "fwl/narrow", "fwpkm"]
    plt.close(fig)
    for n in (3, 11, 20):
        palette = toys_report._palette([f"m{i}" for i in range(n)])
        assert len({tuple(c) for c in palette.values()}) == n


def test_half_right_at_reads_the_curves_by_hand():
    import pandas as pd

    h = lambda vals: [{"sequences": 100 * (i + 1), "val": v} for i, v in enumerate(vals)]  # noqa: E731
    g = pd.DataFrame({"metrics.history": [h([0.03, 0.15, 0.15, 0.6]), h([0.15, 0.5, 0.9]), h([0.03, 0.15])]})
    assert toys_report._reached(g, 0.5) == "400 (2/3 seeds)"  # 200 and 400: the upper median of two
    assert toys_report._reached(g.iloc[2:], 0.5) == "never"


def test_a_stopped_cell_keeps_the_lrs_it_finished(tmp_path, monkeypatch):
    """A cell stopped during its second lr resumes without training the first again, and records
    the row it would have recorded unstopped; the kept trainings go once the row is written."""
    part = ("linear", "mqar", 16, 0)
    whole = toys.run(_ctx(tmp_path / "a", tasks=["mqar"]), ["linear"], only=[part])[0]["metrics"]
    real, calls = toys.train_cell, []

    def stop_second(mc, task, lr, *a, **kw):
        calls.append(lr)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(mc, task, lr, *a, **kw)

    monkeypatch.setattr(toys.cell, "train_cell", stop_second)
    ctx = _ctx(tmp_path / "b", tasks=["mqar"])
    with pytest.raises(KeyboardInterrupt):
        toys.run(ctx, ["linear"], only=[part])
    assert len(list((ctx.work_dir / "cells").glob("*.done.pt"))) == 1
    calls.clear()
    monkeypatch.setattr(toys.cell, "train_cell", lambda *a, **kw: (calls.append(a[2]), real(*a, **kw))[1])
    again = toys.run(ctx, ["linear"], only=[part])[0]["metrics"]
    assert calls and calls[0] == MICRO["lrs"][1]  # the first lr was not trained again
    keys = ("accuracy", "acc_by_kv", "val_by_lr", "lr", "steps", "stop", "history", "left_chance_at_by_lr")
    assert {k: again[k] for k in keys} == {k: whole[k] for k in keys}
    assert not list((ctx.work_dir / "cells").glob("*"))  # nothing left behind


# ---- MQAR at several lengths (the recall-gpu preset) ------------------------------------------


def test_mqar_at_several_lengths_takes_the_lengths_in_turn_with_their_batches():
    s = toys.Settings(mqar_vocab=64, mqar_slices=[[16, 1], [16, 2], [32, 4]], batch_size=6, batch_by_length={32: 2},
                      val_size=5, test_size=3, mqar_gap=0)
    s.check()
    task = toys.MQAR(s)
    assert task.slices == [(16, 1), (16, 2), (32, 4)] and task.lengths == [16, 32] and task.seq_len == 32
    g = torch.Generator().manual_seed(0)
    shapes = [tuple(task.batch(i, g)[0].shape) for i in range(4)]
    assert shapes == [(6, 16), (2, 32), (6, 16), (2, 32)]  # one length a step, in turn, each with its batch
    x, y = task.batch(0, torch.Generator().manual_seed(1))
    pairs = [(int((t != mqar.IGNORE).sum())) for t in y]  # each sequence asks each of its keys once
    assert pairs == [1, 1, 1, 2, 2, 2]  # the 16-token kv counts in equal parts
    assert [task.sequences(n) for n in range(5)] == [0, 6, 8, 14, 16]
    assert {k: tuple(v[0].shape) for k, v in task.val.items()} == {(16, 1): (5, 16), (16, 2): (5, 16), (32, 4): (5, 32)}
    assert [task.eval_batch(k) for k in task.slices] == [6, 6, 2]
    assert [toys.slice_name(k) for k in task.slices] == ["1@16", "2@16", "4@32"]
    assert sorted(["4@32", "2@16", "12", "1@16"], key=toys.slice_order) == ["12", "1@16", "2@16", "4@32"]
    assert toys.MQAR.mean_length(s) == (16 * 6 + 32 * 2) / 2 / 6  # tokens a step, in sequences of batch_size


def test_mqar_slices_are_checked():
    with pytest.raises(ConfigError, match=r"mqar_slices: \[32, 9\]: n_kv=9 needs seq_len >= 4 \* n_kv \+ gap = 44"):
        toys.Settings(mqar_slices=[[32, 9]]).check()
    with pytest.raises(ConfigError, match="each slice is"):
        toys.Settings(mqar_slices=[32]).check()
    with pytest.raises(ConfigError, match="given twice"):
        toys.Settings(mqar_slices=[[32, 2], [32, 2]]).check()
    with pytest.raises(ConfigError, match="batch_by_length: 64"):
        toys.Settings(mqar_slices=[[32, 2]], batch_by_length={64: 8}).check()
    with pytest.raises(ConfigError, match="a batch of 1 sequences of 32 tokens cannot hold one of each of its 2"):
        toys.Settings(mqar_slices=[[32, 1], [32, 2]], batch_by_length={32: 1}).check()


def test_a_single_length_cells_config_is_unchanged_by_the_several_lengths_option():
    """The recorded rows keep their config hashes (a resumed run skips them): a row of the
    recall-10x preset in results.jsonl is found again by the cell's key (one lr: the rule for a
    grid at chance does not change its config either)."""
    from memzoo.bench.common import config_hash, read_results, RESULTS
    from pathlib import Path

    rows = [r for r in read_results(Path(__file__).parents[1] / "leaderboards" / RESULTS)
            if r["preset"] == "recall-10x" and r["layer"] == BASELINE]
    assert rows
    preset = load_preset("recall-10x")
    s = preset.settings("toys", toys.Settings)
    mc = toys.toy_config(preset, BASELINE, 64, s.mqar_vocab, s)
    assert config_hash(toys.cell_config(mc, "mqar", s, BASELINE)) == rows[-1]["config_hash"]
    assert "lr_beyond_chance" in toys.cell_config(mc, "mqar", load_preset("recall").settings("toys", toys.Settings), BASELINE)


def test_a_micro_run_at_several_lengths_names_its_slices_and_renders(tmp_path):
    ctx = _ctx(tmp_path, tasks=["mqar"], widths=[16], seeds=1, lrs=[1e-2], mqar_slices=[[16, 1], [32, 2]],
               batch_by_length={32: 3}, mqar_gap=8, route="memory", model={"layout": "SWA", "window": 4})
    rows = toys.run(ctx, [BASELINE])
    for r in rows:
        m = r["metrics"]
        assert set(m["acc_by_kv"]) == {"1@16", "2@32"} and set(m["history"][0]["by_slice"]) == {"1@16", "2@32"}
        assert m["sequences"] == sum(6 if i % 2 == 0 else 3 for i in range(m["steps"]))
        assert r["config"]["data"]["slices"] == [[16, 1], [32, 2]] and "seq_len" not in r["config"]["data"]
    df = pd.json_normalize([{k: v for k, v in r.items() if k != "config"} for r in rows])
    pos = df["layer"] == POSITIVE
    df.loc[pos, "metrics.acc_by_kv.1@16"] = 1.0
    df.loc[df["layer"] == toys_report.NEGATIVE, "metrics.accuracy"] = 0.0
    df.loc[~pos & (df["layer"] != toys_report.NEGATIVE), ["metrics.acc_by_kv.1@16", "metrics.acc_by_kv.2@32"]] = 0.0
    tabs = toys_report.tables(df)
    mq = next(t for k, t in tabs.items() if k.startswith("MQAR"))
    assert [c for c in mq.columns if c.startswith("kv=")] == ["kv=1@16", "kv=2@32"]
    assert [p.name for p in toys_report.figures(df, tmp_path / "fig")][0] == "toys_mqar_capacity.png"


def test_a_recall_row_at_chance_or_capped_says_whether_its_long_budget_check_is_published():
    def row(layer, seed, stop, preset="recall"):
        r = _row(layer, seed, 0.03 if stop == "chance" else 0.9)
        r["metrics"].update(stop=stop, sequences=64000)
        return {**r, "preset": preset, "suite": "toys"}

    rows = [row(BASELINE, s, "chance") for s in range(3)] + [row(POSITIVE, s, "solved") for s in range(3)]
    rows += [row(toys_report.NEGATIVE, s, "chance") for s in range(3)]  # a control: never read here
    rows += [row("kda", s, stop) for s, stop in enumerate(["solved", "capped", "solved"])]
    rows += [row("mom", s, "chance") for s in range(3)]
    published = rows + [row("mom", 0, "solved", preset=toys_report.LONG)]
    lines = toys_report.reading(pd.json_normalize(rows), published)
    assert lines[1:] == [
        f"{BASELINE}: every seed stopped chance through 64k sequences: a statement about that budget.",
        "mom: every seed stopped chance through 64k sequences: a statement about that budget.",
        f"kda: 1 of 3 seeds stopped capped through 64k sequences; no long-budget check of it is published yet ({toys_report.LONG}).",
        f"mom: 3 of 3 seeds stopped chance through 64k sequences; its long-budget check is published ({toys_report.LONG}).",
    ]
    assert toys_report.reading(pd.json_normalize(rows)) == lines[:3]  # without the published rows: as before


def test_a_runs_closing_lines_say_what_it_showed_where_the_tables_are_and_the_published_command(capsys):
    """The end of a run's output: which layers left chance (a layer that did not is "at chance
    through" its budget), or that the harness is invalid and nothing is judged; then the tables and
    the command that measures the same at the published budget."""
    from memzoo.bench.report import frame, print_closing

    def row(layer, acc, mem=100, seed=0):
        return {"suite": "toys", "preset": "tiny", "layer": layer, "seed": seed, "time": "t", "run_id": "r",
                "git_sha": "x", "config": {}, "hardware": {"cpu": "c"},
                "setting": {"task": "mqar", "d_model": 64, "route": "memory"},
                "metrics": {"accuracy": acc, "chance": 0.03, "acc_by_kv": {"2": acc, "4": acc}, "sequences": 20800,
                            "mem_state": mem, "stop": "plateau"}}

    rows = [row(POSITIVE, 0.999, 0), row(toys_report.NEGATIVE, 0.03, 0), row(BASELINE, 0.031, 0),
            row("mom", 0.3), row("lact", 0.032), row("fwpkm/token", 0.95)]
    assert toys_report.summary(frame(rows)) == (
        "recall (MQAR with the memory the only route; the controls valid): left chance: fwpkm/token 0.950, mom 0.300; "
        "at chance through 20.8k sequences (a budget, not a verdict): lact")
    print_closing(rows, [BASELINE, "fwpkm", "mom", "lact"], "tiny")
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 3 and out[0].startswith("What this run showed (tiny preset): recall (MQAR")
    assert "leaderboards/site/index.html" in out[1]
    assert out[2].endswith("memzoo bench --preset recall --layers fwpkm,mom,lact --suite toys --resume")
    bad = [row(POSITIVE, 0.5, 0), *rows[1:]]
    assert "the harness is INVALID (the positive control reaches only 0.500" in toys_report.summary(frame(bad))


@pytest.mark.parametrize("over", [{}, {"mqar_slices": [[32, 2], [64, 4]], "batch_by_length": {64: 8}}])
def test_a_rows_data_gives_back_the_settings_it_was_measured_with(over):
    """`MQAR.settings_of` inverts `MQAR.data` (what `memzoo verify --rerun` rebuilds a cell from)."""
    s = toys.Settings(**{**MICRO, "tasks": ["mqar"], "mqar_gap": 3, "power_a": 0.02, **over})
    data = toys.MQAR.data(s)
    back = toys.Settings(**toys.MQAR.settings_of(json.loads(json.dumps(data))))  # through a row's JSON
    assert toys.MQAR.data(back) == data
