"""Training checkpoints that resume exactly: per unit the FP32 master and Adam m, v (in the host
state's format: FP32, BF16 or int8 codes with their blocks' absmax; exec/moments.py); plus a JSON of
everything else (global step, RNG states, and what the trainer puts in `meta`: per-unit step
counts, data position, model config, the model fingerprint).

Layout of one checkpoint, <root>/step-<8-digit step>/:
  unit-<5-digit u>.safetensors   tensors "master", "m", "v" (flat, the unit's layout; master
                                 FP32, m and v as the state keeps them) and, for int8 moments,
                                 "m_absmax", "v_absmax" (FP32, one per 256-element block)
  meta.json                      written last; a step dir without it is never reported
Saving streams unit by unit (stream.py: no second copy of the state in memory) into a temp dir
next to the final one and renames it into place after fsync (io/atomic.py); older checkpoints
are pruned only after the new one is complete, so a crash mid-save leaves the previous one intact.
Every tensor is checked finite before it is written (finite.py): a state holding NaN or Inf
raises NonFinite and is never saved, and the checkpoints before it are kept.
Resuming from a checkpoint of another model (fingerprint: model_type + every unit's numel) is a
SpecError.
"""

from __future__ import annotations

import base64
import json
import random
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from slidedp.exec.finite import check_finite
from slidedp.exec.io.atomic import TMP_MARK, atomic_dir
from slidedp.exec.io.stream import ST_DTYPE, SafetensorsWriter
from slidedp.spec.errors import SpecError

FORMAT = 1
META = "meta.json"
STEP_RE = re.compile(r"^step-(\d{8})$")
STATE_NAMES = ("master", "m", "v", "m_absmax", "v_absmax")  # a unit's tensors, in order
ELEMENT_NAMES = 3  # the first three hold one value per parameter of the unit
DTYPE_NAMES = {torch.float32: "FP32", torch.bfloat16: "BF16", torch.uint8: "uint8"}
READ_CHUNK_ELEMS = 1 << 24  # elements copied per slice when loading (bounds the temp memory)


def step_dir(root: Path | str, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def _unit_file(ckpt: Path, u: int) -> Path:
    return ckpt / f"unit-{u:05d}.safetensors"


# ---- RNG states (JSON-able) ---------------------------------------------------------------------


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng() -> dict:
    """Python, numpy (legacy global), torch CPU and (when present) CUDA generator states."""
    py = random.getstate()
    npy = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npy[0], npy[1].tolist(), int(npy[2]), int(npy[3]), float(npy[4])],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npy = state["numpy"]
    np.random.set_state((npy[0], np.asarray(npy[1], dtype=np.uint32), npy[2], npy[3], npy[4]))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


# ---- save ---------------------------------------------------------------------------------------


def save_checkpoint(
    root: Path | str,
    step: int,
    units: Iterable[tuple[int, torch.Tensor, ...]],
    meta: dict,
    keep: int = 2,
) -> Path:
    """Write <root>/step-<step> from (u, master, m, v[, m_absmax, v_absmax]) flat tensors, each
    unit once (HostState.unit_state's, in STATE_NAMES order; dtypes as given).

    `meta` must be JSON-able and hold "fingerprint" (io.hf.fingerprint); "format", "step" and
    "rng" (capture_rng() now) are added. Keeps the newest `keep` checkpoints after this one is
    complete; leftovers of a crashed save are removed first.
    """
    if keep < 1:
        raise ValueError(f"save_checkpoint: keep must be >= 1, got {keep}")
    root = Path(root)
    numels = meta["fingerprint"]["unit_numels"]
    for stale in root.glob(f".step-*{TMP_MARK}*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = step_dir(root, step)
    with atomic_dir(final, overwrite=True) as tmp:
        done: set[int] = set()
        for u, *state in units:
            if u in done or not 0 <= u < len(numels):
                raise ValueError(f"save_checkpoint: unit {u} repeated or out of range")
            named = list(zip(STATE_NAMES, state, strict=False))
            if len(named) != len(state) or len(state) < ELEMENT_NAMES \
                    or any(t.numel() != numels[u] for t in state[:ELEMENT_NAMES]):
                raise ValueError(f"save_checkpoint: unit {u}: expected master, m, v of "
                                 f"{numels[u]} elements (and absmax), got {len(state)} tensors")
            plan = [(name, t.dtype, (t.numel(),)) for name, t in named]
            with SafetensorsWriter(_unit_file(tmp, u), plan) as w:
                for name, t in named:
                    check_finite(t, f"unit {u}'s {name} (checkpoint step {step})")
                    w.write(name, t)
            done.add(u)
        if len(done) != len(numels):
            raise ValueError(
                f"save_checkpoint: units never given: {sorted(set(range(len(numels))) - done)}"
            )
        full = {**meta, "format": FORMAT, "step": step, "rng": capture_rng()}
        (tmp / META).write_text(json.dumps(full))
    for old in _complete(root)[:-keep]:
        shutil.rmtree(old)
    return final


# ---- find and load ------------------------------------------------------------------------------


def _complete(root: Path) -> list[Path]:
    """Complete checkpoints under root (meta.json present), oldest first."""
    if not root.is_dir():
        return []
    found = [d for d in root.iterdir() if STEP_RE.match(d.name) and (d / META).is_file()]
    return sorted(found, key=lambda d: int(STEP_RE.match(d.name).group(1)))


def latest_checkpoint(root: Path | str) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    done = _complete(Path(root))
    return done[-1] if done else None


class CheckpointReader:
    """Copies a unit's saved master, m and v (and absmax) into caller-owned flat tensors."""

    def __init__(self, ckpt: Path, unit_numels: list[int]):
        self.ckpt, self.unit_numels = ckpt, unit_numels

    def read_unit(self, u: int, *outs: torch.Tensor) -> None:
        """Unit u's tensors into `outs` (master, m, v[, m_absmax, v_absmax], as saved: each of
        the saved dtype and size, else a SpecError naming the file and the tensor)."""
        path = _unit_file(self.ckpt, u)
        if not path.is_file():
            raise SpecError(str(path), "<file>", f"unit {u}'s state (the checkpoint is incomplete)")
        n = self.unit_numels[u]
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())  # safe_open is not a dict: it has no __contains__
            for i, (name, out) in enumerate(zip(STATE_NAMES, outs, strict=False)):
                k = n if i < ELEMENT_NAMES else out.numel()
                sl = f.get_slice(name) if name in names else None
                shape, dtype = (None, None) if sl is None else (sl.get_shape(), sl.get_dtype())
                want = DTYPE_NAMES.get(out.dtype, str(out.dtype))
                if shape != [k] or out.numel() != k or dtype != ST_DTYPE.get(out.dtype):
                    got = "none" if sl is None else f"{dtype} {shape}"
                    raise SpecError(str(path), name,
                                    f"a flat {want} tensor of {k} elements, got {got}")
                for lo in range(0, k, READ_CHUNK_ELEMS):
                    hi = min(k, lo + READ_CHUNK_ELEMS)
                    out[lo:hi].copy_(sl[lo:hi])


def load_checkpoint(ckpt: Path | str, expect_fingerprint: dict) -> tuple[dict, CheckpointReader]:
    """(meta, reader) of a checkpoint dir; SpecError if incomplete or of another model."""
    ckpt = Path(ckpt)
    meta_path = ckpt / META
    if not meta_path.is_file():
        raise SpecError(str(ckpt), META, "a complete checkpoint (meta.json is written last)")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecError(str(meta_path), "<syntax>", f"valid JSON ({e})") from None
    if meta.get("format") != FORMAT:
        raise SpecError(str(meta_path), "format", f"{FORMAT}, got {meta.get('format')!r}")
    got = meta.get("fingerprint")
    if got != expect_fingerprint:
        raise SpecError(str(meta_path), "fingerprint", _mismatch(expect_fingerprint, got))
    return meta, CheckpointReader(ckpt, list(got["unit_numels"]))


def _mismatch(want: dict, got) -> str:
    if not isinstance(got, dict):
        return f"a model fingerprint, got {got!r}"
    if got.get("model_type") != want["model_type"]:
        return f"model_type {want['model_type']!r} (the model being trained), got {got.get('model_type')!r}"
    g, w = got.get("unit_numels") or [], want["unit_numels"]
    if len(g) != len(w):
        return (
            f"{len(w)} units (the model being trained), got {len(g)}: a checkpoint of another model"
        )
    u = next(i for i in range(len(w)) if g[i] != w[i])
    return f"unit {u} of {w[u]} parameters (the model being trained), got {g[u]}: another model"
