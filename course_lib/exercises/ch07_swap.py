"""Chapter 07's exercise 7.2: one decode step of vLLM V0's scheduler with its victims, swap out
and swap in (vLLM 0.6.3's ``Scheduler._schedule_running`` and ``_schedule_swapped``).

The reference is the library's V0 :class:`~course_lib.scheduler.scheduler.Scheduler`, set up in the
state a case describes (requests decoding on the GPU, others swapped out to the CPU pool) and
asked for one ``schedule()``. :func:`explain_step` replays the same rules in plain Python with
the reason for every event, so that a difference is told as the step of the pass where it
happened and the rule it breaks; ``tests/test_exercises_ch07.py`` checks that the two agree
on every case. Cases: edge cases (a victim that is the request itself, a CPU pool too small, a
swap-in that fits its blocks but not its next token), then random states from a fixed seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.exercises import Verdict, judge_cases, returns
from course_lib.sizing.units import cdiv

Req = tuple[int, float, int]       # (request_id, arrival_time, num_computed_tokens)
Step = tuple[list[int], list[tuple[int, str]], list[int]]   # (decoded, preempted, swapped_in)


def schedule_running_and_swapped(running: Sequence[Req], swapped: Sequence[Req],
                                 num_free_gpu_blocks: int, num_free_cpu_blocks: int,
                                 block_size: int, preemption_mode: str) -> Step:
    """Reference: one ``schedule()`` of the V0 scheduler (no waiting requests, no budget
    limits, no watermark). ``running`` requests hold ``cdiv(num_computed_tokens, block_size)``
    GPU blocks, ``swapped`` ones as many CPU blocks; ``num_free_*`` more are free."""
    from course_lib.scheduler.scheduler import Scheduler
    from course_lib.sequence import SamplingParams, SequenceStatus

    held = sum(cdiv(c, block_size) for _, _, c in running)
    held_cpu = sum(cdiv(c, block_size) for _, _, c in swapped)
    s = Scheduler(SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=1 << 20,
                                  max_model_len=1 << 20, preemption_mode=preemption_mode),
                  CacheConfig(block_size=block_size, num_gpu_blocks=held + num_free_gpu_blocks,
                              num_cpu_blocks=held_cpu + num_free_cpu_blocks, watermark=0.0))
    bm = s.block_manager
    for queue, reqs in ((s.swapped, swapped), (s.running, running)):   # swapped ones first:
        for rid, arrival, computed in reqs:            # they pass through the GPU on the way
            s.add_request(rid, tuple(range(1, computed + 1)), SamplingParams(max_tokens=1 << 20),
                          arrival_time=arrival)
            req = s.waiting.pop()
            seq = req.seqs[0]
            bm.allocate(seq.seq_id, seq.token_ids)     # its cached tokens' blocks
            seq.output_token_ids.append(7)             # the token this step writes
            seq.num_computed_tokens = computed
            seq.status = SequenceStatus.RUNNING
            if queue is s.swapped:
                bm.swap_out([seq.seq_id])
                seq.status = SequenceStatus.SWAPPED
            queue.append(req)
    out = s.schedule()
    decoded = [e.request.request_id for e in out.scheduled]
    back = {rid for rid, _, _ in swapped}
    return ([r for r in decoded if r not in back], list(out.preempted),
            [r for r in decoded if r in back])


def explain_step(running: Sequence[Req], swapped: Sequence[Req], num_free_gpu_blocks: int,
                 num_free_cpu_blocks: int, block_size: int, preemption_mode: str
                 ) -> tuple[Step, list[str]]:
    """The same step in plain Python, with one sentence per event (each preemption and each
    swap-in, in order) saying why it happened."""
    def blocks(tokens: int) -> int:
        return cdiv(tokens, block_size)

    queue = sorted(running, key=lambda r: (r[1], r[0]))          # V0 serves by arrival
    free, cpu_free = num_free_gpu_blocks, num_free_cpu_blocks
    decoded: list[int] = []
    preempted: list[tuple[int, str]] = []
    swapped_in: list[int] = []
    why: list[str] = []
    while queue:
        rid, _, c = queue.pop(0)
        need, victim = blocks(c + 1) - blocks(c), None
        while need > free:
            victim = queue.pop() if queue else (rid, 0.0, c)
            mode = "swap" if preemption_mode == "swap" and blocks(victim[2]) <= cpu_free \
                else "recompute"
            why.append(f"request {rid} needs a new block and {free} are free: the victim is "
                       f"{'the request itself' if victim[0] == rid else f'request {victim[0]}'}"
                       f" (the last to arrive of those not served yet in this step), by "
                       f"{mode} ({_mode_reason(preemption_mode, blocks(victim[2]), cpu_free)})")
            cpu_free -= blocks(victim[2]) if mode == "swap" else 0
            free += blocks(victim[2])
            preempted.append((victim[0], mode))
            if victim[0] == rid:
                break
        if victim is None or victim[0] != rid:
            free -= need
            decoded.append(rid)
    if not preempted:
        for rid, _, c in sorted(swapped, key=lambda r: (r[1], r[0])):
            if blocks(c + 1) > free:
                why.append(f"swapped request {rid} stays out: its {blocks(c)} blocks and "
                           f"{blocks(c + 1) - blocks(c)} for the token it writes now do not fit "
                           f"in {free} free blocks, and the pass stops there")
                break
            why.append(f"swapped request {rid} comes back: its {blocks(c)} blocks and "
                       f"{blocks(c + 1) - blocks(c)} for the token it writes now fit in {free} "
                       f"free blocks")
            free -= blocks(c + 1)
            swapped_in.append(rid)
    return (decoded, preempted, swapped_in), why


def _mode_reason(preemption_mode: str, victim_blocks: int, cpu_free: int) -> str:
    if preemption_mode != "swap":
        return "preemption_mode is recompute"
    return (f"its {victim_blocks} blocks {'fit' if victim_blocks <= cpu_free else 'do not fit'}"
            f" in the {cpu_free} free CPU blocks")


def swap_cases(seed: int = 15, count: int = 50) -> list[tuple]:
    """(running, swapped, num_free_gpu_blocks, num_free_cpu_blocks, block_size, mode)."""
    cases: list[tuple] = [
        ([(0, 0.0, 8), (1, 1.0, 5)], [], 1, 0, 4, "recompute"),        # room: both decode
        ([(0, 0.0, 8), (1, 1.0, 8), (2, 2.0, 8)], [], 1, 8, 4, "swap"),  # 2 is swapped out
        ([(2, 2.0, 8), (0, 0.0, 8), (1, 1.0, 8)], [], 1, 8, 4, "swap"),  # queue order is not
        ([(0, 0.0, 8), (1, 1.0, 8), (2, 2.0, 8)], [], 0, 1, 4, "swap"),  # CPU too small
        ([(0, 0.0, 8), (1, 1.0, 8)], [], 0, 2, 4, "swap"),             # one swap, then none
        ([(0, 0.0, 9), (1, 1.0, 8)], [], 0, 0, 4, "recompute"),        # 1 is its own victim
        ([(0, 0.0, 8), (1, 1.0, 4), (2, 2.0, 3)], [], 0, 9, 4, "swap"),  # two victims
        ([(0, 0.0, 5)], [(1, 1.0, 8)], 2, 0, 4, "recompute"),          # 2 + 1 blocks: stays
        ([(0, 0.0, 5)], [(1, 1.0, 7)], 2, 0, 4, "swap"),               # 2 blocks, no new one
        ([(0, 0.0, 4)], [(2, 1.0, 3), (1, 1.0, 3)], 2, 0, 4, "swap"),  # ties: the smaller id
        ([(0, 0.0, 8), (1, 1.0, 8)], [(2, 0.5, 1)], 0, 4, 4, "swap"),  # preempted: no swap-in
        ([(3, 5.0, 2), (1, 3.0, 1)], [(0, 0.0, 4), (2, 4.0, 1)], 3, 0, 1, "swap"),
    ]
    rng = random.Random(seed)
    while len(cases) < count + 12:
        bs = rng.choice([1, 2, 4, 8])
        ids = rng.sample(range(40), rng.randrange(1, 9))
        reqs = [(rid, float(rng.randrange(6)), rng.randrange(1, 30)) for rid in ids]
        cut = rng.randrange(1, len(reqs) + 1)
        running, swapped = reqs[:cut], reqs[cut:]
        free = rng.randrange(0, 5) if rng.random() < 0.6 else rng.randrange(5, 25)
        pool = sum(cdiv(c, bs) for _, _, c in running) + free
        if any(cdiv(c, bs) + 1 > pool for _, _, c in reqs):
            continue                     # a request alone without room: not this exercise
        cases.append((running, swapped, free, rng.randrange(0, 12), bs,
                      rng.choice(["swap", "swap", "recompute"])))
    return cases


def _case_text(case: tuple) -> str:
    running, swapped, free, cpu_free, bs, mode = case
    return (f"running {list(running)}, swapped {list(swapped)} (request_id, arrival_time, "
            f"num_computed_tokens), {free} free GPU and {cpu_free} free CPU blocks of {bs}, "
            f"preemption_mode {mode!r}")


def _judge(case: tuple, got: Any) -> str | None:
    want = schedule_running_and_swapped(*case)
    where = _case_text(case)
    try:
        decoded, preempted, swapped_in = got
        got = (list(decoded), [tuple(p) for p in preempted], list(swapped_in))
    except (TypeError, ValueError):
        return f"{where}: returned {got!r:.80}; expected (decoded, preempted, swapped_in)"
    if got == want:
        return None
    (_, why) = explain_step(*case)
    (g_dec, g_pre, g_in), (w_dec, w_pre, w_in) = got, want
    if g_pre != w_pre:
        k = next((i for i, (g, w) in enumerate(zip(g_pre, w_pre, strict=False)) if g != w),
                 min(len(g_pre), len(w_pre)))
        if k == len(w_pre):
            return (f"{where}: preemption {k}: you preempted {g_pre[k]}, the library stops "
                    f"preempting after {w_pre} (a request's decode needs a new block only when "
                    f"num_computed_tokens is a multiple of block_size; victims free all their "
                    f"blocks)")
        order = {rid: (t, rid) for rid, t, _ in case[0]}
        unsorted = [order.get(r) for r in g_dec] != sorted(order.get(r, (0, r)) for r in g_dec)
        return (f"{where}: preemption {k}: you {g_pre[k] if k < len(g_pre) else 'none'}, the "
                f"library {w_pre[k]}: {why[k]}"
                + ("; V0 serves the running requests in order of arrival_time, then "
                   "request_id, whatever their order in the queue" if unsorted else ""))
    if g_dec != w_dec:
        return (f"{where}: decoded {g_dec}, the library {w_dec} (the running requests are "
                f"served in order of arrival_time, then request_id; a victim does not decode)")
    k = next((i for i, (g, w) in enumerate(zip(g_in, w_in, strict=False)) if g != w),
             min(len(g_in), len(w_in)))
    rule = ("nobody comes back in a step that preempted" if w_pre else
            "swapped requests come back in order of arrival, while the free GPU blocks hold "
            "their blocks plus the one the token they write now may need; the first that does "
            "not fit stops the pass")
    return (f"{where}: swapped_in {g_in}, the library {w_in} ({rule})"
            + (f": {why[len(w_pre) + k]}" if len(w_pre) + k < len(why) else ""))


def check_schedule_running_and_swapped(fn: Callable[..., Step]) -> Verdict:
    """7.2: the three lists; a difference names the event (preemption k, the decodes, the
    swap-ins) and the library's reason for it."""
    return judge_cases("7.2 schedule_running_and_swapped", fn, swap_cases(), returns(_judge),
                       _case_text)


# ------------------------------------------------------------------ plausible wrong answers
def _variant(running, swapped, free, cpu_free, bs, mode, *, sort=True, cpu_room=True,
             decode_room=True, victim_last=True, swap_in_after_preempt=False) -> Step:
    def blocks(tokens):
        return cdiv(tokens, bs)

    queue = sorted(running, key=lambda r: (r[1], r[0])) if sort else list(running)
    decoded, preempted, swapped_in = [], [], []
    while queue:
        rid, _, c = queue.pop(0)
        need, stopped = blocks(c + 1) - blocks(c), False
        while need > free:
            victim = queue.pop() if queue and victim_last else (rid, 0.0, c)
            swap = mode == "swap" and (blocks(victim[2]) <= cpu_free or not cpu_room)
            cpu_free -= blocks(victim[2]) if swap else 0
            free += blocks(victim[2])
            preempted.append((victim[0], "swap" if swap else "recompute"))
            if victim[0] == rid:
                stopped = True
                break
        if not stopped:
            free -= need
            decoded.append(rid)
    if not preempted or swap_in_after_preempt:
        for rid, _, c in sorted(swapped, key=lambda r: (r[1], r[0])):
            need = blocks(c + 1) if decode_room else blocks(c)
            if need > free:
                break
            free -= blocks(c + 1)
            swapped_in.append(rid)
    return decoded, preempted, swapped_in


def _queue_order(*case):
    """Wrong: serves the running requests in the order given, not by arrival."""
    return _variant(*case, sort=False)


def _swap_without_cpu_room(*case):
    """Wrong: in swap mode every victim is swapped, whether the CPU pool has room or not."""
    return _variant(*case, cpu_room=False)


def _swap_in_forgets_the_new_token(*case):
    """Wrong: swaps a request in when its blocks fit, forgetting the block its decode needs."""
    return _variant(*case, decode_room=False)


def _needy_one_is_the_victim(*case):
    """Wrong: the request short of a block gives up its own blocks (not the last arrival)."""
    return _variant(*case, victim_last=False)


def _swap_in_after_preempting(*case):
    """Wrong: brings swapped requests back even in a step that preempted."""
    return _variant(*case, swap_in_after_preempt=True)


WRONG = (_queue_order, _swap_without_cpu_room, _swap_in_forgets_the_new_token,
         _needy_one_is_the_victim, _swap_in_after_preempting)
