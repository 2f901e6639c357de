"""Helpers chapter 00 uses: envcheck, the exercise checker, the program-grid drawing."""

from __future__ import annotations

import pytest

from course_lib import envcheck, exercises

pytestmark = pytest.mark.ch00


def test_envcheck_finds_nothing_missing_in_the_course_env():
    assert envcheck.missing() == []


def test_envcheck_versions_name_python_and_each_package():
    found = envcheck.versions()
    assert set(found) == {"python", *envcheck.SHOWN}
    assert found["python"].count(".") == 2
    assert found["torch"] is not None


def test_envcheck_report_ends_with_the_backend_line():
    from course_lib import device

    assert envcheck.report().splitlines()[-1] == device.describe()


def square(x):
    return x * x


CASES = [(0,), (3,), (-2,)]


def test_check_passes_a_correct_solution():
    verdict = exercises.check("9.9 square", lambda x: x**2, square, CASES)
    assert verdict.ok and (verdict.passed, verdict.total) == (3, 3)
    assert str(verdict) == "exercise 9.9 square: all 3 cases match the library"


def test_check_names_the_first_wrong_case():
    verdict = exercises.check("9.9 square", lambda x: abs(x) * x, square, CASES)
    assert not verdict.ok and verdict.passed == 2
    assert verdict.first_problem == "(-2) returned -4, the library returns 4"


def test_check_reports_a_stub_as_not_attempted():
    def stub(x):
        raise NotImplementedError

    verdict = exercises.check("9.9 square", stub, square, CASES)
    assert not verdict.ok and not verdict.attempted
    assert "not attempted yet" in str(verdict)


def test_check_turns_a_crash_into_a_verdict():
    verdict = exercises.check("9.9 square", lambda x: 1 / x, square, CASES)
    assert verdict.passed == 0
    assert verdict.first_problem == "(0) raised ZeroDivisionError: division by zero"


def test_same_compares_tensors_by_shape_and_value():
    torch = pytest.importorskip("torch")
    a = torch.tensor([1.0, 2.0])
    assert exercises.same(a.clone(), a)
    assert not exercises.same(a[:1], a)
    assert not exercises.same([1.0, 2.0], a)


def test_draw_programs_draws_every_lane_and_masks_the_tail():
    pytest.importorskip("torch")
    from course_lib.viz.programs import draw_programs

    fig = draw_programs(10, 4)
    (ax,) = fig.axes
    assert len(ax.patches) == 12  # 3 programs x 4 lanes
    assert sum(p.get_hatch() == "//" for p in ax.patches) == 2
    assert ax.get_title() == "n=10, block_size=4: 3 programs, 2 lanes masked off"
    with pytest.raises(ValueError, match=r"block_size must be an integer in \[1, 256\]"):
        draw_programs(10, 0)
