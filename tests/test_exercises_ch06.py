"""Chapter 06's exercises: 6.2's operation sequences really evict, hit and cap, and each
wrong pool fails with the history that exposes it."""

from __future__ import annotations

import pytest

from course_lib.exercises import ch06

pytestmark = pytest.mark.ch06


def test_the_pool_cases_hit_evict_and_cap():
    hits = evictions = capped = 0
    for n, bs, ops in ch06.pool_cases():
        ref = ch06.ReferencePool(n, bs)
        for op in ops:
            before = ref.m.gpu.num_evictable_blocks
            got = getattr(ref, op[0])(*op[1:])
            if op[0] == "run":
                hits += got > 0
                held = len(ref.block_table(op[1])) - got // bs
                evictions += ref.m.gpu.num_evictable_blocks < before - got // bs
                capped += len(op[2]) % bs == 0 and got == len(op[2]) - bs and held == 1
    assert hits >= 30 and evictions >= 10 and capped >= 1


@pytest.mark.parametrize("wrong, words", [
    ("_EvictsTheNewest", "least recently used"),
    ("_NoCap", "leave one token to compute"),
    ("_FinishesHeadFirst", "released from its last block"),
])
def test_each_wrong_pool_is_told_what_it_missed(wrong, words):
    v = ch06.check_prefix_pool(getattr(ch06, wrong))
    assert not v.ok and words in v.first_problem and "op " in v.first_problem


def test_shared_blocks_wait_for_their_last_table():
    assert ch06.lru_order([[0, 1, 5], [0, 1, 2]]) == [5, 2, 1, 0]
    v = ch06.check_lru_order(ch06._no_ref_counts)
    assert "[[0, 1, 2], [0, 1, 5]]" in v.first_problem
