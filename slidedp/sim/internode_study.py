"""Study of the network between nodes: the step of K nodes against each node's NIC rate, for both
inter-node reductions (graph/features/internode.py), predicted (analytic) and simulated.

Weak scaling: every node keeps the one-node workload (micro-batch x GPUs per node, no
accumulation), so the global batch grows with K and the one-node step is the step K nodes would
take over an infinitely fast network. Per row:
    one_node_s       the one-node step (simulated)
    predicted_s      the analytic step of K nodes (model/predict.py)
    simulated_s      the simulated step of K nodes (sim/simulator.py)
    exposed_s        simulated_s - one_node_s: what the network adds to the step
    nic_busy_s       the NIC's busy seconds per step (simulated)
    nic_bytes        bytes each NIC sends per step (the ring's share of the NODE_* tasks' buffers)
Consumed by notebooks/multinode_network.ipynb and benchmarks/multinode_predictions.py.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from slidedp.graph.tasks import COLLECTIVE_OPS, Kind
from slidedp.model.predict import predict
from slidedp.sim.simulator import simulate
from slidedp.spec.hardware import load_hardware
from slidedp.spec.model import load_model
from slidedp.spec.network import NODE_OPS, wire_share
from slidedp.spec.plan import InternodeReduce, Plan
from slidedp.spec.units import GB
from slidedp.spec.workload import Workload

NODE_KINDS = (int(Kind.NODE_REDUCE), int(Kind.NODE_GATHER))


def node_scaling(hardware: str, model: str, nodes: list[int], nic_gbps: list[float],
                 reduces: list[str] = ("all_reduce", "reduce_scatter"), seq: int = 4096,
                 micro_batch: int = 4, plan: Plan | None = None) -> pd.DataFrame:
    """One row per (nodes, NIC rate, reduction) on `hardware` (module docstring)."""
    base_hw, m = load_hardware(hardware), load_model(model)
    gpus, base = base_hw.gpu.count, plan or Plan()
    one = Workload(m, seq, micro_batch * gpus, micro_batch, gpus)
    one_s = simulate(base_hw, one, base).step_time_s
    rows = []
    for K in nodes:
        wl = replace(one, global_batch=one.global_batch * K, nodes=K)
        for rate in nic_gbps:
            hw = replace(base_hw, network=replace(base_hw.network, nodes=K, nic_bps=rate * GB))
            for reduce in reduces:
                p = replace(base, internode_reduce=InternodeReduce(reduce))
                pred = predict(hw, wl, p)
                res = simulate(hw, wl, p)
                rows.append({"hardware": hardware, "model": model, "nodes": K, "nic_gbps": rate,
                             "nic_gbit_per_s": rate * 8, "reduce": reduce,
                             "one_node_s": one_s, "predicted_s": pred.step_time_s,
                             "simulated_s": res.step_time_s,
                             "exposed_s": res.step_time_s - one_s,
                             "nic_busy_s": res.busy_s.get("nic", 0.0),
                             "nic_bytes": nic_bytes(res.graph, K),
                             "tokens_per_s": res.tokens_per_s})
    return pd.DataFrame(rows)


def nic_bytes(g, nodes: int) -> float:
    """Bytes one NIC sends in one steady iteration of graph g (the ring's share, spec/network.py)."""
    mine = np.isin(g.kind, NODE_KINDS) & (g.iteration == g.n_iterations - 1)
    return float(sum(g.work[mine & (g.op == i)].sum() * wire_share(op, nodes)
                     for i, op in enumerate(COLLECTIVE_OPS) if op in NODE_OPS))
