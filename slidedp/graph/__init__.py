"""The task graph built from (hardware, workload, plan): the one schedule every consumer reads."""

from slidedp.graph.build import build_graph
from slidedp.graph.tasks import AGENT_KINDS, Channel, EdgeKind, Kind, TaskGraph

__all__ = ["AGENT_KINDS", "Channel", "EdgeKind", "Kind", "TaskGraph", "build_graph"]
