"""Exercise 5.3 (a copy-on-write manager): its checker replays the history of a failure and
says which concept broke, and its cases reach every copy-on-write situation."""

from __future__ import annotations

import pytest

from course_lib.exercises import ch05
from course_lib.exercises.solutions.ch05 import CowManager

pytestmark = pytest.mark.ch05


def test_the_cases_copy_share_and_reuse_freed_blocks():
    ops = [op for _, _, case in ch05.cow_cases() for op in case]
    kinds = {op[0] for op in ops}
    assert kinds == {"allocate", "fork", "append", "free"}
    copies = 0
    for n, bs, case in ch05.cow_cases():
        ref = ch05.ReferenceCow(n, bs)
        copies += sum(ref.append(*op[1:]) is not None if op[0] == "append"
                      else getattr(ref, op[0])(*op[1:]) is not None for op in case)
    assert copies >= 20                       # many appends into a shared partial block


def test_a_leaking_copy_fails_with_the_history_and_the_concept():
    class Leaks(CowManager):
        def _drop(self, block):               # never frees anything
            self.refs[block] -= 1

    v = ch05.check_cow_manager(Leaks)
    assert not v.ok
    assert "after allocate(0, " in v.first_problem and "op " in v.first_problem


def test_a_copy_returned_as_a_list_is_accepted():
    class ListCopies(CowManager):
        def append(self, seq):
            copy = super().append(seq)
            return None if copy is None else list(copy)

    assert ch05.check_cow_manager(ListCopies).ok
