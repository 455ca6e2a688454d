"""Training data: token sequences from a .npy array, text, chat or a Hugging Face data set,
served as global batches.

Sources (picked by extension; a bare name such as "tiny-markov" is a bundled set under
slidedp/presets/data/):
  .npy    integer array (sequences, seq_len), memory-mapped and read in order; seq_len must
          equal --seq. Token ids are checked (0 <= id < vocab) in one chunked vectorised pass
          when opened, so bad data fails before training starts.
  .jsonl  one JSON object per line, the document under DataOptions.field;
  .txt    the whole file is one document;
  .parquet, .arrow, a save_to_disk directory: a Hugging Face data set, the document in column
          DataOptions.field (exec/data_hf.py: offline, optional `datasets` package).
Documents are text (field default "text"), or with DataOptions.chat conversations (field default
"messages", exec/data_chat.py: the tokenizer's chat template, labels on assistant tokens only).
Text is tokenized with the model directory's tokenizer (no special tokens added) and every text
document is followed by the tokenizer's EOS. Rows of seq_len tokens (exec/packing.py):
  text, no packing   documents concatenated and cut into seq_len rows; the last len % seq_len
                     tokens (less than one row) are dropped and counted in `dropped_tokens`
  chat, no packing   one conversation a row, padded (pad token, else EOS; labels -100 there)
  DataOptions.pack   documents packed into rows with their boundaries: per-row position ids
                     that restart at 0 per document (the executor masks attention across
                     documents) and labels -100 at each document's first token
A document longer than seq_len is cut into pieces of seq_len tokens in the last two layouts.

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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from slidedp.exec import data_hf
from slidedp.exec.packing import Document, Rows, concat_rows, pack_rows, pad_rows
from slidedp.spec.errors import SpecError

CHECK_CHUNK_ELEMS = 1 << 24  # tokens per chunk of the id-range pass (bounds its temp memory)
TOKENIZE_DOCS = 1024  # documents per tokenizer call
NO_TOKENIZER = "a model directory with a tokenizer (presets have none: use a .npy of token ids)"
BUNDLED_SUFFIX = ".npy"
TEXT_SUFFIXES = (".jsonl", ".txt")
KINDS = ".npy, .jsonl, .txt, .parquet or .arrow file, or a save_to_disk directory"


@dataclass(frozen=True)
class DataOptions:
    """How documents are read and laid into rows (see the module docstring)."""

    field: str | None = None  # the JSON key / column; None: "messages" with chat, else "text"
    chat: bool = False
    pack: bool = False

    @property
    def column(self) -> str:
        return self.field or ("messages" if self.chat else "text")


@dataclass
class TokenSequences:
    """N sequences of seq_len token ids; `tokens` is an (N, seq_len) integer array (maybe mmap).
    `labels` (-100 = no loss) where not every token is one; `position_ids` for packed rows."""

    where: str
    tokens: np.ndarray
    dropped_tokens: int = 0  # text only: the tail shorter than one sequence
    labels: np.ndarray | None = None
    position_ids: np.ndarray | None = None
    documents: int = 0  # documents (pieces) laid one per row or packed

    def __len__(self) -> int:
        return self.tokens.shape[0]


def bundled_data_dir() -> Path:
    return Path(str(resources.files("slidedp") / "presets" / "data"))


def open_tokens(
    path: str | Path,
    seq: int,
    vocab: int,
    tokenizer_dir: str | Path | None = None,
    options: DataOptions = DataOptions(),
    role: str = "train",
) -> TokenSequences:
    """Token sequences of length `seq` with ids < `vocab` from any source of the module
    docstring; `role` ("train" or "eval") picks a DatasetDict's split (data_hf.SPLITS)."""
    p = _resolve(path)
    if _kind(p, options) == "npy":
        data = TokenSequences(str(p), _load_npy(p, seq))
    else:
        data = _load_documents(p, seq, tokenizer_dir, options, role)
    _check_ids(data, vocab)
    return data


def precheck_tokens(path: str | Path, seq: int, tokenizer_dir: str | Path | None = None,
                    options: DataOptions = DataOptions()) -> None:
    """What open_tokens checks without reading the data: the source, its kind, a .npy's
    header (2-D integer array of `seq` columns), a tokenizer for documents (with a chat template
    for chat), the `datasets` package for data sets. For checks that must come before something
    long (AutoPolicy's selection); the token ids are checked when opened."""
    p = _resolve(path)
    kind = _kind(p, options)
    if kind == "npy":
        _load_npy(p, seq)
        return
    if kind == "dataset":
        data_hf.import_datasets(str(p))
    tok = _tokenizer(p, tokenizer_dir)
    if options.chat:
        from slidedp.exec.data_chat import check_chat_tokenizer

        check_chat_tokenizer(tok, str(tokenizer_dir))


def _resolve(path: str | Path) -> Path:
    """The data source: a path, or the name of a bundled set; SpecError if there is none."""
    p = Path(path)
    if not p.exists() and (bundled_data_dir() / f"{path}{BUNDLED_SUFFIX}").is_file():
        p = bundled_data_dir() / f"{path}{BUNDLED_SUFFIX}"
    if not p.exists():
        raise SpecError(str(p), "<file>", f"an existing {KINDS} (or a bundled set)")
    return p


def _kind(p: Path, options: DataOptions) -> str:
    """"npy", "text" or "dataset"; SpecError for other extensions and for options a .npy
    cannot take."""
    if p.suffix == ".npy" and p.is_file():
        if options.chat or options.pack:
            raise SpecError(str(p), "--chat / --pack", "documents (a .jsonl, .txt or data set "
                            "source): a .npy holds finished token rows")
        return "npy"
    if p.suffix in TEXT_SUFFIXES and p.is_file():
        return "text"
    if data_hf.is_dataset(p):
        return "dataset"
    raise SpecError(str(p), "<extension>", f"a {KINDS}, got {p.suffix!r}")


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


def _records(p: Path, field: str, role: str) -> Iterator[tuple[str, object]]:
    """(where, value) of every document of the source, in order (value unchecked)."""
    if p.suffix == ".txt":
        yield str(p), p.read_text()
        return
    if p.suffix != ".jsonl":
        yield from data_hf.column_values(p, field, role)
        return
    for i, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecError(f"{p}:{i}", "<syntax>", f"one JSON object per line ({e})") from None
        yield f"{p}:{i}", obj.get(field) if isinstance(obj, dict) else None


def _tokenizer(p: Path, tokenizer_dir):
    if tokenizer_dir is None:
        raise SpecError(str(p), "tokenizer", NO_TOKENIZER)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as e:
        raise SpecError(
            str(tokenizer_dir), "tokenizer", f"loadable by AutoTokenizer ({e})"
        ) from None


def _text_documents(tok, records: Iterable[tuple[str, object]], field: str
                    ) -> Iterator[Document]:
    """Each text record tokenized (batched), followed by EOS."""
    if tok.eos_token_id is None:
        raise SpecError(str(tok.name_or_path), "eos_token", "set (documents end with EOS)")
    eos = np.asarray([tok.eos_token_id], dtype=np.int32)
    batch: list[str] = []

    def flush():
        for ids in tok(batch, add_special_tokens=False)["input_ids"]:
            yield Document(np.concatenate([np.asarray(ids, dtype=np.int32), eos]))
        batch.clear()

    for where, text in records:
        if not isinstance(text, str):
            raise SpecError(where, field, "a string (set --data-field)")
        batch.append(text)
        if len(batch) == TOKENIZE_DOCS:
            yield from flush()
    yield from flush()


def _chat_documents(tok, records: Iterable[tuple[str, object]], field: str, where: str
                    ) -> Iterator[Document]:
    from slidedp.exec.data_chat import chat_document, check_chat_tokenizer, has_generation_tags

    check_chat_tokenizer(tok, where)
    tags = has_generation_tags(tok)
    for at, messages in records:
        yield chat_document(tok, messages, at, field, tags)


def _load_documents(p: Path, seq: int, tokenizer_dir, options: DataOptions,
                    role: str) -> TokenSequences:
    tok = _tokenizer(p, tokenizer_dir)
    field = options.column
    records = _records(p, field, role)
    if options.chat:
        docs = _chat_documents(tok, records, field, str(tokenizer_dir))
    else:
        docs = _text_documents(tok, records, field)
    if not (options.chat or options.pack):
        rows: Rows = concat_rows(docs, seq)
    else:
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if pad is None:
            raise SpecError(str(tokenizer_dir), "pad_token", "set, or an eos_token (rows are "
                            "padded with it)")
        rows = (pack_rows if options.pack else pad_rows)(docs, seq, pad)
    return TokenSequences(str(p), rows.tokens, rows.dropped_tokens, rows.labels,
                          rows.position_ids, rows.documents)


class Batches:
    """Infinite iterator of global batches {"input_ids", "labels"[, "position_ids"]}:
    (global_batch, seq) int64.

    labels is the same tensor as input_ids (the loss shifts) unless the data has labels;
    position_ids only for packed data. See the module docstring for the epoch order and the
    resumable state.
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
        self.index += 1
        if self.index == self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        return batch_of(self.data, rows)

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


def batch_of(data: TokenSequences, rows: np.ndarray) -> dict[str, torch.Tensor]:
    """Rows `rows` of `data` as {"input_ids", "labels"[, "position_ids"]}, (len(rows), seq)
    int64 (labels: input_ids itself where the data has none)."""
    def take(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(a[rows], dtype=np.int64))

    ids = take(data.tokens)
    out = {"input_ids": ids, "labels": ids if data.labels is None else take(data.labels)}
    if data.position_ids is not None:
        out["position_ids"] = take(data.position_ids)
    return out


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
