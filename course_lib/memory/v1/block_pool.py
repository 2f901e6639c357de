"""vLLM V1's block pool: one free-block queue that is also the LRU of cached blocks.

The V1 design of vLLM (``vllm/v1/core/kv_cache_utils.py`` and ``block_pool.py`` in vLLM 0.33.0),
in the course's words:

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
  may map to several blocks. A hybrid model's KV-cache groups share the pool: a block is
  cached under its hash *and its group* (:func:`block_hash_with_group_id`), so that a
  full-attention block and a sliding-window block of the same tokens are two entries.
* **The null block** (``use_null_block``): block 0, taken out of the queue for good, stands in
  a sliding-window table for blocks that left the window (vLLM's ``null_block``,
  ``is_null``). It is never freed, never cached, never touched, and its ref count is not
  kept: ``touch`` and ``free_blocks`` skip it. vLLM's pool always has one; the course's only
  when some group needs it (a sliding-window or chunked-local group), so that a model of
  full-attention layers keeps the block ids and free counts chapters 06 and 12 showed
  (block ``i`` there is vLLM's ``i + 1``: tests/fidelity declares it).
* :func:`hash_block_tokens`: ``hash_fn((parent_hash, tokens, extra_keys))``, chained from
  ``NONE_HASH``; ``hash_fn`` is one of vLLM's four (``vllm/utils/hashing.py``): ``sha256``
  (the default: SHA-256 of the pickled tuple), ``sha256_cbor`` (of its canonical CBOR, the same
  bytes in any language), ``xxhash`` and ``xxhash_cbor`` (xxHash3-128: fast, not collision
  resistant). ``NONE_HASH`` is ``hash_fn(seed)`` (vLLM's ``init_none_hash``): the seed is
  ``PYTHONHASHSEED`` when set, else the fixed ``"vllm-none-hash"`` for a cryptographic hash (so
  that processes agree), else random bytes, once per process (so that nobody can precompute
  collisions of the fast one). The extra keys are vLLM's ``generate_block_hash_extra_keys``:
  the first block of a request with a cache salt carries ``(("cache_salt", salt),)``, every
  other block ``None`` (an empty salt is no salt). V1 trusts the hash: a hit is not checked
  token by token.

Left out, and said so: KV events, the metrics collector, partial (sub-block) hash entries,
pinned blocks (``unpin_blocks``), blocks of another pool, ``evict_blocks``.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

NONE_HASH_SEED = "vllm-none-hash"        # vLLM's DEFAULT_NONE_HASH_SEED

HashFn = Callable[[object], bytes]


def sha256(value: object) -> bytes:
    """vLLM's ``vllm/utils/hashing.py:sha256``: SHA-256 of the pickled value."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(value: object) -> bytes:
    """vLLM's ``sha256_cbor``: SHA-256 of the value's canonical CBOR (language-neutral)."""
    import cbor2

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash as _xxhash
    except ImportError:
        _xxhash = None
    if _xxhash is None or not hasattr(_xxhash, "xxh3_128_digest"):
        raise ModuleNotFoundError(
            "xxhash is required for the 'xxhash' prefix caching hash algorithms. "
            "Install it via `pip install xxhash`.")
    return _xxhash.xxh3_128_digest(data)


def xxhash(value: object) -> bytes:
    """vLLM's ``xxhash``: xxHash3-128 of the pickled value (fast, not collision resistant)."""
    return _xxh3_128(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor(value: object) -> bytes:
    """vLLM's ``xxhash_cbor``: xxHash3-128 of the value's canonical CBOR."""
    import cbor2

    return _xxh3_128(cbor2.dumps(value, canonical=True))


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256, "sha256_cbor": sha256_cbor,
                                     "xxhash": xxhash, "xxhash_cbor": xxhash_cbor}
_NON_CRYPTO_HASH_FUNCTIONS = frozenset({xxhash, xxhash_cbor})
_RANDOM_SEED: list[str] = []             # the per-process random seed, drawn once


def get_hash_fn_by_name(hash_fn_name: str) -> HashFn:
    """vLLM's ``get_hash_fn_by_name`` (``--prefix-caching-hash-algo``)."""
    if hash_fn_name not in HASH_FUNCTIONS:
        raise ValueError(f"Unsupported hash function: {hash_fn_name}")
    return HASH_FUNCTIONS[hash_fn_name]


def resolve_none_hash_seed(hash_fn: HashFn) -> str:
    """vLLM's ``resolve_none_hash_seed``: ``PYTHONHASHSEED`` if set; else the fixed seed for a
    cryptographic hash, random bytes (once per process) for a non-cryptographic one."""
    seed = os.getenv("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if hash_fn in _NON_CRYPTO_HASH_FUNCTIONS:
        if not _RANDOM_SEED:
            _RANDOM_SEED.append(os.urandom(32).hex())
        return _RANDOM_SEED[0]
    return NONE_HASH_SEED


def none_hash_for(hash_fn: HashFn = sha256) -> bytes:
    """The parent hash of a request's first block (vLLM's ``init_none_hash``)."""
    return hash_fn(resolve_none_hash_seed(hash_fn))


NONE_HASH = none_hash_for(sha256)            # sha256's, as this process resolves its seed


def block_hash_extra_keys(start_token_idx: int, cache_salt: Hashable = None) -> tuple | None:
    """vLLM's ``generate_block_hash_extra_keys`` for what the course has of it, the cache
    salt: ``(("cache_salt", salt),)`` for the block starting at token 0 of a salted request,
    else None (an empty salt is no salt). LoRA, multimodal and prompt-embedding keys: none."""
    return (("cache_salt", cache_salt),) if start_token_idx == 0 and cache_salt else None


def block_hash_with_group_id(block_hash: bytes, kv_cache_group_id: int) -> bytes:
    """The key a block is cached under in its group (vLLM's ``make_block_hash_with_group_id``
    appends the group id as 4 big-endian bytes). The course appends nothing for group 0, so
    that a model of one group keeps the bare hashes chapters 06 and 12 showed; vLLM 0.33.0
    appends four zero bytes there too (a declared difference: tests/fidelity)."""
    return block_hash + kv_cache_group_id.to_bytes(4, "big") if kv_cache_group_id \
        else block_hash


def hash_block_tokens(parent_block_hash: bytes | None, block_token_ids: Sequence[int],
                      extra_keys: Hashable = None, hash_fn: HashFn = sha256,
                      none_hash: bytes | None = None) -> bytes:
    """The hash of a full block: its tokens, its extra keys (:func:`block_hash_extra_keys`)
    and, through the parent's hash, everything before it (vLLM's ``hash_block_tokens``;
    ``none_hash``: the first block's parent, :data:`NONE_HASH` unless given)."""
    parent = parent_block_hash if parent_block_hash else \
        (NONE_HASH if none_hash is None else none_hash)
    return hash_fn((parent, tuple(block_token_ids), extra_keys))


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block's metadata (vLLM's ``KVCacheBlock``)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None          # set once full and cached (with its group id)
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False                    # the pool's null block (never freed nor cached)

    def __repr__(self) -> str:
        if self.is_null:
            return f"KVCacheBlock({self.block_id}, null)"
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:3].hex()}"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeKVCacheBlockQueue:
    """A doubly linked list of free blocks through the blocks' own links, with a fake head and
    tail so that no operation branches on an empty neighbour. Every operation is O(1) per
    block, removal from the middle included. Each one writes the links in vLLM's order, and
    a queue corrupted by a caller (a block linked twice) fails where vLLM's does, with its
    exception: ``remove`` of a block not in the queue and ``popleft`` of a block without a
    successor raise ``RuntimeError``, ``popleft`` of an empty queue ``ValueError``,
    ``popleft_n`` of more blocks than are free ``AssertionError``
    (``vllm/v1/core/kv_cache_utils.py``)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        for prev, block in zip(blocks, blocks[1:], strict=False):
            block.prev_free_block, prev.next_free_block = prev, block
        self.fake_free_list_head = KVCacheBlock(-1)
        self.fake_free_list_tail = KVCacheBlock(-1)
        first, last = (blocks[0], blocks[-1]) if blocks else \
            (self.fake_free_list_tail, self.fake_free_list_head)
        self.fake_free_list_head.next_free_block, first.prev_free_block = \
            first, self.fake_free_list_head
        self.fake_free_list_tail.prev_free_block, last.next_free_block = \
            last, self.fake_free_list_tail

    def popleft(self) -> KVCacheBlock:
        head = self.fake_free_list_head
        block = head.next_free_block
        if block is self.fake_free_list_tail or block is None:
            assert self.num_free_blocks == 0, (
                f"num_free_blocks ({self.num_free_blocks}) is out of sync with the free list.")
            raise ValueError("No free blocks available")
        nxt = block.next_free_block
        if nxt is None:
            raise RuntimeError("Invalid block found in popleft() "
                               "which doesn't have a valid next_free_block")
        head.next_free_block, nxt.prev_free_block = nxt, head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The first ``n`` blocks (no more than are free)."""
        if n == 0:
            return []
        assert self.num_free_blocks >= n
        self.num_free_blocks -= n
        out, block = [], self.fake_free_list_head.next_free_block
        for _ in range(n):
            assert block is not None
            out.append(block)
            last, block = block, block.next_free_block
            last.prev_free_block = last.next_free_block = None
        if block is not None:
            self.fake_free_list_head.next_free_block = block
            block.prev_free_block = self.fake_free_list_head
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue (a prefix-cache hit on a free block)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on an invalid block: {block}")
        prev.next_free_block, nxt.prev_free_block = nxt, prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        if last is None:
            raise RuntimeError("prev_free_block of fake_free_list_tail should always exist")
        last.next_free_block, block.prev_free_block = block, last
        block.next_free_block, tail.prev_free_block = tail, block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put blocks at the back, in their order (the last is popped last)."""
        blocks = list(blocks)
        if not blocks:
            return
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        assert last is not None, "prev_free_block of fake_free_list_tail should always exist"
        for block in blocks:
            block.prev_free_block, last.next_free_block = last, block
            last = block
        last.next_free_block, tail.prev_free_block = tail, last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the front, in their order (the first is popped first)."""
        if not blocks:
            return
        first = self.fake_free_list_head.next_free_block
        assert first is not None, "next_free_block of fake_free_list_head should always exist"
        prev = self.fake_free_list_head
        for block in blocks:
            block.prev_free_block, prev.next_free_block = prev, block
            prev = block
        prev.next_free_block, first.prev_free_block = first, prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The queue front to back (next popped first)."""
        out, block = [], self.fake_free_list_head.next_free_block
        if block is None:
            raise RuntimeError("next_free_block of fake_free_list_head should always exist")
        while block.next_free_block is not None:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """The V1 block pool (see the module docstring)."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True,
                 use_null_block: bool = False) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, dict[int, KVCacheBlock]] = {}
        # block 0 as the placeholder of blocks that left a window (module docstring)
        self.null_block: KVCacheBlock | None = None
        if use_null_block:
            self.null_block = self.free_block_queue.popleft()
            self.null_block.is_null = True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """The blocks a request can hold: all but the null block."""
        return self.num_gpu_blocks - (self.null_block is not None)

    def get_usage(self) -> float:
        """Held blocks / usable blocks (``vllm:kv_cache_usage_perc``; the null block is
        neither)."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: bytes,
                         kv_cache_group_id: int = 0) -> KVCacheBlock | None:
        """Any cached block of the group with this hash (the first), or None. (vLLM's takes a
        list of groups of one spec and answers one block each; the course asks per group.)"""
        key = block_hash_with_group_id(block_hash, kv_cache_group_id)
        blocks = self.cached_block_hash_to_block.get(key)
        return next(iter(blocks.values())) if blocks else None

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes],
                          num_cached_blocks: int, num_full_blocks: int,
                          kv_cache_group_id: int = 0) -> None:
        """Enter ``blocks[num_cached_blocks:num_full_blocks]`` in the hash map under their
        hashes and group (blocks already cached are left as they are; null blocks, in a
        sliding-window table, are skipped)."""
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue                      # a hit: cached already, by whoever filled it
            key = block_hash_with_group_id(block_hashes[i], kv_cache_group_id)
            block.block_hash = key
            self.cached_block_hash_to_block.setdefault(key, {})[block.block_id] = block

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
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """One more reference to each block; a free (evictable) one leaves the queue. The null
        block is skipped (its ref count is not kept)."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block, in eviction order (first = evicted first).
        Blocks reaching 0 that are not cached go to the front of the queue (reused first),
        cached ones to the back (the most recently used end of the LRU). The null block is
        skipped (never pooled)."""
        first, last = [], []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (last if self.enable_caching and block.block_hash is not None
                 else first).append(block)
        self.free_block_queue.prepend_n(first)
        self.free_block_queue.append_n(last)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only while no block is held (returns whether it did)."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True

    def check_invariants(self) -> None:
        """The queue holds exactly the ref-0 blocks but the null block, linked both ways; the
        hash map holds exactly the blocks with a hash, each under its own; the null block is
        the pool's only one, unheld, uncached."""
        queue = self.free_block_queue.get_all_free_blocks()
        assert len(queue) == self.free_block_queue.num_free_blocks, "queue count is off"
        assert {b.block_id for b in queue} == {b.block_id for b in self.blocks
                                               if b.ref_cnt == 0 and not b.is_null}, \
            "queue != ref-0 blocks"
        null = self.null_block
        assert [b for b in self.blocks if b.is_null] == ([] if null is None else [null]), \
            "null blocks != the pool's null block"
        assert null is None or (null.ref_cnt == 0 and null.block_hash is None
                                and null.prev_free_block is None), "the null block was used"
        assert len({b.block_id for b in queue}) == len(queue), "a block is queued twice"
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        back, head = [] if not queue else [queue[-1]], self.free_block_queue.fake_free_list_head
        while back and back[-1].prev_free_block is not head:
            back.append(back[-1].prev_free_block)
        assert back[::-1] == queue, "the queue's backward links disagree"
        mapped = {i for bs in self.cached_block_hash_to_block.values() for i in bs}
        assert mapped == {b.block_id for b in self.blocks if b.block_hash is not None}, \
            "hash map != blocks with a hash"
        for h, bs in self.cached_block_hash_to_block.items():
            assert bs and all(b.block_hash == h for b in bs.values()), "block under a wrong hash"
        if not self.enable_caching:
            assert not mapped, "cached blocks with prefix caching off"
