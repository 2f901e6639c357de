"""Chapter 12 exercises: predictions of vLLM V1's free-block queue, SGLang's token-level prefix
match, and V1's ``allocate_slots`` (its checker is in :mod:`course_lib.exercises.ch12_allocate`).

References run the library's ``BlockPool`` (V1), ``RadixCache`` (SGLang) and ``KVCacheManager``
on the same input; feedback names the scenarios predicted wrong (the library's values only
after several different wrong answers), the prompt, or the operation and the room it had,
that differs.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from course_lib.exercises import (
    Exercise,
    Exercises,
    Rule,
    Scenario,
    Verdict,
    judge_cases,
    judge_predictions,
    returns,
    rule_wrongs,
)
from course_lib.exercises.ch12_allocate import check_allocate_slots
from course_lib.exercises.solutions import ch12 as solutions
from course_lib.memory.radix.radix_cache import RadixCache
from course_lib.memory.v1.block_pool import BlockPool
from course_lib.sizing.units import cdiv


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


def _front(queue: list[int], table: list[tuple[int, bool]]) -> Callable[[], int]:
    return lambda: free_queue_after(queue, table)[0]


def _back(queue: list[int], table: list[tuple[int, bool]]) -> Callable[[], int]:
    return lambda: free_queue_after(queue, table)[-1]


def _position(queue: list[int], table: list[tuple[int, bool]], block: int
              ) -> Callable[[], int]:
    return lambda: free_queue_after(queue, table).index(block)


SCENARIOS = (
    Scenario("a", "queue [5, 6], then a request holding blocks 0, 1 (cached) and 2 (not "
                  "cached) is freed: the block at the front",
             _front([5, 6], [(0, True), (1, True), (2, False)])),
    Scenario("b", "queue [5, 6], then a request holding blocks 0, 1 (cached) and 2 (not "
                  "cached) is freed: the block at the back",
             _back([5, 6], [(0, True), (1, True), (2, False)])),
    Scenario("c", "queue [3], then a request holding blocks 0 and 1 (not cached) is "
                  "freed: the block at the front",
             _front([3], [(0, False), (1, False)])),
    Scenario("d", "queue [7], then a request holding blocks 0, 1 and 2 (cached) is freed: "
                  "the block at the front",
             _front([7], [(0, True), (1, True), (2, True)])),
    Scenario("e", "queue [4, 5], then a request holding blocks 0, 1, 2 (cached) and 3 (not "
                  "cached) is freed: the position of block 0 (the front is 0)",
             _position([4, 5], [(0, True), (1, True), (2, True), (3, False)], 0)),
)


def check_free_queue_predictions(fn: Callable[[], dict]) -> Verdict:
    """12.1: each scenario played on a ``BlockPool`` (:func:`free_queue_after`), against the
    learner's prediction."""
    return judge_predictions("12.1 free_queue_predictions", fn, SCENARIOS)


def _queue_predictions(**changed: int) -> Callable[[], dict]:
    """A wrong answer: the solution's predictions with ``changed`` ones."""
    return lambda: {**solutions.free_queue_predictions(), **changed}


_ALL_TO_THE_BACK = _queue_predictions(a=5)          # V0's habit: every freed block at the back
_CACHED_HEAD_FIRST = _queue_predictions(b=1)        # the table freed from its first block
_UNCACHED_HEAD_FIRST = _queue_predictions(c=0)
_CACHED_REUSED_FIRST = _queue_predictions(d=2)      # cached blocks to the front too
_PREFIX_IN_TABLE_ORDER = _queue_predictions(e=3)    # [3, 4, 5, 0, 1, 2]


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
    def judge(case: tuple, got) -> str | None:
        prompt, earlier, page = case
        want = radix_hit(prompt, earlier, page)
        if isinstance(got, int) and got == want:
            return None
        common = [next((i for i, (a, b) in enumerate(zip(prompt, e, strict=False))
                        if a != b), min(len(prompt), len(e))) for e in earlier]
        best = max(common, default=0)
        src = f"earlier prompt {common.index(best)}" if earlier else "nothing cached"
        return (f"prompt {prompt}, page_size {page}, earlier {earlier}: yours {got!r}, the "
                f"library {want} (longest common prefix {best} tokens, with {src}; whole "
                f"pages of it: {want})")

    return judge_cases("12.2 radix_hit", fn, cases, returns(judge),
                       lambda c: f"prompt {c[0]}, page_size {c[2]}, earlier {c[1]}")


def _blocks_only(prompt, earlier, page_size):        # a hash chain of 4-token blocks
    best = min(solutions.radix_hit(prompt, earlier, 1), len(prompt) - 1)
    return best - best % 4


# ---------------------------------------------- 12.3's plausible wrong answers
def _allocate(pool, req, n, hits, bs, watermark, *, evictable_cost=True, partial=False,
              reserve_always=False, reserve_never=False, all_hits_cost=False,
              touch_last=False, touch_first=False):
    """The solution with one idea switched off or changed (the wrong answers below)."""
    total = req.num_computed_tokens + len(hits) * bs + n
    new = cdiv(total, bs) - len(req.blocks) - len(hits)
    cost = new + (len(hits) if all_hits_cost else
                  sum(1 for b in hits if b.ref_cnt == 0) if evictable_cost else 0)
    reserve = 0 if reserve_never else watermark if (reserve_always or not req.blocks) else 0
    if touch_first:                 # the free ones leave the queue: no longer counted twice
        pool.touch(hits)
        cost = new
    if cost > pool.get_num_free_blocks() - reserve:
        return None
    if not touch_last and not touch_first:
        pool.touch(hits)
    fresh = pool.get_new_blocks(new)
    if touch_last:
        pool.touch(hits)
    req.blocks = req.blocks + hits + fresh
    full = cdiv(total, bs) if partial else total // bs
    pool.cache_full_blocks(req.blocks, req.block_hashes, req.num_cached_block, full)
    req.num_cached_block = full
    return fresh


def hits_are_free(pool, req, n, hits, bs, watermark):
    """Wrong: a hit costs no free block, even one with ref count 0 (in the free queue)."""
    return _allocate(pool, req, n, hits, bs, watermark, evictable_cost=False)


def caches_partial_block(pool, req, n, hits, bs, watermark):
    """Wrong: caches the partial last block too (ceil instead of floor)."""
    return _allocate(pool, req, n, hits, bs, watermark, partial=True)


def no_watermark(pool, req, n, hits, bs, watermark):
    """Wrong: admissions may use every free block."""
    return _allocate(pool, req, n, hits, bs, watermark, reserve_never=True)


def watermark_always(pool, req, n, hits, bs, watermark):
    """Wrong: holds the watermark back from running requests too."""
    return _allocate(pool, req, n, hits, bs, watermark, reserve_always=True)


def all_hits_cost(pool, req, n, hits, bs, watermark):
    """Wrong: counts every hit against the free blocks, held ones too."""
    return _allocate(pool, req, n, hits, bs, watermark, all_hits_cost=True)


def touches_hits_last(pool, req, n, hits, bs, watermark):
    """Wrong: takes the new blocks before touching the hits."""
    return _allocate(pool, req, n, hits, bs, watermark, touch_last=True)


def touches_then_checks(pool, req, n, hits, bs, watermark):
    """Wrong: touches the hits, then finds no room and returns None (the hits stay held)."""
    return _allocate(pool, req, n, hits, bs, watermark, touch_first=True)


EXERCISES = Exercises(
    Exercise("12.1", "predict the free queue", check_free_queue_predictions, hints=(
        "Write the queue as a row, front on the left: new blocks are taken from the front, so "
        "the front is reused (and evicted from the prefix cache) first.",
        "A block that is not cached holds nothing worth keeping: it goes to the front. A "
        "cached block may be hit again: it goes to the back, behind the blocks already free.",
        "The table is freed from its last block to its first, so a prompt's first block, on "
        "which every later block's hash depends, is the last to be evicted.",
    ), solution=solutions.free_queue_predictions, rules=(
        Rule("freed blocks that are not cached go to the front",
             "a (queue [5, 6],", _ALL_TO_THE_BACK),
        Rule("the table is freed tail first: its first cached block ends at the back",
             "b (queue [5, 6],", _CACHED_HEAD_FIRST),
        Rule("uncached blocks too are freed tail first", "c (queue [3],", _UNCACHED_HEAD_FIRST),
        Rule("cached blocks go behind the blocks already free", "d (queue [7],",
             _CACHED_REUSED_FIRST),
        Rule("a prompt's first block is evicted after its later ones", "e (queue [4, 5],",
             _PREFIX_IN_TABLE_ORDER),
    ), trivial=(lambda *a: None, lambda *a: {}), compare_with=(
        "BlockPool.free_blocks and FreeKVCacheBlockQueue in course_lib/memory/v1/block_pool.py "
        "(vllm/v1/core/block_pool.py in vLLM)")),
    Exercise("12.2", "radix_hit", check_radix_hit, hints=(
        "The tree holds every earlier prompt, so the match is the longest common prefix of "
        "the prompt with any one of them (token by token, not block by block).",
        "Only whole pages are matched: round the longest common prefix down to a multiple of "
        "page_size. Unlike V1's hash chain, the whole prompt may be matched.",
    ), solution=solutions.radix_hit, rules=(
        Rule("the radix tree matches token by token, in whole pages of page_size",
             "prompt [1, 2, 3], page_size 1, earlier [[1, ",
             _blocks_only),
        Rule("a prefix match: it stops at the first token that differs",
             "prompt [1, 1, 2, 1, ",
             lambda p, e, ps: max((sum(1 for a, b in zip(p, o, strict=False) if a == b)
                              for o in e), default=0)),
        Rule("whole pages only",
             "prompt [1, 0, 1, 0],",
             rule_wrongs.radix_token_granular),
    ), compare_with=(
        "RadixCache.match_prefix in course_lib/memory/radix/radix_cache.py (SGLang's "
        "srt/mem_cache/radix_cache.py)")),                          # not a prefix
    Exercise("12.3", "allocate_slots", check_allocate_slots, hints=(
        "Count first, change nothing yet: the request needs ceil(total / block_size) blocks "
        "for total = num_computed_tokens + len(hits) * block_size + num_new_tokens; it holds "
        "len(req.blocks), the hits give len(hits), the rest are new blocks.",
        "The room check: new blocks, plus the hits with ref_cnt == 0 (they sit in the free "
        "queue, so taking them uses free blocks), must fit in pool.get_num_free_blocks(), "
        "less watermark_blocks when the request holds no blocks yet (an admission). If not, "
        "return None before touching anything.",
        "Then pool.touch(hits) (before get_new_blocks: a free hit could be handed out as a "
        "new block), req.blocks = held + hits + new, and cache the full blocks only: "
        "pool.cache_full_blocks(req.blocks, req.block_hashes, req.num_cached_block, "
        "total // block_size), then req.num_cached_block = total // block_size.",
    ), solution=solutions.allocate_slots, rules=(
        Rule("a hit in the free queue (ref_cnt 0) costs a free block",
             "(5, 4, 0, ([1, 2",
             hits_are_free),
        Rule("no room: return None and touch nothing",
             "(5, 4, 0, ([1, 2",
             touches_then_checks),
        Rule("only full blocks are cached",
             "(4, 4, 0, ([1, 2, 3, 4, 5, 6, 7, 8, 9], ",
             caches_partial_block),
        Rule("admissions keep watermark_blocks free",
             "(6, 2, 2, ([",
             no_watermark),
        Rule("running requests ignore the watermark",
             "(6, 2, 2, ([",
             watermark_always),
        Rule("a hit held by other requests costs no free block",
             "(4, 4, 0, ([1, 2, 3, 4, 5, 6, 7, 8, 9], ",
             all_hits_cost),
        Rule("the hits are touched before the new blocks are taken",
             "(5, 4, 0, ([1, 2",
             touches_hits_last),
    ), compare_with=(
        "KVCacheManager.allocate_slots in course_lib/memory/v1/kv_cache_manager.py, then vLLM "
        "0.33.0's allocate_slots in vllm/v1/core/kv_cache_manager.py and "
        "get_num_blocks_to_allocate in vllm/v1/core/single_type_kv_cache_manager.py (where the "
        "evictable hits are counted)")),
)


hint = EXERCISES.print_hint            # ch12.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch12.solution("N.M"): a solution's code
