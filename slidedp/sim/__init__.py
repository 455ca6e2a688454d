"""Discrete-event simulator (simpy) of the task graph: contention, buffers, version gates, exposure.

    simulate(hw, wl, plan, SimConfig()) -> SimResult    (slidedp.sim.simulator)
Modules: resources (what tasks draw on, the sharing rule), engine (simpy processes), exposure
(why a GPU idles), result (steady-state figures, Timeline), plot (Gantt), microbench (host
microbenchmarks as synthetic graphs), studies (scaling and route helpers), sweep (grids).
"""

from slidedp.sim.engine import SimConfig
from slidedp.sim.result import SimResult
from slidedp.sim.simulator import simulate, simulate_graph

__all__ = ["SimConfig", "SimResult", "simulate", "simulate_graph"]
