"""Chapter 08's exercise 8.1 (the smallest tensor-parallel size for a load): its cases need
TP sizes that are not powers of two, whole blocks per request, and sizes that never fit."""

from __future__ import annotations

import pytest

from course_lib.exercises import ch08

pytestmark = pytest.mark.ch08


def test_answers_cover_every_regime():
    answers = [ch08.raises_as_value(ch08.reference_smallest_tp)(*c) for c in ch08.tp_cases()]
    assert ch08.RAISES in answers and 1 in answers
    assert any(a not in (ch08.RAISES, 1, 2, 4, 8, 16, 32, 64) for a in answers)   # e.g. 3 or 6


@pytest.mark.parametrize("wrong, case", [
    ("_powers_of_two", "(40, 24, 6, 128, 20000000000, 24, 8192, 40)"),
    ("_tokens_not_blocks", "(32, 32, 8, 128, 8030261248, 24, 17, 2500)"),
    ("_weights_not_split", "returned 'raises ValueError', the library returns 2"),
])
def test_wrong_searches_fail_on_the_case_made_for_them(wrong, case):
    v = ch08.check_smallest_tp(getattr(ch08, wrong))
    assert not v.ok and case in v.first_problem
