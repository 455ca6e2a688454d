"""Cross-kind validation (`slidedp validate --cross-kind`, slidedp/validate/cross_kind.py) and the
scale-out of a one-GPU profile to a machine file (slidedp/validate/scale_out.py).

The CLI tests run the real command on a small validation root of copied cases (case.toml and
measured.json only), so they take seconds; the whole stored set is the `slow` test at the end.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slidedp.spec.errors import SpecError
from slidedp.spec.tomlio import read_toml
from slidedp.validate import cross_kind
from slidedp.validate.scale_out import Machine, load_machine, scaled_document, scaled_hardware

ROOT = Path(__file__).resolve().parents[1]
VALIDATION = ROOT / "validation"
SAME = "h200m0259-4b-r1-gb1-mb1-c64"
X2 = "h200x2-0009-4b-r1-gb1-mb1-c64"
X4 = "h200x4-2142-qwen3-8b-r4-gb4-mb1-sharded-gpu-rank0-w36"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "slidedp.cli", "validate", *args],
                          capture_output=True, text=True)


def _copy_case(root: Path, name: str, as_name: str | None = None) -> Path:
    dst = root / (as_name or name)
    dst.mkdir(parents=True)
    for f in ("case.toml", "measured.json"):
        shutil.copy(VALIDATION / name / f, dst / f)
    return dst


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


@pytest.fixture
def small_root(tmp_path):
    """One same-kind case, one x2 case, one x4 case; an x2 case without a step time (excluded);
    a same-kind name measured on another machine (not a member)."""
    root = tmp_path / "validation"
    for name in (SAME, X2, X4):
        _copy_case(root, name)
    broken = _copy_case(root, X2, "h200x2-no-step-time")
    meas = json.loads((broken / "measured.json").read_text())
    del meas["step_time_s"]
    (broken / "measured.json").write_text(json.dumps(meas))
    other = _copy_case(root, SAME, "h200m0259-elsewhere")
    meas = json.loads((other / "measured.json").read_text())
    (other / "measured.json").write_text(json.dumps(meas | {"machine": "somewhere-else"}))
    return root


def test_cli_prints_only_the_json_and_writes_nothing(small_root):
    before = _tree(small_root)
    out = _cli("--cross-kind", "--json", "--out", str(small_root))
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)  # the whole of stdout is one JSON document
    assert _tree(small_root) == before
    assert r["profile"] == "h200-profile-0259"
    assert r["profile_file"] == "2026-12-02-h200-profile-0259.toml"
    assert set(r) >= {"profile", "same_kind", "cross_kind", "excluded"}
    assert r["excluded"] == [{"case": "h200x2-no-step-time",
                              "reason": "step_time_s: a measured step time in measured.json"}]
    same, cross = r["same_kind"], r["cross_kind"]
    assert same["cases"] == 1 and type(same["cases"]) is int
    assert cross["cases"] == 2 and type(cross["cases"]) is int
    assert [c["case"] for c in same["per_case"]] == [SAME]
    assert {c["case"]: c["machine"] for c in cross["per_case"]} == {
        X2: "nvidia-h200-x2", X4: "nvidia-h200-x4"}
    assert set(cross["by_machine"]) == {"nvidia-h200-x2", "nvidia-h200-x4"}
    for s in (same, cross):
        errs = []
        for c in s["per_case"]:
            assert c["error_pct"] == pytest.approx(
                100 * (c["simulated_s"] - c["measured_s"]) / c["measured_s"], abs=0.02)
            errs.append(abs(c["error_pct"]))
        assert s["mean_pct"] == pytest.approx(sum(errs) / len(errs), abs=0.01)
        assert s["max_pct"] == pytest.approx(max(errs), abs=0.01)


def test_cli_text_mode_and_select(small_root):
    out = _cli("--cross-kind", "--out", str(small_root), "--select", "h200x2-*")
    assert out.returncode == 0, out.stderr
    assert "same_kind: 0 cases" in out.stdout
    assert "cross_kind: 1 cases" in out.stdout
    assert "excluded h200x2-no-step-time: step_time_s" in out.stdout


@pytest.mark.parametrize("args, needle", [
    (["--json"], "--json"),
    (["--cross-kind", "no-such-file.toml"], "no-such-file.toml"),
])
def test_cli_bad_input_is_one_line_exit_2(args, needle):
    out = _cli(*args)
    assert out.returncode == 2
    assert out.stdout == "" and len(out.stderr.strip().splitlines()) == 1
    assert needle in out.stderr


def test_bad_cross_kind_file_names_the_field(tmp_path):
    f = tmp_path / "ck.toml"
    f.write_text('profile = "missing.toml"\ngpu_ops = "h200x2"\n'
                 '[same_kind]\nmachine = "nvidia-h200"\ncases = []\n')
    with pytest.raises(SpecError, match="same_kind.cases"):
        cross_kind.load_spec(f)
    f.write_text('profile = "missing.toml"\ngpu_ops = "h200x2"\n'
                 '[same_kind]\nmachine = "nvidia-h200"\ncases = ["*"]\n'
                 '[[cross_kind]]\nmachine = "nvidia-h200-x2"\nspec = "m.toml"\n')
    with pytest.raises(SpecError, match="profile"):
        cross_kind.load_spec(f)


def test_the_sets_are_the_matrix_and_every_larger_kind_case():
    """same_kind is exactly the 12 stored cases of the h200 matrix on profile 0259; cross_kind is
    every stored case whose measured.json names nvidia-h200-x2 or -x4."""
    spec = cross_kind.load_spec(cross_kind.default_file())
    sets = cross_kind._Sets(VALIDATION, "*", [])
    same = [f.name for f, _ in sets.members(spec.same_kind)]
    matrix = [t["name"] for t in read_toml(VALIDATION / "cases-h200-matrix.toml")["case"]]
    assert len(same) == 12
    assert sorted(n.split("-", 1)[1] for n in same) == sorted(n.split("-", 1)[1] for n in matrix)
    for f, _ in sets.members(spec.same_kind):
        ref = json.loads((f / "predicted.json").read_text())["hardware"]
        assert ref["name"] == "h200-profile-0259"
    by_machine = {}
    for f in sets.folders:
        m = json.loads((f / "measured.json").read_text()).get("machine")
        by_machine.setdefault(m, []).append(f.name)
    for s in spec.cross_kind:
        assert [f.name for f, _ in sets.members(s)] == by_machine[s.machine]


# ---- scale_out ---------------------------------------------------------------------------------

def _profile_and_machines():
    spec = cross_kind.load_spec(cross_kind.default_file())
    return read_toml(spec.profile), str(spec.profile), [load_machine(s.spec)
                                                        for s in spec.cross_kind]


def test_scaled_hardware_takes_the_machine_and_keeps_the_gpu():
    profile, where, machines = _profile_and_machines()
    one = scaled_hardware(profile, where, machines[0])
    for m in machines:
        hw = scaled_hardware(profile, where, m)
        assert hw.gpu.count == m.gpus and hw.host.cores == m.cores
        assert hw.gpu.achieved == one.gpu.achieved  # the same GPU: its measured rows stay
        assert hw.pcie.all_h2d_bps == pytest.approx(m.gpus * hw.pcie.h2d_bps, rel=1e-3)
        doc = scaled_document(profile, where, m)
        h = doc["host"]
        for key, b in (("adam_gparam_per_s", h["adam_dram_bytes_per_param"]),
                       ("cast_gelem_per_s", h["cast_dram_bytes_per_elem"])):
            rates = [r[-1] for r in h[key]]
            assert rates == sorted(rates)  # more threads never slower
            assert max(rates) * b <= h["dram_gbps"] * 1.0001  # never above the DRAM
            assert h[key][-1][0] == m.cores


def test_scale_out_refuses_what_it_cannot_price():
    profile, where, machines = _profile_and_machines()
    m = machines[0]
    two_sockets = Machine(**{**m.__dict__, "sockets": 2})
    with pytest.raises(SpecError, match="sockets"):
        load_machine_from(two_sockets)
    other_gpu = Machine(**{**m.__dict__, "gpu_model": "NVIDIA A800"})
    with pytest.raises(SpecError, match="gpu"):
        scaled_hardware(profile, where, other_gpu)


def load_machine_from(m: Machine):
    """A machine file written from `m`, loaded back (the file checks run in load_machine)."""
    import tempfile

    keys = ("kind", "description", "gpus", "gpu_model", "sockets", "cores", "ram_gib", "pcie",
            "nvlink_gbps", "nccl_efficiency", "nccl_latency_us")
    lines = ["[machine]"] + [f"{k} = {json.dumps(getattr(m, k))}" for k in keys]
    lines += ['source = "test"', "[machine.sources]"]
    lines += [f'{k} = "test"' for k in keys[2:]]
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "m.toml"
        f.write_text("\n".join(lines) + "\n")
        return load_machine(f)


# ---- the whole stored set ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def whole():
    return cross_kind.run(VALIDATION)


@pytest.mark.slow
def test_same_kind_within_5_percent_mean_10_max(whole):
    s = whole["same_kind"]
    assert s["cases"] == 12 and s["mean_pct"] <= 5 and s["max_pct"] <= 10


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=(
    "cross-kind misses its target (docs/calibration.md, 'Hardware you do not have'): the "
    "host-bound cases of the larger kinds are predicted slow; scale_out.py extrapolates the host "
    "rates of the 16-core profile to 32 and 64 cores at the slope of their last measured segment"))
def test_cross_kind_within_10_percent_mean_20_max(whole):
    s = whole["cross_kind"]
    assert whole["excluded"] == [] and s["cases"] == 95
    assert s["mean_pct"] <= 10 and s["max_pct"] <= 20
