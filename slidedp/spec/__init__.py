"""Specs: hardware, model, workload and plan, as frozen dataclasses loaded from TOML."""

from slidedp.spec.errors import InfeasiblePlan, SpecError
from slidedp.spec.hardware import HardwareSpec, load_hardware
from slidedp.spec.model import ModelSpec, load_model
from slidedp.spec.plan import (
    ActivationPolicy,
    GradRoute,
    ParamRoute,
    Plan,
    UpdateSharding,
    load_plan,
)
from slidedp.spec.workload import Workload

__all__ = [
    "ActivationPolicy",
    "GradRoute",
    "HardwareSpec",
    "InfeasiblePlan",
    "ModelSpec",
    "ParamRoute",
    "Plan",
    "SpecError",
    "UpdateSharding",
    "Workload",
    "load_hardware",
    "load_model",
    "load_plan",
]
