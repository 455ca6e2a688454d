"""The training loop: model source -> footprint check -> data -> host state -> Engine steps ->
metrics, checkpoints, trace, and the final Hugging Face export.

Order of work (nothing large is allocated before the check):
  1. preflight(): the workload over R ranks and the footprint of the plan from the analytic
     model (model/memory.py check_fits: the host state counted once) against the hardware,
     InfeasiblePlan if it does not fit; and the checkpoint to resume from;
  2. the data (token ids checked against the vocab), the checkpoint's model fingerprint and data
     position (they must match);
  3. the host state in shared memory, filled unit by unit: from the model directory's
     safetensors, a preset's per-unit random init (seeded), or the checkpoint (master, Adam m
     and v, per-unit step counts, RNG, data position); then the Engine (window, rings).
Each step takes the next global batch and the schedule's rate (schedule.py); the loss is the
mean over all the global batch's tokens (the Engine accumulates the micro-batches).
Checkpoints go to OUT/checkpoints/step-N (exec/checkpoint.py: atomic, the newest
`keep_checkpoints` kept) every `checkpoint_every` steps and after the last step; the final
model goes to OUT/final in `save_dtype` (else `dtype`), with the source directory's tokenizer and
generation config (exec/io/export.py). With `eval_data`, the eval loss (exec/evaluate.py) is
added to the metrics row of every `eval_every`-th step and of the last (key eval_loss).

R > 1 (`slidedp train --nproc R`): every rank process runs a Trainer with its DistSession.
Every rank reads the same global batches (the Engine picks its rows); local rank 0 creates and
fills the one shared host state (DistSession.host_state) and alone writes metrics.jsonl (with
host_pss_bytes summed over the ranks), the checkpoints (from the shared state, after step()
returned on every rank), the trace (its own tasks) and the export.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from slidedp.exec.adamw import AdamWConfig
from slidedp.exec.checkpoint import (
    META,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from slidedp.exec.data import Batches, DataOptions, open_tokens
from slidedp.exec.dist import DistSession
from slidedp.exec.dtypes import COMPUTE_DTYPES
from slidedp.exec.engine import Engine, StepResult
from slidedp.exec.evaluate import Evaluator
from slidedp.exec.host_state import HostState
from slidedp.exec.io import ModelSource, export_hf
from slidedp.exec.metrics import MetricsLog, metrics_row
from slidedp.exec.schedule import LrSchedule
from slidedp.model.memory import check_fits
from slidedp.spec.cores import host_cores
from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import HardwareSpec, load_hardware
from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload

DTYPES = {name: getattr(torch, name) for name in COMPUTE_DTYPES}
MEMINFO = Path("/proc/meminfo")
KIB = 1024
BASE_HARDWARE = "h200x1"  # local_hardware() replaces its memory sizes and core count


@dataclass(frozen=True)
class TrainConfig:
    out: Path
    data: str
    seq: int
    global_batch: int
    micro_batch: int
    steps: int
    optimizer: AdamWConfig
    schedule: LrSchedule
    dtype: str  # compute and export dtype: float32 | bfloat16
    device: str  # cpu | cuda
    seed: int
    shuffle: bool
    checkpoint_every: int  # 0: only after the last step
    keep_checkpoints: int
    resume: bool
    trace: Path | None  # Chrome trace of the last step's measured Timeline
    plan: Plan
    hardware: HardwareSpec
    data_options: DataOptions = DataOptions()
    eval_data: str | None = None
    eval_every: int = 0  # 0: after the last step only
    save_dtype: str | None = None  # the export's dtype; None: dtype
    report_to: str = "none"  # exec/report.py: a tracker beside metrics.jsonl (the lead's)

    @property
    def checkpoint_root(self) -> Path:
        return self.out / "checkpoints"


def local_hardware(device: str, ranks: int = 1) -> HardwareSpec:
    """The footprint check's hardware: this machine's available host RAM (/proc/meminfo) and
    cores, and `ranks` devices with the CUDA device's total memory; on the CPU the device
    buffers live in host RAM, so the "GPU" budget is the available host RAM too. Rates (unused
    by the check) are BASE_HARDWARE's."""
    base = load_hardware(BASE_HARDWARE)
    ram = float(base.host.ram_bytes)
    if MEMINFO.is_file():
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                ram = float(int(line.split()[1]) * KIB)
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        gpu = replace(base.gpu, model=props.name, count=ranks,
                      hbm_bytes=float(props.total_memory))
    else:
        gpu = replace(base.gpu, model="cpu (device buffers in host RAM)", count=ranks,
                      hbm_bytes=ram)
    host = replace(base.host, ram_bytes=ram, cores=host_cores())
    return replace(base, name=f"local {device}", description="this machine", gpu=gpu, host=host)


def preflight(cfg: TrainConfig, source: ModelSource, ranks: int
              ) -> tuple[Workload, float, float, Path | None]:
    """(workload, GPU bytes, host bytes, checkpoint to resume from or None): the checks that
    read nothing large, also run by `slidedp train --nproc R` before it starts the ranks. The
    workload spans `ranks` rank processes; SpecError / InfeasiblePlan on bad input, a plan that
    does not fit, --resume without a checkpoint, or an earlier run in --out without --resume."""
    wl = Workload(source.spec, cfg.seq, cfg.global_batch, cfg.micro_batch, ranks,
                  where="command line")
    gpu_bytes, host_bytes = check_fits(cfg.hardware, wl, cfg.plan)
    ckpt = latest_checkpoint(cfg.checkpoint_root)
    if cfg.resume and ckpt is None:
        raise SpecError(str(cfg.checkpoint_root), "<checkpoint>",
                        "a complete checkpoint to resume from (none found)")
    if not cfg.resume and (ckpt is not None or (cfg.out / "final").exists()):
        raise SpecError(str(cfg.out), "--out", "a directory without an earlier run "
                        "(pass --resume to continue it, or choose another --out)")
    return wl, gpu_bytes, host_bytes, ckpt


class Trainer:
    """One training run; use as a context manager (closes the engine and the host state).

    `session`: this rank process's DistSession when R > 1 (see the module docstring); `lead`
    is the process that writes the output (the only one with R = 1, else local rank 0)."""

    def __init__(self, cfg: TrainConfig, source: ModelSource, session: DistSession | None = None):
        self.cfg, self.source, self.session = cfg, source, session
        self.lead = session is None or session.local_rank == 0
        self.wl, self.gpu_bytes, self.host_bytes, ckpt = preflight(
            cfg, source, session.world_size if session else 1)
        data = open_tokens(cfg.data, cfg.seq, source.spec.vocab_size, source.model_dir,
                           cfg.data_options)
        eval_data = None if cfg.eval_data is None else open_tokens(
            cfg.eval_data, cfg.seq, source.spec.vocab_size, source.model_dir, cfg.data_options,
            role="eval")
        self.batches = Batches(data, cfg.global_batch, cfg.shuffle, cfg.seed)
        meta = reader = None
        if ckpt is not None:
            meta, reader = load_checkpoint(ckpt, source.fingerprint())
            self.batches.load_state_dict(meta["data"], where=str(ckpt / META))
        torch.manual_seed(cfg.seed)

        def fill(hs: HostState) -> HostState:
            """The initial state (closed again if reading fails: its memory released, and a
            shared one's files removed from /dev/shm)."""
            try:
                for u in range(hs.n_units):
                    if reader is None:
                        source.read_unit(u, out=hs.unit_master(u))
                    else:
                        reader.read_unit(u, hs.unit_master(u), hs.unit_m(u), hs.unit_v(u))
                if hs.copy is not None:
                    hs.copy.copy_(hs.master)
                if meta is not None:
                    hs.steps.copy_(torch.tensor(meta["unit_steps"], dtype=torch.int64))
            except BaseException:
                hs.close()
                raise
            return hs

        numels = source.unit_numels
        copy_dtype = DTYPES[cfg.dtype] if cfg.plan.host_bf16_copy else None
        if session is None:
            hs = fill(HostState.create(numels, copy_dtype))
        else:
            hs = session.host_state(numels, copy_dtype, init=fill)
        try:
            self.engine = self._engine(hs)
            self.evaluator = None if eval_data is None else Evaluator(
                source.config, eval_data, hs, self.engine.device, DTYPES[cfg.dtype],
                self.wl.accum_steps * self.wl.micro_batch, self.wl.micro_batch, session)
        except BaseException:
            hs.close()
            raise
        self.step = 0
        if meta is not None:
            restore_rng(meta["rng"])
            self.step = int(meta["step"])
        self.last: StepResult | None = None

    def _engine(self, hs: HostState) -> Engine:
        cfg = self.cfg
        try:
            return Engine(self.source.config, self.wl, cfg.plan, device=cfg.device,
                          dtype=DTYPES[cfg.dtype], optimizer=cfg.optimizer, host_state=hs,
                          session=self.session, packed=cfg.data_options.pack)
        except SpecError as e:
            if e.where == "model config":  # name the model the user gave
                raise SpecError(self.source.where, e.field, e.expected) from None
            raise

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.engine.close()
        self.engine.host_state.close()

    def run(self, on_step: Callable[[dict], None] | None = None) -> None:
        """Train up to cfg.steps, then write the trace (if asked) and the final export; with
        R > 1 every rank calls it, and only the lead writes (and calls on_step)."""
        cfg, sess = self.cfg, self.session
        tokens = cfg.global_batch * cfg.seq
        log = MetricsLog(cfg.out / "metrics.jsonl", start_after=self.step) if self.lead else None
        try:
            while self.step < cfg.steps:
                batch = next(self.batches)
                lr = cfg.schedule.lr(self.step)
                self.last = self.engine.step(batch["input_ids"], batch["labels"], lr=lr,
                                             position_ids=batch.get("position_ids"))
                self.step += 1
                row = metrics_row(self.step, self.last, lr, tokens)
                if self.evaluator is not None and (self.step == cfg.steps or (
                        cfg.eval_every and self.step % cfg.eval_every == 0)):
                    row["eval_loss"] = self.evaluator.loss()  # every rank: a collective
                if sess is not None and row["host_pss_bytes"] is not None:
                    row["host_pss_bytes"] = int(sess.all_reduce_sum([row["host_pss_bytes"]])[0])
                if not self.lead:
                    continue
                log.write(row)
                if on_step is not None:
                    on_step(row)
                every = cfg.checkpoint_every
                if self.step == cfg.steps or (every and self.step % every == 0):
                    self.save_checkpoint()
        finally:
            if log is not None:
                log.close()
        if not self.lead:
            return
        if cfg.trace is not None and self.last is not None:
            self.last.timeline.save_chrome_trace(cfg.trace)
        self.export()

    def save_checkpoint(self) -> Path:
        hs = self.engine.host_state
        meta = {"fingerprint": self.source.fingerprint(), "model": self.source.where,
                "unit_steps": hs.steps.tolist(), "data": self.batches.state_dict()}
        units = ((u, hs.unit_master(u), hs.unit_m(u), hs.unit_v(u)) for u in range(hs.n_units))
        return save_checkpoint(self.cfg.checkpoint_root, self.step, units, meta,
                               keep=self.cfg.keep_checkpoints)

    def export(self) -> Path:
        hs = self.engine.host_state
        units = ((u, hs.unit_master(u)) for u in range(hs.n_units))
        return export_hf(self.cfg.out / "final", self.source.config, units,
                         dtype=self.cfg.save_dtype or self.cfg.dtype, overwrite=True,
                         assets_from=self.source.model_dir)
