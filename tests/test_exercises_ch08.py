"""Chapter 08's exercise 8.1 (the smallest tensor-parallel size for a load): its cases need
TP sizes that are not powers of two, whole blocks per request, and sizes that never fit."""

from __future__ import annotations

import pytest

from course_lib.exercises import ch08
from course_lib.exercises.ch08_requests import (
    _average_request,
    _last_token_cached,
    _mix_tokens_not_blocks,
    _reserve_final_size,
    check_max_num_requests,
    reference_max_num_requests,
    request_cases,
)

pytestmark = pytest.mark.ch08


def test_answers_cover_every_regime():
    answers = [ch08.raises_as_value(ch08.reference_smallest_tp)(*c) for c in ch08.tp_cases()]
    assert ch08.RAISES in answers and 1 in answers
    assert any(a not in (ch08.RAISES, 1, 2, 4, 8, 16, 32, 64) for a in answers)   # e.g. 3 or 6


@pytest.mark.parametrize("wrong, case", [
    ("_powers_of_two", "(40, 24, 6, 128, 20000000000, 24, 8192, 40)"),
    ("_tokens_not_blocks", "(32, 32, 8, 128, 8030261248, 24, 17, 2500)"),
    ("_weights_not_split", "returned 'raises ValueError', the library returns 2"),
])
def test_wrong_searches_fail_on_the_case_made_for_them(wrong, case):
    v = ch08.check_smallest_tp(getattr(ch08, wrong))
    assert not v.ok and case in v.first_problem


# ---------------------------------------------------------------- 8.3: a mix of lengths

def runs_together(num_gpu_blocks: int, block_size: int, mix: list[tuple[int, int]]) -> bool:
    """The V0 scheduler admits every request of ``mix`` in step 0 and runs them all to the end
    without a preemption."""
    from course_lib.config import CacheConfig, SchedulerConfig
    from course_lib.scheduler.scheduler import Scheduler
    from course_lib.sequence import SamplingParams
    from course_lib.sim.fake_sampler import fake_samples

    budget = sum(p + o for p, o in mix) + 1
    s = Scheduler(SchedulerConfig(max_num_seqs=len(mix) + 1, max_model_len=budget,
                                  max_num_batched_tokens=budget, enable_chunked_prefill=False),
                  CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                              watermark=0.0))
    for i, (p, o) in enumerate(mix):
        s.add_request(i, tuple(range(1, p + 1)), SamplingParams(max_tokens=o),
                      arrival_time=float(i))
    step = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        if out.preempted or out.ignored or (step == 0 and len(out.scheduled) != len(mix)):
            return False
        s.update(out, fake_samples(out))
        step += 1
    return True


def test_8_3_reference_is_what_the_v0_scheduler_runs_without_preempting():
    cases = [c for c in request_cases(count=12) if c[0] > 0]
    assert len(cases) >= 20
    for pool, bs, mix in cases:
        k = reference_max_num_requests(pool, bs, mix)
        assert runs_together(pool, bs, mix[:k]), (pool, bs, mix, k)
        if k < len(mix):
            assert not runs_together(pool, bs, mix[:k + 1]), (pool, bs, mix, k)


def test_8_3_cases_separate_the_usual_mistakes_from_the_answer():
    answers = [reference_max_num_requests(*c) for c in request_cases()]
    assert 0 in answers and any(a == len(c[2]) > 1 for a, c in
                                zip(answers, request_cases(), strict=True))
    for wrong, words in ((_reserve_final_size, "final size"),
                         (_mix_tokens_not_blocks, "not whole blocks"),
                         (_last_token_cached, "never written to the cache")):
        v = check_max_num_requests(wrong)
        assert not v.ok and words in v.first_problem, (wrong, v)
    assert "step" in check_max_num_requests(_average_request).first_problem
