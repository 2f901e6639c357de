"""Chapter 07's exercise 7.4: one ``schedule()`` decision of vLLM V1's scheduler, with the
token budget, chunked prefill, ``max_num_seqs`` and preemption by recompute.

The reference is the library's ``SchedulerV1`` set up in the state a case describes and asked
for one step. The checker runs hand-made cases (a budget that ends the pass, a victim that is
the request itself, admissions stopped by the blocks, a budget of one token), then random
states from a fixed seed; a difference names the first batch entry or victim that differs and
the scheduling rule it breaks.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.exercises import Verdict, judge_cases, returns
from course_lib.exercises.solutions import ch07 as solutions
from course_lib.scheduler.v1 import SchedulerV1
from course_lib.sizing.units import cdiv

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


def _judge_schedule(case: tuple, got: Any) -> str | None:
    want = schedule_step(*case)
    try:
        got = _normal(got)
    except (TypeError, ValueError) as exc:     # a wrong shape is a verdict
        return f"{_state_text(case)}: {exc}"
    return None if got == want else f"{_state_text(case)}: {_why(got, want, case[0], case[1])}"


def _state_text(case: tuple) -> str:
    running, waiting, free, bs, seqs, tokens = case
    return (f"running {running}, waiting {waiting}, {free} free blocks of {bs}, "
            f"max_num_seqs {seqs}, max_num_batched_tokens {tokens}")


def check_schedule_step(fn: Callable[..., Decision]) -> Verdict:
    """Each case through the learner's function and the library's scheduler; a failure names
    the state, the first differing entry of the batch or the victims, and the rule."""
    return judge_cases("7.4 schedule_step", fn, schedule_cases(), returns(_judge_schedule),
                       _state_text)


# ------------------------------------------------------------------ plausible wrong answers
def _admits_after_preempting(running, waiting, free, bs, seqs, tokens):
    """Wrong: lets waiting requests join in a step that preempted (with the freed blocks)."""
    scheduled, preempted = solutions.schedule_step(running, waiting, free, bs, seqs, tokens)
    if not preempted:
        return scheduled, preempted
    kept = [r for r in running if r[0] not in preempted]
    held = sum(cdiv(c, bs) for _, _, c in running) + free
    used = sum(cdiv(c + n, bs) for (rid, _, c), (_, n) in zip(kept, scheduled, strict=False))
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
        need = cdiv(c + num_new, bs) - cdiv(c, bs)
        if need > free:
            preempted.append(rid)
            free += cdiv(c, bs)
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
    free -= sum(cdiv(c + n, bs) - cdiv(c, bs) for (_, n), (_, _, c) in
                zip(scheduled, running, strict=False))
    for rid, n in waiting[:max(0, seqs - len(running))]:
        if n > budget or cdiv(n, bs) > free:
            break
        scheduled.append((rid, n))
        budget, free = budget - n, free - cdiv(n, bs)
    return scheduled, preempted
