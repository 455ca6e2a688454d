"""What a simulation returns: steady-state step time, utilization, busy and exposed time, Timeline.

Steady state: iteration 0 fills an empty pipeline (warm-up); iterations 1.. start gated by the
previous iteration's update (I3) and are steady. The step time of iteration t is the distance
between the finish of iteration t and of t-1 (the last task of each iteration); step_time_s is
the last one, as in slidedp.model.predict, and every figure below is taken over that last step's
window [end of iteration N-2, end of iteration N-1].
  utilization[j]   work served by resource j in the window / (capacity x window); a task's draw is
                   spread evenly over its simulated interval; core pools count core-seconds held
  busy_s[j]        utilization x window (seconds of full capacity), plus agent:{a} busy seconds
  channel_busy_s   seconds in the window during which at least one task of the channel runs
  exposed (per rank and channel): seconds the rank's compute stream is idle in the window, by the
                   channel it waits on (exposure.py); the critical rank is the one idle longest
  compute_s (C)    the busiest compute stream; host_s (H): the busiest other resource or agent;
  exposed_s        step - max(C, H), as in the analytic model
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from slidedp.graph.costs import ResourceUse
from slidedp.graph.kinds import CHANNELS, COLLECTIVE_KINDS
from slidedp.graph.tasks import Channel, Kind, TaskGraph
from slidedp.graph.timeline import Exposure, Record, Timeline
from slidedp.sim.engine import RawRun, SimConfig
from slidedp.sim.exposure import Chains, exposed_by_channel_s, exposures


@dataclass
class SimResult:
    graph: TaskGraph
    durations: np.ndarray
    use: ResourceUse
    run: RawRun
    config: SimConfig
    tokens_per_step: int
    analytic: dict[str, float] = field(default_factory=dict)  # lower bound and critical path

    # ---- iterations and the steady window
    @cached_property
    def iteration_end_s(self) -> list[float]:
        it = self.graph.iteration
        return [float(self.run.finish_s[it == t].max()) for t in range(self.graph.n_iterations)]

    @property
    def step_times_s(self) -> list[float]:
        e = self.iteration_end_s
        return [b - a for a, b in zip(e, e[1:], strict=False)]

    @property
    def steady_iterations(self) -> list[int]:
        return list(range(1, self.graph.n_iterations))

    @property
    def step_time_s(self) -> float:
        return self.step_times_s[-1]

    @property
    def window_s(self) -> tuple[float, float]:
        e = self.iteration_end_s
        return e[-2], e[-1]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def analytic_step_s(self) -> float:
        """The analytic model's step on the same graph: max(lower bound, critical-path step)."""
        return max(self.analytic["lower_bound_s"], self.analytic["critical_path_s"])

    # ---- busy and utilization in the window
    @cached_property
    def _overlap(self) -> np.ndarray:
        """Fraction of each task's interval inside the window."""
        t0, t1 = self.window_s
        s, f = self.run.start_s, self.run.finish_s
        inside = np.clip(np.minimum(f, t1) - np.maximum(s, t0), 0.0, None)
        length = f - s
        return np.divide(inside, length, out=(inside > 0).astype(float), where=length > 0)

    @cached_property
    def utilization(self) -> dict[str, float]:
        u, g = self.use, self.graph
        task_of = np.repeat(np.arange(g.n_tasks), np.diff(u.ptr))
        amount = u.amount.copy()
        pools = np.array([n.endswith(".cores") for n in u.names])
        if self.config.contention:  # core-seconds held, split as the task's pools' draws
            is_pool = pools[u.res]
            of = task_of[is_pool]
            drawn = np.bincount(of, weights=u.amount[is_pool], minlength=g.n_tasks)
            amount[is_pool] = self.run.core_s[of] * np.divide(
                u.amount[is_pool], drawn[of], out=np.ones(len(of)), where=drawn[of] > 0)
        served = np.bincount(u.res, weights=amount * self._overlap[task_of], minlength=len(u.names))
        if self.config.contention and self.config.collective_sm_fraction > 0:
            coll = np.flatnonzero(np.isin(g.kind, [int(k) for k in COLLECTIVE_KINDS]))
            sm_s = float(((self.run.finish_s - self.run.start_s)[coll] * self._overlap[coll]).sum())
            for r in range(g.n_ranks):
                served[u.index(f"gpu{r}.compute")] += self.config.collective_sm_fraction * sm_s
        window = self.step_time_s
        return {n: float(x) for n, x in zip(u.names, served / (u.capacity * window), strict=True)}

    @cached_property
    def agent_busy_s(self) -> dict[str, float]:
        g = self.graph
        secs = (self.run.finish_s - self.run.start_s) * self._overlap
        busy = np.bincount(g.agent, weights=secs, minlength=len(g.agents))
        return {f"agent:{a}": float(b) for a, b in zip(g.agents, busy, strict=True)}

    @cached_property
    def busy_s(self) -> dict[str, float]:
        w = self.step_time_s
        return {**{k: v * w for k, v in self.utilization.items()}, **self.agent_busy_s}

    @cached_property
    def channel_busy_s(self) -> dict[str, float]:
        """Union of the channel's task intervals inside the window."""
        t0, t1 = self.window_s
        s = np.maximum(self.run.start_s, t0)
        f = np.minimum(self.run.finish_s, t1)
        chan = CHANNELS[self.graph.kind]
        out = {}
        for c in Channel:
            m = (chan == int(c)) & (f > s)
            out[c.name] = _union_length(s[m], f[m])
        return out

    @property
    def compute_s(self) -> float:
        return max(v for k, v in self.agent_busy_s.items() if k.endswith(".compute"))

    @property
    def host(self) -> tuple[str, float]:
        items = {k: v for k, v in self.busy_s.items() if not k.endswith(".compute")}
        k = max(items, key=items.get)
        return k, items[k]

    @property
    def bottleneck(self) -> tuple[str, float]:
        """The resource or agent busiest in the window, and its busy fraction."""
        k = max(self.busy_s, key=self.busy_s.get)
        return k, self.busy_s[k] / self.step_time_s

    # ---- exposure
    @cached_property
    def exposures(self) -> list[Exposure]:
        return exposures(self.graph, self.run)

    @cached_property
    def exposed_by_rank(self) -> list[dict[str, float]]:
        t0, t1 = self.window_s
        return [exposed_by_channel_s(self.exposures, r, t0, t1) for r in range(self.graph.n_ranks)]

    @property
    def critical_rank(self) -> int:
        idle = [sum(d.values()) for d in self.exposed_by_rank]
        return int(np.argmax(idle))

    @property
    def exposed_by_channel_s(self) -> dict[str, float]:
        """The critical rank's compute idle in the window, by the channel it waited on."""
        d = self.exposed_by_rank[self.critical_rank]
        return {c.name: d.get(c.name, 0.0) for c in Channel}

    @property
    def exposed_s(self) -> float:
        return max(0.0, self.step_time_s - max(self.compute_s, self.host[1]))

    @cached_property
    def critical_path_by_channel_s(self) -> dict[str, float]:
        """The chain that ends the last iteration, walked back through the window, by channel."""
        ch = Chains(self.graph, self.run)
        t0, t1 = self.window_s
        end = int(np.argmax(self.run.finish_s))
        pieces = [(max(float(self.run.start_s[end]), t0), t1, end, 0)]
        pieces += ch.pieces(end, t0, pieces[0][0])
        out: dict[str, float] = {}
        for s, e, u, _ in pieces:
            out[ch.channel[u]] = out.get(ch.channel[u], 0.0) + e - s
        return out

    # ---- records
    def timeline(self) -> Timeline:
        g, run = self.graph, self.run
        kinds = [Kind(k).name for k in range(len(Kind))]
        recs = [Record(it, kinds[k], u, r, c, g.agents[a], s, f) for it, k, u, r, c, a, s, f in zip(
            g.iteration.tolist(), g.kind.tolist(), g.unit.tolist(), g.rank.tolist(),
            g.chunk.tolist(), g.agent.tolist(), run.start_s.tolist(), run.finish_s.tolist(),
            strict=True)]
        mode = "contention" if self.config.contention else "no contention"
        mode += ", buffers" if self.config.buffers else ", no buffer limits"
        return Timeline(recs, self.exposures, source=f"simulated (slidedp.sim, {mode})")

    @property
    def events_per_s(self) -> float:
        return self.run.events / self.run.wall_s if self.run.wall_s > 0 else float("inf")


def _union_length(s: np.ndarray, f: np.ndarray) -> float:
    if len(s) == 0:
        return 0.0
    o = np.argsort(s, kind="stable")
    s, f = s[o], np.maximum.accumulate(f[o])
    # a new block starts where a start lies beyond every earlier finish
    new = np.ones(len(s), bool)
    new[1:] = s[1:] > f[:-1]
    idx = np.flatnonzero(new)
    ends = np.append(f[idx[1:] - 1], f[-1])
    return float((ends - s[idx]).sum())


HOST_CHANNELS = ("UPLOAD", "ACTIVATION", "DOWNLOAD", "UPDATE")


def result_row(res: SimResult, **keys) -> dict:
    """One table row of a simulated point: `keys` (what identifies it), then the step, throughput,
    C / H, the GPU's idle time in all and on host channels, the analytic step, and the idle
    seconds per channel (studies and sweeps write the same columns)."""
    exp = res.exposed_by_channel_s
    return keys | {
        "step_time_s": res.step_time_s, "tokens_per_s": res.tokens_per_s,
        "compute_s": res.compute_s, "host_s": res.host[1], "host_resource": res.host[0],
        "host_idle_s": sum(exp.get(c, 0.0) for c in HOST_CHANNELS),
        "gpu_idle_s": sum(exp.values()),
        "analytic_step_s": res.analytic_step_s,
        **{f"idle_{c.lower()}_s": v for c, v in exp.items()}}
