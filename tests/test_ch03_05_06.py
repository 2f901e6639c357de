"""The exercise checkers of chapters 03, 05 and 06: each passes the library's own solution,
fails a plausible wrong one (naming the first difference), and reports a fresh exercise as not
attempted."""

from __future__ import annotations

import re

import pytest

from course_lib.exercises import ch03, ch05, ch06
from course_lib.exercises.ch03_manager import ReferenceManager, check_manager
from course_lib.exercises.ch05_beams import BeamCase, beam_args, beam_blocks, check_beam_blocks
from course_lib.memory.v0.pool import NoFreeBlocksError
from course_lib.memory.v0.prefix_cache import ROOT_HASH
from course_lib.sizing.units import cdiv

pytestmark = [pytest.mark.ch03, pytest.mark.ch05, pytest.mark.ch06]


def not_done(*args):
    raise NotImplementedError


def test_manager_checker_names_the_operation_and_the_concept():
    assert check_manager(ReferenceManager).ok
    assert not check_manager(not_done).attempted
    rule = ch03.EXERCISES["3.1"].rule
    partial, no_never = rule("changes nothing").wrong, rule("NEVER").wrong
    watermark_on_append = rule("appends ignore the watermark").wrong
    v = check_manager(partial)
    assert "append_step({'A': 2, 'B': 2}) returns False" in v.first_problem
    assert "must change nothing" in v.first_problem
    assert "NEVER: more blocks than the pool" in check_manager(no_never).first_problem
    v = check_manager(watermark_on_append)
    assert not v.ok and "append_step" in v.first_problem


def test_step_slot_mapping_checker():
    assert ch03.step_slot_mapping({"A": [7, 3, 12]}, {"A": 39}, {"A": 1}, 16) == [199]
    assert ch03.step_slot_mapping({"A": [7, 3, 12], "B": [1]}, {"A": 15, "B": 0},
                                  {"B": 1, "A": 2}, 16) == [16, 127, 48]
    mine = lambda t, c, n, bs: [t[s][p // bs] * bs + p % bs           # noqa: E731
                                for s in n for p in range(c[s], c[s] + n[s])]
    assert ch03.check_step_slot_mapping(mine).ok
    v = ch03.check_step_slot_mapping(
        lambda t, c, n, bs: [t[s][p // bs] + p % bs for s in n for p in range(c[s], c[s] + n[s])])
    assert not v.ok and "want 7 * 16 + 0 = 112" in v.first_problem
    assert not ch03.check_step_slot_mapping(not_done).attempted


class ListAllocator:
    """A correct learner solution without the library."""

    def __init__(self, num_blocks):
        self.stack = list(range(num_blocks - 1, -1, -1))
        self.free_set = set(self.stack)
        self.n = num_blocks

    @property
    def num_free(self):
        return len(self.stack)

    def allocate(self):
        if not self.stack:
            raise RuntimeError("empty")
        block = self.stack.pop()
        self.free_set.discard(block)
        return block

    def free(self, block):
        if not 0 <= block < self.n or block in self.free_set:
            raise ValueError(block)
        self.stack.append(block)
        self.free_set.add(block)


class FifoAllocator(ListAllocator):
    def free(self, block):           # FIFO: freed blocks go to the bottom
        if not 0 <= block < self.n or block in self.free_set:
            raise ValueError(block)
        self.stack.insert(0, block)
        self.free_set.add(block)


class NoDoubleFreeCheck(ListAllocator):
    def free(self, block):
        self.stack.append(block)
        self.free_set.add(block)


def test_allocator_checker():
    assert ch03.check_allocator(ch03.ReferenceAllocator).ok
    assert ch03.check_allocator(ListAllocator).ok
    v = ch03.check_allocator(NoDoubleFreeCheck)
    assert not v.ok and "raises ValueError" in v.first_problem
    assert not ch03.check_allocator(FifoAllocator).ok
    assert not ch03.check_allocator(type("Todo", (), {"__init__": not_done})).attempted


def test_reference_allocator_rejects_without_changing_state():
    ref = ch03.ReferenceAllocator(2)
    assert [ref.allocate(), ref.allocate()] == [0, 1]
    with pytest.raises(NoFreeBlocksError):
        ref.allocate()
    ref.free(1)
    with pytest.raises(ValueError):
        ref.free(1)
    assert ref.num_free == 1 and ref.allocate() == 1


def test_beam_blocks_checker():
    fork = BeamCase(7, 4, (), (0, 0))            # the page's first step: one copy
    assert beam_args(fork) == ({0: [0, 1]}, 7, [0, 0], 4)
    assert beam_blocks(fork) == ([], [1], 3)
    assert beam_blocks(BeamCase(8, 4, (), (0, 0))) == ([], [], 4)   # full: no copy

    def mine(tables, n, picks, bs):
        refs = {}
        for t in tables.values():
            for b in t:
                refs[b] = refs.get(b, 0) + 1
        freed = []
        for beam, t in tables.items():
            if beam not in picks:
                for b in t:
                    refs[b] -= 1
                    freed += [b] if refs[b] == 0 else []
        for beam in set(picks):
            for b in tables[beam]:
                refs[b] += picks.count(beam) - 1
        copied = [] if n % bs == 0 else [
            last for last in {tables[p][-1] for p in picks} for _ in range(refs[last] - 1)]
        held = sum(r > 0 for r in refs.values()) + len(copied) + (len(picks) if n % bs == 0
                                                                   else 0)
        return freed, copied, held

    assert check_beam_blocks(mine).ok
    every_beam_copies = ch05.EXERCISES["5.1"].rule("k - 1 copies").wrong
    frees_whole_tables = ch05.EXERCISES["5.1"].rule("dropped beam").wrong
    v = check_beam_blocks(every_beam_copies)
    assert not v.ok and "picks [0, 0]: copied is [1, 1]" in v.first_problem
    assert "k - 1 copies" in v.first_problem
    v = check_beam_blocks(frees_whole_tables)
    assert "freed is [0, 2], the library's manager [2]" in v.first_problem
    assert not check_beam_blocks(not_done).attempted


def test_blocks_held_checker():
    assert ch05.blocks_held(4, 18, 1, 4) == 4 + 4                 # 4 shared + 4 partial
    assert ch05.blocks_held(4, 18, 0, 4) == 5

    def mine(n, prompt, gen, bs):
        if gen == 0:
            return cdiv(prompt, bs)
        full = prompt // bs
        return full + n * (cdiv(prompt + gen, bs) - full)

    assert ch05.check_blocks_held(mine).ok
    naive = lambda n, p, g, bs: n * cdiv(p + g, bs)  # noqa: E731
    assert not ch05.check_blocks_held(naive).ok
    assert not ch05.check_blocks_held(not_done).attempted


def test_lru_order_checker():
    assert ch06.lru_order([[0, 1, 2, 3]]) == [3, 2, 1, 0]            # the chapter's request X
    assert ch06.lru_order([[0, 1, 2], [0, 1, 5]]) == [2, 5, 1, 0]    # shared blocks wait
    assert ch06.lru_order([]) == []
    v = ch06.check_lru_order(lambda tables: [b for t in tables for b in reversed(t)])
    assert not v.ok and "[[0, 1, 2], [0, 1, 5]]" in v.first_problem
    assert not ch06.check_lru_order(not_done).attempted


def test_prefix_pool_checker_replays_the_history():
    from course_lib.exercises.solutions.ch06 import PrefixPool

    assert ROOT_HASH == 0                      # 6.2's chain starts from parent 0, as the toy's
    assert ch06.check_prefix_pool(PrefixPool).ok

    class NoEviction(PrefixPool):              # never reuses a cached block's slot
        def _new_block(self):
            if not self.free_stack:
                raise NoFreeBlocksError("full")
            return super()._new_block()

    v = ch06.check_prefix_pool(NoEviction)
    assert not v.ok and "after run(0, " in v.first_problem
    assert "NoFreeBlocksError" in v.first_problem
    assert not ch06.check_prefix_pool(not_done).attempted


class _TakesNoArguments:
    pass


def _raises_in_init(*args):
    raise TypeError("boom")


@pytest.mark.parametrize("checker", [ch03.check_allocator, check_manager,
                                     ch06.check_prefix_pool])
@pytest.mark.parametrize("answer, match", [
    (5, r"pass the class itself \(its name, not called\), got int 5"),
    (None, r"pass the class itself .* got NoneType None"),
    (_TakesNoArguments, r"building it with \(.*\) raises TypeError: _TakesNoArguments\(\) "
                        r"takes no arguments"),
    (_raises_in_init, r"building it with \(.*\) raises TypeError: boom")])
def test_a_class_checker_turns_a_wrong_answer_into_a_verdict(checker, answer, match):
    """A learner's class whose constructor raises, or a non-class, was a traceback from deep
    inside ``replay_ops``; it is a failed verdict naming the problem."""
    v = checker(answer)
    assert v.attempted and v.passed == 0 and not v.ok
    assert re.search(match, v.first_problem), v.first_problem
