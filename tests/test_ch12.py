"""Chapter 12's exercise references are the library's behaviour, and their checkers catch
the natural wrong answers."""

from __future__ import annotations

import pytest

from course_lib.exercises import ch12
from course_lib.memory.v1.kv_cache_manager import KVCacheManager

pytestmark = pytest.mark.ch12


def test_free_queue_reference_is_what_the_kv_cache_manager_does():
    m = KVCacheManager(block_size=4, num_gpu_blocks=8)
    hits, n = m.get_computed_blocks(0, list(range(1, 11)))
    table = m.allocate_slots(0, list(range(1, 11)), 0, 10, hits)
    queue = [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
    cached = [m.block_pool.blocks[b].block_hash is not None for b in table]
    m.free(0)
    got = [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
    assert ch12.free_queue_after(queue, list(zip(table, cached, strict=True))) == got


def test_checkers_pass_the_right_answer_and_catch_wrong_ones():
    def right():                                     # the queue itself, then read off it
        def q(queue, table):
            rev = table[::-1]
            return [b for b, c in rev if not c] + queue + [b for b, c in rev if c]
        cached = [(0, True), (1, True), (2, False)]
        return {"a": q([5, 6], cached)[0], "b": q([5, 6], cached)[-1],
                "c": q([3], [(0, False), (1, False)])[0],
                "d": q([7], [(0, True), (1, True), (2, True)])[0],
                "e": q([4, 5], [(0, True), (1, True), (2, True), (3, False)]).index(0)}

    assert ch12.check_free_queue_predictions(right).ok
    assert not ch12.check_free_queue_predictions(lambda: {**right(), "e": 3}).ok

    def common(p, q):
        pairs = enumerate(zip(p, q, strict=False))
        return next((i for i, (a, b) in pairs if a != b), min(len(p), len(q)))

    def radix(prompt, earlier, page):
        best = max((common(prompt, q) for q in earlier), default=0)
        return best - best % page

    def blocks_only(prompt, earlier, page):           # a hash chain: never the last token
        best = min(max((common(prompt, q) for q in earlier), default=0), len(prompt) - 1)
        return best - best % 4

    assert ch12.check_radix_hit(radix).ok
    assert not ch12.check_radix_hit(blocks_only).ok
    assert "not attempted" in str(ch12.check_radix_hit(
        lambda *a: (_ for _ in ()).throw(NotImplementedError)))
