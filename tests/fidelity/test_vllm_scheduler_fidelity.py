"""vLLM 0.33.0's V1 ``Scheduler`` (``vllm/v1/core/sched/scheduler.py``, over its own
``KVCacheManager``, ``Request`` and request queues) beside the course's ``SchedulerV1``, under
one scripted KV connector, step by step on random traces (tests/fidelity/scheduler_twins.py):
synchronous and asynchronous loads, loads failed from their first block or a later one, aborts
while loading, ``None`` ("ask again") answers, whole-prompt answers, tight pools (preemption),
a binding ``max_num_seqs``. Compared after every operation: the requests scheduled and their
tokens, preemptions, finished requests, the queues (running, waiting, waiting for remote K/V,
with statuses), computed tokens, block tables, free blocks and every connector call.

What stays different is declared (test_scheduler_declared_differences.py), and the random
traces keep away from exactly those cases: no synchronous whole-prompt answer, no one-token
prompt, vLLM's second ``update_state_after_alloc`` for a loaded request set aside, and an
aborted load's blocks kept until it reports done on both sides.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from harness import run_lockstep
from scheduler_twins import CourseTwin, RealTwin, random_trace

CHUNKS, PER_CHUNK = 5, 500              # 2,500 traces, a few milliseconds each
CASES = ("async load", "sync load", "failed from its first block", "failed from a later block",
         "aborted while loading", "None answer", "whole-prompt answer", "preemption",
         "max_num_seqs binding", "loading beyond max_num_seqs")


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_traces_step_by_step(vllm_scheduler, chunk):
    """Each chunk of traces identical step by step; and not vacuous: each case the issue names
    occurred in it, several times."""
    seen: Counter = Counter()
    for seed in range(chunk * PER_CHUNK, (chunk + 1) * PER_CHUNK):
        trace = random_trace(random.Random(seed))
        course, real = CourseTwin(trace), RealTwin(trace, vllm_scheduler)
        run_lockstep(f"trace {seed}", trace.ops, course, real)
        seen.update(course.worker.seen)
    assert all(seen[case] >= 5 for case in CASES), seen
