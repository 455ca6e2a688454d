"""The compute dtypes the executor runs, by name (no torch import: the CLI lists them cheaply)."""

COMPUTE_DTYPES = ("float32", "bfloat16")
