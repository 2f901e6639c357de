"""Chapter 05 exercises: which block a write must copy, how many blocks sharing saves, and a
copy-on-write block manager (allocate, fork, append, free with reference counts).

The expected answers come from running a real ``BlockManager`` (fork, append_slots, free), not
from a second copy of the rule. Exercise 5.3's checker follows 3.3's: random operation
sequences, and a failure replays the operations that led to it. :func:`cow_scenarios` counts
the copies the V0 scheduler asks for in three workloads (forked samples, a shared prefix,
preemption by recompute): only forks copy.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import NamedTuple

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.exercises import Exercise, Exercises, Verdict, check, pool_history, replay_ops
from course_lib.exercises.solutions import ch05 as solutions
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


class ReferenceCow:
    """Exercise 5.3's contract, on the library's ``BlockManager`` (no prefix caching)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.m = BlockManager(block_size, num_blocks, watermark=0.0)

    def allocate(self, seq: int, num_tokens: int) -> None:
        self.m.allocate(seq, [0] * num_tokens)

    def fork(self, parent: int, child: int) -> None:
        self.m.fork(parent, child)

    def append(self, seq: int) -> tuple[int, int] | None:
        copies = self.m.append_slots(seq, [0])
        return copies[0] if copies else None

    def free(self, seq: int) -> None:
        self.m.free(seq)

    def block_table(self, seq: int) -> list[int]:
        return self.m.get_block_table(seq)

    def ref_count(self, block: int) -> int:
        return self.m.ref_count(block)


def cow_cases(seed: int = 10, count: int = 30) -> list[tuple[int, int, list[tuple]]]:
    """(num_blocks, block_size, ops); ops are ("allocate", seq, num_tokens), ("fork", parent,
    child), ("append", seq), ("free", seq), always valid and always with a free block."""
    rng = random.Random(seed)
    cases: list[tuple[int, int, list[tuple]]] = [
        (8, 4, [("allocate", 0, 18), ("fork", 0, 1), ("append", 0), ("append", 1)]),  # §11.2
        (8, 4, [("allocate", 0, 16), ("fork", 0, 1), ("append", 0), ("append", 1)]),  # full
        (8, 4, [("allocate", 0, 6), ("fork", 0, 1), ("fork", 0, 2), ("append", 1),
                ("append", 2), ("append", 0), ("append", 0)]),                        # 3 sharers
        (8, 2, [("allocate", 0, 3), ("fork", 0, 1), ("free", 0), ("append", 1)]),      # sole owner
        (6, 4, [("allocate", 0, 9), ("allocate", 1, 2), ("free", 0), ("allocate", 2, 5)]),
        (6, 1, [("allocate", 0, 2), ("fork", 0, 1), ("append", 1), ("free", 1), ("free", 0)]),
    ]
    for _ in range(count):
        bs = rng.choice([1, 2, 4])
        n = rng.randrange(6, 16)
        ref, live, next_id, ops = ReferenceCow(n, bs), [], 0, []
        for _ in range(rng.randrange(8, 30)):
            free = ref.m.num_free_gpu_blocks
            r = rng.random()
            if not live and not free:
                break
            if not live or (r < 0.15 and free >= 3):
                tokens = rng.randrange(1, min(free, 3) * bs + 1)
                op = ("allocate", next_id, tokens)
                live.append(next_id)
                next_id += 1
            elif r < 0.35:
                op = ("fork", rng.choice(live), next_id)
                live.append(next_id)
                next_id += 1
            elif r < 0.85:
                op = ("append", rng.choice(live))
                if not ref.m.can_append_slots(op[1]):
                    op = ("free", op[1])
            else:
                op = ("free", rng.choice(live))
            if op[0] == "free":
                live.remove(op[1])
            getattr(ref, op[0])(*op[1:])
            ops.append(op)
        cases.append((n, bs, ops))
    return cases


def _state(obj, seqs: list[int], num_blocks: int) -> tuple[dict, list[int]]:
    return {s: list(obj.block_table(s)) for s in seqs}, [obj.ref_count(b)
                                                          for b in range(num_blocks)]


def _difference(got: tuple, want: tuple) -> str:
    """The first difference between two (returned, tables, ref counts), in words."""
    (g_ret, g_tables, g_refs), (w_ret, w_tables, w_refs) = got, want
    if g_ret != w_ret:
        why = ("a write into a shared partial block must copy it first"
               if w_ret is not None and g_ret is None else
               "only a shared, partial last block is copied" if w_ret is None else
               "the copy takes the top of the free stack")
        return f"returned {g_ret!r}, the library {w_ret!r} ({why})"
    for seq, table in w_tables.items():
        if g_tables[seq] != table:
            return f"seq {seq}'s block table is {g_tables[seq]}, the library's {table}"
    b = next(i for i, (g, w) in enumerate(zip(g_refs, w_refs, strict=True)) if g != w)
    return (f"block {b} has ref count {g_refs[b]}, the library {w_refs[b]} (every table that "
            f"points at a block counts once; a copy or a free drops one reference)")


def _live(ops: list[tuple], i: int) -> list[int]:
    """The sequences alive after operations ``0..i``."""
    live: list[int] = []
    for op in ops[:i + 1]:
        if op[0] in ("allocate", "fork"):
            live.append(op[1] if op[0] == "allocate" else op[2])
        elif op[0] == "free":
            live.remove(op[1])
    return live


def _cow_outcome(obj, setup: tuple, ops: list[tuple], i: int) -> tuple:
    """Apply operation ``i``; what it returned, every live table and every ref count."""
    ret = getattr(obj, ops[i][0])(*ops[i][1:])
    return (tuple(ret) if isinstance(ret, list) else ret, *_state(obj, _live(ops, i), setup[0]))


def check_cow_manager(cls: type) -> Verdict:
    """Run the same operations on ``cls(num_blocks, block_size)`` and on the library; after
    every operation compare what it returned, every live block table and every ref count."""
    return replay_ops("5.3 CowManager", cow_cases(), cls, ReferenceCow, _cow_outcome,
                      pool_history(_difference))


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
def _copies_a_full_block(block_table, num_tokens, ref_counts, block_size):
    """Wrong: copies a shared last block even when it is full (the token opens a new one)."""
    return block_table[-1] if ref_counts[block_table[-1]] > 1 else None


def _copies_every_partial_block(block_table, num_tokens, ref_counts, block_size):
    """Wrong: forgets to ask whether the partial last block is shared at all."""
    return block_table[-1] if num_tokens % block_size else None


def _no_sharing(num_samples, prompt_len, gen_len, block_size):
    """Wrong: every sample holds its own copy of everything."""
    return num_samples * -(-(prompt_len + gen_len) // block_size)


def _partial_block_shared_forever(num_samples, prompt_len, gen_len, block_size):
    """Wrong: counts the prompt's partial block once, as if nobody wrote into it."""
    prompt_blocks = -(-prompt_len // block_size)
    return prompt_blocks + num_samples * (-(-(prompt_len + gen_len) // block_size)
                                          - prompt_blocks)


class _FreesHeadFirst(solutions.CowManager):
    """Wrong: free releases the first block first, so the free stack ends in another order."""

    def free(self, seq):
        for block in self.tables.pop(seq):
            self._drop(block)
        del self.lens[seq]


class _CopyKeepsTheReference(solutions.CowManager):
    """Wrong: after a copy the source block keeps the writer's reference (it leaks)."""

    def append(self, seq):
        table, n = self.tables[seq], self.lens[seq]
        if n % self.block_size and self.refs[table[-1]] > 1:
            src = table[-1]
            table[-1] = self._take()
            self.lens[seq] = n + 1
            return (src, table[-1])
        return super().append(seq)


class _FreeIgnoresSharing(solutions.CowManager):
    """Wrong: free returns every block to the pool, even those another table still uses."""

    def free(self, seq):
        for block in reversed(self.tables.pop(seq)):
            if self.refs[block] > 0:
                self.refs[block] = 0
                self.free_stack.append(block)
        del self.lens[seq]


class _DoesNothing:
    def __init__(self, num_blocks, block_size):
        pass

    def allocate(self, *args):
        return None

    fork = append = free = block_table = ref_count = allocate


EXERCISES = Exercises(
    Exercise("5.1", "block_to_copy", check_block_to_copy, hints=(
        "Two questions decide it: does the new token go into the last block at all, and does "
        "anybody else point at that block?",
        "num_tokens % block_size == 0 means the last block is full: the token opens a new "
        "block and nothing is copied. Otherwise the last block is copied only if its ref "
        "count is above 1.",
        "Read BlockManager._append_need in course_lib/memory/manager.py: the same two tests.",
    ), solution=solutions.block_to_copy, wrong=(_copies_a_full_block,
                                                _copies_every_partial_block)),
    Exercise("5.2", "blocks_held", check_blocks_held, hints=(
        "Split the prompt into its full blocks (shared by every sample for ever) and the rest "
        "(each sample writes there, so each ends with its own copy).",
        "After the first write, each sample holds ceil((prompt_len + gen_len) / block_size) - "
        "prompt_len // block_size blocks of its own. With gen_len = 0 nobody wrote: the "
        "partial block is still shared.",
        "Compare with capacity.blocks_with_shared_prefix in course_lib/capacity.py, then "
        "BlockManager.append_slots in course_lib/memory/manager.py.",
    ), solution=solutions.blocks_held, wrong=(_no_sharing, _partial_block_shared_forever)),
    Exercise("5.3", "CowManager", check_cow_manager, hints=(
        "Start from the toy on the page (tables, lens, refs, a free stack) and put it in a "
        "class; what is new is free(): it drops one reference per block of the table.",
        "A block goes back on the free stack only when its ref count reaches 0. free() walks "
        "the table from its last block to its first; a copy takes the top of the free stack, "
        "then drops the writer's reference to the source block.",
        "Read BlockManager.append_slots, fork and free in course_lib/memory/manager.py, and "
        "BlockAllocator.touch / release in course_lib/memory/pool.py.",
    ), solution=solutions.CowManager, wrong=(_FreesHeadFirst, _CopyKeepsTheReference,
                                             _FreeIgnoresSharing), trivial=(_DoesNothing,)),
)


hint = EXERCISES.print_hint            # ch05.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch05.solution("N.M"): a solution's code
