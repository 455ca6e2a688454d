"""Export units as a Hugging Face model directory (config.json + safetensors) that
`AutoModelForCausalLM.from_pretrained` loads, streaming unit by unit.

Tensors are written in BF16, FP16 or FP32 (argument, else the config's dtype, else BF16). Units
are grouped into shards of at most `max_shard_bytes` (a unit is never split; a single unit larger
than the limit gets a shard of its own); with more than one shard the files are named
model-0000i-of-0000n.safetensors plus model.safetensors.index.json, as transformers writes them.
A tied model writes only the embedding (transformers re-ties the head on load). With
`assets_from` (the source model directory), its tokenizer files, chat template and
generation_config.json (ASSETS, those it has) are copied beside the weights, byte for byte, so
that AutoTokenizer and generate() find what the source model had. The directory is built under a
temp name and renamed into place (atomic.py).
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from pathlib import Path

import torch
from transformers import PretrainedConfig

from slidedp.exec.dtypes import SAVE_DTYPES
from slidedp.exec.io.atomic import atomic_dir
from slidedp.exec.io.hf import hf_config, meta_layout
from slidedp.exec.io.source import INDEX, SINGLE
from slidedp.exec.io.stream import SafetensorsWriter
from slidedp.exec.layout import UnitLayout
from slidedp.spec.errors import SpecError

EXPORT_DTYPES = {name: getattr(torch, name) for name in SAVE_DTYPES}
MAX_SHARD_BYTES = 4 * 2**30
# a model directory's files besides config and weights that a complete export carries over
ASSETS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
          "spiece.model", "chat_template.jinja", "chat_template.json", "generation_config.json")
ASSET_DIRS = ("additional_chat_templates",)


def copy_assets(src: Path, dst: Path) -> list[str]:
    """Copy the ASSETS (and ASSET_DIRS) that `src` has into `dst`; their names."""
    done = []
    for name in ASSETS:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)  # follows the HF cache's symlinks
            done.append(name)
    for name in ASSET_DIRS:
        if (src / name).is_dir():
            shutil.copytree(src / name, dst / name)
            done.append(name)
    return done


def export_dtype(config: PretrainedConfig, dtype: str | None) -> torch.dtype:
    """The dtype to write: `dtype`, else the config's dtype when supported, else bfloat16."""
    if dtype is None:
        cfg = str(getattr(config, "dtype", None) or "").removeprefix("torch.")
        return EXPORT_DTYPES.get(cfg, torch.bfloat16)
    if dtype not in EXPORT_DTYPES:
        raise SpecError("export", "dtype", f"one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    return EXPORT_DTYPES[dtype]


def plan_shards(layout: list[UnitLayout], itemsize: int, max_shard_bytes: int) -> list[list[int]]:
    """Consecutive units grouped greedily so that each group's tensor bytes <= max_shard_bytes."""
    shards: list[list[int]] = [[]]
    size = 0
    for ul in layout:
        nbytes = ul.numel * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(ul.unit)
        size += nbytes
    return shards


def export_hf(
    out_dir: Path | str,
    config: Mapping | PretrainedConfig,
    unit_iter: Iterable[tuple[int, torch.Tensor]],
    dtype: str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    overwrite: bool = False,
    assets_from: Path | str | None = None,
) -> Path:
    """Write every unit from `unit_iter` ((u, flat FP32 vector), any order, each once) to out_dir,
    and the source directory's tokenizer and generation config when `assets_from` is given."""
    config = copy.deepcopy(hf_config(config))
    _, layout = meta_layout(config)
    dt = export_dtype(config, dtype)
    shards = plan_shards(layout, dt.itemsize, max_shard_bytes)
    n = len(shards)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    out_dir = Path(out_dir)
    with atomic_dir(out_dir, overwrite) as tmp, ExitStack() as stack:
        writer_of: dict[int, SafetensorsWriter] = {}
        weight_map: dict[str, str] = {}
        for name, units in zip(names, shards, strict=True):
            plan = [(e.name, dt, e.shape) for u in units for e in layout[u].entries]
            w = stack.enter_context(SafetensorsWriter(tmp / name, plan))
            writer_of.update(dict.fromkeys(units, w))
            weight_map.update({p[0]: name for p in plan})
        done: set[int] = set()
        for u, flat in unit_iter:
            if u in done or not 0 <= u < len(layout) or flat.numel() != layout[u].numel:
                raise ValueError(f"export_hf: unit {u} repeated, out of range or of the wrong size")
            for e in layout[u].entries:
                writer_of[u].write(e.name, flat[e.offset : e.offset + e.numel])
            done.add(u)
        if len(done) != len(layout):
            raise ValueError(
                f"export_hf: units never given: {sorted(set(range(len(layout))) - done)}"
            )
        if n > 1:
            total = sum(ul.numel for ul in layout) * dt.itemsize
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        config.dtype = dt
        config.to_json_file(tmp / "config.json")
        if assets_from is not None:
            copy_assets(Path(assets_from), tmp)
    return out_dir
