"""Traffic per layer and per step: the closed forms of method.md section 3, and the graph's sums.

For a unit of P parameters, R ranks, q = 2 bytes per parameter on the wire, G = 2P gradient bytes
on the GPU (BF16: what REDUCE moves) and G' = wP gradient bytes on the wire back, w =
graph.layout.grad_wire_bytes (2: BF16, widened by the CPU update in cache; 4: widened to FP32 on
the GPU, and always on the cpu route with R > 1), per delivery (forward, and
again in backward unless the layer is still in the window):
    H2D        replicated R * q * P        sharded q * P        (+ ALLGATHER of q * P on the GPUs)
    D2H        gpu route  G'               cpu route R * G'     (+ REDUCE of G on the GPUs, gpu route)
The two tests agree: the graph's per-kind sums equal these formulas for every route combination.
"""

from __future__ import annotations

from slidedp.graph.kinds import MOVING_KINDS
from slidedp.graph.layout import grad_wire_bytes
from slidedp.graph.tasks import Kind, TaskGraph
from slidedp.spec.elements import GRAD_BYTES, PARAM_BYTES
from slidedp.spec.plan import GradRoute, ParamRoute, Plan

# per kind that moves bytes between devices (copies and collectives), its bytes under its name
TRAFFIC_KINDS = {k.name.lower(): k for k in MOVING_KINDS}


def layer_traffic_bytes(params: int, ranks: int, plan: Plan) -> dict[str, float]:
    """Bytes moved for one delivery and one gradient return of a unit of `params` parameters."""
    sharded = plan.param_route == ParamRoute.SHARDED and ranks > 1
    gpu_reduce = plan.grad_route == GradRoute.GPU
    q, g, g_wire = PARAM_BYTES * params, GRAD_BYTES * params, grad_wire_bytes(plan, ranks) * params
    return {
        "h2d": q if sharded else ranks * q,
        "allgather": q if sharded else 0.0,
        "d2h": g_wire if (gpu_reduce or ranks == 1) else ranks * g_wire,
        "reduce": g if (gpu_reduce and ranks > 1) else 0.0,
    }


def graph_traffic_bytes(g: TaskGraph, iteration: int, unit: int | None = None) -> dict[str, float]:
    """Bytes per kind of one iteration (optionally of one unit), summed from the graph."""
    mask = g.iteration == iteration
    if unit is not None:
        mask &= g.unit == unit
    return {name: float(g.work[mask & (g.kind == int(k))].sum()) for name, k in TRAFFIC_KINDS.items()}


def deliveries_per_iteration(g: TaskGraph, iteration: int, unit: int) -> int:
    """How many times a unit is uploaded in one iteration (1 or 2)."""
    m = (g.iteration == iteration) & (g.unit == unit) & (g.kind == int(Kind.H2D)) & ~g.rows
    return int((m & (g.rank == 0) & (g.chunk == 0)).sum())
