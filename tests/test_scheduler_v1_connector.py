"""The V1 scheduler with a KV connector, case by case against vLLM 0.33.0's own scheduler
(``Scheduler.schedule`` and its helpers in ``vllm/v1/core/sched/scheduler.py``): a scripted
connector (no model, no tensors) answers each lookup as a test says, and records every call.

* ``request_finished`` is asked exactly once for every finished sequence, whether it holds
  blocks or not (vLLM's ``_free_request`` calls ``_connector_finished`` for every finished
  request): a decode request aborted before it was admitted tells its prefill engine at once.
* A connector answer covering the whole prompt is taken and backed off by one token: the last
  one is computed again, for the logits (vLLM's ``_update_waiting_for_remote_kv``, after an
  asynchronous load; loaded synchronously, the course backs off the same way).
* Sequences waiting for remote K/V do not count against ``max_num_seqs`` (vLLM's
  ``kv_holding_waiting`` is a waiting queue); a loaded sequence comes back through the waiting
  loop, after the running ones, and is admitted only if it fits (``_handle_blocked_waiting_
  request``); a ``None`` lookup skips that sequence alone (``skip_request``); a load that
  failed from its first block frees its blocks and looks the sequence up again; an
  asynchronous load is admitted only if it leaves the prefills in flight the blocks they still
  need (``_inflight_prefill_reserved_blocks``).

Each case fails on the scheduler before issue 34 (it is named in each test).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_budget import examples

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.scheduler.kv_connector import KVConnectorScheduler
from course_lib.scheduler.output import KVConnectorMetadata
from course_lib.scheduler.v1 import SchedulerV1
from course_lib.sequence import SamplingParams, SequenceStatus
from course_lib.sim.fake_sampler import fake_samples

S = SequenceStatus
BS = 4


class Scripted(KVConnectorScheduler):
    """Answers ``get_num_new_matched_tokens`` from ``answers[seq_id]``: ``(tokens, async)``
    (the tokens it holds from token 0, as NIXL's decode side counts them: it reports those past
    the local hit), ``None`` (ask again), or a list of such answers taken in turn (the last one
    kept); no entry: nothing. Records every call as ``(method, seq_id, ...)``."""

    def __init__(self, answers=None, keep=()):
        super().__init__()
        self.answers = dict(answers or {})
        self.keep = set(keep)                  # seq ids whose blocks request_finished keeps
        self.calls: list[tuple] = []

    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        answer = self.answers.get(seq.seq_id, (0, False))
        if isinstance(answer, list):
            answer = answer.pop(0) if len(answer) > 1 else answer[0]
        self.calls.append(("lookup", seq.seq_id, num_computed_tokens, answer))
        if answer is None:
            return None, False
        tokens = max(0, min(answer[0], len(seq)) - num_computed_tokens)
        return tokens, answer[1] and tokens > 0

    def update_state_after_alloc(self, seq, block_ids, num_external_tokens):
        self.calls.append(("alloc", seq.seq_id, num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, seq, block_ids):
        self.calls.append(("finished", seq.seq_id, len(block_ids)))
        return seq.seq_id in self.keep, None

    def finished(self) -> Counter:
        return Counter(c[1] for c in self.calls if c[0] == "finished")


def make(conn, *, num_gpu_blocks=64, budget=64, max_num_seqs=8):
    return SchedulerV1(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                       max_model_len=256),
                       CacheConfig(BS, num_gpu_blocks, 0, 0.0, True, "hash"), kv_connector=conn)


def prompt(i: int, n: int = 16) -> list[int]:
    return [1000 * (i + 1) + t for t in range(n)]


def step(s: SchedulerV1, recving=(), invalid=()):
    """One scheduler step, the worker side reporting ``recving`` loaded (and ``invalid``
    blocks failed) after it; returns the output."""
    out = s.schedule()
    s.check_invariants()
    s.update(out, fake_samples(out), 0.0)
    s.update_from_kv_xfer_finished(None, set(recving) or None, set(invalid) or None)
    s.check_invariants()
    return out


def scheduled(out) -> dict[int, tuple[int, int]]:
    """seq id -> (computed tokens before the step, tokens scheduled)."""
    return {e.seq.seq_id: (e.seq.num_computed_tokens - e.num_tokens, e.num_tokens)
            for e in out.scheduled}


# ------------------------------------------------------------------ request_finished, once
def test_request_finished_is_asked_once_for_a_sequence_that_holds_no_blocks():
    """Aborted before admission (it never held a block): before issue 34 the connector was
    never told, so a P/D prefill engine kept its blocks until its timeout."""
    conn = Scripted()
    s = make(conn, max_num_seqs=1)
    s.add_request(0, prompt(0), SamplingParams(max_tokens=4))
    s.add_request(1, prompt(1), SamplingParams(max_tokens=4))
    step(s)                                           # 0 runs; 1 waits (max_num_seqs=1)
    assert s.abort_request(1)
    assert conn.finished() == Counter({1: 1})
    assert ("finished", 1, 0) in conn.calls           # no blocks to name
    s.check_invariants()


def test_request_finished_is_asked_once_for_every_finished_sequence_however_it_ends():
    """Finished by its tokens, aborted running, aborted while loading, aborted waiting,
    ignored (it can never fit): one ``request_finished`` each, never two."""
    conn = Scripted({0: (8, True)})
    s = make(conn, num_gpu_blocks=14, max_num_seqs=2)
    s.add_request(0, prompt(0), SamplingParams(max_tokens=4))    # aborted while loading
    s.add_request(1, prompt(1), SamplingParams(max_tokens=2))    # finishes by its tokens
    s.add_request(2, prompt(2), SamplingParams(max_tokens=50))   # aborted running
    s.add_request(3, prompt(3), SamplingParams(max_tokens=4))    # aborted waiting
    s.add_request(4, prompt(4, 60), SamplingParams(max_tokens=4))   # needs 15 of 14 blocks
    step(s)
    assert [q.seq_id for q in s.waiting_for_remote] == [0]
    assert [q.seq_id for q in s.running] == [1, 2]
    for rid in (0, 2, 3):
        assert s.abort_request(rid)
    for _ in range(6):
        step(s)
    assert not s.has_unfinished_requests()
    assert conn.finished() == Counter({i: 1 for i in range(5)})


# ------------------------------------------------------------------ whole-prompt answers
@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_a_whole_prompt_answer_is_taken_and_the_last_token_computed(load_async):
    """The connector answers all 16 tokens (vLLM's NIXL decode side and its offloading
    connector may): the sequence computes token 15 again and samples. Before issue 34: a
    0-token entry that sampled (sync), ``ValueError: num_new_tokens must be >= 1`` (async)."""
    conn = Scripted({0: (16, load_async)})
    s = make(conn)
    s.add_request(0, prompt(0), SamplingParams(max_tokens=3))
    out = step(s, recving={0} if load_async else ())
    if load_async:
        assert not out.scheduled and s.waiting_for_remote
        out = step(s)
    assert scheduled(out) == {0: (15, 1)}
    assert out.scheduled[0].num_candidates == 1           # it samples the first token
    assert ("alloc", 0, 16) in conn.calls                  # the connector loads all 16
    while s.has_unfinished_requests():
        step(s)
    assert s.num_generated_tokens == 3


# ------------------------------------------------------------------ the waiting loop
def test_requests_waiting_for_remote_kv_do_not_count_against_max_num_seqs():
    """Two sequences loading and ``max_num_seqs=2``: a third is admitted beside them (before
    issue 34 the loads took both places); once loaded, one of them runs, the other waits for
    a place."""
    conn = Scripted({0: (8, True), 1: (8, True)})
    s = make(conn, max_num_seqs=2)
    for i in range(3):
        s.add_request(i, prompt(i), SamplingParams(max_tokens=20))
    out = step(s, recving={0, 1})
    assert scheduled(out) == {2: (0, 16)}
    assert [q.seq_id for q in s.waiting_for_remote] == [0, 1]
    out = step(s)
    assert scheduled(out) == {2: (16, 1), 0: (8, 8)}       # 1 loaded, but no place left
    assert [(q.seq_id, q.status) for q in s.waiting_for_remote] == [
        (1, S.WAITING_FOR_REMOTE_KVS)]
    assert s.finished_recving_kv_req_ids == {1}


def test_a_loaded_sequence_is_not_the_next_victim():
    """Loaded, it comes back through the waiting loop, after the running sequences (vLLM's
    ``_handle_blocked_waiting_request``). Before issue 34 it joined the end of ``running`` at
    the start of the step, the first candidate for preemption: a running sequence short of a
    block preempted it and threw its loaded blocks away. Now the running sequence is the
    victim, and the loaded one runs next step on the blocks it holds."""
    conn = Scripted({1: (8, True)})
    s = make(conn, num_gpu_blocks=6)
    s.add_request(0, prompt(0), SamplingParams(max_tokens=20))
    s.add_request(1, prompt(1), SamplingParams(max_tokens=20))
    out = step(s, recving={1})                 # 0: 4 blocks, 1: 2 blocks loading; pool full
    assert scheduled(out) == {0: (0, 16)}
    loaded = list(s.kv_cache_manager.req_to_block_ids[1])
    out = step(s)                              # 0 needs a fifth block: it is preempted
    assert out.preempted == [(0, "recompute")] and not out.scheduled
    assert s.kv_cache_manager.req_to_block_ids[1] == loaded
    out = step(s)
    assert scheduled(out) == {1: (8, 8)}


def test_a_loaded_sequence_waits_when_the_running_ones_take_the_budget():
    """Loaded while a long prompt's chunks take the whole budget: it waits, holding its
    blocks, until the budget has room (before issue 34 it sat in ``running``)."""
    conn = Scripted({0: (8, True)})
    s = make(conn, budget=16)
    s.add_request(0, prompt(0), SamplingParams(max_tokens=2))
    s.add_request(1, prompt(1, 32), SamplingParams(max_tokens=2))
    out = step(s, recving={0})                       # 0 loads; 1's first chunk
    assert scheduled(out) == {1: (0, 16)}
    out = step(s)                                    # 1's second chunk: the budget again
    assert scheduled(out) == {1: (16, 16)}
    assert [q.seq_id for q in s.waiting_for_remote] == [0] and not s.running[1:]
    out = step(s)
    assert scheduled(out) == {1: (32, 1), 0: (8, 8)}


def test_a_none_lookup_skips_that_sequence_alone():
    """``None`` (the connector does not know yet): the sequence keeps its place at the head of
    the queue and the ones behind it are admitted (before issue 34 it stopped them all)."""
    conn = Scripted({0: [None, (0, False)]})
    s = make(conn)
    s.add_request(0, prompt(0), SamplingParams(max_tokens=2))
    s.add_request(1, prompt(1), SamplingParams(max_tokens=2))
    out = step(s)
    assert scheduled(out) == {1: (0, 16)}
    assert [q.seq_id for q in s.waiting] == [0]
    out = step(s)
    assert scheduled(out) == {1: (16, 1), 0: (0, 16)}


def test_a_load_failed_from_its_first_block_looks_the_sequence_up_again():
    """Every block of the load failed: its blocks are freed and it is looked up again, local
    prefix cache and connector (vLLM: ``num_computed_tokens == 0`` after
    ``_update_requests_with_invalid_blocks``); before issue 34 it ran from token 0 on its old
    blocks without a second lookup."""
    conn = Scripted({0: [(8, True), (0, False)]})
    s = make(conn)
    s.add_request(0, prompt(0), SamplingParams(max_tokens=2))
    step(s)
    seq = s.waiting_for_remote[0]
    first = s.kv_cache_manager.req_to_block_ids[0][0]
    s.update_from_kv_xfer_finished(None, {0}, {first})
    assert seq.num_computed_tokens == 0
    out = step(s)
    assert [c for c in conn.calls if c[0] == "lookup"] == [
        ("lookup", 0, 0, (8, True)), ("lookup", 0, 0, (0, False))]
    assert scheduled(out) == {0: (0, 16)}


def test_blocks_are_reserved_for_loads_in_flight():
    """A load waiting for 8 of its 40 tokens holds 2 blocks and still needs 8 to hold its
    sequence: another load that needs 4 of the 12 blocks' 10 free ones is held back, since it
    would leave the first one short (vLLM's ``_inflight_prefill_reserved_blocks``); before
    issue 34 it was admitted. Once the first one's prompt is computed, the second is admitted."""
    conn = Scripted({0: (8, True), 1: (16, True)})
    s = make(conn, num_gpu_blocks=12)
    s.add_request(0, prompt(0, 40), SamplingParams(max_tokens=1))
    s.add_request(1, prompt(1), SamplingParams(max_tokens=1))
    step(s, recving={0})
    assert [q.seq_id for q in s.waiting_for_remote] == [0]
    assert [q.seq_id for q in s.waiting] == [1]
    assert s.inflight_prefills.keys() == {0}
    out = step(s)                          # 0 loaded: its 32 tokens; 1 still held back
    assert scheduled(out) == {0: (8, 32)} and [q.seq_id for q in s.waiting] == [1]
    assert not s.inflight_prefills
    step(s)                                # 0 finished and freed: 1 loads
    assert [q.seq_id for q in s.waiting_for_remote] == [1] and s.inflight_prefills.keys() == {1}


# ------------------------------------------------------------------ random traces
@settings(max_examples=examples(50), deadline=None)
@given(st.data())
def test_random_traces_keep_the_invariants_and_finish_each_sequence_once(data):
    """Random answers (none, sync, async, whole prompt, ``None`` once), loads reported done
    or failed at random, aborts at random, a tight pool and ``max_num_seqs``: every step keeps
    the scheduler's invariants, every request ends, and ``request_finished`` is asked exactly
    once for each sequence."""
    n = data.draw(st.integers(2, 6))
    lens = [data.draw(st.integers(2, 24)) for _ in range(n)]
    answers = {}
    for i, length in enumerate(lens):
        full = data.draw(st.integers(0, length // BS)) * BS
        kind = data.draw(st.sampled_from(["none", "sync", "async", "whole", "ask"]))
        answers[i] = {"none": (0, False), "sync": (min(full, length - 1) // BS * BS, False),
                      "async": (full, full > 0), "whole": (length, data.draw(st.booleans())),
                      "ask": [None, (full, full > 0)]}[kind]
    conn = Scripted(answers)
    s = make(conn, num_gpu_blocks=data.draw(st.integers(8, 16)),
             budget=data.draw(st.integers(4, 32)), max_num_seqs=data.draw(st.integers(1, 4)))
    for i, length in enumerate(lens):
        s.add_request(i, prompt(i, length), SamplingParams(max_tokens=data.draw(
            st.integers(1, 4))))
    for _ in range(400):
        if not s.has_unfinished_requests():
            break
        loading = [q.seq_id for q in s.waiting_for_remote
                   if q.status == S.WAITING_FOR_REMOTE_KVS]
        done = {i for i in loading if data.draw(st.booleans())}
        invalid = set()
        for i in done:
            if data.draw(st.integers(0, 3)) == 0:
                invalid.add(s.kv_cache_manager.req_to_block_ids[i][0])
        if data.draw(st.integers(0, 9)) == 0:
            s.abort_request(data.draw(st.integers(0, n - 1)))
        step(s, done, invalid)
    assert not s.has_unfinished_requests()
    assert conn.finished() == Counter(range(n))
