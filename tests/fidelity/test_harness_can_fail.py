"""The harness can fail: the course's counterpart broken on purpose, in one small way each, and
the comparison names the operation sequence, both answers and the first difference."""

from __future__ import annotations

import pytest
from harness import Mismatch, run_lockstep
from sglang_twins import CoursePages, CourseRadix, RealPages, RealRadix
from vllm_twins import CourseManager, CourseQueue, RealManager, RealQueue

from course_lib.memory.radix.radix_cache import RadixCache
from course_lib.memory.v1 import block_pool as course_pool
from course_lib.memory.v1.kv_cache_manager import KVCacheManager


class ReversedPrependQueue(course_pool.FreeKVCacheBlockQueue):
    """Blocks put at the front in reverse order: the free queue's order reversed."""

    def prepend_n(self, blocks):
        super().prepend_n(list(reversed(blocks)))


class ForwardFreePool(course_pool.BlockPool):
    """Frees a finished request's blocks head first (vLLM frees the tail first)."""

    def free_blocks(self, ordered_blocks):
        super().free_blocks(reversed(list(ordered_blocks)))


class ForwardFreeManager(KVCacheManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.block_pool = ForwardFreePool(self.num_gpu_blocks, self.enable_caching)


class SaltAsTheOnlyKeyManager(KVCacheManager):
    """The course's salt before it followed vLLM: the bare salt as the first block's extra
    key, not ``(("cache_salt", salt),)``."""

    def _hashes(self, seq_id, token_ids, num_blocks):
        hashes = self.req_to_block_hashes.setdefault(seq_id, [])
        bs, salt = self.block_size, self.salts.get(seq_id)
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            parent = course_pool.hash_block_tokens(
                parent, token_ids[i * bs:(i + 1) * bs], salt if i == 0 else None)
            hashes.append(parent)
        return hashes


class MostRecentlyUsedRadix(RadixCache):
    """Evicts the most recently used leaf first."""

    def evict(self, num_tokens):
        freed = 0
        while freed < num_tokens and self.evictable_leaves:
            leaf = max(self.evictable_leaves, key=lambda n: n.last_access_time)
            self.pool.free(leaf.value)
            freed += len(leaf.value)
            parent = leaf.parent
            del parent.children[next(k for k, c in parent.children.items() if c is leaf)]
            self.evictable_leaves.discard(leaf)
            self.evictable_size_ -= len(leaf.key)
            self._update_leaf_status(parent)
        return freed


def test_a_reversed_free_queue_is_caught_with_its_first_difference(vllm):
    ops = [("popleft",), ("popleft",), ("prepend_n", [0, 1])]
    course = CourseQueue(4, queue_cls=ReversedPrependQueue)
    with pytest.raises(Mismatch) as err:
        run_lockstep("FreeKVCacheBlockQueue", ops, course, RealQueue(4, vllm))
    text = str(err.value)
    assert "after operation 2 (('prepend_n', [0, 1]))" in text
    assert "operations: [('popleft',), ('popleft',), ('prepend_n', [0, 1])]" in text
    assert "first difference: ['state']['links']['head'][1]" in text
    assert "course: {'answer': None, 'state': {'num_free_blocks': 4, 'links': " \
           "{'head': (None, 1)" in text
    assert "real:   {'answer': None, 'state': {'num_free_blocks': 4, 'links': " \
           "{'head': (None, 0)" in text


def test_a_head_first_free_is_caught_in_the_free_queue_order(vllm):
    prompts = [list(range(1, 10))]
    ops = [("add", 0, 0, None), ("schedule", 0, 64), ("finish", 0)]
    with pytest.raises(Mismatch) as err:
        run_lockstep("KVCacheManager", ops,
                     CourseManager(prompts, 4, 6, manager_cls=ForwardFreeManager),
                     RealManager(prompts, vllm, 4, 6))
    text = str(err.value)
    assert "after operation 2 (('finish', 0))" in text
    assert "first difference: ['state']['free_queue'][4]" in text
    assert "'free_queue': [2, 3, 4, 5, 0, 1]" in text      # the course's, head first
    assert "'free_queue': [2, 3, 4, 5, 1, 0]" in text      # vLLM's: the tail is evicted first


def test_a_salt_hashed_the_old_way_is_caught_in_the_hash_bytes(vllm):
    prompts = [list(range(1, 10))]
    ops = [("add", 0, 0, "alice"), ("schedule", 0, 64)]
    with pytest.raises(Mismatch) as err:
        run_lockstep("KVCacheManager", ops,
                     CourseManager(prompts, 4, 6, manager_cls=SaltAsTheOnlyKeyManager),
                     RealManager(prompts, vllm, 4, 6))
    assert "first difference: ['state']['blocks'][0][1]" in str(err.value)
    # unsalted, the same broken manager agrees: only the salt's extra key was wrong
    run_lockstep("KVCacheManager", [("add", 0, 0, None), ("schedule", 0, 64)],
                 CourseManager(prompts, 4, 6, manager_cls=SaltAsTheOnlyKeyManager),
                 RealManager(prompts, vllm, 4, 6))


def test_a_most_recently_used_eviction_is_caught_in_the_evicted_slots(sglang):
    ops = [("insert", [1, 2], None), ("insert", [3, 4], None), ("evict", 2)]
    with pytest.raises(Mismatch) as err:
        run_lockstep("RadixCache", ops, CourseRadix(1, cache_cls=MostRecentlyUsedRadix),
                     RealRadix(1, sglang))
    text = str(err.value)
    assert "first difference: ['answer']['freed'][0]" in text
    assert "'freed': [2, 3]" in text and "'freed': [0, 1]" in text


def test_freed_pages_stacked_in_order_are_caught_in_the_free_list(sglang_allocators):
    """The course's ``BlockSlotPool`` before it followed SGLang: freed blocks pushed on a
    stack one by one, so that the last of a freed run went out first."""

    class StackPages(CoursePages):
        def _free(self, pages):
            super()._free(pages)
            self.pool.free_blocks[-len(pages):] = pages       # as pushed one by one

    ops = [("alloc", 3), ("free", 0, False)]
    with pytest.raises(Mismatch) as err:
        run_lockstep("allocator", ops, StackPages(4, 2), RealPages(4, 2, sglang_allocators))
    assert "first difference: ['state']['free_list'][0]" in str(err.value)
