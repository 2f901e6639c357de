"""The frame of a step-by-step explorer: play, ◀ prev, a step slider and next ▶, then a
caption and a picture.

Chapter 03's block-table explorer and chapter 14's hybrid-tables explorer both replay a
scenario up to a chosen step; this is the frame they share. The explorer redraws (fills
``caption`` and ``image``) in ``on_change`` whenever the step moves (slider, play, buttons or
:meth:`StepControls.set_step`).
"""

from __future__ import annotations

from collections.abc import Callable

import ipywidgets as widgets


class StepControls:
    """Steps ``0 .. last``; ``widget`` is the frame to show (the row of controls, ``caption``,
    ``image``), ``step.value`` the step shown."""

    def __init__(self, last: int, on_change: Callable[[], None]) -> None:
        self.step = widgets.IntSlider(value=0, min=0, max=last, description="step",
                                      continuous_update=False)
        self.play = widgets.Play(value=0, min=0, max=last, interval=1500, description="play")
        widgets.jslink((self.play, "value"), (self.step, "value"))
        self.prev_button = widgets.Button(description="◀ prev", layout={"width": "80px"})
        self.next_button = widgets.Button(description="next ▶", layout={"width": "80px"})
        self.prev_button.on_click(lambda _: self.set_step(max(0, self.step.value - 1)))
        self.next_button.on_click(lambda _: self.set_step(min(last, self.step.value + 1)))
        self.step.observe(lambda change: on_change(), names="value")
        self.caption = widgets.HTML()
        self.image = widgets.Image(format="png")
        self.widget = widgets.VBox([
            widgets.HBox([self.play, self.prev_button, self.step, self.next_button]),
            self.caption, self.image])

    def set_step(self, k: int) -> None:
        """Show step ``k`` (``ValueError`` outside ``[0, last]``)."""
        if not 0 <= k <= self.step.max:
            raise ValueError(f"step must be in [0, {self.step.max}], got {k}")
        self.step.value = k     # the observer redraws (a no-op when k is already shown)
