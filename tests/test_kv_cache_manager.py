"""vLLM V1's KVCacheManager and BlockPool: the free-block queue, hashing, hits, eviction order,
allocation without a probe, and a stateful hypothesis test with the invariants."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from memory_helpers import pool_state
from property_budget import examples

from course_lib.memory.v1.block_pool import (
    HASH_FUNCTIONS,
    NONE_HASH,
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    block_hash_extra_keys,
    hash_block_tokens,
    none_hash_for,
    resolve_none_hash_seed,
    sha256,
    sha256_cbor,
    xxhash,
    xxhash_cbor,
)
from course_lib.memory.v1.kv_cache_manager import KVCacheManager

pytestmark = pytest.mark.ch06
BS = 4


def toks(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


# ------------------------------------------------------------------ free block queue
def test_free_queue_pops_front_removes_from_the_middle_and_keeps_both_links():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 1, 2, 3, 4]
    q.remove(blocks[2])                                # a prefix hit: O(1), from the middle
    assert q.popleft() is blocks[0] and q.num_free_blocks == 3
    q.prepend_n([blocks[0]])
    q.append(blocks[2])
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 1, 3, 4, 2]
    assert [b.block_id for b in q.popleft_n(5)] == [0, 1, 3, 4, 2]
    with pytest.raises(ValueError, match="No free blocks available"):        # vLLM's
        q.popleft()
    with pytest.raises(RuntimeError, match="remove.. called on an invalid block"):
        q.remove(blocks[1])


def test_a_corrupted_free_queue_fails_as_vllms_does():
    """A block whose links a caller broke: popleft raises vLLM's RuntimeError, and so does a
    second remove of the same block (tests/fidelity compares these with vLLM's own queue)."""
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = FreeKVCacheBlockQueue(blocks)
    blocks[0].next_free_block = None                   # corrupted by a caller
    with pytest.raises(RuntimeError, match="doesn't have a valid next_free_block"):
        q.popleft()
    q = FreeKVCacheBlockQueue(blocks := [KVCacheBlock(i) for i in range(3)])
    q.remove(blocks[1])
    with pytest.raises(RuntimeError, match="invalid block"):
        q.remove(blocks[1])
    with pytest.raises(ValueError, match="Cannot get 4 free blocks from the pool"):
        BlockPool(3).get_new_blocks(4)


def test_hashes_chain_from_vllms_none_hash_and_equal_content_gives_equal_hashes():
    assert NONE_HASH == sha256(os.environ.get("PYTHONHASHSEED", "vllm-none-hash"))
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(NONE_HASH, (1, 2, 3, 4))
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    salted = block_hash_extra_keys(0, "salt")
    assert salted == (("cache_salt", "salt"),)         # vLLM's generate_block_hash_extra_keys
    assert hash_block_tokens(None, [1, 2, 3, 4], salted) != first
    assert block_hash_extra_keys(4, "salt") is None    # the first block only
    assert block_hash_extra_keys(0, "") is None        # an empty salt is no salt


def test_none_hash_seed_is_vllms(monkeypatch):
    """vLLM's resolve_none_hash_seed: PYTHONHASHSEED wins; else the fixed seed for sha256,
    random (once per process) for xxhash."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert resolve_none_hash_seed(sha256) == "vllm-none-hash"
    assert resolve_none_hash_seed(sha256_cbor) == "vllm-none-hash"
    seed = resolve_none_hash_seed(xxhash)
    assert seed != "vllm-none-hash" and len(seed) == 64
    assert resolve_none_hash_seed(xxhash_cbor) == seed                 # once per process
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert resolve_none_hash_seed(sha256) == resolve_none_hash_seed(xxhash) == "42"
    assert none_hash_for(sha256) == sha256("42")


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_the_manager_takes_vllms_four_hash_algorithms(algo):
    m = KVCacheManager(BS, 16, prefix_caching_hash_algo=algo)
    assert m.hash_fn is HASH_FUNCTIONS[algo]
    admit(m, 0, toks(9))
    assert admit(m, 1, toks(9)) == 8
    first = hash_block_tokens(None, toks(4), None, m.hash_fn, m.none_hash)
    assert m.req_to_block_hashes[0][0] == first and len(first) in (16, 32)
    m.check_invariants()


@pytest.mark.parametrize("algo", ["builtin", "md5"])
def test_the_manager_refuses_a_hash_vllm_has_not(algo):
    with pytest.raises(ValueError, match="Unsupported hash function"):
        KVCacheManager(BS, 16, prefix_caching_hash_algo=algo)


# -------------------------------------------------------------------- the manager
def admit(m: KVCacheManager, seq_id: int, tokens: list[int], salt=None) -> int:
    hits, num_hit = m.get_computed_blocks(seq_id, tokens, salt)
    assert m.allocate_slots(seq_id, tokens, 0, len(tokens) - num_hit, hits,
                            admission=True) is not None
    m.record_prefix_cache_stats(len(tokens), num_hit)
    return num_hit


def test_a_second_prompt_hits_the_first_ones_full_blocks_but_never_its_last_token():
    m = KVCacheManager(BS, 16)
    assert admit(m, 0, toks(10)) == 0
    assert admit(m, 1, toks(10)) == 8                  # 2 full blocks; token 9 in a partial
    assert m.get_block_table(1)[:2] == m.get_block_table(0)[:2]
    assert admit(m, 2, toks(8)) == 4                   # all full, but the last token computes
    assert m.prefix_cache_stats.hits == 12 and m.prefix_cache_stats.queries == 28
    m.check_invariants()


def test_freed_blocks_never_cached_are_reused_first_cached_ones_last_in_lru_order():
    m = KVCacheManager(BS, 8)
    admit(m, 0, toks(10))                              # blocks 0, 1 cached; 2 partial
    admit(m, 1, toks(6, 100))                          # block 3 cached; 4 partial
    m.free(0)
    m.free(1)
    queue = [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
    # never-cached partial blocks first (1's, then 0's), then the fresh ones, then the
    # cached ones, tail of each chain first, least recently freed first
    assert queue[:2] == [4, 2] and queue[-3:] == [1, 0, 3]
    assert m.usage().num_cached_free_blocks == 3
    m.check_invariants()


def test_equal_blocks_are_not_merged_and_allocation_evicts_from_the_front():
    m = KVCacheManager(BS, 4)
    m.get_computed_blocks(0, toks(8))
    assert m.allocate_slots(0, toks(8), 0, 4) == [0]   # a first chunk of 4 tokens
    m.get_computed_blocks(1, toks(8))                  # same prompt, nothing cached yet? no:
    hits, n = m.get_computed_blocks(1, toks(8))        # block 0 was cached when allocated
    assert [b.block_id for b in hits] == [0] and n == 4
    assert m.allocate_slots(0, toks(8), 4, 4) == [0, 1]
    # a third sequence fills its own block with the same tokens: not merged into block 0
    m.get_computed_blocks(2, toks(5))
    assert m.allocate_slots(2, toks(5), 0, 5) == [2, 3]
    assert len(m.block_pool.cached_block_hash_to_block[m.req_to_block_hashes[0][0]]) == 2
    m.check_invariants()


def test_allocate_slots_answers_none_when_short_and_changes_nothing():
    m = KVCacheManager(BS, 3, watermark=0.34)          # 1 block held back from admissions
    admit(m, 0, toks(8))
    before = pool_state(m)
    hits, _ = m.get_computed_blocks(1, toks(5, 50))
    assert m.allocate_slots(1, toks(5, 50), 0, 5, hits, admission=True) is None
    assert pool_state(m) == before and m.get_block_table(0) == [0, 1]
    assert not m.has_seq(1)
    assert m.allocate_slots(0, toks(9), 8, 1) == [0, 1, 2]   # a running one may use it
    m.check_invariants()


def test_a_decode_step_extends_the_sequences_lists_and_hashes_only_the_block_it_filled():
    """vLLM extends a request's blocks and block hashes in place
    (``single_type_kv_cache_manager.py``, ``Request.block_hashes``): a decode step's cost does
    not grow with the sequence. The ids handed out are the sequence's own list, growing."""
    calls = []

    def counting_sha256(value):
        calls.append(value)
        return sha256(value)

    m = KVCacheManager(BS, 64)
    m.hash_fn = counting_sha256
    tokens = toks(9)
    ids = m.allocate_slots(0, tokens, 0, 9)
    assert ids == [0, 1, 2] and len(calls) == 2            # two full blocks hashed
    hashes = m.req_to_block_hashes[0]
    for n in range(9, 30):
        tokens.append(n + 1)
        out = m.allocate_slots(0, tokens, n, 1)
        assert out is ids                                   # no copy, no rebuild
        assert m.req_to_block_hashes[0] is hashes
        assert len(calls) == (n + 1) // BS                  # each full block hashed once
        m.check_invariants()
    assert ids == m.get_block_table(0) and ids is not m.get_block_table(0)
    assert [b.block_id for b in m.req_to_blocks[0]] == ids


def test_a_salt_changes_the_first_hash_only_and_separates_namespaces():
    m = KVCacheManager(BS, 16)
    admit(m, 0, toks(9), salt="alice")
    assert admit(m, 1, toks(9), salt="bob") == 0
    assert admit(m, 2, toks(9), salt="alice") == 8
    a, b = m.req_to_block_hashes[0], m.req_to_block_hashes[1]
    assert a[0] != b[0] and a[1] != b[1]               # the chain carries the salt on
    assert admit(m, 3, toks(9)) == 0 and admit(m, 4, toks(9), salt="") == 8   # "": no salt


def test_reset_prefix_cache_only_when_idle_and_invariants_catch_corruption():
    m = KVCacheManager(BS, 8)
    admit(m, 0, toks(9))
    assert not m.reset_prefix_cache()
    m.forget(0)
    assert m.reset_prefix_cache() and not m.block_pool.cached_block_hash_to_block
    admit(m, 1, toks(9))
    m.check_invariants()
    m.block_pool.blocks[m.get_block_table(1)[0]].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref counts != tables"):
        m.check_invariants()
    pool = BlockPool(2)
    pool.free_blocks([pool.blocks[0]])                 # a block nobody holds, freed (vLLM's)
    with pytest.raises(AssertionError, match="queue != ref-0 blocks"):
        pool.check_invariants()


# ------------------------------------------------------------------- stateful test
class KVCacheManagerMachine(RuleBasedStateMachine):
    """Random admissions, chunks, decodes, frees and resets; a model of the physical cache
    in which each slot records the whole prefix it was computed after: a hit must read the
    right prefix (sha256 is trusted, so this also checks the chain)."""

    @initialize(num_blocks=st.integers(2, 24), caching=st.booleans(),
                watermark=st.sampled_from([0.0, 0.2]))
    def setup(self, num_blocks, caching, watermark):
        self.m = KVCacheManager(BS, num_blocks, caching, watermark)
        self.seqs: dict[int, list] = {}            # seq_id -> [tokens, num_computed]
        self.kv: dict[int, list] = {b: [None] * BS for b in range(num_blocks)}
        self.next_id = 0

    def write(self, seq_id: int, start: int, end: int) -> None:
        tokens = self.seqs[seq_id][0]
        table = self.m.get_block_table(seq_id)
        for p in range(start, end):
            self.kv[table[p // BS]][p % BS] = tuple(tokens[:p + 1])

    def read_ok(self, seq_id: int, upto: int) -> bool:
        tokens = self.seqs[seq_id][0]
        table = self.m.get_block_table(seq_id)
        return all(self.kv[table[p // BS]][p % BS] == tuple(tokens[:p + 1])
                   for p in range(upto))

    @rule(prefix=st.sampled_from([(1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9), (5,) * 8]),
          cut=st.integers(0, 8), suffix=st.lists(st.integers(0, 3), max_size=6),
          chunk=st.integers(1, 12))
    def admit(self, prefix, cut, suffix, chunk):
        tokens = list(prefix[:cut]) + suffix
        if not tokens:
            return
        seq_id, before = self.next_id, pool_state(self.m)
        self.next_id += 1
        hits, num_hit = self.m.get_computed_blocks(seq_id, tokens)
        num_new = min(chunk, len(tokens) - num_hit)
        ids = self.m.allocate_slots(seq_id, tokens, 0, num_new, hits, admission=True)
        if ids is None:
            self.m.forget(seq_id)
            assert pool_state(self.m) == before, "a refused allocation changed state"
            return
        self.seqs[seq_id] = [tokens, num_hit]
        assert self.read_ok(seq_id, num_hit), "a hit reads another prefix"
        self.write(seq_id, num_hit, num_hit + num_new)
        self.seqs[seq_id][1] += num_new

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), chunk=st.integers(1, 6), new=st.integers(0, 3))
    def step(self, data, chunk, new):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens, done = self.seqs[seq_id]
        if done == len(tokens):
            tokens.append(new)                      # a decoded token joins the sequence
        num_new = min(chunk, len(tokens) - done)
        if self.m.allocate_slots(seq_id, tokens, done, num_new) is None:
            return
        self.write(seq_id, done, done + num_new)
        self.seqs[seq_id][1] += num_new

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.m.forget(seq_id)
        del self.seqs[seq_id]

    @rule()
    def reset(self):
        assert self.m.reset_prefix_cache() == (not self.seqs)

    @invariant()
    def consistent(self):
        self.m.check_invariants()
        held = {b for s in self.seqs for b in self.m.get_block_table(s)}
        assert self.m.num_free_gpu_blocks == self.m.num_gpu_blocks - len(held)


TestKVCacheManagerStateful = KVCacheManagerMachine.TestCase
TestKVCacheManagerStateful.settings = settings(max_examples=examples(80), stateful_step_count=40)
