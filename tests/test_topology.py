"""The hardware topology (slidedp/spec/topology.py): the flat spec is its one-socket, one-switch
case, every flow has a path whose rate is its tightest link, every GPU reaches every socket's
memory, random valid topologies load and random invalid ones are one SpecError naming the file
and the field (exit 2 through the CLI)."""

from __future__ import annotations

import copy
import subprocess
import sys
import tomllib

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import SRC, topologies

from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import hardware_presets, load_hardware, parse_hardware, preset_dir
from slidedp.spec.topology import Hop, merged, path_capacity_bps
from slidedp.spec.units import GB, GIB


def _raw(name: str) -> dict:
    return tomllib.loads((preset_dir() / f"{name}.toml").read_text())


def _flat_as_table(hw) -> dict:
    """An explicit [topology] table with the flat spec's numbers: one socket, one switch."""
    p, h, f = hw.pcie, hw.host, hw.fabric
    gpus = {"switch": [0] * hw.gpu.count, "source": SRC}
    if f.kind == "nvswitch":
        gpus["nvswitch_gbps"] = f.link_bps / GB
    elif f.kind == "nvlink-pairs":
        gpus |= {"nvlink": [[r, r + 1] for r in range(0, hw.gpu.count - 1, 2)],
                 "nvlink_gbps": f.link_bps / GB, "p2p_gbps": f.cross_pair_bps / GB}
    else:
        gpus["p2p_gbps"] = f.link_bps / GB
    return {"source": SRC,
            "socket": [{"cores": h.cores, "ram_gib": h.ram_bytes / GIB,
                        "dram_gbps": h.dram_bps / GB, "source": SRC}],
            "switch": [{"socket": 0, "h2d_gbps": p.all_h2d_bps / GB,
                        "d2h_gbps": p.all_d2h_bps / GB, "duplex_gbps": p.all_total_bps / GB,
                        "p2p_gbps": p.all_total_bps / GB, "source": SRC}],
            "gpus": gpus}


def _flows(topo) -> dict:
    """Every flow kind of the API, by a readable key -> its path."""
    n, out = topo.gpus.count, {}
    for r in range(n):
        for k in range(len(topo.sockets)):
            out[f"h2d {r} from {k}"] = topo.h2d(r, {k: 1.0})
            out[f"d2h {r} to {k}"] = topo.d2h(r, {k: 1.0})
        out[f"h2d {r} interleaved"] = topo.h2d(r, topo.memory_split(placement="interleave"))
        out[f"offload {r}"] = topo.activation_offload(r)
        for s in range(n):
            if s != r:
                out[f"p2p {r} {s}"] = topo.p2p(r, s)
    for k in range(len(topo.sockets)):
        for j in range(len(topo.sockets)):
            out[f"cpu {k} on {j}"] = topo.host_access(k, {j: 1.0}, write_fraction=0.5)
    return out


@pytest.mark.parametrize("name", hardware_presets())
def test_every_preset_has_a_topology_whose_paths_use_its_links(name):
    topo = load_hardware(name).topology
    caps = topo.resources()
    for key, path in _flows(topo).items():
        assert path, key
        for hop in path:
            assert caps[hop.resource] == hop.capacity_bps > 0, (key, hop)
            assert hop.share > 0, (key, hop)
        assert path_capacity_bps(path) == min(h.capacity_bps / h.share for h in path)


@pytest.mark.parametrize("name", hardware_presets())
def test_flat_spec_equals_the_one_switch_topology(name):
    """The flat reading of a preset's [pcie]/[host]/[fabric] gives the same resources and the
    same path for every flow as an explicit one-socket, one-switch [topology] table."""
    raw = _raw(name)
    raw.pop("topology", None)
    flat = parse_hardware(copy.deepcopy(raw), "flat.toml")
    explicit = parse_hardware(raw | {"topology": _flat_as_table(flat)}, "explicit.toml")
    assert flat.explicit_topology is None and explicit.explicit_topology is not None
    a, b = flat.topology, explicit.topology
    assert a.resources() == pytest.approx(b.resources(), rel=1e-12)
    assert a.cores_by_socket() == b.cores_by_socket() == (flat.host.cores,)
    fa, fb = _flows(a), _flows(b)
    assert fa.keys() == fb.keys()
    for key in fa:
        assert [(h.resource, h.share) for h in fa[key]] == [(h.resource, h.share) for h in fb[key]]
        assert [h.capacity_bps for h in fa[key]] == pytest.approx(
            [h.capacity_bps for h in fb[key]], rel=1e-12), key


def test_flat_h2d_crosses_the_links_graph_costs_charges():
    """One GPU's upload in the flat case: its own link and duplex cap, the all-GPU caps, DRAM
    (the resources graph/costs.py gives an H2D: gpu{r}.h2d, .duplex, host.h2d, host.pcie,
    host.dram)."""
    raw = _raw("h200x2")
    raw.pop("topology", None)
    hw = parse_hardware(raw, "flat.toml")
    path = hw.topology.h2d(1)
    assert {h.resource: h.capacity_bps for h in path} == {
        "socket0.dram": hw.host.dram_bps, "switch0.h2d": hw.pcie.all_h2d_bps,
        "switch0.duplex": hw.pcie.all_total_bps, "gpu1.h2d": hw.pcie.h2d_bps,
        "gpu1.duplex": hw.pcie.duplex_bps}


def test_merged_sums_the_shares_of_a_resource_crossed_twice():
    a = (Hop("x", 10.0), Hop("y", 4.0, 0.5))
    b = (Hop("y", 4.0, 0.5), Hop("z", 1.0))
    assert merged(a, b) == (Hop("x", 10.0), Hop("y", 4.0, 1.0), Hop("z", 1.0))
    assert path_capacity_bps(merged(a, b)) == 1.0


# ---- random topologies --------------------------------------------------------------------------


@given(topologies())
def test_random_valid_topologies_load_and_every_gpu_reaches_every_socket(raw):
    hw = parse_hardware(raw, "random.toml")
    topo = hw.topology
    assert topo.gpus.count == hw.gpu.count
    assert sum(topo.cores_by_socket()) == hw.host.cores
    caps = topo.resources()
    for key, path in _flows(topo).items():
        assert path, key
        assert all(caps[h.resource] == h.capacity_bps for h in path), key
        # alone, a flow loads no link beyond its capacity, and its tightest link to the full
        rate = path_capacity_bps(path)
        assert rate > 0
        assert all(rate * h.share <= h.capacity_bps * (1 + 1e-12) for h in path), key
        assert any(rate * h.share == pytest.approx(h.capacity_bps) for h in path), key
        full = [h.capacity_bps for h in path if h.share >= 1]
        assert not full or rate <= min(full) * (1 + 1e-12), key
    for r in range(topo.gpus.count):
        home = topo.gpu_socket(r)
        for k in range(len(topo.sockets)):
            names = {h.resource for h in topo.h2d(r, {k: 1.0})}
            assert f"socket{k}.dram" in names and f"gpu{r}.h2d" in names
            assert (f"socket{k}.to{home}" in names) == (k != home)
            assert f"switch{topo.gpus.switch[r]}.h2d" in names


@given(topologies(), st.data())
def test_interleaved_memory_splits_a_copy_over_the_sockets(raw, data):
    topo = parse_hardware(raw, "random.toml").topology
    r = data.draw(st.integers(0, topo.gpus.count - 1))
    split = topo.memory_split(placement="interleave")
    assert sum(split.values()) == pytest.approx(1.0)
    shares = {h.resource: h.share for h in topo.d2h(r, split)}
    for k in range(len(topo.sockets)):
        assert shares[f"socket{k}.dram"] == pytest.approx(1 / len(topo.sockets))
    assert shares[f"gpu{r}.d2h"] == 1.0


def _break(kind: str, raw: dict, draw) -> str:
    """Make the [topology] table of `raw` invalid in one way; return the field the error names."""
    t = raw["topology"]
    n_gpus, n_switches = raw["gpu"]["count"], len(t["switch"])
    if kind == "gpu under no switch":
        t["gpus"]["switch"] = t["gpus"]["switch"][:-1]
        return "topology.gpus.switch"
    if kind == "switch out of range":
        r = draw(st.integers(0, n_gpus - 1))
        t["gpus"]["switch"][r] = n_switches + draw(st.integers(0, 3))
        return f"topology.gpus.switch[{r}]"
    if kind == "zero link":
        i = draw(st.integers(0, n_switches - 1))
        key = draw(st.sampled_from(["h2d_gbps", "d2h_gbps"]))
        t["switch"][i][key] = draw(st.sampled_from([0, -1.5]))
        return f"topology.switch[{i}].{key}"
    if kind == "zero socket rate":
        t["socket"][0]["dram_gbps"] = 0
        return "topology.socket[0].dram_gbps"
    if kind == "cycle":
        for sw in t["switch"]:
            sw["socket"] = 0
            sw.pop("parent", None)
        t["switch"].append({"socket": 0, "h2d_gbps": 1.0, "d2h_gbps": 1.0, "source": SRC,
                            "parent": n_switches})
        t["switch"][0]["parent"] = n_switches
        t["switch"][n_switches]["parent"] = 0
        return "topology.switch[0].parent"
    if kind == "gpu index out of range":
        t["gpus"].pop("nvswitch_gbps", None)
        raw["fabric"]["kind"] = "nvlink-pairs"
        t["gpus"]["nvlink"] = [[0, n_gpus + draw(st.integers(0, 3))]]
        t["gpus"]["nvlink_gbps"] = 100.0
        return "topology.gpus.nvlink[0]"
    if kind == "cores do not add up":
        raw["host"]["cores"] += 1
        return "topology.socket"
    raise AssertionError(kind)


BREAKS = ("gpu under no switch", "switch out of range", "zero link", "zero socket rate", "cycle",
          "gpu index out of range", "cores do not add up")


@given(topologies(), st.sampled_from(BREAKS), st.data())
def test_random_invalid_topologies_raise_one_spec_error(raw, kind, data):
    field = _break(kind, raw, data.draw)
    with pytest.raises(SpecError) as e:
        parse_hardware(raw, "bad.toml")
    assert e.value.where == "bad.toml"
    assert e.value.field == field, (kind, str(e.value))
    assert "\n" not in str(e.value)


def test_fabric_kind_must_agree_with_the_gpu_links():
    raw = _raw("h200x2")
    raw.pop("topology", None)
    table = _flat_as_table(parse_hardware(copy.deepcopy(raw), "x"))
    raw["fabric"]["kind"] = "pcie"
    with pytest.raises(SpecError, match="fabric.kind"):
        parse_hardware(raw | {"topology": table}, "bad.toml")


def test_bad_topology_file_is_one_line_exit_2(tmp_path):
    text = (preset_dir() / "h200x2.toml").read_text()
    raw = tomllib.loads(text)
    raw.pop("topology", None)
    table = _flat_as_table(parse_hardware(raw, "x"))
    lines = ["", "[topology]", f'source = "{SRC}"', "[[topology.socket]]",
             f"cores = {table['socket'][0]['cores']}", f"ram_gib = {table['socket'][0]['ram_gib']}",
             "dram_gbps = 100", f'source = "{SRC}"', "[[topology.switch]]", "socket = 0",
             "h2d_gbps = 0", "d2h_gbps = 50", f'source = "{SRC}"', "[topology.gpus]",
             "switch = [0, 0]", "nvswitch_gbps = 400", f'source = "{SRC}"']
    if "[topology]" in text:
        text = text[:text.index("[topology]")]
    bad = tmp_path / "bad-topology.toml"
    bad.write_text(text + "\n".join(lines) + "\n")
    out = subprocess.run([sys.executable, "-m", "slidedp.cli", "predict", "--hardware", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 2
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in out.stderr
    assert str(bad) in err[0] and "topology.switch[0].h2d_gbps" in err[0]
