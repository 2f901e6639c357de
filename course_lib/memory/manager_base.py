"""What the KV-cache managers share, written once.

* The argument checks every manager makes (``check_block_size``, ``check_watermark``).
* ``PrefixCacheCounters``: the prefix-cache counters (tokens looked up, tokens found) that
  every manager keeps and reports the same way (``vllm:prefix_cache_queries`` / ``_hits``).
* ``V1ManagerBase``: the state and accessors of the V1 interface that both V1 managers answer
  the same way (:class:`~course_lib.memory.KVCacheManager` over hash chains,
  :class:`~course_lib.memory.RadixKVCacheManager` over the radix tree): per-sequence maps,
  ``has_seq`` / ``seq_ids``, ``record_prefix_cache_stats``, ``forget``, ``usage`` and the
  snapshot's shape (``V1Snapshot``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

from .usage import BlockUsage, PrefixCacheStats


def check_block_size(block_size: int) -> None:
    """Raise ValueError unless ``block_size`` is a power of two in [1, 256]."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) \
            or not 1 <= block_size <= 256 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in [1, 256], got {block_size!r}")


def check_watermark(watermark: float) -> None:
    """Raise ValueError unless ``watermark`` is in [0, 1)."""
    if not 0.0 <= watermark < 1.0:
        raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")


class PrefixCacheCounters:
    """Mixed into every manager: prefix-cache lookups counted in tokens."""

    prefix_cache_queries: int       # tokens looked up (vllm:prefix_cache_queries_total)
    prefix_cache_hits: int          # of those, found (vllm:prefix_cache_hits_total)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.prefix_cache_queries, self.prefix_cache_hits)


class SeqBlocks(NamedTuple):
    """A sequence's blocks as a snapshot sees them (the V0 snapshot's table shape)."""
    blocks: list[int]
    device: str = "gpu"


class PoolState(NamedTuple):
    state: bytearray                     # HELD / FREE / EVICTABLE per block


class V1Snapshot(NamedTuple):
    """``snapshot()`` of a V1 manager; ``gpu``, ``cpu`` and ``tables`` read like V0's."""
    gpu: PoolState
    cpu: PoolState
    tables: dict[int, SeqBlocks]
    pool: tuple                          # the manager's own pool or tree state
    per_seq: tuple
    counters: tuple[int, int]


class V1ManagerBase(PrefixCacheCounters):
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
        self.prefix_cache_queries = self.prefix_cache_hits = 0

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

    def record_prefix_cache_stats(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted sequence's lookup (``vllm:prefix_cache_queries`` / ``_hits``):
        once, when it is admitted, however many steps it waited."""
        if self.enable_caching:
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
