"""Feature defer_update, joined (clip_schedule = joined, the reference; split_update.py runs
the split schedule): every ADAM of an iteration after every gradient chunk of it is on the
host, when the global gradient norm (clipping) is known.

The ADAMs of an iteration are issued after its last D2H / HOST_SUM, in the order their chunks
came (head, layers L..1, embedding), and the first ADAM of each update worker has a DATA edge
from every chunk producer of the iteration (each D2H feeding an ADAM directly, each HOST_SUM,
which follows its D2Hs): every ADAM then runs after every D2H of its iteration. Edges rather than
a barrier task: no new kind for the cost model, the simulator and the executor to run, and the
first ADAM is where the executor computes the clipping coefficient anyway. The embedding, first
needed by the next forward, is updated last: the next step waits for the whole update, as the
executor's step boundary makes it (updating in forward order could overlap the next forward
only if the executor did not join the step; method.md section 11).

The rings the ADAMs read (the source rank's; rank 0's on the cpu route, into which HOST_SUM then
adds the other ranks' chunks, as the sum waits there for its ADAM) hold every chunk of their
worker in an iteration, so no D2H waits for an ADAM.
"""

from __future__ import annotations

from slidedp.graph.features.base import Feature
from slidedp.graph.tasks import EdgeKind, Kind
from slidedp.spec.plan import GradRoute, Plan


class DeferredUpdate(Feature):
    @staticmethod
    def applies(plan: Plan) -> bool:
        return plan.defer_update and not plan.splits_update

    @staticmethod
    def grad_ring_slots(plan: Plan, ranks: int, key: tuple[int, int], slots: int,
                        worker_chunks: int) -> int:
        summed = plan.grad_route == GradRoute.CPU and ranks > 1
        return worker_chunks if key[0] == 0 or not summed else slots

    def __init__(self, b):
        super().__init__(b)
        self.pending: dict[int, list] = {}  # unit -> its GradChunks waiting, in arrival order

    def hold_chunk(self, chunk) -> bool:
        self.pending.setdefault(chunk.unit, []).append(chunk)
        return True

    def version_gates(self, t: int, gates: dict) -> dict:
        """Every held ADAM of iteration t, after every chunk producer of t (module docstring);
        they gate the next iteration."""
        b = self.b
        producers = [c.src for chunks in self.pending.values() for c in chunks]
        workers: set[int] = set()
        out = {}
        for u, chunks in self.pending.items():
            out[u] = []
            for c in chunks:
                a = b.adam(c)
                if b.rec.kind_of(c.src) != Kind.D2H:  # the sum waits in the ring for its ADAM
                    b.d2h_rings[c.ring].readers[c.slot].append(a)
                if c.worker not in workers:  # its first ADAM: the later ones follow it (ORDER)
                    workers.add(c.worker)
                    b.rec.edges([p for p in producers if p != c.src], a, EdgeKind.DATA)
                out[u].append((a, c.lo, c.hi))
        self.pending.clear()
        return out
