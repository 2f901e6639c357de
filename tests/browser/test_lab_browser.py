"""A learner's walk through chapter 03 in a real browser (`make test-browser`).

JupyterLab runs on 127.0.0.1 over a throw-away copy of notebooks/; Playwright drives Debian's
Chromium (/usr/bin/chromium): open 03_blocks_and_tables, run all cells, move the block-table
explorer's step slider, and check that the drawn block table changed. A screenshot of each
state is saved under build/browser/ for a human to look at.

Skipped unless COURSE_BROWSER_TEST=1 (make test-browser sets it): it needs Chromium and
takes a minute, so `make test` leaves it out.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.ch03]

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
NOTEBOOK = "03_blocks_and_tables.ipynb"
SHOTS = ROOT / "build" / "browser"
TOKEN = "course-browser-test"

if os.environ.get("COURSE_BROWSER_TEST") != "1":
    pytest.skip("browser test: run `make test-browser`", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on 127.0.0.1 serving a copy of the notebooks; yields its base URL."""
    work = tmp_path_factory.mktemp("lab")
    source = Path(os.environ.get("COURSE_BROWSER_NOTEBOOKS", ROOT / "notebooks"))
    shutil.copytree(source, work / "notebooks")
    # Fresh settings and workspaces: nothing remembered from earlier runs, no news toast.
    settings = work / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    port = free_port()
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", f"--IdentityProvider.token={TOKEN}",
           f"--ServerApp.root_dir={work / 'notebooks'}", "--ServerApp.open_browser=False",
           f"--LabApp.user_settings_dir={work / 'settings'}",
           f"--LabApp.workspaces_dir={work / 'workspaces'}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(work / "lab.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={TOKEN}", timeout=2)
                break
            except OSError as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n"
                                       + (work / "lab.log").read_text()[-3000:]) from exc
                time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def wait_for_kernel_idle(page) -> None:
    """The status bar reads "<kernel> | Idle" once the kernel is connected and not busy (the
    toolbar's indicator already says idle while the kernel is still initializing)."""
    page.wait_for_function("""() => [...document.querySelectorAll('.jp-StatusBar-Widget')]
        .some(e => /\\| Idle/.test(e.textContent))""")
    page.wait_for_timeout(300)


def choose_course_kernel_if_asked(page) -> None:
    """On a loaded machine Lab may still be connecting the kernel when "Run All" is clicked and
    then asks which kernel to use: answer as a learner would (the course's kernel)."""
    dialog = page.locator(".jp-Dialog:has-text('Select Kernel')")
    try:
        dialog.wait_for(timeout=5_000)
    except Exception:   # no dialog: the run started
        return
    dialog.locator("select").select_option(label="Python 3 (paged-kv-course)")
    dialog.get_by_role("button", name="Select", exact=True).click()
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()


def test_block_table_explorer_in_a_real_browser(lab):
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: apt-get install chromium")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        try:
            page.goto(f"{lab}/lab/tree/{NOTEBOOK}?token={TOKEN}")
            page.wait_for_selector(".jp-Notebook .jp-Cell")
            wait_for_kernel_idle(page)   # connected, not just "Initializing", before Run All
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
            choose_course_kernel_if_asked(page)
            # The explorer is the first output with a slider; wait until it and its image render.
            explorer = page.locator(".jp-OutputArea-output:has(.widget-slider)").first
            explorer.wait_for()
            image = explorer.locator("img").first
            image.wait_for()
            wait_for_kernel_idle(page)
            explorer.scroll_into_view_if_needed()
            before = image.get_attribute("src")
            page.screenshot(path=str(SHOTS / "03_explorer_before.png"))
            readout = explorer.locator(".widget-readout").first
            start = int(readout.inner_text())
            handle = explorer.locator(".noUi-handle").first
            handle.focus()
            for _ in range(3):
                handle.press("ArrowRight")
            page.wait_for_function(
                "([img, old]) => img.getAttribute('src') !== old",
                arg=[image.element_handle(), before])
            wait_for_kernel_idle(page)
            page.wait_for_timeout(500)   # let the last redraw land before the screenshot
            after = image.get_attribute("src")
            moved_to = int(readout.inner_text())
            page.screenshot(path=str(SHOTS / "03_explorer_after.png"))
            errors = page.locator(".jp-OutputArea-output[data-mime-type*='error']").count()
        except Exception:
            page.screenshot(path=str(SHOTS / "03_failure.png"))
            raise
        finally:
            browser.close()
    assert moved_to > start, f"the step slider did not move ({start} -> {moved_to})"
    assert after != before, "the block-table drawing did not change when the step moved"
    assert errors == 0, f"{errors} cell(s) raised an error in the browser"
