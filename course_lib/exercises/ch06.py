"""Chapter 06 exercises: the chained block hashes, and how many prompt tokens the cache saves.

References run the library's ``PrefixCache`` / ``BlockManager`` on the same input.
:func:`ttft_with_and_without_cache` replays a multi-turn chat trace with the cache off and on.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.exercises import Verdict, check
from course_lib.memory import BlockManager, BlockTable, PrefixCache
from course_lib.sim.replay import replay
from course_lib.sim.traces import TraceRequest


def block_hashes(tokens: list[int], block_size: int, extra_key: Hashable = ()) -> list[int]:
    """Reference: the chain ``PrefixCache("builtin")`` computes, one hash per full block."""
    table = BlockTable(0, block_size, token_ids=list(tokens), extra_key=extra_key)
    PrefixCache("builtin").hash_blocks(table, len(tokens) // block_size)
    return table.block_hashes


def num_cached_tokens(prompt: list[int], earlier_prompts: list[list[int]],
                      block_size: int) -> int:
    """Reference: prompt tokens found in the cache after ``earlier_prompts`` ran (each one
    computed, then finished; the pool is big enough that nothing is evicted)."""
    total = sum(len(p) for p in earlier_prompts) + len(prompt)
    m = BlockManager(block_size, total // block_size + len(earlier_prompts) + 2, watermark=0.0,
                     enable_prefix_caching=True)
    for i, earlier in enumerate(earlier_prompts):
        m.allocate(i + 1, earlier)
        m.mark_blocks_as_computed(i + 1, len(earlier))
        m.free(i + 1)
    return m.allocate(0, prompt)


def _prompt(rng: random.Random, n: int, vocab: int = 3) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def check_block_hashes(fn: Callable[[list[int], int, Hashable], list[int]]) -> Verdict:
    rng = random.Random(8)
    cases = [([], 4, ()), ([1, 2, 3], 4, ()), ([1, 2, 3, 4], 4, ()), (list(range(9)), 4, ()),
             ([5, 5, 5, 5, 5, 5, 5, 5], 4, ()), ([1, 2, 3, 4], 4, "tenant-b"),
             ([1, 2, 3, 4], 4, ("lora", 7)), ([7], 1, ())]
    cases += [(_prompt(rng, rng.randrange(0, 40)), 2 ** rng.randrange(0, 4),
               rng.choice([(), "salt", 3])) for _ in range(30)]
    return check("6.1 block_hashes", fn, block_hashes, cases)


def check_num_cached_tokens(fn: Callable[[list[int], list[list[int]], int], int]) -> Verdict:
    rng = random.Random(9)
    sys_prompt = list(range(100, 112))                     # 3 blocks of 4
    cases = [(sys_prompt + [1, 2], [], 4),                 # cold cache
             (sys_prompt + [1, 2], [sys_prompt + [3]], 4),  # shared system prompt
             (sys_prompt, [sys_prompt], 4),                 # identical: the last token is kept
             (sys_prompt + [1], [sys_prompt], 4),           # one token past the cached blocks
             ([9] + sys_prompt, [sys_prompt], 4),           # a prefix that differs in token 0
             ([1, 2, 3], [[1, 2, 3, 4]], 4),                # no full block
             ([1, 2, 3, 4, 5, 6, 7, 8, 9], [[1, 2, 3, 4, 0, 6, 7, 8, 9]], 4)]
    for _ in range(30):
        bs = 2 ** rng.randrange(0, 3)
        base = _prompt(rng, rng.randrange(1, 20), vocab=2)
        earlier = [base[:rng.randrange(1, len(base) + 1)] + _prompt(rng, rng.randrange(0, 6), 2)
                   for _ in range(rng.randrange(0, 3))]
        cases.append((base + _prompt(rng, rng.randrange(0, 6), 2), earlier, bs))
    return check("6.2 num_cached_tokens", fn, num_cached_tokens, cases)


class CacheTTFT(NamedTuple):
    """Mean time to first token of one replay with the prefix cache off and one with it on."""

    ttft_off_s: float
    ttft_on_s: float
    hit_rate: float      # prompt tokens read from the cache, cache on

    @property
    def ttft_cut(self) -> float:
        return 1 - self.ttft_on_s / self.ttft_off_s


def ttft_with_and_without_cache(trace: Sequence[TraceRequest],
                                block_size: int = 16) -> CacheTTFT:
    """Replay ``trace`` (``sim.replay``: the V0 scheduler, the default ``CostModel``, a pool
    that never runs short) with prefix caching off, then on."""
    longest = max((t.prompt_len + t.output_len for t in trace), default=1)
    need = sum(-(-(t.prompt_len + t.output_len) // block_size) for t in trace) + 1
    runs = [replay(trace, SchedulerConfig(max_model_len=longest),
                   CacheConfig(block_size=block_size, num_gpu_blocks=need, watermark=0.0,
                               enable_prefix_caching=on)) for on in (False, True)]
    return CacheTTFT(runs[0].ttft_mean, runs[1].ttft_mean, runs[1].prefix_cache_hit_rate)
