"""Exercises 14.1 (which blocks a sliding-window group frees) and 14.2 (the longest hit over a
full and a windowed group): the references follow the statements, the solutions are what the
real hybrid KVCacheManager does on a run, each wrong answer fails with the case its rule
names, and answers that do nothing fail."""

from __future__ import annotations

import random

import pytest

from course_lib.exercises import ch14
from course_lib.exercises.solutions import ch14 as solutions
from course_lib.memory.v1.kv_cache_groups import get_kv_cache_groups
from course_lib.memory.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from course_lib.memory.v1.kv_cache_manager import KVCacheManager

pytestmark = pytest.mark.ch14


def test_the_references_follow_the_statements():
    # window 4, blocks of 2: token 5 attends to 2..5, so tokens 0, 1 (block 0) are out
    assert ch14.blocks_freed(0, 5, 4, 2) == [0]
    assert ch14.blocks_freed(0, 6, 4, 4) == []             # 3 tokens out: no whole block
    assert ch14.blocks_freed(10, 4, 4, 2) == [3, 4]        # 0..2 went with token 10
    assert ch14.blocks_freed(0, 2, 8, 2) == []
    T, F = True, False
    assert ch14.longest_hit([T, T, T], [T, T, T], 4, 2, 7) == 6
    assert ch14.longest_hit([T, F, T], [T, T, T], 4, 2, 7) == 2
    assert ch14.longest_hit([T] * 5, [F, F, F, T, T], 4, 2, 11) == 10
    assert ch14.longest_hit([T, T, F, F, F], [F, T, F, T, T], 4, 2, 11) == 0


def hybrid(block_size: int, window: int, num_blocks: int) -> KVCacheManager:
    groups = get_kv_cache_groups({"layers.0": SlidingWindowSpec(block_size,
                                                                sliding_window=window),
                                  "layers.1": FullAttentionSpec(block_size)})
    return KVCacheManager(block_size, num_blocks, kv_cache_groups=groups)


@pytest.mark.parametrize("block_size, window", [(1, 3), (2, 5), (4, 6), (4, 16)])
def test_14_1_is_what_a_decoding_request_frees_at_each_step(block_size, window):
    """A prompt in chunks, then decode: at every allocate_slots, the window group's entries
    that turn null are the solution's, from the count the previous call had."""
    m, null = hybrid(block_size, window, 64), 0
    tokens = list(range(1, 60))
    previous, computed, freed_seen = 0, 0, 0
    for step in [7, 5] + [1] * 30:
        before = m.get_block_tables(0)[0] if computed else []
        m.allocate_slots(0, tokens, computed, step)
        after = m.get_block_tables(0)[0]
        got = [i for i, b in enumerate(before) if b != null and after[i] == null]
        assert got == solutions.blocks_freed(previous, computed - previous, window,
                                             block_size), (previous, computed)
        freed_seen += len(got)
        previous, computed = computed, computed + step
    m.check_invariants()
    assert freed_seen > 0


@pytest.mark.parametrize("seed", range(4))
def test_14_2_is_the_hit_a_real_manager_finds(seed):
    """Requests sharing prefixes run and finish in a small pool, so that blocks are evicted
    in one group and not the other; each new prompt's hit is the solution's, read from which
    of its blocks each group still caches."""
    rng = random.Random(seed)
    bs, window = 2, rng.choice([3, 4, 6])
    m = hybrid(bs, window, 21)
    stems = [[rng.randrange(1, 4) for _ in range(12)] for _ in range(3)]
    checked = 0
    for seq in range(30):
        prompt = rng.choice(stems)[:rng.randrange(4, 13)] + [100 + seq]
        full, win = [], []
        hits, num_hit = m.get_computed_blocks(seq, prompt)
        hashes = m.req_to_block_hashes[seq]
        for h in hashes:
            win.append(m.block_pool.get_cached_block(h, 0) is not None)
            full.append(m.block_pool.get_cached_block(h, 1) is not None)
        assert num_hit == solutions.longest_hit(full, win, window, bs, len(prompt)), \
            (prompt, full, win)
        checked += num_hit > 0
        assert m.allocate_slots(seq, prompt, 0, len(prompt) - num_hit, hits) is not None
        computed = len(prompt)
        for _ in range(rng.randrange(0, 4)):        # a few decode steps (windows slide)
            prompt.append(7)
            m.allocate_slots(seq, prompt, computed, 1)
            computed += 1
        m.free(seq)
        m.forget(seq)
        m.check_invariants()
    assert checked >= 5


@pytest.mark.parametrize("wrong, words", [
    (ch14._WINDOW_OFF_BY_ONE, "then 5 more: yours [], the library frees [0]"),
    (ch14._rounds_up, "then 6 more: yours [0], the library frees []"),
    (ch14._FREES_AGAIN, "yours [0, 1, 2, 3, 4], the library frees [3, 4]"),
])
def test_14_1_names_the_blocks_that_differ(wrong, words):
    verdict = ch14.check_blocks_freed(wrong)
    assert not verdict.ok and words in verdict.first_problem, verdict.first_problem


@pytest.mark.parametrize("wrong, words", [
    (ch14._FULL_FURTHEST, "yours 8, the library's hit is 2 tokens"),
    (ch14._WINDOW_LIKE_FULL, "yours 0, the library's hit is 10 tokens"),
    (ch14._ONE_ROUND, "the window group [1, 3, 4]: yours 4, the library's hit is 0 tokens"),
])
def test_14_2_names_the_tokens_that_differ(wrong, words):
    verdict = ch14.check_longest_hit(wrong)
    assert not verdict.ok and words in verdict.first_problem, verdict.first_problem


@pytest.mark.parametrize("ex", list(ch14.EXERCISES), ids=lambda e: e.number)
def test_every_rule_fails_its_own_case_and_the_solution_passes(ex):
    """What tests/test_exercises.py holds every registered exercise to, run here directly."""
    assert ex.checker(ex.solution).ok
    cases = ex.checker(ex.solution).cases
    for rule in ex.rules:
        assert any(rule.case in c for c in cases), rule.text
        verdict = ex.checker(rule.wrong)
        assert not verdict.ok and any(rule.case in f for f in verdict.failed), \
            (rule.text, verdict.first_problem)
    for answer in ex.trivial:
        verdict = ex.checker(answer)
        assert verdict.attempted and not verdict.ok


def test_a_stub_a_learner_exception_or_a_bool_is_a_verdict():
    def stub(*args):
        raise NotImplementedError

    assert not ch14.check_blocks_freed(stub).attempted
    assert "raised KeyError" in ch14.check_blocks_freed(lambda *a: {}["x"]).first_problem
    assert not ch14.check_longest_hit(lambda *a: True).ok
