"""Chapter 10's drawings of the engine at work: block tables growing step by step.

:class:`TableHistory` is an ``on_step`` hook for :meth:`LLMEngine.generate`: after each step
it copies every GPU-resident block table (plain data). :func:`draw_table_growth` draws one
panel per request: a row per step, a cell per logical block, labelled with the physical block
it maps to -- the table gains a block only when the last one is full, and the physical ids
come from wherever the pool had room (not contiguous).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..engine.llm_engine import LLMEngine
from ..sizing.units import cdiv

_PALETTE = ["#4c9be8", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#edc948"]


@dataclass
class TableHistory:
    """``steps[i]``: {request_id: (num_tokens, [physical blocks])} of each request's first
    live sequence after step ``i``; ``shared[i]``: (blocks held, blocks without sharing)."""

    steps: list[dict[int, tuple[int, list[int]]]] = field(default_factory=list)
    shared: list[tuple[int, int]] = field(default_factory=list)

    def __call__(self, engine: LLMEngine, out) -> None:
        bm, snap = engine.block_manager, {}
        for req in engine.scheduler.running:
            seqs = [s for s in req.unfinished_seqs if bm.has_seq(s.seq_id)
                    and bm.get_table(s.seq_id).device == "gpu"]
            if seqs:
                table = bm.get_table(seqs[0].seq_id)
                snap[req.request_id] = (table.num_tokens, list(table.blocks))
        self.steps.append(snap)
        usage = bm.usage()
        self.shared.append((usage.num_held_blocks, usage.num_table_entries))

    def request_ids(self) -> list[int]:
        return sorted({r for s in self.steps for r in s})


def draw_table_growth(history: TableHistory, block_size: int, max_rows: int = 24) -> Figure:
    """One panel per request: rows = steps (every k-th step if there are many), cells =
    logical blocks labelled with their physical block; the last row shows the final table."""
    for name, value in (("block_size", block_size), ("max_rows", max_rows)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    rids = history.request_ids()
    fig = Figure(figsize=(3.2 * max(1, len(rids)), 4.2))
    axes = fig.subplots(1, max(1, len(rids)), squeeze=False)[0]
    for ax, rid in zip(axes, rids, strict=False):
        rows = [(i, s[rid]) for i, s in enumerate(history.steps) if rid in s]
        stride = max(1, cdiv(len(rows), max_rows))
        shown = rows[::stride]
        if shown[-1] is not rows[-1]:
            shown.append(rows[-1])
        width = max(len(b) for _, (_, b) in shown)
        color = _PALETTE[rid % len(_PALETTE)]
        for r, (step, (num_tokens, blocks)) in enumerate(shown):
            y = len(shown) - 1 - r
            for j, block in enumerate(blocks):
                fill = min(block_size, num_tokens - j * block_size) / block_size
                ax.add_patch(Rectangle((j, y), 0.95, 0.9, facecolor="white", edgecolor="0.4"))
                ax.add_patch(Rectangle((j, y), 0.95 * fill, 0.9, facecolor=color, alpha=0.7))
                ax.text(j + 0.47, y + 0.45, str(block), ha="center", va="center", fontsize=7)
            ax.text(-0.2, y + 0.45, f"step {step}", ha="right", va="center", fontsize=7)
        ax.set_xlim(-2.2, width + 0.2)
        ax.set_ylim(-0.2, len(shown))
        ax.set_title(f"request {rid}: {shown[-1][1][0]} tokens, {len(shown[-1][1][1])} blocks",
                     fontsize=9)
        ax.axis("off")
    fig.suptitle("block tables as they grow (cell = logical block, label = physical block, "
                 "fill = tokens in it)", fontsize=9)
    fig.tight_layout()
    return fig


def draw_sharing(history: TableHistory, title: str) -> Figure:
    """Blocks held vs blocks the same sequences would hold without sharing, per step."""
    fig = Figure(figsize=(6.0, 2.8))
    ax = fig.subplots()
    steps = range(len(history.shared))
    ax.plot(steps, [u for _, u in history.shared], label="without sharing", color="0.5")
    ax.plot(steps, [h for h, _ in history.shared], label="held (shared once)", color="#4c9be8")
    ax.set_xlabel("step")
    ax.set_ylabel("GPU blocks")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
