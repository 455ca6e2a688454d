"""The host's cores, counted one way for every layer: the physical cores of the CPUs this process
may run on (its affinity mask; SMT siblings count once), since a CPU-bound kernel gains nothing
from a core's second thread. The profile writes this count into the hardware file (host.cores),
which the model and the simulator read, and the executor builds its task graph on it: on the
machine that was profiled, the graph it runs is the graph that was predicted."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

CPU_SYSFS = Path("/sys/devices/system/cpu")


def physical_cores(cpus: Iterable[int]) -> int:
    """How many distinct (package, core) pairs the logical CPUs `cpus` belong to, as sysfs's
    topology gives them; the count of `cpus` where sysfs does not say."""
    cpus = list(cpus)
    cores = set()
    for c in cpus:
        topo = CPU_SYSFS / f"cpu{c}" / "topology"
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(),
                       (topo / "core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return len(cores)


def host_cores() -> int:
    """The physical cores in this process's affinity mask (module docstring)."""
    return physical_cores(os.sched_getaffinity(0))
