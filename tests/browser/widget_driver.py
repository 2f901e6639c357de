"""Drive the ipywidgets a notebook shows and tell whether what they control changed.

After Run All, every cell output holding a widget control is a *widget*; inside it, the
*controls* (sliders, dropdowns, checkboxes, buttons, toggle buttons, radio buttons, Play) are
what a learner touches and the *display* (images, HTML, labels and Output widgets outside the
controls) is what they look at. ``WidgetDriver.drive`` changes one control as a learner would
(a key press on a slider's handle, another option in a dropdown, a click), waits until the kernel
has handled it and the display has stopped changing, saves a screenshot of the widget and says
whether the display changed. Images are compared by their pixels (a hash over the decoded
image, drawn to a canvas), text by its rendered text, so a redraw of the same picture is not a
change and a moved slider handle is not either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from lab_page import SETTLED, NotebookPage

# (kind, CSS class of its root element); a control's kind is the first that matches.
CONTROL_KINDS = [("play", ".widget-play"), ("slider", ".widget-slider"),
                 ("dropdown", ".widget-dropdown"), ("select", ".widget-select"),
                 ("checkbox", ".widget-checkbox"), ("toggles", ".widget-toggle-buttons"),
                 ("toggle", ".widget-toggle-button"), ("radio", ".widget-radio"),
                 ("button", ".widget-button")]
_CONTROLS = ", ".join(sel for _, sel in CONTROL_KINDS)
_DISPLAY = "img, .widget-html-content, .widget-htmlmath-content, .widget-output, .widget-label"

# Tag the widgets (data-walk-widget) and their controls (data-walk-control); list the controls.
_TAG = f"""() => {{
  const kinds = {[list(k) for k in CONTROL_KINDS]!r};
  const outs = [...document.querySelectorAll('.jp-Notebook .jp-OutputArea-output')].filter(
    o => !o.parentElement.closest('.jp-OutputArea-output') && o.querySelector({_CONTROLS!r}));
  return outs.map((out, w) => {{
    out.setAttribute('data-walk-widget', String(w));
    const found = [...out.querySelectorAll({_CONTROLS!r})].filter(
      el => !el.parentElement.closest({_CONTROLS!r}));
    return found.map((el, i) => {{
      el.setAttribute('data-walk-control', w + '-' + i);
      const kind = kinds.find(([, sel]) => el.matches(sel))[0];
      // ipywidgets writes spaces as no-break spaces and an empty description as a zero-width one
      const clean = t => (t || '').replace(/\u00a0/g, ' ').replace(/\u200b/g, '').trim();
      const description = el.querySelector('.widget-label');
      const label = kind === 'play' ? 'play' : (clean(description && description.textContent)
        || clean(el.textContent) || clean(el.title) || kind);
      return {{widget: w, index: i, kind, label}};
    }});
  }});
}}"""

# What the widget shows, excluding its controls: image pixel hashes and texts.
_SNAPSHOT = f"""(w) => {{
  const root = document.querySelector('[data-walk-widget="' + w + '"]');
  const cache = window.__walkHashes = window.__walkHashes || new Map();
  let ready = true;
  const images = [], texts = [];
  for (const el of root.querySelectorAll({_DISPLAY!r})) {{
    if (el.closest({_CONTROLS!r})) continue;
    if (el.tagName !== 'IMG') {{ texts.push(el.innerText.replace(/\u00a0/g, ' ')); continue; }}
    const src = el.getAttribute('src') || '';
    if (!src) {{ images.push('empty'); continue; }}
    if (!el.complete || el.naturalWidth === 0) {{ ready = false; continue; }}
    if (!cache.has(src)) {{
      const c = document.createElement('canvas');
      c.width = el.naturalWidth; c.height = el.naturalHeight;
      const ctx = c.getContext('2d');
      ctx.drawImage(el, 0, 0);
      const px = new Uint32Array(ctx.getImageData(0, 0, c.width, c.height).data.buffer);
      let h = 0x811c9dc5;
      for (let i = 0; i < px.length; i++) {{ h ^= px[i]; h = Math.imul(h, 16777619); }}
      cache.set(src, c.width + 'x' + c.height + ':' + (h >>> 0).toString(16));
    }}
    images.push(cache.get(src));
  }}
  return {{ready, images, texts}};
}}"""

# The snapshot once the kernel is idle with nothing pending and two polls in a row agree.
_STABLE = f"""(w) => {{
  const snap = ({_SNAPSHOT})(w);
  const key = JSON.stringify(snap);
  const same = window.__walkLast === key;
  window.__walkLast = key;
  return snap.ready && same && ({SETTLED})() ? snap : false;
}}"""


def clean(text: str) -> str:
    """Text as a learner reads it: ipywidgets writes spaces as no-break spaces."""
    return text.replace("\u00a0", " ").replace("\u200b", "").strip()


@dataclass(frozen=True)
class Control:
    """One control: ``widget`` (the widget's order in the notebook), ``index`` (its order in
    the widget), ``kind`` (see CONTROL_KINDS) and ``label`` (its description or caption)."""
    widget: int
    index: int
    kind: str
    label: str

    @property
    def selector(self) -> str:
        return f'[data-walk-control="{self.widget}-{self.index}"]'


@dataclass(frozen=True)
class Outcome:
    """What one drive did: ``action`` in words, and the display before and after."""
    control: Control
    action: str
    before: dict
    after: dict

    @property
    def changed(self) -> bool:
        return (self.before["images"], self.before["texts"]) != (self.after["images"],
                                                                 self.after["texts"])

    def changed_parts(self) -> str:
        parts = []
        if self.before["images"] != self.after["images"]:
            parts.append("picture")
        if self.before["texts"] != self.after["texts"]:
            parts.append("text")
        return " and ".join(parts) or "nothing"


class WidgetDriver:
    """Drives the widgets of one notebook page; screenshots go to ``shots`` as
    ``<prefix>_w<widget>_<step>_<control>.png``."""

    def __init__(self, nb: NotebookPage, shots: Path, prefix: str) -> None:
        self.nb, self.page, self.shots, self.prefix = nb, nb.page, shots, prefix
        self.steps = 0
        self.shown: set[int] = set()     # widgets whose starting state has a screenshot

    def controls(self) -> list[list[Control]]:
        """The notebook's widgets (in notebook order), each as its list of controls."""
        return [[Control(**c) for c in widget] for widget in self.page.evaluate(_TAG)]

    def display(self, widget: int, timeout_ms: int = 120_000) -> dict:
        """The widget's display once the kernel has handled everything and it is still."""
        self.page.evaluate("() => { window.__walkLast = null; }")
        handle = self.page.wait_for_function(_STABLE, arg=widget, polling=150,
                                             timeout=timeout_ms)
        return handle.json_value()

    def screenshot(self, widget: int, name: str) -> Path:
        path = self.shots / f"{self.prefix}_w{widget}_{name}.png"
        self.page.locator(f'[data-walk-widget="{widget}"]').screenshot(path=str(path))
        return path

    def slider_value(self, control: Control) -> float:
        handle = self.page.locator(control.selector).locator(".noUi-handle").first
        return float(handle.get_attribute("aria-valuenow"))

    def drive(self, control: Control, how: str = "") -> Outcome:
        """Change ``control`` (``how``: see ``_act``), wait for the kernel, compare displays."""
        before = self.display(control.widget)
        if control.widget not in self.shown:
            self.shown.add(control.widget)
            self.screenshot(control.widget, "00_start")
        action = self._act(control, how)
        self.nb.settle()
        after = self.display(control.widget)
        self.steps += 1
        slug = re.sub(r"\W+", "-", f"{control.kind}-{control.label}-{how}".lower()).strip("-")
        self.screenshot(control.widget, f"{self.steps:02d}_{slug}")
        return Outcome(control, action, before, after)

    def _act(self, control: Control, how: str) -> str:
        """Do one learner action on ``control`` and return it in words. ``how`` by kind:
        slider "up" / "down" (one key press), "home" / "end", "" (up unless at the maximum);
        dropdown, select, radio, toggles: "" (the next option, wrapping round) or an option's
        text; checkbox, toggle, button: "" (click); play: "" (play, then pause) or "stop"."""
        el = self.page.locator(control.selector)
        if control.kind == "slider":
            handle = el.locator(".noUi-handle").first
            now = float(handle.get_attribute("aria-valuenow"))
            top = float(handle.get_attribute("aria-valuemax"))
            key = {"up": "ArrowRight", "down": "ArrowLeft", "home": "Home", "end": "End",
                   "": "ArrowRight" if now < top else "ArrowLeft"}[how]
            handle.focus()
            handle.press(key)
            return f"pressed {key} on the slider (value was {now:g})"
        if control.kind in ("dropdown", "select"):
            select = el.locator("select")
            options = [clean(t) for t in select.locator("option").all_inner_texts()]
            current = select.evaluate("s => s.selectedIndex")
            choice = how or options[(current + 1) % len(options)]
            select.select_option(index=options.index(choice))
            return f"chose {choice!r} (was {options[current]!r})"
        if control.kind in ("radio", "toggles"):
            items = el.locator("label" if control.kind == "radio" else "button")
            texts = [clean(t) for t in items.all_inner_texts()]
            active = (el.locator("input:checked").locator("xpath=..") if control.kind == "radio"
                      else el.locator("button.mod-active"))
            current = texts.index(clean(active.first.inner_text())) if active.count() else -1
            choice = how or texts[(current + 1) % len(texts)]
            items.nth(texts.index(choice)).click()
            return f"chose {choice!r}"
        if control.kind == "checkbox":
            box = el.locator("input[type=checkbox]")
            was = box.is_checked()
            box.click()
            return f"{'un' if was else ''}checked it"
        if control.kind in ("button", "toggle"):
            el.click()
            return "clicked it"
        if control.kind == "play":
            buttons = el.locator("button")
            if how == "stop":
                buttons.nth(1).click()
                return "clicked stop"
            buttons.nth(0).click()
            # Playing: the button shows pause. Pause after the first step has been sent.
            el.locator(".fa-pause").wait_for()
            self.nb.settle()
            buttons.nth(0).click()
            el.locator(".fa-play").wait_for()
            return "clicked play, then pause"
        raise ValueError(f"cannot drive a {control.kind}")
