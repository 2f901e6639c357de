"""Chapter 08's exercise 8.3: how many requests of a real mix of lengths a block pool runs at
once without a preemption.

vLLM's startup log gives "Maximum concurrency for max_model_len tokens per request", as if
every request reached max_model_len and held it from the start. A real mix does neither: a
request's blocks come one step at a time and all go back when it leaves, so short requests
leave before long ones peak. The reference sums each step's blocks over the requests still
running; ``tests/test_exercises_ch08.py`` checks it against the V0 ``Scheduler`` (no
preemption exactly up to its answer). The checker runs edge cases, then random mixes from a
fixed seed, and names the step where the learner's batch overflows (or the library's peak),
and the idea missed when the answer is one of the usual mistakes.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from course_lib.exercises import Verdict, judge_cases, returns
from course_lib.sizing.units import cdiv

# ------------------------------------------------------------------ 8.3 a mix of requests
Mix = list[tuple[int, int]]       # (prompt_len, output_len) of each request, in arrival order


def blocks_by_step(block_size: int, requests: Mix) -> list[int]:
    """Blocks the requests hold in each step when they all start in step 0: request
    ``(p, o)`` holds ``cdiv(p + s, block_size)`` blocks in its steps ``s = 0 .. o - 1`` (step 0
    is the prefill; step s writes the K/V of its s-th generated token) and none after."""
    need: list[int] = []
    for prompt_len, output_len in requests:
        need += [0] * (output_len - len(need))
        for s in range(output_len):
            need[s] += cdiv(prompt_len + s, block_size)
    return need


def reference_max_num_requests(num_gpu_blocks: int, block_size: int, requests: Mix) -> int:
    """The largest k such that the first k requests, started together, never need more than
    ``num_gpu_blocks`` blocks in one step (they run to the end without a preemption)."""
    need: list[int] = []
    for k, (prompt_len, output_len) in enumerate(requests):
        need += [0] * (output_len - len(need))
        for s in range(output_len):
            need[s] += cdiv(prompt_len + s, block_size)
        if max(need) > num_gpu_blocks:
            return k
    return len(requests)


def request_cases(seed: int = 13, count: int = 30) -> list[tuple[int, int, Mix]]:
    """(num_gpu_blocks, block_size, requests): edge cases, then random mixes from a seed."""
    cases: list[tuple[int, int, Mix]] = [
        (10, 16, []),                                    # no requests
        (0, 16, [(1, 1)]),                               # an empty pool
        (1, 16, [(17, 1)]),                              # the first prompt alone is too big
        (2, 16, [(16, 2)]),                              # its first decode opens block 2
        (1, 16, [(16, 1), (1, 1)]),                      # a prefill-only request: one block
        (4, 4, [(4, 4), (4, 4)]),                        # 2 + 2 blocks in steps 1..3: fits
        (6, 4, [(3, 10), (3, 10), (12, 1)]),             # the long ones peak after 12 leaves
        (9, 4, [(8, 9), (2, 3), (2, 3), (2, 3)]),        # short ones leave before 0 peaks
        (100, 16, [(500, 300)] * 6),                     # all alike: the final size decides
        (50, 1, [(10, 20), (5, 5), (30, 1)]),            # block_size 1: blocks are tokens
        (30, 8, [(40, 40), (3, 5), (3, 5), (3, 5), (3, 5), (100, 2)]),
    ]
    rng = random.Random(seed)
    for _ in range(count):
        bs = rng.choice([1, 4, 8, 16, 32])
        mix = [(rng.randrange(1, 600), min(700, max(1, round(rng.lognormvariate(4, 1.2)))))
               for _ in range(rng.randrange(2, 40))]
        final = sum(cdiv(p + o - 1, bs) for p, o in mix)
        cases.append((rng.randrange(final // 5, final + 2), bs, mix))
    return cases


def _n(count: int, thing: str) -> str:
    return f"{count} {thing}{'' if count == 1 else 's'}"


def _mix_text(requests: Mix) -> str:
    shown = ", ".join(map(str, requests[:6]))
    return f"[{shown}{f', ... {len(requests) - 6} more' if len(requests) > 6 else ''}]"


def _requests_text(case: tuple) -> str:
    pool, bs, requests = case
    return (f"pool of {_n(pool, 'block')} of {bs}, requests (prompt_len, output_len) "
            f"{_mix_text(requests)}")


def _peak(block_size: int, requests: Mix) -> tuple[int, int]:
    need = blocks_by_step(block_size, requests)
    return max((n, s) for s, n in enumerate(need)) if need else (0, 0)


def _judge_requests(case: tuple, got) -> str | None:
    pool, bs, requests = case
    want = reference_max_num_requests(pool, bs, requests)
    if got == want and isinstance(got, int):
        return None
    where = _requests_text(case)
    if not isinstance(got, int) or not 0 <= got <= len(requests):
        return f"{where}: returned {got!r:.60}, want a count from 0 to {len(requests)}: {want}"
    rule = (" (a request holds cdiv(prompt_len + s, block_size) blocks in its step s, "
            "s = 0 .. output_len - 1, and none once it leaves)")
    for wrong, concept in ((_reserve_final_size, "every request held its final size from "
                            "step 0: blocks come one at a time, and a short request leaves "
                            "before a long one peaks"),
                           (_mix_tokens_not_blocks, "tokens were counted, not whole blocks"),
                           (_average_request, "one average request stood for the mix"),
                           (_last_token_cached, "the last generated token was given a slot: "
                            "it is sampled, never written to the cache")):
        if wrong(pool, bs, requests) == got:
            rule = f" (here {concept})"
            break
    if got > want:
        need, step = next((n, s) for s, n in enumerate(blocks_by_step(bs, requests[:got]))
                          if n > pool)
        return (f"{where}: returned {got}, the library {want}: the first {_n(got, 'request')} "
                f"need {need} blocks in step {step}, more than {pool}{rule}")
    peak, step = _peak(bs, requests[:want])
    return (f"{where}: returned {got}, the library {want}: the first {_n(want, 'request')} need "
            f"at most {_n(peak, 'block')} (in step {step}) and the pool has {pool}{rule}")


def check_max_num_requests(fn: Callable[[int, int, Mix], int]) -> Verdict:
    """8.3: the count; a difference names the step where the learner's batch overflows (or
    the peak of the library's) and, where it can tell, the idea that was missed."""
    return judge_cases("8.3 max_num_requests", fn, request_cases(), returns(_judge_requests),
                       _requests_text)


def _reserve_final_size(num_gpu_blocks, block_size, requests):
    """Wrong: each request holds its final size, cdiv(p + o - 1, bs), from step 0 on."""
    used = 0
    for k, (p, o) in enumerate(requests):
        used += cdiv(p + o - 1, block_size)
        if used > num_gpu_blocks:
            return k
    return len(requests)


def _mix_tokens_not_blocks(num_gpu_blocks, block_size, requests):
    """Wrong: counts the tokens of each step against num_gpu_blocks x block_size slots."""
    return _first_overflow(requests, lambda p, s: p + s, num_gpu_blocks * block_size)


def _last_token_cached(num_gpu_blocks, block_size, requests):
    """Wrong: step s holds p + s + 1 tokens, as if the token just sampled had its slot."""
    return _first_overflow(requests, lambda p, s: cdiv(p + s + 1, block_size), num_gpu_blocks)


def _average_request(num_gpu_blocks, block_size, requests):
    """Wrong: the pool divided by the blocks of one request of the mix's average length."""
    if not requests:
        return 0
    average = round(sum(p + o - 1 for p, o in requests) / len(requests))
    return min(len(requests), num_gpu_blocks // cdiv(average, block_size))


def _first_overflow(requests, held, limit):
    need: list[int] = []
    for k, (p, o) in enumerate(requests):
        need += [0] * (o - len(need))
        for s in range(o):
            need[s] += held(p, s)
        if max(need) > limit:
            return k
    return len(requests)
