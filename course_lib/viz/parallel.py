"""Figures and the strategy explorer of chapter 09 (context parallelism, MLA, strategy).

Numbers come from course_lib.parallel and course_lib.capacity; this module lays them out.
Functions return matplotlib Figures; :class:`StrategyExplorer` keeps its state here and shows
its figure through ``widgets.Image`` (PNG bytes), so a test can set values and check.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
from matplotlib.figure import Figure

from course_lib import capacity as cap
from course_lib.parallel.cp_decode import CPCase
from course_lib.parallel.decision_tree import Recommendation, recommend
from course_lib.parallel.deployment import DeploymentPlan, gib, plan
from course_lib.sizing.models import PRESETS, ModelSpec, get_preset
from course_lib.sizing.units import H200_MEMORY_GIB, format_bytes
from course_lib.viz.readable import EXPLORER_DPI, figure_png


def draw_cp_layout(case: CPCase, cp_size: int) -> Figure:
    """Which rank holds each token after the prompt and the decode steps of ``case``."""
    n = case.prompt_len + case.num_steps
    fig = Figure(figsize=(7.5, 0.5 + 0.45 * cp_size))
    ax = fig.add_subplot()
    for pos in range(n):
        r = case.rank_of(pos, cp_size)
        decode = pos >= case.prompt_len
        ax.add_patch(_cell(pos, cp_size - 1 - r, f"C{r}", hatch="//" if decode else None))
    ax.set(xlim=(0, n), ylim=(0, cp_size), xlabel="token position (hatched: decoded)")
    ax.set_yticks([cp_size - 1 - r + 0.5 for r in range(cp_size)],
                  [f"rank {r}" for r in range(cp_size)])
    ax.set_title(f"{case.placement} placement, CP={cp_size}", fontsize=10)
    fig.tight_layout()
    return fig


def _cell(x: float, y: float, color: str, hatch: str | None = None):
    from matplotlib.patches import Rectangle

    return Rectangle((x + 0.05, y + 0.1), 0.9, 0.8, facecolor=color, edgecolor="white",
                     hatch=hatch)


def draw_decode_flow(cp_size: int = 4, head_dim_bytes: str = "q [H, d]") -> Figure:
    """The decode step of the "Block Manager tutorial" §8 as a diagram: broadcast Q, local
    partial attention + LSE on every rank, all-reduce merge. Arrows carry what crosses the
    network."""
    from matplotlib.patches import FancyArrowPatch

    if not 1 <= cp_size <= 8:
        raise ValueError(f"cp_size must be in [1, 8] to draw, got {cp_size}")
    fig = Figure(figsize=(7.5, 0.9 + 0.55 * cp_size))
    ax = fig.add_subplot()
    ax.set_axis_off()
    ax.set(xlim=(0, 10), ylim=(-0.5, cp_size))
    ys = [cp_size - 1 - r + 0.25 for r in range(cp_size)]
    box = {"boxstyle": "round", "facecolor": "white"}
    ax.text(0.9, sum(ys) / cp_size, "new token\n(rank 0)", ha="center", va="center",
            fontsize=8, bbox={**box, "edgecolor": "C0"})
    for r, y in enumerate(ys):
        ax.text(4.6, y, f"rank {r}: attend over its tokens\n-> out_{r} [H, d], lse_{r} [H]",
                ha="center", va="center", fontsize=7.5, bbox={**box, "edgecolor": f"C{r}"})
        ax.add_patch(FancyArrowPatch((1.75, sum(ys) / cp_size), (2.9, y), arrowstyle="->",
                                     mutation_scale=10, color="C0"))
        ax.add_patch(FancyArrowPatch((6.3, y), (7.6, sum(ys) / cp_size), arrowstyle="->",
                                     mutation_scale=10, color="C2"))
    ax.text(8.7, sum(ys) / cp_size, "merge\nw_r = exp(lse_r - lse)\nout = sum w_r out_r",
            ha="center", va="center", fontsize=8, bbox={**box, "edgecolor": "C2"})
    ax.text(2.3, -0.35, f"1. broadcast {head_dim_bytes}", ha="center", fontsize=8, color="C0")
    ax.text(4.6, -0.35, "2. local partial attention", ha="center", fontsize=8)
    ax.text(7.0, -0.35, "3. all-reduce (max, sums)", ha="center", fontsize=8, color="C2")
    fig.tight_layout()
    return fig


def draw_move_q_vs_kv(spec: ModelSpec, context_lens: list[int], cp_size: int) -> Figure:
    """Bytes per layer of one decode step: query + partial results vs shipping remote KV."""
    if not context_lens:
        raise ValueError("context_lens must hold at least one context length")
    comms = [cap.decode_comm_bytes(spec, n, cp_size) for n in context_lens]
    fig = Figure(figsize=(7.5, 3.2))
    ax = fig.add_subplot()
    xs = range(len(context_lens))
    q = [c.query_bytes + c.partial_output_bytes for c in comms]
    kv = [c.move_kv_bytes for c in comms]
    ax.bar([x - 0.2 for x in xs], q, width=0.4, color="C0", label="move Q (+ partials back)")
    ax.bar([x + 0.2 for x in xs], kv, width=0.4, color="C3", label="move KV")
    for x, a, b in zip(xs, q, kv, strict=True):
        ax.annotate(format_bytes(a), (x - 0.2, a), ha="center", va="bottom", fontsize=7)
        ax.annotate(format_bytes(b), (x + 0.2, b), ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(list(xs), [f"{n:,}" for n in context_lens])
    ax.set(xlabel="context length (tokens)", ylabel="bytes per layer (log)")
    ax.set_ylim(bottom=min(q) / 10, top=max(kv) * 20)
    ax.set_title(f"{spec.name}, CP={cp_size}: one decode step, one layer", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def draw_plan(p: DeploymentPlan, context_len: int, label: str = "") -> Figure:
    """Tokens per GPU, longest single request and the target context, on one axis; ``label``
    starts the title. A request longer than the model's context is drawn red."""
    if isinstance(context_len, bool) or not isinstance(context_len, int) or context_len < 1:
        raise ValueError(f"context_len must be an integer >= 1, got {context_len!r}")
    fig = Figure(figsize=(7.5, 2.8))
    ax = fig.add_subplot()
    labels = ["tokens per GPU", f"longest request (x CP={p.context_parallel_size})",
              "tokens, all GPUs"]
    values = [p.tokens_per_gpu, p.max_request_tokens, p.total_tokens]
    fits = p.max_request_tokens >= context_len
    bars = ax.barh(labels, values, color=["C0", "C2" if fits else "C3", "C7"])
    for bar, v in zip(bars, values, strict=True):
        ax.annotate(f" {v:,}", (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                    va="center", fontsize=9.5)
    limit = p.model.max_position_embeddings
    beyond = 0 < limit < context_len
    ax.axvline(context_len, color="C3" if beyond else "k", linestyle="--", linewidth=1,
               label=f"request: {context_len:,} tokens"
                     + (f" > the model's context ({limit:,})" if beyond else ""))
    ax.legend(fontsize=9.5, loc="lower right")
    ax.set_xlim(0, max(*values, context_len) * 1.35)
    ax.xaxis.set_major_formatter(_tokens)
    verdict = ("fits" if fits else "does NOT fit") + (
        " in memory,\nbut vLLM refuses the request: it is longer than the model's context"
        if beyond else "")
    ax.set_title(f"{label}{p.model.name}: {p.num_gpus} GPU(s), TP={p.tensor_parallel_size}, "
                 f"CP={p.context_parallel_size}: {verdict}", fontsize=10,
                 color="C3" if beyond else "k")
    ax.tick_params(axis="y", labelsize=9.5)
    fig.tight_layout()
    return fig


def _tokens(value: float, _pos: object = None) -> str:
    """A tick label: 750K, 1.5M."""
    if abs(value) >= 1e6:
        return f"{value / 1e6:g}M"
    return f"{value / 1e3:g}K" if abs(value) >= 1e3 else f"{value:g}"


GPU_MEMORY_GIB = (24, 40, 48, 80, H200_MEMORY_GIB)   # H200: nvidia-smi's 143,771 MiB
CONTEXT_LENS = (4_096, 32_768, 131_072, 200_000, 1_000_000, 2_000_000)
NUM_GPUS = (1, 2, 4, 8, 16)
CP_SIZES = (1, 2, 4, 8)
UTIL_RANGE = (0.8, 0.95)


class StrategyExplorer:
    """Pick a model, GPU memory, GPUs, TP, CP, utilization and a request length; see the plan.

    State: ``plan`` (a :class:`~course_lib.parallel.deployment.DeploymentPlan`, or None with
    ``error`` set when the weights do not fit), ``recommendation`` (the decision tree's
    answer for the same model, memory and request), ``text`` and ``png`` (what is shown).
    CP is the article's (extra GPUs). A request longer than the model's context
    (``ModelSpec.max_position_embeddings``) is flagged in the figure and the text: vLLM would
    refuse it, so the plans only answer the memory question.
    """

    def __init__(self, model: str = "deepseek-v3",
                 gpu_memory_gib: float = H200_MEMORY_GIB,
                 num_gpus: int = 8, tp: int = 1, cp: int = 4, gpu_memory_utilization: float = 0.9,
                 context_len: int = 1_000_000) -> None:
        spec = get_preset(model)
        # a dropdown refuses a value it does not list with a TraitError naming no argument,
        # and a slider clamps silently: check each start value against its widget's choices
        for name, value, options in (
                ("gpu_memory_gib", gpu_memory_gib, GPU_MEMORY_GIB),
                ("num_gpus", num_gpus, NUM_GPUS), ("tp", tp, self._tp_options(spec)),
                ("cp", cp, CP_SIZES), ("context_len", context_len, CONTEXT_LENS)):
            if isinstance(value, bool) or value not in options:
                raise ValueError(f"{name} must be one of {list(options)}, got {value!r}")
        if isinstance(gpu_memory_utilization, bool) \
                or not isinstance(gpu_memory_utilization, (int, float)) \
                or not UTIL_RANGE[0] <= gpu_memory_utilization <= UTIL_RANGE[1]:
            raise ValueError(f"gpu_memory_utilization must be in [{UTIL_RANGE[0]}, "
                             f"{UTIL_RANGE[1]}] (the slider's range), got "
                             f"{gpu_memory_utilization!r}")
        self.model = widgets.Dropdown(options=[(s.name, k) for k, s in PRESETS.items()],
                                      value=model.lower(), description="model")
        self.memory = widgets.Dropdown(options=[(gib(g), g) for g in GPU_MEMORY_GIB],
                                       value=gpu_memory_gib, description="GPU GiB")
        self.gpus = widgets.Dropdown(options=NUM_GPUS, value=num_gpus,
                                     description="GPUs")
        self.tp = widgets.Dropdown(options=self._tp_options(spec), value=tp, description="TP")
        self.cp = widgets.Dropdown(options=CP_SIZES, value=cp, description="CP")
        self.util = widgets.FloatSlider(value=gpu_memory_utilization, min=UTIL_RANGE[0],
                                        max=UTIL_RANGE[1],
                                        step=0.05, description="utilization")
        self.context = widgets.Dropdown(options=CONTEXT_LENS, value=context_len,
                                        description="request")
        self.image = widgets.Image(format="png")
        self.html = widgets.HTML()
        self.plan: DeploymentPlan | None = None
        self.error: str | None = None
        self.recommendation: Recommendation | None = None
        self.text, self.png = "", b""
        for w in (self.model, self.memory, self.gpus, self.tp, self.cp, self.util, self.context):
            w.observe(self._changed, names="value")
        self.render()

    @staticmethod
    def _tp_options(spec: ModelSpec) -> list[int]:
        return [t for t in cap.valid_tp_sizes(spec) if t in (1, 2, 4, 8)]   # vLLM's rule

    def _changed(self, change: dict) -> None:
        if change["owner"] is self.model:
            options = self._tp_options(get_preset(self.model.value))
            keep = self.tp.value if self.tp.value in options else options[0]
            with self.tp.hold_trait_notifications():
                self.tp.options = options
                self.tp.value = keep
        self.render()

    def render(self) -> None:
        spec = get_preset(self.model.value)
        try:
            self.plan = plan(spec, self.memory.value, self.tp.value, self.cp.value,
                                      gpu_memory_utilization=round(self.util.value, 2),
                                      num_gpus=self.gpus.value)
            self.error = None
        except ValueError as exc:
            self.plan, self.error = None, str(exc)
        self.recommendation = recommend(spec, self.context.value, self.memory.value,
                                                 max_gpus=self.gpus.value)
        if self.plan is not None:
            fig = draw_plan(self.plan, self.context.value, "your plan: ")
            self.text = "your plan: " + self.plan.summary()
        else:
            fig = Figure(figsize=(7.5, 1.2))
            fig.text(0.5, 0.5, "no plan: " + (self.error or "")[:90], ha="center",
                     color="C3", fontsize=10)
            self.text = f"your plan does not fit: {self.error}"
        self.text += (f"\n\nrecommended by the decision tree for a {self.context.value:,}-token "
                      f"request:\n{self.recommendation}")
        self.png = figure_png(fig, EXPLORER_DPI)
        self.image.value = self.png
        self.html.value = f"<pre style='font-size:11px'>{html.escape(self.text)}</pre>"

    def widget(self) -> widgets.Widget:
        controls = widgets.VBox([self.model, self.memory, self.gpus, self.tp, self.cp, self.util,
                                 self.context])
        return widgets.VBox([controls, self.image, self.html])
