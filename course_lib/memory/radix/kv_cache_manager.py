"""The V1 pair with SGLang's radix tree as its prefix cache, instead of block hashes.

:class:`RadixKVCacheManager` answers the V1 scheduler exactly as vLLM V1's ``KVCacheManager``
(``course_lib/memory/v1/kv_cache_manager.py``) does (``get_computed_blocks``,
``allocate_slots`` returning ``None`` when short, ``free``, ``forget``, usage), but
finds and keeps cached prefixes the way SGLang 0.5.23 does, with the algorithm of its
``RadixCache`` (``python/sglang/srt/mem_cache/radix_cache.py``), which the ``UnifiedRadixCache``
its server builds keeps (``srt/mem_cache/unified_radix_cache.py``; see ``radix_cache.py``'s
docstring): a :class:`~course_lib.memory.radix.radix_cache.RadixCache` whose pages are the KV
cache's blocks (``page_size = block_size``, slots from a
:class:`~course_lib.memory.radix.allocator.BlockSlotPool`, SGLang's
``PagedTokenToKVPoolAllocator``), walked token by token from the root. What follows from that:

* **Hits compare tokens, not hashes**: nothing to trust, nothing to collide.
* **Only computed content enters the tree, after the step that computed it.** vLLM caches a
  full block when it is allocated; SGLang inserts a request's computed, page-aligned prefix
  once its prefill chunk has run (``checkpoint_kv_cache`` in ``srt/mem_cache/common.py`` ->
  ``RadixCache.checkpoint`` / ``_insert_cache``) and again when it finishes
  (``release_kv_cache``). Here the V1 scheduler's ``update`` calls :meth:`cache_computed` for
  each sequence whose step completed a block: its computed full blocks are inserted, and
  ``insert`` answers how many leading tokens the tree held already.
* **Duplicates are freed and the sequence is switched onto the tree's blocks**, as SGLang
  does: the sequence's own blocks for content the tree already held (another sequence computed
  the same prefix first, or in the same step) go back to the free list
  (``free_segment(kv_indices[cache_protected_len:prefix_len])``), its block table is rewritten
  to the tree's blocks (``req_to_token_pool.write``) and its lock moves to the new last node.
  The switch happens after the step, never at allocation: both copies then hold the same
  K/V, and the step wrote only into the sequence's own block; the next step's tables (which
  ``allocate_slots`` returns) are the switched ones.
* **Eviction is SGLang's**: when the free list is short, the least recently used *unlocked
  leaves* of the tree are evicted (never an inner node: a prefix others extend stays while
  they do), where V1's free-block queue evicts from its front.
* **Locks instead of reference counts** for cached blocks: a sequence locks the path to the end
  of its cached prefix (``inc_lock_ref``), so nothing it reads is evicted; :meth:`free`
  unlocks it (the path stays cached, evictable) and gives the private tail back.

* **A decode step does not walk the tree**: a block a decoding sequence fills is attached below
  its locked node (``RadixCache.insert_below``), leaving what the walk from the root would
  (the same nodes, locks, access times and clock: ``tests/test_radix_kv_cache_manager.py``
  checks it against the walk); its table is extended in place and handed out without a copy.

A block is in exactly one place: the free list, the tree (evictable when unlocked), or one
sequence's private tail (the blocks past its cached prefix: a partial last block, blocks this
step is computing, or, with caching off, all of them).

Where the timing differs from SGLang's: SGLang checkpoints after every prefill chunk (whether or
not it completed a page) and at finish, not after decode steps, and releases a retracted or
aborted request without an insert (``release_kv_cache(checkpoint=False)``, with a TODO to
insert); the course inserts after any step that completed a block, decode steps included, so a
block filled by decoding is shared as soon as it is full, and a preempted or aborted sequence
leaves all its computed full blocks in the tree. In both, a step never has a block switched
under it, and a lookup finds only computed content (so, unlike vLLM's hash chain, a request
cannot reuse blocks that a request admitted in the same step is still computing).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ...sizing.units import cdiv
from ..v1_interface import V1ManagerBase
from .allocator import BlockSlotPool
from .radix_cache import RadixCache, TreeNode


class RadixKVCacheManager(V1ManagerBase):
    """V1's KV-cache manager interface over SGLang's radix tree (module docstring). The
    accessors both V1 managers share (``has_seq``, ``seq_ids``, ``prefix_cache_stats``,
    ``record_prefix_cache_stats``, ``forget``, ``usage``) are
    :class:`~course_lib.memory.v1_interface.V1ManagerBase`'s."""

    def __init__(self, block_size: int = 16, num_gpu_blocks: int = 1024,
                 enable_caching: bool = True, watermark: float = 0.0) -> None:
        super().__init__(block_size, num_gpu_blocks, enable_caching, watermark)
        self.pool = BlockSlotPool(num_gpu_blocks, block_size)
        self.tree = RadixCache(num_gpu_blocks * block_size, block_size, pool=self.pool)
        self.last_node: dict[int, TreeNode] = {}     # locked end of the cached prefix

    # ------------------------------------------------------------------------ queries
    @property
    def num_free_gpu_blocks(self) -> int:
        """Blocks an allocation can get: the free list plus unlocked cached blocks."""
        return self.pool.num_free_blocks + self.tree.evictable_size() // self.block_size

    def get_block_table(self, seq_id: int) -> list[int]:
        return list(self.req_to_blocks[seq_id])

    def _namespace(self, seq_id: int) -> Hashable:
        salt = self.salts.get(seq_id)               # typed: 1, True and 1.0 never share
        return (type(salt).__name__, salt) if salt else None     # "" is no salt (SGLang's)

    def _slots(self, blocks: Sequence[int]) -> list[int]:
        bs = self.block_size
        return [s for b in blocks for s in range(b * bs, (b + 1) * bs)]

    def _peek(self, tokens: Sequence[int], ns: Hashable) -> tuple[list[int], int]:
        """Blocks of the longest cached prefix of ``tokens`` (whole blocks) and how many of
        them are unlocked, without splitting or touching anything."""
        blocks, unlocked, bs = [], 0, self.block_size
        for node, n in self.tree.peek_prefix(tokens, ns):
            new = [s // bs for s in node.value[:n:bs]]
            blocks += new
            unlocked += len(new) if node.lock_ref == 0 else 0
        return blocks, unlocked

    # -------------------------------------------------------------- look up, allocate
    def get_computed_blocks(self, seq_id: int, token_ids: list[int],
                            cache_salt: Hashable = None) -> tuple[list[int], int]:
        """Block ids of the longest cached prefix of whole blocks, at most ``len - 1``
        tokens, and how many tokens they hold. Changes nothing but the salt it records."""
        self.salts[seq_id] = cache_salt
        if not self.enable_caching:
            return [], 0
        limit = (len(token_ids) - 1) // self.block_size * self.block_size
        hits, _ = self._peek(token_ids[:limit], self._namespace(seq_id))
        return hits, len(hits) * self.block_size

    def allocate_slots(self, seq_id: int, token_ids: list[int], num_computed_tokens: int,
                       num_new_tokens: int, new_computed_blocks: Sequence[int] = (),
                       admission: bool = False, delay_cache_blocks: bool = False
                       ) -> list[int] | None:
        """Room for ``num_new_tokens`` more tokens (and the hit ``new_computed_blocks`` of a
        sequence being admitted); the sequence's block ids, or None (nothing changes). The
        list returned is the sequence's own, extended in place (no copy per step: read it
        before the next call for this sequence, or copy it). ``delay_cache_blocks``: the
        V1 call's parameter, a no-op here: the tree takes blocks in only after a step computed
        them (``cache_computed``), never at allocation."""
        bs, tree = self.block_size, self.tree
        blocks = self.req_to_blocks.get(seq_id)
        hits = list(new_computed_blocks)
        total = num_computed_tokens + len(hits) * bs + num_new_tokens
        num_new = cdiv(total, bs) - len(hits) - (len(blocks) if blocks is not None else 0)
        unlocked = 0
        if hits:                                     # hits no sequence holds are not free
            _, unlocked = self._peek(token_ids[:len(hits) * bs], self._namespace(seq_id))
        reserve = self.watermark_blocks if admission else 0
        if num_new + unlocked > self.num_free_gpu_blocks - reserve:
            return None
        if blocks is None:
            blocks = self.req_to_blocks[seq_id] = []
        if hits:                                     # lock the hit path before evicting
            _, node = tree.match_prefix(token_ids[:len(hits) * bs], self._namespace(seq_id))
            tree.inc_lock_ref(node)
            self.last_node[seq_id], self.num_cached_block[seq_id] = node, len(hits)
            blocks += hits
        if num_new > 0:                              # extended in place, never rebuilt
            slots = tree.alloc(num_new * bs)
            blocks += [s // bs for s in slots[::bs]]
        self.num_slots[seq_id] = total
        return blocks

    # ------------------------------------------------------------ after the step ran
    def cache_computed(self, seq_id: int, token_ids: list[int], num_computed_tokens: int,
                       num_prompt_tokens: int | None = None) -> None:
        """The sequence has computed its first ``num_computed_tokens`` tokens (the step that
        computed them has run): SGLang's ``RadixCache.checkpoint``. Its computed full blocks
        are inserted into the tree; those whose content the tree held already (``insert``'s
        answer) are duplicates: they go back to the free list, in table order, and the block
        table is rewritten to the tree's blocks; the lock moves to the new last node. With
        ``num_prompt_tokens``, an insert that reaches past the prompt splits the tree at the
        prompt's last whole block too (SGLang's ``split_prompt``: eviction can then drop the
        generated part and keep the prompt). A no-op when caching is off, for a sequence
        holding no blocks, or when no new full block was computed."""
        if not self.enable_caching or seq_id not in self.req_to_blocks:
            return
        bs = self.block_size
        done = self.num_cached_block.get(seq_id, 0)
        num_full = num_computed_tokens // bs
        if num_full <= done:
            return
        node = self.last_node.get(seq_id)
        prompt_blocks = num_prompt_tokens // bs if num_prompt_tokens is not None else 0
        if node is not None and done >= prompt_blocks:
            self._cache_decoded(seq_id, token_ids, node, done, num_full, prompt_blocks)
        else:
            self._cache_walked(seq_id, token_ids, done, num_full, prompt_blocks)

    def _cache_walked(self, seq_id: int, token_ids: list[int], done: int, num_full: int,
                      prompt_blocks: int) -> None:
        """:meth:`cache_computed` from the root (a prompt, or a chunk of it): insert the
        computed full blocks (and split at the prompt's last whole block), free the
        duplicates, match the path, move the lock, rewrite the table onto the tree's blocks."""
        bs, tree, ns = self.block_size, self.tree, self._namespace(seq_id)
        blocks = self.req_to_blocks[seq_id]
        tokens = token_ids[:num_full * bs]
        num_dup = tree.insert(tokens, self._slots(blocks[:num_full]), ns) // bs
        if 0 < prompt_blocks < num_full:
            tree.insert(tokens[:prompt_blocks * bs], self._slots(blocks[:prompt_blocks]), ns)
        self.pool.free(self._slots(blocks[done:num_dup]))      # the tree had these already
        path, node = tree.match_prefix(tokens, ns)
        if seq_id in self.last_node:
            tree.dec_lock_ref(self.last_node[seq_id])
        tree.inc_lock_ref(node)
        self.req_to_blocks[seq_id] = [s // bs for s in path[::bs]] + blocks[num_full:]
        self.last_node[seq_id], self.num_cached_block[seq_id] = node, num_full

    def _cache_decoded(self, seq_id: int, token_ids: list[int], node: TreeNode, done: int,
                       num_full: int, prompt_blocks: int) -> None:
        """:meth:`cache_computed` for a sequence whose cached prefix (the path to its locked
        ``node``, ``done`` blocks) covers its prompt: the blocks it filled since are attached
        below ``node`` (``RadixCache.insert_below``), without walking, re-inserting or
        re-matching the path above, and the lock moves down by the new nodes only. What it
        leaves is what the walk from the root leaves (the same nodes, splits, locks, clock and
        access times: the path is stamped as ``match_prefix`` would), in time that grows with
        the blocks added, and with the number of nodes on the path for the time stamps, not
        with the tokens. SGLang's decode does not touch the tree at all (it inserts once the
        request finishes): see the module docstring."""
        bs, tree = self.block_size, self.tree
        blocks = self.req_to_blocks[seq_id]
        tokens = tuple(token_ids[done * bs:num_full * bs])
        num_dup, cached, end = tree.insert_below(node, tokens, self._slots(blocks[done:num_full]),
                                                 self._namespace(seq_id))
        num_dup //= bs
        if 0 < prompt_blocks < num_full:             # the prompt's boundary (split_prompt)
            tree._tick()                              # the tick of that insert
            self._split_at(node, done, prompt_blocks)
        self.pool.free(self._slots(blocks[done:done + num_dup]))   # the tree had these already
        blocks[done:done + num_dup] = [s // bs for s in cached[::bs]]     # the tree's blocks
        tree.stamp_path(end, tree._tick())            # the tick of match_prefix
        tree.inc_lock_ref(end, above=node)            # the lock moves from node down to end
        self.last_node[seq_id], self.num_cached_block[seq_id] = end, num_full

    def _split_at(self, node: TreeNode, done: int, prompt_blocks: int) -> None:
        """Make the end of the prompt's last whole block a node boundary, if it falls inside
        an edge of the path root..``node`` (which ends after ``done`` blocks)."""
        bs, end = self.block_size, done * self.block_size
        target = prompt_blocks * bs
        while node is not self.tree.root and end > target:
            start = end - len(node.key)
            if start < target:
                self.tree._split_node(node, target - start, node.extra_key)
                return
            node, end = node.parent, start

    # ------------------------------------------------------------------ give back
    def free(self, seq_id: int) -> None:
        """Give the sequence's private blocks back to the free list, in table order, and
        unlock its cached prefix (it stays in the tree, evictable): SGLang's
        ``release_kv_cache``. What it computed in full blocks is in the tree already
        (:meth:`cache_computed` ran after each of its steps), so nothing is inserted here."""
        blocks = self.req_to_blocks.pop(seq_id)
        cached = self.num_cached_block.pop(seq_id, 0)
        self.pool.free(self._slots(blocks[cached:]))
        if seq_id in self.last_node:
            self.tree.dec_lock_ref(self.last_node.pop(seq_id))
        self.num_slots.pop(seq_id, None)

    def reset_prefix_cache(self) -> bool:
        """Evict the whole tree; only while no sequence holds blocks."""
        if self.req_to_blocks:
            return False
        self.tree.evict(self.tree.evictable_size())
        return True

    # ------------------------------------------------------------- usage and checks
    def _free_counts(self) -> tuple[int, int]:
        return self.num_free_gpu_blocks, self.tree.evictable_size() // self.block_size

    def _tree_blocks(self) -> dict[int, TreeNode]:
        bs = self.block_size
        return {s // bs: n for n in self.tree.nodes() for s in n.value[::bs]}

    def check_invariants(self) -> None:
        """The tree's invariants; every block is free, in the tree or one sequence's private
        tail (the blocks past its cached prefix: a switched duplicate is on the free list, not
        in a table); a sequence's cached prefix is the path to its locked node; each node is
        locked once per sequence whose locked node is at or below it; with caching off the
        tree is empty."""
        bs, tree = self.block_size, self.tree
        tree.check_invariants()
        assert self.enable_caching or not tree.root.children, "caching off, a tree"
        in_tree = self._tree_blocks()
        for n in tree.nodes():
            for i in range(0, len(n.value), bs):
                b = n.value[i] // bs
                assert n.value[i:i + bs] == list(range(b * bs, (b + 1) * bs)), "not one block"
        free = set(self.pool.free_blocks)
        private = [b for s, bl in self.req_to_blocks.items()
                   for b in bl[self.num_cached_block.get(s, 0):]]
        assert len(private) == len(set(private)), "a private block in two tables"
        assert not (free & set(in_tree)) and not (free | set(in_tree)) & set(private), \
            "a block in two places"
        assert len(free) + len(in_tree) + len(private) == self.num_gpu_blocks, "a block lost"
        locks: dict[int, int] = {}
        for s, blocks in self.req_to_blocks.items():
            assert len(blocks) == cdiv(self.num_slots[s], bs), f"seq {s}: blocks vs slots"
            path, node = [], self.last_node.get(s, tree.root)
            while node is not tree.root:
                locks[id(node)] = locks.get(id(node), 0) + 1
                path = [v // bs for v in node.value[::bs]] + path
                node = node.parent
            assert path == blocks[:self.num_cached_block.get(s, 0)], f"seq {s}: cached prefix"
        for n in tree.nodes():
            assert n.lock_ref == locks.get(id(n), 0), "a lock nobody holds"
        assert set(self.last_node) <= set(self.req_to_blocks)

