"""lm-eval's API on a memzoo model (memzoo.harness), offline: task YAMLs over text the test
writes (Shakespeare's opening lines), a perplexity task (loglikelihood_rolling), a
multiple-choice task (loglikelihood) and a generation task (generate_until), on a
``GDN | linear@0 + FwPKM@1`` model: linear attention's state is per sequence (carried across a
document's windows by the rolling reading), FwPKM's is shared and persists across sequences
(each request must start from the trained one), so how the harness handles both shows in the
numbers."""

from __future__ import annotations

import json
import math

import lm_eval
import pytest
import torch
import torch.nn.functional as F
from lm_eval.tasks import TaskManager

from memzoo import harness
from memzoo.backbone import HybridLM
from memzoo.config import ModelConfig
from memzoo.data import get_tokenizer
from tests.conftest import TINY_LM

DOCS = ["Shall I compare thee to a summer's day? Thou art more lovely and more temperate: "
        "rough winds do shake the darling buds of May, and summer's lease hath all too short a date.",
        "When, in disgrace with fortune and men's eyes, I all alone beweep my outcast state."]
CHOICES = [{"q": "To be, or not to", "choices": [" be", " sea"], "label": 0},
           {"q": "A horse! a horse! my kingdom for a", "choices": [" horse", " house"], "label": 0}]


def task_yaml(name: str, data, body: str) -> str:
    return f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files: {{test: {data}}}\ntest_split: test\n{body}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("harness")
    torch.manual_seed(0)
    mc = ModelConfig.from_dict(dict(TINY_LM, layout="GDN | linear@0 + fwpkm@1", vocab_size=257, memory={"fwpkm": dict(
        key_dim=16, value_dim=16, topk=2, n_subkeys=16, chunk_size=8, addr_loss_weight=1.0)}))
    model = HybridLM(mc)
    # what `memzoo train` writes (the parts the loader reads), with fast weights moved off their init
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 64)))
    torch.save({"model": model.state_dict(), "config": {"model": mc.to_dict(), "train": {"tokenizer": "byte",
                                                                                          "seq_len": 32}}},
               d / "ckpt.pt")
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    (d / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHOICES))
    tasks = d / "tasks"
    tasks.mkdir()
    (tasks / "ppl.yaml").write_text(task_yaml("memzoo_ppl", d / "docs.jsonl", (
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")))
    (tasks / "mc.yaml").write_text(task_yaml("memzoo_mc", d / "mc.jsonl", (
        'output_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n")))
    (tasks / "gen.yaml").write_text(task_yaml("memzoo_gen", d / "mc.jsonl", (
        'output_type: generate_until\ndoc_to_text: "{{q}}"\ndoc_to_target: "{{choices[label]}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n")))
    return d, TaskManager(include_path=str(tasks))


def evaluate(setup, tasks):
    d, tm = setup
    return lm_eval.simple_evaluate(model="memzoo", model_args=f"pretrained={d}", tasks=tasks, task_manager=tm)


def carried_nll(model: HybridLM, text: str, L: int, carry: bool = True) -> float:
    """The PPL suite's carried reading, written out: EOS, then the text's bytes, in windows of L
    (`carry=False`: per-sequence memories start each window anew)."""
    tok = get_tokenizer("byte")
    ids = torch.tensor([tok.eos_id, *tok.encode(text)])
    total = 0.0
    with torch.no_grad():
        for s in range(0, ids.numel() - 1, L):
            x, y = ids[s : s + L], ids[s + 1 : s + L + 1]
            total += F.cross_entropy(model(x[: y.numel()][None], keep_memory=carry and s > 0).logits[0], y, reduction="sum").item()
    return total


def test_perplexity_multiple_choice_and_generation_through_the_lm_eval_api(setup):
    res = evaluate(setup, ["memzoo_ppl", "memzoo_mc", "memzoo_gen"])["results"]
    assert 1 < res["memzoo_ppl"]["byte_perplexity,none"] < 1e4
    assert 0 <= res["memzoo_mc"]["acc,none"] <= 1
    assert 0 <= res["memzoo_gen"]["exact_match,none"] <= 1
    # the rolling loss is the PPL suite's carried reading (32-token windows, fast weights carried)
    d, _ = setup
    model, _, _ = harness.load(str(d))
    trained = model.eval().memory_state()
    nll = 0.0
    for t in DOCS:  # each document from the trained fast weights
        model.load_memory_state(trained)
        nll += carried_nll(model, t, 32)
    n_bytes = sum(len(t.encode()) for t in DOCS)
    assert math.isclose(res["memzoo_ppl"]["byte_perplexity,none"], math.exp(nll / n_bytes), rel_tol=1e-5)
    model.load_memory_state(trained)
    reset_each_window = sum(carried_nll(model, t, 32, carry=False) for t in DOCS[:1])
    model.load_memory_state(trained)
    assert reset_each_window != carried_nll(model, DOCS[0], 32), "the carried state should matter here"


def test_requests_do_not_leak_through_persistent_fast_weights(setup):
    """FwPKM's fast weights persist across calls; each request starts from the trained ones, so a
    second evaluation gives the same numbers."""
    a = evaluate(setup, ["memzoo_ppl", "memzoo_mc"])["results"]
    b = evaluate(setup, ["memzoo_ppl", "memzoo_mc"])["results"]
    assert a["memzoo_ppl"]["byte_perplexity,none"] == b["memzoo_ppl"]["byte_perplexity,none"]
    assert a["memzoo_mc"]["acc,none"] == b["memzoo_mc"]["acc,none"]


def test_batched_evaluation_is_refused(setup):
    d, _ = setup
    with pytest.raises(ValueError, match="batch_size 1"):
        harness.MemzooLM(pretrained=str(d), batch_size=8)


def test_loading_a_run_its_checkpoint_or_a_save_pretrained_dir(setup, tmp_path):
    d, _ = setup
    for path in (d, d / "ckpt.pt"):
        model, tok, seq_len = harness.load(str(path))
        assert (tok, seq_len) == ("byte", 32)
    model.save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="tokenizer"):
        harness.load(str(tmp_path / "hf"))
    again, tok, _ = harness.load(str(tmp_path / "hf"), tokenizer="byte")
    assert tok == "byte" and all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_an_attached_model_through_the_lm_eval_api(setup, tmp_path, monkeypatch):
    """`memzoo train --from DIR --attach ...`'s out dir evaluates as `--model memzoo`: the attached model
    reloaded, the run's tokenizer, each request from the trained fast weights of its shared FwPKM (two
    evaluations agree)."""
    from memzoo.cli import main
    from tests.test_attach import _shrink, _tiny_llama_dir, _train_args

    _shrink(monkeypatch)
    out = tmp_path / "run"
    assert main(_train_args(_tiny_llama_dir(tmp_path), out, "--attach", "fwpkm@last:test",
                            "--attach", "gated_deltanet@0:num_heads=2,head_dim=16")) == 0
    model, tok, seq_len = harness.load(str(out))
    assert (tok, seq_len) == ("byte", 32) and model.config.memzoo_attach[0]["layer"] == "fwpkm"
    _, tm = setup
    runs = [lm_eval.simple_evaluate(model="memzoo", model_args=f"pretrained={out}", tasks=["memzoo_ppl", "memzoo_mc"],
                                    task_manager=tm)["results"] for _ in range(2)]
    assert 1 < runs[0]["memzoo_ppl"]["byte_perplexity,none"] < 1e4
    assert runs[0]["memzoo_ppl"] == runs[1]["memzoo_ppl"] and runs[0]["memzoo_mc"] == runs[1]["memzoo_mc"]
