"""What a drawing of a block manager needs, as plain data.

:func:`pool_view` turns a ``BlockManager`` into a :class:`PoolView`, and :func:`view_from_tables`
builds the same from hand-written tables (how the source articles' schematic figures are
redrawn). :mod:`course_lib.viz.blocks` draws either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from course_lib.memory.v0.manager import BlockManager

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
    """A view from hand-written tables (a schematic figure); ref counts are table entries.
    ``num_tokens[label]`` (default: the table full) must be in ``0..len(table) * block_size``."""
    for name, value, low in (("num_blocks", num_blocks, 0), ("block_size", block_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    for label, n in dict(num_tokens or {}).items():
        if label not in tables:
            raise ValueError(f"num_tokens names {label!r}, which has no table; tables: "
                             f"{list(tables)}")
        room = len(tables[label]) * block_size
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= room:
            raise ValueError(f"num_tokens[{label!r}] must be in 0..{room} (its {len(tables[label])}"
                             f" blocks of {block_size}), got {n!r}")
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
