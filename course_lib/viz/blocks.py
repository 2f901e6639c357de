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
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from matplotlib.figure import Figure
from matplotlib.patches import ConnectionPatch, Rectangle

from course_lib import capacity as cap
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


def draw_block_across_layers(spec: cap.ModelSpec, block_id: int = 3, num_blocks: int = 8,
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
    fig = Figure(figsize=(7.5, 0.9 + 0.75 * n))
    ax = fig.add_subplot()
    for r, layer in enumerate(layers):
        y = 2.4 * (n - 1 - r) + (1.0 if r < n - 1 else 0.0)   # a gap before the last layer
        for dy, kind in ((1, "K"), (0, "V")):
            ax.text(-0.2, y + dy + 0.45, f"layer {layer} {kind}", ha="right", va="center",
                    fontsize=7)
            for b in range(num_blocks):
                hit = b == block_id
                ax.add_patch(Rectangle((b + 0.05, y + dy + 0.05), 0.9, 0.8, edgecolor="black",
                                       facecolor="C0" if hit else "white", linewidth=0.6))
                ax.text(b + 0.5, y + dy + 0.45, f"#{b}", ha="center", va="center", fontsize=6,
                        color="white" if hit else "black")
        ax.text(num_blocks + 0.2, y + 0.95, f"K+V {cap.format_bytes(2 * k)}", va="center",
                fontsize=7)
    ax.text(num_blocks / 2, 2.7, f"... {spec.num_layers - n} more layers ...", ha="center",
            va="center", fontsize=7)
    ax.set_xlim(-2.2, num_blocks + 2.0)
    ax.set_ylim(-0.2, 2.4 * (n - 1) + 3.2)
    ax.set_axis_off()
    k_text, total = cap.format_bytes(k), cap.format_bytes(cap.block_bytes(spec, block_size))
    ax.set_title(f"{spec.name}, block_size {block_size}: block #{block_id} = K {k_text} + V "
                 f"{k_text} in each of {spec.num_layers} layers = {total}", fontsize=9)
    return fig


class ComponentRow(NamedTuple):
    """One component of the Block Manager tutorial's §3.1 table, then (vLLM 0.6.3) and now."""
    component: str
    role: str
    course: str     # course_lib names (dotted paths under course_lib, checked by the tests)
    v0: str         # vLLM 0.6.3's (V0) class and file
    v1: str         # vLLM 0.33.0's (V1) class and file


ARTICLE_COMPONENTS = (
    ComponentRow("Block Allocator (GPU)", "hands out and takes back the GPU pool's blocks",
                 "memory.pool.BlockAllocator (BlockManager.gpu); V1 twin: "
                 "memory.block_pool.BlockPool",
                 "NaiveBlockAllocator / PrefixCachingBlockAllocator inside CpuGpuBlockAllocator "
                 "(vllm/core/block/cpu_gpu_block_allocator.py)",
                 "BlockPool (vllm/v1/core/block_pool.py) over FreeKVCacheBlockQueue "
                 "(vllm/v1/core/kv_cache_utils.py)"),
    ComponentRow("Block Allocator (CPU)", "a CPU pool that holds swapped-out blocks",
                 "memory.pool.BlockAllocator (BlockManager.cpu, used by swap_out / swap_in)",
                 "the CPU half of CpuGpuBlockAllocator "
                 "(vllm/core/block/cpu_gpu_block_allocator.py)",
                 "none: V1 preempts by recompute, never swaps; an optional CPU offload of "
                 "cached blocks lives in vllm/v1/kv_offload/"),
    ComponentRow("Block Table", "maps a sequence's logical blocks to physical ones",
                 "memory.block_table.BlockTable; V1 twin: the req_to_blocks of "
                 "memory.kv_cache_manager.KVCacheManager",
                 "BlockTable (vllm/core/block/block_table.py)",
                 "req_to_blocks in SingleTypeKVCacheManager "
                 "(vllm/v1/core/single_type_kv_cache_manager.py); the GPU copy the kernels "
                 "read: BlockTable (vllm/v1/worker/block_table.py)"),
    ComponentRow("Evictor", "picks which cached free block to reuse first (LRU)",
                 "memory.pool.BlockAllocator.evictable_block_ids (an LRU OrderedDict)",
                 "LRUEvictor (vllm/core/evictor_v2.py)",
                 "no separate object: FreeKVCacheBlockQueue's order is the LRU, and "
                 "BlockPool.get_new_blocks drops a reused block's hash "
                 "(vllm/v1/core/block_pool.py)"),
)


def component_table(rows: Sequence[ComponentRow] = ARTICLE_COMPONENTS) -> str:
    """The §3.1 components as text: role, course_lib name, vLLM 0.6.3 and vLLM 0.33.0."""
    lines = []
    for r in rows:
        lines.append(f"{r.component}: {r.role}")
        for name, text in (("course_lib", r.course), ("vLLM 0.6.3", r.v0), ("vLLM 0.33.0", r.v1)):
            lines += textwrap.wrap(text, 96, initial_indent=f"  {name:<12} ",
                                   subsequent_indent=" " * 15)
    return "\n".join(lines)


def figure_png(fig: Figure, dpi: int = 80) -> bytes:
    """PNG bytes of a figure (for ``widgets.Image``), without the matplotlib version stamp,
    so equal drawings give equal bytes on any install."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()
