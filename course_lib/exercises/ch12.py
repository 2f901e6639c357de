"""Chapter 12 exercises: vLLM V1's free-block queue, and SGLang's token-level prefix match.

References run the library's ``BlockPool`` (V1) and ``RadixCache`` (SGLang) on the same input;
feedback names the first queue position (and the block's kind) or the prompt that differs.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from course_lib.exercises import Exercise, Exercises, Verdict, check
from course_lib.exercises.solutions import ch12 as solutions
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
    passed, problem = 0, None
    for queue, table in cases:
        want = free_queue_after(queue, table)
        try:
            got = [int(b) for b in fn(list(queue), list(table))]
        except NotImplementedError:
            return Verdict("12.1 free_queue_after", 0, len(cases), attempted=False)
        except Exception as exc:
            problem = problem or (f"queue {queue}, freeing {table}: raised "
                                  f"{type(exc).__name__}: {exc}")
            continue
        if got == want:
            passed += 1
        elif problem is None:
            problem = f"queue {queue}, freeing {table} ((block, cached)): " + _queue_diff(
                got, want, dict(table))
    return Verdict("12.1 free_queue_after", passed, len(cases), problem)


def _queue_diff(got: list[int], want: list[int], cached: dict[int, bool]) -> str:
    i = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w),
             min(len(got), len(want)))
    if i == len(want) or i == len(got):
        return f"{len(got)} free blocks, should be {len(want)}"
    b = want[i]
    kind = ("a freed cached block: to the back, tail of the table first" if cached.get(b)
            else "a freed uncached block: to the front, tail of the table first"
            if b in cached else "a block that was already free")
    return f"position {i} of the queue is block {got[i]}, should be block {b} ({kind})"


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
    def compare(got, want):
        return isinstance(got, int) and got == want

    verdict = check("12.2 radix_hit", fn, radix_hit, cases, compare=compare)
    if verdict.ok or not verdict.attempted:
        return verdict
    for prompt, earlier, page in cases:          # say it in the learner's terms
        want = radix_hit(prompt, earlier, page)
        try:
            got = fn(list(prompt), [list(e) for e in earlier], page)
        except Exception as exc:
            got = f"raises {type(exc).__name__}: {exc}"
        if not compare(got, want):
            common = [next((i for i, (a, b) in enumerate(zip(prompt, e, strict=False))
                            if a != b), min(len(prompt), len(e))) for e in earlier]
            best = max(common, default=0)
            src = f"earlier prompt {common.index(best)}" if earlier else "nothing cached"
            problem = (f"prompt {prompt}, page_size {page}, earlier {earlier}: yours "
                       f"{got!r}, the library {want} (longest common prefix {best} tokens, "
                       f"with {src}; whole pages of it: {want})")
            return Verdict(verdict.exercise, verdict.passed, verdict.total, problem)
    return verdict


def _blocks_only(prompt, earlier, page_size):        # a hash chain of 4-token blocks
    best = min(solutions.radix_hit(prompt, earlier, 1), len(prompt) - 1)
    return best - best % 4


EXERCISES = Exercises(
    Exercise("12.1", "free_queue_after", check_free_queue_after, hints=(
        "Walk the table backwards (the tail is freed first) and sort each block into one of "
        "two lists by whether it is cached.",
        "The uncached blocks go in front of the old queue (reused first) and the cached ones "
        "behind it (evicted last), each list in the order it was freed: tail first.",
        "Read BlockPool.free_blocks and FreeKVCacheBlockQueue in "
        "course_lib/memory/block_pool.py (vllm/v1/core/block_pool.py in vLLM).",
    ), solution=solutions.free_queue_after, wrong=(
        lambda q, t: [b for b, c in t if not c] + q + [b for b, c in t if c],   # table order
        lambda q, t: q + [b for b, _ in t[::-1]])),                             # all to the back
    Exercise("12.2", "radix_hit", check_radix_hit, hints=(
        "The tree holds every earlier prompt, so the match is the longest common prefix of "
        "the prompt with any one of them (token by token, not block by block).",
        "Only whole pages are matched: round the longest common prefix down to a multiple of "
        "page_size. Unlike V1's hash chain, the whole prompt may be matched.",
        "Read RadixCache.match_prefix in course_lib/memory/radix_cache.py (SGLang's "
        "srt/mem_cache/radix_cache.py).",
    ), solution=solutions.radix_hit, wrong=(
        _blocks_only,
        lambda p, e, ps: max((sum(1 for a, b in zip(p, o, strict=False) if a == b)
                              for o in e), default=0))),                          # not a prefix
)


hint = EXERCISES.print_hint            # ch12.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch12.solution("N.M"): a solution's code
