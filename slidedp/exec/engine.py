"""The executor engine: an interpreter of the task graph's per-iteration template.

`build_graph(workload, plan, cores, iterations=1)` is the schedule. Every agent of the graph
(gpu0.compute, gpu0.h2d, gpu0.d2h, cpu.cast0, cpu.update{w}) is a worker thread, created once,
that walks its task list (`g.agent_tasks`) in order each step; a task first waits for its DATA
and BUFFER predecessors on other agents (ORDER is the walk itself), then runs one small function
per Kind (the `_run_<kind>` methods below). Each step issues the same template again; the step
ends with a join of every agent (see "Step boundary").

Stream contract (device = cuda). Each GPU agent owns one CUDA stream; every task's work is
enqueued on its agent's stream and followed by a per-task `end` CUDA event (plus a `start` event
for the measured Timeline). A per-step threading.Event `issued[v]` is set once task v's work is
enqueued (GPU agents) or finished (CPU agents). Waiting on a predecessor u:
    GPU task after GPU task     host waits issued[u], then stream.wait_event(end[u])  (no host sync)
    CPU task after GPU task     host waits issued[u], then end[u].synchronize()  (the host must
                                see the bytes: CAST reusing a staging chunk after its H2D, ADAM
                                reading a gradient chunk after its D2H)
    any task after CPU task     host waits issued[u] (the CPU work is done), then enqueues
Host synchronisations are exactly those CPU-after-GPU waits plus two at the step boundary:
torch.cuda.synchronize() after the inputs are uploaded (so the Timeline's reference event is
recorded on an idle GPU) and after the join (loss, Timeline). Tensors that cross streams are
reserved at construction (slots, gradient buffers, checkpoints, rings), except a layer output
handed to ACT_OFFLOAD, which is record_stream()-ed on the D2H stream.
On the CPU (device = cpu) the same code runs: "streams" are the agent threads themselves, copies
are plain copies done synchronously, and issued[v] means done.

Step boundary: step() returns after every task of the step has finished, so the version gate I3
(next step's CAST/H2D of a unit after this step's ADAM of it) holds trivially, as do the
cross-step reuses of buffers. What it costs: the next step's first delivery is the embedding,
whose gradient comes last, so it waits for the embedding's ADAM either way; only the ADAM tails
of other units could have overlapped the next step's first deliveries.

Compute tasks cover all micro-batches of the step for their unit (layer-major):
    EMBED_FWD   embeds every micro-batch; keeps layer 1's input as a checkpoint
    FWD(l)      runs every micro-batch through layer l (no autograd); keeps layer l+1's input
    HEAD_LOSS   final norm + chunked linear/cross-entropy (loss.py), forward and backward
    RECOMPUTE(l) re-runs layer l with autograd for micro-batch 0; BWD(l) back-propagates
                micro-batch b and recomputes b+1, so one micro-batch's graph is alive at a time
                (memory.py's `transient` term); the gradients of all micro-batches accumulate in
                the gradient buffer
    EMBED_BWD   scatters the input gradients into the embedding's gradient
Loss = mean over the non-ignored tokens of the GLOBAL batch (labels shifted as HF does).

Gradient clipping is not supported: with updates streaming during backward the global norm is
known only after the last ADAM; an exact version must defer every update until then (keeping the
whole gradient on the host, +2 B/param, and losing the update/backward overlap) or defer it into
the next step's forward (method.md section 11). AdamWConfig(grad_clip=...) is rejected.
The reported grad_norm is exact: the L2 norm of the gradient chunks as ADAM consumes them.

Only one rank (workload.gpus == 1) is supported; the graph's R > 1 kinds (ALLGATHER, REDUCE,
HOST_SUM) are not implemented and such workloads are rejected at construction.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from slidedp.exec.activations import Checkpoints
from slidedp.exec.adamw import AdamWConfig, adamw_chunk
from slidedp.exec.host_state import HostState
from slidedp.exec.layer_runner import ModelRunner
from slidedp.exec.loss import IGNORE_INDEX, linear_cross_entropy, shift_labels
from slidedp.exec.staging import HostRings, PinnedPool
from slidedp.exec.window import Window
from slidedp.graph.build import build_graph
from slidedp.graph.tasks import EdgeKind, Kind
from slidedp.graph.timeline import Record, Timeline
from slidedp.spec.errors import SpecError
from slidedp.spec.plan import ActivationPolicy, Plan
from slidedp.spec.workload import Workload

MODES = ("overlap", "sync")
_POLL_S = 0.05  # how often a waiting worker checks whether another worker failed


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    step_time_s: float
    channel_s: dict[str, float]  # per channel: seconds at least one of its tasks was running
    gpu_peak_bytes: int | None  # torch.cuda.max_memory_reserved, None on the CPU
    timeline: Timeline


class _Aborted(Exception):
    """Raised in a worker waiting on a task of a worker that failed."""


class _Template:
    """The per-iteration task list, with what each task needs precomputed once."""

    def __init__(self, g):
        if g.n_edges and not bool(np.all(g.edge_src < g.edge_dst)):
            raise AssertionError("task ids are not a topological order")
        self.g = g
        self.n = g.n_tasks
        self.kind = [Kind(int(k)) for k in g.kind]
        self.agent_names = list(g.agents)
        self.is_gpu_agent = [a.startswith("gpu") for a in g.agents]
        self.preds: list[list[int]] = [[] for _ in range(self.n)]
        self.h2d_src = [-1] * self.n  # H2D: staging chunk its CAST wrote
        self.worker = [-1] * self.n  # D2H / ADAM: update worker owning the gradient ring
        worker_of_agent = {a: int(n.removeprefix("cpu.update")) for a, n in enumerate(g.agents)
                           if n.startswith("cpu.update")}
        for s, d, k in zip(g.edge_src.tolist(), g.edge_dst.tolist(), g.edge_kind.tolist(),
                           strict=True):
            if k == EdgeKind.ORDER or g.agent[s] == g.agent[d]:
                continue
            self.preds[d].append(s)
            if self.kind[s] == Kind.CAST and self.kind[d] == Kind.H2D:
                self.h2d_src[d] = int(g.buffer[s])
            if self.kind[s] == Kind.D2H and k == EdgeKind.DATA:
                self.worker[s] = worker_of_agent[int(g.agent[d])]
        for v in range(self.n):
            if self.kind[v] == Kind.ADAM:
                self.worker[v] = worker_of_agent[int(g.agent[v])]

    def on_gpu(self, v: int) -> bool:
        return self.is_gpu_agent[int(self.g.agent[v])]


class _StepState:
    """Everything one step's tasks share (inputs, activations in flight, accumulators)."""

    def __init__(self, n_tasks: int, workers: int):
        self.issued = [threading.Event() for _ in range(n_tasks)]
        self.host_s = [(0.0, 0.0)] * n_tasks
        self.error: BaseException | None = None
        self.sqnorm = [0.0] * workers  # per update worker: sum of squared gradient elements
        self.act_out: dict[tuple[int, int], torch.Tensor] = {}  # (layer, mb) -> to offload
        self.cur: list[torch.Tensor] = []  # per micro-batch: hidden states / their gradients
        self.saved = None  # RECOMPUTE's autograd state for micro-batch 0
        self.ids: list[torch.Tensor] = []  # per micro-batch, on the device
        self.targets: list[torch.Tensor] = []  # per micro-batch, shifted labels, flat
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.loss: torch.Tensor | None = None  # device scalar, summed by HEAD_LOSS
        self.lr = 0.0
        self.scale = 0.0  # 1 / non-ignored tokens of the global batch
        self.remaining = 0
        self.done = threading.Condition()


class Engine:
    """Host-streaming training of one transformers decoder model; see the module docstring."""

    def __init__(self, model_config, workload: Workload, plan: Plan, *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, mode: str = "overlap",
                 optimizer: AdamWConfig, host_state: HostState | None = None):
        if mode not in MODES:
            raise SpecError("engine", "mode", f"one of {', '.join(MODES)}, got {mode!r}")
        if workload.gpus != 1:
            raise NotImplementedError("the executor runs one rank only (workload.gpus == 1) for "
                                      "now: ALLGATHER / REDUCE / HOST_SUM are not implemented")
        if plan.activation_policy != ActivationPolicy.LAYER:
            raise SpecError("plan", "activation_policy", "'layer' (the only policy the executor runs)")
        if optimizer.grad_clip is not None:
            raise SpecError("optimizer", "grad_clip", "None: clipping is not supported (engine.py)")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype, self.mode, self.opt, self.wl, self.plan = dtype, mode, optimizer, workload, plan
        self.runner = ModelRunner(model_config, self.device, dtype)
        layouts = self.runner.layouts
        numels = [lay.numel for lay in layouts]
        if numels != workload.model.unit_params():
            raise SpecError("workload", "model", f"a model whose units have {numels} parameters "
                            f"(the config's), got {workload.model.unit_params()}")
        g = build_graph(workload, plan, os.cpu_count() or 1, iterations=1)
        self.tpl = _Template(g)
        self.n_workers = int(g.meta["update_workers"])
        copy_dtype = dtype if plan.host_bf16_copy else None
        if host_state is None:
            host_state = HostState.create(numels, copy_dtype)
        if host_state.unit_numels != numels or host_state.copy_dtype != copy_dtype:
            raise SpecError("engine", "host_state", f"units {numels} with a parameter copy of "
                            f"dtype {copy_dtype}, got {host_state.unit_numels} / {host_state.copy_dtype}")
        self.host_state = host_state
        self.iteration = 0

        # ---- reserve: buffers, streams, events, workers (nothing of this is allocated later)
        self.pool = PinnedPool(pin=self.cuda)
        if self.cuda:
            torch.cuda.set_device(self.device)
            host_state.pin()
        kind = np.asarray(g.kind)
        span = g.elem_hi - g.elem_lo

        def largest(k: Kind) -> int:
            sel = kind == int(k)
            return int(span[sel].max()) if sel.any() else 0

        self.rings = HostRings(self.pool, dtype, plan.staging_chunks, largest(Kind.CAST),
                               self.n_workers, plan.d2h_staging_chunks, largest(Kind.D2H))
        self.window = Window(layouts, plan.window_slots, plan.grad_buffers, self.device, dtype)
        self.ckpt = Checkpoints(self.runner.n_layers, workload.accum_steps, workload.micro_batch,
                                workload.seq_len, self.runner.hidden, plan.offload_ratio,
                                plan.reload_ahead_layers, self.device, dtype, self.pool)
        names = self.tpl.agent_names
        self.streams = [torch.cuda.Stream(self.device) if self.cuda and self.tpl.is_gpu_agent[a]
                        else None for a in range(len(names))]
        gpu_tasks = [v for v in range(self.tpl.n) if self.tpl.on_gpu(v)] if self.cuda else []
        self.ev_start = {v: torch.cuda.Event(enable_timing=True) for v in gpu_tasks}
        self.ev_end = {v: torch.cuda.Event(enable_timing=True) for v in gpu_tasks}
        self.ev_ref = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self._queues: list[queue.Queue] = []
        self._threads: list[threading.Thread] = []
        if mode == "overlap":
            for a in range(len(names)):
                q: queue.Queue = queue.Queue()
                t = threading.Thread(target=self._agent_loop, args=(a, q), daemon=True,
                                     name=f"slidedp-{names[a]}")
                t.start()
                self._queues.append(q)
                self._threads.append(t)
        self._run = {Kind.CAST: self._run_cast, Kind.H2D: self._run_h2d,
                     Kind.EMBED_FWD: self._run_embed_fwd, Kind.FWD: self._run_fwd,
                     Kind.ACT_OFFLOAD: self._run_act_offload, Kind.ACT_RELOAD: self._run_act_reload,
                     Kind.HEAD_LOSS: self._run_head_loss, Kind.RECOMPUTE: self._run_recompute,
                     Kind.BWD: self._run_bwd, Kind.EMBED_BWD: self._run_embed_bwd,
                     Kind.D2H: self._run_d2h, Kind.ADAM: self._run_adam}

    # ---- public -------------------------------------------------------------------------------

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
             lr: float | None = None) -> StepResult:
        """One optimizer step on a global batch: input_ids (global_batch, seq_len) int64 on CPU."""
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
        st = _StepState(self.tpl.n, self.n_workers)
        st.lr = self.opt.lr if lr is None else lr
        st.scale = 1.0 / n_valid
        mb = wl.micro_batch
        st.ids = input_ids.to(self.device).split(mb)
        st.targets = [t.reshape(-1) for t in targets.to(self.device).split(mb)]
        st.rope = self.runner.rope(wl.seq_len)
        st.loss = torch.zeros((), dtype=torch.float32, device=self.device)
        self.host_state.steps += 1  # this step's update of every unit (Adam's bias correction)
        if self.cuda:
            torch.cuda.synchronize(self.device)  # boundary sync (see the module docstring)
            self.ev_ref.record()
        t_ref = time.perf_counter()
        if self.mode == "overlap":
            st.remaining = len(self._threads)
            for q in self._queues:
                q.put(st)
            with st.done:
                st.done.wait_for(lambda: st.remaining == 0)
        else:
            for v in range(self.tpl.n):
                self._task(st, v)
                if self.cuda:
                    torch.cuda.synchronize(self.device)
        if st.error is not None:
            raise st.error
        if self.cuda:
            torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        timeline = self._timeline(st, t0, t_ref)
        self.iteration += 1
        return StepResult(
            loss=float(st.loss), grad_norm=math.sqrt(sum(st.sqnorm)), step_time_s=t1 - t0,
            channel_s=channel_busy_s(timeline),
            gpu_peak_bytes=torch.cuda.max_memory_reserved(self.device) if self.cuda else None,
            timeline=timeline)

    def close(self) -> None:
        """Stop the workers and release pinned registrations (the HostState stays open)."""
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()
        self._queues.clear()
        self._threads.clear()
        self.pool.close()

    # ---- the interpreter ---------------------------------------------------------------------

    def _agent_loop(self, a: int, q: queue.Queue) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        while (st := q.get()) is not None:
            try:
                for v in self.tpl.g.agent_tasks[a].tolist():
                    self._task(st, v)
            except _Aborted:
                pass
            except BaseException as e:  # noqa: BLE001 - handed to step(), which re-raises it
                st.error = st.error or e
            finally:
                with st.done:
                    st.remaining -= 1
                    st.done.notify_all()

    def _task(self, st: _StepState, v: int) -> None:
        tpl = self.tpl
        a = int(tpl.g.agent[v])
        stream = self.streams[a]
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
            self._run[tpl.kind[v]](st, v)
            if stream is not None:
                self.ev_end[v].record(stream)
        st.host_s[v] = (t0, time.perf_counter())
        st.issued[v].set()

    def _timeline(self, st: _StepState, t0: float, t_ref: float) -> Timeline:
        g, tl = self.tpl.g, Timeline(source=f"measured: slidedp.exec {self.mode} on {self.device}")
        for v in range(self.tpl.n):
            if self.cuda and self.tpl.on_gpu(v):
                off = t_ref - t0
                s = off + self.ev_ref.elapsed_time(self.ev_start[v]) / 1e3
                e = off + self.ev_ref.elapsed_time(self.ev_end[v]) / 1e3
            else:
                s, e = st.host_s[v][0] - t0, st.host_s[v][1] - t0
            tl.add(Record(self.iteration, self.tpl.kind[v].name, int(g.unit[v]), int(g.rank[v]),
                          int(g.chunk[v]), self.tpl.agent_names[int(g.agent[v])], s, e))
        return tl

    # ---- one function per Kind ---------------------------------------------------------------

    def _range(self, v: int) -> tuple[int, int, int]:
        g = self.tpl.g
        return int(g.unit[v]), int(g.elem_lo[v]), int(g.elem_hi[v])

    def _run_cast(self, st, v):
        u, lo, hi = self._range(v)
        self.rings.staging[int(self.tpl.g.buffer[v])][:hi - lo].copy_(
            self.host_state.unit_master(u)[lo:hi])

    def _run_h2d(self, st, v):
        u, lo, hi = self._range(v)
        i = self.tpl.h2d_src[v]
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
        self.ckpt.keep(layer, b, x)
        if self.ckpt.n_off:
            st.act_out[(layer, b)] = x

    @torch.no_grad()
    def _run_fwd(self, st, v):
        layer = int(self.tpl.g.unit[v])
        params = self.window.params(layer)
        for b, x in enumerate(st.cur):
            out = self.runner.layer_forward(params, x, st.rope)
            if layer < self.runner.n_layers:
                self._keep_input(st, layer + 1, b, out)
            st.cur[b] = out

    def _run_act_offload(self, st, v):
        layer = int(self.tpl.g.unit[v])
        for b in range(self.wl.accum_steps):
            x = st.act_out.pop((layer, b), None)
            if x is None:  # n_off == 0: the ratio rounds to no token
                continue
            if self.cuda:
                x.record_stream(torch.cuda.current_stream())
            self.ckpt.offload(layer, b, x)

    def _run_act_reload(self, st, v):
        self.ckpt.reload_layer(int(self.tpl.g.unit[v]))

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
            loss, grad_xn = linear_cross_entropy(xn.detach().reshape(-1, xn.shape[-1]), weight,
                                                 st.targets[b], st.scale, grad_weight)
            gx, gw = torch.autograd.grad(xn, (x, norm_w), grad_xn.view_as(xn))
            _accumulate(head_grad["norm.weight"], gw, b)
            st.loss += loss
            st.cur[b] = gx

    def _recompute(self, st, layer: int, b: int):
        params = {k: p.detach().requires_grad_() for k, p in self.window.params(layer).items()}
        x = self.ckpt.load(layer, b).detach().requires_grad_()
        with torch.enable_grad():
            out = self.runner.layer_forward(params, x, st.rope)
        return x, params, out

    def _run_recompute(self, st, v):
        st.saved = self._recompute(st, int(self.tpl.g.unit[v]), 0)

    def _run_bwd(self, st, v):
        layer = int(self.tpl.g.unit[v])
        grads = self.window.grad_views(layer)
        for b in range(self.wl.accum_steps):
            x, params, out = st.saved if b == 0 else self._recompute(st, layer, b)
            st.saved = None
            got = torch.autograd.grad(out, [x, *params.values()], st.cur[b])
            st.cur[b] = got[0]
            for name, gp in zip(params, got[1:], strict=True):
                _accumulate(grads[name], gp, b)

    def _run_embed_bwd(self, st, v):
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

    def _run_d2h(self, st, v):
        u, lo, hi = self._range(v)
        dst = self.rings.grad[self.tpl.worker[v]][int(self.tpl.g.buffer[v])][:hi - lo]
        dst.copy_(self.window.grad(u)[lo:hi], non_blocking=True)

    def _run_adam(self, st, v):
        u, lo, hi = self._range(v)
        w = self.tpl.worker[v]
        g = self.rings.grad_fp32(w, int(self.tpl.g.buffer[v]), hi - lo)
        st.sqnorm[w] += float(torch.dot(g, g))
        hs = self.host_state
        p = hs.unit_master(u)[lo:hi]
        adamw_chunk(p, g, hs.unit_m(u)[lo:hi], hs.unit_v(u)[lo:hi], int(hs.steps[u]), self.opt,
                    st.lr)
        if hs.copy is not None:
            hs.unit_copy(u)[lo:hi].copy_(p)


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
    out = {}
    for ch, iv in by.items():
        iv.sort()
        total, cs, ce = 0.0, iv[0][0], iv[0][1]
        for s, e in iv[1:]:
            if s > ce:
                total += ce - cs
                cs, ce = s, e
            else:
                ce = max(ce, e)
        out[ch] = total + ce - cs
    return out
