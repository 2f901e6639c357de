"""Chapter 09's exercise checkers pass the library's solutions and catch wrong ones."""

from __future__ import annotations

import pytest
import torch

from course_lib.exercises import ch09

pytestmark = pytest.mark.ch09


def not_yet(*args):
    raise NotImplementedError


@pytest.mark.parametrize("checker,solution", [
    (ch09.check_merge_two, ch09.reference_merge_two),
    (ch09.check_rank_of_token, ch09.reference_rank_of_token),
    (ch09.check_cp_max_tokens, ch09.reference_cp_max_tokens),
    (ch09.check_mla_bytes_per_token, ch09.reference_mla_bytes_per_token),
])
def test_checker_passes_the_solution_and_reports_not_attempted(checker, solution):
    assert checker(solution).ok
    v = checker(not_yet)
    assert not v.attempted and "not attempted yet" in str(v)


def test_reference_values():
    assert ch09.reference_cp_max_tokens(3258, 16, 4) == 208_512
    assert ch09.reference_mla_bytes_per_token(61, 512, 64, 2, 8) == 70_272
    assert [ch09.reference_rank_of_token(p, 16, 4) for p in (0, 3, 4, 15)] == [0, 0, 1, 3]
    assert ch09.reference_rank_of_token(1, 2, 4) == 3       # ranks 0 and 2 hold nothing


def naive_merge(out_a, lse_a, out_b, lse_b):
    """Forgets the max-subtraction: overflows on large LSEs, NaN on two empty pieces."""
    wa, wb = torch.exp(lse_a), torch.exp(lse_b)
    s = wa + wb
    return (wa[:, None] * out_a + wb[:, None] * out_b) / s[:, None], torch.log(s)


def averaged_merge(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


@pytest.mark.parametrize("wrong", [naive_merge, averaged_merge])
def test_merge_checker_catches_wrong_merges(wrong):
    v = ch09.check_merge_two(wrong)
    assert v.attempted and not v.ok and "first difference" in str(v)


def test_other_checkers_catch_wrong_answers():
    assert not ch09.check_rank_of_token(lambda p, n, cp: p // -(-n // cp)).ok   # ceil chunks
    assert not ch09.check_cp_max_tokens(lambda b, bs, cp: b * bs).ok          # forgot CP
    assert not ch09.check_mla_bytes_per_token(                                # TP divides it
        lambda n, c, r, b, tp: n * (c + r) * b // tp).ok
