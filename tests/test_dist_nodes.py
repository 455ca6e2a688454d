"""K = 2 nodes of R rank processes (gloo, CPU), each node with its own host state, train like
plain torch AdamW on the same global batches.

One launch per R in {1, 2} (launch(..., nodes=2): two torchrun agents on this host joined by a
c10d rendezvous) runs the intra-node routes (param replicated / sharded x gradient gpu / cpu x
update rank0 / sharded where R = 2) and one clipped combination (deferred update: the norm read
after the nodes' reduction) in the same rank processes; the test then checks, from what each
rank recorded:
  equivalence  losses and final parameters against plain torch AdamW on the global batch of
               K R micro-batches x accumulation (loss diff <= 1e-4, ||p - p_ref|| /
               ||p_ref - p_init|| <= 1e-3), and the norm of the global gradient
  nodes        K distinct host states (their shared-memory names), and every node's master
               copy identical bit for bit after every combination (a BLAKE2b of each)
  I2           one ADAM per chunk per node, one NODE_REDUCE before each
  cleanup      nothing of the job left in /dev/shm
Run as a script, this file is the rank worker: python tests/test_dist_nodes.py OUT_DIR.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from reference import plain_adamw

from slidedp.exec.adamw import AdamWConfig
from slidedp.exec.dist.launch import launch
from slidedp.exec.host_state import SHM_DIR
from slidedp.spec.model import parse_hf_config
from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload

pytestmark = pytest.mark.xdist_group("dist")

MIB = 2**20
NODES = 2
CFG = json.loads((Path(__file__).parents[1] / "slidedp/presets/models/tiny-qwen3.json").read_text())
CFG = CFG | {"num_hidden_layers": 2}
OPT = AdamWConfig(lr=2e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
SEQ, SEED, STEPS, MICRO, ACCUM = 16, 0, 2, 1, 2
CLIP = 0.5  # below every step's gradient norm here: clips every step


def combos(ranks: int) -> dict[str, Plan]:
    base = dict(window_slots=2, h2d_chunk_mib=3000 * 2 / MIB, d2h_chunk_mib=2000 * 2 / MIB,
                staging_chunks=2, d2h_staging_chunks=2)
    names = (["replicated-gpu-rank0", "sharded-gpu-sharded", "replicated-cpu-sharded",
              "sharded-cpu-rank0"] if ranks > 1 else ["replicated-gpu-rank0"])
    out = {}
    for name in names:
        param, grad, upd = name.split("-")
        out[name] = Plan(param_route=param, grad_route=grad, update_sharding=upd,
                         update_workers=2 if upd == "rank0" else 1, **base)
    first = names[1] if ranks > 1 else names[0]
    out[f"{first}-clip"] = replace(out[first], defer_update=True, clip_schedule="joined")
    return out


def workload(ranks: int) -> Workload:
    return Workload(parse_hf_config(CFG, "test"), seq_len=SEQ,
                    global_batch=NODES * ranks * MICRO * ACCUM, micro_batch=MICRO, gpus=ranks,
                    nodes=NODES)


def batches(batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, CFG["vocab_size"], (batch, SEQ), generator=gen)
        labels = ids.clone()
        labels[-1, :3] = -100
        out.append((ids, labels))
    return out


def _digest(units) -> str:
    h = hashlib.blake2b(digest_size=12)
    for t in units:
        h.update(t.contiguous().numpy())
    return h.hexdigest()


# ---- the rank worker ------------------------------------------------------------------------------


def _worker(out_dir: Path) -> None:
    from transformers import AutoConfig

    from slidedp.exec.dist.session import DistSession
    from slidedp.exec.engine import Engine

    with DistSession(device="cpu", timeout_s=60, num_threads=1) as sess:
        R = sess.local_world_size
        results: dict = {"names": sess.node_names, "node": sess.node_rank}
        for name, plan in combos(R).items():
            wl = workload(R)
            numels = wl.model.unit_params()
            hs = sess.host_state(numels, None, init=lambda h: h.init_random(
                AutoConfig.for_model(**CFG), SEED))
            opt = replace(OPT, grad_clip=CLIP) if plan.defer_update else OPT
            rec = {"loss": [], "norm": [], "kinds": Counter()}
            with Engine(CFG, wl, plan, optimizer=opt, host_state=hs, session=sess) as eng:
                for ids, labels in batches(wl.global_batch):
                    res = eng.step(ids, labels)
                    rec["loss"].append(res.loss)
                    rec["norm"].append(res.grad_norm)
                    rec["kinds"].update((r.kind, r.iteration, r.unit, r.chunk)
                                        for r in res.timeline.records
                                        if r.kind in ("ADAM", "NODE_REDUCE"))
            if sess.local_rank == 0:
                masters = [hs.unit_master(u).clone() for u in range(len(numels))]
                rec["digest"] = _digest(masters)
                rec["masters"] = masters if sess.rank == 0 else None
            hs.close()
            sess.barrier()
            results[name] = rec
        torch.save(results, out_dir / f"rank{sess.rank}.pt")


# ---- the test (this process) ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=[1, 2], ids=["2x1", "2x2"])
def run(request, tmp_path_factory):
    R = request.param
    out = tmp_path_factory.mktemp(f"nodes2x{R}")
    before = set(SHM_DIR.glob("slidedp-*"))
    rc = launch(R, [__file__, str(out)], env=os.environ | {"OMP_NUM_THREADS": "1"},
                timeout_s=240, nodes=NODES)
    assert rc == 0, f"the job exited with {rc}"
    left = set(SHM_DIR.glob("slidedp-*")) - before
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(NODES * R)]
    data = batches(NODES * R * MICRO * ACCUM)
    refs = {"plain": plain_adamw(CFG, data, OPT, SEED),
            "clip": plain_adamw(CFG, data, replace(OPT, grad_clip=CLIP), SEED)}
    return R, ranks, refs, left


def test_every_route_matches_plain_adamw_on_the_global_batch(run):
    R, ranks, refs, _ = run
    for name, plan in combos(R).items():
        losses, norms, init, params = refs["clip" if plan.defer_update else "plain"]
        got = ranks[0][name]
        for r in range(1, NODES * R):
            assert ranks[r][name]["loss"] == got["loss"], f"{name}: ranks report different losses"
            assert ranks[r][name]["norm"] == got["norm"], f"{name}: ranks report different norms"
        for step, (loss, ref) in enumerate(zip(got["loss"], losses, strict=True)):
            assert abs(loss - ref) <= 1e-4, f"{name} step {step}: {loss} vs {ref}"
        for step, (norm, ref) in enumerate(zip(got["norm"], norms, strict=True)):
            assert norm == pytest.approx(ref, rel=1e-4), f"{name} step {step}: norm {norm} vs {ref}"
        if plan.defer_update:
            assert all(n > CLIP for n in got["norm"]), f"{name}: a step was not clipped"
        for u, (p, pr, p0) in enumerate(zip(got["masters"], params, init, strict=True)):
            rel = float((p - pr).norm() / (pr - p0).norm())
            assert rel <= 1e-3, f"{name} unit {u}: {rel:.2e} from plain AdamW"


def test_each_node_has_its_own_host_state_and_they_stay_identical(run):
    R, ranks, _, left = run
    names = ranks[0]["names"]
    assert len(names) == NODES and len(set(names)) == NODES, names
    assert [ranks[r]["node"] for r in range(NODES * R)] == [r // R for r in range(NODES * R)]
    for name in combos(R):
        digests = [ranks[n * R][name]["digest"] for n in range(NODES)]
        assert len(set(digests)) == 1, f"{name}: the nodes' master copies differ: {digests}"
    assert not left, f"shared memory left behind: {sorted(left)}"


def test_one_node_reduce_before_each_adam_on_every_node(run):
    R, ranks, _, _ = run
    for name in combos(R):
        for n in range(NODES):
            kinds = sum((ranks[n * R + r][name]["kinds"] for r in range(R)), Counter())
            adams = {k[1:]: c for k, c in kinds.items() if k[0] == "ADAM"}
            reduces = {k[1:]: c for k, c in kinds.items() if k[0] == "NODE_REDUCE"}
            assert adams and set(adams.values()) == {1}, f"{name} node {n}: ADAM not once"
            assert reduces == adams, f"{name} node {n}: a NODE_REDUCE per ADAM"


if __name__ == "__main__":
    torch.set_num_threads(1)
    _worker(Path(sys.argv[1]))
