"""Chapter 03 exercises: blocks per sequence, slot mapping, a free-list allocator.

Each ``check_*`` runs the learner's code and the library's on the same cases (edge cases
first, then random ones from a fixed seed) and returns a :class:`Verdict` that prints the
first difference.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from course_lib.exercises import Verdict, check
from course_lib.memory import BlockAllocator, BlockTable, NoFreeBlocksError, cdiv


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Reference: blocks that hold ``num_tokens`` tokens (0 tokens need 0 blocks)."""
    return cdiv(num_tokens, block_size)


def slot_mapping(block_table: list[int], positions: list[int], block_size: int) -> list[int]:
    """Reference: flat KV-cache slot of each position, through ``BlockTable.slot``."""
    table = BlockTable(0, block_size, blocks=list(block_table),
                       token_ids=[0] * (len(block_table) * block_size))
    return [table.slot(p) for p in positions]


def check_blocks_needed(fn: Callable[[int, int], int]) -> Verdict:
    rng = random.Random(3)
    cases = [(0, 16), (1, 16), (15, 16), (16, 16), (17, 16), (50, 16), (4096, 16), (1, 1),
             (7, 1), (255, 256), (257, 256), (2**60 + 1, 16)]
    cases += [(rng.randrange(0, 10_000), 2 ** rng.randrange(0, 9)) for _ in range(40)]
    return check("3.1 blocks_needed", fn, blocks_needed, cases)


def check_slot_mapping(fn: Callable[[list[int], list[int], int], list[int]]) -> Verdict:
    rng = random.Random(4)
    cases = [([7, 3, 12], [0, 15, 16, 31, 32, 39], 16),   # "PagedAttention explained" #7, #3, #12
             ([5], [0], 1), ([0, 1], [3, 4], 4), ([9, 2], [], 4)]
    for _ in range(40):
        bs = 2 ** rng.randrange(0, 6)
        table = rng.sample(range(64), rng.randrange(1, 8))
        positions = [rng.randrange(len(table) * bs) for _ in range(rng.randrange(1, 10))]
        cases.append((table, positions, bs))
    return check("3.2 slot_mapping", fn, slot_mapping, cases)


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
    try:
        result = obj.allocate() if op[0] == "allocate" else obj.free(op[1])
    except (NoFreeBlocksError, RuntimeError, IndexError) as exc:
        if op[0] == "allocate":
            return "raises (pool empty)"
        return f"raises {type(exc).__name__}"
    except ValueError:
        return "raises ValueError"
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


def check_allocator(toy_class: type) -> Verdict:
    """Run the same op sequences on ``toy_class(num_blocks)`` and the reference; compare the
    outcome of every op (returned id and ``num_free``, or that it raised)."""
    cases = allocator_cases()
    passed, problem = 0, None
    for n, ops in cases:
        try:
            toy = toy_class(n)
        except NotImplementedError:
            return Verdict("3.3 free-list allocator", 0, len(cases), attempted=False)
        ref = ReferenceAllocator(n)
        for i, op in enumerate(ops):
            try:
                got = _outcome(toy, op)
            except NotImplementedError:
                return Verdict("3.3 free-list allocator", 0, len(cases), attempted=False)
            except Exception as exc:   # a learner's bug is a verdict
                got = f"raises {type(exc).__name__}: {exc}"
            want = _outcome(ref, op)
            if got != want:
                if problem is None:
                    call = "allocate()" if op[0] == "allocate" else f"free({op[1]})"
                    problem = (f"pool of {n}, after {ops[max(0, i - 4):i]} "
                               f"(op {i}): {call} {got}; the library {want}")
                break
        else:
            passed += 1
    return Verdict("3.3 free-list allocator", passed, len(cases), problem)
