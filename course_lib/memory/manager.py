"""BlockManager: the KV-cache memory of a server, one block table per sequence.

It answers the scheduler's questions ("is there room for this prompt? for one more token?")
and carries out its decisions (allocate, append, fork, free, swap), returning the block
copies the cache kernels must perform. It holds no tensors: block ids in, block ids out.

Names follow vLLM (v0's ``BlockSpaceManager`` for fork / copy-on-write / swap, v1's
``KVCacheManager`` for prefix caching). The data flow of one step:

    can_allocate / allocate(prompt)       -> blocks for the prompt, cache hits reused
    can_append_slots / append_slots(toks) -> a slot per new token; [(src, dst)] CoW copies
    mark_blocks_as_computed(n)            -> full computed blocks become prefix-cache entries
    fork(parent, child)                   -> the child shares every block (ref += 1)
    swap_out / swap_in(seqs)              -> [(src, dst)] copies between the GPU and CPU pools
    free(seq)                             -> blocks back to the pool (cached ones stay findable)

Every method checks its input before it changes anything, so a rejected call (ValueError, or
NoFreeBlocksError when the pool is short) leaves the manager exactly as it was.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple

from .block_table import BlockTable, cdiv
from .pool import BlockAllocator, NoFreeBlocksError
from .prefix_cache import PrefixCache


class AllocStatus(enum.Enum):
    """Answer of ``can_allocate`` / ``can_swap_in`` (vLLM's names)."""
    OK = "ok"          # fits now
    LATER = "later"    # fits once other sequences free blocks
    NEVER = "never"    # larger than the whole pool (minus the watermark): reject the request


class BlockUsage(NamedTuple):
    device: str
    num_total_blocks: int
    num_free_blocks: int         # includes cached blocks no sequence holds (evictable)
    num_cached_free_blocks: int
    block_usage: float           # held blocks / total blocks  (vllm:gpu_cache_usage_perc)
    token_usage: float           # filled slots of held blocks / total slots


class PrefixCacheStats(NamedTuple):
    queries: int                 # prompt tokens looked up
    hits: int                    # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
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
        if isinstance(block_size, bool) or not isinstance(block_size, int) \
                or not 1 <= block_size <= 256 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {block_size!r}")
        for name, value in (("num_gpu_blocks", num_gpu_blocks), ("num_cpu_blocks", num_cpu_blocks)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
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
        self._tables: dict[int, BlockTable] = {}
        self.prefix_cache_queries = 0   # tokens (vllm:prefix_cache_queries_total)
        self.prefix_cache_hits = 0      # tokens (vllm:prefix_cache_hits_total)

    # ----------------------------------------------------------------- read-only queries
    @property
    def num_free_gpu_blocks(self) -> int:
        """Blocks an allocation can take now: the free stack plus evictable cached blocks."""
        return len(self.gpu._free) + (len(self.cache._evictor) if self.cache else 0)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.cpu._free)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.prefix_cache_queries, self.prefix_cache_hits)

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def seq_ids(self) -> list[int]:
        return list(self._tables)

    def get_table(self, seq_id: int) -> BlockTable:
        """The sequence's table (read it, do not mutate it)."""
        return self._get(seq_id)

    def get_block_table(self, seq_id: int) -> list[int]:
        """Physical block ids of the sequence, logical order (a copy)."""
        return list(self._get(seq_id).blocks)

    def pool(self, device: str) -> BlockAllocator:
        if device not in ("gpu", "cpu"):
            raise ValueError(f"device must be 'gpu' or 'cpu', got {device!r}")
        return self.gpu if device == "gpu" else self.cpu

    def ref_count(self, block: int, device: str = "gpu") -> int:
        return self.pool(device).ref_counts[block]

    def _get(self, seq_id: int, device: str | None = None) -> BlockTable:
        table = self._tables.get(seq_id)
        if table is None:
            raise ValueError(f"seq {seq_id!r} has no blocks (never allocated, or already freed); "
                             f"allocated seqs: {sorted(self._tables)[:10]}")
        if device is not None and table.device != device:
            raise ValueError(f"seq {seq_id} is on {table.device}, this needs it on {device}")
        return table

    # ------------------------------------------------------------ GPU block primitives
    def _alloc_gpu(self) -> int:
        """A free GPU block with ref 1: from the free stack, else evict the LRU cached block."""
        if self.gpu._free:
            block = self.gpu._free.pop()
        else:
            block = self.cache.evict()   # caller checked num_free_gpu_blocks
        self.gpu.ref_counts[block] = 1
        return block

    def _release_gpu(self, block: int) -> None:
        """Drop one reference; at zero a cached block stays findable, others go free."""
        refs = self.gpu.ref_counts
        refs[block] -= 1
        if refs[block] == 0:
            if self.cache is not None and self.cache.is_cached(block):
                self.cache.park(block)
            else:
                self.gpu._free.append(block)

    def _touch(self, block: int) -> None:
        """Take one more reference to a cached block (a prefix-cache hit)."""
        if self.gpu.ref_counts[block] == 0:
            self.cache.unpark(block)
        self.gpu.ref_counts[block] += 1

    # ------------------------------------------------------------------ prefix caching
    def mark_blocks_as_computed(self, seq_id: int, num_computed_tokens: int) -> None:
        """Tell the cache that the first ``num_computed_tokens`` tokens' K/V are written.

        Call it after the step that computed them ran (e.g. after each prefill chunk): only
        then may another request reuse those blocks. ``append_slots`` does this implicitly
        for every token before the ones it appends.
        """
        table = self._get(seq_id, "gpu")
        if not 0 <= num_computed_tokens <= table.num_tokens:
            raise ValueError(f"num_computed_tokens must be in [0, {table.num_tokens}], "
                             f"got {num_computed_tokens}")
        upto = num_computed_tokens // self.block_size
        if self.cache is not None and upto > table.num_cached_blocks:
            self.cache.register(table, upto)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks. Only possible while no GPU block is held (vLLM's rule:
        a held block may be mid-use); returns whether the reset happened."""
        if self.cache is None:
            return True
        if len(self.gpu._free) + self.cache.num_evictable != self.num_gpu_blocks:
            return False
        self.gpu._free.extend(self.cache.clear())
        return True

    # -------------------------------------------------------------- allocate a prompt
    def _blocks_needed(self, num_tokens: int) -> int:
        if num_tokens < 1:
            raise ValueError(f"a sequence needs at least 1 token, got {num_tokens}")
        return cdiv(num_tokens, self.block_size)

    def can_allocate(self, token_ids: Sequence[int] | int, extra_key: Hashable = ()) -> AllocStatus:
        """Can a prompt (token ids, or just a length) get its blocks now, later, or never?
        Given token ids and prefix caching, cached blocks count as already there."""
        num_tokens = token_ids if isinstance(token_ids, int) else len(token_ids)
        required = self._blocks_needed(num_tokens)
        if required > self.num_gpu_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        free = self.num_free_gpu_blocks
        if self.cache is not None and not isinstance(token_ids, int):
            probe = BlockTable(-1, self.block_size, token_ids=list(token_ids), extra_key=extra_key)
            hits = self.cache.hash_and_match(probe)
            required -= len(hits)
            free -= sum(1 for b in hits if self.gpu.ref_counts[b] == 0)
        return AllocStatus.OK if free - required >= self.watermark_blocks else AllocStatus.LATER

    def allocate(self, seq_id: int, token_ids: Sequence[int], extra_key: Hashable = ()) -> int:
        """Give a new sequence blocks for its prompt. Returns the number of prompt tokens found
        in the prefix cache (their K/V need no computing: a multiple of block_size)."""
        if seq_id in self._tables:
            raise ValueError(f"seq {seq_id!r} is already allocated; free it or use a new id")
        required = self._blocks_needed(len(token_ids))
        if required > self.num_gpu_blocks:
            raise ValueError(f"a prompt of {len(token_ids)} tokens needs {required} blocks but the "
                             f"GPU pool has {self.num_gpu_blocks}: it can never fit")
        table = BlockTable(seq_id, self.block_size, token_ids=list(token_ids), extra_key=extra_key)
        hits: list[int] = []
        if self.cache is not None:
            hits = self.cache.hash_and_match(table)
        free = self.num_free_gpu_blocks - sum(1 for b in hits if self.gpu.ref_counts[b] == 0)
        if required - len(hits) > free:
            raise NoFreeBlocksError(f"seq {seq_id} needs {required - len(hits)} new GPU blocks, "
                                    f"{free} are free; ask can_allocate() first")
        for block in hits:
            self._touch(block)
        table.blocks = hits + [self._alloc_gpu() for _ in range(required - len(hits))]
        table.num_cached_blocks = len(hits)
        table.cache_parent = self.cache.identity(hits[-1]) if hits else None
        self._tables[seq_id] = table
        num_cached_tokens = len(hits) * self.block_size
        if self.cache is not None:
            self.prefix_cache_queries += len(token_ids)
            self.prefix_cache_hits += num_cached_tokens
        return num_cached_tokens

    # ----------------------------------------------------- grow: the decode hot path
    def _append_need(self, table: BlockTable, num_new_tokens: int) -> tuple[int, bool]:
        n, blocks = len(table.token_ids), table.blocks
        cow = num_new_tokens > 0 and n % self.block_size != 0 \
            and self.gpu.ref_counts[blocks[-1]] > 1
        return (n + num_new_tokens + self.block_size - 1) // self.block_size - len(blocks), cow

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
        blocks = table.blocks
        copies: list[tuple[int, int]] = []
        if cow:
            src = blocks[-1]
            blocks[-1] = self._alloc_gpu()
            self.gpu.ref_counts[src] -= 1      # was > 1, stays >= 1
            copies.append((src, blocks[-1]))
        for _ in range(new_blocks):
            blocks.append(self._alloc_gpu())
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
        refs = self.gpu.ref_counts
        for block in parent.blocks:
            refs[block] += 1
        self._tables[child_seq_id] = parent.copy(child_seq_id)

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references. Tail blocks are released first, so that cached
        chain ends are evicted before the prefixes other requests are likelier to share."""
        table = self._get(seq_id)
        del self._tables[seq_id]
        if table.device == "gpu":
            for block in reversed(table.blocks):
                self._release_gpu(block)
        else:
            for block in reversed(table.blocks):
                self._release_cpu(block)

    # ------------------------------------------------------------------------- swapping
    def _group(self, seq_ids: Iterable[int], device: str) -> tuple[list[BlockTable], list[int]]:
        """Tables of a group of sequences (e.g. one request's samples) and their distinct
        blocks: a block shared inside the group moves once and stays shared."""
        seq_ids = list(seq_ids)
        if not seq_ids or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids must be a non-empty list of distinct ids, got {seq_ids}")
        tables = [self._get(s, device) for s in seq_ids]
        return tables, list(dict.fromkeys(b for t in tables for b in t.blocks))

    def can_swap_out(self, seq_ids: Iterable[int]) -> bool:
        return len(self._group(seq_ids, "gpu")[1]) <= self.num_free_cpu_blocks

    def swap_out(self, seq_ids: Iterable[int]) -> list[tuple[int, int]]:
        """Move the group's blocks to the CPU pool; returns ``[(gpu_block, cpu_block)]``.
        The engine must run these copies before any other cache op of the same step: the
        freed GPU blocks may be handed out again right away."""
        tables, distinct = self._group(seq_ids, "gpu")
        if len(distinct) > self.num_free_cpu_blocks:
            raise NoFreeBlocksError(f"swap out needs {len(distinct)} CPU blocks, "
                                    f"{self.num_free_cpu_blocks} are free (raise swap_space)")
        mapping = {b: self.cpu.allocate() for b in distinct}
        self._move(tables, mapping, self.cpu, self._release_gpu)
        for table in tables:
            table.num_cached_blocks, table.cache_parent = 0, None   # re-offered after swap-in
        return list(mapping.items())

    def can_swap_in(self, seq_ids: Iterable[int]) -> AllocStatus:
        need = len(self._group(seq_ids, "cpu")[1])
        if need > self.num_gpu_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if self.num_free_gpu_blocks - need >= self.watermark_blocks \
            else AllocStatus.LATER

    def swap_in(self, seq_ids: Iterable[int]) -> list[tuple[int, int]]:
        """Bring a swapped-out group back to the GPU; returns ``[(cpu_block, gpu_block)]``."""
        tables, distinct = self._group(seq_ids, "cpu")
        if len(distinct) > self.num_free_gpu_blocks:
            raise NoFreeBlocksError(f"swap in needs {len(distinct)} GPU blocks, "
                                    f"{self.num_free_gpu_blocks} are free")
        mapping = {b: self._alloc_gpu() for b in distinct}
        self._move(tables, mapping, self.gpu, self._release_cpu)
        return list(mapping.items())

    def _release_cpu(self, block: int) -> None:
        self.cpu.ref_counts[block] -= 1
        if self.cpu.ref_counts[block] == 0:
            self.cpu.free(block)

    def _move(self, tables: list[BlockTable], mapping: dict[int, int], dst: BlockAllocator,
              release_src) -> None:
        """Point the tables at the destination blocks, release the source ones, and set each
        destination block's ref count to its number of entries in the group."""
        for table in tables:
            old = table.blocks
            table.blocks = [mapping[b] for b in old]
            table.device = dst.device
            for block in reversed(old):
                release_src(block)
        refs = dst.ref_counts
        for block in mapping.values():
            refs[block] = 0
        for table in tables:
            for block in table.blocks:
                refs[block] += 1

    # --------------------------------------------------------------------- usage, checks
    def usage(self, device: str = "gpu") -> BlockUsage:
        """Block- and token-level occupancy of one pool (a shared block counts once)."""
        pool = self.pool(device)
        parked = self.cache.num_evictable if (self.cache is not None and device == "gpu") else 0
        free = len(pool._free) + parked
        filled: dict[int, int] = {}
        bs = self.block_size
        for table in self._tables.values():
            if table.device != device:
                continue
            last = len(table.blocks) - 1
            tail = table.num_tokens - last * bs
            for i, block in enumerate(table.blocks):
                filled[block] = max(filled.get(block, 0), bs if i < last else tail)
        total = pool.num_blocks
        return BlockUsage(device, total, free, parked,
                          (total - free) / total if total else 0.0,
                          sum(filled.values()) / (total * bs) if total else 0.0)

    def check_invariants(self) -> None:
        """Assert the invariants of DESIGN.md; cheap enough for tests, not for the hot path."""
        self.gpu.check_invariants()
        self.cpu.check_invariants()
        parked = set(self.cache.evictable_blocks()) if self.cache else set()
        if self.cache is not None:
            self.cache.check_invariants()
            assert not parked & set(self.gpu._free), "a block is both free and parked"
        for pool, extra_free in ((self.gpu, parked), (self.cpu, set())):
            entries = [0] * pool.num_blocks
            for table in self._tables.values():
                if table.device == pool.device:
                    for block in table.blocks:
                        entries[block] += 1
            assert entries == pool.ref_counts, f"{pool.device}: ref counts != table entries"
            held = sum(1 for r in pool.ref_counts if r > 0)
            free = len(pool._free) + len(extra_free)
            assert held + free == pool.num_blocks, \
                f"{pool.device}: {held} held + {free} free != {pool.num_blocks} blocks"
            assert all(pool.ref_counts[b] == 0 for b in extra_free), "a held block is parked"
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
