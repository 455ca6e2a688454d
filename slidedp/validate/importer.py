"""Benchmark results measured before `slidedp validate` existed, turned into stored cases.

A provenance file (TOML; paths relative to it) says where each results file came from:

    [[source]]
    results = "../benchmarks/results/RUN-h200x2-qwen3-8b-r1.jsonl"
    format = "multi_gpu"          # benchmarks/multi_gpu.py JSONL | "single_gpu" (single_gpu.py JSON)
    prefix = "h200x2-qwen3-8b"    # case folder = <prefix>-r<R>-gb<G>-mb<M>-<param>-<grad>-<update>
                                  #   [-bf16copy][-w<window>][-c<chunk MiB>][-t<cast>-<update threads>][-rows]
                                  #   [-bf16grad][-<policy>x<layers>...][-off<ratio>][-s<seq>]
                                  #   (non-default fields)
    machine = "nvidia-h200-x2"    # the lent machine kind
    discard = 3                   # steps discarded before the mean (the benchmark's --discard)
    command = "..."               # the command that measured it (benchmarks/RESULTS.md)
    hardware = "../benchmarks/results/RUN-h200x2-profile.toml"   # or a preset name
    hardware_notes = ["..."]      # what to know about that hardware file (optional)
    notes = ["..."]               # what to know about the measurement (optional)
    ran_threads = {default = [8, 24], "4:4:sharded:gpu:rank0:cast_threads=16" = [24, 24]}
                                  # the CPU teams the executor ran, [cast, update] threads: per
                                  # case string, `default` for plans without thread fields (the
                                  # default split when it ran, or a threading bug's sizes). Give
                                  # it for every source: a plan without thread fields would else
                                  # be predicted with today's default, which moves with the code
    skip = ["6:6:sharded:gpu:rank0:embedding_rows=true"]
                                  # case strings not imported (optional): say why in notes, e.g.
                                  # an executor schedule the current graph no longer describes
    traces = "../benchmarks/results/RUN-h200-qwen3-4b.traces"
                                  # the folder of `multi_gpu.py --traces` (optional): a case's
                                  # measured trace (trace_file_name of its case string, .json.gz,
                                  # or the same name as plain .json), stored gzip-compressed
                                  # beside it with the simulated trace and their overlay

The case folder is named after the plan as requested; the stored plan carries the threads as run,
so that the predictions model what ran.

Rows without a step time (compute-only references, cut runs) are skipped. Rows of one case
folder (runs of the measurement protocol, e.g. benchmarks/confirm_sweep.py's two of each plan)
are one case: its step time the mean of the rows', its other figures (and trace) the last
row's; rows of different configurations that would share a folder are refused. Without
`traces` (or a case's file in it) no trace is stored: measured.json says so and the predictions
leave the simulated trace out.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import replace
from pathlib import Path

from slidedp.spec.errors import SpecError
from slidedp.spec.plan import GradRoute, GradWiden, ParamRoute, Plan, UpdateSharding, parse_plan
from slidedp.spec.tomlio import Table, read_toml
from slidedp.spec.units import GIB
from slidedp.validate import store
from slidedp.validate.cases import Case
from slidedp.validate.predict import write_predictions
from slidedp.validate.traces import find_trace, read_trace_doc, trace_names, write_trace_doc

FORMATS = ("multi_gpu", "single_gpu")
NO_TRACE = "no Timeline trace was saved by this benchmark run (figures only)"


TRACE_NAME_CHARS = 160  # file names stop at 255 bytes on Linux


def trace_file_name(case: str) -> str:
    """The file benchmarks/multi_gpu.py --traces writes a case's measured trace to (gzip; the
    importer also takes the plain .json of that name). A case string too long for a file name
    (a plan with one policy per decoder layer) keeps its first TRACE_NAME_CHARS characters and a
    digest of the whole."""
    name = "".join(ch if (ch.isascii() and ch.isalnum()) or ch in "-." else "_" for ch in case)
    if len(name) > TRACE_NAME_CHARS:
        name = f"{name[:TRACE_NAME_CHARS]}-{hashlib.sha256(case.encode()).hexdigest()[:16]}"
    return name + ".json.gz"


def case_name(prefix: str, c: Case) -> str:
    p = c.plan
    name = (f"{prefix}-r{c.gpus}-gb{c.global_batch}-mb{c.micro_batch}-{p.param_route}-"
            f"{p.grad_route}-{p.update_sharding}")
    default = Plan()
    name += "-bf16copy" if p.host_bf16_copy else ""
    name += f"-w{p.window_slots}" if p.window_slots != default.window_slots else ""
    name += f"-c{p.h2d_chunk_mib:g}" if p.h2d_chunk_mib != default.h2d_chunk_mib else ""
    threads = (p.cast_threads, p.update_threads)
    name += f"-t{threads[0]}-{threads[1]}" if threads != (default.cast_threads, default.update_threads) else ""
    name += "-rows" if p.embedding_rows else ""
    name += "-bf16grad" if p.grad_widen == GradWiden.HOST else ""
    if p.layer_policies and set(p.layer_policies) != {"layer"}:  # e.g. -sacx36, -nonex18-...
        name += "".join(f"-{pol.replace(':', '')}x{n}"
                        for pol, n in Counter(p.layer_policies).items())
    elif not p.layer_policies and p.activation_policy != "layer":  # every layer: -none
        name += f"-{p.activation_policy}"
    name += f"-off{p.offload_ratio:g}" if p.offload_ratio else ""
    name += f"-s{c.seq}" if c.seq != 4096 else ""
    return name


def _bytes(gib: float | None) -> int | None:
    """GiB as written by the benchmarks -> bytes; None stays None (a CPU run has no GPU peak)."""
    return None if gib is None else round(gib * GIB)


def multi_gpu_rows(path: Path) -> list[tuple[Case, dict]]:
    """(case, measured figures) of each measured row of a benchmarks/multi_gpu.py JSONL."""
    out = []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        if "step_s" not in d:
            continue
        plan = (parse_plan({"plan": d["plan"]}, f"{path}: case {d['case']}") if "plan" in d else
                Plan(param_route=ParamRoute(d["param_route"]), grad_route=GradRoute(d["grad_route"]),
                     update_sharding=UpdateSharding(d["update_sharding"])))
        case = Case(d["case"], d["model"], d["seq"], d["ranks"], d["global_batch"],
                    d["micro_batch"], plan)
        scope = "last step" + (", rank 0's tasks only (benchmarks/multi_gpu.py)" if d["ranks"] > 1 else "")
        out.append((case, {
            "date": d["date"], "gpu": d["gpu"], "torch": None,
            "machine_detail": {"cpus": d["cpus"], "gpu": d["gpu"]},
            "step_time_s": d["step_s"], "all_steps_s": d["all_steps_s"],
            "tokens_per_s": d["tokens_per_s"], "channel_s": d["channel_s"],
            "channel_s_scope": scope, "gpu_peak_bytes": _bytes(d["gpu_peak_gib"]),
            "host_pss_bytes": round(d["host_pss_gib_all_ranks"] * GIB),
            "loss_last": d["loss_last"]}))
    return out


def _single_gpu(path: Path) -> list[tuple[Case, dict]]:
    """(case, measured figures) of each row of a benchmarks/single_gpu.py JSON."""
    doc = json.loads(path.read_text())
    meta, out = doc["meta"], []
    for d in doc["rows"]:
        p = d["plan"]
        plan = Plan(host_bf16_copy=p["host_bf16_copy"], window_slots=p["window_slots"],
                    h2d_chunk_mib=p["h2d_chunk_mib"], d2h_chunk_mib=p["d2h_chunk_mib"])
        case = Case("", d["model"], d["seq"], 1, d["micro_batch"], d["micro_batch"], plan)
        out.append((case, {
            "date": meta["date"], "gpu": meta["gpu"], "torch": meta["torch"],
            "machine_detail": {"cpus": meta["cpus"], "gpu": meta["gpu"]},
            "step_time_s": d["step_s"], "all_steps_s": d["all_steps_s"],
            "tokens_per_s": d["tokens_per_s"], "channel_s": d["channel_s_last_step"],
            "channel_s_scope": "last step", "gpu_peak_bytes": _bytes(d["gpu_peak_gib"]),
            "host_pss_bytes": round(d["host_pss_gib"] * GIB), "loss_last": d["loss_first_last"][1],
            "reference_step_s": d["reference_step_s"]}))
    return out


def _ran_threads(raw, where: str, field: str) -> dict[str, tuple[int, int]]:
    if not isinstance(raw, dict):
        raise SpecError(where, field, "a table of case string -> [cast, update] threads")
    out = {}
    for key, pair in raw.items():
        if not (isinstance(pair, list) and len(pair) == 2
                and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in pair)):
            raise SpecError(where, f"{field}.{key}", f"[cast threads, update threads], positive integers, got {pair!r}")
        out[key] = (pair[0], pair[1])
    return out


def _as_run(case: Case, ran: dict[str, tuple[int, int]]) -> tuple[Plan, list[str]]:
    """The case's plan with the CPU teams that really ran (ran_threads), and a note saying so."""
    p = case.plan
    asked = (p.cast_threads, p.update_threads)
    key = case.name if case.name in ran else "default" if asked == (0, 0) else None
    if key not in ran:
        return p, []
    cast, update = ran[key]
    note = (f"CPU teams as they ran: cast {cast} + update {update} threads (the plan asked for "
            f"{'the default split of the day' if asked == (0, 0) else f'{asked[0]} + {asked[1]}'}); "
            "the stored plan and the predictions use the threads that ran")
    return replace(p, cast_threads=cast, update_threads=update), [note]


def _path(base: Path, value: str) -> Path:
    return (base / value).resolve()


def import_results(provenance: str | Path, root: Path) -> list[Path]:
    """Write a stored case (case.toml, measured.json, predicted.json) per measured row of every
    source of the provenance file; the case folders, in order."""
    where, base = str(provenance), Path(provenance).resolve().parent
    folders = []
    for src in Table(read_toml(provenance), where).subs("source"):
        results = _path(base, src.str("results"))
        fmt = src.str("format", choices=FORMATS)
        prefix, machine, command = src.str("prefix"), src.str("machine"), src.str("command")
        discard = src.int("discard", minimum=0)
        hw = src.str("hardware")
        hw_arg = str(_path(base, hw)) if hw.endswith(".toml") else hw
        hw_notes, notes = src.raw("hardware_notes", []), src.raw("notes", [])
        ran = _ran_threads(src.raw("ran_threads", {}), where, f"{src.prefix}.ran_threads")
        skip = src.raw("skip", [])
        if not isinstance(skip, list) or not all(isinstance(x, str) for x in skip):
            raise SpecError(where, f"{src.prefix}.skip", f"a list of case strings, got {skip!r}")
        traces = _path(base, src.str("traces")) if src.has("traces") else None
        src.done()
        if not results.is_file():
            raise SpecError(where, f"{src.prefix}.results", f"an existing file, got {results}")
        rows = multi_gpu_rows(results) if fmt == "multi_gpu" else _single_gpu(results)
        names = {case.name for case, _ in rows}
        for field, given in (("ran_threads", set(ran) - {"default"}), ("skip", set(skip))):
            if given - names:
                raise SpecError(where, f"{src.prefix}.{field}.{sorted(given - names)[0]}",
                                f"a case string of {results.name}")
        if traces is not None and not traces.is_dir():
            raise SpecError(where, f"{src.prefix}.traces", f"an existing folder, got {traces}")
        # per case folder, its rows: (the case as requested, as run, figures, notes)
        runs: dict[str, list[tuple[Case, Case, dict, list[str]]]] = {}
        for case, figures in rows:
            if case.name in skip:
                continue
            plan, ran_notes = _as_run(case, ran)
            name = case_name(prefix, case)
            group = runs.setdefault(name, [])
            if group and replace(group[0][0], name="") != replace(case, name=""):
                raise SpecError(where, f"{src.prefix}.prefix", f"one case folder per configuration: "
                                f"{group[0][0].name!r} and {case.name!r} of {results.name} differ "
                                f"but would both be {name}")
            group.append((case, replace(case, plan=plan), figures, ran_notes))
        for name, case_runs in runs.items():
            _, case, figures, _ = case_runs[-1]
            trace = find_trace(traces / trace_file_name(case.name)) if traces is not None else None
            case = replace(case, name=name)
            folder = root / case.name
            store.write_case(folder, case, f"imported by slidedp validate --import-results from "
                                           f"{results.name} (measured {figures['date']}, {machine})")
            stored_trace = folder / store.MEASURED_TRACE
            if trace is not None:
                write_trace_doc(read_trace_doc(trace), stored_trace)
            else:
                for old in trace_names(stored_trace):
                    old.unlink(missing_ok=True)
            has_trace = trace is not None
            measured = [f | {
                "case": case.name, "machine": machine, "gpus_used": case.gpus,
                **({"device": "cpu", "dtype": "float32"} if f["gpu"] == "cpu" else
                   {"device": "cuda", "dtype": "bfloat16"}), "command": command,
                "iters": len(f["all_steps_s"]), "discard": discard,
                "host_pss_scope": "summed over the rank processes",
                "trace": store.MEASURED_TRACE if has_trace else None,
                "source": os.path.relpath(results, folder.resolve()),
                "notes": [*([] if has_trace else [NO_TRACE]), *notes, *ran_notes]}
                for _, _, f, ran_notes in case_runs]
            store.write_json(folder / store.MEASURED, measured[0] if len(measured) == 1 else
                             store.merged_runs(measured, len(measured)))
            write_predictions(folder, hw_arg, list(hw_notes))
            folders.append(folder)
    return folders
