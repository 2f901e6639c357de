"""A throw-away JupyterLab for the browser walk: copies of the notebooks, fresh settings.

``start_lab(work, notebooks)`` copies ``notebooks`` into ``work/notebooks`` with every output and
execution count stripped (so whatever the browser shows was produced in this run, and Run All
never touches the files in notebooks/), writes settings that keep the run quiet and
deterministic (no news toast, no autosave, no windowed notebook: every cell stays in the DOM),
and starts ``jupyter lab`` on 127.0.0.1 with ``window.jupyterapp`` exposed, which the page
helpers use to reach the notebook's kernel.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TOKEN = "course-browser-test"
ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = Path(os.environ.get("COURSE_BROWSER_NOTEBOOKS", ROOT / "notebooks"))

# JupyterLab user settings, one file per plugin: {plugin path: settings}.
SETTINGS = {
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false",
                                                     "checkForUpdates": False},
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
}


def strip_notebook(source: Path, target: Path) -> None:
    """Copy a notebook without outputs or execution counts (its cells and metadata unchanged)."""
    nb = json.loads(source.read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
    nb.get("metadata", {}).pop("widgets", None)   # stored widget state: none of it is live
    target.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def copy_notebooks(source: Path, target: Path) -> list[str]:
    """Copy ``source`` (the whole folder: notebooks may read files next to them) to ``target``,
    notebooks stripped; returns the copied notebooks' names."""
    names = []
    for path in sorted(source.rglob("*")):
        if ".ipynb_checkpoints" in path.parts or path.is_dir():
            continue
        out = target / path.relative_to(source)
        out.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".ipynb":
            strip_notebook(path, out)
            names.append(str(path.relative_to(source)))
        else:
            out.write_bytes(path.read_bytes())
    return names


def write_notebook(path: Path, cells: list[str], kernel: str) -> None:
    """A scratch notebook of code cells for ``kernel`` (used to prove the detectors)."""
    nb = {"cells": [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "source": src,
                     "outputs": [], "execution_count": None} for i, src in enumerate(cells)],
          "metadata": {"kernelspec": {"name": kernel, "display_name": kernel,
                                      "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb, indent=1) + "\n", encoding="utf-8")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_settings(settings_dir: Path) -> None:
    for plugin, values in SETTINGS.items():
        path = settings_dir / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@contextmanager
def start_lab(work: Path, timeout_s: float = 120) -> Iterator[str]:
    """Run JupyterLab over ``work/notebooks`` until the block exits; yields its base URL.

    The server's log is ``work/lab.log`` (kernels' own stderr lands there too)."""
    _write_settings(work / "settings")
    port = _free_port()
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", f"--IdentityProvider.token={TOKEN}",
           f"--ServerApp.root_dir={work / 'notebooks'}", "--LabApp.expose_app_in_browser=True",
           f"--LabApp.user_settings_dir={work / 'settings'}",
           f"--LabApp.workspaces_dir={work / 'workspaces'}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    base = f"http://127.0.0.1:{port}"
    with open(work / "lab.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=work)
        try:
            deadline = time.monotonic() + timeout_s
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
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def api(base: str, path: str, method: str = "GET") -> object:
    """Call the Jupyter server's REST API; returns the decoded JSON (None when empty)."""
    req = urllib.request.Request(f"{base}{path}", method=method,
                                 headers={"Authorization": f"token {TOKEN}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        body = resp.read()
    return json.loads(body) if body else None


def shut_down_kernels(base: str) -> None:
    """End every session and kernel the server runs (after a chapter: the next starts fresh)."""
    for session in api(base, "/api/sessions"):
        api(base, f"/api/sessions/{session['id']}", "DELETE")
    for kernel in api(base, "/api/kernels"):
        api(base, f"/api/kernels/{kernel['id']}", "DELETE")
