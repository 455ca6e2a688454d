"""What the machine at hand is, read once at the start, and the source line every number carries.

Cores are spec.cores.host_cores(): the physical cores of the CPUs this process may run on (its
affinity mask; SMT siblings count once). RAM is
MemTotal at the time of the run: a VM that grows its memory as it is touched reads low. The LLC
size (the largest cache level sysfs lists) sets how large host buffers must be to measure DRAM
rather than cache.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from slidedp.spec.cores import CPU_SYSFS, host_cores

_THP_SYSFS = Path("/sys/kernel/mm/transparent_hugepage")
_LLC_FALLBACK_BYTES = 256 * 2**20  # when sysfs says nothing: larger than any LLC of one socket


@dataclass(frozen=True)
class Machine:
    hostname: str
    date: str  # ISO date of the run
    cpu_model: str
    cores: int  # physical cores in the affinity mask
    cpus: int  # logical CPUs in the affinity mask
    ram_bytes: float
    llc_bytes: int
    gpu_model: str  # "" without CUDA
    gpu_count: int
    hbm_bytes: float  # per GPU; 0 without CUDA
    huge_pages: str = "THP enabled=unknown shmem_enabled=unknown"  # huge_pages()

    def gpus(self) -> str:
        return f"{self.gpu_count}x {self.gpu_model}" if self.gpu_count else "no CUDA GPU"

    def line(self) -> str:
        """"<host> (<cpu>, <cores> cores, <gpus>) <date>": a probe's machine line."""
        return f"{self.hostname} ({self.cpu_model}, {self.cores} cores, {self.gpus()}) {self.date}"

    def source(self, what: str) -> str:
        """"slidedp profile <date> on <host> (<cpu>, <gpus>): <what>"."""
        return f"slidedp profile {self.date} on {self.hostname} ({self.cpu_model}, {self.gpus()}): {what}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _size_bytes(text: str) -> int:
    text = text.strip()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
    return int(text.rstrip("KMGkmg")) * mult


def llc_bytes() -> int:
    """The largest cache sysfs lists for cpu0 (the last-level cache), else a safe upper guess."""
    sizes = []
    for f in (CPU_SYSFS / "cpu0" / "cache").glob("index*/size"):
        try:
            sizes.append(_size_bytes(f.read_text()))
        except (OSError, ValueError):
            continue
    return max(sizes, default=_LLC_FALLBACK_BYTES)


def huge_pages() -> str:
    """The kernel's transparent-huge-page modes for anonymous memory and for /dev/shm (the
    bracketed choice of each sysfs file), e.g. "THP enabled=madvise shmem_enabled=never"."""
    modes = []
    for what in ("enabled", "shmem_enabled"):
        try:
            text = (_THP_SYSFS / what).read_text()
            mode = text[text.index("[") + 1:text.index("]")]
        except (OSError, ValueError):
            mode = "unknown"
        modes.append(f"{what}={mode}")
    return "THP " + " ".join(modes)


def probe_machine() -> Machine:
    cpus = os.sched_getaffinity(0)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpu_model, gpu_count, hbm = "", 0, 0.0
    if torch.cuda.is_available():
        gpu_count = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        gpu_model, hbm = props.name, float(props.total_memory)
    return Machine(socket.gethostname(), datetime.date.today().isoformat(), _cpu_model(),
                   host_cores(), len(cpus), float(ram), llc_bytes(), gpu_model,
                   gpu_count, hbm, huge_pages())
