"""Every exercise's checker, tried as a teacher would before giving it to learners.

For each chapter module that declares ``EXERCISES`` (``course_lib/exercises/chNN.py``):
the solution passes; an unattempted stub (it raises ``NotImplementedError``) is reported as not
attempted; answers that do nothing (``None``, a constant) fail; every plausible wrong answer
the module lists fails with a first difference; hints are graded (two or more); and the
chapter's notebook poses the exercise, calls the checker, and stores its stub unsolved.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path

import pytest

import course_lib.exercises as exercises_pkg
from course_lib.exercises import Exercise, Exercises

ROOT = Path(__file__).resolve().parents[1]


def chapter_modules():
    for info in pkgutil.iter_modules(exercises_pkg.__path__):
        if info.name.startswith("ch"):
            module = importlib.import_module(f"course_lib.exercises.{info.name}")
            if isinstance(getattr(module, "EXERCISES", None), Exercises):
                yield module


def _triton_runs() -> bool:
    from course_lib.device import BACKEND
    from course_lib.kernels import interpreter_incompatibility

    return BACKEND.uses_triton and interpreter_incompatibility() is None


NO_TRITON = pytest.mark.skipif(not _triton_runs(), reason="the learner writes a Triton kernel")
CASES = [pytest.param(m, ex, id=ex.number, marks=[NO_TRITON] if ex.needs_triton else [])
         for m in chapter_modules() for ex in m.EXERCISES]


def stub_like(answer):
    """The notebook's stub for an answer of this shape: it raises NotImplementedError."""
    if isinstance(answer, type):
        class Stub:
            def __init__(self, *args, **kwargs):
                raise NotImplementedError
        return Stub

    def stub(*args, **kwargs):
        raise NotImplementedError
    return stub


@pytest.mark.parametrize("module, ex", CASES)
def test_the_solution_passes(module, ex: Exercise):
    verdict = ex.checker(ex.solution)
    assert verdict.ok, str(verdict)


@pytest.mark.parametrize("module, ex", CASES)
def test_an_unattempted_stub_is_reported_as_such(module, ex: Exercise):
    verdict = ex.checker(stub_like(ex.solution))
    assert not verdict.attempted and "not attempted" in str(verdict)


@pytest.mark.parametrize("module, ex", CASES)
def test_answers_that_do_nothing_fail(module, ex: Exercise):
    assert ex.trivial, f"{ex.number}: list at least one do-nothing answer"
    for answer in ex.trivial:
        verdict = ex.checker(answer)
        assert verdict.attempted and not verdict.ok, str(verdict)


@pytest.mark.parametrize("module, ex", CASES)
def test_plausible_wrong_answers_fail_with_a_first_difference(module, ex: Exercise):
    assert ex.wrong, f"{ex.number}: list at least one plausible wrong answer"
    for answer in ex.wrong:
        verdict = ex.checker(answer)
        assert verdict.attempted and not verdict.ok, (answer, str(verdict))
        assert verdict.first_problem, str(verdict)


@pytest.mark.parametrize("module, ex", CASES)
def test_hints_are_graded_and_the_solution_is_code(module, ex: Exercise):
    assert len(ex.hints) >= 2
    book = Exercises(ex)
    shown = [book.hint(ex.number) for _ in ex.hints]
    assert [s.split(":", 1)[0] for s in shown] == [
        f"hint {i}/{len(ex.hints)} for {ex.number}" + ("" if i == len(ex.hints) else
                                                        f" (hint({ex.number!r}) again for the"
                                                        " next one)")
        for i in range(1, len(ex.hints) + 1)]
    with pytest.raises(ValueError, match="hints 1.."):
        book.hint(ex.number, len(ex.hints) + 1)
    source = book.solution(ex.number)
    assert source.startswith(("def ", "class ", "@")) and "NotImplementedError" not in source
    assert ex.solution.__module__.startswith("course_lib.exercises.solutions.")


@pytest.mark.parametrize("module, ex", CASES)
def test_the_notebook_poses_it_unsolved(module, ex: Exercise):
    chapter = module.__name__.rsplit(".", 1)[1][2:]
    (path,) = (ROOT / "notebooks").glob(f"{chapter}_*.ipynb")
    nb = json.loads(path.read_text())
    markdown = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert f"**{ex.number}**" in markdown, f"{path.name} does not pose {ex.number}"
    printed = ["".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code"
               for o in c.get("outputs", [])]
    assert any(f"exercise {ex.number}" in p and "not attempted yet" in p for p in printed), (
        f"{path.name}: the stored output of {ex.number} is not its unsolved stub's")


def test_the_registry_refuses_what_a_learner_cannot_use():
    ex = Exercise("9.9", "x", lambda f: None, hints=("a", "b"), solution=len)
    with pytest.raises(ValueError, match="at least one hint"):
        Exercise("9.8", "x", lambda f: None, hints=(), solution=len)
    with pytest.raises(ValueError, match="share a number"):
        Exercises(ex, ex)
    with pytest.raises(KeyError, match="the exercises are 9.9"):
        Exercises(ex)["1.1"]


def test_3_3_accepts_any_exception_from_an_empty_pool():
    """The exercise says "raise an exception when empty": a ValueError is one."""
    from course_lib.exercises import ch03
    from course_lib.exercises.solutions.ch03 import ToyAllocator

    class RaisesValueError(ToyAllocator):
        def allocate(self):
            if not self.free_stack:
                raise ValueError("empty")
            return super().allocate()

    assert ch03.check_allocator(RaisesValueError).ok
