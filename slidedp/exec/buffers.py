"""The executor's buffer setup: everything a step touches is reserved here, once, per engine.

    window      the GPU's parameter slots and gradient buffers (window.py)
    rings       the host staging ring and the (rank, worker) gradient rings (staging.py), page-locked
                for one rank, in shared memory every rank process maps for several
    sq          one FP32 squared norm per producer of an aggregated gradient chunk (host; shared
                between processes), and on the GPU `sq_dev` and the FP32 widening buffer `d2h_fp32`
    done        one int64 completion counter per template task (shared memory; several ranks only)
    coll        the collectives' buffers (several ranks only)
    acts        what each layer keeps from forward to backward (activations.py), sized from one
                forward per distinct activation policy
Sizes come from the template (the largest chunk of each kind) and the BufferSpec, which the plan
features set before anything is reserved. Nothing here is allocated again during a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slidedp.exec.activations import KeptActivations
from slidedp.exec.dist.collectives import Collectives
from slidedp.exec.dist.session import DistSession
from slidedp.exec.layer_runner import ModelRunner
from slidedp.exec.policy_runner import PolicyRunner, kept_layout
from slidedp.exec.staging import HostRings, PinnedPool
from slidedp.exec.template import Template
from slidedp.exec.window import Window
from slidedp.graph.tasks import Kind
from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload


@dataclass
class BufferSpec:
    """What the plan features decide about the shared buffers before they are reserved."""

    grad_dtype: torch.dtype = torch.float32  # the gradient rings' elements
    host_sum_acc: bool = True  # HOST_SUM adds into a private FP32 chunk per worker (else in place)
    embedding_grad: bool = True  # the window holds the embedding's gradient buffer
    masked_downloads: bool = False  # some D2H zeroes part of its chunk on the GPU first


class Buffers:
    def __init__(self, spec: BufferSpec, tpl: Template, plan: Plan, wl: Workload,
                 runner: ModelRunner, layer_runner: PolicyRunner, policies: list,
                 device: torch.device, dtype: torch.dtype, session: DistSession | None):
        """policies[l]: decoder layer l's parsed activation policy (index 0 unused)."""
        self.spec, self.device = spec, device
        cuda = device.type == "cuda"
        self.pool = PinnedPool(pin=cuda)
        self._host(spec, tpl, plan, dtype, session)
        n_norm, grad_elems = tpl.n_norm, tpl.largest(Kind.D2H)
        # D2H widens a gradient chunk to FP32 on the GPU (one buffer per D2H stream: its stream
        # order keeps the next widening behind the previous copy) and squares an aggregated chunk
        # into sq_dev there, copied back into sq: the host makes one pass over the gradient
        self.d2h_fp32 = (torch.empty(grad_elems, device=device, dtype=torch.float32)
                         if cuda else None)
        self.sq_dev = torch.empty(n_norm, device=device, dtype=torch.float32) if cuda else None
        # a masked chunk narrowed again for a narrow ring (exact: the widening was)
        self.d2h_narrow = (torch.empty(grad_elems, device=device, dtype=dtype)
                           if cuda and spec.masked_downloads and spec.grad_dtype != torch.float32
                           else None)
        # the norm entries this process writes (step(): their sum, then the step-end all-reduce)
        self.local_sq = torch.tensor([tpl.norm_slot[v] for v in range(tpl.n)
                                      if tpl.local[v] and tpl.norm_slot[v] >= 0], dtype=torch.long)
        self.done = (session.shared_tensor("done", tpl.n, torch.int64).numpy()
                     if session is not None else None)
        self.window = Window(runner.layouts, plan.window_slots, plan.grad_buffers, device, dtype,
                             embedding_grad=spec.embedding_grad)
        R = wl.gpus
        self.coll = (Collectives(self.window, R, tpl.rank, tpl.g.meta.scatter_update, device,
                                 dtype) if R > 1 else None)
        x = torch.zeros(wl.micro_batch, wl.seq_len, runner.hidden, device=device, dtype=dtype)
        layout = {p: kept_layout(layer_runner, p, self.window.params(1), x,
                                 runner.rope(wl.seq_len))
                  for p in set(policies[1:])}
        self.acts = layer_runner.acts = KeptActivations([layout[p] for p in policies[1:]],
                                                        wl.accum_steps)

    def _host(self, spec: BufferSpec, tpl: Template, plan: Plan, dtype: torch.dtype,
              session: DistSession | None) -> None:
        """The staging ring, the gradient rings and the norm entries: pinned, or shared."""
        g, ring_chunks = tpl.g, tpl.g.meta.grad_ring_chunks
        d2hs = (g.kind == Kind.D2H).nonzero()[0].tolist()  # each writes the ring it names
        grad_chunks = {key: ring_chunks[key] for key in sorted(
            {(int(g.ring_rank[v]), int(g.ring_worker[v])) for v in d2hs})}
        staging_elems = max(tpl.largest(Kind.CAST), tpl.largest(Kind.UPDATE_CAST))
        grad_elems = tpl.largest(Kind.D2H)
        staging_numel = plan.staging_chunks * staging_elems
        grad_numel = HostRings.grad_numel(grad_chunks, grad_elems)
        if session is None:
            staging_flat = self.pool.empty(staging_numel, dtype)
            grad_flat = self.pool.empty(grad_numel, spec.grad_dtype)
            self.sq = torch.empty(tpl.n_norm, dtype=torch.float32, pin_memory=self.pool.pin)
        else:
            staging_flat = self.pool.register(session.shared_tensor("staging", staging_numel,
                                                                    dtype))
            grad_flat = self.pool.register(session.shared_tensor("grads", grad_numel,
                                                                 spec.grad_dtype))
            self.sq = self.pool.register(session.shared_tensor("gradsq", tpl.n_norm,
                                                               torch.float32))
        self.local_workers = sorted({tpl.worker[v] for v in range(tpl.n)
                                     if tpl.local[v] and tpl.kind[v] == Kind.ADAM})
        acc = self.local_workers if any(tpl.summed) and spec.host_sum_acc else []
        self.rings = HostRings(staging_flat, plan.staging_chunks, staging_elems, grad_flat,
                               grad_chunks, grad_elems, acc, grad_elems)

    def close(self) -> None:
        """Unregister the page-locked host buffers."""
        self.pool.close()
