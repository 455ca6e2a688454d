"""Documents into rows: chat labels, packing, and Hugging Face data set sources.

Chat: labels are the assistant tokens, the same whether they come from {% generation %} tags
(transformers' assistant mask) or from rendering prefixes; templates where prefixes do not render
as prefixes are refused. Packing (hypothesis): every token of every document lands once, each
document restarts the position ids, its first label is -100. Data sets (save_to_disk directories,
a DatasetDict's split, parquet, arrow) give the rows a .jsonl of the same records gives.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from isolation import run_without
from tiny_hf import CHATML, CHATML_TAGS, WORDS, chat_jsonl, conversation, save_tokenizer
from transformers import AutoTokenizer

from slidedp.exec.data import DataOptions, open_tokens, precheck_tokens
from slidedp.exec.data_chat import chat_document
from slidedp.exec.packing import IGNORE, Document, pack_rows, pad_rows
from slidedp.spec.errors import SpecError

VOCAB = len(WORDS)
CHAT = DataOptions(chat=True)


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("toks")
    return {name: save_tokenizer(root / name, t)
            for name, t in (("plain", CHATML), ("tags", CHATML_TAGS), ("none", None))}


def _doc(tok_dir, msgs, tags):
    return chat_document(AutoTokenizer.from_pretrained(tok_dir), msgs, "x", "messages", tags)


def test_chat_labels_are_the_assistant_tokens(toks):
    msgs = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "a dog sat"},
            {"role": "user", "content": "why"}, {"role": "assistant", "content": "yes"}]
    w = {t: i for i, t in enumerate(WORDS)}
    s, e = w["<|im_start|>"], w["<|im_end|>"]
    ids = [s, w["user"], w["the"], w["cat"], e, s, w["assistant"], w["a"], w["dog"], w["sat"], e,
           s, w["user"], w["why"], e, s, w["assistant"], w["yes"], e]
    want = [IGNORE] * 7 + ids[7:11] + [IGNORE] * 6 + ids[17:]
    for name, tags in (("plain", False), ("tags", True)):
        d = _doc(toks[name], msgs, tags)
        assert d.ids.tolist() == ids and d.labels.tolist() == want, name


def test_prefix_rendering_agrees_with_generation_tags(toks):
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        msgs = conversation(WORDS[8:], 3, gen)
        a, b = _doc(toks["plain"], msgs, False), _doc(toks["tags"], msgs, True)
        assert a.ids.tolist() == b.ids.tolist() and a.labels.tolist() == b.labels.tolist()


def test_bad_chat_input_is_one_line_naming_where(tmp_path, toks):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"messages": "hello"}) + "\n")
    with pytest.raises(SpecError, match=r"c.jsonl:1: field 'messages': a list of \{role, content"):
        open_tokens(f, 16, VOCAB, toks["plain"], CHAT)
    f.write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    with pytest.raises(SpecError, match=r"c.jsonl:1: field 'messages': a conversation that does"):
        open_tokens(f, 16, VOCAB, toks["plain"], CHAT)
    chat_jsonl(f, 2, seed=0)
    with pytest.raises(SpecError, match=r"field 'chat_template': a chat template"):
        open_tokens(f, 16, VOCAB, toks["none"], CHAT)
    with pytest.raises(SpecError, match=r"field 'chat_template': a chat template"):
        precheck_tokens(f, 16, toks["none"], CHAT)
    last_differs = save_tokenizer(tmp_path / "odd", CHATML.replace(
        "<|im_end|>\n{% endfor %}", "<|im_end|>\n{% if loop.last %}the{% endif %}{% endfor %}"))
    with pytest.raises(SpecError, match=r"c.jsonl:1: field 'chat_template': a template whose"):
        open_tokens(f, 16, VOCAB, last_differs, CHAT)
    np.save(tmp_path / "t.npy", np.zeros((2, 16), dtype=np.int32))
    with pytest.raises(SpecError, match=r"t.npy: field '--chat / --pack': documents"):
        open_tokens(tmp_path / "t.npy", 16, VOCAB, None, DataOptions(pack=True))


def test_chat_rows_one_conversation_each_or_packed(tmp_path, toks):
    f = chat_jsonl(tmp_path / "c.jsonl", 6, seed=1)
    tok = AutoTokenizer.from_pretrained(toks["plain"])
    docs = [chat_document(tok, json.loads(ln)["messages"], "x", "messages", False)
            for ln in f.read_text().splitlines()]
    seq = max(len(d.ids) for d in docs) + 2
    padded = open_tokens(f, seq, VOCAB, toks["plain"], CHAT)
    assert padded.position_ids is None and len(padded) == 6
    for r, d in enumerate(docs):
        k = len(d.ids)
        assert padded.tokens[r, :k].tolist() == d.ids.tolist()
        assert padded.labels[r, :k].tolist() == d.labels.tolist()
        assert (padded.tokens[r, k:] == tok.pad_token_id).all()
        assert (padded.labels[r, k:] == IGNORE).all()
    packed = open_tokens(f, 2 * seq, VOCAB, toks["plain"], DataOptions(chat=True, pack=True))
    assert len(packed) < 6 and packed.documents == 6
    assert packed.tokens.tolist() == pack_rows(docs, 2 * seq, tok.pad_token_id).tokens.tolist()


@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30), seq=st.integers(1, 24))
def test_packing_keeps_every_token_once_and_restarts_positions(lengths, seq):
    docs, at = [], 0
    for k in lengths:  # distinct ids: each token can be found again
        docs.append(Document(np.arange(at, at + k), None if k % 3 else np.arange(at, at + k) * 0 - 1))
        at += k
    rows = pack_rows(docs, seq, pad_id=-5)
    total = sum(lengths)
    assert rows.tokens.shape[1] == seq and len(rows.tokens) * seq >= total
    real = rows.tokens[rows.tokens != -5]
    assert sorted(real.tolist()) == list(range(total))
    pieces = sum(-(-k // seq) for k in lengths)
    assert rows.documents == pieces
    for tokens, labels, pos in zip(rows.tokens, rows.labels, rows.position_ids, strict=True):
        starts = np.flatnonzero(pos == 0)
        assert starts[0] == 0 and (labels[starts] == IGNORE).all()
        for lo, hi in zip(starts, [*starts[1:], seq], strict=True):
            seg = tokens[lo:hi]
            assert (pos[lo:hi] == np.arange(hi - lo)).all()
            if seg[0] != -5:  # a piece: consecutive ids of one document
                assert (np.diff(seg) == 1).all()
            else:
                assert (seg == -5).all() and (labels[lo:hi] == IGNORE).all()
    padded = pad_rows(docs, seq, pad_id=-5)
    assert len(padded.tokens) == pieces and padded.position_ids is None


def _records(n: int):
    gen = torch.Generator().manual_seed(2)
    words = WORDS[8:]
    return [" ".join(words[int(i)] for i in torch.randint(len(words), (3 + k % 4,), generator=gen))
            for k in range(n)]


def test_datasets_sources_give_the_rows_of_the_same_jsonl(tmp_path, toks):
    datasets = pytest.importorskip("datasets")
    texts = _records(12)
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"body": t, "n": 1}) + "\n" for t in texts))
    opts = DataOptions(field="body")
    want = open_tokens(f, 8, VOCAB, toks["plain"], opts).tokens.tolist()
    ds = datasets.Dataset.from_dict({"body": texts, "n": [1] * len(texts)})
    ds.save_to_disk(str(tmp_path / "saved"))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    other = datasets.Dataset.from_dict({"body": ["the cat"] * 12, "n": [0] * 12})
    datasets.DatasetDict({"train": ds, "test": other}).save_to_disk(str(tmp_path / "dict"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for src in (tmp_path / "saved", tmp_path / "d.parquet", arrow, tmp_path / "dict"):
        assert open_tokens(src, 8, VOCAB, toks["plain"], opts).tokens.tolist() == want, src
    ev = open_tokens(tmp_path / "dict", 2, VOCAB, toks["plain"], opts, role="eval")
    assert set(ev.tokens.reshape(-1).tolist()) <= {8, 9, 1}  # the test split: "the cat" <eos>
    with pytest.raises(SpecError, match=r"d.parquet: field 'text': a column .* it has body, n"):
        open_tokens(tmp_path / "d.parquet", 8, VOCAB, toks["plain"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match=r"empty: field '<directory>': a data set written by"):
        open_tokens(tmp_path / "empty", 8, VOCAB, toks["plain"])
    datasets.DatasetDict({"a": ds, "b": ds}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(SpecError, match=r"ab: field 'split': one of train"):
        open_tokens(tmp_path / "ab", 8, VOCAB, toks["plain"], opts)


def test_without_datasets_a_data_set_is_one_line_naming_the_extra(tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    code = ("from slidedp.exec.data import precheck_tokens\n"
            "from slidedp.spec.errors import SpecError\n"
            "try:\n"
            f"    precheck_tokens({str(tmp_path / 'd.parquet')!r}, 8, None)\n"
            "except SpecError as e:\n"
            "    print(e)\n")
    p = run_without(("datasets",), code)
    assert "pip install 'slidedp[data]'" in p.stdout and "d.parquet" in p.stdout, p.stderr
