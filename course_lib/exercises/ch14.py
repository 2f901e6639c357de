"""Chapter 14 exercises: which blocks a sliding-window group frees after more tokens (14.1),
and the longest prefix-cache hit a full-attention and a sliding-window group agree on (14.2).

References run the library's hybrid :class:`~course_lib.memory.v1.kv_cache_manager.
KVCacheManager` (14.1: ``allocate_slots``, which calls ``remove_skipped_blocks`` first) and
:class:`~course_lib.memory.v1.kv_cache_coordinator.HybridKVCacheCoordinator` (14.2:
``find_longest_cache_hit`` over a pool whose blocks are cached in each group as the case
says) on the same input. Feedback names the case (window, block size, tokens, which blocks
each group caches) and the blocks or tokens that differ, in the chapter's terms.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from course_lib.exercises import Exercise, Exercises, Rule, Verdict, judge_cases, returns
from course_lib.exercises.solutions import ch14 as solutions
from course_lib.memory.v1.kv_cache_coordinator import get_kv_cache_coordinator
from course_lib.memory.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from course_lib.memory.v1.kv_cache_manager import KVCacheManager
from course_lib.sizing.units import cdiv


# ------------------------------------------------------------------ 14.1
def blocks_freed(num_computed_tokens: int, num_new_tokens: int, sliding_window: int,
                 block_size: int) -> list[int]:
    """Reference: the table positions a sliding-window group frees (puts the null block in)
    at the ``allocate_slots`` after ``num_new_tokens`` more tokens were computed, for a
    request that had ``num_computed_tokens`` computed (and freed what those left behind).
    Plays it on a real one-group ``KVCacheManager``: the calls that computed the first tokens,
    then the more ones, then the next step's."""
    c, n, w, bs = num_computed_tokens, num_new_tokens, sliding_window, block_size
    groups = (KVCacheGroupSpec(("layers.0",), SlidingWindowSpec(bs, sliding_window=w)),)
    m = KVCacheManager(bs, cdiv(c + n + 1, bs) + 2, kv_cache_groups=groups)
    tokens = list(range(1, c + n + 2))
    if c:
        m.allocate_slots(0, tokens, 0, c)        # the tokens computed so far
    m.allocate_slots(0, tokens, c, n)            # frees what they left behind; room for n more
    null = m.block_pool.null_block.block_id
    before = m.get_block_table(0)
    m.allocate_slots(0, tokens, c + n, 1)        # the next step: frees what the n left behind
    after = m.get_block_table(0)
    return [i for i, b in enumerate(after) if b == null and before[i] != null]


def _freed_cases() -> list[tuple[int, int, int, int]]:
    cases = [(0, 5, 4, 2),          # the next token reads w - 1 before it: one block out
             (0, 6, 4, 4),          # 3 tokens out of the window: not a whole block
             (10, 4, 4, 2),         # blocks 0..2 were freed already: only 3 and 4 now
             (0, 2, 8, 2),          # a window longer than the context frees nothing
             (0, 16, 16, 4),        # a window of exactly the context
             (7, 1, 4, 4),          # one more token crosses a block boundary
             (20, 0, 6, 4)]         # no new token: nothing new
    rng = random.Random(141)
    for _ in range(30):
        bs = rng.choice([1, 2, 4, 8])
        cases.append((rng.randrange(0, 40), rng.randrange(0, 24), rng.randrange(2, 20), bs))
    return cases


def _freed_text(case: tuple) -> str:
    c, n, w, bs = case
    return f"window {w}, block_size {bs}: {c} tokens computed, then {n} more"


def check_blocks_freed(fn: Callable[[int, int, int, int], list[int]]) -> Verdict:
    """14.1: the learner's positions against the library manager's, case by case."""
    def judge(case: tuple, got) -> str | None:
        c, n, w, bs = case
        want = blocks_freed(*case)
        if isinstance(got, list | tuple) and list(got) == want:
            return None
        first = max(0, c + n - w + 1)
        return (f"{_freed_text(case)}: yours {got!r}, the library frees {want} (token "
                f"{c + n} reads tokens {first}..{c + n}; the blocks wholly before token "
                f"{first} are out of its window, and those wholly before token "
                f"{max(0, c - w + 1)} were freed already)")

    return judge_cases("14.1 blocks_freed", fn, _freed_cases(), returns(judge), _freed_text)


def _freed_with(skipped: Callable[[int, int], int], from_start: bool = False):
    """A wrong answer: the solution with another count of skipped tokens (``skipped(n, w)``),
    or (``from_start``) every skipped block, not only the new ones."""
    def answer(c, n, w, bs):
        already = 0 if from_start else skipped(c, w) // bs
        return list(range(already, skipped(c + n, w) // bs))
    return answer


_WINDOW_OFF_BY_ONE = _freed_with(lambda n, w: max(0, n - w))        # reads w tokens before


def _rounds_up(c, n, w, bs):
    """Wrong: a block partly out of the window is freed too (rounded up, not down)."""
    def blocks(k):
        return cdiv(max(0, k - w + 1), bs)
    return list(range(blocks(c), blocks(c + n)))


_FREES_AGAIN = _freed_with(lambda n, w: max(0, n - w + 1), from_start=True)
_NEGATIVE_WINDOW = _freed_with(lambda n, w: n - w + 1)                # no max(0, ...)


# ------------------------------------------------------------------ 14.2
def longest_hit(full_cached: list[bool], window_cached: list[bool], sliding_window: int,
                block_size: int, prompt_len: int) -> int:
    """Reference: the hit, in tokens, of a prompt of ``prompt_len`` tokens whose full block
    ``i`` is cached in the full-attention group where ``full_cached[i]`` and in the
    sliding-window group where ``window_cached[i]``: the library's hybrid coordinator's
    ``find_longest_cache_hit`` (full attention looked up first, as vLLM does), at most
    ``prompt_len - 1`` tokens."""
    bs = block_size
    groups = (KVCacheGroupSpec(("layers.0",), SlidingWindowSpec(bs, sliding_window=sliding_window)),
              KVCacheGroupSpec(("layers.1",), FullAttentionSpec(bs)))
    hashes = [f"block {i}".encode() for i in range(prompt_len // bs)]
    coordinator = get_kv_cache_coordinator(
        KVCacheConfig(2 * len(hashes) + 1, groups))
    pool = coordinator.block_pool
    for group, cached in ((0, window_cached), (1, full_cached)):
        for i, is_cached in enumerate(cached):
            if is_cached:             # a block that some earlier request filled and freed
                (block,) = pool.get_new_blocks(1)
                pool.cache_full_blocks([block], [hashes[i]], 0, 1, group)
                pool.free_blocks([block])
    return coordinator.find_longest_cache_hit(hashes, prompt_len - 1)[1]


def _hit_cases() -> list[tuple]:
    T, F = True, False
    cases = [([T, F, T, T], [T, T, T, T], 4, 2, 9),          # a miss ends a full hit
             ([T] * 5, [F, F, T, T, T], 4, 2, 11),           # a window hit needs its tail only
             ([T, T, F, F, F], [F, T, F, T, T], 4, 2, 11),   # the full group's cut undoes it
             ([T] * 4, [T] * 4, 4, 2, 8),                    # the last token is computed
             ([T] * 3, [T, T, F], 8, 2, 7),                  # shorter than the window
             ([T] * 5, [T, T, T, F, F], 4, 2, 11),           # the hit ends where the run ends
             ([F, T, T], [T, T, T], 4, 4, 13),               # nothing cached in the full group
             ([T] * 6, [T, F, T, F, T, F], 3, 1, 7)]         # window 3 of 1-token blocks
    rng = random.Random(142)
    for _ in range(40):
        bs = rng.choice([1, 2, 4])
        num_blocks = rng.randrange(1, 9)
        prompt_len = num_blocks * bs + rng.randrange(0, bs + 1)
        num_blocks = prompt_len // bs
        full = [rng.random() < 0.85 for _ in range(num_blocks)]
        window = [rng.random() < 0.6 for _ in range(num_blocks)]
        cases.append((full, window, rng.randrange(2, 4 * bs + 2), bs, prompt_len))
    return cases


def _blocks(cached: list[bool]) -> str:
    return "[" + ", ".join(str(i) for i, c in enumerate(cached) if c) + "]"


def _hit_text(case: tuple) -> str:
    full, window, w, bs, prompt_len = case
    return (f"window {w}, block_size {bs}, a prompt of {prompt_len} tokens: the full group "
            f"caches blocks {_blocks(full)}, the window group {_blocks(window)}")


def check_longest_hit(fn: Callable[..., int]) -> Verdict:
    """14.2: the learner's hit against the library coordinator's, case by case."""
    def judge(case: tuple, got) -> str | None:
        want = longest_hit(*case)
        if isinstance(got, int) and not isinstance(got, bool) and got == want:
            return None
        w, bs = case[2], case[3]
        return (f"{_hit_text(case)}: yours {got!r}, the library's hit is {want} tokens "
                f"(the window group needs the {cdiv(w - 1, bs)} block(s) before the hit's "
                f"end cached; the full group every block before it)")

    return judge_cases("14.2 longest_hit", fn, _hit_cases(), returns(judge), _hit_text)


def _hit_with(**changes):
    """A wrong answer: the solution with one of its rules changed (the keywords below)."""
    def answer(full_cached, window_cached, sliding_window, block_size, prompt_len):
        bs = block_size

        def full_hit(length):
            if changes.get("full_furthest"):          # up to the last cached block
                cached = [i for i in range(length // bs) if full_cached[i]]
                return (cached[-1] + 1) * bs if cached else 0
            n = 0
            while n < length // bs and full_cached[n]:
                n += 1
            return n * bs

        def window_hit(length):
            if changes.get("window_like_full"):       # every block before the end cached
                n = 0
                while n < length // bs and window_cached[n]:
                    n += 1
                return n * bs
            need, run = cdiv(sliding_window - 1, bs), 0
            for i in range(length // bs - 1, -1, -1):
                if not window_cached[i]:
                    run = 0
                    continue
                run += 1
                if run >= need:
                    return length if changes.get("ends_at_length") else (i + run) * bs
            return 0 if changes.get("no_short_hit") else run * bs

        top = prompt_len if changes.get("whole_prompt") else prompt_len - 1
        if changes.get("one_round_window_first"):
            return min(window_hit(top), full_hit(top))
        length = top
        while True:
            cut = window_hit(full_hit(length))
            if cut == length:
                return length
            length = cut
    return answer


_FULL_FURTHEST = _hit_with(full_furthest=True)
_WINDOW_LIKE_FULL = _hit_with(window_like_full=True)
_ONE_ROUND = _hit_with(one_round_window_first=True)
_WHOLE_PROMPT = _hit_with(whole_prompt=True)
_NO_SHORT_HIT = _hit_with(no_short_hit=True)
_ENDS_AT_LENGTH = _hit_with(ends_at_length=True)


EXERCISES = Exercises(
    Exercise("14.1", "blocks_freed", check_blocks_freed, hints=(
        "Work in tokens first: after n computed tokens, which tokens does the next token "
        "(number n) attend to in a window of w? Every token before the first of those is "
        "never needed again.",
        "A block is freed only when every token in it is out of the window: divide the number "
        "of such tokens by block_size, rounding down. A window longer than the context leaves "
        "nothing out.",
        "Do it for the old count and for the new one: the blocks freed now are those between "
        "the two (the ones before were freed by the step that came with the old count), "
        "range(max(0, c - w + 1) // bs, max(0, c + n - w + 1) // bs).",
    ), solution=solutions.blocks_freed, rules=(
        Rule("the next token reads the w - 1 tokens before it and itself",
             _freed_text((0, 5, 4, 2)), _WINDOW_OFF_BY_ONE),
        Rule("only blocks wholly out of the window are freed (round down)",
             _freed_text((0, 6, 4, 4)), _rounds_up),
        Rule("blocks freed at an earlier step are not freed again",
             _freed_text((10, 4, 4, 2)), _FREES_AGAIN),
        Rule("a window longer than the context frees nothing",
             _freed_text((0, 2, 8, 2)), _NEGATIVE_WINDOW),
    ), trivial=(lambda *a: None, lambda *a: []), compare_with=(
        "SlidingWindowManager.get_num_skipped_tokens and remove_skipped_blocks in "
        "course_lib/memory/v1/single_type_kv_cache_manager.py (vLLM 0.33.0's in "
        "vllm/v1/core/single_type_kv_cache_manager.py)")),
    Exercise("14.2", "longest_hit", check_longest_hit, hints=(
        "Each group answers one question: the longest hit it holds within a given length. "
        "The full group's is the leading run of its cached blocks (the hashes are chained).",
        "The window group needs only the blocks the token after the hit attends to: "
        "ceil((w - 1) / block_size) cached blocks right before the hit's end. Scan from the "
        "right; a hit shorter than that needs every block from block 0.",
        "Start from prompt_len - 1 tokens (the last token is computed for its logits) and let "
        "the groups cut it in turn, asking each again at the shorter length, until a whole "
        "round cuts nothing: a shorter length can lose the window group's run.",
    ), solution=solutions.longest_hit, rules=(
        Rule("the full group's hit is the leading run of its cached blocks",
             _hit_text(_hit_cases()[0]), _FULL_FURTHEST),
        Rule("a window hit needs only the last ceil((w - 1) / block_size) blocks cached",
             _hit_text(_hit_cases()[1]), _WINDOW_LIKE_FULL),
        Rule("a group's cut is checked again by the other groups (the fixed point)",
             _hit_text(_hit_cases()[2]), _ONE_ROUND),
        Rule("at most prompt_len - 1 tokens", _hit_text(_hit_cases()[3]), _WHOLE_PROMPT),
        Rule("a hit shorter than the window needs every block from block 0",
             _hit_text(_hit_cases()[4]), _NO_SHORT_HIT),
        Rule("the window hit ends where its run of cached blocks ends",
             _hit_text(_hit_cases()[5]), _ENDS_AT_LENGTH),
    ), trivial=(lambda *a: None, lambda *a: 0), compare_with=(
        "HybridKVCacheCoordinator.find_longest_cache_hit in "
        "course_lib/memory/v1/kv_cache_coordinator.py and SlidingWindowManager."
        "find_longest_cache_hit in course_lib/memory/v1/single_type_kv_cache_manager.py "
        "(vLLM 0.33.0's in vllm/v1/core/kv_cache_coordinator.py)")),
)


hint = EXERCISES.print_hint            # ch14.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch14.solution("N.M"): a solution's code
