"""Chapter 10's figures beside the published ones: sharing per width beside the vLLM paper,
the metric names of the V0 and V1 designs, the "Memory optimization" article's prefix-caching
case in numbers."""

from __future__ import annotations

import pytest
import torch

from course_lib import capacity as cap
from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.engine.llm_engine import LLMEngine
from course_lib.engine.workloads import model_trace
from course_lib.exercises import ch10
from course_lib.model.loader import load_tiny_model
from course_lib.sizing.models import get_preset

pytestmark = pytest.mark.ch10
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    return load_tiny_model()


def test_sharing_rows_pair_each_width_with_the_papers_figure(model) -> None:
    def make_engine():
        return LLMEngine(model, SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512,
                                                max_model_len=256),
                         CacheConfig(block_size=16, num_gpu_blocks=256), stop_token_ids=())

    rows = ch10.sharing_rows(make_engine, model_trace("alpaca", 3, seed=0), widths=(2, 4))
    assert [(r.decoding, r.width) for r in rows] == [
        ("parallel sampling", 2), ("parallel sampling", 4), ("beam search", 2),
        ("beam search", 4)]
    assert [r.paper_pct for r in rows] == [6.09, 8.53, 37.56, 53.13]
    n2, n4, b2, b4 = (r.saving for r in rows)
    assert 0 < n2 < n4 < b4 and n2 < b2                 # wider shares more; beams more
    assert "n = 2" in str(rows[0]) and "paper  6.09%" in str(rows[0])
    assert "beam_width = 4" in str(rows[3])


def test_metric_names_follow_the_design(model) -> None:
    v0 = ch10.metric_names(LLMEngine(model).metrics)
    v1 = ch10.metric_names(LLMEngine(model, design="v1").metrics)
    # V0 (vLLM 0.6.3, vllm/engine/metrics.py); gone from vLLM 0.33.0's V1 loggers
    for name in ("vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc",
                 "vllm:num_requests_swapped", "vllm:gpu_prefix_cache_hit_rate",
                 "vllm:time_per_output_token_seconds"):
        assert name in v0 and name not in v1
    for name in ("vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:inter_token_latency_seconds"):
        assert name in v1 and name not in v0
    common = {"vllm:num_preemptions_total", "vllm:prompt_tokens_total",
              "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds"}
    assert common <= set(v0) & set(v1)
    assert v0 == sorted(v0) and not any(n.endswith(("_bucket", "_count")) for n in v0)


def test_article_prefix_case_numbers() -> None:
    c = ch10.article_prefix_case()
    assert c.speedup == pytest.approx(2600 / 850)
    l8 = get_preset("llama-3-8b")
    assert c.kv_bytes_needed == 64_000 * cap.kv_bytes_per_token(l8) == 64_000 * 131_072
    assert c.pool_tokens_per_gpu == cap.plan_kv_cache(l8, 80).num_gpu_tokens
    assert c.pool_tokens_per_gpu > 64_000                 # memory does not limit the batch
    assert c.prefill_no_cache == 64_000
    assert c.prefill_system_prompt_cached == 1000 + 63 * (1000 - 496)   # 31 full blocks shared
    assert c.prefill_history_cached == 64 * 8                             # 62 full blocks of 1000
    text = str(c)
    assert '"Memory optimization"' in text and "3.06x" in text and "1.95x fewer" in text
    assert "seed" not in text.lower()
