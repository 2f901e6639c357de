"""Fixtures for the browser walk (`make test-browser`): one JupyterLab, one Chromium.

Tests marked ``browser`` are skipped unless COURSE_BROWSER_TEST=1 (make test-browser sets it):
they need Debian's Chromium (/usr/bin/chromium, or $CHROMIUM) and take minutes, so `make test`
leaves them out. JupyterLab serves stripped copies of notebooks/ (or of
$COURSE_BROWSER_NOTEBOOKS) from a temporary folder. Screenshots and the walk's log (walk.txt:
seconds and widget actions per chapter) go to build/browser/, emptied at the start of a run.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from lab_server import NOTEBOOKS, ROOT, copy_notebooks, start_lab

SHOTS = ROOT / "build" / "browser"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
ENABLED = os.environ.get("COURSE_BROWSER_TEST") == "1"
_WALKED = pytest.StashKey[dict]()


def pytest_configure(config):
    config.stash[_WALKED] = {}


def pytest_collection_modifyitems(config, items):
    if ENABLED:
        return
    skip = pytest.mark.skip(reason="browser walk: run `make test-browser`")
    for item in items:
        if item.get_closest_marker("browser") is not None:
            item.add_marker(skip)


@dataclass(frozen=True)
class Lab:
    """The running JupyterLab: ``base`` URL and ``root`` (the folder it serves)."""
    base: str
    root: Path


@pytest.fixture(scope="session")
def lab(tmp_path_factory) -> Lab:
    work = tmp_path_factory.mktemp("lab")
    copy_notebooks(NOTEBOOKS, work / "notebooks")
    with start_lab(work) as base:
        yield Lab(base, work / "notebooks")


@pytest.fixture(scope="session")
def browser_context():
    """A Chromium context (1400x1000) that every page of the walk opens in."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: apt-get install chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(60_000)
        yield context
        browser.close()


@pytest.fixture(scope="session")
def shots() -> Path:
    shutil.rmtree(SHOTS, ignore_errors=True)
    SHOTS.mkdir(parents=True)
    return SHOTS


@pytest.fixture(scope="session")
def walk_log(request) -> dict[str, dict]:
    """{notebook: {"seconds": float, "actions": [one line per widget action]}}; printed at the
    end of the run and saved as build/browser/walk.txt."""
    return request.config.stash[_WALKED]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    walked = config.stash.get(_WALKED, {})
    if not walked:
        return
    lines = []
    for name, w in walked.items():
        lines.append(f"{name:45} {w['seconds']:6.1f} s, {len(w['actions'])} widget actions")
        lines += [f"    {action}" for action in w["actions"]]
    lines.append(f"{'total':45} {sum(w['seconds'] for w in walked.values()):6.1f} s")
    terminalreporter.section("browser walk: seconds and widget actions per chapter")
    for line in lines:
        terminalreporter.write_line(line)
    if SHOTS.is_dir():
        (SHOTS / "walk.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
