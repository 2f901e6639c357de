"""What every design's KV-cache manager answers the same way, written once.

The three designs of ``memory/`` (the paper's / vLLM V0's in ``v0/``, vLLM V1's in ``v1/``,
SGLang's radix tree in ``radix/``) each keep their own blocks, but the scheduler, the metrics,
the replay, the engine and the widgets read them through the same plain answers:

* :class:`AllocStatus`: is there room now, later, or never (``can_allocate`` / ``can_swap_in``);
* :class:`BlockUsage`: how full a pool is (held, free, evictable blocks; table entries; slots);
* :class:`PrefixCacheStats`: prompt tokens looked up in the prefix cache, and found.
"""

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
    """Prefix-cache lookups, counted in prompt tokens (``vllm:prefix_cache_queries`` /
    ``_hits``). A sequence admitted again after a preemption is counted apart, as vLLM 0.33.0's
    ``PrefixCacheStats.record`` counts it (``vllm/v1/metrics/stats.py``): not in the exported
    counters. Immutable: a manager holds one in its ``prefix_cache_stats`` attribute and
    replaces it at each lookup (:meth:`record`), so the engine can keep a step's value and
    give it to a new manager."""
    queries: int                 # prompt tokens looked up
    hits: int                    # of those, tokens found in the cache
    preempted_queries: int = 0   # the same, for sequences admitted again after a preemption
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hits: int, preempted: bool = False
               ) -> PrefixCacheStats:
        """These counts with one more sequence's lookup added."""
        if preempted:
            return self._replace(preempted_queries=self.preempted_queries + num_tokens,
                                 preempted_hits=self.preempted_hits + num_hits)
        return self._replace(queries=self.queries + num_tokens, hits=self.hits + num_hits)
