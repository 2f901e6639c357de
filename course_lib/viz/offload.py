"""Chapter 13's CPU tier widget: where a chat's prompt tokens come from as the GPU pool
shrinks, with and without a CPU offload tier.

* :func:`draw_offload_sweep`: for one tier size, the share of prompt tokens the GPU prefix
  cache found and the share the tier loaded (stacked) against the GPU pool's size, the run
  without a tier beside them; and the prompt tokens computed (prefill) by each.
* :func:`sweep_table`: the same rows as text.
* :class:`OffloadExplorer`: the drawing with a dropdown for the tier size.

The rows are those of :func:`course_lib.engine.offload_study.sweep` (any with the fields of
its :class:`~course_lib.engine.offload_study.OffloadRow` that are read here: ``gpu_blocks``,
``cpu_blocks``, ``gpu_hit_rate``, ``cpu_hit_rate``, ``prefill_tokens``, ``same_tokens``);
``cpu_blocks`` 0 is the run without a tier.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import ipywidgets as widgets
from matplotlib.figure import Figure

from .readable import EXPLORER_DPI, MAX_WIDTH_IN, figure_png


def tier_sizes(rows: Sequence[Any]) -> list[int]:
    """The tier sizes the rows were run with (0, no tier, left out), smallest first."""
    return sorted({r.cpu_blocks for r in rows} - {0})


def _by_gpu(rows: Sequence[Any], num_cpu_blocks: int) -> list[Any]:
    """The rows of one tier size, largest GPU pool first (the x axis shrinks to the right)."""
    return sorted((r for r in rows if r.cpu_blocks == num_cpu_blocks),
                  key=lambda r: -r.gpu_blocks)


def _check(rows: Sequence[Any], num_cpu_blocks: int) -> None:
    sizes = tier_sizes(rows)
    if num_cpu_blocks not in sizes:
        raise ValueError(f"no rows with a tier of {num_cpu_blocks!r} blocks; the rows have "
                         f"tiers of {sizes}")
    if not _by_gpu(rows, 0):
        raise ValueError("the rows need the runs without a tier (cpu_blocks 0)")


def draw_offload_sweep(rows: Sequence[Any], num_cpu_blocks: int) -> Figure:
    """Left: % of prompt tokens found on the GPU and loaded from a tier of ``num_cpu_blocks``
    blocks (stacked bars), and the GPU hit rate without a tier (a line), at each GPU pool size
    (largest on the left). Right: prompt tokens computed, without and with the tier."""
    _check(rows, num_cpu_blocks)
    tier, plain = _by_gpu(rows, num_cpu_blocks), {r.gpu_blocks: r for r in _by_gpu(rows, 0)}
    x = list(range(len(tier)))
    labels = [str(r.gpu_blocks) for r in tier]
    fig = Figure(figsize=(MAX_WIDTH_IN, 3.6))
    left, right = fig.subplots(1, 2)
    gpu = [100 * r.gpu_hit_rate for r in tier]
    cpu = [100 * r.cpu_hit_rate for r in tier]
    left.bar(x, gpu, 0.6, color="#4c78a8", label="found in the GPU pool")
    left.bar(x, cpu, 0.6, bottom=gpu, color="#f58518",
             label=f"loaded from the CPU tier ({num_cpu_blocks} blocks)")
    left.plot(x, [100 * plain[r.gpu_blocks].gpu_hit_rate for r in tier], "k--o", ms=4,
              label="GPU hits without a tier")
    left.set(xticks=x, xticklabels=labels, xlabel="GPU pool (blocks)", ylim=(0, 100),
             ylabel="% of prompt tokens looked up", title="where a prompt's tokens came from")
    width = 0.38
    right.bar([i - width / 2 for i in x], [plain[r.gpu_blocks].prefill_tokens for r in tier],
              width, color="#bbbbbb", label="no tier")
    right.bar([i + width / 2 for i in x], [r.prefill_tokens for r in tier], width,
              color="#f58518", label=f"tier of {num_cpu_blocks} blocks")
    right.set(xticks=x, xticklabels=labels, xlabel="GPU pool (blocks)",
              ylabel="prompt tokens computed", title="prefill work")
    for ax in (left, right):
        ax.tick_params(labelsize=9)
        ax.title.set_fontsize(10)
        ax.xaxis.label.set_fontsize(9.5)
        ax.yaxis.label.set_fontsize(9.5)
        ax.legend(fontsize=9, loc="upper left")
    fig.tight_layout()
    return fig


def sweep_table(rows: Sequence[Any]) -> str:
    """The rows as a text table, one line per run, GPU pool sizes largest first."""
    lines = [f"{'GPU blocks':>10} {'tier blocks':>11} {'GPU hits':>9} {'tier hits':>9} "
             f"{'computed':>9} {'same tokens':>11}"]
    for r in sorted(rows, key=lambda r: (-r.gpu_blocks, r.cpu_blocks)):
        tier = "-" if r.cpu_hit_rate is None else f"{r.cpu_hit_rate:.1%}"
        lines.append(f"{r.gpu_blocks:>10} {r.cpu_blocks or '-':>11} "
                     f"{r.gpu_hit_rate:>9.1%} {tier:>9} {r.prefill_tokens:>9} "
                     f"{'yes' if r.same_tokens else 'NO':>11}")
    return "\n".join(lines)


class OffloadExplorer:
    """:func:`draw_offload_sweep` of precomputed ``rows``, with a dropdown for the tier size
    (nothing is run when it changes: the sweep is run once, by the caller)."""

    def __init__(self, rows: Sequence[Any], num_cpu_blocks: int | None = None) -> None:
        self.rows = list(rows)
        sizes = tier_sizes(self.rows)
        if not sizes:
            raise ValueError("the rows need runs with a tier (cpu_blocks > 0)")
        if num_cpu_blocks is not None:
            _check(self.rows, num_cpu_blocks)
        self.tier = widgets.Dropdown(options=[(f"{n} blocks", n) for n in sizes],
                                     value=sizes[-1] if num_cpu_blocks is None
                                     else num_cpu_blocks,
                                     description="CPU tier", style={"description_width": "80px"})
        self.image, self.text = widgets.Image(format="png"), widgets.HTML()
        self.tier.observe(lambda _: self.show(), names="value")
        self.widget = widgets.VBox([self.tier, self.image, self.text])
        self.show()

    def show(self) -> None:
        n = self.tier.value
        self.image.value = figure_png(draw_offload_sweep(self.rows, n), EXPLORER_DPI)
        tier = _by_gpu(self.rows, n)
        saved = [self._plain(r).prefill_tokens - r.prefill_tokens for r in tier]
        self.text.value = html.escape(
            f"CPU tier of {n} blocks: prefill tokens saved per GPU pool size "
            + ", ".join(f"{r.gpu_blocks} blocks: {s}" for r, s in zip(tier, saved,
                                                                           strict=True)))

    def _plain(self, row: Any) -> Any:
        return next(r for r in self.rows
                    if r.cpu_blocks == 0 and r.gpu_blocks == row.gpu_blocks)
