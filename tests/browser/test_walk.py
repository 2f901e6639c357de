"""A learner's walk through every chapter in a real browser (`make test-browser`).

For each notebook NN_*.ipynb (a stripped copy, served by the session's JupyterLab): open it in
Chromium, Run All Cells from the menu, wait until the kernel has run every cell, and fail on
any error (lab_page.NotebookPage.problems). Then drive every widget the chapter shows
(scenarios.py): each change of a control must change the picture or text it controls. The
chapter's kernel is shut down afterwards. Screenshots: build/browser/NN_*.png.
"""

from __future__ import annotations

import re
import time

import pytest
from lab_page import NotebookPage
from lab_server import NOTEBOOKS, shut_down_kernels
from scenarios import SCENARIOS, drive_widgets
from widget_driver import WidgetDriver

CHAPTERS = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
RUN_ALL_TIMEOUT_MS = 20 * 60_000


def test_every_chapter_is_walked():
    numbers = [int(name[:2]) for name in CHAPTERS]
    assert numbers == list(range(len(numbers))) and len(numbers) >= 13, CHAPTERS


@pytest.mark.browser
@pytest.mark.parametrize("name", [
    pytest.param(n, id=n[:2], marks=getattr(pytest.mark, f"ch{n[:2]}")) for n in CHAPTERS])
def test_chapter_in_the_browser(name, lab, browser_context, shots, walk_log):
    start = time.monotonic()
    walked = walk_log[name] = {"seconds": 0.0, "actions": []}
    chapter = name[:2]
    nb = NotebookPage.open(browser_context, lab.base, name)
    try:
        nb.run_all(RUN_ALL_TIMEOUT_MS)
        problems = nb.problems()
        assert not problems, f"{name} after Run All:\n" + "\n".join(problems)
        ran, cells = nb.cells_run()
        assert ran == cells, f"{name}: only {ran} of {cells} code cells ran"
        driver = WidgetDriver(nb, shots, re.sub(r"\.ipynb$", "", name))
        done, failures = drive_widgets(driver, SCENARIOS.get(chapter, []))
        walked["actions"] += done
        failures += [f"after driving the widgets: {p}" for p in nb.problems()]
        assert not failures, f"{name}:\n" + "\n".join(failures)
    except Exception:
        nb.page.screenshot(path=str(shots / f"{chapter}_failure.png"))
        raise
    finally:
        nb.page.close()
        shut_down_kernels(lab.base)
        walked["seconds"] = time.monotonic() - start
