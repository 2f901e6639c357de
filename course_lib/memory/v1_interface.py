"""The V1 interface that two designs implement: vLLM V1's ``KVCacheManager`` over hash chains
(``v1/kv_cache_manager.py``) and the same calls over SGLang's radix tree
(``radix/kv_cache_manager.py``). The V1 scheduler (``scheduler/v1.py``) drives either one.

``V1ManagerBase`` holds what both answer alike: the per-sequence maps, ``has_seq`` /
``seq_ids``, the prefix-cache counters (``record_prefix_cache_stats``, ``prefix_cache_stats``),
``forget`` and ``usage``. Each design subclasses it
with its own pool: the base is a real class with state, not a mixin.
"""

from __future__ import annotations

from collections.abc import Hashable

from ..sizing.blocks import check_block_size
from .common import BlockUsage, PrefixCacheStats, check_watermark


class V1ManagerBase:
    """What both V1 managers hold and answer alike. Keys are sequence ids (a V1 request is
    one sequence); a subclass sets ``req_to_blocks[seq]`` and ``num_slots[seq]`` together,
    and says how many of its free blocks are cached (:meth:`_free_counts`)."""

    num_free_cpu_blocks = 0                          # V1: no swap space

    def __init__(self, block_size: int, num_gpu_blocks: int, enable_caching: bool,
                 watermark: float) -> None:
        check_block_size(block_size)
        if isinstance(num_gpu_blocks, bool) or not isinstance(num_gpu_blocks, int) \
                or num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be an int >= 1, got {num_gpu_blocks!r}")
        check_watermark(watermark)
        self.block_size, self.num_gpu_blocks = block_size, num_gpu_blocks
        self.num_cpu_blocks = 0
        self.enable_caching = enable_caching
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.req_to_blocks: dict[int, list] = {}
        self.num_slots: dict[int, int] = {}          # tokens with a slot
        self.num_cached_block: dict[int, int] = {}   # leading blocks that are the cache's
        self.salts: dict[int, Hashable] = {}
        self.prefix_cache_queries = 0     # tokens looked up (vllm:prefix_cache_queries_total)
        self.prefix_cache_hits = 0        # of those, found (vllm:prefix_cache_hits_total)
        self.prefix_cache_preempted_queries = 0   # re-admissions after a preemption, apart
        self.prefix_cache_preempted_hits = 0

    # ------------------------------------------------------------------------ queries
    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self.req_to_blocks

    def seq_ids(self) -> list[int]:
        return list(self.req_to_blocks)

    def _blocks_of(self, seq_id: int) -> list:
        """The sequence's blocks (the list itself); ValueError if it holds none."""
        if seq_id not in self.req_to_blocks:
            raise ValueError(f"seq {seq_id!r} has no blocks")
        return self.req_to_blocks[seq_id]

    def _tokens_to_hold(self, seq_id: int, token_ids: list[int], num_computed_tokens: int,
                        num_hit_tokens: int, num_new_tokens: int) -> int:
        """The tokens ``allocate_slots`` must give slots to, after checking its arguments."""
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        total = num_computed_tokens + num_hit_tokens + num_new_tokens
        if total > len(token_ids):
            raise ValueError(f"seq {seq_id}: {total} tokens to hold, it has {len(token_ids)}")
        return total

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.prefix_cache_queries, self.prefix_cache_hits)

    def record_prefix_cache_stats(self, num_tokens: int, num_hit_tokens: int,
                                  preempted: bool = False) -> None:
        """Count one admitted sequence's lookup (``vllm:prefix_cache_queries`` / ``_hits``):
        once, when it is admitted, however many steps it waited. A sequence admitted again
        after a preemption counts apart (``prefix_cache_preempted_queries`` / ``_hits``), as
        vLLM 0.33.0's ``PrefixCacheStats.record`` counts it: not in the exported counters."""
        if not self.enable_caching:
            return
        if preempted:
            self.prefix_cache_preempted_queries += num_tokens
            self.prefix_cache_preempted_hits += num_hit_tokens
        else:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

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
        held = self.num_gpu_blocks - free
        empty = sum(len(blocks) * bs - self.num_slots[s]
                    for s, blocks in self.req_to_blocks.items())
        return BlockUsage("gpu", bs, self.num_gpu_blocks, free, cached_free,
                          sum(len(b) for b in self.req_to_blocks.values()), held * bs - empty)
