"""The hybrid harness can fail: the course's sliding-window manager broken on purpose, in one
small way each, and the lockstep against vLLM 0.33.0 names the first difference."""

from __future__ import annotations

import pytest
from harness import Mismatch
from test_vllm_hybrid_fidelity import lockstep_hybrid

from course_lib.memory.v1.single_type_kv_cache_manager import SlidingWindowManager

# one request decoding past a window of 3 (blocks of 2), a second one hitting its tail
OPS = [("add", 0, 6, None), ("schedule", 0, 64)] + [("schedule", 0, 1)] * 6 + \
    [("add", 1, 6, None), ("schedule", 1, 64), ("preempt", 0), ("schedule", 0, 64)]


def test_blocks_that_left_the_window_freed_front_to_back_are_caught(vllm, monkeypatch):
    """vLLM frees the blocks that left the window back to front (the last to leave is freed
    first); front to back, the free queue's order differs at the first slide."""
    real = SlidingWindowManager.remove_skipped_blocks

    def front_to_back(self, seq_id, num_computed_tokens):
        free_blocks = self.block_pool.free_blocks
        self.block_pool.free_blocks = lambda blocks: free_blocks(list(reversed(blocks)))
        try:
            real(self, seq_id, num_computed_tokens)
        finally:
            del self.block_pool.free_blocks

    monkeypatch.setattr(SlidingWindowManager, "remove_skipped_blocks", front_to_back)
    with pytest.raises(Mismatch, match=r"first difference: \['state'\]\['free_queue'\]"):
        lockstep_hybrid(vllm, OPS, 2, 24, 3)


def test_a_window_one_token_short_is_caught(vllm, monkeypatch):
    """Freeing a token too early (the window taken as w - 1 tokens): a table differs."""
    monkeypatch.setattr(SlidingWindowManager, "get_num_skipped_tokens",
                        lambda self, n: max(0, n - self.sliding_window + 2))
    with pytest.raises(Mismatch, match=r"first difference: \['answer'\]\['table'\]\[1\]"):
        lockstep_hybrid(vllm, OPS, 2, 24, 3)
