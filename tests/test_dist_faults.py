"""A rank that raises or dies stops the whole job quickly, with the rank and the cause named.

Two rank processes (gloo, CPU) train one step, local rank 0 writes a checkpoint from the shared
host state, then in step 2 rank 1's backward either raises or kills its own process (SIGKILL);
in mode kill-term it first sends rank 0 a SIGTERM, as torchrun does when its monitor sees the
dead rank before rank 0's watchdog has (the race a fixed monitor interval leaves open); in mode
term nothing fails but rank 1 gets a SIGTERM (a user's kill, a preemption) and both ranks go on
training: rank 1 must stop as the failed one, and rank 0 must name it.
Expected: torchrun returns non-zero within a bounded time of the fault (rank 1 writes the
fault's CLOCK_MONOTONIC time, one clock for the host's processes, so the two ranks' start-up on
a loaded machine does not count); rank 0 prints
"slidedp rank 0: stopping: rank 1 failed: <cause>"; nothing of the job is left in /dev/shm; the
step-1 checkpoint loads and holds the state after step 1.
Run as a script, this file is the rank worker: python tests/test_dist_faults.py OUT_DIR MODE.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from slidedp.exec.adamw import AdamWConfig
from slidedp.exec.dist.launch import torchrun_argv
from slidedp.spec.model import parse_hf_config
from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload

# one xdist worker runs the torchrun jobs of the dist modules one at a time (addopts: --dist
# loadgroup): two at once on the 2-core CI machine stretch their timing-bound checks
pytestmark = pytest.mark.xdist_group("dist")

CFG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
       "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
       "vocab_size": 256, "max_position_embeddings": 64, "tie_word_embeddings": False}
SEQ, STOP_BOUND_S = 16, 30.0  # the fault -> torchrun's exit: FAIL_GRACE_S 10 s and teardown


def _worker(out: Path, mode: str, device: str) -> None:
    from transformers import AutoConfig

    from slidedp.exec.checkpoint import save_checkpoint
    from slidedp.exec.dist.session import DistSession
    from slidedp.exec.engine import Engine
    from slidedp.exec.io.hf import fingerprint
    from slidedp.graph.tasks import Kind

    with DistSession(device=device, timeout_s=30, num_threads=1) as sess:
        (out / "name").write_text(sess.name)
        wl = Workload(parse_hf_config(CFG, "test"), seq_len=SEQ, global_batch=4, micro_batch=1,
                      gpus=2)
        numels = wl.model.unit_params()
        hs = sess.host_state(numels, init=lambda h: h.init_random(AutoConfig.for_model(**CFG), 0))
        eng = Engine(CFG, wl, Plan(grad_route="cpu", update_sharding="sharded"),
                     optimizer=AdamWConfig(lr=1e-3), host_state=hs, session=sess)
        ids = torch.randint(0, CFG["vocab_size"], (4, SEQ), generator=torch.Generator().manual_seed(0))
        eng.step(ids)
        if sess.local_rank == 0:
            units = ((u, hs.unit_master(u), hs.unit_m(u), hs.unit_v(u)) for u in range(len(numels)))
            save_checkpoint(out / "ckpt", 1, units, {"fingerprint": fingerprint("llama", numels)})
            torch.save([hs.unit_master(u).clone() for u in range(len(numels))], out / "step1.pt")
        sess.barrier()
        if sess.rank == 1:
            def faulty(bwd, d, v):
                if int(eng.tpl.g.unit[v]) == 1:  # mid-backward, after some updates streamed
                    if not (out / "fault_t").exists():
                        (out / "fault_t").write_text(repr(time.monotonic()))
                    if mode == "kill-term":  # rank 0's pid from the status block
                        os.kill(int(sess._status[sess.world_size]), signal.SIGTERM)
                    if mode in ("kill", "kill-term"):
                        os.kill(os.getpid(), signal.SIGKILL)
                    if mode != "term":
                        raise RuntimeError("injected fault in BWD")
                    if not signalled:  # once; then train on
                        signalled.append(os.kill(os.getpid(), signal.SIGTERM))
                bwd(d, v)

            signalled: list = []
            table = eng.interpreter.kernels  # this engine's kernels only
            for v, kernel in enumerate(table):
                if kernel is not None and eng.tpl.kind[v] == Kind.BWD:
                    table[v] = partial(faulty, kernel)
        for _ in range(2000 if mode == "term" else 1):  # term: train on until stopped
            eng.step(ids)
        raise AssertionError("step 2 returned despite the fault")


@pytest.mark.parametrize("mode", ["raise", "kill", "kill-term", "term"])
def test_failure_stops_every_rank_names_the_cause_and_keeps_the_checkpoint(mode, tmp_path):
    _check_fault(mode, tmp_path, "cpu")


@pytest.mark.gpu(2)
@pytest.mark.parametrize("mode", ["raise", "kill", "kill-term"])
def test_cuda_failure_stops_every_rank(mode, tmp_path):
    """NCCL: ranks blocked in collectives or on GPU events are stopped by the watchdog too."""
    _check_fault(mode, tmp_path, "cuda")


def _check_fault(mode: str, tmp_path: Path, device: str) -> None:
    from slidedp.exec.checkpoint import latest_checkpoint, load_checkpoint
    from slidedp.exec.io.hf import fingerprint

    proc = subprocess.run(torchrun_argv(2, [__file__, str(tmp_path), mode, device]),
                          capture_output=True,
                          text=True, timeout=120, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert (tmp_path / "fault_t").exists(), f"the job ended before the fault:\n{proc.stderr[-3000:]}"
    stop_s = time.monotonic() - float((tmp_path / "fault_t").read_text())
    assert proc.returncode != 0
    assert stop_s < STOP_BOUND_S, f"the job took {stop_s:.0f} s to stop after the fault"
    cause = {"raise": "RuntimeError: injected fault in BWD",
             "term": "terminated by SIGTERM"}.get(mode, r"its process \(pid \d+\) died without a report")
    assert re.search(f"slidedp rank 0: stopping: rank 1 failed: {cause}", proc.stderr), \
        proc.stderr[-3000:]
    if mode in ("raise", "term"):
        assert f"slidedp rank 1: failed: {cause}" in proc.stderr
    assert "slidedp rank 0: failed" not in proc.stderr  # the healthy rank never takes the blame
    name = (tmp_path / "name").read_text()
    assert not list(Path("/dev/shm").glob(f"{name}*")), "shared memory left behind"
    wl = Workload(parse_hf_config(CFG, "test"), seq_len=SEQ, global_batch=4, micro_batch=1, gpus=2)
    numels = wl.model.unit_params()
    ckpt = latest_checkpoint(tmp_path / "ckpt")
    meta, reader = load_checkpoint(ckpt, fingerprint("llama", numels))
    assert meta["step"] == 1
    step1 = torch.load(tmp_path / "step1.pt")
    for u, n in enumerate(numels):
        master, m, v = torch.empty(n), torch.empty(n), torch.empty(n)
        reader.read_unit(u, master, m, v)
        assert torch.equal(master, step1[u])


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
