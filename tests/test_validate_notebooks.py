"""The validation notebooks execute headless (nbclient) on the stored validation data, as CI
runs them."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).parents[1] / "notebooks"
# the notebook kernels start one at a time (addopts: --dist loadgroup): each picks free ports
# and then binds them, which two kernels starting at once on two workers could both pick
pytestmark = pytest.mark.xdist_group("notebooks")


@pytest.mark.parametrize("name", ["validation_predicted_vs_measured.ipynb", "exposure_analysis.ipynb"])
def test_notebook_executes(name):
    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
