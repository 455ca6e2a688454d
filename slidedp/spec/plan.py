"""Plan: how a workload runs (routes, chunk sizes, buffers, activation policy, update workers).

Routes (method.md section 3) change how data moves, never where state lives:
  param_route  replicated: every rank uploads the whole BF16 layer (H2D R * q * P_l)
               sharded:    each rank uploads 1/R, the ranks all-gather on the GPU fabric (H2D q * P_l)
  grad_route   gpu: reduce (or reduce-scatter) on the GPUs, one aggregated copy comes back (D2H G_l)
               cpu: every rank copies its gradient back and the host sums (D2H R * G_l)
update_sharding  rank0: the published design, one update process (rank 0) consumes every layer;
                 sharded: each rank's process updates its 1/R share of every layer.
Buffers are bounded: `window_slots` GPU slots for decoder layers (the embedding and the LM head
have their own resident slots), `staging_chunks` pinned host chunks for cast+H2D,
`grad_buffers` GPU gradient buffers per rank, `d2h_staging_chunks` pinned host chunks per update
worker for gradients. Activations: `activation_policy` for every decoder layer, or
`layer_policies` with one entry per layer, each "layer", "none", "sac" or "seg:0b<7 bits>"
(slidedp.spec.segments defines them; stored in canonical form); `offload_ratio` r of what a layer keeps goes to pinned
host memory and is reloaded `reload_ahead_layers` layers ahead of its backward.
`defer_update` holds every ADAM of an iteration until all of its gradient chunks are on the host,
which exact global-norm clipping needs (the norm covers every chunk before any update). It costs
~4 B/param of host memory (the gradient rings the update reads hold a whole iteration's FP32
chunks) and the update no longer overlaps backward: the whole CPU update is exposed after it.
The executor sets it whenever the optimizer clips (AdamWConfig.grad_clip,
exec/features/deferred_update.py); plan_for_clipping gives the plan of a clipping optimizer
(`--grad-clip X` on train, predict, simulate and plan; X = 0 is no clipping), `--defer-update`
sets it alone.
`clip_schedule` says how a deferred update runs. "split" (default): step t's update of each
chunk is computed twice from the same inputs: once, after step t's backward, straight into the
BF16 staging chunk that step t+1's forward uploads (UPDATE_CAST, in the forward order, each gated
only on its own inputs), once in step t+1's backward into the FP32 master and moments (the
commit); the held gradient comes down in the compute dtype, exact (2 B/param of host memory
instead of 4), and the forward's host work is a read of the state with a BF16 write instead of
an update and a cast (graph/features/split_update.py, docs/graph.md "Clipping schedule").
"joined": every update after the backward, before the next step (graph/features/
deferred_update.py): the synchronous reference. A plan with host_bf16_copy runs joined.
`step_join` (default true) ends every iteration with a join of every agent, as the executor does
(docs/executor.md, "Step boundary"): nothing of step t+1 starts before all of step t is done. False
leaves only the per-unit version gates (I3) between iterations: what an executor pipelining
across steps would achieve (`--no-step-join` predicts it; the executor refuses it).
`embedding_rows` (default false) splits the embedding's update, which otherwise sits on the step
boundary (its gradient comes last, the next forward needs it first; method.md section 11): every
row is updated during the backward with the gradient known before EMBED_BWD (the tied head's
share, or zero when untied) while the rows the batch looked up keep their state, and only those
rows are updated after EMBED_BWD and re-sent (graph/features/embedding_rows.py). Ignored with
defer_update. The executor runs it (exec/features/embedding_rows.py), the simulator and the analytic model
predict it (`--embedding-rows`); off by default: it pays for tied embeddings only
(docs/embedding-rows.md).
`grad_widen` says where a BF16 gradient chunk becomes FP32 for the CPU update: "gpu" (default)
widens it on the GPU and downloads FP32 (4 B/param), "host" downloads it as BF16 (2 B/param over
PCIe and into host memory) and the update widens it block by block in cache (exec/adamw.py). The
values are the same either way (widening is exact). Host widening halves the download but costs
the update CPU time: on nvidia-h200 (Qwen3-4B mb 4 and 5, benchmarks/RESULTS.md) the update took
1.75-1.82 s a step against 1.34-1.36 s and the step 3-25% longer, so the GPU widens by default;
host widening is for hosts where the downloads, not the update's cores, are the bottleneck. The
cpu route with more than one GPU always downloads FP32: its host sum adds the ranks' chunks in
FP32 (graph.build.grad_wire_bytes).
`kernels` says which kernels the decoder layers and the LM head run (exec/fused_kernels.py): "eager"
(transformers' own PyTorch code, the exact CPU path), "liger" (liger-kernel's fused RMSNorm, SwiGLU,
RoPE and linear + cross-entropy; CUDA only) or "auto" (the default: liger on a CUDA device where
liger-kernel imports, else eager). The profile times the layer with the kernels it ran and tags the
row (spec/hardware.py, gpu.layer_time.kernels), and the cost model takes the plan's kernels' rows.
`internode_reduce` says how the nodes of a job of several (workload.nodes > 1) combine their
node-aggregated gradients over the network (graph/features/internode.py): "all_reduce" (default)
sums every chunk on every node, and every node updates the whole model on its own host state;
"reduce_scatter" gives each node the sum of 1/K of each chunk, which it alone updates, and the
nodes all-gather the new BF16 weights. The executor runs all_reduce; reduce_scatter is predicted
only (the executor refuses it).
`moments` is the format of the Adam moments on the host (exec/moments.py): "fp32" (default, 8
B/param), "bf16" (4 B/param) or "int8" (block-wise 8-bit, the bitsandbytes scheme: 2 B/param plus
an FP32 scale per 256 elements). The FP32 master stays. The update dequantizes, steps and
requantizes chunk by chunk, at the host's measured rate for that format (spec/host.py); gradient
chunks start on 256-element boundaries (graph/features/compact_moments.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import StrEnum
from pathlib import Path

from slidedp.spec.elements import FP32_BYTES, MOMENT_QBLOCK
from slidedp.spec.errors import SpecError
from slidedp.spec.segments import parse_policy
from slidedp.spec.tomlio import Table, read_toml


class ParamRoute(StrEnum):
    REPLICATED = "replicated"
    SHARDED = "sharded"


class GradRoute(StrEnum):
    GPU = "gpu"
    CPU = "cpu"


class GradWiden(StrEnum):
    GPU = "gpu"  # widened to FP32 on the GPU, downloaded as FP32 (4 B/param on the wire)
    HOST = "host"  # downloaded in the compute dtype (2 B/param), widened by the update in cache


class Kernels(StrEnum):
    AUTO = "auto"  # liger on a CUDA device where liger-kernel imports, else eager
    EAGER = "eager"  # transformers' own modules
    LIGER = "liger"  # liger-kernel's fused RMSNorm, SwiGLU, RoPE, linear + cross-entropy (CUDA)


class Moments(StrEnum):
    FP32 = "fp32"  # Adam m and v in FP32 (8 B/param)
    BF16 = "bf16"  # rounded to BF16 after every update (4 B/param)
    INT8 = "int8"  # block-wise 8-bit with an FP32 absmax per 256 elements (2.03 B/param)

    @property
    def bytes_per_param(self) -> float:
        """Host bytes of m and v together per parameter."""
        return {"fp32": 8.0, "bf16": 4.0, "int8": 2 * (1 + FP32_BYTES / MOMENT_QBLOCK)}[self.value]


class ClipSchedule(StrEnum):
    SPLIT = "split"  # the update cast into the next forward's upload, committed in its backward
    JOINED = "joined"  # every update after the backward, before the next step (the reference)


class InternodeReduce(StrEnum):
    ALL_REDUCE = "all_reduce"  # every node sums every chunk and updates the whole model
    REDUCE_SCATTER = "reduce_scatter"  # each node updates 1/K, then all-gathers the new weights


class UpdateSharding(StrEnum):
    RANK0 = "rank0"
    SHARDED = "sharded"


class ActivationPolicy(StrEnum):
    LAYER = "layer"  # whole-layer checkpoint: keep the layer input, recompute in backward
    NONE = "none"  # plain autograd: keep everything, no recompute


@dataclass(frozen=True)
class Plan:
    param_route: ParamRoute = ParamRoute.SHARDED
    grad_route: GradRoute = GradRoute.GPU
    update_sharding: UpdateSharding = UpdateSharding.RANK0
    h2d_chunk_mib: float = 64.0
    d2h_chunk_mib: float = 64.0
    window_slots: int = 3
    staging_chunks: int = 4
    grad_buffers: int = 2
    d2h_staging_chunks: int = 4
    activation_policy: ActivationPolicy = ActivationPolicy.LAYER
    layer_policies: tuple[str, ...] = ()  # per decoder layer (segments.py names); () = activation_policy
    offload_ratio: float = 0.0
    reload_ahead_layers: int = 2
    update_workers: int = 1
    cast_threads: int = 0  # 0: three quarters of the host's cores (see threads())
    update_threads: int = 0  # 0: three quarters of the host's cores
    host_bf16_copy: bool = False  # keep a BF16 copy on the host, written by the update (+2 B/param)
    defer_update: bool = False  # every ADAM after every gradient chunk (clipping; +4 B/param host)
    step_join: bool = True  # every task of step t+1 after every task of step t (the executor's)
    embedding_rows: bool = False  # the embedding's update in two parts (see the module docstring)
    grad_widen: GradWiden = GradWiden.GPU  # where a gradient chunk becomes FP32 (docstring)
    kernels: Kernels = Kernels.AUTO  # the layers' and the head's kernels (docstring)
    clip_schedule: ClipSchedule = ClipSchedule.SPLIT  # how a deferred update runs (docstring)
    internode_reduce: InternodeReduce = InternodeReduce.ALL_REDUCE  # across nodes (docstring)
    moments: Moments = Moments.FP32  # the Adam moments' format on the host (docstring)

    def __post_init__(self):
        checks = {
            "h2d_chunk_mib": self.h2d_chunk_mib > 0,
            "d2h_chunk_mib": self.d2h_chunk_mib > 0,
            "window_slots": self.window_slots >= 2,
            "staging_chunks": self.staging_chunks >= 1,
            "grad_buffers": self.grad_buffers >= 1,
            "d2h_staging_chunks": self.d2h_staging_chunks >= 1,
            "offload_ratio": 0.0 <= self.offload_ratio <= 1.0,
            "reload_ahead_layers": self.reload_ahead_layers >= 1,
            "update_workers": self.update_workers >= 1,
            "cast_threads": self.cast_threads >= 0,
            "update_threads": self.update_threads >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise SpecError("plan", name, f"a valid value (see Plan docs), got {getattr(self, name)!r}")
        if self.moments != Moments.FP32 and self.embedding_rows:
            raise SpecError("plan", "embedding_rows", f"false with {self.moments} moments (the "
                            "split embedding update keeps FP32 moments)")
        if self.moments != Moments.FP32 and self.splits_update:
            raise SpecError("plan", "clip_schedule", f"joined with {self.moments} moments (the "
                            "split schedule's update cast reads FP32 moments)")
        if not isinstance(self.layer_policies, tuple | list):
            raise SpecError("plan", "layer_policies", f"a list of policies, got {self.layer_policies!r}")
        names = tuple(parse_policy(p, "plan", f"layer_policies[{i}]").name
                      for i, p in enumerate(self.layer_policies))
        object.__setattr__(self, "layer_policies", names)  # canonical names (frozen dataclass)

    def policy_of(self, layer: int) -> str:
        """The activation policy name of decoder layer `layer` (1..L, as graph units)."""
        return self.layer_policies[layer - 1] if self.layer_policies else str(self.activation_policy)

    def check_layers(self, n_layers: int, where: str = "plan") -> None:
        """A per-layer policy list must name every decoder layer."""
        if self.layer_policies and len(self.layer_policies) != n_layers:
            raise SpecError(where, "layer_policies",
                            f"one policy per decoder layer ({n_layers}), got {len(self.layer_policies)}")

    @property
    def splits_update(self) -> bool:
        """Whether a deferred update runs split (clip_schedule): its result cast into the next
        forward's upload, its commit in the next backward. A host BF16 copy, which the uploads
        read instead of a cast, leaves it joined."""
        return (self.defer_update and self.clip_schedule == ClipSchedule.SPLIT
                and not self.host_bf16_copy)

    @property
    def splits_embedding(self) -> bool:
        """Whether the embedding's update is split (embedding_rows; off when deferred)."""
        return self.embedding_rows and not self.defer_update

    def threads(self, cores: int) -> tuple[int, int]:
        """(cast threads, update threads) on a host with `cores` cores. Default: each team gets
        the cores left after a quarter for the agents' own threads (build.team_share). The two
        teams add up to more than the cores, but the cast runs mostly in the forward and the
        update in the backward; where they overlap they share the cores. Measured on
        nvidia-h200-x2 (Qwen3-8B mb 4, window 36, one call): 24 + 24 threads 2.67 s, 16 + 16
        2.92 s, 8 + 24 (a quarter of the cores for the cast) 3.11 s."""
        cast = self.cast_threads or team_cores(cores)
        update = self.update_threads or team_cores(cores)
        return cast, update

    def with_overrides(self, **kw) -> Plan:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


def _clip_schedule(plan: Plan, moments: Moments, deferred: bool) -> ClipSchedule:
    """The clipping schedule of `plan` with `moments` and `deferred`: compact moments take the
    joined one (the split one's update cast reads FP32 moments)."""
    return ClipSchedule.JOINED if deferred and moments != Moments.FP32 else plan.clip_schedule


def with_moments(plan: Plan, moments: Moments) -> Plan:
    """`plan` with the Adam moments in `moments` (and the clipping schedule they allow)."""
    return replace(plan, moments=moments,
                   clip_schedule=_clip_schedule(plan, moments, plan.defer_update))


def plan_for_clipping(plan: Plan, grad_clip: float | None, skip_nonfinite: int = 0) -> Plan:
    """The plan the executor runs for an optimizer that clips the global gradient norm to
    `grad_clip` (None or 0: no clipping) or may skip up to `skip_nonfinite` non-finite steps:
    both read the norm of every gradient chunk before any update, so every update is deferred
    (defer_update). Without either, `plan` itself (an explicit defer_update stays). Train,
    predict, simulate and plan all take the clipping schedule from here (_clip_schedule)."""
    if grad_clip or skip_nonfinite:
        return replace(plan, defer_update=True,
                       clip_schedule=_clip_schedule(plan, plan.moments, True))
    return plan


def team_cores(cores: int) -> int:
    """The cores a CPU team may use: all but a quarter, left to the agents' own threads (the GPU
    agents' Python threads, the notifier, the communicator)."""
    return max(1, cores - cores // 4)


_ENUMS = {"param_route": ParamRoute, "grad_route": GradRoute, "update_sharding": UpdateSharding,
          "activation_policy": ActivationPolicy, "grad_widen": GradWiden, "kernels": Kernels,
          "clip_schedule": ClipSchedule, "internode_reduce": InternodeReduce,
          "moments": Moments}


def parse_plan(data: dict, where: str) -> Plan:
    """A plan TOML: a [plan] table whose keys are Plan's fields (all optional)."""
    root = Table(data, where)
    t = root.sub("plan")
    kw = {}
    for f in fields(Plan):
        if not t.has(f.name):
            continue
        if f.name == "layer_policies":
            names = t.raw(f.name)
            if not isinstance(names, list):
                raise SpecError(where, "plan.layer_policies", "a list of policy names (segments.py)")
            kw[f.name] = tuple(parse_policy(n, where, f"plan.layer_policies[{i}]").name
                               for i, n in enumerate(names))
        elif f.name == "activation_policy" and t.raw(f.name) not in tuple(ActivationPolicy):
            raise SpecError(where, "plan.activation_policy",
                            "layer or none (every layer alike; sac and seg:0b<7 bits> go in "
                            f"layer_policies, one per decoder layer), got {t.raw(f.name)!r}")
        elif f.name in _ENUMS:
            enum = _ENUMS[f.name]
            kw[f.name] = enum(t.str(f.name, choices=tuple(e.value for e in enum)))
        elif f.type == "bool":
            kw[f.name] = t.bool(f.name)
        elif f.type == "int":
            kw[f.name] = t.int(f.name, minimum=0)
        else:
            kw[f.name] = t.num(f.name, allow_zero=True)
    t.done()
    root.done()
    try:
        return Plan(**kw)
    except SpecError as e:
        raise SpecError(where, f"plan.{e.field}", e.expected) from None


def load_plan(path: str | Path) -> Plan:
    return parse_plan(read_toml(path), str(path))


def default_plan(fabric_kind: str) -> Plan:
    """Sharded upload where GPUs have their own fast links, replicated where the all-gather
    would share the PCIe links with the uploads (method.md section 3)."""
    route = ParamRoute.REPLICATED if fabric_kind == "pcie" else ParamRoute.SHARDED
    return Plan(param_route=route)


def plan_dict(plan: Plan) -> dict:
    """Every plan field as TOML-ready values (enums as strings, tuples as lists), as parse_plan
    reads them back."""
    out = {}
    for f in fields(Plan):
        v = getattr(plan, f.name)
        out[f.name] = [str(x) for x in v] if isinstance(v, tuple) else (
            str(v) if hasattr(v, "value") else v)
    return out
