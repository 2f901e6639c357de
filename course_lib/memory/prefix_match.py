"""Finding a new prompt's cached prefix fast, for :class:`~course_lib.memory.PrefixCache`.

The scheduler asks ``can_allocate`` for a prompt (maybe for several steps) and then
``allocate``; both need the prompt's chained block hashes and its longest verified cached
prefix. Three memos keep that cheap without changing any answer: the hashes of the last few
prompts (``hash_prompt``), the last match until the cache's maps change (``match``), and the
hits of recent prompts that began alike, each still registered with the very key it had
(``hash_and_match``). A hit is accepted exactly as ``PrefixCache.lookup`` would accept it:
its stored key (tokens, salt, parent hash and parent block) must equal the prompt's.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from .block_hash import ROOT_HASH, BlockKey, builtin_block_hash

if TYPE_CHECKING:
    from .block_table import BlockTable


class PrefixMatching:
    """Mixed into ``PrefixCache``: memoized prompt hashing and prefix matching, over its maps
    (``_block_of``, ``_key_of``, ``_generation``, ``_find``) and its memos (``_prompts``,
    ``_chains``, ``_last_match``)."""

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
