"""The scheduler's twin (``FastBlockManager``, memory/v0/fast.py) against the plain
``BlockManager`` the chapters teach (memory/v0/manager.py): the same answers, the same state.

Hypothesis drives both managers with one random sequence of the calls a scheduler makes
(probe and allocate prompts, groups, decode steps of groups, chunks, forks, marks, frees,
swaps out and in, resets), some of them made without room (``NoFreeBlocksError``), with and
without prefix caching, with Python's hash and with a 3-valued hash (collisions all the time).
After every call the answers (a value, or the exception's type and message) and the whole
public state (``memory_helpers.snapshot``: pools, free stack, LRU, tables, cache keys,
generations, counters) must be equal, both managers' invariants must hold, and the block-id
lists the twin's ``append_decode`` hands out must be its tables' own ``blocks`` lists (no
copy, so that a decode step costs the same at any length). The harness is proven on twins
broken on purpose (``test_the_twin_check_catches_a_broken_twin``).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memory_helpers import snapshot
from property_budget import examples

from course_lib.memory.common import AllocStatus
from course_lib.memory.v0.fast import FastBlockManager
from course_lib.memory.v0.manager import BlockManager
from course_lib.memory.v0.pool import NoFreeBlocksError

pytestmark = pytest.mark.ch03

PREFIXES = [(1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 2, 3, 4, 7, 7), (5, 5, 5, 5, 5, 5, 5, 5)]
OPS = ["probe", "admit", "admit", "admit", "group", "decode", "decode", "decode", "decode",
       "chunk", "can_append", "fork", "split", "mark", "free", "free", "swap_out", "swap_in",
       "reset"]


def weak_hash(parent, tokens, extra):
    return hash((parent, tokens, extra)) % 3


def answer(m: BlockManager, name: str, *args):
    """What a call returns, or which error it raises and why (compared between managers)."""
    try:
        return "ok", getattr(m, name)(*args)
    except NoFreeBlocksError as exc:
        return type(exc).__name__, str(exc)


class Twins:
    """A plain manager and a twin, driven alike; ``call`` compares what they answer."""

    def __init__(self, twin_class: type[BlockManager], bs: int, gpu: int, cpu: int,
                 caching: bool, watermark: float, weak: bool) -> None:
        self.plain = BlockManager(bs, gpu, cpu, watermark, caching)
        self.twin = twin_class(bs, gpu, cpu, watermark, caching)
        if caching and weak:
            self.plain.cache.hash_fn = self.twin.cache.hash_fn = weak_hash
    def call(self, name: str, *args):
        want = answer(self.plain, name, *args)
        got = answer(self.twin, name, *args)
        assert got == want, f"{name}{args}: twin answered {got}, plain {want}"
        if name == "append_decode" and got[0] == "ok" and got[1] is not None:
            assert all(ids is self.twin.get_table(s).blocks
                       for s, ids in zip(args[0], got[1][1], strict=True)), \
                "a handed-out block list is a copy, not the table's own"
        return got

    def check(self) -> None:
        assert snapshot(self.twin) == snapshot(self.plain), "the twin's state differs"
        self.plain.check_invariants()
        self.twin.check_invariants()


def drive(twin_class: type[BlockManager], bs, gpu, cpu, caching, watermark, weak, ops) -> None:
    t = Twins(twin_class, bs, gpu, cpu, caching, watermark, weak)
    groups: dict[int, list[int]] = {}      # request -> its live seq ids (all on one device)
    next_id = 1000
    for op, g, k in ops:
        if op not in ("probe", "admit", "group") and groups:
            g = sorted(groups)[g % len(groups)]
        salt = () if g % 3 else ("tenant", g % 2)
        prompt = list(PREFIXES[g % 3][:k % 9 + 1]) + [g] * (k // 3)
        ids = groups.get(g, [])
        on_gpu = bool(ids) and t.plain.get_table(ids[0]).device == "gpu"
        if op == "probe":                  # a waiting request is asked about at every step
            t.call("can_allocate", prompt, salt)
            t.call("can_allocate", prompt, salt)
            t.call("can_allocate", len(prompt))
        elif op == "admit" and g not in groups:
            status = t.call("can_allocate", prompt, salt)[1]   # the scheduler asks first
            if status is AllocStatus.OK or k % 4 == 0:         # sometimes allocate anyway
                if t.call("allocate", g, prompt, salt)[0] == "ok":
                    groups[g] = [g]
                    if k % 3:                                  # its prefill ran
                        t.call("mark_blocks_as_computed", g, len(prompt))
        elif op == "group" and g not in groups:
            seqs = [(g, prompt)] + [(next_id + i, prompt + [50 + i] * (k % 5))
                                    for i in range(1 + k % 2)]
            next_id += 2
            t.call("can_allocate_group", [s for _, s in seqs], salt)
            if t.call("allocate_group", seqs, salt)[0] == "ok":
                groups[g] = [s for s, _ in seqs]
                for s, tokens in seqs:
                    t.call("mark_blocks_as_computed", s, len(tokens))
        elif op == "decode" and on_gpu:
            t.call("append_decode", ids, [k * 10 + i for i in range(len(ids))])
        elif op == "chunk" and on_gpu:
            n = k % 6
            t.call("can_append_slots", ids[0], n)
            t.call("append_slots", ids[0], [70 + i for i in range(n)])
        elif op == "can_append" and ids:
            t.call("num_blocks_to_append", ids)
            if on_gpu:
                t.call("can_append_slots", ids[-1], k % 3)
        elif op == "fork" and on_gpu and len(ids) < 4:
            if t.call("fork", ids[k % len(ids)], next_id)[0] == "ok":
                ids.append(next_id)
            next_id += 1
        elif op == "split" and len(ids) > 1:                   # a sharer decodes on its own
            groups[next_id] = [ids.pop()]
            next_id += 1
        elif op == "mark" and on_gpu:
            n = t.plain.get_table(ids[0]).num_tokens
            t.call("mark_blocks_as_computed", ids[0], n - k % 3)
        elif op == "free" and ids:
            victim = ids.pop(k % len(ids))
            t.call("free", victim)
            if not ids:
                del groups[g]
        elif op == "swap_out" and on_gpu:
            if t.call("can_swap_out", ids)[1] or k % 3 == 0:
                t.call("swap_out", ids)
        elif op == "swap_in" and ids and not on_gpu:
            if t.call("can_swap_in", ids)[1] is AllocStatus.OK or k % 3 == 0:
                t.call("swap_in", ids)
        elif op == "reset":
            t.call("reset_prefix_cache")
        t.check()
    for g in list(groups):
        for s in groups.pop(g):
            t.call("free", s)
    t.check()
    assert t.plain.num_free_gpu_blocks == gpu and t.plain.num_free_cpu_blocks == cpu


CONFIGS = dict(bs=st.sampled_from([1, 2, 4]), gpu=st.integers(2, 24), cpu=st.integers(0, 12),
               caching=st.booleans(), watermark=st.sampled_from([0.0, 0.1]), weak=st.booleans(),
               ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 3),
                                      st.integers(0, 26)), min_size=5, max_size=60))


@settings(max_examples=examples(400), deadline=None)
@given(**CONFIGS)
def test_the_twin_answers_and_ends_as_the_plain_manager(bs, gpu, cpu, caching, watermark,
                                                          weak, ops):
    drive(FastBlockManager, bs, gpu, cpu, caching, watermark, weak, ops)


class LeakyTwin(FastBlockManager):
    """Broken on purpose: decode in a private partial block forgets to hash the block it
    fills (the kind of slip a fast path makes); its state drifts from the plain manager's."""

    def append_decode(self, seq_ids, token_ids):
        if len(seq_ids) == 1 and self.cache is not None:
            table = self._tables.get(seq_ids[0])
            if table is not None and table.device == "gpu" and table.num_tokens % self.block_size \
                    and self.gpu.ref_counts[table.blocks[-1]] == 1 \
                    and table.num_cached_blocks == table.num_full_blocks:
                table.token_ids.append(token_ids[0])
                return [], [table.blocks]
        return super().append_decode(seq_ids, token_ids)


class CopyingTwin(FastBlockManager):
    """Broken on purpose: the right answers, but block lists copied before they are handed
    out (an O(blocks) copy per decode step, the cost the twin's hand-out avoids)."""

    def append_decode(self, seq_ids, token_ids):
        grown = super().append_decode(seq_ids, token_ids)
        return grown if grown is None else (grown[0], [list(ids) for ids in grown[1]])


def test_the_twin_check_catches_a_broken_twin():
    decode_a_block_full = [("admit", 0, 2), ("decode", 0, 1), ("decode", 0, 2)]  # 3+2 = 5 > 4
    with pytest.raises(AssertionError, match="differs|answered"):
        drive(LeakyTwin, 4, 8, 0, True, 0.0, False, decode_a_block_full)
    drive(FastBlockManager, 4, 8, 0, True, 0.0, False, decode_a_block_full)   # the real one
    decode_once = [("admit", 0, 3), ("decode", 0, 1)]
    with pytest.raises(AssertionError, match="handed-out"):
        drive(CopyingTwin, 4, 8, 0, False, 0.0, False, decode_once)
    drive(FastBlockManager, 4, 8, 0, False, 0.0, False, decode_once)


def test_a_remembered_chain_is_reused_only_while_its_blocks_keep_their_registration():
    """The twin's ``hash_and_match`` reuses the hits of a recent prompt that began alike,
    block by block, only while each block is still registered with the very key it had.
    Here block 0 of the first prompt is evicted and registered again with other tokens: the
    next prompt like the first must not hit it (a check on 'still cached' alone would)."""
    def toks(n, start=0):
        return list(range(start, start + n))

    bs = 4
    twins = Twins(FastBlockManager, bs, 3, 0, True, 0.0, False)
    a = toks(9, 100)                                 # blocks [100..103], [104..107], +1
    twins.call("allocate", 0, a)
    twins.call("mark_blocks_as_computed", 0, 9)
    twins.call("free", 0)                            # blocks 0, 1 cached and evictable
    assert twins.call("allocate", 1, toks(4, 100) + toks(5, 900)) == ("ok", 4)   # the chain
    twins.call("mark_blocks_as_computed", 1, 9)
    twins.call("free", 1)
    twins.call("allocate", 2, toks(12, 500))         # evicts every cached block, registers
    twins.call("mark_blocks_as_computed", 2, 12)     # another prompt's blocks in their place
    m = twins.twin
    assert m.get_block_table(2)[2] == 0 and m.cache.is_cached(0)   # block 0: other tokens
    twins.call("free", 2)
    got = twins.call("allocate", 3, a)[1]
    twins.check()                                    # cached blocks hold their tokens
    table = m.get_table(3)
    for i in range(got // bs):
        assert m.cache.key_of(table.blocks[i]).token_ids == tuple(a[i * bs:(i + 1) * bs])


@pytest.mark.parametrize("gpu", [6, 12])
def test_a_shared_system_prompt_hits_through_the_remembered_chain(gpu):
    """Requests that share a system prompt come one after another (each computed, then
    freed): from the third on the twin reuses the remembered chain instead of hashing; a
    tight pool makes ``can_allocate`` hash and walk (and ``allocate`` reuse that walk)."""
    twins = Twins(FastBlockManager, 4, gpu, 0, True, 0.0, False)
    system = list(range(100, 108))                       # two full blocks
    for i in range(6):
        prompt = system + [200 + i] * (1 + i % 3)
        for _ in range(2):
            twins.call("can_allocate", prompt)
        assert twins.call("allocate", i, prompt)[1] == (8 if i else 0)
        twins.call("mark_blocks_as_computed", i, len(prompt))
        twins.check()
        twins.call("free", i)
        twins.check()
