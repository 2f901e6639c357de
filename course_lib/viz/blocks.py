"""Drawings of a block manager: the physical pool as a grid, each sequence's block table.

The drawing code never reads a ``BlockManager`` directly: :func:`pool_view` turns one into a
:class:`PoolView` (plain data), and :func:`view_from_tables` builds the same from hand-written
tables, which is how the source articles' schematic figures are redrawn. One renderer,
:func:`draw_pool_and_tables`, draws either.

Colors: a block held by one sequence takes that sequence's color; a block shared by several
(ref count > 1) is hatched and labelled with its ref count; a cached block that no sequence holds
(ref 0, still findable by hash, evictable) is grey with its LRU rank (0 = next victim); a free
block is white.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from matplotlib.figure import Figure
from matplotlib.patches import ConnectionPatch, Rectangle

from course_lib.memory import BlockManager

FREE, HELD, SHARED, CACHED = "free", "held", "shared", "cached"
CACHED_COLOR = "#c8c8c8"
_PALETTE = ["#4c9be8", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#edc948", "#76b7b2",
            "#ff9da7", "#9c755f", "#8cd17d"]


@dataclass(frozen=True)
class BlockView:
    """One physical block as drawn."""
    block_id: int
    ref_count: int
    owners: tuple[str, ...]        # labels of the tables that point at it
    state: str                     # FREE | HELD | SHARED | CACHED
    num_filled: int = 0            # tokens written in it (0 for free blocks)
    tokens: tuple = ()             # its token ids, when known
    lru_rank: int | None = None    # CACHED only: 0 = evicted first


@dataclass
class PoolView:
    """What a drawing needs: the pool's blocks and the tables (label -> physical ids)."""
    block_size: int
    blocks: list[BlockView]
    tables: dict[str, list[int]]
    num_tokens: dict[str, int] = field(default_factory=dict)   # label -> tokens in the table
    color_index: dict[str, int] = field(default_factory=dict)  # label -> palette slot

    def color_of(self, label: str) -> str:
        i = self.color_index.get(label, list(self.tables).index(label))
        return _PALETTE[i % len(_PALETTE)]


def pool_view(manager: BlockManager, labels: Mapping[int, str] | None = None) -> PoolView:
    """The GPU pool and GPU-resident tables of a manager. ``labels``: seq id -> name."""
    labels = dict(labels or {})
    bs = manager.block_size
    tables: dict[str, list[int]] = {}
    num_tokens: dict[str, int] = {}
    color_index: dict[str, int] = {}
    owners: dict[int, list[str]] = {}
    filled: dict[int, int] = {}
    tokens: dict[int, tuple] = {}
    for seq_id in sorted(manager.seq_ids(), key=lambda s: (str(type(s)), s)):
        table = manager.get_table(seq_id)
        if table.device != "gpu":
            continue
        label = labels.get(seq_id, f"seq {seq_id}")
        tables[label], num_tokens[label] = list(table.blocks), table.num_tokens
        if isinstance(seq_id, int):
            color_index[label] = seq_id       # a sequence keeps its color as others come and go
        for i, block in enumerate(table.blocks):
            owners.setdefault(block, []).append(label)
            chunk = tuple(table.token_ids[i * bs:(i + 1) * bs])
            if len(chunk) >= filled.get(block, -1):
                filled[block], tokens[block] = len(chunk), chunk
    parked = manager.gpu.evictable_block_ids()
    rank = {b: i for i, b in enumerate(parked)}
    blocks = []
    for b in range(manager.num_gpu_blocks):
        ref = manager.ref_count(b)
        if ref > 1:
            state = SHARED
        elif ref == 1:
            state = HELD
        else:
            state = CACHED if b in rank else FREE
        if state == CACHED:
            key = manager.cache.key_of(b)
            filled[b], tokens[b] = bs, key.token_ids
        blocks.append(BlockView(b, ref, tuple(owners.get(b, ())), state, filled.get(b, 0),
                                tokens.get(b, ()), rank.get(b)))
    return PoolView(bs, blocks, tables, num_tokens, color_index)


def view_from_tables(num_blocks: int, tables: Mapping[str, Sequence[int]], block_size: int = 16,
                     num_tokens: Mapping[str, int] | None = None) -> PoolView:
    """A view from hand-written tables (a schematic figure); ref counts are table entries."""
    owners: dict[int, list[str]] = {}
    for label, blocks in tables.items():
        for b in blocks:
            if not 0 <= b < num_blocks:
                raise ValueError(f"table {label!r} points at block {b}, the pool has "
                                 f"blocks 0..{num_blocks - 1}")
            owners.setdefault(b, []).append(label)
    num_tokens = {k: len(v) * block_size for k, v in tables.items()} | dict(num_tokens or {})
    filled: dict[int, int] = {}
    for label, blocks in tables.items():
        for i, b in enumerate(blocks):
            n = min(block_size, max(0, num_tokens[label] - i * block_size))
            filled[b] = max(filled.get(b, 0), n)
    blocks = []
    for b in range(num_blocks):
        who = tuple(owners.get(b, ()))
        state = SHARED if len(who) > 1 else HELD if who else FREE
        blocks.append(BlockView(b, len(who), who, state, filled.get(b, 0)))
    return PoolView(block_size, blocks, {k: list(v) for k, v in tables.items()}, num_tokens)


def _short(tokens: tuple, width: int = 4) -> str:
    """Token ids of a block, shortened to fit in a cell."""
    text = " ".join(str(t) for t in tokens[:width])
    return text + (" …" if len(tokens) > width else "")


def draw_pool(view: PoolView, ax, ncols: int = 8, show_tokens: bool = False,
              title: str = "physical block pool") -> dict[int, tuple[float, float]]:
    """The pool as a grid of blocks; returns each block's cell centre (for arrows)."""
    n = len(view.blocks)
    ncols = max(1, min(ncols, n))
    nrows = -(-n // ncols) if n else 1
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
        box = {"facecolor": "white", "alpha": 0.75, "pad": 0.6, "edgecolor": "none"} \
            if b.state == SHARED else None
        ax.text(x + 0.5, y + 0.78, f"#{b.block_id}", ha="center", va="center", fontsize=8,
                fontweight="bold", bbox=box)
        if b.state == SHARED:
            note = f"ref {b.ref_count}"
        elif b.state == CACHED:
            note = f"cached\nLRU {b.lru_rank}"
        elif b.state == HELD:
            note = f"{b.num_filled}/{view.block_size}"
        else:
            note = "free"
        if show_tokens and b.tokens and b.state != FREE:
            note = _short(b.tokens) + "\n" + note
        ax.text(x + 0.5, y + 0.36, note, ha="center", va="center", fontsize=5.5, bbox=box)
    ax.set_xlim(0, ncols)
    ax.set_ylim(0, nrows)
    ax.set_aspect("equal")
    ax.set_axis_off()
    ax.set_title(title, fontsize=9)
    return centres


def draw_tables(view: PoolView, ax, show_tokens: bool = True,
                title: str = "block tables (logical -> physical)") -> dict[tuple[str, int], tuple]:
    """One row per table: logical block i and the physical block it maps to. Returns each
    entry's right-edge point (for arrows)."""
    bs = view.block_size
    width = max([len(t) for t in view.tables.values()] + [1])
    rows = max(len(view.tables), 1)
    anchors = {}
    for r, (label, blocks) in enumerate(view.tables.items()):
        y = rows - 1 - r
        ax.text(-0.1, y + 0.5, label, ha="right", va="center", fontsize=8)
        n = view.num_tokens.get(label, len(blocks) * bs)
        for i, b in enumerate(blocks):
            ax.add_patch(Rectangle((i + 0.04, y + 0.08), 0.92, 0.84,
                                   facecolor=view.color_of(label), edgecolor="black", alpha=0.9))
            text = f"L{i}→#{b}"
            if show_tokens:
                last = min(n, (i + 1) * bs) - 1
                text += f"\nt{i * bs}–t{last}" if last > i * bs else f"\nt{i * bs}"
            ax.text(i + 0.5, y + 0.5, text, ha="center", va="center", fontsize=6.5)
            anchors[(label, i)] = (i + 0.96, y + 0.5)
    if not view.tables:
        ax.text(0.5, 0.5, "(no sequences)", ha="center", va="center", fontsize=8)
    ax.set_xlim(-1.6, width)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.set_axis_off()
    ax.set_title(title, fontsize=9)
    return anchors


def draw_pool_and_tables(view: PoolView | BlockManager, title: str = "", ncols: int = 8,
                         show_tokens: bool = False, arrows: bool = False,
                         labels: Mapping[int, str] | None = None) -> Figure:
    """Tables on the left, the pool on the right; ``arrows`` links each entry to its block."""
    if isinstance(view, BlockManager):
        view = pool_view(view, labels)
    n = max(len(view.blocks), 1)
    nrows = -(-n // max(1, min(ncols, n)))
    width = max([len(t) for t in view.tables.values()] + [1])
    rows = max(len(view.tables), 1)
    fig = Figure(figsize=(min(16.0, 2.2 + 0.9 * (width + ncols)),
                          max(2.2, 0.75 * max(rows, nrows) + 1.0)))
    ax_t, ax_p = fig.subplots(1, 2, gridspec_kw={"width_ratios": [width + 1.6, ncols]})
    anchors = draw_tables(view, ax_t, show_tokens=width <= 8)   # ranges fit short tables only
    centres = draw_pool(view, ax_p, ncols=ncols, show_tokens=show_tokens)
    if arrows:
        for (label, i), start in anchors.items():
            end = centres[view.tables[label][i]]
            fig.add_artist(ConnectionPatch(start, (end[0] - 0.46, end[1]), "data", "data",
                                           axesA=ax_t, axesB=ax_p, arrowstyle="->",
                                           color=view.color_of(label), alpha=0.8, lw=1.0))
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def draw_static_vs_paged(used: Sequence[int], reserved: int, view: PoolView,
                         labels: Sequence[str] = ("A", "B", "C")) -> Figure:
    """The picture of the "Memory optimization" article: contiguous max-length reservations
    (top) vs a paged pool (bottom)."""
    if len(labels) < len(used):
        raise ValueError(f"need a label per request, got {len(labels)} for {len(used)}")
    fig = Figure(figsize=(10, 4.0))
    ax_s, ax_p = fig.subplots(2, 1, gridspec_kw={"height_ratios": [1.1, 1.4]})
    for r, (label, u) in enumerate(zip(labels, used, strict=False)):
        y = len(used) - 1 - r
        if u > reserved:
            raise ValueError(f"request {label} uses {u} tokens, more than the {reserved} reserved")
        ax_s.add_patch(Rectangle((0, y + 0.15), u, 0.7, facecolor="#59a14f", edgecolor="black"))
        ax_s.add_patch(Rectangle((u, y + 0.15), reserved - u, 0.7, facecolor="#f28e2b",
                                 hatch="//", alpha=0.5, edgecolor="black"))
        ax_s.text(-15, y + 0.5, f"request {label}", ha="right", va="center", fontsize=8)
        ax_s.text(u / 2, y + 0.5, f"used {u}", ha="center", va="center", fontsize=8)
        ax_s.text(u + (reserved - u) / 2, y + 0.5, f"reserved, unused {reserved - u}",
                  ha="center", va="center", fontsize=8)
    total = reserved * len(used)
    ax_s.set_xlim(-160, reserved)
    ax_s.set_ylim(0, len(used))
    ax_s.set_axis_off()
    ax_s.set_title(f"static: {reserved} slots reserved per request, {sum(used)} of {total} "
                   f"used ({100 * sum(used) / total:.1f}%)", fontsize=9)
    centres = draw_pool(view, ax_p, ncols=len(view.blocks), title="")
    ax_p.set_title("paged: blocks taken on demand from one pool; "
                   + ", ".join(f"{k}: " + " ".join(f"L{i}→#{b}" for i, b in enumerate(v))
                               for k, v in view.tables.items()), fontsize=9)
    del centres
    return fig


def figure_png(fig: Figure, dpi: int = 80) -> bytes:
    """PNG bytes of a figure (for ``widgets.Image``), without the matplotlib version stamp,
    so equal drawings give equal bytes on any install."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()
