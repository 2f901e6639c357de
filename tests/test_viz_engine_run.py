"""Chapter 11's run figure: the log follows the engine, the drawing follows the log."""

from __future__ import annotations

import pytest

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.engine.llm_engine import LLMEngine
from course_lib.engine.workloads import model_trace, run_trace
from course_lib.model.loader import load_tiny_model
from course_lib.sequence import SamplingParams
from course_lib.viz.engine_run import PREEMPT, RunLog, draw_run
from course_lib.viz.readable import MAX_WIDTH_IN, MIN_FONT_PT, shown_font_pt

pytestmark = pytest.mark.ch11


@pytest.fixture(scope="module")
def tight_run():
    """Eight requests, two samples each, in a pool of 12 blocks: the run must preempt."""
    engine = LLMEngine(load_tiny_model(),
                       SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512,
                                       max_model_len=256),
                       CacheConfig(block_size=16, num_gpu_blocks=12), stop_token_ids=())
    log = RunLog()
    run = run_trace(engine, model_trace("alpaca", 8, seed=3),
                    params=SamplingParams(temperature=0.8, seed=0, n=2), on_step=log)
    return engine, run, log


def test_the_log_has_a_sample_per_step_and_counts_what_the_engine_counts(tight_run):
    engine, run, log = tight_run
    assert len(log.samples) == run.num_steps
    assert [s.step for s in log.samples] == list(range(run.num_steps))
    assert log.num_gpu_blocks == 12
    assert log.num_preemptions == run.num_preemptions == engine.scheduler.num_preemptions > 0
    assert all(0 <= s.held_blocks <= 12 for s in log.samples)
    assert max(s.held_blocks for s in log.samples) > 0
    assert log.samples[-1].running == log.samples[-1].waiting == 0
    assert sum(s.prefill_tokens + s.decode_tokens for s in log.samples) \
        >= engine.num_generated_tokens


def test_the_drawing_marks_every_preempting_step(tight_run):
    _, run, log = tight_run
    fig = draw_run(log)
    assert fig.get_figwidth() <= MAX_WIDTH_IN
    assert shown_font_pt(fig, 100) >= MIN_FONT_PT
    blocks_ax, queues_ax = fig.axes
    marks = [line for line in blocks_ax.get_lines() if line.get_color() == PREEMPT]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == log.preemption_steps()
    red = [line for line in queues_ax.get_lines() if line.get_color() == PREEMPT]
    assert len(red) == len(log.preemption_steps())
    assert f"{run.num_preemptions} preemptions" in fig.texts[0].get_text()


def test_an_empty_log_is_refused():
    with pytest.raises(ValueError, match="empty"):
        draw_run(RunLog())
