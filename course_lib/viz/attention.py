"""Drawings for chapter 04: how attention finds a token through a block table, and the
block_size trade-off."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from ..sizing.units import cdiv, check_int


def draw_three_level_mapping(block_table: Sequence[int], seq_len: int, block_size: int,
                             num_blocks: int, others: Mapping[int, str] | None = None,
                             ncols: int = 8) -> Figure:
    """Tokens -> logical blocks -> block table -> physical pool, one arrow per logical block.

    ``others`` labels physical blocks held by other requests (e.g. ``{1: "Req-B"}``); the rest
    of the pool is free. Blocks of this sequence are coloured by their logical index.
    """
    check_int("seq_len", seq_len, 1)
    check_int("block_size", block_size, 1)
    check_int("num_blocks", num_blocks, 1)
    check_int("ncols", ncols, 1)
    n_logical = cdiv(seq_len, block_size)
    if n_logical > len(block_table):
        raise ValueError(f"seq_len {seq_len} needs {n_logical} blocks of {block_size}, the "
                         f"table has {len(block_table)}")
    if any(not 0 <= b < num_blocks for b in block_table):
        raise ValueError(f"block numbers must be in 0..{num_blocks - 1}, got {list(block_table)}")
    others = dict(others or {})
    rows = cdiv(num_blocks, ncols)
    fig = Figure(figsize=(9, 2.6 + 0.7 * rows))
    ax = fig.add_subplot()
    width = max(n_logical * 2.5, ncols * 1.1)
    w = width / n_logical
    top = rows * 1.0 + 3.2
    for i in range(n_logical):
        first, last = i * block_size, min(seq_len, (i + 1) * block_size) - 1
        color = f"C{i % 10}"
        ax.add_patch(Rectangle((i * w, top), w, 0.6, facecolor=color, alpha=0.35,
                               edgecolor="black"))
        ax.text((i + 0.5) * w, top + 0.3, f"tokens t{first}..t{last}", ha="center",
                va="center", fontsize=8)
        ax.add_patch(Rectangle((i * w, top - 1.3), w, 0.6, facecolor="white",
                               edgecolor="black"))
        ax.text((i + 0.5) * w, top - 1.0, f"logical {i} -> Phys#{block_table[i]}",
                ha="center", va="center", fontsize=8)
    ax.text(-0.2, top + 0.3, "sequence", ha="right", va="center", fontsize=9)
    ax.text(-0.2, top - 1.0, "block table", ha="right", va="center", fontsize=9)
    cell = width / ncols
    mine = {b: i for i, b in enumerate(block_table[:n_logical])}
    for b in range(num_blocks):
        x, y = (b % ncols) * cell, (rows - 1 - b // ncols) * 1.0
        if b in mine:
            face, label = f"C{mine[b] % 10}", f"Phys#{b}\nlogical {mine[b]}"
        elif b in others:
            face, label = "lightgrey", f"Phys#{b}\n{others[b]}"
        else:
            face, label = "white", f"Phys#{b}\nfree"
        ax.add_patch(Rectangle((x + 0.05, y + 0.05), cell - 0.1, 0.9, facecolor=face,
                               alpha=0.5 if b in mine else 1.0, edgecolor="black"))
        ax.text(x + cell / 2, y + 0.5, label, ha="center", va="center", fontsize=7)
        if b in mine:
            i = mine[b]
            ax.add_patch(FancyArrowPatch(((i + 0.5) * w, top - 1.3), (x + cell / 2, y + 0.95),
                                         arrowstyle="->", mutation_scale=10, color=f"C{i % 10}"))
    ax.text(-0.2, rows / 2, "physical pool", ha="right", va="center", fontsize=9)
    ax.set_xlim(-2.2, width + 0.1)
    ax.set_ylim(-0.1, top + 0.8)
    ax.set_axis_off()
    ax.set_title(f"{seq_len} tokens in blocks of {block_size}: logical blocks "
                 f"{list(range(n_logical))} live in physical blocks "
                 f"{list(block_table[:n_logical])}", fontsize=9)
    return fig


def plot_block_size_tradeoff(block_sizes: Sequence[int], waste_fraction: Sequence[float],
                             time_per_step: Sequence[float], backend: str,
                             waste_label: str = "") -> Figure:
    """Two panels: KV slots wasted in partially-filled last blocks, and measured kernel time."""
    if not block_sizes or not len(block_sizes) == len(waste_fraction) == len(time_per_step):
        raise ValueError(f"block_sizes, waste_fraction and time_per_step must be non-empty and "
                         f"of one length, got {len(block_sizes)}, {len(waste_fraction)}, "
                         f"{len(time_per_step)}")
    fig = Figure(figsize=(8, 2.8))
    left, right = fig.subplots(1, 2)
    labels = [str(b) for b in block_sizes]
    left.bar(labels, [100 * f for f in waste_fraction], color="C1")
    left.set_xlabel("block_size")
    left.set_ylabel("% of allocated slots unused")
    left.set_title(f"empty slots in last blocks{': ' + waste_label if waste_label else ''}",
                   fontsize=9)
    right.bar(labels, [1e3 * t for t in time_per_step], color="C0")
    right.set_xlabel("block_size")
    right.set_ylabel("ms per decode step")
    right.set_title(f"paged decode time ({backend})", fontsize=9)
    fig.tight_layout()
    return fig
