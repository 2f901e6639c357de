"""Chapter 00's Triton exercises: what each checker catches, beyond tests/test_exercises.py."""

from __future__ import annotations

import pytest

from course_lib.device import BACKEND
from course_lib.exercises import ch00

pytestmark = pytest.mark.ch00
needs_triton = pytest.mark.skipif(not BACKEND.uses_triton, reason="the kernels need Triton")


@needs_triton
def test_the_floor_grid_is_told_to_use_the_ceiling():
    (floor_grid, _) = ch00.EXERCISES["0.1"].wrong
    verdict = ch00.check_leaky_relu(floor_grid)
    assert "ceil(n / block_size)" in verdict.first_problem and "never written" in str(verdict)


@needs_triton
def test_a_store_past_the_end_is_seen_in_the_sentinel():
    (_, unmasked) = ch00.EXERCISES["0.1"].wrong
    verdict = ch00.check_leaky_relu(unmasked)
    assert "overwritten" in verdict.first_problem and "mask the store" in verdict.first_problem


@needs_triton
def test_block_max_names_other_and_the_mask():
    zero_lanes, no_mask = ch00.EXERCISES["0.2"].wrong
    assert "other=float('-inf')" in ch00.check_block_max(zero_lanes).first_problem
    assert "mask=offsets < n" in ch00.check_block_max(no_mask).first_problem


def test_cases_cover_the_edges():
    lengths = {(c[1]["n"], c[1]["block_size"]) for c in ch00.leaky_relu_cases()}
    assert {(1, 4), (4, 4), (5, 4), (17, 16)} <= lengths          # one, exact, one past
    negative_tail = [c for c in ch00.block_max_cases() if c[1]["n"] % c[1]["block_size"]]
    assert negative_tail and all((c[0][-1] < 0).item() for c in negative_tail)


def test_without_triton_a_stub_is_unattempted_and_an_answer_is_sent_elsewhere(monkeypatch):
    class NoTriton:
        name, uses_triton, device = "torch-reference", False, "cpu"

    monkeypatch.setattr(ch00, "BACKEND", NoTriton())

    def stub(*args):
        raise NotImplementedError

    def answer(*args):
        raise NameError("name 'leaky_relu_kernel' is not defined")

    assert not ch00.check_leaky_relu(stub).attempted
    verdict = ch00.check_leaky_relu(answer)
    assert verdict.attempted and not verdict.ok and "runs no Triton" in verdict.first_problem
