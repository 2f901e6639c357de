"""Chapter 09's exercise references are the library's behaviour, computed independently, and
their checkers catch the natural wrong answers."""

from __future__ import annotations

import pytest
import torch

from course_lib.exercises import ch09
from course_lib.exercises.solutions import ch09 as solutions
from course_lib.parallel.merge import merge_partials, partial_attention, split_ranges

pytestmark = pytest.mark.ch09


def not_yet(*args):
    raise NotImplementedError


@pytest.mark.parametrize("checker,solution", [
    (ch09.check_place_tokens, ch09.place_tokens),
    (ch09.check_cp_decode, solutions.cp_decode),   # ch09.cp_decode is dense: see below
    (ch09.check_max_decode_steps, ch09.max_decode_steps),
])
def test_checker_passes_the_reference_and_reports_not_attempted(checker, solution):
    assert checker(solution).ok
    v = checker(not_yet)
    assert not v.attempted and "not attempted yet" in str(v)


def test_placement_is_the_pages_figures():
    """The tokens per rank the page's real runs print (cells of 09: [10, 14], [0, 1, 0, 4])."""
    assert [len(r) for r in ch09.place_tokens(21, 3, 2, 0)] == [10, 14]
    assert [len(r) for r in ch09.place_tokens(2, 3, 4, 0)] == [0, 1, 0, 4]
    assert [len(r) for r in ch09.place_tokens(30, 4, 2, 2)] == [18, 16]
    assert [len(r) for r in ch09.place_tokens(37, 2, 4, 4)] == [12, 11, 8, 8]
    assert ch09.place_tokens(21, 0, 4, 0) == [list(range(a, b)) for a, b in split_ranges(21, 4)]


def test_cp_decode_reference_equals_the_merge_of_real_pieces():
    for q, k, v, owner, cp in ch09._decode_cases():
        parts = [partial_attention(q, k[[i for i, o in enumerate(owner) if o == r]],
                                   v[[i for i, o in enumerate(owner) if o == r]])
                 for r in range(cp)]
        out, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
        want_out, want_lse = ch09.cp_decode(q, k, v, owner, cp)
        assert torch.allclose(out, want_out, atol=1e-9) and torch.allclose(lse, want_lse)


def test_the_decode_cases_have_empty_ranks_and_overflowing_scores():
    cases = ch09._decode_cases()
    assert any(set(range(cp)) - set(owner) for *_, owner, cp in cases)
    assert any(float(partial_attention(q, k, v)[1].max()) > 709 for q, k, v, *_ in cases)


def test_max_decode_steps_fills_a_rank_exactly():
    for prompt, cp, inter, blocks, bs in [(20, 4, 0, 2, 4), (20, 4, 1, 2, 4), (37, 4, 4, 3, 4)]:
        steps = ch09.max_decode_steps(prompt, cp, inter, blocks, bs)
        held = [len(r) for r in ch09.place_tokens(prompt, steps, cp, inter)]
        nxt = [len(r) for r in ch09.place_tokens(prompt, steps + 1, cp, inter)]
        assert max(held) <= blocks * bs < max(nxt)
    assert ch09.max_decode_steps(20, 4, 0, 2, 4) == 3        # contiguous: the last rank only
    assert ch09.max_decode_steps(20, 4, 1, 2, 4) == 12       # interleaved: every rank


@pytest.mark.parametrize("number", ["9.1", "9.2", "9.3"])
def test_wrong_answers_fail_with_a_named_difference(number):
    ex = ch09.EXERCISES[number]
    for wrong in ex.wrong:
        v = ex.checker(wrong)
        assert v.attempted and not v.ok and v.first_problem
    if number == "9.2":
        assert "MAX" in ex.checker(ex.rule("subtract the MAX").wrong).first_problem


def test_9_2_dense_attention_has_the_numbers_but_not_the_merge():
    """ch09.cp_decode, the reference, is attention over every token on one rank: the same
    numbers as the merge, which is why the checker watches partial_attention's calls."""
    verdict = ch09.check_cp_decode(ch09.cp_decode)
    assert not verdict.ok and "not one rank's tokens" in verdict.first_problem

    def merged_in_torch(q, k, v, owner, cp_size):     # never calls partial_attention
        out = torch.softmax(torch.einsum("hd,nhd->hn", q, k.repeat_interleave(
            q.shape[0] // k.shape[1], 1)) * q.shape[1] ** -0.5, -1)
        return (torch.einsum("hn,nhd->hd", out, v.repeat_interleave(q.shape[0] // k.shape[1], 1)),
                ch09.cp_decode(q, k, v, owner, cp_size)[1])

    verdict = ch09.check_cp_decode(merged_in_torch)
    assert not verdict.ok and "never attended" in verdict.first_problem
