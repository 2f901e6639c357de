"""Exercise 12.3: vLLM V1's ``allocate_slots`` for one request, over a real ``BlockPool``.

The learner writes ``allocate_slots(pool, req, num_new_tokens, hits, block_size,
watermark_blocks)``. The checker plays the scheduler: it replays operation sequences
(``step(seq, num_new_tokens)``: look up the prefix hits of a request that holds no blocks, then
call ``allocate_slots``; ``free(seq)``: give its blocks back, tail first) on the learner's
function over one ``BlockPool`` and on the library's ``KVCacheManager``, and after each one
compares what it returned, every request's blocks and ``num_cached_block``, the free queue's
order, every ref count and which blocks are cached. The first difference is told with the
history that led to it, the room the step had (free blocks, hits with ref count 0, watermark)
and, where it can tell, the idea that was missed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from course_lib.exercises import Verdict, replay_ops
from course_lib.memory.v1.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from course_lib.memory.v1.kv_cache_manager import KVCacheManager
from course_lib.sizing.units import cdiv


def chain_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """The hash of every full block of ``token_ids``, chained (``hash_block_tokens``)."""
    hashes: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                        token_ids[i * block_size:(i + 1) * block_size]))
    return hashes


@dataclass
class Request:
    """A V1 request as ``allocate_slots`` sees it (vLLM's ``Request`` plus the manager's
    per-request entries): ``blocks`` is its block table, ``num_cached_block`` how many of its
    leading blocks are entered in the prefix cache, ``block_hashes`` the hash of every full
    block of its tokens. The scheduler (the checker) advances ``num_computed_tokens``."""
    seq_id: int
    token_ids: list[int]
    block_hashes: list[bytes]
    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_block: int = 0


def _pool_state(pool: BlockPool) -> tuple:
    return ([b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            [b.ref_cnt for b in pool.blocks], [b.block_hash is not None for b in pool.blocks])


class LearnerRun:
    """The scheduler around the learner's function: one pool, one ``Request`` per prompt."""

    def __init__(self, fn: Callable, num_blocks: int, block_size: int, watermark: int,
                 prompts: tuple) -> None:
        self.fn, self.block_size, self.watermark = fn, block_size, watermark
        self.pool = BlockPool(num_blocks)
        self.reqs = [Request(s, list(p), chain_hashes(list(p), block_size))
                     for s, p in enumerate(prompts)]

    def step(self, seq: int, n: int) -> list[int] | None:
        req, bs = self.reqs[seq], self.block_size
        hits: list[KVCacheBlock] = []
        if not req.blocks:                      # waiting: V1's get_computed_blocks
            for h in req.block_hashes[:(len(req.token_ids) - 1) // bs]:
                block = self.pool.get_cached_block(h)
                if block is None:
                    break
                hits.append(block)
        done = req.num_computed_tokens
        got = self.fn(self.pool, req, n, list(hits), bs, self.watermark)
        if got is None:
            return None
        req.num_computed_tokens = done + len(hits) * bs + n
        return [getattr(b, "block_id", b) for b in got]

    def free(self, seq: int) -> None:
        req = self.reqs[seq]
        self.pool.free_blocks(reversed(req.blocks))
        req.blocks, req.num_computed_tokens, req.num_cached_block = [], 0, 0

    def state(self) -> tuple:
        return ([[b.block_id for b in r.blocks] for r in self.reqs],
                [r.num_cached_block for r in self.reqs], *_pool_state(self.pool))


class LibraryRun:
    """The same scheduler around the library's ``KVCacheManager``."""

    def __init__(self, num_blocks: int, block_size: int, watermark: int, prompts: tuple) -> None:
        self.m = KVCacheManager(block_size, num_blocks)
        self.m.watermark_blocks = watermark
        self.prompts = [list(p) for p in prompts]
        self.done = [0] * len(prompts)

    def room(self, seq: int, n: int) -> dict:
        """What step(seq, n) would see: hits, free blocks, the blocks it needs."""
        m, bs = self.m, self.m.block_size
        held = m.req_to_blocks.get(seq, [])
        hits = [] if held else m.get_computed_blocks(seq, self.prompts[seq])[0]
        total = self.done[seq] + len(hits) * bs + n
        return dict(admission=not held, hits=hits, total=total, free=m.num_free_gpu_blocks,
                    new=cdiv(total, bs) - len(held) - len(hits),
                    evictable=[b.block_id for b in hits if b.ref_cnt == 0])

    def step(self, seq: int, n: int) -> list[int] | None:
        room = self.room(seq, n)
        before = len(self.m.req_to_blocks.get(seq, [])) + len(room["hits"])
        ids = self.m.allocate_slots(seq, self.prompts[seq], self.done[seq], n, room["hits"],
                                    admission=room["admission"])
        if ids is None:
            return None
        self.done[seq] = room["total"]
        return ids[before:]

    def free(self, seq: int) -> None:
        self.m.free(seq)
        self.done[seq] = 0

    def state(self) -> tuple:
        m = self.m
        return ([m.get_block_table(s) if m.has_seq(s) else [] for s in range(len(self.done))],
                [m.num_cached_block.get(s, 0) for s in range(len(self.done))],
                *_pool_state(m.block_pool))


# ------------------------------------------------------------------------ the cases
EDGE_CASES = [
    # evictable hits: seq 0 comes back to find its blocks 0, 1 in the free queue, 2 free in all
    (5, 4, 0, (list(range(1, 13)), list(range(20, 32))),
     [("step", 0, 12), ("free", 0), ("step", 1, 12), ("step", 0, 4), ("free", 1),
      ("step", 0, 4)]),
    # hits held by a running request cost no free block
    (4, 4, 0, (list(range(1, 10)), list(range(1, 9)) + [20, 21, 22, 23]),
     [("step", 0, 9), ("step", 1, 4)]),
    # the watermark: an admission must leave 2 blocks free, a running request may use them
    (6, 2, 2, (list(range(1, 11)), list(range(20, 28))),
     [("step", 0, 8), ("step", 1, 2), ("step", 0, 2), ("free", 0), ("step", 1, 2)]),
    # only full blocks are cached, the partial last one once it fills
    (4, 4, 0, (list(range(1, 11)),), [("step", 0, 6), ("step", 0, 1), ("step", 0, 3)]),
    # a block size of 1, an exact fit, then no room for one more token
    (3, 1, 0, ([5, 6, 7, 8], [5, 6, 9]), [("step", 0, 3), ("step", 0, 1), ("step", 1, 1),
                                          ("free", 0), ("step", 1, 1)]),
    # a whole prompt in the cache: the last token is computed again, its block is new
    (4, 2, 1, ([1, 2, 3, 4], [1, 2, 3, 4]), [("step", 0, 4), ("free", 0), ("step", 1, 2),
                                             ("step", 0, 2)]),
]


def random_case(rng: random.Random) -> tuple:
    """Prompts sharing a document's prefix, in a pool small enough to run out; the ops are
    drawn by a scheduler that admits, steps, finishes and preempts."""
    bs = rng.choice([1, 2, 4])
    num_blocks = rng.randint(4, 9)
    watermark = rng.choice([0, 0, 1, 2])
    doc = [rng.randrange(1, 5) for _ in range(4 * bs)]
    prompts = tuple(doc[:rng.randint(0, 4 * bs)] + [rng.randrange(5, 60) for _ in range(
        rng.randint(1, 2 * bs))] for _ in range(rng.randint(2, 3)))
    lib, ops = LibraryRun(num_blocks, bs, watermark, prompts), []
    for _ in range(rng.randint(6, 12)):
        seq = rng.randrange(len(prompts))
        held = lib.m.has_seq(seq)
        if held and (lib.done[seq] == len(prompts[seq]) or rng.random() < 0.2):
            op = ("free", seq)
        else:
            left = len(prompts[seq]) - lib.done[seq] - len(lib.room(seq, 1)["hits"]) * bs
            op = ("step", seq, rng.randint(1, min(left, 3 * bs)))
        getattr(lib, op[0])(*op[1:])
        ops.append(op)
    return (num_blocks, bs, watermark, prompts, ops)


def allocate_cases(seed: int = 123, count: int = 40) -> list[tuple]:
    rng = random.Random(seed)
    return [*EDGE_CASES, *(random_case(rng) for _ in range(count))]


# ------------------------------------------------------------------------ feedback
def _outcome(obj, setup: tuple, ops: list[tuple], i: int) -> tuple:
    ret = getattr(obj, ops[i][0])(*ops[i][1:])
    return (ret, *obj.state())


def _op(op: tuple) -> str:
    return f"step(seq {op[1]}, {op[2]} new tokens)" if op[0] == "step" else f"free(seq {op[1]})"


def _room_text(room: dict, watermark: int) -> str:
    hits = [b.block_id for b in room["hits"]]
    return (f"seq {'being admitted' if room['admission'] else 'running'}, "
            f"{room['total']} tokens need slots, prefix hits {hits} (with ref count 0: "
            f"{room['evictable']}), new blocks needed: {room['new']}, free blocks: "
            f"{room['free']}, watermark: {watermark}")


def _why(got, want, room: dict, watermark: int) -> str:
    """The concept behind a difference in what step() returned."""
    reserve = watermark if room["admission"] else 0
    cost = room["new"] + len(room["evictable"])
    if want is None and got is not None:
        if cost <= room["free"] and reserve:
            return f"an admission must leave the watermark's {watermark} blocks free"
        if room["new"] <= room["free"] - reserve:
            return ("a hit block with ref count 0 sits in the free queue: taking it uses a "
                    f"free block, so this step needs {cost} free blocks, "
                    f"{room['free'] - reserve} may be used")
        return f"it needs {cost} free blocks, {room['free'] - reserve} may be used"
    if want is not None and got is None:
        if not room["admission"] and watermark and cost > room["free"] - watermark:
            return ("the watermark holds blocks back from admissions only; a running request "
                    "may use them")
        if len(room["hits"]) > len(room["evictable"]):
            return ("a hit block already held by another request (ref count > 0) is not in "
                    "the free queue and costs no free block")
        return f"there is room: {cost} blocks needed, {room['free'] - reserve} may be used"
    return ("the new blocks come from the front of the free queue, taken after the hits are "
            "touched (else a hit can be handed out as a new block)")


def _state_diff(got: tuple, want: tuple) -> str:
    """The first difference between two states (tables, num_cached_block, pool), in words."""
    (g_tables, g_cached, g_queue, g_refs, g_hash), (w_tables, w_cached, w_queue, w_refs,
                                                    w_hash) = got, want
    for s, (g, w) in enumerate(zip(g_tables, w_tables, strict=True)):
        if g != w:
            return (f"seq {s}'s blocks are {g}, the library's {w} (the blocks it held, then "
                    "the hits, then the new ones)")
    for b, (g, w) in enumerate(zip(g_hash, w_hash, strict=True)):
        if g != w:
            what = ("cached, the library's is not: only full blocks of computed tokens are "
                    "cached (total // block_size of them)" if g else
                    "not cached, the library's is: every full block of computed tokens enters "
                    "the cache this step (pool.cache_full_blocks)")
            return f"block {b} is {what}"
    for s, (g, w) in enumerate(zip(g_cached, w_cached, strict=True)):
        if g != w:
            return (f"seq {s}'s num_cached_block is {g}, the library's {w} (the number of its "
                    f"full blocks: tokens with slots // block_size)")
    for b, (g, w) in enumerate(zip(g_refs, w_refs, strict=True)):
        if g != w:
            return (f"block {b} has ref count {g}, the library's {w} (touch each hit once, "
                    "new blocks start at 1)")
    return (f"the free queue is {g_queue}, the library's {w_queue} (touch the hits, which "
            "unlinks the free ones, before taking new blocks from the front)")


def explain(setup: tuple, ops: list[tuple], i: int, got, want) -> str:
    num_blocks, bs, watermark, prompts = setup
    lib = LibraryRun(*setup)
    for op in ops[:i]:
        getattr(lib, op[0])(*op[1:])
    room = lib.room(*ops[i][1:]) if ops[i][0] == "step" else None
    before = ", ".join(_op(op) for op in ops[:i]) or "nothing"
    head = (f"pool of {num_blocks} blocks of {bs} tokens, watermark {watermark}, prompts "
            f"{[list(p) for p in prompts]}; after {before}: {_op(ops[i])}")
    if room is not None:
        head += f" ({_room_text(room, watermark)})"
    if isinstance(got, str):
        why = ""
        if room is not None and want[0] is None:
            why = f" ({_why([], None, room, watermark)})"
        elif "IndexError" in got:
            why = (" (req.block_hashes has one hash per full block of the prompt: is a "
                   "partial block being cached?)")
        return f"{head} {got}; the library returns {want[0]}{why}" if room else f"{head} {got}"
    if got[0] != want[0]:
        why = _why(got[0], want[0], room, watermark) if room else ""
        if got[0] is not None and want[0] is not None and got[0] == got[1][ops[i][1]]:
            why = "return only the blocks this step took from the pool, not the whole table"
        return f"{head} returned {got[0]}, the library {want[0]} ({why})"
    what = _state_diff(got[1:], want[1:])
    if want[0] is None and room is not None:
        what += "; a step that returns None must change nothing"
    return f"{head}: {what}"


def check_allocate_slots(fn: Callable) -> Verdict:
    """Replay the cases on ``fn`` over a ``BlockPool`` and on the library's
    ``KVCacheManager``; compare after every operation (module docstring)."""
    return replay_ops("12.3 allocate_slots", allocate_cases(),
                      lambda *setup: LearnerRun(fn, *setup), LibraryRun, _outcome, explain)
