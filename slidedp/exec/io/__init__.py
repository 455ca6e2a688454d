"""Model I/O: open a model source (HF directory or preset), read/init units as flat FP32
vectors, export units as a Hugging Face model directory."""

from slidedp.exec.io.export import export_hf
from slidedp.exec.io.hf import fingerprint, hf_config, meta_layout
from slidedp.exec.io.init import RandomInit, init_from_hf_model
from slidedp.exec.io.source import ModelSource, open_model_source

__all__ = [
    "ModelSource",
    "RandomInit",
    "export_hf",
    "fingerprint",
    "hf_config",
    "init_from_hf_model",
    "meta_layout",
    "open_model_source",
]
