"""Chapter 05 exercises: one beam-search step on shared block tables, the blocks parallel
sampling holds, and predictions of what copy-on-write does (forks, writes, frees).

The expected answers come from running a real ``BlockManager`` (fork, append_slots, free), not
from a second copy of the rule. 5.1 and 5.2 run the edge cases, then random cases from a fixed
seed, and name the first difference with the rule it breaks; 5.3 (in
:mod:`course_lib.exercises.ch05_cow`) asks for predictions of five scenarios and plays each on
the manager. :func:`cow_scenarios` counts the copies the V0
scheduler asks for in three workloads (forked samples, a shared prefix, preemption by
recompute): only forks copy.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from course_lib import capacity
from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.exercises import Exercise, Exercises, Rule, Verdict, args_text, judge_cases
from course_lib.exercises.ch05_beams import WRONG as _WRONG_BEAMS
from course_lib.exercises.ch05_beams import (
    check_beam_blocks,
)
from course_lib.exercises.ch05_cow import WRONG as _WRONG_COW
from course_lib.exercises.ch05_cow import check_cow_predictions
from course_lib.exercises.solutions import ch05 as solutions
from course_lib.memory.v0.manager import BlockManager
from course_lib.scheduler.scheduler import Scheduler
from course_lib.sequence import SamplingParams
from course_lib.sim.fake_sampler import fake_samples
from course_lib.sim.traces import TraceRequest, alpaca_like, few_shot
from course_lib.sizing.units import cdiv


# ------------------------------------------------------------------ 5.2 blocks held
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


class CountedOnAManager(RuntimeError):
    """5.2 asks for the count from the lengths; the page already counts it on a manager."""


@contextlib.contextmanager
def _no_manager() -> Iterator[None]:
    """While the learner's function runs, building a ``BlockManager`` or calling
    ``capacity.blocks_with_shared_prefix`` (the page's two ways to count) raises."""
    def refuse(*args, **kwargs):
        raise CountedOnAManager("5.2 asks for the count from the four lengths alone, not from "
                                "a BlockManager or capacity.blocks_with_shared_prefix as the "
                                "page counts it")
    init, formula = BlockManager.__init__, capacity.blocks_with_shared_prefix
    BlockManager.__init__ = capacity.blocks_with_shared_prefix = refuse
    try:
        yield
    finally:
        BlockManager.__init__, capacity.blocks_with_shared_prefix = init, formula


HUGE_LENGTHS = (1000, 10**9 + 7, 10**9, 16)   # a formula answers at once, a simulation never


def _judge_held(learner: Callable, case: tuple) -> str | None:
    # the manager counts the small cases; the lengths in the billions only a formula can
    # (tests/test_exercises_ch05.py checks the two agree on every small case)
    want = solutions.blocks_held(*case) if case == HUGE_LENGTHS else blocks_held(*case)
    with _no_manager():
        got = learner(*case)
    if got == want:
        return None
    n, prompt, gen, bs = case
    text = (f"{n} samples of a {prompt}-token prompt, {gen} generated tokens each, blocks of {bs}: "
            f"you count {got!r}, the manager holds {want}")
    if got == n * cdiv(prompt + gen, bs):
        return text + " (the prompt's full blocks are shared: they count once)"
    if gen == 0:
        return text + " (nobody has written yet: even the partial block is still shared)"
    if prompt % bs:
        return text + (" (the partial prompt block is copied by each sample that writes "
                       "into it, so it counts once per sample)")
    return text


def check_blocks_held(fn: Callable[[int, int, int, int], int]) -> Verdict:
    rng = random.Random(7)
    cases = [(1, 10, 5, 4), (4, 16, 0, 4), (4, 18, 0, 4), (4, 18, 1, 4), (4, 16, 1, 4),
             (4, 16, 4, 4), (4, 16, 5, 4), (2, 1, 1, 1), (3, 500, 20, 16)]
    cases += [(rng.randrange(1, 6), rng.randrange(1, 50), rng.randrange(0, 20),
               2 ** rng.randrange(0, 5)) for _ in range(30)]
    cases.append(HUGE_LENGTHS)
    return judge_cases("5.2 blocks_held", fn, cases, _judge_held, _held_text, seconds=2.0)


def _held_text(case: tuple) -> str:
    return args_text(case) + (" (lengths in the billions: count with a formula, not a "
                              "simulation)" if case == HUGE_LENGTHS else "")


# ------------------------------------------------------------------ copies in three workloads
class CowCount(NamedTuple):
    """What one run asked of the cache: copies, preemptions, prefix-cache hits."""

    workload: str
    copies: int          # copy-on-write block copies (SchedulerOutput.blocks_to_copy)
    preemptions: int     # all by recompute: blocks freed, the sequence prefilled again
    prefix_hits: int     # prompt tokens found in the prefix cache (recomputed prompts too)


def count_cow_copies(workload: str, trace: Sequence[TraceRequest], *, n: int = 1,
                     enable_prefix_caching: bool = False, num_gpu_blocks: int = 10_000,
                     block_size: int = 16) -> CowCount:
    """Run ``trace`` through the V0 scheduler (``sim.fake_sampler`` stands in for the model)
    and count the copy-on-write copies it asks for, its preemptions and prefix-cache hits."""
    longest = max((t.prompt_len + t.output_len for t in trace), default=1)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4096, max_model_len=longest),
                      CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                                  watermark=0.0, enable_prefix_caching=enable_prefix_caching))
    for t in trace:
        sched.add_request(t.request_id, t.prompt_token_ids,
                          SamplingParams(max_tokens=t.output_len, n=n))
    copies = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        copies += len(out.blocks_to_copy)
        sched.update(out, fake_samples(out))
    return CowCount(workload, copies, sched.num_preemptions,
                    sched.block_manager.prefix_cache_stats.hits)


def cow_scenarios(num_requests: int = 40, seed: int = 0) -> list[CowCount]:
    """Three workloads of ``num_requests`` requests: two samples per Alpaca-like prompt (a
    fork), few-shot prompts sharing one prefix through the prefix cache, and the Alpaca-like
    prompts on a 40-block pool that forces preemption by recompute."""
    short = alpaca_like(num_requests, seed=seed)
    return [count_cow_copies("fork: n = 2 samples per prompt", short, n=2),
            count_cow_copies("prefix cache: one few-shot prefix", few_shot(num_requests,
                                                                            seed=seed),
                             enable_prefix_caching=True),
            count_cow_copies("recompute: a 40-block pool", short, num_gpu_blocks=40)]

# ----------------------------------------------------------------- the registry
def _no_sharing(num_samples, prompt_len, gen_len, block_size):
    """Wrong: every sample holds its own copy of everything."""
    return num_samples * cdiv(prompt_len + gen_len, block_size)


def _partial_block_shared_forever(num_samples, prompt_len, gen_len, block_size):
    """Wrong: counts the prompt's partial block once, as if nobody wrote into it."""
    prompt_blocks = cdiv(prompt_len, block_size)
    return prompt_blocks + num_samples * (cdiv(prompt_len + gen_len, block_size)
                                          - prompt_blocks)


def _held_after_sampling(n, prompt_len, gen_len, block_size):
    """Wrong (for 5.2's purpose): the page's cell, counting on a BlockManager (as
    :func:`blocks_held` does), which the exercise forbids."""
    return blocks_held(n, prompt_len, gen_len, block_size)


def _counted_token_by_token(num_samples, prompt_len, gen_len, block_size):
    """Wrong for 5.2: right on small lengths, but it walks every token of every sample (a
    simulation, as with a class of one's own), so lengths in the billions never finish."""
    if gen_len == 0:
        return cdiv(prompt_len, block_size)
    full = prompt_len // block_size
    total = full
    for _ in range(num_samples):
        own = set()
        for position in range(full * block_size, prompt_len + gen_len):
            own.add(position // block_size)
        total += len(own)
    return total


EXERCISES = Exercises(
    Exercise("5.1", "beam_blocks", check_beam_blocks, hints=(
        "Count the references first: a block's ref count is the number of tables (beams) "
        "that contain it. Dropping a beam takes one reference off each of its blocks; a "
        "block is freed when its count reaches 0.",
        "A beam picked k times becomes k beams: every block of its table gains k - 1 "
        "references. Then each beam appends: with num_tokens % block_size == 0 every beam "
        "opens a new block; otherwise a last block with count r > 1 is copied r - 1 times "
        "(the last beam left on it is its only owner by then and writes in place).",
        "held = blocks with a count above 0 after the frees and forks, plus one per copy, plus "
        "one per beam when the last blocks were full.",
    ), solution=solutions.beam_blocks, rules=(
        Rule("k beams on one shared partial block make k - 1 copies (the last writer keeps it)",
             "beams {0: [0, 1]} at 7 t",
             _WRONG_BEAMS[0]),
        Rule("a dropped beam's blocks that a kept beam shares stay held",
             "beams {1: [0, 2], 0: [0, 1]} at 8 tokens, block size 4, picks [0",
             _WRONG_BEAMS[1]),
        Rule("a full shared last block is not copied: the new token opens a new block",
             "beams {0: [0, 1]} at 8 t",
             _WRONG_BEAMS[2]),
    ),
        trivial=(lambda *a: None, lambda *a: ([], [], 0)), compare_with=(
        "_beam_step in course_lib/scheduler/output_processor.py and BlockManager.fork / free / "
        "append_slots in course_lib/memory/v0/manager.py")),
    Exercise("5.2", "blocks_held", check_blocks_held, hints=(
        "Split the prompt into its full blocks (shared by every sample for ever) and the rest "
        "(each sample writes there, so each ends with its own copy).",
        "After the first write, each sample holds ceil((prompt_len + gen_len) / block_size) - "
        "prompt_len // block_size blocks of its own. With gen_len = 0 nobody wrote: the "
        "partial block is still shared.",
    ), solution=solutions.blocks_held, rules=(
        Rule("the prompt's full blocks are shared: they count once",
             "(4, 16, 0, 4",
             _no_sharing),
        Rule("each sample that writes into the partial prompt block copies it",
             "(4, 18, 1, 4",
             _partial_block_shared_forever),
        Rule("counted from the four lengths alone (no BlockManager)",
             "(1, 10, 5, 4",
             _held_after_sampling),
        Rule("counted from the four lengths alone (no simulation of one's own)",
             "lengths in the billions",
             _counted_token_by_token),
    ), compare_with=(
        "capacity.blocks_with_shared_prefix in course_lib/capacity.py (which has no gen_len = 0 "
        "case), then BlockManager.append_slots in course_lib/memory/v0/manager.py")),
    Exercise("5.3", "predict copy-on-write", check_cow_predictions, hints=(
        "Draw each table as a row of boxes of 4 slots and write each block's ref count under "
        "it: a fork adds one to every block of the parent's table, a free takes one off.",
        "A write goes into the last block. Full: a new block, nothing copied. Partial and "
        "shared (count > 1): a fresh block and a copy, the old block loses a reference. "
        "Partial with count 1: written in place, whoever the block came from.",
        "The free stack is last in, first out, and free pushes a table from its last block "
        "to its first.",
    ), solution=solutions.cow_predictions, rules=(
        Rule("a write into a shared partial block copies it; its last owner writes in place",
             "a (an 18-token", _WRONG_COW[0]),
        Rule("a full last block is never copied: the new token opens a new block",
             "b (a 16-token", _WRONG_COW[1]),
        Rule("k owners of one partial block make k - 1 copies",
             "c (a 6-token", _WRONG_COW[2]),
        Rule("free drops one reference; a block another table holds stays, and its sole "
             "owner writes in place", "d (a 10-token", _WRONG_COW[3]),
        Rule("free pushes the table from its last block to its first on a LIFO stack",
             "e (a 12-token", _WRONG_COW[4]),
    ), trivial=(lambda *a: None, lambda *a: {}), compare_with=(
        "BlockManager.append_slots, fork and free in course_lib/memory/v0/manager.py, and "
        "BlockAllocator.touch / release in course_lib/memory/v0/pool.py")),
)


hint = EXERCISES.print_hint            # ch05.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch05.solution("N.M"): a solution's code
