"""Checkers for the exercises at the end of each chapter.

A learner writes a function in the notebook; :func:`check` runs it and the library's version on
the same cases and says, in one line, whether they agree. An exercise left as
``raise NotImplementedError`` is reported as not attempted, so a fresh notebook runs clean.

The generic :func:`check` lives here; each chapter's exercise cases and checkers live in
``course_lib/exercises/chNN.py`` (e.g. ``from course_lib.exercises import ch03``).
"""

from __future__ import annotations

import copy
import warnings
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


def args_text(case: Sequence[Any]) -> str:
    """A case's arguments as a call would show them: ``(1, [2, 3])``."""
    return f"({', '.join(map(repr, case))})"


def returns(judge: Callable[[Any, Any], str | None]) -> Callable[[Callable, Any], str | None]:
    """A :func:`judge_cases` judge from ``judge(case, got)``, where ``got = learner(*case)``
    on a copy of the case (a learner who changes an argument cannot change the question)."""
    return lambda learner, case: judge(case, learner(*copy.deepcopy(case)))


def judge_cases(exercise: str, learner: Callable[..., Any], cases: Sequence[Any],
                judge: Callable[[Callable, Any], str | None],
                describe: Callable[[Any], str] = args_text, *,
                needs_triton: bool = False) -> Verdict:
    """The checker of the exercises where a learner writes a function.

    ``judge(learner, case)`` runs the learner on one case and returns the problem in words, or
    ``None`` when the case passes (:func:`returns` builds one from a ``judge(case, got)``). A
    learner's exception is a problem, told as ``describe(case): raised Type: message``;
    ``NotImplementedError`` means not attempted. The verdict counts the cases and keeps the
    first problem.

    ``needs_triton``: the learner writes a Triton kernel. Where Triton does not run, anything
    but the stub is told to move to a Triton backend; where it runs, an answer that launched
    no ``@triton.jit`` kernel of its own (it computed in torch, or called the course's kernels)
    fails whatever it returned (see :mod:`course_lib.exercises.launches`)."""
    from course_lib.exercises import launches  # loads the device (torch) only to check

    passed, first = 0, None
    with launches.recorded() as kernels, warnings.catch_warnings():
        # the interpreter computes with numpy, which warns where a GPU quietly gives inf/NaN
        # (log(0), -inf - -inf): the verdict, not the warning, tells the learner
        warnings.simplefilter("ignore", RuntimeWarning)
        for i, case in enumerate(cases):
            try:
                problem = judge(learner, case)
            except NotImplementedError:
                return Verdict(exercise, 0, len(cases), attempted=False)
            except Exception as exc:  # a learner's bug is a verdict, not a crash
                problem = f"{describe(case)}: raised {type(exc).__name__}: {exc}"
            if i == 0 and needs_triton and not launches.triton_runs():
                return Verdict(exercise, 0, len(cases), launches.no_triton())
            passed += problem is None
            first = first or problem
    if needs_triton and not launches.own(kernels):
        return Verdict(exercise, 0, len(cases), launches.not_a_kernel(kernels)
                       + (f"; and {first}" if first else ""))
    return Verdict(exercise, passed, len(cases), first)


@dataclass(frozen=True)
class Exercise:
    """One exercise, as the tests and the notebook helpers see it.

    * ``checker(answer) -> Verdict``: the learner's function (or class) against the library;
    * ``hints``: graded, from a nudge to nearly the answer; the last one names the course's own
      code to read once it is solved;
    * ``solution``: a solution as a learner would write it (not a call into the library), shown
      by :meth:`show_solution` only when asked;
    * ``wrong``: plausible wrong answers, each of which the checker must fail (tested, with a
      first difference that says what went wrong);
    * ``trivial``: answers that do nothing (return ``None`` or a constant), which must fail;
    * ``needs_triton``: the learner writes a Triton kernel, so the solution runs only where
      Triton does (the tests skip it under ``COURSE_BACKEND=torch-reference``).
    """
    number: str
    title: str
    checker: Callable[[Any], Verdict]
    hints: tuple[str, ...]
    solution: Callable[..., Any] | type
    wrong: tuple[Callable[..., Any] | type, ...] = ()
    trivial: tuple[Callable[..., Any] | type, ...] = (lambda *a, **k: None,)
    needs_triton: bool = False

    def __post_init__(self) -> None:
        if not self.hints:
            raise ValueError(f"exercise {self.number} needs at least one hint")


class Exercises:
    """A chapter's exercises by number, with graded hints: each ``hint(number)`` shows the next
    one (``hint(number, level)`` a given one), ``solution(number)`` prints the solution's code."""

    def __init__(self, *exercises: Exercise) -> None:
        self.by_number = {e.number: e for e in exercises}
        if len(self.by_number) != len(exercises):
            raise ValueError("two exercises share a number")
        self._shown: dict[str, int] = {}

    def __getitem__(self, number: str) -> Exercise:
        if number not in self.by_number:
            raise KeyError(f"no exercise {number!r} here; the exercises are "
                           f"{', '.join(self.by_number)}")
        return self.by_number[number]

    def __iter__(self):
        return iter(self.by_number.values())

    def hint(self, number: str, level: int | None = None) -> str:
        """The next hint of exercise ``number`` (or hint ``level``, from 1), as printed text."""
        ex = self[number]
        if level is None:
            level = min(self._shown.get(number, 0) + 1, len(ex.hints))
        if not 1 <= level <= len(ex.hints):
            raise ValueError(f"exercise {number} has hints 1..{len(ex.hints)}, got {level}")
        self._shown[number] = max(self._shown.get(number, 0), level)
        more = ("" if level == len(ex.hints) else
                f" (hint({number!r}) again for the next one)")
        return f"hint {level}/{len(ex.hints)} for {number}{more}: {ex.hints[level - 1]}"

    def print_hint(self, number: str, level: int | None = None) -> None:
        """Print the next hint of exercise ``number`` (``level``: a given one): a chapter's
        ``chNN.hint``."""
        print(self.hint(number, level))

    def print_solution(self, number: str) -> None:
        """Print a solution of exercise ``number`` (try first: the hints come before it): a
        chapter's ``chNN.solution``."""
        print(self.solution(number))

    def solution(self, number: str) -> str:
        """The solution of exercise ``number``, as source code."""
        import inspect
        import textwrap

        return textwrap.dedent(inspect.getsource(self[number].solution))


def op_text(op: tuple) -> str:
    """An operation ``("name", arg, ...)`` as a call: ``name(arg, ...)``."""
    return f"{op[0]}({', '.join(map(repr, op[1:]))})"


def replay_ops(name: str, cases: Sequence[tuple], learner: type, reference: type,
               outcome: Callable[[Any, tuple, list[tuple], int], Any],
               explain: Callable[[tuple, list[tuple], int, Any, Any], str]) -> Verdict:
    """The checker of the exercises where a learner writes a stateful class (3.3's model).

    Each case is ``(*setup, ops)``: ``learner(*setup)`` and ``reference(*setup)`` run the same
    operations; after operation ``i``, ``outcome(obj, setup, ops, i)`` (which applies it and
    observes the state) must be equal for both. A case stops at its first difference; the
    first one found is told by ``explain(setup, ops, i, got, want)``. A learner's exception is
    an outcome (``"raises Type: message"``), ``NotImplementedError`` means not attempted."""
    passed, problem = 0, None
    for *setup, ops in cases:
        try:
            mine = learner(*setup)
        except NotImplementedError:
            return Verdict(name, 0, len(cases), attempted=False)
        ref = reference(*setup)
        for i in range(len(ops)):
            want = outcome(ref, tuple(setup), ops, i)
            try:
                got = outcome(mine, tuple(setup), ops, i)
            except NotImplementedError:
                return Verdict(name, 0, len(cases), attempted=False)
            except Exception as exc:   # a learner's bug is a verdict, not a crash
                got = f"raises {type(exc).__name__}: {exc}"
            if got != want:
                problem = problem or explain(tuple(setup), ops, i, got, want)
                break
        else:
            passed += 1
    return Verdict(name, passed, len(cases), problem)


def pool_history(difference: Callable[[Any, Any], str]
                 ) -> Callable[[tuple, list[tuple], int, Any, Any], str]:
    """An ``explain`` for :func:`replay_ops` whose setup is ``(num_blocks, block_size)``: the
    whole history up to the operation that differed, then ``difference(got, want)`` in words
    (or the learner's exception)."""
    def explain(setup: tuple, ops: list[tuple], i: int, got: Any, want: Any) -> str:
        what = got if isinstance(got, str) else difference(got, want)
        before = ", ".join(map(op_text, ops[:i])) or "nothing"
        return (f"pool of {setup[0]} blocks of {setup[1]}, after {before}: "
                f"op {i} {op_text(ops[i])} {what}")
    return explain
