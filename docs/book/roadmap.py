"""The course's roadmap: which chapters each chapter builds on, drawn as boxes and arrows.

`draw_roadmap(chapters, path)` writes an SVG with matplotlib only (no graphviz, no network).
The graph and the place of each box are data below, written by hand so that no arrow crosses a
box; `check_roadmap(chapters)` names every chapter that has no place or an unknown neighbour, so
adding a notebook without adding it here fails the build instead of leaving it off the map.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.rcParams["svg.hashsalt"] = "paged-kv-course"  # stable ids: the same SVG every build
from matplotlib.figure import Figure  # noqa: E402  (after the rcParam above)
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch  # noqa: E402

# part -> box colour
PARTS: dict[str, str] = {
    "why paging": "#fde2c8",
    "the block manager": "#cfe3f7",
    "kernels and scale": "#d8f0d2",
    "scheduling and serving": "#eadcf5",
}

# chapter -> (short label, x, row, part); row 0 is at the top
PLACES: dict[str, tuple[str, float, int, str]] = {
    "00_setup": ("Setup", 4, 0, "why paging"),
    "01_kv_cache_cost": ("What the KV\ncache costs", 4, 1, "why paging"),
    "02_fragmentation": ("Fragmentation", 4, 2, "why paging"),
    "03_blocks_and_tables": ("Blocks and\nblock tables", 4, 3, "the block manager"),
    "05_copy_on_write": ("Copy-on-write", 1, 4, "the block manager"),
    "07_scheduling_and_preemption": ("Scheduling and\npreemption", 3, 4, "scheduling and serving"),
    "04_paged_attention": ("Paged attention", 5, 4, "kernels and scale"),
    "08_capacity_planning": ("Capacity\nplanning", 7, 4, "kernels and scale"),
    "06_prefix_caching": ("Prefix caching", 1, 5, "the block manager"),
    "09_context_parallelism": ("Context\nparallelism", 6, 5, "kernels and scale"),
    "10_serving_end_to_end": ("Serving\nend to end", 3, 6, "scheduling and serving"),
    "11_capstone": ("Capstone", 2, 7, "scheduling and serving"),
    "12_vllm_v1_and_sglang": ("vLLM V1\nand SGLang", 4.5, 7, "scheduling and serving"),
    "13_beyond_one_gpu": ("Beyond one\nGPU's pool", 4.5, 8, "scheduling and serving"),
    "14_hybrid_models": ("Hybrid models", 7, 8, "the block manager"),
}

# (chapter, a chapter that builds on it); only the direct steps, what follows from two steps
# (01 -> 08 through 03, 06 -> 12 through 10) is left out so that the figure stays readable
EDGES: list[tuple[str, str]] = [
    ("00_setup", "01_kv_cache_cost"),
    ("01_kv_cache_cost", "02_fragmentation"),
    ("02_fragmentation", "03_blocks_and_tables"),
    ("03_blocks_and_tables", "04_paged_attention"),
    ("03_blocks_and_tables", "05_copy_on_write"),
    ("03_blocks_and_tables", "07_scheduling_and_preemption"),
    ("03_blocks_and_tables", "08_capacity_planning"),
    ("05_copy_on_write", "06_prefix_caching"),
    ("04_paged_attention", "09_context_parallelism"),
    ("08_capacity_planning", "09_context_parallelism"),
    ("04_paged_attention", "10_serving_end_to_end"),
    ("06_prefix_caching", "10_serving_end_to_end"),
    ("07_scheduling_and_preemption", "10_serving_end_to_end"),
    ("10_serving_end_to_end", "11_capstone"),
    ("10_serving_end_to_end", "12_vllm_v1_and_sglang"),
    ("12_vllm_v1_and_sglang", "13_beyond_one_gpu"),
    ("08_capacity_planning", "14_hybrid_models"),
    ("12_vllm_v1_and_sglang", "14_hybrid_models"),
]

BOX_W, BOX_H = 1.8, 0.72


def check_roadmap(chapters: list[str]) -> list[str]:
    """Problems between the chapters that exist and the roadmap's data; [] when they agree."""
    problems = [f"{c}: no place on the roadmap (add it to PLACES in docs/book/roadmap.py)"
                for c in chapters if c not in PLACES]
    problems += [f"{c}: on the roadmap but there is no such notebook"
                 for c in PLACES if c not in chapters]
    problems += [f"edge {a} -> {b}: unknown chapter" for a, b in EDGES
                 if a not in PLACES or b not in PLACES]
    problems += [f"edge {a} -> {b}: must point down the page" for a, b in EDGES
                 if a in PLACES and b in PLACES and PLACES[a][2] >= PLACES[b][2]]
    return problems


def draw_roadmap(chapters: list[str], path: Path) -> Path:
    """Draw the roadmap of `chapters` (notebook stems) into the SVG file `path`.

    Raises ValueError listing the problems when `check_roadmap(chapters)` finds any.
    """
    problems = check_roadmap(chapters)
    if problems:
        raise ValueError("roadmap out of step with notebooks/:\n  " + "\n  ".join(problems))
    rows = max(row for _, _, row, _ in PLACES.values()) + 1
    fig = Figure(figsize=(8.5, 0.95 * rows + 0.5))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-0.2, 8.2)
    ax.set_ylim(rows + 0.05, -0.5)  # row 0 at the top, room for the legend below
    ax.axis("off")
    boxes = {}
    for stem, (label, x, row, part) in PLACES.items():
        box = FancyBboxPatch((x - BOX_W / 2, row - BOX_H / 2), BOX_W, BOX_H,
                             boxstyle="round,pad=0.02,rounding_size=0.1",
                             facecolor=PARTS[part], edgecolor="#444444", linewidth=1.0)
        ax.add_patch(box)
        ax.text(x, row, f"{stem[:2]} · {label}", ha="center", va="center", fontsize=11,
                linespacing=1.3)
        boxes[stem] = box
    for a, b in EDGES:
        (_, xa, ra, _), (_, xb, rb, _) = PLACES[a], PLACES[b]
        ax.add_patch(FancyArrowPatch((xa, ra), (xb, rb), patchA=boxes[a], patchB=boxes[b],
                                     arrowstyle="-|>", mutation_scale=12, color="#555555",
                                     linewidth=1.0, shrinkA=1, shrinkB=1))
    handles = [Patch(facecolor=c, edgecolor="#444444", label=p) for p, c in PARTS.items()]
    ax.legend(handles=handles, loc="lower center", ncol=len(PARTS), frameon=False, fontsize=10.5)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="svg", metadata={"Date": None})
    return path
