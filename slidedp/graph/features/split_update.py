"""Feature split_update (plan.splits_update: defer_update with clip_schedule = split): exact
clipping whose update leaves the step's tail.

The clipping norm is known only once every gradient chunk of step t is on the host, and step
t+1's forward needs every unit updated, in the forward order. Step t's update of a chunk is
therefore computed twice, from the same inputs (the held gradient, the master and the moments
as step t-1's commit left them, the norm):
  UPDATE_CAST(t+1)  in step t+1's forward delivery, in place of the CAST: the updated master
                    written as BF16 straight into the staging chunk the H2D uploads; the host
                    state is read only (an ADAM's reads and a BF16 write). The first one of the
                    step waits for every chunk producer of step t (the norm); each one for the
                    chunks of the held gradient it reads and the commits of its range (the
                    version gates: the state it reads).
  ADAM(t+1)         the commit, issued after every rank's HEAD_LOSS of step t+1, in the
                    backward's order (the head, layers L..1, the embedding): after the
                    UPDATE_CASTs that read the state it writes, and before the backward's
                    re-upload of its unit, whose CAST then reads the committed master (the same
                    values the UPDATE_CAST uploaded: one computation, bit for bit).
The forward then costs the host one read of the state per parameter instead of a whole update,
and the commit shares the backward's host time with the downloads and the re-uploads.
Step 0 has nothing pending: its deliveries are the base schedule's, unless the builder starts it
with the previous step's update pending (update_pending: the executor's per-step template, whose
pending chunks then have no producer in the graph and sit in the ring slots the step's own
chunks take). Each graph's last step's update stays pending (the executor flushes it before a
read of the host state).

The rings hold a whole step's gradient (as joined, features/deferred_update.py), in the compute
dtype unless the cpu route sums several ranks' chunks in FP32 (exact: the GPU's gradient is
BF16), so the held gradient costs 2 B/param of host memory instead of 4.
"""

from __future__ import annotations

from dataclasses import replace

from slidedp.graph.features.base import Feature, add_term
from slidedp.graph.features.deferred_update import DeferredUpdate
from slidedp.graph.recorder import GradChunk
from slidedp.graph.tasks import EdgeKind, Kind
from slidedp.spec.elements import FP32_BYTES, GRAD_BYTES
from slidedp.spec.plan import GradRoute, Plan
from slidedp.spec.workload import Workload

DATA = EdgeKind.DATA
SCRATCH_ELEMS = 1 << 22  # an UPDATE_CAST's FP32 blocks (exec/adamw.py WIDEN_BLOCK)


class SplitUpdate(Feature):
    @staticmethod
    def applies(plan: Plan) -> bool:
        return plan.splits_update

    @staticmethod
    def grad_wire_bytes(plan: Plan, ranks: int, wire: int) -> int:
        summed = plan.grad_route == GradRoute.CPU and ranks > 1
        return wire if summed else GRAD_BYTES

    grad_ring_slots = DeferredUpdate.grad_ring_slots

    @staticmethod
    def host_memory(wl: Workload, plan: Plan, terms: dict[str, float], wire: int) -> None:
        """The UPDATE_CASTs' scratch: the master, the gradient and the moments of a block in
        FP32, per rank process (each runs its own casts with update_sharding = sharded)."""
        add_term(terms, "update_cast", 4 * SCRATCH_ELEMS * FP32_BYTES * wl.gpus
                 if plan.splits_update else 0.0, before="runtime")

    def __init__(self, b):
        super().__init__(b)
        self.pending: dict[int, list] = {}  # unit -> step t-1's GradChunks, in arrival order
        self.held: dict[int, list] = {}  # unit -> this step's GradChunks, in arrival order
        self.producers: list[int] = []  # step t-1's chunk producers (D2H / HOST_SUM)
        self.readers: dict[int, list[tuple[int, int, int]]] = {}  # unit -> UPDATE_CASTs of t
        self.commits: dict[int, list[tuple[int, int, int]]] = {}  # unit -> commits issued in t
        self.first = True  # the next UPDATE_CAST is its step's first
        self.committed = False  # this step's commits are issued (later casts are re-uploads)
        if b.update_pending:
            self.pending = self._previous_chunks()

    def _previous_chunks(self) -> dict[int, list]:
        """The chunks of a step before iteration 0, in the ring slots iteration 0's own chunks
        take (a ring holds exactly a step's chunks of its worker, taken in arrival order: the
        head, layers L..1, the embedding), with no producer."""
        b, plan = self.b, self.b.plan
        taken: dict[tuple[int, int], int] = {}
        out: dict[int, list] = {}
        for u in [b.head_u, *range(b.L, 0, -1), 0]:
            for k, (w, lo, hi) in enumerate(b.grad_plans[u]):
                key = (w // plan.update_workers if b.scatter else 0, w)
                slot = taken.get(key, 0)
                taken[key] = slot + 1
                out.setdefault(u, []).append(GradChunk(-1, u, k, w, lo, hi, -1, key, slot))
        return out

    def hold_chunk(self, chunk) -> bool:
        self.held.setdefault(chunk.unit, []).append(chunk)
        return True

    def cast_task(self, t: int, u: int, k: int, lo: int, hi: int, staging: int) -> int | None:
        """A forward delivery of a unit with a pending update: UPDATE_CAST of [lo, hi)."""
        if self.committed or u not in self.pending:
            return None
        b = self.b
        v = b.rec.task(Kind.UPDATE_CAST, t, u, -1, k, b.cast, hi - lo, lo, hi,
                       threads=b.cast_threads, buffer=staging)
        if self.first:  # the norm: every chunk of the pending step (the later ones follow, ORDER)
            self.first = False
            b.rec.edges(self.producers, v, DATA)
        for c in self.pending[u]:
            if c.lo < hi and lo < c.hi:
                if c.src >= 0:
                    b.rec.edge(c.src, v, DATA)
                b.d2h_rings[c.ring].readers[c.slot].append(v)
        self.readers.setdefault(u, []).append((v, lo, hi))
        return v

    def delivery_gates(self, t: int, u: int, gated: bool, gates: list) -> list:
        """A re-upload in the backward reads the master this step's commit of u wrote."""
        return gates if gated else gates + self.commits.get(u, [])

    def before_head_gradient(self, t: int) -> None:
        """The commits of the pending step, in the backward's order (module docstring)."""
        b = self.b
        self.committed = True
        for u in [b.head_u, *range(b.L, 0, -1), 0]:
            out = self.commits[u] = []
            for c in self.pending.get(u, []):
                a = b.adam(replace(c, t=t))  # a task of step t, reading step t-1's chunk
                if c.src < 0 or b.rec.kind_of(c.src) != Kind.D2H:  # b.adam did not record it
                    b.d2h_rings[c.ring].readers[c.slot].append(a)
                b.rec.edges([x for x, lo, hi in self.readers.get(u, [])
                             if lo < c.hi and c.lo < hi], a, DATA)
                out.append((a, c.lo, c.hi))

    def version_gates(self, t: int, gates: dict) -> dict:
        """This step's commits gate the next step's UPDATE_CASTs (and CASTs: the state they
        read); this step's held chunks become the next step's pending update."""
        out = self.commits
        self.pending, self.held = self.held, {}
        self.producers = [c.src for chunks in self.pending.values() for c in chunks]
        self.readers, self.commits, self.first, self.committed = {}, {}, True, False
        return out
