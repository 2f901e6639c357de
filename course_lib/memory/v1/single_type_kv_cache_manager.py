"""One KV-cache group's block tables: vLLM 0.33.0's ``SingleTypeKVCacheManager`` and three of
its subclasses (``vllm/v1/core/single_type_kv_cache_manager.py``), at the course's size.

A manager keeps, per sequence, the group's block table (``req_to_blocks``, its ids kept
alongside in ``req_to_block_ids``) and how many of its leading blocks are in the prefix cache
(``num_cached_block``), all over the pool every group shares. What differs between kinds of
layers is two questions, each one method:

* **Which tokens will never be read again?** (:meth:`~SingleTypeKVCacheManager.
  get_num_skipped_tokens`). Full attention: none. Sliding window ``w``: the next token reads
  the last ``w - 1`` computed ones, so after ``n`` computed tokens the first
  ``n - w + 1`` are skipped. Chunked local (chunk ``c``): every token before the current
  chunk, ``n // c * c``. :meth:`~SingleTypeKVCacheManager.remove_skipped_blocks` frees the
  blocks wholly made of skipped tokens and puts the pool's null block in their place in the
  table, so that the table keeps its positions (block ``i`` holds tokens
  ``i * block_size ..``) and the model runner's kernels skip the null entries.
* **What is a prefix-cache hit?** (``find_longest_cache_hit``). Full attention: the leading
  run of cached blocks (a miss ends it: hashes are chained). Sliding window: only the blocks
  the next token reads must be cached, so the scan goes from the right and stops at the first
  run of ``cdiv(w - 1, block_size)`` cached blocks; everything before the run is the null
  block (a hit of ``n`` tokens whose first ones are not cached at all). Chunked local: the
  blocks of earlier chunks are null, the current chunk's are looked up from its start.

Course choices, declared: sequence ids for requests, and block hashes handed in (vLLM reads
``request.block_hashes``); ``find_longest_cache_hit`` an instance method for this group
(vLLM's is a classmethod over a list of groups of one spec, which the coordinator batches);
``req_to_block_ids`` kept beside the blocks (the course's scheduler hands that list to the
model runner, growing in place; vLLM's model runner keeps its own block table); one block
size for every group and the hash block size equal to it, so no alignment beyond a block and
no fine-grained (partial-block) hits; ``req_to_blocks`` a plain dict (vLLM's a
``defaultdict``, whose reads create entries). Left out: EAGLE's dropped last block, KV
connectors' external tokens for a windowed group, sparse retention (``reachable_block_mask``,
``retention_interval``: a sliding-window group caches every full block, as vLLM does at its
default alignment), copy-on-write of partial hits, zeroing new blocks, the admission cap, and
vLLM's other managers: ``MambaManager`` (linear-attention state), ``RSWAManager``,
``CircularBufferManager``, ``CrossAttentionManager``, ``SinkFullAttentionManager`` and the
HiSparse ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from ...sizing.units import cdiv
from .block_pool import BlockPool, KVCacheBlock
from .kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)


class SingleTypeKVCacheManager:
    """One group's tables (module docstring); subclasses answer the two questions. The
    coordinator calls it; it trusts its caller (sequence ids it knows, hits of its group)."""

    def __init__(self, kv_cache_spec: AttentionSpec, block_pool: BlockPool,
                 kv_cache_group_id: int, enable_caching: bool = True) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[int, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[int, list[int]] = {}     # the same blocks' ids
        self.num_cached_block: dict[int, int] = {}           # leading blocks in the cache

    # ------------------------------------------------------------------ allocating
    def get_num_blocks_to_allocate(self, seq_id: int, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int) -> int:
        """Blocks the pool must give for ``num_tokens`` slots: new blocks, plus the hit blocks
        that are free now (touching them takes them out of the free queue). Hit blocks that
        fall out of the window are not taken at all (vLLM's ``get_num_blocks_to_allocate``).
        ``total_computed_tokens``: computed ones, hit included."""
        num_required = cdiv(num_tokens, self.block_size)
        num_req_blocks = len(self.req_to_blocks.get(seq_id, ()))
        if seq_id in self.num_cached_block:       # running: no new hit
            return max(num_required - num_req_blocks, 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) \
            // self.block_size
        num_new = max(num_required - max(num_skipped_blocks,
                                         len(new_computed_blocks) + num_req_blocks), 0)
        kept_hits = new_computed_blocks[max(0, num_skipped_blocks - num_req_blocks):]
        return num_new + sum(1 for b in kept_hits if b.ref_cnt == 0 and not b.is_null)

    def add_local_computed_blocks(self, seq_id: int,
                                  new_computed_blocks: Sequence[KVCacheBlock],
                                  num_computed_tokens: int) -> None:
        """A new sequence's hit enters its table: hit blocks already out of the window are
        null, the others touched (one more holder each). They count as cached."""
        null = self.block_pool.null_block
        num_skipped = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        kept = new_computed_blocks[num_skipped:]
        self.block_pool.touch(kept)
        blocks = [null] * num_skipped + list(kept)
        self.req_to_blocks[seq_id] = blocks
        self.req_to_block_ids[seq_id] = [b.block_id for b in blocks]
        self.num_cached_block[seq_id] = len(blocks)

    def allocate_new_blocks(self, seq_id: int, num_tokens: int) -> list[KVCacheBlock]:
        """Blocks from the pool until the table has slots for ``num_tokens``; the table and
        its ids are extended in place (a decode step costs the same at any length)."""
        blocks = self.req_to_blocks.setdefault(seq_id, [])
        ids = self.req_to_block_ids.setdefault(seq_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        ids.extend(b.block_id for b in new_blocks)
        return new_blocks

    def cache_blocks(self, seq_id: int, block_hashes: Sequence[bytes], num_tokens: int) -> None:
        """Enter the blocks ``num_tokens`` fill into the prefix cache, from the first not
        cached yet (null blocks are skipped by the pool)."""
        num_cached = self.num_cached_block.get(seq_id, 0)
        num_full = min(num_tokens // self.block_size, len(block_hashes))
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(self.req_to_blocks[seq_id], block_hashes,
                                              num_cached, num_full, self.kv_cache_group_id)
            self.num_cached_block[seq_id] = num_full

    # ---------------------------------------------------------------------- freeing
    def pop_blocks_for_free(self, seq_id: int) -> list[KVCacheBlock]:
        """Forget the sequence; its blocks, in table order, without the null ones (they lead
        the table: vLLM's ``trim_null_head``). ``KeyError`` for a sequence without a table."""
        blocks = self.req_to_blocks.pop(seq_id)
        del self.req_to_block_ids[seq_id]
        self.num_cached_block.pop(seq_id, None)
        return [b for b in blocks if not b.is_null]

    def free(self, seq_id: int) -> None:
        """Give the sequence's blocks back, tail first: the end of a chain is evicted before
        its beginning, which more requests are likely to share."""
        self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(seq_id)))

    def remove_skipped_blocks(self, seq_id: int, num_computed_tokens: int) -> None:
        """Free the blocks that no token from ``num_computed_tokens`` on will read, and put
        the null block in their place, back to front, stopping at the first null (the ones
        before were removed already). They are freed in that order: the block that left the
        window last is freed first (vLLM's ``_remove_blocks_in_range``)."""
        num_skipped = self.get_num_skipped_tokens(num_computed_tokens)
        blocks = self.req_to_blocks.get(seq_id)
        if num_skipped <= 0 or blocks is None:
            return
        null, ids, freed = self.block_pool.null_block, self.req_to_block_ids[seq_id], []
        for i in range(min(num_skipped // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break
            freed.append(blocks[i])
            blocks[i], ids[i] = null, null.block_id
        if freed:
            self.block_pool.free_blocks(freed)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no later token reads (module docstring). Full attention: none."""
        return 0

    # ------------------------------------------------------------------- cache hits
    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_length: int) -> tuple[list[KVCacheBlock], int]:
        """The longest hit of at most ``max_length`` tokens (whole blocks): its blocks, null
        where the group needs nothing, and its length in tokens."""
        raise NotImplementedError


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every block is kept; a hit is the leading run of cached blocks."""

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_length: int) -> tuple[list[KVCacheBlock], int]:
        hits, pool, group = [], self.block_pool, self.kv_cache_group_id
        for block_hash in islice(block_hashes, max_length // self.block_size):
            block = pool.get_cached_block(block_hash, group)
            if block is None:
                break                       # chained hashes: every later block misses too
            hits.append(block)
        return hits, len(hits) * self.block_size


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window ``w``: blocks before the window are freed; a hit needs only the last
    ``cdiv(w - 1, block_size)`` blocks before its end cached (vLLM's
    ``SlidingWindowManager``)."""

    def __init__(self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool,
                 kv_cache_group_id: int, enable_caching: bool = True) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, enable_caching)
        self.sliding_window = kv_cache_spec.sliding_window

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """The next token (at ``num_computed_tokens``) reads the ``w - 1`` before it: window
        4, 7 computed: tokens 4..7 are its window, 0..3 skipped (4)."""
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_length: int) -> tuple[list[KVCacheBlock], int]:
        """From the right: the first run of ``cdiv(w - 1, block_size)`` cached blocks ends the
        hit, nulls before it. Without such a run, the run that starts at block 0 (shorter than
        the window, so the whole prefix is cached) is the hit, however short."""
        need = cdiv(self.sliding_window - 1, self.block_size)
        pool, group = self.block_pool, self.kv_cache_group_id
        hits = [pool.null_block] * (max_length // self.block_size)
        run = 0
        for i in range(len(hits) - 1, -1, -1):
            block = pool.get_cached_block(block_hashes[i], group)
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run >= need:
                del hits[i + run:]               # [null, null, 8, 3, null, 9] -> [.., 8, 3]
                return hits, len(hits) * self.block_size
        del hits[run:]
        return hits, len(hits) * self.block_size


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention (chunk ``c``): blocks of earlier chunks are freed; a hit is
    null up to the current chunk, then the chunk's leading run of cached blocks (vLLM's
    ``ChunkedLocalAttentionManager``; a chunk is a multiple of the block size)."""

    def __init__(self, kv_cache_spec: ChunkedLocalAttentionSpec, block_pool: BlockPool,
                 kv_cache_group_id: int, enable_caching: bool = True) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, enable_caching)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Every token before the chunk of the next one: chunk 8, 13 computed: 8."""
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_length: int) -> tuple[list[KVCacheBlock], int]:
        pool, group = self.block_pool, self.kv_cache_group_id
        chunk_start = max_length // self.attention_chunk_size * self.attention_chunk_size
        hits = [pool.null_block] * (chunk_start // self.block_size)
        for i in range(len(hits), max_length // self.block_size):
            block = pool.get_cached_block(block_hashes[i], group)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size


def get_manager_for_kv_cache_spec(kv_cache_spec: AttentionSpec, block_pool: BlockPool,
                                  kv_cache_group_id: int,
                                  enable_caching: bool = True) -> SingleTypeKVCacheManager:
    """The manager for a group's spec (vLLM's ``get_manager_for_kv_cache_spec``)."""
    manager_cls = {FullAttentionSpec: FullAttentionManager,
                   SlidingWindowSpec: SlidingWindowManager,
                   ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager}[type(kv_cache_spec)]
    return manager_cls(kv_cache_spec, block_pool, kv_cache_group_id, enable_caching)
