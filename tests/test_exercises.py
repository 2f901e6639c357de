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
import re
import time
from pathlib import Path

import pytest
from interpreter_only import INTERPRETER_ONLY

import course_lib.exercises as exercises_pkg
from course_lib.exercises import Exercise, Exercises, Rule

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
# the wrong answers of a Triton exercise: judged in Triton's interpreter only
WRONG_CASES = [pytest.param(m, ex, id=ex.number,
                            marks=[NO_TRITON, INTERPRETER_ONLY] if ex.needs_triton else [])
               for m, ex in (p.values for p in CASES)]


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


@pytest.fixture(scope="module")
def verdict_of():
    """``verdict_of(ex, answer)``: the checker's verdict on one answer, computed once for the
    module: several tests read the same verdicts (the solution's; each rule's wrong answer is
    one of the plausible wrong answers), and a capstone checker replays whole engine runs."""
    seen = {}

    def verdict(ex: Exercise, answer):
        if (ex.number, answer) not in seen:
            seen[ex.number, answer] = ex.checker(answer)
        return seen[ex.number, answer]
    return verdict


@pytest.mark.parametrize("module, ex", CASES)
def test_the_solution_passes(module, ex: Exercise, verdict_of):
    verdict = verdict_of(ex, ex.solution)
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


@pytest.mark.parametrize("module, ex", WRONG_CASES)
def test_plausible_wrong_answers_fail_with_a_first_difference(module, ex: Exercise, verdict_of):
    assert ex.wrong, f"{ex.number}: list at least one plausible wrong answer"
    for answer in ex.wrong:
        verdict = verdict_of(ex, answer)
        assert verdict.attempted and not verdict.ok, (answer, str(verdict))
        assert verdict.first_problem, str(verdict)


def pinned(rule: Rule, described: tuple[str, ...]) -> list[str]:
    """The case descriptions a rule's ``case`` names (a part of each)."""
    return [d for d in described if rule.case in d]


@pytest.mark.parametrize("module, ex", WRONG_CASES)
def test_every_rule_is_pinned_by_a_case_its_wrong_answer_fails(module, ex: Exercise, verdict_of):
    """Each rule the statement states has a case among the checker's, and the answer that
    drops the rule fails that very case (not merely some case)."""
    assert ex.rules, f"{ex.number}: list the rules its statement states (Exercise.rules)"
    cases = verdict_of(ex, ex.solution).cases
    for rule in ex.rules:
        assert pinned(rule, cases), (f"{ex.number}: no case of the checker is {rule.case!r}, "
                                     f"which should pin {rule.text!r}")
        assert rule.wrong in ex.wrong
        verdict = verdict_of(ex, rule.wrong)
        assert verdict.attempted and not verdict.ok, (rule.text, str(verdict))
        assert pinned(rule, verdict.failed), (
            f"{ex.number}: dropping {rule.text!r} does not fail {rule.case!r}; it fails "
            f"{verdict.failed[:3]}")


LIBRARY_POINTER = re.compile(r"\b[Rr]ead (?!\w+ (?:only|past|outside))|[Cc]ompare with|"
                             r"course_lib[./]|vllm/")


def test_the_library_pointer_detector():
    assert LIBRARY_POINTER.search("Then read BlockTable.slot in course_lib/memory/v0/x.py.")
    assert LIBRARY_POINTER.search("Compare with reference.merge_attn_states.")
    assert not LIBRARY_POINTER.search("the -1 entries past the last block are never read.")


@pytest.mark.parametrize("module, ex", CASES)
def test_hints_point_to_ideas_and_the_library_comes_after_a_pass(module, ex: Exercise,
                                                                 verdict_of):
    """No hint sends the learner to the library function that is the answer; where there is
    code to compare with, the verdict of a pass says so."""
    for hint in ex.hints:
        assert not LIBRARY_POINTER.search(hint), f"{ex.number}: {hint}"
    verdict = verdict_of(ex, ex.solution)
    if ex.compare_with:
        assert str(verdict).endswith(f"now compare with {ex.compare_with}"), str(verdict)


@pytest.mark.parametrize("module, ex", CASES)
def test_a_triton_solution_shows_its_kernel(module, ex: Exercise):
    source = Exercises(ex).solution(ex.number)
    assert ("@triton.jit" in source) == ex.needs_triton, source[:200]


def test_a_case_that_hangs_is_stopped_and_named(monkeypatch):
    """Every case runs under a deadline; the verdict names the case that ran past it and
    stops there."""
    import course_lib.exercises as ex_pkg
    from course_lib.exercises import ch07

    monkeypatch.setattr(ex_pkg, "CASE_SECONDS", 0.3)

    def off_by_one(prompt_len, budget, num_decoding):   # >= 0: never ends
        chunks, left = [], prompt_len
        while left >= 0:
            take = min(left, budget - num_decoding)
            chunks.append(take)
            left -= take
        return chunks

    start = time.monotonic()
    verdict = ch07.check_prefill_chunks(off_by_one)
    assert time.monotonic() - start < 5
    assert not verdict.ok and "still running after 0.3 s" in verdict.first_problem
    assert verdict.first_problem.startswith("(")          # the case's arguments come first
    assert verdict.failed and verdict.failed[-1] in verdict.first_problem


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


def test_3_1_reads_only_what_its_statement_names():
    """3.1 names the methods, ``tables`` and ``num_free``: a correct manager that keeps its
    pool size under another name, and gives block ids of its own choosing, passes."""
    from course_lib.exercises import ch03_manager
    from course_lib.exercises.solutions.ch03 import ToyManager

    class Renamed:
        def __init__(self, num_blocks, block_size, watermark_blocks):
            self._inner = ToyManager(num_blocks, block_size, watermark_blocks)
            self._inner.free_blocks = [f"b{i}" for i in self._inner.free_blocks]

        def __getattr__(self, name):        # the four methods, tables and num_free only
            if name in ("can_allocate", "allocate", "append_step", "free", "tables",
                        "num_free"):
                return getattr(self._inner, name)
            raise AttributeError(name)

    verdict = ch03_manager.check_manager(Renamed)
    assert verdict.ok, str(verdict)


def test_an_operation_that_hangs_is_stopped_and_named(monkeypatch):
    """The same deadline holds for each operation of a class's checker (replay_ops)."""
    import course_lib.exercises as ex_pkg
    from course_lib.exercises import ch03
    from course_lib.exercises.solutions.ch03 import ToyAllocator

    class SpinsWhenEmpty(ToyAllocator):
        def allocate(self):
            while not self.free_stack:       # waits for a free that never comes
                pass
            return super().allocate()

    monkeypatch.setattr(ex_pkg, "CASE_SECONDS", 0.3)
    verdict = ch03.check_allocator(SpinsWhenEmpty)
    assert not verdict.ok and "op 0 allocate()" in verdict.first_problem
    assert "still running after 0.3 s" in verdict.first_problem


def _markdown(chapter: str) -> str:
    (path,) = (ROOT / "notebooks").glob(f"{chapter}_*.ipynb")
    nb = json.loads(path.read_text())
    text = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    return " ".join(text.split())


def test_a_prediction_exercise_poses_the_scenarios_its_checker_plays():
    """Predict-then-run (5.3, 10.3, 12.1): the statement lists every scenario in the words
    the checker's verdict uses, so a learner predicts what is played."""
    from course_lib.exercises import ch05_cow, ch10, ch12

    for chapter, scenarios in (("05", ch05_cow.SCENARIOS), ("10", ch10.SHARING_SCENARIOS),
                               ("12", ch12.SCENARIOS)):
        text = _markdown(chapter)
        for s in scenarios:
            assert f"**{s.key}**: {' '.join(s.text.split())}" in text, (chapter, s.key)


def test_a_fix_the_bug_exercise_shows_the_code_its_wrong_answer_runs():
    """Fix-the-bug (3.3, 8.2, 11.1) and find-the-failing-input (2.2): the broken code the
    notebook shows is the code the tests hold to failing, line for line."""
    import ast
    import inspect
    import textwrap

    from course_lib.exercises import ch02, ch03, ch08, ch11

    for chapter, broken, number in (("02", ch02.RightMergeFirstFit.free, None),
                                    ("03", ch03.ShownAllocator, "3.3"),
                                    ("08", ch08.shown_kv_heads_per_rank, "8.2"),
                                    ("11", ch11.shown_append_slots, "11.1")):
        text = _markdown(chapter)
        source = textwrap.dedent(inspect.getsource(broken))
        node = ast.parse(source).body[0]
        first = node.body[1 if ast.get_docstring(node) else 0].lineno
        for line in source.splitlines()[first - 1:]:
            assert " ".join(line.split()) in text, (chapter, line)
        if number:
            assert broken in module_of(number).EXERCISES[number].wrong


def module_of(number: str):
    return importlib.import_module(f"course_lib.exercises.ch{int(number.split('.')[0]):02d}")


def test_a_nested_deadline_gives_back_what_is_left_of_the_outer_one():
    """An inner deadline restores the enclosing one minus the time the inner block took (it
    restored ``outer - seconds``: an inner deadline of 1 s that took 0.01 s cut 1 s off the
    outer one, which then fired early), and never outlasts it."""
    import signal
    import time

    from course_lib.exercises import CaseTimeout, deadline

    with deadline(5.0):
        with deadline(2.0):
            pass                                        # takes nothing
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert left > 4.5, left                         # was 3.0: 5 - 2
        with deadline(60.0):                            # capped at what the outer has left
            inner, _ = signal.getitimer(signal.ITIMER_REAL)
            assert inner <= 5.0, inner
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0
    t0 = time.monotonic()
    with pytest.raises(CaseTimeout):
        with deadline(0.2):
            with deadline(30.0):                        # the outer one still fires on time
                while True:
                    time.sleep(0.01)
    assert time.monotonic() - t0 < 5


def test_a_cpu_deadline_counts_computing_not_waiting_and_keeps_the_outer_one():
    """A learner's case runs under a deadline of its own CPU time (a loaded machine does not
    count against it); a block that only waits is still stopped, by WALL_FACTOR x its limit
    or by an enclosing deadline, whichever comes first."""
    import time

    from course_lib.exercises import CaseTimeout, deadline

    t0 = time.monotonic()
    with deadline(0.05, cpu=True):
        time.sleep(0.2)                                  # 4 x its limit, but no CPU used
    with pytest.raises(CaseTimeout) as spun:
        with deadline(0.05, cpu=True):
            while True:
                pass
    assert not spun.value.waited
    with pytest.raises(CaseTimeout) as waited:
        with deadline(0.2):
            with deadline(30.0, cpu=True):               # the outer one still fires on time
                while True:
                    time.sleep(0.01)
    assert waited.value.waited and time.monotonic() - t0 < 5
