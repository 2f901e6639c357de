"""Chapter 07's pictures: who runs in each step, batch and KV usage over time, preemption cost.

* :func:`draw_timeline`: one row per request, one column per step: prefill chunks (light,
  labelled with their token count), decodes (dark), preemptions (red x, "S" for swap).
* :class:`TimelineExplorer`: a step slider over a replay's timeline; the picture is a
  ``widgets.Image`` (PNG bytes) and the step's batch is spelled out below it.
* :func:`draw_replay`: batch size and KV-cache usage over simulated time.
* :func:`draw_preemption_costs`: recompute vs swap time as block size and length change.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import ipywidgets as widgets
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..sim.replay import PreemptionCost, ReplayResult, StepRecord
from .readable import EXPLORER_DPI, MAX_WIDTH_IN, MIN_FONT_PT, figure_png, text_width_in

PREFILL, DECODE, PREEMPT = "#9ecae1", "#08519c", "#d62728"


def describe_step(steps: Sequence[StepRecord], index: int) -> str:
    """One line per kind of work in step ``index`` (steps must have been recorded with
    ``record_batches=True``)."""
    if not 0 <= index < len(steps):
        raise ValueError(f"step must be in [0, {len(steps)}), got {index}")
    s = steps[index]
    prefill = [f"r{rid} ({n} tok)" for rid, n, is_prefill in s.batch if is_prefill]
    decode = sorted({f"r{rid}" for rid, _, is_prefill in s.batch if not is_prefill},
                    key=lambda r: int(r[1:]))
    lines = [f"step {index}: {len(s.batch)} sequences, "
             f"{s.num_prefill_tokens + s.num_decode_tokens} tokens, KV blocks "
             f"{100 * s.gpu_block_usage:.0f}% used",
             f"  prefill: {', '.join(prefill) or '-'}",
             f"  decode:  {', '.join(decode) or '-'}"]
    if s.preempted:
        lines.append("  preempted: " + ", ".join(f"r{rid} ({mode})" for rid, mode in s.preempted))
    lines.append(f"  queues after: {s.num_running} running, {s.num_waiting} waiting, "
                 f"{s.num_swapped} swapped")
    return "\n".join(lines)


def draw_timeline(steps: Sequence[StepRecord], current: int | None = None,
                  first: int = 0, last: int | None = None) -> Figure:
    """Requests (rows) x steps (columns) for steps ``first..last`` (recorded batches).

    At most ``MAX_WIDTH_IN`` wide with every text at least 9 pt: a prefill cell shows its token
    count only when the number fits its column (40 steps do at 9 pt; wider windows lose the
    numbers, not their size)."""
    last = len(steps) if last is None else min(last, len(steps))
    if not 0 <= first < last:
        raise ValueError(f"need 0 <= first < last <= {len(steps)}, got first={first}, "
                         f"last={last}")
    rids = sorted({rid for s in steps[first:last] for rid, _, _ in s.batch}
                  | {rid for s in steps[first:last] for rid, _ in s.preempted})
    row = {rid: i for i, rid in enumerate(rids)}
    width = last - first
    fig_w = min(MAX_WIDTH_IN, 1.2 + 0.3 * width)
    col_in = (fig_w - 0.9) / width                  # the axes span about fig_w - 0.9 inches
    fig = Figure(figsize=(fig_w, 1.3 + 0.3 * max(1, len(rids))))
    ax = fig.add_subplot()
    for x, s in enumerate(steps[first:last]):
        cells: dict[int, tuple[int, bool]] = {}
        for rid, n, is_prefill in s.batch:     # a request's sequences share its row
            tokens, pre = cells.get(rid, (0, False))
            cells[rid] = (tokens + n, pre or is_prefill)
        for rid, (tokens, pre) in cells.items():
            ax.add_patch(Rectangle((x, row[rid]), 0.92, 0.85,
                                   facecolor=PREFILL if pre else DECODE, edgecolor="none"))
            if pre and text_width_in(str(tokens), MIN_FONT_PT) <= 0.92 * col_in:
                ax.text(x + 0.46, row[rid] + 0.42, str(tokens), ha="center", va="center",
                        fontsize=MIN_FONT_PT)
        for rid, mode in s.preempted:
            ax.text(x + 0.46, row[rid] + 0.42, "S" if mode == "swap" else "x", ha="center",
                    va="center", color=PREEMPT, fontsize=12, fontweight="bold")
    if current is not None and first <= current < last:
        ax.axvline(current - first + 0.46, color="black", lw=1.5, alpha=0.6)
    ax.set_xlim(0, width)
    ax.set_ylim(len(rids), 0)
    ax.set_yticks([i + 0.42 for i in range(len(rids))], [f"r{r}" for r in rids], fontsize=9.5)
    ticks = list(range(0, width, max(1, width // 10)))
    ax.set_xticks([t + 0.46 for t in ticks], [str(first + t) for t in ticks], fontsize=9.5)
    ax.set_xlabel("step", fontsize=10)
    ax.set_title("light: prefill chunk (tokens)   dark: decode   x: preempted (recompute)   "
                 "S: swapped out", fontsize=10)
    fig.tight_layout()
    return fig


class TimelineExplorer:
    """A step slider over a recorded replay. State: ``self.step``; the slider only sets it."""

    def __init__(self, steps: Sequence[StepRecord], window: int = 40) -> None:
        if not steps or not any(s.batch for s in steps):
            raise ValueError("replay the trace with record_batches=True: no batches recorded")
        self.steps, self.window, self.step = list(steps), window, 0
        self.slider = widgets.IntSlider(value=0, min=0, max=len(self.steps) - 1,
                                        description="step")
        self.image = widgets.Image(format="png")
        self.text = widgets.HTML()
        self.slider.observe(lambda change: self.show(change["new"]), names="value")
        self.widget = widgets.VBox([self.slider, self.image, self.text])
        self.show(0)

    def show(self, step: int) -> None:
        self.step = step
        first = max(0, min(step - self.window // 2, len(self.steps) - self.window))
        self.image.value = figure_png(draw_timeline(self.steps, step, first,
                                                    first + self.window), EXPLORER_DPI)
        self.text.value = f"<pre>{html.escape(describe_step(self.steps, step))}</pre>"


def draw_replay(results: dict[str, ReplayResult]) -> Figure:
    """Batch size and KV block usage over simulated time, one line per named replay."""
    fig = Figure(figsize=(10, 3.2))
    ax1, ax2 = fig.subplots(1, 2)
    for name, r in results.items():
        t = [s.time for s in r.steps]
        ax1.plot(t, [s.num_seqs for s in r.steps], lw=0.8, label=name)
        ax2.plot(t, [100 * s.gpu_block_usage for s in r.steps], lw=0.8, label=name)
    ax1.set(xlabel="simulated time (s)", ylabel="sequences in the batch", title="batch size")
    ax2.set(xlabel="simulated time (s)", ylabel="% of GPU blocks held", ylim=(0, 105),
            title="vllm:gpu_cache_usage_perc")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    return fig


def draw_preemption_costs(rows: Sequence[PreemptionCost]) -> Figure:
    """Left: time vs block size at each length. Right: recompute / swap ratio."""
    fig = Figure(figsize=(10, 3.4))
    ax1, ax2 = fig.subplots(1, 2)
    lengths = sorted({r.num_tokens for r in rows})
    for i, n in enumerate(lengths):
        sub = sorted((r for r in rows if r.num_tokens == n), key=lambda r: r.block_size)
        bs = [r.block_size for r in sub]
        ax1.plot(bs, [1e3 * r.swap_s for r in sub], "-o", ms=3, color=f"C{i}",
                 label=f"swap out+in, {n} tok")
        ax1.plot(bs, [1e3 * r.recompute_s for r in sub], "--", color=f"C{i}",
                 label=f"recompute, {n} tok")
        ax2.plot(bs, [r.ratio for r in sub], "-o", ms=3, color=f"C{i}", label=f"{n} tokens")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
    ax1.set_yscale("log")
    ax1.set(ylabel="ms", title="time to get one sequence's K/V back")
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.axhline(1.2, color="grey", lw=0.8, ls=":")
    ax2.set(ylabel="recompute / swap", title="recompute time / swap time")
    ax1.legend(fontsize=6, ncol=2)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig
