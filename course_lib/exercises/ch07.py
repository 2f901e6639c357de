"""Chapter 07 exercises: chunked prefill, one V0 decode step with its victims, swap out and
swap in, recompute or swap, one V1 scheduling step.

References run the library: the real ``Scheduler`` for the chunks (7.1) and for the V0 step
(7.2, in ``ch07_swap``), ``CostModel`` for the preemption choice (7.3), and V1's
``SchedulerV1.schedule()`` for one whole step with budgets, chunks and preemption (7.4, in
``ch07_schedule``), each set up in the state a case describes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.exercises import Exercise, Exercises, Rule, Verdict, check
from course_lib.exercises.ch07_schedule import (
    _admits_after_preempting,
    _no_chunked_prefill,
    _preempts_the_one_that_needs,
    check_schedule_step,
)
from course_lib.exercises.ch07_swap import (
    WRONG,
    check_schedule_running_and_swapped,
)
from course_lib.exercises.solutions import ch07 as solutions
from course_lib.scheduler.scheduler import Scheduler
from course_lib.sequence import SamplingParams
from course_lib.sim.fake_sampler import fake_samples
from course_lib.sim.replay import CostModel
from course_lib.sizing.units import cdiv


def prefill_chunks(prompt_len: int, max_num_batched_tokens: int, num_decoding: int) -> list[int]:
    """Reference: the prompt's chunk in each step, while ``num_decoding`` other requests
    decode in every step (they go first and take one token each), chunked prefill on."""
    s = Scheduler(SchedulerConfig(max_num_seqs=num_decoding + 1,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=prompt_len + 10_000),
                  CacheConfig(block_size=16, num_gpu_blocks=4 * (prompt_len // 16 + 2)
                              + 4 * num_decoding * 80, watermark=0.0))

    def step() -> list[int]:
        out = s.schedule()
        s.update(out, fake_samples(out))
        return [e.num_tokens for e in out.scheduled if e.request.request_id == -1]

    for i in range(num_decoding):                  # get them decoding first
        s.add_request(i, (1, 2, 3), SamplingParams(max_tokens=10_000))
    while any(r.is_prefill for r in s.running) or s.waiting:
        step()
    s.add_request(-1, tuple(range(1, prompt_len + 1)), SamplingParams(max_tokens=1))
    chunks = []
    while any(r.request_id == -1 for r in [*s.waiting, *s.running]):
        chunks += step()
    return chunks


def cheaper_preemption(num_tokens: int, block_size: int, kv_bytes_per_token: int,
                       s_per_token: float) -> str:
    """Reference: "recompute" or "swap" (out + in), whichever ``CostModel`` says is cheaper
    (the other constants at their defaults); a tie (equal to a relative 1e-9, so that the
    order of a float computation does not matter) goes to recompute, vLLM's default."""
    cm = CostModel(s_per_token=s_per_token, kv_bytes_per_token=kv_bytes_per_token)
    recompute = cm.recompute_time(num_tokens)
    swap = 2 * cm.swap_time(cdiv(num_tokens, block_size), block_size)
    return "recompute" if recompute < swap or math.isclose(recompute, swap, rel_tol=1e-9) \
        else "swap"


def tie_s_per_token(block_size: int, kv_bytes_per_token: int) -> float:
    """The prefill cost per token at which recompute and swap (out + in) of whole blocks cost
    the same: 2 x (bytes / 20 GB/s + 2 x 32 copies x 4 us per block) / block_size."""
    cm = CostModel(kv_bytes_per_token=kv_bytes_per_token)
    return 2 * cm.swap_time(1, block_size) / block_size


def _same_list(got: Any, want: list) -> bool:
    """A list or a tuple of the same numbers (the exercise asks for "a list"; a tuple is one
    way to write it)."""
    return isinstance(got, list | tuple) and list(got) == want


def check_prefill_chunks(fn: Callable[[int, int, int], list[int]]) -> Verdict:
    rng = random.Random(7)
    cases = [(50, 16, 0), (50, 16, 3), (16, 16, 0), (17, 16, 0), (1, 8, 0), (100, 10, 9),
             (33, 2048, 5)]
    cases += [(rng.randrange(1, 300), rng.randrange(8, 64), rng.randrange(0, 7))
              for _ in range(15)]
    return check("7.1 prefill_chunks", fn, prefill_chunks, cases, compare=_same_list)


def check_cheaper_preemption(fn: Callable[[int, int, int, float], str]) -> Verdict:
    cases = [(n, bs, kv, spt) for n in (16, 1000, 4096) for bs in (1, 16, 256)
             for kv, spt in ((524_288, 1e-4), (819_200, 1.7e-4), (131_072, 1e-4),
                             (524_288, 2e-5))]
    # near the crossover: exact ties (recompute), then 3% either side of them; 5 * bs + 1
    # tokens swap 6 whole blocks
    for bs, kv in ((16, 524_288), (8, 524_288), (32, 131_072), (4, 819_200), (64, 262_144)):
        tie = tie_s_per_token(bs, kv)
        for n in (bs, 10 * bs, 37 * bs, 5 * bs + 1):
            cases += [(n, bs, kv, tie), (n, bs, kv, 0.97 * tie), (n, bs, kv, 1.03 * tie)]
    # recompute costs between one and two swaps (only the way back in tips it), partial blocks
    for bs, kv in ((16, 524_288), (8, 262_144), (32, 819_200)):
        tie = tie_s_per_token(bs, kv)
        cases += [(n, bs, kv, 0.7 * tie) for n in (bs * 5 + 1, bs * 12 - 1)]
    return check("7.3 cheaper_preemption", fn, cheaper_preemption, cases)


# ----------------------------------------------------------------- the registry
def _chunks_ignore_decodes(prompt_len, max_num_batched_tokens, num_decoding):
    """Wrong: forgets that the decoding requests take their tokens first."""
    return solutions.prefill_chunks(prompt_len, max_num_batched_tokens, 0)


def _decodes_only_in_the_first_step(prompt_len, max_num_batched_tokens, num_decoding):
    """Wrong: takes the decodes' tokens out of the first chunk only."""
    first = min(prompt_len, max_num_batched_tokens - num_decoding)
    return [first] + solutions.prefill_chunks(prompt_len - first, max_num_batched_tokens, 0)


def _swap_forgets_the_way_back(num_tokens, block_size, kv_bytes_per_token, s_per_token):
    """Wrong: compares recompute with swapping out only."""
    blocks = cdiv(num_tokens, block_size)
    out = blocks * block_size * kv_bytes_per_token / 20e9 + blocks * 64 * 4e-6
    return "recompute" if num_tokens * s_per_token <= out else "swap"


def _tie_goes_to_swap(num_tokens, block_size, kv_bytes_per_token, s_per_token):
    """Wrong: recompute only when strictly cheaper, without a tolerance for the tie."""
    blocks = cdiv(num_tokens, block_size)
    swap = 2 * (blocks * block_size * kv_bytes_per_token / 20e9 + blocks * 64 * 4e-6)
    return "recompute" if num_tokens * s_per_token < swap else "swap"


def _swap_fractional_blocks(num_tokens, block_size, kv_bytes_per_token, s_per_token):
    """Wrong: swaps num_tokens / block_size blocks, as if a partial block moved in part."""
    import math

    blocks = num_tokens / block_size
    swap = 2 * (blocks * block_size * kv_bytes_per_token / 20e9 + blocks * 64 * 4e-6)
    recompute = num_tokens * s_per_token
    return "recompute" if recompute < swap or math.isclose(recompute, swap, rel_tol=1e-9) \
        else "swap"


EXERCISES = Exercises(
    Exercise("7.1", "prefill_chunks", check_prefill_chunks, hints=(
        "Every step has max_num_batched_tokens tokens; who takes theirs first?",
        "The decodes go first, one token each, in every step; the prompt takes what is left, "
        "until none of it is left. The last chunk is the remainder.",
    ), solution=solutions.prefill_chunks, rules=(
        Rule("the decodes take one token each before any prefill",
             "(50, 16, 3)",
             _chunks_ignore_decodes),
        Rule("the decodes take their tokens in every step, not only the first",
             "(50, 16, 3)",
             _decodes_only_in_the_first_step),
    ), compare_with=(
        "SchedulerV1.schedule in course_lib/scheduler/v1.py (V0's chunking: "
        "Scheduler._schedule_prefill in course_lib/scheduler/scheduler.py)")),
    Exercise("7.2", "one V0 decode step: victims, swap out, swap in",
             check_schedule_running_and_swapped, hints=(
        "Two passes. First the running requests, sorted by (arrival_time, request_id): each "
        "needs a new block only when num_computed_tokens % block_size == 0. Then, only if "
        "nobody was preempted, the swapped requests in the same order.",
        "Short of a block: pop the last request of the sorted queue still to be served (itself "
        "if none is left), free its cdiv(num_computed_tokens, block_size) GPU blocks, and "
        "record (id, 'swap') if the mode is swap and the free CPU blocks hold all of them "
        "(they are then used up), else (id, 'recompute'). A request that was its own victim "
        "does not decode. A swapped request comes back if the free GPU blocks cover "
        "cdiv(num_computed_tokens + 1, block_size); the first that does not fit stops.",
    ), solution=solutions.schedule_running_and_swapped, rules=(
        Rule("the running requests are served in order of arrival_time, then request_id",
             "running [(2, 2.0",
             WRONG[0]),
        Rule("a victim is swapped out only if the free CPU blocks hold all its blocks",
             "running [(0, 0.0, 8), (1, 1.0, 8), (2, 2.0, 8)], swapped [] (request_id, "
             "arrival_time, num_computed_tokens), 0 f",
             WRONG[1]),
        Rule("a swapped request comes back only if the free GPU blocks cover "
             "cdiv(num_computed_tokens + 1, block_size)",
             "running [(0, 0.0, 5)], swapped [(1, 1.0, 8)]",
             WRONG[2]),
        Rule("the victim is the last to arrive of the requests not yet served, itself included",
             "running [(0, 0.0, 8), (1, 1.0, 8), (2, 2.0, 8)], swapped [] (request_id, "
             "arrival_time, num_computed_tokens), 1 f",
             WRONG[3]),
        Rule("swapped requests come back only if nobody was preempted",
             "running [(0, 0.0, 8), (1, 1.0, 8)], swapped [(2,",
             WRONG[4]),
    ), compare_with=(
        "Scheduler.schedule, _preempt and _schedule_swapped in course_lib/scheduler/scheduler.py,"
        " and can_swap_out / swap_in_need in course_lib/memory/v0/manager.py")),
    Exercise("7.3", "cheaper_preemption", check_cheaper_preemption, hints=(
        "Recompute costs num_tokens x s_per_token. Swap moves whole blocks, and moves them "
        "twice: out now, back in later.",
        "One way: blocks x block_size x kv_bytes_per_token / 20e9 seconds of PCIe, plus "
        "blocks x 2 x 32 copy calls of 4e-6 s. Near the crossover the float order of your "
        "sums matters: decide a tie with math.isclose(recompute, swap, rel_tol=1e-9).",
    ), solution=solutions.cheaper_preemption, rules=(
        Rule("swap moves the blocks twice: out now, back in later",
             "(16, 16, 524288, 8.4",
             _swap_forgets_the_way_back),
        Rule("a tie goes to recompute",
             "(16, 16, 524288, 8.4",
             _tie_goes_to_swap),
        Rule("swap moves whole blocks",
             "(16, 256, 524288, 0.",
             _swap_fractional_blocks),
    ),
        compare_with=(
        "CostModel.recompute_time and swap_time in course_lib/sim/replay.py, and preemption_costs"
        " beside them")),
    Exercise("7.4", "schedule_step", check_schedule_step, hints=(
        "Keep three running numbers: the free blocks, the budget left and the requests "
        "running. A request's blocks are ceil(tokens / block_size): what it needs this step is "
        "ceil((computed + new) / block_size) - ceil(computed / block_size).",
        "Running pass: while the request's need exceeds the free blocks, pop the *last* running "
        "request, give its blocks back, record it; stop the pass if it was the request "
        "itself. Waiting pass, only if nobody was preempted: stop at the first request whose "
        "chunk min(tokens, budget) does not get its blocks.",
    ), solution=solutions.schedule_step, rules=(
        Rule("waiting requests are admitted only if nobody was preempted",
             "running [(0, 9, 8), (1, 9, 8), (",
             _admits_after_preempting),
        Rule("the victim is the last running request",
             "running [(0, 9, 8), (1, 9, 8), (",
             _preempts_the_one_that_needs),
        Rule("a waiting request takes min(its tokens, budget left): a chunk",
             "running [(0, 9, 8), (1, 5, 4",
             _no_chunked_prefill),
    ), compare_with=(
        "SchedulerV1.schedule and _schedule_waiting in course_lib/scheduler/v1.py, and "
        "KVCacheManager.allocate_slots in course_lib/memory/v1/kv_cache_manager.py")),
)


hint = EXERCISES.print_hint            # ch07.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch07.solution("N.M"): a solution's code
