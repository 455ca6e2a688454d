"""Real probes for AutoPolicy: short runs of the real executor on this device (method.md section
7: rank with the calibrated simulator in seconds, confirm the top candidates with short real
probes). The only module of slidedp.policy that needs torch; auto.py takes its methods as plain
callables.

ExecutorProbe(model, workload, device), a context manager, random weights:
  prepare()              start building the whole model's host state in a background thread
                         (every selection with probes probes at least one finalist on it), so
                         that it overlaps AutoPolicy's simulated stages; auto_plan calls it once
                         the route ranking has found a plan that fits (host memory included).
                         Every measurement first waits for that build (no measurement runs beside
                         it); without prepare() the first probe builds it
  setup_s                seconds spent building host states, or waiting for the background
                         build, so far (AutoPolicy's time limit leaves it out of a probe's cost)
  probe(plan)            measured steady seconds per step of `plan` on the whole model: STEPS
                         optimizer steps of slidedp.exec.Engine (exec/measure.py measure; bf16
                         on cuda, float32 on cpu), the first DISCARD left out, the fastest of the
                         others (the least disturbed by other load on the machine); one host state,
                         built on the first call and reused by every candidate, in which decoder
                         layer i lives in layer i mod DISTINCT_LAYERS's memory (HostState's
                         storage_of): each layer's cast, copies and update move the same bytes as
                         on a whole state (a layer of a 4B model, 0.4 GB of FP32 master per
                         array, is far larger than any CPU cache), while the state is built in a
                         fraction of the time and memory (first-touching a whole 8B state took
                         ~30 s on the H200 hosts, most of an 8B probe's 33 s). One
                         difference remains: with a window below the layer count the backward
                         re-uploads layers, and the task graph leaves a re-upload's cast unordered
                         with updates of layers 1 to window + 3 or more behind it (more with larger
                         chunks or more update workers), DISTINCT_LAYERS behind included; where two
                         such tasks run at once on the same chunk, the cast may read lines the
                         update just wrote from cache rather than DRAM (at most its 4 B/param
                         read). benchmarks/probes/probe_state_check.py measures the whole effect
                         on the step at window 3 (such pairs) and at the full window (none): on
                         nvidia-h200, Qwen3-4B, shared / whole 1.068 at mb 1,
                         window 3 (the shared steps spread 1.67-2.03 s against 1.64-1.77: not
                         separated from noise), 1.005 at mb 4, window 36. None where the
                         executor refuses the plan (a SpecError: a policy it does not run yet) or
                         the device runs out of memory; the reason is kept in `refusals`.
  layer_delta_s(name)    seconds per step one layer on policy `name` adds over `layer` on the
                         GPU alone (method.md section 7, stage 3, ProfileCkpt): the compute time
                         (forward, recompute, backward) of one decoder layer measured by
                         exec/policy_profile.profile_layer_policy (median of LAYER_REPEATS),
                         the difference to `layer` times the micro-batches of a step.
  marginal_s(ref, name)  tau_j - tau_0 measured in a reduced real pipeline (method.md section 7,
                         step 4): the model cut to REDUCED_LAYERS decoder layers of the same
                         shape (its host state: the whole model's probe state's embedding,
                         first layers and head, HostState.subset, so nothing more is built),
                         every one on policy `name`,
                         window min(ref's, layers): (T_j - T_0) / REDUCED_LAYERS with T_0 the
                         all-`layer` reduced step, then bounded by layer_delta_s(name): a
                         layer's policy changes the GPU's work by that much, which the pipeline
                         can hide (host-bound: down to 0) but not enlarge. The bound matters:
                         the reduced step keeps the whole embedding and head, whose host work
                         makes it host-bound for large vocabularies, and its step-to-step noise
                         (tens of ms) exceeds a policy's effect on 4 layers (unbounded, it
                         measured seg:0b0000000, which recomputes as much as `layer`, 12.7 and
                         30.7 ms per layer faster: Qwen3-8B mb 4 on nvidia-h200-x2, Qwen3-4B
                         seq 16384 on nvidia-h200). Not bounded with an offload ratio above 0:
                         policies then also differ in offload traffic, which one layer's
                         compute leaves out. None where the executor does not run `name`
                         (runs_policy), checked before anything large is built, or where a
                         run fails (refusals).
runs_policy(name, device)  whether the executor accepts an activation policy: builds an Engine
                         of tiny-qwen3 on the device with every layer on it (milliseconds).
One rank only: probing R > 1 ranks needs rank processes (exec/measure.py with a DistSession, as
the validate worker runs it), which is not done here; a workload with gpus > 1 is refused and
callers skip the probes.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
from functools import cache

import torch

from slidedp.exec.engine import Engine
from slidedp.exec.host_state import HostState
from slidedp.exec.measure import OPTIMIZER, measure, random_host_state
from slidedp.exec.policy_profile import profile_layer_policy
from slidedp.spec.errors import SpecError
from slidedp.spec.model import ModelSpec, first_layers_config, load_model, parse_hf_config
from slidedp.spec.plan import ParamRoute, Plan
from slidedp.spec.workload import Workload

STEPS = 3  # the fastest of 2 after the first: a probe of Qwen3-4B seq 16384 takes ~11 s at 4
DISCARD = 1  # the first step allocates and warms up
REDUCED_LAYERS = 4
DISTINCT_LAYERS = 4  # decoder layers with memory of their own in a probe's host state (docstring);
# at least REDUCED_LAYERS: the reduced pipeline runs on the first ones (HostState.subset)
assert DISTINCT_LAYERS >= REDUCED_LAYERS
LAYER_REPEATS = 3
POLICY_FIELDS = ("activation_policy", "layer_policies")  # Engine's refusal of a policy


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


@cache
def runs_policy(name: str, device: str) -> bool:
    """Whether the executor on `device` runs activation policy `name` (module docstring)."""
    tiny = load_model("tiny-qwen3")
    plan = Plan(param_route=ParamRoute.REPLICATED, layer_policies=(name,) * tiny.n_layers)
    try:
        with Engine(dict(tiny.config), Workload(tiny, 16, 1, 1, 1), plan, device=device,
                    dtype=_dtype(device), optimizer=OPTIMIZER):
            pass
    except SpecError as e:
        if e.field in POLICY_FIELDS:
            return False
        raise
    return True


def reduced_model(model: ModelSpec, n_layers: int) -> ModelSpec:
    """`model` with only its first `n_layers` decoder layers (same shapes)."""
    spec = parse_hf_config(first_layers_config(model.config, n_layers),
                           f"{model.source or model.name} cut to {n_layers} layers")
    return dataclasses.replace(spec, name=f"{model.name}[:{n_layers}]")


class _Pipeline:
    """One model on this device and its host state (built on first use). With a `whole`
    pipeline (of the uncut model), a cut model's state is the subset of the whole one's units it
    keeps (the embedding, its first layers, the head: HostState.subset), built by building the
    whole one: the two pipelines never measure at once."""

    def __init__(self, wl: Workload, device: str, whole: _Pipeline | None = None,
                 moments: str = "fp32"):
        self.wl, self.device, self.whole, self.moments = wl, device, whole, moments
        self.config = dict(wl.model.config)
        self.hs: HostState | None = None
        self.setup_s = 0.0  # building the host state in the measuring thread

    def build(self) -> None:
        """The host state, built once (random weights)."""
        if self.hs is not None:
            return
        if self.whole is None:
            self.hs = random_host_state(self.config, None, None, distinct_layers=DISTINCT_LAYERS,
                                        moments=self.moments)
            return
        self.whole.build()
        n, last = self.wl.model.n_layers, self.whole.hs.n_units - 1
        self.hs = self.whole.hs.subset([*range(n + 1), last])

    def step_s(self, plan: Plan) -> float:
        """Measured steady seconds per step; SpecError when the executor refuses the plan."""
        if self.hs is None:
            t = time.perf_counter()
            self.build()
            self.setup_s += time.perf_counter() - t
        m = measure(self.config, self.wl, plan, self.hs, device=self.device, iters=STEPS,
                    discard=DISCARD)
        return min(m.all_steps_s[DISCARD:])

    def close(self) -> None:
        if self.hs is not None:
            self.hs.close()
            self.hs = None


class ExecutorProbe:
    """Real probes of plans for one workload on this device (module docstring)."""

    def __init__(self, wl: Workload, device: str, moments: str = "fp32"):
        """`moments`: the format of the probed plans' moments (plan.moments; one for all)."""
        if wl.gpus != 1:
            raise SpecError(wl.where, "gpus", "1 for real probes (probing R > 1 ranks needs rank "
                            f"processes, not implemented), got {wl.gpus}")
        self.device = device
        self.refusals: list[str] = []
        self.full = _Pipeline(wl, device, moments=moments)
        L = wl.model.n_layers
        self.reduced = self.full if L <= REDUCED_LAYERS else _Pipeline(
            dataclasses.replace(wl, model=reduced_model(wl.model, REDUCED_LAYERS)), device,
            whole=self.full)
        self._t0: dict[Plan, float] = {}
        self._layer_s: dict[str, float] = {}  # policy -> one layer's compute seconds
        self._prebuild: threading.Thread | None = None
        self._prebuild_error: BaseException | None = None
        self._waited_s = 0.0  # for the background build

    def __enter__(self) -> ExecutorProbe:
        return self

    def prepare(self) -> None:
        """Start building the whole model's host state in the background (module docstring)."""
        if self._prebuild is None and self.full.hs is None:
            self._prebuild = threading.Thread(target=self._build_full, name="probe-host-state",
                                              daemon=True)
            self._prebuild.start()

    def _build_full(self) -> None:
        try:
            self.full.build()
        except BaseException as e:  # raised again by the first measurement (_ready)
            self._prebuild_error = e

    def _ready(self) -> None:
        """Wait for the background build (the wait counts as setup); its error, if it failed."""
        if self._prebuild is not None:
            t = time.perf_counter()
            self._prebuild.join()
            self._prebuild = None
            self._waited_s += time.perf_counter() - t
        if self._prebuild_error is not None:
            raise self._prebuild_error

    @property
    def setup_s(self) -> float:
        """Seconds spent so far building host states or waiting for them (one-off, not any
        probe's own cost)."""
        return self._waited_s + self.full.setup_s + (
            self.reduced.setup_s if self.reduced is not self.full else 0.0)

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            if self._prebuild is not None:  # not cancellable: waits for the build to end
                self._prebuild.join()
                self._prebuild = None
        finally:
            self.full.close()
            self.reduced.close()

    def _measured(self, pipe: _Pipeline, plan: Plan) -> float | None:
        """The plan's step time, or None with the reason in `refusals`. Each probe starts with
        the earlier probes' garbage collected and the allocator's cached blocks released, as in
        a fresh process (on nvidia-h200, without it, the probes of a selection measured a route
        4% and a policy mix 11% slower than runs of the same plans in a process of their own).
        Out of memory, the probe runs once more after the same release: a plan near the cap
        fits alone (a 4B mb-6 mix at 137 of 139.8 GiB, nvidia-h200-x2) but not beside what the
        failed attempt still holds."""
        for attempt in range(2):
            gc.collect()
            if self.device == "cuda":
                torch.cuda.empty_cache()
            try:
                self._ready()
                return pipe.step_s(plan)
            except SpecError as e:
                self.refusals.append(str(e))
                return None
            except torch.OutOfMemoryError as e:
                if attempt:
                    self.refusals.append(f"{self.device} out of memory: {str(e).splitlines()[0]}")
                    return None

    def __call__(self, plan: Plan) -> float | None:
        return self._measured(self.full, plan)

    def layer_delta_s(self, name: str) -> float | None:
        """Seconds per step one layer on `name` adds over `layer` on the GPU alone (module
        docstring); None, with the reason in `refusals`, where the one-layer run fails (out of
        memory, a policy the executor refuses)."""
        wl = self.full.wl
        self._ready()
        for p in ("layer", name):
            if p in self._layer_s:
                continue
            try:
                self._layer_s[p] = profile_layer_policy(
                    self.full.config, p, wl.micro_batch, wl.seq_len, device=self.device,
                    dtype=_dtype(self.device), repeats=LAYER_REPEATS).compute_s
            except (SpecError, torch.OutOfMemoryError) as e:
                self.refusals.append(f"one layer on {p}: {str(e).splitlines()[0]}")
                return None
        micro_batches = wl.tokens_per_gpu_step // wl.tokens_per_micro_batch
        return (self._layer_s[name] - self._layer_s["layer"]) * micro_batches

    def marginal_s(self, reference: Plan, name: str) -> float | None:
        """Measured seconds per step one layer on `name` adds over `layer` (module docstring)."""
        if not runs_policy(name, self.device):
            return None
        L = self.reduced.wl.model.n_layers
        ref = dataclasses.replace(reference, window_slots=max(2, min(reference.window_slots, L)),
                                  layer_policies=("layer",) * L)
        if ref not in self._t0:
            t0 = self._measured(self.reduced, ref)
            if t0 is None:
                return None
            self._t0[ref] = t0
        tj = self._measured(self.reduced, dataclasses.replace(ref, layer_policies=(name,) * L))
        if tj is None:
            return None
        if ref.offload_ratio > 0:  # policies also differ in offload traffic: no compute bound
            return (tj - self._t0[ref]) / L
        layer_s = self.layer_delta_s(name)
        return None if layer_s is None else bounded((tj - self._t0[ref]) / L, layer_s)


def bounded(pipeline_s: float, layer_s: float) -> float:
    """A reduced pipeline's per-layer difference kept between 0 and the layer's own compute
    difference (module docstring, marginal_s)."""
    return min(max(pipeline_s, min(0.0, layer_s)), max(0.0, layer_s))
