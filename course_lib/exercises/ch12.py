"""Chapter 12 exercises: vLLM V1's free-block queue, and SGLang's token-level prefix match.

References run the library's ``BlockPool`` (V1) and ``RadixCache`` (SGLang) on the same input.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from course_lib.exercises import Verdict, check
from course_lib.memory.block_pool import BlockPool
from course_lib.memory.radix_cache import RadixCache


def free_queue_after(queue: list[int], table: list[tuple[int, bool]]) -> list[int]:
    """Reference: the free queue (block ids, front first) after a request whose block table
    is ``table`` (``(block_id, cached)`` in table order, each block held by it alone) is freed
    the way V1 frees it: tail first, blocks that are not cached to the front, cached ones to
    the back. Runs a real ``BlockPool`` in that state."""
    ids = [b for b, _ in table]
    pool = BlockPool(max([*queue, *ids], default=0) + 1)
    free = pool.free_block_queue
    for block in pool.blocks:
        free.remove(block)
        block.ref_cnt = 1
    for b in queue:
        pool.blocks[b].ref_cnt = 0
        free.append(pool.blocks[b])
    for b, cached in table:
        pool.blocks[b].block_hash = bytes([b % 256]) * 8 if cached else None
    pool.free_blocks(reversed([pool.blocks[b] for b in ids]))
    return [b.block_id for b in free.get_all_free_blocks()]


def check_free_queue_after(fn: Callable[[list[int], list[tuple[int, bool]]], list[int]]
                           ) -> Verdict:
    rng = random.Random(12)
    cases = [([], [(0, False)]), ([5, 6], [(0, True), (1, True), (2, False)]),
             ([3], [(0, False), (1, False)]), ([1, 2], [])]
    for _ in range(30):
        ids = rng.sample(range(24), rng.randint(0, 12))
        split = rng.randint(0, len(ids))
        queue = ids[:split]
        cached_prefix = rng.randint(0, len(ids) - split)
        table = [(b, i < cached_prefix) for i, b in enumerate(ids[split:])]
        cases.append((queue, table))
    return check("12.1 free_queue_after", fn, free_queue_after, cases)


def radix_hit(prompt: list[int], earlier: list[list[int]], page_size: int) -> int:
    """Reference: prompt tokens SGLang's radix tree finds after ``earlier`` prompts were
    cached (big enough a cache that nothing is evicted): whole pages of the longest common
    prefix with any of them."""
    cache = RadixCache(sum(len(p) for p in earlier) + len(prompt) + 1, page_size)
    for p in earlier:
        value, node = cache.match_prefix(p)
        slots = value + cache.alloc(len(p) - len(value))
        done = cache.insert(p, slots)
        cache.pool.free(slots[len(value):done])
    return len(cache.match_prefix(prompt)[0])


def check_radix_hit(fn: Callable[[list[int], list[list[int]], int], int]) -> Verdict:
    rng = random.Random(120)
    cases = [([1, 2, 3], [], 1), ([1, 2, 3], [[1, 2, 3]], 1), ([1, 2, 3, 4], [[1, 2, 9]], 2),
             ([1, 2, 3, 4, 5], [[1, 2, 3], [1, 2, 3, 4, 6]], 1)]
    for _ in range(30):
        page = rng.choice([1, 2, 4])
        earlier = [[rng.randrange(3) for _ in range(rng.randint(1, 12))]
                   for _ in range(rng.randint(0, 4))]
        cases.append(([rng.randrange(3) for _ in range(rng.randint(1, 12))], earlier, page))
    return check("12.2 radix_hit", fn, radix_hit, cases)
