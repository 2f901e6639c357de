"""Chapter 12's drawings: the paper's / vLLM V0's design beside vLLM V1's on one trace.

* :func:`compare_designs`: replay one trace through both schedulers (model-free, the cost
  model of chapter 07) and return the two results.
* :func:`draw_designs`: blocks held, preemptions and block sharing over time, one line each.
* :class:`DesignExplorer`: the same, with sliders for the pool, ``n`` and prefix caching.
* :func:`draw_free_queue`: a ``BlockPool``'s free-block queue, front to back.
"""

from __future__ import annotations

import html
from itertools import accumulate

import ipywidgets as widgets
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..config import CacheConfig, SchedulerConfig
from ..memory.v1.block_pool import BlockPool
from ..sim.replay import ReplayResult, replay
from ..sim.traces import sharegpt_like, with_parallel_sampling
from ..sizing.units import check_int
from .readable import EXPLORER_DPI, MAX_WIDTH_IN, figure_png

LABELS = {"v0": "V0 (paper): CoW + swap", "v1": "V1 (vLLM today): child requests + cache"}


def compare_designs(num_requests: int = 60, n: int = 2, num_gpu_blocks: int = 600,
                    prefix_caching: bool = True, seed: int = 0) -> dict[str, ReplayResult]:
    """One ShareGPT-like trace (``n`` samples per request) through both designs, the same
    pool and budgets; V0 preempts by swap (its default for n > 1 in vLLM V0), V1 by
    recompute (its only mode)."""
    check_int("num_requests", num_requests, 1)
    check_int("n", n, 1)
    trace = sharegpt_like(num_requests, seed=seed)
    if n > 1:
        trace = with_parallel_sampling(trace, n)
    out = {}
    for design, mode in (("v0", "swap"), ("v1", "recompute")):
        cc = CacheConfig(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_gpu_blocks,
                         watermark=0.0, enable_prefix_caching=prefix_caching)
        out[design] = replay(trace, SchedulerConfig(preemption_mode=mode), cc, design=design)
    return out


def draw_designs(results: dict[str, ReplayResult]) -> Figure:
    fig = Figure(figsize=(MAX_WIDTH_IN, 3.8))
    axes = fig.subplots(1, 3)
    for design, r in results.items():
        t = [s.time for s in r.steps]
        label = LABELS.get(design, design)
        axes[0].plot(t, [100 * s.gpu_block_usage for s in r.steps], lw=0.8, label=label)
        axes[1].plot(t, list(accumulate(s.num_preempted for s in r.steps)), lw=1.0, label=label)
        axes[2].plot(t, [100 * s.sharing_saving for s in r.steps], lw=0.8, label=label)
    axes[0].set(xlabel="simulated time (s)", ylabel="% of GPU blocks held", ylim=(0, 105),
                title="KV usage")
    axes[1].set(xlabel="simulated time (s)", ylabel="preemptions so far", title="preemptions")
    axes[2].set(xlabel="simulated time (s)", ylabel="% of table entries shared",
                title="blocks shared (CoW or cache hits)")
    for ax in axes:
        ax.tick_params(labelsize=9)
        ax.title.set_fontsize(10)
        ax.xaxis.label.set_fontsize(9.5)
        ax.yaxis.label.set_fontsize(9.5)
    fig.legend(*axes[0].get_legend_handles_labels(), fontsize=9, loc="lower center", ncols=2)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    return fig


def summary_rows(results: dict[str, ReplayResult]) -> list[str]:
    rows = [f"{'design':42} {'tok/s':>7} {'preempt':>8} {'swapped GB':>10} {'hit rate':>8}"]
    for design, r in results.items():
        rows.append(f"{LABELS.get(design, design):42} {r.throughput_tokens_s:7.0f} "
                    f"{r.num_preemptions:8d} {r.swapped_bytes / 1e9:10.2f} "
                    f"{r.prefix_cache_hit_rate:8.1%}")
    return rows


class DesignExplorer:
    """Sliders for the pool size and ``n``, a prefix-caching switch; both designs redrawn."""

    def __init__(self, num_requests: int = 40) -> None:
        check_int("num_requests", num_requests, 1)
        self.num_requests = num_requests
        style = {"description_width": "120px"}
        self.blocks = widgets.IntSlider(600, min=200, max=2000, step=100,
                                        description="GPU blocks", style=style)
        self.n = widgets.IntSlider(2, min=1, max=4, description="samples n", style=style)
        self.caching = widgets.Checkbox(True, description="prefix caching")
        self.image, self.text = widgets.Image(format="png"), widgets.HTML()
        for w in (self.blocks, self.n, self.caching):
            w.observe(lambda _: self.show(), names="value")
        self.widget = widgets.VBox([widgets.HBox([self.blocks, self.n, self.caching]),
                                    self.image, self.text])
        self.show()

    def show(self) -> None:
        results = compare_designs(self.num_requests, self.n.value, self.blocks.value,
                                  self.caching.value)
        self.image.value = figure_png(draw_designs(results), EXPLORER_DPI)
        self.text.value = f"<pre>{html.escape(chr(10).join(summary_rows(results)))}</pre>"


def draw_free_queue(pool: BlockPool, title: str = "") -> Figure:
    """The free-block queue front (popped first) to back; cached blocks shaded."""
    queue = pool.free_block_queue.get_all_free_blocks()
    fig = Figure(figsize=(max(4, 0.55 * len(queue) + 1), 1.1))
    ax = fig.subplots()
    for i, block in enumerate(queue):
        cached = block.block_hash is not None
        ax.add_patch(Rectangle((i, 0), 0.9, 0.9, facecolor="#bbbbbb" if cached else "white",
                               edgecolor="black"))
        ax.text(i + 0.45, 0.45, str(block.block_id), ha="center", va="center", fontsize=9)
    ax.set_xlim(-0.2, max(1, len(queue)) + 0.2)
    ax.set_ylim(-0.1, 1.0)
    ax.axis("off")
    ax.set_title(title or "free queue: front (next popped) on the left; grey = cached",
                 fontsize=9)
    return fig
