"""Chapter 05 exercises: which block a write must copy, and how many blocks sharing saves.

The expected answers come from running a real ``BlockManager`` (fork, append_slots), not from
a second copy of the rule. :func:`cow_scenarios` counts the copies the V0 scheduler asks for
in three workloads (forked samples, a shared prefix, preemption by recompute): only forks copy.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import NamedTuple

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.exercises import Verdict, check
from course_lib.memory import BlockManager
from course_lib.scheduler import Scheduler
from course_lib.sequence import SamplingParams
from course_lib.sim.fake_sampler import fake_samples
from course_lib.sim.traces import TraceRequest, alpaca_like, few_shot


def cow_case(num_tokens: int, block_size: int, num_sharers: int) -> tuple:
    """A sequence of ``num_tokens`` forked so ``num_sharers`` sequences share its blocks.
    Returns the learner's arguments ``(block_table, num_tokens, ref_counts, block_size)``."""
    m = _forked(num_tokens, block_size, num_sharers)
    return (m.get_block_table(0), num_tokens, list(m.gpu.ref_counts), block_size)


def _forked(num_tokens: int, block_size: int, num_sharers: int) -> BlockManager:
    m = BlockManager(block_size, 2 * (num_tokens // block_size + 2), watermark=0.0)
    m.allocate(0, list(range(num_tokens)))
    for child in range(1, num_sharers):
        m.fork(0, child)
    return m


def block_to_copy(block_table: list[int], num_tokens: int, ref_counts: list[int],
                  block_size: int) -> int | None:
    """Reference: append one token to the manager state the arguments describe and report the
    source of the copy ``append_slots`` asks for (None when it asks for none)."""
    sharers = ref_counts[block_table[-1]]
    m = _forked(num_tokens, block_size, sharers)
    assert m.get_block_table(0) == block_table and list(m.gpu.ref_counts) == ref_counts
    copies = m.append_slots(0, [0])
    return copies[0][0] if copies else None


def check_block_to_copy(fn: Callable[[list[int], int, list[int], int], int | None]) -> Verdict:
    rng = random.Random(6)
    specs = [(18, 4, 2), (16, 4, 2), (17, 4, 2), (1, 4, 1), (1, 4, 3), (3, 1, 2), (5, 16, 4)]
    specs += [(rng.randrange(1, 60), 2 ** rng.randrange(0, 5), rng.randrange(1, 5))
              for _ in range(30)]
    return check("5.1 block_to_copy", fn, block_to_copy,
                 [cow_case(n, bs, k) for n, bs, k in specs])


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


def check_blocks_held(fn: Callable[[int, int, int, int], int]) -> Verdict:
    rng = random.Random(7)
    cases = [(1, 10, 5, 4), (4, 16, 0, 4), (4, 18, 0, 4), (4, 18, 1, 4), (4, 16, 1, 4),
             (4, 16, 4, 4), (4, 16, 5, 4), (2, 1, 1, 1), (3, 500, 20, 16)]
    cases += [(rng.randrange(1, 6), rng.randrange(1, 50), rng.randrange(0, 20),
               2 ** rng.randrange(0, 5)) for _ in range(30)]
    return check("5.2 blocks_held", fn, blocks_held, cases)


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
