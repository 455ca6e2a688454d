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
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from slidedp.exec.adamw import AdamWConfig
from slidedp.exec.buffers import Buffers, BufferSpec
from slidedp.exec.dist.ownership import process_threads, task_owners
from slidedp.exec.dist.session import DistSession
from slidedp.exec.features import FEATURES
from slidedp.exec.host_state import HostState
from slidedp.exec.interpreter import MODES, Interpreter, Step
from slidedp.exec.kernels import KERNELS, Context, StepData
from slidedp.exec.layer_runner import ModelRunner
from slidedp.exec.loss import IGNORE_INDEX, shift_labels
from slidedp.exec.policy_runner import PolicyRunner
from slidedp.exec.template import Template
from slidedp.graph.build import build_graph
from slidedp.graph.tasks import Kind
from slidedp.graph.timeline import Timeline, union_intervals
from slidedp.spec.errors import SpecError
from slidedp.spec.plan import Plan
from slidedp.spec.segments import parse_policy
from slidedp.spec.workload import Workload

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


class Engine:
    """Host-streaming training of one transformers decoder model; see the module docstring.

    With workload.gpus = R > 1, pass the process's DistSession and the HostState it made
    (session.host_state); the device is the session's. `probe` is for instrumented tests (it
    may synchronize the device). With plan.embedding_rows each step delivers the next step's
    embedding: after changing the host state between steps of a live engine, call
    host_state_changed().
    """

    def __init__(self, model_config, workload: Workload, plan: Plan, *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, mode: str = "overlap",
                 optimizer: AdamWConfig, host_state: HostState | None = None,
                 session: DistSession | None = None, probe: Probe | None = None):
        """Without `host_state` the engine creates one (eng.host_state), closed with the engine
        (or here, if the construction fails: its shared memory removed)."""
        self._created_state: HostState | None = None
        try:
            self._build(model_config, workload, plan, device, dtype, mode, optimizer, host_state,
                        session, probe)
        except BaseException:
            if self._created_state is not None:
                self._created_state.close()
            raise

    def _build(self, model_config, workload: Workload, plan: Plan, device: str,
               dtype: torch.dtype, mode: str, optimizer: AdamWConfig,
               host_state: HostState | None, session: DistSession | None,
               probe: Probe | None) -> None:
        plan = self._checked(workload, plan, mode, optimizer, host_state, session)
        self.session, self.R = session, workload.gpus
        self.rank = session.rank if session else 0
        self.device = session.device if session else torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype, self.mode, self.opt, self.wl, self.plan = dtype, mode, optimizer, workload, plan
        self.runner = runner = ModelRunner(model_config, self.device, dtype)
        numels = [lay.numel for lay in runner.layouts]
        if numels != workload.model.unit_params():
            raise SpecError("workload", "model", f"a model whose units have {numels} parameters "
                            f"(the config's), got {workload.model.unit_params()}")
        cores = os.cpu_count() or 1
        options = {key: val for F in FEATURES for key, val in F.graph_options(plan).items()}
        g = build_graph(workload, plan, cores, iterations=1, **options)
        self.tpl = tpl = Template(g, task_owners(g, plan), self.rank)
        self.host_state = self._host_state(host_state, numels, dtype if plan.host_bf16_copy
                                           else None)
        self.iteration = 0
        if session is not None:
            torch.set_num_threads(session.num_threads or process_threads(
                plan, cores, self.R, self.rank, g.meta.scatter_update))
        threads = torch.get_num_threads()
        if self.cuda:
            torch.cuda.set_device(self.device)
            self.host_state.pin()
        self._gc_frozen = False  # set after the first step (_freeze_long_lived)
        self.ctx = self._reserve()
        self.bufs = self.ctx.bufs
        self.interpreter = Interpreter(tpl, self._kernels(probe), mode=mode, device=self.device,
                                       session=session, done=self.bufs.done,
                                       process_threads=threads)

    @staticmethod
    def _checked(workload: Workload, plan: Plan, mode: str, optimizer: AdamWConfig,
                 host_state: HostState | None, session: DistSession | None) -> Plan:
        """The arguments checked; the plan the engine runs (as the features adjust it)."""
        if mode not in MODES:
            raise SpecError("engine", "mode", f"one of {', '.join(MODES)}, got {mode!r}")
        R = workload.gpus
        for F in FEATURES:
            plan = F.adjust(plan, optimizer)
        if (session.world_size if session else 1) != R:
            raise SpecError("engine", "session", f"a DistSession of workload.gpus = {R} rank "
                            "processes (start them with slidedp.exec.dist.launch)")
        if session is not None and host_state is None:
            raise SpecError("engine", "host_state", "the session's shared host state "
                            "(DistSession.host_state)")
        if not plan.step_join:
            raise SpecError("plan", "step_join", "true: the executor joins every agent at the step "
                            "boundary (see 'Step boundary' above)")
        return plan

    def _host_state(self, host_state: HostState | None, numels: list[int],
                    copy_dtype: torch.dtype | None) -> HostState:
        if host_state is None:
            host_state = self._created_state = HostState.create(numels, copy_dtype)
        if host_state.unit_numels != numels or host_state.copy_dtype != copy_dtype:
            raise SpecError("engine", "host_state", f"units {numels} with a parameter copy of "
                            f"dtype {copy_dtype}, got {host_state.unit_numels} / {host_state.copy_dtype}")
        return host_state

    def _reserve(self) -> Context:
        """The kernels' context with every buffer reserved (nothing of this is allocated later),
        the enabled features' included."""
        runner = self.runner
        policies = [None] + [parse_policy(self.plan.policy_of(layer))
                             for layer in range(1, runner.n_layers + 1)]
        ctx = Context(self.tpl, self.plan, self.wl, self.opt, self.dtype, runner,
                      PolicyRunner(runner, None), policies, self.host_state, self.device)
        enabled = [F for F in FEATURES if F.enabled(ctx)]
        spec = BufferSpec()
        for F in enabled:
            F.configure(spec, ctx)
        ctx.bufs = Buffers(spec, self.tpl, self.plan, self.wl, runner, ctx.layer_runner, policies,
                           self.device, self.dtype, self.session)
        self.features = [F(ctx) for F in enabled]
        return ctx

    def _kernels(self, probe: Probe | None) -> list:
        """Per task: the kernel this process runs it with (None: another process runs it)."""
        tpl = self.tpl
        table = [partial(KERNELS[tpl.kind[v]], self.ctx)
                 if tpl.local[v] and tpl.kind[v] in KERNELS else None for v in range(tpl.n)]
        for f in self.features:
            for v, kernel in f.kernels(table).items():
                table[v] = kernel
        missing = [tpl.g.label(v) for v in range(tpl.n) if tpl.local[v] and table[v] is None]
        if missing:
            raise RuntimeError(f"no kernel runs {', '.join(missing[:3])}: a feature module is "
                               "not registered (exec/features/__init__.py)")
        if probe is not None:
            table = [_probed(f, probe, tpl, v, self.bufs.window)
                     if f is not None and tpl.kind[v] in READS_SLOT else f
                     for v, f in enumerate(table)]
        return table

    # ---- public -------------------------------------------------------------------------------

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
             lr: float | None = None) -> StepResult:
        """One optimizer step on a global batch: input_ids (global_batch, seq_len) int64 on CPU.

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
        st = Step(self.interpreter.issued, self.iteration + 1, None)
        st.data = d = self._step_data(input_ids, targets, n_valid, lr)
        self.bufs.acts.reset()  # nothing is kept across steps (a failed step may have left entries)
        for f in self.features:
            f.begin_step(d, input_ids)
        t_ref = self.interpreter.run(st)
        for f in self.features:
            f.end_step()
        loss, sqnorm = float(d.loss), float(self.bufs.sq[self.bufs.local_sq].double().sum())
        if self.session is None or self.session.local_rank == 0:
            self.host_state.steps += 1  # this step's update of every unit is done (rank 0: its own)
        if self.session is not None:
            loss, sqnorm = self.session.all_reduce_sum([loss, sqnorm])
        t1 = time.perf_counter()
        timeline = self.interpreter.timeline(st, t0, t_ref, self.iteration)
        self.iteration += 1
        if not self._gc_frozen:
            self._freeze_long_lived()
        return StepResult(
            loss=loss, grad_norm=math.sqrt(sqnorm), step_time_s=t1 - t0,
            channel_s=channel_busy_s(timeline),
            gpu_peak_bytes=torch.cuda.max_memory_reserved(self.device) if self.cuda else None,
            timeline=timeline, origin_s=t0)

    def _step_data(self, input_ids: torch.Tensor, targets: torch.Tensor, n_valid: int,
                   lr: float | None) -> StepData:
        """This rank's micro-batches on the device and the step's scalars (see "Data")."""
        wl = self.wl
        mb, rows = wl.micro_batch, wl.accum_steps * wl.micro_batch
        mine = slice(self.rank * rows, (self.rank + 1) * rows)
        return StepData(
            iteration=self.iteration, lr=self.opt.lr if lr is None else lr, scale=1.0 / n_valid,
            adam_step=(self.host_state.steps + 1).tolist(),
            ids=input_ids[mine].to(self.device).split(mb),
            targets=[t.reshape(-1) for t in targets[mine].to(self.device).split(mb)],
            rope=self.runner.rope(wl.seq_len),
            loss=torch.zeros((), dtype=torch.float32, device=self.device))

    def host_state_changed(self) -> None:
        """The host state was written outside the steps: a feature that keeps part of it on the
        GPU across steps delivers it again before the next step."""
        for f in self.features:
            f.host_state_changed()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers, release the pinned registrations and close the host state the engine
        created (one passed in stays open). The with-statement calls it; an owner that holds the
        engine beyond one block (the Trainer) calls it itself."""
        self.interpreter.close()
        self.bufs.close()
        if self._gc_frozen:  # what this engine held may be collected again
            gc.unfreeze()
            self._gc_frozen = False
        if self._created_state is not None:
            self._created_state.close()

    def _freeze_long_lived(self) -> None:
        """After the first step ("Python's cyclic garbage collector" in the module docstring):
        collect once, then move every object alive now out of the collector's generations."""
        gc.collect()
        gc.freeze()
        self._gc_frozen = True


def _probed(kernel, probe: Probe, tpl: Template, v: int, window):
    """kernel, after probe(iteration, kind, unit, slot) on the unit's slot it reads."""
    kind, u = tpl.kind[v], int(tpl.g.unit[v])

    def run(d: StepData, v: int) -> None:
        probe(d.iteration, kind, u, window.slot(u))
        kernel(d, v)

    return run


def channel_busy_s(timeline: Timeline) -> dict[str, float]:
    """Seconds during which at least one task of each channel ran (union of its intervals)."""
    by: dict[str, list[tuple[float, float]]] = {}
    for r in timeline.records:
        by.setdefault(r.channel, []).append((r.start_s, r.end_s))
    return {ch: sum(e - s for s, e in union_intervals(iv)) for ch, iv in by.items()}
