"""Chapter 07's exercise checkers and its timeline widget / drawings."""

from __future__ import annotations

import pytest

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.exercises import ch07
from course_lib.exercises.ch07_schedule import check_schedule_step, schedule_step
from course_lib.exercises.ch07_swap import (
    WRONG,
    check_schedule_running_and_swapped,
    schedule_running_and_swapped,
)
from course_lib.sim.replay import CostModel, preemption_costs, replay
from course_lib.sim.traces import sharegpt_like
from course_lib.viz import timeline

pytestmark = pytest.mark.ch07


def learner_chunks(prompt_len, budget, num_decoding):
    left, out = prompt_len, []
    while left:
        out.append(min(left, budget - num_decoding))
        left -= out[-1]
    return out


def test_prefill_chunks_reference_and_a_learner_version():
    assert ch07.prefill_chunks(50, 16, 0) == [16, 16, 16, 2]
    assert ch07.prefill_chunks(50, 16, 3) == [13, 13, 13, 11]
    assert ch07.check_prefill_chunks(ch07.prefill_chunks).ok
    assert ch07.check_prefill_chunks(learner_chunks).ok
    wrong = ch07.check_prefill_chunks(lambda p, b, d: learner_chunks(p, b, 0))
    assert not wrong.ok and "first difference" in str(wrong)


def test_v0_decode_step_reference_and_a_learner_version():
    state = ([(0, 0.0, 8), (1, 1.0, 8), (2, 2.0, 8)], [], 1, 8, 4, "swap")
    assert schedule_running_and_swapped(*state) == ([0, 1], [(2, "swap")], [])
    assert schedule_running_and_swapped(*state[:5], "recompute") == (
        [0, 1], [(2, "recompute")], [])
    assert schedule_running_and_swapped([(0, 0.0, 5)], [(1, 1.0, 7)], 2, 0, 4, "swap") == (
        [0], [], [1])                                      # 2 blocks, its token fits in them
    assert check_schedule_running_and_swapped(schedule_running_and_swapped).ok
    wrong = check_schedule_running_and_swapped(WRONG[0])
    assert not wrong.ok and "first difference" in str(wrong)


def test_cheaper_preemption():
    assert ch07.cheaper_preemption(1000, 1, 524_288, 1e-4) == "recompute"
    assert ch07.cheaper_preemption(1000, 256, 524_288, 1e-4) == "swap"
    assert ch07.check_cheaper_preemption(ch07.cheaper_preemption).ok
    assert not ch07.check_cheaper_preemption(lambda *a: "recompute").ok


def test_schedule_step_reference_and_not_attempted():
    assert schedule_step([(0, 9, 8), (1, 5, 4)], [(2, 30)], 10, 4, 4, 16) == (
        [(0, 1), (1, 1), (2, 14)], [])                       # decodes, then a chunk
    assert schedule_step([(0, 9, 8), (1, 9, 8), (2, 9, 8)], [(3, 2)], 1, 4, 4, 64) == (
        [(0, 1), (1, 1)], [2])                              # the last one is the victim
    assert schedule_step([(0, 9, 8)], [(1, 1)], 0, 4, 4, 64) == ([], [0])

    def todo(*args):
        raise NotImplementedError  # your code here
    verdict = check_schedule_step(todo)
    assert not verdict.attempted and "not attempted" in str(verdict)


@pytest.fixture(scope="module")
def recorded():
    trace = sharegpt_like(12, seed=2, max_total_len=256)
    return replay(trace, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                         max_model_len=256),
                  CacheConfig(block_size=16, num_gpu_blocks=30), record_batches=True)


def test_describe_step_lists_prefill_decode_and_preemptions(recorded):
    steps = recorded.steps
    text = timeline.describe_step(steps, 0)
    assert steps[0].batch and all(pre for _, _, pre in steps[0].batch)   # all prompts at first
    assert "prefill: " + ", ".join(f"r{r} ({n} tok)" for r, n, _ in steps[0].batch) in text
    dec = next(i for i, s in enumerate(steps) if any(not pre for _, _, pre in s.batch))
    rids = sorted({r for r, _, pre in steps[dec].batch if not pre})
    assert "decode:  " + ", ".join(f"r{r}" for r in rids) in timeline.describe_step(steps, dec)
    pre = next(i for i, s in enumerate(steps) if s.preempted)
    text = timeline.describe_step(steps, pre)
    rid, mode = steps[pre].preempted[0]
    assert f"preempted: r{rid} ({mode})" in text
    with pytest.raises(ValueError, match="step must be in"):
        timeline.describe_step(steps, len(steps))


def test_timeline_widget_slider_moves_the_step_and_redraws(recorded):
    ex = timeline.TimelineExplorer(recorded.steps, window=20)
    first_png, first_text = ex.image.value, ex.text.value
    assert first_png[:4] == b"\x89PNG" and "step 0:" in first_text
    ex.slider.value = 7
    assert ex.step == 7 and "step 7:" in ex.text.value and ex.image.value != first_png
    ex.slider.value = 0
    assert ex.image.value == first_png                  # same state, same drawing
    with pytest.raises(ValueError, match="record_batches"):
        timeline.TimelineExplorer(replay(sharegpt_like(3, seed=0, max_total_len=64)).steps)


def test_draw_timeline_has_a_row_per_request_and_marks_preemptions(recorded):
    fig = timeline.draw_timeline(recorded.steps, current=3, first=0, last=30)
    ax = fig.axes[0]
    rows = {t.get_text() for t in ax.get_yticklabels()}
    assert rows == {f"r{rid}" for s in recorded.steps[:30] for rid, _, _ in s.batch} \
        | {f"r{rid}" for s in recorded.steps[:30] for rid, _ in s.preempted}
    marks = [t.get_text() for t in ax.texts if t.get_text() in ("x", "S")]
    assert len(marks) == sum(len(s.preempted) for s in recorded.steps[:30])
    with pytest.raises(ValueError, match="first"):
        timeline.draw_timeline(recorded.steps, first=5, last=5)


def test_replay_and_preemption_cost_figures(recorded):
    fig = timeline.draw_replay({"a": recorded})
    assert len(fig.axes) == 2 and len(fig.axes[0].lines) == 1
    rows = preemption_costs(CostModel(), [256, 1024], [1, 16, 256])
    assert len(rows) == 6 and rows[0].ratio < 1 < rows[-1].ratio
    fig = timeline.draw_preemption_costs(rows)
    assert len(fig.axes[1].lines) == 2 + 2             # two lengths + the 1.0 and 1.2 lines
