"""Static snapshots of a notebook's ipywidgets explorers, for the book.

The book embeds each notebook's saved widget state, which the widgets' JavaScript (loaded from a
CDN) draws as the live view; offline, or with JavaScript off, that view stays empty. So
`add_widget_snapshots(nb)` puts after every widget output a plain HTML rendering of the same
saved state: its controls' values as text, its images inline, its HTML as is.
`_static/widget_snapshots.js` hides a snapshot once the live view beside it has been drawn.
"""

from __future__ import annotations

import html
from typing import Any

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
NOTE = ("The explorer as the notebook saved it (its controls need a running kernel: "
        "run the notebook to use them).")


def _control(state: dict[str, Any], model: str) -> str:
    """One control as text: 'description: value' (a button: its label)."""
    label = html.escape(str(state.get("description") or ""))
    if model == "ButtonModel":
        return f'<span class="widget-snapshot-button">{label}</span>'
    if "_options_labels" in state and state.get("index") is not None:
        value = state["_options_labels"][state["index"]]
    elif model == "CheckboxModel":
        value = "on" if state.get("value") else "off"
    elif isinstance(state.get("value"), float) and state.get("readout_format"):
        value = format(state["value"], state["readout_format"])
    else:
        value = state.get("value", "")
    return (f'<span class="widget-snapshot-control">{label}: '
            f"<b>{html.escape(str(value))}</b></span>")


def render_widget(models: dict[str, dict], model_id: str) -> str:
    """HTML for the saved view `model_id` of the widget state `models` (id -> model)."""
    model = models[model_id]
    name, state = model["model_name"], model["state"]
    if name in ("VBoxModel", "HBoxModel", "BoxModel", "GridBoxModel"):
        kind = "row" if name == "HBoxModel" else "column"
        inner = "".join(render_widget(models, child.removeprefix("IPY_MODEL_"))
                        for child in state.get("children", []))
        return f'<div class="widget-snapshot-{kind}">{inner}</div>'
    if name == "ImageModel":
        buffers = {tuple(b["path"]): b for b in model.get("buffers", [])}
        data = buffers.get(("value",))
        if data is None or data.get("encoding") != "base64":
            return ""
        fmt = html.escape(state.get("format") or "png")
        return f'<img class="widget-snapshot-image" src="data:image/{fmt};base64,{data["data"]}"/>'
    if name in ("HTMLModel", "HTMLMathModel"):
        return f'<div class="widget-snapshot-html">{state.get("value", "")}</div>'
    if name in ("LabelModel", "TextModel", "TextareaModel"):
        return f'<div class="widget-snapshot-html">{html.escape(str(state.get("value", "")))}</div>'
    if "value" in state or "index" in state or name == "ButtonModel":
        return _control(state, name)
    return ""


def add_widget_snapshots(nb: dict) -> int:
    """Insert a snapshot output after each widget output of `nb` (in place); return how many.

    A widget whose state the notebook did not save gets no snapshot.
    """
    saved = nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    added = 0
    for cell in nb["cells"]:
        outputs = []
        for out in cell.get("outputs", []):
            outputs.append(out)
            view = out.get("data", {}).get(WIDGET_VIEW)
            if view and view.get("model_id") in saved:
                body = render_widget(saved, view["model_id"])
                outputs.append({
                    "output_type": "display_data", "metadata": {},
                    "data": {"text/html": (f'<div class="widget-snapshot"><p class='
                                           f'"widget-snapshot-note">{NOTE}</p>{body}</div>')},
                })
                added += 1
        if "outputs" in cell:
            cell["outputs"] = outputs
    return added
