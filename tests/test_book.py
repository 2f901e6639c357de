"""The HTML book (`make book`, scripts/build_book.py): built from the stored outputs, complete.

The whole book is built once into a temporary folder (about 5 s on the 2-core CI machine, so the
full build is tested rather than one chapter). Skipped where the book's toolchain (the `book`
extra: Sphinx, MyST-NB, sphinx-book-theme) is not installed, as in a learner's `make lab` venv.
"""

from __future__ import annotations

import html
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
IMAGE_TYPES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")
GLOSSARY = [
    "KV cache", "block", "block table", "slot", "block_size", "copy-on-write", "prefix caching",
    "block hash", "eviction", "preemption (recompute / swap)", "continuous batching",
    "chunked prefill", "watermark", "gpu_memory_utilization", "TP", "DP", "CP", "DCP", "MLA",
    "paged attention", "split-K", "log-sum-exp merge", "V0", "V1", "radix tree",
]

# Sphinx 9 deprecations inside myst-parser and sphinx-book-theme, not in the course's code.
pytestmark = pytest.mark.filterwarnings("ignore:.*Check CHANGES for Sphinx API modifications")

for _name in ("sphinx", "myst_nb", "sphinx_book_theme"):
    pytest.importorskip(_name, reason="the book's toolchain is not installed "
                        "(pip install -e '.[book]'; `make test` and `make book` install it)")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


build_book = _load("build_book", ROOT / "scripts" / "build_book.py")
roadmap = _load("roadmap", ROOT / "docs" / "book" / "roadmap.py")
snapshots = _load("snapshots", ROOT / "docs" / "book" / "snapshots.py")


def output_images(notebook: dict) -> int:
    """How many figures the notebook's stored outputs hold (one per output with an image)."""
    return sum(any(t in out.get("data", {}) for t in IMAGE_TYPES)
               for cell in notebook["cells"] for out in cell.get("outputs", []))


def page_images(page: str) -> list[str]:
    """The src of every <img> of a page that shows a stored output (files under _images/)."""
    return re.findall(r'<img\b[^>]*\bsrc="(_images/[^"]+)"', page)


def first_printed_line(notebook: dict) -> str | None:
    """The first non-empty line of the notebook's first stream output, if any."""
    for cell in notebook["cells"]:
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream":
                lines = [s.strip() for s in "".join(out["text"]).splitlines() if s.strip()]
                if lines:
                    return lines[0]
    return None


@pytest.fixture(scope="module")
def book(tmp_path_factory) -> tuple[Path, list[str]]:
    out = tmp_path_factory.mktemp("book") / "html"
    return out, build_book.build(out)


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# --- the detectors, each shown to trip -------------------------------------------------------

def test_image_counters_see_outputs_only():
    nb = {"cells": [{"cell_type": "code", "outputs": [
        {"output_type": "display_data", "data": {"image/png": "..", "text/plain": "fig"}},
        {"output_type": "stream", "name": "stdout", "text": ["x\n"]},
        {"output_type": "display_data", "data": {"image/svg+xml": ".."}}]},
        {"cell_type": "markdown", "source": ["# t"]}]}
    assert output_images(nb) == 2
    page = ('<img alt="logo" src="_static/logo.png"/>'
            '<img alt="../_images/a.png" src="_images/a.png"/>'
            '<img class="widget-snapshot-image" src="data:image/png;base64,"/>')
    assert page_images(page) == ["_images/a.png"]


def test_course_map_refuses_a_chapter_missing_from_readme():
    readme = "# x\n\n## Chapters\n\n| chapter | what |\n| --- | --- |\n| `00_setup` | setup |\n"
    assert build_book.chapter_table(readme) == {"00_setup": "setup"}
    with pytest.raises(ValueError, match="01_kv_cache_cost: no row"):
        build_book.course_map(NOTEBOOKS[:2], NOTEBOOKS[:2], readme)


def test_roadmap_check_names_a_chapter_without_a_place():
    stems = [nb.stem for nb in NOTEBOOKS]
    assert roadmap.check_roadmap(stems) == []
    problems = roadmap.check_roadmap(stems + ["13_new_chapter"])
    assert problems == ["13_new_chapter: no place on the roadmap "
                        "(add it to PLACES in docs/book/roadmap.py)"]


def test_widget_snapshot_renders_the_saved_state():
    def model(name, **state):
        return {"model_name": name, "state": state}
    models = {
        "box": model("VBoxModel", children=["IPY_MODEL_dd", "IPY_MODEL_cb", "IPY_MODEL_im"]),
        "dd": model("DropdownModel", description="model", index=1, _options_labels=["a", "b"]),
        "cb": model("CheckboxModel", description="cache", value=True),
        "im": {**model("ImageModel", format="png"),
               "buffers": [{"path": ["value"], "encoding": "base64", "data": "iVBO"}]},
    }
    body = snapshots.render_widget(models, "box")
    assert "model: <b>b</b>" in body and "cache: <b>on</b>" in body
    assert 'src="data:image/png;base64,iVBO"' in body
    nb = {"metadata": {"widgets": {snapshots.WIDGET_STATE: {"state": models}}}, "cells": [
        {"cell_type": "code", "outputs": [
            {"output_type": "display_data", "data": {snapshots.WIDGET_VIEW: {"model_id": "box"}}},
            {"output_type": "display_data", "data": {snapshots.WIDGET_VIEW: {"model_id": "gone"}}},
        ]}]}
    assert snapshots.add_widget_snapshots(nb) == 1
    assert [list(o["data"]) for o in nb["cells"][0]["outputs"]] == [
        [snapshots.WIDGET_VIEW], ["text/html"], [snapshots.WIDGET_VIEW]]


@pytest.mark.slow
def test_a_broken_cross_link_is_a_warning(tmp_path):
    # Only chapter 00 built: the glossary's links to the other chapters have no target.
    warnings = build_book.build(tmp_path / "html", only=["00_setup"])
    assert any("01_kv_cache_cost" in w for w in warnings), warnings


# --- the book --------------------------------------------------------------------------------

@pytest.mark.slow
def test_test_markers_are_stripped_from_code_cells_and_nothing_else():
    nb = {"cells": [
        {"cell_type": "code", "source": [
            "# NBVAL_IGNORE_OUTPUT\n",
            "# (the backend depends on the machine: chapter 00 explains the three; not compared)\n",
            "from course_lib.device import BACKEND\n", "# a comment a reader needs\n",
            "print(BACKEND.name)  # NBVAL_SKIP stays inside a line of code\n"]},
        {"cell_type": "markdown", "source": ["# NBVAL_IGNORE_OUTPUT is a marker nbval reads\n"]}]}
    out = build_book.strip_test_markers(nb)
    assert out["cells"][0]["source"] == [
        "from course_lib.device import BACKEND\n", "# a comment a reader needs\n",
        "print(BACKEND.name)  # NBVAL_SKIP stays inside a line of code\n"]
    assert out["cells"][1]["source"] == ["# NBVAL_IGNORE_OUTPUT is a marker nbval reads\n"]


def test_the_build_has_no_warning(book):
    _, warnings = book
    assert warnings == []


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_chapter_page_shows_the_stored_outputs(book, notebook):
    out, _ = book
    nb = json.loads(read(notebook))
    page_path = out / f"{notebook.stem}.html"
    assert page_path.exists()
    page = read(page_path)
    images = page_images(page)
    assert len(images) == output_images(nb)
    assert all((out / src).is_file() for src in images)
    assert read(out / "_sources" / notebook.name) == read(notebook)  # the download button
    assert "NBVAL" not in page                                      # test markers stripped
    line = first_printed_line(nb)
    if line is not None:
        assert html.escape(line, quote=False) in page


@pytest.mark.slow
@pytest.mark.parametrize("notebook", [nb for nb in NOTEBOOKS if build_book.has_widgets(nb)],
                         ids=lambda p: p.stem)
def test_widget_state_is_embedded_with_a_snapshot(book, notebook):
    out, _ = book
    page = read(out / f"{notebook.stem}.html")
    nb = json.loads(read(notebook))
    views = [o for c in nb["cells"] for o in c.get("outputs", [])
             if snapshots.WIDGET_VIEW in o.get("data", {})]
    assert '<script type="application/vnd.jupyter.widget-state+json">' in page
    assert page.count('<script type="application/vnd.jupyter.widget-view+json">') == len(views)
    assert page.count('<div class="widget-snapshot">') == len(views)


@pytest.mark.slow
def test_landing_page_has_map_roadmap_and_glossary(book):
    out, _ = book
    page = read(out / "index.html")
    course_map = page.split('id="the-course-map"', 1)[1].split("</table>", 1)[0]
    for notebook in NOTEBOOKS:
        assert f'href="{notebook.stem}.html"' in course_map, notebook.stem
    (svg,) = re.findall(r'<img\b[^>]*\bsrc="(_images/roadmap[^"]*\.svg)"', page)
    assert read(out / svg).lstrip().startswith("<?xml")
    glossary = page.split('<dl class="simple glossary">', 1)[1].split("</dl>", 1)[0]
    terms = [html.unescape(re.sub(r"<[^>]+>", "", re.sub(r'<a class="headerlink".*?</a>', "", t)))
             .strip() for t in re.findall(r"<dt\b[^>]*>(.*?)</dt>", glossary, flags=re.S)]
    assert [t for t in GLOSSARY if t not in terms] == []
    run = re.sub(r"<[^>]+>", "", page.split('id="run-the-course-yourself"', 1)[1])
    assert "make lab" in run and "make test" in run
