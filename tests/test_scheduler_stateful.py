"""Random traces through a tiny KV pool: preemption all the time, in both modes.

For every trace: ``check_invariants()`` holds after every ``schedule()`` and ``update()``;
every request finishes; every GPU and CPU block comes back; and every request's tokens are
exactly those it would have had without preemption (the fake sampler makes a token depend
only on the request, the sample index and the position -- or on the beam's tokens).
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from property_budget import examples
from test_scheduler import reference_beam_search

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.scheduler.scheduler import Scheduler
from course_lib.sequence import SamplingParams, SequenceStatus
from course_lib.sim.fake_sampler import expected_tokens, fake_samples
from course_lib.sizing.units import cdiv

pytestmark = pytest.mark.ch07

PREFIXES = [(), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9), (5, 5, 5, 5, 5, 5, 5, 5, 5)]

request_st = st.tuples(
    st.sampled_from(PREFIXES),
    st.lists(st.integers(0, 20), min_size=0, max_size=12),
    st.integers(1, 10),                                  # max_tokens
    st.sampled_from([(1, 1)] * 4 + [(2, 1), (3, 1), (1, 2), (1, 3)]),   # (n, beam_width)
    st.one_of(st.just(0), st.integers(0, 12)),           # arrival step
)


@settings(max_examples=examples(150))
@given(requests=st.lists(request_st, min_size=3, max_size=12),
       block_size=st.sampled_from([1, 2, 4]), mode=st.sampled_from(["recompute", "swap"]),
       caching=st.booleans(), chunked=st.booleans(), watermark=st.sampled_from([0.0, 0.1]),
       max_num_seqs=st.integers(3, 16), budget=st.integers(4, 40), extra=st.integers(0, 4),
       cpu_factor=st.sampled_from([0, 1, 3]))
def test_random_traces_finish_with_the_tokens_of_an_unpreempted_run(
        requests, block_size, mode, caching, chunked, watermark, max_num_seqs, budget, extra,
        cpu_factor):
    max_model_len = 40
    trace = []
    for i, (prefix, tail, max_tokens, (n, width), arrival) in enumerate(requests):
        ids = (prefix + tuple(tail)) or (7,)
        trace.append((i, ids, SamplingParams(max_tokens=max_tokens, n=n, beam_width=width),
                      arrival))
    # the largest request must fit alone, even unshared after a recompute (+1 block per seq
    # for a copy-on-write or a new block in its next decode)
    need = max(p.num_seqs * (cdiv(len(ids) + p.max_tokens, block_size) + 1)
               for _, ids, p, _ in trace)
    num_gpu = int((need + extra) / (1 - watermark)) + 1
    if not chunked:
        budget = max(budget, max_model_len)
    s = Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, chunked, mode),
                  CacheConfig(block_size, num_gpu, cpu_factor * need, watermark, caching))
    reqs, pending, steps = [], sorted(trace, key=lambda t: t[3]), 0
    while pending or s.has_unfinished_requests():
        while pending and pending[0][3] <= steps:
            rid, ids, params, arrival = pending.pop(0)
            reqs.append(s.add_request(rid, ids, params, arrival_time=float(arrival)))
        out = s.schedule()
        s.check_invariants()
        assert out.num_batched_tokens <= budget
        assert len({e.seq.seq_id for e in out.scheduled}) <= max_num_seqs
        samples = fake_samples(out)
        s.update(out, samples, float(steps))
        s.check_invariants()
        for _, m in out.preempted:
            event(f"preempted by {m}")
        steps += 1
        assert steps < 5000, "no progress"
    if s.num_preemptions:
        event("some preemption")
    bm = s.block_manager
    assert bm.num_free_gpu_blocks == num_gpu and bm.num_free_cpu_blocks == bm.num_cpu_blocks
    assert not bm.seq_ids()
    for req in reqs:
        p = req.sampling_params
        assert req.is_finished, req.request_id
        assert all(q.status == SequenceStatus.FINISHED_LENGTH_CAPPED for q in req.seqs), \
            (req.request_id, req.finish_reason)
        if p.use_beam_search:
            want = reference_beam_search(req.request_id, req.prompt_token_ids, p.beam_width,
                                         p.max_tokens)
        else:
            want = [expected_tokens(req.prompt_token_ids, req.request_id, i, p.max_tokens)
                    for i in range(p.n)]
        assert req.outputs() == want, (req.request_id, req.num_preemptions)


def test_the_random_traces_do_preempt():
    """The property above is only worth something if preemption happens: check one trace."""
    s = Scheduler(SchedulerConfig(6, 16, 40, True, "swap"), CacheConfig(2, 20, 8, 0.0, True))
    reqs = [s.add_request(i, (1, 2, 3, 4, 5, i), SamplingParams(max_tokens=10, n=1 + i % 3))
            for i in range(8)]
    modes = set()
    while s.has_unfinished_requests():
        out = s.schedule()
        modes |= {m for _, m in out.preempted}
        s.update(out, fake_samples(out))
    assert modes == {"swap", "recompute"}, modes
    for r in reqs:
        assert r.outputs() == [expected_tokens(r.prompt_token_ids, r.request_id, i, 10)
                               for i in range(r.sampling_params.n)]
