"""The scheduler's twin of the V0 block manager: the same answers, fewer Python operations.

:class:`FastBlockManager` subclasses the plain :class:`~course_lib.memory.v0.manager.BlockManager`
(the one the chapters teach) and overrides only the calls the scheduler makes for every step or
every token; :class:`FastPrefixCache` subclasses the plain ``PrefixCache`` with memos. Nothing
here changes an answer or the state a call leaves: ``tests/test_block_manager_twin.py`` drives
both managers with the same random operation sequences (allocate, append, fork, free, mark
computed, swap, groups, rejected calls) and compares every answer and the whole public state
after each call, as ``kernels/reference.py`` checks the Triton kernels. The scheduler and
``bench/block_manager.py`` run this twin; read the plain one first.

What is faster, and why it is still the same:

* **One decode call per request, fused** (:meth:`FastBlockManager.append_decode`): the common
  cases (a private partial last block, or a full one) are decided up front and written out;
  anything else (copy-on-write, blocks waiting to be cached) takes the plain path. The block
  ids are handed out without a copy: each table's own ``blocks`` list, which the sequence's
  next change extends in place, as V1's ``allocate_slots`` returns its list (the scheduler's
  ``ScheduledSeq.block_ids``, read within its step; a reader that keeps them longer copies
  them). So nothing a decode step does grows with the sequence, where the plain manager's
  ``get_block_table`` copy costs O(blocks) for every token.
* **A prompt is hashed once** (:meth:`FastPrefixCache.hash_prompt`): the scheduler asks
  ``can_allocate`` for a prompt, maybe for several steps, then ``allocate``. ``can_allocate``
  answers from bounds when it can (room without any hit: OK; no room even if every full block
  hit: LATER), and only then hashes and walks.
* **A match is remembered** until the cache's maps change (``version``): ``allocate`` right
  after ``can_allocate`` walks nothing.
* **Chains are reused** (:meth:`FastPrefixCache.hash_and_match`): the hits of a recent prompt
  that began alike are reused block by block while each is still registered with the very key
  it had, with no hashing and no key comparison.
* Python's ``hash`` is inlined where the chain is hashed, and registration of a new hash is
  written out (the plain ``insert`` re-checks what the loop already knows).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ...sizing.units import cdiv
from ..common import AllocStatus
from .block_table import BlockTable
from .manager import BlockManager
from .prefix_cache import ROOT_HASH, BlockKey, PrefixCache, builtin_block_hash, typed_salt

Grown = tuple[list[tuple[int, int]], list[list[int]]]     # (CoW copies, each table's block ids)


class FastPrefixCache(PrefixCache):
    """``PrefixCache`` with memoized prompt hashing and matching (module docstring)."""

    def __init__(self, hash_algo: str = "builtin") -> None:
        super().__init__(hash_algo)
        self._prompts: dict[tuple, tuple[list[int], list[tuple]]] = {}   # hash_prompt's memo
        self._chains: dict[tuple, list[tuple]] = {}     # hash_and_match's recent chains
        self.version = 0                                # changes whenever the maps change
        self._last_match: tuple = ()                    # match_prompt's memo, for a version

    # --- every change of the maps moves the version on -----------------------------------
    def insert(self, block: int, key: BlockKey) -> bool:
        done = super().insert(block, key)
        self.version += done
        return done

    def forget(self, block: int) -> None:
        self.version += 1
        super().forget(block)

    def clear(self) -> None:
        self.version += 1
        super().clear()

    # --- the chain, Python's hash inlined -------------------------------------------------
    def hash_blocks(self, table: BlockTable, upto: int) -> None:
        if self.hash_fn is not builtin_block_hash:
            return super().hash_blocks(table, upto)
        hashes, tokens, bs, extra = table.block_hashes, table.token_ids, table.block_size, \
            table.extra_key
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), upto):
            parent = hash((parent, tuple(tokens[i * bs:(i + 1) * bs]), extra))
            hashes.append(parent)

    def register(self, table: BlockTable, upto: int) -> None:
        """``PrefixCache.register`` with a new hash registered in place."""
        parent = table.cache_parent
        block_of, key_of, generation = self._block_of, self._key_of, self._generation
        hashes, tokens, blocks, extra, bs = table.block_hashes, table.token_ids, table.blocks, \
            table.extra_key, table.block_size
        new_key = tuple.__new__                          # BlockKey without its Python __new__
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

    # --- a new prompt: hashed once, matched once --------------------------------------------
    def hash_prompt(self, tokens: Sequence[int], block_size: int, extra: Hashable
                    ) -> tuple[list[int], list[tuple]]:
        """The chained hashes of the full blocks of ``tokens`` and each block's tokens as a
        tuple, remembered for the last 16 prompts. The lists returned are shared: copy
        before changing them."""
        key = (tuple(tokens), block_size, extra)
        found = self._prompts.get(key)
        if found is not None:
            return found
        hash_fn, parent, hashes, blocks = self.hash_fn, ROOT_HASH, [], []
        flat = key[0]
        builtin = hash_fn is builtin_block_hash
        for i in range(0, len(flat) - block_size + 1, block_size):
            block_tokens = flat[i:i + block_size]
            parent = hash((parent, block_tokens, extra)) if builtin \
                else hash_fn(parent, block_tokens, extra)
            hashes.append(parent)
            blocks.append(block_tokens)
        if len(self._prompts) >= 16:
            del self._prompts[next(iter(self._prompts))]
        self._prompts[key] = hashes, blocks
        return hashes, blocks

    def match_prompt(self, hashes: Sequence[int], blocks: Sequence[tuple], extra: Hashable,
                     max_hits: int) -> tuple[list[int], bool]:
        """``PrefixCache.match`` over a hashed prompt, remembered until the maps change."""
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
        """Hash every full block of a new table and match its longest cached prefix, leaving
        at least one token to compute (``BlockManager._cached_prefix``, answered the same
        way). A prompt ``can_allocate`` just probed is not hashed again; a prompt that begins
        as a recent one did reuses that one's hits while each is still registered with the
        very key it had; any other is hashed and matched in one pass."""
        tokens, bs, extra = table.token_ids, table.block_size, table.extra_key
        max_hits = (len(tokens) - 1) // bs
        flat = tuple(tokens)
        found = self._prompts.get((flat, bs, extra)) if self._prompts else None
        if found is not None:
            table.block_hashes = list(found[0])
            return self.match_prompt(found[0], found[1], extra, max_hits)
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


class FastBlockManager(BlockManager):
    """``BlockManager`` with the scheduler's calls fused and memoized (module docstring)."""

    PrefixCacheClass = FastPrefixCache
    cache: FastPrefixCache | None

    # --- a prompt ---------------------------------------------------------------------------
    def can_allocate(self, token_ids: Sequence[int] | int, extra_key: Hashable = ()) -> AllocStatus:
        num_tokens = token_ids if isinstance(token_ids, int) else len(token_ids)
        required, watermark = cdiv(num_tokens, self.block_size), self.watermark_blocks
        if required > self.num_gpu_blocks - watermark:
            return AllocStatus.NEVER
        free = self.gpu.num_free_blocks
        if free - required >= watermark:
            return AllocStatus.OK                # hits could only leave more room
        if self.cache is not None and not isinstance(token_ids, int):
            if free - required + (num_tokens - 1) // self.block_size < watermark:
                return AllocStatus.LATER         # even if every full block were a free hit
            extra = typed_salt(extra_key)
            hashes, blocks = self.cache.hash_prompt(token_ids, self.block_size, extra)
            hits, _ = self.cache.match_prompt(hashes, blocks, extra,
                                              (num_tokens - 1) // self.block_size)
            required -= len(hits)
            refs = self.gpu.ref_counts
            free -= sum(1 for b in hits if refs[b] == 0)
        return AllocStatus.OK if free - required >= watermark else AllocStatus.LATER

    def _cached_prefix(self, table: BlockTable) -> tuple[list[int], bool]:
        return self.cache.hash_and_match(table)

    # --- one more token ------------------------------------------------------------------------
    def num_blocks_to_append(self, seq_ids: Sequence[int]) -> int:
        bs, tables, need = self.block_size, self._tables, 0
        for seq_id in seq_ids:          # _append_need(table, 1), inlined: once per decode
            table = tables[seq_id]
            if len(table.token_ids) % bs == 0:
                need += 1               # the last block is full: a new one
            elif (self.gpu if table.device == "gpu" else self.cpu).ref_counts[
                    table.blocks[-1]] > 1:
                need += 1               # a shared partial last block: its copy
        return need

    def append_slots(self, seq_id: int, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        table = self._tables[seq_id]
        n, bs = len(table.token_ids), self.block_size
        if 0 < n % bs < bs - len(token_ids) and self.gpu.ref_counts[table.blocks[-1]] == 1 \
                and (self.cache is None or table.num_cached_blocks == n // bs):
            table.token_ids.extend(token_ids)       # the last block is private, stays
            return []                               # partial, and nothing waits to be cached
        return super().append_slots(seq_id, token_ids)

    def append_decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> Grown | None:
        """``BlockManager.append_decode``, with the common cases written out and the block ids
        handed out without a copy (module docstring)."""
        tables, bs, cache, gpu = self._tables, self.block_size, self.cache, self.gpu
        if len(seq_ids) == 1:                            # most requests: one sequence
            table = tables[seq_ids[0]]
            tokens = table.token_ids
            n = len(tokens)
            r = n % bs
            if cache is None or table.num_cached_blocks == n // bs:
                if r == 0:                               # the last block is full: a new one
                    if not gpu.num_free_blocks:          # the pool is short: preempt
                        return None
                    table.blocks.append(gpu.allocate())
                elif gpu.ref_counts[table.blocks[-1]] != 1:
                    return self._append_decode_plain(seq_ids, token_ids)   # copy-on-write
                tokens.append(token_ids[0])
                if cache is not None and r == bs - 1:
                    cache.hash_blocks(table, n // bs + 1)              # it just filled up
                return [], [table.blocks]                # the table's own list
        else:                                            # a group: plan all, then grow all
            refs, plan, need = gpu.ref_counts, [], 0
            for seq_id in seq_ids:
                table = tables[seq_id]
                n = len(table.token_ids)
                if cache is not None and table.num_cached_blocks != n // bs:
                    break                                # blocks waiting to be cached
                if n % bs == 0:
                    need += 1                            # the last block is full: a new one
                elif refs[table.blocks[-1]] != 1:
                    break                                # shared partial block: copy-on-write
                plan.append(table)
            else:
                if need > gpu.num_free_blocks:
                    return None
                out = []
                for table, token in zip(plan, token_ids, strict=True):
                    tokens = table.token_ids
                    if len(tokens) % bs == 0:
                        table.blocks.append(gpu.allocate())
                    tokens.append(token)
                    if cache is not None and len(tokens) % bs == 0:
                        cache.hash_blocks(table, len(tokens) // bs)    # it just filled up
                    out.append(table.blocks)                 # the table's own list
                return [], out
        return self._append_decode_plain(seq_ids, token_ids)   # anything else

    def _append_decode_plain(self, seq_ids: Sequence[int], token_ids: Sequence[int]
                             ) -> Grown | None:
        """The plain path (copy-on-write, blocks waiting to be cached), the tables' own lists
        handed out as on the fast path."""
        grown = super().append_decode(seq_ids, token_ids)
        if grown is None:
            return None
        return grown[0], [self._tables[s].blocks for s in seq_ids]
