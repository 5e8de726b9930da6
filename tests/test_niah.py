"""NIAH: the construction (memzoo.data.niah), the training mixture, the n-iter protocol and
the suite's tables/figures (memzoo.bench.suites.niah)."""

from __future__ import annotations

import re

import hashlib
import math

import pandas as pd
import pytest
import torch

import memzoo.layers  # noqa: F401  (registers the layers)
from memzoo.backbone.model import HybridLM
from memzoo.bench.report import niah as report
from memzoo.bench.suites import niah as suite
from memzoo.bench.common import load_preset, logit_ci, mean_ci, model_config, wilson
from memzoo.data import LMStream, get_tokenizer
from memzoo.data.niah import NEEDLE, NeedleMix, TextSource, make_sample, niah_samples

TOK = get_tokenizer("byte")
TRAIN = [
    "\n".join(f"Line {i} of the first training play, with some words in it." for i in range(300)),
    "\n".join(f"Another training line number {i}; and more words follow here." for i in range(300)),
]
HELD_OUT = ["\n".join(f"HELD OUT verse {i}: the quality of mercy is not strained." for i in range(400))]


def small_model(layer: str) -> HybridLM:
    torch.manual_seed(0)
    p = load_preset("tiny")
    return HybridLM(model_config(p, layer, d_model=32, n_layers=4, ffn_dim=64, gdn_heads=2, gdn_head_dim=16)).eval()


# ---- construction -----------------------------------------------------------------------------


def test_sample_has_five_unique_needles_and_a_question_for_one():
    for i, s in enumerate(niah_samples(HELD_OUT, TOK, 1024, 6, seed=3, depth_buckets=3)):
        assert s.length == 1024 and s.haystack.dtype == torch.long
        keys = [n.key for n in s.needles]
        assert len(keys) == 5 and len(set(keys)) == 5
        assert all(len(k) == 4 and k.isalpha() and k.islower() for k in keys)
        assert len({n.value for n in s.needles}) == 5
        assert all(len(n.value) == 6 and n.value.isdigit() and n.value[0] != "0" for n in s.needles)
        text = TOK.decode(s.haystack)
        for n in s.needles:  # each needle is where it says, and starts a line
            needle = NEEDLE.format(key=n.key, value=n.value)
            assert TOK.decode(s.haystack[n.position : n.position + len(needle)]) == needle
            assert n.position == 0 or text[n.position - 1] == "\n"
            assert n.depth == n.position / 1024
        q = s.needles[s.query]
        assert TOK.decode(s.question).endswith(f"? {q.key}=")
        assert TOK.decode(s.answer) == q.value and s.answer.numel() == 6
        assert min(int(s.depth * 3), 2) == i % 3  # the queried needle's depth is stratified
        assert "HELD OUT" in text and "training" not in text  # haystack from the given (held-out) text


def test_samples_are_deterministic_and_seeded():
    a = niah_samples(HELD_OUT, TOK, 512, 3, seed=0)
    b = niah_samples(HELD_OUT, TOK, 512, 3, seed=0)
    c = niah_samples(HELD_OUT, TOK, 512, 3, seed=1)
    for x, y in zip(a, b):
        assert torch.equal(x.haystack, y.haystack) and torch.equal(x.question, y.question) and x.needles == y.needles
    assert not all(torch.equal(x.haystack, y.haystack) for x, y in zip(a, c))


def test_long_haystack_wraps_round_short_text_and_short_one_is_an_error():
    import random

    src = TextSource(["one line\ntwo lines\n"], TOK)
    s = make_sample(src, 600, random.Random(0))
    assert s.length == 600
    with pytest.raises(ValueError, match="cannot hold"):
        make_sample(src, 100, random.Random(0))


# ---- training mixture -------------------------------------------------------------------------


def test_needle_mix_is_deterministic_and_mixes_the_fraction():
    docs = [TOK.encode_tensor(t) for t in TRAIN]
    plain = LMStream(docs, 128, seed=0)
    mix = NeedleMix(plain, TRAIN, TOK, 128, mix=0.3, seed=0)
    x, y = mix.batch(5, 16)
    x2, y2 = mix.batch(5, 16)
    assert torch.equal(x, x2) and torch.equal(y, y2) and x.shape == (16, 128)
    px, _ = plain.batch(5, 16)
    n, changed = 0, 0
    for step in range(40):
        x, y = mix.batch(step, 16)
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted
        px, _ = plain.batch(step, 16)
        for r in range(16):
            n += 1
            if not torch.equal(x[r], px[r]):
                changed += 1
                text = TOK.decode(torch.cat([x[r], y[r, -1:]]))
                asked = re.findall(r"\nWhat is ([a-z]{4})\? \1=(\d{6})", text)
                assert asked and text.endswith(asked[-1][1])  # the last answer closes the window
                for key, value in asked:  # every question asks a needle of the window, answered
                    assert f"Remember {key}={value}.\n" in text
    assert 0.2 < changed / n < 0.4
    assert torch.equal(NeedleMix(plain, TRAIN, TOK, 128, mix=0.0).batch(3, 4)[0], plain.batch(3, 4)[0])
    weighted = NeedleMix(plain, TRAIN, TOK, 128, mix=0.3, seed=0, answer_weight=20.0)
    for step in range(10):  # the same windows; the answer digits (and nothing else) weigh 20
        x, y = mix.batch(step, 16)
        wx, (wy, w) = weighted.batch(step, 16)
        assert torch.equal(x, wx) and torch.equal(y, wy) and set(w.unique().tolist()) <= {1.0, 20.0}
        for r in range(16):
            text = TOK.decode(torch.cat([x[r], y[r, -1:]]))
            answers = [m.span(1) for m in re.finditer(r"\nWhat is [a-z]{4}\? [a-z]{4}=(\d{6})", text)]
            want = torch.zeros(128)
            for a, b in answers:  # target t is token t + 1 of the window
                want[a - 1 : b - 1] = 1
            assert torch.equal(w[r] == 20.0, want.bool())
    with pytest.raises(ValueError, match="answer_weight"):
        NeedleMix(plain, TRAIN, TOK, 128, answer_weight=0.0)
    with pytest.raises(ValueError, match="too short"):
        NeedleMix(plain, TRAIN, TOK, 40, mix=0.3)


# ---- the n-iter protocol ----------------------------------------------------------------------


def test_streaming_in_pieces_equals_one_call():
    model = small_model("baseline")
    s = niah_samples(HELD_OUT, TOK, 512, 1, seed=0)[0]
    one = suite.read_and_ask(model, s, [1, 2], piece=512)
    pieces = suite.read_and_ask(model, s, [1, 2], piece=128)
    only2 = suite.read_and_ask(model, s, [2], piece=256)
    for n in (1, 2):
        assert one[n].shape == (6, model.config.vocab_size)
        torch.testing.assert_close(pieces[n], one[n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(only2[2], one[2], atol=1e-4, rtol=1e-4)  # asking after pass 1 changes nothing
    # the reference: the whole stream haystack, haystack, question in one call
    full = torch.cat([s.haystack, s.haystack, s.question, s.answer[:-1]])[None]
    ref = model(full).logits[0, 2 * 512 + s.question.numel() - 1 :]
    torch.testing.assert_close(one[2], ref, atol=1e-4, rtol=1e-4)


def test_fwpkm_pass_is_one_memory_update_and_samples_do_not_leak():
    model = small_model("fwpkm")
    mems = model.memories()
    assert mems and all(suite.stretchable(m) for m in mems)
    s = niah_samples(HELD_OUT, TOK, 512, 1, seed=0)[0]
    start = model.memory_state()
    got = suite.read_and_ask(model, s, [1, 2], piece=128)
    # the same as reading each pass in one call with the update chunk = the haystack length
    model.load_memory_state(start)
    for m in mems:
        m.chunk_size = 512
    ref = suite.read_and_ask(model, s, [1, 2], piece=512, stretch_chunk=False)
    for m in mems:
        m.chunk_size = 64
    for n in (1, 2):
        torch.testing.assert_close(got[n], ref[n], atol=1e-4, rtol=1e-4)
    # without stretching, the layer updates every 64 tokens: a different result
    model.load_memory_state(start)
    plain = suite.read_and_ask(model, s, [1], piece=128, stretch_chunk=False)
    assert not torch.allclose(plain[1], got[1], atol=1e-4)
    # evaluate_niah restores the trained fast weights per sample and at the end
    model.load_memory_state(start)
    cfg = suite.Settings(lengths=[512], iters=[1, 2], samples=2, depth_buckets=2, piece=256)
    rows = suite.evaluate_niah(model, HELD_OUT, TOK, cfg)
    for m, st in zip(mems, start):
        for k, v in m.state.items():
            assert torch.equal(v, st[k])
    again = suite.evaluate_niah(model, HELD_OUT, TOK, cfg)
    assert [r["metrics"]["digit_accuracy"] for r in rows] == [r["metrics"]["digit_accuracy"] for r in again]
    assert [(r["setting"]["length"], r["setting"]["n_iter"]) for r in rows] == [(512, 1), (512, 2)]
    m = rows[0]["metrics"]
    assert m["n_samples"] == 2 and 0 <= m["accuracy"] <= 1 and set(m["by_depth"]) == {"0-50%", "50-100%"}
    assert m["tokens_per_s"] > 0 and m["peak_rss_gib"] > 0 and m["answer_nll"] > 0 and m["digit_accuracy_half"] >= 0


def test_settings_reject_unknown_keys_and_bad_values():
    from memzoo.config import ConfigError

    p = load_preset("tiny")
    s = p.settings(suite.NAME, suite.Settings)
    assert s.lengths and s.iters == [1, 2, 3, 4]
    with pytest.raises(ConfigError, match="unknown key"):
        p.suites["niah"] = {"lenghts": [1]}
        p.settings(suite.NAME, suite.Settings)
    with pytest.raises(ConfigError, match="iters"):
        suite.Settings(iters=[0])
    assert load_preset("paper").settings(suite.NAME, suite.Settings).train_mix == 0.0
    with pytest.raises(ConfigError, match="niah.lm: .*seq_lenn"):
        suite.Settings(lm={"seq_lenn": 128})


def test_niah_lms_of_its_own(tmp_path):
    """With `niah.lm` the niah suite's LMs are trained apart (the train: section changed by it,
    the needle mixture) and ppl's read plain text; without it the two suites share one LM."""
    from memzoo.bench.common import Context, Recorder
    from memzoo.bench.lm import lm_config, untrained_steps

    p = load_preset("tiny")
    ctx = Context(p, 0, Recorder(tmp_path, p.name, 0), tmp_path, "cpu", False)
    (ppl_rc, ppl_mix, k1), (niah_rc, niah_mix, k2) = (lm_config(ctx, "fwpkm", s) for s in ("ppl", "niah"))
    assert k1 == k2 and ppl_mix == niah_mix == {"train_mix": 0.3}
    assert untrained_steps(ctx, "fwpkm", ["ppl", "niah"]) == p.lm["steps"]  # one LM, trained once
    p.suites["niah"] = {"lm": {"seq_len": 128, "steps": 7}, "train_mix": 1.0, "answer_weight": 20}
    (ppl_rc, ppl_mix, k1), (niah_rc, niah_mix, k2) = (lm_config(ctx, "fwpkm", s) for s in ("ppl", "niah"))
    assert k1 != k2 and ppl_mix == {"train_mix": 0.0} and niah_mix == {"train_mix": 1.0, "answer_weight": 20}
    assert (ppl_rc.train.seq_len, niah_rc.train.seq_len, niah_rc.train.steps) == (256, 128, 7)
    assert ppl_rc.train.batch_size == niah_rc.train.batch_size == p.lm["batch_size"]  # the rest is train:'s
    assert untrained_steps(ctx, "fwpkm", ["ppl", "niah"]) == p.lm["steps"] + 7


# ---- tables and figures -------------------------------------------------------------------------


def fake_rows(control_acc: float = 1.0, controls: bool = True) -> pd.DataFrame:
    """NIAH rows of 8 samples at 192 tokens (inside the LMs' 256-token training length) and 1K."""
    rows = []
    layers = {"fwpkm": 2, "baseline": 0, **({"ctrl:attention": 0, "ctrl:none": 0} if controls else {})}
    for layer, k in layers.items():
        for length in (192, 1024):
            for n in (1, 2, 3, 4):
                acc = min(1.0, 0.125 * n * k)
                if layer == "ctrl:attention":
                    acc = control_acc
                lo, hi = wilson(round(8 * acc), 8)
                rows.append({
                    "suite": "niah", "layer": layer, "preset": "tiny", "seed": 0, "wall_s": 1.0,
                    "setting": {"length": length, "n_iter": n},
                    "metrics": {"accuracy": acc, "accuracy_lo": lo, "accuracy_hi": hi, "digit_accuracy": max(acc, 0.1),
                                "digit_accuracy_half": 0.1 if layer == "fwpkm" else 0.05,
                                "answer_nll": 2.3 - acc, "n_samples": 8, "tokens_per_s": 1000.0 + length,
                                "peak_rss_gib": 0.5, "by_depth": {"0-50%": acc, "50-100%": acc / 2},
                                "inside_training": length < 256},
                })
    return pd.json_normalize(rows)


def test_wilson_interval_hand_computed():
    # 5 of 10: p = 0.5, centre (0.5 + 1.96^2/20) / (1 + 1.96^2/10), half-width 1.96 sqrt(0.025 + 1.96^2/400) / (1 + 1.96^2/10)
    assert wilson(5, 10) == pytest.approx((0.23659, 0.76341), abs=1e-5)
    assert wilson(0, 10) == pytest.approx((0.0, 0.27754), abs=1e-5)  # upper: z^2/n / (1 + z^2/n)
    assert wilson(10, 10) == pytest.approx((0.72246, 1.0), abs=1e-5)


def test_tables_and_figures(tmp_path):
    df = fake_rows()
    t = report.tables(df)
    acc = t["NIAH exact-match accuracy (%) [95% interval over samples], length x n-iter"]
    assert list(acc.index) == ["baseline", "fwpkm", "ctrl:attention", "ctrl:none"]
    assert list(acc.columns)[:4] == ["family", "seeds", "192 x1", "192 x2"] and set(acc["seeds"]) == {1}  # one training seed each
    assert acc.loc["baseline", "192 x1"] == "0.0 [0, 32]"  # 0 of 8: upper z^2/8 / (1 + z^2/8)
    assert acc.loc["fwpkm", "1K x2"] == "50.0 [22, 78]"  # 4 of 8: overlaps the baseline's [0, 32]
    assert acc.loc["fwpkm", "1K x3"] == "75.0 [41, 93] ▲"  # 6 of 8: wholly above it
    assert t["NIAH answer NLL (nats per answer token; chance ln 10), length x n-iter"].loc["fwpkm", "1K x1"] == 2.05
    digits = t["NIAH answer digits right (%, [95% interval over samples, within 0-100] where recorded; ▲/▼ as above), "
               "length x n-iter"]
    assert digits.loc["baseline", "1K x1"] == "10.0 [5.0, 15.0]"
    assert digits.loc["fwpkm", "1K x1"] == "25.0 [15.0, 35.0]"  # touches the baseline's [5, 15]: no mark
    assert digits.loc["fwpkm", "1K x3"] == "75.0 [65.0, 85.0] ▲"
    assert list(t["NIAH throughput and memory"]["layer"])[:2] == ["baseline", "baseline"]
    for table in t.values():
        table.to_markdown()
    recalls = fake_rows()
    recalls.loc[recalls["layer"] == "baseline", "metrics.digit_accuracy"] = 0.3  # the backbone finds needles itself
    for bad, why in ((fake_rows(control_acc=0.875), "positive control's exact match is 87.5% at 192 tokens"),
                     (fake_rows(controls=False), "the controls were not run"),
                     (recalls, "the backbone alone (baseline) gets 30.0% of the digits")):
        t = report.tables(bad)
        (title, table), = [(k, v) for k, v in t.items() if "exact-match" in k]
        assert title.startswith("HARNESS INVALID") and why in title
        assert set(table.index) <= {"ctrl:attention", "ctrl:none"}  # layer rows withheld
        assert all(set(v.get("layer", pd.Series(dtype=str))) <= {"ctrl:attention", "ctrl:none"} for v in t.values())
    df = df[df["setting.n_iter"] <= 2]  # fewer panels: the same code, faster
    paths = report.figures(df, tmp_path / "a")
    assert [p.name for p in paths] == ["niah_iters.png", "niah_depth.png"]
    again = report.figures(df.sample(frac=1, random_state=0), tmp_path / "b")
    for p, q in zip(paths, again):  # deterministic: same data, same bytes
        assert hashlib.sha256(p.read_bytes()).hexdigest() == hashlib.sha256(q.read_bytes()).hexdigest()


def seeded(df: pd.DataFrame, layers, seeds=(1, 2)) -> pd.DataFrame:
    """`df` with the rows of `layers` repeated for training seeds `seeds` (as a bench run with
    --seed adds the baseline's and the controls' LMs beside the layers')."""
    extra = [df[df["layer"].isin(layers)].assign(seed=s) for s in seeds]
    return pd.concat([df, *extra], ignore_index=True)


def test_logit_interval_of_three_proportions_by_hand_stays_inside_0_1():
    # n = 48: clipped to [1/96, 95/96], logits -ln 95, 0, ln 95; sd ln 95, half t(0.975, 2) ln 95 / sqrt 3
    half = 4.303 * math.log(95) / math.sqrt(3)
    mean, lo, hi = logit_ci([0.0, 0.5, 1.0], [48] * 3)
    assert (mean, lo, hi) == pytest.approx((0.5, 1 / (1 + math.exp(half)), 1 / (1 + math.exp(-half))), rel=1e-9)
    assert 0 < lo < 0.001 and 0.999 < hi < 1  # mean ± t of the values themselves reaches past both ends
    m, h = mean_ci([0.0, 0.5, 1.0])
    assert m - h < 0 and m + h > 1
    # seeds that agree at 0: the clipped point (0.5/n, or 1e-3 without n) widened to hold the mean
    assert logit_ci([0.0, 0.0], [48, 48]) == pytest.approx((0.0, 0.0, 1 / 96))
    assert logit_ci([0.0, 0.0]) == pytest.approx((0.0, 0.0, 1e-3))


def test_tables_aggregate_training_seeds():
    """A layer with 3 seeds: the mean and a 95% interval over the trainings (logit scale for
    exact match, plain t for the answer loss), marked against the baseline's seeds; a layer with
    one seed: today's cell, marked against the baseline's row of its seed."""
    df = fake_rows()
    one = df[df["layer"] == "fwpkm"].assign(layer="fwl")  # one seed: fwpkm's seed-0 rows under another name
    df = seeded(pd.concat([df, one], ignore_index=True), ["baseline", "fwpkm", "ctrl:attention", "ctrl:none"])
    at = (df["layer"] == "fwpkm") & (df["setting.length"] == 1024) & (df["setting.n_iter"] == 1)
    for seed, acc in ((0, 0.5), (1, 0.75), (2, 1.0)):
        df.loc[at & (df["seed"] == seed), ["metrics.accuracy", "metrics.answer_nll"]] = acc, 2.3 - acc
    t = report.tables(df)
    (title, acc), = [(k, v) for k, v in t.items() if k.startswith("NIAH exact-match")]
    assert title == "NIAH exact-match accuracy (%) [95% interval over samples; over trainings where seeds > 1], length x n-iter"
    assert acc["seeds"].to_dict() == {"baseline": 3, "fwl": 1, "fwpkm": 3, "ctrl:attention": 3, "ctrl:none": 3}
    # n = 8: 1.0 clipped to 15/16; logits 0, ln 3, ln 15, their mean and t-interval mapped back
    z = [0.0, math.log(3), math.log(15)]
    m = sum(z) / 3
    half = 4.303 * math.sqrt(sum((v - m) ** 2 for v in z) / 2) / math.sqrt(3)
    lo, hi = 100 / (1 + math.exp(half - m)), 100 / (1 + math.exp(-m - half))
    assert (round(lo), round(hi)) == (11, 99)
    # ▲: above the baseline's interval over its three trainings, all at 0: [0, 100/16]
    assert acc.loc["fwpkm", "1K x1"] == f"75.0 [{lo:.0f}, {hi:.0f}] ▲"
    assert acc.loc["baseline", "1K x1"] == "0.0 [0, 6]"
    # the answer loss: 1.8, 1.55, 1.3, the mean and its t-interval over the seeds, bounded below by 0
    nll = next(v for k, v in t.items() if k.startswith("NIAH answer NLL"))
    h = 4.303 * 0.25 / math.sqrt(3)
    assert nll.loc["fwpkm", "1K x1"] == f"1.550 [{max(0.0, 1.55 - h):.3f}, {1.55 + h:.3f}]"
    assert nll.loc["fwl", "1K x1"] == "2.05"  # one seed: as a float prints in a column of numbers
    # one seed: the cells of today (fwpkm's seed 0 before), against the baseline's seed-0 row
    one_seed = report.tables(fake_rows())
    for old, new in ((one_seed[next(iter(one_seed))], acc),
                     (next(v for k, v in one_seed.items() if k.startswith("NIAH answer digits")),
                      next(v for k, v in t.items() if k.startswith("NIAH answer digits")))):
        # (the family differs: the rows are fwpkm's numbers under fwl's name)
        assert new.loc["fwl"].drop(["seeds", "family"]).to_dict() == old.loc["fwpkm"].drop(["seeds", "family"]).to_dict()
    assert acc.loc["fwl", "1K x3"] == "75.0 [41, 93] ▲"
    costs = next(v for k, v in t.items() if k.startswith("NIAH throughput"))
    assert costs.set_index(["layer", "length"])["seeds"].to_dict()[("fwpkm", 1024)] == 3


def test_validity_judges_every_seed_of_the_controls():
    df = seeded(fake_rows(), ["baseline", "fwpkm", "ctrl:attention", "ctrl:none"])
    assert report.validity(df) == []
    pos = df.copy()  # the positive control misses in one seed of three
    pos.loc[(pos["layer"] == "ctrl:attention") & (pos["seed"] == 2) & (pos["setting.length"] == 192), "metrics.accuracy"] = 0.875
    assert report.validity(pos) == ["the positive control's exact match is 87.5% at 192 tokens in seed 2 (< 90%)"]
    (title, table), = [(k, v) for k, v in report.tables(pos).items() if "exact-match" in k]
    assert title.startswith("HARNESS INVALID") and set(table.index) == {"ctrl:attention", "ctrl:none"}
    neg = df.copy()  # the negative control finds needles in one seed
    neg.loc[(neg["layer"] == "ctrl:none") & (neg["seed"] == 1), "metrics.digit_accuracy"] = 0.3
    assert report.validity(neg) == ["the negative control gets 30.0% of the digits in seed 1, above twice chance (10%)"]
    gone = df[~((df["layer"] == "ctrl:attention") & (df["seed"] == 2))]  # a seed without its controls
    assert report.validity(gone) == ["the controls were not run in seed 2 (niah.controls)"]


def test_fwpkm_gate_and_hit_diagnostics_with_one_slot_by_hand():
    """research/niah_fwpkm on a memory of one slot (top-1 of 1² slots), so every read
    has weight 1 on slot 0, and after a pass written as one chunk (lookahead: q_t stores
    v_{t+1}) its last writer is the pass's last token. The haystack ends with the needle's
    value 481444, so that writer is the needle's last digit "4": at the six answer positions
    the read stores the true next token wherever that is a 4 (hit = 4/6), is the matching needle
    digit only at the last (needle = 1/6), stores a digit every time (digit = 1) and always
    something this sample wrote (written = 1). In pass 2 the writer is the same digit one
    haystack later (n = 2: the same shares). The training-format read follows the same rule
    with chunks of 8. The gates are the layer's own at the needle's writing positions ("=" and
    the first five digits)."""
    from dataclasses import replace

    from research import niah_fwpkm
    from memzoo.data.niah import Needle, NiahSample

    torch.manual_seed(0)
    base = model_config(load_preset("tiny"), "baseline", d_model=32, n_layers=2, ffn_dim=64, gdn_heads=2, gdn_head_dim=16)
    mc = replace(base, layout="SWA | fwpkm@0", window=4,
                 memory={"fwpkm": {"key_dim": 8, "value_dim": 8, "n_subkeys": 1, "topk": 1, "chunk_size": 64}})
    model = HybridLM(mc).eval()
    text = "Some words of a play.\nRemember qzfa=481444"
    hay = torch.tensor(TOK.encode(text))
    q = torch.tensor(TOK.encode("\nWhat is qzfa? qzfa="))
    a = torch.tensor(TOK.encode("481444"))
    smp = NiahSample(hay, q, a, [Needle("qzfa", "481444", text.index("Remember"), 0.5)], 0)
    digit_ids = niah_fwpkm.digit_tokens(TOK)
    for n in (1, 2):
        (r,) = niah_fwpkm.measure_sample(model, smp, n, piece=1024, digit_ids=digit_ids)
        assert r["hit"] == pytest.approx(4 / 6) and r["needle"] == pytest.approx(1 / 6)
        assert r["digit"] == pytest.approx(1.0) and r["written"] == pytest.approx(1.0)
        logits = suite.read_and_ask(model, smp, [n], piece=1024)[n]
        assert r["digits"] == pytest.approx((logits.argmax(-1) == a).float().mean().item())
        assert 0 <= r["value_cos"] <= 1
    # training format, one window, chunks of 8: a read sees the slot as the previous chunk's last pair
    # left it, storing the token just before its own chunk (position 8·floor(p/8) - 1)
    mem = model.memories()[0]
    mem.chunk_size = 8
    window = torch.tensor(TOK.encode(text + ".\nWhat is qzfa? qzfa=481444"))
    answers = torch.zeros(window.numel(), dtype=torch.bool)
    answers[-6:] = True
    ans = torch.arange(window.numel() - 7, window.numel() - 1)  # inputs whose next token is a digit
    writer = ans // 8 * 8 - 1
    expect_hit = (window[writer] == window[ans + 1]).float().mean().item()
    expect_needle = (writer == torch.arange(d0 := text.index("481444"), d0 + 6)).float().mean().item()
    (r,) = niah_fwpkm.measure_windows(model, window[None], answers[None], 1, digit_ids)
    assert expect_hit == pytest.approx(3 / 6) and expect_needle == 0  # the question's own "4" at 63, read from 64 on
    assert r["questions"] == 1 and r["written"] == pytest.approx(1.0)  # (the means are rounded to 4 places)
    assert r["hit"] == pytest.approx(expect_hit, abs=1e-4) and r["needle"] == pytest.approx(expect_needle, abs=1e-4)
    assert r["digit"] == pytest.approx(torch.isin(window[writer], digit_ids).float().mean().item(), abs=1e-4)
    mem.chunk_size = 64
    from memzoo.inspection import restart_traces

    restart_traces(model)
    with torch.no_grad():
        model(hay[None])
    g = mem.stats()["gates"][0]
    on = torch.zeros(hay.numel(), dtype=torch.bool)
    on[d0 - 1 : d0 + 5] = True
    (r,) = niah_fwpkm.measure_sample(model, smp, 1, piece=1024, digit_ids=digit_ids)
    assert r["gate_needle"] == pytest.approx(g[on].mean().item(), abs=1e-6)
    assert r["gate_hay"] == pytest.approx(g[~on].mean().item(), abs=1e-6)
