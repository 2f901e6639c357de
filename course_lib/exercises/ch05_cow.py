"""Exercise 5.3's checker: a copy-on-write block manager (allocate, fork, append, free with
reference counts) against the library's ``BlockManager``.

It follows 3.3's model: random operation sequences from a fixed seed after the hand-picked
edge cases, every returned value, live table and ref count compared after each operation, and
a failure replays the operations that led to it and names the rule that broke.
"""

from __future__ import annotations

import random

from course_lib.exercises import Verdict, pool_history, replay_ops
from course_lib.exercises.solutions import ch05 as solutions
from course_lib.memory.v0.manager import BlockManager


class ReferenceCow:
    """Exercise 5.3's contract, on the library's ``BlockManager`` (no prefix caching)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.m = BlockManager(block_size, num_blocks, watermark=0.0)

    def allocate(self, seq: int, num_tokens: int) -> None:
        self.m.allocate(seq, [0] * num_tokens)

    def fork(self, parent: int, child: int) -> None:
        self.m.fork(parent, child)

    def append(self, seq: int) -> tuple[int, int] | None:
        copies = self.m.append_slots(seq, [0])
        return copies[0] if copies else None

    def free(self, seq: int) -> None:
        self.m.free(seq)

    def block_table(self, seq: int) -> list[int]:
        return self.m.get_block_table(seq)

    def ref_count(self, block: int) -> int:
        return self.m.ref_count(block)


def cow_cases(seed: int = 10, count: int = 30) -> list[tuple[int, int, list[tuple]]]:
    """(num_blocks, block_size, ops); ops are ("allocate", seq, num_tokens), ("fork", parent,
    child), ("append", seq), ("free", seq), always valid and always with a free block."""
    rng = random.Random(seed)
    cases: list[tuple[int, int, list[tuple]]] = [
        (8, 4, [("allocate", 0, 18), ("fork", 0, 1), ("append", 0), ("append", 1)]),  # §11.2
        (8, 4, [("allocate", 0, 16), ("fork", 0, 1), ("append", 0), ("append", 1)]),  # full
        (8, 4, [("allocate", 0, 6), ("fork", 0, 1), ("fork", 0, 2), ("append", 1),
                ("append", 2), ("append", 0), ("append", 0)]),                        # 3 sharers
        (8, 2, [("allocate", 0, 3), ("fork", 0, 1), ("free", 0), ("append", 1)]),      # sole owner
        (6, 4, [("allocate", 0, 9), ("allocate", 1, 2), ("free", 0), ("allocate", 2, 5)]),
        (6, 1, [("allocate", 0, 2), ("fork", 0, 1), ("append", 1), ("free", 1), ("free", 0)]),
    ]
    for _ in range(count):
        bs = rng.choice([1, 2, 4])
        n = rng.randrange(6, 16)
        ref, live, next_id, ops = ReferenceCow(n, bs), [], 0, []
        for _ in range(rng.randrange(8, 30)):
            free = ref.m.num_free_gpu_blocks
            r = rng.random()
            if not live and not free:
                break
            if not live or (r < 0.15 and free >= 3):
                tokens = rng.randrange(1, min(free, 3) * bs + 1)
                op = ("allocate", next_id, tokens)
                live.append(next_id)
                next_id += 1
            elif r < 0.35:
                op = ("fork", rng.choice(live), next_id)
                live.append(next_id)
                next_id += 1
            elif r < 0.85:
                op = ("append", rng.choice(live))
                if not ref.m.can_append_slots(op[1]):
                    op = ("free", op[1])
            else:
                op = ("free", rng.choice(live))
            if op[0] == "free":
                live.remove(op[1])
            getattr(ref, op[0])(*op[1:])
            ops.append(op)
        cases.append((n, bs, ops))
    return cases


def _state(obj, seqs: list[int], num_blocks: int) -> tuple[dict, list[int]]:
    return {s: list(obj.block_table(s)) for s in seqs}, [obj.ref_count(b)
                                                          for b in range(num_blocks)]


def _difference(got: tuple, want: tuple) -> str:
    """The first difference between two (returned, tables, ref counts), in words."""
    (g_ret, g_tables, g_refs), (w_ret, w_tables, w_refs) = got, want
    if g_ret != w_ret:
        why = ("a write into a shared partial block must copy it first"
               if w_ret is not None and g_ret is None else
               "only a shared, partial last block is copied" if w_ret is None else
               "the copy takes the top of the free stack")
        return f"returned {g_ret!r}, the library {w_ret!r} ({why})"
    for seq, table in w_tables.items():
        if g_tables[seq] != table:
            return f"seq {seq}'s block table is {g_tables[seq]}, the library's {table}"
    b = next(i for i, (g, w) in enumerate(zip(g_refs, w_refs, strict=True)) if g != w)
    return (f"block {b} has ref count {g_refs[b]}, the library {w_refs[b]} (every table that "
            f"points at a block counts once; a copy or a free drops one reference)")


def _live(ops: list[tuple], i: int) -> list[int]:
    """The sequences alive after operations ``0..i``."""
    live: list[int] = []
    for op in ops[:i + 1]:
        if op[0] in ("allocate", "fork"):
            live.append(op[1] if op[0] == "allocate" else op[2])
        elif op[0] == "free":
            live.remove(op[1])
    return live


def _cow_outcome(obj, setup: tuple, ops: list[tuple], i: int) -> tuple:
    """Apply operation ``i``; what it returned, every live table and every ref count."""
    ret = getattr(obj, ops[i][0])(*ops[i][1:])
    return (tuple(ret) if isinstance(ret, list) else ret, *_state(obj, _live(ops, i), setup[0]))


def check_cow_manager(cls: type) -> Verdict:
    """Run the same operations on ``cls(num_blocks, block_size)`` and on the library; after
    every operation compare what it returned, every live block table and every ref count."""
    return replay_ops("5.3 CowManager", cow_cases(), cls, ReferenceCow, _cow_outcome,
                      pool_history(_difference))


# ----------------------------------------------------------------- plausible wrong answers
class _FreesHeadFirst(solutions.CowManager):
    """Wrong: free releases the first block first, so the free stack ends in another order."""

    def free(self, seq):
        for block in self.tables.pop(seq):
            self._drop(block)
        del self.lens[seq]


class _CopyKeepsTheReference(solutions.CowManager):
    """Wrong: after a copy the source block keeps the writer's reference (it leaks)."""

    def append(self, seq):
        table, n = self.tables[seq], self.lens[seq]
        if n % self.block_size and self.refs[table[-1]] > 1:
            src = table[-1]
            table[-1] = self._take()
            self.lens[seq] = n + 1
            return (src, table[-1])
        return super().append(seq)


class _FreeIgnoresSharing(solutions.CowManager):
    """Wrong: free returns every block to the pool, even those another table still uses."""

    def free(self, seq):
        for block in reversed(self.tables.pop(seq)):
            if self.refs[block] > 0:
                self.refs[block] = 0
                self.free_stack.append(block)
        del self.lens[seq]


class _DoesNothing:
    def __init__(self, num_blocks, block_size):
        pass

    def allocate(self, *args):
        return None

    fork = append = free = block_table = ref_count = allocate


WRONG = (_FreesHeadFirst, _CopyKeepsTheReference, _FreeIgnoresSharing)
