"""One rank process's measurement of a configuration (the executor, random weights, torch).

random_host_state() builds the one host state of a model once (random weights, filled in
seconds); measure() then runs `iters` real optimizer steps of slidedp.exec.Engine on it and
returns the steady step time (mean of the steps after `discard`), the last step's per-channel
busy seconds and measured Timeline, the GPU peak and the host PSS. With R > 1 ranks (a
DistSession), every rank calls measure() and rank 0 receives the merged figures: the Timelines of
all ranks on rank 0's clock (one CLOCK_MONOTONIC per host: a record's time + that rank's
origin_s - rank 0's), channel seconds recomputed over the merged Timeline (union over ranks, as
the simulator counts them), the GPU peak as the maximum over ranks, PSS summed over ranks (shared
memory counted once in the sum). Used by the validate worker, AutoPolicy's executor probe, the
profile's agent timings and benchmarks/multi_gpu.py.

Several measurements share one process (a sweep, AutoPolicy's probes): measure() drops its Engine
(which holds no reference cycle: freed at once) and returns the CUDA cache before it returns, and
resets the peak before the next Engine is built, so that each GPU peak is that configuration's
alone and no finished engine's buffers are still held when the next one allocates (otherwise,
on nvidia-h200, one plan's peak read 28.5 GiB first in a process and 50.6 GiB after four other
plans, with each finished engine left to a later collection).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from slidedp.exec.adamw import AdamWConfig
from slidedp.exec.dist.session import DistSession
from slidedp.exec.engine import Engine, channel_busy_s
from slidedp.exec.host_state import HostState
from slidedp.exec.io import RandomInit, hf_config, meta_layout
from slidedp.exec.metrics import host_pss_bytes
from slidedp.graph.timeline import Timeline
from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload

OPTIMIZER = AdamWConfig(lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0)
BLOCK_ELEMS = 2**26


@dataclass
class Measurement:
    step_time_s: float  # mean of the steps after `discard`
    all_steps_s: list[float]
    channel_s: dict[str, float]  # last step, union over the ranks' tasks
    gpu_peak_bytes: int | None  # max over ranks of torch.cuda.max_memory_reserved; None on CPU
    host_pss_bytes: int | None  # summed over ranks
    loss_last: float
    timeline: Timeline | None  # last step, every rank, rank 0's clock (None on ranks > 0)
    loss_first: float = float("nan")


def fill_random(init: RandomInit, layout, state: HostState) -> None:
    """Random weights in seconds instead of minutes: every 'normal' tensor is filled from one
    pre-drawn N(0, std) block (wrapping around), norms with ones, as RandomInit's rules say.
    The values are not HF's exact init; for timing, they need only be real, non-zero numbers.
    The Adam moments are written with zeros too: the state's files are sparse, and a first step
    that faults in 8 B/param of fresh pages (30 s for Qwen3-8B on the H200 hosts, and slower
    steps after it) would otherwise land in the first measured case."""
    g = torch.Generator().manual_seed(0)
    block = torch.empty(BLOCK_ELEMS).normal_(0.0, init.std, generator=g)
    pos = 0
    for u, ul in enumerate(layout):
        if not state.owns_storage(u):  # its memory is an earlier unit's, filled already
            continue
        flat = state.unit_master(u)
        for e in ul.entries:
            view = flat[e.offset:e.offset + e.numel]
            if init.rules[e.name] != "normal":
                view.fill_(1.0 if init.rules[e.name] == "ones" else 0.0)
                continue
            done = 0
            while done < e.numel:
                n = min(e.numel - done, BLOCK_ELEMS - pos)
                view[done:done + n].copy_(block[pos:pos + n])
                done += n
                pos = (pos + n) % BLOCK_ELEMS
        state.unit_m(u).zero_()
        state.unit_v(u).zero_()
        if state.copy is not None:
            state.unit_copy(u).copy_(flat)


def random_host_state(model_config: dict, copy_dtype: torch.dtype | None,
                      session: DistSession | None, distinct_layers: int | None = None,
                      moments: str = "fp32") -> HostState:
    """The one host state of the model, random weights, its Adam moments in the `moments`
    format (plan.moments) (collective with a session). With
    `distinct_layers` = k (a timing probe's state, one process only), decoder layer i lives in
    the memory of layer i mod k (layers_sharing_memory): the same work per layer on k layers'
    memory."""
    model, layout = meta_layout(hf_config(model_config))
    numels = [u.numel for u in layout]
    init = RandomInit(model, layout, seed=0)
    if session is not None:
        if distinct_layers is not None:
            raise ValueError("distinct_layers: a probe's state, for one process without a session")
        return session.host_state(numels, copy_dtype, init=lambda s: fill_random(init, layout, s),
                                  moments=moments)
    storage_of = None if distinct_layers is None else layers_sharing_memory(numels, distinct_layers)
    hs = HostState.create(numels, copy_dtype, storage_of=storage_of, moments=moments)
    try:
        fill_random(init, layout, hs)
    except BaseException:  # a failed fill releases the state's memory at once
        hs.close()
        raise
    return hs


def layers_sharing_memory(unit_numels: list[int], distinct_layers: int) -> list[int]:
    """HostState's `storage_of` for units 0 (embedding), 1..L (decoder layers), L + 1 (head):
    decoder layer i (unit i + 1) in the memory of layer i mod `distinct_layers` where the two are
    of one size; the embedding and the head keep their own."""
    if distinct_layers < 1:
        raise ValueError(f"distinct_layers: expected at least 1, got {distinct_layers}")
    storage_of = list(range(len(unit_numels)))
    for u in range(1, len(unit_numels) - 1):
        s = 1 + (u - 1) % distinct_layers
        if unit_numels[s] == unit_numels[u]:
            storage_of[u] = s
    return storage_of


def measure(model_config: dict, wl: Workload, plan: Plan, hs: HostState, *, device: str,
            iters: int, discard: int, session: DistSession | None = None) -> Measurement:
    """Run `iters` steps of one configuration on the host state (module docstring)."""
    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    eng = Engine(model_config, wl, plan, device=device,
                 dtype=torch.bfloat16 if cuda else torch.float32, optimizer=OPTIMIZER,
                 host_state=hs, **({"session": session} if session else {}))
    data = torch.randint(0, wl.model.vocab_size, (wl.global_batch, wl.seq_len),
                         generator=torch.Generator().manual_seed(0))
    try:
        with eng:
            first = last = eng.step(data)
            times = [first.step_time_s]
            for _ in range(iters - 1):
                last = eng.step(data)
                times.append(last.step_time_s)
            pss = host_pss_bytes()  # with the engine's pinned buffers still held
    finally:
        del eng  # its GPU buffers go now, before the CUDA cache is returned below
    steady = times[discard:]
    mine = (last.origin_s, last.timeline.records, last.gpu_peak_bytes, pss)
    parts = [mine]
    if session is not None:
        parts = [None] * session.world_size if session.rank == 0 else None
        dist.gather_object(mine, parts, dst=0, group=session.ctl)
    if cuda:
        torch.cuda.empty_cache()
    if parts is None:
        return Measurement(sum(steady) / len(steady), times, {}, None, None, last.loss, None,
                           first.loss)
    origin0 = parts[0][0]
    merged = Timeline(source=last.timeline.source + f", {len(parts)} rank(s)")
    for origin, records, _, _ in parts:
        for r in records:
            merged.add(r.shifted(origin - origin0))
    peaks = [p[2] for p in parts if p[2] is not None]
    pss = [p[3] for p in parts if p[3] is not None]
    return Measurement(
        step_time_s=sum(steady) / len(steady), all_steps_s=times,
        channel_s=channel_busy_s(merged), gpu_peak_bytes=max(peaks) if peaks else None,
        host_pss_bytes=sum(pss) if len(pss) == len(parts) else None, loss_last=last.loss,
        timeline=merged, loss_first=first.loss)
