"""SGLang's prefix cache: a radix tree over token ids (RadixAttention), pure Python.

SGLang keeps no block hashes: it keeps every cached prefix in a radix tree whose edges are runs
of token ids and whose values are the KV-cache slots of those tokens (one slot per token when
``page_size`` is 1, whole pages otherwise). Where vLLM finds a prefix by hashing block after
block and looking each hash up, SGLang walks the tree from the root; where vLLM can only share
whole blocks, a radix tree at page size 1 shares any prefix, token by token.

This module follows SGLang 0.5.23's ``RadixCache``
(``python/sglang/srt/mem_cache/radix_cache.py``), the tree in its plain form. SGLang's server
builds ``UnifiedRadixCache`` instead (``srt/mem_cache/unified_radix_cache.py``, picked in
``srt/mem_cache/registry.py``), which keeps this algorithm (match and split, lock refs,
eviction of unlocked leaves, least recently used by default) over a tree core in Rust by default
(``srt/mem_cache/unified_cache/``, with a Python core as fallback) and adds sliding-window and
Mamba state and a host-memory tier; ``RadixCache`` backs the scheduler's simulated tree of the
waiting queue and a few subclasses.

* :meth:`RadixCache.match_prefix`: the slots of the longest cached prefix, and its last node;
  a match that ends inside an edge splits it, so that the boundary is a node.
* :meth:`RadixCache.insert`: add a request's tokens and slots; returns how many leading tokens
  were cached already (their slots in the request are duplicates: the caller frees them).
  SGLang's caller (``checkpoint_kv_cache`` in ``srt/mem_cache/common.py`` ->
  ``RadixCache.checkpoint``; ``cache_unfinished_req`` in earlier releases) inserts after every
  prefill chunk and again when the request finishes, frees the duplicates, points the request
  at the tree's slots and moves its lock to the new last node; the course's V1 manager does the
  same after each step (``RadixKVCacheManager.cache_computed`` in ``kv_cache_manager.py``).
* ``inc_lock_ref`` / ``dec_lock_ref``: a running request locks the path to its last node, so
  that nothing it reads is evicted; ``evictable_size`` and ``protected_size`` count tokens.
* :meth:`RadixCache.evict`: free tokens by removing unlocked leaves, least recently used first
  (a parent that becomes an unlocked leaf joins the candidates).
* A namespace (``extra_key``: a LoRA id, a cache salt) is part of every child key, so equal
  tokens under different namespaces never share nodes.

The slots come from an allocator (``allocator.py``), handed out in SGLang's order:
:class:`~course_lib.memory.radix.allocator.SlotPool`, a first-in, first-out free list of token
slots standing in for SGLang's ``TokenToKVPoolAllocator``, or whole blocks (``BlockSlotPool``,
its ``PagedTokenToKVPoolAllocator``: freed pages go out first). Time is a logical
clock (a counter), so eviction order is reproducible: it ticks where SGLang reads
``time.monotonic()``, once per lookup or insert (every node on the path gets that time) and
once more for each node made (a split, a new leaf), so that no two leaves share a time and the
least recently used one is SGLang's.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

from .allocator import SlotPool


class TreeNode:
    """An edge of the tree (``key``: its tokens) and the node it leads to."""

    __slots__ = ("children", "parent", "key", "value", "extra_key", "lock_ref",
                 "last_access_time")

    def __init__(self, key: tuple = (), value: list[int] | None = None,
                 parent: TreeNode | None = None, extra_key: Hashable = None) -> None:
        self.children: dict[Hashable, TreeNode] = {}
        self.parent = parent
        self.key = key                    # token ids of the edge into this node
        self.value = value or []          # their KV slots, one per token
        self.extra_key = extra_key        # its namespace
        self.lock_ref = 0
        self.last_access_time = 0


class RadixCache:
    """A radix tree of cached prefixes over a :class:`SlotPool` (see the module docstring)."""

    def __init__(self, num_slots: int, page_size: int = 1, pool: SlotPool | None = None) -> None:
        """``pool``: where slots come from and go back to (default: a :class:`SlotPool` of
        ``num_slots``); anything with ``alloc``, ``free``, ``available_size`` and
        ``free_slots``, e.g. whole KV-cache blocks (``allocator.BlockSlotPool``)."""
        self.page_size = page_size
        self.pool = pool if pool is not None else SlotPool(num_slots)
        self.root = TreeNode()
        self.root.lock_ref = 1            # never evicted
        self.evictable_size_ = 0          # tokens in unlocked nodes
        self.protected_size_ = 0          # tokens in locked nodes
        self.evictable_leaves: set[TreeNode] = set()
        self._clock = 0

    # ------------------------------------------------------------------------- keys
    def _child_key(self, tokens: Sequence[int], extra_key: Hashable) -> Hashable:
        first = tokens[0] if self.page_size == 1 else tuple(tokens[:self.page_size])
        return first if extra_key is None else (extra_key, first)

    def _match_len(self, key: Sequence[int], tokens: Sequence[int]) -> int:
        """Common prefix length of two token runs, in whole pages. Compared by slices, page by
        page (SGLang's ``_key_match_paged``), after one comparison of the whole overlap, which
        is how most lookups end: a run that is all there."""
        limit = min(len(key), len(tokens))
        limit -= limit % self.page_size
        if key[:limit] == tokens[:limit]:
            return limit
        n, ps = 0, self.page_size
        if ps == 1:
            while key[n] == tokens[n]:                 # stops before limit: they differ there
                n += 1
            return n
        while key[n:n + ps] == tokens[n:n + ps]:
            n += ps
        return n

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---------------------------------------------------------------- match, insert
    def match_prefix(self, token_ids: Sequence[int], extra_key: Hashable = None
                     ) -> tuple[list[int], TreeNode]:
        """The slots of the longest cached prefix of ``token_ids`` (whole pages) and the node
        where it ends (split there if it ends inside an edge)."""
        tokens = tuple(token_ids[:len(token_ids) - len(token_ids) % self.page_size])
        node, value, now = self.root, [], self._tick()
        node.last_access_time = now
        while tokens:
            child = node.children.get(self._child_key(tokens, extra_key))
            if child is None:
                break
            child.last_access_time = now
            n = self._match_len(child.key, tokens)
            if n < len(child.key):
                if n:
                    node = self._split_node(child, n, extra_key)
                    value += node.value
                break
            value += child.value
            node, tokens = child, tokens[n:]
        return value, node

    def peek_prefix(self, token_ids: Sequence[int], extra_key: Hashable = None
                    ) -> list[tuple[TreeNode, int]]:
        """The nodes along the longest cached prefix of ``token_ids`` (whole pages) and how
        many tokens of each edge match, changing nothing: no split, no access time (a probe,
        for a caller that may not go on to use the prefix)."""
        n_pages = len(token_ids) - len(token_ids) % self.page_size
        tokens, node, path = tuple(token_ids[:n_pages]), self.root, []
        while tokens:
            child = node.children.get(self._child_key(tokens, extra_key))
            if child is None:
                break
            n = self._match_len(child.key, tokens)
            if n:
                path.append((child, n))
            if n < len(child.key):
                break
            node, tokens = child, tokens[n:]
        return path

    def _split_node(self, child: TreeNode, n: int, extra_key: Hashable) -> TreeNode:
        """Cut ``child``'s edge after ``n`` tokens: a new node holds the first part."""
        new = TreeNode(child.key[:n], child.value[:n], child.parent, extra_key)
        new.lock_ref, new.last_access_time = child.lock_ref, self._tick()   # stamped when made
        child.parent.children[self._child_key(child.key, extra_key)] = new
        child.key, child.value, child.parent = child.key[n:], child.value[n:], new
        new.children[self._child_key(child.key, extra_key)] = child
        return new

    def insert(self, token_ids: Sequence[int], value: Sequence[int],
               extra_key: Hashable = None) -> int:
        """Cache ``token_ids`` with their slots ``value`` (whole pages). Returns how many
        leading tokens were cached already: the caller's slots for those are duplicates,
        for it to free (the tree keeps its own). One slot per token."""
        n_pages = len(token_ids) - len(token_ids) % self.page_size
        done, _, _ = self.insert_below(self.root, tuple(token_ids[:n_pages]),
                                       list(value[:n_pages]), extra_key)
        return done

    def insert_below(self, node: TreeNode, tokens: tuple, value: list[int],
                     extra_key: Hashable = None) -> tuple[int, list[int], TreeNode]:
        """:meth:`insert`'s walk from ``node`` instead of the root, for tokens (whole pages)
        that continue the path root..node: how many leading tokens were cached already, the
        tree's slots for them, and the node where the tokens end. Only the nodes below
        ``node`` get this access's time; the caller stamps the path above
        (:meth:`stamp_path`). A sequence that filled one more block while decoding attaches it
        under its locked node this way, in time that does not grow with the sequence."""
        done, cached, now = 0, [], self._tick()
        while tokens:
            child = node.children.get(self._child_key(tokens, extra_key))
            if child is None:
                new = TreeNode(tokens, value, node, extra_key)
                new.last_access_time = self._tick()          # stamped when made
                node.children[self._child_key(tokens, extra_key)] = new
                self.evictable_size_ += len(tokens)
                self._update_leaf_status(node)
                self._update_leaf_status(new)
                return done, cached, new
            child.last_access_time = now
            n = self._match_len(child.key, tokens)
            if n < len(child.key):
                child = self._split_node(child, n, extra_key)
            done += n
            cached += child.value
            node, tokens, value = child, tokens[n:], value[n:]
        return done, cached, node

    def stamp_path(self, node: TreeNode, now: int) -> None:
        """Give ``node`` and every node above it, the root included, the access time ``now``
        (what :meth:`match_prefix` of the path's tokens leaves)."""
        while node is not None:
            node.last_access_time = now
            node = node.parent

    # ------------------------------------------------------------- locks, eviction
    def inc_lock_ref(self, node: TreeNode, above: TreeNode | None = None) -> None:
        """A request now reads the path root..node: none of it may be evicted. ``above``: a
        node on that path the request has locked already (its lock moves down to ``node``):
        only the nodes below it are counted, as ``dec_lock_ref(above)`` then
        ``inc_lock_ref(node)`` would leave them."""
        while node is not self.root and node is not above:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
            node.lock_ref += 1
            self._update_leaf_status(node)
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "dec_lock_ref on a node that is not locked"
            if node.lock_ref == 1:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
            node.lock_ref -= 1
            self._update_leaf_status(node)
            node = node.parent

    def _update_leaf_status(self, node: TreeNode) -> None:
        """``node`` is in ``evictable_leaves`` exactly while it is an unlocked leaf (SGLang
        0.5.23's ``_update_leaf_status``, ``srt/mem_cache/radix_cache.py``)."""
        if node is not self.root and node.lock_ref == 0 and not node.children:
            self.evictable_leaves.add(node)
        else:
            self.evictable_leaves.discard(node)

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots (if possible) by removing unlocked leaves, least
        recently used first; returns the tokens freed. As SGLang's ``evict``, the leaves are
        put in a heap once per call (by access time: no two share one), and a parent left an
        unlocked leaf joins it."""
        if num_tokens <= 0 or not self.evictable_leaves:
            return 0
        heap = [(n.last_access_time, id(n), n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            self.pool.free(leaf.value)
            freed += len(leaf.value)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key, leaf.extra_key)]
            self.evictable_leaves.discard(leaf)
            self.evictable_size_ -= len(leaf.key)
            self._update_leaf_status(parent)
            if parent in self.evictable_leaves:
                heapq.heappush(heap, (parent.last_access_time, id(parent), parent))
        return freed

    def alloc(self, n: int) -> list[int] | None:
        """``n`` slots, evicting cached tokens if the pool is short; None if even that fails."""
        if self.pool.available_size() < n:
            self.evict(n - self.pool.available_size())
        return self.pool.alloc(n)

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack += node.children.values()
        return out

    def total_size(self) -> int:
        return sum(len(n.key) for n in self.nodes())

    def metadata_bytes(self) -> int:
        """Python-object bytes the tree holds besides the KV cache (``sys.getsizeof``)."""
        import sys

        return sum(sys.getsizeof(n) + sys.getsizeof(n.children) + sys.getsizeof(n.key)
                   + sys.getsizeof(n.value) for n in self.nodes())

    def check_invariants(self) -> None:
        """One slot per token, each slot in one place; sizes and leaves as counted; a child
        sits under its own first token; a locked node's parent is locked too."""
        nodes = self.nodes()
        slots = [s for n in nodes for s in n.value]
        assert len(slots) == len(set(slots)), "a slot is in the tree twice"
        assert not set(slots) & self.pool.free_slots(), "a cached slot is on the free list"
        assert all(len(n.key) == len(n.value) and n.key for n in nodes), "bad edge"
        assert all(len(n.key) % self.page_size == 0 for n in nodes), "edge not in whole pages"
        assert self.evictable_size_ == sum(len(n.key) for n in nodes if n.lock_ref == 0)
        assert self.protected_size_ == sum(len(n.key) for n in nodes if n.lock_ref > 0)
        leaves = {n for n in nodes if not n.children and n.lock_ref == 0}
        assert self.evictable_leaves == leaves, "evictable leaves out of date"
        for n in nodes:
            assert n.parent.children.get(self._child_key(n.key, n.extra_key)) is n, \
                "child under a wrong key"
            assert n.parent is self.root or n.parent.lock_ref >= n.lock_ref, \
                "a locked node under an unlocked parent"
