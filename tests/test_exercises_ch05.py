"""Chapter 05's checkers beyond the generic tests: 5.1's cases reach every situation of a beam
step and its expected answers come from the manager; 5.2 refuses the page's ways of counting;
5.3 (a copy-on-write manager) replays the history of a failure and says which concept broke,
and its cases reach every copy-on-write situation."""

from __future__ import annotations

import pytest

from course_lib.exercises import ch05, ch05_beams
from course_lib.exercises.ch05_beams import beam_args, beam_blocks, beam_cases, check_beam_blocks
from course_lib.exercises.ch05_cow import ReferenceCow, check_cow_manager, cow_cases
from course_lib.exercises.solutions import ch05 as solutions
from course_lib.exercises.solutions.ch05 import CowManager
from course_lib.sizing.units import cdiv

pytestmark = pytest.mark.ch05


def test_the_cases_copy_share_and_reuse_freed_blocks():
    ops = [op for _, _, case in cow_cases() for op in case]
    kinds = {op[0] for op in ops}
    assert kinds == {"allocate", "fork", "append", "free"}
    copies = 0
    for n, bs, case in cow_cases():
        ref = ReferenceCow(n, bs)
        copies += sum(ref.append(*op[1:]) is not None if op[0] == "append"
                      else getattr(ref, op[0])(*op[1:]) is not None for op in case)
    assert copies >= 20                       # many appends into a shared partial block


def test_a_leaking_copy_fails_with_the_history_and_the_concept():
    class Leaks(CowManager):
        def _drop(self, block):               # never frees anything
            self.refs[block] -= 1

    v = check_cow_manager(Leaks)
    assert not v.ok
    assert "after allocate(0, " in v.first_problem and "op " in v.first_problem


def test_a_copy_returned_as_a_list_is_accepted():
    class ListCopies(CowManager):
        def append(self, seq):
            copy = super().append(seq)
            return None if copy is None else list(copy)

    assert check_cow_manager(ListCopies).ok


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
