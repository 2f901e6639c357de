"""A hybrid model's KV-cache manager beside vLLM 0.33.0's: one full-attention group and one
sliding-window group over one pool with its null block, prefix caching on or off, the same
hypothesis-generated scheduler moves (admissions with hits, chunks, decodes, preemptions,
finishes, resets) on both, the same answers and states after every move
(tests/fidelity/hybrid_twins.py says what is compared). Differences that remain are declared:
test_declared_differences.py."""

from __future__ import annotations

import pytest
from harness import run_lockstep
from hybrid_twins import CourseHybrid, RealHybrid
from hypothesis import given, settings
from hypothesis import strategies as st
from test_vllm_fidelity import manager_ops, prompts_for


def lockstep_hybrid(vllm, ops, block_size, num_blocks, window, caching=True, watermark=0.0,
                    chunk=0):
    """Full attention beside a sliding window ``window`` (or, with ``chunk``, chunked local
    attention of ``chunk`` tokens)."""
    prompts = prompts_for(block_size)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONHASHSEED", "fidelity")
        course = CourseHybrid(prompts, block_size, num_blocks, window, caching, watermark,
                              chunk)
        real = RealHybrid(prompts, vllm, block_size, num_blocks, window, caching, watermark,
                          chunk)
    local = f"attention_chunk_size={chunk}" if chunk else f"sliding_window={window}"
    run_lockstep(f"hybrid KVCacheManager(block_size={block_size}, num_blocks={num_blocks}, "
                 f"{local}, enable_caching={caching}, watermark={watermark})",
                 ops, course, real)


@settings(max_examples=400, deadline=None)
@given(ops=manager_ops, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 32),
       window=st.integers(2, 20), caching=st.booleans(),
       watermark=st.sampled_from([0.0, 0.0, 0.1, 0.25]))
def test_hybrid_kv_cache_manager_matches_vllms(vllm, ops, block_size, num_blocks, window,
                                               caching, watermark):
    """Block ids per group (nulls included), hit lengths and hit blocks per group, the free
    queue front to back (what each free and each slide of the window gave back, in order),
    every block's ref count and (hash, group), the hash map, the counters, the usage."""
    lockstep_hybrid(vllm, ops, block_size, num_blocks, window, caching, watermark)


def test_a_window_that_slides_matches_vllms_step_by_step(vllm):
    """One long decode past a window of 3 tokens (blocks of 2), then a second request with
    the same prompt hitting the tail, then a preemption and a re-admission: a fixed sequence
    that exercises every path at least once."""
    ops = [("add", 0, 6, None), ("schedule", 0, 64)] + [("schedule", 0, 1)] * 6 + \
        [("add", 1, 6, None), ("schedule", 1, 64), ("preempt", 0), ("schedule", 0, 5),
         ("schedule", 0, 64), ("finish", 1), ("reset",), ("finish", 0), ("reset",)]
    lockstep_hybrid(vllm, ops, 2, 24, 3)


@settings(max_examples=150, deadline=None)
@given(ops=manager_ops, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 32),
       chunks=st.integers(1, 5), caching=st.booleans())
def test_chunked_local_attention_matches_vllms(vllm, ops, block_size, num_blocks, chunks,
                                               caching):
    """Full attention beside chunked local attention (a chunk of ``chunks`` blocks): the
    same comparison; earlier chunks' blocks freed, hits null up to the current chunk."""
    lockstep_hybrid(vllm, ops, block_size, num_blocks, 0, caching, chunk=chunks * block_size)
