"""Chapter 03 exercises: a block manager (can_allocate's OK/LATER/NEVER and a step that
changes nothing when it does not fit), the slots of one step's new tokens, a free-list
allocator.

Each ``check_*`` runs the learner's code and the library's on the same cases (edge cases
first, then random ones from a fixed seed) and returns a :class:`Verdict` that prints the
first difference: for the classes, the operation, the ones before it and the state after it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from course_lib.exercises import Exercise, Exercises, Verdict, op_text, replay_ops
from course_lib.exercises.solutions import ch03 as solutions
from course_lib.memory import BlockAllocator, BlockTable, cdiv


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
            tables[seq] = [pool.pop() for _ in range(-(-total // bs))]
            done[seq] = rng.randrange(0, total)
            new[seq] = rng.choice([1, total - done[seq], rng.randrange(0, total - done[seq] + 1)])
        cases.append((tables, done, new, bs))
    return cases


def check_step_slot_mapping(fn: Callable) -> Verdict:
    """3.2: compare slot lists; a difference names the sequence, the position and its block."""
    cases = slot_cases()
    passed, problem = 0, None
    for tables, done, new, bs in cases:
        want = step_slot_mapping(tables, done, new, bs)
        try:
            got = fn(tables, done, new, bs)
        except NotImplementedError:
            return Verdict("3.2 step_slot_mapping", 0, len(cases), attempted=False)
        except Exception as exc:   # a learner's bug is a verdict
            got, why = None, f"raised {type(exc).__name__}: {exc}"
        else:
            why = None
        try:
            got = [int(x) for x in got]
        except (TypeError, ValueError):
            why = why or f"returned {got!r:.60}, not a list of ints"
        if why is None and got == want:
            passed += 1
            continue
        if problem is None:
            where = f"tables {tables}, num_computed {done}, num_new {new}, block_size {bs}"
            if why is None and len(got) != len(want):
                why = (f"returned {len(got)} slots; the step has {len(want)} new tokens "
                       f"(sum of num_new), in the order of num_new")
            elif why is None:
                i = next(j for j, (g, w) in enumerate(zip(got, want, strict=True)) if g != w)
                seq, pos = _positions(done, new)[i]
                block = tables[seq][pos // bs]
                why = (f"the new token of {seq!r} at position {pos} (logical block {pos // bs}, "
                       f"offset {pos % bs}, so block {block}) got slot {got[i]}; want "
                       f"{block} * {bs} + {pos % bs} = {want[i]}")
            problem = f"{where}: {why}"
    return Verdict("3.2 step_slot_mapping", passed, len(cases), problem)


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


def _allocator_problem(setup: tuple, ops: list[tuple], i: int, got: str, want: str) -> str:
    op = ops[i]
    call = "allocate()" if op[0] == "allocate" else f"free({op[1]})"
    return f"pool of {setup[0]}, after {ops[max(0, i - 4):i]} (op {i}): {call} {got}; " \
        f"the library {want}"


def check_allocator(toy_class: type) -> Verdict:
    """Run the same op sequences on ``toy_class(num_blocks)`` and the reference; compare the
    outcome of every op (returned id and ``num_free``, or that it raised)."""
    return replay_ops("3.3 free-list allocator", allocator_cases(), toy_class,
                      ReferenceAllocator, lambda obj, setup, ops, i: _outcome(obj, ops[i]),
                      _allocator_problem)


class ReferenceManager:
    """What 3.1's manager must do: ``can_allocate`` answers "OK" (free - needed >= watermark),
    "NEVER" (needed > num_blocks - watermark: it cannot fit even in an empty pool) or "LATER";
    ``append_step({seq: new_tokens})`` grows every listed sequence, or, when the step needs
    more blocks than are free (appends ignore the watermark), returns False and changes
    nothing; ``free(seq)`` returns its blocks."""

    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int) -> None:
        self.pool = BlockAllocator("gpu", num_blocks)
        self.num_blocks, self.block_size, self.watermark = num_blocks, block_size, watermark_blocks
        self.tables: dict = {}
        self.lens: dict = {}

    @property
    def num_free(self) -> int:
        return self.pool.num_free_blocks

    def can_allocate(self, num_tokens: int) -> str:
        needed = cdiv(num_tokens, self.block_size)
        if needed > self.num_blocks - self.watermark:
            return "NEVER"
        return "OK" if self.num_free - needed >= self.watermark else "LATER"

    def allocate(self, seq_id, num_tokens: int) -> None:
        self.tables[seq_id] = self.pool.allocate_n(cdiv(num_tokens, self.block_size))
        self.lens[seq_id] = num_tokens

    def append_step(self, new_tokens: dict) -> bool:
        extra = {s: cdiv(self.lens[s] + k, self.block_size) - len(self.tables[s])
                 for s, k in new_tokens.items()}
        if sum(extra.values()) > self.num_free:
            return False
        for s, k in new_tokens.items():
            self.tables[s] += self.pool.allocate_n(extra[s])
            self.lens[s] += k
        return True

    def free(self, seq_id) -> None:
        self.pool.release(reversed(self.tables.pop(seq_id)))
        del self.lens[seq_id]


def manager_cases(seed: int = 6, count: int = 30) -> list[tuple[tuple, list[tuple]]]:
    """((num_blocks, block_size, watermark_blocks), ops); ops: ("can_allocate", n),
    ("allocate", seq, n) (only where the library said OK), ("append_step", {seq: k}),
    ("free", seq)."""
    rng = random.Random(seed)
    cases = [((4, 16, 0), [("can_allocate", 65), ("can_allocate", 64), ("allocate", "A", 16),
                           ("allocate", "B", 32), ("append_step", {"A": 40}),
                           ("append_step", {"A": 1}), ("free", "B"), ("can_allocate", 1)]),
             ((6, 4, 1), [("can_allocate", 21), ("can_allocate", 20), ("allocate", "A", 16),
                          ("can_allocate", 4), ("append_step", {"A": 4}),
                          ("can_allocate", 1)]),
             ((5, 2, 0), [("allocate", "A", 3), ("allocate", "B", 3),
                          ("append_step", {"A": 1, "B": 1}), ("append_step", {"A": 2, "B": 2}),
                          ("append_step", {"A": 0}), ("append_step", {})]),
             ((2, 4, 0), [("can_allocate", 0), ("allocate", "A", 0), ("append_step", {"A": 1}),
                          ("free", "A")])]
    for _ in range(count):
        geo = (rng.randrange(2, 16), 2 ** rng.randrange(0, 4), rng.randrange(0, 3))
        ref, ops, next_id = ReferenceManager(*geo), [], 0
        for _ in range(rng.randrange(5, 30)):
            r = rng.random()
            if r < 0.35 or not ref.tables:
                n = rng.randrange(1, geo[0] * geo[1] + geo[1])
                ops.append(("can_allocate", n))
                if ref.can_allocate(n) == "OK":
                    ops.append(("allocate", f"s{next_id}", n))
                    ref.allocate(f"s{next_id}", n)
                    next_id += 1
            elif r < 0.85:
                seqs = rng.sample(sorted(ref.tables), rng.randrange(1, len(ref.tables) + 1))
                ops.append(("append_step", {s: rng.choice([1, 1, geo[1], rng.randrange(0, 9)])
                                            for s in seqs}))
                ref.append_step(ops[-1][1])
            else:
                ops.append(("free", rng.choice(sorted(ref.tables))))
                ref.free(ops[-1][1])
        cases.append((geo, ops))
    return cases


def _manager_outcome(obj, op: tuple) -> str:
    """What one operation did, as the learner would say it."""
    result = getattr(obj, op[0])(*op[1:])
    result = getattr(result, "name", result)          # an AllocStatus enum reads as its name
    tables = obj.tables
    held = [b for t in tables.values() for b in t]
    if len(held) != len(set(held)) or any(not 0 <= b < obj_size(obj) for b in held):
        return f"returns {result!r}; the tables {tables} share a block or hold a bad id"
    lengths = {s: len(t) for s, t in tables.items()}
    return f"returns {result!r}, num_free {obj.num_free}, blocks per sequence {lengths}"


def obj_size(obj) -> int:
    return getattr(obj, "num_blocks", None) or len(obj.pool.ref_counts)


def _manager_problem(geo: tuple, ops: list[tuple], i: int, got: str, want: str) -> str:
    history = ", ".join(map(op_text, ops[max(0, i - 4):i])) or "nothing"
    return (f"pool of {geo[0]} blocks of {geo[1]} tokens, watermark {geo[2]}, after {history} "
            f"(op {i}): {op_text(ops[i])} {got}; the library "
            f"{want}{_manager_concept(ops[i], got, want)}")


def check_manager(manager_class: type) -> Verdict:
    """Run the op sequences on ``manager_class(num_blocks, block_size, watermark_blocks)`` and
    the reference; compare what every op returns, ``num_free`` and each table's length."""
    return replay_ops("3.1 block manager", [(*geo, ops) for geo, ops in manager_cases()],
                      manager_class, ReferenceManager,
                      lambda obj, geo, ops, i: _manager_outcome(obj, ops[i]), _manager_problem)


def _manager_concept(op: tuple, got: str, want: str) -> str:
    if op[0] == "can_allocate" and "'NEVER'" in want:
        return " (NEVER: more blocks than the pool minus the watermark, even when empty)"
    if op[0] == "can_allocate" and "'LATER'" in want:
        return " (LATER: it fits the pool, but not the free blocks above the watermark now)"
    if op[0] == "append_step" and "returns False" in want:
        return " (a step that does not fit must change nothing: check every sequence first)"
    return ""


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


class _PartialStep(solutions.ToyManager):
    """Wrong: grows the sequences one by one and stops at the first that does not fit."""

    def append_step(self, new_tokens):
        for seq, k in new_tokens.items():
            extra = -(-(self.lens[seq] + k) // self.block_size) - len(self.tables[seq])
            if extra > len(self.free_blocks):
                return False
            self.tables[seq] += [self.free_blocks.pop() for _ in range(extra)]
            self.lens[seq] += k
        return True


class _NoNever(solutions.ToyManager):
    """Wrong: LATER for anything that does not fit now, even what never can."""

    def can_allocate(self, num_tokens):
        answer = super().can_allocate(num_tokens)
        return "LATER" if answer == "NEVER" else answer


class _WatermarkOnAppend(solutions.ToyManager):
    """Wrong: keeps the watermark free on appends too (it is for admitting new prompts)."""

    def append_step(self, new_tokens):
        extra = sum(-(-(self.lens[s] + k) // self.block_size) - len(self.tables[s])
                    for s, k in new_tokens.items())
        if extra > len(self.free_blocks) - self.watermark:
            return False
        return super().append_step(new_tokens)


class _ManagerDoesNothing:
    def __init__(self, num_blocks, block_size, watermark_blocks):
        self.num_free, self.num_blocks, self.tables = num_blocks, num_blocks, {}

    def can_allocate(self, num_tokens):
        return "OK"

    def allocate(self, seq_id, num_tokens):
        self.tables[seq_id] = []

    def append_step(self, new_tokens):
        return True

    def free(self, seq_id):
        self.tables.pop(seq_id)


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
        "append_step: add up the extra blocks of every sequence in the step *before* taking "
        "any; if the sum exceeds num_free, return False with nothing touched. Then read "
        "can_allocate and can_append_slots in course_lib/memory/manager.py.",
    ), solution=solutions.ToyManager, wrong=(_PartialStep, _NoNever, _WatermarkOnAppend),
        trivial=(_ManagerDoesNothing,)),
    Exercise("3.2", "the slots of one step's new tokens", check_step_slot_mapping, hints=(
        "List the new tokens first: for each sequence in num_new's order, the positions "
        "num_computed[s], ..., num_computed[s] + num_new[s] - 1.",
        "A position p sits in logical block p // block_size, at offset p % block_size; the "
        "table turns the logical block into a physical one.",
        "slot = tables[s][p // block_size] * block_size + p % block_size. Then read "
        "BlockTable.slot in course_lib/memory/block_table.py.",
    ), solution=solutions.step_slot_mapping, wrong=(_slots_logical, _slots_from_zero)),
    Exercise("3.3", "free-list allocator", check_allocator, hints=(
        "Keep the free blocks in a Python list used as a stack: append() pushes, pop() takes "
        "the top. Which order must the list start in for a fresh pool to give 0, 1, 2, ...?",
        "free() must change nothing when it refuses: check the id's range and whether the "
        "block is already free *before* touching the stack (a list of booleans answers the "
        "second question in O(1)).",
        "Start from list(range(num_blocks - 1, -1, -1)). Then read BlockAllocator in "
        "course_lib/memory/pool.py: the same stack, plus reference counts.",
    ), solution=solutions.ToyAllocator, wrong=(_FifoAllocator, _TrustingAllocator),
        trivial=(_DoesNothing,)),
)


hint = EXERCISES.print_hint            # ch03.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch03.solution("N.M"): a solution's code
