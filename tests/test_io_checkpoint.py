"""Checkpoints: exact round trip, refusal of another model's checkpoint, atomicity under failure,
and no checkpoint of a non-finite state."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from slidedp.exec.checkpoint import (
    capture_rng,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from slidedp.exec.finite import NonFinite
from slidedp.exec.io import fingerprint
from slidedp.spec.errors import SpecError

NUMELS = [40, 7, 7, 13]
FP = fingerprint("qwen3", NUMELS)


def state(seed: int) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(u, *(torch.randn(n, generator=g) for _ in range(3))) for u, n in enumerate(NUMELS)]


def meta(step: int) -> dict:
    return {
        "fingerprint": FP,
        "unit_steps": [step] * len(NUMELS),
        "data": {"epoch": 0, "index": step},
    }


def read_all(reader) -> list[list[torch.Tensor]]:
    out = []
    for n in NUMELS:
        bufs = [torch.full((n,), float("nan")) for _ in range(3)]
        reader.read_unit(len(out), *bufs)
        out.append(bufs)
    return out


def test_round_trip_is_exact_and_latest_is_the_newest(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, 1, state(1), meta(1))
    saved = state(2)
    path = save_checkpoint(tmp_path, 2, reversed(saved), meta(2))
    assert latest_checkpoint(tmp_path) == path and path.name == "step-00000002"
    got_meta, reader = load_checkpoint(path, FP)
    assert (
        got_meta["step"] == 2
        and got_meta["unit_steps"] == [2] * 4
        and got_meta["data"]["index"] == 2
    )
    for (_, *want), got in zip(saved, read_all(reader), strict=True):
        for w, g in zip(want, got, strict=True):
            assert torch.equal(w, g)


def test_keep_prunes_only_after_the_new_one_is_complete(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, state(step), meta(step), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]


def test_rng_states_are_restored_exactly(tmp_path):
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    path = save_checkpoint(tmp_path, 5, state(0), meta(5))
    want = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    restore_rng(load_checkpoint(path, FP)[0]["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert want[:2] == got[:2] and torch.equal(want[2], got[2])
    assert json.loads(json.dumps(capture_rng())) == capture_rng()


def test_checkpoint_of_another_model_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, 1, state(1), meta(1))
    with pytest.raises(
        SpecError, match=r"meta.json: field 'fingerprint': model_type 'llama'.*got 'qwen3'"
    ):
        load_checkpoint(path, fingerprint("llama", NUMELS))
    with pytest.raises(
        SpecError, match=r"meta.json: field 'fingerprint': unit 2 of 8 parameters .*got 7"
    ):
        load_checkpoint(path, fingerprint("qwen3", [40, 7, 8, 13]))
    with pytest.raises(SpecError, match=r"meta.json: field 'fingerprint': 5 units"):
        load_checkpoint(path, fingerprint("qwen3", [*NUMELS, 1]))


def test_incomplete_or_corrupt_checkpoints_name_file_and_field(tmp_path):
    with pytest.raises(SpecError, match=r"field 'meta.json': a complete checkpoint"):
        load_checkpoint(tmp_path, FP)
    path = save_checkpoint(tmp_path, 1, state(1), meta(1))
    (path / "unit-00003.safetensors").unlink()
    _, reader = load_checkpoint(path, FP)
    with pytest.raises(SpecError, match=r"unit-00003.safetensors: field '<file>'"):
        reader.read_unit(3, *(torch.empty(13) for _ in range(3)))
    with pytest.raises(
        SpecError, match=r"unit-00001.safetensors: field 'master': a flat FP32 tensor of 7"
    ):
        reader.read_unit(1, torch.empty(6), torch.empty(7), torch.empty(7))
    (path / "meta.json").write_text("{")
    with pytest.raises(SpecError, match=r"meta.json: field '<syntax>'"):
        load_checkpoint(path, FP)


def test_failure_mid_save_leaves_the_previous_checkpoint_intact(tmp_path):
    save_checkpoint(tmp_path, 1, state(1), meta(1), keep=1)

    def failing():
        it = iter(state(2))
        yield next(it)
        yield next(it)
        raise OSError("disk full (injected)")

    with pytest.raises(OSError, match="injected"):
        save_checkpoint(tmp_path, 2, failing(), meta(2), keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]
    path = latest_checkpoint(tmp_path)
    for (_, *want), got in zip(state(1), read_all(load_checkpoint(path, FP)[1]), strict=True):
        assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
    with pytest.raises(ValueError, match="never given"):
        save_checkpoint(tmp_path, 3, state(3)[:2], meta(3))


def test_process_killed_mid_save_leaves_the_previous_checkpoint_intact(tmp_path):
    script = textwrap.dedent(f"""
        import os, torch
        from slidedp.exec.checkpoint import save_checkpoint
        from slidedp.exec.io import fingerprint
        fp = fingerprint("qwen3", {NUMELS})
        units = [(u, torch.ones(n), torch.ones(n), torch.ones(n)) for u, n in enumerate({NUMELS})]
        save_checkpoint({str(tmp_path)!r}, 1, units, {{"fingerprint": fp}}, keep=1)
        def dying():
            yield units[0]
            yield units[1]
            os._exit(3)  # no cleanup at all, like a kill -9
        save_checkpoint({str(tmp_path)!r}, 2, dying(), {{"fingerprint": fp}}, keep=1)
    """)
    assert subprocess.run([sys.executable, "-c", script], timeout=120).returncode == 3
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "step-00000001"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".step-00000002.tmp-")
    path = latest_checkpoint(tmp_path)
    assert path.name == "step-00000001"
    assert all(bool((t == 1).all()) for ts in read_all(load_checkpoint(path, FP)[1]) for t in ts)
    save_checkpoint(tmp_path, 2, state(2), meta(2), keep=1)  # the next save clears the leftover
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000002"]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_state_is_never_saved_nor_the_finite_ones_pruned(tmp_path, bad):
    """A NaN or Inf in any tensor (here unit 2's Adam v) fails the save before the checkpoint is
    complete: nothing of it stays, and with keep=1 the finite checkpoint before is kept."""
    save_checkpoint(tmp_path, 1, state(1), meta(1), keep=1)
    units = state(2)
    units[2][3][4] = bad
    with pytest.raises(NonFinite, match=r"unit 2's v \(checkpoint step 2\) holds NaN or Inf"):
        save_checkpoint(tmp_path, 2, units, meta(2), keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]
