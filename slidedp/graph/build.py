"""Build the task graph of `iterations` consecutive training steps from (workload, plan, cores).

The schedule, per iteration and per rank r (units: 0 embedding, 1..L layers, L+1 head):
  deliveries  embedding, layers 1..L, head, in the order compute needs them; a layer is
              delivered again in backward unless it is still in the window. A delivery is
              CAST per chunk (host, once, into a pinned staging ring) -> H2D per chunk (each rank
              its chunks: all of them when replicated, its 1/R shard when sharded) -> ALLGATHER
              (sharded, R > 1). With `host_bf16_copy` the update wrote the BF16 copy: no CAST.
  compute     EMBED_FWD, FWD 1..L, HEAD_LOSS (head fwd+bwd and loss), then for l = L..1
              RECOMPUTE and BWD, then EMBED_BWD. RECOMPUTE(l) exists when layer l's policy
              recomputes anything (slidedp.spec.segments: layer, sac, seg masks other than all
              kept); its work is the policy's recompute FLOPs, and meta.recompute_hbm_bytes
              holds its elementwise HBM bytes per unit (costs.py turns both into seconds).
  activations ACT_OFFLOAD of ratio r of what layer l's policy retains, after the task that
              produces the last of it: the producer of its input when it keeps the input alone
              ("layer", seg:0b0000000), else FWD(l); ACT_RELOAD before RECOMPUTE(l) (or BWD(l)),
              at most `reload_ahead_layers` layers ahead.
  gradients   per unit, after every rank's BWD: REDUCE (gpu route: reduce to rank 0, or
              reduce-scatter when the update is sharded) -> D2H per chunk -> ADAM per chunk; on
              the cpu route every rank downloads every chunk and HOST_SUM adds them before ADAM.
  deferred    with plan.defer_update the ADAMs of an iteration are issued after its last D2H /
              HOST_SUM, in the order their chunks came (head, layers L..1, embedding), and the
              first ADAM of each update worker has a DATA edge from every chunk producer of the
              iteration (each D2H feeding an ADAM directly, each HOST_SUM, which follows its
              D2Hs): every ADAM then runs after every D2H of its iteration, when the global
              gradient norm is known. Edges rather than a barrier task: no new kind for the cost
              model, the simulator and the executor to run, and the first ADAM is where the
              executor computes the clipping coefficient anyway. The embedding, first needed by
              the next forward, is updated last: the next step waits for the whole update, as the
              executor's step boundary makes it (updating in forward order could overlap the
              next forward only if the executor did not join the step; method.md section 11).
embedding rows  with plan.embedding_rows (and no defer_update) the embedding's update leaves the
              step boundary. Bulk: ADAM of every chunk of the embedding with the gradient known
              before EMBED_BWD, each keeping the looked-up rows' state as it was (their p, m, v
              saved and restored: work + 2 x the rows' elements): tied, the head's share, through
              the unit's usual REDUCE / D2H / HOST_SUM path after HEAD_LOSS, its chunks'
              D2Hs and ADAMs issued ceil(chunks / L) after each layer's in the backward (all
              at once they held the download ring and the update workers and stalled the
              backward: measured on nvidia-h200, Qwen3-4B); untied, a zero
              gradient, no download, at the step's start. The bulk delivery for the NEXT step
              (CAST / H2D / ALLGATHER of the embedding, gated by these ADAMs) follows the
              backward's deliveries and waits for the embedding's readers (EMBED_FWD, and
              HEAD_LOSS when tied). Rows: EMBED_BWD writes a compact gradient of the looked-up
              rows (row_capacity(wl) x hidden elements, the most a batch can look up; tasks
              flagged `rows`, ranges in that compact space, whole rows; their work scaled to the
              expected looked_up_rows(wl); the embedding's own gradient chunks and update shares
              are whole rows: meta.embedding_grad_align), which takes the usual gradient
              path (REDUCE / D2H / HOST_SUM ->
              ADAM, after every bulk ADAM and every host-side reader of the bulk delivery: its
              CASTs, or its H2Ds of the host copy) -> CAST -> H2D to every rank
              (after its bulk delivery: the rows overwrite their stale bulk copy). The next
              step's EMBED_FWD waits for its rank's bulk delivery and rows H2Ds instead of a
              delivery of its own (iteration 0 delivers the embedding at its start).
Edges: DATA along those arrows; the version gate I3 from ADAM(t, u, k) to the first delivery of
unit u in t+1 that touches the same parameters (with embedding_rows, the embedding's gates run
from the bulk ADAMs of t to the bulk delivery created in t, and from the rows ADAMs to the rows
CASTs: same-iteration edges, as that delivery is the next step's); ORDER along each agent's
issue order; BUFFER from the last readers of a slot / staging chunk / gradient buffer to the next
writer; with
plan.step_join, JOIN from every agent's last task of step t to every agent's first of t+1.

Buffers: decoder layers share `window_slots` GPU slots per rank (layer l uses slot (l-1) mod W in
forward; a re-delivery in backward reuses the slot freed by BWD(l+W)); the embedding and the head
have resident slots of their own, reused across iterations. Host staging rings are FIFO; their
sizes are grad_ring_sizes (with defer_update the rings the ADAMs read hold a whole iteration).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np

from slidedp.graph.tasks import COLLECTIVE_OPS, EdgeKind, GraphMeta, Kind, TaskGraph
from slidedp.spec.elements import FP32_BYTES, GRAD_BYTES, PARAM_BYTES
from slidedp.spec.plan import GradRoute, GradWiden, ParamRoute, Plan, UpdateSharding, team_cores
from slidedp.spec.segments import keeps_beyond_input, policy_cost
from slidedp.spec.units import MIB
from slidedp.spec.workload import Workload


def host_sum_bytes_per_elem(ranks: int) -> int:
    """Host-memory bytes a HOST_SUM of `ranks` FP32 chunks moves per element: R - 1 additions,
    each reading two chunks and writing one (staging.add_chunks), then the sum's squares for the
    gradient norm (one more read: engine._run_host_sum)."""
    return FP32_BYTES * (3 * (ranks - 1) + 1)


_OP = {name: i for i, name in enumerate(COLLECTIVE_OPS)}


def grad_wire_bytes(plan: Plan, ranks: int) -> int:
    """Bytes per element of a downloaded gradient chunk (D2H, the host rings): BF16 when the
    update widens it on the host (plan.grad_widen = host), FP32 when the GPU widens it first, and
    always FP32 on the cpu route with several ranks, whose HOST_SUM adds the ranks' chunks in FP32
    (staging.host_sum: a sum of BF16 chunks into FP32 would cost an extra pass)."""
    summed = plan.grad_route == GradRoute.CPU and ranks > 1
    return GRAD_BYTES if plan.grad_widen == GradWiden.HOST and not summed else FP32_BYTES


def teams_chunk_bytes(plan: Plan, ranks: int) -> float | None:
    """The PCIe chunk size (bytes) at which the profile's teams by chunk size ran this plan's CPU
    tasks (HostSpec.teams_at): its upload chunk, where its ADAMs are the ones measured there (an
    FP32 gradient chunk as large as the upload chunk); None otherwise (the whole-buffer run)."""
    same = plan.d2h_chunk_mib == plan.h2d_chunk_mib and grad_wire_bytes(plan, ranks) == FP32_BYTES
    return plan.h2d_chunk_mib * MIB if same else None


def team_share(team_threads: float, cores: float) -> float:
    """Fraction of its threads' speed an OpenMP team of `team_threads` keeps on a host of `cores`:
    min(1, plan.team_cores(cores) / team_threads), team_cores = cores - cores // 4.

    The executor gives every CPU agent its own OpenMP team for the whole run (the cast agent
    cast_threads, each update worker update_threads / workers; engine._cpu_threads). An OpenMP op
    splits its work statically into one part per thread, so a team that needs more cores than the
    ones left after the agents' own threads (the GPU agents' Python threads, the notifier, the
    communicator: a quarter of the cores is reserved for them) waits on its preempted threads and
    runs at this fraction of its own rate curve. Teams of different agents that run at the same
    time share the cores in the simulator (host.cores), not here. Measured on nvidia-h200-x2 (32
    cores, Qwen3-8B mb 4, window 36, one device call, validation cases h200x2-1621-*): cast 24 +
    update 24 threads 2.67 s, 16 + 16 2.92 s, 8 + 24 3.11 s (teams within 24 cores: share 1; the
    8-thread cast is slow on its own curve); two 32-thread teams (the t16-32 case of 14:25, which
    ran 32 + 32) took the update x1.40 and the cast x1.53 longer than their 32-thread rates, this
    rule says x1.33. Teams beyond the cores do not slow each other while only one of them runs
    (with window = L the cast runs in the forward and the update in the backward).
    """
    return min(1.0, team_cores(int(cores)) / team_threads) if team_threads > 0 else 1.0


def chunk_ranges(lo: int, hi: int, chunk_elems: int) -> list[tuple[int, int]]:
    """Split [lo, hi) into consecutive chunks of at most chunk_elems elements."""
    out = []
    while lo < hi:
        out.append((lo, min(hi, lo + chunk_elems)))
        lo += chunk_elems
    return out


def shard_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """Split [0, n) into `parts` contiguous shards as equal as possible."""
    return [(n * p // parts, n * (p + 1) // parts) for p in range(parts)]


def grad_plans(wl: Workload, plan: Plan) -> list[list[tuple[int, int, int]]]:
    """Per unit, its gradient chunks as (update worker, lo, hi): one ADAM each. With
    embedding_rows the embedding's chunks are whole rows (its ADAMs save and restore rows)."""
    align = wl.model.hidden if plan.splits_embedding else 1
    return [grad_chunks(n, wl.gpus, plan, align if u == 0 else 1)
            for u, n in enumerate(wl.model.unit_params())]


def grad_chunks(n: int, R: int, plan: Plan, align: int = 1) -> list[tuple[int, int, int]]:
    """The gradient chunks (update worker, lo, hi) of n elements: D2H-chunk sized, each update
    process (R of them when the update is sharded) taking a contiguous share; every boundary a
    multiple of `align` (n must be one)."""
    scatter = plan.update_sharding == UpdateSharding.SHARDED and R > 1
    wire = grad_wire_bytes(plan, R)
    d2h_chunk = max(align, int(plan.d2h_chunk_mib * MIB) // wire // align * align)
    chunks = []
    for p, (lo, hi) in enumerate(update_shards(n, R, align) if scatter else [(0, n)]):
        for k, (a, z) in enumerate(chunk_ranges(lo, hi, d2h_chunk)):
            chunks.append((p * plan.update_workers + k % plan.update_workers, a, z))
    return chunks


def update_shards(n: int, R: int, align: int = 1) -> list[tuple[int, int]]:
    """The R update shares of n elements (sharded update): shard_ranges in units of `align`."""
    return [(a * align, z * align) for a, z in shard_ranges(n // align, R)]


def row_capacity(wl: Workload) -> int:
    """Most distinct embedding rows a global batch can look up: min(V, tokens of the batch)."""
    return min(wl.model.vocab_size, wl.global_batch * wl.seq_len)


def looked_up_rows(wl: Workload) -> int:
    """Expected distinct embedding rows a global batch looks up, for uniformly random token ids:
    V (1 - (1 - 1/V)^T), T = tokens of the global batch. Real text repeats tokens more (the rows
    are fewer), so this is the upper end the embedding-rows tasks are sized by."""
    v, t = wl.model.vocab_size, wl.global_batch * wl.seq_len
    return max(1, min(v, t, round(v * -math.expm1(t * math.log1p(-1.0 / v)))))


def grad_ring_sizes(wl: Workload, plan: Plan) -> dict[tuple[int, int], int]:
    """Slots of each (rank, update worker) host gradient ring, one FP32 chunk each.

    plan.d2h_staging_chunks, except with defer_update for the rings the ADAMs read (the source
    rank's; rank 0's on the cpu route, into which HOST_SUM then adds the other ranks' chunks):
    those hold every chunk of their worker in an iteration, so no D2H waits for an ADAM.
    """
    R = wl.gpus
    scatter = plan.update_sharding == UpdateSharding.SHARDED and R > 1
    summed = plan.grad_route == GradRoute.CPU and R > 1
    per_worker = Counter(w for chunks in grad_plans(wl, plan) for w, _, _ in chunks)
    sizes = {}
    for w in range(plan.update_workers * (R if scatter else 1)):
        for r in range(R) if summed else [w // plan.update_workers if scatter else 0]:
            held = plan.defer_update and (r == 0 or not summed)
            sizes[(r, w)] = per_worker[w] if held else plan.d2h_staging_chunks
    return sizes


class _Builder:
    """Appends tasks and edges into flat lists; converted to numpy arrays once at the end."""

    def __init__(self):
        self.cols = {k: [] for k in ("kind", "iteration", "unit", "rank", "chunk", "agent",
                                     "work", "elem_lo", "elem_hi", "threads", "op", "buffer",
                                     "rows")}
        self.es, self.ed, self.ek, self.eg = [], [], [], []
        self.agents: list[str] = []
        self.agent_id: dict[str, int] = {}
        self.agent_tasks: list[list[int]] = []
        self.n = 0

    def agent(self, name: str) -> int:
        a = self.agent_id.get(name)
        if a is None:
            a = self.agent_id[name] = len(self.agents)
            self.agents.append(name)
            self.agent_tasks.append([])
        return a

    def task(self, kind, it, unit, rank, chunk, agent, work, lo=-1, hi=-1, threads=0.0, op=-1,
             buffer=-1, rows=False):
        c = self.cols
        c["buffer"].append(buffer)
        c["rows"].append(rows)
        c["kind"].append(int(kind))
        c["iteration"].append(it)
        c["unit"].append(unit)
        c["rank"].append(rank)
        c["chunk"].append(chunk)
        c["agent"].append(agent)
        c["work"].append(float(work))
        c["elem_lo"].append(lo)
        c["elem_hi"].append(hi)
        c["threads"].append(threads)
        c["op"].append(op)
        v = self.n
        self.n += 1
        tasks = self.agent_tasks[agent]
        if tasks:
            self.edge(tasks[-1], v, EdgeKind.ORDER)
        tasks.append(v)
        return v

    def edge(self, src: int, dst: int, kind: EdgeKind, gate: bool = False):
        self.es.append(src)
        self.ed.append(dst)
        self.ek.append(int(kind))
        self.eg.append(gate)

    def edges(self, srcs, dst: int, kind: EdgeKind):
        for s in srcs:
            self.edge(s, dst, kind)


class _Ring:
    """A FIFO ring of host staging buffers: a writer waits for the previous occupant's readers."""

    def __init__(self, size: int):
        self.size, self.next = size, 0
        self.readers: list[list[int]] = [[] for _ in range(size)]

    def take(self) -> tuple[int, list[int]]:
        i = self.next
        self.next = (i + 1) % self.size
        prev = self.readers[i]
        self.readers[i] = []
        return i, prev


def build_graph(wl: Workload, plan: Plan, cores: int, iterations: int = 2,
                first_delivery: bool = True) -> TaskGraph:
    """The task graph of `iterations` consecutive steps (>= 2 so that version gates exist).
    first_delivery=False leaves out iteration 0's embedding delivery when each step delivers the
    next step's (embedding_rows): the executor's per-step template, which delivers it once
    itself before its first step."""
    if iterations < 1:
        raise ValueError("iterations must be >= 1")
    m = wl.model
    R, L = wl.gpus, m.n_layers
    units = m.unit_params()
    head_u = L + 1
    tokens = wl.tokens_per_gpu_step
    cast_threads, update_threads = plan.threads(cores)
    sharded = plan.param_route == ParamRoute.SHARDED and R > 1
    scatter = plan.update_sharding == UpdateSharding.SHARDED and R > 1
    n_workers = plan.update_workers * (R if scatter else 1)
    worker_threads = update_threads / n_workers
    h2d_chunk = max(1, int(plan.h2d_chunk_mib * MIB) // PARAM_BYTES)
    wire = grad_wire_bytes(plan, R)
    W = plan.window_slots
    lf = m.layer_flops_per_token(wl.seq_len)
    hf = m.head_flops_per_token()
    plan.check_layers(L)
    costs = [None] + [policy_cost(m, plan.policy_of(layer), wl.seq_len) for layer in range(1, L + 1)]
    recompute = [False] + [c.recomputes for c in costs[1:]]
    act_bytes = [0.0] + [plan.offload_ratio * tokens * c.retained_bytes for c in costs[1:]]
    keeps_more = [False] + [keeps_beyond_input(plan.policy_of(layer)) for layer in range(1, L + 1)]
    recompute_hbm = {layer: tokens * costs[layer].recompute_hbm_bytes for layer in range(1, L + 1)}

    b = _Builder()
    compute = [b.agent(f"gpu{r}.compute") for r in range(R)]
    h2d = [b.agent(f"gpu{r}.h2d") for r in range(R)]
    d2h = [b.agent(f"gpu{r}.d2h") for r in range(R)]
    fabric = b.agent("fabric") if R > 1 else -1
    cast = b.agent("cpu.cast0")
    update = [b.agent(f"cpu.update{w}") for w in range(n_workers)]

    # Upload chunking per unit: list over ranks of [(lo, hi)] the rank uploads.
    def upload_plan(u: int) -> list[list[tuple[int, int]]]:
        n = units[u]
        if sharded:
            return [chunk_ranges(lo, hi, h2d_chunk) for lo, hi in shard_ranges(n, R)]
        return [chunk_ranges(0, n, h2d_chunk)] * R

    up_plans = [upload_plan(u) for u in range(len(units))]
    gr_plans = grad_plans(wl, plan)
    rows_mode = plan.splits_embedding  # module docstring, "embedding rows"
    # the rows tasks tile the capacity (the most rows a batch can look up); their work is the
    # expected share of it (`fill`), as the executor skips the rows past the batch's own
    rows_elems = row_capacity(wl) * m.hidden if rows_mode else 0
    fill = looked_up_rows(wl) / row_capacity(wl) if rows_mode else 0.0
    rows_gp = grad_chunks(rows_elems, R, plan, m.hidden) if rows_mode else []
    bulk_extra = 2.0 * fill * rows_elems / units[0] if rows_mode else 0.0  # saved + restored rows

    staging = _Ring(plan.staging_chunks)
    ring_sizes = grad_ring_sizes(wl, plan)
    d2h_rings = {key: _Ring(size) for key, size in ring_sizes.items()}
    # with defer_update, per unit the downloaded chunks waiting for their ADAM (see adam())
    pending: dict[int, list[tuple]] = {}
    # last readers of each GPU buffer: ("slot", r, s) / ("embed", r) / ("head", r) / ("grad", r, g)
    readers: dict[tuple, list[int]] = {}
    prev_adam: dict[int, list[tuple[int, int, int]]] = {}  # unit -> [(task, lo, hi)] of last iteration

    def deliver(t: int, u: int, buf: tuple, slot: int, gated: bool,
                gates: list | None = None) -> list[list[int]]:
        """Upload unit u into GPU buffer `buf` on every rank; per rank, the tasks compute waits on.

        Chunks are cast once (shared by every rank that uploads them), round-robin across the
        ranks' shards so that every rank's first chunk is ready early. The version gates are the
        previous iteration's ADAMs of u, or `gates` when given.
        """
        if gates is None:
            gates = prev_adam.get(u, []) if gated else []
        per_rank = up_plans[u]
        order: list[tuple[int, int]] = []  # distinct chunks in cast order
        owners: dict[tuple[int, int], list[int]] = {}
        depth = max(len(x) for x in per_rank)
        for k in range(depth):
            for r in range(R):
                if k < len(per_rank[r]):
                    rng = per_rank[r][k]
                    if rng not in owners:
                        owners[rng] = []
                        order.append(rng)
                    owners[rng].append(r)
        slot_readers = [readers.get(buf + (r,), []) for r in range(R)]
        h2ds = [[] for _ in range(R)]
        for k, (lo, hi) in enumerate(order):
            src = -1
            if not plan.host_bf16_copy:
                i, prev = staging.take()
                src = b.task(Kind.CAST, t, u, -1, k, cast, hi - lo, lo, hi, threads=cast_threads,
                             buffer=i)
                b.edges(prev, src, EdgeKind.BUFFER)
                _gate(src, lo, hi, gates)
            for r in owners[(lo, hi)]:
                v = b.task(Kind.H2D, t, u, r, len(h2ds[r]), h2d[r], (hi - lo) * PARAM_BYTES, lo, hi,
                           buffer=slot)
                b.edges(slot_readers[r], v, EdgeKind.BUFFER)
                if src >= 0:
                    b.edge(src, v, EdgeKind.DATA)
                    staging.readers[i].append(v)
                else:
                    _gate(v, lo, hi, gates)
                h2ds[r].append(v)
        if not sharded:
            return h2ds
        v = b.task(Kind.ALLGATHER, t, u, -1, -1, fabric, units[u] * PARAM_BYTES,
                   0, units[u], op=_OP["all_gather"], buffer=slot)
        for hs in h2ds:
            b.edges(hs, v, EdgeKind.DATA)
        return [[v]] * R

    def _gate(v: int, lo: int, hi: int, gates):
        for a, alo, ahi in gates:
            if alo < hi and lo < ahi:
                b.edge(a, v, EdgeKind.DATA, gate=True)

    def adam(t: int, u: int, k: int, w: int, lo: int, hi: int, src: int, ring: _Ring | None,
             i: int, rows: bool = False, extra: int = 0):
        """ADAM of chunk k of unit u after `src`, its D2H or HOST_SUM, wrote it into slot i of
        `ring` (the sum stays in HOST_SUM's private accumulator unless the update is deferred);
        src = -1: no gradient comes (an untied embedding's bulk reads zeros). `extra` elements of
        work beyond the chunk's (the embedding bulk's saved rows)."""
        a = b.task(Kind.ADAM, t, u, -1, k, update[w], hi - lo + extra, lo, hi,
                   threads=worker_threads, buffer=i, rows=rows)
        if src < 0:
            return a
        b.edge(src, a, EdgeKind.DATA)
        if plan.defer_update or b.cols["kind"][src] == Kind.D2H:
            ring.readers[i].append(a)
        return a

    def deferred_updates(t: int) -> dict[int, list[tuple[int, int, int]]]:
        """Every ADAM of iteration t, after every chunk producer of t (module docstring)."""
        producers = [c[5] for chunks in pending.values() for c in chunks]
        workers: set[int] = set()
        out = {}
        for u, chunks in pending.items():
            out[u] = []
            for c in chunks:
                _, _, w, lo, hi, src, _, _ = c
                a = adam(t, *c)
                if w not in workers:  # its first ADAM: the later ones follow it (ORDER)
                    workers.add(w)
                    b.edges([p for p in producers if p != src], a, EdgeKind.DATA)
                out[u].append((a, lo, hi))
        pending.clear()
        return out

    def reduce_and_update(t: int, u: int, bwd: list[int], gbuf: tuple | None,
                          rows: bool = False, extra: float = 0.0):
        """Gradient path of unit u once every rank's backward of it is done: its ADAMs, or none
        with defer_update (the chunks wait in `pending`). rows: the embedding's looked-up rows
        (compact space); extra: work per element added to each ADAM (the bulk's saved rows)."""
        return [a for a in gradient_path(t, u, bwd, gbuf, rows, extra) if a is not None]

    def gradient_path(t: int, u: int, bwd: list[int], gbuf: tuple | None, rows: bool,
                      extra: float):
        """reduce_and_update's tasks, issued lazily: yields after each chunk's tasks (its ADAM
        as (task, lo, hi), or None when deferred), so that a caller can interleave a unit's
        chunks with other units' in the agents' issue order."""
        gp = rows_gp if rows else gr_plans[u]
        n = rows_elems if rows else units[u]
        k0 = len(gr_plans[0]) if rows else 0  # rows chunks are numbered after the bulk's
        scale = fill if rows else 1.0
        nbytes = n * GRAD_BYTES * scale
        red = -1
        if R > 1 and plan.grad_route == GradRoute.GPU:
            op = "reduce_scatter" if scatter else "reduce"
            red = b.task(Kind.REDUCE, t, u, -1, -1, fabric, nbytes, 0, n, op=_OP[op], rows=rows)
            b.edges(bwd, red, EdgeKind.DATA)
        grad_readers = {r: [] for r in range(R)}
        if red >= 0:
            for r in range(R):
                grad_readers[r].append(red)
        for k, (w, lo, hi) in enumerate(gp):
            if plan.grad_route == GradRoute.CPU and R > 1:
                src_ranks = range(R)
            else:
                src_ranks = [w // plan.update_workers if scatter else 0]
            downs = []
            for r in src_ranks:
                i, prev = d2h_rings[(r, w)].take()
                v = b.task(Kind.D2H, t, u, r, k0 + k, d2h[r], (hi - lo) * wire * scale,
                           lo, hi, buffer=i, rows=rows)
                b.edge(red if red >= 0 else bwd[r], v, EdgeKind.DATA)
                b.edges(prev, v, EdgeKind.BUFFER)
                grad_readers[r].append(v)
                downs.append((r, v, i))
            # the staging chunks are read by HOST_SUM (cpu route) or directly by ADAM
            r0, src, i = downs[0]
            if len(downs) > 1:
                src = b.task(Kind.HOST_SUM, t, u, -1, k0 + k, update[w],
                             (hi - lo) * host_sum_bytes_per_elem(len(downs)) * scale,
                             lo, hi, threads=worker_threads, buffer=i, rows=rows)
                for r, v, j in downs:
                    b.edge(v, src, EdgeKind.DATA)
                    d2h_rings[(r, w)].readers[j].append(src)
            chunk = (u, k0 + k, w, lo, hi, src, d2h_rings[(r0, w)], i)
            if plan.defer_update:
                pending.setdefault(u, []).append(chunk)
                yield None
            else:
                work_extra = round((extra + scale - 1.0) * (hi - lo))
                yield adam(t, *chunk, rows=rows, extra=work_extra), lo, hi
        if gbuf is not None:
            for r in range(R):
                readers[gbuf + (r,)] = grad_readers[r]

    def zero_grad_updates(t: int, after: list[int]) -> list[tuple[int, int, int]]:
        """The untied embedding's bulk: ADAMs with a zero gradient (nothing to download), after
        the previous step's rows update and its readers (`after`), and after every rank's
        EMBED_FWD (each rank's own first delivery of the embedding, the executor's, reads the
        master before its first step: the bulk must not change it meanwhile)."""
        out = []
        for k, (w, lo, hi) in enumerate(gr_plans[0]):
            a = adam(t, 0, k, w, lo, hi, -1, None, -1, extra=round(bulk_extra * (hi - lo)))
            b.edges(after + emb_fwd, a, EdgeKind.DATA)
            out.append((a, lo, hi))
        return out

    def deliver_rows(t: int, rows_adams: list, bulk_ready: list[list[int]]) -> list[list[int]]:
        """The looked-up rows to every rank's embedding slot, after the rank's bulk delivery:
        per rank, the H2Ds the next step's EMBED_FWD waits on (besides the bulk delivery)."""
        h2ds = [[] for _ in range(R)]
        k0 = sum(len(x) for x in up_plans[0])  # rows chunks are numbered after the bulk's
        for k, (_, lo, hi) in enumerate(rows_gp):
            i, prev = staging.take()
            src = b.task(Kind.CAST, t, 0, -1, k0 + k, cast, (hi - lo) * fill, lo, hi,
                         threads=cast_threads, buffer=i, rows=True)
            b.edges(prev, src, EdgeKind.BUFFER)
            _gate(src, lo, hi, rows_adams)
            for r in range(R):
                v = b.task(Kind.H2D, t, 0, r, k0 + len(h2ds[r]), h2d[r],
                           (hi - lo) * PARAM_BYTES * fill, lo, hi, buffer=W, rows=True)
                b.edge(src, v, EdgeKind.DATA)
                b.edges(bulk_ready[r], v, EdgeKind.BUFFER)
                staging.readers[i].append(v)
                h2ds[r].append(v)
        return h2ds

    next_emb: list[list[int]] | None = None  # rows mode: per rank, what EMBED_FWD of t+1 waits on
    rows_prev: list[int] = []  # rows mode: the tasks the next step's bulk follows
    for t in range(iterations):
        gated = t > 0
        new_adam: dict[int, list[tuple[int, int, int]]] = {}
        # ---- forward deliveries and compute, interleaved in need order
        if next_emb is not None:
            emb_ready = next_emb
        elif first_delivery or not rows_mode:
            emb_ready = deliver(t, 0, ("embed",), W, gated)
        else:  # the executor delivered it before its first step
            emb_ready = [[] for _ in range(R)]
        last = [-1] * R
        act_src = [[-1] * (L + 2) for _ in range(R)]  # compute task producing layer l's input
        emb_fwd = []
        for r in range(R):
            v = b.task(Kind.EMBED_FWD, t, 0, r, -1, compute[r], tokens * m.hidden * 2)
            b.edges(emb_ready[r], v, EdgeKind.DATA)
            last[r] = v
            act_src[r][1] = v
            emb_fwd.append(v)
        bulk = (zero_grad_updates(t, rows_prev) if rows_mode and not m.tie_embeddings else [])
        fwd_tasks = [[-1] * (L + 2) for _ in range(R)]
        offloads = [[-1] * (L + 2) for _ in range(R)]

        def offload(r: int, layer: int, src: int, t: int = t, offloads: list = offloads):
            o = b.task(Kind.ACT_OFFLOAD, t, layer, r, -1, d2h[r], act_bytes[layer])
            b.edge(src, o, EdgeKind.DATA)
            offloads[r][layer] = o

        for layer in range(1, L + 1):
            ready = deliver(t, layer, ("slot", (layer - 1) % W), (layer - 1) % W, gated)
            for r in range(R):
                if act_bytes[layer] > 0 and not keeps_more[layer]:
                    offload(r, layer, act_src[r][layer])
                v = b.task(Kind.FWD, t, layer, r, -1, compute[r], lf["fwd"] * tokens)
                b.edges(ready[r], v, EdgeKind.DATA)
                b.edge(last[r], v, EdgeKind.DATA)
                last[r] = v
                fwd_tasks[r][layer] = v
                act_src[r][layer + 1] = v
                readers[("slot", (layer - 1) % W, r)] = [v]
                if act_bytes[layer] > 0 and keeps_more[layer]:
                    offload(r, layer, v)
        head_ready = deliver(t, head_u, ("head",), W + 1, gated)
        head_tasks = []
        for r in range(R):
            v = b.task(Kind.HEAD_LOSS, t, head_u, r, -1, compute[r], (hf["fwd"] + hf["bwd"]) * tokens)
            b.edges(head_ready[r], v, EdgeKind.DATA)
            b.edge(last[r], v, EdgeKind.DATA)
            last[r] = v
            head_tasks.append(v)
            readers[("head", r)] = [v]
        new_adam[head_u] = reduce_and_update(t, head_u, head_tasks, None)
        # tied with embedding_rows: the head's share of every row, after HEAD_LOSS, its chunks
        # spread over the backward (a few after each layer's), so that the update workers and
        # the download ring never stall the backward on the whole bulk at once
        bulk_path = (gradient_path(t, 0, head_tasks, None, False, bulk_extra)
                     if rows_mode and m.tie_embeddings else iter(()))
        bulk_per_layer = -(-len(gr_plans[0]) // L)

        def spread_bulk(n: int | None, path=bulk_path, out=bulk, after=rows_prev):
            for a, lo, hi in itertools.islice(path, n):
                b.edges(after, a, EdgeKind.DATA)
                out.append((a, lo, hi))
        # ---- backward
        bwd_tasks = [[-1] * (L + 2) for _ in range(R)]
        for layer in range(L, 0, -1):
            resident = layer > L - W
            ready = None if resident else deliver(t, layer, ("slot", (layer - 1) % W), (layer - 1) % W,
                                                  False)
            for r in range(R):
                reload = -1
                if act_bytes[layer] > 0:
                    reload = b.task(Kind.ACT_RELOAD, t, layer, r, -1, h2d[r], act_bytes[layer],
                                    buffer=layer % plan.reload_ahead_layers)
                    b.edge(offloads[r][layer], reload, EdgeKind.DATA)
                    ahead = layer + plan.reload_ahead_layers
                    if ahead <= L:
                        b.edge(bwd_tasks[r][ahead], reload, EdgeKind.BUFFER)
                srcs = [fwd_tasks[r][layer]] if ready is None else ready[r]
                if recompute[layer]:
                    rc = b.task(Kind.RECOMPUTE, t, layer, r, -1, compute[r],
                                costs[layer].recompute_flops * tokens)
                    b.edges(srcs, rc, EdgeKind.DATA)
                    b.edge(last[r], rc, EdgeKind.DATA)
                    if reload >= 0:
                        b.edge(reload, rc, EdgeKind.DATA)
                    last[r] = rc
                v = b.task(Kind.BWD, t, layer, r, -1, compute[r], lf["bwd"] * tokens,
                           buffer=layer % plan.grad_buffers)
                b.edge(last[r], v, EdgeKind.DATA)
                if not recompute[layer]:
                    b.edges(srcs, v, EdgeKind.DATA)
                    if reload >= 0:
                        b.edge(reload, v, EdgeKind.DATA)
                # the gradient buffer this layer writes must be drained by its previous user
                b.edges(readers.get(("grad", layer % plan.grad_buffers, r), []), v, EdgeKind.BUFFER)
                last[r] = v
                bwd_tasks[r][layer] = v
                readers[("slot", (layer - 1) % W, r)] = [v]
            new_adam[layer] = reduce_and_update(
                t, layer, [bwd_tasks[r][layer] for r in range(R)], ("grad", layer % plan.grad_buffers))
            spread_bulk(bulk_per_layer)
        spread_bulk(None)
        if rows_mode:  # the next step's embedding, after its readers in this step
            for r in range(R):
                readers[("embed", r)] = [head_tasks[r] if m.tie_embeddings else emb_fwd[r]]
            first = b.n
            next_bulk = deliver(t, 0, ("embed",), W, True, gates=bulk)
            # the host-side readers of the bulk delivery: CASTs of the master, or with
            # host_bf16_copy the H2Ds of the copy, which the rows update rewrites
            reader = Kind.H2D if plan.host_bf16_copy else Kind.CAST
            bulk_casts = [v for v in range(first, b.n) if b.cols["kind"][v] == reader]
        emb_bwd = []
        for r in range(R):
            v = b.task(Kind.EMBED_BWD, t, 0, r, -1, compute[r], tokens * m.hidden * 2)
            b.edge(last[r], v, EdgeKind.DATA)
            emb_bwd.append(v)
            if not rows_mode:
                readers[("embed", r)] = [v]
        if rows_mode:
            rows_adams = reduce_and_update(t, 0, emb_bwd, None, rows=True)
            for a, _, _ in rows_adams:  # the bulk restored the rows' state; it read the master
                b.edges([x for x, _, _ in bulk] + bulk_casts, a, EdgeKind.DATA)
            first = b.n
            rows_ready = deliver_rows(t, rows_adams, next_bulk)
            next_emb = [next_bulk[r] + rows_ready[r] for r in range(R)]
            # what the next bulk must not overtake: the rows update, and whatever read the
            # host state it changes (the rows' CASTs; the bulk's CASTs or copy H2Ds)
            rows_prev = [a for a, _, _ in rows_adams] + bulk_casts + [
                v for v in range(first, b.n) if b.cols["kind"][v] == Kind.CAST]
        else:
            new_adam[0] = reduce_and_update(t, 0, emb_bwd, None)
        prev_adam = deferred_updates(t) if plan.defer_update else new_adam

    if plan.step_join:
        _join_steps(b, iterations)
    c = b.cols
    g = TaskGraph(
        kind=np.asarray(c["kind"], np.int8), iteration=np.asarray(c["iteration"], np.int32),
        unit=np.asarray(c["unit"], np.int32), rank=np.asarray(c["rank"], np.int32),
        chunk=np.asarray(c["chunk"], np.int32), agent=np.asarray(c["agent"], np.int32),
        work=np.asarray(c["work"], np.float64), elem_lo=np.asarray(c["elem_lo"], np.int64),
        elem_hi=np.asarray(c["elem_hi"], np.int64), threads=np.asarray(c["threads"], np.float64),
        op=np.asarray(c["op"], np.int8), buffer=np.asarray(c["buffer"], np.int32),
        edge_src=np.asarray(b.es, np.int64), edge_dst=np.asarray(b.ed, np.int64),
        edge_kind=np.asarray(b.ek, np.int8), edge_gate=np.asarray(b.eg, bool),
        agents=b.agents, agent_tasks=[np.asarray(x, np.int64) for x in b.agent_tasks],
        n_iterations=iterations, n_ranks=R, unit_params=list(units),
        rows=np.asarray(c["rows"], bool),
        meta=GraphMeta(
            cast_threads=cast_threads, update_threads=update_threads,
            teams_chunk_bytes=teams_chunk_bytes(plan, R), update_workers=n_workers,
            sharded_upload=sharded, scatter_update=scatter,
            cast_share=team_share(cast_threads, cores),
            update_share=team_share(worker_threads, cores), grad_ring_chunks=ring_sizes,
            recompute_hbm_bytes=recompute_hbm, adam_writes_copy=plan.host_bf16_copy,
            embedding_rows_elems=rows_elems, grad_wire_bytes=wire,
            embedding_grad_align=m.hidden if rows_mode else 1),
    )
    return g


def _join_steps(b: _Builder, iterations: int) -> None:
    """JOIN edges from each agent's last task of step t to each agent's first task of step t+1."""
    its = b.cols["iteration"]
    for t in range(1, iterations):
        last = [max((v for v in tasks if its[v] == t - 1), default=-1) for tasks in b.agent_tasks]
        first = [min((v for v in tasks if its[v] == t), default=-1) for tasks in b.agent_tasks]
        for f in first:
            for lt in last:
                if f >= 0 and lt >= 0:
                    b.edge(lt, f, EdgeKind.JOIN)
