"""Chapter 14's memory layer: layer specs and their grouping, the null block, one manager per
KV-cache group (full attention, sliding window, chunked local) and the coordinator over them
(``course_lib/memory/v1``: kv_cache_interface, kv_cache_groups, single_type_kv_cache_manager,
kv_cache_coordinator, kv_cache_manager). Worked examples checked by hand, then a hypothesis
state machine over random full + sliding-window models."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from memory_helpers import pool_state
from property_budget import examples

from course_lib.memory.v1.block_pool import BlockPool
from course_lib.memory.v1.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from course_lib.memory.v1.kv_cache_groups import (
    get_kv_cache_groups,
    num_padding_layers,
    unify_kv_cache_spec_page_size,
)
from course_lib.memory.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from course_lib.memory.v1.kv_cache_manager import KVCacheManager

pytestmark = pytest.mark.ch14
BS = 2


def toks(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def full(bs: int = BS) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(("full",), FullAttentionSpec(bs))


def swa(window: int, bs: int = BS) -> KVCacheGroupSpec:
    return KVCacheGroupSpec((f"swa{window}",), SlidingWindowSpec(bs, sliding_window=window))


def hybrid(window: int = 4, num_blocks: int = 16, **kwargs) -> KVCacheManager:
    """Full attention (group 0) beside a sliding window (group 1), blocks of 2 tokens."""
    return KVCacheManager(BS, num_blocks, kv_cache_groups=[full(), swa(window)], **kwargs)


def free_queue(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


# ----------------------------------------------------------------- specs and groups
def test_page_size_is_k_and_v_of_a_block():
    spec = FullAttentionSpec(16, num_kv_heads=8, head_size=64, dtype_bytes=2)
    assert spec.page_size_bytes == 2 * 16 * 8 * 64 * 2
    assert SlidingWindowSpec(16, 8, 64, 2, sliding_window=128).page_size_bytes == \
        spec.page_size_bytes


def test_gpt_oss_alternating_layers_make_two_groups_of_twelve():
    layers = {f"layer.{i}": SlidingWindowSpec(16, 8, 64, sliding_window=128) if i % 2 == 0
              else FullAttentionSpec(16, 8, 64) for i in range(24)}
    groups = get_kv_cache_groups(layers)
    assert [len(g.layer_names) for g in groups] == [12, 12]
    assert groups[0].layer_names[:2] == ("layer.0", "layer.2")
    assert isinstance(groups[1].kv_cache_spec, FullAttentionSpec)
    assert num_padding_layers(groups) == 0


def test_gemma3_27b_five_local_per_global_make_seven_groups_with_eight_padding_layers():
    """62 layers, every sixth global: 52 local and 10 global; groups of 10 layers: the local
    ones dealt round-robin into six groups of 9, 9, 9, 9, 8, 8 (layers[i::6])."""
    layers = {f"l{i}": FullAttentionSpec(16, 16, 128) if (i + 1) % 6 == 0
              else SlidingWindowSpec(16, 16, 128, sliding_window=1024) for i in range(62)}
    groups = get_kv_cache_groups(layers)
    assert [len(g.layer_names) for g in groups] == [9, 9, 9, 9, 8, 8, 10]
    assert groups[0].layer_names[:3] == ("l0", "l7", "l14")
    assert num_padding_layers(groups) == 8


def test_a_draft_layer_pads_to_the_larger_kind_under_one_and_a_half_times():
    layers = {**{f"s{i}": SlidingWindowSpec(16, sliding_window=128) for i in range(12)},
              **{f"f{i}": FullAttentionSpec(16) for i in range(13)}}
    groups = get_kv_cache_groups(layers)
    assert [len(g.layer_names) for g in groups] == [12, 13]
    assert num_padding_layers(groups) == 1


def test_a_smaller_page_gets_a_larger_block():
    layers = {"a": FullAttentionSpec(16, num_kv_heads=8), "b": FullAttentionSpec(16, 2),
              "c": SlidingWindowSpec(16, 8, sliding_window=64)}
    unified = unify_kv_cache_spec_page_size(layers)
    assert [s.block_size for s in unified.values()] == [16, 64, 16]
    assert len({s.page_size_bytes for s in unified.values()}) == 1
    with pytest.raises(NotImplementedError, match="does not divide"):
        unify_kv_cache_spec_page_size({"a": FullAttentionSpec(16, 3),
                                       "b": FullAttentionSpec(16, 2)})


# ------------------------------------------------------------------ the null block
def test_the_null_block_only_where_a_group_needs_one():
    """A full-attention model keeps chapter 12's ids; a windowed group reserves block 0."""
    assert KVCacheManager(BS, 4).block_pool.null_block is None
    assert KVCacheManager(BS, 4).allocate_slots(0, toks(4), 0, 4) == [0, 1]
    m = hybrid(num_blocks=5)
    null = m.block_pool.null_block
    assert null.block_id == 0 and null.is_null and m.num_free_gpu_blocks == 4
    assert m.allocate_slots(0, toks(4), 0, 4) == [1, 2]
    assert m.get_block_tables(0) == ([1, 2], [3, 4])
    assert m.block_pool.get_usage() == 1.0
    pool = BlockPool(3, use_null_block=True)
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block])                # both skip it
    assert pool.null_block.ref_cnt == 0 and pool.get_num_free_blocks() == 2
    pool.check_invariants()
    assert KVCacheManager(BS, 4, kv_cache_groups=[swa(4)]).block_pool.null_block is not None


def test_the_manager_refuses_groups_of_another_block_size():
    with pytest.raises(ValueError, match="block_size 2"):
        KVCacheManager(BS, 8, kv_cache_groups=[full(), swa(4, bs=4)])
    with pytest.raises(ValueError, match="one or more groups"):
        KVCacheManager(BS, 8, kv_cache_groups=[])


# ---------------------------------------------------------------- a window slides
def test_blocks_that_leave_a_window_of_4_become_null():
    """Window 4, blocks of 2. After n computed tokens the next one reads the 3 before it, so
    n - 3 tokens are skipped: whole blocks of them are freed (at the next allocate_slots) and
    the table keeps block 0, the null block, in their place."""
    m = hybrid(window=4, num_blocks=16)
    m.allocate_slots(0, toks(8), 0, 8)                  # a prompt of 8: nothing skipped yet
    assert m.get_block_tables(0) == ([1, 2, 3, 4], [5, 6, 7, 8])
    tokens = toks(9)
    m.allocate_slots(0, tokens, 8, 1)                   # 8 computed: 5 skipped, 2 blocks
    assert m.get_block_tables(0) == ([1, 2, 3, 4, 9], [0, 0, 7, 8, 10])
    # freed back to front (the block that left last first), cached: the LRU end of the queue
    assert free_queue(m)[-2:] == [6, 5]
    tokens.append(10)
    m.allocate_slots(0, tokens, 9, 1)                   # 9 computed: 6 skipped, 3 blocks
    assert m.get_block_tables(0)[1] == [0, 0, 0, 8, 10]
    assert free_queue(m)[-1] == 7
    m.check_invariants()
    m.free(0)                                          # the nulls are not freed
    assert m.num_free_gpu_blocks == 15
    m.check_invariants()


def test_chunked_local_attention_frees_earlier_chunks():
    """Chunk 4, blocks of 2: after 9 computed tokens, the next one (9) is in chunk 8..11."""
    m = KVCacheManager(BS, 16, kv_cache_groups=[
        full(), KVCacheGroupSpec(("local",), ChunkedLocalAttentionSpec(BS,
                                                                       attention_chunk_size=4))])
    m.allocate_slots(0, toks(9), 0, 9)
    tokens = toks(10)
    m.allocate_slots(0, tokens, 9, 1)
    assert m.get_block_tables(0)[1] == [0, 0, 0, 0, 10]
    m.check_invariants()


# ------------------------------------------------------------------ hits with windows
def test_a_window_hit_needs_only_the_last_windows_blocks():
    """The same prompt again: full attention hits its 4 blocks; the sliding-window group
    needs only cdiv(4 - 1, 2) = 2 cached blocks before the hit's end, nulls before them, even
    once the first two are evicted."""
    m = hybrid(window=4, num_blocks=11)
    m.allocate_slots(0, toks(8), 0, 8)                 # full 1-4, window 5-8; free: 9, 10
    m.allocate_slots(0, toks(9), 8, 1)                 # window: 5, 6 out; full 9, window 10
    m.free(0)                                          # partial blocks first, cached last
    assert free_queue(m) == [10, 9, 6, 5, 4, 3, 2, 1, 8, 7]
    hits, n = m.get_computed_blocks(1, toks(8) + [50])
    assert n == 8 and [b.block_id for b in hits[0]] == [1, 2, 3, 4]
    assert [b.block_id for b in hits[1]] == [0, 0, 7, 8]
    m.allocate_slots(2, toks(4, 100), 0, 4)            # takes 10, 9, 6, 5: evicts 6 and 5
    assert m.get_block_tables(2) == ([10, 9], [6, 5])
    hits, n = m.get_computed_blocks(1, toks(8) + [50])
    assert n == 8 and [b.block_id for b in hits[1]] == [0, 0, 7, 8]
    m.check_invariants()


def cached_coordinator(groups, cached: dict[int, list[int]], num_blocks: int = 32):
    """A coordinator whose group ``g`` has the blocks at ``cached[g]`` of a 4-block prompt
    cached (hashes h0..h3), the others not."""
    coordinator = get_kv_cache_coordinator(KVCacheConfig(num_blocks, tuple(groups)))
    pool = coordinator.block_pool
    hashes = [f"h{i}".encode() for i in range(4)]
    for g, where in cached.items():
        blocks = pool.get_new_blocks(4)
        for i in where:
            pool.cache_full_blocks(blocks, hashes, i, i + 1, g)
    return coordinator, hashes


def test_a_windowed_group_shortens_the_full_attention_hit():
    """Full attention has all 4 blocks (8 tokens); the window (4: needs 2 blocks) has blocks
    0, 1 and 3 but not 2: from the right, block 3 alone is no window, so the hit ends after
    block 1: 4 tokens, and full attention's hit is cut to 2 blocks."""
    coordinator, hashes = cached_coordinator([full(), swa(4)], {0: [0, 1, 2, 3], 1: [0, 1, 3]})
    assert isinstance(coordinator, HybridKVCacheCoordinator)
    (full_hit, window_hit), n = coordinator.find_longest_cache_hit(hashes, 8)
    assert n == 4 and [b.block_id for b in full_hit] == [1, 2]     # block 0: the null block
    assert [b.block_id for b in window_hit] == [5, 6]


def test_the_fixed_point_goes_round_until_no_group_cuts():
    """Window 4 (2 blocks) cached at 0, 2, 3; window 6 (3 blocks) at 0, 1, 2. Round 1: full
    8, window 4: 8 (blocks 2, 3), window 6: 6 (blocks 0-2). Round 2: window 4 within 6: block
    2 alone, then block 0 alone from the start: 2 tokens; window 6 within 2: 2. Round 3 cuts
    nothing: 2 tokens."""
    coordinator, hashes = cached_coordinator(
        [full(), swa(4), swa(6)], {0: [0, 1, 2, 3], 1: [0, 2, 3], 2: [0, 1, 2]})
    hits, n = coordinator.find_longest_cache_hit(hashes, 8)
    assert n == 2 and [[b.block_id for b in h] for h in hits] == [[1], [5], [9]]
    unitary, _ = cached_coordinator([full()], {0: [0, 1, 3]})
    assert isinstance(unitary, UnitaryKVCacheCoordinator)
    assert unitary.find_longest_cache_hit(hashes, 8)[1] == 4


def test_a_short_prefix_under_one_window_is_a_hit():
    """No run of 3 blocks (window 6) anywhere: the run that starts at block 0 is the hit."""
    coordinator, hashes = cached_coordinator([swa(6)], {0: [0, 1, 3]})
    hits, n = coordinator.find_longest_cache_hit(hashes, 8)
    assert n == 4 and [b.block_id for b in hits[0]] == [1, 2]


def test_a_hit_already_out_of_the_window_is_not_touched():
    """A hit of 8 tokens with window 4: token 8 reads tokens 5..7, so the windowed group's
    hit starts with two null blocks; its two kept blocks and full attention's four are
    touched (held by both sequences now)."""
    m = hybrid(window=4, num_blocks=16)
    m.allocate_slots(0, toks(8), 0, 8)
    hits, n = m.get_computed_blocks(1, toks(9))
    assert n == 8
    m.allocate_slots(1, toks(9), 0, 1, hits, admission=True)
    assert m.get_block_tables(1) == ([1, 2, 3, 4, 9], [0, 0, 7, 8, 10])
    assert [m.block_pool.blocks[i].ref_cnt for i in (5, 6, 7, 8)] == [1, 1, 2, 2]
    m.check_invariants()


# -------------------------------------------------------------- the checker trips
def test_check_invariants_catches_a_wrong_ref_count():
    m = hybrid(window=4, num_blocks=16)
    m.allocate_slots(0, toks(8), 0, 8)
    m.check_invariants()
    m.block_pool.blocks[6].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref counts != tables"):
        m.check_invariants()


@pytest.mark.parametrize("num_tokens, group, index, message", [
    (8, 0, 0, "null blocks inside the window"),     # full attention: nothing leaves
    (4, 1, 0, "null blocks inside the window"),     # 4 slots, window 4: tokens 1..3 read
    (8, 1, 2, "a null block mid-table"),
])
def test_check_invariants_catches_a_misplaced_null_block(num_tokens, group, index, message):
    """The null block put where it must not be, the block that was there freed (so that the
    ref counts stay right): the checker names the misplaced null."""
    m = hybrid(window=4, num_blocks=16)
    m.allocate_slots(0, toks(num_tokens), 0, num_tokens)
    manager = m.coordinator.single_type_managers[group]
    block = manager.req_to_blocks[0][index]
    manager.req_to_blocks[0][index] = m.block_pool.null_block
    manager.req_to_block_ids[0][index] = 0
    m.block_pool.free_blocks([block])
    with pytest.raises(AssertionError, match=message):
        m.check_invariants()


# ---------------------------------------------------------------- state machine
class HybridMachine(RuleBasedStateMachine):
    """Random full + sliding-window models, random requests with shared prefixes: admit (a
    hit, a chunk), step (a chunk or a decode), preempt (freed), re-admit (looked up again),
    finish, reset. A model of the physical cache records, for every slot written, the prefix
    it was computed after: a hit must read the right prefix in each group where the next
    token reads it (all of it for full attention, the window for the windowed group), and a
    running sequence's window is never freed."""

    @initialize(window=st.integers(2, 9), num_blocks=st.integers(3, 24), caching=st.booleans())
    def setup(self, window, num_blocks, caching):
        self.window = window
        self.m = hybrid(window, num_blocks, enable_caching=caching)
        self.seqs: dict[int, list] = {}            # seq_id -> [tokens, num_computed]
        self.waiting: set[int] = set()             # preempted: no blocks
        self.kv = {b: [None] * BS for b in range(num_blocks)}
        self.next_id = 0

    def readable(self, group: int, upto: int) -> range:
        """Positions the token at ``upto`` reads in ``group``."""
        return range(upto) if group == 0 else range(max(0, upto - self.window + 1), upto)

    def write(self, seq_id: int, start: int, end: int) -> None:
        tokens = self.seqs[seq_id][0]
        for table in self.m.get_block_tables(seq_id):
            for p in range(start, end):
                assert table[p // BS] != 0, "a token written to the null block"
                self.kv[table[p // BS]][p % BS] = tuple(tokens[:p + 1])

    def reads_ok(self, seq_id: int, upto: int) -> bool:
        tokens = self.seqs[seq_id][0]
        return all(self.kv[table[p // BS]][p % BS] == tuple(tokens[:p + 1])
                   for g, table in enumerate(self.m.get_block_tables(seq_id))
                   for p in self.readable(g, upto))

    def allocate(self, seq_id: int, chunk: int, admission: bool) -> None:
        tokens, done = self.seqs[seq_id]
        before = pool_state(self.m)
        hits, num_hit = self.m.get_computed_blocks(seq_id, tokens) if admission \
            else ((), 0)
        num_new = min(chunk, len(tokens) - done - num_hit)
        if num_new <= 0:
            return
        ids = self.m.allocate_slots(seq_id, tokens, done, num_new, hits, admission=admission)
        if ids is None:
            if admission:
                assert pool_state(self.m) == before, "a refused admission changed state"
            return
        self.waiting.discard(seq_id)
        assert self.reads_ok(seq_id, done + num_hit), "a hit reads another prefix"
        self.write(seq_id, done + num_hit, done + num_hit + num_new)
        self.seqs[seq_id][1] = done + num_hit + num_new

    @rule(prefix=st.sampled_from([tuple(range(1, 13)), (1, 2, 3, 4, 9), (5,) * 10]),
          cut=st.integers(0, 12), suffix=st.lists(st.integers(0, 3), max_size=6),
          chunk=st.integers(1, 12))
    def admit(self, prefix, cut, suffix, chunk):
        tokens = list(prefix[:cut]) + suffix
        if not tokens:
            return
        seq_id = self.next_id
        self.next_id += 1
        self.seqs[seq_id] = [tokens, 0]
        self.waiting.add(seq_id)
        self.allocate(seq_id, chunk, admission=True)

    def running(self) -> list[int]:
        return sorted(set(self.seqs) - self.waiting)

    @precondition(lambda self: set(self.seqs) - self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 6), new=st.integers(0, 3))
    def step(self, data, chunk, new):
        seq_id = data.draw(st.sampled_from(self.running()))
        tokens, done = self.seqs[seq_id]
        if done == len(tokens):
            tokens.append(new)                      # a decoded token joins the sequence
        self.allocate(seq_id, chunk, admission=False)

    @precondition(lambda self: set(self.seqs) - self.waiting)
    @rule(data=st.data())
    def preempt(self, data):
        seq_id = data.draw(st.sampled_from(self.running()))
        self.m.free(seq_id)
        self.seqs[seq_id][1] = 0
        self.waiting.add(seq_id)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def readmit(self, data, chunk):
        self.allocate(data.draw(st.sampled_from(sorted(self.waiting))), chunk, admission=True)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.m.forget(seq_id)
        del self.seqs[seq_id]
        self.waiting.discard(seq_id)

    @rule()
    def reset(self):
        assert self.m.reset_prefix_cache() == (not self.running())

    @invariant()
    def consistent(self):
        self.m.check_invariants()
        held = {b for s in self.running() for t in self.m.get_block_tables(s) for b in t} - {0}
        assert self.m.num_free_gpu_blocks == self.m.num_gpu_blocks - 1 - len(held)
        for seq_id in self.running():              # the next token's window is all there
            assert self.reads_ok(seq_id, self.seqs[seq_id][1]), "a window block was freed"


TestHybridStateful = HybridMachine.TestCase
TestHybridStateful.settings = settings(max_examples=examples(60), stateful_step_count=40,
                                       deadline=None)


def test_usage_counts_every_group_and_not_the_null_block():
    """usage() over a full and a windowed group: the null block is no block to hold, the
    windowed table's null entries are not held entries; held blocks = what the pool lent."""
    groups = [KVCacheGroupSpec(("full",), FullAttentionSpec(2)),
              KVCacheGroupSpec(("swa",), SlidingWindowSpec(2, sliding_window=4))]
    kvm = KVCacheManager(2, 32, enable_caching=False, kv_cache_groups=groups)
    tokens = list(range(1, 12))                        # 11 tokens
    assert kvm.allocate_slots(0, tokens, 0, 11) is not None
    tokens.append(12)
    assert kvm.allocate_slots(0, tokens, 11, 1) is not None     # the window has moved on
    full, swa = kvm.get_block_tables(0)
    nulls = swa.count(kvm.block_pool.null_block.block_id)
    assert len(full) == len(swa) == 6 and nulls > 0
    u = kvm.usage()
    assert u.num_total_blocks == 31                            # block 0 is the null block
    assert u.num_table_entries == len(full) + len(swa) - nulls
    assert u.num_held_blocks == 31 - kvm.num_free_gpu_blocks == u.num_table_entries
    kvm.check_invariants()
