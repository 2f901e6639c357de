"""Chapter 05's checkers beyond the generic tests: 5.1's cases reach every situation of a beam
step and its expected answers come from the manager; 5.2 refuses the page's ways of counting;
5.3 (predictions of copy-on-write) tells a wrong prediction as wrong, and the library's value
only after several different wrong answers; a missing one without it."""

from __future__ import annotations

import pytest

from course_lib.exercises import ch05, ch05_beams
from course_lib.exercises.ch05_beams import beam_args, beam_blocks, beam_cases, check_beam_blocks
from course_lib.exercises.ch05_cow import SCENARIOS, check_cow_predictions
from course_lib.exercises.solutions import ch05 as solutions
from course_lib.sizing.units import cdiv

pytestmark = pytest.mark.ch05


def test_5_3_tells_the_value_only_after_several_different_wrong_answers(monkeypatch):
    import course_lib.exercises as ex_pkg

    monkeypatch.setattr(ex_pkg, "_TRIED", {})
    right = solutions.cow_predictions()
    assert set(right) == {s.key for s in SCENARIOS}
    missing = check_cow_predictions(lambda: {k: v for k, v in right.items() if k != "c"})
    assert not missing.ok and "no prediction for 'c'" in missing.first_problem
    assert "library gives" not in missing.first_problem
    for n, guess in enumerate((5, 6, 5, 7)):     # 5 twice: a rerun is not a new answer
        wrong = check_cow_predictions(lambda g=guess: {**right, "c": g})
        assert wrong.first_problem.startswith("right: a, b, d, e; wrong: c ("), wrong
        told = "the library gives 2" in wrong.first_problem
        assert told == (n == 3), (n, wrong.first_problem)
    assert not check_cow_predictions(lambda: {**right, "e": False}).ok  # False is not 0


def test_5_3_scenarios_copy_open_free_and_reuse():
    """Each scenario's number differs from what its misconception predicts."""
    values = {s.key: s.run() for s in SCENARIOS}
    assert values == solutions.cow_predictions()
    assert len(set(values.values())) >= 3             # one number does not fit them all


def test_beam_cases_free_copy_open_blocks_and_reuse_freed_ones():
    answers = [beam_blocks(c) for c in beam_cases()]
    assert sum(bool(freed) for freed, _, _ in answers) >= 10
    assert sum(len(copied) >= 2 for _, copied, _ in answers) >= 3     # k beams, k - 1 copies
    full = [c for c in beam_cases() if (c.prompt_len + len(c.history)) % c.block_size == 0
            and len(set(c.picks)) < len(c.picks)]
    assert len(full) >= 3                        # forks at a full block: nothing to copy
    # a block the dropped beams give back may be taken again by this step's appends: the
    # answer still lists it as freed
    reused = 0
    for case in beam_cases():
        m, beams, next_id = ch05_beams._replay(case)
        _, _, freed, copies = ch05_beams._take_step(m, beams, case.picks, next_id)
        after = {b for s in m.seq_ids() for b in m.get_block_table(s)}
        reused += bool(set(freed) & after)
    assert reused >= 3


def test_the_beam_solution_matches_the_manager_and_dicts_of_any_order_pass():
    for case in beam_cases():
        got = solutions.beam_blocks(*beam_args(case))
        assert (sorted(got[0]), sorted(got[1]), got[2]) == beam_blocks(case)

    def reversed_lists(*args):
        freed, copied, held = solutions.beam_blocks(*args)
        return tuple(reversed(freed)), set(copied) if len(set(copied)) == len(copied) \
            else copied, held

    assert check_beam_blocks(reversed_lists).ok


def test_blocks_held_refuses_the_pages_manager_and_formula():
    from course_lib import capacity

    def formula(n, prompt, gen, bs):
        if gen == 0:
            return cdiv(prompt, bs)
        return capacity.blocks_with_shared_prefix(n, prompt + gen, prompt, bs)

    v = ch05.check_blocks_held(formula)
    assert not v.ok and "from the four lengths alone" in v.first_problem
    held_after_sampling = ch05.EXERCISES["5.2"].rule("no BlockManager").wrong
    assert "BlockManager" in ch05.check_blocks_held(held_after_sampling).first_problem
    assert capacity.blocks_with_shared_prefix(2, 10, 8, 4) == 4       # restored afterwards


def test_5_2_the_formula_behind_the_huge_case_agrees_with_the_manager():
    """The case with lengths in the billions is judged by the solution's formula (no manager
    could count it): the formula gives the manager's count on every other case."""
    import random

    from course_lib.exercises import ch05
    from course_lib.exercises.solutions import ch05 as solutions

    rng = random.Random(5)
    for _ in range(60):
        case = (rng.randrange(1, 6), rng.randrange(1, 50), rng.randrange(0, 20),
                2 ** rng.randrange(0, 5))
        assert solutions.blocks_held(*case) == ch05.blocks_held(*case), case
    assert "billions" in ch05.check_blocks_held(solutions.blocks_held).cases[-1]
