"""Checkers for the exercises at the end of each chapter.

A learner writes a function in the notebook; :func:`check` runs it and the library's version on
the same cases and says, in one line, whether they agree. An exercise left as
``raise NotImplementedError`` is reported as not attempted, so a fresh notebook runs clean.

The generic :func:`check` lives here; each chapter's exercise cases and checkers live in
``course_lib/exercises/chNN.py`` (e.g. ``from course_lib.exercises import ch03``).
"""

from __future__ import annotations

import copy
import math
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

CASE_SECONDS = 5.0            # CPU seconds a case may take (plain Python), far above a solution
TRITON_CASE_SECONDS = 120.0   # the same for a Triton case (the interpreter is slow on a CPU)
WALL_FACTOR = 10.0            # a case that waits (uses no CPU) is stopped after this x its limit
CHECK_THREADS = 1             # torch's threads while a learner's case runs (see deadline)
_COMPARE_WITH: dict[str, str] = {}   # exercise number -> what to read once it passes


class CaseTimeout(BaseException):
    """Raised in a case that ran past its deadline. A ``BaseException``, so that a learner's
    ``except Exception`` cannot swallow it. ``waited``: it ran out of wall-clock time while
    using less CPU than its limit (it waits for something), not out of CPU time."""

    def __init__(self, waited: bool = False) -> None:
        super().__init__("waited" if waited else "computed")
        self.waited = waited


@dataclass(frozen=True)
class Budget:
    """The CPU time one case may take, and what that limit was measured against (a case that
    runs past it is told both, so a learner can judge whether the machine or the code is
    slow)."""
    seconds: float
    against: str


def fixed_budget(seconds: float) -> Budget:
    """A fixed limit, far above what a solution takes on any machine the course runs on."""
    return Budget(seconds, "a fixed limit per case, many times what the solution takes")


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` within the block (if torch is loaded)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def deadline(seconds: float, cpu: bool = False) -> Iterator[None]:
    """Within the block, raise :class:`CaseTimeout` after ``seconds`` of wall-clock time.

    ``cpu``: count instead the CPU time of this thread (``time.thread_time``), with torch on
    :data:`CHECK_THREADS` thread(s). Why: a checker's limit must measure the learner's code,
    not the machine. On a loaded 2-core machine a correct answer can take five times its
    wall-clock time waiting for a core, and torch's default thread pool spins its threads
    against each other; CPU time of one thread is what the code itself costs. A block that
    waits without computing (``sleep``, ``input``) uses no CPU, so it is still stopped after
    :data:`WALL_FACTOR` x ``seconds`` of wall-clock time (``CaseTimeout.waited``).

    Uses ``SIGALRM`` (a Jupyter cell, like pytest, runs in the main thread); elsewhere (another
    thread, or Windows) the block runs without a deadline. An enclosing deadline is restored,
    minus the wall-clock time the block took, and is never outlasted."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(
            signal, "setitimer"):
        yield
        return
    outer, _ = signal.getitimer(signal.ITIMER_REAL)      # seconds left to an enclosing one
    start, cpu_start = time.monotonic(), time.thread_time()
    wall_end = start + (seconds * WALL_FACTOR if cpu else seconds)
    if outer:
        wall_end = min(wall_end, start + outer)

    def expire(signum, frame):
        now = time.monotonic()
        used = time.thread_time() - cpu_start
        if cpu and used < seconds and now < wall_end:  # the machine was busy: wait the rest
            signal.setitimer(signal.ITIMER_REAL,
                             max(min(seconds - used, wall_end - now), 0.001))
            return
        raise CaseTimeout(waited=cpu and used < seconds)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, min(seconds, wall_end - start))
    try:
        with torch_threads(CHECK_THREADS) if cpu else nullcontext():
            yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:                 # what is left of it now: the time this block really took
            signal.setitimer(signal.ITIMER_REAL,
                             max(outer - (time.monotonic() - start), 0.001))


def hung(what: str, budget: Budget, left: int, before: str | None = None,
         waited: bool = False) -> str:
    """The problem of a case that ran past its deadline, naming the case, the limit and what
    it was measured against (``before``: the first problem of an earlier case, if any)."""
    rest = f"; the {left} case(s) after it were not run" if left else ""
    earlier = f"; an earlier case: {before}" if before else ""
    if waited:
        return (f"{what}: still waiting after {budget.seconds * WALL_FACTOR:g} s of "
                f"wall-clock time, having used less than its {budget.seconds:g} s of CPU time "
                f"({budget.against}), so it was stopped (does it sleep, or wait for something "
                f"that never comes?){rest}{earlier}")
    return (f"{what}: still running after {budget.seconds:g} s of its own CPU time (the "
            f"limit: {budget.against}), so it was stopped (a loop that never ends? check the "
            f"condition that should end it){rest}{earlier}")


@dataclass(frozen=True)
class Verdict:
    """A checker's answer: how many cases passed, the first problem in words, and (for the
    tests) every case run and every case failed, described as the learner sees them."""

    exercise: str
    passed: int
    total: int
    first_problem: str | None = None  # None when every case passed
    attempted: bool = True
    cases: tuple[str, ...] = field(default=(), compare=False)   # every case run, described
    failed: tuple[str, ...] = field(default=(), compare=False)  # the cases that failed

    @property
    def number(self) -> str:
        """The exercise's number: ``"3.1"`` of ``"3.1 block manager"``."""
        return self.exercise.split()[0]

    @property
    def ok(self) -> bool:
        return self.attempted and self.passed == self.total

    def __str__(self) -> str:
        if not self.attempted:
            return f"exercise {self.exercise}: not attempted yet (it raises NotImplementedError)"
        if self.ok:
            after = _COMPARE_WITH.get(self.number)
            return (f"exercise {self.exercise}: all {self.total} cases match the library"
                    + (f"; now compare with {after}" if after else ""))
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
    passed, first_problem, failed = 0, None, []
    described = tuple(args_text(case) for case in cases)
    for i, case in enumerate(cases):
        args = ", ".join(map(repr, case))
        want = reference(*case)
        try:
            with deadline(CASE_SECONDS, cpu=True):
                got = learner(*case)
        except NotImplementedError:
            return Verdict(exercise, 0, len(cases), attempted=False)
        except CaseTimeout as t:
            failed.append(described[i])
            return Verdict(exercise, passed, len(cases),
                           hung(f"({args})", fixed_budget(CASE_SECONDS), len(cases) - i - 1,
                                first_problem, t.waited),
                           cases=described, failed=tuple(failed))
        except Exception as exc:  # a learner's bug is a verdict, not a crash of the notebook
            got, ok = None, False
            problem = f"({args}) raised {type(exc).__name__}: {exc}"
        else:
            ok = compare(got, want)
            problem = f"({args}) returned {got!r}, the library returns {want!r}"
        if ok:
            passed += 1
        else:
            failed.append(described[i])
            first_problem = first_problem or problem
    return Verdict(exercise, passed, len(cases), first_problem, cases=described,
                   failed=tuple(failed))


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
                needs_triton: bool = False,
                seconds: float | Callable[[Any], Budget] | None = None) -> Verdict:
    """The checker of the exercises where a learner writes a function.

    ``judge(learner, case)`` runs the learner on one case and returns the problem in words, or
    ``None`` when the case passes (:func:`returns` builds one from a ``judge(case, got)``). A
    learner's exception is a problem, told as ``describe(case): raised Type: message``;
    ``NotImplementedError`` means not attempted. The verdict counts the cases and keeps the
    first problem.

    ``needs_triton``: the learner writes a Triton kernel. Where Triton does not run, anything
    but the stub is told to move to a Triton backend; where it runs, an answer that launched
    no ``@triton.jit`` kernel of its own (it computed in torch, or called the course's kernels)
    fails whatever it returned (see :mod:`course_lib.exercises.launches`).

    Each case runs under a deadline of the learner's own CPU time (see :func:`deadline`):
    ``seconds`` (default :data:`CASE_SECONDS`, or :data:`TRITON_CASE_SECONDS` for a Triton
    exercise), or ``seconds(case)``, a :class:`Budget` measured for that case before it runs
    (e.g. scaled from the library's own run of it on this machine). A case still running then
    is stopped, and the verdict names it, the limit and what the limit was measured against
    (the cases after it are not run)."""
    from course_lib.exercises import launches  # loads the device (torch) only to check

    passed, first, failed = 0, None, []
    described = tuple(describe(case) for case in cases)
    seconds = seconds or (TRITON_CASE_SECONDS if needs_triton else CASE_SECONDS)
    fixed = None if callable(seconds) else fixed_budget(seconds)
    budget_of = seconds if fixed is None else (lambda case: fixed)
    with launches.recorded() as kernels, warnings.catch_warnings():
        # the interpreter computes with numpy, which warns where a GPU quietly gives inf/NaN
        # (log(0), -inf - -inf): the verdict, not the warning, tells the learner
        warnings.simplefilter("ignore", RuntimeWarning)
        for i, case in enumerate(cases):
            launches.new_case()
            budget = budget_of(case)
            try:
                with deadline(budget.seconds, cpu=True):
                    problem = judge(learner, case)
            except NotImplementedError:
                return Verdict(exercise, 0, len(cases), attempted=False)
            except CaseTimeout as t:
                failed.append(described[i])
                return Verdict(exercise, passed, len(cases),
                               hung(described[i], budget, len(cases) - i - 1, first,
                                    t.waited),
                               cases=described, failed=tuple(failed))
            except Exception as exc:  # a learner's bug is a verdict, not a crash
                exc = launches.out_of_bounds_in(exc) or exc
                problem = f"{described[i]}: raised {type(exc).__name__}: {exc}"
            if i == 0 and needs_triton and not launches.triton_runs():
                return Verdict(exercise, 0, len(cases), launches.no_triton())
            passed += problem is None
            if problem is not None:
                failed.append(described[i])
            first = first or problem
    if needs_triton and not launches.own(kernels):
        return Verdict(exercise, 0, len(cases), launches.not_a_kernel(kernels)
                       + (f"; and {first}" if first else ""), cases=described,
                       failed=described)
    return Verdict(exercise, passed, len(cases), first, cases=described, failed=tuple(failed))


@dataclass(frozen=True)
class Scenario:
    """One scenario of a predict-then-run exercise: ``key`` names it in the learner's answer,
    ``text`` says it in the statement's words, ``run()`` plays it on the library and returns
    the number the learner predicts."""
    key: str
    text: str
    run: Callable[[], Any]

    def __str__(self) -> str:
        return f"{self.key} ({self.text})"


REVEAL_AFTER = 3   # different wrong answers to a predict-then-run exercise before its numbers
_TRIED: dict[str, set[str]] = {}   # exercise -> the wrong answers seen (as text)


def prediction_matches(mine: Any, want: Any) -> bool:
    """A prediction equals the library's number: exactly where both are exact (ints,
    ``Fraction``, ``Decimal``: ``Fraction(1, 3)`` is 1/3), else to the 1e-9 the float of a
    fraction such as ``1 - 3 / 8`` carries. ``True`` is not 1: a bool is no prediction."""
    import numbers
    from decimal import Decimal
    from fractions import Fraction

    if isinstance(mine, bool) or isinstance(want, bool):
        return mine is want
    exact = (numbers.Rational, Decimal)
    if isinstance(want, numbers.Real | Decimal) and isinstance(mine, numbers.Real | Decimal):
        if isinstance(want, exact) and isinstance(mine, exact):
            return Fraction(mine) == Fraction(want)
        return math.isclose(float(mine), float(want), rel_tol=1e-9, abs_tol=1e-12)
    return bool(mine == want)


def _number_text(want: Any) -> str:
    """The library's number as the learner can compare it: a fraction and its decimals."""
    from fractions import Fraction

    if isinstance(want, float) and math.isfinite(want):
        near = Fraction(want).limit_denominator(10_000)
        want = near if math.isclose(float(near), want, rel_tol=1e-12, abs_tol=1e-15) else want
    if isinstance(want, Fraction) and want.denominator != 1:
        return f"{want} = {float(want):.12g}"
    return f"{want:.12g}" if isinstance(want, float) else repr(want)


def judge_predictions(exercise: str, learner: Callable[[], Any],
                      scenarios: Sequence[Scenario]) -> Verdict:
    """The checker of a predict-then-run exercise: ``learner()`` returns a dict of predictions
    ``{key: number}``; each scenario is run on the library and compared with its prediction
    (:func:`prediction_matches`: exactly, or to 1e-9 for a float).

    A wrong answer is told right or wrong per scenario, without the library's numbers: were
    they told, one run with made-up numbers would give every answer, and the exercise is the
    prediction. After :data:`REVEAL_AFTER` different wrong answers the numbers are told (the
    learner has committed, and may be stuck). A missing prediction is told as missing."""
    outcome: dict[str, tuple[Any, Any]] = {}     # key -> (prediction, library's) if wrong

    def judge(learner: Callable[[], Any], scenario: Scenario) -> str | None:
        got = learner()
        if not isinstance(got, dict):
            return f"{scenario}: returned {got!r:.60}, not a dict {{scenario: prediction}}"
        if scenario.key not in got:
            return f"{scenario}: no prediction for {scenario.key!r}"
        want, mine = scenario.run(), got[scenario.key]
        if prediction_matches(mine, want):
            return None
        outcome[scenario.key] = (mine, want)
        return f"{scenario}: your prediction {mine!r} is wrong"

    verdict = judge_cases(exercise, learner, scenarios, judge, str)
    if verdict.ok or not verdict.attempted or not outcome:
        return verdict
    tried = _TRIED.setdefault(exercise, set())
    tried.add(repr(sorted((k, repr(v[0])) for k, v in outcome.items())))
    wrong = [s for s in scenarios if s.key in outcome]
    right = [s.key for s in scenarios if str(s) not in verdict.failed]
    if len(tried) >= REVEAL_AFTER:
        told = "; ".join(f"{s}: you predicted {outcome[s.key][0]!r}, the library gives "
                         f"{_number_text(outcome[s.key][1])}" for s in wrong)
    else:
        left = REVEAL_AFTER - len(tried)
        told = ("; ".join(f"{s}: your prediction {outcome[s.key][0]!r} is wrong"
                          for s in wrong)
                + f" (work it out again; after {left} more different wrong answer(s) the "
                  "checker tells the library's numbers)")
    problem = (f"right: {', '.join(right) or 'none'}; wrong: {told}"
               if len(wrong) == len(verdict.failed) else verdict.first_problem)
    return Verdict(exercise, verdict.passed, verdict.total, problem, cases=verdict.cases,
                   failed=verdict.failed)


@dataclass(frozen=True)
class Rule:
    """One rule an exercise's statement states, and how its checker holds the learner to it.

    * ``text``: the rule, in the statement's words;
    * ``case``: the case that pins it, as the checker describes it (``Verdict.cases``), or a
      part of that description that only this case's has;
    * ``wrong``: an answer right but for this rule, which must fail that case (tested)."""
    text: str
    case: str
    wrong: Callable[..., Any] | type


@dataclass(frozen=True)
class Exercise:
    """One exercise, as the tests and the notebook helpers see it.

    * ``checker(answer) -> Verdict``: the learner's function (or class) against the library;
    * ``hints``: graded, from a nudge to nearly the answer; they point to ideas, never to the
      library function that is the answer;
    * ``solution``: a solution as a learner would write it (not a call into the library), shown
      by :meth:`show_solution` only when asked;
    * ``wrong``: plausible wrong answers, each of which the checker must fail (tested, with a
      first difference that says what went wrong);
    * ``trivial``: answers that do nothing (return ``None`` or a constant), which must fail;
    * ``needs_triton``: the learner writes a Triton kernel, so the solution runs only where
      Triton does (the tests skip it under ``COURSE_BACKEND=torch-reference``);
    * ``rules``: every rule the statement states, each with the case that pins it and the wrong
      answer that drops it (its wrong answer joins ``wrong``);
    * ``compare_with``: the course's (or a system's) code to read once the checker passes: the
      verdict of a pass says it, the hints do not.
    """
    number: str
    title: str
    checker: Callable[[Any], Verdict]
    hints: tuple[str, ...]
    solution: Callable[..., Any] | type
    wrong: tuple[Callable[..., Any] | type, ...] = ()
    trivial: tuple[Callable[..., Any] | type, ...] = (lambda *a, **k: None,)
    needs_triton: bool = False
    rules: tuple[Rule, ...] = ()
    compare_with: str | None = None

    def __post_init__(self) -> None:
        if not self.hints:
            raise ValueError(f"exercise {self.number} needs at least one hint")
        extra = tuple(r.wrong for r in self.rules if r.wrong not in self.wrong)
        object.__setattr__(self, "wrong", self.wrong + extra)
        if self.compare_with:
            _COMPARE_WITH[self.number] = self.compare_with

    def rule(self, words: str) -> Rule:
        """The one rule whose text contains ``words``."""
        found = [r for r in self.rules if words in r.text]
        if len(found) != 1:
            raise KeyError(f"{len(found)} rules of {self.number} say {words!r}; its rules: "
                           + "; ".join(r.text for r in self.rules))
        return found[0]


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
        """The solution of exercise ``number``, as source code: the ``@triton.jit`` kernels it
        launches first (the kernel is the exercise), then the function or class."""
        import inspect
        import textwrap

        answer = self[number].solution
        code = textwrap.dedent(inspect.getsource(answer))
        return "\n\n".join([*jit_kernels_of(answer), code])


def jit_kernels_of(answer: Callable[..., Any] | type) -> list[str]:
    """The source of each ``@triton.jit`` function of ``answer``'s module that ``answer`` names,
    found in the module's text (so also where Triton does not run and the kernels are not
    defined)."""
    import ast
    import inspect
    import sys
    import textwrap

    names = set(getattr(getattr(answer, "__code__", None), "co_names", ()))
    source = inspect.getsource(sys.modules[answer.__module__])
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name in names and any(
                "jit" in ast.unparse(d) for d in node.decorator_list):
            first = min(d.lineno for d in node.decorator_list)
            lines = source.splitlines()[first - 1:node.end_lineno]
            found.append(textwrap.dedent("\n".join(lines)))
    return found


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
    passed, problem, failed = 0, None, []
    described = tuple(args_text(case) for case in cases)
    if not callable(learner):                  # 5, None, or an instance: no class to build
        return Verdict(name, 0, len(cases), f"pass the class itself (its name, not called), "
                       f"got {type(learner).__name__} {learner!r:.60}", cases=described,
                       failed=described)
    for c, (*setup, ops) in enumerate(cases):
        try:
            with deadline(CASE_SECONDS, cpu=True):
                mine = learner(*setup)
        except NotImplementedError:
            return Verdict(name, 0, len(cases), attempted=False)
        except CaseTimeout as t:
            return Verdict(name, passed, len(cases), hung(
                f"building it with {tuple(setup)}", fixed_budget(CASE_SECONDS),
                len(cases) - c - 1, problem, t.waited),
                cases=described, failed=(*failed, described[c]))
        except Exception as exc:   # its constructor's bug is a verdict too, not a crash
            problem = problem or (f"building it with {tuple(setup)} raises "
                                  f"{type(exc).__name__}: {exc}")
            failed.append(described[c])
            continue
        ref = reference(*setup)
        for i in range(len(ops)):
            want = outcome(ref, tuple(setup), ops, i)
            try:
                with deadline(CASE_SECONDS, cpu=True):
                    got = outcome(mine, tuple(setup), ops, i)
            except NotImplementedError:
                return Verdict(name, 0, len(cases), attempted=False)
            except CaseTimeout as t:
                failed.append(described[c])
                before = ", ".join(map(op_text, ops[:i])) or "nothing"
                return Verdict(name, passed, len(cases), hung(
                    f"setup {tuple(setup)}, after {before}: op {i} {op_text(ops[i])}",
                    fixed_budget(CASE_SECONDS), len(cases) - c - 1, problem, t.waited),
                    cases=described, failed=tuple(failed))
            except Exception as exc:   # a learner's bug is a verdict, not a crash
                got = f"raises {type(exc).__name__}: {exc}"
            if got != want:
                problem = problem or explain(tuple(setup), ops, i, got, want)
                failed.append(described[c])
                break
        else:
            passed += 1
    return Verdict(name, passed, len(cases), problem, cases=described, failed=tuple(failed))


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
