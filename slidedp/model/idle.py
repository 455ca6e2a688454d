"""Two measures of a step's waiting, side by side in the JSON of `predict` and `simulate`.

    E           exposed_s = step - max(C, H): what neither the GPU compute C (the busiest
                rank's) nor the busiest host-side resource H covers. A host-bound step whose
                host work hides nothing else has E = 0 though its GPUs wait.
    gpu_idle_s  per rank r (list index r): step - rank r's compute in the step, the seconds
                GPU r has nothing to compute, whatever it waits for (a host-bound step's
                uploads included). Never below E where rank r is the busiest compute stream.
Both come from the same busy seconds the bound reads (agent:gpu{r}.compute): the analytic
model's last iteration, or the simulator's steady window.
"""

from __future__ import annotations

EXPOSURE_HELP = (
    "Exposure, two figures: E (exposed_s) = step - max(C, H), what neither the GPU compute C "
    "nor the busiest host resource H hides; gpu_idle_s (JSON, one per rank) = step - that "
    "rank's compute, every second the GPU waits. A host-bound step may have E = 0 while its "
    "GPUs idle. Host placement per socket ([topology] memory, the cast and update teams per "
    "socket) is a model feature: `train` runs on one NUMA node, where it changes nothing.")


def gpu_idle_s(step_s: float, busy_s: dict[str, float], ranks: int) -> list[float]:
    """Per rank, the step minus its compute stream's busy seconds (module docstring)."""
    return [max(0.0, step_s - busy_s[f"agent:gpu{r}.compute"]) for r in range(ranks)]
