"""Chapter 07 exercises: chunked prefill, the victim, recompute or swap, one scheduling step.

References run the library: the real ``Scheduler`` for the chunks, ``last_arrived_first`` for
the victim, ``CostModel`` for the preemption choice, and V1's ``SchedulerV1.schedule()`` (set
up in the state a case describes) for one whole step with budgets, chunks and preemption.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.exercises import Exercise, Exercises, Verdict, check
from course_lib.exercises.solutions import ch07 as solutions
from course_lib.memory import cdiv
from course_lib.scheduler import Scheduler, last_arrived_first
from course_lib.scheduler.v1 import SchedulerV1
from course_lib.sequence import Request, SamplingParams
from course_lib.sim.fake_sampler import fake_samples
from course_lib.sim.replay import CostModel


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


def pick_victim(requests: list[tuple[int, float]]) -> int:
    """Reference: which request (id, arrival time) vLLM's default policy preempts."""
    reqs = [Request(rid, (1,), SamplingParams(), arrival_time=t) for rid, t in requests]
    return last_arrived_first(reqs).request_id


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


def check_pick_victim(fn: Callable[[list[tuple[int, float]]], int]) -> Verdict:
    rng = random.Random(8)
    cases = [([(0, 0.0)],), ([(0, 0.0), (1, 1.0), (2, 0.5)],), ([(5, 2.0), (3, 2.0)],),
             ([(9, 0.0), (1, 3.0), (4, 3.0), (2, 1.0)],)]
    for _ in range(20):
        ids = rng.sample(range(100), rng.randrange(1, 8))
        cases.append(([(i, float(rng.randrange(0, 4))) for i in ids],))
    return check("7.2 pick_victim", fn, pick_victim, cases)


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


# ------------------------------------------------------------------ 7.4: one schedule() step
Running = Sequence[tuple[int, int, int]]      # (request_id, num_tokens, num_computed_tokens)
Waiting = Sequence[tuple[int, int]]           # (request_id, num_tokens)
Decision = tuple[list[tuple[int, int]], list[int]]


def schedule_step(running: Running, waiting: Waiting, num_free_blocks: int, block_size: int,
                  max_num_seqs: int, max_num_batched_tokens: int) -> Decision:
    """Reference: one ``SchedulerV1.schedule()`` (chunked prefill on, recompute, no prefix
    cache, no watermark) from the state described: each running request holds
    ``ceil(num_computed_tokens / block_size)`` blocks, ``num_free_blocks`` more are free.
    Returns ``([(request_id, num_new_tokens), ...] in batch order, [preempted ids] in order)``."""
    held = sum(cdiv(c, block_size) for _, _, c in running)
    s = SchedulerV1(SchedulerConfig(max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=max_num_batched_tokens,
                                    max_model_len=1 << 20),
                    CacheConfig(block_size=block_size, num_gpu_blocks=held + num_free_blocks,
                                watermark=0.0, enable_prefix_caching=False))
    kvm = s.kv_cache_manager
    for rid, n, computed in running:
        s.add_request(rid, range(1000 * rid, 1000 * rid + n))
        seq = s.waiting.popleft()
        kvm.allocate_slots(seq.seq_id, seq.token_ids, 0, computed)
        seq.num_computed_tokens = computed
        s.running.append(seq)
    for rid, n in waiting:
        s.add_request(rid, range(1000 * rid, 1000 * rid + n))
    out = s.schedule()
    return ([(e.request.request_id, e.num_tokens) for e in out.scheduled],
            [rid for rid, _ in out.preempted])


def schedule_cases(seed: int = 11, count: int = 60) -> list[tuple]:
    """(running, waiting, num_free_blocks, block_size, max_num_seqs, max_num_batched_tokens)."""
    cases: list[tuple] = [
        ([(0, 9, 8), (1, 5, 4)], [(2, 30)], 10, 4, 4, 16),      # decodes, then a chunk of 14
        ([(0, 40, 8)], [(1, 4)], 10, 4, 4, 16),                 # the budget ends the pass
        ([(0, 9, 8), (1, 9, 8), (2, 9, 8)], [(3, 2)], 1, 4, 4, 64),   # preempt the last one
        ([(0, 9, 8), (1, 9, 8)], [], 0, 4, 4, 64),              # preempt 1, then 0 runs
        ([(0, 9, 8)], [(1, 1)], 0, 4, 4, 64),                   # the victim is itself
        ([(0, 9, 8), (1, 3, 2)], [(2, 4)], 5, 4, 2, 64),        # max_num_seqs: nobody joins
        ([(0, 5, 4)], [(1, 16), (2, 4)], 3, 4, 4, 64),          # no room: 2 may not skip ahead
        ([(0, 17, 16), (1, 30, 6)], [(2, 8)], 1, 8, 4, 64),     # a chunk that needs 3 blocks
        ([], [(0, 5), (1, 5), (2, 5)], 7, 2, 4, 16),            # admissions until blocks run out
        ([(0, 2, 1)], [(1, 9)], 9, 1, 4, 1),                    # a budget of one token
    ]
    rng = random.Random(seed)
    while len(cases) < count + 10:
        bs = rng.choice([1, 2, 4, 16])
        running = []
        for rid in range(rng.randrange(0, 6)):
            computed = rng.randrange(1, 50)
            n = computed + (1 if rng.random() < 0.7 else rng.randrange(2, 40))
            running.append((rid, n, computed))
        free = rng.randrange(0, 8)
        pool = sum(cdiv(c, bs) for _, _, c in running) + free
        waiting = [(rid, rng.randrange(1, 60)) for rid in range(len(running),
                                                                 len(running) + rng.randrange(4))]
        if any(cdiv(n, bs) > pool for _, n in waiting) or not running + waiting:
            continue                          # a prompt the pool can never hold is refused
        budget = rng.randrange(1, 64) if rng.random() < 0.5 else len(running) + rng.randrange(1, 12)
        cases.append((running, waiting, free, bs, max(1, len(running) + rng.randrange(0, 3)),
                      budget))
    return cases


def _normal(decision: Any) -> Decision:
    if not isinstance(decision, list | tuple) or len(decision) != 2:
        raise TypeError(f"returned {decision!r}; expected a pair (scheduled, preempted)")
    scheduled, preempted = decision
    return [tuple(e) for e in scheduled], list(preempted)


def _why(got: Decision, want: Decision, running: Running, waiting: Waiting) -> str:
    """The first difference between two decisions, with the rule it breaks."""
    (g_s, g_p), (w_s, w_p) = got, want
    if g_p != w_p:
        return (f"preempted {g_p}, the library {w_p} (when the pool is short the *last* running "
                f"request is preempted, again until the blocks suffice; when the victim is the "
                f"request itself, the pass over the running requests stops)")
    pairs = enumerate(zip(g_s, w_s, strict=False))
    k = next((i for i, (g, w) in pairs if g != w), min(len(g_s), len(w_s)))
    running_ids = {rid for rid, _, _ in running}
    if k < len(g_s) and k < len(w_s):
        rule = ("a running request takes min(tokens it has not computed, budget left)"
                if w_s[k][0] in running_ids else
                "a prompt takes min(its tokens, budget left): chunked prefill")
        return f"batch entry {k} is {g_s[k]}, the library's {w_s[k]} ({rule})"
    if k < len(g_s):
        rule = ("nobody joins in a step that preempted" if w_p else
                "admissions stop at the budget, at max_num_seqs, or at the first waiting "
                "request whose blocks do not fit (no skipping ahead)")
        return f"batch entry {k} is {g_s[k]}, the library stops before it ({rule})"
    rule = ("a waiting request joins while budget, max_num_seqs and free blocks allow")
    if w_s[k][1] < dict(waiting).get(w_s[k][0], 0):
        rule = ("chunked prefill: a prompt that does not fit the budget left takes what is left, "
                "min(its tokens, budget left)")
    return f"the batch stops after {k} entries, the library's goes on with {w_s[k]} ({rule})"


def check_schedule_step(fn: Callable[..., Decision]) -> Verdict:
    """Each case through the learner's function and the library's scheduler; a failure names
    the state, the first differing entry of the batch or the victims, and the rule."""
    name = "7.4 schedule_step"
    cases = schedule_cases()
    passed, problem = 0, None
    for case in cases:
        want = schedule_step(*case)
        try:
            got = _normal(fn(*case))
        except NotImplementedError:
            return Verdict(name, 0, len(cases), attempted=False)
        except Exception as exc:   # a learner's bug (or a wrong shape) is a verdict
            got, why = None, f"raised {type(exc).__name__}: {exc}"
        else:
            why = None if got == want else _why(got, want, case[0], case[1])
        if why is None:
            passed += 1
        elif problem is None:
            running, waiting, free, bs, seqs, tokens = case
            problem = (f"running {running}, waiting {waiting}, {free} free blocks of {bs}, "
                       f"max_num_seqs {seqs}, max_num_batched_tokens {tokens}: {why}")
    return Verdict(name, passed, len(cases), problem)


# ----------------------------------------------------------------- the registry
def _chunks_ignore_decodes(prompt_len, max_num_batched_tokens, num_decoding):
    """Wrong: forgets that the decoding requests take their tokens first."""
    return solutions.prefill_chunks(prompt_len, max_num_batched_tokens, 0)


def _decodes_only_in_the_first_step(prompt_len, max_num_batched_tokens, num_decoding):
    """Wrong: takes the decodes' tokens out of the first chunk only."""
    first = min(prompt_len, max_num_batched_tokens - num_decoding)
    return [first] + solutions.prefill_chunks(prompt_len - first, max_num_batched_tokens, 0)


def _victim_no_tiebreak(requests):
    """Wrong: the latest arrival, but the first of a tie (the smaller id when listed so)."""
    return max(requests, key=lambda r: r[1])[0]


def _victim_earliest(requests):
    """Wrong: preempts the request that arrived first (the one with the most work done)."""
    return min(requests, key=lambda r: (r[1], r[0]))[0]


def _swap_forgets_the_way_back(num_tokens, block_size, kv_bytes_per_token, s_per_token):
    """Wrong: compares recompute with swapping out only."""
    blocks = -(-num_tokens // block_size)
    out = blocks * block_size * kv_bytes_per_token / 20e9 + blocks * 64 * 4e-6
    return "recompute" if num_tokens * s_per_token <= out else "swap"


def _tie_goes_to_swap(num_tokens, block_size, kv_bytes_per_token, s_per_token):
    """Wrong: recompute only when strictly cheaper, without a tolerance for the tie."""
    blocks = -(-num_tokens // block_size)
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


def _admits_after_preempting(running, waiting, free, bs, seqs, tokens):
    """Wrong: lets waiting requests join in a step that preempted (with the freed blocks)."""
    scheduled, preempted = solutions.schedule_step(running, waiting, free, bs, seqs, tokens)
    if not preempted:
        return scheduled, preempted
    kept = [r for r in running if r[0] not in preempted]
    held = sum(-(-c // bs) for _, _, c in running) + free
    used = sum(-(-(c + n) // bs) for (rid, _, c), (_, n) in zip(kept, scheduled, strict=False))
    more, _ = solutions.schedule_step([], waiting, held - used,
                                      bs, seqs - len(kept), tokens - sum(n for _, n in scheduled))
    return scheduled + more, preempted


def _preempts_the_one_that_needs(running, waiting, free, bs, seqs, tokens):
    """Wrong: the request short of a block gives up its own blocks (not the last one)."""
    scheduled, preempted, budget = [], [], tokens
    for rid, n, c in running:
        if budget == 0:
            break
        num_new = min(n - c, budget)
        need = -(-(c + num_new) // bs) - -(-c // bs)
        if need > free:
            preempted.append(rid)
            free += -(-c // bs)
            continue
        free, budget = free - need, budget - num_new
        scheduled.append((rid, num_new))
    if not preempted:
        more, _ = solutions.schedule_step([], waiting, free, bs, seqs - len(running), budget)
        scheduled += more
    return scheduled, preempted


def _no_chunked_prefill(running, waiting, free, bs, seqs, tokens):
    """Wrong: a prompt joins only if all of it fits the budget left (chunked prefill off)."""
    scheduled, preempted = solutions.schedule_step(running, [], free, bs, seqs, tokens)
    if preempted:
        return scheduled, preempted
    budget = tokens - sum(n for _, n in scheduled)
    free -= sum(-(-(c + n) // bs) - -(-c // bs) for (_, n), (_, _, c) in
                zip(scheduled, running, strict=False))
    for rid, n in waiting[:max(0, seqs - len(running))]:
        if n > budget or -(-n // bs) > free:
            break
        scheduled.append((rid, n))
        budget, free = budget - n, free - -(-n // bs)
    return scheduled, preempted


EXERCISES = Exercises(
    Exercise("7.1", "prefill_chunks", check_prefill_chunks, hints=(
        "Every step has max_num_batched_tokens tokens; who takes theirs first?",
        "The decodes go first, one token each, in every step; the prompt takes what is left, "
        "until none of it is left. The last chunk is the remainder.",
        "Read SchedulerV1.schedule in course_lib/scheduler/v1.py (V0's chunking: "
        "Scheduler._schedule_prefill in course_lib/scheduler/scheduler.py).",
    ), solution=solutions.prefill_chunks, wrong=(_chunks_ignore_decodes,
                                                 _decodes_only_in_the_first_step)),
    Exercise("7.2", "pick_victim", check_pick_victim, hints=(
        "The victim is the request that arrived last: the one that has done the least work.",
        "Two requests can arrive at the same time; then the larger id counts as later. A key "
        "of (arrival_time, request_id) orders both at once.",
        "Read last_arrived_first in course_lib/scheduler/policy.py.",
    ), solution=solutions.pick_victim, wrong=(_victim_no_tiebreak, _victim_earliest)),
    Exercise("7.3", "cheaper_preemption", check_cheaper_preemption, hints=(
        "Recompute costs num_tokens x s_per_token. Swap moves whole blocks, and moves them "
        "twice: out now, back in later.",
        "One way: blocks x block_size x kv_bytes_per_token / 20e9 seconds of PCIe, plus "
        "blocks x 2 x 32 copy calls of 4e-6 s. Near the crossover the float order of your "
        "sums matters: decide a tie with math.isclose(recompute, swap, rel_tol=1e-9).",
        "Read CostModel.recompute_time and swap_time in course_lib/sim/replay.py, and "
        "preemption_costs beside them.",
    ), solution=solutions.cheaper_preemption, wrong=(_swap_forgets_the_way_back,
                                                     _tie_goes_to_swap, _swap_fractional_blocks)),
    Exercise("7.4", "schedule_step", check_schedule_step, hints=(
        "Keep three running numbers: the free blocks, the budget left and the requests "
        "running. A request's blocks are ceil(tokens / block_size): what it needs this step is "
        "ceil((computed + new) / block_size) - ceil(computed / block_size).",
        "Running pass: while the request's need exceeds the free blocks, pop the *last* running "
        "request, give its blocks back, record it; stop the pass if it was the request "
        "itself. Waiting pass, only if nobody was preempted: stop at the first request whose "
        "chunk min(tokens, budget) does not get its blocks.",
        "Read SchedulerV1.schedule and _schedule_waiting in course_lib/scheduler/v1.py, and "
        "KVCacheManager.allocate_slots in course_lib/memory/kv_cache_manager.py.",
    ), solution=solutions.schedule_step, wrong=(_admits_after_preempting,
                                                _preempts_the_one_that_needs,
                                                _no_chunked_prefill)),
)


hint = EXERCISES.print_hint            # ch07.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch07.solution("N.M"): a solution's code
