"""The task kernels: one small function per task kind, over the engine's reserved buffers.

A kernel `kernel(k, d, v)` runs task v of the template with the engine's Context k and the step's
StepData d. The interpreter calls it on v's agent thread, inside the agent's CUDA stream context
(GPU agents), once every predecessor of v is complete as far as v needs (docs/executor.md,
"Stream contract"): a GPU task only enqueues work on the current stream, a CPU task does its
work. No kernel synchronizes the host or allocates a buffer that another stream reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from slidedp.exec.adamw import AdamWConfig
from slidedp.exec.buffers import Buffers
from slidedp.exec.host_state import HostState
from slidedp.exec.layer_runner import Attention, ModelRunner, PerMicroBatch
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
    device: torch.device
    bufs: Buffers | None = None  # reserved once the plan features have set the BufferSpec
    session: object = None  # the rank process's DistSession (None: one process)
    # download(k, v, src, mask): a gradient chunk into D2H v's ring chunk (a feature may set it)
    download: Callable = field(default_factory=lambda: download)
    cuda: bool = field(init=False)

    def __post_init__(self):
        self.cuda = self.device.type == "cuda"


@dataclass(eq=False)
class StepData:
    """What one step's kernels share: inputs, activations in flight, accumulators."""

    iteration: int  # the engine's steps before this one
    lr: float
    scale: float  # 1 / non-ignored tokens of the global batch
    adam_step: list[int]  # per unit: its update count including this step's
    ids: list[torch.Tensor]  # per micro-batch, on the device
    targets: list[torch.Tensor]  # per micro-batch, shifted labels, flat
    rope: Attention | PerMicroBatch  # RoPE tables (and packed rows' masks), per micro-batch
    loss: torch.Tensor  # device scalar, summed by HEAD_LOSS
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
    staging[:hi - lo].copy_(k.host_state.unit_master(u)[lo:hi])


def h2d(k: Context, d: StepData, v: int) -> None:
    u, lo, hi = span(k, v)
    i = k.tpl.h2d_src[v]  # -1: straight from the host state's parameter copy
    src = k.host_state.unit_copy(u)[lo:hi] if i < 0 else k.bufs.rings.staging[i][:hi - lo]
    k.bufs.window.slot(u)[lo:hi].copy_(src, non_blocking=True)


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
        loss, grad_xn = runner.head_loss(xn.detach().reshape(-1, xn.shape[-1]), weight,
                                         d.targets[b], d.scale, grad_weight)
        gx, gw = torch.autograd.grad(xn, (x, norm_w), grad_xn.view_as(xn))
        accumulate(head_grad["norm.weight"], gw, b)
        d.loss += loss
        d.cur[b] = gx


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
    u, meta = int(k.tpl.g.unit[v]), k.tpl.g.meta
    k.bufs.coll.reduce(u, meta.embedding_grad_align if u == 0 else 1)


def d2h(k: Context, d: StepData, v: int) -> None:
    u, lo, hi = span(k, v)
    k.download(k, v, k.bufs.window.grad(u)[lo:hi])


def ring_chunk(k: Context, v: int, n: int) -> torch.Tensor:
    """The first n elements of the gradient ring chunk task v writes (a D2H)."""
    tpl = k.tpl
    key = (int(tpl.g.rank[v]), tpl.worker[v])
    return k.bufs.rings.grad[key][int(tpl.g.buffer[v])][:n]


def widened(k: Context, v: int, src: torch.Tensor, dst: torch.Tensor,
            mask: Callable[[torch.Tensor], None] | None) -> torch.Tensor | None:
    """D2H of gradient chunk src (device) into ring chunk dst, up to the last copy: on the GPU,
    src widened to FP32 into d2h_fp32, mask applied there, its squared norm enqueued into sq
    (a producer of an aggregated chunk: norm slot >= 0); the widened chunk is returned for the
    last copy. On the CPU, src copied into dst, mask applied, its norm taken; None."""
    j, bufs = k.tpl.norm_slot[v], k.bufs
    if not k.cuda:
        dst.copy_(src)
        if mask is not None:
            mask(dst)
        if j >= 0:
            wide = dst.float()
            bufs.sq[j] = torch.dot(wide, wide)
        return None
    wide = bufs.d2h_fp32[:len(src)]
    wide.copy_(src)
    if mask is not None:
        mask(wide)
    if j >= 0:
        bufs.sq_dev[j].copy_(torch.dot(wide, wide))
        bufs.sq[j:j + 1].copy_(bufs.sq_dev[j:j + 1], non_blocking=True)
    return wide


def download(k: Context, v: int, src: torch.Tensor,
             mask: Callable[[torch.Tensor], None] | None = None) -> None:
    """Gradient chunk src into task v's FP32 ring chunk (widened on the GPU), with its norm;
    mask(chunk), if given, zeroes part of the widened chunk first."""
    dst = ring_chunk(k, v, len(src))
    wide = widened(k, v, src, dst, mask)
    if wide is not None:
        dst.copy_(wide, non_blocking=True)


def host_sum(k: Context, d: StepData, v: int) -> None:
    _, lo, hi = span(k, v)
    sum_chunks(k, v, hi - lo)


def sum_chunks(k: Context, v: int, n: int, in_place: bool = False) -> None:
    """HOST_SUM v: the ranks' chunks (n elements) summed in FP32 into its worker's accumulator
    (or, in_place, into the first chunk), and the sum's squared norm into sq."""
    tpl, bufs = k.tpl, k.bufs
    acc = bufs.rings.host_sum(tpl.worker[v], tpl.grad_src[v], n, in_place=in_place)
    bufs.sq[tpl.norm_slot[v]] = torch.dot(acc, acc)


def adam(k: Context, d: StepData, v: int) -> None:
    u, lo, hi = span(k, v)
    update(k, d, u, lo, hi, adam_grad(k, v, hi - lo))


def adam_grad(k: Context, v: int, n: int) -> torch.Tensor:
    """The gradient ADAM v reads (n elements): its HOST_SUM's accumulator, or its ring chunk."""
    tpl = k.tpl
    if tpl.summed[v]:
        return k.bufs.rings.acc[tpl.worker[v]][:n]
    (key, slot), = tpl.grad_src[v]
    return k.bufs.rings.grad[key][slot][:n]


def update(k: Context, d: StepData, u: int, lo: int, hi: int, g: torch.Tensor,
           coef: float = 1.0) -> None:
    """AdamW on elements [lo, hi) of unit u with gradient g times coef (adamw.adamw_chunk, through
    the moments' format: moments.MomentSpan), and
    the parameter copy the uploads read, if the host state keeps one."""
    hs = k.host_state
    p = hs.unit_master(u)[lo:hi]
    hs.moment_span(u, lo, hi).adamw(p, g, d.adam_step[u], k.opt, d.lr, coef)
    if hs.copy is not None:
        hs.unit_copy(u)[lo:hi].copy_(p)


# the base schedule's kernels; a plan feature adds its own kinds' (features/)
KERNELS = {Kind.CAST: cast, Kind.H2D: h2d, Kind.ALLGATHER: allgather, Kind.EMBED_FWD: embed_fwd,
           Kind.FWD: fwd, Kind.HEAD_LOSS: head_loss, Kind.RECOMPUTE: recompute, Kind.BWD: bwd,
           Kind.EMBED_BWD: embed_bwd, Kind.REDUCE: reduce, Kind.D2H: d2h,
           Kind.HOST_SUM: host_sum, Kind.ADAM: adam}
