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
  them on the ``Request``, extended by its block hasher as tokens arrive; the course keeps them
  here, per sequence). The cache salt enters the first block's hash only: the chain carries it
  to the rest (``generate_block_hash_extra_keys``).
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
* **A decode step costs the same at any length**: the sequence's blocks, their ids and its
  hashes are lists extended in place (``single_type_kv_cache_manager.py``'s
  ``allocate_new_blocks`` does ``req_blocks.extend(new_blocks)``; ``cache_blocks`` hashes and
  caches only the blocks that became full, from ``num_cached_block`` on). Nothing that grows
  with the sequence is sliced, rebuilt or copied per token, and the block-id list
  :meth:`allocate_slots` returns is the one it keeps: it grows in place, as the block table
  vLLM's model runner keeps for a request does (the scheduler reads it for one step).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

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
        self.req_to_block_ids: dict[int, list[int]] = {}   # req_to_blocks' ids, kept alongside
        # a KV connector's say over freeing (SchedulerV1 sets it): free_delay(seq_id, ids) True
        # keeps a finished sequence's blocks, held, in delayed_frees until free_delayed
        self.free_delay: Callable[[int, list[int]], bool] | None = None
        self.delayed_frees: dict[int, list[KVCacheBlock]] = {}

    # ------------------------------------------------------------------------ queries
    @property
    def num_free_gpu_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_block_table(self, seq_id: int) -> list[int]:
        """Block ids of the sequence, in order (a copy)."""
        return list(self.req_to_block_ids[seq_id])

    # ------------------------------------------------------------------- the hashes
    def _hashes(self, seq_id: int, token_ids: list[int], num_blocks: int) -> list:
        """The sequence's block hashes, extended (in place) to its first ``num_blocks`` full
        blocks of ``token_ids``: only the blocks not hashed yet are read, so a decode step
        hashes at most the one block it filled (vLLM's ``Request.block_hashes``, which its
        block hasher extends as tokens arrive)."""
        hashes = self.req_to_block_hashes.setdefault(seq_id, [])
        if len(hashes) >= num_blocks:
            return hashes
        bs, salt = self.block_size, self.salts.get(seq_id)
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
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
        hits, get_cached_block = [], self.block_pool.get_cached_block
        hashes = self._hashes(seq_id, token_ids, len(token_ids) // self.block_size)
        for i in range((len(token_ids) - 1) // self.block_size):
            block = get_cached_block(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    # -------------------------------------------------------------------- allocate
    def allocate_slots(self, seq_id: int, token_ids: list[int], num_computed_tokens: int,
                       num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] = (),
                       admission: bool = False, delay_cache_blocks: bool = False
                       ) -> list[int] | None:
        """Room for ``num_new_tokens`` more tokens after ``num_computed_tokens`` (plus the
        ``new_computed_blocks`` of a prefix hit, for a sequence being admitted). Returns the
        sequence's block ids, or None if the pool is short (nothing changes). Full blocks of
        the tokens this step computes enter the prefix cache now (see the module docstring).
        ``admission``: a waiting or preempted sequence while some request is running, held to
        the watermark (vLLM's ``has_scheduled_reqs`` and status test: module docstring).
        ``delay_cache_blocks`` (vLLM's name): the tokens are a KV connector's to load between
        steps, so their blocks hold nothing yet and must not be hit by another request; they
        enter the cache once the load is done (:meth:`cache_blocks`).

        The list returned is the sequence's own, not a copy: it grows in place as blocks are
        added (read it before the next call for this sequence, or copy it). Its cost does not
        grow with the sequence: blocks, ids and hashes are extended by what this step adds."""
        bs = self.block_size
        total = num_computed_tokens + len(new_computed_blocks) * bs + num_new_tokens
        req_blocks = self.req_to_blocks.get(seq_id)
        num_new = cdiv(total, bs) - len(new_computed_blocks) - \
            (len(req_blocks) if req_blocks is not None else 0)
        pool = self.block_pool
        num_free = pool.free_block_queue.num_free_blocks
        if new_computed_blocks:                  # a hit on a free block takes it out of the queue
            num_free -= sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new > num_free - (self.watermark_blocks if admission else 0):
            return None
        if req_blocks is None:
            req_blocks = self.req_to_blocks[seq_id] = []
            self.req_to_block_ids[seq_id] = []
        block_ids = self.req_to_block_ids[seq_id]
        if new_computed_blocks:                  # a hit: touched before anything is evicted
            pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            block_ids.extend(b.block_id for b in new_computed_blocks)
        if num_new > 0:                          # allocate_new_blocks: extend, never rebuild
            new_blocks = pool.get_new_blocks(num_new)
            req_blocks.extend(new_blocks)
            block_ids.extend(b.block_id for b in new_blocks)
        self.num_slots[seq_id] = total
        if not delay_cache_blocks:
            self.cache_blocks(seq_id, token_ids, total)
        return block_ids

    def cache_blocks(self, seq_id: int, token_ids: list[int], num_tokens: int) -> None:
        """Enter the sequence's blocks that ``num_tokens`` fill into the prefix cache, from
        the first not cached yet (vLLM's ``cache_blocks``). :meth:`allocate_slots` calls it
        for the tokens it makes room for; the scheduler calls it for tokens a connector loaded
        (``delay_cache_blocks``) once the load is done, for as many as arrived intact."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens, self.num_slots[seq_id]) // self.block_size
        num_cached = self.num_cached_block.get(seq_id, 0)
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(self.req_to_blocks[seq_id],
                                              self._hashes(seq_id, token_ids, num_full),
                                              num_cached, num_full)
            self.num_cached_block[seq_id] = num_full

    def free(self, seq_id: int) -> None:
        """Give the sequence's blocks back, tail first: the end of a chain is evicted before
        its beginning, which more requests are likely to share. Its hashes stay (a preempted
        sequence comes back with them) until :meth:`forget`."""
        blocks = self.req_to_blocks.pop(seq_id)
        if self.free_delay is not None and self.free_delay(seq_id,
                                                           self.req_to_block_ids[seq_id]):
            self.delayed_frees[seq_id] = blocks      # a transfer still reads them: held
        else:
            self.block_pool.free_blocks(reversed(blocks))
        self.req_to_block_ids.pop(seq_id, None)
        self.num_cached_block.pop(seq_id, None)
        self.num_slots.pop(seq_id, None)

    def free_delayed(self, seq_id: int) -> None:
        """The connector is done with a finished sequence's blocks (``free_delay`` kept
        them): give them back now, tail first. Nothing if none were kept."""
        blocks = self.delayed_frees.get(seq_id)
        if blocks is not None:
            self.block_pool.free_blocks(reversed(blocks))
            del self.delayed_frees[seq_id]

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
        for blocks in self.delayed_frees.values():   # kept for a connector's transfer
            for block in blocks:
                refs[block.block_id] += 1
        for seq_id, blocks in self.req_to_blocks.items():
            for block in blocks:
                refs[block.block_id] += 1
            assert len(blocks) == cdiv(self.num_slots[seq_id], self.block_size), \
                f"seq {seq_id}: {len(blocks)} blocks for {self.num_slots[seq_id]} slots"
            assert self.req_to_block_ids[seq_id] == [b.block_id for b in blocks], \
                f"seq {seq_id}: block ids != blocks"
            hashes = self.req_to_block_hashes.get(seq_id, [])
            for i in range(self.num_cached_block.get(seq_id, 0)):
                assert blocks[i].block_hash == hashes[i], f"seq {seq_id} block {i}: hash"
        assert refs == [b.ref_cnt for b in self.block_pool.blocks], "ref counts != tables"
        assert self.req_to_block_ids.keys() == self.req_to_blocks.keys(), "ids != tables"
