"""course_lib.sim.disagg_replay: colocated vs xPyD replays, their figures, the capacity side.

Behaviour only (the figures are bench/disagg.py's to print): every request finishes with the
same tokens either way, the decode engines' pools bound them, TTFT includes the transfer, the
prefill side keeps its blocks until the transfer ends, goodput falls as the SLO tightens, exact
relations on a lone request, bad inputs refused.
"""

from __future__ import annotations

import math

import pytest

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.sim.disagg_replay import (
    SLO,
    KVLink,
    decode_heavy,
    decode_node_capacity,
    max_goodput_rate,
    prefill_heavy,
    replay_colocated,
    replay_disaggregated,
)
from course_lib.sim.fake_sampler import expected_tokens
from course_lib.sim.replay import CostModel
from course_lib.sim.traces import TraceRequest, gamma_arrivals, random_like

SC = SchedulerConfig(max_model_len=4096, max_num_batched_tokens=2048)
CC = CacheConfig(num_gpu_blocks=2000)


@pytest.fixture(scope="module")
def mixed() -> list[TraceRequest]:
    """Long and short prompts together, at a rate that queues."""
    a = prefill_heavy(20, rate=8.0, seed=1, input_len=1200, output_len=16)
    b = decode_heavy(20, rate=8.0, seed=2, output_len=48)
    rows = sorted([*a, *b], key=lambda t: t.arrival_time)
    return [TraceRequest(i, t.arrival_time, t.prompt_token_ids, t.output_len)
            for i, t in enumerate(rows)]


def test_every_request_finishes_with_the_same_tokens_on_both_deployments(mixed):
    colo = replay_colocated(mixed, 2, SC, CC, check_invariants=True)
    pd = replay_disaggregated(mixed, 1, 1, SC, CC, check_invariants=True)
    for r in (colo, pd):
        assert [q.request_id for q in r.requests] == [t.request_id for t in mixed]
        for q, t in zip(r.requests, mixed, strict=True):
            assert len(q.token_ids) == len(q.token_times) == t.output_len
            assert list(q.token_ids) == expected_tokens(t.prompt_token_ids, t.request_id, 0,
                                                        t.output_len)
    assert colo.generated_tokens == pd.generated_tokens
    assert all(q.transfer_s > 0 for q in pd.requests if q.prompt_len > 16)
    assert all(q.transfer_s == 0 for q in colo.requests)


def test_the_prefill_side_keeps_its_blocks_until_the_transfer_ends(mixed):
    """At the end nothing is held anywhere; with a slow link the prefill engine's pool holds
    finished requests' blocks while they travel (its peak is above what its running prefills
    need alone: with a free link the peak is lower)."""
    slow = replay_disaggregated(mixed, 1, 1, SC, CC, link=KVLink(1e9, 0.5))
    fast = replay_disaggregated(mixed, 1, 1, SC, CC, link=KVLink.free())
    assert slow.engines[0].role == "prefill"
    assert [e.blocks_held_at_end for e in (*slow.engines, *fast.engines)] == [0] * 4
    assert slow.engines[0].max_blocks_held > fast.engines[0].max_blocks_held
    colo = replay_colocated(mixed, 1, SC, CC)
    assert colo.engines[0].role == "colocated" and len(colo.serving_engines()) == 1


def test_a_decode_engine_never_holds_more_blocks_than_it_has_and_its_pool_bounds_the_batch():
    trace = decode_heavy(30, rate=float("inf"), seed=3, input_len=160, output_len=64)
    small = CacheConfig(num_gpu_blocks=60)       # ~5 requests' worth on the decode engine
    big = replay_disaggregated(trace, 1, 1, SC, CC)
    tight = replay_disaggregated(trace, 1, 1, SC, small, check_invariants=True)
    d_big, d_tight = big.serving_engines()[0], tight.serving_engines()[0]
    assert d_tight.max_blocks_held <= d_tight.num_gpu_blocks == 60
    assert d_tight.max_blocks_held >= 60 - 12          # the pool filled up: the limit bound
    assert d_tight.max_running < d_big.max_running     # fewer decodes at once
    assert tight.ttft_mean > big.ttft_mean             # requests waited for room
    assert tight.generated_tokens == big.generated_tokens


def test_ttft_includes_the_transfer_exactly_on_a_lone_request():
    cost = CostModel()
    t = random_like(1, input_len=1000, output_len=8, seed=5)
    colo = replay_colocated(t, 1, SC, CC, cost)
    free = replay_disaggregated(t, 1, 1, SC, CC, cost, KVLink.free())
    slow = replay_disaggregated(t, 1, 1, SC, CC, cost, KVLink(2e9, 0.25))
    p = t[0].prompt_len
    rest = p - (p - 1) // 16 * 16                       # the tokens the decode side computes
    # a free link: the colocated prefill, then one decode-side step for the rest of the prompt
    assert free.ttft_mean == pytest.approx(colo.ttft_mean + cost.step_base_s
                                           + rest * cost.s_per_token)
    xfer = 0.25 + (p - rest) * cost.kv_bytes_per_token / 2e9
    assert slow.requests[0].transfer_s == pytest.approx(xfer)
    assert slow.ttft_mean == pytest.approx(free.ttft_mean + xfer)
    # after the first token a lone request decodes alike everywhere: the same gaps
    assert slow.requests[0].itls == pytest.approx(colo.requests[0].itls)


def test_goodput_drops_when_the_slo_tightens(mixed):
    r = replay_disaggregated(mixed, 1, 1, SC, CC)
    loose = SLO(math.inf, math.inf)
    assert r.slo_attainment(loose) == 1.0
    assert r.goodput(loose) == pytest.approx(r.throughput_requests_s)
    median_ttft = sorted(r.ttfts)[len(r.ttfts) // 2]
    tighter = [SLO(math.inf, math.inf), SLO(max(r.ttfts), math.inf), SLO(median_ttft, math.inf),
               SLO(median_ttft, min(q.tpot for q in r.requests if q.tpot > 0))]
    goodputs = [r.goodput(s) for s in tighter]
    assert goodputs == sorted(goodputs, reverse=True)
    assert goodputs[-1] < goodputs[2] < goodputs[0]
    assert r.goodput(SLO(min(r.ttfts) / 2, 1.0)) == 0.0


def test_max_goodput_rate_is_the_highest_rate_that_meets_the_attainment():
    def make(rate):
        return prefill_heavy(24, rate=rate, seed=4, input_len=1500, output_len=8)

    def run(trace):
        return replay_colocated(trace, 1, SC, CC)

    slo = SLO(1.0, 1.0)
    rates = (0.5, 1.0, 4.0, 64.0)
    best, per_gpu = max_goodput_rate(make, run, rates, slo)
    assert best in rates and per_gpu == best
    if best != max(rates):
        nxt = rates[rates.index(best) + 1]
        assert run(make(nxt)).slo_attainment(slo) < 0.9
    assert run(make(best)).slo_attainment(slo) >= 0.9
    assert max_goodput_rate(make, run, (64.0,), SLO(1e-3, 1e-3)) == (0.0, 0.0)


def test_the_workloads_have_the_shapes_they_say():
    pre, dec = prefill_heavy(50), decode_heavy(50)
    assert min(t.prompt_len for t in pre) > 10 * max(t.output_len for t in pre)
    assert min(t.output_len for t in dec) > max(t.prompt_len for t in dec)
    assert prefill_heavy(50) == pre                    # seeded
    gaps = [b - a for a, b in zip(gamma_arrivals(2000, 1.0, 0.25)[:-1],
                                  gamma_arrivals(2000, 1.0, 0.25)[1:], strict=True)]
    mean = sum(gaps) / len(gaps)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert 0.8 < mean < 1.2 and cv > 1.5               # bursty: CV 1/sqrt(0.25) = 2


def test_the_capacity_side_paged_holds_more_decodes_than_static():
    trace = decode_heavy(100)
    c = decode_node_capacity("Llama-2-7B", trace, gpu_memory_gib=80.0, max_model_len=4096)
    assert c.static_concurrency == c.num_gpu_blocks // 256
    assert c.paged_concurrency > 3 * c.static_concurrency
    assert c.paged_utilization > 0.95 > 0.3 > c.static_utilization
    longer = decode_node_capacity("Llama-2-7B", prefill_heavy(100), max_model_len=4096)
    assert longer.ratio < c.ratio                      # long requests gain less from paging


@pytest.mark.parametrize(("call", "name"), [
    (lambda t: replay_disaggregated(t, 0, 1, SC, CC), "num_prefill"),
    (lambda t: replay_disaggregated(t, 1, 0, SC, CC), "num_decode"),
    (lambda t: replay_disaggregated(t, 1.5, 1, SC, CC), "num_prefill"),
    (lambda t: replay_colocated(t, 0, SC, CC), "num_gpus"),
    (lambda t: KVLink(-1.0), "bytes_per_s"),
    (lambda t: KVLink(0.0), "bytes_per_s"),
    (lambda t: KVLink(1e9, -0.1), "latency_s"),
    (lambda t: KVLink(1e9, math.nan), "latency_s"),
    (lambda t: decode_node_capacity("Llama-2-7B", t, max_model_len=8), "max_model_len"),
    (lambda t: decode_node_capacity("Llama-2-7B", []), "trace"),
    (lambda t: max_goodput_rate(lambda r: t, lambda tr: None, (1.0,), SLO(1, 1), 0.0),
     "attainment"),
    (lambda t: gamma_arrivals(3, 1.0, 0.0), "burstiness"),
    (lambda t: random_like(3, input_len=10, output_len=4, range_ratio=1.0), "range_ratio"),
])
def test_bad_inputs_raise_naming_the_value(call, name):
    trace = decode_heavy(2)
    with pytest.raises(ValueError, match=name):
        call(trace)


def test_the_chapter_draws_the_study_and_a_request_path_readably():
    """Chapter 13's two figures: readable at 100% zoom, the request's moments all listed, the
    messages found between them; an empty input is refused."""
    from test_viz_readability import NOTEBOOK_PX

    from course_lib.parallel.disagg import Hop
    from course_lib.sim.disagg_replay import STUDY_SLO, decode_heavy, run_deployment
    from course_lib.viz.disagg import _messages, draw_deployments, draw_request_path
    from course_lib.viz.readable import EXPLORER_DPI, MIN_FONT_PT, shown_font_pt

    hops = [Hop(0.0, "proxy", "sent to prefill 0"),
            Hop(0.020, "prefill 0", "prefill done, first token sampled"),
            Hop(0.021, "proxy", "sent to decode 0"), Hop(0.025, "decode 0", "read request"),
            Hop(0.028, "prefill 0", "send"), Hop(0.035, "prefill 0", "sent, blocks freed"),
            Hop(0.036, "decode 0", "loaded"), Hop(0.115, "decode 0", "finished")]
    assert _messages(hops) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 6)]
    fig = draw_request_path(hops[::-1])                  # any order: sorted by time
    texts = " ".join(t.get_text() for t in fig.texts)
    assert all(f"{n}. {h.where}: {h.what}" in texts for n, h in enumerate(hops, 1))
    assert shown_font_pt(fig, EXPLORER_DPI, NOTEBOOK_PX) >= MIN_FONT_PT
    trace = decode_heavy(12, rate=4.0)
    study = {"decode-heavy": [run_deployment(trace, 0, 2), run_deployment(trace, 1, 1)]}
    fig = draw_deployments(study, STUDY_SLO)
    assert shown_font_pt(fig, EXPLORER_DPI, NOTEBOOK_PX) >= MIN_FONT_PT
    with pytest.raises(ValueError, match="no moments"):
        draw_request_path([])
    with pytest.raises(ValueError, match="no results"):
        draw_deployments({}, STUDY_SLO)


@pytest.mark.parametrize("run", [
    lambda trace, **kw: replay_colocated(trace, 1, **kw),
    lambda trace, **kw: replay_disaggregated(trace, 1, 1, **kw)])
def test_the_deployments_refuse_a_bad_trace_or_cost_model_before_running(run):
    """A repeated request id was queued twice (the replays key their tokens by id); a dict
    for the cost model was falsy and ran the defaults."""
    t = TraceRequest(0, 0.0, (1, 2, 3), 4)
    with pytest.raises(ValueError, match="trace item 1: request_id 0 is already used"):
        run([t, t])
    with pytest.raises(ValueError, match="cost_model must be None or a CostModel .*got dict"):
        run([t], cost_model={})
    with pytest.raises(ValueError, match="max_events must be an int >= 1, got 0"):
        run([t], max_events=0)
    with pytest.raises(ValueError, match="cache_config must be None or a CacheConfig"):
        run([t], cache_config={})


@pytest.mark.parametrize("ttft, tpot", [(-1.0, 1.0), (1.0, -0.5), (math.nan, 1.0),
                                        (1.0, math.nan), (True, 1.0), ("2", 1.0)])
def test_slo_rejects_negative_nan_and_non_numbers(ttft, tpot):
    with pytest.raises(ValueError, match="must be a number of seconds >= 0"):
        SLO(ttft, tpot)


def test_slo_accepts_zero_and_no_limit():
    assert SLO(0, math.inf).tpot_s == math.inf
