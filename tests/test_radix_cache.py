"""SGLang's radix-tree prefix cache: matches, splits, inserts, locks and LRU eviction of
unlocked leaves, page sizes and namespaces; a stateful test over a model of the KV slots."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from property_budget import examples

from course_lib.memory.radix.allocator import SlotPool
from course_lib.memory.radix.radix_cache import RadixCache

pytestmark = pytest.mark.ch06


def serve(cache: RadixCache, tokens, extra=None):
    """A request's life in SGLang's terms: match, lock, allocate the rest, (run), insert,
    free the duplicates, unlock. Returns the cached prefix length it found."""
    value, node = cache.match_prefix(tokens, extra)
    cache.inc_lock_ref(node)
    slots = value + cache.alloc(len(tokens) - len(value))
    done = cache.insert(tokens, slots, extra)
    cache.pool.free(slots[len(value):done])
    cache.dec_lock_ref(node)
    return len(value)


def test_a_prefix_is_shared_token_by_token_and_edges_split_where_prompts_part():
    cache = RadixCache(64)
    assert serve(cache, [1, 2, 3, 4, 5, 6]) == 0
    assert serve(cache, [1, 2, 3, 9, 9]) == 3          # any prefix, not whole blocks
    keys = sorted(len(n.key) for n in cache.nodes())
    assert keys == [2, 3, 3]                            # [1,2,3] split off, two branches
    assert cache.total_size() == 8 and cache.evictable_size() == 8
    value, node = cache.match_prefix([1, 2, 3, 4, 7])
    assert len(value) == 4 and cache.total_size() == 8  # split again at 4, no copy of KV
    cache.check_invariants()


def test_locked_paths_survive_eviction_and_the_lru_leaf_goes_first():
    cache = RadixCache(12)
    serve(cache, [1, 2, 3, 4])
    serve(cache, [5, 6, 7, 8])
    value, node = cache.match_prefix([1, 2, 3, 4])      # touch: [5..8] is now the LRU leaf
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 4
    assert cache.evict(10) == 4                          # only the unlocked leaf can go
    assert cache.match_prefix([5, 6, 7, 8])[0] == [] and len(cache.match_prefix([1, 2])[0]) == 2
    cache.dec_lock_ref(node)
    assert cache.evict(1) == 2                           # the leaf [3, 4] of the split
    assert cache.evict(10) == 2 and cache.total_size() == 0
    with pytest.raises(AssertionError, match="not locked"):     # a lock released twice
        cache.dec_lock_ref(node)
    cache.check_invariants()


def test_pages_namespaces_and_a_double_free():
    paged = RadixCache(32, page_size=4)
    assert serve(paged, list(range(10))) == 0            # 8 tokens cached, 2 left over
    assert paged.total_size() == 8
    assert serve(paged, list(range(6)) + [99, 99]) == 4  # whole pages only
    spaced = RadixCache(32)
    serve(spaced, [1, 2, 3], extra="alice")
    assert serve(spaced, [1, 2, 3], extra="bob") == 0 and serve(spaced, [1, 2, 3],
                                                               extra="alice") == 3
    with pytest.raises(AssertionError, match="double free"):
        SlotPool(2).free([0])


class RadixMachine(RuleBasedStateMachine):
    """Requests come and go; every slot records the namespace and the whole prefix it was
    written for, so a match that returned a slot of another prefix would be caught."""

    @initialize(num_slots=st.integers(8, 40), page_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_slots, page_size):
        self.cache = RadixCache(num_slots, page_size)
        self.kv: dict[int, tuple] = {}
        self.active: list[tuple] = []            # (tokens, slots, matched, node, extra)

    @rule(base=st.sampled_from([(1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 9), (7, 7, 7, 7, 7)]),
          cut=st.integers(1, 8), tail=st.lists(st.integers(0, 3), max_size=5),
          extra=st.sampled_from([None, "salt"]))
    def admit(self, base, cut, tail, extra):
        tokens = list(base[:cut]) + tail
        value, node = self.cache.match_prefix(tokens, extra)
        for j, s in enumerate(value):
            assert self.kv[s] == (extra, tuple(tokens[:j + 1])), "a match read another prefix"
        self.cache.inc_lock_ref(node)
        new = self.cache.alloc(len(tokens) - len(value))
        if new is None:
            self.cache.dec_lock_ref(node)
            return
        for i, s in enumerate(new):
            self.kv[s] = (extra, tuple(tokens[:len(value) + i + 1]))
        self.active.append((tokens, value + new, len(value), node, extra))

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def finish(self, data):
        i = data.draw(st.integers(0, len(self.active) - 1))
        tokens, slots, matched, node, extra = self.active.pop(i)
        done = self.cache.insert(tokens, slots, extra)
        self.cache.pool.free(slots[matched:done])
        n = len(tokens) - len(tokens) % self.cache.page_size
        self.cache.pool.free(slots[n:])           # a partial page is not cached
        self.cache.dec_lock_ref(node)

    @rule(n=st.integers(1, 20))
    def evict(self, n):
        before = self.cache.evictable_size()
        freed = self.cache.evict(n)
        assert freed >= min(n, before) or not self.cache.evictable_leaves

    @invariant()
    def consistent(self):
        self.cache.check_invariants()
        held = {s for _, slots, matched, _, _ in self.active for s in slots[matched:]}
        tree = {s for n in self.cache.nodes() for s in n.value}
        assert len(held) + len(tree) + self.cache.pool.available_size() == \
            self.cache.pool.num_slots, "slots leaked or counted twice"


TestRadixStateful = RadixMachine.TestCase
TestRadixStateful.settings = settings(max_examples=examples(80), stateful_step_count=40)
