"""The exercise checkers of chapters 03, 05 and 06: each passes the library's own solution,
fails a plausible wrong one (naming the first difference), and reports a fresh exercise as not
attempted."""

from __future__ import annotations

import pytest

from course_lib.exercises import ch03, ch05, ch06
from course_lib.memory import ROOT_HASH, NoFreeBlocksError

pytestmark = [pytest.mark.ch03, pytest.mark.ch05, pytest.mark.ch06]


def not_done(*args):
    raise NotImplementedError


def test_blocks_needed_checker():
    assert ch03.check_blocks_needed(ch03.blocks_needed).ok
    assert ch03.check_blocks_needed(lambda n, bs: (n + bs - 1) // bs).ok
    v = ch03.check_blocks_needed(lambda n, bs: n // bs + 1)       # wrong when bs divides n
    assert not v.ok and "(0, 16) returned 1" in v.first_problem
    assert not ch03.check_blocks_needed(lambda n, bs: int(n / bs + 0.999999)).ok  # floats
    assert not ch03.check_blocks_needed(not_done).attempted


def test_slot_mapping_checker():
    assert ch03.slot_mapping([7, 3, 12], [0, 16, 39], 16) == [112, 48, 199]
    mine = lambda t, ps, bs: [t[p // bs] * bs + p % bs for p in ps]  # noqa: E731
    assert ch03.check_slot_mapping(mine).ok
    v = ch03.check_slot_mapping(lambda t, ps, bs: [t[p // bs] + p % bs for p in ps])
    assert not v.ok and "[7, 3, 12]" in v.first_problem
    assert not ch03.check_slot_mapping(not_done).attempted


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


def test_block_to_copy_checker():
    assert ch05.block_to_copy(*ch05.cow_case(18, 4, 2)) == 4      # Block Manager tutorial §11.2
    assert ch05.block_to_copy(*ch05.cow_case(16, 4, 2)) is None    # full: new block, no copy
    assert ch05.block_to_copy(*ch05.cow_case(18, 4, 1)) is None    # not shared

    def mine(table, n, refs, bs):
        return table[-1] if n % bs and refs[table[-1]] > 1 else None

    assert ch05.check_block_to_copy(mine).ok
    v = ch05.check_block_to_copy(lambda t, n, r, bs: t[-1] if r[t[-1]] > 1 else None)
    assert not v.ok and "returned 3, the library returns None" in v.first_problem
    assert not ch05.check_block_to_copy(not_done).attempted


def test_blocks_held_checker():
    assert ch05.blocks_held(4, 18, 1, 4) == 4 + 4                 # 4 shared + 4 partial
    assert ch05.blocks_held(4, 18, 0, 4) == 5

    def mine(n, prompt, gen, bs):
        if gen == 0:
            return -(-prompt // bs)
        full = prompt // bs
        return full + n * (-(-(prompt + gen) // bs) - full)

    assert ch05.check_blocks_held(mine).ok
    naive = lambda n, p, g, bs: n * -(-(p + g) // bs)  # noqa: E731
    assert not ch05.check_blocks_held(naive).ok
    assert not ch05.check_blocks_held(not_done).attempted


def test_block_hashes_checker():
    assert ch06.block_hashes([1, 2, 3], 4) == []
    assert ch06.block_hashes([1, 2, 3, 4], 4) == [hash((ROOT_HASH, (1, 2, 3, 4), ()))]

    def mine(tokens, bs, extra=()):
        out, parent = [], 0
        for i in range(len(tokens) // bs):
            parent = hash((parent, tuple(tokens[i * bs:(i + 1) * bs]), extra))
            out.append(parent)
        return out

    assert ch06.check_block_hashes(mine).ok
    unchained = lambda t, bs, e=(): [hash((0, tuple(t[i * bs:(i + 1) * bs]), e))  # noqa: E731
                                     for i in range(len(t) // bs)]
    assert not ch06.check_block_hashes(unchained).ok
    unsalted = lambda t, bs, e=(): mine(t, bs)  # noqa: E731
    v = ch06.check_block_hashes(unsalted)
    assert not v.ok and "tenant-b" in v.first_problem
    assert not ch06.check_block_hashes(not_done).attempted


def test_num_cached_tokens_checker():
    sys_prompt = list(range(100, 112))
    assert ch06.num_cached_tokens(sys_prompt, [sys_prompt], 4) == 8        # the cap
    assert ch06.num_cached_tokens(sys_prompt + [1], [sys_prompt], 4) == 12

    def mine(prompt, earlier, bs):
        cached = set()
        for p in earlier:
            cached.update(tuple(p[:k * bs]) for k in range(1, len(p) // bs + 1))
        hits = 0
        for k in range(1, (len(prompt) - 1) // bs + 1):
            if tuple(prompt[:k * bs]) not in cached:
                break
            hits = k
        return hits * bs

    assert ch06.check_num_cached_tokens(mine).ok
    no_cap = lambda p, e, bs: max([0] + [k * bs for q in e for k in range(len(q) // bs + 1)  # noqa: E731
                                         if k * bs <= len(p) and p[:k * bs] == q[:k * bs]])
    v = ch06.check_num_cached_tokens(no_cap)
    assert not v.ok
    assert not ch06.check_num_cached_tokens(not_done).attempted
