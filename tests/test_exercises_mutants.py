"""Mutation test of the exercise checkers: wrong answers kept here as data, each of which its
checker must refuse with the rule it breaks named in the verdict, and right answers written
another way than the course's solution, each of which it must accept.

The wrong answers are the plausible ones a learner writes (one rule dropped each, as the
attack on the exercises of issue 35 found them); the words each verdict must contain are the
chapter's words for that rule. A later change to a checker that lets one through, or that
stops saying why, fails here by name. The answers live in this file, not in
``course_lib/exercises``, so that changing a checker and its own wrong answers together
cannot hide it. Every case is small: the whole file takes a few seconds (the Triton ones run
only where Triton does).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import pytest
import torch
from interpreter_only import INTERPRETER_ONLY

import course_lib.exercises as ex_pkg
from course_lib.exercises import ch02, ch03, ch05, ch08, ch09, ch10, ch11, ch12
from course_lib.exercises.solutions import ch03 as sol03
from course_lib.exercises.solutions import ch05 as sol05
from course_lib.exercises.solutions import ch09 as sol09
from course_lib.exercises.solutions import ch10 as sol10
from course_lib.exercises.solutions import ch11 as sol11
from course_lib.exercises.solutions import ch12 as sol12

torch.set_num_threads(1)


@dataclass(frozen=True)
class Mutant:
    """A wrong answer to exercise ``number`` that must be refused with ``words`` (the rule it
    breaks, in the chapter's words) in the verdict's first problem."""
    number: str
    name: str
    answer: Any
    words: str


def checker(number: str) -> Callable[[Any], Any]:
    module = {"2": ch02, "3": ch03, "5": ch05, "8": ch08, "9": ch09, "10": ch10, "11": ch11,
              "12": ch12}[number.split(".")[0]]
    return module.EXERCISES[number].checker


@pytest.fixture(autouse=True)
def fresh_tries(monkeypatch):
    """Each test sees a predict-then-run exercise as tried for the first time."""
    monkeypatch.setattr(ex_pkg, "_TRIED", {})


# ------------------------------------------------------------------ 2.2 failing events
def events(*evs):
    return lambda num_slots: list(evs)


# ------------------------------------------------------------------ 3.3 the allocator
class FifoFree(sol03.ToyAllocator):
    def free(self, block):
        if not 0 <= block < self.num_blocks or self.is_free[block]:
            raise ValueError(block)
        self.is_free[block] = True
        self.free_stack.insert(0, block)         # the freed block goes to the bottom


class UpperBoundInclusive(sol03.ToyAllocator):
    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.is_free.append(False)               # so that free(num_blocks) goes through

    def free(self, block):
        if not 0 <= block <= self.num_blocks or self.is_free[block]:
            raise ValueError(block)
        self.is_free[block] = True
        self.free_stack.append(block)


class NoLowerBound(sol03.ToyAllocator):
    def free(self, block):
        if block >= self.num_blocks or self.is_free[block]:
            raise ValueError(block)
        self.is_free[block] = True
        self.free_stack.append(block)


class DoubleFreeAllowed(sol03.ToyAllocator):
    def free(self, block):
        if not 0 <= block < self.num_blocks:
            raise ValueError(block)
        self.is_free[block] = True
        self.free_stack.append(block)


class EmptyReturnsMinusOne(sol03.ToyAllocator):
    def allocate(self):
        return super().allocate() if self.free_stack else -1


class NumFreeCountsHeld(sol03.ToyAllocator):
    @property
    def num_free(self):
        return self.num_blocks - len(self.free_stack)


class FreeRaisesKeyError(sol03.ToyAllocator):
    def free(self, block):
        if not 0 <= block < self.num_blocks or self.is_free[block]:
            raise KeyError(block)
        super().free(block)


# ------------------------------------------------------------------ 8.2 heads per rank
def kv_zero_only(h, tp):                      # the two fixes that return -4 for (8, -2)
    if tp == 0:
        raise ValueError("tp = 0")
    if tp > h:
        if tp % h:
            raise ValueError("no")
        return 1
    if h % tp:
        raise ValueError("no")
    return h // tp


def kv_no_divide_check(h, tp):
    if tp < 1:
        raise ValueError("tp < 1")
    return max(1, h // tp)


def kv_split_always(h, tp):
    if tp < 1 or (h % tp if tp <= h else tp % h):
        raise ValueError("no")
    return h // tp


def kv_refuses_replication(h, tp):
    if tp < 1 or h % tp:
        raise ValueError("no")
    return h // tp


# ------------------------------------------------------------------ 9.2 CP decode
def cp_no_max(q, k, v, owner, cp_size):
    outs, lses = _partials(q, k, v, owner, cp_size)
    w = [torch.exp(lse) for lse in lses]
    den = sum(w)
    return sum(wi[:, None] * o for wi, o in zip(w, outs, strict=True)) / den[:, None], \
        torch.log(den)


def cp_lse_is_max(q, k, v, owner, cp_size):
    out, lse = sol09.cp_decode(q, k, v, owner, cp_size)
    _, lses = _partials(q, k, v, owner, cp_size)
    return out, torch.stack(lses).max(dim=0).values


def cp_average(q, k, v, owner, cp_size):
    outs, lses = _partials(q, k, v, owner, cp_size)
    full = [o for o, lse in zip(outs, lses, strict=True) if bool(torch.isfinite(lse).all())]
    return sum(full) / len(full), sol09.cp_decode(q, k, v, owner, cp_size)[1]


def cp_dense(q, k, v, owner, cp_size):
    from course_lib.parallel.merge import partial_attention

    return partial_attention(q, k, v)


def _partials(q, k, v, owner, cp_size):
    from course_lib.parallel.merge import partial_attention

    outs, lses = [], []
    for r in range(cp_size):
        mine = [i for i, o in enumerate(owner) if o == r]
        out, lse = partial_attention(q, k[mine], v[mine])
        outs.append(out)
        lses.append(lse)
    return outs, lses


# ------------------------------------------------------------------ 11.1 append
def append_release_before_copy_check(bm, seq_id, token_ids):   # never copies: no CoW at all
    table = bm.get_table(seq_id)
    while len(table.blocks) * bm.block_size < len(table.token_ids) + len(token_ids):
        table.blocks.append(bm.gpu.allocate())
    table.token_ids.extend(token_ids)
    return []


def append_releases_twice(bm, seq_id, token_ids):
    table = bm.get_table(seq_id)
    blocks, n, bs = table.blocks, len(table.token_ids), bm.block_size
    copies = []
    if n % bs and bm.gpu.ref_counts[blocks[-1]] > 1:
        src, blocks[-1] = blocks[-1], bm.gpu.allocate()
        bm.gpu.release([src])
        if bm.gpu.ref_counts[src] > 1:
            bm.gpu.release([src])                # one reference too many
        copies.append((src, blocks[-1]))
    while len(blocks) * bs < n + len(token_ids):
        blocks.append(bm.gpu.allocate())
    table.token_ids.extend(token_ids)
    return copies


def append_copies_private_blocks(bm, seq_id, token_ids):   # copies every partial last block
    table = bm.get_table(seq_id)
    blocks, n, bs = table.blocks, len(table.token_ids), bm.block_size
    copies = []
    if n % bs:
        src, blocks[-1] = blocks[-1], bm.gpu.allocate()
        bm.gpu.release([src])
        copies.append((src, blocks[-1]))
    while len(blocks) * bs < n + len(token_ids):
        blocks.append(bm.gpu.allocate())
    table.token_ids.extend(token_ids)
    return copies


def _predictions(solution: Callable[[], dict], **changed) -> Callable[[], dict]:
    return lambda: {**solution(), **changed}


MUTANTS = [
    Mutant("2.2", "frees that merge", events(("alloc", 1), ("alloc", 1), ("free", 1),
                                             ("free", 0), ("alloc", 2)),
           "the broken allocator keeps the rule all through"),
    Mutant("2.2", "a free names a slot", events(("alloc", 1), ("alloc", 1), ("free", 0),
                                                ("free", 2), ("alloc", 2)),
           "is not an earlier alloc"),
    Mutant("2.2", "a double free", events(("alloc", 1), ("free", 0), ("free", 0)),
           "was freed already"),
    Mutant("2.2", "an empty alloc", events(("alloc", 0), ("alloc", 1)),
           "with size >= 1"),
    Mutant("2.2", "sized for a large pool", events(("alloc", 3), ("alloc", 3), ("free", 0),
                                                   ("free", 1), ("alloc", 6)),
           "got no slots, so nothing is freed"),
    Mutant("3.3", "free pushes to the bottom", FifoFree,
           "allocate() takes the top of a LIFO stack"),
    Mutant("3.3", "free accepts num_blocks", UpperBoundInclusive,
           "free() raises ValueError and changes nothing if the id is out of range"),
    Mutant("3.3", "free accepts -1", NoLowerBound,
           "if the id is out of range (0 <= block < num_blocks)"),
    Mutant("3.3", "a double free", DoubleFreeAllowed,
           "changes nothing if the id is already free"),
    Mutant("3.3", "an empty pool gives -1", EmptyReturnsMinusOne,
           "allocate() raises an exception when the pool is empty"),
    Mutant("3.3", "num_free counts the held blocks", NumFreeCountsHeld,
           "num_free is the number of free blocks"),
    Mutant("3.3", "free raises KeyError", FreeRaisesKeyError,
           "free() raises ValueError (by name)"),
    Mutant("5.3", "c: every child copies", _predictions(sol05.cow_predictions, c=3),
           "wrong: c ("),
    Mutant("5.3", "a bool for 0", _predictions(sol05.cow_predictions, e=True),
           "wrong: e ("),
    Mutant("8.2", "only tp = 0 refused", kv_zero_only,
           "(8, -2): returned -4, should raise ValueError: TP must be at least 1"),
    Mutant("8.2", "no divisibility check", kv_no_divide_check,
           "TP and the head count must divide one another"),
    Mutant("8.2", "heads // tp past the head count", kv_split_always,
           "each rank holds one (replicated) head"),
    Mutant("8.2", "more ranks than heads refused", kv_refuses_replication,
           "should return 1: with more ranks than heads each rank holds one"),
    Mutant("9.2", "no max before exp", cp_no_max, "subtract the MAX of the ranks' LSEs"),
    Mutant("9.2", "lse is the max", cp_lse_is_max, "the union's lse: max + log(SUM"),
    Mutant("9.2", "the ranks' outputs averaged", cp_average,
           "weigh each rank's output by exp(lse_r - max)"),
    Mutant("9.2", "attention over every token", cp_dense,
           "each rank attends over its own tokens only"),
    Mutant("10.3", "distinct over entries", _predictions(sol10.sharing_predictions, a=0.25),
           "wrong: a ("),
    Mutant("10.3", "4 digits of 1/3", _predictions(sol10.sharing_predictions, c=0.3333),
           "wrong: c ("),
    Mutant("11.1", "no copy-on-write", append_release_before_copy_check,
           "the rule broken: a partial shared last block is replaced by a fresh one"),
    Mutant("11.1", "two references dropped", append_releases_twice,
           "the rule broken: drop one reference to the old block"),
    Mutant("11.1", "a private block copied", append_copies_private_blocks,
           "the rule broken: only a shared last block is copied"),
    Mutant("12.1", "c: freed head first", _predictions(sol12.free_queue_predictions, c=0),
           "wrong: c ("),
    Mutant("12.1", "d: cached blocks to the front", _predictions(
        sol12.free_queue_predictions, d=2), "wrong: d ("),
]


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: f"{m.number} {m.name}")
def test_a_wrong_answer_is_refused_with_its_rule_named(mutant: Mutant):
    verdict = checker(mutant.number)(mutant.answer)
    assert verdict.attempted and not verdict.ok, str(verdict)
    assert mutant.words in (verdict.first_problem or ""), verdict.first_problem


def test_every_exercise_the_attack_changed_has_mutants_here():
    """2.2, 3.3, 5.3, 8.2, 9.2, 10.3, 11.1 and 12.1 here; 4.1 and 4.3 (Triton) below."""
    assert {m.number for m in MUTANTS} >= {"2.2", "3.3", "5.3", "8.2", "9.2", "10.3", "11.1",
                                           "12.1"}
    for number in {m.number for m in MUTANTS}:
        assert sum(m.number == number for m in MUTANTS) >= 2, number


# ------------------------------------------------------------------ right answers, another way
def kv_by_gcd(h, tp):
    import math

    if not isinstance(tp, int) or tp < 1 or math.gcd(h, tp) != min(h, tp):
        raise ValueError(f"{tp} ranks cannot split {h} heads")
    return h // math.gcd(h, tp)


class PopFromEmptyList(sol03.ToyAllocator):
    def allocate(self):                       # IndexError from pop(): any exception is one
        block = self.free_stack.pop()
        self.is_free[block] = False
        return block


def append_release_first(bm, seq_id, token_ids):
    table = bm.get_table(seq_id)
    n, bs = len(table.token_ids), bm.block_size
    copies = []
    if n % bs and bm.gpu.ref_counts[table.blocks[-1]] > 1:
        src = table.blocks[-1]
        bm.gpu.release([src])                # another table still holds it: it stays
        table.blocks[-1] = bm.gpu.allocate()
        copies.append((src, table.blocks[-1]))
    need = -(-(n + len(token_ids)) // bs) - len(table.blocks)
    table.blocks.extend(bm.gpu.allocate() for _ in range(need))
    table.token_ids += token_ids
    return copies


ACCEPTED = [
    ("10.3", "exact fractions", lambda: {"a": Fraction(3, 4), "b": Fraction(3, 8),
                                         "c": Fraction(1, 3), "d": Fraction(1, 2)}),
    ("10.3", "floats of fractions", lambda: {"a": 1 - 2 / 8, "b": 1 - 5 / 8, "c": 1 - 4 / 6,
                                             "d": 1 - 2 / 4}),
    ("5.3", "numpy integers", lambda: {k: __import__("numpy").int64(v)
                                       for k, v in sol05.cow_predictions().items()}),
    ("5.3", "floats", lambda: {k: float(v) for k, v in sol05.cow_predictions().items()}),
    ("8.2", "by gcd", kv_by_gcd),
    ("3.3", "IndexError when empty", PopFromEmptyList),
    ("2.2", "a larger pattern", events(("alloc", 1), ("alloc", 1), ("alloc", 1), ("free", 0),
                                       ("free", 1), ("alloc", 2))),
    ("11.1", "release before allocate", append_release_first),
]



@pytest.mark.parametrize("number, name, answer", ACCEPTED, ids=[f"{a[0]} {a[1]}"
                                                                 for a in ACCEPTED])
def test_a_right_answer_written_another_way_is_accepted(number, name, answer):
    verdict = checker(number)(answer)
    assert verdict.ok, str(verdict)


def test_the_numbers_are_told_only_after_several_different_wrong_answers():
    """Predict-then-run: right or wrong per scenario, the library's numbers only after
    ``REVEAL_AFTER`` different wrong answers (a rerun of the same one does not count)."""
    check = checker("10.3")
    seen = []
    for guess in (0.5, 0.5, 0.4, 0.3):
        v = check(_predictions(sol10.sharing_predictions, c=guess))
        assert v.first_problem.startswith("right: a, b, d; wrong: c ("), v.first_problem
        seen.append("the library gives 1/3 = 0.333333333333" in v.first_problem)
    assert seen == [False, False, False, True]


# ------------------------------------------------------------------ a slow or loaded machine
def test_a_case_waiting_for_the_machine_is_not_refused(monkeypatch):
    """The limit counts the learner's own CPU time: a right answer that spends longer than
    the limit in wall-clock time (here sleeping, as on a machine busy with other work) passes;
    one that computes past it is stopped, and told what the limit was measured against."""
    monkeypatch.setattr(ex_pkg, "CASE_SECONDS", 0.1)

    def slow_but_right(h, tp):
        time.sleep(0.15)
        return sol_kv(h, tp)

    sol_kv = ch08.EXERCISES["8.2"].solution
    cases = [(8, 2), (8, 16)]
    got = ex_pkg.check("8.2 slow", slow_but_right, sol_kv, cases)
    assert got.ok, str(got)

    def spins(h, tp):
        while True:
            pass

    stopped = ex_pkg.check("8.2 spins", spins, sol_kv, cases)
    assert "still running after 0.1 s of its own CPU time (the limit: a fixed limit per " \
           "case" in stopped.first_problem

    def waits_forever(h, tp):
        while True:
            time.sleep(0.05)

    monkeypatch.setattr(ex_pkg, "WALL_FACTOR", 3.0)
    waited = ex_pkg.check("8.2 waits", waits_forever, sol_kv, cases)
    assert "still waiting after 0.3 s of wall-clock time" in waited.first_problem


def test_the_learner_runs_on_the_harness_threads():
    """torch's thread pool is set for the learner's case (spinning threads on a loaded machine
    cost CPU time the learner did not write) and given back after."""
    before = torch.get_num_threads()
    seen = []

    def records(h, tp):
        seen.append(torch.get_num_threads())
        return ch08.EXERCISES["8.2"].solution(h, tp)

    torch.set_num_threads(2)
    try:
        assert ex_pkg.check("8.2 threads", records, records, [(8, 2)]).ok
        assert seen[-1] == ex_pkg.CHECK_THREADS and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_an_engine_workload_is_timed_against_the_librarys_own_run(monkeypatch):
    """11.1's limit per workload is scaled from the library's run of it on this machine
    (measured before the learner's clock starts); a timeout says so."""
    from course_lib.exercises import capstone_checks

    monkeypatch.setattr(capstone_checks, "CASE_SECONDS", 0.0)
    monkeypatch.setattr(capstone_checks, "BUDGET_FACTOR", 0.5)   # half the library's time

    def slow(bm, seq_id, token_ids):
        t = time.thread_time()
        while time.thread_time() - t < 0.01:
            pass
        return sol11.append_slots(bm, seq_id, token_ids)

    problem = ch11.check_append_slots(slow).first_problem
    assert problem.startswith("workload 0 (1 prompt(s)"), problem
    assert "of CPU time the library's own parts took on this workload on this machine" in problem


# ------------------------------------------------------------------ 4.1 and 4.3, in Triton
def _triton_runs() -> bool:
    from course_lib.device import BACKEND
    from course_lib.kernels import interpreter_incompatibility

    return BACKEND.uses_triton and interpreter_incompatibility() is None


if _triton_runs():
    import triton
    import triton.language as tl

    @triton.jit
    def _gather(k_cache, v_cache, table, k_out, v_out, BLOCK_SIZE: tl.constexpr,
                ROW: tl.constexpr, ROW_PAD: tl.constexpr, MASK_LOAD: tl.constexpr,
                MASK_STORE: tl.constexpr):
        pos = tl.program_id(0)
        page = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
        start = (page * BLOCK_SIZE + pos % BLOCK_SIZE) * ROW
        cols = tl.arange(0, ROW_PAD)
        load_mask = cols < ROW if MASK_LOAD else cols < ROW_PAD
        store_mask = cols < ROW if MASK_STORE else cols < ROW_PAD
        tl.store(k_out + pos * ROW + cols, tl.load(k_cache + start + cols, mask=load_mask,
                                                   other=0.0), mask=store_mask)
        tl.store(v_out + pos * ROW + cols, tl.load(v_cache + start + cols, mask=load_mask,
                                                   other=0.0), mask=store_mask)

    @triton.jit
    def _merge(out_a, lse_a, out_b, lse_b, out, lse_out, HEAD_DIM: tl.constexpr):
        h = tl.program_id(0)
        a = tl.load(lse_a + h)
        b = tl.load(lse_b + h)
        lse = tl.log(tl.exp(a) + tl.exp(b))            # no max: exp(300) is inf
        d = tl.arange(0, HEAD_DIM)
        tl.store(out + h * HEAD_DIM + d, tl.exp(a - lse) * tl.load(out_a + h * HEAD_DIM + d)
                 + tl.exp(b - lse) * tl.load(out_b + h * HEAD_DIM + d))
        tl.store(lse_out + h, lse)


def gather_masking(load: bool, store: bool) -> Callable:
    def gather_kv(key_cache, value_cache, block_table, seq_len):
        _, bs, heads, head_dim = key_cache.shape
        k = torch.empty(seq_len, heads, head_dim, device=key_cache.device)
        v = torch.empty_like(k)
        row = heads * head_dim
        _gather[(seq_len,)](key_cache, value_cache, block_table, k, v, BLOCK_SIZE=bs, ROW=row,
                            ROW_PAD=triton.next_power_of_2(row), MASK_LOAD=load,
                            MASK_STORE=store)
        return k, v
    return gather_kv


def merge_without_max(out_a, lse_a, out_b, lse_b):
    out, lse = torch.empty_like(out_a), torch.empty_like(lse_a)
    _merge[(out_a.shape[0],)](out_a, lse_a, out_b, lse_b, out, lse, HEAD_DIM=out_a.shape[1])
    return out, lse


TRITON_MUTANTS = [
    ("4.1", "loads not masked", lambda: gather_masking(load=False, store=True),
     "(its last slot the cache's last): raised OutOfBounds: a lane of your kernel loaded "
     "element 144 of k_cache, past its end"),
    ("4.1", "stores not masked", lambda: gather_masking(load=True, store=False),
     "raised OutOfBounds: a lane of your kernel stored element 276 of k_out, past its end"),
    ("4.3", "no max before exp", lambda: merge_without_max,
     "exp(lse) overflows float32 past 88.7"),
]


@pytest.mark.skipif(not _triton_runs(), reason="the learner writes a Triton kernel")
@pytest.mark.parametrize("number, name, make, words", TRITON_MUTANTS,
                         ids=[f"{m[0]} {m[1]}" for m in TRITON_MUTANTS])
@INTERPRETER_ONLY
def test_a_wrong_kernel_is_refused_with_its_rule_named(number, name, make, words):
    """An out-of-bounds load or store is a verdict (never a dead notebook kernel), naming the
    argument and the element."""
    from course_lib.exercises import ch04

    verdict = ch04.EXERCISES[number].checker(make())
    assert verdict.attempted and not verdict.ok, str(verdict)
    assert words in (verdict.first_problem or ""), verdict.first_problem
