"""The training loop: model source -> footprint check -> data -> host state -> Engine steps ->
metrics, checkpoints, trace, and the final Hugging Face export.

Order of work (nothing large is allocated before the check):
  1. preflight(): the executor runs the model's architecture; --seq against the model's
     positions (seq_warning: past max_position_embeddings only with plain RoPE); the workload
     over R ranks and the footprint of the plan from the analytic model (model/memory.py
     check_fits: the host state counted once) against the hardware, InfeasiblePlan if it does not
     fit; the disk space a checkpoint and the export need (InfeasiblePlan, naming how much); and
     the checkpoint to resume from (--steps at least its step: on resume it is the new total);
  2. the data (token ids checked against the vocab), the checkpoint's model fingerprint, data
     position and data fingerprint (data_fingerprint.py: the contents' BLAKE2b; they must match);
  3. the host state in shared memory, filled unit by unit: from the model directory's
     safetensors, a preset's per-unit random init (seeded), or the checkpoint (master, Adam m
     and v, per-unit step counts, RNG, data position); then the Engine (window, rings).
Each step takes the next global batch and the schedule's rate (schedule.py); the loss is the
mean over all the global batch's tokens (the Engine accumulates the micro-batches). After each
step (finite.py): a NaN or Inf loss or gradient norm ends the run with one line, nothing saved
after it, or with skip_nonfinite = N the engine skipped that step's update and up to N such steps
are passed over. A stop signal (signals.py; with R > 1 agreed on by every rank at the step
boundary, DistSession.agree_stop) ends the run at the boundary after a checkpoint (unless
save_on_stop is off). run() returns how the run ended (outcome.RunEnd); a write that fails (disk
full, read-only) is a RunError naming the file.
Checkpoints go to OUT/checkpoints/step-N (exec/checkpoint.py: atomic, the newest
`keep_checkpoints` kept) every `checkpoint_every` steps and after the last step, unless
`checkpoints` is off (final/ only); the final
model goes to OUT/final in `save_dtype` (else `dtype`), with the source directory's tokenizer and
generation config (exec/io/export.py). With `eval_data`, the eval loss (exec/evaluate.py) is
added to the metrics row of every `eval_every`-th step and of the last (key eval_loss).
Every rank flushes the engine (Engine.flush: the split clipping schedule finishes a step's
update in the next step) before anything reads the host state: the evaluation, a checkpoint,
the export; a step after a flush starts with nothing pending.

R > 1 (`slidedp train --nproc R`): every rank process runs a Trainer with its DistSession.
Every rank reads the same global batches (the Engine picks its rows); local rank 0 creates and
fills the one shared host state (DistSession.host_state), and rank 0 (the lead) alone writes
metrics.jsonl (with host_pss_bytes summed over the ranks), the checkpoints (from the shared
state, after step() returned on every rank), the trace (its own tasks) and the export. With
several nodes (`--nodes K`) each node's local rank 0 fills its node's host state from the same
source (the same seed, or the same checkpoint: a checkpoint does not depend on the node count),
the nodes' states stay identical (exec/features/internode.py), and node 0's rank 0 writes the
job's one checkpoint, as one node would (the same files, the same atomicity).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from slidedp.exec.adamw import AdamWConfig
from slidedp.exec.checkpoint import (
    META,
    STEP_RE,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from slidedp.exec.data import Batches, DataOptions, open_tokens
from slidedp.exec.data_fingerprint import data_fingerprint
from slidedp.exec.dist import DistSession
from slidedp.exec.dtypes import COMPUTE_DTYPES
from slidedp.exec.engine import Engine, StepResult
from slidedp.exec.evaluate import Evaluator
from slidedp.exec.finite import check_finite, nonfinite_terms
from slidedp.exec.host_state import HostState
from slidedp.exec.io import ModelSource, export_hf
from slidedp.exec.layer_runner import hf_config as executor_config
from slidedp.exec.metrics import MetricsLog, metrics_row
from slidedp.exec.outcome import EXIT_FAILED, RunEnd, RunError, stopped
from slidedp.exec.rundir import check_disk
from slidedp.exec.schedule import LrSchedule
from slidedp.exec.signals import StopSignals
from slidedp.exec.testhooks import pause_point
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
    skip_nonfinite: int = 0  # non-finite steps whose update may be skipped (0: stop at the first)
    save_on_stop: bool = True  # a stop signal saves a checkpoint at the step boundary
    checkpoints: bool = True  # False: no checkpoint at all, final/ only (--no-checkpoint)
    data_options: DataOptions = DataOptions()
    eval_data: str | None = None
    eval_every: int = 0  # 0: after the last step only
    save_dtype: str | None = None  # the export's dtype; None: dtype
    report_to: str = "none"  # exec/report.py: a tracker beside metrics.jsonl (the lead's)
    nodes: int = 1  # nodes of the job, each of `ranks` rank processes and its own host state

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
    read nothing large (module docstring, step 1), also run by `slidedp train --nproc R` before
    it starts the ranks. The workload spans `ranks` rank processes on each of cfg.nodes nodes
    (the host bytes are one node's: its host state); SpecError / InfeasiblePlan
    on bad input, a plan that does not fit, too little disk, --resume without a checkpoint, or
    an earlier run in --out without --resume."""
    try:
        executor_config(source.config.to_dict())
    except SpecError as e:  # name the model the user gave
        raise SpecError(source.where, e.field, e.expected) from None
    check_positions(cfg, source)
    wl = Workload(source.spec, cfg.seq, cfg.global_batch, cfg.micro_batch, ranks,
                  where="command line", nodes=cfg.nodes)
    gpu_bytes, host_bytes = check_fits(cfg.hardware, wl, cfg.plan)
    ckpt = latest_checkpoint(cfg.checkpoint_root)
    if cfg.resume and ckpt is None:
        raise SpecError(str(cfg.checkpoint_root), "<checkpoint>",
                        "a complete checkpoint to resume from (none found)")
    if not cfg.resume and (ckpt is not None or (cfg.out / "final").exists()):
        raise SpecError(str(cfg.out), "--out", "a directory without an earlier run "
                        "(pass --resume to continue it, or choose another --out)")
    done = int(STEP_RE.match(ckpt.name).group(1)) if ckpt is not None else 0
    if cfg.steps < done:
        raise SpecError("command line", "--steps", f"at least {done}, the steps of the "
                        f"checkpoint {ckpt} (on --resume, --steps is the new total), got "
                        f"{cfg.steps}")
    params = sum(source.unit_numels)
    export_bytes = params * DTYPES[cfg.dtype].itemsize
    check_disk(cfg.out, params * CHECKPOINT_BYTES_PER_PARAM + export_bytes,
               f"one checkpoint ({CHECKPOINT_BYTES_PER_PARAM} B/param: FP32 master, Adam m "
               f"and v; older ones are removed only after it is complete) and the final model "
               f"({DTYPES[cfg.dtype].itemsize} B/param) of {params:,} parameters")
    return wl, gpu_bytes, host_bytes, ckpt


CHECKPOINT_BYTES_PER_PARAM = 12


def rope_kind(config) -> str | None:
    """The model's rotary scaling kind ("llama3", "yarn", ...), None for plain RoPE."""
    rp = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = rp.get("rope_type") or rp.get("type")
    return None if kind in (None, "default") else str(kind)


def check_positions(cfg: TrainConfig, source: ModelSource) -> None:
    """SpecError for a --seq past max_position_embeddings of a model with scaled RoPE (its
    frequencies are fit to that length); plain RoPE extrapolates (seq_warning)."""
    most = getattr(source.config, "max_position_embeddings", None)
    kind = rope_kind(source.config)
    if most and cfg.seq > most and kind is not None:
        raise SpecError("command line", "--seq", f"at most {most}, the model's "
                        f"max_position_embeddings (its rope scaling {kind!r} is fit to that "
                        f"length), got {cfg.seq}")


def seq_warning(cfg: TrainConfig, source: ModelSource) -> str | None:
    """A warning when --seq passes the model's max_position_embeddings (plain RoPE)."""
    most = getattr(source.config, "max_position_embeddings", None)
    if most and cfg.seq > most:
        return (f"--seq {cfg.seq} is longer than the model's max_position_embeddings {most}: "
                f"positions past {most} were never trained (plain RoPE extrapolates)")
    return None


class Trainer:
    """One training run; use as a context manager (closes the engine and the host state).

    `session`: this rank process's DistSession when R > 1 (see the module docstring); `lead`
    is the process that writes the output (the only one with R = 1, else local rank 0)."""

    def __init__(self, cfg: TrainConfig, source: ModelSource, session: DistSession | None = None):
        self.cfg, self.source, self.session = cfg, source, session
        self.lead = session is None or session.rank == 0
        self.wl, self.gpu_bytes, self.host_bytes, ckpt = preflight(
            cfg, source, session.local_world_size if session else 1)
        data = open_tokens(cfg.data, cfg.seq, source.spec.vocab_size, source.model_dir,
                           cfg.data_options)
        eval_data = None if cfg.eval_data is None else open_tokens(
            cfg.eval_data, cfg.seq, source.spec.vocab_size, source.model_dir, cfg.data_options,
            role="eval")
        self.batches = Batches(data, cfg.global_batch, cfg.shuffle, cfg.seed)
        self.data_fingerprint = (data_fingerprint(data.where, data.tokens, cfg.out)
                                 if self.lead else None)
        meta = reader = None
        if ckpt is not None:
            meta, reader = load_checkpoint(ckpt, source.fingerprint())
            self.batches.load_state_dict(meta["data"], where=str(ckpt / META))
            self._check_data(meta, ckpt)
        torch.manual_seed(cfg.seed)
        self.engine = self._start_engine(reader, meta)
        try:
            self.evaluator = None if eval_data is None else Evaluator(
                source.config, eval_data, self.engine.host_state, self.engine.device,
                DTYPES[cfg.dtype], self.wl.accum_steps * self.wl.micro_batch,
                self.wl.micro_batch, session)
        except BaseException:
            self.close()
            raise
        self.step, self.skipped = 0, 0  # steps done; non-finite steps skipped (skip_nonfinite)
        if meta is not None:
            restore_rng(meta["rng"])
            self.step, self.skipped = int(meta["step"]), int(meta.get("nonfinite_skipped", 0))
        self.last: StepResult | None = None

    def _check_data(self, meta: dict, ckpt: Path) -> None:
        """SpecError when the data's contents differ from the checkpoint's (its fingerprint;
        checkpoints that predate it carry none)."""
        saved, now = meta.get("data_fingerprint"), self.data_fingerprint
        if saved is None or now is None or saved["blake2b"] == now["blake2b"]:
            return
        raise SpecError(str(ckpt / META), "data_fingerprint", f"the data the run was trained "
                        f"on ({saved['where']}, BLAKE2b {saved['blake2b'][:16]}...), got other "
                        f"contents: {now['where']} has BLAKE2b {now['blake2b'][:16]}...")

    def _start_engine(self, reader, meta: dict | None) -> Engine:
        """The host state, filled (module docstring, step 3), and the Engine on it."""
        cfg, source = self.cfg, self.source

        def fill(hs: HostState) -> HostState:
            """The initial state (closed again if reading fails: its memory released, and a
            shared one's files removed from /dev/shm)."""
            try:
                pause_point("load")
                for u in range(hs.n_units):
                    if reader is None:
                        source.read_unit(u, out=hs.unit_master(u))
                    else:
                        reader.read_unit(u, *hs.unit_state(u).values())
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
        if self.session is None:
            hs = fill(HostState.create(numels, copy_dtype, moments=str(cfg.plan.moments)))
        else:
            hs = self.session.host_state(numels, copy_dtype, init=fill,
                                         moments=str(cfg.plan.moments))
        try:
            return self._engine(hs)
        except BaseException:
            hs.close()
            raise

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

    def run(self, on_step: Callable[[dict], None] | None = None,
            signals: StopSignals | None = None) -> RunEnd:
        """Train up to cfg.steps, then write the trace (if asked) and the final export; how the
        run ended (module docstring). With R > 1 every rank calls it, and only the lead writes
        (and calls on_step). `signals`: this process's stop signals (R = 1; a rank's are its
        session's)."""
        cfg = self.cfg
        log = None
        with signals.deferring() if signals is not None else nullcontext():
            if self.session is not None:
                self.session.begin_steps()
            try:
                if self.lead:
                    with writing(cfg.out / "metrics.jsonl"):
                        log = MetricsLog(cfg.out / "metrics.jsonl", start_after=self.step)
                while self.step < cfg.steps:
                    end = self._step(log, on_step, signals)
                    if end is not None:
                        return end
            finally:
                if log is not None:
                    log.close()
            self.engine.flush()  # every rank; the export reads the host state
            self.check_nodes()
            if self.lead:
                if cfg.trace is not None and self.last is not None:
                    with writing(cfg.trace):
                        self.last.timeline.save_chrome_trace(cfg.trace)
                self.export()
        return RunEnd(0)

    def _step(self, log: MetricsLog | None, on_step, signals: StopSignals | None
              ) -> RunEnd | None:
        """One step and what follows it at the boundary; how the run ends there, or None."""
        cfg, sess = self.cfg, self.session
        batch = next(self.batches)
        lr = cfg.schedule.lr(self.step)
        res = self.last = self.engine.step(batch["input_ids"], batch["labels"], lr=lr,
                                           position_ids=batch.get("position_ids"))
        self.step += 1
        row = metrics_row(self.step, res, lr, cfg.global_batch * cfg.seq)
        if self.evaluator is not None and (self.step == cfg.steps or (
                cfg.eval_every and self.step % cfg.eval_every == 0)):
            self.engine.flush()  # the evaluation reads the host state: every rank
            row["eval_loss"] = self.evaluator.loss()  # every rank: a collective
        stop = signals.first if signals is not None else None
        if sess is not None:  # one all-reduce: the stop agreement and the summed PSS
            pss = row["host_pss_bytes"]
            stop, (pss_sum,) = sess.agree_stop([pss or 0])
            row["host_pss_bytes"] = None if pss is None else int(pss_sum)
        bad = nonfinite_terms(res.loss, res.grad_norm)
        if bad and res.skipped and self.skipped < cfg.skip_nonfinite:
            self.skipped += 1
            row["skipped"], bad = True, []
        if self.lead:
            with writing(log.path):
                log.write(row)
            if on_step is not None:
                on_step(row)
        if bad:
            return self._nonfinite_end(bad, res.skipped)
        every = cfg.checkpoint_every
        saved = cfg.checkpoints and (self.step == cfg.steps
                                     or bool(every and self.step % every == 0))
        if saved or stop is not None:  # a checkpoint or the export reads the host state next
            self.engine.flush()  # every rank: the saved and stop decisions are alike on all
        if saved and self.lead:
            self.save_checkpoint()
        if stop is None or self.step == cfg.steps:
            return None
        if cfg.save_on_stop and not saved and self.lead:
            self.save_checkpoint()
        return stopped(self.step, cfg.out, cfg.save_on_stop, stop)

    def _nonfinite_end(self, bad: list[str], skipped: bool) -> RunEnd:
        cfg = self.cfg
        newest = latest_checkpoint(cfg.checkpoint_root)
        kept = f"the newest checkpoint, {newest.name}, is kept" if newest is not None \
            else "there is no checkpoint"
        why = (f"{self.skipped} such steps skipped already (--skip-nonfinite "
               f"{cfg.skip_nonfinite})" if skipped else
               "--skip-nonfinite N would skip such steps" if not cfg.skip_nonfinite else
               "the gradient norm was finite, so the update was applied")
        return RunEnd(EXIT_FAILED, f"step {self.step}: {' and '.join(bad)} ({why}); stopped "
                                   f"without saving: {kept}, no final model written")

    def check_nodes(self) -> None:
        """With several nodes (every rank calls it): the lead prints each node's host state and
        the BLAKE2b of its master copy; a RunError on every rank when they differ (the nodes'
        updates must keep them identical)."""
        sess = self.session
        if sess is None or sess.nodes == 1:
            return
        hs = self.engine.host_state
        digest = None
        if sess.local_rank == 0:
            h = hashlib.blake2b(digest_size=16)
            for u in range(hs.n_units):
                h.update(hs.unit_master(u).numpy())
            digest = h.hexdigest()
        every = [(n, d) for n, d in sess.all_gather((sess.node_rank, digest)) if d is not None]
        if self.lead:
            print("nodes: " + "; ".join(f"node {n} host state {sess.node_names[n]}.state, "
                                        f"master blake2b {d}" for n, d in sorted(every)),
                  flush=True)
        if len({d for _, d in every}) > 1:
            raise RunError("the nodes' master copies differ after the last step: "
                           + ", ".join(f"node {n} {d}" for n, d in sorted(every)))

    def save_checkpoint(self) -> Path:
        hs = self.engine.host_state
        meta = {"fingerprint": self.source.fingerprint(), "model": self.source.where,
                "unit_steps": hs.steps.tolist(), "data": self.batches.state_dict(),
                "data_fingerprint": self.data_fingerprint, "nonfinite_skipped": self.skipped}
        units = ((u, *hs.unit_state(u).values()) for u in range(hs.n_units))
        with writing(self.cfg.checkpoint_root):
            return save_checkpoint(self.cfg.checkpoint_root, self.step, units, meta,
                                   keep=self.cfg.keep_checkpoints)

    def export(self) -> Path:
        hs = self.engine.host_state

        def units() -> Iterator[tuple[int, torch.Tensor]]:
            for u in range(hs.n_units):
                check_finite(hs.unit_master(u), f"unit {u}'s weights (the final model)")
                yield u, hs.unit_master(u)

        with writing(self.cfg.out / "final"):
            return export_hf(self.cfg.out / "final", self.source.config, units(),
                             dtype=self.cfg.save_dtype or self.cfg.dtype, overwrite=True,
                             assets_from=self.source.model_dir)


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """An OSError while writing `path` (a full disk, a read-only filesystem, a file size limit)
    becomes a RunError naming the file: one line, not a traceback; the newest complete
    checkpoint stays (checkpoint.py)."""
    try:
        yield
    except OSError as e:
        if isinstance(e, TimeoutError | ConnectionError):
            raise
        raise RunError(f"cannot write {e.filename or path}: {e.strerror or e}") from None
