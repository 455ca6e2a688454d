"""Where the optimizer state lives: the cheapest moments format whose host state fits host RAM.

The tiers, in the order a plan prefers them (each slower or less exact than the one before, and
smaller; exec/moments.py):
  fp32  FP32 master + FP32 m, v       12 B/param: torch.optim.AdamW's state, the fastest update
  bf16  FP32 master + BF16 m, v        8 B/param
  int8  FP32 master + 8-bit m, v    ~6.03 B/param: block-wise, an FP32 scale per 256 elements
host_bytes_by_tier gives the whole host footprint of a plan under each (model/memory.py, with the
plan's other terms: the BF16 copy, the staging rings, the runtime); choose_tier keeps the first
that fits hw.host.ram_bytes and says why, or raises InfeasiblePlan naming the smallest.
"""

from __future__ import annotations

from slidedp.model.memory import host_footprint
from slidedp.spec.errors import InfeasiblePlan
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.plan import Moments, Plan, with_moments
from slidedp.spec.units import GIB
from slidedp.spec.workload import Workload

TIERS = (Moments.FP32, Moments.BF16, Moments.INT8)  # preferred first (module docstring)


def host_bytes_by_tier(wl: Workload, plan: Plan) -> dict[Moments, float]:
    """The plan's whole host footprint (bytes) with each moments format."""
    return {m: sum(host_footprint(wl, with_moments(plan, m)).values()) for m in TIERS}


def describe_tiers(hw: HardwareSpec, sizes: dict[Moments, float]) -> str:
    """'fp32 168.6 GiB, bf16 113.4, int8 86.4 (host RAM 125.0 GiB)'."""
    parts = [f"{m} {b / GIB:.1f}" + (" GiB" if i == 0 else "") for i, (m, b) in enumerate(sizes.items())]
    return ", ".join(parts) + f" (host RAM {hw.host.ram_bytes / GIB:.1f} GiB)"


def choose_tier(hw: HardwareSpec, wl: Workload, plan: Plan) -> tuple[Plan, str]:
    """(plan with the first moments format of TIERS whose host footprint fits, why)."""
    sizes = host_bytes_by_tier(wl, plan)
    table = describe_tiers(hw, sizes)
    for m in TIERS:
        if sizes[m] <= hw.host.ram_bytes:
            if m == TIERS[0]:
                return with_moments(plan, m), f"moments {m}: the host holds the FP32 state " \
                                                 f"(host memory by moments: {table})"
            return with_moments(plan, m), (
                f"moments {m}: the cheapest format whose host state fits (host memory by "
                f"moments: {table})")
    raise InfeasiblePlan("host memory", sizes[TIERS[-1]], hw.host.ram_bytes,
                         f"even with {TIERS[-1]} moments (host memory by moments: {table})")
