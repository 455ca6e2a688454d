"""Host rates against thread count: DRAM copy bandwidth, FP32 -> BF16 cast, CPU AdamW.

Each rate is measured at a torch intra-op thread count (torch.set_num_threads: the OpenMP pool
that copy_ and the fused Adam kernel run on) on buffers larger than the LLC (sizes.py):
  dram   dst.copy_(src), FP32 -> FP32: (bytes read + bytes written) / time, STREAM's "copy"
         convention (the write-allocate reads a cache does on its own are not counted)
  cast   dst_bf16.copy_(src_fp32): elements / time (the CAST task of the graph)
  adam   slidedp.exec.adamw.adamw_chunk, i.e. torch's fused CPU AdamW (what
         torch.optim.AdamW(fused=True) runs) on flat FP32 p, g, m, v: parameters / time (the
         gradient as the GPU widened it: plan.grad_widen = gpu)
  adam, BF16 gradient   the same with a BF16 gradient, widened block by block in cache by
         adamw_chunk (plan.grad_widen = host): parameters / time
  adam, bf16 / int8 moments   the update with compact moments (plan.moments; exec/moments.py:
         dequantize, fused AdamW, requantize, block by block) on the same master and FP32
         gradient, its m and v (and int8's absmax) in state memory: parameters / time
  teams  the executor's two CPU teams at once (HostBench.teams_bps): a cast team casting FP32 ->
         BF16 and an update team running the fused AdamW, each in its own thread with its own
         OpenMP team (interpreter.own_omp_team), both looping for the same wall time on buffers of
         their own: (6 B x cast elements + 28 B x Adam parameters) / time, the DRAM traffic the
         executor's default teams reach together (the model's host DRAM cap, HostSpec.team_dram_bps),
         and the cast's own part of it (how the two share it, HostSpec.cast_weight)
  teams by chunk  the same, each team's call one of the executor's tasks at a PCIe chunk size
         instead of a whole buffer (a CAST of the chunk's BF16 elements, an ADAM of the FP32
         gradient chunk's parameters, on successive slices of buffers holding at least two such
         tasks): the two teams as the executor's chunking makes them meet
         (HostSpec.dram_teams_chunk). Where the host buffers are smaller, the run makes its own:
         at 256 MiB chunks, 1.5 GiB for the cast and, below 512 MiB buffers, 2 GiB for AdamW
  teams + DMA   the same with every GPU copying both ways at once beside them (PCIe: pinned
         buffers, pcie.PcieBench.dma_loads): (the teams' bytes + the copies' bytes) / time, all the
         host-memory traffic of the executor's mix (HostSpec.memory_bps); and against the teams
         alone on the same buffers just before, what a copied byte costs the teams
         (run.dma_weight_sample, HostSpec.dram_dma_weight)
The cast is also measured by chunk size (CastChunkBench), as the executor runs the CAST task:
  cast chunk   staging[i % slots][:n].copy_(src[k n : (k + 1) n]) for a chunk of n elements
         (n = the chunk's BF16 bytes / 2, the PCIe chunk sizes of sizes.py), the source slice
         rotating through an FP32 buffer of at least two largest chunks and of the host buffer
         size (so each chunk is read from DRAM, as the executor reads its FP32 master), the
         destination a ring of `slots` chunk buffers (the plan's staging_chunks), page-locked
         with cudaHostRegister when CUDA is present (the executor's staging ring): elements /
         time per chunk, median of at least `repeats` chunks (more for small chunks, so every
         chunk size casts about as many elements as the largest) after `warmup`.
The FP32 arrays the executor keeps in its host state (the master, which the cast reads and Adam
updates, and Adam's m and v) are mapped from /dev/shm as the host state's are
(host_state.private_shared); the gradient (the executor's D2H staging) and the cast's BF16
destination (its upload staging) are the process's own memory, as in the executor. The kernel
may back the two kinds of memory with different page sizes (transparent huge pages: anonymous
memory under `enabled`, /dev/shm under `shmem_enabled`, each recorded in the profile's source
line), and a streaming kernel's rate in a VM depends on it.
Threads are not pinned: the OpenMP runtime places them (OMP_PROC_BIND / OMP_PLACES, if set in
the environment, apply), within the process's CPU affinity mask, as it does for the executor's
update workers. Buffers are first touched by the filling kernel's threads, so their pages spread
the way the kernels that later read them run; no NUMA binding is done.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from slidedp.exec.adamw import AdamWConfig, adamw_chunk
from slidedp.exec.host_state import cuda_host_register, cuda_host_unregister, private_shared
from slidedp.exec.interpreter import own_omp_team
from slidedp.exec.moments import STORED_DTYPE, MomentSpan, blocks
from slidedp.profile.machine import Machine
from slidedp.profile.timing import run_together, wall_median_s
from slidedp.spec.model import BF16, FP32

MIN_CHUNK_SLICES = 2  # a team's buffers in the run by chunk size hold at least this many tasks
ADAM_DRAM_BYTES_PER_PARAM = 28  # read p, m, v, g; write p, m, v (FP32)
CAST_DRAM_BYTES_PER_ELEM = 6  # read FP32, write BF16


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class HostBench:
    """FP32 buffers of `nbytes` each (src, dst, Adam's m and v) and a BF16 one, allocated once;
    each timed sample of a rate repeats its kernel for at least `sample_s`."""

    def __init__(self, nbytes: int, warmup: int, repeats: int, sample_s: float = 0.0,
                 state_memory: Callable[[int, torch.dtype], torch.Tensor] = private_shared):
        """`state_memory(numel, dtype)`: where the master, m and v live (module docstring;
        benchmarks/probes/memory_kind_probe.py compares it with the process's own memory)."""
        self.elems = nbytes // FP32
        self.state_memory = state_memory
        self.nbytes = self.elems * FP32
        self.warmup, self.repeats, self.sample_s = warmup, repeats, sample_s
        # filled by torch's parallel kernels (a random fill is single-threaded and slow); the
        # rates do not depend on the values, which stay finite and normal throughout
        self.src = state_memory(self.elems, torch.float32).fill_(0.5)  # the master
        self.dst = torch.full((self.elems,), 1e-3)  # also Adam's FP32 gradient
        self.bf16 = torch.zeros(self.elems, dtype=torch.bfloat16)
        self.grad_bf16 = torch.full((self.elems,), 1e-3, dtype=torch.bfloat16)
        self.m = state_memory(self.elems, torch.float32).zero_()
        self.v = state_memory(self.elems, torch.float32).zero_()
        self.opt = AdamWConfig()
        self.adam_steps = 0
        self.cast_src: torch.Tensor | None = None  # the teams run's cast source, made on first use
        self._compact: dict[str, MomentSpan] = {}  # compact moments by format, made on first use
        # the run by chunk size's buffers per team, where the bench's hold too few chunks
        self._chunked: dict[str, tuple[torch.Tensor, ...]] = {}

    def _median_s(self, fn, threads: int) -> float:
        with torch_threads(threads):
            return wall_median_s(fn, self.warmup, self.repeats, min_s=self.sample_s)

    def dram_bps(self, threads: int) -> float:
        return 2 * self.nbytes / self._median_s(lambda: self.dst.copy_(self.src), threads)

    def cast_elems_per_s(self, threads: int) -> float:
        return self.elems / self._median_s(lambda: self.bf16.copy_(self.src), threads)

    def _adam_step(self, bf16_grad: bool = False) -> None:
        # the parameter is `src` (the dram / cast runs only read it, so updating it is harmless)
        self._adam_slice((self.src, self.grad_bf16 if bf16_grad else self.dst, self.m, self.v),
                         slice(None))

    def adam_params_per_s(self, threads: int, bf16_grad: bool = False) -> float:
        return self.elems / self._median_s(lambda: self._adam_step(bf16_grad), threads)

    def adam_moments_params_per_s(self, threads: int, fmt: str) -> float:
        """Parameters/s of the update with `fmt` (bf16, int8) moments (module docstring)."""
        span = self._compact.get(fmt)
        if span is None:
            m, v = (self.state_memory(self.elems, STORED_DTYPE[fmt]).zero_() for _ in range(2))
            absmax = [self.state_memory(blocks(self.elems), torch.float32).zero_()
                      for _ in range(2)] if fmt == "int8" else [None, None]
            span = self._compact[fmt] = MomentSpan(fmt, m, v, *absmax)

        def step() -> None:
            self.adam_steps += 1
            span.adamw(self.src, self.dst, self.adam_steps, self.opt, self.opt.lr)
        return self.elems / self._median_s(step, threads)

    def teams_bps(self, cast_threads: int, update_threads: int, seconds: float,
                  dma: Sequence[tuple[Callable[[], None], float]] = (),
                  chunk_bytes: int | None = None) -> tuple[float, float, float]:
        """DRAM bytes/s of a cast team and an update team running at once (module docstring),
        with `dma` loads beside them (each a call and the host-memory bytes one call moves, run
        in a thread of its own: every GPU's copies, PcieBench.dma_loads): one warm-up call each,
        then all loop from a common start for `seconds`. With `chunk_bytes` (a PCIe chunk), each
        call of a team is one of the executor's tasks at that chunk size instead of a whole
        buffer: a CAST of chunk_bytes / 2 elements (the BF16 chunk it stages), an ADAM of
        chunk_bytes / 4 parameters (the FP32 gradient chunk one D2H brings where the GPU widens
        the gradient), each on the next slice of its buffers in turn, its buffers holding at least
        MIN_CHUNK_SLICES such slices (_chunk_buffers). Returns (the bytes all moved, the bytes the
        cast team moved, the bytes both teams moved), each over the time from the first start to
        the last end. A load that raises stops the others at the start barrier (or lets them
        finish) and the run raises RuntimeError from its error."""
        if self.cast_src is None:  # the cast's own master: Adam writes `src`
            self.cast_src = self.state_memory(self.elems, torch.float32).fill_(0.25)
        if chunk_bytes is None:
            cast_src = self.cast_src
            cast, cast_elems = (lambda: self.bf16.copy_(cast_src)), self.elems
            adam, adam_params = self._adam_step, self.elems
        else:
            cast, cast_elems = self._sliced("cast", chunk_bytes // BF16, self._cast_slice)
            adam, adam_params = self._sliced("adam", chunk_bytes // FP32, self._adam_slice)
        loads = [(cast_threads, cast, cast_elems * CAST_DRAM_BYTES_PER_ELEM),
                 (update_threads, adam, adam_params * ADAM_DRAM_BYTES_PER_PARAM),
                 *((0, fn, nbytes) for fn, nbytes in dma)]
        moved = [0.0] * len(loads)
        spans = [(0.0, 0.0)] * len(loads)

        def body(i: int, threads: int, fn, nbytes: float) -> Callable[[Callable[[], None]], None]:
            def loop(start: Callable[[], None]) -> None:
                if threads:
                    own_omp_team(threads)
                fn()  # warm-up
                start()
                t0 = time.perf_counter()
                while True:
                    fn()
                    moved[i] += nbytes
                    if (t1 := time.perf_counter()) - t0 >= seconds:
                        break
                spans[i] = (t0, t1)
            return loop

        run_together([body(i, *x) for i, x in enumerate(loads)],
                     "a load of the teams-at-once run")
        span_s = max(e for _, e in spans) - min(s for s, _ in spans)
        return sum(moved) / span_s, moved[0] / span_s, (moved[0] + moved[1]) / span_s

    def _sliced(self, team: str, n: int, kernel: Callable[[tuple[torch.Tensor, ...], slice], None]
                ) -> tuple[Callable[[], None], int]:
        """A call running `kernel` on `team`'s chunk buffers, on the next of their slices of `n`
        elements in turn, and n."""
        bufs = self._chunk_buffers(team, MIN_CHUNK_SLICES * n)
        slices, calls = bufs[0].numel() // n, 0

        def call() -> None:
            nonlocal calls
            k = calls % slices
            calls += 1
            kernel(bufs, slice(k * n, (k + 1) * n))
        return call, n

    def _chunk_buffers(self, team: str, numel: int) -> tuple[torch.Tensor, ...]:
        """The run by chunk size's buffers of `team`, of at least `numel` elements each ("cast":
        the FP32 source, the BF16 destination; "adam": p, g, m, v): the bench's own where they
        are large enough, else made once and kept (larger ones replace them), the FP32 master and
        Adam's moments in the host state's memory as the bench's."""
        have = self._chunked.get(team)
        if have is not None and have[0].numel() >= numel:
            return have
        self._chunked.pop(team, None)  # free a smaller set first
        if numel <= self.elems:
            bufs = ((self.cast_src, self.bf16) if team == "cast"
                    else (self.src, self.dst, self.m, self.v))
        elif team == "cast":
            bufs = (self.state_memory(numel, torch.float32).fill_(0.25),
                    torch.zeros(numel, dtype=torch.bfloat16))
        else:
            bufs = (self.state_memory(numel, torch.float32).fill_(0.5),
                    torch.full((numel,), 1e-3),
                    self.state_memory(numel, torch.float32).zero_(),
                    self.state_memory(numel, torch.float32).zero_())
        self._chunked[team] = bufs
        return bufs

    @staticmethod
    def _cast_slice(bufs: tuple[torch.Tensor, ...], s: slice) -> None:
        src, dst = bufs
        dst[s].copy_(src[s])

    def _adam_slice(self, bufs: tuple[torch.Tensor, ...], s: slice) -> None:
        p, g, m, v = bufs
        self.adam_steps += 1
        adamw_chunk(p[s], g[s], m[s], v[s], self.adam_steps, self.opt, self.opt.lr)


def quick_bench(m: Machine, nbytes: int | None = None,
                state_memory: Callable[[int, torch.dtype], torch.Tensor] = private_shared,
                warm_threads: int | None = None) -> HostBench:
    """A HostBench as the quick profile samples the host of machine `m` (sizes.QUICK: its buffer
    size there unless `nbytes`, its warm-up and minimum sample time, one sample per call): for
    the checks and probes that set their readings against a quick profile's. With
    `warm_threads`, AdamW and the cast run once at that thread count first (the first pass also
    faults the pages in) and the samples after it take no warm-up of their own."""
    from slidedp.profile.sizes import QUICK

    if nbytes is None:
        nbytes = QUICK.host_bytes(m.llc_bytes, m.ram_bytes)
    bench = HostBench(nbytes, QUICK.warmup, 1, QUICK.host_sample_s, state_memory)
    if warm_threads is not None:
        bench.adam_params_per_s(warm_threads)
        bench.cast_elems_per_s(warm_threads)
        bench.warmup = 0
    return bench


MAX_CHUNK_REPEATS = 64


class CastChunkBench:
    """FP32 -> BF16 casts of chunks of `chunk_elems` elements into a (pinned) ring of chunk buffers.

    The FP32 source holds max(`src_bytes`, two largest chunks); the BF16 ring `slots` largest
    chunks, page-locked with cudaHostRegister when `pin` (close() unregisters it).
    """

    def __init__(self, chunk_elems: list[int], src_bytes: int, slots: int, pin: bool,
                 warmup: int, repeats: int):
        self.chunk_elems = sorted(chunk_elems)
        big = self.chunk_elems[-1]
        self.src_elems = max(src_bytes // FP32, 2 * big)
        self.slots, self.warmup, self.repeats = slots, warmup, repeats
        self.src = private_shared(self.src_elems, torch.float32).fill_(0.5)  # the master
        self.ring = torch.zeros(slots * big, dtype=torch.bfloat16)  # faults the pages in
        self.pinned = False
        if pin:
            cuda_host_register(self.ring)
            self.pinned = True
        self.casts = 0

    def repeats_for(self, n: int) -> int:
        """Timed chunks at size n: at least `repeats`, and about the largest chunk's elements."""
        return max(self.repeats, min(MAX_CHUNK_REPEATS, self.chunk_elems[-1] // n))

    def elems_per_s(self, n: int, threads: int) -> float:
        ring = self.ring[:self.slots * n].view(self.slots, n)
        slices = self.src_elems // n

        def cast():
            i = self.casts
            self.casts += 1
            ring[i % self.slots].copy_(self.src[(i % slices) * n:(i % slices + 1) * n])

        with torch_threads(threads):
            return n / wall_median_s(cast, self.warmup, self.repeats_for(n))

    def close(self) -> None:
        if self.pinned:
            cuda_host_unregister(self.ring)
            self.pinned = False
