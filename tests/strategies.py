"""Hypothesis strategies for random small models, workloads and plans (shared by graph/model/sim tests)."""

from hypothesis import strategies as st

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
