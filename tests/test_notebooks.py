"""Conventions every chapter notebook keeps, so that nbval's run of it means something.

nbval (run by `make test`) re-executes each notebook and compares outputs; these checks catch
what it cannot: a cell never run (nbval skips it), outputs silenced wholesale, a chapter
missing from the README, a first cell that does not say which backend it ran on, a compared
output that names the backend or prints a float's rounding residue (nbval would then fail on
another machine).
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


IGNORED = re.compile(r"NBVAL_(IGNORE_OUTPUT|SKIP)")
# The course's backends by name: a compared output naming one differs on another machine.
BACKEND_NAMES = re.compile(r"triton-cuda|triton-interpreter|torch-reference|device='cuda")


def test_first_code_cell_reports_the_backend_and_nothing_else(notebook):
    """The backend varies between machines: the first cell prints it for the learner, is not
    compared, and does nothing else (so that nothing else escapes comparison with it)."""
    _, nb = notebook
    cell = code_cells(nb)[0]
    source = "".join(cell["source"])
    assert source.startswith("# NBVAL_IGNORE_OUTPUT\n")
    code = [line for line in source.splitlines() if line.strip() and not line.startswith("#")]
    assert code[:2] == ["from course_lib.device import BACKEND", 'print("backend:", BACKEND.name)']
    assert all(line.startswith("print(") and "BACKEND." in line for line in code[1:])
    printed = "".join(t for o in cell["outputs"] for t in o.get("text", []))
    assert printed.startswith("backend: ")


def compared_texts(nb: dict) -> list[str]:
    """The text of every output nbval compares (cells not marked to be ignored)."""
    return ["".join(out.get("text", [])) + "".join(out.get("data", {}).get("text/plain", []))
            for cell in code_cells(nb) if not IGNORED.search("".join(cell["source"]))
            for out in cell["outputs"]]


def backend_names_in_compared_outputs(nb: dict) -> list[str]:
    """Backend names found in the text outputs of the cells nbval compares."""
    return [name for text in compared_texts(nb) for name in BACKEND_NAMES.findall(text)]


def test_no_compared_output_names_a_backend(notebook):
    _, nb = notebook
    assert backend_names_in_compared_outputs(nb) == []


def test_the_backend_name_detector_trips():
    def cell(source: str, text: str) -> dict:
        return {"cell_type": "code", "source": [source],
                "outputs": [{"output_type": "stream", "name": "stdout", "text": [text]}]}

    nb = {"cells": [cell("print(smoke.check_add())", "vector add on triton-interpreter: ok\n"),
                    cell("x", "tensor([1.], device='cuda:0')"),
                    cell("# NBVAL_IGNORE_OUTPUT\nprint(BACKEND.name)", "torch-reference\n")]}
    assert backend_names_in_compared_outputs(nb) == ["triton-interpreter", "device='cuda"]


# A float printed in scientific notation far below 1 (an error such as 5.6e-16) is rounding
# noise: its digits change with the CPU's vector kernels (ATEN_CPU_CAPABILITY), so a compared
# output must print it against a tolerance instead ("max |a - b| < 1e-12: True"). A measured
# value is printed with a fraction (5.6e-16); a tolerance written by hand has none (1e-12).
ROUNDING_RESIDUE = re.compile(r"\b\d\.\d+e-(?:0?[6-9]|[1-9]\d)\b", re.IGNORECASE)


def rounding_residues_in_compared_outputs(nb: dict) -> list[str]:
    """Tiny floats (<= 1e-6, scientific notation) in the outputs nbval compares."""
    return [x for text in compared_texts(nb) for x in ROUNDING_RESIDUE.findall(text)]


def test_no_compared_output_prints_a_rounding_residue(notebook):
    _, nb = notebook
    assert rounding_residues_in_compared_outputs(nb) == [], \
        "print float errors against a tolerance: their last digits differ from CPU to CPU"


def test_the_rounding_residue_detector_trips():
    def cell(source: str, text: str) -> dict:
        return {"cell_type": "code", "source": [source],
                "outputs": [{"output_type": "stream", "name": "stdout", "text": [text]}]}

    nb = {"cells": [cell("print(err)", "max |merged - full| = 5.6e-16\n"),   # chapter 09, once
                    cell("print(x)", "tensor([1.0000e+00, 2.2204E-16])"),
                    cell("print(tol)", "fp32 tolerance 1e-4, error < 1e-12: True\n"),
                    cell("# NBVAL_IGNORE_OUTPUT\nprint(err)", "4.4e-16\n")]}
    assert rounding_residues_in_compared_outputs(nb) == ["5.6e-16", "2.2204E-16"]


def test_outputs_were_stored_from_one_clean_top_to_bottom_run(notebook):
    _, nb = notebook
    counts = [c["execution_count"] for c in code_cells(nb)]
    assert counts == list(range(1, len(counts) + 1)), "restart the kernel and run all cells"
    errors = [o for c in code_cells(nb) for o in c["outputs"] if o["output_type"] == "error"]
    assert not errors


def test_fewer_than_half_the_cells_escape_comparison(notebook):
    _, nb = notebook
    cells = code_cells(nb)
    escaped = [c for c in cells if IGNORED.search("".join(c["source"]))]
    assert len(escaped) < len(cells) / 2


def test_the_first_screen_says_what_the_learner_will_be_able_to_do(notebook):
    """Every chapter opens (its first markdown cell) with what a learner can do after it."""
    _, nb = notebook
    first = "".join(nb["cells"][0]["source"])
    assert nb["cells"][0]["cell_type"] == "markdown" and "**After this chapter you can:**" in first
    outcomes = first.split("**After this chapter you can:**", 1)[1]
    assert len(re.findall(r"^- \S", outcomes, flags=re.M)) >= 2
