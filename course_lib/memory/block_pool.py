"""vLLM V1's block pool: one free-block queue that is also the LRU of cached blocks.

The V1 design of vLLM (``vllm/v1/core/kv_cache_utils.py`` and ``block_pool.py`` in vLLM 0.33.0),
for one full-attention KV-cache group, in the course's words:

* :class:`KVCacheBlock`: a block's metadata: id, reference count, the hash it is cached under
  (None until it is full and cached), and its two links in the free queue.
* :class:`FreeKVCacheBlockQueue`: a doubly linked list of every block with ref count 0, cached
  or not. Allocation pops from the front; a block hit by a prefix lookup is unlinked from the
  middle in O(1) (why a ``deque`` will not do). vLLM 0.33's ``free_blocks`` puts freed blocks
  that are not cached at the *front* (reused first, LIFO) and cached ones at the *back*, so the
  front of the queue is where the never-cached and then the least recently used cached blocks
  are: one queue does what the V0 pair (``pool.BlockAllocator``) does with a stack and an LRU.
* :class:`BlockPool`: the blocks, the queue, and ``cached_block_hash_to_block``, the map from a
  block hash to the cached blocks with it. Equal blocks are *not* merged: a block that fills
  with content already cached stays where it is (block tables only ever append), so one hash
  may map to several blocks.
* :func:`hash_block_tokens`: ``sha256(pickle((parent_hash, tokens, extra_keys)))``, chained
  from ``NONE_HASH``, the hash of the fixed seed ``"vllm-none-hash"`` (vLLM 0.33.0 derives it
  that way for a cryptographic hash, so that processes agree; a non-cryptographic hash gets a
  random seed). V1 trusts the hash: a hit is not checked token by token.

Left out, and said so: the null block (block 0, a placeholder for sliding-window and Mamba
layers), hybrid models' several KV-cache groups, KV events, the metrics collector.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

NONE_HASH_SEED = "vllm-none-hash"


def sha256(value: object) -> bytes:
    """vLLM's ``vllm/utils/hashing.py:sha256``: SHA-256 of the pickled value."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


NONE_HASH = sha256(NONE_HASH_SEED)


def hash_block_tokens(parent_block_hash: bytes | None, block_token_ids: Sequence[int],
                      extra_keys: Hashable = None) -> bytes:
    """The hash of a full block: its tokens, its extra keys (a cache salt, a LoRA id) and,
    through the parent's hash, everything before it."""
    parent = parent_block_hash if parent_block_hash else NONE_HASH
    return sha256((parent, tuple(block_token_ids), extra_keys))


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block's metadata (vLLM's ``KVCacheBlock``)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None          # set once full and cached
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:3].hex()}"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeKVCacheBlockQueue:
    """A doubly linked list of free blocks through the blocks' own links, with a fake head and
    tail so that no operation branches on an empty neighbour. Every operation is O(1) per
    block, removal from the middle included."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head, self.tail = KVCacheBlock(-1), KVCacheBlock(-1)
        self.head.next_free_block, self.tail.prev_free_block = self.tail, self.head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free_block
        if block is self.tail:
            raise ValueError("no free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks, {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue (a prefix-cache hit on a free block)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block, nxt.prev_free_block = nxt, prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def _link_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        nxt = anchor.next_free_block
        anchor.next_free_block, block.prev_free_block = block, anchor
        block.next_free_block, nxt.prev_free_block = nxt, block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        self._link_after(self.tail.prev_free_block, block)

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the front, in their order (the first is popped first)."""
        for block in reversed(blocks):
            self._link_after(self.head, block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The queue front to back (next popped first)."""
        out, block = [], self.head.next_free_block
        while block is not self.tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """The V1 block pool (see the module docstring)."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True) -> None:
        if isinstance(num_gpu_blocks, bool) or not isinstance(num_gpu_blocks, int) \
                or num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be an int >= 1, got {num_gpu_blocks!r}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, dict[int, KVCacheBlock]] = {}

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Held blocks / all blocks (``vllm:kv_cache_usage_perc``)."""
        return 1.0 - self.get_num_free_blocks() / self.num_gpu_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """Any cached block with this hash (the first), or None."""
        blocks = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Enter ``blocks[num_cached_blocks:num_full_blocks]`` in the hash map under their
        hashes (blocks already cached under a hash are left as they are)."""
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                continue                      # a hit: cached already, by whoever filled it
            block.block_hash = block_hashes[i]
            self.cached_block_hash_to_block.setdefault(block_hashes[i], {})[block.block_id] = \
                block

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        same = self.cached_block_hash_to_block[block.block_hash]
        del same[block.block_id]
        if not same:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """``num_blocks`` blocks from the front of the free queue, each with ref count 1; a
        cached one is evicted (its hash forgotten)."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool, "
                             f"{self.get_num_free_blocks()} are free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """One more reference to each block; a free (evictable) one leaves the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block, in eviction order (first = evicted first).
        Blocks reaching 0 that are not cached go to the front of the queue (reused first),
        cached ones to the back (the most recently used end of the LRU)."""
        ordered_blocks = list(ordered_blocks)
        drops: dict[int, int] = {}
        for block in ordered_blocks:            # checked first: a bad call changes nothing
            drops[block.block_id] = drops.get(block.block_id, 0) + 1
            if drops[block.block_id] > block.ref_cnt:
                raise ValueError(f"block {block.block_id} is not held that many times")
        first, last = [], []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (last if self.enable_caching and block.block_hash is not None
                 else first).append(block)
        self.free_block_queue.prepend_n(first)
        self.free_block_queue.append_n(last)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only while no block is held (returns whether it did)."""
        if self.get_num_free_blocks() != self.num_gpu_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True

    # ------------------------------------------------------------ snapshot / restore
    def snapshot(self) -> tuple:
        """Every block's count and hash and the queue's order (O(num_blocks))."""
        return ([(b.ref_cnt, b.block_hash) for b in self.blocks],
                [b.block_id for b in self.free_block_queue.get_all_free_blocks()],
                {h: list(bs) for h, bs in self.cached_block_hash_to_block.items()})

    def restore(self, snap: tuple) -> None:
        states, free_ids, cached = snap
        for block, (block.ref_cnt, block.block_hash) in zip(self.blocks, states, strict=True):
            block.prev_free_block = block.next_free_block = None
        self.free_block_queue = FreeKVCacheBlockQueue([self.blocks[i] for i in free_ids])
        self.cached_block_hash_to_block = {h: {i: self.blocks[i] for i in ids}
                                           for h, ids in cached.items()}

    def check_invariants(self) -> None:
        """The queue holds exactly the ref-0 blocks, linked both ways; the hash map holds
        exactly the blocks with a hash, each under its own."""
        queue = self.free_block_queue.get_all_free_blocks()
        assert len(queue) == self.free_block_queue.num_free_blocks, "queue count is off"
        assert {b.block_id for b in queue} == {b.block_id for b in self.blocks
                                               if b.ref_cnt == 0}, "queue != ref-0 blocks"
        assert len({b.block_id for b in queue}) == len(queue), "a block is queued twice"
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        back = [] if not queue else [queue[-1]]
        while back and back[-1].prev_free_block is not self.free_block_queue.head:
            back.append(back[-1].prev_free_block)
        assert back[::-1] == queue, "the queue's backward links disagree"
        mapped = {i for bs in self.cached_block_hash_to_block.values() for i in bs}
        assert mapped == {b.block_id for b in self.blocks if b.block_hash is not None}, \
            "hash map != blocks with a hash"
        for h, bs in self.cached_block_hash_to_block.items():
            assert bs and all(b.block_hash == h for b in bs.values()), "block under a wrong hash"
        if not self.enable_caching:
            assert not mapped, "cached blocks with prefix caching off"
