"""The executor's dispatch cost per task on its CPU agents, measured in a short real run.

Between two tasks of one CPU agent (the cast agent, an update worker) the executor spends time
outside the kernels: waiting on the events of the next task's inputs, its Python (slicing the
host state, bookkeeping, timing), the kernel's start. Where every input of the next task had
completed before the previous task ended, that whole interval is dispatch cost: the stored traces
show 0.11-0.15 ms between chunk updates (a mean; Qwen3-4B and 8B on the H200 hosts), which the
model did not count and which adds up over the ~280 chunk updates of a host-bound Qwen3-4B
step. The model adds the measured cost to every CAST and ADAM (graph/costs.py
task_durations, from HostSpec.task_gap_s).

measure() runs slidedp.exec.Engine (random weights) on the model at hand cut to LAYERS decoder
layers, one sequence per step, the default plan's chunks (64 MiB: the gap depends on the chunk
size, a median of 0.12 ms at 64 MiB and 0.05 ms at 256 MiB in the stored traces, and one
figure stands for all sizes): after WARMUP_STEPS steps it pools the ready pairs of each further
step's Timeline (ready_gaps) until every kind has MIN_PAIRS of them or MAX_STEPS steps have run
(which kind's tasks were ready depends on the run's timing: on a contended CPU a short step may
have no ready update at all), and gives per agent kind the median of start(next) - end(previous)
over consecutive tasks of one agent
(whatever the previous one's kind) whose next task is a CAST or an ADAM and was ready: its inputs
from other agents (Template.preds) all ended before the previous task did, and none from another
process (Template.remote). A 2-layer run leaves the GPU agents' threads idler than a whole
model's, so it may read low where the GIL is contended.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

import torch

from slidedp.exec.engine import Engine
from slidedp.exec.measure import OPTIMIZER, random_host_state
from slidedp.exec.template import Template
from slidedp.graph.timeline import Record
from slidedp.spec.host import AGENT_GAP_KINDS
from slidedp.spec.model import first_layers_config, parse_hf_config
from slidedp.spec.plan import ParamRoute, Plan
from slidedp.spec.workload import Workload

LAYERS = 2
WARMUP_STEPS = 3  # as before pooling: allocation, pinning and first touches are over by step 4
MIN_PAIRS = 20
MAX_STEPS = 12
KINDS = {k.upper(): k for k in AGENT_GAP_KINDS}  # a CPU task's Kind -> its task_gap_s key


@dataclass(frozen=True)
class AgentGaps:
    gap_s: dict[str, float]  # "cast" / "adam" -> median dispatch seconds
    pairs: dict[str, int]  # ready pairs each median is over
    steps: int = 1  # measured steps the pairs come from

    @classmethod
    def of(cls, samples: dict[str, list[float]], steps: int) -> AgentGaps:
        return cls({k: max(0.0, statistics.median(v)) for k, v in samples.items() if v},
                   {k: len(v) for k, v in samples.items() if v}, steps)


def ready_gaps(tpl: Template, records: list[Record]) -> dict[str, list[float]]:
    """Dispatch seconds of each ready pair, per CPU agent kind (module docstring); `records` are
    one step's Timeline records, in the order Engine writes them (this process's tasks by task
    id)."""
    local = [v for v in range(tpl.n) if tpl.local[v]]
    if len(local) != len(records):
        raise ValueError(f"{len(records)} records for {len(local)} local tasks")
    rec = dict(zip(local, records, strict=True))
    by_agent: dict[str, list[int]] = defaultdict(list)
    for v, r in rec.items():
        by_agent[r.agent].append(v)
    gaps: dict[str, list[float]] = defaultdict(list)
    for vs in by_agent.values():
        vs.sort(key=lambda v: rec[v].start_s)
        for a, b in zip(vs, vs[1:], strict=False):
            end_a = rec[a].end_s
            if (rec[b].kind in KINDS and not tpl.remote[b]
                    and all(rec[u].end_s <= end_a for u in tpl.preds[b])):
                gaps[KINDS[rec[b].kind]].append(rec[b].start_s - end_a)
    return dict(gaps)


def measure(model_config: dict, seq: int, device: str,
            chunk_mib: float = Plan().h2d_chunk_mib) -> AgentGaps:
    """The executor's dispatch cost per CPU agent kind on this machine (module docstring)."""
    cfg = first_layers_config(model_config, LAYERS)
    spec = parse_hf_config(cfg, f"the profiled model cut to {LAYERS} layers")
    wl = Workload(spec, seq, 1, 1, 1)
    plan = Plan(param_route=ParamRoute.REPLICATED, h2d_chunk_mib=chunk_mib, d2h_chunk_mib=chunk_mib)
    hs = random_host_state(cfg, None, None)
    try:
        with Engine(cfg, wl, plan, device=device,
                    dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                    optimizer=OPTIMIZER, host_state=hs) as eng:
            data = torch.randint(0, spec.vocab_size, (1, seq),
                                 generator=torch.Generator().manual_seed(0))
            for _ in range(WARMUP_STEPS):
                eng.step(data)
            samples: dict[str, list[float]] = {k: [] for k in AGENT_GAP_KINDS}
            steps = 0
            while steps < MAX_STEPS and min(map(len, samples.values())) < MIN_PAIRS:
                for k, v in ready_gaps(eng.tpl, eng.step(data).timeline.records).items():
                    samples[k] += v
                steps += 1
            return AgentGaps.of(samples, steps)
    finally:
        hs.close()
