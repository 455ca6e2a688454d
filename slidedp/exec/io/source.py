"""Where the initial weights come from: a local Hugging Face model directory (config.json +
safetensors, one file or sharded with model.safetensors.index.json), a Hugging Face model id
("Qwen/Qwen3-4B", optionally "@revision") already in the local Hugging Face cache (its snapshot
directory; never downloaded: huggingface_hub with local_files_only), or a preset name (random
init, see init.py). Weights are read unit by unit into flat FP32 vectors in the layout of
slidedp.exec.layout; only the tensors of one unit are ever materialized.

Every tensor the layout needs is checked (present, floating dtype, right shape) when the source is
opened, from the safetensors headers alone, so a bad directory fails before training starts with
a SpecError naming the file and the tensor. qwen3_moe experts are read from either the fused
tensors transformers >= 5 builds or the per-expert tensors of Hub checkpoints (file_pieces). Tied embeddings: the layout has no lm_head.weight, so
a file that also stores it (some exports do) has it ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from slidedp.exec.io.hf import fingerprint, hf_config, meta_layout
from slidedp.exec.io.init import RandomInit
from slidedp.exec.layout import Entry, UnitLayout
from slidedp.spec.errors import SpecError
from slidedp.spec.model import ModelSpec, load_model

INDEX = "model.safetensors.index.json"
MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")  # org/name[@revision]
SINGLE = "model.safetensors"
FLOAT_DTYPES = ("F32", "BF16", "F16")


@dataclass
class ModelSource:
    """A model's config, unit layout and initial weights; `read_unit` gives unit u as flat FP32."""

    where: str  # the directory, or "preset <name>"
    spec: ModelSpec
    config: PretrainedConfig
    layout: list[UnitLayout]
    model_dir: Path | None  # None for a preset
    files: dict[str, Path] | None  # HF tensor name -> safetensors file; None: random init
    init: RandomInit | None

    @property
    def unit_numels(self) -> list[int]:
        return [ul.numel for ul in self.layout]

    def fingerprint(self) -> dict:
        return fingerprint(self.spec.family, self.unit_numels)

    def read_unit(self, u: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Unit u as a flat FP32 vector, written into `out` (numel = layout[u].numel) when given."""
        if self.init is not None:
            return self.init.unit(u, out)
        ul = self.layout[u]
        flat = torch.empty(ul.numel, dtype=torch.float32) if out is None else out
        with ExitStack() as stack:
            handles: dict[Path, Any] = {}
            for e in ul.entries:
                off = e.offset
                for name, shape in file_pieces(e, self.files):
                    path = self.files[name]
                    if path not in handles:
                        handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
                    n = math.prod(shape)  # one file tensor materialized at a time
                    flat[off : off + n].copy_(handles[path].get_tensor(name).reshape(-1))
                    off += n
        return flat

    def units(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(u, flat FP32 vector) for every unit in order, one unit in memory at a time."""
        for u in range(len(self.layout)):
            yield u, self.read_unit(u)


def cached_model_dir(name: str) -> Path | None:
    """The local snapshot directory of Hugging Face model id `name` (org/name[@revision]) in the
    local Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub), offline; None when `name` is an
    existing path or no model id. SpecError for an id that is not in the cache."""
    if Path(name).exists() or not MODEL_ID.match(name):
        return None
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, _, revision = name.partition("@")
    try:
        return Path(snapshot_download(repo, revision=revision or None, local_files_only=True))
    except LocalEntryNotFoundError:
        raise SpecError(name, "<model>", "a local model directory, a preset, or a model id in the "
                        f"local Hugging Face cache ({constants.HF_HUB_CACHE}); it is none of these "
                        f"(slidedp never downloads: fetch it first, e.g. `hf download {repo}`)"
                        ) from None


def open_model_source(name_or_dir: str | Path, seed: int = 0) -> ModelSource:
    """A local HF model directory, a model id in the local HF cache (cached_model_dir), or a
    preset name (random init drawn from `seed`)."""
    snapshot = cached_model_dir(str(name_or_dir))
    if snapshot is not None:
        source = open_model_source(snapshot, seed)
        spec = dataclasses.replace(source.spec, name=str(name_or_dir))
        return dataclasses.replace(source, where=f"{name_or_dir} ({snapshot})", spec=spec)
    p = Path(name_or_dir)
    is_path = p.exists() or "/" in str(name_or_dir) or str(name_or_dir).startswith(".")
    if is_path and not p.is_dir():
        expected = "does not exist" if not p.exists() else "a directory, got a file"
        raise SpecError(
            str(p), "<model directory>", f"{expected} (want config.json + *.safetensors)"
        )
    spec = load_model(str(name_or_dir))  # SpecError on missing/bad config.json or model_type
    config = hf_config(dict(spec.config))
    model, layout = meta_layout(config)
    if not is_path:
        init = RandomInit(model, layout, seed)
        return ModelSource(f"preset {name_or_dir}", spec, config, layout, None, None, init)
    files = _weight_files(p)
    _check_tensors(files, layout, p)
    return ModelSource(str(p), spec, config, layout, p, files, None)


def _weight_files(d: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (from the index, or the single file)."""
    index = d / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise SpecError(
                str(index), "weight_map", f"valid JSON with a weight_map object ({e})"
            ) from None
        files = {name: d / fname for name, fname in weight_map.items()}
        for name, f in files.items():
            if not f.is_file():
                raise SpecError(
                    str(index), f"weight_map.{name}", f"an existing file, {f.name} is missing"
                )
        return files
    single = d / SINGLE
    if not single.is_file():
        hint = (
            " (found only pytorch_model*.bin: convert to safetensors)"
            if any(d.glob("*.bin"))
            else ""
        )
        raise SpecError(str(d), SINGLE, f"safetensors weights: {SINGLE} or {INDEX}{hint}")
    return dict.fromkeys(_header(single), single)


def _header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (safetensors dtype, shape), read from the file's header only."""
    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())  # safe_open is not a dict: it has no __iter__
            return {
                n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape())) for n in names
            }
    except Exception as e:  # safetensors raises its own SafetensorError or OSError
        raise SpecError(str(path), "<header>", f"a valid safetensors file ({e})") from None


def file_pieces(e: Entry, files: dict[str, Path]) -> list[tuple[str, tuple[int, ...]]]:
    """The file tensors whose flattened concatenation is layout entry `e`: the tensor itself, or
    for a fused qwen3_moe expert tensor (experts.gate_up_proj [E, 2m, h], experts.down_proj
    [E, h, m], as transformers >= 5 builds them) stored per expert as on the Hub
    (experts.{i}.gate_proj / up_proj / down_proj.weight), those tensors in expert order."""
    prefix, _, kind = e.name.rpartition(".")
    if e.name in files or kind not in ("gate_up_proj", "down_proj") or len(e.shape) != 3:
        return [(e.name, e.shape)]
    n_experts, rows, cols = e.shape
    if kind == "gate_up_proj":
        parts = [
            (f"{prefix}.{i}.{p}.weight", (rows // 2, cols))
            for i in range(n_experts)
            for p in ("gate_proj", "up_proj")
        ]
    else:
        parts = [(f"{prefix}.{i}.down_proj.weight", (rows, cols)) for i in range(n_experts)]
    return parts if parts[0][0] in files else [(e.name, e.shape)]


def _check_tensors(files: dict[str, Path], layout: list[UnitLayout], d: Path) -> None:
    """Every file tensor the layout needs present, floating, right shape: headers only."""
    need: dict[Path, list[tuple[str, tuple[int, ...]]]] = {}
    for ul in layout:
        for e in ul.entries:
            for name, shape in file_pieces(e, files):
                if name not in files:
                    where = d / INDEX if (d / INDEX).is_file() else d / SINGLE
                    raise SpecError(str(where), name, f"a tensor of shape {list(shape)}, missing")
                need.setdefault(files[name], []).append((name, shape))
    for path, pieces in need.items():
        header = _header(path)
        for name, want in pieces:
            if name not in header:
                raise SpecError(str(path), name, "a tensor (listed in the index), missing")
            dtype, shape = header[name]
            if dtype not in FLOAT_DTYPES:
                raise SpecError(str(path), name, f"dtype in {FLOAT_DTYPES}, got {dtype}")
            if shape != want:
                raise SpecError(str(path), name, f"shape {list(want)}, got {list(shape)}")
