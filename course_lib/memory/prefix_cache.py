"""Automatic prefix caching: the hash -> block maps of the cached blocks, verified lookups.

A full block is named by a chained hash of its tokens and everything before it, salted by an
``extra_key`` (``block_hash.py``); two requests that share a system prompt compute the same
hashes for its blocks and share the physical blocks. A hash only points at a candidate: a hit
is accepted only if the block was registered with exactly the same key, so a hit proves the
whole prefix equal even when two prefixes' hashes collide.

Only full blocks are cached: a partially filled block is still being written.

A cached block whose reference count drops to zero is *not* forgotten: the block pool
(``pool.BlockAllocator``) keeps it evictable, in LRU order, still findable by hash here, until
an allocation needs the space and evicts it (then :meth:`PrefixCache.forget` drops its hash).
Blocks of one freed sequence become evictable tail first, so the end of a chain is evicted
before its beginning (a beginning is shared by more future requests). This cache holds only
the hash <-> block maps; which free block goes next is the pool's policy. Finding a new
prompt's cached prefix fast (``hash_and_match``, ``can_allocate``'s probe) is mixed in from
``prefix_match.py``.
"""

from __future__ import annotations

from collections.abc import KeysView
from typing import TYPE_CHECKING

from .block_hash import (
    HASH_FUNCTIONS,
    ROOT_HASH,
    BlockKey,
    HashFn,
    ParentRef,
    block_key,
    builtin_block_hash,
    sha256_block_hash,
    typed_salt,
)
from .prefix_match import PrefixMatching

if TYPE_CHECKING:
    from .block_table import BlockTable

__all__ = ["HASH_FUNCTIONS", "ROOT_HASH", "BlockKey", "HashFn", "ParentRef", "PrefixCache",
           "builtin_block_hash", "sha256_block_hash", "typed_salt"]


class PrefixCache(PrefixMatching):
    """The hash -> block map of every registered block (held or evictable), verified lookups."""

    def __init__(self, hash_algo: str = "builtin") -> None:
        if hash_algo not in HASH_FUNCTIONS:
            raise ValueError(f"hash_algo must be one of {sorted(HASH_FUNCTIONS)}, "
                             f"got {hash_algo!r}")
        self.hash_algo = hash_algo
        self.hash_fn: HashFn = HASH_FUNCTIONS[hash_algo]
        self._block_of: dict[int, int] = {}             # block_hash -> first block with it
        self._collided: dict[int, list[int]] = {}       # block_hash -> later blocks with it
        self._key_of: dict[int, BlockKey] = {}          # block id -> its key (cached blocks only)
        self._generation: dict[int, int] = {}           # block id -> times it was registered
        self._prompts: dict[tuple, tuple[list[int], list[tuple]]] = {}   # hash_prompt's memo
        self._chains: dict[tuple, list[tuple]] = {}     # hash_and_match's (prefix_match.py)
        self.version = 0                                # changes whenever the maps change
        self._last_match: tuple = ()                    # match()'s memo, valid for a version
        self.num_collisions = 0                         # hash matched, content did not

    # --- lookup and registration -------------------------------------------------------
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

    def identity(self, block: int) -> ParentRef:
        """How a child block's key names this cached block."""
        return block, self._generation[block]

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
        self.version += 1
        self._generation[block] = self._generation.get(block, 0) + 1
        return True

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def cached_block_ids(self) -> KeysView[int]:
        """The registered block ids: a live, read-only view (``in`` is O(1))."""
        return self._key_of.keys()

    def key_of(self, block: int) -> BlockKey | None:
        return self._key_of.get(block)

    # --- walking a sequence's chain -----------------------------------------------------
    def hash_blocks(self, table: BlockTable, upto: int) -> None:
        """Extend ``table.block_hashes`` to the first ``upto`` full blocks (chained)."""
        hashes, tokens, bs = table.block_hashes, table.token_ids, table.block_size
        hash_fn, extra = self.hash_fn, table.extra_key
        parent = hashes[-1] if hashes else ROOT_HASH
        builtin = hash_fn is builtin_block_hash
        for i in range(len(hashes), upto):
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            parent = hash((parent, block_tokens, extra)) if builtin \
                else hash_fn(parent, block_tokens, extra)
            hashes.append(parent)

    def key(self, table: BlockTable, i: int, parent: ParentRef | None) -> BlockKey:
        bs = table.block_size
        parent_hash = table.block_hashes[i - 1] if i else ROOT_HASH
        return block_key((table.block_hashes[i], parent_hash,
                         tuple(table.token_ids[i * bs:(i + 1) * bs]), table.extra_key, parent))

    def register(self, table: BlockTable, upto: int) -> None:
        """Offer full, computed blocks ``num_cached_blocks .. upto-1`` to the prefix cache.
        A block whose content is already cached elsewhere is not registered, but the chain
        continues from that canonical block; if the chain's parent is gone, nothing after it
        can be found by a lookup, so nothing after it is registered."""
        parent = table.cache_parent
        block_of, key_of, generation = self._block_of, self._key_of, self._generation
        hashes, tokens, blocks, extra, bs = table.block_hashes, table.token_ids, table.blocks, \
            table.extra_key, table.block_size
        new_key = tuple.__new__
        for i in range(table.num_cached_blocks, upto):
            if i and parent is None:
                break
            block_hash = hashes[i]
            key = new_key(BlockKey, (block_hash, hashes[i - 1] if i else ROOT_HASH,
                                     tuple(tokens[i * bs:(i + 1) * bs]), extra, parent))
            block, first = blocks[i], block_of.get(block_hash)
            if block in key_of:
                block = block if self.insert(block, key) else self.lookup(key)
            elif first is None:                          # a new hash: register it (insert())
                block_of[block_hash], key_of[block] = block, key
                generation[block] = generation.get(block, 0) + 1
                self.version += 1
            elif key_of[first] == key:                   # cached already: chain from that one
                block = first
            else:                                        # rare: a collision
                block = block if self.insert(block, key) else self.lookup(key)
            parent = None if block is None else (block, generation[block])
        table.num_cached_blocks, table.cache_parent = upto, parent

    # --- forgetting --------------------------------------------------------------------
    def forget(self, block: int) -> None:
        """The pool evicted this block for a new allocation: its hash no longer finds it."""
        self.version += 1
        h = self._key_of.pop(block)[0]                   # its block_hash
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
        self.version += 1
        self._block_of.clear()
        self._collided.clear()
        self._key_of.clear()

    # --- snapshot / restore ---------------------------------------------------------------
    def snapshot(self) -> tuple:
        """A copy of the maps and counters (see ``LLMEngine.step``)."""
        return (dict(self._block_of), {h: list(b) for h, b in self._collided.items()},
                dict(self._key_of), dict(self._generation), self.num_collisions)

    def restore(self, snap: tuple) -> None:
        """Put the maps back in place (the block manager holds a live view of the keys)."""
        block_of, collided, key_of, generation, self.num_collisions = snap
        self.version += 1
        for mine, saved in ((self._block_of, block_of), (self._key_of, key_of),
                            (self._generation, generation)):
            mine.clear()
            mine.update(saved)
        self._collided.clear()
        self._collided.update({h: list(b) for h, b in collided.items()})

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
