"""Feature activation offload (plan.offload_ratio r > 0): part of what each layer keeps goes to
host memory in the forward and comes back before the layer's backward.

ACT_OFFLOAD of r x what layer l's policy retains (tokens per GPU step x its retained bytes), on
the rank's D2H agent, after the task that produces the last of it: the producer of the layer's
input when the policy keeps the input alone ("layer", seg:0b0000000), else FWD(l). ACT_RELOAD on
the rank's H2D agent before RECOMPUTE(l) (or BWD(l)), into reload buffer l % reload_ahead_layers,
which BWD(l + reload_ahead_layers) frees: at most that many layers ahead.
Memory terms: GPU checkpoints x (1 - r), reload = reload_ahead_layers x r x the largest layer's
kept activations; host act_offload = every rank's r x kept activations.
"""

from __future__ import annotations

from slidedp.graph.features.base import Feature, add_term
from slidedp.graph.tasks import EdgeKind, Kind
from slidedp.spec.plan import Plan
from slidedp.spec.segments import keeps_beyond_input, policy_cost
from slidedp.spec.workload import Workload


def kept_bytes(wl: Workload, plan: Plan) -> list[float]:
    """Per layer 1..L, the activation bytes its policy keeps over one GPU step."""
    m = wl.model
    return [wl.tokens_per_gpu_step * policy_cost(m, plan.policy_of(layer), wl.seq_len).retained_bytes
            for layer in range(1, m.n_layers + 1)]


class Offload(Feature):
    @staticmethod
    def applies(plan: Plan) -> bool:
        return plan.offload_ratio > 0

    @staticmethod
    def gpu_memory(wl: Workload, plan: Plan, terms: dict[str, float], wire: int) -> None:
        r = plan.offload_ratio
        terms["checkpoints"] = (1 - r) * terms["checkpoints"]
        add_term(terms, "reload", plan.reload_ahead_layers * r * max(kept_bytes(wl, plan)),
                 before="transient")

    @staticmethod
    def host_memory(wl: Workload, plan: Plan, terms: dict[str, float], wire: int) -> None:
        m = wl.model
        kept = sum(wl.tokens_per_gpu_step * m.activation_bytes_per_token(plan.policy_of(layer))
                   for layer in range(1, m.n_layers + 1))
        add_term(terms, "act_offload", wl.gpus * plan.offload_ratio * kept, before="runtime")

    def __init__(self, b):
        super().__init__(b)
        plan = b.plan
        self.act_bytes = [0.0] + [plan.offload_ratio * b.tokens * c.retained_bytes
                                  for c in b.layer_costs[1:]]
        self.keeps_more = [False] + [keeps_beyond_input(plan.policy_of(layer))
                                     for layer in range(1, b.L + 1)]
        self.offloaded: dict[tuple[int, int], int] = {}  # (rank, layer) -> its latest ACT_OFFLOAD

    def _offload(self, t: int, layer: int, r: int, src: int) -> None:
        b = self.b
        o = b.rec.task(Kind.ACT_OFFLOAD, t, layer, r, -1, b.d2h[r], self.act_bytes[layer])
        b.rec.edge(src, o, EdgeKind.DATA)
        self.offloaded[(r, layer)] = o

    def before_fwd(self, t: int, layer: int, r: int) -> None:
        if self.act_bytes[layer] > 0 and not self.keeps_more[layer]:
            s = self.b.step
            self._offload(t, layer, r, s.emb_fwd[r] if layer == 1 else s.fwd[r][layer - 1])

    def after_fwd(self, t: int, layer: int, r: int) -> None:
        if self.act_bytes[layer] > 0 and self.keeps_more[layer]:
            self._offload(t, layer, r, self.b.step.fwd[r][layer])

    def backward_inputs(self, t: int, layer: int, r: int) -> list[int]:
        if self.act_bytes[layer] <= 0:
            return []
        b, ahead_n = self.b, self.b.plan.reload_ahead_layers
        reload = b.rec.task(Kind.ACT_RELOAD, t, layer, r, -1, b.h2d[r], self.act_bytes[layer],
                            buffer=layer % ahead_n)
        b.rec.edge(self.offloaded[(r, layer)], reload, EdgeKind.DATA)
        if layer + ahead_n <= b.L:
            b.rec.edge(b.step.bwd[r][layer + ahead_n], reload, EdgeKind.BUFFER)
        return [reload]
