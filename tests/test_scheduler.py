"""The scheduler's rules, one at a time: budgets, chunked prefill, decode priority, rejection,
victim policy, recompute and swap preemption, copy-on-write, parallel sampling, beam search."""

from __future__ import annotations

import math
import re

import pytest

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.scheduler.policy import longest_first
from course_lib.scheduler.scheduler import Scheduler
from course_lib.sequence import SamplingParams, SequenceStatus
from course_lib.sim.fake_sampler import expected_tokens, fake_sample, fake_samples

pytestmark = pytest.mark.ch07


def make(block_size=4, num_gpu_blocks=64, num_cpu_blocks=0, watermark=0.0, caching=False,
         policy=None, **sched):
    sched.setdefault("max_model_len", 256)
    cc = CacheConfig(block_size, num_gpu_blocks, num_cpu_blocks, watermark, caching)
    kwargs = {"victim_policy": policy} if policy else {}
    return Scheduler(SchedulerConfig(**sched), cc, **kwargs)


def step(s: Scheduler, now: float = 0.0):
    out = s.schedule()
    s.check_invariants()
    samples = fake_samples(out)
    finished = s.update(out, samples, now)
    s.check_invariants()
    return out, finished


def drain(s: Scheduler, max_steps: int = 10_000):
    outs, finished = [], []
    while s.has_unfinished_requests():
        out, done = step(s, float(len(outs)))
        outs.append(out)
        finished += done
        assert len(outs) < max_steps, "the scheduler does not make progress"
    return outs, finished


def prompt(n: int, start: int = 1) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def test_config_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=512, max_model_len=2048,
                        enable_chunked_prefill=False)


@pytest.mark.parametrize("bad", [12, 0, 512, 16.0, True])
def test_cache_config_block_size_is_a_power_of_two_up_to_256(bad):
    with pytest.raises(ValueError, match=re.escape(
            f"block_size must be a power of two in [1, 256], got {bad!r}")):
        CacheConfig(block_size=bad)
    with pytest.raises(ValueError, match="prefix_cache"):
        CacheConfig(prefix_cache="trie")
    assert CacheConfig(block_size=256).block_size == 256


def test_budgets_are_respected_every_step():
    s = make(num_gpu_blocks=400, max_num_seqs=5, max_num_batched_tokens=24)
    for i in range(20):
        s.add_request(i, prompt(3 + 7 * (i % 5)), SamplingParams(max_tokens=1 + i % 9))
    outs, finished = drain(s)
    assert len(finished) == 20
    assert max(o.num_batched_tokens for o in outs) == 24          # the budget is used...
    assert all(o.num_batched_tokens <= 24 for o in outs)          # ...and never exceeded
    assert max(len(o.scheduled) for o in outs) == 5
    for o in outs:
        assert len({e.seq.seq_id for e in o.scheduled}) <= 5


def test_chunked_prefill_splits_a_long_prompt_and_marks_each_chunk():
    s = make(caching=True, max_num_batched_tokens=16)
    calls = []
    mark = s.block_manager.mark_blocks_as_computed
    s.block_manager.mark_blocks_as_computed = lambda sid, n: (calls.append(n), mark(sid, n))
    req = s.add_request(0, prompt(50), SamplingParams(max_tokens=2))
    chunks = []
    for _ in range(4):
        out, _ = step(s)
        chunks.append([(e.num_tokens, e.is_prefill, e.num_candidates) for e in out.scheduled])
    assert chunks == [[(16, True, 0)], [(16, True, 0)], [(16, True, 0)], [(2, True, 1)]]
    assert calls == [16, 32, 48, 50]
    assert req.seqs[0].output_token_ids == expected_tokens(prompt(50), 0, 0, 1)


def test_chunks_become_prefix_cache_hits_only_after_they_ran():
    s = make(caching=True, max_num_batched_tokens=16)
    s.add_request(0, prompt(40), SamplingParams(max_tokens=1))
    step(s)                                      # first chunk: 16 tokens computed
    b = s.add_request(1, prompt(40), SamplingParams(max_tokens=1))
    out, _ = step(s)                             # 0 continues (16), 1 waits for budget
    assert [e.request.request_id for e in out.scheduled] == [0]
    step(s)                                      # 0's last 8; 1 admitted: 32 tokens computed
    assert b.num_cached_tokens == 32
    drain(s)
    assert b.outputs() == [expected_tokens(prompt(40), 1, 0, 1)]


def test_without_chunking_a_prompt_runs_whole():
    s = make(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    s.add_request(0, prompt(40), SamplingParams(max_tokens=3))
    s.add_request(1, prompt(40), SamplingParams(max_tokens=3))
    out, _ = step(s)
    assert [(e.request.request_id, e.num_tokens) for e in out.scheduled] == [(0, 40)]
    out, _ = step(s)   # 0 decodes (1 token), 1's 40-token prompt fits in the 63 left
    assert [(e.request.request_id, e.num_tokens) for e in out.scheduled] == [(0, 1), (1, 40)]


def test_decodes_go_first_then_prefill_chunks_take_what_is_left():
    s = make(max_num_batched_tokens=10)
    s.add_request(0, prompt(3), SamplingParams(max_tokens=20))
    step(s)
    s.add_request(1, prompt(30), SamplingParams(max_tokens=1))
    out, _ = step(s)
    assert [(e.request.request_id, e.is_prefill, e.num_tokens) for e in out.scheduled] == \
        [(0, False, 1), (1, True, 9)]
    out, _ = step(s)
    assert [(e.request.request_id, e.is_prefill, e.num_tokens) for e in out.scheduled] == \
        [(0, False, 1), (1, True, 9)]


@pytest.mark.parametrize("kwargs, word", [
    ({"length": 300}, "max_model_len"),
    ({"length": 200, "blocks": 40}, "GPU blocks"),
    ({"length": 8, "n": 9}, "max_num_seqs"),
])
def test_a_request_that_can_never_fit_is_ignored_once(kwargs, word):
    s = make(num_gpu_blocks=kwargs.get("blocks", 64), max_num_seqs=8)
    bad = s.add_request(0, prompt(kwargs["length"]), SamplingParams(n=kwargs.get("n", 1)))
    good = s.add_request(1, prompt(5), SamplingParams(max_tokens=2))
    out, finished = step(s)
    assert out.ignored == [bad] and bad in finished
    assert all(q.status == SequenceStatus.FINISHED_IGNORED for q in bad.seqs)
    assert bad.finish_reason == "ignored" and word in bad.finish_detail
    assert [e.request for e in out.scheduled] == [good]      # the loop goes on
    _, finished = drain(s)
    assert finished == [good] and bad not in s.waiting


def test_watermark_keeps_room_for_running_sequences():
    s = make(num_gpu_blocks=10, watermark=0.2)    # 2 blocks kept free for growth
    s.add_request(0, prompt(24), SamplingParams(max_tokens=1))    # 6 blocks
    s.add_request(1, prompt(8), SamplingParams(max_tokens=1))     # 2 more would leave 2
    s.add_request(2, prompt(4), SamplingParams(max_tokens=1))     # 1 more would leave 1
    out, _ = step(s)
    assert sorted(e.request.request_id for e in out.scheduled) == [0, 1]


def _fill_and_grow(policy=None, mode="recompute", num_cpu_blocks=0):
    """Three requests fill a 9-block pool exactly; the next decode needs a new block."""
    s = make(num_gpu_blocks=9, num_cpu_blocks=num_cpu_blocks, policy=policy,
             preemption_mode=mode)
    reqs = [s.add_request(i, prompt(11, 10 * i), SamplingParams(max_tokens=6),
                          arrival_time=float(i)) for i in range(3)]
    step(s)                   # prefill: 3 blocks each, 11 tokens + 1 sampled = 12 slots
    out, _ = step(s)          # the 12th token goes in; every last block is full now
    assert not out.preempted
    out, _ = step(s)          # each needs a new block: one request must go
    return s, reqs, out


def test_default_victim_is_the_last_arrived_request():
    s, reqs, out = _fill_and_grow()
    assert out.preempted == [(2, "recompute")]
    assert [e.request.request_id for e in out.scheduled] == [0, 1]


def test_victim_policy_is_pluggable():
    def first_arrived(cands):
        return min(cands, key=lambda r: r.arrival_time)
    s, reqs, out = _fill_and_grow(policy=first_arrived)
    assert out.preempted[0] == (0, "recompute")
    s, reqs, out = _fill_and_grow(policy=longest_first)
    assert out.preempted and out.preempted[0][0] in (0, 1, 2)


def test_recompute_frees_every_block_and_requeues_first_with_outputs_kept():
    s, reqs, out = _fill_and_grow()
    victim = reqs[2]
    seq = victim.seqs[0]
    assert not s.block_manager.has_seq(seq.seq_id) and seq.status == SequenceStatus.WAITING
    assert s.waiting[0] is victim and seq.num_computed_tokens == 0
    assert len(seq.output_token_ids) == 2                      # kept
    assert seq.prefill_target == 11 + 2 - 1                    # prompt + outputs, last by decode
    _, finished = drain(s)
    for r in reqs:
        assert r.outputs() == [expected_tokens(r.prompt_token_ids, r.request_id, 0, 6)]
    assert s.block_manager.num_free_gpu_blocks == 9


def test_swap_out_and_in_list_exactly_the_block_managers_copies():
    s = make(num_gpu_blocks=9, num_cpu_blocks=8, preemption_mode="swap")
    bm = s.block_manager
    returned = {"out": [], "in": []}
    swap_out, swap_in = bm.swap_out, bm.swap_in
    bm.swap_out = lambda ids: returned["out"].append(swap_out(ids)) or returned["out"][-1]
    bm.swap_in = lambda ids: returned["in"].append(swap_in(ids)) or returned["in"][-1]
    reqs = [s.add_request(i, prompt(11, 10 * i), SamplingParams(max_tokens=6),
                          arrival_time=float(i)) for i in range(3)]
    outs, _ = drain(s)
    swapped = [o for o in outs if o.blocks_to_swap_out]
    assert swapped and swapped[0].preempted == [(2, "swap")]
    assert [o.blocks_to_swap_out for o in swapped] == returned["out"]
    assert [o.blocks_to_swap_in for o in outs if o.blocks_to_swap_in] == returned["in"]
    assert all(len(pairs) == 3 for pairs in returned["out"])  # the victim's 3 blocks
    for r in reqs:
        assert r.outputs() == [expected_tokens(r.prompt_token_ids, r.request_id, 0, 6)]
    assert bm.num_free_gpu_blocks == 9 and bm.num_free_cpu_blocks == 8


def test_swap_moves_a_requests_sequences_together():
    s = make(num_gpu_blocks=12, num_cpu_blocks=12, preemption_mode="swap")
    a = s.add_request(0, prompt(7), SamplingParams(max_tokens=8), arrival_time=0.0)
    b = s.add_request(1, prompt(7, 50), SamplingParams(max_tokens=8, n=3), arrival_time=1.0)
    seen = False
    while s.has_unfinished_requests():
        out, _ = step(s)
        if (1, "swap") in out.preempted:
            seen = True
            assert all(q.status == SequenceStatus.SWAPPED for q in b.unfinished_seqs)
            assert len(b.unfinished_seqs) == 3
            tables = [s.block_manager.get_table(q.seq_id) for q in b.unfinished_seqs]
            assert {t.device for t in tables} == {"cpu"}
    assert seen
    assert a.outputs() == [expected_tokens(prompt(7), 0, 0, 8)]
    assert b.outputs() == [expected_tokens(prompt(7, 50), 1, i, 8) for i in range(3)]


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full():
    s, reqs, out = _fill_and_grow(mode="swap", num_cpu_blocks=2)   # the victim needs 3
    assert out.preempted == [(2, "recompute")] and not out.blocks_to_swap_out
    drain(s)
    assert reqs[2].outputs() == [expected_tokens(reqs[2].prompt_token_ids, 2, 0, 6)]


def test_parallel_samples_fork_after_the_prompt_and_copy_on_first_write():
    s = make()
    bm = s.block_manager
    copies = []
    append = bm.append_slots
    bm.append_slots = lambda sid, toks: copies.append(append(sid, toks)) or copies[-1]
    req = s.add_request(0, prompt(6), SamplingParams(max_tokens=4, n=3))
    out, _ = step(s)
    assert out.scheduled[0].num_candidates == 3 and len(req.seqs) == 3
    tables = [bm.get_block_table(q.seq_id) for q in req.seqs]
    assert tables[0] == tables[1] == tables[2]                     # the prompt's 2 blocks shared
    assert [bm.ref_count(b) for b in tables[0]] == [3, 3]
    out, _ = step(s)                       # each writes its first token into the partial block
    assert out.blocks_to_copy == [pair for c in copies for pair in c]
    assert len(out.blocks_to_copy) == 2    # two copies; the last writer owns the original
    full = bm.get_block_table(req.seqs[0].seq_id)[0]
    assert bm.ref_count(full) == 3         # the full block stays shared
    drain(s)
    assert req.outputs() == [expected_tokens(prompt(6), 0, i, 4) for i in range(3)]
    assert bm.num_free_gpu_blocks == 64


def reference_beam_search(req_id, prompt_ids, width, max_tokens):
    """Beam search on token lists alone (no blocks, no scheduler), with the same sampler."""
    from course_lib.sequence import Request, Sequence
    req = Request(req_id, prompt_ids, SamplingParams(max_tokens=max_tokens, beam_width=width))
    beams = [Sequence(0, prompt_ids)]
    for _ in range(max_tokens):
        scored = []
        for b in beams:
            for tok, lp in fake_sample(req, b, 2 * width):
                scored.append((b.cumulative_logprob + lp, tok, b))
        scored.sort(key=lambda c: (-c[0], c[2].output_token_ids, c[1]))
        beams = [Sequence(0, prompt_ids, output_token_ids=[*b.output_token_ids, t],
                          cumulative_logprob=sc) for sc, t, b in scored[:width]]
    beams.sort(key=lambda b: (-b.cumulative_logprob, b.output_token_ids))
    return [b.output_token_ids for b in beams]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_search_matches_a_plain_reference_even_under_preemption(mode):
    s = make(num_gpu_blocks=14, num_cpu_blocks=14, preemption_mode=mode)
    reqs = [s.add_request(i, prompt(5 + i, 7 * i), SamplingParams(max_tokens=7, beam_width=3),
                          arrival_time=float(i)) for i in range(3)]
    outs, _ = drain(s)
    assert s.num_preemptions > 0 and any(m == mode for o in outs for _, m in o.preempted)
    for r in reqs:
        assert r.outputs() == reference_beam_search(r.request_id, r.prompt_token_ids, 3, 7)
    assert s.block_manager.num_free_gpu_blocks == 14


def test_beam_search_frees_dropped_beams_at_once():
    s = make(num_gpu_blocks=100)
    req = s.add_request(0, prompt(9), SamplingParams(max_tokens=6, beam_width=4))
    held = []
    while s.has_unfinished_requests():
        step(s)
        held.append(len(s.block_manager.seq_ids()))
        assert len(req.unfinished_seqs) in (0, 4)
    assert max(held) == 4 and held[-1] == 0


def test_abort_frees_the_blocks():
    s = make()
    req = s.add_request(0, prompt(9), SamplingParams(max_tokens=30, n=2))
    step(s)
    step(s)
    assert s.abort_request(0) and not s.abort_request(0)
    assert all(q.status == SequenceStatus.FINISHED_ABORTED for q in req.seqs)
    assert s.block_manager.num_free_gpu_blocks == 64 and not s.has_unfinished_requests()
    s.check_invariants()


def test_a_request_too_big_to_grow_alone_stops_with_its_own_reason():
    """Not "abort" (what a client's own abort says) nor "ignored" (it ran): its output is cut
    by the pool, like a length cap, and the detail says so."""
    s = make(num_gpu_blocks=4, max_model_len=64)
    req = s.add_request(0, prompt(10), SamplingParams(max_tokens=40))
    _, finished = drain(s)
    assert finished == [req] and req.seqs[0].status == SequenceStatus.FINISHED_LENGTH_CAPPED
    assert req.finish_reason == "length" and req.finish_detail.startswith("cannot grow")
    assert len(req.seqs[0].output_token_ids) == 7
    assert s.block_manager.num_free_gpu_blocks == 4


def test_generation_stops_at_max_model_len():
    s = make(max_model_len=12)
    req = s.add_request(0, prompt(10), SamplingParams(max_tokens=50))
    drain(s)
    assert len(req.seqs[0].output_token_ids) == 2
    assert req.seqs[0].status == SequenceStatus.FINISHED_LENGTH_CAPPED


def test_timestamps_for_ttft():
    s = make(max_num_batched_tokens=8)
    req = s.add_request(0, prompt(20), SamplingParams(max_tokens=3), arrival_time=0.0)
    drain(s)
    assert req.first_scheduled_time == 0.0 and req.first_token_time == 2.0
    assert req.finished_time == 4.0


def test_a_parallel_sampling_prompt_reserves_its_future_sequences():
    s = make(max_num_seqs=3)
    a = s.add_request(0, prompt(5), SamplingParams(max_tokens=3))
    b = s.add_request(1, prompt(5, 20), SamplingParams(max_tokens=2, n=3))
    out, _ = step(s)                 # a's prefill takes 1 slot: b's 3 samples would not fit
    assert [e.request for e in out.scheduled] == [a]
    outs, _ = drain(s)
    first_b = next(i for i, o in enumerate(outs) if any(e.request is b for e in o.scheduled))
    assert all(e.request is not a for o in outs[first_b:] for e in o.scheduled)
    assert all(len(o.scheduled) <= 3 for o in outs)
    assert b.outputs() == [expected_tokens(prompt(5, 20), 1, i, 2) for i in range(3)]


def test_abort_a_swapped_and_a_waiting_request():
    s, reqs, out = _fill_and_grow(mode="swap", num_cpu_blocks=8)
    assert out.preempted == [(2, "swap")] and s.block_manager.num_free_cpu_blocks == 5
    late = s.add_request(9, prompt(5), SamplingParams(max_tokens=2), arrival_time=9.0)
    assert s.abort_request(2) and s.abort_request(9)
    assert s.block_manager.num_free_cpu_blocks == 8 and late not in s.waiting
    assert reqs[2].finish_reason == "abort" and reqs[2].finish_detail == "aborted by the user"
    s.check_invariants()
    drain(s)
    assert s.block_manager.num_free_gpu_blocks == 9


def test_a_stop_token_finishes_the_sample_that_draws_it_and_frees_its_blocks():
    s = make(num_gpu_blocks=64)
    params = SamplingParams(max_tokens=50, n=2)
    s.add_request(0, prompt(9), params)
    step(s)                                       # prefill: the prompt forks into 2 samples
    req = s.running[0]
    first, second = req.seqs
    stop_token = expected_tokens(req.prompt_token_ids, 0, first.index, 2)[-1]  # `first`'s next
    assert stop_token != expected_tokens(req.prompt_token_ids, 0, second.index, 2)[-1]
    req.sampling_params = SamplingParams(max_tokens=50, n=2, stop_token_ids=(stop_token,))
    free_before = s.block_manager.num_free_gpu_blocks
    step(s)
    assert first.status == SequenceStatus.FINISHED_STOPPED
    assert first.output_token_ids[-1] == stop_token            # the stop token is kept
    assert not s.block_manager.has_seq(first.seq_id)           # and its blocks are released
    assert second.status == SequenceStatus.RUNNING and req in s.running
    assert s.block_manager.num_free_gpu_blocks > free_before - 1
    _, finished = drain(s)
    assert finished == [req] and req.finish_reason in ("stop", "length")
    assert s.block_manager.num_free_gpu_blocks == 64


def test_stop_token_ids_must_be_token_ids():
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(-1,))


def test_output_processor_needs_only_the_block_manager_ids_and_max_model_len():
    """apply_samples takes explicit arguments, no scheduler: the prompt forks into n samples
    that share its blocks, each named by ``new_seq_id``, and a sample stops at max_model_len."""
    from course_lib.memory.v0.manager import BlockManager
    from course_lib.scheduler.output import ScheduledSeq
    from course_lib.scheduler.output_processor import apply_samples
    from course_lib.sequence import Request, Sequence

    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    req = Request(0, prompt(6), SamplingParams(max_tokens=5, n=3))
    seq = Sequence(10, req.prompt_token_ids, status=SequenceStatus.RUNNING)
    req.seqs.append(seq)
    bm.allocate(10, seq.token_ids)
    seq.num_computed_tokens = 6
    ids = iter([20, 21])
    entry = ScheduledSeq(req, seq, 6, True, 3, tuple(bm.get_block_table(10)))
    apply_samples(req, [entry], {10: [(7, -1.0), (8, -2.0), (9, -3.0)]}, bm,
                  lambda: next(ids), max_model_len=7)
    assert [s.seq_id for s in req.seqs] == [10, 20, 21]
    assert [s.output_token_ids for s in req.seqs] == [[7], [8], [9]]
    assert all(s.status == SequenceStatus.FINISHED_LENGTH_CAPPED for s in req.seqs)  # 7 tokens
    assert req.finish_reason == "length" and bm.seq_ids() == []
    bm.check_invariants()
    with pytest.raises(ValueError, match="needs 3 sampled candidates, got 1"):
        req2 = Request(1, prompt(2), SamplingParams(n=3))
        req2.seqs.append(Sequence(30, req2.prompt_token_ids, status=SequenceStatus.RUNNING))
        bm.allocate(30, req2.seqs[0].token_ids)
        apply_samples(req2, [ScheduledSeq(req2, req2.seqs[0], 2, True, 3, ())], {30: [(1, 0.0)]},
                      bm, lambda: 31, max_model_len=64)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=5, n=3),
                                    SamplingParams(max_tokens=5, beam_width=3),
                                    SamplingParams(max_tokens=5)])
def test_scheduler_asks_num_candidates_and_counts_the_tokens_it_keeps(params):
    """Every sampling entry carries what SamplingParams.num_candidates rules; the scheduler's
    generated-token counter equals the tokens in the finished outputs (dropped beams' excluded)
    and its prompt-token counter the prefill tokens scheduled."""
    s = make(block_size=4, num_gpu_blocks=64)
    req = s.add_request(0, prompt(9), params)
    outs, _ = drain(s)
    for out in outs:
        for e in out.scheduled:
            if e.num_candidates:
                assert e.num_candidates == params.num_candidates(first_token=e.is_prefill)
    assert s.num_generated_tokens == sum(len(t) for t in req.outputs()) == 5 * params.num_seqs
    assert s.num_prompt_tokens == sum(o.num_prefill_tokens for o in outs) == 9


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=12, beam_width=2),
                                    SamplingParams(max_tokens=12, n=2)])
def test_a_group_preempted_by_recompute_comes_back_sharing_its_prefix(params):
    """The issue's repro: a 60-token prompt with 2 beams (or 2 samples) fits 24 blocks of 4
    alone; with a small request ahead of it, it is preempted by recompute mid-generation and
    must be re-admitted counting its shared prompt blocks once (15 + 2 x 3 = 21 <= 24, not
    2 x 18 = 36), then finish with the tokens of a run without the neighbour."""
    alone = make(block_size=4, num_gpu_blocks=24)
    ref = alone.add_request(1, prompt(60), params)
    drain(alone)
    s = make(block_size=4, num_gpu_blocks=24)
    small = s.add_request(0, prompt(6, 500), SamplingParams(max_tokens=40), arrival_time=0.0)
    req = s.add_request(1, prompt(60), params, arrival_time=1.0)
    outs, finished = drain(s)
    assert req.num_preemptions > 0, "the scenario must preempt the group"
    assert req.finish_reason == "length" and req.finish_detail is None
    assert all(q.status == SequenceStatus.FINISHED_LENGTH_CAPPED for q in req.seqs)
    assert req.outputs() == ref.outputs() and small.finish_reason == "length"
    # while re-admitted, the samples shared the prompt's blocks (never 2 x 15 prompt blocks)
    assert max(o.num_prefill_tokens for o in outs) <= 60 + 11 + 24


@pytest.mark.parametrize("field, bad", [
    ("num_gpu_blocks", 0), ("num_gpu_blocks", -1), ("num_gpu_blocks", "16"),
    ("num_gpu_blocks", 16.0), ("num_gpu_blocks", True), ("num_gpu_blocks", None),
    ("num_cpu_blocks", -1), ("num_cpu_blocks", 4.0), ("num_cpu_blocks", None),
    ("watermark", 1.0), ("watermark", -0.1), ("watermark", math.nan), ("watermark", "0.01"),
    ("watermark", True),
    ("enable_prefix_caching", "no"), ("enable_prefix_caching", None),
    ("enable_prefix_caching", 1),
    ("kv_offloading_size", math.inf)])
def test_cache_config_refuses_a_bad_field_where_it_is_written(field, bad):
    """Each was accepted by ``CacheConfig`` and failed later (in whichever block manager read
    it), or never: ``enable_prefix_caching="no"`` is truthy and turned caching on."""
    with pytest.raises(ValueError, match=rf"^{field} (must|is)"):
        CacheConfig(**{field: bad})


@pytest.mark.parametrize("bad", [None, "no", 0, 1.0])
def test_scheduler_config_refuses_a_switch_that_is_not_a_bool(bad):
    with pytest.raises(ValueError, match=rf"enable_chunked_prefill must be True or False, "
                                         rf"got {re.escape(repr(bad))}"):
        SchedulerConfig(enable_chunked_prefill=bad)


@pytest.mark.parametrize("cls", ["Scheduler", "SchedulerV1"])
def test_a_dict_for_a_config_is_refused_not_read_as_the_defaults(cls):
    """``{}`` is falsy: ``config or SchedulerConfig()`` silently ran the defaults."""
    from course_lib.scheduler.v1 import SchedulerV1
    make = {"Scheduler": Scheduler, "SchedulerV1": SchedulerV1}[cls]
    with pytest.raises(ValueError, match="scheduler_config must be None or a SchedulerConfig"):
        make({})
    with pytest.raises(ValueError, match="cache_config must be None or a CacheConfig"):
        make(None, {"num_gpu_blocks": 8})
