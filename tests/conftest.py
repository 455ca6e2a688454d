"""Shared fixtures, the hypothesis CI profile (few examples, no deadline: CI has 2 cores), and
the `gpu` marker's rule: `@pytest.mark.gpu` needs one CUDA GPU, `@pytest.mark.gpu(n)` needs n
(two rank processes need two); a test on a machine with fewer is skipped, the reason naming how
many it needs and how many there are. CI deselects the marker (pyproject's addopts); on the
device machine `python -m pytest -m gpu` runs or skips every such test."""

import os
from functools import cache

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@cache
def cuda_gpus() -> int:
    """The CUDA GPUs this process sees (0 without CUDA); torch is imported only when a `gpu`
    test is about to run."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpus_needed(item: pytest.Item) -> int:
    """How many CUDA GPUs a test's closest `gpu` marker asks for (0: not a GPU test)."""
    mark = item.get_closest_marker("gpu")
    if mark is None:
        return 0
    return mark.args[0] if mark.args else 1


def pytest_runtest_setup(item: pytest.Item) -> None:
    need = gpus_needed(item)
    if need and cuda_gpus() < need:
        pytest.skip(f"needs {need} CUDA GPU{'s' * (need > 1)}, this machine has {cuda_gpus()}")
