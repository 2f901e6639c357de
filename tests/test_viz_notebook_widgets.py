"""After Run All, each explorer a chapter displays shows where it starts.

The stored notebooks are what Run All leaves (nbconvert executes them top to bottom and saves
every widget's last state in the notebook's metadata, which JupyterLab restores on opening): a
later cell that demonstrated another step on the displayed instance would show up here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
STATE_KEY = "application/vnd.jupyter.widget-state+json"
VIEW_KEY = "application/vnd.jupyter.widget-view+json"


def widget_state(path: Path) -> dict[str, dict]:
    nb = json.loads(path.read_text())
    return dict(nb["metadata"]["widgets"][STATE_KEY]["state"])


def displayed(path: Path) -> list[str]:
    """Model ids of the widgets the notebook's outputs display, in order."""
    nb = json.loads(path.read_text())
    return [out["data"][VIEW_KEY]["model_id"] for cell in nb["cells"] if cell["cell_type"] == "code"
            for out in cell["outputs"] if VIEW_KEY in out.get("data", {})]


def descendants(state: dict[str, dict], model_id: str) -> list[dict]:
    """The model and every model its state refers to (children, layouts, ...)."""
    seen, todo, out = set(), [model_id], []
    while todo:
        mid = todo.pop()
        if mid in seen or mid not in state:
            continue
        seen.add(mid)
        out.append(state[mid])
        todo += re.findall(r"IPY_MODEL_([0-9a-f]+)", json.dumps(state[mid]["state"]))
    return out


def step_sliders(path: Path) -> list[dict]:
    state = widget_state(path)
    return [m["state"] for mid in displayed(path) for m in descendants(state, mid)
            if m["model_name"] == "IntSliderModel" and m["state"].get("description") == "step"]


def test_the_step_detector_finds_a_moved_slider(tmp_path):
    nb = json.loads((NOTEBOOKS / "03_blocks_and_tables.ipynb").read_text())
    for model in nb["metadata"]["widgets"][STATE_KEY]["state"].values():
        if model["model_name"] == "IntSliderModel":
            model["state"]["value"] = 7                  # what the old chapter stored
    (tmp_path / "moved.ipynb").write_text(json.dumps(nb))
    assert [s["value"] for s in step_sliders(tmp_path / "moved.ipynb")] == [7]


@pytest.mark.parametrize("name", [
    pytest.param("03_blocks_and_tables.ipynb", marks=pytest.mark.ch03),
    pytest.param("07_scheduling_and_preemption.ipynb", marks=pytest.mark.ch07),
])
def test_step_explorers_open_at_their_first_step(name):
    sliders = step_sliders(NOTEBOOKS / name)
    assert sliders, f"{name} displays no step slider"
    assert all(s["value"] == s.get("min", 0) == 0 for s in sliders), sliders


@pytest.mark.ch06
def test_prefix_cache_explorer_opens_with_nothing_submitted():
    path = NOTEBOOKS / "06_prefix_caching.ipynb"
    state = widget_state(path)
    captions = [m["state"]["value"] for mid in displayed(path) for m in descendants(state, mid)
                if m["model_name"] == "HTMLModel" and "hit rate" in m["state"].get("value", "")]
    assert captions and all(c.startswith("nothing submitted yet") for c in captions), captions


@pytest.mark.ch08
def test_capacity_explorer_opens_at_its_default_state():
    from course_lib.sizing.models import get_preset
    from course_lib.viz.capacity_explorer import ExplorerState

    path = NOTEBOOKS / "08_capacity_planning.ipynb"
    state = widget_state(path)
    models = [m["state"] for mid in displayed(path) for m in descendants(state, mid)
              if m["model_name"] == "DropdownModel" and m["state"].get("description") == "model"]
    assert models
    labels = [m["_options_labels"][m["index"]] for m in models]
    assert labels == [get_preset(ExplorerState().preset).name]
