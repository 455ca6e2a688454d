"""The simulator notebook executes headless (nbclient), as CI runs it."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "sim_scaling_and_routes.ipynb"
# the notebook kernels start one at a time (addopts: --dist loadgroup): each picks free ports
# and then binds them, which two kernels starting at once on two workers could both pick
pytestmark = pytest.mark.xdist_group("notebooks")


def test_notebook_executes():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
