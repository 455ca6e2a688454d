"""Build the task graph of `iterations` consecutive training steps from (workload, plan, cores).

The Builder emits the method's base schedule, per iteration and rank: deliveries (CAST -> H2D
-> ALLGATHER), EMBED_FWD, FWD 1..L, HEAD_LOSS, RECOMPUTE / BWD L..1, EMBED_BWD, each unit's
gradient path (REDUCE -> D2H -> HOST_SUM -> ADAM) once every rank's backward of it is done, the
version gates from each ADAM to the next iteration's delivery of its parameters, and the step
join. Plan features (slidedp/graph/features/) add their tasks and edges at the hook points that
features/base.py lists. docs/graph.md describes the schedule, its edges and its buffers.
"""

from __future__ import annotations

from slidedp.graph.features import FEATURES
from slidedp.graph.layout import grad_plans, grad_ring_sizes, grad_wire_bytes, teams_chunk_bytes
from slidedp.graph.recorder import GradChunk, GradPath, Recorder, Ring
from slidedp.graph.sizes import (
    chunk_ranges,
    host_sum_bytes_per_elem,
    shard_ranges,
    team_share,
)
from slidedp.graph.tasks import COLLECTIVE_OPS, EdgeKind, GraphMeta, Kind, TaskGraph
from slidedp.spec.elements import GRAD_BYTES, PARAM_BYTES
from slidedp.spec.plan import GradRoute, ParamRoute, Plan, UpdateSharding
from slidedp.spec.segments import policy_cost
from slidedp.spec.units import MIB
from slidedp.spec.workload import Workload

__all__ = ["Builder", "build_graph"]

DATA, BUFFER = EdgeKind.DATA, EdgeKind.BUFFER
_OP = {name: i for i, name in enumerate(COLLECTIVE_OPS)}


class Step:
    """One iteration's tasks so far, per rank (lists indexed [rank][layer] where per layer)."""

    def __init__(self, R: int, L: int):
        self.last = [-1] * R  # the rank's latest compute task
        self.fwd = [[-1] * (L + 2) for _ in range(R)]
        self.bwd = [[-1] * (L + 2) for _ in range(R)]
        self.emb_fwd: list[int] = []
        self.head: list[int] = []
        self.emb_bwd: list[int] = []
        self.new_adam: dict[int, list[tuple[int, int, int]]] = {}  # unit -> [(ADAM, lo, hi)]


class Builder:
    """The base schedule's state and its steps; features read and extend it (features/base.py).

    State beyond the recorder: the staging ring and the gradient rings, `readers` (the last
    readers of each GPU buffer: ("slot", s, r), ("embed", r), ("head", r), ("grad", g, r)),
    `gates` (the previous iteration's ADAMs per unit: the version gates) and `step`.
    """

    def __init__(self, wl: Workload, plan: Plan, cores: int, iterations: int,
                 first_delivery: bool, update_pending: bool = False):
        m = wl.model
        self.wl, self.plan, self.m = wl, plan, m
        self.R, self.L = R, L = wl.gpus, m.n_layers
        self.iterations, self.first_delivery, self.cores = iterations, first_delivery, cores
        self.update_pending = update_pending
        self.units = m.unit_params()
        self.head_u = L + 1
        self.tokens = wl.tokens_per_gpu_step
        self.cast_threads, self.update_threads = plan.threads(cores)
        self.sharded = plan.param_route == ParamRoute.SHARDED and R > 1
        self.scatter = plan.update_sharding == UpdateSharding.SHARDED and R > 1
        self.n_workers = plan.update_workers * (R if self.scatter else 1)
        self.worker_threads = self.update_threads / self.n_workers
        self.h2d_chunk = max(1, int(plan.h2d_chunk_mib * MIB) // PARAM_BYTES)
        self.wire = grad_wire_bytes(plan, R)
        self.W = plan.window_slots
        self.lf = m.layer_flops_per_token(wl.seq_len)
        self.hf = m.head_flops_per_token()
        plan.check_layers(L)
        self.layer_costs = [None] + [policy_cost(m, plan.policy_of(layer), wl.seq_len)
                                     for layer in range(1, L + 1)]
        self.recompute = [False] + [c.recomputes for c in self.layer_costs[1:]]
        rec = self.rec = Recorder()
        self.compute = [rec.agent(f"gpu{r}.compute") for r in range(R)]
        self.h2d = [rec.agent(f"gpu{r}.h2d") for r in range(R)]
        self.d2h = [rec.agent(f"gpu{r}.d2h") for r in range(R)]
        self.fabric = rec.agent("fabric") if R > 1 else -1
        self.cast = rec.agent("cpu.cast0")
        self.update = [rec.agent(f"cpu.update{w}") for w in range(self.n_workers)]
        self.up_plans = [self._upload_plan(u) for u in range(len(self.units))]
        self.grad_plans = grad_plans(wl, plan)
        self.staging = Ring(plan.staging_chunks)
        self.ring_sizes = grad_ring_sizes(wl, plan)
        self.d2h_rings = {key: Ring(size) for key, size in self.ring_sizes.items()}
        self.readers: dict[tuple, list[int]] = {}
        self.gates: dict[int, list[tuple[int, int, int]]] = {}
        self.step = Step(R, L)
        self.features = [f(self) for f in FEATURES if f.applies(plan)]

    def _upload_plan(self, u: int) -> list[list[tuple[int, int]]]:
        """Per rank, the (lo, hi) chunks of unit u it uploads (its shard when sharded)."""
        n = self.units[u]
        if self.sharded:
            return [chunk_ranges(lo, hi, self.h2d_chunk) for lo, hi in shard_ranges(n, self.R)]
        return [chunk_ranges(0, n, self.h2d_chunk)] * self.R

    # ---- the parts every iteration is made of
    def deliver(self, t: int, u: int, buf: tuple, slot: int, gated: bool,
                gates: list | None = None) -> list[list[int]]:
        """Upload unit u into GPU buffer `buf` on every rank; per rank, the tasks compute waits on.

        Chunks are cast once (shared by every rank that uploads them), round-robin across the
        ranks' shards so that every rank's first chunk is ready early. The version gates are the
        previous iteration's ADAMs of u, or `gates` when given.
        """
        rec, R = self.rec, self.R
        if gates is None:
            gates = self.gates.get(u, []) if gated else []
            for f in self.features:
                gates = f.delivery_gates(t, u, gated, gates)
        per_rank = self.up_plans[u]
        order: list[tuple[int, int]] = []  # distinct chunks in cast order
        owners: dict[tuple[int, int], list[int]] = {}
        for k in range(max(len(x) for x in per_rank)):
            for r in range(R):
                if k < len(per_rank[r]):
                    rng = per_rank[r][k]
                    if rng not in owners:
                        owners[rng] = []
                        order.append(rng)
                    owners[rng].append(r)
        slot_readers = [self.readers.get(buf + (r,), []) for r in range(R)]
        h2ds = [[] for _ in range(R)]
        for k, (lo, hi) in enumerate(order):
            src = -1
            if not self.plan.host_bf16_copy:
                i, prev = self.staging.take()
                src = next((x for f in self.features
                            if (x := f.cast_task(t, u, k, lo, hi, i)) is not None), None)
                if src is None:
                    src = rec.task(Kind.CAST, t, u, -1, k, self.cast, hi - lo, lo, hi,
                                   threads=self.cast_threads, buffer=i)
                rec.edges(prev, src, BUFFER)
                self.gate(src, lo, hi, gates)
            for r in owners[(lo, hi)]:
                v = rec.task(Kind.H2D, t, u, r, len(h2ds[r]), self.h2d[r], (hi - lo) * PARAM_BYTES,
                             lo, hi, buffer=slot, staging_slot=i if src >= 0 else -1)
                rec.edges(slot_readers[r], v, BUFFER)
                if src >= 0:
                    rec.edge(src, v, DATA)
                    self.staging.readers[i].append(v)
                else:
                    self.gate(v, lo, hi, gates)
                h2ds[r].append(v)
        if not self.sharded:
            return h2ds
        v = rec.task(Kind.ALLGATHER, t, u, -1, -1, self.fabric, self.units[u] * PARAM_BYTES,
                     0, self.units[u], op=_OP["all_gather"], buffer=slot)
        for hs in h2ds:
            rec.edges(hs, v, DATA)
        return [[v]] * R

    def gate(self, v: int, lo: int, hi: int, gates) -> None:
        """Version-gate edges into v from the ADAMs (task, lo, hi) that overlap [lo, hi)."""
        for a, alo, ahi in gates:
            if alo < hi and lo < ahi:
                self.rec.edge(a, v, DATA, gate=True)

    def adam(self, c: GradChunk) -> int:
        """ADAM of chunk c after its source (a D2H writes ring slot c.slot, which the ADAM then
        reads; a HOST_SUM keeps the sum in its own accumulator)."""
        a = self.rec.task(Kind.ADAM, c.t, c.unit, -1, c.k, self.update[c.worker],
                          c.hi - c.lo + c.extra, c.lo, c.hi, threads=self.worker_threads,
                          buffer=c.slot, rows=c.rows, ring=c.ring)
        if c.src >= 0:
            self.rec.edge(c.src, a, DATA)
            self.rec.read_by(c.src, a)
            if self.rec.kind_of(c.src) == Kind.D2H:
                self.d2h_rings[c.ring].readers[c.slot].append(a)
        return a

    def reduce_and_update(self, t: int, u: int, bwd: list[int], gbuf: tuple | None,
                          path: GradPath | None = None) -> list[tuple[int, int, int]]:
        """Gradient path of unit u (or `path`) once every rank's backward of it is done: its
        ADAMs (task, lo, hi), less the ones a feature holds (hold_chunk)."""
        return [a for a in self.gradient_path(t, u, bwd, gbuf, path) if a is not None]

    def gradient_path(self, t: int, u: int, bwd: list[int], gbuf: tuple | None,
                      path: GradPath | None = None):
        """reduce_and_update's tasks, issued lazily: yields after each chunk's tasks (its ADAM
        as (task, lo, hi), or None when a feature holds it), so that a caller can interleave a
        unit's chunks with other units' in the agents' issue order. gbuf: the GPU gradient
        buffer it reads, whose readers it records."""
        rec, plan, R = self.rec, self.plan, self.R
        p = path or GradPath(self.grad_plans[u], self.units[u])
        red = -1
        if R > 1 and plan.grad_route == GradRoute.GPU:
            op = "reduce_scatter" if self.scatter else "reduce"
            red = rec.task(Kind.REDUCE, t, u, -1, -1, self.fabric, p.elems * GRAD_BYTES * p.scale,
                           0, p.elems, op=_OP[op], rows=p.rows)
            rec.edges(bwd, red, DATA)
        grad_readers = {r: [] if red < 0 else [red] for r in range(R)}
        summed = plan.grad_route == GradRoute.CPU and R > 1
        for k, (w, lo, hi) in enumerate(p.chunks):
            downs = []  # (rank, D2H, ring slot): every rank's when summed, else the source's
            for r in range(R) if summed else [w // plan.update_workers if self.scatter else 0]:
                i, prev = self.d2h_rings[(r, w)].take()
                v = rec.task(Kind.D2H, t, u, r, p.first_chunk + k, self.d2h[r],
                             (hi - lo) * self.wire * p.scale, lo, hi, buffer=i, rows=p.rows,
                             ring=(r, w))
                rec.edge(red if red >= 0 else bwd[r], v, DATA)
                rec.edges(prev, v, BUFFER)
                grad_readers[r].append(v)
                downs.append((r, v, i))
            r0, src, i = downs[0]
            if len(downs) > 1:
                src = rec.task(Kind.HOST_SUM, t, u, -1, p.first_chunk + k, self.update[w],
                               (hi - lo) * host_sum_bytes_per_elem(len(downs)) * p.scale, lo, hi,
                               threads=self.worker_threads, buffer=i, rows=p.rows, ring=(r0, w))
                for r, v, j in downs:
                    rec.edge(v, src, DATA)
                    rec.read_by(v, src)
                    self.d2h_rings[(r, w)].readers[j].append(src)
            c = GradChunk(t, u, p.first_chunk + k, w, lo, hi, src, (r0, w), i, p.rows,
                          round((p.extra + p.scale - 1.0) * (hi - lo)))
            yield None if any(f.hold_chunk(c) for f in self.features) else (self.adam(c), lo, hi)
        if gbuf is not None:
            for r in range(R):
                self.readers[gbuf + (r,)] = grad_readers[r]

    # ---- one iteration
    def forward(self, t: int) -> None:
        """The embedding's delivery and EMBED_FWD, then per layer its delivery and FWD."""
        rec, s, R = self.rec, self.step, self.R
        emb_ready = next((x for f in self.features
                          if (x := f.embedding_delivery(t)) is not None), None)
        if emb_ready is None:
            emb_ready = self.deliver(t, 0, ("embed",), self.W, t > 0)
        for r in range(R):
            v = rec.task(Kind.EMBED_FWD, t, 0, r, -1, self.compute[r], self.tokens * self.m.hidden * 2)
            rec.edges(emb_ready[r], v, DATA)
            s.last[r] = v
            s.emb_fwd.append(v)
        for f in self.features:
            f.after_embed_fwd(t)
        for layer in range(1, self.L + 1):
            slot = (layer - 1) % self.W
            ready = self.deliver(t, layer, ("slot", slot), slot, t > 0)
            for r in range(R):
                for f in self.features:
                    f.before_fwd(t, layer, r)
                v = rec.task(Kind.FWD, t, layer, r, -1, self.compute[r], self.lf["fwd"] * self.tokens)
                rec.edges(ready[r], v, DATA)
                rec.edge(s.last[r], v, DATA)
                s.last[r] = s.fwd[r][layer] = v
                self.readers[("slot", slot, r)] = [v]
                for f in self.features:
                    f.after_fwd(t, layer, r)

    def head(self, t: int) -> None:
        """The head's delivery, HEAD_LOSS (its forward, the loss and its backward), its gradient."""
        rec, s = self.rec, self.step
        ready = self.deliver(t, self.head_u, ("head",), self.W + 1, t > 0)
        for r in range(self.R):
            v = rec.task(Kind.HEAD_LOSS, t, self.head_u, r, -1, self.compute[r],
                         (self.hf["fwd"] + self.hf["bwd"]) * self.tokens)
            rec.edges(ready[r], v, DATA)
            rec.edge(s.last[r], v, DATA)
            s.last[r] = v
            s.head.append(v)
            self.readers[("head", r)] = [v]
        for f in self.features:
            f.before_head_gradient(t)
        s.new_adam[self.head_u] = self.reduce_and_update(t, self.head_u, s.head, None)
        for f in self.features:
            f.after_head(t)

    def backward(self, t: int) -> None:
        """Per layer L..1: its delivery unless still in the window, RECOMPUTE where its policy
        recomputes, BWD into gradient buffer layer % grad_buffers, then its gradient path."""
        rec, s, plan = self.rec, self.step, self.plan
        for layer in range(self.L, 0, -1):
            slot, gb = (layer - 1) % self.W, layer % plan.grad_buffers
            resident = layer > self.L - self.W
            ready = None if resident else self.deliver(t, layer, ("slot", slot), slot, False)
            for r in range(self.R):
                inputs = [x for f in self.features for x in f.backward_inputs(t, layer, r)]
                srcs = [s.fwd[r][layer]] if ready is None else ready[r]
                if self.recompute[layer]:
                    rc = rec.task(Kind.RECOMPUTE, t, layer, r, -1, self.compute[r],
                                  self.layer_costs[layer].recompute_flops * self.tokens)
                    rec.edges(srcs, rc, DATA)
                    rec.edge(s.last[r], rc, DATA)
                    rec.edges(inputs, rc, DATA)
                    s.last[r] = rc
                v = rec.task(Kind.BWD, t, layer, r, -1, self.compute[r], self.lf["bwd"] * self.tokens,
                             buffer=gb)
                rec.edge(s.last[r], v, DATA)
                if not self.recompute[layer]:
                    rec.edges(srcs, v, DATA)
                    rec.edges(inputs, v, DATA)
                # the gradient buffer this layer writes must be drained by its previous user
                rec.edges(self.readers.get(("grad", gb, r), []), v, BUFFER)
                s.last[r] = s.bwd[r][layer] = v
                self.readers[("slot", slot, r)] = [v]
            s.new_adam[layer] = self.reduce_and_update(
                t, layer, [s.bwd[r][layer] for r in range(self.R)], ("grad", gb))
            for f in self.features:
                f.after_backward_layer(t, layer)
        for f in self.features:
            f.after_backward(t)

    def embedding_backward(self, t: int) -> None:
        """EMBED_BWD on every rank, then the embedding's gradient path."""
        rec, s = self.rec, self.step
        for r in range(self.R):
            v = rec.task(Kind.EMBED_BWD, t, 0, r, -1, self.compute[r], self.tokens * self.m.hidden * 2)
            rec.edge(s.last[r], v, DATA)
            s.emb_bwd.append(v)
            self.readers[("embed", r)] = [v]
        if not any(f.embedding_gradient(t) for f in self.features):
            s.new_adam[0] = self.reduce_and_update(t, 0, s.emb_bwd, None)

    def iteration(self, t: int) -> None:
        self.step = Step(self.R, self.L)
        self.forward(t)
        self.head(t)
        self.backward(t)
        self.embedding_backward(t)
        gates = self.step.new_adam
        for f in self.features:
            gates = f.version_gates(t, gates)
        self.gates = gates

    def build(self) -> TaskGraph:
        for t in range(self.iterations):
            self.iteration(t)
        if self.plan.step_join:
            self.rec.join_steps(self.iterations)
        plan, R = self.plan, self.R
        meta = dict(
            cast_threads=self.cast_threads, update_threads=self.update_threads,
            teams_chunk_bytes=teams_chunk_bytes(plan, R), update_workers=self.n_workers,
            sharded_upload=self.sharded, scatter_update=self.scatter,
            cast_share=team_share(self.cast_threads, self.cores),
            update_share=team_share(self.worker_threads, self.cores),
            grad_ring_chunks=self.ring_sizes,
            recompute_hbm_bytes={layer: self.tokens * self.layer_costs[layer].recompute_hbm_bytes
                                 for layer in range(1, self.L + 1)},
            adam_writes_copy=plan.host_bf16_copy, grad_wire_bytes=self.wire,
            kernels=str(plan.kernels))
        for f in self.features:
            meta.update(f.meta())
        return self.rec.graph(self.iterations, R, self.units, GraphMeta(**meta))


def build_graph(wl: Workload, plan: Plan, cores: int, iterations: int = 2,
                first_delivery: bool = True, update_pending: bool = False) -> TaskGraph:
    """The task graph of `iterations` consecutive steps (>= 2 so that version gates exist).
    first_delivery=False leaves out iteration 0's delivery of a unit that each step delivers
    for the next one (a feature's choice): the executor's per-step template, which delivers it
    once itself before its first step. update_pending=True starts iteration 0 with the previous
    step's update pending, as every later iteration does (a feature's choice): the executor's
    per-step template of a schedule that finishes a step's update in the next step."""
    if iterations < 1:
        raise ValueError("iterations must be >= 1")
    return Builder(wl, plan, cores, iterations, first_delivery, update_pending).build()
