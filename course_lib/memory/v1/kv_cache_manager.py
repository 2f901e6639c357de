"""KVCacheManager: vLLM V1's block manager (``vllm/v1/core/kv_cache_manager.py``, vLLM 0.33.0),
for one full-attention KV-cache group, over :class:`~course_lib.memory.v1.block_pool.BlockPool`.

What V1 does differently from the V0 pair (:class:`~course_lib.memory.v0.manager.BlockManager`):

* **No copy-on-write, no swap, no fork.** A V1 request is one sequence. Parallel sampling runs
  ``n`` child requests that share the prompt's full blocks through the prefix cache; beam search
  runs outside the engine core; preemption is by recompute only.
* **No separate can-allocate probe.** The scheduler looks up the cache hit once
  (:meth:`get_computed_blocks`), then asks :meth:`allocate_slots` for room for the tokens it
  will compute this step; ``None`` means there is no room (preempt something, or wait).
  Blocks are allocated per step for the tokens scheduled (a chunk, or one decode token), not for
  the whole prompt up front.
* **Hashes are computed once per request** as its blocks fill, and kept with it (vLLM 0.33 keeps
  them on the ``Request``; the course keeps them here, per sequence). The cache salt enters the
  first block's hash only: the chain carries it to the rest (``generate_block_hash_extra_keys``).
* **Blocks are cached when they are allocated** for tokens this step computes, as vLLM does: a
  request admitted later in the same step may hit them, because in one forward pass each layer
  writes every new token's K/V before any token attends. (The V0 pair caches blocks only after
  the step ran: its preemptions and swaps can give blocks away between schedule and forward.)
* **Hits trust the hash** (sha256 by default, or vLLM's other three, ``block_pool.py``): no
  token check. The V0 pair's verified hit is the other choice; chapter 06 compares the two.
* **The watermark** (vLLM 0.33's ``watermark``, default 0) holds back blocks from waiting and
  preempted requests, never from running ones, and in vLLM only while some request is running
  (``has_scheduled_reqs=bool(self.running)`` in ``vllm/v1/core/sched/scheduler.py``; the test
  is in ``allocate_slots``): into an empty engine vLLM admits a request without it. So does the
  course: ``SchedulerV1`` passes ``admission=bool(self.running)``, and finishes as ignored only
  a request that needs more blocks than the whole pool.
"""

from __future__ import annotations

from collections.abc import Hashable

from ...sizing.units import cdiv
from ..v1_interface import V1ManagerBase
from .block_pool import (
    BlockPool,
    KVCacheBlock,
    block_hash_extra_keys,
    get_hash_fn_by_name,
    hash_block_tokens,
    none_hash_for,
)


class KVCacheManager(V1ManagerBase):
    """vLLM V1's KV-cache manager for one group of full-attention layers (module docstring).

    Keys are sequence ids (a V1 request is one sequence). ``prefix_caching_hash_algo``:
    vLLM's ``--prefix-caching-hash-algo``, ``"sha256"`` (the default), ``"sha256_cbor"``,
    ``"xxhash"`` or ``"xxhash_cbor"`` (``block_pool.HASH_FUNCTIONS``; the xxhash ones seed
    ``NONE_HASH`` at random per process unless PYTHONHASHSEED is set). Python's ``hash`` is
    the V0 pair's choice only. The accessors both V1 managers share (``has_seq``,
    ``seq_ids``, ``prefix_cache_stats``, ``record_prefix_cache_stats``, ``usage``) are
    :class:`~course_lib.memory.v1_interface.V1ManagerBase`'s.
    """

    def __init__(self, block_size: int = 16, num_gpu_blocks: int = 1024,
                 enable_caching: bool = True, watermark: float = 0.0,
                 prefix_caching_hash_algo: str = "sha256") -> None:
        super().__init__(block_size, num_gpu_blocks, enable_caching, watermark)
        self.hash_fn = get_hash_fn_by_name(prefix_caching_hash_algo)
        self.none_hash = none_hash_for(self.hash_fn)
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        self.req_to_block_hashes: dict[int, list] = {}

    # ------------------------------------------------------------------------ queries
    @property
    def num_free_gpu_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_block_table(self, seq_id: int) -> list[int]:
        """Block ids of the sequence, in order (a copy)."""
        return [b.block_id for b in self._blocks_of(seq_id)]

    # ------------------------------------------------------------------- the hashes
    def _hashes(self, seq_id: int, token_ids: list[int]) -> list:
        """The sequence's block hashes, extended to every full block of ``token_ids``."""
        hashes = self.req_to_block_hashes.setdefault(seq_id, [])
        bs, salt = self.block_size, self.salts.get(seq_id)
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), len(token_ids) // bs):
            extra = block_hash_extra_keys(i * bs, salt)   # the salt: first block only
            parent = hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs], extra,
                                       self.hash_fn, self.none_hash)
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, seq_id: int, token_ids: list[int],
                            cache_salt: Hashable = None) -> tuple[list[KVCacheBlock], int]:
        """The cached blocks of the longest prefix of full blocks of ``token_ids`` (a new or
        preempted sequence), at most ``len - 1`` tokens (the last one must be computed to
        get logits); and how many tokens they hold. Counts a prefix-cache query."""
        self.salts[seq_id] = cache_salt
        if not self.enable_caching:
            return [], 0
        hits = []
        max_blocks = (len(token_ids) - 1) // self.block_size
        for block_hash in self._hashes(seq_id, token_ids)[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    # -------------------------------------------------------------------- allocate
    def allocate_slots(self, seq_id: int, token_ids: list[int], num_computed_tokens: int,
                       num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] = (),
                       admission: bool = False) -> list[int] | None:
        """Room for ``num_new_tokens`` more tokens after ``num_computed_tokens`` (plus the
        ``new_computed_blocks`` of a prefix hit, for a sequence being admitted). Returns the
        sequence's block ids, or None if the pool is short (nothing changes). Full blocks of
        the tokens this step computes enter the prefix cache now (see the module docstring).
        ``admission``: a waiting or preempted sequence while some request is running, held to
        the watermark (vLLM's ``has_scheduled_reqs`` and status test: module docstring)."""
        total = self._tokens_to_hold(seq_id, token_ids, num_computed_tokens,
                                     len(new_computed_blocks) * self.block_size, num_new_tokens)
        blocks = self.req_to_blocks.get(seq_id, [])
        num_required = cdiv(total, self.block_size)
        num_new = num_required - len(blocks) - len(new_computed_blocks)
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        reserve = self.watermark_blocks if admission else 0
        if num_new + evictable_hits > self.num_free_gpu_blocks - reserve:
            return None
        pool = self.block_pool
        pool.touch(new_computed_blocks)
        blocks = blocks + list(new_computed_blocks) + pool.get_new_blocks(max(num_new, 0))
        self.req_to_blocks[seq_id] = blocks
        self.num_slots[seq_id] = total
        if self.enable_caching:
            num_full = total // self.block_size
            hashes = self._hashes(seq_id, token_ids[:num_full * self.block_size])
            pool.cache_full_blocks(blocks, hashes, self.num_cached_block.get(seq_id, 0),
                                   num_full)
            self.num_cached_block[seq_id] = num_full
        return [b.block_id for b in blocks]

    def free(self, seq_id: int) -> None:
        """Give the sequence's blocks back, tail first: the end of a chain is evicted before
        its beginning, which more requests are likely to share. Its hashes stay (a preempted
        sequence comes back with them) until :meth:`forget`."""
        self._blocks_of(seq_id)                      # raises if it holds none
        self.block_pool.free_blocks(reversed(self.req_to_blocks.pop(seq_id)))
        self.num_cached_block.pop(seq_id, None)
        self.num_slots.pop(seq_id, None)

    def forget(self, seq_id: int) -> None:
        """A finished sequence: drop its blocks (if any), its salt and its hashes."""
        super().forget(seq_id)
        self.req_to_block_hashes.pop(seq_id, None)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # ------------------------------------------------------------- usage and checks
    def _free_counts(self) -> tuple[int, int]:
        free = self.block_pool.free_block_queue.get_all_free_blocks()
        return len(free), sum(1 for b in free if b.block_hash is not None)

    def check_invariants(self) -> None:
        """The pool's invariants; a block's ref count is the number of tables holding it; a
        table holds the blocks its slots need, each cached block under its own hash."""
        self.block_pool.check_invariants()
        refs = [0] * self.num_gpu_blocks
        for seq_id, blocks in self.req_to_blocks.items():
            for block in blocks:
                refs[block.block_id] += 1
            assert len(blocks) == cdiv(self.num_slots[seq_id], self.block_size), \
                f"seq {seq_id}: {len(blocks)} blocks for {self.num_slots[seq_id]} slots"
            hashes = self.req_to_block_hashes.get(seq_id, [])
            for i in range(self.num_cached_block.get(seq_id, 0)):
                assert blocks[i].block_hash == hashes[i], f"seq {seq_id} block {i}: hash"
        assert refs == [b.ref_cnt for b in self.block_pool.blocks], "ref counts != tables"

