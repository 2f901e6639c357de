"""The course's radix tree (``course_lib.memory.radix.radix_cache.RadixCache``) beside SGLang
0.5.23's own ``RadixCache``: the same hypothesis-generated inserts, matches, lock changes and
evictions, the same answers (tests/fidelity/sglang_twins.py says what is compared), at page
sizes 1 (token by token) and 16 (whole pages, the course's blocks), and 2."""

from __future__ import annotations

import random

import pytest
from harness import run_lockstep
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang_twins import CoursePages, CourseRadix, RealPages, RealRadix


def radix_ops_from(rng: random.Random, n: int, page_size: int) -> list[tuple]:
    """Token runs over a 3-token alphabet (so that prefixes are shared and split anywhere),
    two namespaces, locks on the nodes matches returned, evictions of a few pages."""
    ops, handles = [], 0
    for _ in range(n):
        kind = rng.choices(["insert", "match", "lock", "unlock", "evict"], [4, 3, 2, 2, 2])[0]
        if kind in ("insert", "match"):
            length = rng.randrange(0, 4 * page_size + 3)
            tokens = [rng.randrange(3) for _ in range(length)]
            ops.append((kind, tokens, rng.choice([None, None, "lora-a"])))
            handles += kind == "match"
        elif kind == "evict":
            ops.append(("evict", rng.randrange(0, 3 * page_size + 2)))
        else:
            ops.append((kind, rng.randrange(max(handles, 1))))
    return ops


@pytest.mark.parametrize("page_size", [1, 2, 16])
def test_radix_cache_matches_sglangs(sglang, page_size):
    """Match lengths and slots, insert prefix lengths, evicted slots in eviction order, the
    whole tree, evictable and protected sizes."""

    @settings(max_examples=300 if page_size != 2 else 150)
    @given(seed=st.integers(0, 2**32 - 1), n=st.integers(5, 40))
    def check(seed, n):
        ops = radix_ops_from(random.Random(seed), n, page_size)
        run_lockstep(f"RadixCache(page_size={page_size})", ops, CourseRadix(page_size),
                     RealRadix(page_size, sglang))

    check()


def test_a_matched_prefix_is_locked_and_evicted_last_as_in_sglang(sglang):
    """The course's chapter-12 story, on both trees: a locked path survives eviction, the
    least recently used leaf goes first, a split node's halves are evicted leaf first."""
    ops = [("insert", [1, 2, 3, 4, 5, 6], None), ("insert", [1, 2, 3, 9, 9], None),
           ("insert", [7, 7, 7], None), ("match", [1, 2, 3, 4, 5, 6], None), ("lock", 0),
           ("evict", 100), ("unlock", 0), ("evict", 1), ("evict", 100)]
    course, real = CourseRadix(1), RealRadix(1, sglang)
    run_lockstep("RadixCache(page_size=1)", ops, course, real)
    assert course.apply(("match", [1, 2, 3], None))["slots"] == []


def page_ops_from(rng: random.Random, n: int) -> list[tuple]:
    """Allocations of 0-3 pages and frees of what is held, in order or reversed."""
    return [("alloc", rng.randrange(4)) if rng.random() < 0.55
            else ("free", rng.randrange(8), rng.random() < 0.5) for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 2, 16])
def test_allocators_hand_out_pages_in_sglangs_order(sglang_allocators, page_size):
    """``SlotPool`` beside ``TokenToKVPoolAllocator`` (page size 1: from the front, freed
    slots to the back) and ``BlockSlotPool`` beside ``PagedTokenToKVPoolAllocator`` (freed
    pages to the front, in the order given), ``need_sort`` off as SGLang sets it outside
    disaggregation: the pages handed out, the whole free list, the available size."""

    @settings(max_examples=150)
    @given(seed=st.integers(0, 2**32 - 1), n=st.integers(5, 40), pages=st.integers(1, 8))
    def check(seed, n, pages):
        ops = page_ops_from(random.Random(seed), n)
        run_lockstep(f"allocator(page_size={page_size})", ops, CoursePages(pages, page_size),
                     RealPages(pages, page_size, sglang_allocators))

    check()
