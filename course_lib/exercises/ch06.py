"""Chapter 06 exercises: the LRU order of cached blocks, and a prefix-caching pool.

References run the library: ``BlockAllocator.release`` for the LRU order, a ``BlockManager``
with prefix caching for the pool (6.2's checker follows 3.3's: random operation sequences, a
failure replays the operations that led to it). :func:`ttft_with_and_without_cache` replays a
multi-turn chat trace with the cache off and on.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import NamedTuple

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.exercises import Exercise, Exercises, Rule, Verdict, check, pool_history, replay_ops
from course_lib.exercises.solutions import ch06 as solutions
from course_lib.memory.v0.manager import BlockManager
from course_lib.memory.v0.pool import BlockAllocator
from course_lib.sim.replay import replay
from course_lib.sim.traces import TraceRequest
from course_lib.sizing.units import cdiv


# ------------------------------------------------------------------ 6.1 the LRU order
def lru_order(finished_tables: list[list[int]]) -> list[int]:
    """Reference: every table's blocks held at once (a block in k tables has ref count k), all
    cached; then the requests finish in the order given (``BlockManager.free`` releases a table
    from its last block). Returns the pool's evictable blocks, next victim first."""
    blocks = {b for table in finished_tables for b in table}
    pool = BlockAllocator("gpu", max(blocks, default=-1) + 1)
    every = pool.allocate_n(pool.num_blocks)          # each id held once, then once per table
    for table in finished_tables:
        pool.touch(table)
    pool.release(every)                               # ids in no table become free
    for table in finished_tables:
        pool.release(reversed(table), cached=set(blocks))
    return pool.evictable_block_ids()


def _tables(rng: random.Random) -> list[list[int]]:
    """Requests that share prefixes: each table starts with a prefix of an earlier one."""
    ids = rng.sample(range(40), 40)
    tables: list[list[int]] = []
    for _ in range(rng.randrange(1, 6)):
        shared = []
        if tables and rng.random() < 0.7:
            other = rng.choice(tables)
            shared = other[:rng.randrange(0, len(other) + 1)]
        own = [ids.pop() for _ in range(rng.randrange(0 if shared else 1, 5))]
        tables.append(shared + own)
    return tables


def check_lru_order(fn: Callable[[list[list[int]]], list[int]]) -> Verdict:
    rng = random.Random(8)
    cases = [([[0, 1, 2, 3]],),                          # the page's X: [3, 2, 1, 0]
             ([[0, 1, 2], [3, 4]],),
             ([[0, 1, 2], [0, 1, 5]],),                  # 0 and 1 wait for the second one
             ([[0, 1, 5], [0, 1, 2]],),
             ([[7, 2, 9], [7, 2, 9]],),                  # the same blocks twice
             ([[0, 1], [0, 1, 2, 3], [0, 4]],),
             ([],)]
    cases += [(_tables(rng),) for _ in range(30)]
    return check("6.1 lru_order", fn, lru_order, cases)


# ------------------------------------------------------------- 6.2 a prefix-caching pool
class ReferencePool:
    """Exercise 6.2's contract on a ``BlockManager`` with prefix caching: ``run`` allocates a
    prompt and marks it all computed, ``finish`` frees the request."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.m = BlockManager(block_size, num_blocks, watermark=0.0, enable_prefix_caching=True)

    def run(self, seq: int, prompt: list[int]) -> int:
        cached = self.m.allocate(seq, prompt)
        self.m.mark_blocks_as_computed(seq, len(prompt))
        return cached

    def finish(self, seq: int) -> None:
        self.m.free(seq)

    def block_table(self, seq: int) -> list[int]:
        return self.m.get_block_table(seq)

    def lru_order(self) -> list[int]:
        return self.m.gpu.evictable_block_ids()


def pool_cases(seed: int = 9, count: int = 30) -> list[tuple[int, int, list[tuple]]]:
    """(num_blocks, block_size, ops): ("run", seq, prompt) or ("finish", seq); every run fits
    (``can_allocate`` says OK) when it is asked for."""
    from course_lib.memory.common import AllocStatus

    cases: list[tuple[int, int, list[tuple]]] = [
        (6, 4, [("run", 0, list(range(1, 17))), ("finish", 0),               # the page's LRU
                ("run", 1, list(range(50, 62))), ("finish", 1), ("run", 2, list(range(1, 17)))]),
        (8, 4, [("run", 0, [1] * 8 + [2]), ("run", 1, [1] * 8 + [3]), ("finish", 0),
                ("finish", 1), ("run", 2, [1] * 8)]),                        # the cap
        (4, 2, [("run", 0, [1, 2, 3, 4]), ("finish", 0), ("run", 1, [1, 2, 3, 4]),
                ("finish", 1), ("run", 2, [5, 6, 7, 8, 9, 9])]),  # a full block not cached twice
        (3, 1, [("run", 0, [1, 2, 3]), ("finish", 0), ("run", 1, [2, 3]), ("finish", 1),
                ("run", 2, [1, 2, 9])]),                                     # evictions
    ]
    rng = random.Random(seed)
    for _ in range(count):
        bs = rng.choice([1, 2, 4])
        n = rng.randrange(4, 12)
        prefixes = [[rng.randrange(3) for _ in range(rng.randrange(0, 3 * bs))]
                    for _ in range(3)]
        ref, live, next_id, ops = ReferencePool(n, bs), [], 0, []
        for _ in range(rng.randrange(6, 25)):
            prompt = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(1,
                                                                                     2 * bs + 1))]
            if (live and rng.random() < 0.4) or ref.m.can_allocate(prompt) != AllocStatus.OK:
                if not live:
                    continue
                op: tuple = ("finish", live.pop(rng.randrange(len(live))))
            else:
                op = ("run", next_id, prompt)
                live.append(next_id)
                next_id += 1
            getattr(ref, op[0])(*op[1:])
            ops.append(op)
        cases.append((n, bs, ops))
    return cases


def _difference(got: tuple, want: tuple) -> str:
    (g_ret, g_table, g_lru), (w_ret, w_table, w_lru) = got, want
    if g_ret != w_ret:
        return (f"returned {g_ret!r} cached tokens, the library {w_ret!r} (walk the chain from "
                f"the first block, stop at the first miss, and leave one token to compute)")
    if g_table != w_table:
        return (f"gave the table {g_table}, the library {w_table} (hits first; new blocks from "
                f"the free stack, and only when it is empty the least recently used cached one)")
    return (f"left the LRU order {g_lru}, the library {w_lru} (a finished table is released "
            f"from its last block; a hit leaves the LRU; a block cached twice is not cached "
            f"again, it is freed)")


def _pool_outcome(obj, setup: tuple, ops: list[tuple], i: int) -> tuple:
    """Apply operation ``i``; what it returned, the request's table (after a run), the LRU."""
    op = ops[i]
    ret = getattr(obj, op[0])(*op[1:])
    return (ret, list(obj.block_table(op[1])) if op[0] == "run" else None,
            list(obj.lru_order()))


def check_prefix_pool(cls: type) -> Verdict:
    """Run the same operations on ``cls(num_blocks, block_size)`` and the library; after each,
    compare what it returned, the request's block table (after a run) and the LRU order."""
    return replay_ops("6.2 PrefixPool", pool_cases(), cls, ReferencePool, _pool_outcome,
                      pool_history(_difference))


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
    need = sum(cdiv(t.prompt_len + t.output_len, block_size) for t in trace) + 1
    runs = [replay(trace, SchedulerConfig(max_model_len=longest),
                   CacheConfig(block_size=block_size, num_gpu_blocks=need, watermark=0.0,
                               enable_prefix_caching=on)) for on in (False, True)]
    return CacheTTFT(runs[0].ttft_mean, runs[1].ttft_mean, runs[1].prefix_cache_hit_rate)


# ----------------------------------------------------------------- the registry
def _released_head_first(finished_tables):
    """Wrong: releases a finished table from its first block (the chain's start goes first)."""
    return solutions.lru_order([list(reversed(t)) for t in finished_tables])


def _no_ref_counts(finished_tables):
    """Wrong: a block becomes evictable when the first table holding it finishes."""
    order = []
    for table in finished_tables:
        order += [b for b in reversed(table) if b not in order]
    return order


def _newest_first(finished_tables):
    """Wrong: lists the LRU most recent first (the last block to go, first)."""
    return solutions.lru_order(finished_tables)[::-1]


class _EvictsTheNewest(solutions.PrefixPool):
    """Wrong: evicts the most recently released cached block, not the least recent."""

    def _new_block(self):
        if self.free_stack or not self.lru:
            return super()._new_block()
        block = list(self.lru)[-1]
        del self.lru[block]
        del self.cache[self.hash_of.pop(block)]
        self.refs[block] = 1
        return block


class _NoCap(solutions.PrefixPool):
    """Wrong: reuses every cached full block, leaving the model no token to run on."""

    def run(self, seq, prompt):
        hashes, hits = self._hashes(prompt), []
        for h in hashes:
            if h not in self.cache:
                break
            hits.append(self.cache[h])
        if len(hits) * self.block_size < len(prompt) or not hits:
            return super().run(seq, prompt)
        for block in hits:
            self.lru.pop(block, None)
            self.refs[block] += 1
        self.tables[seq] = hits
        return len(prompt)


class _FinishesHeadFirst(solutions.PrefixPool):
    """Wrong: a finished table is released from its first block."""

    def finish(self, seq):
        self.tables[seq].reverse()
        super().finish(seq)


class _DoesNothing:
    def __init__(self, *args):
        pass

    def run(self, *args):
        return None

    finish = block_table = lru_order = run


EXERCISES = Exercises(
    Exercise("6.1", "lru_order", check_lru_order, hints=(
        "Count references first: a block that appears in k tables has ref count k while they "
        "all run. It becomes evictable when the last of them finishes, not before.",
        "Walk each finished table from its last block to its first; every block whose count "
        "reaches 0 goes to the end of the list (the end is evicted last).",
    ), solution=solutions.lru_order, rules=(
        Rule("BlockManager.free releases a table from its last block to its first",
             "([[0, 1, 2, ",
             _released_head_first),
        Rule("a block becomes evictable when the last table holding it is released",
             "([[0, 1, 2], [0,",
             _no_ref_counts),
        Rule("the LRU list starts with the next victim (the least recently released)",
             "([[0, 1, 2, ",
             _newest_first),
    ), compare_with=(
        "BlockManager.free in course_lib/memory/v0/manager.py and BlockAllocator.release in "
        "course_lib/memory/v0/pool.py (an OrderedDict keeps the LRU)")),
    Exercise("6.2", "PrefixPool", check_prefix_pool, hints=(
        "Four pieces of state: the free stack, a ref count per block, the LRU of cached blocks "
        "at ref 0 (a dict keeps insertion order) and the cache, hash -> block (and back). "
        "toy_block_hashes and toy_cached_tokens on the page do the hashing and the lookup.",
        "run: touch the hits (a hit at ref 0 leaves the LRU), then take the new blocks: the "
        "free stack's top, or when it is empty the LRU's first block, whose hash you forget. "
        "Then cache each full block whose hash is not cached yet. finish: release the table "
        "from its last block; a cached block goes to the LRU's end, any other to the stack.",
    ), solution=solutions.PrefixPool, rules=(
        Rule("with the free stack empty, new blocks come from the front of the LRU",
             "(6, 4, [('run', 0, [1, 2",
             _EvictsTheNewest),
        Rule("leave at least one token to compute",
             "(8, 4, [('run', 0, [1, 1",
             _NoCap),
        Rule("finish releases the table from its last block to its first",
             "(6, 4, [('run', 0, [1, 2",
             _FinishesHeadFirst),
    ),
        trivial=(_DoesNothing,), compare_with=(
        "BlockManager.allocate and free in course_lib/memory/v0/manager.py, "
        "BlockAllocator.allocate_n / release in course_lib/memory/v0/pool.py and "
        "PrefixCache.register in course_lib/memory/v0/prefix_cache.py")),
)


hint = EXERCISES.print_hint            # ch06.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch06.solution("N.M"): a solution's code
