"""Unit tests of the V0 block manager (course_lib/memory/v0/): one behaviour per test,
hand-computed.

Every test ends with ``m.check_invariants()``; the last group proves that checker can fail.
The random, stateful counterpart is tests/test_block_manager_stateful.py; the scheduler's
twin (FastBlockManager) is checked against this plain manager in test_block_manager_twin.py.
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
from course_lib.memory.v0.pool import BlockAllocator, NoFreeBlocksError
from course_lib.memory.v0.prefix_cache import ROOT_HASH

BS = 4


def mgr(gpu=16, cpu=0, bs=BS, **kw) -> BlockManager:
    return BlockManager(block_size=bs, num_gpu_blocks=gpu, num_cpu_blocks=cpu, watermark=0.0, **kw)


def cached(gpu=16, **kw) -> BlockManager:
    return mgr(gpu, enable_prefix_caching=True, **kw)


def rejects(m: BlockManager, exc, match, fn, *args):
    """``fn(*args)`` raises ``exc`` matching ``match`` and changes nothing."""
    before = snapshot(m)
    with pytest.raises(exc, match=match):
        fn(*args)
    assert snapshot(m) == before
    m.check_invariants()


def toks(n, start=0):
    return list(range(start, start + n))


# --------------------------------------------------------------- allocation on demand
def test_prompt_takes_ceil_blocks_from_a_fresh_pool_in_order():
    m = mgr()
    assert m.allocate(0, toks(10)) == 0               # no prefix caching: no cached tokens
    assert m.get_block_table(0) == [0, 1, 2]          # 10 tokens / 4 per block -> 3 blocks
    m.allocate(1, toks(1))
    assert m.get_block_table(1) == [3]
    m.append_slots(1, toks(8, 1))                     # 9 tokens: 2 new blocks at once
    assert m.get_block_table(1) == [3, 4, 5]
    assert m.num_free_gpu_blocks == 10
    m.check_invariants()


@pytest.mark.parametrize("prompt_len", [BS - 1, BS])
def test_append_takes_a_block_only_when_the_last_is_full(prompt_len):
    m = mgr()
    m.allocate(0, toks(prompt_len))
    lengths_blocks = []
    for n in range(prompt_len + 1, BS + 2):           # up to block_size + 1 tokens
        assert m.append_slots(0, [n]) == []
        lengths_blocks.append((n, len(m.get_block_table(0))))
    assert lengths_blocks[-1] == (BS + 1, 2)
    assert all(b == 1 for n, b in lengths_blocks if n <= BS)  # block_size-1, block_size: 1 block
    assert m.get_block_table(0) == [0, 1]
    m.check_invariants()


def test_slot_mapping_is_block_times_size_plus_offset():
    m = mgr()
    m.allocate(0, toks(4))                            # block 0, full
    m.allocate(1, toks(2))                            # block 1
    m.append_slots(0, [7, 8])                         # seq 0 grows into block 2
    t = m.get_table(0)
    assert t.blocks == [0, 2]
    assert t.slot_mapping() == [0, 1, 2, 3, 8, 9]
    assert t.slot_mapping(start=5) == [9]             # one decode step: the last token
    assert [t.slot(p) for p in range(6)] == [0, 1, 2, 3, 8, 9]
    m.check_invariants()


def test_free_returns_every_block_lifo():
    m = mgr(8)
    m.allocate(0, toks(10))
    m.allocate(1, toks(5))
    m.free(0)
    assert m.num_free_gpu_blocks == 6
    assert m.gpu.free_block_ids()[-3:] == [2, 1, 0]   # pushed tail first: 0 is on top
    m.allocate(2, toks(9))
    assert m.get_block_table(2) == [0, 1, 2]          # popped straight back, O(1) each
    m.free(1), m.free(2)
    assert m.num_free_gpu_blocks == 8 and m.gpu.ref_counts == [0] * 8
    m.check_invariants()


def test_usage_counts_a_shared_block_once():
    m = mgr(10)
    m.allocate(0, toks(10))
    m.fork(0, 1)                                      # 3 blocks, each ref 2
    u = m.usage()
    assert (u.num_total_blocks, u.num_free_blocks, u.num_cached_free_blocks) == (10, 7, 0)
    assert u.block_usage == pytest.approx(3 / 10)
    assert u.token_usage == pytest.approx((4 + 4 + 2) / 40)
    assert (u.num_held_blocks, u.num_table_entries) == (3, 6) and u.sharing_saving == 0.5
    m.append_slots(1, [99])                           # CoW: seq 1 gets block 3 with 3 tokens
    u = m.usage()
    assert u.block_usage == pytest.approx(4 / 10)
    assert u.token_usage == pytest.approx((4 + 4 + 2 + 3) / 40)
    assert m.usage("cpu").block_usage == 0.0 and m.usage("cpu").sharing_saving == 0.0
    m.check_invariants()


def test_pool_owns_the_free_block_policy():
    """Free blocks before evictable ones; evictable in LRU order; an eviction tells the
    prefix cache; a hit on an evictable block holds it again; every block in one state."""
    pool = BlockAllocator("gpu", 4)
    evicted = []
    pool.on_evict = evicted.append
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert (a, b, c) == (0, 1, 2) and pool.num_free_blocks == 1
    pool.release([c, b], cached={1, 2})               # tail first: 2 then 1 become evictable
    pool.release([a])                                 # never cached: back on the stack
    assert pool.evictable_block_ids() == [2, 1] and pool.free_block_ids() == [3, 0]
    assert pool.num_free_blocks == 4 and pool.num_evictable_blocks == 2
    pool.touch([1])                                   # a prefix-cache hit on block 1
    assert pool.evictable_block_ids() == [2] and pool.ref_counts[1] == 1
    assert [pool.allocate() for _ in range(3)] == [0, 3, 2] and evicted == [2]
    with pytest.raises(NoFreeBlocksError, match="no free gpu blocks"):
        pool.allocate()
    pool.check_invariants()
    pool._free.append(1)                              # fault: a held block on the stack
    with pytest.raises(AssertionError, match="held block is free or evictable"):
        pool.check_invariants()


def test_free_puts_a_block_back_on_top_and_a_double_release_is_caught():
    """``free`` (chapter 03's O(1) timing) pushes a block whose count was set to 0; releasing
    a block nobody holds is a double free, an invariant the pool asserts."""
    a = BlockAllocator("cpu", 2)
    b = a.allocate()
    a.ref_counts[b] = 0
    a.free(b)
    assert a.free_block_ids()[-1] == b and a.allocate() == b
    a.check_invariants()
    with pytest.raises(AssertionError, match="not held"):
        a.release([1 - b])


# -------------------------------------------------------------- fork, copy-on-write
def test_seed_cow_example_block_4_copied_to_5():
    m = mgr(8)
    m.allocate("A", toks(18))                         # 4 full blocks + 2 tokens in block 4
    m.fork("A", "B")
    assert m.get_block_table("A") == m.get_block_table("B") == [0, 1, 2, 3, 4]
    assert m.ref_count(4) == 2
    assert m.append_slots("A", [100]) == [(4, 5)]     # copy block 4 into new block 5
    assert m.get_block_table("A") == [0, 1, 2, 3, 5]
    assert m.get_block_table("B") == [0, 1, 2, 3, 4]
    assert (m.ref_count(4), m.ref_count(5)) == (1, 1)
    assert [m.ref_count(b) for b in range(4)] == [2] * 4
    assert m.append_slots("B", [200]) == []           # B is the last holder: write in place
    assert m.get_block_table("B") == [0, 1, 2, 3, 4]
    m.check_invariants()


def test_fork_on_a_full_last_block_appends_a_fresh_block_without_copy():
    m = mgr(8)
    m.allocate("A", toks(16))
    m.fork("A", "B")
    assert m.append_slots("A", [1]) == []
    assert m.get_block_table("A") == [0, 1, 2, 3, 4]
    assert m.get_block_table("B") == [0, 1, 2, 3]
    assert m.ref_count(3) == 2 and m.ref_count(4) == 1
    m.check_invariants()


def test_parallel_sampling_n4_copies_until_the_last_holder():
    m = mgr(16)
    m.allocate(0, toks(10))                           # blocks 0, 1 full; 2 partial
    for child in (1, 2, 3, 4):
        m.fork(0, child)
    assert [m.ref_count(b) for b in (0, 1, 2)] == [5, 5, 5]
    assert m.append_slots(1, [7]) == [(2, 3)]
    assert m.append_slots(2, [7]) == [(2, 4)]
    assert m.append_slots(3, [7]) == [(2, 5)]
    m.free(0)                                         # parent finishes: child 4 is last holder
    assert m.ref_count(2) == 1
    assert m.append_slots(4, [7]) == []
    assert m.get_block_table(4) == [0, 1, 2]
    assert [m.ref_count(b) for b in (0, 1)] == [4, 4]
    m.check_invariants()


def test_beam_search_like_fork_append_free_returns_everything():
    m = mgr(32)
    m.allocate(0, toks(6))
    beams = [0]
    next_id = 1
    for step in range(6):
        new = []
        for parent in beams:
            for _ in range(2):
                m.fork(parent, next_id)
                m.append_slots(next_id, [1000 + step])
                new.append(next_id)
                next_id += 1
            m.free(parent)
        beams = new[:2]                               # keep the best two
        for dropped in new[2:]:
            m.free(dropped)
        m.check_invariants()
    for b in beams:
        m.free(b)
    assert m.num_free_gpu_blocks == 32 and m.gpu.ref_counts == [0] * 32
    m.check_invariants()


# ----------------------------------------------------------------- prefix caching
def test_prefix_hit_only_after_blocks_are_computed():
    m = cached()
    assert m.prefix_cache_stats.hit_rate == 0.0
    prompt = toks(9)                                  # 2 full blocks + 1 token
    m.allocate(0, prompt)
    assert m.allocate(1, prompt) == 0                 # seq 0's K/V not written yet
    m.mark_blocks_as_computed(0, 9)
    assert m.allocate(2, prompt) == 2 * BS
    assert m.get_block_table(2)[:2] == m.get_block_table(0)[:2]
    assert m.ref_count(m.get_block_table(0)[0]) == 2
    assert m.get_table(2).num_cached_blocks == 2
    s = m.prefix_cache_stats                          # counted in tokens, like vLLM's metrics
    assert (s.queries, s.hits) == (27, 8)
    assert s.hit_rate == pytest.approx(8 / 27)
    m.check_invariants()


def test_append_marks_earlier_tokens_computed():
    m = cached()
    m.allocate(0, toks(8))
    m.append_slots(0, [50])                           # tokens 0..7 computed by now
    assert m.allocate(1, toks(8) + [60]) == 2 * BS
    m.check_invariants()


def test_hits_leave_at_least_one_token_to_compute():
    m = cached()
    m.allocate(0, toks(8))
    m.mark_blocks_as_computed(0, 8)
    assert m.allocate(1, toks(8)) == BS               # not 8: the last token must run
    assert m.get_block_table(1)[0] == m.get_block_table(0)[0]
    assert m.get_block_table(1)[1] != m.get_block_table(0)[1]
    m.check_invariants()


def test_extra_key_salt_prevents_a_hit():
    m = cached()
    m.allocate(0, toks(9), extra_key="lora-1")
    m.mark_blocks_as_computed(0, 9)
    assert m.allocate(1, toks(9), extra_key="lora-2") == 0
    assert m.allocate(2, toks(9)) == 0
    assert m.allocate(3, toks(9), extra_key="lora-1") == 8
    m.check_invariants()


def test_freed_cached_block_is_reused_by_identical_prompt():
    m = cached()
    m.allocate(0, toks(9))
    m.mark_blocks_as_computed(0, 9)
    first = m.get_block_table(0)
    m.free(0)
    assert m.gpu.evictable_block_ids() == [first[1], first[0]]
    assert m.num_free_gpu_blocks == 16                # parked blocks count as free
    assert m.allocate(1, toks(9)) == 8
    assert m.get_block_table(1)[:2] == first[:2]      # same physical blocks
    assert m.gpu.num_evictable_blocks == 0
    m.check_invariants()


def test_lru_eviction_oldest_sequence_first_and_tail_before_prefix():
    m = cached(6)
    m.allocate("A", toks(9))                          # blocks 0, 1 (cached), 2 (partial)
    m.allocate("B", toks(9, 100))                     # blocks 3, 4 (cached), 5 (partial)
    m.mark_blocks_as_computed("A", 9)
    m.mark_blocks_as_computed("B", 9)
    m.free("A")
    m.free("B")
    assert m.gpu.evictable_block_ids() == [1, 0, 4, 3]
    m.allocate("C", toks(24, 500))                    # 6 new blocks, no hit
    assert m.get_block_table("C") == [5, 2, 1, 0, 4, 3]  # free stack first, then LRU order
    assert m.gpu.num_evictable_blocks == 0 and not m.cache.is_cached(1)
    m.check_invariants()


def test_constant_hash_collision_is_detected_not_hit():
    """With every hash equal, a lookup still only hits the block with the very key, and a
    block that collides is cached beside the first one instead of being kept out."""
    m = cached()
    m.cache.hash_fn = lambda p, t, e: 42
    m.allocate(0, toks(9))
    m.mark_blocks_as_computed(0, 9)                   # blocks 0 and 1 share hash 42
    assert m.cache.is_cached(0) and m.cache.is_cached(1)
    before = m.cache.num_collisions
    assert m.allocate(1, toks(9, 100)) == 0           # same hash, other tokens
    assert m.cache.num_collisions == before + 1
    assert m.allocate(2, toks(9)) == 2 * BS           # both genuine blocks are hits
    assert m.cache.num_collisions == before + 1
    assert m.allocate(3, toks(9), extra_key="salt") == 0  # same tokens, other salt
    assert m.cache.num_collisions == before + 2
    m.check_invariants()
    for s in range(4):
        m.free(s)
    for _ in range(m.num_free_gpu_blocks):            # evict everything: buckets emptied
        m.gpu.allocate()
    assert not m.cache.cached_block_ids()
    m.cache.check_invariants()


def test_block_after_a_colliding_parent_is_not_hit_under_another_prefix():
    """A hit must prove the whole prefix equal, not just the parent's hash."""
    m = cached()
    # Every first block hashes to 1: A and B collide; later blocks hash normally.
    m.cache.hash_fn = lambda p, t, e: 1 if p == ROOT_HASH else hash((p, t, e))
    A, B, C = [1, 2, 3, 4], [5, 6, 7, 8], [10, 11, 12, 13]
    m.allocate(0, A + [9])
    m.mark_blocks_as_computed(0, 5)                   # A cached under hash 1
    m.allocate(1, B + C + [99])
    m.mark_blocks_as_computed(1, 9)                   # B collides with A; C follows B
    assert m.allocate(2, A + C + [77]) == BS          # C's K/V were computed after B, not A
    m.check_invariants()


def test_reset_prefix_cache_only_when_nothing_is_held():
    m = cached(8)
    m.allocate(0, toks(9))
    m.mark_blocks_as_computed(0, 9)
    assert m.reset_prefix_cache() is False
    assert m.cache.is_cached(m.get_block_table(0)[0])
    m.free(0)
    assert m.reset_prefix_cache() is True
    assert m.gpu.num_evictable_blocks == 0 and m.gpu.num_free_blocks == 8
    assert m.allocate(1, toks(9)) == 0
    m.check_invariants()


def test_sha256_hash_algo_gives_the_same_hits():
    m = cached(prefix_caching_hash_algo="sha256")
    m.allocate(0, toks(13), extra_key=("tenant", 7))
    m.mark_blocks_as_computed(0, 13)
    assert m.allocate(1, toks(13), extra_key=("tenant", 7)) == 3 * BS
    assert m.allocate(2, toks(13)) == 0
    m.check_invariants()


def test_multi_turn_chat_reuses_turn_one_blocks():
    m = cached()
    turn1 = toks(6)
    m.allocate(0, turn1)
    for tok in (100, 101, 102, 103, 104):             # the reply, one decode step each
        m.append_slots(0, [tok])
    history = m.get_table(0).token_ids                # 11 tokens: 2 full blocks
    first_blocks = m.get_block_table(0)[:2]
    m.free(0)
    turn2 = history + [200, 201, 202]
    assert m.allocate(1, turn2) == 2 * BS
    assert m.get_block_table(1)[:2] == first_blocks
    m.check_invariants()


# ------------------------------------------------------------------ watermark, can_*
def test_can_allocate_ok_later_never_with_watermark():
    m = BlockManager(block_size=BS, num_gpu_blocks=10, watermark=0.2)  # 2 blocks kept free
    assert m.watermark_blocks == 2
    assert m.can_allocate(8 * BS) is AllocStatus.OK
    assert m.can_allocate(8 * BS + 1) is AllocStatus.NEVER  # 9 blocks > 10 - 2
    m.allocate(0, toks(1))
    assert m.can_allocate(8 * BS) is AllocStatus.LATER
    assert m.can_allocate(toks(7 * BS)) is AllocStatus.OK
    m.check_invariants()


def test_can_allocate_counts_cache_hits():
    m = BlockManager(block_size=BS, num_gpu_blocks=6, watermark=0.0, enable_prefix_caching=True)
    m.allocate(0, toks(13))                           # 4 blocks, 3 full
    m.mark_blocks_as_computed(0, 13)
    assert m.can_allocate(13) is AllocStatus.LATER    # a length alone: 4 blocks, 2 free
    assert m.can_allocate(toks(13)) is AllocStatus.OK  # 3 hits: 1 new block needed
    assert m.can_allocate(toks(13, 100)) is AllocStatus.LATER
    m.check_invariants()


def test_parked_cache_hits_are_not_free_blocks_too():
    m = cached(4)
    m.allocate(0, toks(9))                            # blocks 0, 1 (cached), 2
    m.mark_blocks_as_computed(0, 9)
    m.free(0)                                         # 0, 1 parked; free stack [3, 2]
    m.allocate(1, toks(8, 100))                       # takes 2 and 3
    assert m.num_free_gpu_blocks == 2                 # the two parked blocks
    # The same prompt would hit both parked blocks and still need a third one: none left.
    assert m.can_allocate(toks(9)) is AllocStatus.LATER
    rejects(m, NoFreeBlocksError, "needs 1 new", m.allocate, 2, toks(9))
    m.free(1)
    assert m.can_allocate(toks(9)) is AllocStatus.OK
    assert m.allocate(2, toks(9)) == 2 * BS
    m.check_invariants()


def test_can_append_slots_counts_the_cow_block():
    m = mgr(4)
    m.allocate(0, toks(6))
    m.allocate(1, toks(5))                            # pool full
    assert m.can_append_slots(0, 2)                   # fills block 1 in place
    m.fork(0, 2)
    assert m.num_free_gpu_blocks == 0
    assert not m.can_append_slots(0, 1)               # needs a CoW copy, no room
    m.free(1)                                         # 2 blocks free
    assert m.can_append_slots(0, 2)                   # CoW only
    assert m.can_append_slots(0, 3)                   # CoW + 1 new
    assert not m.can_append_slots(0, 7)               # CoW + 2 new
    m.check_invariants()


# -------------------------------------------------------------------------- swapping
def forked_group(m):
    m.allocate(0, toks(10))
    m.fork(0, 1)
    m.fork(0, 2)
    m.append_slots(1, [77])                           # seq 1: private copy of block 2 -> 3


def test_swap_out_moves_shared_blocks_once_and_swap_in_restores():
    m = mgr(8, cpu=8)
    forked_group(m)
    mapping = m.swap_out([0, 1, 2])
    assert [g for g, _ in mapping] == [0, 1, 2, 3]    # 4 distinct blocks, not 12 entries
    assert [c for _, c in mapping] == [0, 1, 2, 3]
    assert [m.ref_count(b, "cpu") for b in range(4)] == [3, 3, 2, 1]
    assert m.get_block_table(1) == [0, 1, 3]
    assert m.num_free_gpu_blocks == 8 and m.num_free_cpu_blocks == 4
    tokens = {s: list(m.get_table(s).token_ids) for s in (0, 1, 2)}
    back = m.swap_in([0, 1, 2])
    assert sorted(c for c, _ in back) == [0, 1, 2, 3]
    assert {s: m.get_table(s).token_ids for s in (0, 1, 2)} == tokens
    assert all(m.get_table(s).device == "gpu" for s in (0, 1, 2))
    assert m.num_free_cpu_blocks == 8
    assert m.append_slots(0, [5]) == [(2, 4)]         # 0 and 2 share block 2 again: CoW
    m.check_invariants()


def test_swap_out_without_cpu_room_changes_nothing():
    m = mgr(8, cpu=3)
    forked_group(m)
    assert not m.can_swap_out([0, 1, 2])
    rejects(m, NoFreeBlocksError, "CPU", m.swap_out, [0, 1, 2])


def test_swap_in_without_gpu_room_changes_nothing_and_free_returns_cpu_blocks():
    m = mgr(6, cpu=8)
    forked_group(m)
    m.swap_out([0, 1, 2])
    # back in: 4 distinct blocks, then the next decode copies the partial block 2 for 0 and 2
    assert m.swap_in_need([0, 1, 2]) == 4 + 2 and m.num_blocks_to_append([0, 1, 2]) == 2
    m.allocate(9, toks(13))                           # 4 blocks: 2 left
    assert m.can_swap_in([0, 1, 2]) is AllocStatus.LATER
    rejects(m, NoFreeBlocksError, "GPU", m.swap_in, [0, 1, 2])
    for s in (0, 1, 2):
        m.free(s)
    assert m.num_free_cpu_blocks == 8 and m.cpu.ref_counts == [0] * 8
    m.check_invariants()
    small = mgr(4, cpu=8)
    forked_group(small)
    small.swap_out([0, 1, 2])
    assert small.can_swap_in([0, 1, 2]) is AllocStatus.NEVER   # 6 > 4: it could never decode


def test_swap_in_part_of_a_group_keeps_the_shared_cpu_blocks():
    m = mgr(8, cpu=8)
    forked_group(m)
    m.swap_out([0, 1, 2])
    assert sorted(c for c, _ in m.swap_in([1])) == [0, 1, 3]  # 0 and 2 stay on the CPU
    assert [m.ref_count(b, "cpu") for b in range(4)] == [2, 2, 2, 0]
    assert m.get_table(0).device == "cpu" and m.get_table(1).device == "gpu"
    m.check_invariants()
    m.swap_in([0, 2])
    for s in (0, 1, 2):
        m.free(s)
    assert m.num_free_gpu_blocks == 8 and m.num_free_cpu_blocks == 8
    m.check_invariants()


# ---------------------------------------------------------------- no room: refused
def test_prompt_larger_than_the_pool_never_fits():
    m = mgr(4)
    assert m.can_allocate(4 * BS + 1) is AllocStatus.NEVER
    assert m.can_allocate(toks(4 * BS + 1)) is AllocStatus.NEVER
    assert m.can_allocate(toks(4 * BS)) is AllocStatus.OK
    m.check_invariants()


def test_allocate_and_append_without_room_change_nothing():
    m = cached(3)
    m.allocate(0, toks(8))                            # 2 full blocks
    m.mark_blocks_as_computed(0, 8)
    m.allocate(1, toks(3, 50))                        # the last block
    rejects(m, NoFreeBlocksError, "can_allocate", m.allocate, 2, toks(5, 90))
    rejects(m, NoFreeBlocksError, "preempt", m.append_slots, 0, [1])
    m.fork(1, 3)
    rejects(m, NoFreeBlocksError, "preempt", m.append_slots, 1, [1])  # CoW needs a block


# --------------------------------------------------- check_invariants can fail
def corrupted(kind):
    m = cached()
    m.allocate(0, toks(9))
    m.mark_blocks_as_computed(0, 9)
    m.check_invariants()
    block = m.get_block_table(0)[0]
    if kind == "ref_count":
        m.gpu.ref_counts[block] += 1
    elif kind == "free_stack":
        m.gpu._free.append(block)
    elif kind == "cached_tokens":
        key = m.cache._key_of[block]
        m.cache._key_of[block] = key._replace(token_ids=(9, 9, 9, 9))
    elif kind == "table_tokens":
        m.get_table(0).token_ids[1] = 999
    return m


@pytest.mark.parametrize("kind", ["ref_count", "free_stack", "cached_tokens", "table_tokens"])
def test_check_invariants_catches_corruption(kind):
    m = corrupted(kind)
    with pytest.raises(AssertionError):
        m.check_invariants()


def test_salts_equal_in_python_but_of_other_types_never_share_blocks():
    m = cached()
    m.allocate(0, toks(9), extra_key=1)
    m.mark_blocks_as_computed(0, 9)
    for other in (True, 1.0, "1", (1,)):
        assert m.allocate(len(m.seq_ids()), toks(9), extra_key=other) == 0, other
    assert m.allocate(len(m.seq_ids()), toks(9), extra_key=1) == 2 * BS   # the same salt hits
    m.check_invariants()


# ------------------------------------ where the V0 pair differs from vLLM V0 (design notes)
def test_differs_from_v0_a_block_that_fills_to_match_a_cached_one_is_not_merged():
    m = cached()
    m.allocate(0, toks(8, 200))
    m.mark_blocks_as_computed(0, 8)
    m.allocate(1, toks(5, 200))                       # shares block 0, owns a partial block
    own = m.get_block_table(1)[1]
    for t in toks(3, 205):                            # fills it with seq 0's second block
        m.append_slots(1, [t])
    m.append_slots(1, [999])
    table0, table1 = m.get_block_table(0), m.get_block_table(1)
    assert table1[:2] == [table0[0], own] and own != table0[1]     # V0 would merge into table0[1]
    assert m.ref_count(own) == 1 and m.ref_count(table0[1]) == 1
    m.check_invariants()


def test_differs_from_v0_swap_in_counts_the_partial_block_and_takes_new_blocks():
    m = cached(6, cpu=8)
    m.allocate(0, toks(9, 300))                       # 2 full blocks + 1 partial
    m.mark_blocks_as_computed(0, 9)
    full = m.get_block_table(0)[:2]
    m.swap_out([0])
    assert all(m.cache.is_cached(b) for b in full)    # parked on the GPU, evictable
    m.allocate(1, toks(13, 500))                      # 4 blocks: the 2 parked ones stay free
    assert m.num_free_gpu_blocks == 2 and m.gpu.num_evictable_blocks == 2
    # V0 counts full blocks only (2 <= 2 free: OK); the course counts the partial one too
    assert m.swap_in_need([0]) == 3 and m.can_swap_in([0]) == AllocStatus.LATER
    m.free(1)
    mapping = m.swap_in([0])
    assert len(mapping) == 3                          # every block copied back, none revived
    m.check_invariants()


def test_differs_from_v0_prefix_counters_survive_a_reset():
    m = cached(8)
    m.allocate(0, toks(9))
    m.mark_blocks_as_computed(0, 9)
    m.free(0)
    m.allocate(1, toks(9))
    m.free(1)
    before = m.prefix_cache_stats
    assert before.hits == 8 and before.queries == 18
    assert m.reset_prefix_cache() is True
    assert m.prefix_cache_stats == before             # cumulative, like V1's counters


# ------------------------------------------------ the scheduler's decode path, fused
@settings(max_examples=examples(150), deadline=None)
@given(bs=st.sampled_from([1, 2, 4]), blocks=st.integers(3, 12), caching=st.booleans(),
       ops=st.lists(st.tuples(st.sampled_from(["admit", "decode", "decode", "decode", "fork",
                                               "split", "mark", "free"]),
                              st.integers(0, 2), st.integers(1, 9)), min_size=10, max_size=80))
def test_append_decode_is_the_three_calls_it_replaces(bs, blocks, caching, ops):
    """``append_decode`` (one call per request) against what it fuses: ``num_blocks_to_append``
    > free -> None, else ``append_slots`` per sequence and ``get_block_table``. Two managers
    driven alike must give the same answers and end in the same state, whatever the sharing,
    copy-on-write, caching and eviction."""
    fused, plain = FastBlockManager(bs, blocks, 0, 0.0, caching), \
        BlockManager(bs, blocks, 0, 0.0, caching)
    groups: dict[int, list[int]] = {}                 # group (0-2, split ones 3-11) -> seq ids
    next_id = 100
    for op, g, k in ops:
        if op != "admit" and groups:                  # act on a live group
            g = sorted(groups)[g % len(groups)]
        if op == "admit" and g not in groups:
            tokens = [1, 2, 3, 4, 5, 6, 7][:k % 7 + 1] + [g] * (k // 3)
            if fused.can_allocate(tokens) is AllocStatus.OK:
                for m in (fused, plain):
                    m.allocate(g, tokens)
                groups[g] = [g]
        elif op == "decode" and g in groups:
            ids, toks = groups[g], [k * 10 + i for i in range(len(groups[g]))]
            got = fused.append_decode(ids, toks)
            if got is not None:                       # handed out without a copy
                assert all(blocks is fused.get_table(s).blocks
                           for s, blocks in zip(ids, got[1], strict=True))
            if plain.num_blocks_to_append(ids) > plain.num_free_gpu_blocks:
                want = None
            else:
                copies = [c for s, t in zip(ids, toks, strict=True)
                          for c in plain.append_slots(s, [t])]
                want = (copies, [plain.get_block_table(s) for s in ids])
            assert got == want
        elif op == "fork" and g in groups and len(groups[g]) < 4:
            for m in (fused, plain):
                m.fork(groups[g][0], next_id)
            groups[g].append(next_id)
            next_id += 1
        elif op == "split" and g in groups and len(groups[g]) > 1 and k + 2 not in groups:
            groups[k + 2] = [groups[g].pop()]          # a sharer decoded on its own
        elif op == "mark" and g in groups:
            for s in groups[g]:
                n = len(fused.get_table(s).token_ids)
                for m in (fused, plain):
                    m.mark_blocks_as_computed(s, n)
        elif op == "free" and g in groups:
            for s in groups.pop(g):
                for m in (fused, plain):
                    m.free(s)
        assert snapshot(fused) == snapshot(plain)
        fused.check_invariants()
