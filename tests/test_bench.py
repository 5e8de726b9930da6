"""The bench harness: presets, layer/suite validation, recording with provenance, the ppl
protocol, deterministic leaderboard rendering, `memzoo inspect`. The suites' own numerics are
tested in test_toys.py, test_niah.py and test_cost.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from memzoo.bench.common import BASELINE, Context, Recorder, check_layers, load_preset, model_config, read_results
from memzoo.bench.report import ppl as ppl_report
from memzoo.bench.cli import main
from memzoo.config import ConfigError
from memzoo.registry import layer_names

MICRO = {
    "model": {"layout": "GDN", "vocab_size": 257, "d_model": 32, "n_layers": 2, "ffn_dim": 64,
              "gdn_heads": 2, "gdn_head_dim": 16, "attn_heads": 2, "attn_kv_heads": 2},
    "layers": {"fwpkm": {"at": "1", "options": {"key_dim": 16, "value_dim": 16, "n_subkeys": 8, "topk": 2,
                                                "chunk_size": 16}}},
    "train": {"corpus": "shakespeare", "tokenizer": "byte", "seq_len": 96, "batch_size": 2, "steps": 3,
              "warmup": 1, "eval_every": 3, "eval_batches": 1, "ckpt_every": 100},
    "ppl": {"seq_len": 32, "max_tokens": 96, "passages": 3, "passage_len": 16},
    "niah": {"train_mix": 0.5},
}


@pytest.fixture
def micro(tmp_path):
    path = tmp_path / "micro.yaml"
    path.write_text(yaml.safe_dump(MICRO))
    return path


def test_every_registered_layer_builds_in_both_presets():
    for preset in ("tiny", "paper"):
        p = load_preset(preset)
        for layer in [BASELINE, *layer_names()]:
            mc = model_config(p, layer)
            assert (layer == BASELINE) == ("|" not in mc.layout)


def test_a_built_in_suite_asked_for_before_the_suites_register_says_so():
    """`get_suite` before memzoo.bench.suites ran (a fresh interpreter): not "unknown suite 'niah' (did you
    mean 'niah'?)" but what to import."""
    import subprocess
    import sys

    code = "from memzoo.bench.registry import get_suite\ntry:\n    get_suite('niah')\nexcept ValueError as e:\n    print(e)"
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "suite 'niah' is not registered yet: import memzoo.bench.suites first" in said and "did you mean" not in said


def test_unknown_names_are_one_clear_error(capsys):
    with pytest.raises(ConfigError, match="valid layers: .*fwpkm"):
        check_layers(["fwpkm", "nope"])
    assert main(["bench", "--layers", "fwpkm,nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown layer 'nope'" in err and "lact" in err
    assert main(["bench", "--layers", "fwpkm", "--suite", "ppl,speed"]) == 2
    assert "unknown suite(s) 'speed'; valid suites: cost, pairs, toys, ppl, niah" in capsys.readouterr().err
    assert main(["bench", "--preset", "huge"]) == 2
    assert ("shipped presets: attach, capacity, gpu, paper, recall, recall-10x, recall-10x-seeds, recall-gpu, recall-state, "
            "recall-state-10x, standard, tiny"
            in capsys.readouterr().err)


def test_preset_rejects_unknown_keys(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**MICRO, "layers": {"fwpkm": {"where": "1"}}}))
    with pytest.raises(ConfigError, match="unknown key 'where'"):
        load_preset(bad)
    bad.write_text(yaml.safe_dump({**MICRO, "speed": {}}))
    with pytest.raises(ConfigError, match="unknown section"):
        load_preset(bad)


def test_recorder_appends_rows_with_provenance(tmp_path):
    rec = Recorder(tmp_path, "tiny", 3)
    rec.add("ppl", "fwpkm", {"corpus": "c"}, {"loss": 1.5}, {"model": {"d": 1}}, 0.25)
    rec.add("ppl", BASELINE, {"corpus": "c"}, {"loss": 1.7}, {"model": {"d": 2}}, 0.5)
    rows = read_results(tmp_path / "results.jsonl")
    assert [r["layer"] for r in rows] == ["fwpkm", BASELINE]
    for r in rows:
        for key in ("config", "config_hash", "seed", "git_sha", "versions", "hardware", "wall_s", "run_id", "time"):
            assert key in r, key
        assert r["versions"]["torch"] == torch.__version__
    assert rows[0]["config_hash"] != rows[1]["config_hash"]


def test_a_resumed_run_prints_the_whole_comparison(tmp_path):
    """A resumed run's tables cover what earlier runs recorded for its preset, suites and layers
    (variants, and the controls with the baseline), not only the cells it measured itself."""
    from memzoo.bench.run import _with_recorded

    old = Recorder(tmp_path, "standard", 0, run_id="old")
    for suite, layer in [("toys", BASELINE), ("toys", "ctrl:attention"), ("toys", "fwpkm/shared"), ("toys", "mom"),
                         ("ppl", "fwpkm")]:
        old.add(suite, layer, {"task": "mqar"}, {"accuracy": 0.5}, {"m": layer}, 0.1)
    Recorder(tmp_path, "tiny", 0, run_id="other").add("toys", "fwpkm", {"task": "mqar"}, {"accuracy": 0.1}, {}, 0.1)
    new = Recorder(tmp_path, "standard", 0, run_id="new")
    new.add("toys", "fwpkm", {"task": "mqar"}, {"accuracy": 0.9}, {}, 0.1)
    shown = _with_recorded(new, [BASELINE, "fwpkm"], ["toys"])
    assert sorted((r["layer"], r["run_id"]) for r in shown) == [
        (BASELINE, "old"), ("ctrl:attention", "old"), ("fwpkm", "new"), ("fwpkm/shared", "old")]
    assert [r["layer"] for r in _with_recorded(new, ["fwpkm"], ["toys"])] == ["fwpkm/shared", "fwpkm"]
    # a variant run alone (--layers fwpkm/shared) shows its own rows beside the baseline's
    assert [r["layer"] for r in _with_recorded(new, [BASELINE, "fwpkm/shared"], ["toys"])] == [
        BASELINE, "ctrl:attention", "fwpkm/shared"]


def test_a_resumed_run_shows_the_cells_its_preset_borrows_inside_its_own_section(tmp_path):
    """recall-state's top sizes and controls are the recall preset's cells (toys.reuse): a resumed run
    of it counts them (else its closing line called the harness invalid for want of controls), and
    shows them in its own section, not as a recall section of their own."""
    from memzoo.bench.report import _groups
    from memzoo.bench.run import _with_recorded

    old = Recorder(tmp_path, "recall", 0, run_id="old")
    for layer in (BASELINE, "ctrl:attention", "ctrl:none", "deltanet", "mom"):
        old.add("toys", layer, {"task": "mqar"}, {"accuracy": 0.5}, {"m": layer}, 0.1)
    new = Recorder(tmp_path, "recall-state", 0, run_id="new")
    new.add("toys", "deltanet/hd8", {"task": "mqar"}, {"accuracy": 0.2}, {"m": "deltanet/hd8"}, 0.1)
    shown = _with_recorded(new, [BASELINE, "deltanet"], ["toys"])
    assert sorted(r["layer"] for r in shown) == sorted([BASELINE, "ctrl:attention", "ctrl:none", "deltanet", "deltanet/hd8"])
    sections = [(name, preset, sorted(df["layer"])) for name, preset, _, df in _groups(shown, only="recall-state")]
    assert sections == [("toys", "recall-state", sorted(r["layer"] for r in shown))]


def test_ppl_protocol(micro, tmp_path):
    """The baseline has no memory: carried and reset evaluation agree exactly. FwPKM's carried
    memory changes the loss, and evaluation leaves the trained memory as it was."""
    from memzoo.bench.suites import ppl
    from memzoo.bench.lm import shared_lm

    ctx = Context(load_preset(micro), 0, Recorder(tmp_path, "micro", 0), tmp_path / "work", progress=False)
    rows = ppl.run(ctx, [BASELINE, "fwpkm"])
    probe = {r["layer"]: r["metrics"] for r in rows if r["setting"]["corpus"] == "repeat"}
    rows = [r for r in rows if r["setting"]["corpus"] != "repeat"]
    loss = {(r["layer"], r["setting"]["corpus"], r["setting"]["mode"]): r["metrics"]["loss"] for r in rows}
    for corpus in ("shakespeare", "sonnets"):
        assert loss[(BASELINE, corpus, "carry")] == loss[(BASELINE, corpus, "reset")]
        assert loss[("fwpkm", corpus, "carry")] != loss[("fwpkm", corpus, "reset")]
    assert all(math.isfinite(v) and r["metrics"]["tokens"] == 96 for r, v in zip(rows, loss.values()))
    carry = {(r["layer"], r["setting"]["corpus"]): r["metrics"] for r in rows if r["setting"]["mode"] == "carry"}
    assert carry[(BASELINE, "sonnets")]["gain"] == 0 and carry[(BASELINE, "sonnets")]["gain_half"] == 0
    # 96 tokens of a play in sequences of 32: targets 1..96 of the document, all in the first bucket
    assert carry[("fwpkm", "shakespeare")]["by_position"] == {"0-256": pytest.approx(loss[("fwpkm", "shakespeare", "carry")])}
    # the baseline carries nothing from the first reading: the second is the same computation
    assert probe[BASELINE]["gain"] == 0 and probe[BASELINE]["first_loss"] == probe[BASELINE]["second_loss"]
    assert probe["fwpkm"]["gain"] != 0 and probe["fwpkm"]["n_passages"] == 3
    model, _ = shared_lm(ctx, "fwpkm")
    before = {k: v.clone() for k, v in model.memories()[0].state.items()}
    ppl.eval_corpus(model, [torch.arange(80) % 50], ppl.Settings(seq_len=32), "carry", "cpu")
    for k, v in model.memories()[0].state.items():
        assert torch.equal(v, before[k])



def test_ppl_probe_withholds_layer_rows_when_the_positive_control_does_not_copy():
    """The repeated-passage probe's layer rows are published only beside a positive control
    whose gain's 95% interval lies wholly above ppl_report.MIN_PROBE_GAIN."""
    import pandas as pd

    from memzoo.bench.common import POSITIVE
    from memzoo.bench.suites import ppl

    def rows(control_gain, half):
        out = []
        for layer, gain in ((BASELINE, 0.0), ("fwpkm", 0.05), (POSITIVE, control_gain)):
            for corpus, mode in (("sonnets", "carry"), ("sonnets", "reset"), ("repeat", "carry")):
                m = {"loss": 1.5, "params": 1e6, "lm_steps": 10, "lm_tokens": 1e4, "lm_val_loss": 1.6, "lm_train_wall_s": 1.0}
                if corpus == "repeat":
                    m = {**m, "first_loss": 1.5, "second_loss": 1.5 - gain, "gain": gain, "gain_half": half, "n_passages": 32}
                elif mode == "carry":
                    m = {**m, "gain": 0.0, "gain_half": 0.0, "by_position": {"0-256": 1.5}}
                out.append({"suite": "ppl", "layer": layer, "setting": {"corpus": corpus, "mode": mode}, "metrics": m})
        return pd.json_normalize(out)

    good = ppl_report.tables(rows(0.5, 0.05))
    (title, probe), = [(k, v) for k, v in good.items() if "probe" in k]
    assert not title.startswith("HARNESS INVALID") and list(probe.index) == [BASELINE, "fwpkm", POSITIVE]
    for gain, half in ((-0.03, 0.02), (0.12, 0.05)):  # no copy; a gain whose interval reaches below 0.1
        t = ppl_report.tables(rows(gain, half))
        (title, probe), = [(k, v) for k, v in t.items() if "probe" in k]
        assert title.startswith("HARNESS INVALID (the positive control's gain is") and list(probe.index) == [POSITIVE]
        assert BASELINE in t["Perplexity"].index  # the carried-vs-reset tables do not depend on copying



def ppl_seed_rows(probe_gains: dict | None = None):
    """ppl rows of three training seeds for the baseline, fwpkm and the positive control and one
    for mom: fwpkm's sonnets carry loss 1.5 / 1.6 / 1.7, its gain 0.01 / 0.02 / 0.03 and its probe
    gain 0.05 / 0.06 / 0.07; `probe_gains` replaces the positive control's probe gain by seed."""
    import pandas as pd

    from memzoo.bench.common import POSITIVE

    out = []
    for layer, seeds in ((BASELINE, (0, 1, 2)), ("fwpkm", (0, 1, 2)), (POSITIVE, (0, 1, 2)), ("mom", (0,))):
        for seed in seeds:
            d = 0.1 * seed if layer == "fwpkm" else 0.0
            gain = {"fwpkm": 0.01 * (seed + 1), "mom": 0.05}.get(layer, 0.0)
            probe = {"fwpkm": 0.05 + 0.01 * seed, "mom": 0.05, POSITIVE: (probe_gains or {}).get(seed, 0.5)}.get(layer, 0.0)
            for corpus, mode in (("sonnets", "carry"), ("sonnets", "reset"), ("repeat", "carry")):
                m = {"loss": 1.5 + d, "params": 1e6, "lm_steps": 10, "lm_tokens": 1e4, "lm_val_loss": 1.6 + d,
                     "lm_train_wall_s": 1.0}
                if corpus == "repeat":
                    m = {**m, "first_loss": 1.5, "second_loss": 1.5 - probe, "gain": probe, "gain_half": 0.01, "n_passages": 32}
                elif mode == "carry":
                    m = {**m, "gain": gain, "gain_half": 0.01, "by_position": {"0-256": 1.5 + d}}
                out.append({"suite": "ppl", "layer": layer, "seed": seed, "setting": {"corpus": corpus, "mode": mode},
                            "metrics": m})
    return pd.json_normalize(out)


def test_ppl_tables_aggregate_training_seeds():
    """A layer with 3 seeds: the mean ± a 95% t-interval over the trainings, computed by hand, and
    how many seeds; a layer with one seed: the cell of today; marks against the baseline's seeds."""
    from memzoo.bench.common import POSITIVE
    from memzoo.bench.suites import ppl

    t = ppl_report.tables(ppl_seed_rows())
    half = 4.303 * 0.1 / math.sqrt(3)  # sd 0.1 over three seeds, t(0.975, 2)
    (title, loss), = [(k, v) for k, v in t.items() if k.startswith("Loss")]
    assert "over trainings where seeds > 1" in title
    assert loss["seeds"].to_dict() == {BASELINE: 3, "fwpkm": 3, "mom": 1, POSITIVE: 3}
    assert loss.loc["fwpkm", "sonnets carry"] == f"1.6000 ± {half:.4f}"
    assert loss.loc["fwpkm", "sonnets gain"] == f"+0.0200 ± {half / 10:.4f}"  # reaches below 0: no mark
    assert loss.loc[BASELINE, "sonnets carry"] == "1.5000 ± 0.0000"
    assert (loss.loc["mom", "sonnets carry"], loss.loc["mom", "sonnets gain"]) == ("1.5", "+0.0500 ± 0.0100 ▲")  # as today
    ppx = next(v for k, v in t.items() if k.startswith("Perplexity"))
    assert ppx.loc["fwpkm", "sonnets carry"] == f"{math.exp(1.6):.3f} [{math.exp(1.6 - half):.3f}, {math.exp(1.6 + half):.3f}]"
    assert ppx.loc["mom", "sonnets carry"] == "4.482"
    (title, probe), = [(k, v) for k, v in t.items() if "probe" in k]
    assert not title.startswith("HARNESS INVALID")
    assert probe.loc["fwpkm", "gain"] == f"+0.0600 ± {half / 10:.4f} ▲"  # wholly above the baseline's seeds' [0, 0]
    assert (probe.loc["mom", "gain"], probe.loc["mom", "seeds"]) == ("+0.0500 ± 0.0100 ▲", 1)
    by = next(v for k, v in t.items() if k.startswith("Carried loss by position"))
    assert by.loc["fwpkm sonnets", "0-256"] == f"1.6000 ± {half:.4f}" and by.loc["mom sonnets", "0-256"] == "1.5"
    lms = next(v for k, v in t.items() if k.startswith("The LMs"))
    assert lms["seeds"].to_dict() == {BASELINE: 3, "fwpkm": 3, "mom": 1, POSITIVE: 3}
    assert lms.loc["fwpkm", "LM val loss"] == f"1.7000 ± {half:.4f}" and lms.loc["mom", "LM val loss"] == "1.6"


def test_ppl_validity_fails_when_one_seed_of_the_positive_control_does_not_copy():
    from memzoo.bench.common import POSITIVE
    from memzoo.bench.suites import ppl

    assert ppl_report.validity(ppl_seed_rows()) == []
    bad = ppl_seed_rows({1: -0.03})
    assert ppl_report.validity(bad) == ["the positive control's gain in seed 1 is -0.030 ± 0.010 nats/token, not clearly above 0.1"]
    (title, probe), = [(k, v) for k, v in ppl_report.tables(bad).items() if "probe" in k]
    assert title.startswith("HARNESS INVALID") and list(probe.index) == [POSITIVE]
    rows = ppl_seed_rows()
    gone = rows[~((rows["layer"] == POSITIVE) & (rows["seed"] == 2))]
    assert ppl_report.validity(gone) == ["the positive control's probe was not run in seed 2 (niah.controls, ppl.passages)"]


def test_a_resumed_lm_suite_neither_trains_nor_evaluates_recorded_lms(micro, tmp_path, monkeypatch):
    """ppl and niah with `resume`: an LM whose every cell is recorded (same config and seed) is
    skipped, its rows returned; a changed setting evaluates it again."""
    import memzoo.bench.lm as lm
    from memzoo.bench.suites import niah, ppl

    preset, work = load_preset(micro), tmp_path / "work"
    first = Context(preset, 0, Recorder(tmp_path, "micro", 0), work, progress=False)
    rows = ppl.run(first, ["fwpkm"]) + niah.run(first, ["fwpkm"])
    n = len(read_results(tmp_path / "results.jsonl"))
    shared_lm = lm.shared_lm

    def no_lm(*args, **kwargs):
        raise AssertionError("a recorded LM was loaded again")

    monkeypatch.setattr(lm, "shared_lm", no_lm)
    again = Context(preset, 0, Recorder(tmp_path, "micro", 0), work, progress=False, resume=True)
    key = lambda rs: [(r["suite"], r["setting"], r["config_hash"], r["run_id"]) for r in rs]  # noqa: E731
    assert key(ppl.run(again, ["fwpkm"]) + niah.run(again, ["fwpkm"])) == key(rows)
    assert len(read_results(tmp_path / "results.jsonl")) == n  # nothing added
    # where the LMs were kept is no part of what was measured: another work dir finds the same rows
    elsewhere = Context(preset, 0, Recorder(tmp_path, "micro", 0), tmp_path / "elsewhere", progress=False, resume=True)
    assert key(ppl.run(elsewhere, ["fwpkm"]) + niah.run(elsewhere, ["fwpkm"])) == key(rows)
    assert not any("out_dir" in r["config"]["lm"]["train"] for r in rows)
    assert "host" not in rows[0]["config"]["ppl"]  # no host: the backbone's settings as before the field existed
    monkeypatch.setattr(lm, "shared_lm", shared_lm)
    changed = load_preset(micro)
    changed.suites["niah"] = {**changed.suites.get("niah", {}), "samples": 1}
    new = niah.run(Context(changed, 0, Recorder(tmp_path, "micro", 0), work, progress=False, resume=True), ["fwpkm"])
    assert len(read_results(tmp_path / "results.jsonl")) == n + len(new) and all(r["metrics"]["n_samples"] == 1 for r in new)


def test_a_row_that_recorded_its_lms_location_is_the_same_measurement_from_any_work_dir(tmp_path):
    """Rows written before LMs' locations left their configs (``lm.train.out_dir``) are found by a resumed
    run whose config has none, and pool with its rows; any other difference is another measurement."""
    from memzoo.bench.common import protocol_hash
    from memzoo.bench.report import latest

    config = {"lm": {"train": {"lr": 1e-3, "steps": 10}}, "ppl": {"seq_len": 8}}
    old = {**config, "lm": {"train": {**config["lm"]["train"], "out_dir": "/elsewhere/lm/fwpkm-0123"}}}
    Recorder(tmp_path, "p", 0).add("ppl", "fwpkm", {"corpus": "c"}, {"loss": 1.0}, old, 1.0)
    again = Recorder(tmp_path, "p", 0)
    assert again.find("ppl", "fwpkm", {"corpus": "c"}, config)["config"] == old
    assert again.find("ppl", "fwpkm", {"corpus": "c"}, {**config, "lm": {"train": {"lr": 2e-3, "steps": 10}}}) is None
    assert protocol_hash(old) == protocol_hash(config) != protocol_hash({**config, "ppl": {"seq_len": 9}})
    again.add("ppl", "fwpkm", {"corpus": "c"}, {"loss": 1.1}, config, 1.0)  # the same cell, seed, and protocol
    again.add("ppl", "fwpkm", {"corpus": "c"}, {"loss": 1.2}, {**config, "ppl": {"seq_len": 9}}, 1.0)  # another
    rows = read_results(tmp_path / "results.jsonl")
    for r, cpu in zip(rows, ("AMD EPYC", "Intel Xeon", "Apple M2")):  # one processor model each
        r["hardware"] = {**r["hardware"], "cpu": cpu}
    rows[2]["time"] = rows[1]["time"] = rows[0]["time"]
    rows[2]["run_id"] = "0"  # the other protocol measured first: the latest row's protocol is the pooled one
    assert sorted(r["metrics"]["loss"] for r in latest(rows, pooled=True)) == [1.0, 1.1]


def test_ppl_lms_with_persistent_fast_weights_read_documents_in_order(micro):
    """ppl.document_order: FwPKM's LM (fast weights shared and kept across steps) trains on a
    DocumentStream; the baseline's, and every niah LM, on random windows."""
    from memzoo.bench.lm import lm_config
    from memzoo.data import DocumentStream, LMStream
    from memzoo.train import prepare_data

    preset = load_preset(micro)
    preset.suites["ppl"] = {**preset.suites["ppl"], "document_order": True}
    ctx = Context(preset, 0, Recorder("/dev/null", "micro", 0), micro.parent / "work", progress=False)
    mix = {(layer, suite): lm_config(ctx, layer, suite)[1] for layer in (BASELINE, "fwpkm") for suite in ("ppl", "niah")}
    assert mix[("fwpkm", "ppl")]["document_order"] is True
    assert not any(m.get("document_order") for k, m in mix.items() if k != ("fwpkm", "ppl"))
    rc = lm_config(ctx, "fwpkm", "ppl")[0]
    assert isinstance(prepare_data(rc, document_order=True)[0], DocumentStream)
    assert isinstance(prepare_data(rc)[0], LMStream)


def test_leaderboard_renders_byte_for_byte(micro, tmp_path):
    out = tmp_path / "lb"
    assert main(["bench", "--layers", "fwpkm", "--suite", "ppl", "--preset", str(micro), "--out", str(out),
                 "--work-dir", str(tmp_path / "work"), "--quiet"]) == 0
    assert main(["leaderboard", "--out", str(out)]) == 0
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "results.jsonl")
    assert {p.name for p in files} >= {"README.md", "ppl.png", "ppl_gates.png"}
    first = {p: p.read_bytes() for p in files}
    for p in files:
        p.unlink()
    stale = out / "figures" / "gone" / "old.png"  # a figure of a section that no longer exists
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"png")
    assert main(["leaderboard", "--out", str(out)]) == 0
    assert {p: p.read_bytes() for p in files} == first
    assert not stale.exists() and not stale.parent.exists()
    readme = (out / "README.md").read_text()
    assert "## ppl" in readme and "| fwpkm" in readme and "| baseline" in readme


def test_ppl_figures_of_several_seeds_draw_the_same_bytes_every_time(tmp_path):
    """With several training seeds a bar is their mean with a bootstrap interval: its resampling
    is seeded, so the same rows draw the same figure whatever the global random state."""
    import numpy as np
    import pandas as pd

    df = pd.DataFrame([{"layer": layer, "seed": seed, "setting.corpus": corpus, "setting.mode": mode,
                        "metrics.loss": 1.5 + 0.1 * seed + (layer == "fwpkm") * 0.05 * (mode == "carry"),
                        "metrics.gate_hist.mem": [0.5 - 0.1 * seed, 0.5 + 0.1 * seed]}
                       for layer in (BASELINE, "fwpkm") for seed in range(3) for corpus in ("shakespeare", "sonnets")
                       for mode in ("carry", "reset")])
    drawn = []
    for state in (1, 2):
        np.random.seed(state)
        paths = ppl_report.figures(df, tmp_path / str(state))
        drawn.append({p.name: p.read_bytes() for p in paths})
    assert set(drawn[0]) == {"ppl.png", "ppl_gates.png"} and drawn[0] == drawn[1]


def test_inspect_prints_gates_and_trace(micro, tmp_path):
    from memzoo.bench.lm import lm_config, shared_lm
    from memzoo.inspection import inspect_text

    ctx = Context(load_preset(micro), 0, Recorder(tmp_path, "micro", 0), tmp_path / "work", progress=False)
    shared_lm(ctx, "fwpkm")
    rc, _, _ = lm_config(ctx, "fwpkm")
    text = "To be, or not to be, that is the question. " * 3
    out = inspect_text(rc.train.out_dir, text, top=2)
    assert "== memory 0: FwPKM ==" in out and "gate 0." in out
    assert "written by token" in out  # reads after the first 16-token chunk see what wrote the slots
    json.dumps(out)


def test_plan_queues_the_baselines_jobs_first_then_each_groups_first_then_the_costliest(micro, tmp_path):
    from memzoo.bench.run import plan

    two = tmp_path / "two.yaml"  # two seeds: every toy cell has a second in its group
    two.write_text(yaml.safe_dump({**MICRO, "toys": {"seeds": 2}}))
    ctx = Context(load_preset(two), 0, Recorder(tmp_path, "micro", 0), tmp_path / "work", progress=False)
    jobs = plan(ctx, ["baseline", "fwpkm", "mom"], ["toys", "ppl", "niah"])
    toy = [j for j in jobs if j.suites == ("toys",)]
    assert all(j.part is not None for j in toy) and len({j.part for j in toy}) == len(toy)  # one job per cell
    assert {j.part[0] for j in toy if j.layer == "baseline"} == {"baseline", "ctrl:attention", "ctrl:none"}
    lm = [j for j in jobs if j.part is None]  # a layer's LM suites stay one job: ppl then niah (one LM)
    assert sorted(j.layer for j in lm) == ["baseline", "fwpkm", "mom"] and {j.suites for j in lm} == {("ppl", "niah")}
    first = [j.layer == "baseline" for j in jobs]
    assert first == sorted(first, reverse=True)  # the baseline's jobs (and the controls) before any other
    # the first cell of every (model, task, width) before the second of any, each costliest first
    for base in (True, False):
        mine = [j for j in jobs if (j.layer == "baseline") == base]
        later = [i for i, j in enumerate(mine) if j.group is not None and j.group in {k.group for k in mine[:i]}]
        assert later == list(range(len(mine) - len(later), len(mine))) and len(later) > 0
        for part in (mine[: len(mine) - len(later)], mine[len(mine) - len(later):]):
            assert [j.cost for j in part] == sorted((j.cost for j in part), reverse=True)
    assert all(j.group == j.part[:3] for j in toy)
    mom, fwpkm = ({j.part[1:]: j.cost for j in toy if j.layer == n} for n in ("mom", "fwpkm"))
    assert all(mom[k] > fwpkm[k] for k in mom)  # MoM's bench_cost (2.0) over FwPKM's (1.6)


def test_workers_measure_what_one_process_measures(micro, tmp_path):
    """Two worker processes record the same numbers as one process (only timings differ)."""
    from memzoo.bench.run import run_bench

    one = run_bench("fwpkm", "ppl", str(micro), out=tmp_path / "a", work_dir=tmp_path / "wa", progress=False, jobs=1)
    two = run_bench("fwpkm", "ppl", str(micro), out=tmp_path / "b", work_dir=tmp_path / "wb", progress=False, jobs=2)
    key = lambda r: (r["layer"], json.dumps(r["setting"], sort_keys=True))  # noqa: E731
    loss = lambda rows: {key(r): r["metrics"].get("loss", r["metrics"].get("second_loss")) for r in rows}  # noqa: E731
    # 2 layers x (2 corpora x {carry, reset} + the repeated-passage probe)
    assert len(two) == len(one) == 10 and loss(two) == loss(one)
    assert len({r["run_id"] for r in two}) == 1


def test_a_dry_run_marks_recorded_lms_and_estimates_the_others(micro, tmp_path, capsys):
    """The LM suites' jobs in a dry run: an LM whose rows are all recorded (same work dir: its config
    names it) is marked, another gets its training steps and an estimate from the recorded LM rows."""
    from memzoo.bench.run import run_bench

    run_bench("fwpkm", "ppl", str(micro), out=tmp_path, work_dir=tmp_path / "w", progress=False, jobs=1)
    capsys.readouterr()
    run_bench("fwpkm,linear", "ppl", str(micro), out=tmp_path, work_dir=tmp_path / "w", progress=False, dry_run=True,
              device="cpu")
    text = capsys.readouterr().out
    lines = {ln.split()[1]: ln for ln in text.splitlines() if ln.startswith("ppl ")}
    assert "recorded" in lines["baseline"] and "recorded" in lines["fwpkm"]
    assert "LM steps" in lines["linear"] and "min" in lines["linear"]
    assert "3 LM jobs (ppl, niah), 2 recorded" in text and "from this preset's LM rows on this device" in text


def test_a_bench_worker_ends_when_its_parent_is_killed():
    """`exit_with`: a worker whose bench process dies (SIGKILL: no handler runs) stops instead of
    appending rows on its own."""
    import os
    import signal
    import subprocess
    import sys
    import time

    worker = ("import os, time; from memzoo.bench.run import exit_with; exit_with(os.getppid(), poll_s=0.1); "
              "print('up', flush=True); time.sleep(60)")
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys, time; w = subprocess.Popen([sys.executable, '-c', {worker!r}]); "
                               "print(w.pid, flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "up"  # the worker (same stdout) watches its parent
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    for _ in range(100):
        try:
            os.kill(pid, 0)  # still there?
        except ProcessLookupError:
            return
        if open(f"/proc/{pid}/stat").read().split()[2] == "Z":  # exited, not yet reaped
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError("the worker outlived its parent by 10 s")


def test_compile_cache_outlives_the_run_and_drops_killed_builds(tmp_path, monkeypatch):
    """`compile_cache`: the cache is <work dir>/compile-cache (kept for a resumed run); a kernel
    whose g++ build was killed (its scratch dir left, its library maybe truncated) loses its
    outputs, sources kept, so that it is rebuilt; finished kernels and a build that a live
    process holds the lock of are left alone; the same for precompiled headers."""
    import fcntl
    import os

    import torch._inductor.codecache as codecache

    from memzoo.bench.run import compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "elsewhere")  # restored after the test
    headers = tmp_path / "headers"
    monkeypatch.setattr(codecache, "_HEADER_DIR", str(headers))
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", str(headers / "locks"))
    cache = tmp_path / "work" / "compile-cache"

    def kernel(where, key, files, scratch=None):
        where.mkdir(parents=True, exist_ok=True)
        for f in files:
            (where / f"{key}{f}").write_bytes(b"\x7fELF")
        if scratch:  # the build's scratch dir, left by a kill
            (where / f"{key}{scratch}_CxxBuild").mkdir()
        return [where / f"{key}{f}" for f in files]

    killed = kernel(cache / "ab", "cab1", [".main.cpp", ".main.so", ".optimized.cpp", ".optimized.o"], ".main")
    done = kernel(cache / "ab", "cab2", [".main.cpp", ".main.so"])
    live = kernel(cache / "cd", "ccd3", [".main.cpp", ".main.so"], ".main")
    header = kernel(headers, "chh4", [".h", ".h.gch"], ".h")
    (cache / "locks").mkdir()
    fd = os.open(cache / "locks" / "ccd3.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process builds ccd3 now
    try:
        assert compile_cache(tmp_path / "work") == cache
    finally:
        os.close(fd)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache)
    assert [f.exists() for f in killed] == [True, False, True, False]  # the scratch dir went too
    assert not (cache / "ab" / "cab1.main_CxxBuild").exists()
    assert all(f.exists() for f in done + live) and (cache / "cd" / "ccd3.main_CxxBuild").exists()
    assert [f.exists() for f in header] == [True, False]


def test_gpu_check_lists_its_steps_and_refuses_a_machine_without_cuda(capsys, tmp_path, monkeypatch):
    from memzoo.bench import gpu_check

    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    for step in ("tests", "kernels", "train", "cost"):
        assert f"  {step} " in listed
    assert "test_cuda.py" in listed and "bench_kernels" in listed and "--preset" in listed
    assert gpu_check.main(["--dry-run", "--only", "train"]) == 0 and "  cost " not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--only", "tset"])
    assert "unknown step(s) tset" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path)]) == 2 and not any(tmp_path.iterdir())


def test_gpu_check_leaves_the_kernels_step_its_reserve():
    """The issue's loan of 370 s, where the cost step took its whole cap and left the kernels
    step nothing. By hand, every step using its whole limit: tests 180; train min(120, 370 - 180 -
    90) = 100; cost min(150, 370 - 280 - 90) = 0, skipped; kernels 370 - 280 = 90, its reserve. With
    450 s: tests 180, train 120, cost 60, kernels 90."""
    from memzoo.bench.gpu_check import STEPS, limits

    assert [s.name for s in STEPS][-1] == "kernels" and STEPS[-1].reserve_s == 90
    assert [limits(STEPS, 370, t, i) for i, t in enumerate((0, 180, 280, 280))] == [180, 100, 0, 90]
    assert [limits(STEPS, 450, t, i) for i, t in enumerate((0, 180, 300, 360))] == [180, 120, 60, 90]


def test_gpu_check_summarises_cost_rows_and_training(tmp_path):
    from memzoo.bench import gpu_check

    row = {"layer": "baseline", "setting": {"config": "paper/gdn"},
           "metrics": {"samples_per_s": 13.0, "samples_per_s_paper": 42.81, "tokens_per_s": 53248.0,
                       "flops_per_s": 3.7e13, "mfu": 0.047, "peak_flops_per_s": 7.87e14, "peak_mem_gb": 50.3}}
    (tmp_path / "results.jsonl").write_text(json.dumps(row) + "\n")
    [line] = gpu_check.figures("cost", tmp_path, "")
    assert line == "paper/gdn: 13.00 samples/s, paper 42.81; 53,248 tokens/s; 37 TFLOP/s = 5% of the measured 787; 50.3 GiB"
    assert gpu_check.figures("tests", tmp_path, "F..\n2 failed, 4 passed in 1.0s\n") == ["2 failed, 4 passed in 1.0s"]


def test_a_toys_variant_runs_alone(tmp_path):
    from memzoo.bench.run import run_bench
    from memzoo.bench.suites import toys

    assert check_layers(["FwPKM/token", "ba"]) == ["fwpkm/token", "ba"]
    with pytest.raises(ConfigError, match="unknown layer 'nope/token'"):
        check_layers(["nope/token"])
    s = load_preset("recall").settings(toys.NAME, toys.Settings)
    assert toys.models_of("fwpkm/token", s) == ["fwpkm/token"]
    assert toys.models_of("fwpkm", s) == ["fwpkm", "fwpkm/shared", *sorted(n for n in s.variants if n.startswith("fwpkm/t"))]
    with pytest.raises(ConfigError, match="a variant is a row of the toys or niah suite, not of cost"):
        run_bench("fwpkm/token", "cost", "recall", out=tmp_path, work_dir=tmp_path, progress=False)
    with pytest.raises(ConfigError, match="preset recall defines no such niah variant; it defines fwpkm/seq"):
        run_bench("fwpkm/token", "niah", "recall", out=tmp_path, work_dir=tmp_path, progress=False)
    with pytest.raises(ConfigError, match="defines no such toys variant; it defines fwpkm/shared, fwpkm/token, "):
        run_bench("fwpkm/tokn", "toys", "recall", out=tmp_path, work_dir=tmp_path, progress=False)


def test_each_published_table_says_what_its_rows_mix():
    from memzoo.bench.report import provenance

    def row(cpu, sha, gpu=None, version=2, run="r1"):
        return {"hardware": {"cpu": cpu, **({"gpu": gpu} if gpu else {})}, "git_sha": sha, "config": {"version": version},
                "run_id": run}

    one = [row("AMD EPYC", "a" * 40), row("AMD EPYC", "a" * 40)]
    assert provenance(one) == "*Measured on AMD EPYC (2 rows); code of 1 commit (aaaaaaa (2)); protocol version 2.*"
    mixed = [*one, row("Intel Xeon", "b" * 40 + "+dirty", version=1, run="r2"), row("x", "c" * 40, gpu="NVIDIA H200", run="r3")]
    line = provenance(mixed)
    assert "AMD EPYC (2 rows), Intel Xeon (1 row), NVIDIA H200 (1 row): **mixes processors**" in line
    assert "code of 3 commits" in line and "bbbbbbb+dirty (1)" in line
    assert "**combines 3 runs**: r1 (2), r2 (1), r3 (1)" in line
    assert "**mixes protocol versions** 2 (3), 1 (1)" in line


def test_a_table_row_names_its_layers_write_rule_family():
    """One helper resolves a row's name to its family's label: a layer, a variant (its layer's), and
    nothing for the baseline, the controls and a name no layer is registered under; the column
    follows the layer, a column or the index."""
    import pandas as pd

    from memzoo.bench.report import with_family
    from memzoo.layers.base import FAMILIES
    from memzoo.registry import family_of as family
    from memzoo.registry import get_layer

    assert family("linear") == "Hebbian outer product" and family("deltanet") == "delta rule"
    assert family("lact/lr1e-3") == family("lact") == "regression loss: gradient steps or exact solve"
    assert family("fwpkm/token") == "slots"
    assert [family(n) for n in (BASELINE, "ctrl:attention", "ctrl:none", "paper/gdn", "gone")] == [""] * 5
    builtin = ["linear", "ba", "mom", "deltanet", "gated_deltanet", "deltaproduct", "kda", "rwkv7", "fwl", "fwmlp",
               "lact", "ttt_linear", "ttt_mlp", "titans", "pkm", "fwpkm", "mamba2", "gla", "retnet", "hgrn2", "gsa",
               "mesanet", "loglinear_mamba2"]
    # (a plugin's layer may name none)
    assert family("mamba2") == family("gla") == family("retnet") == family("hgrn2") == "gated Hebbian outer product"
    assert family("gsa") == family("pkm") == "slots"
    assert all(get_layer(n).family in FAMILIES for n in builtin)
    assert {family(n) for n in builtin} == set(FAMILIES.values())
    t = with_family(pd.DataFrame({"layer": ["mom", BASELINE], "d_model": [64, 64]}))
    assert list(t.columns) == ["layer", "family", "d_model"] and list(t["family"]) == ["delta rule", ""]
    t = with_family(pd.DataFrame({"seeds": [3]}, index=pd.Index(["ba sonnets"], name="layer, corpus")))
    assert list(t.columns) == ["family", "seeds"] and t["family"].iloc[0] == "Hebbian outer product"


def test_no_table_mixes_machine_models_or_protocols():
    """Rows of one suite and preset on two machines (or of two protocol versions) are two sections,
    each named by its machine (and protocol). A section stays whole (its controls beside its rows)
    while one of its measurements is the latest of all (GPUs and CPUs apart), and is gone once all were
    measured again elsewhere."""
    from memzoo.bench.report import _groups, section_name

    def row(layer, cpu, t, version=3, gpu=None, seed=0):
        return {"suite": "cost", "preset": "paper", "layer": layer, "setting": {}, "seed": seed, "time": t, "run_id": t,
                "metrics": {"params": 1}, "hardware": {"cpu": cpu, **({"gpu": gpu} if gpu else {})},
                "config": {"version": version}, "git_sha": "a" * 40}

    rows = [row("baseline", "AMD EPYC", "1"), row("fwpkm", "AMD EPYC", "2"), row("fwpkm", "x", "3", gpu="NVIDIA H200"),
            row("pkm", "AMD EPYC", "4", version=2)]
    sections = [(sorted(df["layer"]), section_name(n, p, shown, rows)) for n, p, _, df, shown in _groups(rows, with_rows=True)]
    assert sections == [(["pkm"], "cost — preset `paper` — AMD EPYC, protocol 2"),
                        (["baseline", "fwpkm"], "cost — preset `paper` — AMD EPYC, protocol 3"),
                        (["fwpkm"], "cost — preset `paper` — NVIDIA H200, protocol 3")]
    rows.append(row("pkm", "AMD EPYC", "5"))  # protocol 2's only measurement, again under protocol 3
    sections = [(sorted(df["layer"]), section_name(n, p, shown, rows)) for n, p, _, df, shown in _groups(rows, with_rows=True)]
    assert sections == [(["baseline", "fwpkm", "pkm"], "cost — preset `paper` — AMD EPYC"),
                        (["fwpkm"], "cost — preset `paper` — NVIDIA H200")]
    one = [r for r in rows if r["layer"] == "baseline"]
    assert [section_name(n, p, shown, one) for n, p, _, _, shown in _groups(one, with_rows=True)] == ["cost — preset `paper`"]
    # a CPU measuring the GPU's rows again later does not retire the GPU's section (a timing on a GPU is
    # not what a CPU measures); another CPU model would
    rows.append(row("fwpkm", "Intel Xeon", "6"))
    names = [section_name(n, p, shown, rows) for n, p, _, _, shown in _groups(rows, with_rows=True)]
    assert "cost — preset `paper` — NVIDIA H200" in names and "cost — preset `paper` — Intel Xeon" in names


def test_a_torn_last_row_is_skipped_with_a_warning_and_the_next_row_starts_its_own_line(tmp_path):
    rec = Recorder(tmp_path, "tiny", 0)
    rec.add("cost", "baseline", {"b": 1}, {"x": 1.0}, {"c": 1}, 0.1)
    path = tmp_path / "results.jsonl"
    whole = path.read_text()
    path.write_text(whole + whole[: len(whole) // 2])  # a second write cut short
    with pytest.warns(UserWarning, match=r"results.jsonl:2: the last line is not a whole row"):
        assert len(read_results(path)) == 1
    with pytest.warns(UserWarning, match=r"its last line was torn .* set aside in results.jsonl.torn"):
        rec.add("cost", "baseline", {"b": 2}, {"x": 2.0}, {"c": 1}, 0.1)  # the torn tail set aside, not joined
    assert [r["setting"] for r in read_results(path)] == [{"b": 1}, {"b": 2}]
    assert (tmp_path / "results.jsonl.torn").read_text() == whole[: len(whole) // 2] + "\n"
    path.write_text(path.read_text() + '{"not a row"\n' + whole)
    with pytest.raises(Exception, match=r"results.jsonl:3: not a JSON row .*repair or delete that line"):
        read_results(path)  # a bad line inside the file (an edit): an error naming it
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], lines[1], "[1, 2]"]) + "\n")
    with pytest.raises(Exception, match=r"results.jsonl:3: not a result row \(it is a JSON list\)"):  # not torn
        read_results(path)


def test_the_leaderboard_names_a_bad_line_in_one_line(tmp_path, capsys):
    (tmp_path / "results.jsonl").write_text('{"suite": "cost"}\n{"x": 1}\n')
    assert main(["leaderboard", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "results.jsonl:1: not a result row (it lacks preset, layer, setting, seed, metrics, config_hash, run_id, time)" in err


def test_a_failing_measurement_is_one_line_a_row_and_the_exit_status(micro, tmp_path, monkeypatch, capsys):
    from dataclasses import replace

    from memzoo.bench.suites import SUITES

    real = SUITES["ppl"].run

    def breaks_for_fwpkm(ctx, layers, *a, **k):
        if layers == ["fwpkm"]:
            ctx.advance(5, "ppl fwpkm LM training")  # five steps in, then a fault
            raise RuntimeError("boom\nsecond line")
        return real(ctx, layers, *a, **k)

    monkeypatch.setitem(SUITES, "ppl", replace(SUITES["ppl"], run=breaks_for_fwpkm))
    args = ["bench", "--preset", str(micro), "--layers", "fwpkm", "--suite", "ppl", "--jobs", "1", "--quiet",
            "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")]
    assert main(args) == 1  # the exit status says that a measurement failed
    err = capsys.readouterr().err
    [line] = [ln for ln in err.splitlines() if ln.startswith("memzoo bench: FAILED")][:1]
    assert "ppl fwpkm" in line and "at step 5" in line and "RuntimeError: boom second line" in line and ".log)" in line
    rows = read_results(tmp_path / "out" / "results.jsonl")
    assert {r["layer"] for r in rows if r["suite"] == "ppl"} == {"baseline"}  # the rest of the run went on
    [failed] = [r for r in rows if r["suite"] == "failed"]
    assert failed["layer"] == "fwpkm" and failed["metrics"]["step"] == 5
    assert "RuntimeError: boom" in (tmp_path / "work" / "logs" / f"{failed['run_id']}.log").read_text()


def test_ctrl_c_in_a_terminal_stops_the_bench_and_its_workers_at_once(tmp_path):
    """Ctrl-C in a terminal (a pseudo-terminal here) sends SIGINT to the bench and its workers alike:
    the bench stops them and exits 130 within 5 s, results.jsonl whole, saying --resume continues."""
    import os
    import pty
    import select
    import signal
    import sys
    import time

    import fcntl
    import struct
    import termios

    out, micro = tmp_path / "out", tmp_path / "micro.yaml"
    toys = {"tasks": ["mqar"], "widths": [32], "seeds": 1, "lrs": [1e-3], "max_steps": 5000, "min_steps": 5000,
            "model": {"layout": "SWA", "window": 4, "attn_heads": 2, "attn_kv_heads": 2}, "compile": False,
            "precision": "fp32"}
    micro.write_text(yaml.safe_dump({**MICRO, "toys": toys}))  # cells that train for minutes
    cmd = [sys.executable, "-m", "memzoo.bench.cli", "bench", "--preset", str(micro), "--layers", "fwpkm", "--suite", "toys",
           "--jobs", "2", "--out", str(out), "--work-dir", str(tmp_path / "work")]
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session of its own whose controlling terminal is the pty
        # as a terminal's foreground job: a shell's background job (`cmd &`, how CI may run
        # the tests) starts with SIGINT ignored, and an ignored disposition survives exec
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execv(sys.executable, cmd)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))  # wide enough for the workers' status
    seen, t_end = b"", time.time() + 120

    def read(until: float) -> None:
        nonlocal seen
        while time.time() < until:
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    seen += os.read(fd, 65536)
                except OSError:  # the child closed the terminal: it ended
                    return

    while not (b"1: toys" in seen and b"2: toys" in seen) and time.time() < t_end:
        read(time.time() + 1)  # until both workers train
    assert b"1: toys" in seen and b"2: toys" in seen, seen[-2000:]
    os.write(fd, b"\x03")  # Ctrl-C
    t0 = time.time()
    status = None
    while time.time() - t0 < 20:
        if select.select([fd], [], [], 0.1)[0]:
            try:
                seen += os.read(fd, 65536)
            except OSError:
                pass
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        status = None
    took = time.time() - t0
    assert status is not None and os.waitstatus_to_exitcode(status) == 130, seen[-2000:]
    assert took < 5, took
    assert b"interrupted; what was recorded is kept (--resume continues)" in seen
    read_results(out / "results.jsonl")  # whole: no torn line, no error


def test_a_preset_names_the_suites_a_bench_without_suite_runs(tmp_path):
    from memzoo.bench.run import parse_suites

    tiny = load_preset("tiny")
    assert tiny.default_suites == ("cost", "toys")  # the main job: no tables it cannot show in minutes
    assert load_preset("standard").default_suites == ("cost", "toys", "ppl", "niah")
    assert tuple(parse_suites("")) == ("cost", "pairs", "toys", "ppl", "niah")  # every suite
    assert load_preset("standard").settings("ppl", __import__("memzoo.bench.suites.ppl", fromlist=["x"]).Settings).passages == 32
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**MICRO, "run": {"suites": ["toys", "speed"]}}))
    with pytest.raises(ConfigError, match=r"run: expected \{suites: \[...\]\} with suites among cost, pairs, toys, ppl, niah"):
        load_preset(bad)


def test_niah_lms_of_a_memory_only_backbone_with_a_variant_and_controls_asked_once(micro, tmp_path, monkeypatch):
    """`niah.model` changes the backbone of the suite's own LMs (and `ppl.model` ppl's, apart),
    `niah.variants` adds an LM of a layer with another place and options, and the controls read
    each haystack once (n-iter is a memory's); a resumed run finds all of them recorded."""
    import memzoo.bench.lm as lm
    from memzoo.bench.suites import niah

    preset = load_preset(micro)
    preset.suites["niah"] = {"lm": {"seq_len": 64, "steps": 2}, "model": {"layout": "SWA", "window": 4}, "controls": True,
                             "variants": {"fwpkm/seq": {"layer": "fwpkm", "at": "0", "options": {"per_sequence": True}}},
                             "lengths": [48], "iters": [1, 2], "samples": 1, "needles": 1, "train_mix": 1.0}
    preset.suites["ppl"] = {**preset.suites["ppl"], "model": {"window": 8}}
    work = tmp_path / "work"
    ctx = Context(preset, 0, Recorder(tmp_path, "micro", 0), work, progress=False)
    assert lm.models(ctx, "fwpkm", "niah") == ["fwpkm", "fwpkm/seq"] and lm.models(ctx, "fwpkm", "ppl") == ["fwpkm"]
    assert (lm.lm_config(ctx, "fwpkm", "ppl")[0].model.layout, lm.lm_config(ctx, "fwpkm", "ppl")[0].model.window) == ("GDN | fwpkm@1", 8)
    rows = niah.run(ctx, ["baseline", "fwpkm"])
    asked = {(r["layer"], r["setting"]["n_iter"]) for r in rows}
    assert asked == {("baseline", 1), ("baseline", 2), ("fwpkm", 1), ("fwpkm", 2), ("fwpkm/seq", 1), ("fwpkm/seq", 2),
                     ("ctrl:attention", 1), ("ctrl:none", 1)}
    model = {r["layer"]: r["config"]["lm"]["model"] for r in rows}
    assert {k: (m["layout"], m["window"]) for k, m in model.items()} == {
        "baseline": ("SWA", 4), "fwpkm": ("SWA | fwpkm@1", 4), "fwpkm/seq": ("SWA | fwpkm@0", 4),
        "ctrl:attention": ("FA", 4), "ctrl:none": ("NONE", 4)}
    assert model["fwpkm/seq"]["memory"]["fwpkm"]["per_sequence"] is True and "per_sequence" not in model["fwpkm"]["memory"]["fwpkm"]
    monkeypatch.setattr(lm, "shared_lm", lambda *a, **k: pytest.fail("a recorded LM was loaded again"))
    again = niah.run(Context(preset, 0, Recorder(tmp_path, "micro", 0), work, progress=False, resume=True), ["baseline", "fwpkm"])
    assert sorted((r["layer"], r["setting"]["n_iter"]) for r in again) == sorted(asked)
    preset.suites["niah"] = {"model": {"window": 4}}
    with pytest.raises(ConfigError, match="niah.model needs niah.lm"):
        lm.lm_config(ctx, "fwpkm", "niah")
    with pytest.raises(ConfigError, match="niah.variants: 'fwpkm' is already a layer's"):
        niah.Settings(variants={"fwpkm": {"layer": "fwpkm"}})
    with pytest.raises(ConfigError, match="niah.model: unknown backbone field"):
        niah.Settings(model={"widnow": 4})


def test_a_dry_run_lists_the_cells_marks_the_recorded_and_estimates_from_the_rows(tmp_path, capsys):
    """--dry-run runs and writes nothing, plans for a device this machine lacks, and reads its
    estimate from the preset's rows on that kind of device: a cell's wall time over its steps."""
    import yaml

    from memzoo.bench.dry_run import ASSUMED_STEP_S, step_seconds
    from memzoo.bench.run import run_bench

    micro = tmp_path / "micro.yaml"
    micro.write_text(yaml.safe_dump({"base": "_base", "toys": {"max_steps": 4, "eval_every": 2, "batch_size": 4,
                                                              "val_size": 4, "test_size": 4, "lrs": [1e-2, 3e-2]}}))
    out = tmp_path / "out"
    assert run_bench("linear", "toys", str(micro), out=out, work_dir=tmp_path / "w", progress=False, dry_run=True,
                     device="cuda") == []
    assert not out.exists() and not (tmp_path / "w").exists()  # nothing written
    text = capsys.readouterr().out
    assert "preset micro on cuda" in text and "nothing is run" in text
    assert "toys linear mqar d=64 seed 0" in text and "4 toys cells, 0 recorded" in text
    assert f"at an assumed {ASSUMED_STEP_S * 1000:g} ms a step" in text
    assert f"32 training steps at the cap" in text  # 4 cells x 2 lrs x 4 steps

    rows = run_bench("linear", "toys", str(micro), out=out, work_dir=tmp_path / "w", progress=False, device="cpu", jobs=1)
    lin = next(r for r in rows if r["layer"] == "linear")
    steps = sum(len(v) for v in lin["metrics"]["val_history_by_lr"].values()) * 2
    assert step_seconds(lin) == lin["wall_s"] / steps
    capsys.readouterr()
    run_bench("linear", "toys", str(micro), out=out, work_dir=tmp_path / "w", progress=False, dry_run=True, device="cpu")
    text = capsys.readouterr().out
    assert "4 toys cells, 4 recorded" in text and "0 training steps at the cap" in text
    assert "from 4 cells of this preset recorded on this CPU" in text


def test_without_a_preset_a_cuda_device_runs_the_gpu_default_and_says_so(tmp_path, capsys):
    from memzoo.bench.run import DEFAULT_PRESETS, run_bench

    run_bench("fwpkm", None, None, out=tmp_path, progress=False, dry_run=True, device="cuda")
    text = capsys.readouterr().out
    assert "CUDA is available: preset gpu, the default on a GPU" in text and "preset gpu on cuda" in text
    run_bench("fwpkm", None, None, out=tmp_path, progress=False, dry_run=True, device="cpu")
    text = capsys.readouterr().out
    assert "CUDA" not in text and "preset tiny on cpu" in text
    gpu, tiny = load_preset(DEFAULT_PRESETS["cuda"]), load_preset("tiny")
    assert gpu.default_suites == tiny.default_suites  # the same comparison, sized for the device
    from memzoo.bench.suites import toys

    g, t = (p.settings("toys", toys.Settings) for p in (gpu, tiny))
    assert g.batch_size * g.max_steps >= 10 * t.batch_size * t.max_steps  # recall at >= 10x tiny's budget


def test_gpu_check_runs_the_gpu_issues_slices_only_when_named(capsys, tmp_path):
    from memzoo.bench import gpu_check

    assert gpu_check.main(["--dry-run"]) == 0
    default = capsys.readouterr().out
    assert all(f"  {s} " not in default for s in ("gdn", "profile", "pack", "recall", "main"))
    assert gpu_check.main(["--dry-run", "--only", "kernels,recall,gdn,tests"]) == 0
    listed = [ln.split()[0] for ln in capsys.readouterr().out.splitlines()[1:] if not ln.strip().startswith("$")]
    assert listed == ["tests", "gdn", "recall", "kernels"]  # in the order they run, kernels last
    (tmp_path / "gdn.json").write_text(json.dumps([
        {"path": "torch", "ms": 26.4, "first_call_s": 0.5, "max_rel_diff": 0.0, "vs_torch": 1.0},
        {"path": "compiled", "ms": 18.1, "first_call_s": 50.2, "max_rel_diff": 1e-6, "vs_torch": 26.4 / 18.1},
        {"path": "fla", "skipped": "Triton 3.6.0 on a Hopper GPU"}]))
    assert gpu_check.figures("gdn", tmp_path, "") == [
        "torch: 26.40 ms (1.00x the eager torch path; first call 0 s; max rel diff 0.0e+00)",
        "compiled: 18.10 ms (1.46x the eager torch path; first call 50 s; max rel diff 1.0e-06)",
        "fla: not timed (Triton 3.6.0 on a Hopper GPU)"]
    row = {"suite": "toys", "layer": "linear", "seed": 0, "setting": {"d_model": 64},
           "metrics": {"accuracy": 0.9912, "stop": "solved", "lr": 3e-3, "sequences": 123456}}
    (tmp_path / "recall.jsonl").write_text(json.dumps(row) + "\n")
    assert gpu_check.figures("recall", tmp_path, "") == ["linear d=64 seed 0: test 0.991 (solved, lr 0.003, 123,456 sequences)"]
    log = "memzoo bench: CUDA is available: preset gpu, the default on a GPU\nx\nmemzoo bench: 14 rows in 300 s -> f\n"
    assert gpu_check.figures("main", tmp_path, log) == log.splitlines()[::2]


def test_gpu_check_runs_every_step_through_its_loop_on_a_stand_in_device(tmp_path, monkeypatch):
    """main's loop on the CPU, every step named, CUDA and the steps' commands stood in for: each step
    runs, is summarised, and the recall step resumes from a copy of the published rows and keeps only
    the rows its command added (the part of the loop no --dry-run reaches)."""
    import sys

    from memzoo.bench import gpu_check
    from memzoo.ops import gated_delta_rule

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Stand-in GPU")
    monkeypatch.setattr(gated_delta_rule, "gdn_op", lambda device: "torch")
    added = json.dumps({"suite": "toys", "layer": "linear", "seed": 0, "setting": {"d_model": 64},
                        "metrics": {"accuracy": 0.5, "stop": "capped", "lr": 1e-3, "sequences": 64}})

    def command(self, out, scratch, train_steps):
        rows = scratch / "recall" / "results.jsonl"
        code = f"open({str(rows)!r}, 'a').write({added!r} + '\\n')" if self.name == "recall" else "print('ok')"
        return [sys.executable, "-c", code]

    monkeypatch.setattr(gpu_check.Step, "command", command)
    names = [s.name for s in gpu_check.ORDER]
    assert gpu_check.main(["--out", str(tmp_path), "--only", ",".join(names), "--budget", "100000"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["device"] == "Stand-in GPU" and list(summary["steps"]) == names
    assert all(r["status"] == "passed" for r in summary["steps"].values())
    assert (tmp_path / "recall.jsonl").read_text().splitlines() == [added]
    assert "Stand-in GPU" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize("name", ["gated_deltanet", "fwl", "fwpkm"])
def test_the_cuda_layer_comparison_runs_on_the_cpu(name):
    """The mechanics of test_cuda.py's per-layer comparison (gpu_check's tests step), with the CPU
    standing in for the GPU: the same path twice differs by nothing."""
    from conftest import device_paths_differ

    assert device_paths_differ(name, "cpu") == {"output": 0.0, "state": 0.0, "grads": 0.0}


def test_gpu_check_pack_counts_cells_an_hour_at_each_jobs(tmp_path):
    """The pack step's mechanics on the CPU: one run per --jobs, each cold, its cells an hour."""
    from memzoo.bench import gpu_check

    tiny = {"base": "_base", "toys": {"seeds": 1, "max_steps": 2, "min_steps": 2, "eval_every": 1, "val_size": 4,
                                     "test_size": 4, "batch_size": 4}}
    res = gpu_check.pack(tmp_path, device="cpu", jobs=(1, 2), layers="linear", preset=tiny)
    assert [r["jobs"] for r in res["runs"]] == [1, 2]
    for r in res["runs"]:
        assert r["cells"] == 4 and r["failed"] == 0  # baseline, the two controls, linear
        assert r["cells_per_hour"] == round(4 / r["wall_s"] * 3600, 1)
    assert json.loads((tmp_path / "pack.json").read_text()) == res
    assert [ln.split(":")[0] for ln in gpu_check.figures("pack", tmp_path, "")] == ["--jobs 1", "--jobs 2"]


def test_the_gdn_op_benchmark_checks_its_paths_before_it_times_them(gdn_compiled_traced_only):
    from memzoo.bench.benchmarks import bench_gdn_op

    rows = {r["path"]: r for r in bench_gdn_op.run("cpu", (1, 64, 2, 8), reps=2)}
    assert rows["torch"]["max_rel_diff"] == 0 and rows["compiled"]["max_rel_diff"] < 1e-5
    assert rows["fla"] == {"path": "fla", "skipped": "needs CUDA"}
    assert rows["torch"]["vs_torch"] == 1.0 and rows["compiled"]["ms"] > 0


def test_the_fwpkm_profile_lists_the_top_operations(tmp_path):
    from memzoo.bench.benchmarks import profile_fwpkm

    assert profile_fwpkm.main(["--device", "cpu", "--small", "--steps", "2", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "profile_fwpkm.md").read_text()
    assert "## torch path: " in text and "kernels on" not in text  # the Triton kernels are profiled on CUDA
    shares = [float(ln.rsplit("|", 2)[-2].strip(" %")) for ln in text.splitlines() if ln.startswith("| `")]
    assert 5 <= len(shares) <= 15 and shares == sorted(shares, reverse=True) and sum(shares) <= 100.5


def test_a_runs_notes_read_the_checkouts_leaderboard_beside_its_own_out(tmp_path, monkeypatch):
    from memzoo.bench.run import published_beside

    row = lambda layer: json.dumps({"suite": "toys", "layer": layer, "preset": "recall", "setting": {}, "seed": 0,  # noqa: E731
                                    "metrics": {}, "config_hash": "0", "run_id": "r", "time": "t"}) + "\n"
    (tmp_path / "leaderboards").mkdir()
    (tmp_path / "leaderboards" / "results.jsonl").write_text(row("published"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "results.jsonl").write_text(row("mine"))
    monkeypatch.chdir(tmp_path)
    assert [r["layer"] for r in published_beside(tmp_path / "mine" / "results.jsonl")] == ["mine", "published"]
    # the run wrote into the leaderboard itself: read once
    assert [r["layer"] for r in published_beside(Path("leaderboards/results.jsonl"))] == ["published"]
    monkeypatch.chdir(tmp_path / "mine")  # no leaderboard under the working directory: the out file alone
    assert [r["layer"] for r in published_beside(tmp_path / "mine" / "results.jsonl")] == ["mine"]


def test_the_jobs_timed_alone_have_a_bar_of_their_own(tmp_path, capsys):
    """A model timed by the cost suite takes many training steps' time, a unit of the rest one step's:
    on one bar the first minutes' rate set its time left far too long. The cost jobs get a bar
    counting models; the bench's bar, made after them, counts the other units and ends full."""
    import re

    from memzoo.bench.run import run_bench

    from test_toys import MICRO as TOYS

    micro = tmp_path / "micro.yaml"
    micro.write_text(yaml.safe_dump({**MICRO, "toys": {**TOYS, "tasks": ["mqar"], "widths": [16], "seeds": 1,
                                                       "lrs": [1e-2]},
                                      "cost": {"warmup": 1, "steps": 1, "rounds": 1}}))
    rows = run_bench("linear", "cost,toys", str(micro), out=tmp_path / "out", work_dir=tmp_path / "work", jobs=2)
    assert not [r for r in rows if r["suite"] == "failed"]
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()

    def counts(desc: str) -> list[tuple[int, int]]:
        return [tuple(map(int, m.groups())) for ln in lines if ln.startswith(desc + ":")
                for m in [re.search(r"\| *(\d+)/(\d+) \[", ln)] if m]

    timed, bench = counts("timed alone"), counts("bench")
    assert timed[-1] == (2, 2) and {t for _, t in timed} == {2}  # the baseline's model and linear's
    assert bench and bench[-1][0] == bench[-1][1] and len({t for _, t in bench}) == 1  # ends full: none of the cost's
    assert not [ln for ln in lines if ln.startswith("bench:") and "cost" in ln]
    assert [ln for ln in lines if ln.startswith("timed alone:") and "cost linear]" in ln]  # one runs: no "1: ... | 2: "


def test_ppl_with_a_host_compares_a_memory_attached_to_a_pretrained_model(tmp_path):
    """`ppl.host` (the attach preset): the seed's Llama is pretrained once, then the baseline (the Llama
    alone) and fwpkm (the Llama with FwPKM attached) each train the preset's steps further on the batches
    after the pretraining; the positive control reads the baseline's LM with its KV cache carried. The
    baseline carries nothing (gains 0), the control's cache changes the second reading, the LMs are
    cached (a second run trains nothing), and the rows record the host and the attached spec."""
    import transformers as tf

    from memzoo.attach import TrainingView, memories
    from memzoo.bench import lm
    from memzoo.bench.common import POSITIVE
    from memzoo.bench.suites import ppl

    host = {"steps": 2, "config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                   "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}}
    preset = {**MICRO, "ppl": {**MICRO["ppl"], "host": host}}
    path = tmp_path / "host.yaml"
    path.write_text(yaml.safe_dump(preset))
    ctx = Context(load_preset(path), 0, Recorder(tmp_path, "host", 0), tmp_path / "work", progress=False)
    assert lm.models(ctx, BASELINE) == [BASELINE, POSITIVE] and lm.models(ctx, "fwpkm") == ["fwpkm"]
    no_probe = {**preset, "ppl": {**preset["ppl"], "passages": 0}}
    (tmp_path / "np.yaml").write_text(yaml.safe_dump(no_probe))
    assert lm.models(Context(load_preset(tmp_path / "np.yaml"), 0, None, tmp_path / "w"), BASELINE) == [BASELINE]
    assert lm.untrained_steps(ctx, "fwpkm", ["ppl"]) == 3 + 2  # its training and the host's pretraining
    rows = ppl.run(ctx, [BASELINE, "fwpkm"])
    got = {(r["layer"], r["setting"]["corpus"], r["setting"]["mode"]): r for r in rows}
    assert {k[0] for k in got} == {BASELINE, POSITIVE, "fwpkm"}
    base, mem = got[(BASELINE, "sonnets", "carry")], got[("fwpkm", "sonnets", "carry")]
    assert base["metrics"]["gain"] == 0 and mem["metrics"]["gain"] != 0
    assert base["config"]["lm"]["host"] == host and "model" not in base["config"]["lm"]
    assert base["config"]["lm"]["attach"] == [] and mem["config"]["lm"]["attach"] == [
        "fwpkm@1:chunk_size=16,key_dim=16,n_subkeys=8,topk=2,value_dim=16"]
    probe = got[(POSITIVE, "repeat", "carry")]["metrics"]
    assert got[(BASELINE, "repeat", "carry")]["metrics"]["gain"] == 0 and probe["gain"] != 0
    model, info = lm.shared_lm(ctx, "fwpkm")
    assert isinstance(model, TrainingView) and [m.name for m in memories(model.lm)] == ["fwpkm"]
    assert info["steps"] == 3 and lm.untrained_steps(ctx, "fwpkm", ["ppl"]) == 0
    # the arms start from one pretrained host: the baseline's weights moved on from it, and so did fwpkm's base
    rc, mix, _ = lm.lm_config(ctx, BASELINE)
    pre = tf.AutoModelForCausalLM.from_pretrained(str(lm._host_dir(ctx, rc, mix) / "hf"))
    # the host's cache is keyed on its data too: another mixture is another host
    assert lm._host_dir(ctx, rc, {**mix, "repeat_mix": 0.5}) != lm._host_dir(ctx, rc, mix)
    assert lm._host_dir(ctx, rc, {**mix, "attach": ["x"]}) == lm._host_dir(ctx, rc, mix)  # every arm shares it
    plain, _ = lm.shared_lm(ctx, BASELINE)
    w = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(plain.lm.state_dict()[w], pre.state_dict()[w])
    assert not torch.equal(model.lm.state_dict()[w], plain.lm.state_dict()[w])
    lm._loaded.clear()  # a later process: the LMs load from their cache
    again, _ = lm.shared_lm(ctx, "fwpkm")
    x = torch.randint(0, 257, (1, 24))
    torch.testing.assert_close(again(x).logits, model(x).logits, atol=1e-6, rtol=0)
    with pytest.raises(ConfigError, match="ppl.host"):
        ppl.Settings(host={"steps": 2})
    # the overview's PPL columns stay memzoo's backbone's: a section of host LMs gives them no cell
    import pandas as pd

    sec = type("Sec", (), {"rows": rows})()
    assert ppl_report.on_the_backbone(sec, pd.DataFrame(index=["fwpkm"])) == []
    sec.rows = [{**r, "config": {"lm": {"model": {}}}} for r in rows]
    assert ppl_report.on_the_backbone(sec, pd.DataFrame(index=["fwpkm"])) == ["fwpkm"]
    from memzoo.bench.report import frame

    assert "Hugging Face llama (2 layers, width 32), random-init and pretrained 2 steps" in " ".join(
        ppl_report.reading(frame(rows)))
