"""Every difference between the course and vLLM 0.33.0 / SGLang 0.5.23 that the fidelity
harness leaves standing, each shown on a minimal sequence, with why the course differs.
docs/design_notes.md ("Declared differences from vLLM 0.33.0 and SGLang 0.5.23") lists them,
one bullet per test here; the lockstep tests keep away from exactly these cases and no
others."""

from __future__ import annotations

import itertools
import re
import sys
import types
from array import array
from pathlib import Path

import pytest
from sglang_twins import CourseRadix, RealRadix
from vllm_twins import CourseManager, RealManager

from course_lib.memory.radix.radix_cache import RadixCache
from course_lib.memory.v1 import block_pool as course_pool
from course_lib.memory.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from course_lib.memory.v1.kv_cache_manager import KVCacheManager


def real_pool(vllm, num_blocks: int):
    """vLLM's BlockPool with as many usable blocks as the course's ``num_blocks``."""
    return vllm.block_pool.BlockPool(num_blocks + 1, enable_caching=True, hash_block_size=4)


# ------------------------------------------------------------------------------- vLLM V1
def test_vllm_reserves_block_0_the_course_does_not(vllm):
    """vLLM's pool always pops block 0 as its null block (the placeholder in sliding-window,
    chunked-local and Mamba tables); the course's pool pops it only when some group needs one
    (``BlockPool(use_null_block=True)``, which its coordinator asks for a windowed group), so
    that a full-attention model keeps chapter 12's ids: vLLM's block ``i + 1`` is the
    course's ``i``, its pool of N + 1 blocks the course's of N. The harness maps the ids and
    compares all else; for a hybrid model both reserve block 0 and the ids are the same."""
    course, real = course_pool.BlockPool(3), real_pool(vllm, 3)
    assert real.null_block.block_id == 0 and real.null_block.is_null
    assert [b.block_id for b in course.get_new_blocks(3)] == [0, 1, 2]
    assert [b.block_id for b in real.get_new_blocks(3)] == [1, 2, 3]
    assert course.get_num_free_blocks() == real.get_num_free_blocks() == 0
    with_null = course_pool.BlockPool(4, use_null_block=True)
    assert with_null.null_block.block_id == 0 and with_null.null_block.is_null
    assert [b.block_id for b in with_null.get_new_blocks(3)] == [1, 2, 3]


def test_the_watermark_counts_vllms_null_block(vllm):
    """vLLM holds back ``int(watermark * num_blocks)`` with its null block counted, the course
    ``int(watermark * num_gpu_blocks)`` of the blocks it has: at 7 usable blocks and 0.25,
    vLLM holds back 2 blocks, the course 1. (With a windowed group the course's pool has its
    null block too, and the two agree: the hybrid lockstep draws watermarks.)"""
    course = KVCacheManager(4, 7, watermark=0.25)
    real = RealManager([[1]], vllm, 4, 7, watermark=0.25)
    assert course.watermark_blocks == 1 and real.m.watermark_blocks == 2
    assert KVCacheManager(4, 8, watermark=0.5).watermark_blocks == \
        RealManager([[1]], vllm, 4, 8, watermark=0.5).m.watermark_blocks == 4


def test_freeing_a_sequence_that_holds_no_blocks(vllm):
    """vLLM's ``free`` of a request it never allocated for does nothing (``pop(id, [])``);
    the course's looks the sequence up (``KeyError``): its scheduler frees only what it
    allocated, and a double free shows at once."""
    course = KVCacheManager(4, 4)
    real = RealManager([[1, 2, 3]], vllm, 4, 4)
    real.apply(("add", 0, 0, None))
    real.m.free(real.requests[0])                       # nothing happens
    with pytest.raises(KeyError):
        course.free(0)


def test_allocate_slots_speaks_of_sequences_and_whole_tables(vllm):
    """The interface, not the behaviour: vLLM's ``allocate_slots`` takes a ``Request`` and
    answers the *new* blocks (``KVCacheBlocks``); the course's takes a sequence id and its
    token ids and answers the whole table (its scheduler needs nothing else). The harness
    compares whole tables (vLLM's ``get_blocks``)."""
    prompts = [list(range(1, 10))]
    course, real = CourseManager(prompts, 4, 8), RealManager(prompts, vllm, 4, 8)
    for twin in (course, real):
        twin.apply(("add", 0, 0, None))
        twin.apply(("schedule", 0, 5))
    r = real.requests[0]
    r.num_computed_tokens = 5
    new = real.m.allocate_slots(r, 4)
    assert [b.block_id - 1 for b in new.blocks[0]] == [2]
    assert course.m.allocate_slots(0, prompts[0], 5, 4) == [0, 1, 2]


def test_error_messages_name_blocks_the_courses_way(vllm):
    """Messages that embed a block read ``KVCacheBlock(3, ref_cnt=0)`` in the course and
    vLLM's dataclass repr (links, hash fields) there; the harness compares exception types
    and messages with the block cut to ``KVCacheBlock(...)``."""
    course_block = course_pool.KVCacheBlock(3)
    real_block = vllm.kv_cache_utils.KVCacheBlock(3)
    assert repr(course_block) == "KVCacheBlock(3, ref_cnt=0)"
    assert repr(real_block).startswith("KVCacheBlock(block_id=3, ref_cnt=0, _block_hash=None")


# ------------------------------------------------------------------------------ SGLang
def test_unlocking_a_node_that_is_not_locked(sglang):
    """SGLang's ``dec_lock_ref`` lets a lock count go negative, so that the next lock leaves
    the node unprotected (evictable while a request reads it); the course asserts that a node
    it unlocks is locked (an invariant: a lock released twice is a caller's bug)."""
    course = RadixCache(8)
    course.insert([1, 2], [0, 1])
    _, node = course.match_prefix([1, 2])
    with pytest.raises(AssertionError, match="not locked"):
        course.dec_lock_ref(node)
    real = RealRadix(1, sglang)
    real.apply(("insert", [1, 2], None))
    real.apply(("match", [1, 2], None))
    node = real.handles[0]
    real.tree.dec_lock_ref(node)
    assert node.lock_ref == -1
    real.tree.inc_lock_ref(node)                        # a request locks it...
    assert node.lock_ref == 0 and node in real.tree.evictable_leaves      # ...in vain


def test_the_clock_is_a_counter_not_time_monotonic(sglang):
    """SGLang stamps nodes with ``time.monotonic()``; the course with a counter that ticks
    where SGLang reads the clock, so the least recently used leaf is always one node. With a
    clock too coarse to tick between two operations (frozen here), SGLang's leaves tie and
    the eviction heap picks among them by its own order; the harness gives SGLang a counter."""
    ops = [("insert", [1], None), ("insert", [2], None), ("insert", [3], None)]
    course = CourseRadix(1)
    for op in ops:
        course.apply(op)
    assert course.apply(("evict", 1))["freed"] == [0]            # the oldest insert
    real = RealRadix(1, sglang)
    clock = itertools.repeat(5.0)
    sglang.radix_cache.time = types.SimpleNamespace(monotonic=lambda: next(clock),
                                                    perf_counter=lambda: 0.0)
    for op in ops:
        real.apply(op)
    leaves = real.tree.evictable_leaves
    assert len({n.last_access_time for n in leaves}) == 1       # a three-way tie
    key = sglang.radix_cache.RadixKey(array("q", [1]), None)
    assert key.child_key(1) == 1


def test_one_namespace_key_where_sglang_has_two(sglang):
    """SGLang's ``RadixKey`` carries an ``extra_key`` (a LoRA id) and a ``cache_salt``, both
    namespacing the tree; the course's tree has one ``extra_key`` (its radix manager puts the
    typed salt there). An empty salt is no salt in both."""
    radix = sglang.radix_cache
    salted = radix.RadixKey(array("q", [1, 2]), "lora", cache_salt="alice")
    unsalted = radix.RadixKey(array("q", [1, 2]), "lora", cache_salt="")
    assert salted.child_key(1) == (("lora", "alice"), 1)
    assert unsalted.child_key(1) == ("lora", 1) and unsalted.cache_salt is None
    tree = RadixCache(8)
    tree.insert([1, 2], [0, 1], extra_key="lora")
    assert set(tree.root.children) == {("lora", 1)}


def test_sglang_reserves_slot_0_the_course_does_not(sglang_allocators):
    """SGLang's allocators start their free list at slot (page) 1: slot 0 takes the dummy
    writes of padded tokens (``clear`` in ``allocator/token.py`` and ``paged.py``), a buffer
    the course's model runner has no need for. A pool of N usable slots or pages is the
    course's of N, ids shifted by one; the lockstep test maps them."""
    from upstream import Tensor

    token = sglang_allocators.token.TokenToKVPoolAllocator(4, "int64", "cpu", None, False)
    assert list(token.alloc(4)) == [1, 2, 3, 4] and token.alloc(1) is None
    paged = sglang_allocators.paged.PagedTokenToKVPoolAllocator(4, 2, "int64", "cpu", None,
                                                                False)
    assert list(paged.alloc(4)) == [2, 3, 4, 5]
    paged.free_segment(Tensor([2, 3]), start_pos=0)
    assert list(paged.free_pages) == [1]
    from course_lib.memory.radix.allocator import BlockSlotPool, SlotPool

    assert SlotPool(4).alloc(4) == [0, 1, 2, 3] and BlockSlotPool(2, 2).alloc(4) == [0, 1, 2, 3]


def test_no_sorted_release_list(sglang_allocators):
    """With ``need_sort`` (which SGLang sets only under prefill/decode disaggregation,
    ``kv_cache_configurator.py``) freed pages wait in a release list, out of the free list,
    until an ``alloc`` runs short; then both are merged and sorted (``merge_and_sort_free``).
    The course models the default, ``need_sort`` off: freed pages go straight back."""
    from upstream import Tensor

    paged = sglang_allocators.paged.PagedTokenToKVPoolAllocator(8, 2, "int64", "cpu", None,
                                                                True)
    assert list(paged.alloc(6)) == [2, 3, 4, 5, 6, 7]
    paged.free_segment(Tensor([6, 7, 2, 3]), start_pos=0)     # pages 3, 1: staged
    assert list(paged.free_pages) == [4] and paged.available_size() == 6
    assert list(paged.alloc(6)) == [2, 3, 6, 7, 8, 9]          # short: merged and sorted
    from course_lib.memory.radix.allocator import BlockSlotPool

    course = BlockSlotPool(4, 2)
    course.alloc(6)
    course.free([4, 5, 0, 1])                                  # course blocks 2, 0
    assert course.alloc(6) == [4, 5, 0, 1, 6, 7]               # in the order freed, first


def test_group_0_is_cached_under_the_bare_hash(vllm):
    """vLLM keys every cached block by its hash and 4 big-endian bytes of its group id
    (``make_block_hash_with_group_id``), group 0 included; the course appends them for every
    group but 0, so that a one-group model's keys stay the hashes chapters 06 and 12 show.
    The hybrid harness compares (hash, group) pairs."""
    block_hash = course_pool.sha256("a block")
    real = vllm.kv_cache_utils.make_block_hash_with_group_id
    assert real(block_hash, 0) == block_hash + bytes(4)
    assert course_pool.block_hash_with_group_id(block_hash, 0) == block_hash
    assert course_pool.block_hash_with_group_id(block_hash, 1) == real(block_hash, 1)


def test_groups_of_different_block_sizes(vllm):
    """vLLM runs groups whose block sizes differ (pages unified by block size): hashes at
    ``hash_block_size``, viewed at each group's size (``BlockHashListWithBlockSize``), hits
    aligned to the least common multiple (``scheduler_block_size``). The course's groups
    share one block size: its manager refuses others at the door, and
    ``kv_cache_groups.unify_kv_cache_spec_page_size`` is for sizing."""
    groups = [KVCacheGroupSpec(("full",), FullAttentionSpec(2)),
              KVCacheGroupSpec(("swa",), SlidingWindowSpec(4, sliding_window=8))]
    with pytest.raises(ValueError, match="block sizes \\[2, 4\\]"):
        KVCacheManager(2, 16, kv_cache_groups=groups)
    iface = vllm.kv_cache_interface
    config = iface.KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        iface.KVCacheGroupSpec(["full"], iface.FullAttentionSpec(
            block_size=2, num_kv_heads=1, head_size=1, dtype="float32")),
        iface.KVCacheGroupSpec(["swa"], iface.SlidingWindowSpec(
            block_size=4, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=8))])
    real = vllm.kv_cache_manager.KVCacheManager(config, max_model_len=1 << 10,
                                                scheduler_block_size=4, hash_block_size=2)
    assert real.coordinator.scheduler_block_size == 4


def test_every_declared_difference_is_listed_in_the_design_notes():
    """docs/design_notes.md's section names each test of this module and of
    test_scheduler_declared_differences.py (the scheduler's), one bullet each."""
    import test_scheduler_declared_differences as scheduler_differences

    notes = (Path(__file__).resolve().parents[2] / "docs" / "design_notes.md").read_text()
    section = notes.split("## Declared differences from vLLM 0.33.0 and SGLang 0.5.23")[1]
    section = section.split("\n## ")[0]
    listed = re.findall(r"^- \*\*.*?\*\*\s+\(`(test_\w+)`\)", section, re.M)
    this = sys._getframe().f_code.co_name
    here = {name for module in (sys.modules[__name__], scheduler_differences)
            for name in dir(module) if name.startswith("test_") and name != this}
    assert sorted(listed) == sorted(here)
