"""The cost model, the replay over the real scheduler, and the bench script's smoke run."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.sim.fake_sampler import expected_tokens
from course_lib.sim.replay import CostModel, preemption_costs, replay
from course_lib.sim.traces import TraceRequest, few_shot, sharegpt_like, with_parallel_sampling

pytestmark = pytest.mark.ch07
ROOT = Path(__file__).resolve().parents[1]


def test_cost_model_rejects_negative_costs():
    with pytest.raises(ValueError, match="s_per_token"):
        CostModel(s_per_token=-1.0)


@pytest.mark.parametrize("bad", [None, "1e-4", True, math.inf])
def test_cost_model_rejects_what_is_not_a_finite_cost(bad):
    """None and "1e-4" were a TypeError from ``>=``; True and inf were accepted."""
    with pytest.raises(ValueError, match=rf"step_base_s must be a finite number >= 0, got "
                                         rf"{re.escape(repr(bad))}"):
        CostModel(step_base_s=bad)


@pytest.mark.parametrize("lengths, block_sizes, match", [
    ([-1], [16], r"lengths' items must be an integer >= 0, got -1"),
    ([math.nan], [16], r"lengths' items must be an integer >= 0, got nan"),
    ([100], [0], r"block_size must be a power of two in \[1, 256\], got 0"),
    ([100], [12], r"block_size must be a power of two .* got 12")])
def test_preemption_costs_refuse_bad_lengths_and_block_sizes(lengths, block_sizes, match):
    """They gave negative or NaN seconds, or a ZeroDivisionError."""
    with pytest.raises(ValueError, match=match):
        preemption_costs(CostModel(), lengths, block_sizes)


@pytest.mark.parametrize("kwargs, match", [
    (dict(trace=None), r"trace must be a list of TraceRequest, got NoneType"),
    (dict(trace=[1, 2]), r"trace must be a list of TraceRequest; item 0 is int 1"),
    (dict(trace=[TraceRequest(0, 0.0, (1, 2), 3), TraceRequest(0, 0.5, (3,), 3)]),
     r"trace item 1: request_id 0 is already used"),
    (dict(cost_model={}), r"cost_model must be None or a CostModel .*got dict"),
    (dict(scheduler_config={}), r"scheduler_config must be None or a SchedulerConfig"),
    (dict(max_steps="many"), r"max_steps must be an integer >= 1, got 'many'")])
@pytest.mark.parametrize("design", ["v0", "v1"])
def test_replay_refuses_bad_arguments_before_running(kwargs, match, design):
    """Two requests with one id were both queued; ``{}`` was falsy and ran the defaults;
    the others failed deep inside with a ``TypeError`` or an ``AttributeError``."""
    kwargs = {"trace": [TraceRequest(0, 0.0, (1, 2), 3)], **kwargs}
    with pytest.raises(ValueError, match=match):
        replay(kwargs.pop("trace"), design=design, **kwargs)


def test_swap_gets_cheaper_per_token_with_bigger_blocks_recompute_does_not():
    cm = CostModel()
    per_token = [cm.swap_time(1024 // bs, bs) for bs in (1, 4, 16, 64, 256)]
    assert per_token == sorted(per_token, reverse=True)
    assert per_token[0] > 5 * per_token[-1]
    assert cm.recompute_time(1024) == pytest.approx(1024 * cm.s_per_token)
    # bytes alone: 1024 tokens x 0.5 MB over 20 GB/s
    assert cm.swap_time(1, 1024) == pytest.approx(1024 * 524_288 / 20e9 + 2 * 32 * 4e-6)


def test_cost_model_for_a_bigger_model_costs_more():
    small, big = CostModel.for_model("Llama-2-7B"), CostModel.for_model("Llama-2-70B")
    assert small.kv_bytes_per_token == 524_288
    assert big.s_per_token > 9 * small.s_per_token and big.step_base_s > small.step_base_s
    assert CostModel.for_model("Llama-2-7B", s_per_copy=0.0).s_per_copy == 0.0


def test_one_request_alone_has_the_cost_models_ttft_and_tpot():
    cm = CostModel()
    trace = [TraceRequest(0, 0.0, tuple(range(1, 101)), 4)]
    r = replay(trace, SchedulerConfig(), CacheConfig(block_size=16, num_gpu_blocks=64), cm)
    prefill = cm.step_base_s + 100 * cm.s_per_token
    decodes = [cm.step_base_s + cm.s_per_token + (101 + k) * cm.s_per_context_token
               for k in range(3)]
    assert r.ttft_mean == pytest.approx(prefill)
    assert r.tpot_mean == pytest.approx(sum(decodes) / 3)
    assert r.duration_s == pytest.approx(prefill + sum(decodes))
    assert r.generated_tokens == 4 and r.throughput_tokens_s == pytest.approx(4 / r.duration_s)
    assert [s.num_prefill_tokens for s in r.steps] == [100, 0, 0, 0]
    assert [s.duration for s in r.steps] == pytest.approx([prefill, *decodes])
    assert r.itl_percentile(50) == pytest.approx(decodes[1])
    assert r.itl_percentile(100) == pytest.approx(decodes[2])


def test_idle_time_between_arrivals_is_skipped():
    trace = [TraceRequest(0, 0.0, (1, 2, 3), 2), TraceRequest(1, 100.0, (4, 5, 6), 2)]
    r = replay(trace, cache_config=CacheConfig(num_gpu_blocks=8))
    assert r.duration_s > 100.0 and r.requests[1].first_scheduled_time > 100.0
    assert r.ttft_p99 < 1.0


def test_a_small_pool_preempts_and_still_produces_every_token():
    trace = with_parallel_sampling(sharegpt_like(40, seed=3, max_total_len=512), 2)[:40]
    for mode in ("recompute", "swap"):
        r = replay(trace, SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512,
                                          max_model_len=512, preemption_mode=mode),
                   CacheConfig(block_size=16, num_gpu_blocks=80, num_cpu_blocks=200),
                   check_invariants=True)
        assert r.num_preemptions > 0 and r.num_ignored == 0
        if mode == "swap":
            assert r.num_swap_preemptions > 0 and r.swapped_bytes > 0
            assert r.swapped_bytes % (16 * CostModel().kv_bytes_per_token) == 0
        else:
            assert r.num_swap_preemptions == 0 and r.swapped_bytes == 0
        for req, t in zip(r.requests, trace, strict=True):
            assert req.outputs() == [expected_tokens(t.prompt_token_ids, t.request_id, i,
                                                     t.output_len) for i in range(2)]
        assert max(s.num_seqs for s in r.steps) <= 32
        assert all(0.0 <= s.gpu_block_usage <= 1.0 for s in r.steps)
        assert all(s.gpu_token_usage <= s.gpu_block_usage + 1e-9 for s in r.steps)
        assert sum(s.num_preempted for s in r.steps) == r.num_preemptions


def test_prefix_caching_shows_in_the_hit_rate_and_the_ttft():
    trace = few_shot(60, seed=1, rate=20.0)
    runs = {c: replay(trace, cache_config=CacheConfig(num_gpu_blocks=2000,
                                                      enable_prefix_caching=c))
            for c in (False, True)}
    assert runs[False].prefix_cache_hit_rate == 0.0
    assert runs[True].prefix_cache_hit_rate > 0.7
    assert runs[True].ttft_mean < runs[False].ttft_mean


def test_metrics_and_recorded_batches():
    trace = sharegpt_like(20, seed=0, max_total_len=256)
    r = replay(trace, SchedulerConfig(max_num_batched_tokens=128, max_model_len=256),
               CacheConfig(num_gpu_blocks=40), with_metrics=True, record_batches=True,
               progress=True)
    assert r.metrics.value("vllm:num_preemptions_total") == r.num_preemptions
    assert r.metrics.value("vllm:time_to_first_token_seconds_count") == 20
    assert r.metrics.value("vllm:num_requests_running") == 0
    tokens = sum(n for s in r.steps for _, n, _ in s.batch)
    assert tokens == sum(s.num_prefill_tokens + s.num_decode_tokens for s in r.steps)
    assert all(len(s.batch) == s.num_seqs for s in r.steps)
    summary = r.summary()
    assert summary["requests"] == 20 and not math.isnan(summary["ttft_p99_s"])


def test_bench_script_quick_run():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "replay.py"), "--quick"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for word in ("machine:", "steps/s", "per scheduled sequence", "Orca-Max", "paged"):
        assert word in proc.stdout, word


def test_each_tuning_row_shows_its_symptom_and_the_fix_helps():
    from course_lib.claims import tuning

    r = {row.symptom: tuning.run_row(row) for row in tuning.ROWS}
    full = r["cache usage > 90% + frequent preemption"]
    assert full["before"]["steps_over_90pct"] > 0.5 and full["before"]["preemptions"] > 100
    assert full["2x GPU blocks"]["preemptions"] < full["before"]["preemptions"]
    assert full["max_model_len 1024"]["preemptions"] < full["before"]["preemptions"]
    assert full["max_model_len 1024"]["rejected"] > 0            # the price of that fix
    slow = r["cache usage < 50% + high latency"]
    assert slow["before"]["cache_usage_mean"] < 0.5
    assert slow["max_num_batched_tokens 2048"]["ttft_mean_s"] < slow["before"]["ttft_mean_s"] / 5
    queue = r["high TTFT + normal ITL"]
    assert queue["before"]["ttft_p99_s"] > 2.0
    assert queue["before"]["itl_p99_s"] < 1.5 * queue["before"]["itl_p50_s"]   # steady ITL
    assert queue["prefix caching"]["ttft_p99_s"] < queue["before"]["ttft_p99_s"] / 10
    jitter = r["jittery ITL"]
    ratio = {k: v["itl_p99_s"] / v["itl_p50_s"] for k, v in jitter.items()}
    assert ratio["max_num_seqs 32"] < ratio["before"] and ratio["before"] > 3
    text = tuning.format_row(tuning.ROWS[0], full)
    assert "symptom: cache usage > 90%" in text and "2x GPU blocks" in text


def test_replay_steps_record_the_block_managers_usage_with_forks():
    """Each step's KV usage is BlockManager.usage() (whose O(tables) count of filled slots
    check_invariants compares with a block-by-block walk), shared partial blocks included."""
    from course_lib.sim.traces import TraceRequest

    trace = [TraceRequest(i, 0.0, tuple(range(i, i + 7 + 3 * i)), 9, n=1 + i % 3)
             for i in range(5)]
    r = replay(trace, SchedulerConfig(max_num_batched_tokens=32),
               CacheConfig(block_size=4, num_gpu_blocks=60, watermark=0.0),
               check_invariants=True)
    assert any(0 < s.gpu_token_usage < s.gpu_block_usage for s in r.steps)
    assert r.steps[-1].gpu_block_usage == r.steps[-1].gpu_token_usage == 0.0


def test_swap_space_in_blocks():
    cc = CacheConfig.from_swap_space(4.0, 8 * 2**20, num_gpu_blocks=100)
    assert cc.num_cpu_blocks == 512 and cc.num_gpu_blocks == 100
    with pytest.raises(ValueError, match="swap_space"):
        CacheConfig.from_swap_space(-1.0, 1024)


def test_on_metrics_hands_over_the_metrics_before_the_first_step():
    seen = []

    def on_metrics(metrics):       # e.g. serve_metrics(metrics) while the replay runs
        seen.append((metrics, metrics.value("vllm:num_requests_running")))

    r = replay(sharegpt_like(5, seed=1, max_total_len=256), SchedulerConfig(max_model_len=256),
               CacheConfig(num_gpu_blocks=40), on_metrics=on_metrics)
    assert len(seen) == 1 and seen[0][1] == 0          # nothing running yet when handed over
    assert seen[0][0] is r.metrics                     # the same collectors, updated to the end
    assert r.metrics.value("vllm:time_to_first_token_seconds_count") == 5
