"""The compute dtypes the executor runs, by name (no torch import: the CLI lists them cheaply)."""

COMPUTE_DTYPES = ("float32", "bfloat16")
SAVE_DTYPES = ("bfloat16", "float16", "float32")  # what final/ can be written in (io/export.py)
