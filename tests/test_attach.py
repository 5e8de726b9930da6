"""memzoo.attach: a memory in a Hugging Face causal LM, on randomly initialised tiny configs of each
supported architecture (Llama, Mistral, Qwen2, GPT-2; d = 32, two decoder layers, built offline).

Unchanged outputs at insertion; generate (greedy) equals the full forward step by step; left padding
leaves a sequence's outputs unchanged; save/reload identical; detach gives the plain model back;
gradients reach the memory's slow weights; and every registered layer (plugins too) attaches.
The gates are moved off zero (`open_gates`) wherever a test needs the memories to matter.
"""

from __future__ import annotations

import fnmatch

import pytest
import torch
from torch import nn

import memzoo
from memzoo.attach import attachments, from_pretrained, memories
from memzoo.registry import get_layer, layer_names
from tests.conftest import layer_options, layer_test, perturb

V, PROMPT, NEW = 64, 7, 6
SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=V)


def build(arch: str, dtype=torch.float64) -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if arch == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=V, n_positions=64,
                                                 bos_token_id=1, eos_token_id=2))
    else:
        cfg, cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
                    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}[arch]
        model = cls(cfg(**SIZES, bos_token_id=1, eos_token_id=2))
    model.generation_config.eos_token_id = None  # greedy decoding runs its NEW steps (no stop)
    return model.to(dtype).eval()


ARCHS = ["llama", "mistral", "qwen2", "gpt2"]


def open_gates(model, scale: float = 1.0) -> None:
    torch.manual_seed(3)
    with torch.no_grad():
        for a in attachments(model):
            a.gate.normal_(0.0, scale)


def ids(b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, V, (b, t), generator=torch.Generator().manual_seed(seed))


def shared_state(model) -> list:
    """The shared persistent memories' fast weights (they outlive a call), to put back."""
    return [{k: v.clone() for k, v in m.state.items()} if not m.per_sequence else None for m in memories(model)]


def put_back(model, states) -> None:
    for m, st in zip(memories(model), states):
        if st is not None:
            m.load_state(st)


def where(layer: str) -> str:
    return get_layer(layer).default_where or "all"


def attached(arch: str, layer: str = "lact", gates: bool = True, dtype=torch.float64):
    model = build(arch, dtype)
    memzoo.attach(model, layer, at=where(layer), **layer_options(layer))
    if gates:
        open_gates(model)
    return model


def check_generate(model, prompt: torch.Tensor) -> None:
    with torch.no_grad():
        before = shared_state(model)
        out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        put_back(model, before)
        full = model(out.sequences).logits
    T = prompt.shape[1]
    assert out.sequences.shape == (prompt.shape[0], T + NEW)
    torch.testing.assert_close(torch.stack(out.logits, 1), full[:, T - 1 : -1].float(), rtol=1e-6, atol=1e-6)
    assert torch.equal(out.sequences[:, T:], full[:, T - 1 : -1].argmax(-1))  # greedy = argmax, step by step


# ---- per architecture ---------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_attach_leaves_outputs_unchanged(arch):
    model = build(arch)
    x = ids(2, PROMPT)
    with torch.no_grad():
        ref = model(x).logits
        memzoo.attach(model, "lact", at="all", **layer_options("lact"))
        memzoo.attach(model, "pkm", at=0, **layer_options("pkm"))  # beside the FFN
        out = model(x).logits
    assert len(attachments(model)) == 3
    assert (out - ref).abs().max().item() <= 1e-6
    open_gates(model)
    with torch.no_grad():
        assert (model(x).logits - ref).abs().max().item() > 1e-3  # the memories now matter


@pytest.mark.parametrize("arch", ARCHS)
def test_attach_generate_matches_forward(arch):
    """The prompt (7 tokens) ends inside LaCT's chunk of 8: decoding completes it a token at a time."""
    check_generate(attached(arch), ids(2, PROMPT))


@pytest.mark.parametrize("arch", ARCHS)
def test_attach_left_padding_leaves_a_sequence_unchanged(arch):
    model = attached(arch)
    a, b = ids(1, 5, seed=4), ids(1, PROMPT, seed=5)
    batch = torch.cat([torch.cat([torch.zeros(1, 2, dtype=torch.long), a], 1), b])
    mask = torch.ones_like(batch)
    mask[0, :2] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        padded = model(batch, attention_mask=mask, position_ids=pos).logits
        alone_a, alone_b = model(a).logits, model(b).logits
        torch.testing.assert_close(padded[0, 2:], alone_a[0], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(padded[1], alone_b[0], rtol=1e-9, atol=1e-9)
        gen = model.generate(batch, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        gen_a = model.generate(a, max_new_tokens=NEW, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=0)
    assert torch.equal(gen.sequences[0, 2:], gen_a.sequences[0])
    torch.testing.assert_close(torch.stack(gen.logits, 1)[0], torch.stack(gen_a.logits, 1)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_attach_save_and_reload_identical(arch, tmp_path):
    # fp32: a float64 model reloads its RoPE frequencies in fp32 (transformers keeps them so)
    model = attached(arch, dtype=torch.float32)
    memzoo.attach(model, "pkm", at=[-1], **layer_options("pkm"))
    open_gates(model)
    x = ids(2, PROMPT)
    with torch.no_grad():
        ref = model(x).logits
    model.save_pretrained(tmp_path)
    again = from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert again.config.memzoo_attach == [
        {"layer": "lact", "at": [0, 1], "options": layer_options("lact")},
        {"layer": "pkm", "at": [1], "options": layer_options("pkm")},
    ]
    with torch.no_grad():
        assert torch.equal(again(x).logits, ref)
    memzoo.detach(again).save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="records no attached memory"):
        from_pretrained(str(tmp_path / "plain"))


@pytest.mark.parametrize("arch", ARCHS)
def test_detach_restores_the_plain_model(arch):
    model = build(arch)
    x = ids(2, PROMPT)
    with torch.no_grad():
        ref = model(x).logits
        keys = set(model.state_dict())
        memzoo.attach(model, "deltanet", at="all", **layer_options("deltanet"))
        open_gates(model)
        assert (model(x).logits - ref).abs().max() > 1e-3
        assert memzoo.detach(model) is model
        assert torch.equal(model(x).logits, ref)
    assert set(model.state_dict()) == keys and not hasattr(model.config, "memzoo_attach")
    assert attachments(model) == []


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_gradients_reach_the_memory(arch):
    model = attached(arch, "deltanet", gates=False).train()
    x = ids(2, 12)
    model(x, labels=x).loss.backward()
    gates = [a.gate.grad for a in attachments(model)]
    assert all(g is not None and g.abs().sum() > 0 for g in gates)  # at insertion: the gates learn first
    model.zero_grad()
    open_gates(model, 0.1)
    model(x, labels=x).loss.backward()
    for n, p in memories(model)[0].named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n


# ---- every registered layer ------------------------------------------------------------------------
@pytest.mark.parametrize("layer", layer_names())
def test_every_layer_attaches(layer):
    """On one architecture (taking turns): unchanged at insertion; generate = forward once the gates
    are open; every slow weight gets a gradient (a sequence of several chunks, so writes matter; the
    layer's `grad_exempt` patterns of tests/conftest.py excepted)."""
    arch = ARCHS[layer_names().index(layer) % len(ARCHS)]
    model = build(arch)
    x = ids(2, PROMPT)
    with torch.no_grad():
        ref = model(x).logits
        memzoo.attach(model, layer, at=where(layer), **layer_options(layer))
        before = shared_state(model)
        assert (model(x).logits - ref).abs().max().item() <= 1e-6
        put_back(model, before)
    open_gates(model)
    perturb(memories(model)[-1], 0.05)  # off its zero inits (as the property suite), so no gradient is zero by init
    check_generate(model, x)
    model.train()
    long = ids(2, 20, seed=7)
    model(long, labels=long).loss.backward()
    exempt = layer_test(layer)["grad_exempt"]
    for n, p in memories(model)[-1].named_parameters():
        if p.requires_grad and not any(fnmatch.fnmatch(n, pat) for pat in exempt):
            assert p.grad is not None and p.grad.abs().sum() > 0, n


# ---- errors and what is refused ----------------------------------------------------------------------
def test_attach_refuses_what_it_cannot_do():
    import transformers as tf

    with pytest.raises(TypeError, match="Llama, Mistral, Qwen2 and GPT-2"):
        memzoo.attach(nn.Linear(4, 4), "deltanet", at="all")
    t5 = tf.T5ForConditionalGeneration(tf.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=V))
    with pytest.raises(TypeError, match="encoder-decoder"):
        memzoo.attach(t5, "deltanet", at="all")
    model = build("llama")
    with pytest.raises(ValueError, match="out of range"):
        memzoo.attach(model, "deltanet", at=5)
    with pytest.raises(ValueError, match="say where"):
        memzoo.attach(model, "deltanet")
    with pytest.raises(ValueError, match="last decoder layer"):
        memzoo.attach(model, "fwl", at=0, **layer_options("fwl"))
    with pytest.raises(ValueError, match="unknown option"):
        memzoo.attach(model, "deltanet", at=0, nonsense=1)
    assert not hasattr(model.config, "memzoo_attach")  # nothing half-attached


def test_padding_with_a_shared_memory_is_refused():
    model = attached("llama", "fwpkm")
    x = ids(2, 5)
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match="one length"):
        model(x, attention_mask=mask)
    model(x, attention_mask=torch.ones_like(x))  # all ones: fine


def test_memzoo_attach_is_the_module_and_the_verb():
    import memzoo.attach as module

    assert memzoo.attach is module and callable(memzoo.attach) and memzoo.detach is module.detach


@pytest.mark.parametrize("layer", ["fwl", "mom"])
def test_padded_training_rows_and_aux_loss(layer):
    """A padded batch with labels: FWL's targets (the next tokens) are a row's own; MoM's
    load-balancing loss is added to the model's loss."""
    model = attached("llama", layer)
    perturb(memories(model)[-1], 0.05)
    a, b = ids(1, 10, seed=4), ids(1, 12, seed=5)
    batch = torch.cat([torch.cat([torch.zeros(1, 2, dtype=torch.long), a], 1), b])
    mask = torch.ones_like(batch)
    mask[0, :2] = 0
    out = model(batch, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                labels=batch.masked_fill(mask == 0, -100))
    alone = model(a, labels=a)
    torch.testing.assert_close(out.logits[0, 2:], alone.logits[0], rtol=1e-9, atol=1e-9)
    aux = [m.aux_loss for m in memories(model) if m.aux_loss is not None]
    assert len(aux) == (2 if layer == "mom" else 0)  # (at every layer)
    if aux:
        plain = torch.nn.functional.cross_entropy(alone.logits[0, :-1], a[0, 1:])
        torch.testing.assert_close(alone.loss, plain + sum(aux))


# ---- memzoo train --from PATH --attach SPEC: the training loop on an attached model -------------------
def _tiny_llama_dir(tmp_path):
    """A random-init Llama of the byte tokenizer's vocabulary, saved where `--from` reads it."""
    import transformers as tf

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=257, max_position_embeddings=64)
                        ).save_pretrained(tmp_path / "llama")
    return str(tmp_path / "llama")


def _train_args(base: str, out, *extra: str) -> list[str]:
    """`memzoo train` on the tiny configs' recipe, shrunk to a few steps of short windows."""
    return ["train", "tiny/gdn", "--from", base, "--out", str(out), "--steps", "4", *extra]


def _shrink(monkeypatch):
    from memzoo import config as cfg

    load = cfg.load_config

    def small(name):
        rc = load(name)
        rc.train.seq_len, rc.train.batch_size, rc.train.eval_batches, rc.train.warmup = 32, 4, 2, 2
        rc.train.eval_every = rc.train.ckpt_every = 2
        return rc

    monkeypatch.setattr(cfg, "load_config", small)


def test_train_from_a_pretrained_model_writes_what_from_pretrained_reloads(tmp_path, monkeypatch):
    """`memzoo train --from DIR --attach ...` trains the memories (and their gates) of a local tiny Llama,
    the base frozen, and writes out/hf, which `memzoo.attach.from_pretrained` reloads with the trained
    weights; a run killed after step 3 and resumed ends where the uninterrupted one does; a changed
    --attach does not resume."""
    from memzoo import config
    from memzoo.cli import main
    from memzoo.storage import load_tensors
    from memzoo.train import train

    _shrink(monkeypatch)
    base, out = _tiny_llama_dir(tmp_path), tmp_path / "run"
    spec = ["--attach", "gated_deltanet@1:num_heads=2,head_dim=16", "--attach", "fwpkm@last:test"]
    assert main(_train_args(base, out, *spec)) == 0
    model = from_pretrained(str(out / "hf")).eval()
    assert [(s["layer"], s["at"]) for s in model.config.memzoo_attach] == [("gated_deltanet", [1]), ("fwpkm", [1])]
    trained = {k[len("lm."):]: v for k, v in load_tensors(out / "ckpt.pt")["model"].items()}
    got = model.state_dict()
    for k, v in trained.items():
        assert torch.equal(got[k], v), k
    assert any(".memzoo." in k and k.endswith("gate") and v.abs().sum() > 0 for k, v in trained.items())
    import transformers as tf

    for k, v in tf.AutoModelForCausalLM.from_pretrained(base).state_dict().items():  # the base was frozen
        assert torch.equal(got[k], v), k

    rc = config.load_config("tiny/gdn")  # as the command line's (shrunk)
    rc.train.steps, rc.train.out_dir = 4, str(tmp_path / "killed")
    killed = train(rc, stop_after=3, progress=False, base={"from": base, "attach": spec[1::2], "train_base": False})
    assert killed["killed"]
    assert main(_train_args(base, tmp_path / "killed", *spec, "--resume")) == 0
    again = load_tensors(tmp_path / "killed" / "ckpt.pt")["model"]
    for k, v in trained.items():
        assert torch.equal(again["lm." + k], v), k  # bit-exact
    assert main(_train_args(base, out, *spec[:2], "--resume")) == 2  # another --attach: a different config


def test_train_attach_arguments_are_checked(tmp_path, capsys):
    from memzoo.attach import parse_spec
    from memzoo.cli import main

    assert parse_spec("fwpkm") == ("fwpkm", None, {})
    assert parse_spec("gated_deltanet@0,1:num_heads=2,expand_v=0.5") == ("gated_deltanet", "0,1",
                                                                          {"num_heads": 2, "expand_v": 0.5})
    assert parse_spec("linear@last:test") == ("linear", "last", layer_options("linear"))
    with pytest.raises(ValueError, match="did you mean"):
        parse_spec("fwpkn@1")
    with pytest.raises(ValueError, match="key=value"):
        parse_spec("fwpkm@1:key_dim=8,topk")
    assert main(["train", "tiny/gdn", "--attach", "fwpkm@1", "--out", str(tmp_path / "x")]) == 2
    assert "--from" in capsys.readouterr().err
    assert main(_train_args(_tiny_llama_dir(tmp_path), tmp_path / "y")) == 2
    assert "--attach" in capsys.readouterr().err


def test_training_view_carries_memories_as_hybridlm_does():
    """TrainingView's keep_memory: two halves of a sequence, the second continuing the first's memories
    (the model's attention starting empty), give the memory what one call gives it: a per-sequence
    memory's state after both halves equals its state after the whole; use_cache with cache continues
    the attention too, so the second half's logits equal the whole's."""
    from memzoo.attach import TrainingView

    model = attached("llama", "gated_deltanet", dtype=torch.float64)
    view = TrainingView(model)
    x = ids(2, 16)
    whole = view(x, use_cache=True)
    state = {k: v.clone() for k, v in view.memories()[0].state.items()}
    view(x[:, :8])
    view(x[:, 8:], keep_memory=True)
    for k, v in view.memories()[0].state.items():
        torch.testing.assert_close(v, state[k], atol=1e-10, rtol=0)
    first = view(x[:, :8], use_cache=True)
    second = view(x[:, 8:], cache=first.cache, keep_memory=True)
    torch.testing.assert_close(second.logits, whole.logits[:, 8:], atol=1e-10, rtol=0)
    assert view(x[:, 8:]).logits.sub(second.logits).abs().max() > 1e-6  # a fresh call forgets


def test_the_ppl_suites_readings_run_on_an_attached_model():
    """The PPL suite's carried reading and repeated-passage probe take a TrainingView as they take a
    HybridLM (the measured example's evaluation)."""
    from memzoo.attach import TrainingView
    from memzoo.bench.suites.ppl import Settings, eval_corpus, repeat_probe

    view = TrainingView(attached("llama", "fwpkm", dtype=torch.float32)).eval()
    docs = [ids(1, 40, seed=s)[0] for s in (1, 2)]
    probe = repeat_probe(view, [d[:17] for d in docs], carry_cache=False, device="cpu")
    carried = eval_corpus(view, docs, Settings(seq_len=16), "carry", "cpu")
    assert all(torch.isfinite(torch.tensor(v)) for v in (probe["gain"], carried["loss"]))


def test_train_from_a_pretrained_model_without_a_memory_fine_tunes_it(tmp_path, monkeypatch):
    """`--from DIR --train-base` and no --attach: the model itself trains (the plain arm of a comparison);
    its hf/ loads with transformers alone and differs from the base."""
    import transformers as tf

    from memzoo.cli import main

    _shrink(monkeypatch)
    base = _tiny_llama_dir(tmp_path)
    assert main(_train_args(base, tmp_path / "run", "--train-base")) == 0
    got = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "hf")).state_dict()
    was = tf.AutoModelForCausalLM.from_pretrained(base).state_dict()
    assert got.keys() == was.keys() and any(not torch.equal(got[k], was[k]) for k in got)


def test_lora_trains_adapters_beside_the_memory_and_saves_them_merged(tmp_path, monkeypatch):
    """`--lora R`: peft's adapters on the base's attention projections (not on the memory's own q/v
    projections) train with the memory, the base's weights frozen; out/hf holds the adapters merged, so
    the reloaded model (transformers and memzoo, no peft) gives the trained model's logits; the base's
    weights outside the adapted projections are unchanged."""
    import transformers as tf

    from memzoo.attach import for_training, lora_parameters
    from memzoo.cli import main
    from memzoo.storage import load_tensors

    base = _tiny_llama_dir(tmp_path)
    view = for_training(base, ["gated_deltanet@1:num_heads=2,head_dim=16"], lora=4)
    trains = {n for n, p in view.named_parameters() if p.requires_grad}
    assert trains and all(".memzoo." in n or ".lora_" in n for n in trains)
    lora = {n for n in trains if ".lora_" in n}
    assert lora and all(".self_attn." in n and ".memzoo." not in n for n in lora), lora  # not the memory's q_proj
    assert {n.split(".self_attn.")[1].split(".")[0] for n in lora} == {"q_proj", "v_proj"}
    assert len(lora_parameters(view.lm)) == len(lora)

    _shrink(monkeypatch)
    out = tmp_path / "run"
    assert main(_train_args(base, out, "--attach", "gated_deltanet@1:num_heads=2,head_dim=16", "--lora", "4")) == 0
    trained = for_training(base, ["gated_deltanet@1:num_heads=2,head_dim=16"], lora=4)
    trained.load_state_dict(load_tensors(out / "ckpt.pt")["model"])
    assert any(v.abs().sum() > 0 for n, v in trained.named_parameters() if ".lora_B" in n)  # the adapters moved
    x = ids(2, 16)
    reloaded = from_pretrained(str(out / "hf")).eval()
    torch.testing.assert_close(reloaded(x).logits, trained.eval()(x).logits, atol=1e-5, rtol=0)
    was = tf.AutoModelForCausalLM.from_pretrained(base).state_dict()
    got = reloaded.state_dict()
    changed = {k for k in was if not torch.equal(got[k], was[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), changed
    assert main(_train_args(base, tmp_path / "z", "--train-base", "--lora", "4")) == 2  # one or the other


def test_memzoo_generate_continues_a_prompt_from_an_attached_run(tmp_path, monkeypatch, capsys):
    """`memzoo generate RUN --prompt ...` loads an attached run (its out dir: the run's tokenizer) and prints
    the greedy continuation: the tokens of generate() decoded, as many as asked, the same on a rerun."""
    from memzoo.cli import main
    from memzoo.data import get_tokenizer
    from memzoo.generation import generate_text
    from memzoo.inspection import load_any

    _shrink(monkeypatch)
    base, out = _tiny_llama_dir(tmp_path), tmp_path / "run"
    assert main(_train_args(base, out, "--attach", "fwpkm@last:test")) == 0
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "To be, or not", "--max-new-tokens", "5"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    model, tok, _ = load_any(str(out))
    assert tok == "byte"
    prompt = torch.tensor([get_tokenizer("byte").encode("To be, or not")])
    want = model.eval().generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)[0, prompt.shape[1]:]
    assert printed == get_tokenizer("byte").decode(want.tolist())
    assert generate_text(model, tok, "To be, or not", 5, temperature=1.0, seed=3) == \
        generate_text(model, tok, "To be, or not", 5, temperature=1.0, seed=3)  # seeded sampling repeats
    assert main(["generate", str(out), "--prompt", "x", "--max-new-tokens", "0"]) == 2
