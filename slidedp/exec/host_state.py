"""HostState: the one host copy of the optimizer state (FP32 master, Adam m and v, step counts).

Per streaming unit (layout.py: 0 embedding, 1..L layers, L+1 final norm + head) the FP32 master,
exp_avg and exp_avg_sq are flat slices of three files in /dev/shm, mapped with
torch.from_file(shared=True): 12 bytes per parameter, one copy per host, and a second process
(a later rank process) maps the same memory with `HostState.attach(name)`. The moments may be
compact (`moments`, plan.moments: BF16, 4 bytes per parameter for both, or block-wise 8-bit, 2 bytes
plus one FP32 absmax per 256 elements in two more files, each unit's moments starting on a block
boundary of their own; moments.py). Optionally a fourth
file holds the parameters in the compute dtype (`copy_dtype`, BF16 on GPUs: the plan's
`host_bf16_copy`), written by the update and uploaded directly, with no cast in the next step.

Pinning (`pin()`): only what a DMA reads is page-locked, with cudaHostRegister on the exact
mapping (pin_memory() would copy and round the size up to a power of two): the parameter copy.
The master and the moments are touched by the CPU only.

A timing probe may share one unit's memory among several units of the same size (`storage_of`:
unit u lives in unit storage_of[u]'s slices): the executor's work and traffic per unit stay the
same while the state is a few layers large instead of the whole model, so it is built in a fraction
of the time (policy/probe.py). Such a state holds no model: state_dict(), load_state_dict() and
write_unit() of a sharing unit refuse it; the trainer and DistSession create states without
sharing.

The creator owns the files and unlinks them on close() (or earlier with unlink(): once every
process has mapped them, the memory lives as long as a mapping does and nothing can be left behind
in /dev/shm); an attached process only unmaps. A state created without a name is the process's
own (no other process can know its name to attach): its files are unlinked as soon as they are
mapped, so that nothing stays in /dev/shm however the process ends (a process stopped by an
exception or killed for memory would otherwise leave its state there, 98 GB for Qwen3-8B, and
the next run would be killed for want of memory). A named state (DistSession's) stays until its
creator unlinks it; DistSession removes every file of its job on each of its exits.

Names: `segment_name()` is "slidedp-<pid>-<start>-<random>", the creating process's pid and start
time (/proc/<pid>/stat, clock ticks since boot: a pid reused by another process has another
start), so that the files of a process that could not clean up (SIGKILL, the OOM killer) are
known to be orphans: `reclaim_segments()`, run once per process before its first state is
created, removes this user's files whose creator is gone and says so in one line on stderr.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import tempfile
import uuid
from pathlib import Path

import torch

from slidedp.exec.layout import model_layout
from slidedp.exec.moments import FORMATS, QBLOCK, STORED_DTYPE, MomentSpan, blocks
from slidedp.spec.errors import InfeasiblePlan

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
FILES = ("master", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax", "steps", "copy",
         "json")  # a state's, by suffix
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SEGMENT_RE = re.compile(r"^slidedp-(\d+)-(?:(\d+)-)?[0-9a-f]{8}[.]")  # pid, start (older: none)
_reclaimed = False  # reclaim_segments() ran in this process


def process_start(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks since boot), None if there is no such
    process (or it is a zombie: it holds nothing any more)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def segment_name() -> str:
    """A new name for this process's shared-memory files (module docstring: Names)."""
    return f"slidedp-{os.getpid()}-{process_start(os.getpid()) or 0}-{uuid.uuid4().hex[:8]}"


def orphan(name: str) -> bool:
    """Whether the process that created file `name` (segment_name's form) is gone. A name of the
    older form without a start time counts as an orphan only when its pid is gone."""
    m = SEGMENT_RE.match(name)
    if m is None:
        return False
    start = process_start(int(m.group(1)))
    return start is None or (m.group(2) is not None and int(m.group(2)) != start)


def reclaim_segments(shm_dir: Path | None = None) -> list[Path]:
    """Remove this user's slidedp files in shm_dir (SHM_DIR) whose creating process is gone;
    the removed paths, reported in one line on stderr when there are any."""
    shm_dir = shm_dir or SHM_DIR
    uid, gone, nbytes = os.getuid(), [], 0
    for path in shm_dir.glob("slidedp-*"):
        try:
            st = path.stat()
            if st.st_uid != uid or not orphan(path.name):
                continue
            path.unlink()
        except OSError:  # removed meanwhile, or not ours to remove
            continue
        gone.append(path)
        nbytes += st.st_blocks * 512
    if gone:
        pids = sorted({int(SEGMENT_RE.match(p.name).group(1)) for p in gone})
        print(f"slidedp: removed {len(gone)} shared-memory files ({nbytes / 2**30:.2f} GiB) left in "
              f"{shm_dir} by processes that are gone (pids {', '.join(map(str, pids))})",
              file=sys.stderr, flush=True)
    return gone


def reclaim_once() -> None:
    """reclaim_segments() the first time a process calls it."""
    global _reclaimed
    if not _reclaimed:
        _reclaimed = True
        reclaim_segments()


def map_shared(path: Path, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over the shared file mapping of `path` (created sparse, zero-filled, if missing)."""
    return torch.from_file(str(path), shared=True, size=max(numel, 1), dtype=dtype)[:numel]


def check_room(nbytes: float, what: str) -> None:
    """Raise InfeasiblePlan, before anything is written, where SHM_DIR cannot hold `nbytes` more
    (its files are sparse: filling past the room would kill the process with SIGBUS, no message;
    a container's /dev/shm is often 64 MiB unless started with a larger --shm-size)."""
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise InfeasiblePlan(f"shared memory in {SHM_DIR}", nbytes, free,
                             f"{what} (a container's /dev/shm: raise --shm-size)")


def private_shared(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Memory of the host state's kind (a /dev/shm mapping, whose pages the kernel may back
    otherwise than a process's anonymous memory, e.g. without transparent huge pages) for this
    process alone: mapped, then unlinked at once. For benchmarks that must time the kernels on
    the memory the executor runs them on (profile/host.py)."""
    check_room(numel * dtype.itemsize, f"a benchmark buffer of {numel} {dtype} elements")
    path = SHM_DIR / f"{segment_name()}.bench"
    try:
        return map_shared(path, numel, dtype)
    finally:
        path.unlink(missing_ok=True)


def cuda_host_register(t: torch.Tensor) -> None:
    """Page-lock exactly t's bytes for DMA (raises if the CUDA runtime refuses)."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {t.numel() * t.element_size()} bytes failed: {err}"
        )


def cuda_host_unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class HostState:
    """Flat FP32 master, exp_avg / exp_avg_sq (in the `moments` format) per unit in shared memory,
    plus per-unit steps."""

    def __init__(
        self, name: str, unit_numels: list[int], copy_dtype: torch.dtype | None, owner: bool,
        storage_of: list[int] | None = None, moments: str = "fp32",
    ):
        if moments not in FORMATS:
            raise ValueError(f"host state {name}: moments {moments!r}, expected one of {FORMATS}")
        self.name = name
        self.unit_numels = list(unit_numels)
        self.copy_dtype = copy_dtype
        self.owner = owner
        self.moments = moments
        self.storage_of = checked_storage_of(self.unit_numels, storage_of)
        self.starts, total = offsets(self.unit_numels, self.storage_of, 1)
        # the moments' own offsets: a block boundary per unit for int8 (module docstring)
        self.mstarts, mtotal = offsets(self.unit_numels, self.storage_of,
                                       QBLOCK if moments == "int8" else 1)
        self.master = self._map("master", total, torch.float32)
        self.exp_avg = self._map("exp_avg", mtotal, STORED_DTYPE[moments])
        self.exp_avg_sq = self._map("exp_avg_sq", mtotal, STORED_DTYPE[moments])
        self.absmax = None if moments != "int8" else tuple(  # per block, of m and of v
            self._map(f"{what}_absmax", mtotal // QBLOCK, torch.float32)
            for what in ("exp_avg", "exp_avg_sq"))
        self.steps = self._map("steps", len(self.unit_numels), torch.int64)  # updates done per unit
        self.copy = self._map("copy", total, copy_dtype) if copy_dtype is not None else None
        self._pinned: list[torch.Tensor] = []

    # ---- creation / attachment -------------------------------------------------------------

    @classmethod
    def create(
        cls, unit_numels: list[int], copy_dtype: torch.dtype | None = None, name: str | None = None,
        storage_of: list[int] | None = None, moments: str = "fp32",
    ) -> HostState:
        """New zero-filled state (the files are created sparse: pages appear when written);
        `name`: for other processes to attach, None for a state of this process alone (unlinked
        once mapped: module docstring); `storage_of`: units that share memory (module
        docstring), None for none; `moments`: their format (moments.py)."""
        private = name is None
        reclaim_once()
        name = name or segment_name()
        storage_of = checked_storage_of(list(unit_numels), storage_of)
        elems = sum(n for u, n in enumerate(unit_numels) if storage_of[u] == u)
        copy_bytes = 0 if copy_dtype is None else copy_dtype.itemsize
        moment_bytes = 2 * (STORED_DTYPE[moments].itemsize + (4 / QBLOCK if moments == "int8" else 0))
        check_room(elems * (4 + moment_bytes + copy_bytes) + 8 * len(unit_numels),
                   f"host state {name}: FP32 master, {moments} exp_avg, exp_avg_sq"
                   + ("" if copy_dtype is None else f" and a {copy_dtype} copy")
                   + f" of {elems} elements")
        meta = {
            "unit_numels": list(unit_numels),
            "copy_dtype": None if copy_dtype is None else str(copy_dtype).removeprefix("torch."),
            "storage_of": storage_of,
            "moments": moments,
        }
        (SHM_DIR / f"{name}.json").write_text(json.dumps(meta))
        try:
            hs = cls(name, unit_numels, copy_dtype, owner=True, storage_of=storage_of,
                     moments=moments)
        except BaseException:
            cls.unlink_files(name)
            raise
        if private:
            cls.unlink_files(name)
        return hs

    @classmethod
    def attach(cls, name: str) -> HostState:
        """Map the state another process created under `name` (same memory, no copy)."""
        meta = json.loads((SHM_DIR / f"{name}.json").read_text())
        dt = meta["copy_dtype"]
        return cls(name, meta["unit_numels"], None if dt is None else _DTYPES[dt], owner=False,
                   storage_of=meta.get("storage_of"), moments=meta.get("moments", "fp32"))

    def _path(self, what: str) -> Path:
        return SHM_DIR / f"{self.name}.{what}"

    def _map(self, what: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return map_shared(self._path(what), numel, dtype)

    def subset(self, units: list[int]) -> HostState:
        """A state over some of this state's units, in their memory (no copy; unit i of the
        subset is unit units[i] here), with step counts of its own: the state of a model cut to
        those units (policy/probe.py: the reduced pipeline's embedding, first layers and head).
        Each unit must own its memory; a state with a parameter copy is not subset. close()
        leaves this state's memory and files alone."""
        if self.copy is not None:
            raise ValueError(f"host state {self.name}: a subset of a state with a parameter copy")
        for u in units:
            if not (0 <= u < self.n_units and self.owns_storage(u)):
                raise ValueError(f"host state {self.name}: unit {u} is not one of its "
                                 f"{self.n_units} units that own their memory")
        sub = copy.copy(self)  # the same mapped tensors
        sub.name, sub.owner, sub._pinned = f"{self.name}.subset", False, []
        sub.unit_numels = [self.unit_numels[u] for u in units]
        sub.starts = [self.starts[u] for u in units]
        sub.mstarts = [self.mstarts[u] for u in units]
        sub.storage_of = list(range(len(units)))
        sub.steps = torch.zeros(len(units), dtype=torch.int64)
        return sub

    # ---- per-unit access -------------------------------------------------------------------

    @property
    def n_units(self) -> int:
        return len(self.unit_numels)

    @property
    def shares_storage(self) -> bool:
        """Whether some units share memory (a timing probe's state, module docstring)."""
        return any(s != u for u, s in enumerate(self.storage_of))

    def owns_storage(self, u: int) -> bool:
        """Whether unit u's memory is its own (the one unit to initialise among its sharers)."""
        return self.storage_of[u] == u

    def _unit(self, t: torch.Tensor, u: int) -> torch.Tensor:
        return t[self.starts[u] : self.starts[u] + self.unit_numels[u]]

    def unit_master(self, u: int) -> torch.Tensor:
        return self._unit(self.master, u)

    def unit_m(self, u: int) -> torch.Tensor:
        """Unit u's exp_avg as stored (FP32, BF16 or the int8 codes)."""
        return self.exp_avg[self.mstarts[u] : self.mstarts[u] + self.unit_numels[u]]

    def unit_v(self, u: int) -> torch.Tensor:
        """Unit u's exp_avg_sq as stored (FP32, BF16 or the int8 codes)."""
        return self.exp_avg_sq[self.mstarts[u] : self.mstarts[u] + self.unit_numels[u]]

    def unit_absmax(self, u: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The absmax per block of unit u's m and v (int8 moments only)."""
        b0 = self.mstarts[u] // QBLOCK
        return tuple(a[b0 : b0 + blocks(self.unit_numels[u])] for a in self.absmax)

    def moment_span(self, u: int, lo: int, hi: int) -> MomentSpan:
        """The moments of elements [lo, hi) of unit u, for their update (lo on a QBLOCK
        boundary of the unit with int8 moments)."""
        m, v = self.unit_m(u)[lo:hi], self.unit_v(u)[lo:hi]
        if self.absmax is None:
            return MomentSpan(self.moments, m, v)
        if lo % QBLOCK:
            raise ValueError(f"host state {self.name}: int8 moments of unit {u} updated from "
                             f"element {lo}, not a multiple of {QBLOCK}")
        ma, va = self.unit_absmax(u)
        b0, b1 = lo // QBLOCK, blocks(hi)
        return MomentSpan(self.moments, m, v, ma[b0:b1], va[b0:b1])

    def unit_state(self, u: int) -> dict[str, torch.Tensor]:
        """Views of unit u's state as a checkpoint keeps it: master, m, v (as stored) and, with
        int8 moments, m_absmax and v_absmax."""
        out = {"master": self.unit_master(u), "m": self.unit_m(u), "v": self.unit_v(u)}
        if self.absmax is not None:
            out["m_absmax"], out["v_absmax"] = self.unit_absmax(u)
        return out

    def unit_copy(self, u: int) -> torch.Tensor:
        """The unit's parameters in the compute dtype (only with copy_dtype)."""
        return self._unit(self.copy, u)

    def write_unit(self, u: int, flat: torch.Tensor) -> None:
        """Set unit u's master (and parameter copy) from a flat tensor of any float dtype."""
        if not self.owns_storage(u):
            raise RuntimeError(f"host state {self.name}: unit {u} shares unit "
                               f"{self.storage_of[u]}'s memory (a timing probe's state): it "
                               "cannot hold weights of its own")
        self.unit_master(u).copy_(flat.reshape(-1))
        if self.copy is not None:
            self.unit_copy(u).copy_(self.unit_master(u))

    # ---- initialisation --------------------------------------------------------------------

    def init_from_model(self, model: torch.nn.Module) -> None:
        """Masters from a transformers *ForCausalLM's parameters; Adam state and steps zeroed."""
        sd = model.state_dict()
        for lay in model_layout(model):
            self.write_unit(lay.unit, torch.cat([sd[e.name].reshape(-1) for e in lay.entries]))
        self.zero_moments()
        self.steps.zero_()

    def zero_moments(self) -> None:
        """Every unit's m and v zero (and their absmax)."""
        for t in (self.exp_avg, self.exp_avg_sq, *(self.absmax or ())):
            t.zero_()

    def init_random(self, config, seed: int) -> None:
        """The weights transformers' from_config draws under torch.manual_seed(seed).

        Builds the whole model in FP32 on the CPU once (fine for test and small models; large
        models are loaded unit by unit by the io module through write_unit).
        """
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.init_from_model(AutoModelForCausalLM.from_config(config))

    # ---- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Views (no copies) of every unit's state: unit{u}.master / .exp_avg / .exp_avg_sq (and
        .exp_avg_absmax / .exp_avg_sq_absmax with int8 moments), steps."""
        if self.shares_storage:
            raise RuntimeError(f"host state {self.name}: its units share memory (a timing "
                               "probe's state): it holds no model to save or load")
        out = {"steps": self.steps}
        keys = {"master": "master", "m": "exp_avg", "v": "exp_avg_sq",
                "m_absmax": "exp_avg_absmax", "v_absmax": "exp_avg_sq_absmax"}
        for u in range(self.n_units):
            out.update({f"unit{u}.{keys[k]}": t for k, t in self.unit_state(u).items()})
        return out

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy a state_dict() in place (tensors may be memory-mapped: read once, no extra copy)."""
        for key, dst in self.state_dict().items():
            if key not in sd or sd[key].numel() != dst.numel():
                raise KeyError(f"HostState.load_state_dict: missing or mis-sized {key!r}")
            dst.copy_(sd[key].reshape(-1) if dst.dim() == 1 else sd[key])
        if self.copy is not None:
            self.copy.copy_(self.master)

    # ---- DMA pinning and teardown ------------------------------------------------------------

    def pin(self) -> None:
        """Page-lock the parameter copy (the only state a DMA reads) with an exact registration."""
        if self.copy is not None and not self._pinned and self.copy.numel():
            cuda_host_register(self.copy)
            self._pinned.append(self.copy)

    def close(self) -> None:
        for t in self._pinned:
            cuda_host_unregister(t)
        self._pinned.clear()
        self.master = self.exp_avg = self.exp_avg_sq = self.absmax = self.steps = self.copy = None
        if self.owner:
            self.unlink()

    def unlink(self) -> None:
        """Remove the files (the mappings stay valid; no process can attach afterwards)."""
        self.unlink_files(self.name)

    @staticmethod
    def unlink_files(name: str) -> None:
        for what in FILES:
            (SHM_DIR / f"{name}.{what}").unlink(missing_ok=True)


def offsets(unit_numels: list[int], storage_of: list[int], align: int) -> tuple[list[int], int]:
    """(each unit's first element, total elements) of flat arrays holding the units in order,
    each owner's start a multiple of `align`; a sharer starts where its storage unit does."""
    starts, total = [], 0
    for u, n in enumerate(unit_numels):
        s = storage_of[u]
        starts.append(total if s == u else starts[s])
        total += -(-n // align) * align if s == u else 0
    return starts, total


def checked_storage_of(unit_numels: list[int], storage_of: list[int] | None) -> list[int]:
    """`storage_of` checked (each unit's storage unit: itself, or an earlier unit of the same size
    that owns its memory), or every unit its own when None."""
    if storage_of is None:
        return list(range(len(unit_numels)))
    storage_of = [int(s) for s in storage_of]
    if len(storage_of) != len(unit_numels):
        raise ValueError(f"storage_of: {len(storage_of)} entries for {len(unit_numels)} units")
    for u, s in enumerate(storage_of):
        if not (0 <= s <= u and storage_of[s] == s and unit_numels[s] == unit_numels[u]):
            raise ValueError(f"storage_of[{u}] = {s}: expected a unit <= {u} of the same size "
                             f"({unit_numels[u]} elements) that owns its memory")
    return storage_of
