"""BlockManager: the KV-cache memory of a server, one block table per sequence.

It answers the scheduler's questions ("is there room for this prompt? for one more token?")
and carries out its decisions (allocate, append, fork, free, swap), returning the block
copies the cache kernels must perform. It holds no tensors: block ids in, block ids out.

Names follow vLLM (v0's ``BlockSpaceManager`` for fork / copy-on-write / swap, v1's
``KVCacheManager`` for prefix caching). The data flow of one step:

    can_allocate / allocate(prompt)       -> blocks for the prompt, cache hits reused
    can_append_slots / append_slots(toks) -> a slot per new token; [(src, dst)] CoW copies
    append_decode(seqs, tokens)           -> the same for one decode token per sequence, with
                                             the room check and the tables (decode.py)
    mark_blocks_as_computed(n)            -> full computed blocks become prefix-cache entries
    fork(parent, child)                   -> the child shares every block (ref += 1)
    swap_out / swap_in(seqs)              -> [(src, dst)] copies between the GPU and CPU pools
    free(seq)                             -> blocks back to the pool (cached ones stay findable)

Group allocation (``groups.py``), the decode hot path (``decode.py``), swapping (``swap.py``),
marking blocks computed (``cache_control.py``), the read-only questions and ``usage()``
(``queries.py``) and snapshots (``manager_snapshot.py``) are mixed in from their own modules;
the answers it gives are in ``usage.py``, what it shares with the V1 managers in
``manager_base.py``.
Every method checks its input before it changes anything, so a rejected call (ValueError, or
NoFreeBlocksError when the pool is short) leaves the manager exactly as it was.
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Iterable, Sequence

from .block_table import BlockTable, cdiv
from .cache_control import PrefixCacheControl
from .decode import DecodePath
from .groups import GroupAllocation
from .manager_base import PrefixCacheCounters, check_block_size, check_watermark
from .manager_snapshot import ManagerSnapshot, SnapshotRestore
from .pool import BlockAllocator, NoFreeBlocksError
from .prefix_cache import PrefixCache, typed_salt
from .queries import ManagerQueries
from .swap import SwapPath
from .usage import AllocStatus, BlockUsage, PrefixCacheStats

__all__ = ["AllocStatus", "BlockManager", "BlockUsage", "ManagerSnapshot", "PrefixCacheStats"]


class BlockManager(ManagerQueries, PrefixCacheCounters, PrefixCacheControl, GroupAllocation,
                   DecodePath, SwapPath, SnapshotRestore):
    """Paged KV-cache bookkeeping for a GPU pool and a CPU swap pool.

    Args:
        block_size: tokens per block, a power of two in [1, 256] (vLLM's default is 16).
        num_gpu_blocks: blocks in the GPU pool (see ``course_lib.capacity.num_gpu_blocks``).
        num_cpu_blocks: blocks in the CPU swap pool (``swap_space`` GiB / block bytes).
        watermark: fraction of GPU blocks kept free when admitting *new* prompts, so that
            running sequences can still grow without being preempted at once.
        enable_prefix_caching: reuse full blocks across sequences by content hash.
        prefix_caching_hash_algo: "builtin" (fast) or "sha256" (collision-resistant).
    """

    def __init__(self, block_size: int = 16, num_gpu_blocks: int = 1024, num_cpu_blocks: int = 0,
                 watermark: float = 0.01, enable_prefix_caching: bool = False,
                 prefix_caching_hash_algo: str = "builtin") -> None:
        check_block_size(block_size)
        for name, value in (("num_gpu_blocks", num_gpu_blocks), ("num_cpu_blocks", num_cpu_blocks)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        check_watermark(watermark)
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.watermark = watermark
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.gpu = BlockAllocator("gpu", num_gpu_blocks)
        self.cpu = BlockAllocator("cpu", num_cpu_blocks)
        cache = PrefixCache(prefix_caching_hash_algo)   # validates the algorithm name
        self.cache = cache if enable_prefix_caching else None
        # what the GPU pool must keep evictable when a block's last reference goes
        self._cached: Container[int] = cache.cached_block_ids() if self.cache else ()
        if self.cache is not None:
            self.gpu.on_evict = cache.forget
        self._tables: dict[int, BlockTable] = {}
        self.prefix_cache_queries = 0   # tokens (vllm:prefix_cache_queries_total)
        self.prefix_cache_hits = 0      # tokens (vllm:prefix_cache_hits_total)

    # -------------------------------------------------------------- allocate a prompt
    def _blocks_needed(self, num_tokens: int) -> int:
        if num_tokens < 1:
            raise ValueError(f"a sequence needs at least 1 token, got {num_tokens}")
        return cdiv(num_tokens, self.block_size)

    def can_allocate(self, token_ids: Sequence[int] | int, extra_key: Hashable = ()) -> AllocStatus:
        """Can a prompt (token ids, or just a length) get its blocks now, later, or never?
        Given token ids and prefix caching, cached blocks count as already there."""
        num_tokens = token_ids if isinstance(token_ids, int) else len(token_ids)
        required, watermark = self._blocks_needed(num_tokens), self.watermark_blocks
        if required > self.num_gpu_blocks - watermark:
            return AllocStatus.NEVER
        free = self.num_free_gpu_blocks
        if free - required >= watermark:
            return AllocStatus.OK                # hits could only leave more room
        if self.cache is not None and not isinstance(token_ids, int):
            if free - required + (num_tokens - 1) // self.block_size < watermark:
                return AllocStatus.LATER         # even if every full block were a free hit
            extra = typed_salt(extra_key)
            hashes, blocks = self.cache.hash_prompt(token_ids, self.block_size, extra)
            hits, _ = self.cache.match(hashes, blocks, extra, (num_tokens - 1) // self.block_size)
            required -= len(hits)
            refs = self.gpu.ref_counts
            free -= sum(1 for b in hits if refs[b] == 0)
        return AllocStatus.OK if free - required >= watermark else AllocStatus.LATER

    def allocate(self, seq_id: int, token_ids: Sequence[int], extra_key: Hashable = ()) -> int:
        """Give a new sequence blocks for its prompt. Returns the number of prompt tokens found
        in the prefix cache (their K/V need no computing: a multiple of block_size)."""
        if seq_id in self._tables:
            raise ValueError(f"seq {seq_id!r} is already allocated; free it or use a new id")
        required = self._blocks_needed(len(token_ids))
        if required > self.num_gpu_blocks:
            raise ValueError(f"a prompt of {len(token_ids)} tokens needs {required} blocks but the "
                             f"GPU pool has {self.num_gpu_blocks}: it can never fit")
        table = BlockTable(seq_id, self.block_size, token_ids=list(token_ids),
                           extra_key=typed_salt(extra_key))
        hits: list[int] = []
        collided = False
        if self.cache is not None:
            hits, collided = self.cache.hash_and_match(table)
        free = self.num_free_gpu_blocks
        if hits:                                         # evictable hits leave the free count
            free -= list(map(self.gpu.ref_counts.__getitem__, hits)).count(0)
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
            self.prefix_cache_queries += len(token_ids)
            self.prefix_cache_hits += num_cached_tokens
            self.cache.num_collisions += collided
        return num_cached_tokens

    # ----------------------------------------------------- grow: the decode hot path
    def _append_need(self, table: BlockTable, num_new_tokens: int) -> tuple[int, bool]:
        """(new blocks, whether the shared partial last block is copied first) for
        ``num_new_tokens`` more tokens; sharing is read on the table's own device."""
        n, blocks = len(table.token_ids), table.blocks
        refs = self.gpu.ref_counts if table.device == "gpu" else self.cpu.ref_counts
        cow = num_new_tokens > 0 and n % self.block_size != 0 and refs[blocks[-1]] > 1
        return (n + num_new_tokens + self.block_size - 1) // self.block_size - len(blocks), cow

    def num_blocks_to_append(self, seq_ids: Iterable[int]) -> int:
        """GPU blocks one more token for each of these sequences takes (a decode step of a
        group): a new block per full last block, a copy per shared partial last block. Also
        for a swapped-out group, whose sharing is the same on the CPU."""
        bs, tables, need = self.block_size, self._tables, 0
        for seq_id in seq_ids:          # _append_need(table, 1), inlined: once per decode
            table = tables.get(seq_id) or self._get(seq_id)
            if len(table.token_ids) % bs == 0:
                need += 1               # the last block is full: a new one
            elif (self.gpu if table.device == "gpu" else self.cpu).ref_counts[
                    table.blocks[-1]] > 1:
                need += 1               # a shared partial last block: its copy
        return need

    def can_append_slots(self, seq_id: int, num_new_tokens: int = 1) -> bool:
        """Is there room for ``num_new_tokens`` more tokens (new blocks + a CoW copy)?"""
        table = self._tables.get(seq_id)
        if table is not None and table.device == "gpu" and num_new_tokens >= 0:
            free_slots = -len(table.token_ids) % self.block_size
            if num_new_tokens <= free_slots and self.gpu.ref_counts[table.blocks[-1]] == 1:
                return True                    # fast path: room in a private last block
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        new_blocks, cow = self._append_need(self._get(seq_id, "gpu"), num_new_tokens)
        return new_blocks + cow <= self.num_free_gpu_blocks

    def append_slots(self, seq_id: int, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Reserve a slot for each new token (their K/V are written this step).

        A new block is taken only when the last one is full. If the last block is shared
        (ref > 1, after a fork) and not full, it is copied first: the sequence gets a private
        copy and the returned ``[(src, dst)]`` tells the kernels which block to copy.
        """
        table = self._tables.get(seq_id)
        if table is None or table.device != "gpu":
            self._get(seq_id, "gpu")           # raises the explanatory error
        tokens, bs = table.token_ids, self.block_size
        n = len(tokens)
        if 0 < n % bs < bs - len(token_ids) and self.gpu.ref_counts[table.blocks[-1]] == 1 \
                and (self.cache is None or table.num_cached_blocks == n // bs):
            tokens.extend(token_ids)           # fast path: the last block is private, stays
            return []                          # partial, and nothing waits to be cached
        new_blocks, cow = self._append_need(table, len(token_ids))
        if new_blocks + cow > self.num_free_gpu_blocks:
            raise NoFreeBlocksError(f"seq {seq_id} needs {new_blocks + cow} GPU blocks, "
                                    f"{self.num_free_gpu_blocks} are free; preempt something")
        blocks, allocate = table.writable_blocks(), self.gpu.allocate
        copies: list[tuple[int, int]] = []
        if cow:
            src = blocks[-1]
            blocks[-1] = allocate()
            self.gpu.release((src,))           # was > 1, stays >= 1
            copies.append((src, blocks[-1]))
        for _ in range(new_blocks):
            blocks.append(allocate())
        if self.cache is not None:
            tokens.extend(token_ids)           # tokens before these are computed by now:
            if table.num_cached_blocks < n // bs:
                self.cache.register(table, n // bs)
            if len(table.block_hashes) < len(tokens) // bs:
                self.cache.hash_blocks(table, len(tokens) // bs)
        else:
            tokens.extend(token_ids)
        return copies

    # ----------------------------------------------------------------- share and free
    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child shares all of the parent's blocks (parallel sampling, beam search).
        Nothing is copied now; the first write to a shared partial block copies it."""
        parent = self._get(parent_seq_id, "gpu")
        if child_seq_id in self._tables:
            raise ValueError(f"seq {child_seq_id!r} is already allocated; pick a new child id")
        self.gpu.touch(parent.blocks)
        self._tables[child_seq_id] = parent.copy(child_seq_id)

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references. Tail blocks are released first, so that cached
        chain ends are evicted before the prefixes other requests are likelier to share."""
        table = self._get(seq_id)
        del self._tables[seq_id]
        if table.device == "gpu":
            self.gpu.release(reversed(table.blocks), self._cached)
        else:
            self.cpu.release(reversed(table.blocks))

    # ---------------------------------------------------------------------------- checks
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
