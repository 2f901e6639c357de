"""Chapter 08's capacity explorer: a widget over one GPU's KV-cache plan.

``ExplorerState`` holds the inputs (model preset, GPU memory, utilization, TP, block_size,
max_model_len) and turns them into a ``course_lib.capacity.KVBudget``, a summary worded like
vLLM's startup log and a budget bar (``draw_explorer_state``); ``CapacityExplorer`` puts
dropdowns and sliders over that state and shows the picture as PNG bytes
(``course_lib.viz.readable.figure_png``).
"""

from __future__ import annotations

import html
from dataclasses import dataclass, replace

import ipywidgets as widgets
from matplotlib.figure import Figure

from course_lib import capacity as cap
from course_lib.sizing.models import PRESETS, get_preset, verify_max_model_len
from course_lib.sizing.units import GiB
from course_lib.viz.capacity_planning import draw_memory_budget
from course_lib.viz.readable import EXPLORER_DPI, figure_png


@dataclass(frozen=True)
class ExplorerState:
    """The explorer's inputs; plan() turns them into a KVBudget (or an error to show)."""

    preset: str = "llama-3-8b"
    total_gpu_memory_gib: float = 80.0
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    block_size: int = 16
    max_model_len: int = 8192

    def plan(self) -> cap.KVBudget:
        return cap.plan_kv_cache(get_preset(self.preset), self.total_gpu_memory_gib,
                                 gpu_memory_utilization=self.gpu_memory_utilization,
                                 block_size=self.block_size,
                                 tensor_parallel_size=self.tensor_parallel_size)

    def max_model_len_warning(self) -> str:
        """'' when vLLM accepts max_model_len for this model; otherwise why it refuses
        (course_lib.sizing.models.verify_max_model_len)."""
        try:
            verify_max_model_len(get_preset(self.preset), self.max_model_len)
        except ValueError as exc:
            return f"warning: {exc}"
        return ""

    def summary(self) -> str:
        """vLLM-style sizing lines, or the library's error when the model does not fit; a
        last line warns when max_model_len is longer than the model allows."""
        try:
            text = self.plan().summary(self.max_model_len)
        except ValueError as exc:
            text = f"does not start: {exc}"
        warning = self.max_model_len_warning()
        return f"{text}\n{warning}" if warning else text


def draw_explorer_state(state: ExplorerState) -> Figure:
    """The state's stacked budget bar; when the model does not fit, weights vs usable memory."""
    try:
        budget = state.plan()
    except ValueError:
        spec = get_preset(state.preset)
        usable = state.total_gpu_memory_gib * state.gpu_memory_utilization
        fig = Figure(figsize=(7.5, 2.1))
        ax = fig.add_subplot()
        ax.barh(["weights per GPU", "usable"],
                [spec.weight_bytes / state.tensor_parallel_size / GiB, usable],
                color=["C3", "C0"])
        ax.set_xlabel("GiB")
        ax.set_title(f"{spec.name} at TP={state.tensor_parallel_size} does not fit", fontsize=10)
        fig.tight_layout()
        return fig
    return draw_memory_budget([(f"{budget.model.name} TP={state.tensor_parallel_size}", budget)])


BLOCK_SIZES = (8, 16, 32)
MAX_MODEL_LENS = (2048, 4096, 8192, 32768, 131072)
MEMORY_GIB_RANGE = (16, 192)
UTILIZATION_RANGE = (0.5, 1.0)


class CapacityExplorer:
    """Dropdown and sliders over ExplorerState; the picture is a widgets.Image (PNG bytes).

    All state lives in self.state; widget callbacks only replace it and redraw, so a test can
    set a slider's value and read state, summary.value and image.value back.
    """

    def __init__(self, state: ExplorerState | None = None) -> None:
        self.state = state or ExplorerState()
        get_preset(self.state.preset)            # ValueError listing the presets
        # a dropdown refuses a value it does not list (a TraitError naming no argument) and a
        # slider clamps silently: each start value must be one its widget can show
        s = self.state
        for name, value, options in (
                ("tensor_parallel_size", s.tensor_parallel_size, self._tp_options(s.preset)),
                ("block_size", s.block_size, BLOCK_SIZES),
                ("max_model_len", s.max_model_len, MAX_MODEL_LENS)):
            if isinstance(value, bool) or value not in options:
                raise ValueError(f"{name} must be one of {list(options)}, got {value!r}")
        for name, value, (low, high) in (
                ("total_gpu_memory_gib", s.total_gpu_memory_gib, MEMORY_GIB_RANGE),
                ("gpu_memory_utilization", s.gpu_memory_utilization, UTILIZATION_RANGE)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not low <= value <= high:
                raise ValueError(f"{name} must be in [{low}, {high}] (the slider's range), "
                                 f"got {value!r}")
        self.preset = widgets.Dropdown(options=[(s.name, k) for k, s in PRESETS.items()],
                                       value=self.state.preset, description="model")
        self.memory = widgets.IntSlider(value=int(self.state.total_gpu_memory_gib),
                                        min=MEMORY_GIB_RANGE[0], max=MEMORY_GIB_RANGE[1],
                                        step=8, description="GPU GiB")
        self.utilization = widgets.FloatSlider(value=self.state.gpu_memory_utilization,
                                               min=UTILIZATION_RANGE[0],
                                               max=UTILIZATION_RANGE[1], step=0.01,
                                               description="utilization")
        self.tp = widgets.Dropdown(options=self._tp_options(self.state.preset),
                                   value=self.state.tensor_parallel_size, description="TP")
        self.block_size = widgets.Dropdown(options=list(BLOCK_SIZES), value=self.state.block_size,
                                           description="block_size")
        self.max_model_len = widgets.Dropdown(options=list(MAX_MODEL_LENS),
                                              value=self.state.max_model_len,
                                              description="max_model_len")
        self.image = widgets.Image(format="png")
        self.summary = widgets.HTML()
        for w in (self.preset, self.memory, self.utilization, self.tp, self.block_size,
                  self.max_model_len):
            w.observe(self._on_change, names="value")
        self.widget = widgets.VBox([
            widgets.HBox([self.preset, self.tp, self.block_size]),
            widgets.HBox([self.memory, self.utilization, self.max_model_len]),
            self.image, self.summary])
        self._redraw()

    @staticmethod
    def _tp_options(preset: str) -> list[int]:
        return [t for t in cap.valid_tp_sizes(get_preset(preset)) if t <= 16]

    def _on_change(self, change: dict) -> None:
        if change["owner"] is self.preset:
            options = self._tp_options(self.preset.value)
            tp = self.tp.value if self.tp.value in options else 1
            self.tp.unobserve(self._on_change, names="value")
            self.tp.options, self.tp.value = options, tp
            self.tp.observe(self._on_change, names="value")
        self.state = replace(self.state, preset=self.preset.value,
                             total_gpu_memory_gib=float(self.memory.value),
                             gpu_memory_utilization=round(self.utilization.value, 2),
                             tensor_parallel_size=self.tp.value,
                             block_size=self.block_size.value,
                             max_model_len=self.max_model_len.value)
        self._redraw()

    def _redraw(self) -> None:
        self.image.value = figure_png(draw_explorer_state(self.state), EXPLORER_DPI)
        self.summary.value = f"<pre>{html.escape(self.state.summary())}</pre>"
