"""Training data: token sequences from a .npy array or from text, served as global batches.

Sources (picked by extension; a bare name such as "tiny-markov" is a bundled set under
slidedp/presets/data/):
  .npy    integer array (sequences, seq_len), memory-mapped and read in order; seq_len must
          equal --seq. Token ids are checked (0 <= id < vocab) in one chunked vectorised pass
          when opened, so bad data fails before training starts.
  .jsonl  one JSON object per line with the text under `text_field` ("text");
  .txt    the whole file is one document.
          Text is tokenized with the model directory's tokenizer (no special tokens added), every
          document is followed by the tokenizer's EOS, and the concatenation is cut into seq_len
          sequences; the last len % seq_len tokens (less than one sequence) are dropped and
          counted in `dropped_tokens`.

Batches: each epoch visits floor(N / global_batch) batches of global_batch sequences; the
N mod global_batch sequences left over are skipped for that epoch (with shuffling, different ones
each epoch). Shuffled order of epoch e is a permutation drawn from numpy's PCG64 seeded with
(seed, e), so the position (epoch, index) plus the seed is the whole iterator state:
`state_dict()` / `load_state_dict()` resume exactly at the next batch.

The bundled tiny-markov set (512 x 64 tokens < 512, for tiny-qwen3) is `markov_tokens()`: a
first-order Markov chain in which each token has 4 successors with probabilities
(0.7, 0.15, 0.1, 0.05) (entropy ~0.9 nats/token vs ln 512 = 6.2 for uniform), so a tiny model's
loss visibly falls within a minute on a CPU. Regenerate with np.save(path, markov_tokens()).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from slidedp.spec.errors import SpecError

CHECK_CHUNK_ELEMS = 1 << 24  # tokens per chunk of the id-range pass (bounds its temp memory)
TOKENIZE_DOCS = 1024  # documents per tokenizer call
NO_TOKENIZER = "a model directory with a tokenizer (presets have none: use a .npy of token ids)"
BUNDLED_SUFFIX = ".npy"


@dataclass
class TokenSequences:
    """N sequences of seq_len token ids; `tokens` is an (N, seq_len) integer array (maybe mmap)."""

    where: str
    tokens: np.ndarray
    dropped_tokens: int = 0  # text only: the tail shorter than one sequence

    def __len__(self) -> int:
        return self.tokens.shape[0]


def bundled_data_dir() -> Path:
    return Path(str(resources.files("slidedp") / "presets" / "data"))


def open_tokens(
    path: str | Path,
    seq: int,
    vocab: int,
    tokenizer_dir: str | Path | None = None,
    text_field: str = "text",
) -> TokenSequences:
    """Token sequences of length `seq` with ids < `vocab` from a .npy, .jsonl or .txt file."""
    p = _resolve(path)
    if p.suffix == ".npy":
        data = TokenSequences(str(p), _load_npy(p, seq))
    elif p.suffix in (".jsonl", ".txt"):
        data = _load_text(p, seq, tokenizer_dir, text_field)
    else:
        raise SpecError(str(p), "<extension>", f".npy, .jsonl or .txt, got {p.suffix!r}")
    _check_ids(data, vocab)
    return data


def precheck_tokens(path: str | Path, seq: int, tokenizer_dir: str | Path | None = None) -> None:
    """What open_tokens checks without reading the data: the file, its extension, a .npy's
    header (2-D integer array of `seq` columns), a tokenizer for text. For checks that must come
    before something long (AutoPolicy's selection); the token ids are checked when opened."""
    p = _resolve(path)
    if p.suffix == ".npy":
        _load_npy(p, seq)
    elif p.suffix in (".jsonl", ".txt"):
        if tokenizer_dir is None:
            raise SpecError(str(p), "tokenizer", NO_TOKENIZER)
    else:
        raise SpecError(str(p), "<extension>", f".npy, .jsonl or .txt, got {p.suffix!r}")


def _resolve(path: str | Path) -> Path:
    """The data file: a path, or the name of a bundled set; SpecError if there is none."""
    p = Path(path)
    if not p.exists() and (bundled_data_dir() / f"{path}{BUNDLED_SUFFIX}").is_file():
        p = bundled_data_dir() / f"{path}{BUNDLED_SUFFIX}"
    if not p.is_file():
        raise SpecError(
            str(p), "<file>", "an existing .npy, .jsonl or .txt file (or a bundled set)"
        )
    return p


def _load_npy(p: Path, seq: int) -> np.ndarray:
    try:
        arr = np.load(p, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise SpecError(str(p), "<file>", f"a .npy array ({e})") from None
    if arr.ndim != 2:
        raise SpecError(str(p), "shape", f"2-D (sequences, seq_len), got shape {list(arr.shape)}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise SpecError(str(p), "dtype", f"an integer dtype (token ids), got {arr.dtype}")
    if arr.shape[1] != seq:
        raise SpecError(str(p), "seq_len", f"{seq} (the --seq option), got {arr.shape[1]}")
    return arr


def _check_ids(data: TokenSequences, vocab: int) -> None:
    """One chunked vectorised pass: every id in [0, vocab); names the first bad sequence."""
    t = data.tokens
    rows = max(1, CHECK_CHUNK_ELEMS // max(1, t.shape[1]))
    for lo in range(0, len(t), rows):
        chunk = np.asarray(t[lo : lo + rows])
        bad = (chunk < 0) | (chunk >= vocab)
        if bad.any():
            r, c = (int(i[0]) for i in np.nonzero(bad))
            raise SpecError(
                data.where,
                f"token ids (sequence {lo + r})",
                f"in [0, {vocab}) (the model's vocab_size), got {int(chunk[r, c])} at position {c}",
            )


def _documents(p: Path, text_field: str) -> list[str]:
    if p.suffix == ".txt":
        return [p.read_text()]
    docs = []
    for i, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecError(f"{p}:{i}", "<syntax>", f"one JSON object per line ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
            raise SpecError(f"{p}:{i}", text_field, "a string (set the text field option)")
        docs.append(obj[text_field])
    return docs


def _load_text(p: Path, seq: int, tokenizer_dir, text_field: str) -> TokenSequences:
    if tokenizer_dir is None:
        raise SpecError(str(p), "tokenizer", NO_TOKENIZER)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as e:
        raise SpecError(
            str(tokenizer_dir), "tokenizer", f"loadable by AutoTokenizer ({e})"
        ) from None
    if tok.eos_token_id is None:
        raise SpecError(str(tokenizer_dir), "eos_token", "set (documents are joined with EOS)")
    docs = _documents(p, text_field)
    ids: list[int] = []
    for lo in range(0, len(docs), TOKENIZE_DOCS):
        for doc in tok(docs[lo : lo + TOKENIZE_DOCS], add_special_tokens=False)["input_ids"]:
            ids.extend(doc)
            ids.append(tok.eos_token_id)
    n = len(ids) // seq
    tokens = np.asarray(ids[: n * seq], dtype=np.int64).reshape(n, seq)
    return TokenSequences(str(p), tokens, dropped_tokens=len(ids) - n * seq)


class Batches:
    """Infinite iterator of global batches {"input_ids", "labels"}: (global_batch, seq) int64.

    labels is the same tensor as input_ids (the loss shifts). See the module docstring for the
    epoch order and the resumable state.
    """

    def __init__(
        self, data: TokenSequences, global_batch: int, shuffle: bool = True, seed: int = 0
    ):
        if len(data) < global_batch:
            raise SpecError(
                data.where,
                "sequences",
                f"at least one global batch ({global_batch}), got {len(data)}",
            )
        self.data, self.global_batch, self.shuffle, self.seed = data, global_batch, shuffle, seed
        self.batches_per_epoch = len(data) // global_batch
        self.epoch = self.index = 0
        self._order_epoch, self._order = -1, np.arange(0)

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            n = len(self.data)
            rng = np.random.default_rng((self.seed, self.epoch))
            self._order = rng.permutation(n) if self.shuffle else np.arange(n)
            self._order_epoch = self.epoch
        return self._order

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        b = self.global_batch  # a batch's rows are read in file order (sequential mmap reads)
        rows = np.sort(self._epoch_order()[self.index * b : (self.index + 1) * b])
        ids = torch.from_numpy(np.asarray(self.data.tokens[rows], dtype=np.int64))
        self.index += 1
        if self.index == self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        return {"input_ids": ids, "labels": ids}

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "n_sequences": len(self.data),
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict, where: str = "checkpoint") -> None:
        """Resume at `state`'s position; SpecError if the data or batching no longer match."""
        for key in ("seed", "shuffle", "n_sequences", "global_batch"):
            if state.get(key) != self.state_dict()[key]:
                raise SpecError(
                    where,
                    f"data.{key}",
                    f"{self.state_dict()[key]!r} (the current "
                    f"data and options), got {state.get(key)!r}",
                )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def markov_tokens(n_seq: int = 512, seq: int = 64, vocab: int = 512, seed: int = 0) -> np.ndarray:
    """The bundled tiny-markov set: (n_seq, seq) int16 ids of a sparse first-order Markov chain."""
    rng = np.random.default_rng(seed)
    succ = rng.integers(0, vocab, size=(vocab, 4))
    cum = np.cumsum([0.7, 0.15, 0.1, 0.05])
    out = np.empty((n_seq, seq), dtype=np.int16)
    out[:, 0] = rng.integers(0, vocab, size=n_seq)
    for t in range(1, seq):
        pick = np.searchsorted(cum, rng.random(n_seq) * cum[-1], side="right")
        out[:, t] = succ[out[:, t - 1], np.minimum(pick, 3)]
    return out
