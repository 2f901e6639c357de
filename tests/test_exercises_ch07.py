"""Chapter 07's exercises: 7.3 decides near the crossover and on exact ties, 7.1 accepts a
tuple, 7.2's explanations replay the V0 scheduler and its feedback, like 7.4's, names the
scheduling rule that was broken."""

from __future__ import annotations

import math

import pytest

from course_lib.exercises import ch07, ch07_swap
from course_lib.exercises.ch07_schedule import (
    _admits_after_preempting,
    _no_chunked_prefill,
    _preempts_the_one_that_needs,
    check_schedule_step,
    schedule_cases,
    schedule_step,
)
from course_lib.exercises.ch07_swap import (
    check_schedule_running_and_swapped,
    explain_step,
    schedule_running_and_swapped,
    swap_cases,
)
from course_lib.sim.replay import CostModel

pytestmark = pytest.mark.ch07


def test_7_3_has_exact_ties_and_cases_on_both_sides_of_the_crossover():
    for bs, kv in ((16, 524_288), (8, 524_288), (32, 131_072)):
        tie = ch07.tie_s_per_token(bs, kv)
        cm = CostModel(s_per_token=tie, kv_bytes_per_token=kv)
        assert math.isclose(cm.recompute_time(10 * bs), 2 * cm.swap_time(10, bs), rel_tol=1e-12)
        assert ch07.cheaper_preemption(10 * bs, bs, kv, tie) == "recompute"
        assert ch07.cheaper_preemption(10 * bs, bs, kv, 1.03 * tie) == "swap"
        assert ch07.cheaper_preemption(10 * bs, bs, kv, 0.97 * tie) == "recompute"


@pytest.mark.parametrize("wrong", ["_swap_forgets_the_way_back", "_tie_goes_to_swap",
                                   "_swap_fractional_blocks"])
def test_7_3_catches_the_wrong_answers_that_used_to_pass(wrong):
    v = ch07.check_cheaper_preemption(getattr(ch07, wrong))
    assert v.attempted and not v.ok and v.first_problem


def test_7_1_accepts_a_tuple_and_names_a_real_difference():
    from course_lib.exercises.solutions.ch07 import prefill_chunks

    assert ch07.check_prefill_chunks(lambda *a: tuple(prefill_chunks(*a))).ok
    v = ch07.check_prefill_chunks(lambda p, b, d: tuple(prefill_chunks(p, b, 0)))
    assert "returned (16, 16, 16, 2), the library returns [13, 13, 13, 11]" in v.first_problem


def test_7_4_feedback_names_the_rule():
    v = check_schedule_step(_admits_after_preempting)
    assert "nobody joins in a step that preempted" in v.first_problem
    v = check_schedule_step(_preempts_the_one_that_needs)
    assert "the *last* running request" in v.first_problem
    v = check_schedule_step(_no_chunked_prefill)
    assert "chunked prefill" in v.first_problem
    assert "expected a pair" in check_schedule_step(lambda *a: None).first_problem


def test_7_4_cases_preempt_chunk_and_stop_for_each_reason():
    decisions = [schedule_step(*c) for c in schedule_cases()]
    assert sum(bool(p) for _, p in decisions) >= 10
    assert any(p and p[-1] not in [rid for rid, _ in s] and not s for s, p in decisions)
    cases = schedule_cases()
    waiting_chunks = [(rid, n) for c, (s, _) in zip(cases, decisions, strict=True)
                      for rid, n in s if n < dict(c[1]).get(rid, 0)]
    assert len(waiting_chunks) >= 5


# ---------------------------------------------------------------- 7.2: one V0 decode step

def test_7_2_explanations_replay_the_library_on_every_case():
    for case in swap_cases():
        (step, why) = explain_step(*case)
        assert step == schedule_running_and_swapped(*case), case
        assert len(why) >= len(step[1]) + len(step[2])     # a reason for every event


def test_7_2_cases_reach_every_rule():
    steps = [schedule_running_and_swapped(*c) for c in swap_cases()]
    modes = [m for _, pre, _ in steps for _, m in pre]
    assert modes.count("swap") >= 5 and modes.count("recompute") >= 5
    assert sum(1 for c, (_, pre, _) in zip(swap_cases(), steps, strict=True)
               if c[5] == "swap" and any(m == "recompute" for _, m in pre)) >= 2   # CPU full
    assert sum(1 for dec, pre, _ in steps if pre and pre[-1][0] not in dec) >= 5   # itself
    assert sum(1 for _, _, back in steps if back) >= 10
    assert sum(1 for c, (_, _, back) in zip(swap_cases(), steps, strict=True)
               if c[1] and len(back) < len(c[1])) >= 10                    # some stay out


@pytest.mark.parametrize("wrong, words", [
    ("_queue_order", "in order of arrival_time"),
    ("_swap_without_cpu_room", "do not fit in the 1 free CPU blocks"),
    ("_swap_in_forgets_the_new_token", "for the token it writes now do not fit"),
    ("_needy_one_is_the_victim", "the last to arrive of those not served yet"),
    ("_swap_in_after_preempting", "nobody comes back in a step that preempted"),
])
def test_7_2_feedback_names_the_rule(wrong, words):
    v = check_schedule_running_and_swapped(getattr(ch07_swap, wrong))
    assert not v.ok and words in v.first_problem, v.first_problem
    assert "expected (decoded, preempted, swapped_in)" in \
        check_schedule_running_and_swapped(lambda *a: None).first_problem
