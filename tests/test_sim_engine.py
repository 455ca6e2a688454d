"""Exact simulated timelines of hand-computable cases, exposure attribution, the CLI."""

import gzip
import json

import numpy as np
import pytest

from slidedp.cli import main
from slidedp.graph.costs import task_durations
from slidedp.graph.tasks import Kind
from slidedp.sim.engine import SimConfig
from slidedp.sim.microbench import GraphSketch, placeholder_workload
from slidedp.sim.simulator import simulate_graph
from slidedp.spec.hardware import load_hardware

HW = load_hardware("h200x2")  # H2D 55.3 GB/s per GPU, 54.1 each with both GPUs at once
GB = 1e9


def _sim(sk, overrides=None, **cfg):
    g = sk.graph()
    d = task_durations(g, HW, placeholder_workload(2))
    for v, s in (overrides or {}).items():
        d[v] = s
    return simulate_graph(g, HW, d, SimConfig(**cfg))


def test_two_uploads_share_the_host_cap_then_compute():
    sk = GraphSketch(2)
    h0 = sk.task(Kind.H2D, "gpu0.h2d", 55.3 * GB, rank=0)
    sk.task(Kind.H2D, "gpu1.h2d", 55.3 * GB, rank=1)
    f = sk.task(Kind.FWD, "gpu0.compute", 0.0, rank=0, after=[h0])
    res = _sim(sk, {f: 0.5})
    t1 = 55.3 / 54.1
    assert res.run.finish_s[:2] == pytest.approx([t1, t1], rel=1e-12)
    assert (res.run.start_s[f], res.run.finish_s[f]) == pytest.approx((t1, t1 + 0.5), rel=1e-12)
    (e,) = res.exposures[:1]
    assert (e.rank, e.start_s, e.channel) == (0, 0.0, "UPLOAD")
    assert e.end_s == pytest.approx(t1) and e.waiting_on.startswith("H2D")


def test_rate_changes_when_a_second_flow_joins():
    sk = GraphSketch(2)
    h0 = sk.task(Kind.H2D, "gpu0.h2d", 55.3 * GB, rank=0)
    c1 = sk.task(Kind.FWD, "gpu1.compute", 0.0, rank=1)
    h1 = sk.task(Kind.H2D, "gpu1.h2d", 55.3 * GB, rank=1, after=[c1])
    res = _sim(sk, {c1: 0.5})
    # 0-0.5 alone at 55.3: half done; then both at 54.1 until h0 ends; h1's rest alone at 55.3
    t_h0 = 0.5 + 27.65 / 54.1
    assert res.run.finish_s[h0] == pytest.approx(t_h0, rel=1e-12)
    assert res.run.finish_s[h1] == pytest.approx(t_h0 + 0.5, rel=1e-12)


def test_staging_back_pressure_and_version_gate_without_contention():
    # one staging chunk: CAST k+1 waits for H2D k to release it; iteration 1 is gated by ADAM
    sk = GraphSketch(1)
    c0 = sk.task(Kind.CAST, "cpu.cast0", 1, threads=1)
    h0 = sk.task(Kind.H2D, "gpu0.h2d", 1, rank=0, after=[c0])
    c1 = sk.task(Kind.CAST, "cpu.cast0", 1, threads=1, buffer_after=[h0])
    h1 = sk.task(Kind.H2D, "gpu0.h2d", 1, rank=0, after=[c1])
    f = sk.task(Kind.FWD, "gpu0.compute", 0, rank=0, after=[h0, h1])
    a = sk.task(Kind.ADAM, "cpu.update0", 1, threads=1, after=[f])
    c2 = sk.task(Kind.CAST, "cpu.cast0", 1, threads=1, gate_after=[a], buffer_after=[h1], iteration=1)
    durs = {c0: 2.0, h0: 1.0, c1: 2.0, h1: 1.0, f: 3.0, a: 4.0, c2: 2.0}
    res = _sim(sk, durs, contention=False, iterations=3)
    assert res.run.start_s.tolist() == [0.0, 2.0, 3.0, 5.0, 6.0, 9.0, 13.0]
    assert res.run.finish_s.tolist() == [2.0, 3.0, 5.0, 6.0, 9.0, 13.0, 15.0]
    off = _sim(sk, durs, contention=False, buffers=False, iterations=3)
    assert off.run.start_s[c1] == 2.0  # no back-pressure without buffer limits
    exp = [(e.start_s, e.end_s, e.channel, e.waiting_on) for e in res.exposures]
    assert exp[0][:3] == (0.0, 6.0, "UPLOAD")
    assert "version gate" not in exp[0][3]


def test_deterministic():
    sk = GraphSketch(2)
    for r in range(2):
        for k in range(3):
            sk.task(Kind.H2D, f"gpu{r}.h2d", (k + 1) * GB, rank=r)
            sk.task(Kind.D2H, f"gpu{r}.d2h", (3 - k) * GB, rank=r)
    a, b = _sim(sk), _sim(sk)
    assert np.array_equal(a.run.finish_s, b.run.finish_s)


def test_cli_simulate_json_trace_plot(tmp_path, capsys):
    trace, plot = tmp_path / "t.json", tmp_path / "g.png"
    assert main(["simulate", "--model", "qwen3-0.6b", "--json", "--trace", str(trace),
                 "--plot", str(plot)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert main(["predict", "--model", "qwen3-0.6b", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert set(p) <= set(d)
    assert set(d["exposed_by_channel_s"]) >= {"UPLOAD", "UPDATE"}
    assert "socket0.dram" in d["utilization"] and d["step_time_s"] >= d["lower_bound_s"]
    assert d["analytic"]["step_time_s"] == pytest.approx(p["step_time_s"])
    assert json.loads(trace.read_text())["traceEvents"] and plot.stat().st_size > 10_000
    gz = tmp_path / "t.json.gz"  # a .gz name: the same trace, gzip-compressed
    assert main(["simulate", "--model", "qwen3-0.6b", "--trace", str(gz)]) == 0
    assert json.loads(gzip.decompress(gz.read_bytes())) == json.loads(trace.read_text())


def test_cli_no_contention_equals_critical_path(capsys):
    assert main(["simulate", "--model", "qwen3-0.6b", "--json", "--no-contention"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["step_time_s"] == d["critical_path_s"]


def test_cli_verbose_prints_events_per_second(capsys):
    assert main(["simulate", "--model", "qwen3-0.6b", "--verbose"]) == 0
    assert "events/s" in capsys.readouterr().out


def test_cli_bad_route_and_bad_sweep(tmp_path, capsys):
    assert main(["simulate", "--gpus", "1", "--param-route", "sharded"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--param-route" in err and len(err.splitlines()) == 1
    f = tmp_path / "s.toml"
    f.write_text('[sweep]\ngpus = [1, 2]\nbatch = 4\n')
    assert main(["sweep", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert "sweep.batch" in err and "unknown key" in err and len(err.splitlines()) == 1
    f.write_text('[sweep]\nparam_route = ["mirrored"]\n')
    assert main(["sweep", str(f)]) == 2
    assert "param_route" in capsys.readouterr().err


def test_cli_sweep_writes_csv_and_plot(tmp_path, capsys):
    f = tmp_path / "s.toml"
    f.write_text('[sweep]\nmodel = "qwen3-0.6b"\ngpus = [1, 2]\nglobal_batch = [2, 3]\n'
                 'param_route = ["replicated", "sharded"]\nchunk_mib = 64\n')
    out, png = tmp_path / "s.csv", tmp_path / "s.png"
    assert main(["sweep", str(f), "--out", str(out), "--plot", str(png)]) == 0
    import pandas as pd

    df = pd.read_csv(out, keep_default_na=False)
    assert len(df) == 8 and png.exists()
    bad = df[df["error"] != ""]
    assert set(zip(bad["gpus"], bad["global_batch"], strict=True)) == {(2, 3)}
