"""Chapter 03's exercise 3.1: a block manager whose ``can_allocate`` answers OK, LATER or
NEVER and whose step changes nothing when it does not fit, checked like 3.3 by replaying random
operation sequences against :class:`ReferenceManager` (the wrong managers the tests try are
here too). The registry is in :mod:`course_lib.exercises.ch03`.
"""

from __future__ import annotations

import random

from course_lib.exercises import Verdict, op_text, replay_ops
from course_lib.exercises.solutions import ch03 as solutions
from course_lib.memory.v0.pool import BlockAllocator
from course_lib.sizing.units import cdiv


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
    if len(held) != len(set(held)):     # any ids will do (the statement), but never shared
        return f"returns {result!r}; the tables {tables} share a block"
    lengths = {s: len(t) for s, t in tables.items()}
    return f"returns {result!r}, num_free {obj.num_free}, blocks per sequence {lengths}"


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


class _PartialStep(solutions.ToyManager):
    """Wrong: grows the sequences one by one and stops at the first that does not fit."""

    def append_step(self, new_tokens):
        for seq, k in new_tokens.items():
            extra = cdiv(self.lens[seq] + k, self.block_size) - len(self.tables[seq])
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
        extra = sum(cdiv(self.lens[s] + k, self.block_size) - len(self.tables[s])
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
