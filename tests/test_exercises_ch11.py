"""Chapter 11's capstone checkers: an order-of-operations mistake fails and says where.

The generic checks (solution passes, stubs, wrong and do-nothing answers fail) are in
``tests/test_exercises.py``; here, what each failure says, and that the workloads really
contain the steps where the order matters.
"""

from __future__ import annotations

import re

import pytest
import torch

from course_lib.exercises import capstone_checks as checks
from course_lib.exercises import ch11
from course_lib.exercises.ch11_serving import TokenTimes, check_serving_metrics
from course_lib.exercises.solutions import ch11 as solutions

pytestmark = pytest.mark.ch11
torch.set_num_threads(1)
SWAP_IN_FIRST, COPIES_FIRST, KEYS_ONLY = checks.WRONG_CACHE_OPS


@pytest.fixture(scope="module")
def model():
    return ch11.tiny_model()


def test_swap_in_before_swap_out_fails_and_names_the_order(model):
    v = ch11.check_cache_ops(SWAP_IN_FIRST, model)
    assert not v.ok
    assert "swap out [(2, 0)], swap in [(1, 2)]" in v.first_problem
    assert "swap-in, then swap-out" in v.first_problem


def test_copies_before_swaps_fail_at_the_step_where_tokens_diverge(model):
    v = ch11.check_cache_ops(COPIES_FIRST, model)
    assert not v.ok
    m = re.search(r"workload \d \(.*\), step \d+: request \d, sample \d: token \d+ is",
                  v.first_problem)
    assert m, v.first_problem
    assert "this step swapped in" in v.first_problem and "copied" in v.first_problem
    assert "copies" in v.first_problem.split("on a small cache:")[1]


def test_the_workloads_contain_steps_where_the_order_matters(model):
    """A copy of a block swapped in the same step: copies first must change the tokens."""
    runs = checks.compare_runs("x", model, ch11, cache_ops=COPIES_FIRST)
    assert runs.passed < len(ch11.WORKLOADS)


def test_a_forgotten_value_cache_is_named(model):
    v = ch11.check_cache_ops(KEYS_ONLY, model)
    assert "values" in v.first_problem and "step" in v.first_problem


def test_append_mistakes_name_the_step_the_state_and_the_rule(model):
    """Each mistake is named at the append that made it, with the statement's rule."""
    no_cow, leak, full = checks.WRONG_APPENDS
    problem = ch11.check_append_slots(no_cow, model).first_problem
    assert "step 1: appending 1 token(s) to sequence 0" in problem
    assert "its last block 6 partial, held by 3 table(s)" in problem
    assert "the rule broken: a partial shared last block is replaced by a fresh one" in problem
    assert "the rule broken: drop one reference to the old block" in \
        ch11.check_append_slots(leak, model).first_problem
    assert "the rule broken: only a partial last block is copied" in \
        ch11.check_append_slots(full, model).first_problem


def test_a_broken_invariant_is_told_in_words(model):
    """An append that passes the per-call rules but breaks the manager's bookkeeping (here:
    it takes a fresh block from the pool that no table holds) is named with what the
    invariant means, not a bare assertion."""
    def leaks_a_block(bm, seq_id, token_ids):
        copies = solutions.append_slots(bm, seq_id, token_ids)
        if len(bm.get_table(seq_id).token_ids) == 9:
            bm.gpu.allocate()                               # held by no table
        return copies

    problem = ch11.check_append_slots(leaks_a_block, model).first_problem
    assert "the block manager's invariants fail after it" in problem
    assert "a block's reference count is the number of tables that hold it" in problem


def test_the_capstone_passes_with_both_solutions_and_fails_with_either_wrong(model):
    assert ch11.check_capstone(solutions.append_slots, solutions.cache_ops, model).ok
    assert not ch11.check_capstone(checks.WRONG_APPENDS[0], solutions.cache_ops, model).ok
    assert not ch11.check_capstone(solutions.append_slots, COPIES_FIRST, model).ok
    stub = ch11.check_capstone(lambda *a: (_ for _ in ()).throw(NotImplementedError),
                               solutions.cache_ops, model)
    assert "not attempted yet" in str(stub)


def test_tags_say_where_a_block_came_from():
    assert checks._origin(1000 + 100 + 3) == "GPU block 3's old contents"
    assert checks._origin(100 + 50 + 2) == "CPU block 2's old contents"


# ------------------------------------------------------------------ 11.3 serving metrics
def test_the_reference_agrees_with_the_courses_histograms_on_a_simulated_run():
    from course_lib.exercises import ch11_serving as serving

    records, metrics = serving.replayed_records(16, 40.0, 24, seed=2)
    want = serving.serving_metrics(records, 99)
    for name, hist in (("ttft", "vllm:time_to_first_token_seconds"),
                       ("tpot", "vllm:request_time_per_output_token_seconds"),
                       ("itl", "vllm:inter_token_latency_seconds"),
                       ("e2el", "vllm:e2e_request_latency_seconds")):
        mean = 1000 * metrics.value(f"{hist}_sum") / metrics.value(f"{hist}_count")
        assert want[name][0] == pytest.approx(mean, rel=1e-9), name
    assert len(records) == 16 and metrics.value("vllm:num_preemptions_total") > 0


def test_token_times_records_a_real_engine_run(model):
    from course_lib.config import CacheConfig, SchedulerConfig
    from course_lib.engine.llm_engine import LLMEngine
    from course_lib.sequence import SamplingParams

    ticks = iter(range(10_000))
    engine = LLMEngine(model, SchedulerConfig(max_model_len=256),
                       CacheConfig(block_size=16, num_gpu_blocks=32), stop_token_ids=(),
                       clock=lambda: 0.5 * next(ticks))
    times = TokenTimes(engine.metrics)
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4, temperature=0.0))
    records = times.records()
    assert [len(t) for _, t in records] == [4, 4]
    for (sent, t), out in zip(records, outs, strict=True):
        assert t[0] - sent == pytest.approx(out.ttft) and t[-1] - sent == pytest.approx(
            out.latency)


def test_serving_metrics_mistakes_name_the_definition():
    from course_lib.exercises import ch11_serving as serving

    tpot, rank, itl = serving.WRONG
    assert "averaged over the requests with more than one token" in \
        check_serving_metrics(tpot).first_problem
    assert "interpolates linearly" in check_serving_metrics(rank).first_problem
    assert "all requests' gaps in one list" in check_serving_metrics(itl).first_problem

    def seconds(records, p):
        return {k: (m / 1000, q / 1000) for k, (m, q) in
                solutions.serving_metrics(records, p).items()}

    assert "milliseconds" in check_serving_metrics(seconds).first_problem
    assert check_serving_metrics(solutions.serving_metrics).ok
