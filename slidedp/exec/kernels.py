"""The task kernels: one small function per task kind, over the engine's reserved buffers.

A kernel `kernel(k, d, v)` runs task v of the template with the engine's Context k and the step's
StepData d. The interpreter calls it on v's agent thread, inside the agent's CUDA stream context
(GPU agents), once every predecessor of v is complete as far as v needs (docs/executor.md,
"Stream contract"): a GPU task only enqueues work on the current stream, a CPU task does its
work. No kernel synchronizes the host or allocates a buffer that another stream reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from slidedp.exec.adamw import AdamWConfig, adamw_chunk
from slidedp.exec.buffers import Buffers
from slidedp.exec.embedding_rows import EmbeddingRows
from slidedp.exec.host_state import HostState
from slidedp.exec.layer_runner import ModelRunner
from slidedp.exec.loss import linear_cross_entropy
from slidedp.exec.policy_runner import LayerState, PolicyRunner
from slidedp.exec.template import Template
from slidedp.graph.tasks import Kind
from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload


@dataclass(eq=False)
class Context:
    """What every kernel reads: the template, the model's code, the host state, the buffers."""

    tpl: Template
    plan: Plan
    wl: Workload
    opt: AdamWConfig
    dtype: torch.dtype
    runner: ModelRunner
    layer_runner: PolicyRunner
    policies: list  # per decoder layer l (index l; 0 unused): its parsed activation policy
    host_state: HostState
    bufs: Buffers
    emb_rows: EmbeddingRows | None = None
    clip_at: set[int] = field(default_factory=set)

    @property
    def cuda(self) -> bool:
        return self.bufs.device.type == "cuda"


@dataclass(eq=False)
class StepData:
    """What one step's kernels share: inputs, activations in flight, accumulators."""

    iteration: int  # the engine's steps before this one
    lr: float
    scale: float  # 1 / non-ignored tokens of the global batch
    adam_step: list[int]  # per unit: its update count including this step's
    ids: list[torch.Tensor]  # per micro-batch, on the device
    targets: list[torch.Tensor]  # per micro-batch, shifted labels, flat
    rope: tuple[torch.Tensor, torch.Tensor]
    loss: torch.Tensor  # device scalar, summed by HEAD_LOSS
    clip: list[float]  # per update worker: the clipping coefficient of this step
    cur: list[torch.Tensor] = field(default_factory=list)  # per micro-batch: hidden states / grads
    layers: dict[tuple[int, int], LayerState] = field(default_factory=dict)  # (layer, mb)


def span(k: Context, v: int) -> tuple[int, int, int]:
    """Task v's unit and element range [lo, hi) in it."""
    g = k.tpl.g
    return int(g.unit[v]), int(g.elem_lo[v]), int(g.elem_hi[v])


def accumulate(dst: torch.Tensor, g: torch.Tensor, micro_batch: int) -> None:
    """Gradient accumulation over micro-batches: the first one writes, the others add."""
    if micro_batch == 0:
        dst.copy_(g)
    else:
        dst.add_(g)


def cast(k: Context, d: StepData, v: int) -> None:
    u, lo, hi = span(k, v)
    staging = k.bufs.rings.staging[int(k.tpl.g.buffer[v])]
    if k.tpl.g.rows[v]:
        j0, j1 = k.emb_rows.compact(lo, hi)
        if j1 > j0:
            k.emb_rows.rows_cast(staging, k.host_state.unit_master(0), j0, j1)
        return
    staging[:hi - lo].copy_(k.host_state.unit_master(u)[lo:hi])


def h2d(k: Context, d: StepData, v: int) -> None:
    u, lo, hi = span(k, v)
    i, window = k.tpl.h2d_src[v], k.bufs.window
    if k.tpl.g.rows[v]:
        j0, j1 = k.emb_rows.compact(lo, hi)
        if j1 > j0:
            k.emb_rows.rows_h2d(window.slot(0), k.bufs.rings.staging[i], j0, j1)
        return
    src = k.host_state.unit_copy(u)[lo:hi] if i < 0 else k.bufs.rings.staging[i][:hi - lo]
    window.slot(u)[lo:hi].copy_(src, non_blocking=True)


def embed_fwd(k: Context, d: StepData, v: int) -> None:
    weight = k.bufs.window.params(0)["weight"]
    d.cur = []
    for b, ids in enumerate(d.ids):
        x = F.embedding(ids, weight)
        k.bufs.acts.add(1, b, x)
        d.cur.append(x)


@torch.no_grad()
def fwd(k: Context, d: StepData, v: int) -> None:
    layer = int(k.tpl.g.unit[v])
    params = k.bufs.window.params(layer)
    for b, x in enumerate(d.cur):
        out, d.layers[(layer, b)] = k.layer_runner.forward(k.policies[layer], layer, b, params,
                                                            x, d.rope)
        if layer < k.runner.n_layers:
            k.bufs.acts.add(layer + 1, b, out)
        d.cur[b] = out


def act_offload(k: Context, d: StepData, v: int) -> None:
    k.bufs.acts.offload(int(k.tpl.g.unit[v]))


def act_reload(k: Context, d: StepData, v: int) -> None:
    k.bufs.acts.reload_layer(int(k.tpl.g.unit[v]))


def head_loss(k: Context, d: StepData, v: int) -> None:
    runner, window = k.runner, k.bufs.window
    head_u = runner.n_layers + 1
    head, head_grad = window.params(head_u), window.grad_views(head_u)
    if runner.tied:
        weight = window.params(0)["weight"]
        grad_weight = window.grad_views(0)["weight"]
    else:
        weight, grad_weight = head["lm_head.weight"], head_grad["lm_head.weight"]
    grad_weight.zero_()
    for b, x in enumerate(d.cur):
        x = x.detach().requires_grad_()
        norm_w = head["norm.weight"].detach().requires_grad_()
        with torch.enable_grad():
            xn = runner.norm_forward(norm_w, x)
        loss, grad_xn = linear_cross_entropy(xn.detach().reshape(-1, xn.shape[-1]), weight,
                                             d.targets[b], d.scale, grad_weight)
        gx, gw = torch.autograd.grad(xn, (x, norm_w), grad_xn.view_as(xn))
        accumulate(head_grad["norm.weight"], gw, b)
        d.loss += loss
        d.cur[b] = gx
    if k.emb_rows is not None and runner.tied:
        k.emb_rows.gather_head(grad_weight)


def recompute(k: Context, d: StepData, v: int) -> None:
    layer = int(k.tpl.g.unit[v])
    k.layer_runner.recompute(d.layers[(layer, 0)], k.bufs.window.params(layer), d.rope)


def bwd(k: Context, d: StepData, v: int) -> None:
    layer = int(k.tpl.g.unit[v])
    grads, params = k.bufs.window.grad_views(layer), k.bufs.window.params(layer)
    for b in range(k.wl.accum_steps):
        state = d.layers.pop((layer, b))
        k.layer_runner.recompute(state, params, d.rope)  # done by RECOMPUTE for b = 0
        d.cur[b], got = k.layer_runner.backward(state, d.cur[b])
        del state
        k.bufs.acts.release(layer, b)
        for name, gp in got.items():
            accumulate(grads[name], gp, b)


def embed_bwd(k: Context, d: StepData, v: int) -> None:
    if k.emb_rows is not None:
        k.emb_rows.add_lookups(d.cur, d.ids, k.runner.padding_idx, k.runner.tied)
        d.cur = []
        return
    grad = k.bufs.window.grad_views(0)["weight"]
    if not k.runner.tied:  # tied: HEAD_LOSS already wrote the head's share
        grad.zero_()
    pad = k.runner.padding_idx
    for ids, gx in zip(d.ids, d.cur, strict=True):
        ids, gx = ids.reshape(-1), gx.reshape(-1, gx.shape[-1])
        if pad is not None:  # nn.Embedding(padding_idx) gives that row no gradient
            gx = gx * (ids != pad)[:, None].to(gx.dtype)
        grad.index_add_(0, ids, gx)
    d.cur = []


def allgather(k: Context, d: StepData, v: int) -> None:
    k.bufs.coll.all_gather(int(k.tpl.g.unit[v]))


def reduce(k: Context, d: StepData, v: int) -> None:
    g = k.tpl.g
    if g.rows[v]:
        rows = k.emb_rows
        k.bufs.coll.reduce_rows(rows.grad.view(-1), rows.n * rows.h, rows.h)
        return
    u = int(g.unit[v])
    k.bufs.coll.reduce(u, g.meta.embedding_grad_align if u == 0 else 1)


def d2h(k: Context, d: StepData, v: int) -> None:
    u, lo, hi = span(k, v)
    tpl, bufs = k.tpl, k.bufs
    key = (int(tpl.g.rank[v]), tpl.worker[v])
    j = tpl.norm_slot[v]
    rows = k.emb_rows
    if tpl.g.rows[v]:  # this step's looked-up rows of the compact gradient
        j0, j1 = rows.compact(lo, hi)
        if j1 == j0:
            if j >= 0:
                bufs.sq[j] = 0.0
            return
        lo, hi = j0 * rows.h, j1 * rows.h
        src = rows.grad.view(-1)[lo:hi]
    else:
        src = bufs.window.grad(u)[lo:hi]
    bulk = rows is not None and u == 0 and not tpl.g.rows[v]  # rows zeroed: counted once
    dst = bufs.rings.grad[key][int(tpl.g.buffer[v])][:hi - lo]
    if not k.cuda:
        dst.copy_(src)
        if bulk:
            rows.zero_looked_up(dst, lo, hi)
        if j >= 0:
            wide = dst.float()
            bufs.sq[j] = torch.dot(wide, wide)
        return
    wide = bufs.d2h_fp32[:hi - lo]
    wide.copy_(src)
    if bulk:
        rows.zero_looked_up(wide, lo, hi)
    if j >= 0:
        bufs.sq_dev[j].copy_(torch.dot(wide, wide))
        bufs.sq[j:j + 1].copy_(bufs.sq_dev[j:j + 1], non_blocking=True)
    if dst.dtype == torch.float32:
        dst.copy_(wide, non_blocking=True)
    elif bulk:
        dst.copy_(bufs.d2h_narrow[:hi - lo].copy_(wide), non_blocking=True)
    else:
        dst.copy_(src, non_blocking=True)


def host_sum(k: Context, d: StepData, v: int) -> None:
    _, lo, hi = span(k, v)
    n = hi - lo
    tpl, bufs = k.tpl, k.bufs
    if tpl.g.rows[v]:  # this step's looked-up rows of the chunk (what the D2Hs copied)
        j0, j1 = k.emb_rows.compact(lo, hi)
        n = (j1 - j0) * k.emb_rows.h
        if n == 0:
            bufs.sq[tpl.norm_slot[v]] = 0.0
            return
    acc = bufs.rings.host_sum(tpl.worker[v], tpl.grad_src[v], n, in_place=k.plan.defer_update)
    bufs.sq[tpl.norm_slot[v]] = torch.dot(acc, acc)


def adam(k: Context, d: StepData, v: int) -> None:
    u, lo, hi = span(k, v)
    tpl, bufs = k.tpl, k.bufs
    w = tpl.worker[v]
    rows = k.emb_rows
    if tpl.g.rows[v]:
        j0, j1 = rows.compact(lo, hi)
        hi = lo + (j1 - j0) * rows.h
    if tpl.summed[v] and not k.plan.defer_update:
        g = bufs.rings.acc[w][:hi - lo]
    elif not tpl.grad_src[v]:  # the untied embedding's bulk: a zero gradient
        g = rows.zero[:hi - lo]
    else:
        (key, slot), = tpl.grad_src[v]
        g = bufs.rings.grad[key][slot][:hi - lo]
    if v in k.clip_at:  # every gradient chunk of the step is in: its producers precede v
        d.clip[w] = min(1.0, k.opt.grad_clip / (math.sqrt(float(bufs.sq.double().sum()))
                                                 + 1e-6))
    hs = k.host_state
    if tpl.g.rows[v]:
        if j1 > j0:
            new = rows.rows_adam(w, hs.unit_master(0), hs.unit_m(0), hs.unit_v(0), g, j0, j1,
                                 d.adam_step[0], k.opt, d.lr, d.clip[w])
            if hs.copy is not None:
                hs.unit_copy(0).view(-1, rows.h).index_copy_(0, rows.u[j0:j1], new.to(k.dtype))
        return
    p = hs.unit_master(u)[lo:hi]
    m, var = hs.unit_m(u)[lo:hi], hs.unit_v(u)[lo:hi]
    if rows is not None and u == 0:  # the bulk: the looked-up rows keep their state
        rows.bulk_adam(w, p, g, m, var, lo, d.adam_step[0], k.opt, d.lr, d.clip[w])
    else:
        adamw_chunk(p, g, m, var, d.adam_step[u], k.opt, d.lr, d.clip[w])
    if hs.copy is not None:
        hs.unit_copy(u)[lo:hi].copy_(p)


KERNELS = {Kind.CAST: cast, Kind.H2D: h2d, Kind.ALLGATHER: allgather, Kind.EMBED_FWD: embed_fwd,
           Kind.FWD: fwd, Kind.ACT_OFFLOAD: act_offload, Kind.ACT_RELOAD: act_reload,
           Kind.HEAD_LOSS: head_loss, Kind.RECOMPUTE: recompute, Kind.BWD: bwd,
           Kind.EMBED_BWD: embed_bwd, Kind.REDUCE: reduce, Kind.D2H: d2h,
           Kind.HOST_SUM: host_sum, Kind.ADAM: adam}
