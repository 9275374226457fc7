"""The benchmarks notebook runs end to end (in its small, fast mode), so it cannot rot."""

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs nbformat (pip install -e '.[test]')")
nbclient = pytest.importorskip("nbclient", reason="needs nbclient (pip install -e '.[test]')")
pytest.importorskip("matplotlib", reason="needs matplotlib")

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def test_paper_results_notebook_executes(monkeypatch):
    monkeypatch.setenv("HEXISEQ_NOTEBOOK_FAST", "1")
    nb = nbformat.read(BENCH / "paper_results.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(BENCH)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "fast mode" in text and "step time" in text
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3, "every plot cell should produce a figure"
