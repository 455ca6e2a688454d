"""What a plan feature of the executor is: a class whose hooks add to the engine's base schedule.

The engine (engine.py) calls, for each registered feature class F (features/__init__.py), in
registration order:
    plan = F.adjust(plan, optimizer)   the plan the graph is built from (before anything else)
    F.graph_options(plan)              keyword arguments it adds to build_graph
    F.enabled(k)                       whether it runs on this engine (k: the kernels' Context,
                                       whose buffers are not reserved yet)
    F.configure(spec, k)               an enabled feature's say in the BufferSpec
then, once the buffers are reserved, f = F(k) reserves its own and is asked for
    f.kernels(table)                   {task: kernel} for the tasks it runs: a kind the base
                                       schedule lacks, or its own version of a base task
                                       (table[v] is the kernel so far, to wrap)
    f.begin_step(d, input_ids)         at a step's start, before its boundary synchronisation
    f.end_step()                       after a step that completed
    f.may_skip_update                  whether it may skip a step's update (the engine then
                                       counts the step's updates once the global norm is known)
    f.skips_update(grad_sqnorm)        whether it skipped the step's update, given the step's
                                       global squared gradient norm (summed over the ranks)
    f.host_state_changed()             the host state was written between steps
    f.flush()                          finish now whatever of the last step's update is still
                                       to run (Engine.flush, before a read of the host state)
A feature instance holds the Context; the Context never holds a feature (a feature's strategy
it sets there is a plain function): a dropped engine is freed at once, with no cycle to collect.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from slidedp.exec.adamw import AdamWConfig
from slidedp.exec.buffers import BufferSpec
from slidedp.exec.kernels import Context, StepData
from slidedp.spec.plan import Plan

Kernel = Callable[[StepData, int], None]


class Feature:
    name = ""  # its module's name

    @staticmethod
    def adjust(plan: Plan, optimizer: AdamWConfig) -> Plan:
        return plan

    @staticmethod
    def graph_options(plan: Plan) -> dict:
        return {}

    @staticmethod
    def enabled(k: Context) -> bool:
        raise NotImplementedError

    @staticmethod
    def configure(spec: BufferSpec, k: Context) -> None:
        pass

    def __init__(self, k: Context):
        self.k = k

    def kernels(self, table: list[Kernel | None]) -> dict[int, Kernel]:
        return {}

    def begin_step(self, d: StepData, input_ids: torch.Tensor) -> None:
        pass

    def end_step(self) -> None:
        pass

    may_skip_update = False

    def skips_update(self, grad_sqnorm: float) -> bool:
        return False

    def host_state_changed(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def local_tasks(self, *kinds) -> list[int]:
        """This process's tasks of the given kinds, in id order."""
        tpl = self.k.tpl
        return [v for v in range(tpl.n) if tpl.local[v] and tpl.kind[v] in kinds]
