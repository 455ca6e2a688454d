"""The executor's engine: trains a transformers decoder model by interpreting the task graph.

`Engine` builds the per-iteration graph of the plan (build_graph, iterations=1) and this process's
Template of it, reserves every buffer once (buffers.py), binds a kernel to each of its tasks
(kernels.py, and the plan features' own: features/) and starts one worker thread per agent
(interpreter.py). Use it as a context manager; step() runs one optimizer step on a global batch.
With workload.gpus = R > 1 each of R rank processes runs one Engine on the same graph, sharing
the host state, the rings and the completion counters.

Stream contract (device = cuda): each GPU agent and the fabric agent own one CUDA stream, and a
task's work is enqueued on its agent's stream, followed by its end event. A GPU task waits on a
GPU predecessor with stream.wait_event (no host sync); a CPU task waits on a GPU predecessor with
event.synchronize() (the host must see the bytes); any task waits on a CPU predecessor through its
issued event. The host synchronizes nowhere else but in the notifier's publication of tasks another
process waits on and at the step boundary (after the inputs are uploaded, after every task).
docs/executor.md is the whole contract: processes, step boundary, data across ranks, gradient
norm and clipping.
"""

from __future__ import annotations

import gc
import math
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
from slidedp.spec.cores import host_cores
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
    skipped: bool = False  # a feature skipped the step's update (AdamWConfig.skip_nonfinite)


class Engine:
    """Host-streaming training of one transformers decoder model (docs/executor.md).

    With workload.gpus = R > 1, pass the process's DistSession and the HostState it made
    (session.host_state); the device is the session's. `probe` is for instrumented tests (it
    may synchronize the device). After changing the host state between steps of a live engine,
    call host_state_changed().
    """

    def __init__(self, model_config, workload: Workload, plan: Plan, *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, mode: str = "overlap",
                 optimizer: AdamWConfig, host_state: HostState | None = None,
                 session: DistSession | None = None, probe: Probe | None = None,
                 packed: bool = False):
        """Without `host_state` the engine creates one (eng.host_state), closed with the engine
        (or here, if the construction fails: its shared memory removed). `packed`: steps pass
        position_ids (rows holding several documents, layer_runner.py)."""
        self._created_state: HostState | None = None
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
        plan = self._checked(workload, plan, mode, optimizer, host_state, session)
        self.session, self.R = session, workload.gpus
        self.rank = session.local_rank if session else 0  # the graph's rank: within the node
        self.data_rank = session.rank if session else 0  # its rows of the global batch
        self.device = session.device if session else torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype, self.mode, self.opt, self.wl, self.plan = dtype, mode, optimizer, workload, plan
        self.runner = runner = ModelRunner(model_config, self.device, dtype, plan.kernels,
                                           packed=packed)
        numels = [lay.numel for lay in runner.layouts]
        if numels != workload.model.unit_params():
            raise SpecError("workload", "model", f"a model whose units have {numels} parameters "
                            f"(the config's), got {workload.model.unit_params()}")
        cores = host_cores()  # the count the profile wrote: the predicted graph is this one
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
        if (session.local_world_size if session else 1) != R:
            raise SpecError("engine", "session", f"a DistSession of workload.gpus = {R} rank "
                            "processes per node (start them with slidedp.exec.dist.launch)")
        if (session.nodes if session else 1) != workload.nodes:
            raise SpecError("engine", "session", f"a DistSession of workload.nodes = "
                            f"{workload.nodes} nodes, got {session.nodes if session else 1}")
        if session is not None and host_state is None:
            raise SpecError("engine", "host_state", "the session's shared host state "
                            "(DistSession.host_state)")
        if not plan.step_join:
            raise SpecError("plan", "step_join", "true: the executor joins every agent at the step "
                            "boundary (docs/executor.md, 'Step boundary')")
        return plan

    def _host_state(self, host_state: HostState | None, numels: list[int],
                    copy_dtype: torch.dtype | None) -> HostState:
        if host_state is None:
            host_state = self._created_state = HostState.create(numels, copy_dtype,
                                                                moments=str(self.plan.moments))
        if host_state.moments != self.plan.moments:
            raise SpecError("engine", "host_state", f"moments in the plan's format "
                            f"({self.plan.moments}), got {host_state.moments}")
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
                      PolicyRunner(runner, None), policies, self.host_state, self.device,
                      session=self.session)
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
             lr: float | None = None, position_ids: torch.Tensor | None = None) -> StepResult:
        """One optimizer step on a global batch: input_ids (global_batch, seq_len) int64 on CPU;
        position_ids, of the same shape, only for a packed engine (a document starts where it
        is 0).

        With R ranks every process passes the same global batch; rank r computes its share of
        the rows (docs/executor.md, "Data across ranks")."""
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
        st.data = d = self._step_data(input_ids, targets, n_valid, lr, position_ids)
        self.bufs.acts.reset()  # nothing is kept across steps (a failed step may have left entries)
        for f in self.features:
            f.begin_step(d, input_ids)
        t_ref = self.interpreter.run(st)
        for f in self.features:
            f.end_step()
        loss, sqnorm = float(d.loss), float(self.bufs.sq[self.bufs.local_sq].double().sum())
        counts = self.session is None or self.session.local_rank == 0  # rank 0 counts the updates
        may_skip = any(f.may_skip_update for f in self.features)
        if counts and not may_skip:
            self.host_state.steps += 1  # this step's update of every unit is done
        if self.session is not None:  # every node holds the whole norm: its share is 1 / nodes
            loss, sqnorm = self.session.all_reduce_sum([loss, sqnorm / self.wl.nodes])
        skipped = any([f.skips_update(sqnorm) for f in self.features])  # each one told
        if may_skip:  # counted once the global norm is known; no rank reads the count before
            if counts and not skipped:
                self.host_state.steps += 1
            if self.session is not None:
                self.session.barrier()
        t1 = time.perf_counter()
        timeline = self.interpreter.timeline(st, t0, t_ref, self.iteration)
        self.iteration += 1
        if not self._gc_frozen:
            self._freeze_long_lived()
        return StepResult(
            loss=loss, grad_norm=math.sqrt(sqnorm), step_time_s=t1 - t0,
            channel_s=channel_busy_s(timeline),
            gpu_peak_bytes=torch.cuda.max_memory_reserved(self.device) if self.cuda else None,
            timeline=timeline, origin_s=t0, skipped=skipped)

    def _step_data(self, input_ids: torch.Tensor, targets: torch.Tensor, n_valid: int,
                   lr: float | None, position_ids: torch.Tensor | None) -> StepData:
        """This rank's micro-batches on the device and the step's scalars: rank r (global, over
        the nodes) takes rows [r P, (r + 1) P) of the global batch, P = accum_steps x
        micro_batch."""
        wl = self.wl
        mb, rows = wl.micro_batch, wl.accum_steps * wl.micro_batch
        mine = slice(self.data_rank * rows, (self.data_rank + 1) * rows)
        return StepData(
            iteration=self.iteration, lr=self.opt.lr if lr is None else lr, scale=1.0 / n_valid,
            adam_step=(self.host_state.steps + 1).tolist(),
            ids=input_ids[mine].to(self.device).split(mb),
            targets=[t.reshape(-1) for t in targets[mine].to(self.device).split(mb)],
            rope=self.runner.rope(wl.seq_len, None if position_ids is None else
                                  position_ids[mine].to(self.device).split(mb)),
            loss=torch.zeros((), dtype=torch.float32, device=self.device))

    def flush(self) -> None:
        """Finish the last step's update where the plan leaves part of it to the next step
        (exec/features/split_update.py), so that the host state is the last step's. Call it
        before reading the host state between steps (evaluation, checkpoints, exports); with R
        ranks every process calls it (it joins them)."""
        for f in self.features:
            f.flush()
        if self.session is not None:
            self.session.barrier()

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
        """After the first step (docs/executor.md, "Garbage collection"): collect once, then move
        every object alive now out of the collector's generations."""
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
