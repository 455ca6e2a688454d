"""HostState: shared-memory state a second mapping sees, state_dict views, init from a model."""

import json
from pathlib import Path

import torch

from slidedp.exec.host_state import SHM_DIR, HostState
from slidedp.exec.layout import model_layout

TINY = json.loads((Path(__file__).parents[1] / "slidedp/presets/models/tiny-qwen3.json").read_text())


def test_attach_shares_memory_and_close_unlinks():
    hs = HostState.create([3, 5, 2], copy_dtype=torch.bfloat16)
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
