"""Hugging Face `datasets` sources: the values of one column of a local data set, offline.

Sources:
    DIR        a data set written by `save_to_disk` (a Dataset, or a DatasetDict: see SPLITS),
               memory-mapped by load_from_disk
    F.arrow    one Arrow file of a data set (e.g. a save_to_disk shard), memory-mapped
    F.parquet  a Parquet file, streamed (read batch by batch, no copy into the datasets cache)
Nothing reaches the network: HF_DATASETS_OFFLINE and HF_HUB_OFFLINE are set before `datasets`
is imported (unless set already), and every path is a local file. `datasets` is an optional
dependency (pip install 'slidedp[data]'): without it these sources are a SpecError naming the
extra, raised before anything is read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from slidedp.spec.errors import SpecError

SUFFIXES = (".parquet", ".arrow")
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
BATCH_ROWS = 1024  # rows per read
# the split a DatasetDict gives: the first of these it has (or its only split)
SPLITS = {"train": ("train",), "eval": ("validation", "test", "eval")}
EXTRA = "the `datasets` package (pip install 'slidedp[data]')"


def is_dataset(p: Path) -> bool:
    return p.suffix in SUFFIXES or p.is_dir()


def import_datasets(where: str):
    """The `datasets` module, imported offline; SpecError naming the extra when missing."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise SpecError(where, "<reader>", f"{EXTRA} to read .parquet, .arrow or save_to_disk "
                        "directories; it is not installed") from None
    datasets.disable_progress_bars()
    return datasets


def _open(p: Path, role: str):
    datasets = import_datasets(str(p))
    try:
        if p.is_dir():
            if not any((p / m).is_file() for m in SAVED_MARKERS):
                raise SpecError(str(p), "<directory>", "a data set written by save_to_disk "
                                f"(one of {', '.join(SAVED_MARKERS)})")
            ds = datasets.load_from_disk(str(p))
        elif p.suffix == ".arrow":
            ds = datasets.Dataset.from_file(str(p))
        else:
            ds = datasets.load_dataset("parquet", data_files=str(p), split="train",
                                       streaming=True)
    except SpecError:
        raise
    except Exception as e:  # datasets and pyarrow raise many kinds
        raise SpecError(str(p), "<file>", f"a readable data set ({type(e).__name__}: {e})"
                        ) from None
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds)
        pick = next((s for s in SPLITS[role] if s in ds), names[0] if len(names) == 1 else None)
        if pick is None:
            raise SpecError(str(p), "split", f"one of {', '.join(SPLITS[role])} (or a single "
                            f"split) for the {role} data, got {', '.join(names)}")
        ds = ds[pick]
    return ds


def column_values(p: Path, field: str, role: str = "train") -> Iterator[tuple[str, object]]:
    """(where, value) of column `field` for every row in order; `where` names the row. SpecError
    when the column is missing (naming the columns there are)."""
    ds = _open(p, role)
    columns = ds.column_names
    if columns is not None and field not in columns:
        raise SpecError(str(p), field, f"a column of the data set (set --data-field); it has "
                        f"{', '.join(columns)}")
    row = 0
    for batch in ds.select_columns([field]).iter(batch_size=BATCH_ROWS):
        for v in batch[field]:
            yield f"{p} row {row}", v
            row += 1
