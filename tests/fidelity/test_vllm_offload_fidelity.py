"""vLLM 0.33.0's offloading connector, scheduler side (``OffloadingConnectorScheduler`` in
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``, over its real
``CPUOffloadingManager`` and ``lru`` policy, under its real ``Scheduler``) beside the course's
CPU tier (``course_lib/engine/cpu_offload.py``, under ``SchedulerV1``), on the same random
requests (tests/fidelity/offload_twins.py): prompts sharing prefixes and sent again, a GPU pool
that evicts, preemptions, aborts. Compared after every operation: scheduling, queues and
computed tokens, every lookup's answer (the hit lengths), the blocks loaded per request, the
blocks stored, the blocks the tier evicted and every block it holds.

* **A tier that holds everything:** identical step by step, every trace.
* **A tier of 8 to 20 blocks** (it evicts): identical up to the first step where
  the two LRU orders pick different victims, or vLLM refuses an offer it cannot store whole,
  or offers it again, after the request finished too (all declared:
  test_scheduler_declared_differences.py; offload_twins.run_tight); the comparison of that
  trace ends there, and nothing else may differ before it.

Kept out of both: a prompt whose length is a multiple of the block size (the course's tier
looks up one token short: declared, ``test_the_course_tier_looks_up_one_token_short``).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from harness import Mismatch, run_lockstep
from offload_twins import (
    EVICTION_ORDER,
    WHOLE_OFFER,
    CourseOffloadTwin,
    Names,
    RealOffloadTwin,
    random_offload_trace,
    run_tight,
)

from course_lib.engine.cpu_offload import CPUOffloadConnector

TRACES = 500                        # per family, ~10 ms each


def test_a_tier_that_holds_everything_step_by_step(vllm_offloading):
    """Identical on every trace; and not vacuous: loads (after a GPU hit too), stores and
    preemptions occurred, many times."""
    seen: Counter = Counter()
    for seed in range(TRACES):
        trace = random_offload_trace(random.Random(seed))
        names = Names()
        course = CourseOffloadTwin(trace, names)
        run_lockstep(f"trace {seed}", trace.ops, course,
                     RealOffloadTwin(trace, names, vllm_offloading))
        seen.update(course.seen)
    assert all(seen[case] >= 20 for case in
               ("loads", "stores", "preemption", "tier hit after a GPU hit")), seen


def test_a_tier_that_evicts_step_by_step(vllm_offloading):
    """Identical up to a declared difference, every trace (run_tight: eviction order, an offer
    stored whole or not at all, a finished request's offer); and not vacuous: many traces ran
    to their end identical, with evictions and loads in them, and the two frequent
    differences occurred (the third is rarer: its own test shows it)."""
    kinds, seen = Counter(), Counter()
    for seed in range(TRACES):
        trace = random_offload_trace(random.Random(10_000 + seed), tight_tier=True)
        names = Names()
        course = CourseOffloadTwin(trace, names)
        kind = run_tight(f"trace {seed}", trace, course,
                         RealOffloadTwin(trace, names, vllm_offloading))
        kinds[kind] += 1
        if kind == "identical":
            seen.update(course.seen)
    assert kinds["identical"] >= TRACES // 4 and kinds[EVICTION_ORDER] and \
        kinds[WHOLE_OFFER], kinds
    assert seen["evicted"] >= 5 and seen["loads"] >= 5, seen


# ---------------------------------------------------------------- the comparison can fail
class StoresDecodeBlocks(CPUOffloadConnector):
    """Blocks of generated tokens stored too, whatever ``offload_prompt_only`` says."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.offload_prompt_only = False


class NeverStoresAGpuHitAgain(CPUOffloadConnector):
    """The offer starts after the GPU hit: a hit prefix the tier lost is never stored again."""

    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        answer = super().get_num_new_matched_tokens(seq, num_computed_tokens)
        self._next_stored[seq.seq_id] = num_computed_tokens // self.block_size
        return answer


class LoadsABlockTwice(CPUOffloadConnector):
    """A block another request is loading this step is loaded again (no "ask again")."""

    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        self._loading = set()
        return super().get_num_new_matched_tokens(seq, num_computed_tokens)


@pytest.mark.parametrize("broken, tight", [(StoresDecodeBlocks, False),
                                           (NeverStoresAGpuHitAgain, True),
                                           (LoadsABlockTwice, False)])
def test_a_broken_tier_is_caught(vllm_offloading, broken, tight):
    """Each broken tier differs from vLLM's on one of the first traces of its family."""
    for seed in range(TRACES):
        trace = random_offload_trace(random.Random(10_000 * tight + seed), tight_tier=tight)
        names = Names()
        course = CourseOffloadTwin(trace, names, connector_cls=broken)
        real = RealOffloadTwin(trace, names, vllm_offloading)
        try:
            if tight:
                run_tight(f"trace {seed}", trace, course, real)
            else:
                run_lockstep(f"trace {seed}", trace.ops, course, real)
        except Mismatch:
            return
    pytest.fail(f"{broken.__name__} was not caught")
