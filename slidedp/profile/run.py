"""The measurement list: one step per measurement (and per buffer setup), run under a tqdm bar.

What is measured depends on the machine: the host always (its cast also by chunk size, into a
pinned ring with CUDA); PCIe, the layer timings (short runs per policy, then one sustained
back-to-back run per shape, and policy sac's recompute with the executor's policy code), the
matmul and the executor's dispatch cost per CPU task (a short run of the first model cut to 2
layers, profile/agents.py) with CUDA; all-GPU PCIe runs, P2P and NCCL
collectives with two GPUs or more and a known fabric kind. Buffers are allocated by a setup step
before a group and freed after it, so the timed steps only run kernels and copies.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from tqdm import tqdm

from slidedp.exec.policy_profile import profile_layer_policy
from slidedp.profile import agents, compute, fabric, host, pcie
from slidedp.profile.machine import Machine
from slidedp.profile.sizes import MIB, Sizes
from slidedp.profile.timing import Rounds
from slidedp.spec.model import ACTIVATION_POLICIES, BF16, FP32, ModelSpec
from slidedp.spec.plan import Plan, team_cores

SUSTAINED_ORDER = ("layer", "none")  # the cost model's figure (none) last: the longest under load
MAX_SUSTAINED_ITERS = 5000
HOST_KERNELS = ("copy", "cast", "adam", "adam bf16 grad", "adam bf16 moments",
                "adam int8 moments")  # Results.host_rounds' kernel names
CAST_CHUNK = "cast chunk"  # ... the cast by chunk size's
TEAMS_ALONE, TEAMS_WITH_DMA = "teams", "teams with dma"  # ... the teams-at-once runs' totals
TEAMS = (TEAMS_ALONE, TEAMS_WITH_DMA)
TEAMS_CAST, TEAMS_BESIDE_DMA = "teams cast", "teams beside dma"  # ... the cast's, theirs
TEAMS_CHUNK, TEAMS_CHUNK_CAST = "teams by chunk", "teams by chunk cast"  # ... by chunk size
DMA_WEIGHT = "dma weight"  # ... each teams-with-DMA run's dma_weight_sample
TEAMS_S_PER_ROUND = 0.25  # one teams-at-once run: the whole buffers' and one per chunk size
# each round (1 s a round, 7 s over the quick profile's 7 rounds at its 3 chunk sizes)

COLLECTIVE_TIMEOUT_S = 300


@dataclass(frozen=True)
class Request:
    sizes: Sizes
    models: tuple[ModelSpec, ...]  # layer timings (CUDA only)
    seqs: tuple[int, ...]
    micro_batches: tuple[int, ...]
    topology: str  # `nvidia-smi topo -m` output ("" if none)
    fabric_kind: str | None  # from the topology; None: not measured


def dma_weight_sample(alone_bps: float, teams_bps: float, total_bps: float) -> float:
    """What a copied byte costs the CPU teams, from one allocation: the teams' traffic alone
    minus theirs beside the copies, over the copies' traffic (the total minus the teams'), within
    [0, 1] (HostSpec.dram_dma_weight)."""
    copies = total_bps - teams_bps
    return min(1.0, max(0.0, (alone_bps - teams_bps) / copies)) if copies > 0 else 0.0


@dataclass
class Results:
    host_bytes: int = 0
    threads: list[int] = field(default_factory=list)
    dram_bps: dict[int, float] = field(default_factory=dict)  # threads -> read + write bytes/s
    cast_elems_per_s: dict[int, float] = field(default_factory=dict)
    adam_params_per_s: dict[int, float] = field(default_factory=dict)
    adam_bf16_grad_params_per_s: dict[int, float] = field(default_factory=dict)
    adam_bf16_moments_params_per_s: dict[int, float] = field(default_factory=dict)
    adam_int8_moments_params_per_s: dict[int, float] = field(default_factory=dict)
    # the samples of those four, of the cast by chunk size and of the teams at once, one per
    # round, each round on fresh buffers (timing.Rounds): keys (kernel, threads) with kernel in
    # HOST_KERNELS, ("cast chunk", chunk bytes, threads), ("teams", cast threads, update
    # threads) and ("teams cast", ...) its cast team's part, ("teams by chunk", chunk bytes) and
    # ("teams by chunk cast", chunk bytes) the same by chunk size, ("teams with dma", cast threads,
    # update threads, GPUs), ("teams beside dma", ...) the teams' own part of it and ("dma
    # weight", ...) each of its runs' dma_weight_sample
    host_rounds: Rounds = field(default_factory=Rounds)
    # the cast and update teams at once, over the rounds: (cast threads, update threads, DRAM
    # bytes/s, the cast team's bytes/s)
    dram_teams: tuple[int, int, float, float] | None = None
    # the same with each team's call one task at a PCIe chunk size (host.HostBench.teams_bps):
    # chunk bytes -> (DRAM bytes/s, the cast team's bytes/s)
    dram_teams_chunk: dict[int, tuple[float, float]] = field(default_factory=dict)
    # the same with every GPU's duplex copies, over its runs: (cast threads, update threads,
    # GPUs, bytes/s)
    dram_dma: tuple[int, int, int, float] | None = None
    # what a copied byte costs the teams, over those runs (dma_weight_sample); None: not measured
    dma_weight: float | None = None
    # the teams' own bytes/s beside the copies, over those runs; None: not measured
    dma_teams_bps: float | None = None
    # the cast by chunk size: (chunk BF16 bytes, threads) -> elements/s; its buffers
    cast_chunk_elems_per_s: dict[tuple[int, int], float] = field(default_factory=dict)
    cast_chunk_src_bytes: int = 0
    cast_chunk_slots: int = 0
    cast_chunk_pinned: bool = False
    cast_chunk_repeats: dict[int, int] = field(default_factory=dict)  # chunk bytes -> timed chunks
    pcie_alone_bps: dict[tuple[int, str, int], float] = field(default_factory=dict)  # gpu, dir, bytes
    pcie_duplex_bps: dict[int, float] = field(default_factory=dict)  # gpu -> both directions
    pcie_all_bps: dict[str, float] = field(default_factory=dict)  # "h2d" | "d2h" | "both"
    layers: list[compute.LayerTiming] = field(default_factory=list)  # short runs
    sustained: list[compute.LayerTiming] = field(default_factory=list)  # back to back, per policy
    layers_skipped: list[str] = field(default_factory=list)  # shapes that ran out of memory
    # policy sac's recompute / forward of one layer, by (model, seq, micro-batch), both from one
    # run of the executor's own policy code (exec/policy_profile.py), medians of `repeats`
    sac_recompute_fraction: dict[tuple[str, int, int], float] = field(default_factory=dict)
    matmul_flops_per_s: float = 0.0
    link_bps: float = 0.0
    cross_pair_bps: float = 0.0
    collective_s: dict[tuple[str, int], float] = field(default_factory=dict)
    # the executor's dispatch cost per CPU task: (model, seq, its measurement); None: not run
    agent_gaps: tuple[str, int, agents.AgentGaps] | None = None


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[], None]


def sustained_iters(s: Sizes, short_s: float) -> int:
    """Iterations of one policy in the sustained run: half of `sustained_s` at the short-run
    time, at least `sustained_min_iters`."""
    n = math.ceil(s.sustained_s / len(SUSTAINED_ORDER) / max(short_s, 1e-6))
    return min(max(n, s.sustained_min_iters), MAX_SUSTAINED_ITERS)


class Profiler:
    def __init__(self, machine: Machine, req: Request):
        self.m, self.req, self.s = machine, req, req.sizes
        self.res = Results()
        self._host: host.HostBench | None = None
        self._cast: host.CastChunkBench | None = None
        self._pcie: pcie.PcieBench | None = None
        self._layer: compute.LayerBench | None = None

    def steps(self) -> list[Step]:
        out = self._host_steps()
        if self.m.gpu_count:
            out += self._pcie_steps() + self._compute_steps() + self._agent_steps()
            if self.m.gpu_count >= 2 and self.req.fabric_kind:
                out += self._fabric_steps()
        return out

    def run(self, progress: bool = True) -> Results:
        """Every step in order; each one's wall seconds are kept in `step_s` (name, seconds)."""
        steps = self.steps()
        self.step_s: list[tuple[str, float]] = []
        with tqdm(steps, desc="slidedp profile", unit="step", disable=not progress) as bar:
            for step in bar:
                bar.set_postfix_str(step.name)
                t0 = time.perf_counter()
                step.run()
                self.step_s.append((step.name, time.perf_counter() - t0))
        return self.res

    # ---- host ------------------------------------------------------------------------------

    def _host_steps(self) -> list[Step]:
        """The host rates in `host_rounds` rounds over the thread counts, each round on
        freshly allocated buffers: one sample of each kernel at each count and one teams-at-once
        run per round (timing.Rounds; the warm-up runs in the first round only), then each rate
        over the rounds (Rounds.rate)."""
        r, s = self.res, self.s
        r.host_bytes = s.host_bytes(self.m.llc_bytes, self.m.ram_bytes)
        r.threads = s.threads(self.m.cores)

        def sample(n: int, k: int):
            h = self._host
            # each pool size is warm after the first round; a round's fresh buffers were first
            # touched by their fill
            h.warmup = s.warmup if k == 0 else 0
            for kernel, rate in zip(HOST_KERNELS, (h.dram_bps, h.cast_elems_per_s,
                                                   h.adam_params_per_s,
                                                   partial(h.adam_params_per_s, bf16_grad=True),
                                                   partial(h.adam_moments_params_per_s,
                                                           fmt="bf16"),
                                                   partial(h.adam_moments_params_per_s,
                                                           fmt="int8")),
                                    strict=True):
                r.host_rounds.add((kernel, n), rate(n))

        team = team_cores(self.m.cores)  # the executor's default teams (Plan.threads)
        teams_keys = ((TEAMS_ALONE, team, team), (TEAMS_CAST, team, team))

        chunks = s.chunk_bytes()

        def teams(k: int):
            for key, bps in zip(teams_keys,
                                self._host.teams_bps(team, team, TEAMS_S_PER_ROUND)[:2],
                                strict=True):
                r.host_rounds.add(key, bps)
            for c in chunks[k % len(chunks):] + chunks[:k % len(chunks)]:  # each round from
                # another size, so that a drift within a round is not one size's
                total, cast = self._host.teams_bps(team, team, TEAMS_S_PER_ROUND,
                                                   chunk_bytes=c)[:2]
                r.host_rounds.add((TEAMS_CHUNK, c), total)
                r.host_rounds.add((TEAMS_CHUNK_CAST, c), cast)

        def rates():
            tables = (r.dram_bps, r.cast_elems_per_s, r.adam_params_per_s,
                      r.adam_bf16_grad_params_per_s, r.adam_bf16_moments_params_per_s,
                      r.adam_int8_moments_params_per_s)
            for n in r.threads:
                for kernel, table in zip(HOST_KERNELS, tables, strict=True):
                    table[n] = r.host_rounds.rate((kernel, n))
            r.dram_teams = (team, team, *(r.host_rounds.rate(k) for k in teams_keys))
            r.dram_teams_chunk = {c: (r.host_rounds.rate((TEAMS_CHUNK, c)),
                                      r.host_rounds.rate((TEAMS_CHUNK_CAST, c))) for c in chunks}

        rounds, mib = s.host_rounds, r.host_bytes // MIB
        steps = []
        for k in range(rounds):
            steps.append(Step(f"allocate host buffers ({mib} MiB each), round {k + 1} of {rounds}",
                              self._alloc_host))
            steps += [Step(f"host copy, cast, adam at {n} threads, round {k + 1} of {rounds}",
                           lambda n=n, k=k: sample(n, k)) for n in r.threads]
            steps.append(Step(f"cast and update teams of {team} threads at once (whole buffers "
                              f"and by chunk size), round {k + 1} of {rounds}",
                              lambda k=k: teams(k)))
        steps.append(Step("host rates over the rounds", rates))
        return [*steps, Step("free host buffers", self._free_host), *self._cast_chunk_steps()]

    def _alloc_host(self) -> None:
        s = self.s  # one timed sample per call: the rounds are the repeats
        self._free_host()  # a fresh set, placed anew (timing.Rounds)
        self._host = host.HostBench(self.res.host_bytes, s.warmup, 1, s.host_sample_s)

    def _free_host(self) -> None:
        self._host = None
        gc.collect()

    def _cast_chunk_steps(self) -> list[Step]:
        r, s = self.res, self.s
        chunks = s.chunk_bytes()
        pin = self.m.gpu_count > 0

        def alloc():
            if self._cast is not None:
                self._free_cast()  # a fresh set each round, placed anew (timing.Rounds)
            self._cast = host.CastChunkBench([c // BF16 for c in chunks], r.host_bytes,
                                             Plan().staging_chunks, pin, s.warmup, s.repeats)
            r.cast_chunk_src_bytes = self._cast.src_elems * FP32
            r.cast_chunk_slots, r.cast_chunk_pinned = self._cast.slots, self._cast.pinned
            r.cast_chunk_repeats = {c: self._cast.repeats_for(c // BF16) for c in chunks}

        def sample(n: int, k: int):
            self._cast.warmup = s.warmup if k == 0 else 0  # as the host rounds' (above)
            for c in chunks:
                r.host_rounds.add((CAST_CHUNK, c, n), self._cast.elems_per_s(c // BF16, n))

        def rates():
            for n in r.threads:
                for c in chunks:
                    r.cast_chunk_elems_per_s[(c, n)] = r.host_rounds.rate((CAST_CHUNK, c, n))

        rounds, steps = s.host_rounds, []
        for k in range(rounds):
            steps.append(Step("allocate the cast source and " + ("pinned " if pin else "")
                              + f"staging ring, round {k + 1} of {rounds}", alloc))
            steps += [Step(f"cast by chunk size at {n} threads, round {k + 1} of {rounds}",
                           lambda n=n, k=k: sample(n, k)) for n in r.threads]
        steps.append(Step("cast by chunk size over the rounds", rates))
        return [*steps, Step("free the cast buffers", self._free_cast)]

    def _free_cast(self) -> None:
        self._cast.close()
        self._cast = None
        gc.collect()

    # ---- PCIe ------------------------------------------------------------------------------

    def _pcie_steps(self) -> list[Step]:
        r, s, gpus = self.res, self.s, self.m.gpu_count
        chunks = s.chunk_bytes()

        def alloc():
            self._pcie = pcie.PcieBench(gpus, max(chunks), s.stream_copies, s.warmup, s.repeats)

        def alone(g: int):
            for d in pcie.DIRECTIONS:
                for c in chunks:
                    r.pcie_alone_bps[(g, d, c)] = self._pcie.alone_bps(g, d, c)
            r.pcie_duplex_bps[g] = self._pcie.duplex_bps(g)

        def all_gpus(key: str, directions: tuple[str, ...]):
            r.pcie_all_bps[key] = self._pcie.all_gpus_bps(directions)

        team = team_cores(self.m.cores)

        def teams_and_dma():
            key, beside, weight = ((k, team, team, gpus)
                                   for k in (TEAMS_WITH_DMA, TEAMS_BESIDE_DMA, DMA_WEIGHT))
            for _ in range(s.host_rounds):
                self._alloc_host()  # fresh buffers each run, as the rounds (timing.Rounds)
                alone = self._host.teams_bps(team, team, TEAMS_S_PER_ROUND)[2]  # paired: the
                # same buffers, so that their placement cancels out of the weight
                total, _, teams = self._host.teams_bps(team, team, TEAMS_S_PER_ROUND,
                                                       self._pcie.dma_loads())
                r.host_rounds.add(key, total)
                r.host_rounds.add(beside, teams)
                r.host_rounds.add(weight, dma_weight_sample(alone, teams, total))
            r.dram_dma = (team, team, gpus, r.host_rounds.rate(key))
            r.dma_teams_bps = r.host_rounds.rate(beside)
            r.dma_weight = r.host_rounds.mean(weight)

        steps = [Step("pin host buffers", alloc)]
        steps += [Step(f"PCIe GPU {g} alone and duplex", lambda g=g: alone(g)) for g in range(gpus)]
        if gpus >= 2:
            steps += [Step(f"PCIe all GPUs {k}", lambda k=k, d=d: all_gpus(k, d))
                      for k, d in (("h2d", ("h2d",)), ("d2h", ("d2h",)), ("both", pcie.DIRECTIONS))]
        steps += [Step(f"cast and update teams of {team} threads with every GPU's copies, "
                       f"{s.host_rounds} runs on fresh {r.host_bytes // MIB} MiB buffers",
                       teams_and_dma),
                  Step("free host buffers", self._free_host)]
        return [*steps, Step("unpin host buffers", self._free_pcie)]

    def _free_pcie(self) -> None:
        self._pcie.close()
        self._pcie = None
        torch.cuda.empty_cache()

    # ---- compute ---------------------------------------------------------------------------

    def _compute_steps(self) -> list[Step]:
        r, s = self.res, self.s

        def matmul():
            r.matmul_flops_per_s = compute.matmul_flops_per_s(s.warmup, max(s.repeats, 10))

        def build(spec: ModelSpec):
            self._layer = compute.LayerBench(spec, s.warmup, s.repeats)

        def layer(spec: ModelSpec, seq: int, mb: int, policy: str):
            t = self._layer.time(seq, mb, policy)
            if t is None:
                r.layers_skipped.append(f"{spec.name} seq {seq} micro-batch {mb} policy {policy}")
            else:
                r.layers.append(t)

        def sustained(spec: ModelSpec, seq: int, mb: int):
            short = {t.policy: t.total_s for t in r.layers
                     if (t.model, t.seq, t.micro_batch) == (spec.name, seq, mb)}
            if set(SUSTAINED_ORDER) - set(short):
                return  # a short run did not fit: already listed as skipped
            out = self._layer.sustained(seq, mb, {p: sustained_iters(s, short[p])
                                                  for p in SUSTAINED_ORDER})
            if out is None:
                r.layers_skipped.append(f"{spec.name} seq {seq} micro-batch {mb} sustained")
            else:
                r.sustained += out

        def sac_recompute(spec: ModelSpec, seq: int, mb: int):
            try:
                t = profile_layer_policy(spec.config, "sac", mb, seq, device="cuda",
                                         dtype=torch.bfloat16, repeats=s.repeats)
            except torch.cuda.OutOfMemoryError:
                r.layers_skipped.append(f"{spec.name} seq {seq} micro-batch {mb} policy sac")
            else:
                r.sac_recompute_fraction[(spec.name, seq, mb)] = t.recompute_s / t.fwd_s
            finally:
                torch.cuda.empty_cache()

        steps = [Step("bf16 matmul", matmul)]
        for spec in self.req.models:
            steps.append(Step(f"build one {spec.name} layer", lambda spec=spec: build(spec)))
            for q in self.req.seqs:
                for b in self.req.micro_batches:
                    steps += [Step(f"{spec.name} layer seq {q} mb {b} policy {p}",
                                   lambda a=(spec, q, b, p): layer(*a))
                              for p in ACTIVATION_POLICIES]
                    steps.append(Step(f"{spec.name} layer seq {q} mb {b} sustained",
                                      lambda a=(spec, q, b): sustained(*a)))
                    steps.append(Step(f"{spec.name} layer seq {q} mb {b} sac recompute",
                                      lambda a=(spec, q, b): sac_recompute(*a)))
        return [*steps, Step("free the layer", self._free_layer)] if self.req.models else steps

    def _agent_steps(self) -> list[Step]:
        if not self.req.models:
            return []
        spec, seq = self.req.models[0], self.req.seqs[0]

        def run():
            gc.collect()
            torch.cuda.empty_cache()
            try:
                gaps = agents.measure(dict(spec.config), seq, "cuda")
            except (torch.cuda.OutOfMemoryError, OSError) as e:  # GPU memory, /dev/shm
                self.res.layers_skipped.append(
                    f"the executor's dispatch run ({spec.name} cut to {agents.LAYERS} layers): "
                    f"{str(e).splitlines()[0]}")
            else:
                self.res.agent_gaps = (spec.name, seq, gaps)

        return [Step(f"executor dispatch per CPU task ({spec.name} cut to {agents.LAYERS} layers)",
                     run)]

    def _free_layer(self) -> None:
        self._layer = None
        gc.collect()
        torch.cuda.empty_cache()

    # ---- fabric ----------------------------------------------------------------------------

    def _fabric_steps(self) -> list[Step]:
        r, s = self.res, self.s
        nbytes = max(s.collective_mib) * MIB
        peers = fabric.nv_peers(fabric.gpu_link_matrix(self.req.topology))
        link_peer = min(peers[0]) if peers[0] else 1

        def p2p():
            r.link_bps = fabric.p2p_bps(0, link_peer, nbytes, s.stream_copies, s.warmup, s.repeats)
            if self.req.fabric_kind == "nvlink-pairs":
                other = min(set(range(1, self.m.gpu_count)) - peers[0])
                r.cross_pair_bps = fabric.p2p_bps(0, other, nbytes, s.stream_copies, s.warmup,
                                                  s.repeats)
            torch.cuda.empty_cache()

        def collectives():
            r.collective_s = fabric.collective_times_s(
                self.m.gpu_count, [c * MIB for c in s.collective_mib], s.warmup, s.repeats,
                COLLECTIVE_TIMEOUT_S)

        return [Step(f"P2P copy GPU 0 -> {link_peer}", p2p),
                Step(f"NCCL collectives on {self.m.gpu_count} GPUs", collectives)]
