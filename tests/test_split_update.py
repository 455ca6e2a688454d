"""The split clipping schedule (plan.clip_schedule = split, graph/ and exec/features/
split_update.py) against the joined one (the synchronous reference) on the CPU: bit for bit in
losses, norms and the flushed master; in the engine's sync mode; across a flush (what a
checkpoint, an evaluation or the export does); through `slidedp train --resume`. Its graph:
the edges that keep it exact, and predict's host memory for Qwen3-8B on one H200 host.
(Two rank processes: tests/test_dist_engine.py, combos "-clip-split".)"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from slidedp import cli
from slidedp.exec import adamw
from slidedp.exec.adamw import AdamWConfig
from slidedp.exec.engine import Engine
from slidedp.graph.build import build_graph
from slidedp.graph.features import split_update
from slidedp.graph.tasks import EdgeKind, Kind
from slidedp.model.memory import host_footprint
from slidedp.spec.hardware import load_hardware
from slidedp.spec.model import load_model, parse_hf_config
from slidedp.spec.plan import ClipSchedule, Plan, plan_for_clipping
from slidedp.spec.units import MIB
from slidedp.spec.workload import Workload

CFG = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 64,
       "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "attention_bias": False}
OPT = AdamWConfig(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SEQ, STEPS = 16, 4
# upload chunks of 2500 elements, gradient chunks of 1700: an UPDATE_CAST reads pieces of
# several pending gradient chunks; a ring of two slots grows to the step. The split schedule's
# chunks hold BF16 (2 B on the wire), the joined one's FP32: twice the MiB for the same elements
# (the norm then sums the same partial sums)
PLAN = Plan(window_slots=2, h2d_chunk_mib=2500 * 2 / MIB, d2h_chunk_mib=1700 * 2 / MIB,
            d2h_staging_chunks=2, update_workers=2, defer_update=True)
MIB_PER_WIRE = {"split": 1, "joined": 2}


def _batches():
    gen = torch.Generator().manual_seed(1)
    return [(ids := torch.randint(0, CFG["vocab_size"], (4, SEQ), generator=gen), ids.clone())
            for _ in range(STEPS)]


def _train(schedule: str, dtype=torch.float32, max_norm=0.5, mode="overlap", flush_after=()):
    wl = Workload(parse_hf_config(CFG, "test"), seq_len=SEQ, global_batch=4, micro_batch=2,
                  gpus=1)
    opt = replace(OPT, grad_clip=max_norm)
    plan = replace(PLAN, clip_schedule=schedule,
                   d2h_chunk_mib=PLAN.d2h_chunk_mib * MIB_PER_WIRE[schedule])
    with Engine(CFG, wl, plan, optimizer=opt, mode=mode, dtype=dtype) as eng:
        eng.host_state.init_random(AutoConfig.for_model(**CFG), seed=0)
        results = []
        for i, (ids, labels) in enumerate(_batches()):
            results.append(eng.step(ids, labels))
            if i in flush_after:
                eng.flush()
        eng.flush()
        hs = eng.host_state
        names = [f.name for f in eng.features]
        return results, [hs.unit_master(u).clone() for u in range(hs.n_units)], names


def _same(a, b):
    (ra, pa, _), (rb, pb, _) = a, b
    assert [r.loss for r in ra] == [r.loss for r in rb]
    assert [r.grad_norm for r in ra] == [r.grad_norm for r in rb]
    assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_norm", [0.5, 100.0])  # clips every step / never
def test_split_equals_joined_bit_for_bit(dtype, max_norm):
    split, joined = _train("split", dtype, max_norm), _train("joined", dtype, max_norm)
    assert split[2][0] == "split_update" and joined[2][0] == "deferred_update"
    clipped = [r.grad_norm > max_norm for r in split[0]]
    assert all(clipped) if max_norm < 1 else not any(clipped)
    _same(split, joined)
    # the update of step t ran in step t+1: commits (ADAM) before that step's last D2H
    recs = split[0][-1].timeline.records
    assert min(r.start_s for r in recs if r.kind == "ADAM") < max(
        r.end_s for r in recs if r.kind == "D2H")


def test_split_overlap_equals_sync_and_a_flush_changes_nothing():
    a = _train("split", torch.bfloat16)
    _same(a, _train("split", torch.bfloat16, mode="sync"))
    _same(a, _train("split", torch.bfloat16, flush_after=(0, 2)))


def test_resume_with_clipping_is_bit_exact(tmp_path):
    """A run of 6 steps whose updates all spill into the next step, against 3 steps, a
    checkpoint (after a flush) and --resume to 6: the same losses and final model."""
    args = ["--global-batch", "8", "--micro-batch", "4", "--device", "cpu", "--grad-clip",
            "0.05", "--checkpoint-every", "0"]

    def run(out, *extra):
        return cli.main(["train", "--out", str(out), *args, *extra])

    def metrics(out):
        import json
        return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]

    from safetensors.torch import load_file
    assert run(tmp_path / "a", "--steps", "6") == 0
    assert run(tmp_path / "b", "--steps", "3") == 0
    assert run(tmp_path / "b", "--resume", "steps=6") == 0
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert all(r["grad_norm"] > 0.05 for r in a)  # every step clipped
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    ta, tb = (load_file(str(p / "final" / "model.safetensors")) for p in (tmp_path / "a",
                                                                            tmp_path / "b"))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def _graph(plan: Plan, **kw):
    wl = Workload(load_model("qwen3-0.6b"), seq_len=512, global_batch=2, micro_batch=2, gpus=1)
    return build_graph(wl, plan, 16, iterations=3, **kw)


def _preds(g, v: int, kind: Kind | None = None) -> set[int]:
    sel = (g.edge_dst == v) & (g.edge_kind != EdgeKind.ORDER)
    return {int(s) for s in g.edge_src[sel] if kind is None or g.kind[s] == kind}


def test_split_graph_edges_keep_it_exact():
    g = _graph(plan_for_clipping(Plan(window_slots=3), 1.0))
    kind, it, unit = g.kind, g.iteration, g.unit
    casts = np.flatnonzero(kind == Kind.UPDATE_CAST)
    assert set(it[casts].tolist()) == {1, 2}  # step 0 has nothing pending
    for t in (1, 2):  # the first UPDATE_CAST of t waits for every gradient chunk of t-1 (norm)
        first = int(casts[it[casts] == t][0])
        producers = set(np.flatnonzero((kind == Kind.D2H) & (it == t - 1)).tolist())
        assert producers <= _preds(g, first)
    adams = np.flatnonzero(kind == Kind.ADAM)
    assert set(it[adams].tolist()) == {1, 2}
    for a in adams.tolist():  # each commit after the UPDATE_CASTs of its range in its step
        lo, hi = g.elem_lo[a], g.elem_hi[a]
        readers = {int(v) for v in casts if it[v] == it[a] and unit[v] == unit[a]
                   and g.elem_lo[v] < hi and lo < g.elem_hi[v]}
        assert readers and readers <= _preds(g, a, Kind.UPDATE_CAST)
    for c in np.flatnonzero((kind == Kind.CAST) & (it > 0)).tolist():  # backward re-uploads
        assert _preds(g, c, Kind.ADAM), "a re-upload CAST reads the committed master"
    # the executor's template: one steady step, the previous step's update pending
    tpl = _graph(plan_for_clipping(Plan(window_slots=3), 1.0), update_pending=True)
    assert (tpl.kind == Kind.UPDATE_CAST).any() and (tpl.kind == Kind.ADAM).any()


def test_grad_clip_zero_and_joined_keep_their_graphs():
    base = Plan(window_slots=3)
    assert plan_for_clipping(base, 0.0) == base
    joined = _graph(plan_for_clipping(replace(base, clip_schedule=ClipSchedule.JOINED), 1.0))
    assert not (joined.kind == Kind.UPDATE_CAST).any()
    assert plan_for_clipping(base, 1.0).clip_schedule == ClipSchedule.SPLIT  # the default


def test_qwen3_8b_with_clipping_fits_one_h200_host():
    hw = load_hardware("h200x1")
    wl = Workload(load_model("qwen3-8b"), seq_len=4096, global_batch=4, micro_batch=4, gpus=1)
    split = plan_for_clipping(Plan(), 1.0)
    joined = replace(split, clip_schedule=ClipSchedule.JOINED)
    total = {p.clip_schedule: sum(host_footprint(wl, p).values()) for p in (split, joined)}
    assert total[ClipSchedule.SPLIT] <= hw.host.ram_bytes < total[ClipSchedule.JOINED]
    assert total[ClipSchedule.SPLIT] < total[ClipSchedule.JOINED] - 2 * sum(
        wl.model.unit_params()) * 0.9  # the held gradient: 2 B/param instead of 4
    assert split_update.SCRATCH_ELEMS == adamw.WIDEN_BLOCK  # its memory term's blocks


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_update_into_equals_the_update_bit_for_bit(monkeypatch, grad_dtype):
    """Any sub-range of a chunk, across block boundaries and in the scalar tail, as
    adamw_chunk computes it; the inputs untouched."""
    monkeypatch.setattr(adamw, "WIDEN_BLOCK", 1024)
    monkeypatch.setattr(adamw, "_scratch", type(adamw._scratch)())
    gen = torch.Generator().manual_seed(0)
    n = 3701
    p, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    v = torch.rand(n, generator=gen) * 1e-6
    g = (torch.randn(n, generator=gen) * 1e-3).to(grad_dtype)
    ref = p.clone()
    adamw.adamw_chunk(ref, g.clone(), m.clone(), v.clone(), 3, OPT, 2e-3, 0.7)
    before = [x.clone() for x in (p, g, m, v)]
    for lo, hi in [(0, n), (5, 17), (1000, 2050), (1500, n), (3690, n)]:
        out = torch.empty(hi - lo)
        adamw.adamw_chunk_into(out, p, g, m, v, 3, OPT, 2e-3, 0.7, lo)
        assert torch.equal(out, ref[lo:hi]), (lo, hi)
    assert all(torch.equal(x, y) for x, y in zip(before, (p, g, m, v), strict=True))
