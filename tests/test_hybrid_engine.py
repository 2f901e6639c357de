"""A model with sliding-window layers through the whole engine (issue 33 item 4): the V1
scheduler builds its ``KVCacheManager`` with the model's KV-cache groups and hands the runner
every group's table; generation equals dense generation with the same masks, token for token,
under chunked prefill, preemption and prefix-cache hits. The doors refuse what the course does
not run with such a model, and a request the pool can never hold is refused, not looped on.
(``test_hybrid_model.py`` checks the model side with a driver of its own and NaN in every
block nobody may read.)"""

from __future__ import annotations

import pytest
import torch
from test_hybrid_model import FULL_FIRST, SLIDING_FIRST, dense, hybrid, prompt

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.engine.cpu_offload import CPUOffloadConnector
from course_lib.engine.llm_engine import LLMEngine
from course_lib.model.loader import load_tiny_model
from course_lib.sequence import SamplingParams

pytestmark = pytest.mark.ch14
torch.set_num_threads(1)


def engine(model, num_gpu_blocks: int = 60, caching: bool = False, attn: str = "torch",
           **cache) -> LLMEngine:
    return LLMEngine(model, SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8,
                                            max_model_len=256, enable_chunked_prefill=True),
                     CacheConfig(block_size=4, num_gpu_blocks=num_gpu_blocks, watermark=0.0,
                                 enable_prefix_caching=caching, **cache),
                     attn_impl=attn, design="v1", stop_token_ids=())


@pytest.mark.parametrize("pattern", [SLIDING_FIRST, FULL_FIRST], ids=["sliding-first",
                                                                     "full-first"])
@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_the_engine_generates_as_dense_with_preemptions_and_hits(pattern, caching) -> None:
    model = hybrid(12, pattern)
    eng = engine(model, caching=caching)
    assert eng.scheduler.hybrid and eng.block_manager.num_kv_cache_groups == 2
    prompts = [prompt(40), prompt(27, 3), prompt(33, 10), prompt(40)[:36] + prompt(8, 50)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0))
    assert [list(o.outputs[0].token_ids) for o in outs] == dense(model, prompts, 30)
    assert eng.scheduler.num_preemptions > 0           # the pool was short: recomputed
    if caching:                                          # the 4th prompt shares 36 tokens
        assert eng.block_manager.prefix_cache_stats.hits > 0
    eng.check_invariants()


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", [SLIDING_FIRST, FULL_FIRST], ids=["sliding-first",
                                                                     "full-first"])
def test_the_engine_on_cuda_with_the_compiled_kernels(pattern) -> None:
    """The same run on a GPU, the compiled Triton kernels reading every group's table."""
    model = hybrid(12, pattern, device="cuda")
    eng = engine(model, caching=True, attn="auto")
    prompts = [prompt(40), prompt(27, 3), prompt(33, 10), prompt(40)[:36] + prompt(8, 50)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0))
    assert [list(o.outputs[0].token_ids) for o in outs] == dense(model, prompts, 30)
    assert eng.scheduler.num_preemptions > 0
    eng.check_invariants()


def test_a_full_attention_model_keeps_one_table() -> None:
    eng = engine(load_tiny_model(layer_types=["full_attention"] * 4))
    assert not eng.scheduler.hybrid and eng.block_manager.num_kv_cache_groups == 1
    eng.add_request(prompt(20), SamplingParams(max_tokens=2))
    eng.step()
    assert [e.block_tables for e in eng.last_output.scheduled] == [()]


@pytest.mark.parametrize("design, cache, connector, named", [
    ("v0", {}, False, "design='v0'"),
    ("v1", {"prefix_cache": "radix"}, False, "prefix_cache='radix'"),
    ("v1", {}, True, "a kv_connector"),
    ("v1", {"kv_offloading_size": 0.001}, False, "kv_offloading_size"),
])
def test_the_door_refuses_what_a_windowed_model_does_not_run_with(design, cache, connector,
                                                                   named) -> None:
    conn = CPUOffloadConnector(8) if connector else None
    with pytest.raises(ValueError, match="sliding-window layers") as err:
        LLMEngine(hybrid(12), None, CacheConfig(block_size=4, num_gpu_blocks=60, **cache),
                  attn_impl="torch", design=design, kv_connector=conn)
    assert named in str(err.value)
    assert conn is None or not conn.kv_caches              # refused before it was bound


def test_a_request_the_pool_can_never_hold_is_refused_not_looped_on() -> None:
    """11 usable blocks (12 less the null block); 40 tokens need 10 full-attention blocks
    and, for the window of 12 with 24-token steps, up to 10 windowed ones: it can never run.
    A 16-token prompt (4 + 4 blocks at most) runs to its end beside it."""
    model = hybrid(12)
    eng = engine(model, num_gpu_blocks=12)
    big = eng.add_request(prompt(40), SamplingParams(max_tokens=4, temperature=0.0))
    small = eng.add_request(prompt(16), SamplingParams(max_tokens=4, temperature=0.0))
    done = {}
    for _ in range(50):                                   # bounded: a livelock fails here
        for out in eng.step():                            # step() returns finished ones
            done[out.request_id] = out
        if len(done) == 2:
            break
    assert done[big].finish_reason == "ignored" and not done[big].outputs[0].token_ids
    assert "needs 20 GPU blocks, the pool has 11" in done[big].finish_detail
    assert list(done[small].outputs[0].token_ids) == dense(model, [prompt(16)], 4)[0]
    eng.check_invariants()
