"""Data: .npy and text sources, their error messages, and the resumable Batches iterator."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from slidedp.exec.data import (
    Batches,
    DataOptions,
    TokenSequences,
    bundled_data_dir,
    markov_tokens,
    open_tokens,
)
from slidedp.spec.errors import SpecError

WORDS = ["<unk>", "<eos>", "the", "cat", "sat", "on", "mat", "a", "dog"]


def seqs(n: int, seq: int = 4) -> TokenSequences:
    """Sequence i holds the ids i*seq .. i*seq+seq-1, so a batch tells which rows it read."""
    return TokenSequences("mem", np.arange(n * seq, dtype=np.int32).reshape(n, seq))


def rows_of(batch) -> list[int]:
    return (batch["input_ids"][:, 0] // batch["input_ids"].shape[1]).tolist()


def test_npy_in_order_drops_epoch_remainder_and_labels_equal_inputs(tmp_path):
    np.save(tmp_path / "d.npy", np.arange(10 * 4, dtype=np.int64).reshape(10, 4))
    data = open_tokens(tmp_path / "d.npy", seq=4, vocab=40)
    assert isinstance(data.tokens, np.memmap)
    b = Batches(data, global_batch=3, shuffle=False)
    got = [rows_of(next(b)) for _ in range(4)]
    assert got == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 1, 2]]  # row 9 never fits a batch
    batch = next(b)
    assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].shape == (3, 4)
    assert batch["labels"] is batch["input_ids"]


def test_shuffle_is_a_seeded_permutation_per_epoch():
    b = Batches(seqs(12), global_batch=4, shuffle=True, seed=7)
    epoch0 = [r for _ in range(3) for r in rows_of(next(b))]
    epoch1 = [r for _ in range(3) for r in rows_of(next(b))]
    assert sorted(epoch0) == sorted(epoch1) == list(range(12))
    assert epoch0 != epoch1 and epoch0 != list(range(12))
    again = Batches(seqs(12), global_batch=4, shuffle=True, seed=7)
    assert [r for _ in range(3) for r in rows_of(next(again))] == epoch0
    other = Batches(seqs(12), global_batch=4, shuffle=True, seed=8)
    assert [r for _ in range(3) for r in rows_of(next(other))] != epoch0


def test_resume_continues_exactly_across_epochs():
    ref = Batches(seqs(11), global_batch=3, seed=1)
    stream = [rows_of(next(ref)) for _ in range(10)]
    for k in range(10):
        a = Batches(seqs(11), global_batch=3, seed=1)
        for _ in range(k):
            next(a)
        state = json.loads(json.dumps(a.state_dict()))  # survives the checkpoint's JSON
        b = Batches(seqs(11), global_batch=3, seed=1)
        b.load_state_dict(state)
        assert [rows_of(next(b)) for _ in range(10 - k)] == stream[k:], k


def test_resume_refuses_other_data_or_batching():
    state = Batches(seqs(12), global_batch=4, seed=1).state_dict()
    with pytest.raises(SpecError, match=r"ckpt/meta.json: field 'data.n_sequences': 13"):
        Batches(seqs(13), global_batch=4, seed=1).load_state_dict(state, "ckpt/meta.json")
    with pytest.raises(SpecError, match=r"field 'data.global_batch'"):
        Batches(seqs(12), global_batch=3, seed=1).load_state_dict(state)
    with pytest.raises(SpecError, match=r"field 'data.seed'"):
        Batches(seqs(12), global_batch=4, seed=2).load_state_dict(state)


def test_bad_npy_files_name_file_and_field(tmp_path):
    f = tmp_path / "x.npy"
    cases = [
        (np.zeros(8, dtype=np.int32), r"x.npy: field 'shape': 2-D"),
        (np.zeros((2, 4), dtype=np.float32), r"x.npy: field 'dtype': an integer dtype"),
        (
            np.zeros((2, 5), dtype=np.int32),
            r"x.npy: field 'seq_len': 4 \(the --seq option\), got 5",
        ),
        (
            np.array([[0, 1, 2, 3], [4, 5, 99, 7]]),
            r"x.npy: field 'token ids \(sequence 1\)': in \[0, 50\) .* got 99 at position 2",
        ),
        (np.array([[0, -1, 2, 3]]), r"field 'token ids \(sequence 0\)'.* got -1"),
    ]
    for arr, msg in cases:
        np.save(f, arr)
        with pytest.raises(SpecError, match=msg):
            open_tokens(f, seq=4, vocab=50)
    f.write_bytes(b"not numpy")
    with pytest.raises(SpecError, match=r"x.npy: field '<file>': a .npy array"):
        open_tokens(f, seq=4, vocab=50)
    np.save(f, np.zeros((3, 4), dtype=np.int32))
    with pytest.raises(
        SpecError, match=r"x.npy: field 'sequences': at least one global batch \(4\), got 3"
    ):
        Batches(open_tokens(f, seq=4, vocab=50), global_batch=4)
    with pytest.raises(SpecError, match=r"missing.npy: field '<file>'"):
        open_tokens(tmp_path / "missing.npy", seq=4, vocab=50)
    (tmp_path / "d.csv").write_text("1,2")
    with pytest.raises(SpecError, match=r"d.csv: field '<extension>'"):
        open_tokens(tmp_path / "d.csv", seq=4, vocab=50)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    d = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>"
    ).save_pretrained(d)
    return d


def test_jsonl_and_txt_are_packed_with_eos_and_the_tail_dropped(tmp_path, tokenizer_dir):
    f = tmp_path / "d.jsonl"
    f.write_text('{"body": "the cat sat"}\n\n{"body": "a dog sat on the mat"}\n')
    data = open_tokens(f, seq=4, vocab=9, tokenizer_dir=tokenizer_dir, options=DataOptions(field="body"))
    # the cat sat <eos> | a dog sat on | the mat <eos>  -> 11 tokens: 2 sequences, 3 dropped
    assert data.tokens.tolist() == [[2, 3, 4, 1], [7, 8, 4, 5]] and data.dropped_tokens == 3
    t = tmp_path / "d.txt"
    t.write_text("the cat\nsat on a mat")
    data = open_tokens(t, seq=3, vocab=9, tokenizer_dir=tokenizer_dir)
    assert data.tokens.tolist() == [[2, 3, 4], [5, 7, 6]] and data.dropped_tokens == 1


def test_bad_text_inputs_name_file_line_and_field(tmp_path, tokenizer_dir):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "the cat"}\n{"txt": "a dog"}\n')
    with pytest.raises(SpecError, match=r"d.jsonl:2: field 'text': a string"):
        open_tokens(f, seq=2, vocab=9, tokenizer_dir=tokenizer_dir)
    f.write_text('{"text": "the cat"}\n{oops\n')
    with pytest.raises(SpecError, match=r"d.jsonl:2: field '<syntax>'"):
        open_tokens(f, seq=2, vocab=9, tokenizer_dir=tokenizer_dir)
    f.write_text('{"text": "the cat sat on the mat"}\n')
    with pytest.raises(SpecError, match=r"d.jsonl: field 'token ids \(sequence 0\)': in \[0, 3\)"):
        open_tokens(f, seq=2, vocab=3, tokenizer_dir=tokenizer_dir)
    with pytest.raises(SpecError, match=r"d.jsonl: field 'tokenizer': a model directory"):
        open_tokens(f, seq=2, vocab=9)
    with pytest.raises(SpecError, match=r"field 'tokenizer': loadable by AutoTokenizer"):
        open_tokens(f, seq=2, vocab=9, tokenizer_dir=tmp_path)


def test_bundled_tiny_markov_is_reproducible_small_and_learnable():
    path = bundled_data_dir() / "tiny-markov.npy"
    assert path.stat().st_size < 2**20
    assert np.array_equal(np.load(path), markov_tokens())
    data = open_tokens("tiny-markov", seq=64, vocab=512)  # tiny-qwen3's vocab
    assert data.tokens.shape == (512, 64)
    # learnable structure: every token has at most 4 successors
    t = data.tokens.astype(np.int64)
    pairs = np.unique(t[:, :-1] * 512 + t[:, 1:])
    assert np.bincount(pairs // 512, minlength=512).max() <= 4
