"""Drawings of a block manager: the physical pool as a grid, each sequence's block table.

The drawing code never reads a ``BlockManager`` directly: ``pool_view`` turns one into a
``PoolView`` (plain data) and ``view_from_tables`` builds the same from hand-written tables (all
three in ``viz/block_views.py``). One renderer, :func:`draw_pool_and_tables`, draws either.

Readable at 100% zoom (the rules are in ``viz/readable.py``): every text is at least
``MIN_FONT_PT`` (9 pt) and a figure is laid out in inches, never wider than ``MAX_WIDTH_IN``.
At ``EXPLORER_DPI`` (96, the browser's pixels per inch) a figure point is a CSS point, so the
explorers' images show 9 pt text as 9 pt, unscaled in a notebook's output area; the inline
backend's 100 dpi shows it a little larger. The tables
go left of the pool when both fit side by side, above it otherwise; a long table wraps.

Colors: a block held by one sequence takes that sequence's color; a block shared by several
(ref count > 1) is hatched and labelled with its ref count; a cached block that no sequence holds
(ref 0, still findable by hash, evictable) is grey and dashed with its LRU rank (0 = next
victim); a free block is white.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.patches import ConnectionPatch, Rectangle

from course_lib import capacity as cap
from course_lib.memory.v0.manager import BlockManager
from course_lib.sizing.models import ModelSpec
from course_lib.sizing.units import cdiv, format_bytes
from course_lib.viz.block_views import CACHED, CACHED_COLOR, FREE, HELD, SHARED, PoolView, pool_view
from course_lib.viz.readable import MAX_WIDTH_IN, text_width_in

CELL_W, POOL_H, TABLE_H = 0.95, 0.8, 0.62   # inches: a block's width, a pool row, a table row
MARGIN, GAP, TITLE_H, SUPTITLE_H = 0.15, 0.45, 0.4, 0.45
FONT_ID, FONT_NOTE, FONT_TOKENS, FONT_LABEL, FONT_TITLE = 11.0, 10.0, 9.5, 11.0, 11.0
TABLES_TITLE = "block tables: logical → physical"


def _short(tokens: tuple, width_in: float) -> str:
    """Token ids of a block, as many as fit in ``width_in`` at the token font, then '…'."""
    words = [str(t) for t in tokens]
    for k in range(len(words), 0, -1):
        text = " ".join(words[:k]) + (" …" if k < len(words) else "")
        if text_width_in(text, FONT_TOKENS) <= width_in:
            return text
    return "…"


@dataclass(frozen=True)
class Layout:
    """Where the panels go, in inches from the figure's bottom left; ``stacked``: the tables
    above the pool (they did not fit side by side)."""
    width: float
    height: float
    tables: tuple[float, float, float, float]    # x, y, w, h of the tables' axes
    pool: tuple[float, float, float, float]
    label_w: float                               # room left of the entries for the labels
    cell_w: float
    table_cols: int                              # entries per row of a table
    table_rows: int
    pool_cols: int
    stacked: bool
    title: str                                   # the title wrapped to the figure's width


def layout(view: PoolView, ncols: int = 8, title: str = "") -> Layout:
    """Sizes for :func:`draw_pool_and_tables`: cells ``CELL_W`` wide (narrower when ``ncols``
    would not fit ``MAX_WIDTH_IN``), tables beside the pool when that fits, else above it with
    each table wrapped to the width."""
    if isinstance(ncols, bool) or not isinstance(ncols, int) or ncols < 1:
        raise ValueError(f"ncols must be an integer >= 1, got {ncols!r}")
    n = max(len(view.blocks), 1)
    ncols = max(1, min(ncols, n))
    cell_w = min(CELL_W, (MAX_WIDTH_IN - 2 * MARGIN) / ncols)
    pool_w, pool_h = ncols * cell_w, math.ceil(n / ncols) * POOL_H
    labels = list(view.tables) or [""]
    label_w = max(text_width_in(label, FONT_LABEL) for label in labels) + 0.15
    longest = max([len(t) for t in view.tables.values()] + [1])
    tables_min = text_width_in(TABLES_TITLE, FONT_TITLE)
    side_w = max(label_w + longest * cell_w, tables_min)
    stacked = 2 * MARGIN + side_w + GAP + pool_w > MAX_WIDTH_IN
    cols = longest
    if stacked:
        cols = max(1, min(longest, int((MAX_WIDTH_IN - 2 * MARGIN - label_w) / cell_w)))
    rows = sum(math.ceil(len(t) / cols) for t in view.tables.values()) or 1
    tables_w, tables_h = max(label_w + cols * cell_w, tables_min), rows * TABLE_H
    room = MAX_WIDTH_IN - 2 * MARGIN
    lines = math.ceil(text_width_in(title, FONT_TITLE + 1) / room) if title else 0
    if lines > 1:
        title = textwrap.fill(title, int(len(title) / lines) + 4)
    top = SUPTITLE_H + 0.25 * max(0, lines - 1) if title else 0.0
    if stacked:
        width = 2 * MARGIN + max(tables_w, pool_w)
        height = MARGIN + pool_h + TITLE_H + tables_h + TITLE_H + top
        tables_box = (MARGIN, MARGIN + pool_h + TITLE_H, tables_w, tables_h)
        pool_box = (MARGIN, MARGIN, pool_w, pool_h)
    else:
        width = 2 * MARGIN + tables_w + GAP + pool_w
        content = max(tables_h, pool_h)
        height = MARGIN + content + TITLE_H + top
        tables_box = (MARGIN, MARGIN + content - tables_h, tables_w, tables_h)
        pool_box = (MARGIN + tables_w + GAP, MARGIN + content - pool_h, pool_w, pool_h)
    title_w = max([text_width_in(line, FONT_TITLE + 1) for line in title.splitlines()] + [0])
    width = max(width, min(MAX_WIDTH_IN, title_w + 2 * MARGIN))
    return Layout(width, height, tables_box, pool_box, label_w, cell_w, cols, rows, ncols,
                  stacked, title)


def _place(fig: Figure, box: tuple[float, float, float, float], size: tuple[float, float]):
    x, y, w, h = box
    return fig.add_axes((x / size[0], y / size[1], w / size[0], h / size[1]))


def draw_pool(view: PoolView, ax, ncols: int = 8, show_tokens: bool = False,
              title: str = "physical block pool",
              cell_w: float = CELL_W) -> dict[int, tuple[float, float]]:
    """The pool as a grid of unit cells (``cell_w`` inches wide, for fitting token ids);
    returns each block's cell centre in data units (for arrows)."""
    n = len(view.blocks)
    ncols = max(1, min(ncols, n))
    nrows = cdiv(n, ncols) if n else 1
    fit = cell_w - 0.1
    centres = {}
    for b in view.blocks:
        x, y = b.block_id % ncols, nrows - 1 - b.block_id // ncols
        centres[b.block_id] = (x + 0.5, y + 0.5)
        face, hatch, style = "white", None, "solid"
        if b.state in (HELD, SHARED):
            face = view.color_of(b.owners[0]) if b.owners else "#999999"
            hatch = "//" if b.state == SHARED else None
        elif b.state == CACHED:
            face, style = CACHED_COLOR, "dashed"
        ax.add_patch(Rectangle((x + 0.04, y + 0.04), 0.92, 0.92, facecolor=face, hatch=hatch,
                               edgecolor="black", linestyle=style,
                               linewidth=2.0 if b.state == SHARED else 1.0, alpha=0.9))
        box = {"facecolor": "white", "alpha": 0.8, "pad": 0.8, "edgecolor": "none"} \
            if b.state == SHARED else None
        note = {SHARED: f"ref {b.ref_count}", CACHED: f"LRU {b.lru_rank}",
                HELD: f"{b.num_filled}/{view.block_size}"}.get(b.state, "free")
        tokens = _short(b.tokens, fit) if show_tokens and b.tokens and b.state != FREE else ""
        top, bottom = (0.8, 0.2) if tokens else (0.72, 0.3)
        ax.text(x + 0.5, y + top, f"#{b.block_id}", ha="center", va="center",
                fontsize=FONT_ID, fontweight="bold", bbox=box)
        if tokens:
            ax.text(x + 0.5, y + 0.5, tokens, ha="center", va="center", fontsize=FONT_TOKENS,
                    bbox=box)
        ax.text(x + 0.5, y + bottom, note, ha="center", va="center", fontsize=FONT_NOTE,
                bbox=box)
    ax.set_xlim(0, ncols)
    ax.set_ylim(0, nrows)
    ax.set_axis_off()
    if title:
        ax.set_title(title, fontsize=FONT_TITLE, loc="left")
    return centres


def draw_tables(view: PoolView, ax, table_cols: int | None = None, show_tokens: bool = True,
                title: str = TABLES_TITLE) -> dict[tuple[str, int], tuple[float, float]]:
    """One row per table (``table_cols`` entries a row, wrapping): logical block i and the
    physical block it maps to, with its token range when ``show_tokens``. The axes' x range
    must start left of 0 to leave room for the labels. Returns each entry's lower-left corner
    (entries are unit squares, for arrows)."""
    bs = view.block_size
    cols = table_cols or max([len(t) for t in view.tables.values()] + [1])
    rows = sum(cdiv(len(t), cols) for t in view.tables.values()) or 1
    corners = {}
    row = 0
    for label, blocks in view.tables.items():
        ax.text(-0.1, rows - row - 0.5, label, ha="right", va="center", fontsize=FONT_LABEL)
        n = view.num_tokens.get(label, len(blocks) * bs)
        for i, b in enumerate(blocks):
            x, y = i % cols, rows - 1 - (row + i // cols)
            ax.add_patch(Rectangle((x + 0.04, y + 0.08), 0.92, 0.84,
                                   facecolor=view.color_of(label), edgecolor="black", alpha=0.9))
            text = f"L{i}→#{b}"
            if show_tokens:
                last = min(n, (i + 1) * bs) - 1
                text += f"\nt{i * bs}–t{last}" if last > i * bs else f"\nt{i * bs}"
            ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=FONT_NOTE)
            corners[(label, i)] = (float(x), float(y))
        row += cdiv(len(blocks), cols)
    if not view.tables:
        ax.text(0.0, 0.5, "(no sequences)", ha="left", va="center", fontsize=FONT_LABEL)
    ax.set_ylim(0, rows)
    ax.set_axis_off()
    if title:
        ax.set_title(title, fontsize=FONT_TITLE, loc="left")
    return corners


def _ranges_fit(view: PoolView, cell_w: float) -> bool:
    """Whether every entry's token range ("t1000–t1015") fits its cell at the note font."""
    longest = max([len(t) for t in view.tables.values()] + [0])
    last = longest * view.block_size
    return text_width_in(f"t{last}–t{last}", FONT_NOTE) <= cell_w - 0.08


def draw_pool_and_tables(view: PoolView | BlockManager, title: str = "", ncols: int = 8,
                         show_tokens: bool = False, arrows: bool = False,
                         labels: Mapping[int, str] | None = None) -> Figure:
    """The tables and the pool (``ncols`` blocks a row), laid out by :func:`layout`;
    ``arrows`` links each entry to its block. ``show_tokens``: token ids in the pool's cells."""
    if isinstance(view, BlockManager):
        view = pool_view(view, labels)
    lay = layout(view, ncols, title)
    size = (lay.width, lay.height)
    fig = Figure(figsize=size)
    ax_t, ax_p = _place(fig, lay.tables, size), _place(fig, lay.pool, size)
    corners = draw_tables(view, ax_t, lay.table_cols, show_tokens=_ranges_fit(view, lay.cell_w))
    ax_t.set_xlim(-lay.label_w / lay.cell_w, lay.tables[2] / lay.cell_w - lay.label_w / lay.cell_w)
    centres = draw_pool(view, ax_p, ncols=lay.pool_cols, show_tokens=show_tokens,
                        cell_w=lay.cell_w)
    if arrows:
        for (label, i), (x, y) in corners.items():
            cx, cy = centres[view.tables[label][i]]
            start, end = ((x + 0.5, y + 0.08), (cx, cy + 0.46)) if lay.stacked else \
                ((x + 0.96, y + 0.5), (cx - 0.46, cy))
            fig.add_artist(ConnectionPatch(start, end, "data", "data", axesA=ax_t, axesB=ax_p,
                                           arrowstyle="->", color=view.color_of(label),
                                           alpha=0.8, lw=1.0))
    if title:
        fig.suptitle(lay.title, fontsize=FONT_TITLE + 1, y=1 - 0.08 / lay.height, va="top")
    return fig


def draw_static_vs_paged(used: Sequence[int], reserved: int, view: PoolView,
                         labels: Sequence[str] = ("A", "B", "C")) -> Figure:
    """The picture of the "Memory optimization" article: contiguous max-length reservations
    (top) vs a paged pool (bottom)."""
    if len(labels) < len(used):
        raise ValueError(f"need a label per request, got {len(labels)} for {len(used)}")
    n = len(view.blocks)
    fig = Figure(figsize=(MAX_WIDTH_IN, 1.3 + 0.45 * len(used) + POOL_H))
    ax_s, ax_p = fig.subplots(2, 1, gridspec_kw={"height_ratios": [0.45 * len(used), POOL_H]})
    for r, (label, u) in enumerate(zip(labels, used, strict=False)):
        y = len(used) - 1 - r
        if u > reserved:
            raise ValueError(f"request {label} uses {u} tokens, more than the {reserved} reserved")
        if u < 0:
            raise ValueError(f"request {label} uses {u} tokens: must be in 0..{reserved}")
        ax_s.add_patch(Rectangle((0, y + 0.12), u, 0.76, facecolor="#59a14f", edgecolor="black"))
        ax_s.add_patch(Rectangle((u, y + 0.12), reserved - u, 0.76, facecolor="#f28e2b",
                                 hatch="//", alpha=0.5, edgecolor="black"))
        ax_s.text(-0.02 * reserved, y + 0.5, f"request {label}", ha="right", va="center",
                  fontsize=FONT_NOTE)
        ax_s.text(u / 2, y + 0.5, f"used {u}", ha="center", va="center", fontsize=FONT_NOTE)
        ax_s.text(u + (reserved - u) / 2, y + 0.5, f"reserved, unused {reserved - u}",
                  ha="center", va="center", fontsize=FONT_NOTE,
                  bbox={"facecolor": "white", "alpha": 0.8, "pad": 1, "edgecolor": "none"})
    total = reserved * len(used)
    ax_s.set_xlim(-0.14 * reserved, reserved)
    ax_s.set_ylim(0, len(used))
    ax_s.set_axis_off()
    ax_s.set_title(f"static: {reserved} slots reserved per request, {sum(used)} of {total} "
                   f"used ({100 * sum(used) / total:.1f}%)", fontsize=FONT_TITLE)
    draw_pool(view, ax_p, ncols=n, title="", cell_w=(MAX_WIDTH_IN - 0.3) / max(n, 1))
    ax_p.set_title("paged: blocks taken on demand from one pool\n"
                   + ", ".join(f"{k}: " + " ".join(f"L{i}→#{b}" for i, b in enumerate(v))
                               for k, v in view.tables.items()), fontsize=FONT_TITLE)
    fig.subplots_adjust(left=0.02, right=0.98, bottom=0.03, top=0.9, hspace=0.9)
    return fig


def draw_block_across_layers(spec: ModelSpec, block_id: int = 3, num_blocks: int = 8,
                             block_size: int = 16, layers_shown: int = 3) -> Figure:
    """One block id in every layer: a K row and a V row of ``num_blocks`` blocks per layer (the
    first ``layers_shown - 1`` layers and the last), block ``block_id`` highlighted in each; the
    title sums its bytes over all layers (K/V models only)."""
    if spec.is_mla:
        raise ValueError(f"{spec.name} caches an MLA latent, not K and V blocks")
    if not 0 <= block_id < num_blocks or not 2 <= layers_shown <= spec.num_layers:
        raise ValueError(f"need 0 <= block_id < num_blocks and 2 <= layers_shown <= "
                         f"{spec.num_layers}, got {block_id}, {num_blocks}, {layers_shown}")
    k = cap.k_block_bytes_per_layer(spec, block_size)
    layers = [*range(layers_shown - 1), spec.num_layers - 1]
    n = len(layers)
    fig = Figure(figsize=(MAX_WIDTH_IN, 1.1 + 0.95 * n))
    ax = fig.add_subplot()
    for r, layer in enumerate(layers):
        y = 2.4 * (n - 1 - r) + (1.0 if r < n - 1 else 0.0)   # a gap before the last layer
        for dy, kind in ((1, "K"), (0, "V")):
            ax.text(-0.2, y + dy + 0.45, f"layer {layer} {kind}", ha="right", va="center",
                    fontsize=FONT_NOTE)
            for b in range(num_blocks):
                hit = b == block_id
                ax.add_patch(Rectangle((b + 0.05, y + dy + 0.05), 0.9, 0.8, edgecolor="black",
                                       facecolor="C0" if hit else "white", linewidth=0.6))
                ax.text(b + 0.5, y + dy + 0.45, f"#{b}", ha="center", va="center",
                        fontsize=FONT_NOTE, color="white" if hit else "black")
        ax.text(num_blocks + 0.2, y + 0.95, f"K+V {format_bytes(2 * k)}", va="center",
                fontsize=FONT_NOTE)
    ax.text(num_blocks / 2, 2.7, f"... {spec.num_layers - n} more layers ...", ha="center",
            va="center", fontsize=FONT_NOTE)
    ax.set_xlim(-2.0, num_blocks + 2.0)
    ax.set_ylim(-0.2, 2.4 * (n - 1) + 3.2)
    ax.set_axis_off()
    k_text, total = format_bytes(k), format_bytes(cap.block_bytes(spec, block_size))
    ax.set_title(f"{spec.name}, block_size {block_size}: block #{block_id} = K {k_text} + V "
                 f"{k_text} in each of {spec.num_layers} layers = {total}", fontsize=FONT_TITLE)
    fig.subplots_adjust(left=0.02, right=0.98, bottom=0.03, top=0.88)
    return fig
