"""Exercise 12.3 (V1's allocate_slots): its cases reach every idea the exercise names, its
checker names the idea a plausible wrong answer missed, and 12.1/12.2 (now on judge_cases)
still explain their differences in the learner's terms."""

from __future__ import annotations

import pytest

from course_lib.exercises import ch12, ch12_allocate
from course_lib.exercises.ch12_allocate import check_allocate_slots
from course_lib.exercises.solutions import ch12 as solutions

pytestmark = pytest.mark.ch12


def _rooms():
    """Every step of every case, with the room the library saw and what it returned."""
    for *setup, ops in ch12_allocate.allocate_cases():
        lib = ch12_allocate.LibraryRun(*setup)
        for op in ops:
            if op[0] == "step":
                room = lib.room(*op[1:])
                yield setup, room, lib.step(*op[1:])
            else:
                lib.free(op[1])


def test_the_cases_reach_every_idea_of_the_exercise():
    rooms = list(_rooms())
    refused = [r for _, r, ret in rooms if ret is None]
    assert len(refused) >= 20
    # refused only because the free hits count (else it would have fit)
    assert any(r["evictable"] and r["new"] <= r["free"] for r in refused)
    # allocated with hits held elsewhere that would not fit if they were counted
    assert any(ret is not None and r["new"] + len(r["hits"]) > r["free"]
               for _, r, ret in rooms)
    # the watermark refuses an admission, and a running request uses the watermark's blocks
    assert any(r["admission"] and s[2] and r["new"] + len(r["evictable"]) <= r["free"]
               for s, r, _ in [(s, r, ret) for s, r, ret in rooms if ret is None])
    assert any(not r["admission"] and s[2] and r["new"] > r["free"] - s[2]
               for s, r, ret in rooms if ret is not None)
    # steps that end inside a block (a partial last block that must not be cached)
    assert sum(r["total"] % s[1] != 0 for s, r, ret in rooms if ret is not None) >= 20


def test_the_solution_passes_and_the_stub_is_not_attempted():
    assert check_allocate_slots(solutions.allocate_slots).ok

    def stub(*args):
        raise NotImplementedError

    assert "not attempted" in str(check_allocate_slots(stub))


@pytest.mark.parametrize("wrong, idea", [
    (ch12.hits_are_free, "a hit block with ref count 0 sits in the free queue"),
    (ch12.touches_then_checks, "a step that returns None must change nothing"),
    (ch12.caches_partial_block, "is a partial block being cached?"),
    (ch12.no_watermark, "an admission must leave the watermark's 2 blocks free"),
    (ch12.watermark_always, "the watermark holds blocks back from admissions only"),
    (ch12.all_hits_cost, "already held by another request (ref count > 0)"),
    (ch12.touches_hits_last, "taken after the hits are touched"),
])
def test_each_wrong_answer_is_told_the_idea_it_missed(wrong, idea):
    verdict = check_allocate_slots(wrong)
    assert verdict.attempted and not verdict.ok
    assert idea in verdict.first_problem, verdict.first_problem
    assert "after " in verdict.first_problem and "free blocks:" in verdict.first_problem


def test_a_partial_block_given_a_future_hash_is_named():
    """With a hash for it (the prompt goes on), caching the partial block raises nothing: the
    checker sees the block cached too early."""
    def caches_partial_when_it_can(pool, req, n, hits, bs, watermark):
        new = solutions.allocate_slots(pool, req, n, hits, bs, watermark)
        if new is not None:
            upto = min(len(req.blocks), len(req.block_hashes))
            pool.cache_full_blocks(req.blocks, req.block_hashes, req.num_cached_block, upto)
        return new

    problem = check_allocate_slots(caches_partial_when_it_can).first_problem
    assert "is cached, the library's is not: only full blocks" in problem, problem


def test_returning_the_whole_table_is_told_so():
    def whole_table(pool, req, n, hits, bs, watermark):
        new = solutions.allocate_slots(pool, req, n, hits, bs, watermark)
        return None if new is None else req.blocks

    problem = check_allocate_slots(whole_table).first_problem
    assert "return only the blocks this step took" in problem, problem


def test_a_learner_exception_is_a_verdict_not_a_crash():
    def breaks(pool, req, n, hits, bs, watermark):
        raise KeyError("oops")

    verdict = check_allocate_slots(breaks)
    assert verdict.passed == 0 and "raises KeyError" in verdict.first_problem


def test_judge_cases_checkers_still_explain_in_the_learner_terms():
    verdict = ch12.check_free_queue_predictions(lambda: None)
    assert "not a dict {scenario: prediction}" in verdict.first_problem
    verdict = ch12.check_free_queue_predictions(lambda: 1 / 0)
    assert "freed" in verdict.first_problem and "ZeroDivisionError" in verdict.first_problem
    verdict = ch12.check_radix_hit(lambda p, e, ps: 0)
    assert "longest common prefix" in verdict.first_problem
