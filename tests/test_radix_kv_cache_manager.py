"""SGLang's radix tree as the V1 pair's prefix cache: exact-token hits on whole blocks, locks
instead of reference counts, eviction of unlocked leaves in LRU order, no merge of duplicate
blocks, all or nothing; and the V1 manager's stateful test run against it."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize
from test_kv_cache_manager import KVCacheManagerMachine

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.memory.radix.allocator import BlockSlotPool
from course_lib.memory.radix.kv_cache_manager import RadixKVCacheManager
from course_lib.scheduler.scheduler import Scheduler
from course_lib.scheduler.v1 import SchedulerV1

pytestmark = pytest.mark.ch12
BS = 4


def toks(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def admit(m: RadixKVCacheManager, seq_id: int, tokens: list[int], salt=None) -> int:
    hits, num_hit = m.get_computed_blocks(seq_id, tokens, salt)
    assert m.allocate_slots(seq_id, tokens, 0, len(tokens) - num_hit, hits,
                            admission=True) is not None
    m.check_invariants()
    return num_hit


def test_block_slot_pool_hands_out_and_takes_back_whole_blocks():
    pool = BlockSlotPool(3, BS)
    assert pool.alloc(2 * BS) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert pool.alloc(2 * BS) is None and pool.num_free_blocks == 1
    with pytest.raises(ValueError, match="multiple"):
        pool.alloc(3)
    with pytest.raises(ValueError, match="not one block"):
        pool.free([0, 1, 2, 5])
    pool.free(list(range(4, 8)))
    with pytest.raises(ValueError, match="double free"):
        pool.free(list(range(4, 8)))
    assert pool.free_slots() == set(range(4, 12))


def test_hits_are_whole_blocks_of_equal_tokens_never_the_last_token():
    m = RadixKVCacheManager(BS, 16)
    assert admit(m, 0, toks(10)) == 0
    assert admit(m, 1, toks(10)) == 8                  # 2 full blocks; token 9 computed
    assert m.get_block_table(1)[:2] == m.get_block_table(0)[:2]
    assert admit(m, 2, toks(8)) == 4                   # 8 tokens: the last block recomputed
    assert admit(m, 3, toks(4) + [99] * 6) == 4        # diverges inside block 1
    assert admit(m, 4, toks(9), salt="tenant") == 0    # another namespace
    assert admit(m, 5, toks(9), salt="") == 8          # an empty salt is no salt (SGLang's)
    m.free(0)
    assert m.usage().num_cached_free_blocks == 0       # still locked by seqs 1-3


def test_locked_prefixes_survive_and_unlocked_leaves_go_least_recently_used_first():
    m = RadixKVCacheManager(BS, 6)
    admit(m, 0, toks(9, 100))                          # blocks 0, 1 cached, 2 private
    admit(m, 1, toks(9, 200))                          # blocks 3, 4 cached, 5 private
    m.free(0)                                          # 100.. unlocked first: older
    m.free(1)
    assert m.usage().num_cached_free_blocks == 4 and m.num_free_gpu_blocks == 6
    assert admit(m, 2, toks(9, 200)) == 8              # touches 200..: now most recent
    table = m.get_block_table(2)
    assert table[:2] == [3, 4]
    admit(m, 3, toks(9, 300))                          # 3 blocks: 1 on the stack + 100..
    assert m.get_computed_blocks(9, toks(9, 100))[1] == 0     # evicted
    assert m.get_computed_blocks(9, toks(9, 200))[1] == 8     # locked by seq 2: kept
    m.forget(9)


def test_a_block_filling_up_to_cached_content_is_not_merged():
    m = RadixKVCacheManager(BS, 16)
    admit(m, 0, toks(8, 50))                           # caches [50..53], [54..57]
    admit(m, 1, toks(5, 50))                           # hits block 0, owns a partial block
    own = m.get_block_table(1)[1]
    tokens = toks(8, 50) + [7]
    assert m.allocate_slots(1, tokens, 5, 4) is not None     # fills [54..57] and one more
    assert m.get_block_table(1)[1] == own != m.get_block_table(0)[1]
    assert 1 in m.diverged
    m.check_invariants()
    m.free(1)                                          # its private blocks go back
    m.check_invariants()


def test_allocate_slots_answers_none_when_short_and_changes_nothing():
    m = RadixKVCacheManager(BS, 4)
    admit(m, 0, toks(12))
    before = m.snapshot()
    hits, n = m.get_computed_blocks(1, toks(9, 40))
    assert m.allocate_slots(1, toks(9, 40), 0, 9, hits, admission=True) is None
    assert m.snapshot().pool == before.pool and m.snapshot().tables == before.tables
    with pytest.raises(ValueError, match="tokens to hold"):
        m.allocate_slots(0, toks(12), 12, 1)
    with pytest.raises(ValueError, match="not the cached prefix"):
        m.allocate_slots(2, toks(9), 0, 1, [3, 2])
    m.check_invariants()


def test_snapshot_restore_and_reset_and_the_detector_trips():
    m = RadixKVCacheManager(BS, 8)
    admit(m, 0, toks(9))
    snap = m.snapshot()
    admit(m, 1, toks(9))
    m.free(0)
    assert m.snapshot().pool != snap.pool
    m.restore(snap)
    assert m.snapshot().pool == snap.pool and m.seq_ids() == [0]
    m.check_invariants()
    assert m.reset_prefix_cache() is False
    m.forget(0)
    assert m.reset_prefix_cache() is True and m.usage().num_cached_free_blocks == 0
    admit(m, 2, toks(9))
    m.pool.free_blocks.append(m.get_block_table(2)[2])    # a held block also on the stack
    with pytest.raises(AssertionError, match="two places"):
        m.check_invariants()


def test_only_the_v1_design_takes_the_radix_tree():
    with pytest.raises(ValueError, match="prefix_cache must be"):
        CacheConfig(prefix_cache="trie")
    cc = CacheConfig(block_size=BS, num_gpu_blocks=8, prefix_cache="radix")
    assert isinstance(SchedulerV1(SchedulerConfig(), cc).kv_cache_manager, RadixKVCacheManager)
    with pytest.raises(ValueError, match="V1-design option"):
        Scheduler(SchedulerConfig(), cc)


class RadixManagerMachine(KVCacheManagerMachine):
    """The V1 manager's stateful test (hits must read the right prefix, a refused allocation
    changes nothing, free blocks = total - held) against the radix tree."""

    @initialize(num_blocks=st.integers(2, 24), caching=st.booleans(),
                watermark=st.sampled_from([0.0, 0.2]))
    def setup(self, num_blocks, caching, watermark):
        self.m = RadixKVCacheManager(BS, num_blocks, caching, watermark)
        self.seqs: dict[int, list] = {}
        self.kv: dict[int, list] = {b: [None] * BS for b in range(num_blocks)}
        self.next_id = 0


TestRadixManagerStateful = RadixManagerMachine.TestCase
TestRadixManagerStateful.settings = settings(max_examples=80, stateful_step_count=40)
