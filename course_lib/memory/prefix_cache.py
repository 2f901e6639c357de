"""Automatic prefix caching: chained block hashes, a hash -> block map, LRU eviction.

A *full* block is identified by its content **and everything before it**: its hash is
``hash((parent_hash, token_ids_of_this_block, extra_key))``, where ``parent_hash`` is the hash
of the previous block (``ROOT_HASH`` for the first). Two requests that share a system prompt
therefore compute the same hashes for the blocks of that prompt and can share the physical
blocks. ``extra_key`` salts the chain (a LoRA id, a multimodal input hash, a tenant's
cache salt) so that equal tokens under different conditions never match.

Only full blocks are cached: a partially filled block is still being written.

A cached block whose reference count drops to zero is *not* forgotten: the block pool
(``pool.BlockAllocator``) keeps it evictable, in LRU order, still findable by hash here, until
an allocation needs the space and evicts it (then :meth:`PrefixCache.forget` drops its hash).
Blocks of one freed sequence become evictable tail first, so the end of a chain is evicted
before its beginning (a beginning is shared by more future requests). This cache holds only
the hash <-> block maps; which free block goes next is the pool's policy.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Hashable, KeysView, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .block_table import BlockTable

ROOT_HASH = 0  # parent hash of a sequence's first block

HashFn = Callable[[int, tuple, Hashable], int]


def builtin_block_hash(parent_hash: int, token_ids: tuple, extra_key: Hashable) -> int:
    """Python's tuple hash: fast; deterministic across runs for ints and tuples of ints."""
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
    generation it had when this key was made. A lookup walks a prompt from its first block,
    so a hit at block i requires the stored parent to be the very block matched at i-1:
    by induction a hit proves the whole prefix equal, even if two prefixes' hashes collide.
    A parent that was evicted and re-registered has a new generation, so stale children
    can never be matched.
    """
    block_hash: int
    parent_hash: int
    token_ids: tuple
    extra_key: Hashable
    parent: ParentRef | None


def _new_key(fields: tuple) -> BlockKey:
    """``BlockKey(*fields)`` without the named tuple's Python-level ``__new__`` (per block)."""
    return tuple.__new__(BlockKey, fields)


class PrefixCache:
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
        self._chains: dict[tuple, list[tuple]] = {}     # hash_and_match's: see there
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
        return _new_key((table.block_hashes[i], parent_hash,
                         tuple(table.token_ids[i * bs:(i + 1) * bs]), table.extra_key, parent))

    def hash_prompt(self, tokens: Sequence[int], block_size: int, extra: Hashable
                    ) -> tuple[list[int], list[tuple]]:
        """The chained hashes of the full blocks of ``tokens`` and each block's tokens as a
        tuple, remembered for the last few prompts: the scheduler asks ``can_allocate`` (maybe
        for several steps) and then ``allocate`` for the same prompt, which is hashed once.
        The lists returned are shared: copy before changing them."""
        key = (tuple(tokens), block_size, extra)
        found = self._prompts.get(key)
        if found is not None:
            return found
        hash_fn, parent, hashes, blocks = self.hash_fn, ROOT_HASH, [], []
        flat = key[0]
        starts = range(0, len(flat) - block_size + 1, block_size)
        if hash_fn is builtin_block_hash:           # inlined: this runs for every prompt
            for i in starts:
                block_tokens = flat[i:i + block_size]
                parent = hash((parent, block_tokens, extra))
                hashes.append(parent)
                blocks.append(block_tokens)
        else:
            for i in starts:
                block_tokens = flat[i:i + block_size]
                parent = hash_fn(parent, block_tokens, extra)
                hashes.append(parent)
                blocks.append(block_tokens)
        if len(self._prompts) >= 16:
            del self._prompts[next(iter(self._prompts))]
        self._prompts[key] = hashes, blocks
        return hashes, blocks

    def match(self, hashes: Sequence[int], blocks: Sequence[tuple], extra: Hashable,
              max_hits: int) -> tuple[list[int], bool]:
        """The cached blocks of the longest verified prefix (at most ``max_hits`` blocks), and
        whether the walk stopped at a collision (a hash match whose key differs; the caller
        counts it once the allocation is done, so that a probe changes nothing). The last
        answer is remembered until the maps change: ``allocate`` right after ``can_allocate``
        (the scheduler's order) walks nothing."""
        last = self._last_match
        if last and last[0] is hashes and last[1] == (extra, max_hits, self.version):
            return list(last[2]), last[3]
        hits, collided = self._walk(hashes, blocks, extra, max_hits)
        self._last_match = (hashes, (extra, max_hits, self.version), hits, collided)
        return list(hits), collided

    def _walk(self, hashes: Sequence[int], blocks: Sequence[tuple], extra: Hashable,
              max_hits: int) -> tuple[list[int], bool]:
        block_of, key_of, generation = self._block_of, self._key_of, self._generation
        hits: list[int] = []
        parent_hash, parent = ROOT_HASH, None
        for i in range(min(max_hits, len(hashes))):
            block_hash = hashes[i]
            block = block_of.get(block_hash)
            if block is None:
                return hits, False
            key = (block_hash, parent_hash, blocks[i], extra, parent)
            if key_of[block] != key:                     # rare: a hash collision
                block, _ = self._find(BlockKey(*key))
                if block is None:
                    return hits, True
            hits.append(block)
            parent, parent_hash = (block, generation[block]), block_hash
        return hits, False

    def hash_and_match(self, table: BlockTable) -> tuple[list[int], bool]:
        """Hash every full block of a new sequence (into ``table.block_hashes``) and return the
        cached blocks of its longest matching prefix, leaving at least one token to compute
        (the model must run on something to produce the next token's logits), and whether
        the walk stopped at a collision (see :meth:`match`). A prompt ``can_allocate`` just
        probed is not hashed again; any other is hashed and matched in one pass."""
        tokens, bs, extra = table.token_ids, table.block_size, table.extra_key
        max_hits = (len(tokens) - 1) // bs
        flat = tuple(tokens)
        found = self._prompts.get((flat, bs, extra)) if self._prompts else None
        if found is not None:
            table.block_hashes = list(found[0])
            return self.match(found[0], found[1], extra, max_hits)
        hash_fn, block_of, key_of, generation = self.hash_fn, self._block_of, self._key_of, \
            self._generation
        builtin = hash_fn is builtin_block_hash
        hashes = table.block_hashes = []
        hits: list[int] = []
        parent_hash, parent, collided, start = ROOT_HASH, None, False, 0
        head = (flat[:bs], extra)
        chain = self._chains.get(head) if max_hits > 0 else None
        if chain:       # the hits of a recent prompt that began alike, each still registered
            for block_tokens, block, key in chain:       # with the very key it had: no hash,
                if len(hits) == max_hits or key_of.get(block) is not key \
                        or flat[start:start + bs] != block_tokens:     # no verify needed
                    break
                hits.append(block)
                hashes.append(key[0])
                start += bs
            if hits:
                parent_hash, parent = hashes[-1], (hits[-1], generation[hits[-1]])
        reused, matching = len(hits), len(hits) < max_hits
        for i in range(start, len(flat) - bs + 1, bs):
            block_tokens = flat[i:i + bs]
            block_hash = hash((parent_hash, block_tokens, extra)) if builtin \
                else hash_fn(parent_hash, block_tokens, extra)
            hashes.append(block_hash)
            if matching:
                block = block_of.get(block_hash)
                if block is not None:
                    key = (block_hash, parent_hash, block_tokens, extra, parent)
                    if key_of[block] != key:             # rare: a hash collision
                        block, _ = self._find(BlockKey(*key))
                        collided = block is None
                if block is None:
                    matching = False
                else:
                    hits.append(block)
                    parent = (block, generation[block])
                    matching = i // bs + 1 < max_hits
            parent_hash = block_hash
        if len(hits) > reused or (hits and not chain):   # remember the longer chain
            kept = chain[:reused] if chain else []
            self._chains[head] = kept + [(flat[j * bs:(j + 1) * bs], hits[j], key_of[hits[j]])
                                         for j in range(reused, len(hits))]
            if len(self._chains) > 256:
                del self._chains[next(iter(self._chains))]
        return hits, collided

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
