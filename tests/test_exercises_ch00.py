"""Chapter 00's Triton exercises: what each checker catches, beyond tests/test_exercises.py."""

from __future__ import annotations

import pytest
from interpreter_only import INTERPRETER_ONLY

from course_lib.device import BACKEND
from course_lib.exercises import ch00, launches
from course_lib.exercises.solutions import ch00 as solutions

pytestmark = pytest.mark.ch00
needs_triton = pytest.mark.skipif(not BACKEND.uses_triton, reason="the kernels need Triton")


@needs_triton
def test_the_floor_grid_is_told_to_use_the_ceiling():
    floor_grid = ch00.EXERCISES["0.1"].rule("ceil(n / block_size)").wrong
    verdict = ch00.check_leaky_relu(floor_grid)
    assert "ceil(n / block_size)" in verdict.first_problem and "never written" in str(verdict)


@needs_triton
def test_a_store_past_the_end_is_a_verdict():
    """The interpreter's store check names the store before it writes (on a GPU, where no spy
    runs, the sentinel after the output sees it instead)."""
    unmasked = ch00.EXERCISES["0.1"].rule("mask the store").wrong
    verdict = ch00.check_leaky_relu(unmasked)
    assert "mask the store" in verdict.first_problem
    on_cpu = __import__("torch").device(BACKEND.device).type == "cpu"    # the interpreter
    assert ("stored element 1 of out_ptr, past its end" if on_cpu else "overwritten") in \
        verdict.first_problem, verdict


@needs_triton
def test_a_store_far_outside_every_tensor_is_a_verdict_not_a_dead_process():
    """A store through an offset that overflowed lands far from every tensor: in the
    interpreter it would write through a raw address and can kill the process; the check
    stops it first and names it."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def far_store(x_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr):
        offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offs < n
        tl.store(out_ptr + offs + (1 << 40), tl.load(x_ptr + offs, mask=mask), mask=mask)

    def leaky_relu(x, out, alpha, block_size):
        far_store[(triton.cdiv(x.numel(), block_size),)](x, out, x.numel(),
                                                        BLOCK_SIZE=block_size)

    if torch.device(BACKEND.device).type != "cpu":
        pytest.skip("the store check runs in the interpreter")
    verdict = ch00.check_leaky_relu(leaky_relu)
    assert "stored an address far from every tensor" in verdict.first_problem, verdict


@needs_triton
def test_block_max_names_other_and_the_mask():
    zero_lanes = ch00.EXERCISES["0.2"].rule("never win the max").wrong
    no_mask = ch00.EXERCISES["0.2"].rule("mask the load").wrong
    assert "other=float('-inf')" in ch00.check_block_max(zero_lanes).first_problem
    assert "mask=offsets < n" in ch00.check_block_max(no_mask).first_problem


@needs_triton
def test_the_right_numbers_without_a_kernel_fail():
    for in_torch, check in ((ch00._leaky_in_torch, ch00.check_leaky_relu),
                            (ch00._max_in_torch, ch00.check_block_max)):
        verdict = check(in_torch)
        assert verdict.passed == 0 and "launched no Triton kernel" in verdict.first_problem
        assert "; and" not in verdict.first_problem          # every case's numbers were right


@INTERPRETER_ONLY
def test_launches_are_recorded_only_inside_the_block():
    from course_lib.kernels import smoke

    if not BACKEND.uses_triton:
        with launches.recorded() as kernels:
            pass
        assert kernels == []
        return
    x = __import__("torch").ones(5)
    with launches.recorded() as kernels:
        solutions.leaky_relu(x, x.clone(), 0.1, 4)
        smoke.add(x, x)
    assert ("course_lib.exercises.solutions.ch00", "leaky_relu_kernel") in kernels
    assert [k for k in kernels if k[0] == "course_lib.kernels.smoke"]
    assert launches.own(kernels) == [("course_lib.exercises.solutions.ch00", "leaky_relu_kernel")]
    before = len(kernels)
    solutions.leaky_relu(x, x.clone(), 0.1, 4)
    assert len(kernels) == before                              # the spy is gone


def test_cases_cover_the_edges():
    lengths = {(c[1]["n"], c[1]["block_size"]) for c in ch00.leaky_relu_cases()}
    assert {(1, 4), (4, 4), (5, 4), (17, 16)} <= lengths          # one, exact, one past
    negative_tail = [c for c in ch00.block_max_cases() if c[1]["n"] % c[1]["block_size"]]
    assert negative_tail and all((c[0][-1] < 0).item() for c in negative_tail)


def test_without_triton_a_stub_is_unattempted_and_an_answer_is_sent_elsewhere(monkeypatch):
    class NoTriton:
        name, uses_triton, device = "torch-reference", False, "cpu"

    monkeypatch.setattr(launches, "BACKEND", NoTriton())

    def stub(*args):
        raise NotImplementedError

    def answer(*args):
        raise NameError("name 'leaky_relu_kernel' is not defined")

    assert not ch00.check_leaky_relu(stub).attempted
    verdict = ch00.check_leaky_relu(answer)
    assert verdict.attempted and not verdict.ok and "runs no Triton" in verdict.first_problem


@INTERPRETER_ONLY
@needs_triton
def test_a_kernel_that_hangs_is_stopped_and_named(monkeypatch):
    """A Triton case runs under its own, longer deadline; one still running is named."""
    import time

    import triton
    import triton.language as tl

    import course_lib.exercises as ex_pkg

    @triton.jit
    def endless(x_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr):
        i = 0
        while i < n:                        # i never moves: the loop never ends
            i = i * 1
        tl.store(out_ptr + tl.arange(0, BLOCK_SIZE), tl.load(x_ptr + tl.arange(0, BLOCK_SIZE)))

    def leaky_relu(x, out, alpha, block_size):
        endless[(1,)](x, out, x.numel(), BLOCK_SIZE=block_size)

    monkeypatch.setattr(ex_pkg, "TRITON_CASE_SECONDS", 0.5)
    start = time.monotonic()
    verdict = ch00.check_leaky_relu(leaky_relu)
    assert time.monotonic() - start < 10
    assert verdict.first_problem.startswith("n=1, block_size=4")
    assert "still running after 0.5 s" in verdict.first_problem
