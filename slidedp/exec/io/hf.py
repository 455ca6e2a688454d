"""The transformers side of model I/O: a config object from config.json contents, the model built
on the meta device (no memory), and its flat unit layout (slidedp.exec.layout).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from slidedp.exec.layout import UnitLayout, model_layout


def hf_config(cfg: Mapping | PretrainedConfig) -> PretrainedConfig:
    """A transformers config from config.json contents (model_type picks the class)."""
    if isinstance(cfg, PretrainedConfig):
        return cfg
    return CONFIG_MAPPING[cfg["model_type"]].from_dict(dict(cfg))


def meta_model(config: PretrainedConfig) -> torch.nn.Module:
    """The *ForCausalLM with every parameter on the meta device (shapes only, no storage)."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def meta_layout(config: PretrainedConfig) -> tuple[torch.nn.Module, list[UnitLayout]]:
    model = meta_model(config)
    return model, model_layout(model)


def fingerprint(model_type: str, unit_numels: list[int]) -> dict:
    """What a checkpoint must match to resume: the family and every unit's parameter count."""
    return {"model_type": model_type, "unit_numels": list(unit_numels)}
