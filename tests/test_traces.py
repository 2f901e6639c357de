"""Trace synthesis: deterministic from the seed, the documented distributions, real prefixes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from course_lib.sim import traces as tr

pytestmark = pytest.mark.ch02

N = 20_000


def test_same_seed_same_trace_other_seed_other_trace():
    a = tr.sharegpt_like(200, seed=3, rate=5.0)
    assert a == tr.sharegpt_like(200, seed=3, rate=5.0)
    b = tr.sharegpt_like(200, seed=4, rate=5.0)
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in b]
    assert tr.multi_turn_chat(4, 3, seed=1) == tr.multi_turn_chat(4, 3, seed=1)
    assert tr.few_shot(50, seed=2, num_tasks=3) == tr.few_shot(50, seed=2, num_tasks=3)


def test_rate_moves_arrivals_but_not_requests():
    slow, fast = tr.sharegpt_like(100, seed=0, rate=1.0), tr.sharegpt_like(100, seed=0, rate=50.0)
    assert [r.prompt_token_ids for r in slow] == [r.prompt_token_ids for r in fast]
    assert [r.output_len for r in slow] == [r.output_len for r in fast]
    assert slow[-1].arrival_time > fast[-1].arrival_time
    assert all(r.arrival_time == 0.0 for r in tr.sharegpt_like(10, seed=0))


def test_lognormal_integration_matches_closed_form_without_cut():
    # E[exp(Z)] = exp(mu + sigma^2 / 2): checks the numerical integral itself
    want = [math.exp(m + s * s / 2)
            for m, s in zip(tr.SHAREGPT_LOG_MU, tr.SHAREGPT_LOG_SIGMA, strict=True)]
    got = tr.lognormal_means(None)
    assert got == pytest.approx(want, rel=1e-3)


def test_sharegpt_means_are_the_conditioned_lognormal_within_3_percent():
    lens = tr.sharegpt_lengths(N, seed=11)
    want_in, want_out = tr.lognormal_means(2048)
    print(f"ShareGPT-like over {N:,}: mean input {lens.input_lens.mean():.1f} "
          f"(integral {want_in:.1f}), mean output {lens.output_lens.mean():.1f} "
          f"(integral {want_out:.1f}); paper's data: {tr.SHAREGPT_PAPER_MEANS}")
    assert lens.input_lens.mean() == pytest.approx(want_in, rel=0.03)
    assert lens.output_lens.mean() == pytest.approx(want_out, rel=0.03)


def test_sharegpt_lengths_respect_the_cut_and_are_positively_correlated():
    lens = tr.sharegpt_lengths(N, seed=12, max_total_len=2048)
    assert len(lens.input_lens) == len(lens.output_lens) == N
    assert (lens.input_lens >= 1).all() and (lens.output_lens >= 1).all()
    assert (lens.input_lens + lens.output_lens).max() <= 2048
    r = np.corrcoef(np.log(lens.input_lens), np.log(lens.output_lens))[0, 1]
    assert 0.1 < r < 0.25          # 0.18 before the cut; the cut lowers it a little
    short = tr.sharegpt_lengths(2000, seed=12, max_total_len=300)
    assert (short.input_lens + short.output_lens).max() <= 300


def test_alpaca_means_within_3_percent():
    lens = tr.alpaca_lengths(N, seed=5)
    print(f"Alpaca-like over {N:,}: mean input {lens.input_lens.mean():.2f}, "
          f"mean output {lens.output_lens.mean():.2f}; target {tr.ALPACA_MEANS}")
    assert lens.input_lens.mean() == pytest.approx(tr.ALPACA_MEANS[0], rel=0.03)
    assert lens.output_lens.mean() == pytest.approx(tr.ALPACA_MEANS[1], rel=0.03)
    assert (lens.input_lens >= 1).all() and (lens.output_lens >= 1).all()


def test_trace_requests_follow_the_lengths_and_vocab():
    trace = tr.sharegpt_like(300, seed=7, vocab_size=100)
    lens = tr.sharegpt_lengths(300, seed=7)
    assert [r.prompt_len for r in trace] == lens.input_lens.tolist()
    assert [r.output_len for r in trace] == lens.output_lens.tolist()
    assert [r.request_id for r in trace] == list(range(300))
    assert all(1 <= t < 100 for r in trace for t in r.prompt_token_ids)
    assert all(isinstance(t, int) for t in trace[0].prompt_token_ids)


def test_poisson_interarrival_mean_is_one_over_rate():
    times = np.array(tr.poisson_arrivals(N, rate=4.0, seed=9))
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)     # exponential: std == mean
    assert tr.poisson_arrivals(3, float("inf")) == [0.0, 0.0, 0.0]


def test_multi_turn_prompts_extend_the_previous_turn():
    trace = tr.multi_turn_chat(5, 4, seed=2, rate=1.0, think_time=3.0, system_prompt_len=40)
    assert len(trace) == 20
    assert [r.arrival_time for r in trace] == sorted(r.arrival_time for r in trace)
    system = trace[0].prompt_token_ids[:40]
    by_session: dict[int, list] = {}
    for r in trace:
        assert r.prompt_token_ids[:40] == system          # one shared system prompt
        by_session.setdefault(r.session_id, []).append(r)
    assert sorted(by_session) == list(range(5))
    for turns in by_session.values():
        for prev, nxt in zip(turns, turns[1:], strict=False):
            # turn k+1 = turn k's prompt + its reply (output_len tokens) + a new message
            assert nxt.prompt_token_ids[:prev.prompt_len] == prev.prompt_token_ids
            assert nxt.prompt_len > prev.prompt_len + prev.output_len
            assert nxt.arrival_time == pytest.approx(prev.arrival_time + 3.0)


def test_few_shot_requests_of_a_task_share_the_examples():
    trace = tr.few_shot(60, seed=4, num_tasks=2, num_examples=3, instruction_len=10,
                        example_len=20)
    shared_len = 10 + 3 * 20
    prefixes = {r.prompt_token_ids[:shared_len] for r in trace}
    assert len(prefixes) == 2                      # exactly one shared prefix per task
    assert all(r.prompt_len > shared_len for r in trace)
    assert len({r.prompt_token_ids for r in trace}) > 50   # questions differ


def test_sampling_variants_keep_everything_else():
    base = tr.alpaca_like(20, seed=1, rate=2.0)
    par = tr.with_parallel_sampling(base, 4)
    beam = tr.with_beam_search(base, 3)
    assert all(p.n == 4 and p.beam_width == 1 for p in par)
    assert all(b.beam_width == 3 and b.n == 1 for b in beam)
    assert [(p.request_id, p.prompt_token_ids, p.arrival_time) for p in par] == \
        [(b.request_id, b.prompt_token_ids, b.arrival_time) for b in base]
    with pytest.raises(ValueError, match="n must be"):
        tr.with_parallel_sampling(base, 0)


@pytest.mark.parametrize("call, match", [
    (lambda: tr.sharegpt_like(-1), "num must be"),
    (lambda: tr.sharegpt_like(5, rate=0.0), "rate must be"),
    (lambda: tr.sharegpt_like(5, seed=-2), "seed must be"),
    (lambda: tr.alpaca_like(5, vocab_size=1), "vocab_size must be"),
    (lambda: tr.multi_turn_chat(2, 0), "turns must be"),
    (lambda: tr.poisson_arrivals(3, float("nan")), "rate must be"),
])
def test_bad_arguments_name_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_summary():
    s = tr.trace_summary(tr.sharegpt_like(50, seed=0, rate=1.0))
    assert s["requests"] == 50 and s["max_total"] <= 2048 and s["duration_s"] > 0
    assert tr.trace_summary([]) == {"requests": 0}


@pytest.mark.parametrize("kwargs, match", [
    (dict(arrival_time=math.nan), r"request 0: arrival_time must be a finite number of seconds "
                                  r">= 0 .*got nan"),
    (dict(arrival_time=math.inf), r"arrival_time .* got inf"),
    (dict(arrival_time=-1.0), r"arrival_time .* got -1.0"),
    (dict(arrival_time="0"), r"arrival_time .* got '0'"),
    (dict(arrival_time=True), r"arrival_time .* got True"),
    (dict(request_id=-1), r"request_id must be an int >= 0, got -1"),
    (dict(request_id="0"), r"request_id must be an int >= 0, got '0'"),
    (dict(prompt_token_ids=[1, 2]), r"prompt_token_ids must be a tuple of token ids, got list"),
    (dict(output_len=0), r"output_len must be an int >= 1, got 0"),
    (dict(output_len=4.0), r"output_len must be an int >= 1, got 4.0"),
    (dict(n=0), r"n must be an int >= 1"), (dict(beam_width=None), r"beam_width must be"),
    (dict(session_id=-2), r"session_id must be an int >= 0")])
def test_a_trace_request_refuses_bad_fields(kwargs, match):
    """A NaN arrival was accepted and then stalled ``replay`` forever (it never came due)."""
    fields = dict(request_id=0, arrival_time=0.0, prompt_token_ids=(1, 2), output_len=4)
    with pytest.raises(ValueError, match=match):
        tr.TraceRequest(**{**fields, **kwargs})


def test_check_trace_refuses_what_is_not_a_trace_and_repeated_ids():
    t = tr.TraceRequest(3, 0.0, (1,), 2)
    assert tr.check_trace((t,)) == [t]
    with pytest.raises(ValueError, match="trace must be a list of TraceRequest, got NoneType"):
        tr.check_trace(None)
    with pytest.raises(ValueError, match="item 1 is int 7"):
        tr.check_trace([t, 7])
    with pytest.raises(ValueError, match="trace item 1: request_id 3 is already used"):
        tr.check_trace([t, tr.TraceRequest(3, 1.0, (2,), 2)])


@pytest.mark.parametrize("call, match", [
    (lambda: tr.gamma_arrivals(3, 1.0, math.inf), r"burstiness must be finite and > 0"),
    (lambda: tr.gamma_arrivals(3, 1.0, True), r"burstiness .* got True"),
    (lambda: tr.poisson_arrivals(3, True), r"rate must be > 0 requests/s .* got True"),
    (lambda: tr.multi_turn_chat(2, 2, think_time=None), r"think_time must be a finite number"),
    (lambda: tr.multi_turn_chat(2, 2, think_time=math.inf), r"think_time .* got inf")])
def test_arrival_knobs_refuse_values_that_make_no_times(call, match):
    """burstiness=inf drew NaN arrival times; a bool was a rate; None a TypeError."""
    with pytest.raises(ValueError, match=match):
        call()
