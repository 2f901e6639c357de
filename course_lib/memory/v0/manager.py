"""BlockManager: the KV-cache memory of a server in the paper's design (vLLM V0).

It answers the scheduler's questions ("is there room for this prompt? for one more token?")
and carries out its decisions (allocate, append, fork, free, swap), returning the block
copies the cache kernels must perform. It holds no tensors: block ids in, block ids out.

Names follow vLLM V0 (``BlockSpaceManager``: ``can_allocate`` / ``allocate``,
``can_append_slots`` / ``append_slots``, ``fork``, ``free``, ``swap_out`` / ``swap_in``,
``mark_blocks_as_computed``). The data flow of one step:

    can_allocate / allocate(prompt)       -> blocks for the prompt, cache hits reused
    can_append_slots / append_slots(toks) -> a slot per new token; [(src, dst)] CoW copies
    append_decode(seqs, tokens)           -> one decode token for each sequence of a group:
                                             the room check, the slots and the block ids
    mark_blocks_as_computed(n)            -> full computed blocks become prefix-cache entries
    fork(parent, child)                   -> the child shares every block (ref += 1)
    swap_out / swap_in(seqs)              -> [(src, dst)] copies between the GPU and CPU pools
    free(seq)                             -> blocks back to the pool (cached ones stay findable)

It is built from three collaborators, each with its own state: one :class:`BlockTable` per
sequence (``block_table.py``), a :class:`BlockAllocator` per device (``pool.py``: reference
counts, the free stack and the LRU of evictable cached blocks) and the :class:`PrefixCache`
(``prefix_cache.py``: chained hashes, verified lookups). Read them in that order, then this
file top to bottom.

The manager trusts its caller, the scheduler: it asks ``can_allocate`` before ``allocate``,
names only sequences that hold blocks, and so on. Its one refusal is a pool that is short:
``allocate``, ``append_slots`` and the swaps then raise ``NoFreeBlocksError`` and change
nothing (the caller should have asked first).

This is the plain version, written to be read. The scheduler runs its twin,
``FastBlockManager`` (``fast.py``): the same answers and the same state after every call (a
hypothesis test drives both with the same operations), with the decode path fused and prompt
hashing memoized.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from ...sizing.units import cdiv
from ..common import AllocStatus, BlockUsage, PrefixCacheStats
from .block_table import BlockTable, common_full_blocks
from .pool import BlockAllocator, NoFreeBlocksError
from .prefix_cache import PrefixCache, typed_salt


class BlockManager:
    """Paged KV-cache bookkeeping for a GPU pool and a CPU swap pool.

    Args:
        block_size: tokens per block, a power of two in [1, 256] (vLLM's default is 16).
        num_gpu_blocks: blocks in the GPU pool (``plan_kv_cache`` in ``course_lib/capacity.py``).
        num_cpu_blocks: blocks in the CPU swap pool (``swap_space`` GiB / block bytes).
        watermark: fraction of GPU blocks kept free when admitting *new* prompts, so that
            running sequences can still grow without being preempted at once.
        enable_prefix_caching: reuse full blocks across sequences by content hash.
        prefix_caching_hash_algo: "builtin" (fast) or "sha256" (collision-resistant).
    """

    PrefixCacheClass: type[PrefixCache] = PrefixCache   # the fast twin swaps in its own

    def __init__(self, block_size: int = 16, num_gpu_blocks: int = 1024, num_cpu_blocks: int = 0,
                 watermark: float = 0.01, enable_prefix_caching: bool = False,
                 prefix_caching_hash_algo: str = "builtin") -> None:
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.watermark = watermark
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.gpu = BlockAllocator("gpu", num_gpu_blocks)
        self.cpu = BlockAllocator("cpu", num_cpu_blocks)
        self.cache = self.PrefixCacheClass(prefix_caching_hash_algo) \
            if enable_prefix_caching else None
        # the GPU blocks that stay evictable (findable) when their last reference goes
        self._cached = self.cache.cached_block_ids() if self.cache is not None else ()
        if self.cache is not None:
            self.gpu.on_evict = self.cache.forget     # an evicted block leaves the cache
        self._tables: dict[int, BlockTable] = {}
        self.prefix_cache_stats = PrefixCacheStats(0, 0)   # tokens looked up, tokens found

    # ================================================================ allocate a prompt
    def _cached_prefix(self, table: BlockTable) -> tuple[list[int], bool]:
        """Hash every full block of a new table and find its longest cached prefix, leaving at
        least one token to compute (the model must run on something to produce the next
        token's logits); and whether the walk stopped at a hash collision."""
        self.cache.hash_blocks(table, table.num_full_blocks)
        return self.cache.match(table, (table.num_tokens - 1) // self.block_size)

    def _evictable(self, blocks: Iterable[int]) -> int:
        """How many of these cached blocks no sequence holds (a hit on one takes it out of
        the free count)."""
        return sum(1 for b in blocks if self.gpu.ref_counts[b] == 0)

    def _room(self, need: int, free: int | None = None) -> AllocStatus:
        """NEVER if ``need`` blocks exceed the pool less the watermark; OK if they fit in the
        ``free`` blocks (default: the free GPU blocks) keeping the watermark; else LATER."""
        if need > self.num_gpu_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        free = self.num_free_gpu_blocks if free is None else free
        return AllocStatus.OK if free - need >= self.watermark_blocks else AllocStatus.LATER

    def can_allocate(self, token_ids: Sequence[int] | int, extra_key: Hashable = ()) -> AllocStatus:
        """Can a prompt (token ids, or just a length) get its blocks now, later, or never?
        Given token ids and prefix caching, cached blocks count as already there. A probe:
        changes nothing."""
        num_tokens = token_ids if isinstance(token_ids, int) else len(token_ids)
        required = cdiv(num_tokens, self.block_size)
        status = self._room(required)
        if status is AllocStatus.NEVER or self.cache is None or isinstance(token_ids, int):
            return status
        probe = BlockTable(-1, self.block_size, token_ids=list(token_ids),
                           extra_key=typed_salt(extra_key))
        hits, _ = self._cached_prefix(probe)
        return self._room(required - len(hits), self.num_free_gpu_blocks - self._evictable(hits))

    def allocate(self, seq_id: int, token_ids: Sequence[int], extra_key: Hashable = ()) -> int:
        """Give a new sequence blocks for its prompt (after ``can_allocate`` said OK). Returns
        the number of prompt tokens found in the prefix cache (their K/V need no computing: a
        multiple of block_size)."""
        required = cdiv(len(token_ids), self.block_size)
        table = BlockTable(seq_id, self.block_size, token_ids=list(token_ids),
                           extra_key=typed_salt(extra_key))
        hits, collided = self._cached_prefix(table) if self.cache is not None else ([], False)
        free = self.num_free_gpu_blocks - self._evictable(hits)
        if required - len(hits) > free:
            raise NoFreeBlocksError(f"seq {seq_id} needs {required - len(hits)} new GPU blocks, "
                                    f"{free} are free; ask can_allocate() first")
        self.gpu.touch(hits)
        table.blocks = hits + self.gpu.allocate_n(required - len(hits))
        table.num_cached_blocks = len(hits)
        table.cache_parent = self.cache.identity(hits[-1]) if hits else None
        self._tables[seq_id] = table
        num_cached_tokens = len(hits) * self.block_size
        if self.cache is not None:
            self.prefix_cache_stats = self.prefix_cache_stats.record(len(token_ids),
                                                                     num_cached_tokens)
            self.cache.num_collisions += collided
        return num_cached_tokens

    # ====================================================== the sequences of one request
    def _group_plan(self, token_lists: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
        """For each sequence of a group: (the earlier one it shares the most leading full
        blocks with, how many), sharing at most its ``(len - 1) // block_size`` blocks (at
        least one token is computed). (-1, 0) for the first."""
        bs, plan = self.block_size, [(-1, 0)]
        for i in range(1, len(token_lists)):
            limit = (len(token_lists[i]) - 1) // bs
            best = max(((min(common_full_blocks(token_lists[i], token_lists[j], bs), limit), -j)
                        for j in range(i)), default=(0, 0))
            plan.append((-best[1], best[0]) if best[0] else (-1, 0))
        return plan

    def group_blocks_needed(self, token_lists: Sequence[Sequence[int]]) -> int:
        """GPU blocks a group of sequences takes when each shares the full blocks of its
        longest common prefix with an earlier one (prefix-cache hits not counted)."""
        plan = self._group_plan(token_lists)
        return sum(cdiv(len(t), self.block_size) - shared
                   for t, (_, shared) in zip(token_lists, plan, strict=True))

    def can_allocate_group(self, token_lists: Sequence[Sequence[int]],
                           extra_key: Hashable = ()) -> AllocStatus:
        """``can_allocate`` for a group that shares prefixes (see :meth:`allocate_group`)."""
        if len(token_lists) == 1:
            return self.can_allocate(token_lists[0], extra_key)
        return self._room(self.group_blocks_needed(token_lists))

    def allocate_group(self, seqs: Sequence[tuple[int, Sequence[int]]],
                       extra_key: Hashable = ()) -> list[tuple[int, int | None]]:
        """Allocate the sequences of one request together (samples or beams prefilled again
        after a recompute preemption): the first as :meth:`allocate` does, each later one
        sharing the full blocks of its longest common prefix with an earlier one, the way they
        shared them before. Returns, per sequence, ``(tokens it need not compute, the seq id
        that computes them or None)``: prefix-cache hits for the first (already computed),
        the shared prefix for the others, whose K/V the named sequence writes (the caller
        must not run a sharer before that). All or nothing: ``NoFreeBlocksError`` if the
        group does not fit now, nothing allocated."""
        if len(seqs) == 1:                               # one sequence: allocate() it
            seq_id, tokens = seqs[0]
            return [(self.allocate(seq_id, tokens, extra_key), None)]
        ids = [s for s, _ in seqs]
        token_lists = [list(t) for _, t in seqs]
        need = self.group_blocks_needed(token_lists)        # as can_allocate_group counts
        if need > self.num_free_gpu_blocks:
            raise NoFreeBlocksError(f"the group needs {need} GPU blocks, "
                                    f"{self.num_free_gpu_blocks} are free")
        plan = self._group_plan(token_lists)
        out = [(self.allocate(ids[0], token_lists[0], extra_key), None)]
        for i in range(1, len(ids)):
            seq_id, tokens, (j, shared) = ids[i], token_lists[i], plan[i]
            if not shared:
                out.append((self.allocate(seq_id, tokens, extra_key), None))
                continue
            source = self._tables[ids[j]]
            table = BlockTable(seq_id, self.block_size, token_ids=tokens,
                               extra_key=source.extra_key)
            self.gpu.touch(source.blocks[:shared])
            table.blocks = source.blocks[:shared] + self.gpu.allocate_n(
                cdiv(len(tokens), self.block_size) - shared)
            if self.cache is not None:
                table.block_hashes = source.block_hashes[:shared]
                self.cache.hash_blocks(table, table.num_full_blocks)
            self._tables[seq_id] = table
            out.append((shared * self.block_size, ids[j]))
        return out

    # ================================================== grow: append, copy-on-write
    def _append_need(self, table: BlockTable, num_new_tokens: int) -> tuple[int, bool]:
        """(new blocks, whether the shared partial last block is copied first) for
        ``num_new_tokens`` more tokens; sharing is read on the table's own device."""
        n = table.num_tokens
        refs = self.pool(table.device).ref_counts
        cow = num_new_tokens > 0 and n % self.block_size != 0 and refs[table.blocks[-1]] > 1
        return cdiv(n + num_new_tokens, self.block_size) - len(table.blocks), cow

    def num_blocks_to_append(self, seq_ids: Iterable[int]) -> int:
        """GPU blocks one more token for each of these sequences takes (a decode step of a
        group): a new block per full last block, a copy per shared partial last block. Also
        for a swapped-out group, whose sharing is the same on the CPU."""
        return sum(sum(self._append_need(self._tables[s], 1)) for s in seq_ids)

    def can_append_slots(self, seq_id: int, num_new_tokens: int = 1) -> bool:
        """Is there room for ``num_new_tokens`` more tokens (new blocks + a CoW copy)?"""
        new_blocks, cow = self._append_need(self._tables[seq_id], num_new_tokens)
        return new_blocks + cow <= self.num_free_gpu_blocks

    def append_slots(self, seq_id: int, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Reserve a slot for each new token (their K/V are written this step).

        A new block is taken only when the last one is full. If the last block is shared
        (ref > 1, after a fork) and not full, it is copied first: the sequence gets a private
        copy and the returned ``[(src, dst)]`` tells the kernels which block to copy. The
        tokens before these are computed by now, so their full blocks enter the prefix cache.
        """
        table = self._tables[seq_id]
        new_blocks, cow = self._append_need(table, len(token_ids))
        if new_blocks + cow > self.num_free_gpu_blocks:
            raise NoFreeBlocksError(f"seq {seq_id} needs {new_blocks + cow} GPU blocks, "
                                    f"{self.num_free_gpu_blocks} are free; preempt something")
        blocks = table.blocks
        copies: list[tuple[int, int]] = []
        if cow:
            src = blocks[-1]
            blocks[-1] = self.gpu.allocate()
            self.gpu.release([src])            # was > 1, stays >= 1
            copies.append((src, blocks[-1]))
        blocks.extend(self.gpu.allocate() for _ in range(new_blocks))
        num_computed_blocks = table.num_full_blocks
        table.token_ids.extend(token_ids)
        if self.cache is not None:
            if table.num_cached_blocks < num_computed_blocks:
                self.cache.register(table, num_computed_blocks)
            self.cache.hash_blocks(table, table.num_full_blocks)
        return copies

    def append_decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]
                      ) -> tuple[list[tuple[int, int]], list[list[int]]] | None:
        """One decode step of a group (a request's samples or beams) in one call: the room
        check of :meth:`num_blocks_to_append`, then ``append_slots(seq, [token])`` for each
        sequence in order, then each one's block ids. Returns ``(CoW copies, block ids)``, or
        None, changing nothing, when the GPU pool is short (preempt something). vLLM V0 asks
        this in three calls per sequence (``can_append_slots``, ``append_slots``,
        ``get_block_table``)."""
        if self.num_blocks_to_append(seq_ids) > self.num_free_gpu_blocks:
            return None
        copies: list[tuple[int, int]] = []
        for seq_id, token in zip(seq_ids, token_ids, strict=True):
            copies += self.append_slots(seq_id, [token])
        return copies, [self.get_block_table(s) for s in seq_ids]

    def mark_blocks_as_computed(self, seq_id: int, num_computed_tokens: int) -> None:
        """Tell the cache that the first ``num_computed_tokens`` tokens' K/V are written.

        Call it after the step that computed them ran (e.g. after each prefill chunk): only
        then may another request reuse those blocks. ``append_slots`` does this implicitly
        for every token before the ones it appends.
        """
        table = self._tables[seq_id]
        upto = num_computed_tokens // self.block_size
        if self.cache is not None and upto > table.num_cached_blocks:
            self.cache.register(table, upto)

    # ========================================================== share and free
    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child shares all of the parent's blocks (parallel sampling, beam search).
        Nothing is copied now; the first write to a shared partial block copies it."""
        parent = self._tables[parent_seq_id]
        self.gpu.touch(parent.blocks)
        self._tables[child_seq_id] = parent.copy(child_seq_id)

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references. Tail blocks are released first, so that cached
        chain ends are evicted before the prefixes other requests are likelier to share."""
        table = self._tables.pop(seq_id)
        if table.device == "gpu":
            self.gpu.release(reversed(table.blocks), self._cached)
        else:
            self.cpu.release(reversed(table.blocks))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks. Only possible while no GPU block is held (vLLM's rule:
        a held block may be mid-use); returns whether the reset happened."""
        if self.cache is None:
            return True
        if self.gpu.num_free_blocks != self.num_gpu_blocks:
            return False
        self.gpu.drop_evictable()
        self.cache.clear()
        return True

    # =============================================== swap: preemption to CPU memory
    # A group (one request's samples or beams) moves together: a block shared inside the group
    # moves once and stays shared. The engine runs the returned [(src, dst)] copies before any
    # other cache operation of the step (a freed GPU block may be handed out again at once).
    def _group(self, seq_ids: Iterable[int]) -> tuple[list[BlockTable], list[int]]:
        """Tables of a group of sequences and their distinct blocks."""
        tables = [self._tables[s] for s in seq_ids]
        return tables, list(dict.fromkeys(b for t in tables for b in t.blocks))

    def can_swap_out(self, seq_ids: Iterable[int]) -> bool:
        return len(self._group(seq_ids)[1]) <= self.num_free_cpu_blocks

    def swap_out(self, seq_ids: Iterable[int]) -> list[tuple[int, int]]:
        """Move the group's blocks to the CPU pool; returns ``[(gpu_block, cpu_block)]``.
        The engine must run these copies before any other cache op of the same step: the
        freed GPU blocks may be handed out again right away."""
        tables, distinct = self._group(seq_ids)
        if len(distinct) > self.num_free_cpu_blocks:
            raise NoFreeBlocksError(f"swap out needs {len(distinct)} CPU blocks, "
                                    f"{self.num_free_cpu_blocks} are free (raise swap_space)")
        mapping = {b: self.cpu.allocate() for b in distinct}
        self._move(tables, mapping, self.gpu, self.cpu)
        for table in tables:
            table.num_cached_blocks, table.cache_parent = 0, None   # re-offered after swap-in
        return list(mapping.items())

    def swap_in_need(self, seq_ids: Iterable[int]) -> int:
        """GPU blocks a swapped-out group needs to come back and decode one step: its
        distinct blocks plus :meth:`num_blocks_to_append`."""
        seq_ids = list(seq_ids)
        return len(self._group(seq_ids)[1]) + self.num_blocks_to_append(seq_ids)

    def can_swap_in(self, seq_ids: Iterable[int]) -> AllocStatus:
        """Room to swap the group in and run its next decode step, keeping the watermark?"""
        return self._room(self.swap_in_need(seq_ids))

    def swap_in(self, seq_ids: Iterable[int]) -> list[tuple[int, int]]:
        """Bring a swapped-out group back to the GPU; returns ``[(cpu_block, gpu_block)]``."""
        tables, distinct = self._group(seq_ids)
        if len(distinct) > self.num_free_gpu_blocks:
            raise NoFreeBlocksError(f"swap in needs {len(distinct)} GPU blocks, "
                                    f"{self.num_free_gpu_blocks} are free")
        mapping = {b: self.gpu.allocate() for b in distinct}
        self._move(tables, mapping, self.cpu, self.gpu)
        return list(mapping.items())

    def _move(self, tables: list[BlockTable], mapping: dict[int, int], src: BlockAllocator,
              dst: BlockAllocator) -> None:
        """Point the tables at the destination blocks (each allocated once, ref 1) and release
        the source ones; a destination block gets one reference per entry in the group."""
        seen: set[int] = set()
        for table in tables:
            old = table.blocks
            table.blocks = [mapping[b] for b in old]
            table.device = dst.device
            src.release(reversed(old), self._cached if src is self.gpu else ())
            dst.touch([b for b in table.blocks if b in seen or seen.add(b)])

    # ========================================================= read-only questions
    @property
    def num_free_gpu_blocks(self) -> int:
        """Blocks an allocation can take now: the free stack plus evictable cached blocks."""
        return self.gpu.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu.num_free_blocks

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def seq_ids(self) -> list[int]:
        return list(self._tables)

    def get_table(self, seq_id: int) -> BlockTable:
        """The sequence's table (read it, do not mutate it)."""
        return self._tables[seq_id]

    def get_block_table(self, seq_id: int) -> list[int]:
        """Physical block ids of the sequence, logical order (a copy)."""
        return list(self._tables[seq_id].blocks)

    def pool(self, device: str) -> BlockAllocator:
        """The pool of ``"gpu"`` or ``"cpu"``."""
        return self.gpu if device == "gpu" else self.cpu

    def ref_count(self, block: int, device: str = "gpu") -> int:
        return self.pool(device).ref_counts[block]

    def usage(self, device: str = "gpu") -> BlockUsage:
        """Occupancy of one pool, O(sequences on it): only a sequence's last block can have
        empty slots, and a partial block shared by several tables has the same fill in each
        (a write into a shared block copies it first), so each last block counts once."""
        pool, bs = self.pool(device), self.block_size
        entries, empty = 0, {}
        for table in self._tables.values():
            if table.device == device:
                entries += len(table.blocks)
                empty[table.blocks[-1]] = -table.num_tokens % bs
        held = pool.num_blocks - pool.num_free_blocks
        return BlockUsage(device, bs, pool.num_blocks, pool.num_free_blocks,
                          pool.num_evictable_blocks, entries, held * bs - sum(empty.values()))

    # ================================================================== invariants
    def check_invariants(self) -> None:
        """Assert the block manager's invariants (``docs/design_notes.md``): each pool's
        blocks are held, free or evictable, exactly one of them; a block's ref count is its
        number of block-table entries; evictable blocks are cached; every table is well formed
        and its cached blocks hold its tokens; ``usage()`` agrees with a block-by-block count.
        Cheap enough for tests, not for the hot path."""
        for pool in (self.gpu, self.cpu):
            pool.check_invariants()
            entries = [0] * pool.num_blocks
            filled: dict[int, int] = {}
            for table in self._tables.values():
                if table.device != pool.device:
                    continue
                last = len(table.blocks) - 1
                for i, block in enumerate(table.blocks):
                    entries[block] += 1
                    fill = self.block_size if i < last \
                        else table.num_tokens - last * self.block_size
                    filled[block] = max(filled.get(block, 0), fill)
            assert entries == pool.ref_counts, f"{pool.device}: ref counts != table entries"
            usage = self.usage(pool.device)
            assert usage.num_filled_slots == sum(filled.values()), \
                f"{pool.device}: usage() counts {usage.num_filled_slots} filled slots, " \
                f"the blocks hold {sum(filled.values())}"
        evictable = self.gpu.evictable_block_ids()
        if self.cache is None:
            assert not evictable, "evictable blocks without a prefix cache"
        else:
            self.cache.check_invariants()
            assert all(self.cache.is_cached(b) for b in evictable), "evictable block not cached"
        assert not self.cpu.evictable_block_ids(), "evictable blocks in the CPU pool"
        for table in self._tables.values():
            table.check_invariants()
            assert table.block_size == self.block_size
            if self.cache is None:
                continue
            assert len(table.block_hashes) == table.num_full_blocks, f"seq {table.seq_id}: hashes"
            for i in range(table.num_full_blocks):
                key = self.cache.key(table, i, None)
                assert self.cache.hash_fn(key.parent_hash, key.token_ids, key.extra_key) \
                    == key.block_hash, f"seq {table.seq_id} block {i}: stale hash"
                stored = self.cache.key_of(table.blocks[i]) if table.device == "gpu" else None
                assert stored is None or stored._replace(parent=None) == key, \
                    f"seq {table.seq_id} block {i}: cached block holds other tokens"
