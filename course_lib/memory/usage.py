"""Plain answers the KV-cache managers give: room (``AllocStatus``), occupancy
(``BlockUsage``) and prefix-cache counts (``PrefixCacheStats``), shared by the V0 pair, the
V1 pair and the radix tree, and read by the metrics, the replay, the engine and the widgets."""

from __future__ import annotations

import enum
from typing import NamedTuple


class AllocStatus(enum.Enum):
    """Answer of ``can_allocate`` / ``can_swap_in`` (vLLM's names)."""
    OK = "ok"          # fits now
    LATER = "later"    # fits once other sequences free blocks
    NEVER = "never"    # larger than the whole pool (minus the watermark): reject the request


class BlockUsage(NamedTuple):
    """How full one pool is: the figures the metrics, the replay and the engine all report."""

    device: str
    block_size: int
    num_total_blocks: int
    num_free_blocks: int         # includes cached blocks no sequence holds (evictable)
    num_cached_free_blocks: int  # those evictable cached blocks
    num_table_entries: int       # block-table entries: the blocks held if nothing were shared
    num_filled_slots: int        # slots of held blocks that hold a token

    @property
    def num_held_blocks(self) -> int:
        """Blocks some sequence holds (a shared block counts once)."""
        return self.num_total_blocks - self.num_free_blocks

    @property
    def block_usage(self) -> float:
        """Held blocks / total blocks (``vllm:gpu_cache_usage_perc``)."""
        return self.num_held_blocks / self.num_total_blocks if self.num_total_blocks else 0.0

    @property
    def token_usage(self) -> float:
        """Slots holding a token / all slots of the pool."""
        slots = self.num_total_blocks * self.block_size
        return self.num_filled_slots / slots if slots else 0.0

    @property
    def sharing_saving(self) -> float:
        """Share of block-table entries that sharing saves now: 1 - held / entries."""
        if not self.num_table_entries:
            return 0.0
        return 1 - self.num_held_blocks / self.num_table_entries


class PrefixCacheStats(NamedTuple):
    queries: int                 # prompt tokens looked up
    hits: int                    # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
