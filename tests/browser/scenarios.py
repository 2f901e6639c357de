"""What to do with each chapter's widgets, where driving each control once is not enough.

By default every control of every widget is driven once (``Step(label)`` with no ``how``: a
slider moves one notch, a dropdown takes its next option, a checkbox or button is clicked) and
the widget's display must change. A chapter listed in ``SCENARIOS`` runs its steps first, in
order; controls no step names are then driven the default way. Steps name controls by a
case-insensitive part of their label and check behaviour, never a particular step number or
picture: whatever state the notebook leaves a widget in, the same steps must pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from widget_driver import Control, WidgetDriver, clean


@dataclass(frozen=True)
class Step:
    """One learner action. ``label``: part of the control's label ("play" for a Play widget);
    ``how``: see ``WidgetDriver._act``; ``expect``: the display must change (True), must not
    (False) or either (None); ``moves``: (slider label, amount) the action must move that slider
    by; ``names_choice_of``: a dropdown whose chosen option the display must then mention."""
    label: str
    how: str = ""
    expect: bool | None = True
    moves: tuple[str, float] | None = None
    names_choice_of: str | None = None


SCENARIOS: dict[str, list[Step]] = {
    # Block-table explorer: a step slider with prev / next buttons and a Play widget. Start from
    # step 0 so that prev and next both have somewhere to go.
    "03": [Step("step", "home", expect=None),
           Step("next", moves=("step", 1)),
           Step("next", moves=("step", 1)),
           Step("prev", moves=("step", -1)),
           Step("step", "up", moves=("step", 1)),
           Step("play"),
           Step("play", "stop")],
    # Prefix-cache explorer: the prompt dropdown and the "keep running" box only choose what
    # the next submit does, so they are checked through it.
    "06": [Step("submit"),
           Step("prompt", expect=None),
           Step("keep running", expect=None),
           Step("submit", names_choice_of="prompt"),
           Step("finish oldest"),
           Step("reset prefix cache")],
    # Hybrid block tables (14): the same step controls as chapter 03's explorer, so the same
    # start from step 0 (prev at step 0 would change nothing).
    "14": [Step("step", "home", expect=None),
           Step("next", moves=("step", 1)),
           Step("next", moves=("step", 1)),
           Step("prev", moves=("step", -1)),
           Step("step", "up", moves=("step", 1)),
           Step("play"),
           Step("play", "stop")],
}


def find(controls: list[Control], label: str) -> Control:
    """The control labelled ``label``, else the one whose label contains it (ignoring case)."""
    hits = [c for c in controls if label.lower() == c.label.lower()]
    hits = hits or [c for c in controls if label.lower() in c.label.lower()]
    if len(hits) != 1:
        raise LookupError(f"{len(hits)} controls match {label!r}: "
                          f"{[c.label for c in controls]}")
    return hits[0]


def drive_widgets(driver: WidgetDriver, steps: list[Step]) -> tuple[list[str], list[str]]:
    """Run ``steps``, then drive every control they did not name once; returns (what was done,
    what went wrong), one line each."""
    controls = [c for widget in driver.controls() for c in widget]
    done: list[str] = []
    failures: list[str] = []
    named: set[Control] = set()
    plan: list[tuple[Control, Step]] = []
    for step in steps:
        try:
            control = find(controls, step.label)
        except LookupError as exc:
            failures.append(f"step {step}: {exc}")
            continue
        named.add(control)
        plan.append((control, step))
    plan += [(c, Step(c.label)) for c in controls if c not in named]
    for control, step in plan:
        moved = find(controls, step.moves[0]) if step.moves else None
        start = driver.slider_value(moved) if moved else 0.0
        outcome = driver.drive(control, step.how)
        line = (f"widget {control.widget} {control.kind} {control.label!r}: {outcome.action}"
                f" -> {outcome.changed_parts()} changed")
        done.append(line)
        if step.expect is not None and outcome.changed != step.expect:
            failures.append(line + (" (expected a change)" if step.expect
                                    else " (expected no change)"))
        if moved is not None and driver.slider_value(moved) != start + step.moves[1]:
            failures.append(f"{line}: slider {moved.label!r} went from {start:g} to "
                            f"{driver.slider_value(moved):g}, expected {step.moves[1]:+g}")
        if step.names_choice_of:
            choice = clean(driver.page.locator(find(controls, step.names_choice_of).selector)
                           .locator("select option:checked").inner_text())
            if not any(choice in text for text in outcome.after["texts"]):
                failures.append(f"{line}: the display does not name the chosen {choice!r}")
    return done, failures
