"""The course's V1 pair (``course_lib.memory.v1``) beside vLLM 0.33.0's own ``vllm.v1.core``:
the same hypothesis-generated operations, the same answers (tests/fidelity/vllm_twins.py says
what is compared). Differences that remain are declared: test_declared_differences.py."""

from __future__ import annotations

import random

import pytest
from harness import run_lockstep
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm_twins import CourseManager, CourseQueue, RealManager, RealQueue

from course_lib.memory.v1 import block_pool as course_pool
from course_lib.memory.v1.kv_cache_manager import KVCacheManager

ALGOS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
SALTS = [None, "", "alice", "bob"]
N_QUEUE = 5

queue_ops = st.lists(st.one_of(
    st.just(("popleft",)),
    st.tuples(st.just("popleft_n"), st.integers(0, 3)),
    st.tuples(st.sampled_from(["remove", "append"]), st.integers(0, N_QUEUE - 1)),
    st.tuples(st.sampled_from(["append_n", "prepend_n"]),
              st.lists(st.integers(0, N_QUEUE - 1), max_size=3))), min_size=4, max_size=16)


@settings(max_examples=400)
@given(ops=queue_ops)
def test_free_queue_links_and_errors_match_vllms(vllm, ops):
    """Every link of every block, the count and every exception, after each operation, on
    any sequence: a block removed twice, appended while queued (a corrupted queue)."""
    run_lockstep("FreeKVCacheBlockQueue", ops, CourseQueue(N_QUEUE), RealQueue(N_QUEUE, vllm))


def prompts_for(block_size: int) -> list[list[int]]:
    """Prompts that share prefixes at and inside block boundaries."""
    base = list(range(1, 1 + 6 * block_size))
    return [base[:2 * block_size + 1], base[:2 * block_size] + [900, 901],
            base[:block_size], base[:3 * block_size], base[:block_size + 1] + [7] * block_size,
            list(range(500, 500 + 2 * block_size - 1)), base[:6 * block_size]]


def manager_ops_from(rng, n: int) -> list[tuple]:
    """``n`` scheduler moves on up to 4 live requests, weighted toward admissions and steps
    (a move names a live request, an admission a free id)."""
    ops, live = [], set()
    for _ in range(n):
        free = sorted(set(range(4)) - live)
        kinds = [(k, w) for k, w in (("add", 3 * bool(free)), ("schedule", 6 * bool(live)),
                                     ("preempt", 1), ("finish", 1), ("reset", 0.3)) if w]
        kind = rng.choices([k for k, _ in kinds], [w for _, w in kinds])[0]
        if kind == "add":
            rid = rng.choice(free)
            live.add(rid)
            ops.append(("add", rid, rng.randrange(7), rng.choice(SALTS)))
        elif kind == "reset" or not live:
            ops.append(("reset",))
        else:
            rid = rng.choice(sorted(live))
            if kind == "finish":
                live.discard(rid)
            ops.append(("schedule", rid, rng.choice([1, 2, 3, 5, 64, 64]))
                       if kind == "schedule" else (kind, rid))
    return ops


# hypothesis draws a seed and a length; the moves come from random.Random(seed) (its own
# choices() weights them better than hypothesis's HypothesisRandom does)
manager_ops = st.builds(lambda seed, n: manager_ops_from(random.Random(seed), n),
                        st.integers(0, 2**32 - 1), st.integers(10, 80))


def lockstep_managers(vllm, ops, block_size, num_blocks, caching=True, algo="sha256",
                      watermark=0.0, course_cls=KVCacheManager):
    prompts = prompts_for(block_size)
    with pytest.MonkeyPatch.context() as mp:
        # the xxhash algorithms seed NONE_HASH at random per process unless PYTHONHASHSEED
        # is set: set it, so that both sides draw the same (test_none_hash_* checks both ways)
        mp.setenv("PYTHONHASHSEED", "fidelity")
        course = CourseManager(prompts, block_size, num_blocks, caching, watermark, algo,
                               manager_cls=course_cls)
        real = RealManager(prompts, vllm, block_size, num_blocks, caching, watermark, algo)
    run_lockstep(f"KVCacheManager(block_size={block_size}, num_gpu_blocks={num_blocks}, "
                 f"enable_caching={caching}, hash={algo})", ops, course, real)


@settings(max_examples=600)
@given(ops=manager_ops, block_size=st.sampled_from([1, 2, 4, 16]),
       num_blocks=st.integers(2, 24), caching=st.booleans(), algo=st.sampled_from(ALGOS))
def test_kv_cache_manager_matches_vllms(vllm, ops, block_size, num_blocks, caching, algo):
    """Admissions with prefix hits and chunks, decode steps, preemptions (freed, then looked
    up again), finishes, prefix-cache resets: block tables, hit lengths, the free queue front
    to back, every block's ref count and hash bytes, the hash map, the counters, the usage."""
    lockstep_managers(vllm, ops, block_size, num_blocks, caching, algo)


@settings(max_examples=60)
@given(ops=manager_ops, num_blocks=st.integers(4, 24),
       watermark=st.sampled_from([0.1, 0.25, 0.5]))
def test_the_watermark_matches_vllms_where_both_hold_back_as_many_blocks(
        vllm, ops, num_blocks, watermark):
    """vLLM holds back int(watermark * (N + 1)) blocks (its null block counts), the course
    int(watermark * N) (declared: test_the_watermark_counts_vllms_null_block); where the two
    agree, every answer does."""
    if int(watermark * num_blocks) != int(watermark * (num_blocks + 1)):
        return
    lockstep_managers(vllm, ops, 4, num_blocks, watermark=watermark)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("salt", SALTS)
def test_block_hashes_are_vllms_bytes_salted_or_not(vllm, algo, salt, monkeypatch):
    """The chain of a 3-block request, block for block, byte for byte (vLLM's request
    block hasher with its generate_block_hash_extra_keys)."""
    monkeypatch.setenv("PYTHONHASHSEED", "fidelity")
    tokens = list(range(1, 14))
    m = KVCacheManager(4, 8, prefix_caching_hash_algo=algo)
    m.get_computed_blocks(0, tokens, salt)
    m.allocate_slots(0, tokens, 0, len(tokens))
    real = RealManager([tokens], vllm, 4, 8, algo=algo)
    real.apply(("add", 0, 0, salt))
    assert m.req_to_block_hashes[0] == real.requests[0].block_hashes
    assert len(m.req_to_block_hashes[0]) == 3


def test_the_four_hash_functions_are_vllms(vllm):
    values = [("vllm-none-hash"), (b"\x00" * 32, (1, 2, 3), None),
              (b"x", (7,), (("cache_salt", "alice"),))]
    for name in ALGOS:
        course_fn, real_fn = (course_pool.get_hash_fn_by_name(name),
                              vllm.hashing.get_hash_fn_by_name(name))
        assert [course_fn(v) for v in values] == [real_fn(v) for v in values], name
    with pytest.raises(ValueError) as course_err:
        course_pool.get_hash_fn_by_name("builtin")
    with pytest.raises(ValueError) as real_err:
        vllm.hashing.get_hash_fn_by_name("builtin")
    assert str(course_err.value) == str(real_err.value)


@pytest.mark.parametrize("algo", ALGOS)
def test_none_hash_is_seeded_as_vllms(vllm, algo, monkeypatch):
    """With PYTHONHASHSEED: equal bytes. Without: equal for sha256 (the fixed seed), random
    for xxhash on both sides (so not comparable, and not equal to the fixed seed's)."""
    utils = vllm.kv_cache_utils
    fn = course_pool.get_hash_fn_by_name(algo)
    real_fn = vllm.hashing.get_hash_fn_by_name(algo)
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    utils.init_none_hash(real_fn)
    assert course_pool.none_hash_for(fn) == utils.NONE_HASH
    monkeypatch.delenv("PYTHONHASHSEED")
    utils.init_none_hash(real_fn)
    if algo.startswith("sha256"):
        assert course_pool.none_hash_for(fn) == utils.NONE_HASH == fn("vllm-none-hash")
    else:
        assert course_pool.none_hash_for(fn) != fn("vllm-none-hash")
        assert utils.NONE_HASH != fn("vllm-none-hash")
    if algo == "sha256":
        assert course_pool.NONE_HASH == utils.NONE_HASH


def test_pool_errors_and_usage_match_vllms(vllm):
    """BlockPool's own checks: more blocks than are free, usage (vLLM leaves its null block
    out of both counts)."""
    course = course_pool.BlockPool(4)
    real = vllm.block_pool.BlockPool(5, enable_caching=True, hash_block_size=4)
    for pool in (course, real):
        with pytest.raises(ValueError) as err:
            pool.get_new_blocks(5)
        assert str(err.value) == "Cannot get 5 free blocks from the pool"
    got = [[b.block_id for b in p.get_new_blocks(3)] for p in (course, real)]
    assert got[1] == [i + 1 for i in got[0]]
    assert course.get_usage() == real.get_usage() == 0.75
    assert course.reset_prefix_cache() is real.reset_prefix_cache() is False


def test_freeing_a_block_nobody_holds_is_vllms(vllm):
    """``free_blocks`` of a block freed already: both pools drive its ref count to -1 and
    leave it out of the queue (neither checks its caller; the course's ``check_invariants``
    then fails)."""
    course = course_pool.BlockPool(2)
    real = vllm.block_pool.BlockPool(3, enable_caching=True, hash_block_size=4)
    blocks = [p.get_new_blocks(1)[0] for p in (course, real)]
    for pool, block in zip((course, real), blocks, strict=True):
        pool.free_blocks([block])
        pool.free_blocks([block])
    assert [b.ref_cnt for b in blocks] == [-1, -1]
    assert course.get_num_free_blocks() == real.get_num_free_blocks() == 2
    with pytest.raises(AssertionError):
        course.check_invariants()
