"""Tests for the toys suite: the MQAR generator (zoology's multiquery_ar semantics) and a
micro run of bench/suites/toys.py (training, rows, tables, figures)."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
import torch

import memzoo.layers  # noqa: F401  (registers the layers)
from memzoo.bench.suites import toys
from memzoo.bench.common import BASELINE, Context, Recorder, load_preset
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
    "widths": [16, 24],
    "lrs": [1e-2, 3e-2],
    "steps": 4,
    "warmup": 1,
    "batch_size": 6,
    "eval_size": 12,
    "mqar_kv": [1, 2],
    "ar_pairs": [2],
}


def _ctx(tmp_path, **over):
    preset = load_preset("tiny")
    preset.suites["toys"] = {**MICRO, **over}
    rec = Recorder(tmp_path, preset.name, 0, run_id="test")
    return Context(preset=preset, seed=0, recorder=rec, work_dir=tmp_path / "work", progress=False)


def test_defaults_are_the_tiny_preset():
    assert load_preset("tiny").settings("toys", toys.Settings) == toys.Settings()
    load_preset("paper").settings("toys", toys.Settings).check()


def test_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'speed'"):
        _ctx(tmp_path, speed=1).preset.settings("toys", toys.Settings)
    with pytest.raises(ConfigError, match="mqar_kv"):
        toys.Settings(mqar_kv=[5], mqar_seq_len=16).check()
    with pytest.raises(ConfigError, match="unknown layer"):
        toys.Settings(layer_options={"fwpmk": {}}).check()


def test_toy_config_places_the_layer_and_merges_options():
    preset, s = load_preset("tiny"), toys.Settings()
    mc = toys.toy_config(preset, "fwpkm", 64, 32, s)
    assert (mc.d_model, mc.n_layers, mc.vocab_size, mc.gdn_head_dim, mc.ffn_dim) == (64, 2, 32, 16, 192)
    assert mc.layout == "GDN | fwpkm@last"
    assert mc.memory["fwpkm"] == {**preset.layers["fwpkm"].options, "chunk_size": 4}
    assert toys.toy_config(preset, BASELINE, 32, 37, s).memory == {}


def test_micro_run_records_rows_tables_and_figures(tmp_path):
    ctx = _ctx(tmp_path)
    rows = toys.run(ctx, [BASELINE, "fwpkm"])
    assert len(rows) == 2 * 2 * 2  # layers x tasks x widths
    saved = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(saved) == len(rows)
    for r in rows:
        m = r["metrics"]
        assert r["suite"] == "toys" and set(r["setting"]) == {"task", "d_model"}
        assert 0.0 <= m["accuracy"] <= 1.0 and m["best_lr"] in MICRO["lrs"]
        assert set(m["acc_by_lr"]) == {"0.01", "0.03"}
        kv = MICRO["mqar_kv"] if r["setting"]["task"] == "mqar" else MICRO["ar_pairs"]
        assert set(m["acc_by_kv"]) == {str(n) for n in kv}
        assert m["state_size"] == m["gdn_state"] + m["mem_state"]
        assert r["config"]["settings"] == dataclasses.asdict(ctx.preset.settings("toys", toys.Settings))
    base = {(r["setting"]["task"], r["setting"]["d_model"]): r["metrics"] for r in rows if r["layer"] == BASELINE}
    assert base[("mqar", 16)]["gdn_state"] == 2 * 4 * 4 * 4  # 2 GDN layers x 4 heads x 4^2
    assert base[("mqar", 16)]["mem_state"] == 0
    fw = [r["metrics"] for r in rows if r["layer"] == "fwpkm"]
    assert all(m["state_shared"] and m["mem_state"] == 64 * 64 * 64 + 2 * 64 * 32 for m in fw)

    df = pd.json_normalize([{k: v for k, v in r.items() if k != "config"} for r in saved])
    tabs = toys.tables(df)
    assert list(tabs) == [
        "MQAR accuracy by key-value pairs (best lr)",
        "Ba's associative retrieval accuracy by pairs (best lr)",
        "Recurrent state per sequence (numbers)",
        "Mean accuracy per learning rate",
    ]
    mq = tabs["MQAR accuracy by key-value pairs (best lr)"]
    assert list(mq["layer"]) == [BASELINE, BASELINE, "fwpkm", "fwpkm"]
    assert {"kv=1", "kv=2", "state", "mean"} <= set(mq.columns)
    for t in tabs.values():
        assert t.to_markdown()
    paths = toys.figures(df, tmp_path / "a")
    assert [p.name for p in paths] == ["toys_mqar_capacity.png", "toys_mqar_by_kv.png"]
    again = toys.figures(df.iloc[::-1], tmp_path / "b")  # row order does not change the bytes
    assert [p.read_bytes() for p in paths] == [p.read_bytes() for p in again]
