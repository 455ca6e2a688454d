"""Peers side by side on one GPU (issue 27 item 4): `slidedp train` on its default path against
GPU-resident mixed precision, the compute-only reference and DeepSpeed ZeRO-2 with CPU offload,
each with liger-kernel's kernels and with eager transformers; one table.

Systems. Every row runs in a process of its own (kernel patches, GPU and host memory start clean);
a row whose process runs out of GPU memory reports `does not fit` with the allocation that failed.
  ours       `slidedp train --model M --data tok.npy --seq S --global-batch MB --micro-batch MB
             --steps N --lr 1e-5 --out DIR` on random tokens: the default plan. Its liger row
             passes no --kernels (the default, auto, must pick liger on the GPU); its eager row
             passes --kernels eager. The row is filed under the kernels train says it ran (and
             says what was asked where they differ). Step time: the executor's step_time_s of
             metrics.jsonl; GPU peak and host PSS: its last row. The run is stopped once step N
             is logged (the checkpoint and export after it are no step).
  ours-clip  the same with --grad-clip 1.0
  resident   GPU-resident mixed precision: FP32 weights, gradients and AdamW state on the GPU, BF16
             autocast, torch's fused AdamW (lr 1e-5, betas 0.9/0.95), the HF model with SDPA and
             non-reentrant gradient checkpointing (../shared/tools/peer_probe.py `ref`)
  reference  compute_reference.py: BF16 weights resident, forward + backward, no optimizer
  zero2      DeepSpeed ZeRO-2 with the optimizer offloaded to pinned host memory (its CPU Adam),
             BF16, the same HF model and checkpointing (peer_probe.py `ds2`). Skipped, saying why,
             where deepspeed does not import or the host's MemAvailable is under 16 B/param (FP32
             master, m, v and gradient). Its CPU Adam compiles at first use: a process of its own
             builds it before the first zero2 row (`zero2-build`, timed, outside every row).
Liger for the HF peers: compute_reference.use_kernels (RoPE, RMSNorm, SwiGLU, fused linear +
cross-entropy), the kernels slidedp's liger plan runs (exec/fused_kernels.py).

Figures. Steps are timed between torch.cuda.synchronize() calls (ours: the executor's own
step_time_s); step s = mean of steps discard+1..N (default 12 steps, mean of 6-12). tokens/s =
micro-batch x seq / step s. TFLOP/s = model FLOPs with whole-layer recompute / step s, the count
RESULTS.md uses for every system (benchmarks/single_gpu.step_flops: L x (fwd + recompute + bwd) +
head (fwd + bwd) per token, fwd = 2 x layer matmul parameters + 2 x heads x head_dim x seq).
GPU peak = torch.cuda.max_memory_reserved; host PSS from /proc/self/smaps_rollup. Ratios are
throughput ratios at the same kernels and micro-batch: ours tokens/s / the peer's.

Budget. `--budget-s` bounds the rows' wall time. Rows run in PRIORITY order; a row whose estimate
(estimate_s: a guess from start-up and model FLOPs, or the same system's wall time at the other
kernels in this call) exceeds what is left is skipped, saying so; a running row is stopped at the
budget. The estimate only decides what to skip.

usage: python3 benchmarks/peers.py run --model qwen3-4b --micro-batch 4 --out OUT
           [--budget-s 480] [--steps 12] [--discard 5] [--seq 4096] [--systems ...] [--kernels ...]
       python3 benchmarks/peers.py table OUT1/peers.json [OUT2/peers.json ...] [--out DIR]
writes OUT/peers.json (rows + meta) and OUT/peers.md (the table); `table` merges several calls'.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GIB = 2**30
PREDICT_HARDWARE = "h200x1"  # the preset profiled on nvidia-h200, the machine peers_gpu.sh runs on
SYSTEMS = ("ours", "ours-clip", "resident", "reference", "zero2")
KERNELS = ("liger", "eager")
PRIORITY = (("ours", "liger"), ("resident", "liger"), ("ours-clip", "liger"), ("zero2", "liger"),
            ("reference", "liger"), ("resident", "eager"), ("ours", "eager"),
            ("zero2", "eager"), ("reference", "eager"), ("ours-clip", "eager"))
LABELS = {"ours": "slidedp train, default plan", "ours-clip": "slidedp train --grad-clip 1.0",
          "resident": "GPU-resident mixed precision, fused AdamW",
          "reference": "compute-only reference (fwd + bwd)",
          "zero2": "DeepSpeed ZeRO-2, CPU offload"}
PEERS = ("resident", "zero2", "reference")  # the ratio columns, against ours
# estimate_s's guesses: seconds of start-up (imports, model or host state, first step) and a
# sustained FLOP rate with recompute, per system (eager kernels: liger rows run faster)
START_S = {"ours": 45.0, "ours-clip": 45.0, "resident": 30.0, "reference": 25.0, "zero2": 60.0}
RATE_FLOPS = {"ours": 280e12, "ours-clip": 250e12, "resident": 330e12, "reference": 400e12,
              "zero2": 150e12}
ZERO2_HOST_BYTES_PER_PARAM = 16  # FP32 master, Adam m and v, FP32 gradient
ZERO2_BUILD_S = 120.0  # estimate_s's guess for the first zero2 row's CPU Adam build
ROW_MARK = "PEERS_ROW "
TAIL_LINES = 12
KERNELS_LINE = re.compile(r"; kernels (\w+) \(([^)]*)\)")


# ---- figures ------------------------------------------------------------------------------------


def steady_mean(steps: list[float], discard: int) -> float:
    """Mean of steps[discard:] (the steps after the first `discard`)."""
    if len(steps) <= discard:
        raise ValueError(f"{len(steps)} steps timed, more than {discard} needed")
    tail = steps[discard:]
    return sum(tail) / len(tail)


def step_flops(model: str, seq: int, micro_batch: int) -> float:
    """Model FLOPs of one step with whole-layer recompute (single_gpu.step_flops)."""
    from single_gpu import step_flops as flops

    from slidedp.spec.model import load_model
    from slidedp.spec.workload import Workload

    spec = load_model(model)
    return flops(spec, Workload(spec, seq, micro_batch, micro_batch, 1))


def finish_row(row: dict, steps_s: list[float], discard: int, flops: float) -> dict:
    """Add step_s, tokens_per_s and tflops to a row from its step times."""
    step = steady_mean(steps_s, discard)
    row.update(status="ok", all_steps_s=[round(x, 4) for x in steps_s], step_s=step,
               tokens_per_s=row["micro_batch"] * row["seq"] / step, tflops=flops / step / 1e12)
    return row


def ours_row(row: dict, metrics: list[dict], steps: int, discard: int, flops: float) -> dict:
    """An `ours` row from the rows of its metrics.jsonl (step_time_s; memory of the last row)."""
    done = sorted((m for m in metrics if 1 <= m["step"] <= steps), key=lambda m: m["step"])
    if [m["step"] for m in done] != list(range(1, steps + 1)):
        row.update(status="failed", note=f"metrics.jsonl has steps {[m['step'] for m in done]}")
        return row
    finish_row(row, [m["step_time_s"] for m in done], discard, flops)
    last = done[-1]
    row.update(gpu_peak_bytes=last.get("gpu_peak_bytes"), host_pss_bytes=last.get("host_pss_bytes"),
               loss_first_last=[done[0]["loss"], last["loss"]])
    return row


def read_jsonl(path: Path) -> list[dict]:
    """The complete JSON lines of a file being written (a partial last line is left out)."""
    out = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def summary(rows: list[dict]) -> list[dict]:
    """Per (model, micro-batch, kernels) with an `ours` row: ours tokens/s over each peer's and
    the clipped step's speed relative to the unclipped (None where a side is missing)."""
    ok = {(r["model"], r["micro_batch"], r["kernels"], r["system"]): r for r in rows
          if r.get("status") == "ok"}
    out = []
    for (model, mb, k, system), ours in sorted(ok.items(), key=lambda kv: _order(kv[0])):
        if system != "ours":
            continue
        s = {"model": model, "seq": ours["seq"], "micro_batch": mb, "kernels": k,
             "ours_tokens_per_s": ours["tokens_per_s"], "ours_tflops": ours["tflops"]}
        for peer in PEERS:
            p = ok.get((model, mb, k, peer))
            s[f"ours_over_{peer}"] = ours["tokens_per_s"] / p["tokens_per_s"] if p else None
        clip = ok.get((model, mb, k, "ours-clip"))
        s["clipped_over_unclipped"] = ours["step_s"] / clip["step_s"] if clip else None
        out.append(s)
    return out


def predicted_clip_ratio(model: str, seq: int, mb: int, kernels: str,
                         hardware: str = PREDICT_HARDWARE) -> tuple[float, float]:
    """(analytic, simulated) unclipped step / clipped step (--grad-clip 1.0) of `slidedp train
    --model M --seq S --global-batch MB --micro-batch MB` on the `hardware` preset, with the
    default plan and the row's kernels: the prediction the measured clipped / unclipped is
    compared with."""
    from slidedp.model.predict import predict
    from slidedp.sim.simulator import simulate
    from slidedp.spec.hardware import load_hardware
    from slidedp.spec.model import load_model
    from slidedp.spec.plan import Kernels, default_plan, plan_for_clipping
    from slidedp.spec.workload import Workload

    hw = load_hardware(hardware)
    wl = Workload(load_model(model), seq, mb, mb, 1)
    plain = default_plan(hw.fabric.kind).with_overrides(kernels=Kernels(kernels))
    clipped = plan_for_clipping(plain, 1.0)
    analytic = predict(hw, wl, plain).step_time_s / predict(hw, wl, clipped).step_time_s
    sim = simulate(hw, wl, plain).step_time_s / simulate(hw, wl, clipped).step_time_s
    return analytic, sim


def _order(key: tuple) -> tuple:
    model, mb, k, system = key
    return (model, mb, KERNELS.index(k) if k in KERNELS else 9,
            SYSTEMS.index(system) if system in SYSTEMS else 9)


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(rows: list[dict], metas: list[dict]) -> str:
    """The table: every row, then the ratios (summary()), then how each call ran."""
    lines = ["| model | mb | system | kernels | step s | tokens/s | TFLOP/s | GPU peak GiB | "
             "host PSS GiB | status |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: _order((r["model"], r["micro_batch"], r["kernels"],
                                                r["system"]))):
        gpu, pss = r.get("gpu_peak_bytes"), r.get("host_pss_bytes")
        status = r.get("status", "?") + (f": {r['note']}" if r.get("note") else "")
        lines.append(
            f"| {r['model']} | {r['micro_batch']} | {LABELS.get(r['system'], r['system'])} | "
            f"{r['kernels']} | {_f(r.get('step_s'), '.3f')} | {_f(r.get('tokens_per_s'), ',.0f')} | "
            f"{_f(r.get('tflops'), '.0f')} | {_f(gpu and gpu / GIB, '.1f')} | "
            f"{_f(pss and pss / GIB, '.1f')} | {status} |")
    lines += ["", "Ratios (tokens/s of ours over the peer's, same kernels and micro-batch; clipped "
              "= unclipped step s / clipped step s):", "",
              "| model | mb | kernels | ours tokens/s | ours TFLOP/s | / GPU-resident | "
              "/ ZeRO-Offload | / reference | clipped / unclipped | predicted, simulated "
              f"({PREDICT_HARDWARE}) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in summary(rows):
        pred = (predicted_clip_ratio(s["model"], s["seq"], s["micro_batch"], s["kernels"])
                if s["clipped_over_unclipped"] is not None else None)
        lines.append(
            f"| {s['model']} | {s['micro_batch']} | {s['kernels']} | "
            f"{s['ours_tokens_per_s']:,.0f} | {s['ours_tflops']:.0f} | "
            f"{_f(s['ours_over_resident'], '.3f')} | {_f(s['ours_over_zero2'], '.3f')} | "
            f"{_f(s['ours_over_reference'], '.3f')} | {_f(s['clipped_over_unclipped'], '.3f')} | "
            f"{'-' if pred is None else f'{pred[0]:.3f}, {pred[1]:.3f}'} |")
    lines += ["", "Calls:", ""]
    for m in metas:
        lines.append(f"- {m.get('date')} {m.get('gpu')} ({m.get('cpus')} cores, "
                     f"{_f(m.get('host_mem_gib'), '.0f')} GiB): `{m.get('command')}`; "
                     f"torch {m.get('torch')}, transformers {m.get('transformers')}, liger-kernel "
                     f"{m.get('liger_kernel')}, deepspeed {m.get('deepspeed')}; "
                     f"{m.get('steps')} steps, mean of {m.get('discard', 0) + 1}-{m.get('steps')}; "
                     f"zero2 CPU Adam build {_f(m.get('zero2_build_s'), '.0f')} s (not in any row)"
                     f"; rows took {_f(m.get('rows_wall_s'), '.0f')} s of a "
                     f"{_f(m.get('budget_s'), '.0f')} s budget")
    return "\n".join(lines) + "\n"


# ---- budget and processes -----------------------------------------------------------------------


class Budget:
    """Wall seconds left of `total_s` from construction (`clock`: time.monotonic)."""

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic):
        self.total_s, self.clock, self.t0 = total_s, clock, clock()

    def left_s(self) -> float:
        return self.total_s - (self.clock() - self.t0)


def estimate_s(system: str, flops: float, steps: int, walls: dict[str, float]) -> float:
    """A row's expected wall time: the same system's wall at the other kernels in this call if
    one ran (x1.1), else START_S + steps x flops / RATE_FLOPS (a guess; module docstring)."""
    if system in walls:
        return 1.1 * walls[system]
    return START_S[system] + steps * flops / RATE_FLOPS[system]


def run_process(cmd: list[str], log: Path, timeout_s: float, done: Callable[[], bool] = lambda: False,
                poll_s: float = 0.5, env: dict | None = None) -> tuple[int | None, float, str]:
    """Run `cmd` in a session of its own, output to `log`, until it exits, `done()` holds (then it
    is stopped: "done") or `timeout_s` passes (stopped: "timeout"). (exit code or None, wall s,
    how it ended: "exit" | "done" | "timeout")."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)
        how = "exit"
        while proc.poll() is None:
            if done():
                how = "done"
                break
            if time.monotonic() - t0 > timeout_s:
                how = "timeout"
                break
            time.sleep(poll_s)
        wall = time.monotonic() - t0
        if proc.poll() is None:
            stop_group(proc)
    return (proc.returncode if how == "exit" else None), wall, how


def stop_group(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM to the process group `proc` leads (run_process started it), SIGKILL after grace."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tail(log: Path, n: int = TAIL_LINES) -> list[str]:
    with contextlib.suppress(FileNotFoundError):
        return log.read_text(errors="replace").splitlines()[-n:]
    return []


def last_error(lines: list[str]) -> str:
    """The last line that names an error (else the last line) of a process's output."""
    for line in reversed(lines):
        if "Error" in line or "error:" in line or "refused" in line:
            return line.strip()[:300]
    return lines[-1].strip()[:300] if lines else "no output"


def deepspeed_importable() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def host_mem_available_bytes() -> int | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


# ---- the rows -----------------------------------------------------------------------------------


class Call:
    """One device call's rows for a model and its micro-batches (the `run` subcommand)."""

    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.work = Path(a.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.budget = Budget(a.budget_s)
        self.rows: list[dict] = []
        self.zero2_build_s: float | None = None
        self.zero2_why_not: str | None = None
        self.walls: dict[tuple[int, str], float] = {}

    def run(self) -> list[dict]:
        for mb in self.a.micro_batch:
            flops = step_flops(self.a.model, self.a.seq, mb)
            for system, k in PRIORITY:
                if system not in self.a.systems or k not in self.a.kernels:
                    continue
                row = {"model": self.a.model, "seq": self.a.seq, "micro_batch": mb,
                       "system": system, "kernels": k}
                walls = {s: w for (m, s), w in self.walls.items() if m == mb}
                est = estimate_s(system, flops, self.a.steps, walls)
                why = self.skip_reason(system, est)
                if why:
                    row.update(status="skipped", note=why)
                else:
                    self.one_row(row, flops)
                    self.walls[(mb, system)] = row.get("wall_s", est)
                self.rows.append(row)
                print(json.dumps(_rounded(row)), flush=True)
                self.save()
        return self.rows

    def skip_reason(self, system: str, est: float) -> str | None:
        """Why a row does not run (zero2 builds its CPU Adam here the first time), or None."""
        if system == "zero2":
            why = self.zero2_missing()
            if why:
                return why
            if self.zero2_build_s is None:
                est += ZERO2_BUILD_S
        left = self.budget.left_s()
        if est > left:
            return f"estimated {est:.0f} s, {max(left, 0):.0f} s of the budget left"
        return self.zero2_build() if system == "zero2" else None

    def zero2_missing(self) -> str | None:
        """Why zero2 cannot run here at all (no deepspeed, too little host memory), or None."""
        if self.zero2_why_not is None and not deepspeed_importable():
            self.zero2_why_not = "deepspeed does not import here"
        if self.zero2_why_not is None and not self.a.force_zero2:
            from slidedp.spec.model import load_model

            need = ZERO2_HOST_BYTES_PER_PARAM * load_model(self.a.model).total_params()
            avail = host_mem_available_bytes()
            if avail is not None and avail < need:
                self.zero2_why_not = (
                    f"needs {need / GIB:.0f} GiB of host memory ({ZERO2_HOST_BYTES_PER_PARAM} "
                    f"B/param), {avail / GIB:.0f} GiB available (--force-zero2 runs it anyway)")
        return self.zero2_why_not

    def zero2_build(self) -> str | None:
        """Build DeepSpeed's CPU Adam once, in a process of its own (timed: zero2_build_s);
        None once built, else why it did not."""
        if self.zero2_build_s is None and self.zero2_why_not is None:
            log = self.work / "zero2-build.log"
            rc, wall, how = run_process([sys.executable, __file__, "one", "zero2-build"], log,
                                        max(self.budget.left_s(), 1.0))
            if rc == 0:
                self.zero2_build_s = wall
            else:
                self.zero2_why_not = (f"its CPU Adam did not build ({how}): "
                                      f"{last_error(tail(log))}")
        return self.zero2_why_not

    def one_row(self, row: dict, flops: float) -> None:
        system, k, mb = row["system"], row["kernels"], row["micro_batch"]
        tag = f"{system}-{k}-mb{mb}"
        log = self.work / f"{tag}.log"
        timeout = max(self.budget.left_s(), 1.0)
        if system in ("ours", "ours-clip"):
            out = self.work / tag
            shutil.rmtree(out, ignore_errors=True)
            metrics = out / "metrics.jsonl"
            steps = self.a.steps

            def done() -> bool:
                return any(m.get("step") == steps for m in read_jsonl(metrics))

            rc, wall, how = run_process(self.train_cmd(row, out), log, timeout, done)
            lines = tail(log, 10**6)
            got = [m for line in lines for m in KERNELS_LINE.findall(line)]
            if got:
                row["kernels_ran"], row["kernels_why"] = got[-1]
            rows = read_jsonl(metrics)
            shutil.rmtree(out, ignore_errors=True)
            if how == "done" or (rc == 0 and rows):
                ours_row(row, rows, steps, self.a.discard, flops)
            else:
                self.failed(row, rc, how, tail(log))
            if row.get("kernels_ran", k) != k:  # filed under what ran, never under what was asked
                row.update(kernels=row["kernels_ran"], kernels_asked=k)
                row["note"] = (f"asked for {k}, ran {row['kernels_ran']} ({row['kernels_why']})"
                               + (f"; {row['note']}" if row.get("note") else ""))
        else:
            cmd = [sys.executable, __file__, "one", system, "--kernels", k, "--model",
                   self.a.model, "--micro-batch", str(mb), "--seq", str(self.a.seq),
                   "--steps", str(self.a.steps), "--discard", str(self.a.discard)]
            rc, wall, how = run_process(cmd, log, timeout)
            lines = tail(log, 10**6)
            got = [json.loads(x[len(ROW_MARK):]) for x in lines if x.startswith(ROW_MARK)]
            if got:
                row.update(got[-1])
                if row.get("status") == "ok":
                    finish_row(row, row["all_steps_s"], self.a.discard, flops)
            else:
                self.failed(row, rc, how, tail(log))
        row["wall_s"] = wall

    def train_cmd(self, row: dict, out: Path) -> list[str]:
        mb = str(row["micro_batch"])
        cmd = [sys.executable, "-m", "slidedp.cli", "train", "--model", self.a.model, "--data",
               str(self.tokens(row["micro_batch"])), "--seq", str(self.a.seq), "--global-batch",
               mb, "--micro-batch", mb, "--steps", str(self.a.steps), "--lr", "1e-5",
               "--out", str(out)]
        if row["kernels"] == "eager":
            cmd += ["--kernels", "eager"]
        if row["system"] == "ours-clip":
            cmd += ["--grad-clip", "1.0"]
        return cmd

    def tokens(self, mb: int) -> Path:
        """Random token ids for `steps` global batches of `mb` sequences (seeded)."""
        import numpy as np

        from slidedp.spec.model import load_model

        path = self.work / f"tok-{self.a.model}-{self.a.seq}-{mb}.npy"
        if not path.exists():
            vocab = load_model(self.a.model).vocab_size
            rng = np.random.default_rng(0)
            np.save(path, rng.integers(0, vocab, (mb * self.a.steps, self.a.seq), dtype=np.int32))
        return path

    @staticmethod
    def failed(row: dict, rc: int | None, how: str, lines: list[str]) -> None:
        if how == "timeout":
            row.update(status="stopped", note="stopped at the end of the budget")
        elif rc == 2:
            row.update(status="refused", note=last_error(lines))
        else:
            row.update(status="failed", note=f"exit {rc}: {last_error(lines)}")
        row["log_tail"] = lines

    def meta(self) -> dict:
        import torch

        def version(name: str) -> str | None:
            from importlib.metadata import PackageNotFoundError
            from importlib.metadata import version as v

            try:
                return v(name)
            except PackageNotFoundError:
                return None

        mem = None
        with contextlib.suppress(OSError):
            mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024 / GIB
        return {"date": str(date.today()), "host": socket.gethostname(),
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU",
                "cpus": os.cpu_count(), "host_mem_gib": mem, "torch": torch.__version__,
                "transformers": version("transformers"), "liger_kernel": version("liger-kernel"),
                "deepspeed": version("deepspeed"), "command": " ".join(sys.argv),
                "steps": self.a.steps, "discard": self.a.discard, "budget_s": self.a.budget_s,
                "rows_wall_s": self.a.budget_s - self.budget.left_s(),
                "zero2_build_s": self.zero2_build_s}

    def save(self) -> None:
        out = Path(self.a.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = self.meta()
        (out / "peers.json").write_text(json.dumps({"metas": [meta], "rows": self.rows}, indent=1))
        (out / "peers.md").write_text(markdown(self.rows, [meta]))


def _rounded(row: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
            if k != "log_tail"}


# ---- one peer row in this process (the `one` subcommand) ----------------------------------------


def one(a: argparse.Namespace) -> dict:
    """Time one HF peer (resident, reference, zero2) or build zero2's CPU Adam; prints the row."""
    import torch

    from slidedp.exec.metrics import host_pss_bytes

    if a.system == "zero2-build":
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()
        return {"status": "ok"}
    from compute_reference import reference_step_s, use_kernels
    from transformers import AutoConfig

    from slidedp.spec.model import load_model

    config = dict(load_model(a.model).config)
    row: dict = {}
    phase = ["build"]
    try:
        if a.system == "reference":
            r = reference_step_s(config, a.micro_batch, a.seq, iters=a.steps, discard=a.discard,
                                 kernels=a.kernels)
            steps = r["all_steps_s"]
        else:
            use_kernels(config["model_type"], a.kernels)
            cfg = AutoConfig.for_model(**config)
            cfg._attn_implementation = "sdpa"
            cfg.use_cache = False
            step = (resident_step if a.system == "resident" else zero2_step)(cfg, a.micro_batch,
                                                                             a.seq)
            steps, losses = [], []
            for i in range(a.steps):
                phase[0] = f"step {i + 1}"
                torch.cuda.synchronize()
                t = time.perf_counter()
                losses.append(step())
                torch.cuda.synchronize()
                steps.append(time.perf_counter() - t)
            row["loss_first_last"] = [float(losses[0]), float(losses[-1])]
        row.update(status="ok", all_steps_s=steps)
    except torch.OutOfMemoryError as e:
        row.update(status="does not fit", note=f"CUDA out of memory at {phase[0]}: "
                   f"{str(e).splitlines()[0][:200]}")
    row.update(gpu_peak_bytes=torch.cuda.max_memory_reserved(), host_pss_bytes=host_pss_bytes())
    return row


def resident_step(cfg, mb: int, seq: int) -> Callable[[], float]:
    """GPU-resident mixed precision (module docstring): one optimizer step per call."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), fused=True)
    data = torch.randint(0, cfg.vocab_size, (mb, seq), device="cuda")

    def step() -> float:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=data, labels=data).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def zero2_step(cfg, mb: int, seq: int) -> Callable[[], float]:
    """DeepSpeed ZeRO-2 with CPU offload (module docstring): one optimizer step per call."""
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "RANK": "0",
                 "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(k, v)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    conf = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "steps_per_print": 10**9,
            "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                  "offload_optimizer": {"device": "cpu", "pin_memory": True}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.95],
                                                      "eps": 1e-8, "weight_decay": 0.01}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=conf)
    data = torch.randint(0, cfg.vocab_size, (mb, seq), device="cuda")

    def step() -> float:
        loss = engine(input_ids=data, labels=data).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


# ---- command line -------------------------------------------------------------------------------


def table(paths: list[str], out: str | None) -> str:
    """Merge several calls' peers.json into one table (printed; written under `out` if given)."""
    rows, metas = [], []
    for p in paths:
        data = json.loads(Path(p).read_text())
        rows += data["rows"]
        metas += data["metas"]
    text = markdown(rows, metas)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "peers.md").write_text(text)
        (Path(out) / "peers.json").write_text(json.dumps({"metas": metas, "rows": rows}, indent=1))
    return text


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the rows of one device call")
    r.add_argument("--model", default="qwen3-4b")
    r.add_argument("--micro-batch", type=int, nargs="+", required=True)
    r.add_argument("--out", default=os.environ.get("OUT"), help="peers.json and peers.md (default $OUT)")
    r.add_argument("--work", default="/tmp/peers-work", help="token files, logs, train outputs")
    r.add_argument("--budget-s", type=float, default=480.0)
    r.add_argument("--steps", type=int, default=12)
    r.add_argument("--discard", type=int, default=5)
    r.add_argument("--seq", type=int, default=4096)
    r.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    r.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    r.add_argument("--force-zero2", action="store_true",
                   help="run zero2 even where MemAvailable is under 16 B/param")
    o = sub.add_parser("one", help="one HF peer row in this process (run uses it)")
    o.add_argument("system", choices=("resident", "reference", "zero2", "zero2-build"))
    o.add_argument("--kernels", choices=KERNELS, default="eager")
    o.add_argument("--model", default="qwen3-4b")
    o.add_argument("--micro-batch", type=int, default=1)
    o.add_argument("--seq", type=int, default=4096)
    o.add_argument("--steps", type=int, default=12)
    o.add_argument("--discard", type=int, default=5)
    t = sub.add_parser("table", help="merge calls' peers.json into one table")
    t.add_argument("paths", nargs="+")
    t.add_argument("--out")
    return ap


def check_run_args(a: argparse.Namespace) -> str | None:
    """One line naming the bad option, or None."""
    from slidedp.spec.errors import SpecError
    from slidedp.spec.model import load_model

    if not a.out:
        return "--out: an output directory (or $OUT), got none"
    if any(mb < 1 for mb in a.micro_batch):
        return f"--micro-batch: positive integers, got {a.micro_batch}"
    if a.seq < 1 or a.budget_s <= 0:
        return f"--seq / --budget-s: positive, got {a.seq} / {a.budget_s}"
    if not 0 <= a.discard < a.steps:
        return f"--discard: 0 <= discard < --steps ({a.steps}), got {a.discard}"
    try:
        load_model(a.model)
    except SpecError as e:
        return f"--model: {e}"
    return None


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.cmd == "table":
        print(table(a.paths, a.out), end="")
        return 0
    if a.cmd == "one":
        print(ROW_MARK + json.dumps(one(a)), flush=True)
        return 0
    bad = check_run_args(a)
    if bad:
        print(f"peers.py: error: {bad}", file=sys.stderr)
        return 2
    call = Call(a)
    call.run()
    call.save()
    print(markdown(call.rows, [call.meta()]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
