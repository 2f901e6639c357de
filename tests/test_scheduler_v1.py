"""The V1 scheduler: one token budget, chunked prefill, recompute preemption of the latest
request, n child sequences sharing the prompt through the prefix cache; the tokens of the
model-free sampler are the V0 scheduler's, whatever the pool and the budget."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_budget import examples

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.scheduler.scheduler import Scheduler
from course_lib.scheduler.v1 import SchedulerV1
from course_lib.sequence import SamplingParams, SequenceStatus
from course_lib.sim.fake_sampler import expected_tokens, fake_samples

pytestmark = pytest.mark.ch07


def make(block_size=4, num_gpu_blocks=64, caching=True, budget=32, max_num_seqs=16,
         chunked=True, cls=SchedulerV1, prefix_cache="hash"):
    return cls(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(
                   budget, 256 if not chunked else 1), max_model_len=256,
                   enable_chunked_prefill=chunked),
               CacheConfig(block_size, num_gpu_blocks, 0, 0.0, caching, prefix_cache))


def drain(s, max_steps=5000):
    outs = []
    while s.has_unfinished_requests():
        out = s.schedule()
        s.check_invariants()
        s.update(out, fake_samples(out), float(len(outs)))
        s.check_invariants()
        outs.append(out)
        assert len(outs) < max_steps, "no progress"
    return outs


request_st = st.tuples(st.lists(st.integers(1, 6), min_size=1, max_size=30),
                       st.integers(1, 12), st.sampled_from([1, 1, 2, 3]))


@settings(max_examples=examples(120))
@given(requests=st.lists(request_st, min_size=1, max_size=8),
       block_size=st.sampled_from([1, 2, 4, 16]), blocks=st.integers(4, 60),
       caching=st.booleans(), budget=st.integers(4, 64), max_num_seqs=st.integers(1, 8),
       prefix_cache=st.sampled_from(["hash", "radix"]))
def test_random_traces_give_the_fake_samplers_tokens_whatever_the_pressure(
        requests, block_size, blocks, caching, budget, max_num_seqs, prefix_cache):
    """Either prefix cache (V1's hash chain, SGLang's radix tree) under the V1 scheduler."""
    s = make(block_size, blocks, caching, budget, max_num_seqs, prefix_cache=prefix_cache)
    reqs = [s.add_request(i, p, SamplingParams(max_tokens=m, n=n))
            for i, (p, m, n) in enumerate(requests)]
    drain(s)
    assert s.kv_cache_manager.num_free_gpu_blocks == blocks and not s.kv_cache_manager.seq_ids()
    for r in reqs:
        if r.finish_reason == "ignored" or (r.finish_detail or "").startswith("cannot grow"):
            continue
        p = r.sampling_params
        assert r.outputs() == [expected_tokens(r.prompt_token_ids, r.request_id, i,
                                               p.max_tokens) for i in range(p.n)]


def test_children_share_the_prompts_full_blocks_through_the_cache_in_the_same_step():
    s = make(block_size=4, budget=256)
    req = s.add_request(0, list(range(1, 19)), SamplingParams(max_tokens=3, n=3))
    out = s.schedule()
    assert [e.num_tokens for e in out.scheduled] == [18, 2, 2]   # 16 of 18 tokens are hits
    tables = [e.block_ids for e in out.scheduled]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]
    assert s.kv_cache_manager.prefix_cache_stats.hits == 2 * 16
    s.update(out, fake_samples(out))
    drain(s)
    assert req.outputs() == [expected_tokens(req.prompt_token_ids, 0, i, 3) for i in range(3)]


def test_a_short_pool_preempts_the_latest_by_recompute_and_the_tokens_are_unchanged():
    s = make(block_size=4, num_gpu_blocks=10, budget=64)
    reqs = [s.add_request(i, list(range(10 * i + 1, 10 * i + 9)), SamplingParams(max_tokens=12))
            for i in range(3)]
    outs = drain(s)
    modes = [m for o in outs for _, m in o.preempted]
    assert modes and set(modes) == {"recompute"} and reqs[2].num_preemptions > 0
    assert all(not o.blocks_to_copy and not o.blocks_to_swap_out for o in outs)
    for r in reqs:
        assert r.outputs() == [expected_tokens(r.prompt_token_ids, r.request_id, 0, 12)]
    # vLLM's PrefixCacheStats.record: a re-admission after a preemption is counted apart,
    # so vllm:prefix_cache_queries counts each request's first lookup only
    kvm = s.kv_cache_manager
    assert kvm.prefix_cache_stats.queries == sum(len(r.prompt_token_ids) for r in reqs)
    assert kvm.prefix_cache_stats.preempted_queries > 0 and not s.preempted


def test_the_budget_is_one_token_budget_and_chunks_are_the_normal_case():
    s = make(budget=8, max_num_seqs=4)
    s.add_request(0, list(range(1, 20)), SamplingParams(max_tokens=2))
    s.add_request(1, list(range(30, 33)), SamplingParams(max_tokens=2))
    for out in drain(s):
        assert out.num_batched_tokens <= 8


def test_requests_that_can_never_run_are_ignored_and_beams_are_refused():
    s = make(block_size=4, num_gpu_blocks=4)
    big = s.add_request(0, list(range(1, 40)), SamplingParams(max_tokens=2))
    ok = s.add_request(1, [1, 2, 3], SamplingParams(max_tokens=2))
    drain(s)
    assert big.finish_reason == "ignored" and "needs 10 GPU blocks" in big.finish_detail
    assert ok.finish_reason == "length" and ok.outputs()[0]
    grower = s.add_request(2, [1, 2, 3], SamplingParams(max_tokens=40))
    drain(s)
    assert grower.finish_reason == "length" and grower.finish_detail.startswith("cannot grow")
    with pytest.raises(ValueError, match="beam search"):
        s.add_request(3, [1], SamplingParams(beam_width=2))
    assert not s.has_unfinished_requests()


def test_v0_and_v1_give_the_same_tokens_on_the_same_trace():
    trace = [(i, list(range(3 * i + 1, 3 * i + 4 + i)), SamplingParams(max_tokens=6,
                                                                         n=1 + i % 3))
             for i in range(6)]
    results = []
    for cls in (Scheduler, SchedulerV1):
        s = make(block_size=4, num_gpu_blocks=24, cls=cls)
        reqs = [s.add_request(i, p, sp) for i, p, sp in trace]
        drain(s)
        results.append([r.outputs() for r in reqs])
    assert results[0] == results[1]


def test_abort_frees_every_child():
    s = make(block_size=4, num_gpu_blocks=16)
    req = s.add_request(0, list(range(1, 10)), SamplingParams(max_tokens=8, n=2))
    for _ in range(2):
        s.update(out := s.schedule(), fake_samples(out))
    s.check_invariants()
    assert [len(q.output_token_ids) for q in req.seqs] == [2, 2]
    assert s.abort_request(0) and not s.abort_request(0)
    assert not s.has_unfinished_requests() and s.kv_cache_manager.num_free_gpu_blocks == 16
    assert req.finish_reason == "abort" and all(q.status == SequenceStatus.FINISHED_ABORTED
                                                for q in req.seqs)
