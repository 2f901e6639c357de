"""Twins for SGLang's radix tree (tests/fidelity/harness.py): the course's
``course_lib.memory.radix.radix_cache.RadixCache`` and SGLang 0.5.23's
``sglang.srt.mem_cache.radix_cache.RadixCache`` (the algorithm the course models; SGLang's
server builds ``UnifiedRadixCache`` by default, over the same tree) driven by the same
operations, at any page size:

* ``("insert", tokens, extra_key)``: cache ``tokens`` with fresh slot numbers (the same on both
  sides); the answer is how many leading tokens were cached already.
* ``("match", tokens, extra_key)``: the longest cached prefix: its slots, and a handle on the
  node where it ends (for the locks).
* ``("lock", h)`` / ``("unlock", h)``: ``inc_lock_ref`` / ``dec_lock_ref`` on a handle's node
  (unlock only what the driver locked; a node evicted since is skipped on both sides).
* ``("evict", n)``: the slots freed, in the order they were freed, and how many.

The state compared after each operation: the whole tree (every edge's tokens, namespace,
slots and lock count, children in key order), ``evictable_size``, ``protected_size`` and the
number of evictable leaves. SGLang stamps nodes with ``time.monotonic()``; its module gets a
counter instead (ticking at every call, as the clock would), so that eviction order, which
is by last access, does not depend on the machine's clock resolution.
"""

from __future__ import annotations

import itertools
import types
from array import array
from typing import Any

from course_lib.memory.radix.radix_cache import RadixCache


class _Recorder:
    """Where evicted slots go: a list, in order (the course's pool interface)."""

    def __init__(self) -> None:
        self.freed: list[int] = []
        self.device = "cpu"

    # the course's pool
    def free(self, slots) -> None:
        self.freed += list(slots)

    def available_size(self) -> int:
        return 0

    def free_slots(self) -> set[int]:
        return set()

    # SGLang's allocator
    def free_segment(self, values, start_pos: int = 0) -> None:
        self.freed += list(values)


class _RadixTwin:
    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.locks: list[int] = []           # how many times the driver locked each handle
        self.next_slot = 0

    def apply(self, op: tuple) -> Any:
        kind = op[0]
        if kind == "insert":
            _, tokens, extra = op
            values = list(range(self.next_slot, self.next_slot + len(tokens)))
            self.next_slot += len(tokens)
            return self._insert(tokens, values, extra)
        if kind == "match":
            _, tokens, extra = op
            slots, node = self._match(tokens, extra)
            self.handles.append(node)
            self.locks.append(0)
            return {"slots": slots, "handle": len(self.handles) - 1}
        if kind in ("lock", "unlock"):
            h = op[1]
            if h >= len(self.handles) or not self._attached(self.handles[h]):
                return "skipped: no such node"
            if kind == "lock":
                self._lock(self.handles[h])
                self.locks[h] += 1
                return "locked"
            if not self.locks[h]:
                return "skipped: not locked"
            self._unlock(self.handles[h])
            self.locks[h] -= 1
            return "unlocked"
        if kind == "evict":
            self.pool.freed = []
            n = self._evict(op[1])
            return {"freed": list(self.pool.freed), "num_evicted": n}
        raise ValueError(op)


class CourseRadix(_RadixTwin):
    def __init__(self, page_size: int, cache_cls=RadixCache) -> None:
        super().__init__()
        self.pool = _Recorder()
        self.tree = cache_cls(1, page_size, pool=self.pool)

    def _insert(self, tokens, values, extra):
        return self.tree.insert(tokens, values, extra)

    def _match(self, tokens, extra):
        slots, node = self.tree.match_prefix(tokens, extra)
        return list(slots), node

    def _attached(self, node) -> bool:
        while node is not self.tree.root:
            if node.parent is None or node.parent.children.get(
                    self.tree._child_key(node.key, node.extra_key)) is not node:
                return False
            node = node.parent
        return True

    def _lock(self, node):
        self.tree.inc_lock_ref(node)

    def _unlock(self, node):
        self.tree.dec_lock_ref(node)

    def _evict(self, n):
        return self.tree.evict(n)

    def state(self) -> dict:
        def walk(node):
            return sorted(((tuple(c.key), c.extra_key, list(c.value), c.lock_ref, walk(c))
                           for c in node.children.values()), key=repr)

        return {"tree": walk(self.tree.root), "evictable": self.tree.evictable_size(),
                "protected": self.tree.protected_size(),
                "evictable_leaves": len(self.tree.evictable_leaves)}


class RealRadix(_RadixTwin):
    def __init__(self, page_size: int, sglang) -> None:
        super().__init__()
        self.sg = sglang
        mod = sglang.radix_cache
        clock = itertools.count(1)
        # the module's `time`: a counter for monotonic() (see the module docstring)
        mod.time = types.SimpleNamespace(monotonic=lambda: next(clock),
                                         perf_counter=lambda: 0.0)
        self.pool = _Recorder()
        params = sglang.cache_init_params.CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.pool,
            page_size=page_size)
        self.tree = mod.RadixCache(params)

    def _key(self, tokens, extra):
        return self.sg.radix_cache.RadixKey(array("q", tokens), extra)

    def _insert(self, tokens, values, extra):
        base = self.sg.base_prefix_cache
        from upstream import Tensor

        result = self.tree.insert(base.InsertParams(key=self._key(tokens, extra),
                                                    value=Tensor(values)))
        return result.prefix_len

    def _match(self, tokens, extra):
        base = self.sg.base_prefix_cache
        result = self.tree.match_prefix(base.MatchPrefixParams(key=self._key(tokens, extra)))
        node = result.last_device_node
        slots = list(self.tree.path_device_indices(node))
        assert len(slots) == result.device_prefix_len
        return slots, node

    def _attached(self, node) -> bool:
        ps = self.tree.page_size
        while node is not self.tree.root_node:
            if node.parent is None or node.parent.children.get(
                    node.key.child_key(ps)) is not node:
                return False
            node = node.parent
        return True

    def _lock(self, node):
        self.tree.inc_lock_ref(node)

    def _unlock(self, node):
        self.tree.dec_lock_ref(node)

    def _evict(self, n):
        return self.tree.evict(self.sg.base_prefix_cache.EvictParams(num_tokens=n)) \
            .num_tokens_evicted

    def state(self) -> dict:
        def walk(node):
            return sorted(((tuple(c.key.token_ids), c.key.extra_key, list(c.value),
                            c.lock_ref, walk(c)) for c in node.children.values()), key=repr)

        return {"tree": walk(self.tree.root_node), "evictable": self.tree.evictable_size(),
                "protected": self.tree.protected_size(),
                "evictable_leaves": len(self.tree.evictable_leaves)}


# ------------------------------------------------------------------------------ allocators
class _PagesTwin:
    """SGLang's slot allocators and the course's (``course_lib.memory.radix.allocator``),
    page ids on both sides as the course's (SGLang's page ``p`` is the course's ``p - 1``: its
    page 0 takes the dummy writes of padded tokens):

    * ``("alloc", num_pages)``: the pages handed out, in order, or None when short;
    * ``("free", i, reverse)``: give back the ``i``-th allocation still held (modulo how many),
      its pages in the order they came, or reversed; SGLang's ``free_segment``, what its tree's
      eviction and ``_insert_cache`` call, frees them in the order given.

    The state compared: ``available_size`` and the whole free list, front first."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.held: list[list[int]] = []

    def apply(self, op: tuple) -> Any:
        if op[0] == "alloc":
            pages = self._alloc(op[1])
            if pages is not None:
                self.held.append(pages)
            return pages
        if op[0] == "free":
            if not self.held:
                return "skipped: nothing held"
            pages = self.held.pop(op[1] % len(self.held))
            self._free(pages[::-1] if op[2] else pages)
            return "freed"
        raise ValueError(op)

    def _slots(self, pages: list[int], base: int) -> list[int]:
        ps = self.page_size
        return [(p + base) * ps + i for p in pages for i in range(ps)]


class CoursePages(_PagesTwin):
    def __init__(self, num_pages: int, page_size: int) -> None:
        from course_lib.memory.radix.allocator import BlockSlotPool, SlotPool

        super().__init__(page_size)
        self.pool = SlotPool(num_pages) if page_size == 1 else \
            BlockSlotPool(num_pages, page_size)

    def _alloc(self, n):
        slots = self.pool.alloc(n * self.page_size)
        return None if slots is None else [s // self.page_size for s in slots[::self.page_size]]

    def _free(self, pages):
        self.pool.free(self._slots(pages, 0))

    def state(self) -> dict:
        free = list(self.pool._free) if self.page_size == 1 else self.pool.free_blocks[::-1]
        return {"available": self.pool.available_size(), "free_list": list(free)}


class RealPages(_PagesTwin):
    def __init__(self, num_pages: int, page_size: int, allocators) -> None:
        super().__init__(page_size)
        size = num_pages * page_size
        if page_size == 1:
            self.pool = allocators.token.TokenToKVPoolAllocator(
                size, "int64", "cpu", kvcache=None, need_sort=False)
        else:
            self.pool = allocators.paged.PagedTokenToKVPoolAllocator(
                size, page_size, "int64", "cpu", kvcache=None, need_sort=False)

    def _alloc(self, n):
        slots = self.pool.alloc(n * self.page_size)
        if slots is None:
            return None
        return [s // self.page_size - 1 for s in slots[::self.page_size]]

    def _free(self, pages):
        from upstream import Tensor

        self.pool.free_segment(Tensor(self._slots(pages, 1)), start_pos=0)

    def state(self) -> dict:
        return {"available": self.pool.available_size(),
                "free_list": [p - 1 for p in self.pool.free_pages]}
