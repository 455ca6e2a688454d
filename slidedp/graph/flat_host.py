"""The flat hardware spec's machine (graph/kinds.py, "The machine"): one host, every GPU's PCIe
link joined under the host-side caps, one DRAM, one core pool, one GPU fabric.

Resources (capacity per second):
  gpu{r}.compute (seconds), gpu{r}.h2d, gpu{r}.d2h (bytes, the GPU's link per direction),
  gpu{r}.duplex (bytes, both directions), host.h2d, host.d2h, host.pcie (bytes, all GPUs: the
  host-side caps), host.dram (bytes; rates.dram_bps: what the graph's largest CPU team reaches,
  HostSpec.team_dram_bps: the CPU kernels, and the DMA too unless host.mem exists), host.mem
  (bytes, only with a measured HostSpec.memory_bps, at least host.dram's cap: all host-memory
  traffic, the DMA's and the CPU kernels'), host.cores (core-seconds), fabric (seconds).
Draws:
  GPU kinds     gpu{r}.compute: their seconds
  copies        their bytes on the GPU's link (its direction and duplex), the host-side cap of
                their direction and host.pcie, and host memory: host.mem where it exists (else
                host.dram). Beside host.mem the copies cost the CPU kernels: the simulator caps
                every CPU kernel beside copies of D bytes/s at S / (S + D) of its speed, S =
                HostSpec.dma_slowdown_bps, the profile's paired cost at the teams' cap that also
                holds far below it (a lone update beside a D2H stream: +32-36% at S = 125-140
                GB/s, +44% measured). The bound takes its linear part: as S / (S + D) <=
                1 - D / (S + D_max), D_max = min(host.mem, host.pcie), each DMA byte draws
                host.dram's cap / (S + D_max) of a byte of host.dram (the simulator leaves that
                draw out: its slowdown stands for it); a profile with the weight but not S has
                each DMA byte draw HostSpec.dram_dma_weight of a byte of host.dram, in both
  CPU kinds     their host-memory bytes on host.dram (and host.mem), their core-seconds on
                host.cores
  collectives   fabric: their seconds; on a `pcie` fabric also each GPU's PCIe links and, since
                peer traffic crosses the root complex, the host-side all-GPU cap host.pcie
"""

from __future__ import annotations

from slidedp.graph.kinds import Load, TaskLoad
from slidedp.graph.rates import dram_bps
from slidedp.graph.tasks import TaskGraph
from slidedp.spec.hardware import HardwareSpec


class FlatHost:
    """The flat hardware spec's resources and draws (module docstring); a Machine."""

    def __init__(self, hw: HardwareSpec, g: TaskGraph):
        R, p, h = g.n_ranks, hw.pcie, hw.host
        self.R = R
        self.names = [f"gpu{r}.{x}" for r in range(R) for x in ("compute", "h2d", "d2h", "duplex")]
        self.names += ["host.h2d", "host.d2h", "host.pcie", "host.dram", "host.cores", "fabric"]
        cap = {f"gpu{r}.compute": 1.0 for r in range(R)}
        for r in range(R):
            cap[f"gpu{r}.h2d"], cap[f"gpu{r}.d2h"] = p.h2d_bps, p.d2h_bps
            cap[f"gpu{r}.duplex"] = p.duplex_bps
        cap.update({"host.h2d": p.all_h2d_bps, "host.d2h": p.all_d2h_bps,
                    "host.pcie": p.all_total_bps, "host.dram": dram_bps(g, hw),
                    "host.cores": float(h.cores), "fabric": 1.0})
        memory_bps = h.memory_bps()
        self.has_mem = memory_bps is not None
        if self.has_mem:  # all traffic: never a tighter cap than the CPU kernels' alone
            self.names.append("host.mem")
            cap["host.mem"] = max(memory_bps, cap["host.dram"])
        self.capacity = cap
        self.dma = "host.mem" if self.has_mem else "host.dram"  # where the DMA draws
        slowdown = h.dma_slowdown_bps() if self.has_mem else None
        self.slowdowns = [(slowdown, "host.mem", "host.dram")] if slowdown else []
        self.dma_weight = h.dram_dma_weight if self.has_mem else 0.0
        if slowdown is not None:  # the slowdown's linear bound (module docstring)
            self.dma_weight = cap["host.dram"] / (slowdown + min(cap["host.mem"], cap["host.pcie"]))
        self.pcie_fabric = hw.fabric.kind == "pcie"

    @classmethod
    def of(cls, hw: HardwareSpec, g: TaskGraph) -> FlatHost:
        """Every hardware spec has the flat machine (the last factory of costs.MACHINES)."""
        return cls(hw, g)

    def draws(self, t: TaskLoad) -> list[tuple[str, float]]:
        if t.load is Load.GPU:
            return [(f"gpu{t.rank}.compute", t.seconds)]
        if t.load is Load.H2D or t.load is Load.D2H:
            d, w = t.load.value, t.work
            out = [(f"gpu{t.rank}.{d}", w), (f"gpu{t.rank}.duplex", w), (f"host.{d}", w),
                   ("host.pcie", w), (self.dma, w)]
            if self.dma_weight > 0:
                out.append(("host.dram", self.dma_weight * w))
            return out
        if t.load is Load.CPU:
            out = [("host.dram", t.dram_bytes)]
            if self.has_mem:
                out.append(("host.mem", t.dram_bytes))
            out.append(("host.cores", t.core_s))
            return out
        out = [("fabric", t.seconds)]
        if self.pcie_fabric:
            R = self.R
            per_gpu = t.work * (R - 1) / R
            for q in range(R):
                out += [(f"gpu{q}.h2d", per_gpu), (f"gpu{q}.d2h", per_gpu),
                        (f"gpu{q}.duplex", 2 * per_gpu)]
            out.append(("host.pcie", R * per_gpu))  # peer traffic crosses the root complex
        return out
