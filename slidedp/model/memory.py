"""GPU and host memory footprints of a plan, and the feasibility check run before anything allocates.

GPU, per rank (bytes), the base terms:
  window        window_slots x largest decoder layer x 2        (BF16 slots)
  resident      embedding + head unit, x 2                      (their own slots)
  grad_buffers  grad_buffers x largest layer x 2 + embedding and head gradients x 2
  checkpoints   sum over layers of tokens per GPU step x retained bytes per token of the layer's
                policy (spec/segments.py; whole-layer checkpoint: hidden x 2)
  transient     one micro-batch's recompute + backward of one layer: the max over layers of
                tokens per micro-batch x the policy's transient bytes per token
  loss          LOSS_CHUNK_TOKENS x vocab x 4 x 2 (FP32 logits of one chunk and their gradient)
  d2h_widen     one gradient chunk widened to FP32 before its download or its norm (chunk
                elements x 4; a chunk holds d2h_chunk_mib of wire bytes, graph.layout.grad_wire_bytes)
  runtime       CUDA context and allocator slack (estimate)
Host (bytes): state (12 x parameters: FP32 master, Adam m and v, one copy per host), bf16_copy
(+ 2 x parameters with host_bf16_copy), staging (the pinned upload ring and the gradient rings of
graph.layout.grad_ring_sizes) and a runtime allowance per rank process (estimate).
Each registered plan feature (graph/features/) then adds its own terms or adjusts these, in
place (Feature.gpu_memory, Feature.host_memory): its docstring says which.
"""

from __future__ import annotations

from slidedp.graph.features import FEATURES
from slidedp.graph.layout import grad_ring_sizes, grad_wire_bytes
from slidedp.spec.elements import FP32_BYTES, LOSS_CHUNK_TOKENS
from slidedp.spec.errors import InfeasiblePlan, SpecError
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.plan import Plan
from slidedp.spec.segments import policy_cost
from slidedp.spec.units import GIB, MIB
from slidedp.spec.workload import Workload

GPU_RUNTIME_BYTES = 1.5 * GIB  # estimate: CUDA context, cuBLAS workspace, allocator slack
HOST_RUNTIME_BYTES_PER_RANK = 3 * GIB  # estimate: python + torch + CUDA runtime per process
STATE_BYTES_PER_PARAM = 12  # FP32 master + Adam m + Adam v


def gpu_footprint(wl: Workload, plan: Plan) -> dict[str, float]:
    m = wl.model
    units = m.unit_params()
    layer = max(units[1:-1])
    tok = wl.tokens_per_gpu_step
    plan.check_layers(m.n_layers)
    costs = {p: policy_cost(m, p, wl.seq_len) for p in {plan.policy_of(i) for i in range(1, m.n_layers + 1)}}
    kept = [tok * costs[plan.policy_of(layer)].retained_bytes for layer in range(1, m.n_layers + 1)]
    chunk_bytes, wire = plan.d2h_chunk_mib * MIB, grad_wire_bytes(plan, wl.gpus)
    terms = {
        "window": plan.window_slots * layer * 2,
        "resident": (units[0] + units[-1]) * 2,
        "grad_buffers": plan.grad_buffers * layer * 2 + units[-1] * 2 + units[0] * 2,
        "checkpoints": sum(kept),
        "transient": wl.tokens_per_micro_batch * max(c.transient_bytes for c in costs.values()),
        "loss": LOSS_CHUNK_TOKENS * m.vocab_size * 4 * 2,
        "d2h_widen": chunk_bytes * FP32_BYTES / wire,
        "runtime": GPU_RUNTIME_BYTES,
    }
    for f in FEATURES:
        f.gpu_memory(wl, plan, terms, wire)
    return terms


def host_footprint(wl: Workload, plan: Plan) -> dict[str, float]:
    n = wl.model.total_params()
    terms = {
        "state": STATE_BYTES_PER_PARAM * n,
        "bf16_copy": 2 * n if plan.host_bf16_copy else 0.0,
        "staging": plan.staging_chunks * plan.h2d_chunk_mib * MIB
        + sum(grad_ring_sizes(wl, plan).values()) * plan.d2h_chunk_mib * MIB,
        "runtime": wl.gpus * HOST_RUNTIME_BYTES_PER_RANK,
    }
    for f in FEATURES:
        f.host_memory(wl, plan, terms, grad_wire_bytes(plan, wl.gpus))
    return terms


def check_fits(hw: HardwareSpec, wl: Workload, plan: Plan) -> tuple[float, float]:
    """(GPU peak, host) bytes; raises InfeasiblePlan naming the overflow and its largest term."""
    if wl.gpus > hw.gpu.count:
        raise SpecError(wl.where, "gpus", f"at most the {hw.gpu.count} GPUs of {hw.name}, got {wl.gpus}")
    gpu, host = gpu_footprint(wl, plan), host_footprint(wl, plan)
    g, h = sum(gpu.values()), sum(host.values())
    if g > hw.gpu.hbm_bytes:
        big = max(gpu, key=gpu.get)
        raise InfeasiblePlan(f"GPU memory per GPU ({hw.gpu.model})", g, hw.gpu.hbm_bytes,
                             f"largest term: {big} {gpu[big] / GIB:.2f} GiB")
    if h > hw.host.ram_bytes:
        big = max(host, key=host.get)
        raise InfeasiblePlan("host memory", h, hw.host.ram_bytes,
                             f"largest term: {big} {host[big] / GIB:.2f} GiB")
    return g, h
