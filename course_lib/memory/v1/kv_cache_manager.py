"""KVCacheManager: vLLM V1's block manager (``vllm/v1/core/kv_cache_manager.py``, vLLM 0.33.0),
over a :class:`~course_lib.memory.v1.kv_cache_coordinator.KVCacheCoordinator` and its
:class:`~course_lib.memory.v1.block_pool.BlockPool`.

A model of full-attention layers is one KV-cache group: the coordinator is unitary, its one
:class:`~course_lib.memory.v1.single_type_kv_cache_manager.FullAttentionManager` keeps the
tables, and everything below reads as for one table. A hybrid model (``kv_cache_groups``:
full attention beside sliding-window or chunked-local layers, chapter 14) has one table per
group, all grown, freed and hit together by the coordinator; this class does the same calls
either way. The hashes are the sequence's, one chain for all groups.

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

from bisect import bisect_left
from collections.abc import Callable, Hashable, Sequence

from ...sizing.units import cdiv
from ..v1_interface import V1ManagerBase
from .block_pool import (
    BlockPool,
    KVCacheBlock,
    block_hash_extra_keys,
    block_hash_with_group_id,
    get_hash_fn_by_name,
    hash_block_tokens,
    none_hash_for,
)
from .kv_cache_coordinator import GroupBlocks, get_kv_cache_coordinator
from .kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec


class KVCacheManager(V1ManagerBase):
    """vLLM V1's KV-cache manager (module docstring).

    Keys are sequence ids (a V1 request is one sequence). ``prefix_caching_hash_algo``:
    vLLM's ``--prefix-caching-hash-algo``, ``"sha256"`` (the default), ``"sha256_cbor"``,
    ``"xxhash"`` or ``"xxhash_cbor"`` (``block_pool.HASH_FUNCTIONS``; the xxhash ones seed
    ``NONE_HASH`` at random per process unless PYTHONHASHSEED is set). Python's ``hash`` is
    the V0 pair's choice only. The accessors both V1 managers share (``has_seq``,
    ``seq_ids``, ``prefix_cache_stats``, ``record_prefix_cache_stats``, ``usage``) are
    :class:`~course_lib.memory.v1_interface.V1ManagerBase`'s.

    ``kv_cache_groups``: a hybrid model's groups (``kv_cache_groups.get_kv_cache_groups``),
    each of ``block_size`` tokens a block, over the pool of ``num_gpu_blocks``; None (the
    default): one full-attention group. With several groups, what speaks of one table
    (``req_to_blocks``, ``req_to_block_ids``, ``num_cached_block``, :meth:`get_block_table`,
    the list :meth:`allocate_slots` returns) is group 0's; :meth:`get_block_tables` gives
    every group's, and a hit (:meth:`get_computed_blocks`) is one list per group.
    """

    def __init__(self, block_size: int = 16, num_gpu_blocks: int = 1024,
                 enable_caching: bool = True, watermark: float = 0.0,
                 prefix_caching_hash_algo: str = "sha256",
                 kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None) -> None:
        if kv_cache_groups is None:
            kv_cache_groups = (KVCacheGroupSpec(("all",), FullAttentionSpec(block_size)),)
        sizes = {g.kv_cache_spec.block_size for g in kv_cache_groups}
        if not kv_cache_groups or sizes != {block_size}:
            raise ValueError(f"kv_cache_groups must be one or more groups of block_size "
                             f"{block_size} tokens a block (got block sizes {sorted(sizes)})")
        super().__init__(block_size, num_gpu_blocks, enable_caching, watermark)
        self.hash_fn = get_hash_fn_by_name(prefix_caching_hash_algo)
        self.none_hash = none_hash_for(self.hash_fn)
        self.num_kv_cache_groups = len(kv_cache_groups)
        self.coordinator = get_kv_cache_coordinator(
            KVCacheConfig(num_gpu_blocks, tuple(kv_cache_groups)), enable_caching)
        # group 0's tables, under the names the scheduler, the connectors and chapter 12 read
        first = self.coordinator.single_type_managers[0]
        self.req_to_blocks = first.req_to_blocks
        self.req_to_block_ids = first.req_to_block_ids
        self.num_cached_block = first.num_cached_block
        self.req_to_block_hashes: dict[int, list] = {}
        # a KV connector's say over freeing (SchedulerV1 sets it): free_delay(seq_id, ids) True
        # keeps a finished sequence's blocks, held, in delayed_frees until free_delayed
        self.free_delay: Callable[[int, list[int]], bool] | None = None
        self.delayed_frees: dict[int, list[KVCacheBlock]] = {}

    # ------------------------------------------------------------------------ queries
    @property
    def block_pool(self) -> BlockPool:
        """The pool every group allocates from (the coordinator's)."""
        return self.coordinator.block_pool

    @block_pool.setter
    def block_pool(self, pool: BlockPool) -> None:
        """Put another pool under the coordinator and every group (a fidelity test's altered
        pool, a fault test's pool kept from a failed step)."""
        self.coordinator.block_pool = pool
        for manager in self.coordinator.single_type_managers:
            manager.block_pool = pool

    @property
    def num_free_gpu_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_block_table(self, seq_id: int) -> list[int]:
        """Block ids of the sequence, in order (a copy; group 0's with several groups)."""
        return list(self.req_to_block_ids[seq_id])

    def get_block_tables(self, seq_id: int) -> tuple[list[int], ...]:
        """Every group's block ids of the sequence (copies; vLLM's ``get_block_ids``): the
        null block's id where a group's window has passed."""
        return tuple(list(m.req_to_block_ids[seq_id])
                     for m in self.coordinator.single_type_managers)

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

    def get_computed_blocks(self, seq_id: int, token_ids: list[int], cache_salt: Hashable = None
                            ) -> tuple[list[KVCacheBlock] | GroupBlocks, int]:
        """The cached blocks of the longest prefix of full blocks of ``token_ids`` (a new or
        preempted sequence) that every group holds, at most ``len - 1`` tokens (the last one
        must be computed to get logits); and how many tokens they hold. The blocks: a list
        for one group, one list per group for several (null where a window has passed)."""
        self.salts[seq_id] = cache_salt
        if not self.enable_caching:
            return self._for_caller(((),) * self.num_kv_cache_groups), 0
        hashes = self._hashes(seq_id, token_ids, len(token_ids) // self.block_size)
        hits, num_hit = self.coordinator.find_longest_cache_hit(hashes, len(token_ids) - 1)
        return self._for_caller(hits), num_hit

    def _for_caller(self, hits: GroupBlocks) -> list[KVCacheBlock] | GroupBlocks:
        """A hit as callers see it: one group's list itself (chapter 12's), else per group."""
        return list(hits[0]) if self.num_kv_cache_groups == 1 else hits

    def _per_group(self, hits: Sequence[KVCacheBlock] | GroupBlocks) -> GroupBlocks:
        """A hit as the coordinator takes it: one list per group."""
        if self.num_kv_cache_groups == 1:
            return (hits,)
        return tuple(hits) if hits else ((),) * self.num_kv_cache_groups

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
        grow with the sequence: blocks, ids and hashes are extended by what this step adds.

        The steps are vLLM's: blocks that left a window are freed first (so that they can be
        reused now; with several groups this happens even when the answer is None, as in
        vLLM), then the blocks every group needs are counted against the free ones (a hit's
        free blocks count: touching takes them out of the queue), the hit is touched in every
        group, then every group's table is extended and its full blocks cached."""
        coordinator = self.coordinator
        hits = self._per_group(new_computed_blocks)
        num_computed = num_computed_tokens + len(hits[0]) * self.block_size
        total = num_computed + num_new_tokens
        coordinator.remove_skipped_blocks(seq_id, num_computed)
        num_needed = coordinator.get_num_blocks_to_allocate(seq_id, total, hits, num_computed)
        if num_needed > self.block_pool.get_num_free_blocks() - \
                (self.watermark_blocks if admission else 0):
            return None
        if any(hits):                            # a hit: touched before anything is evicted
            coordinator.allocate_new_computed_blocks(seq_id, hits, num_computed)
        coordinator.allocate_new_blocks(seq_id, total)   # extend, never rebuild
        # the table's slots: it never shrinks (after a KV connector's load failed past the
        # tokens computed, the step asks for fewer slots than the table has; vLLM keeps them)
        self.num_slots[seq_id] = max(total, self.num_slots.get(seq_id, 0))
        if not delay_cache_blocks:
            self.cache_blocks(seq_id, token_ids, total)
        return self.req_to_block_ids[seq_id]

    def cache_blocks(self, seq_id: int, token_ids: list[int], num_tokens: int) -> None:
        """Enter the sequence's blocks that ``num_tokens`` fill into the prefix cache, from
        the first not cached yet (vLLM's ``cache_blocks``). :meth:`allocate_slots` calls it
        for the tokens it makes room for; the scheduler calls it for tokens a connector loaded
        (``delay_cache_blocks``) once the load is done, for as many as arrived intact."""
        if not self.enable_caching:
            return
        num_tokens = min(num_tokens, self.num_slots[seq_id])
        hashes = self._hashes(seq_id, token_ids, num_tokens // self.block_size)
        self.coordinator.cache_blocks(seq_id, hashes, num_tokens)

    def free(self, seq_id: int) -> None:
        """Give the sequence's blocks back, tail first: the end of a chain is evicted before
        its beginning, which more requests are likely to share. Its hashes stay (a preempted
        sequence comes back with them) until :meth:`forget`. With several groups, group by
        group (vLLM's order)."""
        if self.free_delay is not None and self.free_delay(seq_id,
                                                           self.req_to_block_ids[seq_id]):
            # a transfer still reads them: held
            self.delayed_frees[seq_id] = self.coordinator.pop_blocks_for_free(seq_id)
        else:
            self.coordinator.free(seq_id)
        del self.num_slots[seq_id]

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
        return self.coordinator.reset_prefix_cache()

    # ------------------------------------------------------------- usage and checks
    def _table_counts(self) -> tuple[int, int, int]:
        """(blocks a sequence can hold, table entries, empty slots in them) over every group:
        the null block is not a block to hold, and a table's leading null entries (tokens that
        left a window) are neither entries nor slots."""
        bs, entries, empty = self.block_size, 0, 0
        for manager in self.coordinator.single_type_managers:
            for seq_id, blocks in manager.req_to_blocks.items():
                nulls = bisect_left(blocks, True, key=lambda b: not b.is_null)   # a prefix
                entries += len(blocks) - nulls
                empty += len(blocks) * bs - self.num_slots[seq_id]
        return self.block_pool.num_usable_blocks, entries, empty

    def _free_counts(self) -> tuple[int, int]:
        free = self.block_pool.free_block_queue.get_all_free_blocks()
        return len(free), sum(1 for b in free if b.block_hash is not None)

    def check_invariants(self) -> None:
        """The pool's invariants; a block's ref count is the number of tables (of every
        group) holding it, the null block aside; each group's table holds the blocks its
        slots need, each cached block under its own hash and group, and the null block only
        in its leading entries whose tokens no later token of that group reads."""
        self.block_pool.check_invariants()
        refs = [0] * self.num_gpu_blocks
        for blocks in self.delayed_frees.values():   # kept for a connector's transfer
            for block in blocks:
                refs[block.block_id] += 1
        for group, manager in enumerate(self.coordinator.single_type_managers):
            assert manager.req_to_blocks.keys() == self.num_slots.keys(), \
                f"group {group}: tables != sequences"
            for seq_id, blocks in manager.req_to_blocks.items():
                self._check_table(group, manager, seq_id, blocks, refs)
        assert refs == [b.ref_cnt for b in self.block_pool.blocks], "ref counts != tables"
        assert self.req_to_block_ids.keys() == self.req_to_blocks.keys(), "ids != tables"

    def _check_table(self, group, manager, seq_id: int, blocks: list[KVCacheBlock],
                     refs: list[int]) -> None:
        num_slots, bs = self.num_slots[seq_id], self.block_size
        num_null = next((i for i, b in enumerate(blocks) if not b.is_null), len(blocks))
        for block in blocks[num_null:]:
            assert not block.is_null, f"group {group} seq {seq_id}: a null block mid-table"
            refs[block.block_id] += 1
        assert num_null * bs <= manager.get_num_skipped_tokens(num_slots), \
            f"group {group} seq {seq_id}: {num_null} null blocks inside the window"
        assert len(blocks) == cdiv(num_slots, bs), \
            f"seq {seq_id}: {len(blocks)} blocks for {num_slots} slots (group {group})"
        assert manager.req_to_block_ids[seq_id] == [b.block_id for b in blocks], \
            f"seq {seq_id}: block ids != blocks (group {group})"
        hashes = self.req_to_block_hashes.get(seq_id, [])
        for i in range(manager.num_cached_block.get(seq_id, 0)):
            assert blocks[i].is_null or blocks[i].block_hash == \
                block_hash_with_group_id(hashes[i], group), f"seq {seq_id} block {i}: hash"
