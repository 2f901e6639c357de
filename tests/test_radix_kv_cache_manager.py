"""SGLang's radix tree as the V1 pair's prefix cache: exact-token hits on whole blocks, locks
instead of reference counts, eviction of unlocked leaves in LRU order, computed blocks inserted
after the step with the duplicates freed and the table switched onto the tree's (SGLang's
``RadixCache.checkpoint``), pages handed out in SGLang's order, a refused allocation changing
nothing; and the V1 manager's stateful test run against it."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule
from memory_helpers import pool_state, tables, v1_state
from property_budget import examples
from test_kv_cache_manager import KVCacheManagerMachine

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.memory.radix.allocator import BlockSlotPool, SlotPool
from course_lib.memory.radix.kv_cache_manager import RadixKVCacheManager
from course_lib.scheduler.scheduler import Scheduler
from course_lib.scheduler.v1 import SchedulerV1
from course_lib.sequence import SamplingParams

pytestmark = pytest.mark.ch12
BS = 4


def toks(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def admit(m: RadixKVCacheManager, seq_id: int, tokens: list[int], salt=None,
          run: bool = True) -> int:
    """Look up, allocate the rest and (``run``) let the step compute it: the scheduler's
    ``update`` then calls ``cache_computed``."""
    hits, num_hit = m.get_computed_blocks(seq_id, tokens, salt)
    assert m.allocate_slots(seq_id, tokens, 0, len(tokens) - num_hit, hits,
                            admission=True) is not None
    m.check_invariants()
    if run:
        m.cache_computed(seq_id, tokens, len(tokens))
        m.check_invariants()
    return num_hit


def test_block_slot_pool_hands_out_and_takes_back_whole_blocks():
    pool = BlockSlotPool(3, BS)
    assert pool.alloc(2 * BS) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert pool.alloc(2 * BS) is None and pool.num_free_blocks == 1
    pool.free(list(range(4, 8)))
    with pytest.raises(AssertionError, match="double free"):
        pool.free(list(range(4, 8)))
    assert pool.free_slots() == set(range(4, 12))


def test_pages_go_out_in_sglangs_order():
    """PagedTokenToKVPoolAllocator (need_sort off): pages from the front, ascending at first;
    freed pages to the front in the order given. TokenToKVPoolAllocator (page size 1): slots
    from the front, freed ones to the back."""
    pool = BlockSlotPool(6, 1)
    assert pool.alloc(3) == [0, 1, 2]
    pool.free([2, 0])
    pool.free([1])
    assert pool.alloc(4) == [1, 2, 0, 3]
    slots = SlotPool(6)
    assert slots.alloc(3) == [0, 1, 2]
    slots.free([2, 0])
    slots.free([1])
    assert slots.alloc(6) == [3, 4, 5, 2, 0, 1]


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


def test_nothing_enters_the_tree_before_the_step_that_computes_it():
    m = RadixKVCacheManager(BS, 8)
    admit(m, 0, toks(9), run=False)                    # allocated, not computed yet
    assert m.tree.total_size() == 0 and m.get_computed_blocks(1, toks(9)) == ([], 0)
    m.cache_computed(0, toks(9), 5)                    # a first chunk of 5 tokens ran
    assert m.get_computed_blocks(1, toks(9)) == ([0], 4)
    m.check_invariants()


def test_a_second_request_computing_a_cached_prefix_is_switched_onto_the_trees_blocks():
    """Two requests with one prompt, admitted in the same step: neither hits, each computes
    the prompt in its own blocks. After the step the first one's full blocks enter the tree;
    the second one's are duplicates: freed, its table switched, its lock on the same node."""
    m = RadixKVCacheManager(BS, 8)
    admit(m, 0, toks(9), run=False)
    admit(m, 1, toks(9), run=False)
    assert m.get_block_table(0) == [0, 1, 2] and m.get_block_table(1) == [3, 4, 5]
    m.cache_computed(0, toks(9), 9)
    m.check_invariants()
    m.cache_computed(1, toks(9), 9)                    # insert answers 8: blocks 3, 4 are dups
    m.check_invariants()
    assert m.get_block_table(1) == [0, 1, 5]           # the tree's blocks, then its own tail
    assert m.allocate_slots(1, toks(10), 9, 1) == [0, 1, 5]     # what the next step reads
    node = m.last_node[0]
    assert m.last_node[1] is node and node.lock_ref == 2 and m.num_cached_block[1] == 2
    assert m.pool.num_free_blocks == 4 and m.num_free_gpu_blocks == 4
    admit(m, 2, toks(8, 50), run=False)                # the freed duplicates go out first
    assert m.get_block_table(2) == [3, 4]
    m.free(0)
    assert node.lock_ref == 1
    m.free(1)
    assert node.lock_ref == 0 and m.usage().num_cached_free_blocks == 2
    assert m.get_computed_blocks(3, toks(9)) == ([0, 1], 8)
    m.check_invariants()


def test_the_lock_moves_to_the_end_of_what_was_computed():
    m = RadixKVCacheManager(BS, 8)
    tokens = toks(13)
    assert m.allocate_slots(0, tokens, 0, 6, admission=True) == [0, 1]
    m.cache_computed(0, tokens, 6)                     # one full block
    first = m.last_node[0]
    assert first.key == (1, 2, 3, 4) and first.lock_ref == 1
    assert m.allocate_slots(0, tokens, 6, 7) == [0, 1, 2, 3]
    m.cache_computed(0, tokens, 13)                    # three: the lock moves down
    assert m.last_node[0] is not first and m.last_node[0].key == tuple(range(5, 13))
    assert first.lock_ref == 1 and m.tree.protected_size() == 12
    m.check_invariants()
    m.free(0)                                          # the path stays, evictable
    assert m.tree.protected_size() == 0 and m.tree.evictable_size() == 12
    assert m.get_computed_blocks(1, toks(13)) == ([0, 1, 2], 12)
    m.check_invariants()


def test_an_insert_past_the_prompt_splits_at_the_prompts_last_whole_block():
    """SGLang's ``split_prompt``: eviction can then drop the generated part alone. A
    preempted sequence recomputes prompt and output in one step: one insert past the prompt."""
    for prompt_len, edges in ((6, [(1, 2, 3, 4), (5, 6, 7, 8)]), (None, [tuple(range(1, 9))])):
        m = RadixKVCacheManager(BS, 8)
        m.allocate_slots(0, toks(10), 0, 10, admission=True)
        m.cache_computed(0, toks(10), 10, prompt_len)
        assert sorted(n.key for n in m.tree.nodes()) == edges
        assert m.get_block_table(0) == [0, 1, 2]
        m.check_invariants()


def test_a_decoded_block_duplicating_the_tree_is_switched_too():
    """What V1 leaves private (a block that fills up to content already cached) is switched,
    after the step that filled it."""
    m = RadixKVCacheManager(BS, 16)
    admit(m, 0, toks(8, 50))                           # caches [50..53], [54..57]
    admit(m, 1, toks(5, 50))                           # hits block 0, owns a partial block
    own = m.get_block_table(1)[1]
    tokens = toks(8, 50) + [7]
    assert m.allocate_slots(1, tokens, 5, 4)[1] == own    # the step writes [54..57] there
    m.cache_computed(1, tokens, 9)
    assert m.get_block_table(1)[:2] == m.get_block_table(0)[:2]
    assert m.pool.is_free(own) and m.num_cached_block[1] == 2
    m.check_invariants()
    m.free(1)
    m.check_invariants()


def test_cache_computed_without_a_new_full_block_or_caching_is_a_no_op():
    m = RadixKVCacheManager(BS, 8)
    admit(m, 0, toks(9))
    admit(m, 1, toks(9, 40), run=False)
    before = v1_state(m)
    m.cache_computed(1, toks(9, 40), 3)                # no full block computed yet
    assert v1_state(m) == before
    m.cache_computed(1, toks(9, 40), 9)
    assert v1_state(m) != before and m.num_cached_block[1] == 2
    m.check_invariants()
    before = v1_state(m)
    m.cache_computed(0, toks(9), 9)                    # nothing new: a no-op
    m.cache_computed(7, toks(9), 9)                    # no blocks: a no-op
    assert v1_state(m) == before
    off = RadixKVCacheManager(BS, 8, enable_caching=False)
    admit(off, 0, toks(9))
    assert off.tree.total_size() == 0 and off.get_block_table(0) == [0, 1, 2]
    off.check_invariants()


def test_allocate_slots_answers_none_when_short_and_changes_nothing():
    m = RadixKVCacheManager(BS, 4)
    admit(m, 0, toks(12))
    before = pool_state(m), tables(m)
    hits, n = m.get_computed_blocks(1, toks(9, 40))
    assert m.allocate_slots(1, toks(9, 40), 0, 9, hits, admission=True) is None
    assert (pool_state(m), tables(m)) == before
    m.check_invariants()


def test_reset_only_when_idle_and_the_detector_trips():
    m = RadixKVCacheManager(BS, 8)
    admit(m, 0, toks(9))
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


def test_the_v1_scheduler_switches_after_the_step():
    """Through ``SchedulerV1.update``: two requests with one prompt run their prefill in one
    step; the next step's block ids are the switched ones."""
    cc = CacheConfig(block_size=BS, num_gpu_blocks=8, enable_prefix_caching=True,
                     prefix_cache="radix")
    s = SchedulerV1(SchedulerConfig(max_num_batched_tokens=64), cc)
    for i in range(2):
        s.add_request(i, toks(9), SamplingParams(max_tokens=4, temperature=0.0))
    kvm = s.kv_cache_manager
    out = s.schedule()
    assert [e.block_ids for e in out.scheduled] == [[0, 1, 2], [3, 4, 5]]
    s.update(out, {e.seq.seq_id: [(7, 0.0)] for e in out.scheduled})
    assert kvm.get_block_table(1) == [0, 1, 5] and kvm.pool.num_free_blocks == 4
    s.check_invariants()
    out = s.schedule()                                 # the decode step reads the tree's
    assert [e.block_ids for e in out.scheduled] == [[0, 1, 2], [0, 1, 5]]
    s.check_invariants()
    while s.has_unfinished_requests():                 # finished: freed, the tree keeps
        s.update(out, {e.seq.seq_id: [(7, 0.0)] for e in out.scheduled})   # what they computed
        out = s.schedule()
    assert kvm.seq_ids() == [] and kvm.tree.protected_size() == 0
    assert kvm.get_computed_blocks(9, toks(9) + [7] * 4)[1] == 12      # 9 + 3 decoded: 3 blocks
    s.check_invariants()


class RadixManagerMachine(KVCacheManagerMachine):
    """The V1 manager's stateful test (hits must read the right prefix, a refused allocation
    changes nothing, free blocks = total - held) against the radix tree; after each simulated
    step the sequence reports what it computed (``cache_computed``, as the V1 scheduler's
    ``update`` does), and its computed full blocks must then be the tree's."""

    @initialize(num_blocks=st.integers(2, 24), caching=st.booleans(),
                watermark=st.sampled_from([0.0, 0.2]))
    def setup(self, num_blocks, caching, watermark):
        self.m = RadixKVCacheManager(BS, num_blocks, caching, watermark)
        self.seqs: dict[int, list] = {}
        self.kv: dict[int, list] = {b: [None] * BS for b in range(num_blocks)}
        self.next_id = 0

    @rule(prefix=st.sampled_from([(1, 2, 3, 4, 5, 6, 7, 8), (5,) * 8]),
          cut=st.integers(4, 8), chunk=st.integers(4, 12))
    def admit_twins(self, prefix, cut, chunk):
        """Two sequences with one prompt in the same step: the second finds nothing the first
        computes, and after the step its duplicates are freed and its table switched."""
        admitted = []
        for _ in range(2):
            tokens, seq_id = list(prefix[:cut]), self.next_id
            self.next_id += 1
            hits, num_hit = self.m.get_computed_blocks(seq_id, tokens)
            num_new = min(chunk, len(tokens) - num_hit)
            if self.m.allocate_slots(seq_id, tokens, 0, num_new, hits, admission=True) is None:
                self.m.forget(seq_id)
                break
            self.seqs[seq_id] = [tokens, num_hit]
            assert self.read_ok(seq_id, num_hit), "a hit reads another prefix"
            admitted.append((seq_id, num_hit, num_new))
        for seq_id, num_hit, num_new in admitted:
            self.write(seq_id, num_hit, num_hit + num_new)
            self.seqs[seq_id][1] += num_new

    def write(self, seq_id: int, start: int, end: int) -> None:
        super().write(seq_id, start, end)              # the step ran; then its update
        tokens = self.seqs[seq_id][0]
        self.m.cache_computed(seq_id, tokens, end)
        assert self.read_ok(seq_id, end), "a switched table reads another prefix"
        if self.m.enable_caching:
            assert self.m.num_cached_block.get(seq_id, 0) == end // BS, "a block not cached"


TestRadixManagerStateful = RadixManagerMachine.TestCase
TestRadixManagerStateful.settings = settings(max_examples=examples(80), stateful_step_count=40)


class _WalkingManager(RadixKVCacheManager):
    """The reference: every ``cache_computed`` walks from the root (insert, split at the
    prompt, match, move the lock), the decode steps included."""

    def _cache_decoded(self, seq_id, token_ids, node, done, num_full, prompt_blocks):
        self._cache_walked(seq_id, token_ids, done, num_full, prompt_blocks)


@pytest.mark.parametrize("seed", range(4))
def test_a_decoded_block_is_attached_below_the_lock_as_the_walk_from_the_root_would(seed):
    """``cache_computed`` of a decoding sequence attaches its new blocks below its locked node
    without walking the path; what it leaves (nodes, splits, locks, access times, the clock,
    the tables, the free list, hence every later eviction) is what the walk leaves."""
    import random

    from memory_helpers import canonical_state

    rng = random.Random(seed)
    fast, ref = RadixKVCacheManager(BS, 40), _WalkingManager(BS, 40)
    prompts = [toks(rng.randint(2, 14), 100 * rng.randint(0, 2)) for _ in range(6)]
    tokens: dict[int, list[int]] = {}
    computed: dict[int, int] = {}
    for _ in range(400):
        seq = rng.randrange(6)
        if seq not in tokens:                             # admit (a prompt, or back after a
            tokens[seq] = tokens.get(-seq - 1) or list(prompts[seq])      # preemption)
            tokens.pop(-seq - 1, None)
            answers = []
            for m in (fast, ref):
                hits, num_hit = m.get_computed_blocks(seq, tokens[seq])
                answers.append(m.allocate_slots(seq, tokens[seq], 0, len(tokens[seq]) - num_hit,
                                                hits, admission=True))
            assert answers[0] == answers[1]
            if answers[0] is None:
                del tokens[seq]
                continue
            computed[seq] = len(tokens[seq])
        elif rng.random() < 0.1:                          # preempt or finish
            for m in (fast, ref):
                m.free(seq)
            if rng.random() < 0.5:
                tokens[-seq - 1] = tokens[seq]            # comes back with what it computed
            del tokens[seq]
            continue
        else:                                             # one decode step
            tokens[seq].append(rng.randrange(3))          # few values: duplicates happen
            answers = [m.allocate_slots(seq, tokens[seq], computed[seq], 1) for m in (fast, ref)]
            assert answers[0] == answers[1]
            if answers[0] is None:
                continue
            computed[seq] += 1
        for m in (fast, ref):
            m.cache_computed(seq, tokens[seq], computed[seq], len(prompts[seq]))
            m.check_invariants()
        assert canonical_state(fast.tree) == canonical_state(ref.tree)
        assert fast.tree._clock == ref.tree._clock
        assert fast.req_to_blocks == ref.req_to_blocks
        assert fast.num_cached_block == ref.num_cached_block
