"""The block table of one sequence: logical block i -> physical block id.

Token ``p`` of a sequence lives in physical block ``blocks[p // block_size]`` at offset
``p % block_size``; its *slot* in the flat KV cache is ``blocks[p // block_size] * block_size
+ p % block_size`` (what ``reshape_and_cache`` writes to). The table grows one block at a
time, only when the last block is full: a sequence never holds more than ``block_size - 1``
empty slots.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from ...sizing.units import cdiv


def common_full_blocks(a: Sequence[int], b: Sequence[int], block_size: int) -> int:
    """How many leading full blocks of tokens ``a`` and ``b`` have in common."""
    n = 0
    while (n + 1) * block_size <= min(len(a), len(b)) and \
            a[n * block_size:(n + 1) * block_size] == b[n * block_size:(n + 1) * block_size]:
        n += 1
    return n


@dataclass(eq=False, slots=True)
class BlockTable:
    """Plain state of one sequence in the block manager (the manager mutates it)."""

    seq_id: int
    block_size: int
    device: str = "gpu"                                  # "gpu", or "cpu" while swapped out
    blocks: list[int] = field(default_factory=list)      # [num_logical_blocks] physical ids
    token_ids: list[int] = field(default_factory=list)   # tokens with a reserved slot
    block_hashes: list[int] = field(default_factory=list)  # chained hash of each full block
    num_cached_blocks: int = 0    # leading full blocks already offered to the prefix cache
    extra_key: Hashable = ()      # salt mixed into every block hash of this sequence
    cache_parent: tuple[int, int] | None = None  # cached block that holds block num_cached-1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_full_blocks(self) -> int:
        return len(self.token_ids) // self.block_size

    def slot(self, position: int) -> int:
        """Flat cache slot of token ``position`` (0-based, below ``num_tokens``)."""
        bs = self.block_size
        return self.blocks[position // bs] * bs + position % bs

    def slot_mapping(self, start: int = 0) -> list[int]:
        """Slots of tokens ``start..num_tokens-1`` in order (one decode step: the last one)."""
        bs, blocks = self.block_size, self.blocks
        return [blocks[p // bs] * bs + p % bs for p in range(start, len(self.token_ids))]

    def copy(self, seq_id: int) -> BlockTable:
        """A fork: same blocks (the caller increments their ref counts), same tokens."""
        return BlockTable(seq_id, self.block_size, self.device, list(self.blocks),
                          list(self.token_ids), list(self.block_hashes),
                          self.num_cached_blocks, self.extra_key, self.cache_parent)

    def check_invariants(self) -> None:
        n, bs = len(self.token_ids), self.block_size
        assert len(self.blocks) == cdiv(n, bs), (
            f"seq {self.seq_id}: {len(self.blocks)} blocks for {n} tokens (block_size {bs})")
        assert len(self.block_hashes) in (0, n // bs), (
            f"seq {self.seq_id}: {len(self.block_hashes)} hashes for {n // bs} full blocks")
        assert 0 <= self.num_cached_blocks <= n // bs, f"seq {self.seq_id}: bad num_cached_blocks"
