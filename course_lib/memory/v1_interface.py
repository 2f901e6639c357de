"""The V1 interface that two designs implement: vLLM V1's ``KVCacheManager`` over hash chains
(``v1/kv_cache_manager.py``) and the same calls over SGLang's radix tree
(``radix/kv_cache_manager.py``). The V1 scheduler (``scheduler/v1.py``) drives either one.

``V1ManagerBase`` holds what both answer alike: the per-sequence maps, ``has_seq`` /
``seq_ids``, the prefix-cache counters (``prefix_cache_stats``, ``record_prefix_cache_stats``),
``forget`` and ``usage``. Each design subclasses it with its own pool: the base is a real
class with state, not a mixin.
"""

from __future__ import annotations

from collections.abc import Hashable

from .common import BlockUsage, PrefixCacheStats


class V1ManagerBase:
    """What both V1 managers hold and answer alike. Keys are sequence ids (a V1 request is
    one sequence); a subclass sets ``req_to_blocks[seq]`` and ``num_slots[seq]`` together,
    and says how many of its free blocks are cached (:meth:`_free_counts`)."""

    num_free_cpu_blocks = 0                          # V1: no swap space

    def __init__(self, block_size: int, num_gpu_blocks: int, enable_caching: bool,
                 watermark: float) -> None:
        self.block_size, self.num_gpu_blocks = block_size, num_gpu_blocks
        self.num_cpu_blocks = 0
        self.enable_caching = enable_caching
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.req_to_blocks: dict[int, list] = {}
        self.num_slots: dict[int, int] = {}          # tokens with a slot
        self.num_cached_block: dict[int, int] = {}   # leading blocks that are the cache's
        self.salts: dict[int, Hashable] = {}
        self.prefix_cache_stats = PrefixCacheStats(0, 0)   # tokens looked up, tokens found

    # ------------------------------------------------------------------------ queries
    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self.req_to_blocks

    def seq_ids(self) -> list[int]:
        return list(self.req_to_blocks)

    def record_prefix_cache_stats(self, num_tokens: int, num_hit_tokens: int,
                                  preempted: bool = False) -> None:
        """Count one admitted sequence's lookup (``vllm:prefix_cache_queries`` / ``_hits``):
        once, when it is admitted, however many steps it waited. A sequence admitted again
        after a preemption counts apart (:meth:`PrefixCacheStats.record`)."""
        if self.enable_caching:
            self.prefix_cache_stats = self.prefix_cache_stats.record(num_tokens, num_hit_tokens,
                                                                     preempted)

    def free(self, seq_id: int) -> None:
        """Give the sequence's blocks back (each manager its own way)."""
        raise NotImplementedError

    def forget(self, seq_id: int) -> None:
        """A finished sequence: drop its blocks (if any) and its salt."""
        if seq_id in self.req_to_blocks:
            self.free(seq_id)
        self.salts.pop(seq_id, None)

    # ------------------------------------------------------------------------ usage
    def _free_counts(self) -> tuple[int, int]:
        """(free blocks, of those the cached ones no sequence holds)."""
        raise NotImplementedError

    def usage(self, device: str = "gpu") -> BlockUsage:
        """Occupancy (the V0 pair's :class:`BlockUsage`); V1 has no CPU pool."""
        bs = self.block_size
        if device == "cpu":
            return BlockUsage("cpu", bs, 0, 0, 0, 0, 0)
        free, cached_free = self._free_counts()
        usable, entries, empty = self._table_counts()
        held = usable - free
        return BlockUsage("gpu", bs, usable, free, cached_free, entries, held * bs - empty)

    def _table_counts(self) -> tuple[int, int, int]:
        """(blocks a sequence can hold, block-table entries, empty slots in them): one table
        per sequence here; a manager with more (several KV-cache groups) counts them all."""
        bs = self.block_size
        empty = sum(len(blocks) * bs - self.num_slots[s]
                    for s, blocks in self.req_to_blocks.items())
        return self.num_gpu_blocks, sum(len(b) for b in self.req_to_blocks.values()), empty
