"""The plan's gradient layout: wire bytes, gradient chunks per update worker, host ring sizes.

The base rules, then each registered feature's (features/base.py, "plan-level rules"): a
downloaded gradient is FP32 (the GPU widens it), a unit's gradient chunks are D2H-chunk sized and
each (rank, update worker) host ring holds plan.d2h_staging_chunks of them.
"""

from __future__ import annotations

from collections import Counter

from slidedp.graph.features import FEATURES
from slidedp.graph.sizes import grad_chunks
from slidedp.spec.elements import FP32_BYTES
from slidedp.spec.plan import GradRoute, Plan, UpdateSharding
from slidedp.spec.units import MIB
from slidedp.spec.workload import Workload


def grad_wire_bytes(plan: Plan, ranks: int) -> int:
    """Bytes per element of a downloaded gradient chunk (D2H, the host rings): FP32, unless a
    feature narrows it."""
    wire = FP32_BYTES
    for f in FEATURES:
        if f.applies(plan):
            wire = f.grad_wire_bytes(plan, ranks, wire)
    return wire


def teams_chunk_bytes(plan: Plan, ranks: int) -> float | None:
    """The PCIe chunk size (bytes) at which the profile's teams by chunk size ran this plan's CPU
    tasks (HostSpec.teams_at): its upload chunk, where its ADAMs are the ones measured there (an
    FP32 gradient chunk as large as the upload chunk); None otherwise (the whole-buffer run)."""
    same = plan.d2h_chunk_mib == plan.h2d_chunk_mib and grad_wire_bytes(plan, ranks) == FP32_BYTES
    return plan.h2d_chunk_mib * MIB if same else None


def grad_align(wl: Workload, plan: Plan, unit: int) -> int:
    """Every gradient chunk boundary of `unit` is a multiple of this (1 unless a feature says)."""
    align = 1
    for f in FEATURES:
        if f.applies(plan):
            align = max(align, f.grad_align(wl, plan, unit))
    return align


def grad_plans(wl: Workload, plan: Plan) -> list[list[tuple[int, int, int]]]:
    """Per unit, its gradient chunks as (update worker, lo, hi): one ADAM each."""
    wire = grad_wire_bytes(plan, wl.gpus)
    return [grad_chunks(n, wl.gpus, plan, wire, grad_align(wl, plan, u))
            for u, n in enumerate(wl.model.unit_params())]


def grad_ring_sizes(wl: Workload, plan: Plan) -> dict[tuple[int, int], int]:
    """Slots of each (rank, update worker) host gradient ring, one gradient chunk each: the
    source rank's ring per worker (every rank's on the cpu route, whose HOST_SUM adds them),
    plan.d2h_staging_chunks slots unless a feature says otherwise."""
    R = wl.gpus
    scatter = plan.update_sharding == UpdateSharding.SHARDED and R > 1
    summed = plan.grad_route == GradRoute.CPU and R > 1
    per_worker = Counter(w for chunks in grad_plans(wl, plan) for w, _, _ in chunks)
    features = [f for f in FEATURES if f.applies(plan)]
    sizes = {}
    for w in range(plan.update_workers * (R if scatter else 1)):
        for r in range(R) if summed else [w // plan.update_workers if scatter else 0]:
            slots = plan.d2h_staging_chunks
            for f in features:
                slots = f.grad_ring_slots(plan, R, (r, w), slots, per_worker[w])
            sizes[(r, w)] = slots
    return sizes
