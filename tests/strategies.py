"""Hypothesis strategies for random small models, workloads and plans (shared by graph/model/sim tests)."""

import tomllib

from hypothesis import strategies as st

from slidedp.spec.hardware import preset_dir
from slidedp.spec.model import parse_hf_config
from slidedp.spec.plan import ClipSchedule, GradRoute, ParamRoute, Plan, UpdateSharding
from slidedp.spec.workload import Workload


@st.composite
def small_models(draw):
    heads = draw(st.sampled_from([2, 4]))
    cfg = {
        "model_type": "qwen3", "vocab_size": draw(st.sampled_from([64, 256, 1000])),
        "hidden_size": draw(st.sampled_from([32, 64, 128])),
        "intermediate_size": draw(st.sampled_from([64, 96, 256])),
        "num_hidden_layers": draw(st.integers(1, 5)), "num_attention_heads": heads,
        "num_key_value_heads": draw(st.sampled_from([1, heads])), "head_dim": 16,
        "tie_word_embeddings": draw(st.booleans()),
    }
    return parse_hf_config(cfg, "random config")


@st.composite
def small_workloads(draw, max_gpus: int = 3):
    m = draw(small_models())
    gpus = draw(st.integers(1, max_gpus))
    mb = draw(st.integers(1, 2))
    accum = draw(st.integers(1, 2))
    return Workload(m, draw(st.sampled_from([16, 64])), mb * gpus * accum, mb, gpus)


@st.composite
def small_plans(draw):
    return Plan(
        param_route=draw(st.sampled_from(list(ParamRoute))),
        grad_route=draw(st.sampled_from(list(GradRoute))),
        update_sharding=draw(st.sampled_from(list(UpdateSharding))),
        h2d_chunk_mib=draw(st.sampled_from([0.002, 0.01, 64.0])),
        d2h_chunk_mib=draw(st.sampled_from([0.003, 0.02, 64.0])),
        window_slots=draw(st.integers(2, 4)),
        staging_chunks=draw(st.integers(1, 4)),
        grad_buffers=draw(st.integers(1, 3)),
        d2h_staging_chunks=draw(st.integers(1, 3)),
        offload_ratio=draw(st.sampled_from([0.0, 0.5, 1.0])),
        reload_ahead_layers=draw(st.integers(1, 2)),
        update_workers=draw(st.integers(1, 2)),
        host_bf16_copy=draw(st.booleans()),
        defer_update=draw(st.booleans()),
        clip_schedule=draw(st.sampled_from(list(ClipSchedule))),
    )


SRC = "test: a number for the test"


@st.composite
def topologies(draw):
    """(hardware dict with a random valid [topology], its switch of each GPU)."""
    n_sockets = draw(st.integers(1, 3))
    n_gpus = draw(st.integers(1, 8))
    n_switches = draw(st.integers(1, 5))
    rate = st.floats(1.0, 500.0)
    sockets = [{"cores": draw(st.integers(1, 64)), "ram_gib": float(draw(st.integers(1, 512))),
                "dram_gbps": draw(rate), "source": SRC} for _ in range(n_sockets)]
    for s in sockets:
        for key in ("dma_h2d_gbps", "dma_d2h_gbps", "dma_duplex_gbps", "p2p_gbps"):
            if draw(st.booleans()):
                s[key] = draw(rate)
    switches = []
    for i in range(n_switches):
        sw = {"socket": draw(st.integers(0, n_sockets - 1)), "h2d_gbps": draw(rate),
              "d2h_gbps": draw(rate), "source": SRC,
              "kind": draw(st.sampled_from(["switch", "root-port"]))}
        same = [j for j in range(i) if switches[j]["socket"] == sw["socket"]]
        if same and draw(st.booleans()):
            sw["parent"] = draw(st.sampled_from(same))  # parents before children: a tree
        for key in ("duplex_gbps", "p2p_gbps"):
            if draw(st.booleans()):
                sw[key] = draw(rate)
        switches.append(sw)
    gpus = {"switch": [draw(st.integers(0, n_switches - 1)) for _ in range(n_gpus)],
            "p2p": draw(st.sampled_from(["system", "socket", "switch", "none"])), "source": SRC}
    fabric = draw(st.sampled_from(["pcie", "nvlink-pairs", "nvswitch"] if n_gpus > 1
                                  else ["pcie", "nvswitch"]))
    if fabric == "nvswitch":
        gpus["nvswitch_gbps"] = draw(rate)
    elif fabric == "nvlink-pairs":
        gpus["nvlink"] = [[r, r + 1] for r in range(0, n_gpus - 1, 2)]
        gpus["nvlink_gbps"] = draw(rate)
    if gpus["p2p"] != "none" and draw(st.booleans()):
        gpus["p2p_gbps"] = draw(rate)
    table = {"source": SRC, "memory": draw(st.sampled_from(["interleave", "shard", "local"])),
             "socket": sockets, "switch": switches, "gpus": gpus}
    if n_sockets > 1:
        table["socket_link_gbps"] = draw(rate)
    raw = tomllib.loads((preset_dir() / "h200x2.toml").read_text())
    raw["gpu"]["count"] = n_gpus
    raw["host"]["cores"] = sum(s["cores"] for s in sockets)
    raw["host"]["ram_gib"] = sum(s["ram_gib"] for s in sockets)
    raw["fabric"]["kind"] = fabric
    raw["topology"] = table
    return raw
