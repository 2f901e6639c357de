"""Automatic prefix caching: how a full block is named, and the maps that find it again.

**The chained block hash.** A *full* block is named by its content **and everything before
it**: ``hash((parent_hash, token_ids_of_this_block, extra_key))``, where ``parent_hash`` is the
hash of the block before it (``ROOT_HASH`` for the first). Two requests that share a system
prompt compute the same hashes for that prompt's blocks and can share the physical blocks.
``extra_key`` salts the chain (a LoRA id, a multimodal input hash, a tenant's cache salt) so
that equal tokens under different conditions never match. :meth:`PrefixCache.hash_blocks` is
the one place that computes the chain.

**A hit is verified.** A hash only points at a candidate. Each cached block keeps the
:class:`BlockKey` it was registered with (its hash, its parent's hash, its tokens, its salt,
and the identity of the cached block before it), and a lookup accepts a block only if that key
equals the prompt's. Walking a prompt from its first block, block ``i`` is accepted only if its
stored parent is the very block matched at ``i - 1``, so by induction a hit proves the whole
prefix equal, even when two prefixes collide on the chained hash.

**Only computed full blocks are cached**: a partially filled block is still being written, and
a block whose K/V the model has not written yet must not be found (``BlockManager`` registers a
block after the step that computed it ran).

**Freed is not forgotten.** A cached block whose reference count drops to zero stays here,
findable by hash; the block pool (``pool.py``) keeps it *evictable*, in LRU order, until an
allocation needs the space and evicts it (then :meth:`PrefixCache.forget` drops its hash). This
cache holds only the hash <-> block maps; which free block goes next is the pool's policy.

The scheduler's fast twin (``fast.py``) remembers prompts it has hashed and matches it has
made; it answers exactly as this plain cache does.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Hashable, KeysView
from typing import NamedTuple

from .block_table import BlockTable

ROOT_HASH = 0  # parent hash of a sequence's first block

HashFn = Callable[[int, tuple, Hashable], int]


def builtin_block_hash(parent_hash: int, token_ids: tuple, extra_key: Hashable) -> int:
    """Python's tuple hash: fast; deterministic across runs for ints and tuples of ints
    (vLLM V0's default)."""
    return hash((parent_hash, token_ids, extra_key))


def sha256_block_hash(parent_hash: int, token_ids: tuple, extra_key: Hashable) -> int:
    """A cryptographic hash (vLLM's ``prefix_caching_hash_algo="sha256"``): slower,
    collision-resistant, identical on every machine."""
    data = pickle.dumps((parent_hash, token_ids, extra_key), protocol=4)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


HASH_FUNCTIONS: dict[str, HashFn] = {"builtin": builtin_block_hash, "sha256": sha256_block_hash}


def typed_salt(salt: Hashable) -> Hashable:
    """A salt (``extra_key``) as it enters the hash: each value with its type, so that salts
    equal in Python but of other types (``1``, ``True``, ``1.0``) never share blocks. Tuples
    are typed item by item; ``()`` (no salt) stays ``()``."""
    if isinstance(salt, tuple):
        return tuple(typed_salt(s) for s in salt) if salt else ()
    return (type(salt).__qualname__, salt)


ParentRef = tuple[int, int]  # (block id, generation) of the cached block before this one


class BlockKey(NamedTuple):
    """What a cached block was registered with: enough to verify a hit exactly.

    ``parent`` names the *cached block* before this one (None for a first block), with the
    generation it had when this key was made. A parent that was evicted and re-registered has
    a new generation, so stale children can never be matched.
    """
    block_hash: int
    parent_hash: int
    token_ids: tuple
    extra_key: Hashable
    parent: ParentRef | None


class PrefixCache:
    """The hash -> block map of every registered block (held or evictable), verified lookups.

    ``hash_algo``: ``"builtin"`` (Python's ``hash``, fast) or ``"sha256"``."""

    def __init__(self, hash_algo: str = "builtin") -> None:
        self.hash_algo = hash_algo
        self.hash_fn: HashFn = HASH_FUNCTIONS[hash_algo]
        self._block_of: dict[int, int] = {}             # block_hash -> first block with it
        self._collided: dict[int, list[int]] = {}       # block_hash -> later blocks with it
        self._key_of: dict[int, BlockKey] = {}          # block id -> its key (cached blocks only)
        self._generation: dict[int, int] = {}           # block id -> times it was registered
        self.num_collisions = 0                         # hash matched, content did not

    # --- a sequence's chain ---------------------------------------------------------------
    def hash_blocks(self, table: BlockTable, upto: int) -> None:
        """Extend ``table.block_hashes`` to its first ``upto`` full blocks: each block's hash
        chains its parent's, its tokens and the table's salt."""
        hashes, tokens, bs = table.block_hashes, table.token_ids, table.block_size
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), upto):
            parent = self.hash_fn(parent, tuple(tokens[i * bs:(i + 1) * bs]), table.extra_key)
            hashes.append(parent)

    def key(self, table: BlockTable, i: int, parent: ParentRef | None) -> BlockKey:
        """The key full block ``i`` of ``table`` is registered with (its hash must be there),
        after the cached block ``parent``."""
        bs = table.block_size
        parent_hash = table.block_hashes[i - 1] if i else ROOT_HASH
        return BlockKey(table.block_hashes[i], parent_hash,
                        tuple(table.token_ids[i * bs:(i + 1) * bs]), table.extra_key, parent)

    # --- lookup ---------------------------------------------------------------------------
    def _find(self, key: BlockKey) -> tuple[int | None, bool]:
        """(the block registered with exactly ``key`` or None, whether another key shares
        its hash): the first block of a hash, then the rare ones that collided with it."""
        block = self._block_of.get(key.block_hash)
        if block is None:
            return None, False
        if self._key_of[block] == key:
            return block, False
        for other in self._collided.get(key.block_hash, ()):
            if self._key_of[other] == key:
                return other, True
        return None, True

    def lookup(self, key: BlockKey) -> int | None:
        """The cached block registered with exactly this key, or None. A hash match whose
        tokens, salt or parent differ is a collision (counted) and a miss."""
        block, collided = self._find(key)
        self.num_collisions += collided and block is None
        return block

    def match(self, table: BlockTable, max_hits: int) -> tuple[list[int], bool]:
        """The cached blocks of the table's longest verified prefix (at most ``max_hits``
        blocks; its hashes must be computed), and whether the walk stopped at a collision (a
        hash match whose key differs: the caller counts it once its allocation is done, so
        that a probe changes nothing)."""
        hits: list[int] = []
        parent = None
        for i in range(min(max_hits, len(table.block_hashes))):
            block, collided = self._find(self.key(table, i, parent))
            if block is None:
                return hits, collided
            hits.append(block)
            parent = self.identity(block)
        return hits, False

    def identity(self, block: int) -> ParentRef:
        """How a child block's key names this cached block."""
        return block, self._generation[block]

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def cached_block_ids(self) -> KeysView[int]:
        """The registered block ids: a live, read-only view (``in`` is O(1))."""
        return self._key_of.keys()

    def key_of(self, block: int) -> BlockKey | None:
        return self._key_of.get(block)

    # --- registration ---------------------------------------------------------------------
    def insert(self, block: int, key: BlockKey) -> bool:
        """Register a full, computed block. Returns False (and registers nothing) when a block
        with this very key is cached: the first one stays the canonical one. A block whose
        hash collides with another key is registered beside it, so that a colliding block can
        never keep a prefix out of the cache."""
        if block in self._key_of or self._find(key)[0] is not None:
            return False
        if key.block_hash in self._block_of:
            self._collided.setdefault(key.block_hash, []).append(block)
        else:
            self._block_of[key.block_hash] = block
        self._key_of[block] = key
        self._generation[block] = self._generation.get(block, 0) + 1
        return True

    def register(self, table: BlockTable, upto: int) -> None:
        """Offer full, computed blocks ``num_cached_blocks .. upto-1`` to the prefix cache.
        A block whose content is already cached elsewhere is not registered, but the chain
        continues from that canonical block; if the chain's parent is gone, nothing after it
        can be found by a lookup, so nothing after it is registered."""
        parent = table.cache_parent
        for i in range(table.num_cached_blocks, upto):
            if i and parent is None:
                break
            key = self.key(table, i, parent)
            block = table.blocks[i]
            if not self.insert(block, key):
                block = self.lookup(key)                 # the canonical block with this key
            parent = None if block is None else self.identity(block)
        table.num_cached_blocks, table.cache_parent = upto, parent

    # --- forgetting -----------------------------------------------------------------------
    def forget(self, block: int) -> None:
        """The pool evicted this block for a new allocation: its hash no longer finds it."""
        h = self._key_of[block].block_hash
        del self._key_of[block]
        others = self._collided.get(h)
        if self._block_of[h] == block:
            if others:
                self._block_of[h] = others.pop(0)
            else:
                del self._block_of[h]
        else:
            others.remove(block)
        if others is not None and not others:
            del self._collided[h]

    def clear(self) -> None:
        """Forget every cached block (the pool frees the evictable ones)."""
        self._block_of.clear()
        self._collided.clear()
        self._key_of.clear()

    def check_invariants(self) -> None:
        """The two maps are inverse; every key re-hashes to its hash; a live parent holds the
        prefix its child claims."""
        registered = list(self._block_of.values()) + [b for bs in self._collided.values()
                                                       for b in bs]
        assert sorted(registered) == sorted(self._key_of), "hash maps and key map differ"
        assert all(h in self._block_of for h in self._collided), "collided hash without a first"
        for block, key in self._key_of.items():
            assert block == self._block_of.get(key.block_hash) \
                or block in self._collided.get(key.block_hash, ()), \
                f"block {block}: map out of sync"
            assert self.hash_fn(key.parent_hash, key.token_ids, key.extra_key) == key.block_hash, \
                f"block {block}: stored hash does not match its content"
            if key.parent is not None and key.parent[0] in self._key_of \
                    and self.identity(key.parent[0]) == key.parent:   # the parent is still live
                assert self._key_of[key.parent[0]].block_hash == key.parent_hash, \
                    f"block {block}: its parent holds another prefix"
