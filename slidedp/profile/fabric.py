"""The GPU fabric (>= 2 GPUs): topology, P2P link rate, NCCL collective rates by message size.

Kind, from the GPU-to-GPU cells of `nvidia-smi topo -m`: NV# between every pair -> nvswitch (an
NVSwitch, or a full NVLink mesh, which the model treats alike); each GPU NV# to exactly one other
-> nvlink-pairs; no NV# at all -> pcie; any other pattern -> unknown (None).
Link rate: `copies` back-to-back copies of one buffer from GPU 0 to its peer (an NV# peer, else
GPU 1), bytes / wall time synchronized on both GPUs; for nvlink-pairs also to a GPU outside the
pair (cross_pair_gbps).
Collectives: one process per GPU (torch.multiprocessing spawn), NCCL, bf16 zeros (sums stay
finite). For each op and full (unsharded) size B as FabricSpec.collective_s defines it, CUDA
events on the current stream around `ITERS` back-to-back calls after a barrier; the median over
`repeats`, then the slowest rank's. Bus bandwidth (NCCL's convention, as collective_s): bytes
each GPU sends / time, all_gather and reduce_scatter (R-1)/R B, all_reduce 2 (R-1)/R B,
reduce B. Latency: the median time of an all_reduce of `LATENCY_BYTES`.
"""

from __future__ import annotations

import json
import re
import socket
import statistics
import subprocess
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

from slidedp.profile.timing import wall_median_s
from slidedp.spec.hardware import COLLECTIVES

ITERS = 5
LATENCY_BYTES = 8 * 2**10
INIT_TIMEOUT_S = 120
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


# ---- topology --------------------------------------------------------------------------------


def gpu_link_matrix(topo: str) -> list[list[str]]:
    """The GPU x GPU cells of `nvidia-smi topo -m` ("X" on the diagonal); [] if none found."""
    table = [[c.strip() for c in _ANSI.sub("", ln).split("\t")] for ln in topo.splitlines()]
    gpu = re.compile(r"GPU\d+")
    header = next((c for c in table if "GPU0" in c[1:] and not gpu.fullmatch(c[0])), None)
    if header is None:
        return []
    cols = {i: int(c[3:]) for i, c in enumerate(header) if gpu.fullmatch(c)}
    rows = {int(c[0][3:]): {g: c[i] for i, g in cols.items() if i < len(c)}
            for c in table if gpu.fullmatch(c[0])}
    n = len(cols)
    if sorted(rows) != list(range(n)) or any(len(r) != n for r in rows.values()):
        return []
    return [[rows[i][j] for j in range(n)] for i in range(n)]


def nv_peers(matrix: list[list[str]]) -> list[set[int]]:
    return [{j for j, c in enumerate(row) if j != i and c.startswith("NV")}
            for i, row in enumerate(matrix)]


def fabric_kind(matrix: list[list[str]]) -> str | None:
    n = len(matrix)
    if n < 2:
        return None
    peers = nv_peers(matrix)
    if all(len(p) == n - 1 for p in peers):
        return "nvswitch"
    if all(len(p) == 1 and i in peers[next(iter(p))] for i, p in enumerate(peers)):
        return "nvlink-pairs"
    if not any(peers):
        return "pcie"
    return None


def read_topology() -> str:
    """`nvidia-smi topo -m` output, or "" when nvidia-smi is absent or fails."""
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout if out.returncode == 0 else ""


# ---- P2P -------------------------------------------------------------------------------------


def p2p_bps(src: int, dst: int, nbytes: int, copies: int, warmup: int, repeats: int) -> float:
    a = torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{src}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")

    def copy():
        for _ in range(copies):
            b.copy_(a, non_blocking=True)

    def sync():
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)

    with torch.cuda.device(src):
        t = wall_median_s(copy, warmup, repeats, sync)
    return copies * nbytes / t


# ---- collectives -----------------------------------------------------------------------------


def bus_bytes(op: str, nbytes: float, ranks: int) -> float:
    """Bytes each GPU sends in a ring collective over a full buffer of `nbytes`."""
    f = {"all_gather": (ranks - 1) / ranks, "reduce_scatter": (ranks - 1) / ranks,
         "all_reduce": 2 * (ranks - 1) / ranks, "reduce": 1.0}[op]
    return nbytes * f


def _op(op: str, nbytes: int, world: int, dev: torch.device):
    import torch.distributed as dist

    n = max(nbytes // 2 // world, 1) * world  # bf16 elements, a multiple of the ranks
    full = torch.zeros(n, dtype=torch.bfloat16, device=dev)
    shard = torch.zeros(n // world, dtype=torch.bfloat16, device=dev)
    return {"all_gather": lambda: dist.all_gather_into_tensor(full, shard),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
            "all_reduce": lambda: dist.all_reduce(full),
            "reduce": lambda: dist.reduce(full, dst=0)}[op]


def _time_op(fn, warmup: int, repeats: int) -> float:
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(ITERS):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / ITERS)
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, sizes: list[int], warmup: int, repeats: int,
            out_path: str) -> None:
    import torch.distributed as dist

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=INIT_TIMEOUT_S),
                            device_id=dev)
    try:
        keys, times = [], []
        for op in COLLECTIVES:
            for nbytes in sizes:
                keys.append((op, nbytes))
                times.append(_time_op(_op(op, nbytes, world, dev), warmup, repeats))
        keys.append(("latency", LATENCY_BYTES))
        times.append(_time_op(_op("all_reduce", LATENCY_BYTES, world, dev), warmup, repeats))
        slowest = torch.tensor(times, dtype=torch.float64, device=dev)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            rows = [[op, nb, t] for (op, nb), t in zip(keys, slowest.tolist(), strict=True)]
            Path(out_path).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collective_times_s(gpus: int, sizes: list[int], warmup: int, repeats: int,
                       timeout_s: float) -> dict[tuple[str, int], float]:
    """{(op, full bytes): seconds} over all `gpus`, plus ("latency", LATENCY_BYTES)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "collectives.json"
        ctx = mp.start_processes(_worker, args=(gpus, _free_port(), sizes, warmup, repeats,
                                                str(out)), nprocs=gpus, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise RuntimeError(f"NCCL collectives did not finish within {timeout_s:.0f} s")
        return {(op, nb): t for op, nb, t in json.loads(out.read_text())}
