"""The block drawings and the step explorers are readable at 100% zoom and fit a notebook.

What a reader sees: a PNG saved at ``dpi`` shows a ``pt``-point font as ``pt * dpi / 72`` image
pixels; shown unscaled (an image no wider than the output area) that is ``pt * dpi / 96`` CSS
points. ``shown_font_pt`` computes it, scaling down when the image is wider than the area.
"""

from __future__ import annotations

import io

import pytest
from matplotlib.figure import Figure
from PIL import Image

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.memory.v0.manager import BlockManager
from course_lib.sim.replay import replay
from course_lib.sim.traces import sharegpt_like
from course_lib.viz import timeline
from course_lib.viz.block_views import pool_view, view_from_tables
from course_lib.viz.blocks import _short, draw_pool_and_tables, layout
from course_lib.viz.explorer import BlockTableExplorer, PrefixCacheExplorer, chat_prompts
from course_lib.viz.readable import (
    EXPLORER_DPI,
    MAX_WIDTH_IN,
    MIN_FONT_PT,
    figure_texts,
    shown_font_pt,
    text_width_in,
)

NOTEBOOK_PX = 900          # a JupyterLab output area at 100% zoom is about 900-1000 px wide


def png_width(png: bytes) -> int:
    return Image.open(io.BytesIO(png)).size[0]


def test_the_detector_trips_on_small_or_scaled_down_text():
    fig = Figure(figsize=(8, 3))
    fig.text(0.5, 0.5, "#3", fontsize=5.5)
    assert shown_font_pt(fig, 90) == pytest.approx(5.5 * 90 / 96)         # the old explorers
    wide = Figure(figsize=(14, 3))
    wide.text(0.5, 0.5, "#3", fontsize=10)
    assert shown_font_pt(wide, 90) == pytest.approx(10 * 90 / 96 * NOTEBOOK_PX / (14 * 90))
    assert shown_font_pt(wide, 90) < MIN_FONT_PT
    empty_text = Figure(figsize=(8, 3))
    empty_text.text(0.5, 0.5, "  ", fontsize=2)
    empty_text.text(0.5, 0.5, "ok", fontsize=10)
    assert [t.get_text() for t in figure_texts(empty_text)] == ["ok"]


@pytest.mark.ch03
def test_block_table_explorer_is_readable_at_every_step():
    e = BlockTableExplorer()
    assert e.dpi == EXPLORER_DPI
    for k in range(e.step.max + 1):
        e.set_step(k)
        fig = draw_pool_and_tables(e.manager, title=f"step {k}", ncols=5, labels=e.run.labels())
        assert shown_font_pt(fig, e.dpi, NOTEBOOK_PX) >= MIN_FONT_PT
        assert png_width(bytes(e.image.value)) <= NOTEBOOK_PX + 2


@pytest.mark.ch06
def test_prefix_cache_explorer_is_readable_with_every_prompt_running():
    e = PrefixCacheExplorer()
    e.keep.value = True
    for name in chat_prompts():                  # the longest labels, all tables at once
        e.prompt.value = name
        e.submit()
    running = {sid: e.session.names[sid] for sid in e.session.running}
    fig = draw_pool_and_tables(e.manager, ncols=8, labels=running, show_tokens=True)
    assert len(running) >= 3
    assert shown_font_pt(fig, e.dpi, NOTEBOOK_PX) >= MIN_FONT_PT
    assert png_width(bytes(e.image.value)) <= NOTEBOOK_PX + 2
    while e.session.running:                      # finished: cached blocks show LRU ranks
        e.finish_button.click()
    texts = [t.get_text() for t in figure_texts(
        draw_pool_and_tables(e.manager, ncols=8, show_tokens=True))]
    assert any(t.startswith("LRU ") for t in texts)


@pytest.mark.ch06
def test_long_tables_wrap_and_wide_pools_stack_below_the_tables():
    tables = {"Req A": list(range(15)), "Req B": list(range(12)) + [15, 16, 17]}
    view = view_from_tables(20, tables, block_size=16)
    lay = layout(view, ncols=10)
    assert lay.stacked and lay.width <= MAX_WIDTH_IN
    assert lay.table_cols < 15 and lay.table_rows == 4            # each table on two rows
    fig = draw_pool_and_tables(view, ncols=10, title="a title " * 20)
    assert fig.get_figwidth() <= MAX_WIDTH_IN
    assert shown_font_pt(fig, 100, NOTEBOOK_PX) >= MIN_FONT_PT     # the inline backend's dpi
    assert len(fig.axes[0].patches) == 30 and len(fig.axes[1].patches) == 20
    small = layout(view_from_tables(10, {"A": [0, 1, 2]}, block_size=4), ncols=5)
    assert not small.stacked                                      # side by side when it fits


def test_token_ids_are_shortened_to_fit_their_cell():
    assert _short((1, 2, 3, 4), 0.85) == "1 2 3 4"
    long = _short((12345, 12346, 12347, 12348), 0.85)
    assert long.endswith("…") and text_width_in(long, 9.5) <= 0.85
    m = BlockManager(block_size=4, num_gpu_blocks=4, watermark=0.0)
    m.allocate(0, [100000, 100001, 100002, 100003])
    assert pool_view(m).blocks[0].tokens == (100000, 100001, 100002, 100003)
    fig = draw_pool_and_tables(m, show_tokens=True)
    assert any(t.get_text().endswith("…") for t in fig.axes[1].texts)


@pytest.mark.ch07
def test_timeline_explorer_is_readable_and_fits():
    small = replay(sharegpt_like(16, seed=2, max_total_len=256),
                   SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
                   CacheConfig(block_size=16, num_gpu_blocks=30), record_batches=True)
    e = timeline.TimelineExplorer(small.steps, window=40)
    assert png_width(bytes(e.image.value)) <= NOTEBOOK_PX + 2
    fig = timeline.draw_timeline(small.steps, 0, 0, 40)
    assert shown_font_pt(fig, EXPLORER_DPI, NOTEBOOK_PX) >= MIN_FONT_PT
    numbers = [t for t in fig.axes[0].texts if t.get_text().isdigit()]
    assert numbers                                  # 40 steps: prefill token counts fit
    crowded = timeline.draw_timeline(small.steps, 0, 0, 120)
    assert shown_font_pt(crowded, EXPLORER_DPI, NOTEBOOK_PX) >= MIN_FONT_PT
    assert not [t for t in crowded.axes[0].texts if t.get_text().isdigit()]


@pytest.mark.ch08
def test_capacity_explorer_is_readable():
    from course_lib.viz.capacity_explorer import CapacityExplorer, draw_explorer_state

    e = CapacityExplorer()
    assert png_width(bytes(e.image.value)) <= NOTEBOOK_PX
    assert shown_font_pt(draw_explorer_state(e.state), EXPLORER_DPI, NOTEBOOK_PX) >= MIN_FONT_PT
    e.preset.value = "llama-3-70b"                   # does not fit one 80 GiB GPU
    assert shown_font_pt(draw_explorer_state(e.state), EXPLORER_DPI, NOTEBOOK_PX) >= MIN_FONT_PT


@pytest.mark.ch09
def test_strategy_explorer_is_readable():
    from course_lib.viz.parallel import StrategyExplorer, draw_plan

    e = StrategyExplorer(model="deepseek-v3", num_gpus=8, tp=1, cp=4, context_len=2_000_000)
    assert png_width(e.png) <= NOTEBOOK_PX
    fig = draw_plan(e.plan, e.context.value, "your plan: ")
    assert shown_font_pt(fig, EXPLORER_DPI, NOTEBOOK_PX) >= MIN_FONT_PT


@pytest.mark.ch12
def test_design_explorer_is_readable():
    from course_lib.viz.designs import DesignExplorer, compare_designs, draw_designs

    e = DesignExplorer(num_requests=10)
    assert png_width(bytes(e.image.value)) <= NOTEBOOK_PX
    fig = draw_designs(compare_designs(10, 2, 600, True))
    assert shown_font_pt(fig, EXPLORER_DPI, NOTEBOOK_PX) >= MIN_FONT_PT


@pytest.mark.parametrize("call, message", [
    (lambda c, e: c(num_requests=0), "num_requests must be an integer >= 1"),
    (lambda c, e: c(num_requests=5, n=0), "n must be an integer >= 1, got 0"),
    (lambda c, e: e(num_requests=0), "num_requests must be an integer >= 1"),
])
def test_design_comparison_refuses_an_empty_trace(call, message):
    from course_lib.viz.designs import DesignExplorer, compare_designs

    with pytest.raises(ValueError, match=message):
        call(compare_designs, DesignExplorer)
