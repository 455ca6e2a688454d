"""Eval loss: a forward pass only, on held-out data, through the layers streamed one unit at a
time from the host state's FP32 master.

What it computes: the mean cross-entropy over every label token of the eval data (token-weighted
over the whole set, as the training loss is over a global batch; labels shifted as HF does), with
the parameters the host state holds at the call (after the last step's update). Every eval row is
read once, in order; nothing is updated.

How: in passes of `rows_per_pass` rows (a rank's share of a global batch, so a pass's hidden
states take what a training step's do), `micro_batch` rows at a time within a pass. For each unit
in order, its FP32 master is cast into one reusable device buffer (the largest unit, compute
dtype) and every micro-batch of the pass goes through it: the embedding lookup, each decoder layer
(the HF layer's code, ModelRunner.layer_forward, without autograd; packed rows with their
document masks), the final norm, then the chunked cross-entropy sum (loss.cross_entropy_sum; a
tied head reads the embedding again). It is synchronous and not overlapped with anything: an
occasional measurement, not a training step. With R ranks, rank r takes rows
[r N / R, (r + 1) N / R) and the loss sums are added across the ranks.
Device memory besides the engine's: the unit buffer and one pass's hidden states.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from slidedp.exec.data import TokenSequences, batch_of
from slidedp.exec.dist import DistSession
from slidedp.exec.host_state import HostState
from slidedp.exec.layer_runner import ModelRunner
from slidedp.exec.loss import IGNORE_INDEX, cross_entropy_sum, shift_labels
from slidedp.spec.errors import SpecError


def label_tokens(data: TokenSequences) -> int:
    """The targets that count in the loss: labels shifted left, -100 left out."""
    if data.labels is None:
        return len(data) * (data.tokens.shape[1] - 1)
    return int((np.asarray(data.labels[:, 1:]) != IGNORE_INDEX).sum())


class Evaluator:
    """The eval loss of `data` with the parameters in `host_state` (see the module docstring)."""

    def __init__(self, config, data: TokenSequences, host_state: HostState,
                 device: torch.device, dtype: torch.dtype, rows_per_pass: int, micro_batch: int,
                 session: DistSession | None = None):
        self.count = label_tokens(data)
        if self.count == 0:
            raise SpecError(data.where, "labels", "at least one label token to evaluate on")
        self.runner = ModelRunner(config, device, dtype, packed=data.position_ids is not None)
        self.data, self.host_state, self.session = data, host_state, session
        self.rows_per_pass, self.micro_batch = rows_per_pass, micro_batch
        self.buf = torch.empty(max(lay.numel for lay in self.runner.layouts), device=device,
                               dtype=dtype)
        rank, world = (session.rank, session.world_size) if session else (0, 1)
        self.lo, self.hi = rank * len(data) // world, (rank + 1) * len(data) // world

    def _unit(self, u: int) -> dict[str, torch.Tensor]:
        """Unit u's parameters: its FP32 master cast into the buffer (the previous unit's gone)."""
        lay = self.runner.layouts[u]
        flat = self.buf[:lay.numel]
        flat.copy_(self.host_state.unit_master(u))
        return lay.views(flat)

    @torch.no_grad()
    def loss(self) -> float:
        total = torch.zeros((), dtype=torch.float32, device=self.buf.device)
        for lo in range(self.lo, self.hi, self.rows_per_pass):
            total += self._pass(np.arange(lo, min(lo + self.rows_per_pass, self.hi)))
        loss_sum = float(total)
        if self.session is not None:
            loss_sum = self.session.all_reduce_sum([loss_sum])[0]
        return loss_sum / self.count

    def _pass(self, rows: np.ndarray) -> torch.Tensor:
        r, dev, mb = self.runner, self.buf.device, self.micro_batch
        batch = {k: v.to(dev) for k, v in batch_of(self.data, rows).items()}
        ids = batch["input_ids"].split(mb)
        targets = [t.reshape(-1) for t in shift_labels(batch["labels"]).split(mb)]
        pos = batch.get("position_ids")
        attn = r.rope(ids[0].shape[1], None if pos is None else pos.split(mb))
        emb = self._unit(0)["weight"]
        xs = [F.embedding(i, emb) for i in ids]
        for layer in range(1, r.n_layers + 1):
            params = self._unit(layer)
            xs = [r.layer_forward(params, x, attn.of(b)) for b, x in enumerate(xs)]
        head = self._unit(r.n_layers + 1)
        xs = [r.norm_forward(head["norm.weight"], x) for x in xs]
        weight = self._unit(0)["weight"] if r.tied else head["lm_head.weight"]
        return sum(cross_entropy_sum(x.reshape(-1, x.shape[-1]), weight, t)
                   for x, t in zip(xs, targets, strict=True))
