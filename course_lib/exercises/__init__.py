"""Checkers for the exercises at the end of each chapter.

A learner writes a function in the notebook; :func:`check` runs it and the library's version on
the same cases and says, in one line, whether they agree. An exercise left as
``raise NotImplementedError`` is reported as not attempted, so a fresh notebook runs clean.

The generic :func:`check` lives here; each chapter's exercise cases and checkers live in
``course_lib/exercises/chNN.py`` (e.g. ``from course_lib.exercises import ch03``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Verdict:
    exercise: str
    passed: int
    total: int
    first_problem: str | None = None  # None when every case passed
    attempted: bool = True

    @property
    def ok(self) -> bool:
        return self.attempted and self.passed == self.total

    def __str__(self) -> str:
        if not self.attempted:
            return f"exercise {self.exercise}: not attempted yet (it raises NotImplementedError)"
        if self.ok:
            return f"exercise {self.exercise}: all {self.total} cases match the library"
        return (f"exercise {self.exercise}: {self.passed}/{self.total} cases match the library; "
                f"first difference: {self.first_problem}")


def same(got: Any, want: Any) -> bool:
    """Equal values; tensors compare by shape and values (to float tolerance)."""
    if type(want).__module__.startswith("torch"):
        import torch

        return (isinstance(got, torch.Tensor) and got.shape == want.shape
                and torch.allclose(got.to(want.dtype), want, equal_nan=True))
    return bool(got == want)


def check(exercise: str, learner: Callable[..., Any], reference: Callable[..., Any],
          cases: Iterable[Sequence[Any]], compare: Callable[[Any, Any], bool] = same) -> Verdict:
    """Call ``learner(*case)`` and ``reference(*case)`` for each case and compare the results."""
    cases = list(cases)
    passed, first_problem = 0, None
    for case in cases:
        args = ", ".join(map(repr, case))
        want = reference(*case)
        try:
            got = learner(*case)
        except NotImplementedError:
            return Verdict(exercise, 0, len(cases), attempted=False)
        except Exception as exc:  # a learner's bug is a verdict, not a crash of the notebook
            got, ok = None, False
            problem = f"({args}) raised {type(exc).__name__}: {exc}"
        else:
            ok = compare(got, want)
            problem = f"({args}) returned {got!r}, the library returns {want!r}"
        if ok:
            passed += 1
        elif first_problem is None:
            first_problem = problem
    return Verdict(exercise, passed, len(cases), first_problem)
