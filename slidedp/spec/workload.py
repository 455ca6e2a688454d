"""Workload: which model, how many tokens per step, on how many GPUs of how many nodes.

global_batch counts sequences per optimizer step, over every node; micro_batch counts sequences
per GPU per forward/backward; gpus counts the GPUs of one node (the rank processes sharing its
host state) and nodes the nodes (each with its own host state, reduced over the network:
graph/features/internode.py); the difference is covered by gradient accumulation:
    accum_steps = global_batch / (micro_batch * gpus * nodes)   (must be an integer >= 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from slidedp.spec.errors import SpecError
from slidedp.spec.model import ModelSpec


@dataclass(frozen=True)
class Workload:
    model: ModelSpec
    seq_len: int
    global_batch: int
    micro_batch: int
    gpus: int
    where: str = "workload"
    nodes: int = 1

    def __post_init__(self):
        for f in ("seq_len", "global_batch", "micro_batch", "gpus", "nodes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(self.where, f, f"a positive integer, got {v!r}")
        per_step = self.micro_batch * self.gpus * self.nodes
        if self.global_batch % per_step:
            across = " x nodes" if self.nodes > 1 else ""
            raise SpecError(
                self.where, "global_batch",
                f"a multiple of micro_batch x gpus{across} = {per_step}, got {self.global_batch}",
            )

    @property
    def accum_steps(self) -> int:
        return self.global_batch // (self.micro_batch * self.gpus * self.nodes)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def tokens_per_gpu_step(self) -> int:
        """Tokens one GPU computes per optimizer step (all its micro-batches)."""
        return self.accum_steps * self.micro_batch * self.seq_len

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch * self.seq_len
