"""HostState: shared-memory state a second mapping sees, state_dict views, init from a model."""

import json
import uuid
from pathlib import Path

import pytest
import torch

from slidedp.exec.host_state import SHM_DIR, HostState
from slidedp.exec.layout import model_layout

TINY = json.loads((Path(__file__).parents[1] / "slidedp/presets/models/tiny-qwen3.json").read_text())


def _named() -> str:
    return f"slidedp-test-{uuid.uuid4().hex[:8]}"


def test_attach_shares_memory_and_close_unlinks():
    hs = HostState.create([3, 5, 2], copy_dtype=torch.bfloat16, name=_named())
    other = HostState.attach(hs.name)
    hs.write_unit(1, torch.arange(5.0))
    hs.unit_m(2).fill_(7.0)
    hs.steps[0] = 4
    assert other.unit_master(1).tolist() == [0, 1, 2, 3, 4]
    assert other.unit_copy(1).dtype == torch.bfloat16 and other.unit_copy(1)[4] == 4
    assert other.unit_m(2).tolist() == [7, 7] and int(other.steps[0]) == 4
    other.close()
    assert (SHM_DIR / f"{hs.name}.master").exists()  # only the creator unlinks
    hs.close()
    assert not (SHM_DIR / f"{hs.name}.master").exists()


def test_state_dict_roundtrip_without_copies():
    hs = HostState.create([4, 4])
    sd = hs.state_dict()
    assert sd["unit1.master"].data_ptr() == hs.unit_master(1).data_ptr()
    saved = {k: v.clone() + 1 for k, v in sd.items()}
    hs.load_state_dict(saved)
    assert torch.equal(hs.unit_v(0), saved["unit0.exp_avg_sq"]) and int(hs.steps[1]) == 1
    hs.close()


def test_init_random_matches_transformers_init():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**TINY)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config)
    layouts = model_layout(model)
    hs = HostState.create([lay.numel for lay in layouts])
    hs.init_random(config, seed=3)
    for lay in layouts:
        for e in lay.entries:
            got = hs.unit_master(lay.unit)[e.offset:e.offset + e.numel].view(e.shape)
            assert torch.equal(got, model.state_dict()[e.name]), e.name
    hs.close()


def test_units_sharing_memory_see_one_another_and_the_files_hold_distinct_units_only():
    """A timing probe's state: units 2 and 3 live in unit 1's memory; attach keeps the sharing;
    such a state refuses to be saved (it holds no model)."""
    hs = HostState.create([3, 4, 4, 4, 2], storage_of=[0, 1, 1, 1, 4], name=_named())
    other = HostState.attach(hs.name)
    hs.unit_master(3).copy_(torch.arange(4.0))
    assert hs.unit_master(1).tolist() == [0, 1, 2, 3] and other.unit_master(2).tolist() == [0, 1, 2, 3]
    hs.unit_v(4).fill_(5.0)
    assert hs.unit_v(1).tolist() == [0] * 4 and other.unit_v(4).tolist() == [5, 5]
    assert hs.master.numel() == 3 + 4 + 2 and hs.steps.numel() == 5  # steps stay per unit
    assert hs.shares_storage and other.shares_storage
    assert [hs.owns_storage(u) for u in range(5)] == [True, True, False, False, True]
    with pytest.raises(RuntimeError, match="share memory"):
        hs.state_dict()
    with pytest.raises(RuntimeError, match="share memory"):
        hs.load_state_dict({})
    hs.write_unit(1, torch.ones(4))  # the unit that owns the memory may be written
    with pytest.raises(RuntimeError, match="unit 2 shares unit 1's memory"):
        hs.write_unit(2, torch.ones(4))
    other.close()
    hs.close()


def test_a_subset_is_a_cut_state_in_the_same_memory():
    """subset(): the chosen units' memory, step counts of its own; close() leaves the files."""
    hs = HostState.create([3, 4, 4, 4, 2], storage_of=[0, 1, 2, 1, 4], name=_named())
    sub = hs.subset([0, 1, 4])
    assert sub.unit_numels == [3, 4, 2] and not sub.shares_storage
    sub.unit_v(2).fill_(3.0)
    sub.steps[1] = 5
    assert hs.unit_v(4).tolist() == [3, 3] and int(hs.steps[1]) == 0
    with pytest.raises(ValueError, match="unit 3 is not one of its 5 units that own"):
        hs.subset([0, 3])
    sub.close()
    assert (SHM_DIR / f"{hs.name}.master").exists() and hs.unit_master(1).numel() == 4
    hs.close()
    with_copy = HostState.create([2, 2], copy_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="parameter copy"):
        with_copy.subset([0])
    with_copy.close()


@pytest.mark.parametrize("numels, storage_of, why", [
    ([3, 2], [0, 0], "same size"),              # unit 1 (2 elements) in unit 0's 3
    ([3, 2, 2], [0, 2, 2], "<= 1"),             # a later unit
    ([2, 2, 2], [0, 0, 1], "owns its memory"),  # a chain: unit 1 owns none
    ([3, 2, 2], [0], "1 entries for 3 units"),
])
def test_bad_sharing_is_refused_before_anything_is_written(numels, storage_of, why):
    name = _named()
    with pytest.raises(ValueError, match=why):
        HostState.create(numels, storage_of=storage_of, name=name)
    assert not list(SHM_DIR.glob(f"{name}*"))


def test_a_state_of_one_process_leaves_no_files_however_the_process_ends(tmp_path):
    """An unnamed state is unlinked as soon as it is mapped: its memory works, nothing of it is
    in /dev/shm even while it lives, and a process killed (SIGKILL: no close, no finalizer)
    holding one leaves nothing behind."""
    import subprocess
    import sys

    hs = HostState.create([3, 5], copy_dtype=torch.bfloat16)
    hs.write_unit(1, torch.arange(5.0))
    assert hs.unit_master(1).tolist() == [0, 1, 2, 3, 4] and hs.unit_copy(1)[4] == 4
    assert not list(SHM_DIR.glob(f"{hs.name}*"))
    hs.close()
    script = ("import os, signal, sys, torch\n"
              "from slidedp.exec.host_state import HostState\n"
              "hs = HostState.create([1 << 20, 1 << 20])\n"
              "hs.unit_m(0).fill_(1.0)\n"
              "print(hs.name, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       cwd=Path(__file__).parents[1], timeout=120)
    assert p.returncode == -9, p.stderr
    name = p.stdout.strip()
    assert name.startswith("slidedp-") and not list(SHM_DIR.glob(f"{name}*"))


def test_a_state_too_large_for_shared_memory_is_refused_before_anything_is_written(monkeypatch):
    """/dev/shm's files are sparse: a state larger than its room would map, then kill the process
    with SIGBUS while being filled. create() refuses it first, naming the directory and the
    bytes, and writes nothing."""
    from types import SimpleNamespace

    from slidedp.exec import host_state as hs_mod
    from slidedp.spec.errors import InfeasiblePlan

    monkeypatch.setattr(hs_mod.os, "statvfs",
                        lambda path: SimpleNamespace(f_bavail=10, f_frsize=4096))
    name = _named()
    with pytest.raises(InfeasiblePlan, match=f"shared memory in {SHM_DIR} needs .*--shm-size"):
        HostState.create([2**20, 2**20], name=name)
    assert not list(SHM_DIR.glob(f"{name}*"))
    with pytest.raises(InfeasiblePlan, match="a benchmark buffer of 1048576"):
        hs_mod.private_shared(2**20, torch.float32)


def test_a_named_state_that_fails_to_map_leaves_no_files(monkeypatch):
    from slidedp.exec import host_state as hs_mod

    real = hs_mod.map_shared

    def failing(path, numel, dtype):
        if path.name.endswith(".exp_avg_sq"):
            raise OSError("no room")
        return real(path, numel, dtype)

    monkeypatch.setattr(hs_mod, "map_shared", failing)
    name = _named()
    with pytest.raises(OSError, match="no room"):
        HostState.create([3, 4], name=name)
    assert not list(SHM_DIR.glob(f"{name}*"))
