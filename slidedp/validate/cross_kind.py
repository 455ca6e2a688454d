"""Cross-kind validation: how well SlideDP predicts hardware nobody profiled (`slidedp validate
--cross-kind`).

One one-GPU profile predicts the stored cases of the larger kinds of the same GPU, each through
its machine file (scale_out.py: the profile scaled to the machine's GPUs, cores, RAM and links),
and the same-kind cases measured with that profile show the error where it was measured. Both are
read from a cross-kind file (default: slidedp/presets/cross-kind/cross-kind.toml), whose sets are
fixed there, before any error is computed:

    profile = "PATH"            the one-GPU hardware file (relative to the cross-kind file)
    gpu_ops = "PRESET"          whose [gpu.ops] table prices layer widths the profile did not time
    [same_kind]  machine, cases = [globs]          the profile's own machine and cases
    [[cross_kind]]  machine, spec (a machine file), cases = [globs] (default ["*"])

A set's members are the stored case folders (under the validation root) whose name matches one
of its globs (and `select`) and whose measured.json names the set's machine: "every stored case
of nvidia-h200-x2" is `machine = "nvidia-h200-x2"` with the default glob. A member is excluded,
with the reason, when it holds no measured step time or its plan cannot be predicted on the
hardware (a SpecError or an InfeasiblePlan); a folder whose measured.json cannot be read is
excluded once, whatever its set. Each member is predicted by the analytic model and the
simulator through the normal path (model/predict.py, sim/simulator.py) on the HardwareSpec, so
what they learn of the hardware (a topology's routes) applies here as it does anywhere. Error =
(predicted - measured) / measured in percent; a set's mean and max are of the absolute errors.
Nothing is written: the result is a dict (the command prints it as JSON).
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch
from importlib import resources
from pathlib import Path

from slidedp.model.predict import predict
from slidedp.sim.simulator import simulate
from slidedp.spec.errors import InfeasiblePlan, SpecError
from slidedp.spec.hardware import HardwareSpec, load_hardware, preset_dir
from slidedp.spec.tomlio import Table, read_toml
from slidedp.validate import store
from slidedp.validate.scale_out import load_machine, scaled_hardware


def default_file() -> Path:
    """The cross-kind file shipped with the package (slidedp/presets/cross-kind/)."""
    return Path(str(resources.files("slidedp") / "presets" / "cross-kind" / "cross-kind.toml"))


@dataclass(frozen=True)
class CaseSet:
    machine: str  # the kind measured.json must name
    patterns: tuple[str, ...]
    spec: Path | None = None  # the machine file; None: the profile's own machine


@dataclass(frozen=True)
class CrossKindSpec:
    where: str
    profile: Path
    gpu_ops: str
    same_kind: CaseSet
    cross_kind: tuple[CaseSet, ...]


def load_spec(path: str | Path) -> CrossKindSpec:
    """The cross-kind file (module docstring); paths in it are relative to it."""
    where, base = str(path), Path(path).parent
    root = Table(read_toml(path), where)

    def case_set(t: Table, machine_file: bool) -> CaseSet:
        pats = t.raw("cases", ["*"] if machine_file else ...)
        if not (isinstance(pats, list) and pats and all(isinstance(p, str) for p in pats)):
            raise SpecError(where, t._name("cases"), f"a non-empty list of globs, got {pats!r}")
        s = CaseSet(t.str("machine"), tuple(pats), base / t.str("spec") if machine_file else None)
        t.done()
        return s

    spec = CrossKindSpec(where, base / root.str("profile"), root.str("gpu_ops"),
                         case_set(root.sub("same_kind"), False),
                         tuple(case_set(t, True) for t in root.subs("cross_kind")))
    root.done()
    if not spec.profile.is_file():
        raise SpecError(where, "profile", f"a hardware file, got {str(spec.profile)!r} (no such "
                                          f"file)")
    return spec


def _gpu_ops_table(preset: str, where: str) -> dict:
    path = preset_dir() / f"{preset}.toml"
    raw = read_toml(path) if path.is_file() else None
    if raw is None or "ops" not in raw.get("gpu", {}):
        raise SpecError(where, "gpu_ops", f"a hardware preset with a [gpu.ops] table, got "
                                          f"{preset!r}")
    return raw["gpu"]["ops"]


def machine_hardware(spec: CrossKindSpec, s: CaseSet, folders: list[Path]) -> HardwareSpec:
    """The profile scaled to the set's machine file, with achieved rows for its cases' layers."""
    models = tuple(store.read_case(f).workload().model for f in folders)
    return scaled_hardware(read_toml(spec.profile), str(spec.profile), load_machine(s.spec),
                           _gpu_ops_table(spec.gpu_ops, spec.where), models)


class _Sets:
    """Reads each folder's measured.json once; the unreadable ones are excluded once."""

    def __init__(self, root: Path, select: str, excluded: list[dict]):
        self.folders = [f for f in store.stored_cases(root) if fnmatch(f.name, select)]
        self.excluded = excluded
        self.measured: dict[Path, dict | None] = {}

    def _measured(self, f: Path) -> dict | None:
        if f not in self.measured:
            try:
                self.measured[f] = store.read_json(f / store.MEASURED)
            except SpecError as e:
                self.measured[f] = None
                self.excluded.append({"case": f.name, "reason": f"{store.MEASURED}: "
                                                                f"{e.expected}"})
        return self.measured[f]

    def members(self, s: CaseSet) -> list[tuple[Path, dict]]:
        """(folder, measured) of the set's members (module docstring), sorted by name."""
        out = []
        for f in self.folders:
            if any(fnmatch(f.name, p) for p in s.patterns):
                meas = self._measured(f)
                if meas is not None and meas.get("machine") == s.machine:
                    out.append((f, meas))
        return out


def case_result(folder: Path, meas: dict, hw: HardwareSpec) -> dict:
    """One case's measured and predicted step; a SpecError with the reason where it is excluded."""
    measured = meas.get("step_time_s")
    if isinstance(measured, bool) or not isinstance(measured, int | float) or measured <= 0:
        raise SpecError(str(folder), "step_time_s", "a measured step time in measured.json")
    case = store.read_case(folder)
    wl = case.workload()
    sim = simulate(hw, wl, case.plan).step_time_s
    ana = predict(hw, wl, case.plan).step_time_s
    return {"case": folder.name, "measured_s": measured, "simulated_s": sim, "analytic_s": ana,
            "error_pct": 100 * (sim - measured) / measured,
            "analytic_error_pct": 100 * (ana - measured) / measured}


def summary(rows: list[dict]) -> dict:
    """mean / max of the absolute simulated (and analytic) errors in percent, the case count and
    the worst case; the rows themselves under per_case."""
    out: dict = {"mean_pct": None, "max_pct": None, "cases": len(rows)}
    if rows:
        for key, prefix in (("error_pct", ""), ("analytic_error_pct", "analytic_")):
            errs = [abs(r[key]) for r in rows]
            out[f"{prefix}mean_pct"] = round(sum(errs) / len(errs), 2)
            out[f"{prefix}max_pct"] = round(max(errs), 2)
        out["worst"] = max(rows, key=lambda r: abs(r["error_pct"]))["case"]
    out["per_case"] = [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                       for r in rows]
    return out


def run(root: str | Path, spec_file: str | Path | None = None, select: str = "*") -> dict:
    """The cross-kind result (module docstring): {"profile", "same_kind", "cross_kind",
    "excluded"}."""
    spec = load_spec(spec_file or default_file())
    excluded: list[dict] = []
    sets = _Sets(Path(root), select, excluded)

    def results(members: list[tuple[Path, dict]], hw: HardwareSpec) -> list[dict]:
        rows = []
        for f, meas in members:
            try:
                rows.append(case_result(f, meas, hw))
            except (SpecError, InfeasiblePlan) as e:
                why = f"{e.field}: {e.expected}" if isinstance(e, SpecError) else str(e)
                excluded.append({"case": f.name, "reason": why})
        return rows

    profile = load_hardware(str(spec.profile))
    same = results(sets.members(spec.same_kind), profile)
    cross, by_machine, hardware = [], {}, {}
    for s in spec.cross_kind:
        members = sets.members(s)
        if not members:
            continue
        hw = machine_hardware(spec, s, [f for f, _ in members])
        rows = [r | {"machine": s.machine} for r in results(members, hw)]
        cross += rows
        hardware[s.machine] = hw.name
        by_machine[s.machine] = {k: v for k, v in summary(rows).items() if k != "per_case"}
    out = {"profile": profile.name, "profile_file": spec.profile.name,
           "profile_sha256": store.sha256(spec.profile),
           "same_kind": {"machine": spec.same_kind.machine} | summary(same),
           "cross_kind": {"hardware": hardware, "by_machine": by_machine} | summary(cross),
           "excluded": excluded}
    return out | ({"select": select} if select != "*" else {})
