"""Host <-> GPU copy rates over PCIe (CUDA only): by chunk size alone, duplex, all GPUs at once.

Host buffers are page-locked the way the executor pins its rings (an exact-size cudaHostRegister,
slidedp.exec.host_state), one source and one destination of the largest chunk per GPU; copies are
`copy_(non_blocking=True)` of uint8 tensors on a dedicated stream per GPU and direction.
  alone    one copy of `chunk` bytes on one GPU, nothing else running: bytes / (CUDA-event time
           around the copy on its stream)
  duplex   one GPU, `copies` back-to-back largest-chunk copies H2D and D2H at once on two
           streams: bytes of both directions / wall time (synchronized before and after)
  all      every GPU at once, one host thread per GPU started together (a barrier), the same
           back-to-back copies in the given direction(s): bytes of all GPUs / (last finish -
           first start)
  loads    the duplex copies of each GPU as a call that waits for them (dma_loads), for the
           host's teams-at-once run (host.HostBench.teams_bps)
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from slidedp.exec.host_state import cuda_host_register, cuda_host_unregister
from slidedp.profile.timing import cuda_median_s, median_s, run_together, wall_median_s

DIRECTIONS = ("h2d", "d2h")


class _Gpu:
    """One GPU's pinned host buffers, device buffers and one stream per direction."""

    def __init__(self, index: int, nbytes: int):
        self.index = index
        self.dev = torch.device("cuda", index)
        self.host_src = torch.empty(nbytes, dtype=torch.uint8)
        self.host_dst = torch.empty(nbytes, dtype=torch.uint8)
        for t in (self.host_src, self.host_dst):
            t.fill_(1)  # fault the pages in before they are registered
            cuda_host_register(t)
        self.dev_src = torch.ones(nbytes, dtype=torch.uint8, device=self.dev)
        self.dev_dst = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
        self.streams = {d: torch.cuda.Stream(self.dev) for d in DIRECTIONS}

    def copy(self, direction: str, nbytes: int) -> None:
        """Enqueue one copy on the current stream."""
        if direction == "h2d":
            self.dev_dst[:nbytes].copy_(self.host_src[:nbytes], non_blocking=True)
        else:
            self.host_dst[:nbytes].copy_(self.dev_src[:nbytes], non_blocking=True)

    def stream_copies(self, directions: tuple[str, ...], nbytes: int, copies: int) -> None:
        for d in directions:
            with torch.cuda.stream(self.streams[d]):
                for _ in range(copies):
                    self.copy(d, nbytes)

    def close(self) -> None:
        torch.cuda.synchronize(self.dev)
        for t in (self.host_src, self.host_dst):
            cuda_host_unregister(t)


class PcieBench:
    def __init__(self, gpus: int, largest_chunk_bytes: int, copies: int, warmup: int,
                 repeats: int):
        self.chunk_bytes = largest_chunk_bytes
        self.copies, self.warmup, self.repeats = copies, warmup, repeats
        self.gpus = [_Gpu(i, largest_chunk_bytes) for i in range(gpus)]

    def alone_bps(self, gpu: int, direction: str, nbytes: int) -> float:
        g = self.gpus[gpu]
        with torch.cuda.device(g.dev), torch.cuda.stream(g.streams[direction]):
            return nbytes / cuda_median_s(lambda: g.copy(direction, nbytes), self.warmup,
                                          self.repeats)

    def duplex_bps(self, gpu: int) -> float:
        g = self.gpus[gpu]
        t = wall_median_s(lambda: g.stream_copies(DIRECTIONS, self.chunk_bytes, self.copies),
                          self.warmup, self.repeats, lambda: torch.cuda.synchronize(g.dev))
        return len(DIRECTIONS) * self.copies * self.chunk_bytes / t

    def all_gpus_bps(self, directions: tuple[str, ...]) -> float:
        nbytes = len(self.gpus) * len(directions) * self.copies * self.chunk_bytes
        return nbytes / median_s(lambda: self._all_at_once_s(directions), self.warmup,
                                 self.repeats)

    def _all_at_once_s(self, directions: tuple[str, ...]) -> float:
        spans: list[tuple[float, float]] = [(0.0, 0.0)] * len(self.gpus)

        def body(i: int, g: _Gpu) -> Callable[[Callable[[], None]], None]:
            def copies(start: Callable[[], None]) -> None:
                torch.cuda.set_device(g.dev)
                torch.cuda.synchronize(g.dev)
                start()
                t0 = time.perf_counter()
                g.stream_copies(directions, self.chunk_bytes, self.copies)
                torch.cuda.synchronize(g.dev)
                spans[i] = (t0, time.perf_counter())
            return copies

        run_together([body(i, g) for i, g in enumerate(self.gpus)],
                     "a copy thread of the all-GPU PCIe run")
        return max(e for _, e in spans) - min(s for s, _ in spans)

    def dma_loads(self) -> list[tuple[Callable[[], None], float]]:
        """Per GPU, a call that runs its duplex copies and waits for them, and the host-memory
        bytes it moves."""
        def duplex(g: _Gpu) -> None:
            with torch.cuda.device(g.dev):
                g.stream_copies(DIRECTIONS, self.chunk_bytes, self.copies)
                torch.cuda.synchronize(g.dev)

        nbytes = len(DIRECTIONS) * self.copies * self.chunk_bytes
        return [(lambda g=g: duplex(g), float(nbytes)) for g in self.gpus]

    def close(self) -> None:
        for g in self.gpus:
            g.close()
