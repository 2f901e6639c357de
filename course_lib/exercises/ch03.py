"""Chapter 03 exercises: a block manager (can_allocate's OK/LATER/NEVER and a step that
changes nothing when it does not fit), the slots of one step's new tokens, a free-list
allocator to fix (:class:`ShownAllocator`, the broken one the notebook shows).

Each ``check_*`` runs the learner's code and the library's on the same cases (edge cases
first, then random ones from a fixed seed) and returns a :class:`Verdict` that prints the
first difference: for the classes, the operation, the ones before it and the state after it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from course_lib.exercises import (
    Exercise,
    Exercises,
    Rule,
    Verdict,
    judge_cases,
    replay_ops,
    returns,
    rule_wrongs,
)
from course_lib.exercises.ch03_manager import (
    _ManagerDoesNothing,
    _NoNever,
    _PartialStep,
    _WatermarkOnAppend,
    check_manager,
)
from course_lib.exercises.solutions import ch03 as solutions
from course_lib.memory.v0.block_table import BlockTable
from course_lib.memory.v0.pool import BlockAllocator
from course_lib.sizing.units import cdiv


def step_slot_mapping(tables: dict, num_computed: dict, num_new: dict,
                      block_size: int) -> list[int]:
    """Reference: the flat cache slot of every new token of one step, sequence after sequence
    in the order of ``num_new``; sequence s's new tokens sit at positions ``num_computed[s]``
    .. ``num_computed[s] + num_new[s] - 1`` (a prompt chunk, or one decode token)."""
    slots = []
    for seq, count in num_new.items():
        table = BlockTable(0, block_size, blocks=list(tables[seq]),
                           token_ids=[0] * (len(tables[seq]) * block_size))
        slots += [table.slot(p) for p in range(num_computed[seq], num_computed[seq] + count)]
    return slots


def slot_cases(seed: int = 4, count: int = 30) -> list[tuple]:
    rng = random.Random(seed)
    cases = [({"A": [7, 3, 12]}, {"A": 0}, {"A": 40}, 16),          # request A's whole prompt
             ({"A": [7, 3, 12]}, {"A": 39}, {"A": 1}, 16),          # its next decode token
             ({"A": [7, 3, 12], "B": [1]}, {"A": 15, "B": 0}, {"A": 2, "B": 3}, 16),
             ({"A": [2, 0], "B": [5]}, {"A": 4, "B": 2}, {"B": 1, "A": 0}, 4),   # nothing new
             ({"C": [9]}, {"C": 0}, {"C": 1}, 1), ({}, {}, {}, 16)]
    for _ in range(count):
        bs = 2 ** rng.randrange(0, 5)
        pool = list(range(64))
        rng.shuffle(pool)
        tables, done, new = {}, {}, {}
        for seq in rng.sample("ABCDEFG", rng.randrange(1, 5)):
            total = rng.randrange(1, 6 * bs + 1)
            tables[seq] = [pool.pop() for _ in range(cdiv(total, bs))]
            done[seq] = rng.randrange(0, total)
            new[seq] = rng.choice([1, total - done[seq], rng.randrange(0, total - done[seq] + 1)])
        cases.append((tables, done, new, bs))
    return cases


def _slot_text(case: tuple) -> str:
    tables, done, new, bs = case
    return f"tables {tables}, num_computed {done}, num_new {new}, block_size {bs}"


def _judge_slots(case: tuple, got) -> str | None:
    tables, done, new, bs = case
    want = step_slot_mapping(*case)
    try:
        got = [int(x) for x in got]
    except (TypeError, ValueError):
        return f"{_slot_text(case)}: returned {got!r:.60}, not a list of ints"
    if got == want:
        return None
    if len(got) != len(want):
        return (f"{_slot_text(case)}: returned {len(got)} slots; the step has {len(want)} new "
                "tokens (sum of num_new), in the order of num_new")
    i = next(j for j, (g, w) in enumerate(zip(got, want, strict=True)) if g != w)
    seq, pos = _positions(done, new)[i]
    block = tables[seq][pos // bs]
    return (f"{_slot_text(case)}: the new token of {seq!r} at position {pos} (logical block "
            f"{pos // bs}, offset {pos % bs}, so block {block}) got slot {got[i]}; want "
            f"{block} * {bs} + {pos % bs} = {want[i]}")


def check_step_slot_mapping(fn: Callable) -> Verdict:
    """3.2: compare slot lists; a difference names the sequence, the position and its block."""
    return judge_cases("3.2 step_slot_mapping", fn, slot_cases(), returns(_judge_slots),
                       _slot_text)


def _positions(done: dict, new: dict) -> list[tuple]:
    return [(s, p) for s, c in new.items() for p in range(done[s], done[s] + c)]


class ReferenceAllocator:
    """What the toy allocator must do, on top of the library's ``BlockAllocator``:
    ``allocate()`` pops the top of a LIFO free stack (a fresh pool gives 0, 1, 2, ...) and
    raises when empty; ``free(b)`` pushes b back and raises ``ValueError`` (changing nothing)
    for an id out of range or a block that is already free."""

    def __init__(self, num_blocks: int) -> None:
        self.pool = BlockAllocator("gpu", num_blocks)

    @property
    def num_free(self) -> int:
        return self.pool.num_free_blocks

    def allocate(self) -> int:
        return self.pool.allocate()

    def free(self, block: int) -> None:
        if not 0 <= block < self.pool.num_blocks or self.pool.ref_counts[block] == 0:
            raise ValueError(f"block {block} is not allocated")
        self.pool.ref_counts[block] = 0
        self.pool.free(block)


def _outcome(obj, op: tuple) -> str:
    """What one operation did: the block returned and ``num_free`` after, or that it raised
    (any exception from ``allocate()``: the exercise asks for one, of any type; ``free()``
    must raise ``ValueError`` by name)."""
    try:
        result = obj.allocate() if op[0] == "allocate" else obj.free(op[1])
    except NotImplementedError:
        raise
    except Exception as exc:
        if op[0] == "allocate":
            return "raises (pool empty)"
        return "raises ValueError" if isinstance(exc, ValueError) else \
            f"raises {type(exc).__name__}"
    return f"returns {result!r}, num_free {obj.num_free}"


def allocator_cases(seed: int = 5, count: int = 30) -> list[tuple[int, list[tuple]]]:
    """(num_blocks, ops): ops are ("allocate",) or ("free", block), some of them invalid."""
    rng = random.Random(seed)
    cases = [(0, [("allocate",)]), (1, [("allocate",), ("allocate",), ("free", 0), ("allocate",)]),
             (3, [("free", 1)]), (3, [("allocate",), ("free", 0), ("free", 0)]),
             (2, [("free", -1), ("free", 2), ("allocate",)])]
    for _ in range(count):
        n = rng.randrange(1, 12)
        held: list[int] = []
        ops: list[tuple] = []
        ref = ReferenceAllocator(n)
        for _ in range(rng.randrange(5, 40)):
            if rng.random() < 0.55 or not held:
                ops.append(("allocate",))
                if ref.num_free:
                    held.append(ref.allocate())
            elif rng.random() < 0.9:
                b = held.pop(rng.randrange(len(held)))
                ops.append(("free", b))
                ref.free(b)
            else:
                ops.append(("free", rng.randrange(-1, n + 1)))   # maybe invalid
                if ops[-1][1] in held:
                    held.remove(ops[-1][1])
                    ref.free(ops[-1][1])
        cases.append((n, ops))
    return cases


def _broken_rule(num_blocks: int, ops: list[tuple], i: int, got: str, want: str) -> str:
    """The rule of 3.3's statement that op ``i`` broke, in the statement's words (the ops
    before it agreed with the library's, so the state before it is the library's)."""
    op = ops[i]
    if op[0] == "allocate":
        if want.startswith("raises"):
            return "allocate() raises an exception when the pool is empty"
        if got.startswith("raises"):
            return "allocate() takes a block while the pool has one free"
        if got.split(",")[0] == want.split(",")[0]:
            return "num_free is the number of free blocks"
        if not any(o[0] == "free" for o in ops[:i]):
            return "a fresh pool gives 0, 1, 2, ..."
        return "allocate() takes the top of a LIFO stack: the block freed last comes first"
    block = op[1]
    if want.startswith("raises"):
        what = ("out of range (0 <= block < num_blocks)" if not 0 <= block < num_blocks
                else "already free")
        if got.startswith("raises"):
            return f"free() raises ValueError (by name) if the id is {what}"
        return f"free() raises ValueError and changes nothing if the id is {what}"
    if got.startswith("raises"):
        return "free() of an allocated block pushes it back (it raises only for a bad id)"
    return "num_free is the number of free blocks"


def _allocator_problem(setup: tuple, ops: list[tuple], i: int, got: str, want: str) -> str:
    op = ops[i]
    call = "allocate()" if op[0] == "allocate" else f"free({op[1]})"
    return f"pool of {setup[0]}, after {ops[max(0, i - 4):i]} (op {i}): {call} {got}; " \
        f"the library {want}: the rule broken: {_broken_rule(setup[0], ops, i, got, want)}"


def check_allocator(toy_class: type) -> Verdict:
    """Run the same op sequences on ``toy_class(num_blocks)`` and the reference; compare the
    outcome of every op (returned id and ``num_free``, or that it raised)."""
    return replay_ops("3.3 free-list allocator", allocator_cases(), toy_class,
                      ReferenceAllocator, lambda obj, setup, ops, i: _outcome(obj, ops[i]),
                      _allocator_problem)


class ShownAllocator:
    """3.3's broken allocator, as the notebook shows it: three bugs, each against a rule of
    the statement (the learner returns it fixed)."""

    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self.free_stack = list(range(num_blocks))      # every block starts free
        self.is_free = [True] * num_blocks

    @property
    def num_free(self):
        return len(self.free_stack)

    def allocate(self):
        if not self.free_stack:
            raise RuntimeError("no free block")
        block = self.free_stack.pop()
        self.is_free[block] = False
        return block

    def free(self, block):
        if not 0 <= block <= self.num_blocks or self.is_free[block]:
            raise ValueError(f"block {block} is not allocated")
        self.is_free[block] = True
        self.free_stack.insert(0, block)


class _FifoAllocator(solutions.ToyAllocator):
    """Wrong: hands out the block freed longest ago (a queue), not the last one (a stack)."""

    def allocate(self):
        if not self.free_stack:
            raise RuntimeError("no free block")
        block = self.free_stack.pop(0)
        self.is_free[block] = False
        return block


class _TrustingAllocator(solutions.ToyAllocator):
    """Wrong: frees whatever it is given, twice or out of range."""

    def free(self, block):
        if 0 <= block < self.num_blocks:
            self.is_free[block] = True
        self.free_stack.append(block)


class _DoesNothing:
    def __init__(self, num_blocks):
        self.num_free = num_blocks

    def allocate(self):
        return None

    def free(self, block):
        return None


def _slots_logical(tables, num_computed, num_new, block_size):
    """Wrong: the position itself, as if the table were [0, 1, 2, ...]."""
    return [p for s, c in num_new.items() for p in range(num_computed[s], num_computed[s] + c)]


def _slots_from_zero(tables, num_computed, num_new, block_size):
    """Wrong: numbers the new tokens from position 0, forgetting what is already cached."""
    return [tables[s][p // block_size] * block_size + p % block_size
            for s, c in num_new.items() for p in range(c)]


EXERCISES = Exercises(
    Exercise("3.1", "a block manager: can_allocate and an all-or-nothing step", check_manager,
             hints=(
        "Keep a LIFO free list as ToyBlockManager does, plus tables {seq: [blocks]} and the "
        "token count of each sequence. A sequence of n tokens holds ceil(n / block_size) "
        "blocks, so a step of k new tokens needs ceil((n + k) / block_size) - len(table) more.",
        "can_allocate: compare the blocks needed with num_blocks - watermark_blocks first "
        "(NEVER), then with num_free - watermark_blocks (OK, else LATER).",
        "append_step: add up the extra blocks of every sequence in the step *before* taking any; "
        "if the sum exceeds num_free, return False with nothing touched.",
    ), solution=solutions.ToyManager, rules=(
        Rule("a step that does not fit returns False and changes nothing, not even for the "
             "sequences that would have fitted",
             "(5, 2, 0, [(",
             _PartialStep),
        Rule("NEVER when the prompt needs more than num_blocks - watermark_blocks blocks",
             "(4, 16, 0, [",
             _NoNever),
        Rule("appends ignore the watermark (it is kept for new prompts)",
             "(14, 1, 1, [",
             _WatermarkOnAppend),
    ),
        trivial=(_ManagerDoesNothing,), compare_with=(
        "can_allocate and can_append_slots in course_lib/memory/v0/manager.py")),
    Exercise("3.2", "the slots of one step's new tokens", check_step_slot_mapping, hints=(
        "List the new tokens first: for each sequence in num_new's order, the positions "
        "num_computed[s], ..., num_computed[s] + num_new[s] - 1.",
        "A position p sits in logical block p // block_size, at offset p % block_size; the "
        "table turns the logical block into a physical one.",
        "slot = tables[s][p // block_size] * block_size + p % block_size.",
    ), solution=solutions.step_slot_mapping, rules=(
        Rule("the table turns a logical block into a physical one",
             "tables {'A': [7, 3, 12]}, num_computed {'A': 0},",
             _slots_logical),
        Rule("sequence s's new tokens start at position num_computed[s]",
             "tables {'A': [7, 3, 12]}, num_computed {'A': 39}",
             _slots_from_zero),
        Rule("sequence after sequence in the order of num_new",
             "tables {'B': [60",
             rule_wrongs.slots_sorted_by_id),
    ),
        compare_with=(
        "BlockTable.slot in course_lib/memory/v0/block_table.py")),
    Exercise("3.3", "fix a free-list allocator", check_allocator, hints=(
        "Run the class above by hand on a pool of 3: what do the first three allocate() calls "
        "return? Free two blocks, then allocate: which one should come back first?",
        "Try free() on the ids just outside the pool, -1 and num_blocks: which one does the "
        "check let through, and what happens to it then?",
        "Three things to fix: the order the stack starts in, the end of the stack free() "
        "pushes onto, and the upper bound of the range check.",
    ), solution=solutions.ToyAllocator, wrong=(ShownAllocator,), rules=(
        Rule("allocate takes the top of a LIFO stack",
             "(3, [('allocate',), ('free', 0), ('f",
             _FifoAllocator),
        Rule("free raises ValueError and changes nothing for an id out of range or already free",
             "(3, [('free'",
             _TrustingAllocator),
        Rule("a fresh pool gives 0, 1, 2, ...",
             "(3, [('allocate',), ('free', 0), ('f",
             rule_wrongs.FreshPoolFromTheTop),
        Rule("allocate raises an exception when the pool is empty",
             "(0, [('alloc",
             rule_wrongs.EmptyGivesNone),
    ),
        trivial=(_DoesNothing,), compare_with=(
        "BlockAllocator in course_lib/memory/v0/pool.py: the same stack, plus reference counts")),
)


hint = EXERCISES.print_hint            # ch03.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch03.solution("N.M"): a solution's code
