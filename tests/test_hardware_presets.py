"""The hardware presets load, every number names its source, and malformed copies are rejected.

Bad-input cases write an edited copy of a preset to tmp_path and expect a SpecError that names the
file and the field.
"""

from __future__ import annotations

import re
import tomllib

import pytest

from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import hardware_presets, load_hardware, preset_dir

FABRIC_KIND = {
    "h200x1": "nvswitch",
    "h200x2": "nvswitch",
    "h100x4": "nvswitch",
    "h100x8": "nvswitch",
    "a800x4": "nvlink-pairs",
    "a800x8": "nvlink-pairs",
    "a800x4-nobridge": "pcie",
    "a800x8-nobridge": "pcie",
    "rtx4090x4": "pcie",
}
SECTIONS = ("gpu", "pcie", "host", "fabric")
# words by which a source says what kind of number it is
KIND_WORDS = (
    "estimate",
    "datasheet",
    "whitepaper",
    "specification",
    "measured",
    "paper",
    "derived",
    "unused",
    "lending",
    "projected",
)


def _raw(name: str) -> dict:
    return tomllib.loads((preset_dir() / f"{name}.toml").read_text())


def _gpus_in_name(name: str) -> int:
    m = re.search(r"x(\d+)(?:-|$)", name)
    assert m, f"preset name {name!r} does not say its GPU count"
    return int(m.group(1))


def test_expected_presets_exist():
    assert set(FABRIC_KIND) <= set(hardware_presets())


@pytest.mark.parametrize("name", hardware_presets())
def test_preset_loads(name):
    hw = load_hardware(name)
    assert hw.name == name
    assert hw.gpu.count == _gpus_in_name(name)
    assert hw.gpu.achieved and hw.gpu.peak_bf16_flops > 0
    assert all(r <= hw.gpu.peak_bf16_flops for _, _, r in hw.gpu.achieved)


@pytest.mark.parametrize("name", sorted(FABRIC_KIND))
def test_fabric_kind(name):
    assert load_hardware(name).fabric.kind == FABRIC_KIND[name]


@pytest.mark.parametrize("name", hardware_presets())
def test_every_number_has_a_source(name):
    hw, raw = load_hardware(name), _raw(name)
    for sec in SECTIONS:
        sources = getattr(hw, sec).sources
        numeric = [
            k
            for k, v in raw[sec].items()
            if k not in ("source", "sources", "layer_time", "ops")
            and isinstance(v, int | float | list | dict)
            and not isinstance(v, bool)
        ]
        assert numeric, sec
        for key in numeric:
            assert sources.get(key, "").strip(), f"{name}: {sec}.{key} has no source"
        for key, text in sources.items():
            assert isinstance(text, str) and text.strip(), f"{name}: {sec}.{key} has no source"
    for lt in hw.gpu.layer_times:
        assert lt.source.strip()


# presets read from a measured profile without a [topology] table, whose flat reading (one socket,
# one switch carrying the measured all-GPU caps) is the machine as measured: h200x1 (stored
# validation predictions name it by its hash) and h200x8 (benchmarks/project_hardware.py's output)
FLAT = {"h200x1", "h200x8"}
EXPLICIT = sorted(set(hardware_presets()) - FLAT)


def _tables_with_sources(name: str):
    """(dotted name, raw table, its parsed sources) of [gpu.ops] and every [topology] table."""
    hw, raw = load_hardware(name), _raw(name)
    topo = hw.topology
    out = [("gpu.ops", raw["gpu"]["ops"], hw.gpu.ops.sources),
           ("topology", raw["topology"], topo.sources),
           ("topology.gpus", raw["topology"]["gpus"], topo.gpus.sources)]
    out += [(f"topology.socket[{k}]", t, s.sources)
            for k, (t, s) in enumerate(zip(raw["topology"]["socket"], topo.sockets, strict=True))]
    out += [(f"topology.switch[{i}]", t, s.sources)
            for i, (t, s) in enumerate(zip(raw["topology"]["switch"], topo.switches, strict=True))]
    return out


@pytest.mark.parametrize("name", EXPLICIT)
def test_topology_and_gpu_ops_numbers_have_sources_saying_what_kind(name):
    """Every preset but the FLAT ones has a [topology] and a [gpu.ops] table; each number in them
    names its source, and each source says what kind of number it is (datasheet, measured,
    estimate, ...)."""
    for where, table, sources in _tables_with_sources(name):
        numeric = [k for k, v in table.items() if k not in ("source", "sources", "socket", "switch",
                                                             "gpus", "kind", "attention")
                   and isinstance(v, int | float | list) and not isinstance(v, bool)]
        for key in numeric:
            text = sources.get(key, "")
            assert text.strip(), f"{name}: {where}.{key} has no source"
            assert any(w in text.lower() for w in KIND_WORDS), f"{name}: {where}.{key}: {text!r}"


@pytest.mark.parametrize("name", EXPLICIT)
def test_preset_topology_agrees_with_the_flat_spec(name):
    """The explicit topology has the GPU count, cores and fabric of the flat tables, and the
    flat per-GPU link rates are the GPUs' own links."""
    hw = load_hardware(name)
    topo = hw.explicit_topology
    assert topo is not None, f"{name} has no [topology]"
    assert topo.gpus.count == hw.gpu.count
    assert sum(topo.cores_by_socket()) == hw.host.cores
    assert topo.gpus.fabric_kind == hw.fabric.kind
    assert (topo.gpus.h2d_bps, topo.gpus.d2h_bps) == (hw.pcie.h2d_bps, hw.pcie.d2h_bps)


@pytest.mark.parametrize("name", sorted(set(FABRIC_KIND) - {"h200x2"}))
def test_sources_say_what_kind_of_number(name):
    hw = load_hardware(name)
    for sec in SECTIONS:
        for key, text in getattr(hw, sec).sources.items():
            assert any(w in text.lower() for w in KIND_WORDS), f"{name}: {sec}.{key}: {text!r}"


@pytest.mark.parametrize("name", hardware_presets())
def test_host_curves_nondecreasing_in_threads(name):
    host = load_hardware(name).host
    for curve in (host.cast_elems_per_s, host.adam_params_per_s):
        assert list(curve.xs) == sorted(curve.xs)
        assert all(b >= a for a, b in zip(curve.rates, curve.rates[1:], strict=False)), curve
        assert host.cast_rate(1) > 0 and host.adam_rate(1) > 0


@pytest.mark.parametrize("name", ["h100x4", "h100x8"])
def test_h100_adam_saturates_near_16_cores(name):
    host = load_hardware(name).host
    ratio = host.adam_rate(32) / host.adam_rate(16)
    assert 1.07 <= ratio <= 1.12
    # 182-184 GB/s of state traffic at 16 B/param (hw_probe.py convention) at 16 cores
    assert 182e9 <= host.adam_rate(16) * 16 <= 184e9


@pytest.mark.parametrize("name", ["a800x4", "a800x8", "a800x4-nobridge", "a800x8-nobridge"])
def test_a800_reproduces_paper_cast_h2d(name):
    """Per GPU: min(cast, H2D link); GPUs at once share the host-side H2D cap (method.md 9)."""
    hw = load_hardware(name)
    one = min(2 * hw.host.cast_rate(hw.host.cores / 2), hw.pcie.h2d_bps)  # BF16: 2 B/elem
    assert one == pytest.approx(15.6e9, rel=0.03)
    # two GPUs of one socket (GPUs 0 and 1, under one switch) share that socket's host-side cap
    two_each = min(2 * one, hw.topology.all_gpus_bps("h2d", (0, 1))) / 2
    assert two_each == pytest.approx(8.7e9, rel=0.03)
    # DRAM must not be the binding cap: cast traffic plus the DMA read of the BF16 copy
    elems_per_s = 2 * two_each / 2  # both GPUs' BF16 bytes at 2 B/elem
    assert elems_per_s * (hw.host.cast_dram_bytes_per_elem + 2) < hw.host.dram_bps


@pytest.mark.parametrize("name", hardware_presets())
def test_flat_all_gpu_caps_summarize_the_topology(name):
    """pcie.all_h2d_gbps and all_d2h_gbps are what every GPU copying at once reaches through
    the topology (sockets' DRAM and DMA caps, switch uplinks, GPU links)."""
    hw = load_hardware(name)
    for direction, flat in (("h2d", hw.pcie.all_h2d_bps), ("d2h", hw.pcie.all_d2h_bps)):
        assert hw.topology.all_gpus_bps(direction) == pytest.approx(flat, rel=0.01), direction


@pytest.mark.parametrize("name", sorted(FLAT))
def test_flat_presets_read_as_their_one_socket_machine(name):
    hw = load_hardware(name)
    assert hw.explicit_topology is None
    assert len(hw.topology.sockets) == 1 and hw.topology.cores_by_socket() == (hw.host.cores,)


def test_single_gpu_caps_equal_per_gpu_rates():
    pcie = load_hardware("h200x1").pcie
    assert pcie.all_h2d_bps == pcie.h2d_bps
    assert pcie.all_d2h_bps == pcie.d2h_bps
    assert pcie.all_total_bps == pcie.duplex_bps


# --- bad input -------------------------------------------------------------------------------

BASE = "a800x4"


def _section_removed(text: str, section: str) -> str:
    start = text.index(f"[{section}]\n")
    nxt = re.search(r"^\[(?!" + re.escape(section) + r"[.\]])", text[start + 1 :], re.M)
    assert nxt
    return text[:start] + text[start + 1 + nxt.start() :]


def _edit(old: str, new: str):
    def f(text: str) -> str:
        assert text.count(old) == 1, old
        return text.replace(old, new)

    return f


BAD = {
    "misspelled optional key": (
        _edit("\ncross_pair_gbps = 22\n", "\ncross_pair_gpbs = 22\n"),
        "fabric.cross_pair_gpbs",
    ),
    "misspelled required key": (
        _edit("\ndram_gbps = 290\n", "\ndram_gpbs = 290\n"),
        "host.dram_gbps",
    ),
    "misspelled source key": (
        _edit("[pcie.sources]\n", '[pcie.sources]\nh2d_gpbs = "x"\n'),
        "pcie.sources.h2d_gpbs",
    ),
    "negative rate": (_edit("[pcie]\nh2d_gbps = 25\n", "[pcie]\nh2d_gbps = -25\n"),
                      "pcie.h2d_gbps"),
    "negative curve rate": (_edit("[8, 7.8]", "[8, -7.8]"), "host.cast_gelem_per_s"),
    "missing section": (lambda t: _section_removed(t, "pcie"), "pcie"),
    "non-monotone curve": (
        _edit(
            "[[1, 0.7], [8, 5.6], [16, 8.3], [32, 9.0]]",
            "[[1, 0.7], [16, 8.3], [8, 5.6], [32, 9.0]]",
        ),
        "host.adam_gparam_per_s",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_copy_names_file_and_field(case, tmp_path):
    edit, field = BAD[case]
    path = tmp_path / f"bad-{case.replace(' ', '-')}.toml"
    good = (preset_dir() / f"{BASE}.toml").read_text()
    path.write_text(edit(good))
    with pytest.raises(SpecError) as e:
        load_hardware(str(path))
    assert e.value.where == str(path)
    assert e.value.field == field
    assert str(path) in str(e.value) and field in str(e.value)


def test_unedited_copy_loads(tmp_path):
    path = tmp_path / "copy.toml"
    path.write_text((preset_dir() / f"{BASE}.toml").read_text())
    assert load_hardware(str(path)) == load_hardware(BASE)


def test_unknown_preset_lists_presets():
    with pytest.raises(SpecError) as e:
        load_hardware("nonexistent")
    msg = str(e.value)
    assert "nonexistent" in msg
    for name in hardware_presets():
        assert name in msg
