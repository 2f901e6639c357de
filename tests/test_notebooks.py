"""Conventions every chapter notebook keeps, so that nbval's run of it means something.

nbval (run by `make test`) re-executes each notebook and compares outputs; these checks catch
what it cannot: a cell never run (nbval skips it), outputs silenced wholesale, a chapter
missing from the README, a first cell that does not say which backend it ran on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.ch00

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "paged-kv-course"


def code_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]


def test_there_is_at_least_the_setup_chapter():
    assert ROOT / "notebooks" / "00_setup.ipynb" in NOTEBOOKS


@pytest.fixture(params=NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def notebook(request) -> tuple[Path, dict]:
    path = request.param
    return path, json.loads(path.read_text(encoding="utf-8"))


def test_name_is_a_chapter_in_the_readme(notebook):
    path, _ = notebook
    assert re.fullmatch(r"\d\d_[a-z0-9_]+", path.stem), f"{path.name}: name it NN_topic.ipynb"
    assert path.stem in (ROOT / "README.md").read_text(encoding="utf-8")


def test_kernel_is_the_course_kernel(notebook):
    _, nb = notebook
    assert nb["metadata"]["kernelspec"]["name"] == KERNEL


def test_first_code_cell_reports_the_backend_and_is_compared(notebook):
    _, nb = notebook
    first = "".join(code_cells(nb)[0]["source"])
    assert "course_lib.device" in first and "BACKEND.name" in first
    assert "NBVAL_" not in first
    printed = "".join(t for o in code_cells(nb)[0]["outputs"] for t in o.get("text", []))
    assert printed.startswith("backend: ")


def test_outputs_were_stored_from_one_clean_top_to_bottom_run(notebook):
    _, nb = notebook
    counts = [c["execution_count"] for c in code_cells(nb)]
    assert counts == list(range(1, len(counts) + 1)), "restart the kernel and run all cells"
    errors = [o for c in code_cells(nb) for o in c["outputs"] if o["output_type"] == "error"]
    assert not errors


def test_fewer_than_half_the_cells_escape_comparison(notebook):
    _, nb = notebook
    cells = code_cells(nb)
    escaped = [c for c in cells if re.search(r"NBVAL_(IGNORE_OUTPUT|SKIP)", "".join(c["source"]))]
    assert len(escaped) < len(cells) / 2
