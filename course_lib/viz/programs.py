"""How a 1-D Triton launch splits ``n`` elements into programs of ``block_size`` lanes."""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from course_lib.kernels.smoke import num_programs

MAX_LANES = 256            # a box and a label per lane: more is unreadable (and slow)


def draw_programs(n: int, block_size: int) -> Figure:
    """One row of lanes: coloured by the program that owns them, hatched where masked off."""
    for name, value in (("n", n), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LANES:
            raise ValueError(f"{name} must be an integer in [1, {MAX_LANES}] (one box per lane "
                             f"is drawn), got {value!r}")
    programs = num_programs(n, block_size)
    lanes = programs * block_size
    fig = Figure(figsize=(max(4.0, 0.35 * lanes), 1.4))
    ax = fig.add_subplot()
    colors = [f"C{i % 10}" for i in range(programs)]
    for lane in range(lanes):
        pid, masked = lane // block_size, lane >= n
        ax.add_patch(Rectangle((lane, 0), 1, 1, facecolor="white" if masked else colors[pid],
                               edgecolor="black", hatch="//" if masked else None, alpha=0.8))
        if not masked:
            ax.text(lane + 0.5, 0.5, str(lane), ha="center", va="center", fontsize=8)
    for pid in range(programs):
        ax.text((pid + 0.5) * block_size, 1.25, f"program {pid}", ha="center", fontsize=9)
    ax.set_xlim(0, lanes)
    ax.set_ylim(0, 1.6)
    ax.set_axis_off()
    ax.set_title(f"n={n}, block_size={block_size}: {programs} programs, "
                 f"{lanes - n} lanes masked off", fontsize=9)
    return fig
