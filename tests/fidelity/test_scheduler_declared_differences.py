"""Every difference between the course's ``SchedulerV1`` with a KV connector and vLLM 0.33.0's
``Scheduler`` (``vllm/v1/core/sched/scheduler.py``) that the scheduler harness
(test_vllm_scheduler_fidelity.py) leaves standing, each shown on a minimal trace, with why the
course differs. The random traces keep away from exactly these cases (scheduler_twins.py).
The same for the course's CPU tier beside vLLM's offloading connector, scheduler side
(test_vllm_offload_fidelity.py, offload_twins.py): the last four tests.
(docs/design_notes.md lists every test here, as it does test_declared_differences.py's.)"""

from __future__ import annotations

import pytest
from harness import run_lockstep
from offload_twins import CourseOffloadTwin, Names, OffloadTrace, RealOffloadTwin
from scheduler_twins import Answer, CourseTwin, RealTwin, Trace


def trace(prompt_len: int, answer: Answer | list[Answer], ops: list[tuple], *,
          block_size: int = 4, num_blocks: int = 16) -> Trace:
    """One request (id 0), ``prompt_len`` tokens, the connector answering ``answer`` (a list:
    one answer per lookup, the last one kept)."""
    answers = answer if isinstance(answer, list) else [answer]
    return Trace(block_size, num_blocks, 64, 4, {0: list(range(1, prompt_len + 1))},
                 {0: 3}, {0: answers}, ops)


def test_vllm_asserts_on_a_synchronous_whole_prompt_answer(vllm_scheduler):
    """A connector answering the whole prompt, loaded synchronously: vLLM 0.33.0's waiting loop
    asserts ``num_new_tokens > 0`` (its connectors never answer so: NIXL and the offloading
    connector load asynchronously), the course backs off by one token, as vLLM does after an
    asynchronous load (``_update_waiting_for_remote_kv``), and computes the last token for the
    logits: a connector the course's learners write must not crash the engine."""
    t = trace(8, Answer(8, load_async=False), [("add", 0), ("step",)])
    course, real = CourseTwin(t), RealTwin(t, vllm_scheduler)
    course.apply(("add", 0))
    real.apply(("add", 0))
    assert course.apply(("step",))["scheduled"] == [(0, 1)]
    assert course.state()["computed"] == {0: 8}
    with pytest.raises(AssertionError):
        real.apply(("step",))


def test_vllm_tells_the_connector_again_when_a_loaded_request_is_admitted(vllm_scheduler):
    """vLLM calls ``update_state_after_alloc(request, blocks, 0)`` a second time when its waiting
    loop admits a request whose asynchronous load is done (every admission calls it, lookup or
    not); the course calls it once per lookup, so that a connector counts one query per lookup
    (the CPU tier's hit rate, chapter 13's call trace). All else is the same."""
    t = trace(8, Answer(8, load_async=True, delay=1), [("add", 0), ("step",), ("step",)])
    course, real = CourseTwin(t), RealTwin(t, vllm_scheduler)
    run_lockstep("a loaded request admitted", t.ops, course, real)
    assert real.worker.readmissions == [0]
    assert course.worker.readmissions == []


def test_vllm_keeps_an_aborted_loads_blocks_whatever_the_connector_says(vllm_scheduler):
    """A request aborted while its asynchronous load is in flight: vLLM keeps its blocks until
    the worker reports the load done (``finish_requests``: ``delay_free_blocks``), whatever the
    connector's ``request_finished`` answers; the course frees them as ``request_finished``
    says, as for any finished request (its connectors say "keep them" while a load writes
    them: the harness's does, and reports such a load done sending)."""
    ops = [("add", 0), ("step",), ("abort", 0), ("step",), ("step",)]
    t = trace(8, Answer(8, load_async=True, delay=3), ops)
    course, real = CourseTwin(t, keep_aborted_loads=False), RealTwin(t, vllm_scheduler)
    for op in ops[:3]:
        course.apply(op)
        real.apply(op)
    assert course.state()["num_free_blocks"] == 16          # freed at the abort
    assert real.state()["num_free_blocks"] == 14            # kept: the load writes them
    for op in ops[3:]:
        course.apply(op)
        real.apply(op)
    assert real.state()["num_free_blocks"] == 16            # reported done: freed


def test_a_one_token_prompt_loaded_whole_keeps_its_block_in_vllm(vllm_scheduler):
    """A one-token prompt whose connector answers the whole prompt, asynchronously: once loaded,
    both back off by one token, to none computed, and look the request up again (and load it
    again: neither ever computes it while the connector answers so). vLLM keeps the block it
    holds through that lookup (``_update_waiting_for_remote_kv`` frees only after a failed
    load); the course frees it first, as after a load failed from its first block, so that a
    waiting request holds blocks only with tokens computed (``SchedulerV1.check_invariants``)."""
    ops = [("add", 0)] + [("step",)] * 4
    t = trace(1, Answer(1, load_async=True, delay=1), ops)
    course, real = CourseTwin(t), RealTwin(t, vllm_scheduler)
    held = {"course": [], "real": []}
    c_lookup, r_lookup = course.worker.lookup, real.worker.lookup
    blocks = real.s.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks

    def course_lookup(rid, num_tokens, num_computed):
        held["course"].append(len(course.s.kv_cache_manager.req_to_block_ids.get(0, ())))
        return c_lookup(rid, num_tokens, num_computed)

    def real_lookup(rid, num_tokens, num_computed):
        held["real"].append(len(blocks.get("0", ())))
        return r_lookup(rid, num_tokens, num_computed)

    course.worker.lookup, real.worker.lookup = course_lookup, real_lookup
    for op in ops:
        a, b = course.apply(op), real.apply(op)
        if op == ("step",):
            assert a["scheduled"] == b["scheduled"] == []
    assert held["course"] == [0, 0, 0, 0]
    assert held["real"] == [0, 1, 1, 1]


def test_a_failed_load_is_recomputed_vllm_fails_it_by_default(vllm_scheduler):
    """vLLM's default ``kv_load_failure_policy`` is ``"fail"`` (``vllm/config/kv_transfer.py``):
    a request whose load failed finishes with an error. The course always recomputes (vLLM's
    ``"recompute"``, which the harness runs vLLM with): a learner's engine should not lose a
    request to a transfer it can redo."""
    ops = [("add", 0), ("step",), ("step",)]
    t = trace(8, [Answer(8, load_async=True, delay=1, fail=0), Answer(0)], ops)
    course, real = CourseTwin(t), RealTwin(t, vllm_scheduler, kv_load_failure_policy="fail")
    for op in ops[:2]:
        course.apply(op)
        b = real.apply(op)
    assert b["finished"] == [0]
    assert real.s.requests.get("0") is None or real.s.requests["0"].is_finished()
    assert course.apply(("step",))["scheduled"] == [(0, 8)]


def test_a_failed_synchronous_load_is_not_the_schedulers_to_redo(vllm_scheduler):
    """A synchronous load that fails (its blocks named by ``get_block_ids_with_load_errors`` at
    the end of the step that loaded them): vLLM rewinds the running request to the first failed
    block and drops that step's sample (``_handle_invalid_blocks`` over ``running``); the
    course's contract reports failed *asynchronous* loads only
    (``KVConnectorBase_V1.get_block_ids_with_load_errors`` in ``course_lib/engine/
    kv_connector.py``): its synchronous loads are copies inside the step, which do not fail
    alone, so its scheduler redoes only loads that wait (``update_from_kv_xfer_finished``)."""
    ops = [("add", 0), ("step",)]
    t = trace(12, Answer(8, load_async=False, fail=1), ops)
    t.fail_sync_loads = True
    course, real = CourseTwin(t), RealTwin(t, vllm_scheduler)
    for op in ops:
        a, b = course.apply(op), real.apply(op)
    assert a["scheduled"] == b["scheduled"] == [(0, 4)]
    assert course.state()["computed"] == {0: 12}
    assert real.state()["computed"] == {0: 4}          # from the failed block, no sample
    assert len(course.seqs[0].output_token_ids) == 1
    assert real.s.requests["0"].num_output_tokens == 0


# ------------------------------------------------------- the CPU tier (offload_twins.py)
def offload_run(trace: OffloadTrace, vllm_offloading) -> tuple[list[dict], list[dict]]:
    """The trace's states after each operation, the course's tier's and vLLM's."""
    names = Names()
    course = CourseOffloadTwin(trace, names)
    real = RealOffloadTwin(trace, names, vllm_offloading)
    a, b = [], []
    for op in trace.ops:
        course.apply(op)
        real.apply(op)
        a.append(course.state())
        b.append(real.state())
    return a, b


def test_vllm_evicts_a_requests_tail_first(vllm_offloading):
    """A tier of 3 blocks holding request 0's prompt (blocks 0, 1, 2), then request 1 storing
    one block: the course's tier evicts the least recently stored block, the *head* of
    request 0's prefix (0), which leaves 1 and 2 unreachable until 0 comes back (a lookup
    stops at the first block missing); vLLM's evicts its tail (2). vLLM 0.33.0's
    ``LRUCachePolicy`` (``vllm/v1/kv_offload/cpu/policies/lru.py``) ranks a request's blocks
    together, ``(request rank, -position)``, so its tail goes first, and ranks them anew when
    the request finishes (``on_request_finished``). The course keeps the plain LRU order one
    ``OrderedDict`` holds (``CPUBlockPool``'s docstring): one concept a learner reads in a
    page, at the cost of a head evicted before its tail."""
    t = OffloadTrace(2, 16, 3, 64, 4, {0: list(range(1, 8)), 1: list(range(11, 14))},
                     {0: 1, 1: 1}, [("add", 0), ("step",), ("add", 1), ("step",)])
    a, b = offload_run(t, vllm_offloading)
    assert a[:3] == b[:3] and a[1]["stores"] == [0, 1, 2]
    assert a[3]["stores"] == b[3]["stores"] == [3]
    assert (a[3]["evicted"], b[3]["evicted"]) == ([0], [2])


def test_vllm_stores_an_offer_whole_or_not_at_all(vllm_offloading):
    """A tier of 3 blocks, a request of 4 full prompt blocks computed in one step: the course's
    tier stores the first 3 (block by block while it has a block to give: the fourth finds
    every block being written this step); vLLM's stores none, this step or the next (after the
    request finished: it offers it again) (``prepare_store`` answers None when the tier cannot
    take the offer's new blocks all, ``vllm/v1/kv_offload/cpu/manager.py``; ``_build_store_jobs``
    keeps ``next_stored_chunk_idx``, ``offloading/scheduler.py``). The course keeps the simpler
    rule, which keeps the head of a long prompt in a small tier (cpu_offload.py's module
    docstring); with room to spare the two are the same."""
    t = OffloadTrace(2, 16, 3, 64, 4, {0: list(range(1, 10))}, {0: 1},
                     [("add", 0), ("step",), ("step",)])
    a, b = offload_run(t, vllm_offloading)
    assert a[:1] == b[:1]
    assert (a[1]["stores"], b[1]["stores"]) == ([0, 1, 2], [])
    assert b[2]["stores"] == [] and b[2]["held"] == []


def test_vllm_offers_a_finished_requests_blocks_once_more(vllm_offloading):
    """A tier of 2 blocks; two requests of 2 full blocks each, computed and finished in one
    step: request 0's blocks are stored, request 1's offer cannot be (the tier's blocks are
    being written). The next step vLLM offers request 1's blocks once more and stores them
    (``_build_store_jobs`` walks ``finished_req_ids`` too, reading the freed GPU blocks,
    fenced against reuse by ``_block_id_to_pending_jobs``: ``offloading/scheduler.py``); the
    course's tier forgets a sequence's offer when it finishes (``request_finished``): its
    stores read only the blocks of sequences scheduled in the step, so a finished
    sequence's blocks go back to the GPU pool at once. It matters only when a request's last
    offer found the tier full of blocks in flight."""
    t = OffloadTrace(2, 16, 2, 64, 4, {0: list(range(1, 6)), 1: list(range(11, 16))},
                     {0: 1, 1: 1}, [("add", 0), ("add", 1), ("step",), ("step",)])
    a, b = offload_run(t, vllm_offloading)
    assert a[:3] == b[:3] and a[2]["stores"] == [0, 1]
    assert a[3]["stores"] == [] and b[3]["stores"] == [2, 3]
    assert b[3]["evicted"] == [0, 1]


def test_the_course_tier_looks_up_one_token_short(vllm_offloading):
    """A prompt of two full blocks sent again after the GPU pool lost it, its two blocks in
    the tier: vLLM's offloading connector reports both (``_lookup_complete_chunks``:
    ``max_hit_size_tokens = req.num_tokens``) and its scheduler computes the last token again
    (1 token scheduled); the course's tier reports one (at most ``len(seq) - 1`` tokens, as
    vLLM's ``SimpleCPUOffloadScheduler`` in ``vllm/v1/simple_kv_offload/manager.py``) and the
    request computes its last block (4 tokens): cpu_offload.py's module docstring, "one token
    short". The random traces keep prompts off block boundaries (offload_twins.py)."""
    prompt = list(range(1, 9))
    t = OffloadTrace(4, 4, 16, 64, 4, {0: prompt, 1: list(range(21, 37)), 2: prompt},
                     {0: 1, 1: 1, 2: 1},
                     [("add", 0), ("step",), ("add", 1), ("step",), ("add", 2), ("step",),
                      ("step",)])
    a, b = offload_run(t, vllm_offloading)
    assert a[:5] == b[:5] and a[4]["held"] == [0, 1, 2, 3, 4, 5]
    assert (a[5]["lookups"], b[5]["lookups"]) == ([(2, 0, 4)], [(2, 0, 8)])
    assert (a[5]["loads"], b[5]["loads"]) == ([(2, [0])], [(2, [0, 1])])
    assert (a[5]["computed"], b[5]["computed"]) == ({2: 4}, {2: 8})
