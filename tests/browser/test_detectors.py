"""The walk's detectors, proven on scratch notebooks before the chapters are walked.

- a cell that raises must be reported, and the cells after it must count as not run; a
  traceback printed on stderr (a caught exception) must be reported too;
- a warning and other text on stderr must not be reported;
- a widget that fails to render must be reported;
- an exception in a widget callback (shown by JupyterLab only in its log console) must be
  reported;
- the change detector must see a new picture and new text, and must not take a redraw of the
  same pixels (a new image, equal pixels) or a click that does nothing for a change.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from lab_page import NotebookPage
from lab_server import shut_down_kernels, write_notebook
from scenarios import find
from widget_driver import WidgetDriver

pytestmark = pytest.mark.browser
KERNEL = "paged-kv-course"
RUN_ALL_TIMEOUT_MS = 5 * 60_000

WIDGETS = """\
import io
import ipywidgets as widgets
from matplotlib.figure import Figure

def png(color, software):
    fig = Figure(figsize=(2, 1))
    fig.patch.set_facecolor(color)
    out = io.BytesIO()
    fig.savefig(out, format="png", metadata={"Software": software})
    return out.getvalue()

image = widgets.Image(value=png("white", "a"), format="png")
text = widgets.HTML("n = 0")
n = widgets.IntSlider(0, min=0, max=5, description="n")
n.observe(lambda change: setattr(text, "value", f"n = {change['new']}"), names="value")
redraw = widgets.Button(description="new picture")
redraw.on_click(lambda _: setattr(image, "value", png("tab:blue", "b")))
same = widgets.Button(description="same pixels")
same.on_click(lambda _: setattr(image, "value", png("tab:blue", "c")))
idle = widgets.Button(description="does nothing")
idle.on_click(lambda _: None)

def boom(_):
    raise RuntimeError("raised in a widget callback")

fails = widgets.Button(description="raises")
fails.on_click(boom)
widgets.VBox([widgets.HBox([n, redraw, same, idle, fails]), image, text])
"""


@contextmanager
def scratch(lab, context, name: str, cells: list[str]) -> Iterator[NotebookPage]:
    """A scratch notebook of ``cells``, opened and run; closed and its kernel shut down after."""
    write_notebook(lab.root / name, cells, KERNEL)
    nb = NotebookPage.open(context, lab.base, name)
    try:
        nb.run_all(RUN_ALL_TIMEOUT_MS)
        yield nb
    finally:
        nb.page.close()
        shut_down_kernels(lab.base)


PRINTS_A_TRACEBACK = """\
import traceback
try:
    {}["missing"]
except KeyError:
    traceback.print_exc()   # the cell goes on: no error output, a traceback on stderr
"""


def test_a_cell_that_raises_is_detected(lab, browser_context):
    with scratch(lab, browser_context, "_scratch_raises.ipynb",
                 [PRINTS_A_TRACEBACK, "1 / 0", "print('never reached')"]) as nb:
        problems = nb.problems()
        assert any("traceback on stderr: KeyError: 'missing'" in p for p in problems), problems
        assert any("ZeroDivisionError: division by zero" in p for p in problems), problems
        assert len(problems) == 2, problems
        assert nb.cells_run() == (2, 3)


def test_stderr_without_a_traceback_is_not_an_error(lab, browser_context):
    with scratch(lab, browser_context, "_scratch_stderr.ipynb", [
        "import sys, warnings\nwarnings.warn('a harmless warning')",
        "print('a note on stderr', file=sys.stderr)",
        "import logging\nlogging.getLogger('course').warning('a logged warning')"]) as nb:
        shown = nb.page.locator("[data-mime-type='application/vnd.jupyter.stderr']")
        assert shown.count() == 3, "the three cells should each show text on stderr"
        assert nb.problems() == []
        assert nb.cells_run() == (3, 3)


def test_a_widget_that_fails_to_render_is_detected(lab, browser_context):
    bogus = ("from IPython.display import display\n"
             "display({'application/vnd.jupyter.widget-view+json': {'model_id': 'no-such-model',"
             " 'version_major': 2, 'version_minor': 0}}, raw=True)")
    with scratch(lab, browser_context, "_scratch_render.ipynb", [bogus]) as nb:
        problems = nb.problems()
        assert any("widget failed to render" in p for p in problems), problems


def test_widget_detectors(lab, browser_context, shots):
    with scratch(lab, browser_context, "_scratch_widgets.ipynb", [WIDGETS]) as nb:
        assert nb.problems() == []
        driver = WidgetDriver(nb, shots, "scratch")
        (controls,) = driver.controls()
        assert [c.kind for c in controls] == ["slider", "button", "button", "button", "button"]
        slider = driver.drive(find(controls, "n"))
        assert slider.changed and slider.changed_parts() == "text", slider
        assert driver.slider_value(find(controls, "n")) == 1
        new = driver.drive(find(controls, "new picture"))
        assert new.changed and new.changed_parts() == "picture", new
        same = driver.drive(find(controls, "same pixels"))
        assert not same.changed, same
        assert not driver.drive(find(controls, "does nothing")).changed
        assert nb.problems() == []
        driver.drive(find(controls, "raises"))
        problems = nb.problems()
        assert any("RuntimeError: raised in a widget callback" in p for p in problems), problems
