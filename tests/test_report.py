"""--report-to: the scalars a metrics row gives, the trackio calls (a stand-in module records them:
trackio is not installed in CI), and a missing tracker package named in one line. TensorBoard's
event files are checked through the real CLI in test_train_data.py."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

import pytest

from slidedp.exec import report
from slidedp.spec.errors import SpecError

ROW = {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.7, "tokens": 128,
       "channel_s": {"UPLOAD": 0.1, "COMPUTE": 0.2}, "gpu_peak_bytes": None, "eval_loss": 2.4}


def test_scalars_flatten_channels_and_leave_out_nulls_and_the_step():
    assert report.scalars(ROW) == {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.7, "tokens": 128.0,
                                   "channel_s/UPLOAD": 0.1, "channel_s/COMPUTE": 0.2,
                                   "eval_loss": 2.4}


def test_trackio_gets_init_log_finish(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("trackio")
    fake.__spec__ = importlib.machinery.ModuleSpec("trackio", None)
    fake.init = lambda **kw: calls.append(("init", kw))
    fake.log = lambda values, step: calls.append(("log", values, step))
    fake.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "trackio", fake)
    r = report.Reporter("trackio", tmp_path / "run-a", {"seq": 64})
    r.log(ROW)
    r.close()
    assert calls == [("init", {"project": "run-a", "config": {"seq": 64}}),
                     ("log", report.scalars(ROW), 3), ("finish",)]


def test_a_missing_tracker_package_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(SpecError, match=r"--report-to': tensorboard needs the `tensorboard` "
                                        r"package: pip install 'slidedp\[tensorboard\]'"):
        report.check("tensorboard")
    report.check("none")
