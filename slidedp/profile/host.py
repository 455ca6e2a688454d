"""Host rates against thread count: DRAM copy bandwidth, FP32 -> BF16 cast, CPU AdamW.

Each rate is measured at a torch intra-op thread count (torch.set_num_threads: the OpenMP pool
that copy_ and the fused Adam kernel run on) on buffers larger than the LLC (sizes.py):
  dram   dst.copy_(src), FP32 -> FP32: (bytes read + bytes written) / time, STREAM's "copy"
         convention (the write-allocate reads a cache does on its own are not counted)
  cast   dst_bf16.copy_(src_fp32): elements / time (the CAST task of the graph)
  adam   slidedp.exec.adamw.adamw_chunk, i.e. torch's fused CPU AdamW (what
         torch.optim.AdamW(fused=True) runs) on flat FP32 p, g, m, v: parameters / time. The
         gradient is FP32 as the executor hands it to Adam (it widens a BF16 gradient into an
         FP32 scratch first: that copy is not part of this rate).
Threads are not pinned: the OpenMP runtime places them (OMP_PROC_BIND / OMP_PLACES, if set in
the environment, apply), within the process's CPU affinity mask, as it does for the executor's
update workers. Buffers are first touched by the filling kernel's threads, so their pages spread
the way the kernels that later read them run; no NUMA binding is done.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from slidedp.exec.adamw import AdamWConfig, adamw_chunk
from slidedp.profile.timing import wall_median_s

FP32 = 4


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class HostBench:
    """FP32 buffers of `nbytes` each (src, dst, Adam's m and v) and a BF16 one, allocated once."""

    def __init__(self, nbytes: int, warmup: int, repeats: int):
        self.elems = nbytes // FP32
        self.nbytes = self.elems * FP32
        self.warmup, self.repeats = warmup, repeats
        # filled by torch's parallel kernels (a random fill is single-threaded and slow); the
        # rates do not depend on the values, which stay finite and normal throughout
        self.src = torch.full((self.elems,), 0.5)
        self.dst = torch.full((self.elems,), 1e-3)  # also Adam's gradient
        self.bf16 = torch.zeros(self.elems, dtype=torch.bfloat16)
        self.m, self.v = torch.zeros(self.elems), torch.zeros(self.elems)
        self.opt = AdamWConfig()
        self.adam_steps = 0

    def _median_s(self, fn, threads: int) -> float:
        with torch_threads(threads):
            return wall_median_s(fn, self.warmup, self.repeats)

    def dram_bps(self, threads: int) -> float:
        return 2 * self.nbytes / self._median_s(lambda: self.dst.copy_(self.src), threads)

    def cast_elems_per_s(self, threads: int) -> float:
        return self.elems / self._median_s(lambda: self.bf16.copy_(self.src), threads)

    def adam_params_per_s(self, threads: int) -> float:
        def step():
            self.adam_steps += 1
            # the parameter is `src` (the dram / cast runs only read it, so updating it is harmless)
            adamw_chunk(self.src, self.dst, self.m, self.v, self.adam_steps, self.opt, self.opt.lr)

        return self.elems / self._median_s(step, threads)
