"""Drawings for chapter 02: memory strips and the memory breakdown of a simulation.

Colours are the same everywhere: token states green, reserved (for tokens still to come)
blue, internal fragmentation red, external fragmentation grey hatched, free white.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from course_lib.memory.v0.manager import BlockManager
from course_lib.sim.static import CATEGORIES, ContiguousAllocator, MemoryTimeline

COLORS = {"token_states": "#4caf50", "reserved": "#64b5f6", "internal": "#e57373",
          "external": "#bdbdbd", "free": "white"}
LABELS = {"token_states": "token states", "reserved": "reserved (future tokens)",
          "internal": "internal fragmentation", "external": "external fragmentation",
          "free": "free"}


class Segment(NamedTuple):
    """A run of slots of one category, optionally labelled (e.g. with a request name)."""
    start: int
    length: int
    category: str
    label: str = ""


def request_segments(start: int, reserved: int, final_len: int, states: int,
                     label: str = "") -> list[Segment]:
    """A contiguous reservation split into token states / reserved / internal fragmentation."""
    if not 0 <= states <= final_len <= reserved:
        raise ValueError("need 0 <= states <= final_len <= reserved, got "
                         f"states={states}, final_len={final_len}, reserved={reserved}")
    parts = [(states, "token_states"), (final_len - states, "reserved"),
             (reserved - final_len, "internal")]
    out, pos = [], start
    for length, category in parts:
        if length:
            out.append(Segment(pos, length, category, label if not out else ""))
            pos += length
    return out


def allocator_segments(alloc: ContiguousAllocator,
                       requests: Mapping[int, tuple[str, int, int]],
                       next_request_size: int | None = None) -> list[Segment]:
    """Segments of a first-fit allocator: each allocation split by ``requests[start] =
    (label, final_len, states)``; holes are external fragmentation when a waiting request of
    ``next_request_size`` slots fits in none of them, else free."""
    blocked = next_request_size is not None and alloc.largest_hole < next_request_size
    segs: list[Segment] = []
    for start, length, is_free in alloc.regions():
        if is_free:
            segs.append(Segment(start, length, "external" if blocked else "free"))
        else:
            label, final_len, states = requests[start]
            segs.extend(request_segments(start, length, final_len, states, label))
    return segs


def paged_segments(bm: BlockManager, labels: Mapping[int, str]) -> list[Segment]:
    """Segments of a paged GPU pool: held blocks as token states plus the empty tail of a
    sequence's last block (internal fragmentation); free blocks free. Neighbouring blocks of
    one sequence merge into one segment, labelled with the sequence's name from ``labels``."""
    bs = bm.block_size
    owner: dict[int, tuple[int, int]] = {}   # block -> (seq_id, filled slots)
    for seq_id in bm.seq_ids():
        table = bm.get_table(seq_id)
        if table.device == "gpu":
            for i, block in enumerate(table.blocks):
                owner[block] = (seq_id, min(bs, table.num_tokens - i * bs))
    segs: list[Segment] = []
    prev = None                              # owner of the previous block, while mergeable
    for block in range(bm.num_gpu_blocks):
        start = block * bs
        seq_id, filled = owner.get(block, (None, 0))
        category = "free" if seq_id is None else "token_states"
        length = bs if seq_id is None else filled
        if segs and prev == seq_id and segs[-1].category == category \
                and sum(segs[-1][:2]) == start:
            last = segs[-1]
            segs[-1] = last._replace(length=last.length + length)
        else:
            label = labels.get(seq_id, "") if seq_id is not None else ""
            segs.append(Segment(start, length, category, label))
        prev = seq_id
        if seq_id is not None and filled < bs:
            segs.append(Segment(start + filled, bs - filled, "internal"))
            prev = None
    return segs


def draw_strip(segments: Sequence[Segment], total: int, title: str = "",
               block_size: int | None = None) -> Figure:
    """One horizontal strip of ``total`` slots; block boundaries drawn when block_size given."""
    if total < 1:
        raise ValueError(f"total must be >= 1 slot, got {total}")
    covered = sum(s.length for s in segments)
    if covered > total or any(s.category not in COLORS for s in segments):
        raise ValueError(f"segments cover {covered} of {total} slots or use an unknown "
                         f"category; categories: {list(COLORS)}")
    fig = Figure(figsize=(10, 1.8))
    ax = fig.add_subplot()
    for seg in segments:
        ax.add_patch(Rectangle((seg.start, 0), seg.length, 1, facecolor=COLORS[seg.category],
                               edgecolor="black", linewidth=0.6,
                               hatch="//" if seg.category == "external" else None))
        if seg.label:
            ax.text(seg.start + 0.005 * total, 0.5, seg.label, va="center", fontsize=9,
                    fontweight="bold")
    if block_size:
        for x in range(block_size, total, block_size):
            ax.axvline(x, color="black", linewidth=0.3, alpha=0.5)
    ax.set_xlim(0, total)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_xlabel("token slot")
    used = sorted({s.category for s in segments}, key=CATEGORIES.index)
    ax.legend(handles=[Patch(facecolor=COLORS[c], edgecolor="black", label=LABELS[c],
                             hatch="//" if c == "external" else None) for c in used],
              loc="upper center", bbox_to_anchor=(0.5, -0.75), ncol=len(used), fontsize=8,
              frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    fig.subplots_adjust(bottom=0.5, top=0.82)
    return fig


def draw_breakdown_area(timeline: MemoryTimeline, max_steps: int | None = None) -> Figure:
    """Stacked area of the five categories (share of memory) over the steps of one system."""
    n = len(timeline.token_states) if max_steps is None else max_steps
    steps = np.arange(len(timeline.token_states))[:n]
    parts = [getattr(timeline, c)[:n] / timeline.total_slots for c in CATEGORIES]
    fig = Figure(figsize=(8, 3))
    ax = fig.add_subplot()
    ax.stackplot(steps, *parts, colors=[COLORS[c] for c in CATEGORIES],
                 labels=[LABELS[c] for c in CATEGORIES], edgecolor="none")
    ax.set_xlim(0, max(1, len(steps) - 1))
    ax.set_ylim(0, 1)
    ax.set_xlabel("step")
    ax.set_ylabel("share of KV memory")
    ax.set_title(f"{timeline.system}: memory over time", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    return fig


def draw_breakdown_bars(timelines: Sequence[MemoryTimeline],
                        paper_token_states: Mapping[str, float] | None = None) -> Figure:
    """One stacked bar per system: mean share of each category over the loaded steps, with
    the paper's token-state share marked (a black tick) where given (system name -> %)."""
    fig = Figure(figsize=(8, 0.6 + 0.7 * len(timelines)))
    ax = fig.add_subplot()
    names = [t.system for t in timelines]
    for y, tl in enumerate(timelines):
        left = 0.0
        for c, share in tl.fractions().items():
            ax.barh(y, 100 * share, left=left, color=COLORS[c], edgecolor="black",
                    linewidth=0.5, hatch="//" if c == "external" else None,
                    label=LABELS[c] if y == 0 else None)
            left += 100 * share
        ax.text(101, y, f"{100 * tl.fractions()['token_states']:.1f}% token states",
                va="center", fontsize=8)
        if paper_token_states and tl.system in paper_token_states:
            ax.plot([paper_token_states[tl.system]] * 2, [y - 0.4, y + 0.4], color="black",
                    linewidth=2, label="paper's token states" if y == 0 else None)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlim(0, 130)
    ax.set_xticks(range(0, 101, 20))
    ax.set_xlabel("share of KV memory (%), mean over steps with a waiting request")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize=8,
              frameon=False)
    fig.tight_layout()
    return fig


def draw_batch_sizes(timelines: Sequence[MemoryTimeline]) -> Figure:
    """Requests resident per step, one line per system, each with its loaded-step mean."""
    fig = Figure(figsize=(8, 3))
    ax = fig.add_subplot()
    for i, tl in enumerate(timelines):
        ax.plot(tl.batch_size, color=f"C{i}", linewidth=0.8,
                label=f"{tl.system} (mean {tl.mean_batch_size():.1f})")
    ax.set_xlabel("step")
    ax.set_ylabel("requests in the batch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
