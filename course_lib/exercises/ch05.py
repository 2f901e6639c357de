"""Chapter 05 exercises: which block a write must copy, and how many blocks sharing saves.

The expected answers come from running a real ``BlockManager`` (fork, append_slots), not from
a second copy of the rule.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from course_lib.exercises import Verdict, check
from course_lib.memory import BlockManager


def cow_case(num_tokens: int, block_size: int, num_sharers: int) -> tuple:
    """A sequence of ``num_tokens`` forked so ``num_sharers`` sequences share its blocks.
    Returns the learner's arguments ``(block_table, num_tokens, ref_counts, block_size)``."""
    m = _forked(num_tokens, block_size, num_sharers)
    return (m.get_block_table(0), num_tokens, list(m.gpu.ref_counts), block_size)


def _forked(num_tokens: int, block_size: int, num_sharers: int) -> BlockManager:
    m = BlockManager(block_size, 2 * (num_tokens // block_size + 2), watermark=0.0)
    m.allocate(0, list(range(num_tokens)))
    for child in range(1, num_sharers):
        m.fork(0, child)
    return m


def block_to_copy(block_table: list[int], num_tokens: int, ref_counts: list[int],
                  block_size: int) -> int | None:
    """Reference: append one token to the manager state the arguments describe and report the
    source of the copy ``append_slots`` asks for (None when it asks for none)."""
    sharers = ref_counts[block_table[-1]]
    m = _forked(num_tokens, block_size, sharers)
    assert m.get_block_table(0) == block_table and list(m.gpu.ref_counts) == ref_counts
    copies = m.append_slots(0, [0])
    return copies[0][0] if copies else None


def check_block_to_copy(fn: Callable[[list[int], int, list[int], int], int | None]) -> Verdict:
    rng = random.Random(6)
    specs = [(18, 4, 2), (16, 4, 2), (17, 4, 2), (1, 4, 1), (1, 4, 3), (3, 1, 2), (5, 16, 4)]
    specs += [(rng.randrange(1, 60), 2 ** rng.randrange(0, 5), rng.randrange(1, 5))
              for _ in range(30)]
    return check("5.1 block_to_copy", fn, block_to_copy,
                 [cow_case(n, bs, k) for n, bs, k in specs])


def blocks_held(num_samples: int, prompt_len: int, gen_len: int, block_size: int) -> int:
    """Reference: distinct GPU blocks held when ``num_samples`` sequences fork from one prompt
    and each then decodes ``gen_len`` tokens (parallel sampling), counted on a BlockManager."""
    need = num_samples * (prompt_len + gen_len) // block_size + 2 * num_samples + 2
    m = BlockManager(block_size, need, watermark=0.0)
    m.allocate(0, list(range(prompt_len)))
    for child in range(1, num_samples):
        m.fork(0, child)
    for _ in range(gen_len):
        for seq in range(num_samples):
            m.append_slots(seq, [seq])
    return m.num_gpu_blocks - m.num_free_gpu_blocks


def check_blocks_held(fn: Callable[[int, int, int, int], int]) -> Verdict:
    rng = random.Random(7)
    cases = [(1, 10, 5, 4), (4, 16, 0, 4), (4, 18, 0, 4), (4, 18, 1, 4), (4, 16, 1, 4),
             (4, 16, 4, 4), (4, 16, 5, 4), (2, 1, 1, 1), (3, 500, 20, 16)]
    cases += [(rng.randrange(1, 6), rng.randrange(1, 50), rng.randrange(0, 20),
               2 ** rng.randrange(0, 5)) for _ in range(30)]
    return check("5.2 blocks_held", fn, blocks_held, cases)
