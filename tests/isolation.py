"""Run Python code in a fresh interpreter where the named modules cannot be imported."""

import subprocess
import sys


def run_without(modules: tuple[str, ...], code: str) -> subprocess.CompletedProcess:
    prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True)
