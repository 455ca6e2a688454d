"""The executor engine: an interpreter of the task graph's per-iteration template.

`build_graph(workload, plan, cores, iterations=1)` is the schedule, for R = workload.gpus ranks.
R = 1 runs in the calling process. R > 1 runs in R rank processes started by torchrun
(dist/launch.py), each with a DistSession (dist/session.py) and one Engine interpreting the same
graph; each process runs the tasks it owns (dist/ownership.py: its rank's GPU agents, the
collectives, and the host tasks assigned to it). Every agent with local tasks (gpu{r}.compute,
gpu{r}.h2d, gpu{r}.d2h, fabric, cpu.cast0, cpu.update{w}) is a worker thread, created once, that
walks its local tasks (template.py) in order each step; a task first waits for its predecessors
on other agents (ORDER is the walk itself), then runs one small function per Kind (the
`_run_<kind>` methods below). Each step issues the same template again and ends with a join.

Process contract (R > 1). State lives once per host, in shared memory every process maps:
the HostState (FP32 master, Adam m and v, step counts), the staging ring, every (rank, worker)
gradient ring, and `done`, one int64 completion counter per template task. The task owner
writes done[v] = the step's sequence number when v is complete: a CPU task when it returns, a
GPU task when its end event has completed (a notifier thread synchronizes the event; in sync
mode the task's own thread does). A task waiting on a predecessor of another process polls
done[u] >= seq (sleeping 20 us doubling to 1 ms), gives up with _Aborted when a local task
failed, with PeerFailure when the status block names a failed peer, and with TimeoutError after
the session's timeout. On x86 the stores are seen in program order (TSO), so data written before
the counter is visible to whoever sees the counter. These are the graph's cross-process edges:
H2D of rank r after the CAST into shared staging, CAST reusing a staging chunk after every
rank's H2D of it, HOST_SUM (cpu route) after every rank's D2H, a D2H reusing a gradient ring slot
after its reader. Collectives need no counters: all processes issue them in the graph's order on
their fabric thread, and a collective waits only for its local predecessors (the collective joins
the other ranks'). Ids are a topological order and every agent walks in id order, so the
processes cannot deadlock.

Stream contract (device = cuda). Each GPU agent and the fabric agent (the comm thread) owns one
CUDA stream; every task's work is enqueued on its agent's stream and followed by a per-task
`end` CUDA event (plus a `start` event for the measured Timeline). A per-step threading.Event
`issued[v]` is set once task v's work is enqueued (GPU agents) or finished (CPU agents).
Waiting on a local predecessor u:
    GPU task after GPU task     host waits issued[u], then stream.wait_event(end[u])  (no host sync)
    CPU task after GPU task     host waits issued[u], then end[u].synchronize()  (the host must
                                see the bytes: CAST reusing a staging chunk after its H2D, ADAM
                                reading a gradient chunk after its D2H)
    any task after CPU task     host waits issued[u] (the CPU work is done), then enqueues
Host synchronisations are exactly those CPU-after-GPU waits, the notifier's waits for tasks
another process waits on, and two at the step boundary: torch.cuda.synchronize() after the
inputs are uploaded (so the Timeline's reference event is recorded on an idle GPU) and after the
join (loss, Timeline). Tensors that cross streams are reserved at construction (slots, gradient
buffers, rings, the activation offload's host, reload and tail buffers), except a kept
activation handed to ACT_OFFLOAD, which is record_stream()-ed on the D2H stream. Collectives run
on the comm stream (dist/collectives.py).
On the CPU (device = cpu, gloo) the same code runs: "streams" are the agent threads themselves,
copies are plain copies done synchronously, and issued[v] means done.

Step boundary: step() returns after every local task of the step has finished and, with R > 1,
after the step-end sum of loss and squared gradient norm across processes (a gloo all-reduce:
every process has then finished the step; local rank 0 counts the step in the shared step
counters just before it). So the version gate I3 (next step's CAST/H2D of a unit after this
step's ADAM of it) holds in every process, as do the cross-step reuses of buffers and counters.
What it costs: the next step's first delivery is the embedding, whose gradient comes last, so it
waits for the embedding's ADAM either way; only the ADAM tails of other units could have
overlapped the next step's first deliveries. With plan.embedding_rows (exec/embedding_rows.py,
docs/embedding-rows.md) each step delivers the NEXT step's embedding: every row during the
backward, then the rows the batch looked up, the only part left on the boundary; the engine
delivers it once itself before its first step and after a failed step (host_state_changed()
after writing the host state between steps).

Python's cyclic garbage collector: a step allocates a few objects per task (records, host
times; the per-task threading events are the engine's, reused and cleared each step, as making
them cost ~15 us each on the step's clock), and every few steps that garbage triggered a full
collection, which walks every object the process holds (the model's modules, the template, the
buffers' wrappers: some 10^5 to 10^6) with the GIL held, stalling every agent thread, the one
that launches the GPU's kernels included. Measured on the CPU (benchmarks/gc_probe.py: a
36-layer model, 7391 tasks, 371k objects): a full collection every 2 steps, 158 ms each; on
nvidia-h200, one step in five to eight took ~0.2 s longer than its neighbours
(benchmarks/RESULTS.md). So after its first step the engine collects once and freezes what is
alive then (gc.freeze: long-lived objects leave the generations the collector walks); a full
collection then walks only the newer objects (0.7-1.7 ms in the same probe). close()
unfreezes them (gc.freeze is process-wide: every frozen object, the caller's too, goes back to
the collector).

Data: every process gets the same global batch; rank r computes rows [r P, (r+1) P) with
P = accum_steps x micro_batch. Compute tasks cover all of a rank's micro-batches for their unit
(layer-major):
    EMBED_FWD   embeds every micro-batch; keeps layer 1's input
    FWD(l)      runs every micro-batch through layer l under layer l's activation policy
                (plan.policy_of(l), slidedp.spec.segments; policy_runner.py): "layer" without
                autograd; the others build one autograd graph per micro-batch, keeping what
                autograd saves outside the segments / ops the policy recomputes and the tensors
                its recompute starts from ("none" keeps all autograd saves); keeps layer l+1's
                input
    HEAD_LOSS   final norm + chunked linear/cross-entropy (loss.py), forward and backward
    RECOMPUTE(l) (only where the policy recomputes something) re-runs, with autograd, what the
                policy recomputes, for micro-batch 0: the whole layer from its input ("layer"),
                or the segments / ops it did not keep, from the nearest kept tensors; BWD(l)
                takes the micro-batches in turn: recomputes b (b = 0 was done by RECOMPUTE),
                back-propagates it (one autograd.grad per micro-batch, whatever the policy) and
                drops what b kept, so one micro-batch's recomputed graph is alive at a time
                (memory.py's `transient` term); the gradients of all micro-batches accumulate in
                the gradient buffer
    ACT_OFFLOAD(l) / ACT_RELOAD(l)  ratio plan.offload_ratio of what layer l keeps (its input
                included, never parameters, which live in slots) goes to pinned host buffers
                after the task that produced it (the producer of its input when it keeps only
                that, else FWD(l)) and comes back into a reload buffer before RECOMPUTE(l) or
                BWD(l) (activations.py: entries, buffers reserved at construction from one
                forward per distinct policy)
    EMBED_BWD   scatters the input gradients into the embedding's gradient
Loss = mean over the non-ignored tokens of the GLOBAL batch (labels shifted as HF does); each
rank's gradient is scaled by the global count, so their sum (REDUCE or HOST_SUM) is the
gradient of the global batch.

Gradient norm: whoever produces an aggregated gradient chunk writes its sum of squares into
`sq[tpl.norm_slot[v]]`, one FP32 entry per producer in host memory (shared with R > 1): a D2H
read by ADAM directly (on the GPU it squares the widened FP32 chunk there and copies the scalar
back behind the chunk, so the host makes one pass over the gradient, Adam's; on the CPU a host
dot) or a HOST_SUM (a host dot of the sum). The reported grad_norm is the exact unclipped norm:
each process sums the entries it wrote, then the step-end all-reduce.

Gradient clipping (AdamWConfig.grad_clip = max_norm), exactly as
torch.nn.utils.clip_grad_norm_(params, max_norm) before torch.optim.AdamW: the engine runs the
plan with defer_update (it sets it), so every ADAM of the step comes after every chunk producer
of the step (graph/build.py: DATA edges to the first ADAM of each update worker, waited on
locally or through the shared counters). That first ADAM sums all of sq in float64 (every entry
is final: its producer is a predecessor, in this process or another) and takes
coef = min(1, max_norm / (norm + 1e-6)); every ADAM of the worker multiplies its FP32 gradient
by coef when coef < 1 (adamw.adamw_chunk: in place, or in the widened block of a BF16 chunk), as
clip_grad_norm_ multiplies the gradients (torch._fused_adamw_'s grad_scale would divide by 1/coef
instead: not the same rounding). Every worker of every process computes the same coef from the
same entries in the same order, so R ranks, any route, clip alike. Cost: the rings the ADAMs read
hold a whole step's gradient (+2 B/param of host memory as BF16, +4 as FP32: model/memory.py),
the update no longer overlaps backward (the CPU update is exposed after it), and a clipped FP32
gradient takes one more pass (read + write).

Skipping non-finite steps (skip_nonfinite=True, `slidedp train --skip-nonfinite N`): the same
deferred schedule; where the first ADAM of a worker finds the norm NaN or Inf it marks the step
skipped for its worker, and every ADAM of the step returns without touching the host state
(master, m, v, the parameter copy). The step's per-unit update counts are then not advanced
either: local rank 0 counts them after the step-end all-reduce, when the global norm is known,
followed by a barrier so that no process reads the counts of the next step before. Every worker
of every process decides from the same entries, so all skip alike; StepResult.skipped says so.
A non-finite loss comes with a non-finite gradient (its backward), so the norm decides.
"""

from __future__ import annotations

import gc
import math
import queue
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext, suppress
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from slidedp.exec.activations import KeptActivations
from slidedp.exec.adamw import AdamWConfig, adamw_chunk
from slidedp.exec.dist.collectives import Collectives
from slidedp.exec.dist.ownership import process_threads, task_owners
from slidedp.exec.dist.session import DistSession, PeerFailure
from slidedp.exec.embedding_rows import EmbeddingRows
from slidedp.exec.host_state import HostState
from slidedp.exec.layer_runner import Attention, ModelRunner, PerMicroBatch
from slidedp.exec.loss import IGNORE_INDEX, shift_labels
from slidedp.exec.policy_runner import LayerState, PolicyRunner, kept_layout
from slidedp.exec.staging import HostRings, PinnedPool
from slidedp.exec.template import Template
from slidedp.exec.window import Window
from slidedp.graph.build import build_graph
from slidedp.graph.tasks import Kind
from slidedp.graph.timeline import Record, Timeline, union_intervals
from slidedp.spec.cores import host_cores
from slidedp.spec.elements import FP32_BYTES
from slidedp.spec.errors import SpecError
from slidedp.spec.plan import Plan
from slidedp.spec.segments import parse_policy
from slidedp.spec.workload import Workload

MODES = ("overlap", "sync")
_POLL_S = 0.05  # how often a waiting worker checks whether another worker failed
_REMOTE_POLL_S = (2e-5, 1e-3)  # first and longest sleep while polling a shared counter
READS_SLOT = frozenset({Kind.EMBED_FWD, Kind.FWD, Kind.HEAD_LOSS, Kind.RECOMPUTE, Kind.BWD})

# probe(iteration, kind, unit, slot): called before a compute task reads its unit's slot
Probe = Callable[[int, Kind, int, torch.Tensor], None]


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    step_time_s: float
    channel_s: dict[str, float]  # per channel: seconds at least one of its tasks was running
    gpu_peak_bytes: int | None  # torch.cuda.max_memory_reserved, None on the CPU
    timeline: Timeline  # this process's tasks, times relative to origin_s
    origin_s: float = 0.0  # time.perf_counter() at the step's start (CLOCK_MONOTONIC: one clock per host)
    skipped: bool = False  # skip_nonfinite: the norm was not finite, the update skipped


class _Aborted(Exception):
    """Raised in a worker waiting on a task of a worker that failed."""


class _StepState:
    """Everything one step's tasks share (inputs, activations in flight, accumulators)."""

    def __init__(self, issued: list[threading.Event], workers: int, seq: int):
        """issued: one event per template task, the engine's, reused by every step (creating
        them took ~15 us each, on the step's clock): cleared here, when no thread of the previous
        step is left (step() returns only once every agent has finished its tasks)."""
        self.seq = seq  # this step's number, 1-based: the value of a completed task's counter
        for e in issued:
            e.clear()
        self.issued = issued
        n_tasks = len(issued)
        self.host_s = [(0.0, 0.0)] * n_tasks
        self.error: BaseException | None = None
        self.clip = [1.0] * workers  # per update worker: the clipping coefficient of this step
        self.skip = [False] * workers  # per update worker: skip_nonfinite found the norm non-finite
        self.adam_step: list[int] = []  # per unit: its update count including this step's
        self.cur: list[torch.Tensor] = []  # per micro-batch: hidden states / their gradients
        self.layers: dict[tuple[int, int], LayerState] = {}  # (layer, mb): forward -> backward
        self.ids: list[torch.Tensor] = []  # per micro-batch, on the device
        self.targets: list[torch.Tensor] = []  # per micro-batch, shifted labels, flat
        self.rope: Attention | PerMicroBatch | None = None  # RoPE tables (and packed rows' masks)
        self.loss: torch.Tensor | None = None  # device scalar, summed by HEAD_LOSS
        self.lr = 0.0
        self.scale = 0.0  # 1 / non-ignored tokens of the global batch
        self.remaining = 0
        self.done = threading.Condition()


class Engine:
    """Host-streaming training of one transformers decoder model; see the module docstring.

    With workload.gpus = R > 1, pass the process's DistSession and the HostState it made
    (session.host_state); the device is the session's. `probe` is for instrumented tests (it
    may synchronize the device). With plan.embedding_rows each step delivers the next step's
    embedding: after changing the host state between steps of a live engine, call
    host_state_changed(). `packed`: steps pass position_ids (rows holding several documents,
    layer_runner.py).
    """

    def __init__(self, model_config, workload: Workload, plan: Plan, *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, mode: str = "overlap",
                 optimizer: AdamWConfig, host_state: HostState | None = None,
                 session: DistSession | None = None, probe: Probe | None = None,
                 packed: bool = False, skip_nonfinite: bool = False):
        """Without `host_state` the engine creates one (eng.host_state: the caller closes it);
        if the construction then fails, that one is closed here (its shared memory removed)."""
        self._created_state: HostState | None = None
        self.skip_nonfinite = skip_nonfinite
        try:
            self._build(model_config, workload, plan, device, dtype, mode, optimizer, host_state,
                        session, probe, packed)
        except BaseException:
            if self._created_state is not None:
                self._created_state.close()
            raise

    def _build(self, model_config, workload: Workload, plan: Plan, device: str,
               dtype: torch.dtype, mode: str, optimizer: AdamWConfig,
               host_state: HostState | None, session: DistSession | None,
               probe: Probe | None, packed: bool) -> None:
        if mode not in MODES:
            raise SpecError("engine", "mode", f"one of {', '.join(MODES)}, got {mode!r}")
        R = workload.gpus
        if optimizer.grad_clip is not None or self.skip_nonfinite:  # both need the norm first
            plan = replace(plan, defer_update=True)  # (module docstring)
        if (session.world_size if session else 1) != R:
            raise SpecError("engine", "session", f"a DistSession of workload.gpus = {R} rank "
                            "processes (start them with slidedp.exec.dist.launch)")
        if session is not None and host_state is None:
            raise SpecError("engine", "host_state", "the session's shared host state "
                            "(DistSession.host_state)")
        if not plan.step_join:
            raise SpecError("plan", "step_join", "true: the executor joins every agent at the step "
                            "boundary (see 'Step boundary' above)")
        self.session, self.probe, self.R = session, probe, R
        self.rank = session.rank if session else 0
        self.device = session.device if session else torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype, self.mode, self.opt, self.wl, self.plan = dtype, mode, optimizer, workload, plan
        self.runner = ModelRunner(model_config, self.device, dtype, plan.kernels, packed=packed)
        layouts = self.runner.layouts
        numels = [lay.numel for lay in layouts]
        if numels != workload.model.unit_params():
            raise SpecError("workload", "model", f"a model whose units have {numels} parameters "
                            f"(the config's), got {workload.model.unit_params()}")
        cores = host_cores()  # the count the profile wrote: the predicted graph is this one
        self.split_embedding = plan.splits_embedding  # embedding_rows (off when deferred)
        g = build_graph(workload, plan, cores, iterations=1,
                        first_delivery=not self.split_embedding)
        self.tpl = tpl = Template(g, task_owners(g, plan), self.rank)
        self.n_workers = g.meta.update_workers
        scatter = g.meta.scatter_update
        copy_dtype = dtype if plan.host_bf16_copy else None
        if host_state is None:
            host_state = self._created_state = HostState.create(numels, copy_dtype)
        if host_state.unit_numels != numels or host_state.copy_dtype != copy_dtype:
            raise SpecError("engine", "host_state", f"units {numels} with a parameter copy of "
                            f"dtype {copy_dtype}, got {host_state.unit_numels} / {host_state.copy_dtype}")
        self.host_state = host_state
        self.iteration = 0
        if session is not None:
            torch.set_num_threads(session.num_threads
                                  or process_threads(plan, cores, R, self.rank, scatter))
        self._process_threads = torch.get_num_threads()

        # ---- reserve: buffers, streams, events, workers (nothing of this is allocated later)
        self.pool = PinnedPool(pin=self.cuda)
        if self.cuda:
            torch.cuda.set_device(self.device)
            host_state.pin()
        ring_chunks = g.meta.grad_ring_chunks
        grad_chunks = {key: ring_chunks[key]
                       for key in sorted({key for srcs in tpl.grad_src for key, _ in srcs})}
        staging_elems, grad_elems = tpl.largest(Kind.CAST), tpl.largest(Kind.D2H)
        staging_numel = plan.staging_chunks * staging_elems
        grad_numel = HostRings.grad_numel(grad_chunks, grad_elems)
        # downloaded gradients: FP32, or the compute dtype widened by the update (plan.grad_widen)
        wire_dtype = torch.float32 if g.meta.grad_wire_bytes == FP32_BYTES else dtype
        if session is None:
            staging_flat = self.pool.empty(staging_numel, dtype)
            grad_flat = self.pool.empty(grad_numel, wire_dtype)
            self.sq = torch.empty(tpl.n_norm, dtype=torch.float32, pin_memory=self.cuda)
        else:
            staging_flat = self.pool.register(session.shared_tensor("staging", staging_numel, dtype))
            grad_flat = self.pool.register(session.shared_tensor("grads", grad_numel, wire_dtype))
            self.sq = self.pool.register(session.shared_tensor("gradsq", tpl.n_norm, torch.float32))
        local_workers = sorted({tpl.worker[v] for v in range(tpl.n)
                                if tpl.local[v] and tpl.kind[v] == Kind.ADAM})
        self.rings = HostRings(staging_flat, plan.staging_chunks, staging_elems, grad_flat,
                               grad_chunks, grad_elems,
                               local_workers if any(tpl.summed) and not plan.defer_update else [],
                               grad_elems)
        # D2H widens a gradient chunk to FP32 on the GPU (one buffer per D2H stream: its stream
        # order keeps the next widening behind the previous copy) and, where the chunk is the
        # aggregated gradient, squares it into sq_dev there, copied back into sq (module
        # docstring, "Gradient norm"): the host makes one pass over the gradient (Adam's). With
        # BF16 rings it downloads the BF16 chunk itself (the embedding bulk's, whose looked-up
        # rows are zeroed in the FP32 copy, narrowed again into d2h_narrow: exact).
        self.d2h_fp32 = (torch.empty(grad_elems, device=self.device, dtype=torch.float32)
                         if self.cuda else None)
        self.d2h_narrow = (torch.empty(grad_elems, device=self.device, dtype=dtype)
                           if self.cuda and wire_dtype != torch.float32 and self.split_embedding
                           and self.runner.tied else None)  # an untied bulk downloads nothing
        self.sq_dev = (torch.empty(tpl.n_norm, device=self.device, dtype=torch.float32)
                       if self.cuda else None)
        self.local_sq = torch.tensor([tpl.norm_slot[v] for v in range(tpl.n)
                                      if tpl.local[v] and tpl.norm_slot[v] >= 0], dtype=torch.long)
        # where the norm is read (clipping, skipping): the first ADAM of each update worker
        self.clip_at = set() if optimizer.grad_clip is None and not self.skip_nonfinite else {
            int(ts[g.kind[ts] == Kind.ADAM][0]) for ts in g.agent_tasks
            if (g.kind[ts] == Kind.ADAM).any()}
        self._done = (session.shared_tensor("done", tpl.n, torch.int64).numpy()
                      if session is not None else None)
        self.window = Window(layouts, plan.window_slots, plan.grad_buffers, self.device, dtype,
                             embedding_grad=self.runner.tied or not self.split_embedding)
        self.coll = (Collectives(self.window, R, self.rank, scatter, self.device, dtype)
                     if R > 1 else None)
        # what each layer's policy keeps: its entry sizes from one forward per distinct policy
        self.policies = [None] + [parse_policy(plan.policy_of(layer))
                                  for layer in range(1, self.runner.n_layers + 1)]
        self.layer_runner = PolicyRunner(self.runner, None)
        x = torch.zeros(workload.micro_batch, workload.seq_len, self.runner.hidden,
                        device=self.device, dtype=dtype)
        layout = {p: kept_layout(self.layer_runner, p, self.window.params(1), x,
                                 self.runner.rope(workload.seq_len))
                  for p in set(self.policies[1:])}
        self.acts = self.layer_runner.acts = KeptActivations(
            [layout[p] for p in self.policies[1:]], workload.accum_steps, plan.offload_ratio,
            plan.reload_ahead_layers, self.device, self.pool)
        self.emb_rows = None
        self._embedding_delivered = False  # split embedding: a step delivers the next one's
        self._gc_frozen = False  # set after the first step (_freeze_long_lived)
        self._issued = [threading.Event() for _ in range(self.tpl.n)]  # per task, every step
        if self.split_embedding:
            rows_cast = int((g.elem_hi - g.elem_lo)[g.rows & (g.kind == Kind.CAST)].max())
            self.emb_rows = EmbeddingRows(
                self.runner.vocab, self.runner.hidden, g.meta.embedding_rows_elems //
                self.runner.hidden, tpl.largest(Kind.ADAM), rows_cast, local_workers,
                self.device, dtype, zero_grad=not self.runner.tied)
        names = tpl.agent_names
        self.streams = [torch.cuda.Stream(self.device) if self.cuda and tpl.is_gpu_agent[a]
                        else None for a in range(len(names))]
        gpu_tasks = [v for v in range(tpl.n) if tpl.local[v] and tpl.on_gpu(v)] if self.cuda else []
        self.ev_start = {v: torch.cuda.Event(enable_timing=True) for v in gpu_tasks}
        self.ev_end = {v: torch.cuda.Event(enable_timing=True) for v in gpu_tasks}
        self.ev_ref = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self._queues: list[queue.Queue] = []
        self._threads: list[threading.Thread] = []
        if mode == "overlap":
            loops = [(self._agent_loop, a, names[a]) for a in range(len(names))
                     if tpl.local_tasks[a]]
            if self.cuda and session is not None:
                loops.append((self._notifier_loop, -1, "notifier"))
            for target, a, name in loops:
                q: queue.Queue = queue.Queue()
                t = threading.Thread(target=target, args=(a, q), daemon=True, name=f"slidedp-{name}")
                t.start()
                self._queues.append(q)
                self._threads.append(t)
        self._notify = self._queues[-1] if self.cuda and session and mode == "overlap" else None

    # ---- public -------------------------------------------------------------------------------

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
             lr: float | None = None, position_ids: torch.Tensor | None = None) -> StepResult:
        """One optimizer step on a global batch: input_ids (global_batch, seq_len) int64 on CPU;
        position_ids, of the same shape, only for a packed engine (a document starts where it
        is 0).

        With R ranks every process passes the same global batch (see "Data")."""
        wl = self.wl
        if tuple(input_ids.shape) != (wl.global_batch, wl.seq_len):
            raise ValueError(f"input_ids must be ({wl.global_batch}, {wl.seq_len}), "
                             f"got {tuple(input_ids.shape)}")
        labels = input_ids if labels is None else labels
        targets = shift_labels(labels)
        n_valid = int((targets != IGNORE_INDEX).sum())
        if n_valid == 0:
            raise ValueError("every label is ignored (-100): the loss is undefined")
        t0 = time.perf_counter()
        st = _StepState(self._issued, self.n_workers, self.iteration + 1)
        st.lr = self.opt.lr if lr is None else lr
        st.scale = 1.0 / n_valid
        st.adam_step = (self.host_state.steps + 1).tolist()
        mb, rows = wl.micro_batch, wl.accum_steps * wl.micro_batch
        mine = slice(self.rank * rows, (self.rank + 1) * rows)
        st.ids = input_ids[mine].to(self.device).split(mb)
        st.targets = [t.reshape(-1) for t in targets[mine].to(self.device).split(mb)]
        st.rope = self.runner.rope(wl.seq_len, None if position_ids is None else
                                   position_ids[mine].to(self.device).split(mb))
        st.loss = torch.zeros((), dtype=torch.float32, device=self.device)
        self.acts.reset()  # nothing is kept across steps (a failed step may have left entries)
        if self.emb_rows is not None:
            self.emb_rows.begin_step(input_ids, st.ids)
            if not self._embedding_delivered:
                self._deliver_embedding()
            self._embedding_delivered = False  # until this step has delivered the next one's
        if self.cuda:
            torch.cuda.synchronize(self.device)  # boundary sync (see the module docstring)
            self.ev_ref.record()
        t_ref = time.perf_counter()
        if self.mode == "overlap":
            st.remaining = len(self._threads) - (self._notify is not None)
            for q in self._queues:
                if q is not self._notify:
                    q.put(st)
            with st.done:
                st.done.wait_for(lambda: st.remaining == 0)
        else:
            for v in range(self.tpl.n):
                if not self.tpl.local[v]:
                    continue
                try:
                    self._task(st, v)
                except BaseException as e:  # noqa: BLE001 - blamed, then raised below
                    st.error = self._blame(e)
                    break
                if self.cuda:
                    torch.cuda.synchronize(self.device)
        if st.error is not None:
            if self.cuda:  # let the failed step's queued copies land before anything reuses
                # their buffers (the next step's delivery, its staging chunk); the step's own
                # error is the one to report
                with suppress(Exception):
                    torch.cuda.synchronize(self.device)
            raise st.error
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._embedding_delivered = True
        loss, sqnorm = float(st.loss), float(self.sq[self.local_sq].double().sum())
        counts = self.session is None or self.session.local_rank == 0  # rank 0 counts the updates
        if counts and not self.skip_nonfinite:
            self.host_state.steps += 1  # this step's update of every unit is done
        if self.session is not None:
            loss, sqnorm = self.session.all_reduce_sum([loss, sqnorm])
        skipped = self.skip_nonfinite and not math.isfinite(sqnorm)
        if self.skip_nonfinite:  # counted once the global norm is known (module docstring)
            if counts and not skipped:
                self.host_state.steps += 1
            if self.session is not None:
                self.session.barrier()
        t1 = time.perf_counter()
        timeline = self._timeline(st, t0, t_ref)
        self.iteration += 1
        if not self._gc_frozen:
            self._freeze_long_lived()
        return StepResult(
            loss=loss, grad_norm=math.sqrt(sqnorm), step_time_s=t1 - t0,
            channel_s=channel_busy_s(timeline),
            gpu_peak_bytes=torch.cuda.max_memory_reserved(self.device) if self.cuda else None,
            timeline=timeline, origin_s=t0, skipped=skipped)

    def host_state_changed(self) -> None:
        """The host state was written outside the steps: deliver the embedding again before the
        next step (plan.embedding_rows; every other unit is delivered by each step anyway)."""
        self._embedding_delivered = False

    def close(self) -> None:
        """Stop the workers and release pinned registrations (the HostState stays open)."""
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()
        self._queues.clear()
        self._threads.clear()
        self.pool.close()
        if self._gc_frozen:  # what this engine held may be collected again
            gc.unfreeze()
            self._gc_frozen = False

    def _freeze_long_lived(self) -> None:
        """After the first step ("Python's cyclic garbage collector" in the module docstring):
        collect once, then move every object alive now out of the collector's generations."""
        gc.collect()
        gc.freeze()
        self._gc_frozen = True

    def _deliver_embedding(self) -> None:
        """The embedding into this rank's slot, whole and synchronously, before the first step of
        a split embedding (and after a failed step), whose steps each deliver the next step's.
        Straight from the host state (pageable: a synchronous copy, once), a staging-ring chunk
        at a time; not through the ring, which the other ranks share."""
        src = self.host_state.unit_copy(0) if self.plan.host_bf16_copy else \
            self.host_state.unit_master(0)
        slot, step = self.window.slot(0), len(self.rings.staging[0])
        for lo in range(0, len(src), step):
            slot[lo:lo + step].copy_(src[lo:lo + step])
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # ---- the interpreter ---------------------------------------------------------------------

    def _agent_loop(self, a: int, q: queue.Queue) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        if self.cuda and (n := self._cpu_threads(a)) > 0:
            own_omp_team(n)
        while (st := q.get()) is not None:
            try:
                for v in self.tpl.local_tasks[a]:
                    self._task(st, v)
            except _Aborted:
                pass
            except BaseException as e:  # noqa: BLE001 - handed to step(), which re-raises it
                st.error = st.error or self._blame(e)
            finally:
                with st.done:
                    st.remaining -= 1
                    st.done.notify_all()

    def _cpu_threads(self, a: int) -> int:
        """Threads of CPU agent `a` (0 for a GPU agent): the graph's team for its tasks (cast
        threads, or update threads / workers), within this process's budget (Plan.threads: by
        default three quarters of the cores for each team, as the model assumes).
        Applied on GPUs only: on the CPU the compute agents need the cores too, and the CPU tests
        compare the overlapped and the synchronous modes bit for bit, which fixed per-thread
        OpenMP teams of different sizes could break in reductions."""
        tasks = self.tpl.local_tasks[a]
        if self.tpl.is_gpu_agent[a] or not len(tasks):
            return 0
        want = max(float(self.tpl.g.threads[v]) for v in tasks)
        return max(1, min(round(want), self._process_threads)) if want > 0 else 0

    def _notifier_loop(self, _a: int, q: queue.Queue) -> None:
        """Publishes GPU tasks that another process waits on, once their end event completed."""
        torch.cuda.set_device(self.device)
        while (item := q.get()) is not None:
            st, v = item
            try:
                self.ev_end[v].synchronize()
                self._done[v] = st.seq
            except BaseException as e:  # noqa: BLE001 - handed to step(), which re-raises it
                st.error = st.error or self._blame(e)

    def _blame(self, e: BaseException) -> BaseException:
        """The error to report. A peer's recorded failure wins (a collective fails when a peer
        dies); otherwise this rank failed: mark it in the status block, so every peer stops."""
        if self.session is None or isinstance(e, PeerFailure):
            return e
        peer = self.session.settled_peer_failure()
        if peer is not None:
            return PeerFailure(peer)
        self.session.fail(f"{type(e).__name__}: {e}")
        return e

    def _wait_remote(self, st: _StepState, u: int) -> None:
        """Wait until task u of another process completed this step (its shared counter)."""
        done, sess = self._done, self.session
        delay, longest = _REMOTE_POLL_S
        deadline = time.monotonic() + sess.timeout_s
        while done[u] < st.seq:
            if st.error is not None:
                raise _Aborted
            peer = sess.peer_failure()
            if peer is not None:
                raise PeerFailure(peer)
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank} waited {sess.timeout_s} s for "
                                   f"{self.tpl.g.label(u)} of rank {int(self.tpl.owner[u])}")
            time.sleep(delay)
            delay = min(2 * delay, longest)

    def _task(self, st: _StepState, v: int) -> None:
        tpl = self.tpl
        a = int(tpl.g.agent[v])
        stream = self.streams[a]
        for u in tpl.remote[v]:
            self._wait_remote(st, u)
        for u in tpl.preds[v]:
            while not st.issued[u].wait(_POLL_S):
                if st.error is not None:
                    raise _Aborted
            if self.cuda and tpl.on_gpu(u):
                if stream is not None:
                    stream.wait_event(self.ev_end[u])
                else:
                    self.ev_end[u].synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            if stream is not None:
                self.ev_start[v].record(stream)
            if self.probe is not None and tpl.kind[v] in READS_SLOT:
                u = int(tpl.g.unit[v])
                self.probe(self.iteration, tpl.kind[v], u, self.window.slot(u))
            self._RUN[tpl.kind[v]](self, st, v)
            if stream is not None:
                self.ev_end[v].record(stream)
        st.host_s[v] = (t0, time.perf_counter())
        st.issued[v].set()
        if tpl.publish[v]:
            self._publish(st, v)

    def _publish(self, st: _StepState, v: int) -> None:
        """done[v] = seq once v's work is complete (module docstring, "Process contract")."""
        if not (self.cuda and self.tpl.on_gpu(v)):
            self._done[v] = st.seq
        elif self._notify is not None:
            self._notify.put((st, v))
        else:  # sync mode
            self.ev_end[v].synchronize()
            self._done[v] = st.seq

    def _timeline(self, st: _StepState, t0: float, t_ref: float) -> Timeline:
        g, tl = self.tpl.g, Timeline(source=f"measured: slidedp.exec {self.mode} on {self.device}")
        for v in range(self.tpl.n):
            if not self.tpl.local[v]:
                continue
            issue = (st.host_s[v][0] - t0, st.host_s[v][1] - t0)  # the agent's host time
            if self.cuda and self.tpl.on_gpu(v):
                off = t_ref - t0
                s = off + self.ev_ref.elapsed_time(self.ev_start[v]) / 1e3
                e = off + self.ev_ref.elapsed_time(self.ev_end[v]) / 1e3
            else:
                s, e = issue
            tl.add(Record(self.iteration, self.tpl.kind[v].name, int(g.unit[v]), int(g.rank[v]),
                          int(g.chunk[v]), self.tpl.agent_names[int(g.agent[v])], s, e,
                          *(issue if self.tpl.on_gpu(v) else (None, None))))
        return tl

    # ---- one function per Kind ---------------------------------------------------------------

    def _range(self, v: int) -> tuple[int, int, int]:
        g = self.tpl.g
        return int(g.unit[v]), int(g.elem_lo[v]), int(g.elem_hi[v])

    def _run_cast(self, st, v):
        u, lo, hi = self._range(v)
        staging = self.rings.staging[int(self.tpl.g.buffer[v])]
        if self.tpl.g.rows[v]:
            j0, j1 = self.emb_rows.compact(lo, hi)
            if j1 > j0:
                self.emb_rows.rows_cast(staging, self.host_state.unit_master(0), j0, j1)
            return
        staging[:hi - lo].copy_(self.host_state.unit_master(u)[lo:hi])

    def _run_h2d(self, st, v):
        u, lo, hi = self._range(v)
        i = self.tpl.h2d_src[v]
        if self.tpl.g.rows[v]:
            j0, j1 = self.emb_rows.compact(lo, hi)
            if j1 > j0:
                self.emb_rows.rows_h2d(self.window.slot(0), self.rings.staging[i], j0, j1)
            return
        src = self.host_state.unit_copy(u)[lo:hi] if i < 0 else self.rings.staging[i][:hi - lo]
        self.window.slot(u)[lo:hi].copy_(src, non_blocking=True)

    def _run_embed_fwd(self, st, v):
        weight = self.window.params(0)["weight"]
        st.cur = []
        for b, ids in enumerate(st.ids):
            x = F.embedding(ids, weight)
            self._keep_input(st, 1, b, x)
            st.cur.append(x)

    def _keep_input(self, st, layer: int, b: int, x: torch.Tensor) -> None:
        self.acts.add(layer, b, x)

    @torch.no_grad()
    def _run_fwd(self, st, v):
        layer = int(self.tpl.g.unit[v])
        params = self.window.params(layer)
        for b, x in enumerate(st.cur):
            out, st.layers[(layer, b)] = self.layer_runner.forward(self.policies[layer], layer, b,
                                                                   params, x, st.rope)
            if layer < self.runner.n_layers:
                self._keep_input(st, layer + 1, b, out)
            st.cur[b] = out

    def _run_act_offload(self, st, v):
        self.acts.offload(int(self.tpl.g.unit[v]))

    def _run_act_reload(self, st, v):
        self.acts.reload_layer(int(self.tpl.g.unit[v]))

    def _run_head_loss(self, st, v):
        head_u = self.runner.n_layers + 1
        head, head_grad = self.window.params(head_u), self.window.grad_views(head_u)
        if self.runner.tied:
            weight = self.window.params(0)["weight"]
            grad_weight = self.window.grad_views(0)["weight"]
        else:
            weight, grad_weight = head["lm_head.weight"], head_grad["lm_head.weight"]
        grad_weight.zero_()
        for b, x in enumerate(st.cur):
            x = x.detach().requires_grad_()
            norm_w = head["norm.weight"].detach().requires_grad_()
            with torch.enable_grad():
                xn = self.runner.norm_forward(norm_w, x)
            loss, grad_xn = self.runner.head_loss(xn.detach().reshape(-1, xn.shape[-1]), weight,
                                                  st.targets[b], st.scale, grad_weight)
            gx, gw = torch.autograd.grad(xn, (x, norm_w), grad_xn.view_as(xn))
            _accumulate(head_grad["norm.weight"], gw, b)
            st.loss += loss
            st.cur[b] = gx
        if self.emb_rows is not None and self.runner.tied:
            self.emb_rows.gather_head(grad_weight)

    def _run_recompute(self, st, v):
        layer = int(self.tpl.g.unit[v])
        self.layer_runner.recompute(st.layers[(layer, 0)], self.window.params(layer), st.rope)

    def _run_bwd(self, st, v):
        layer = int(self.tpl.g.unit[v])
        grads, params = self.window.grad_views(layer), self.window.params(layer)
        for b in range(self.wl.accum_steps):
            state = st.layers.pop((layer, b))
            self.layer_runner.recompute(state, params, st.rope)  # done by RECOMPUTE for b = 0
            st.cur[b], got = self.layer_runner.backward(state, st.cur[b])
            del state
            self.acts.release(layer, b)
            for name, gp in got.items():
                _accumulate(grads[name], gp, b)

    def _run_embed_bwd(self, st, v):
        if self.emb_rows is not None:
            self.emb_rows.add_lookups(st.cur, st.ids, self.runner.padding_idx, self.runner.tied)
            st.cur = []
            return
        grad = self.window.grad_views(0)["weight"]
        if not self.runner.tied:  # tied: HEAD_LOSS already wrote the head's share
            grad.zero_()
        pad = self.runner.padding_idx
        for ids, gx in zip(st.ids, st.cur, strict=True):
            ids, gx = ids.reshape(-1), gx.reshape(-1, gx.shape[-1])
            if pad is not None:  # nn.Embedding(padding_idx) gives that row no gradient
                gx = gx * (ids != pad)[:, None].to(gx.dtype)
            grad.index_add_(0, ids, gx)
        st.cur = []

    def _run_allgather(self, st, v):
        self.coll.all_gather(int(self.tpl.g.unit[v]))

    def _run_reduce(self, st, v):
        if self.tpl.g.rows[v]:
            rows = self.emb_rows
            self.coll.reduce_rows(rows.grad.view(-1), rows.n * rows.h, rows.h)
            return
        u = int(self.tpl.g.unit[v])
        self.coll.reduce(u, self.tpl.g.meta.embedding_grad_align if u == 0 else 1)

    def _run_d2h(self, st, v):
        u, lo, hi = self._range(v)
        key = (int(self.tpl.g.rank[v]), self.tpl.worker[v])
        j = self.tpl.norm_slot[v]
        rows = self.emb_rows
        if self.tpl.g.rows[v]:  # this step's looked-up rows of the compact gradient
            j0, j1 = rows.compact(lo, hi)
            if j1 == j0:
                if j >= 0:
                    self.sq[j] = 0.0
                return
            lo, hi = j0 * rows.h, j1 * rows.h
            src = rows.grad.view(-1)[lo:hi]
        else:
            src = self.window.grad(u)[lo:hi]
        bulk = rows is not None and u == 0 and not self.tpl.g.rows[v]  # rows zeroed: counted once
        dst = self.rings.grad[key][int(self.tpl.g.buffer[v])][:hi - lo]
        if not self.cuda:
            dst.copy_(src)
            if bulk:
                rows.zero_looked_up(dst, lo, hi)
            if j >= 0:
                wide = dst.float()
                self.sq[j] = torch.dot(wide, wide)
            return
        wide = self.d2h_fp32[:hi - lo]
        wide.copy_(src)
        if bulk:
            rows.zero_looked_up(wide, lo, hi)
        if j >= 0:
            self.sq_dev[j].copy_(torch.dot(wide, wide))
            self.sq[j:j + 1].copy_(self.sq_dev[j:j + 1], non_blocking=True)
        if dst.dtype == torch.float32:
            dst.copy_(wide, non_blocking=True)
        elif bulk:
            dst.copy_(self.d2h_narrow[:hi - lo].copy_(wide), non_blocking=True)
        else:
            dst.copy_(src, non_blocking=True)

    def _run_host_sum(self, st, v):
        _, lo, hi = self._range(v)
        n = hi - lo
        if self.tpl.g.rows[v]:  # this step's looked-up rows of the chunk (what the D2Hs copied)
            j0, j1 = self.emb_rows.compact(lo, hi)
            n = (j1 - j0) * self.emb_rows.h
            if n == 0:
                self.sq[self.tpl.norm_slot[v]] = 0.0
                return
        acc = self.rings.host_sum(self.tpl.worker[v], self.tpl.grad_src[v], n,
                                  in_place=self.plan.defer_update)
        self.sq[self.tpl.norm_slot[v]] = torch.dot(acc, acc)

    def _run_adam(self, st, v):
        u, lo, hi = self._range(v)
        w, tpl = self.tpl.worker[v], self.tpl
        rows = self.emb_rows
        if tpl.g.rows[v]:
            j0, j1 = rows.compact(lo, hi)
            hi = lo + (j1 - j0) * rows.h
        if tpl.summed[v] and not self.plan.defer_update:
            g = self.rings.acc[w][:hi - lo]
        elif not tpl.grad_src[v]:  # the untied embedding's bulk: a zero gradient
            g = rows.zero[:hi - lo]
        else:
            (key, slot), = tpl.grad_src[v]
            g = self.rings.grad[key][slot][:hi - lo]
        if v in self.clip_at:  # every gradient chunk of the step is in: its producers precede v
            norm = math.sqrt(float(self.sq.double().sum()))
            st.skip[w] = self.skip_nonfinite and not math.isfinite(norm)
            if self.opt.grad_clip is not None:
                st.clip[w] = min(1.0, self.opt.grad_clip / (norm + 1e-6))
        if st.skip[w]:
            return
        hs = self.host_state
        if tpl.g.rows[v]:
            if j1 > j0:
                new = rows.rows_adam(w, hs.unit_master(0), hs.unit_m(0), hs.unit_v(0), g, j0, j1,
                                     st.adam_step[0], self.opt, st.lr, st.clip[w])
                if hs.copy is not None:
                    hs.unit_copy(0).view(-1, rows.h).index_copy_(0, rows.u[j0:j1], new.to(self.dtype))
            return
        p = hs.unit_master(u)[lo:hi]
        m, var = hs.unit_m(u)[lo:hi], hs.unit_v(u)[lo:hi]
        if rows is not None and u == 0:  # the bulk: the looked-up rows keep their state
            rows.bulk_adam(w, p, g, m, var, lo, st.adam_step[0], self.opt, st.lr, st.clip[w])
        else:
            adamw_chunk(p, g, m, var, st.adam_step[u], self.opt, st.lr, st.clip[w])
        if hs.copy is not None:
            hs.unit_copy(u)[lo:hi].copy_(p)

    # each task kind's function: unbound, so that an engine holds no reference cycle and is freed
    # (with its GPU and pinned buffers) as soon as its last reference goes
    _RUN = {Kind.CAST: _run_cast, Kind.H2D: _run_h2d, Kind.ALLGATHER: _run_allgather,
            Kind.EMBED_FWD: _run_embed_fwd, Kind.FWD: _run_fwd, Kind.ACT_OFFLOAD: _run_act_offload,
            Kind.ACT_RELOAD: _run_act_reload, Kind.HEAD_LOSS: _run_head_loss,
            Kind.RECOMPUTE: _run_recompute, Kind.BWD: _run_bwd, Kind.EMBED_BWD: _run_embed_bwd,
            Kind.REDUCE: _run_reduce, Kind.D2H: _run_d2h, Kind.HOST_SUM: _run_host_sum,
            Kind.ADAM: _run_adam}


def own_omp_team(threads: int) -> None:
    """Give the calling thread its own OpenMP team of `threads` for its later torch CPU ops.

    torch.set_num_threads sets the calling thread's OpenMP team size and a process-wide default,
    but a thread's first parallel op (or get_num_threads) re-initialises its team from that
    process-wide default unless the thread was initialised before: set alone, every worker ends
    up with the size the LAST worker set (a race: the GPU runs of 2026-11-30 ran every CPU agent
    with the update team's size). Initialising first makes the setting stick to this thread."""
    torch.get_num_threads()  # initialise this thread's team (from the process default)
    torch.set_num_threads(threads)


def _accumulate(dst: torch.Tensor, g: torch.Tensor, micro_batch: int) -> None:
    """Gradient accumulation over micro-batches: the first one writes, the others add."""
    if micro_batch == 0:
        dst.copy_(g)
    else:
        dst.add_(g)


def channel_busy_s(timeline: Timeline) -> dict[str, float]:
    """Seconds during which at least one task of each channel ran (union of its intervals)."""
    by: dict[str, list[tuple[float, float]]] = {}
    for r in timeline.records:
        by.setdefault(r.channel, []).append((r.start_s, r.end_s))
    return {ch: sum(e - s for s, e in union_intervals(iv)) for ch, iv in by.items()}
