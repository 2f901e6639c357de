#!/usr/bin/env python3
"""Build the course as a static HTML book from the notebooks' stored outputs (nothing is run).

    python scripts/build_book.py                       # every chapter -> build/book/
    python scripts/build_book.py --out DIR --chapters 03_blocks_and_tables

`make book` runs it after `pip install -e '.[book]'` (Sphinx, MyST-NB, sphinx-book-theme). It
copies docs/book/ (conf.py, index.md) and the chapter notebooks into a temporary source folder,
writes there the course map (from README.md's chapter table) and the roadmap figure
(docs/book/roadmap.py), and runs Sphinx with MyST-NB in `nb_execution_mode = "off"`: the pages
show each notebook's stored figures, tables, printed output and widget state, each widget with a
static snapshot for readers offline (docs/book/snapshots.py). Exit status: 0
when the book built without a warning, 1 when Sphinx warned (a broken cross-link is a bug; the
book is still written), 2 when the toolchain is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOOK_DIR = ROOT / "docs" / "book"
NOTEBOOKS = ROOT / "notebooks"
DEFAULT_OUT = ROOT / "build" / "book"
TOOLCHAIN = ("sphinx", "myst_nb", "sphinx_book_theme")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

_STEM_CELL = re.compile(r"^`(\d\d_[a-z0-9_]+)`$")


def missing_toolchain() -> list[str]:
    """The book's packages that cannot be imported here ([] when all are installed)."""
    return [name for name in TOOLCHAIN if importlib.util.find_spec(name) is None]


def chapter_notebooks() -> list[Path]:
    """notebooks/NN_*.ipynb, in chapter order."""
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def chapter_table(readme: str) -> dict[str, str]:
    """README's "## Chapters" table as {notebook stem: what it covers}, in table order."""
    if "\n## Chapters\n" not in readme:
        raise ValueError("README.md has no '## Chapters' section")
    section = readme.split("\n## Chapters\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        match = _STEM_CELL.match(cells[0])
        if match and len(cells) >= 2:
            rows[match[1]] = cells[1]
    return rows


def notebook_title(notebook: Path) -> str:
    """The chapter's title: its first '# ' heading without the 'NN · ' prefix."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("# "):
                    return re.sub(r"^\d\d\s*·\s*", "", line[2:].strip())
    raise ValueError(f"{notebook.name} has no '# ' title")


def has_widgets(notebook: Path) -> bool:
    """Whether a stored output of the notebook is an ipywidgets view."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    return any(WIDGET_VIEW in out.get("data", {})
               for cell in nb["cells"] for out in cell.get("outputs", []))


def course_map(chapters: list[Path], built: list[Path], readme: str) -> str:
    """The landing page's course map (MyST): one row per chapter, linked when its page is built.

    Raises ValueError if a chapter has no row in README's table or a row has no notebook.
    """
    table = chapter_table(readme)
    stems = [nb.stem for nb in chapters]
    problems = [f"{s}: no row in README.md's chapter table" for s in stems if s not in table]
    problems += [f"{s}: in README.md's chapter table but not in notebooks/"
                 for s in table if s not in stems]
    if problems:
        raise ValueError("course map out of step with README.md:\n  " + "\n  ".join(problems))
    built_stems = {nb.stem for nb in built}
    lines = ["| | chapter | what it covers |", "| --- | --- | --- |"]
    for nb in chapters:
        title = notebook_title(nb)
        name = f"{{doc}}`{title} </{nb.stem}>`" if nb.stem in built_stems else title
        lines.append(f"| {nb.stem[:2]} | {name} | {table[nb.stem]} |")
    explorers = ", ".join(nb.stem[:2] for nb in chapters if has_widgets(nb))
    if explorers:
        lines += ["", f"Chapters {explorers} have an explorer (ipywidgets): controls that redraw a "
                  "figure. The book shows each one as the notebook saved it, drawn by the "
                  "widgets' JavaScript when it can load from its CDN, otherwise as a static "
                  "snapshot; its controls need a running kernel, so run the notebook to explore."]
    return "\n".join(lines) + "\n"


# What a notebook's code carries for its tests, not for a reader: nbval's markers and the
# comments that explain why an output is not compared.
TEST_MARKER = re.compile(r"^\s*#\s*(NBVAL_\w+|\(.*\bnot compared\)\s*)$")


def strip_test_markers(notebook: dict) -> dict:
    """The notebook with the test markers taken out of every code cell (in place)."""
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            lines = "".join(cell["source"]).splitlines(keepends=True)
            kept = [line for line in lines if not TEST_MARKER.match(line)]
            if len(kept) != len(lines):
                cell["source"] = kept
    return notebook


def stage(src: Path, chapters: list[Path], built: list[Path]) -> None:
    """Fill the Sphinx source folder `src`: docs/book/, the notebooks to build, _generated/."""
    sys.path.insert(0, str(BOOK_DIR))
    try:
        from roadmap import draw_roadmap
        from snapshots import add_widget_snapshots
    finally:
        sys.path.remove(str(BOOK_DIR))
    shutil.copytree(BOOK_DIR, src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for nb in built:
        notebook = strip_test_markers(json.loads(nb.read_text(encoding="utf-8")))
        add_widget_snapshots(notebook)
        (src / nb.name).write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n",
                                   encoding="utf-8")
    generated = src / "_generated"
    generated.mkdir()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (generated / "course_map.md").write_text(course_map(chapters, built, readme),
                                             encoding="utf-8")
    draw_roadmap([nb.stem for nb in chapters], generated / "roadmap.svg")


def build(out: Path = DEFAULT_OUT, only: list[str] | None = None) -> list[str]:
    """Build the book into `out` (replaced if it holds an earlier build); return the warnings.

    `only`: notebook stems to build (default: every chapter); the landing page always is.
    Raises RuntimeError if the Sphinx build fails, ValueError on an unknown chapter or when
    README's chapter table or the roadmap is out of step with notebooks/.
    """
    from sphinx.cmd.build import build_main

    chapters = chapter_notebooks()
    built = chapters if only is None else [nb for nb in chapters if nb.stem in only]
    unknown = set(only or ()) - {nb.stem for nb in chapters}
    if unknown:
        raise ValueError(f"no such chapter notebook: {sorted(unknown)}")
    if out.exists():
        if not (out / ".buildinfo").exists():
            raise RuntimeError(f"{out} exists and is not a Sphinx build: not replacing it")
        shutil.rmtree(out)
    with tempfile.TemporaryDirectory(prefix="paged-kv-book-") as tmp:
        src, warnings = Path(tmp) / "src", Path(tmp) / "warnings.txt"
        stage(src, chapters, built)
        args = ["-b", "html", "-q", "-E", "-N", "-w", str(warnings),
                "-d", str(Path(tmp) / "doctrees"), str(src), str(out)]
        if build_main(args) != 0:
            raise RuntimeError("sphinx-build failed (its messages are above)")
        text = warnings.read_text(encoding="utf-8") if warnings.exists() else ""
    for nb in built:  # the download button offers the notebook itself, without the snapshots
        if (out / "_sources" / nb.name).exists():
            shutil.copy2(nb, out / "_sources" / nb.name)
    return [line.replace(str(src) + "/", "") for line in text.splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="output folder (default: build/book)")
    parser.add_argument("--chapters", nargs="+", metavar="STEM",
                        help="build only these chapters, e.g. 03_blocks_and_tables")
    args = parser.parse_args(argv)
    missing = missing_toolchain()
    if missing:
        print(f"the book's toolchain is not installed ({', '.join(missing)} missing): "
              "run `make book`, or `.venv/bin/pip install -e '.[book]'`", file=sys.stderr)
        return 2
    warnings = build(args.out.resolve(), args.chapters)
    index = args.out / "index.html"
    if warnings:
        print(f"book written to {index}, with {len(warnings)} warning(s) (above)",
              file=sys.stderr)
        return 1
    print(f"book written to {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
