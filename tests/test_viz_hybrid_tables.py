"""Chapter 14's widget: each group's block table drawn step by step on the real hybrid
KVCacheManager. What it shows is the manager's state (tables, null entries, the pool); its
door refuses bad sizes before building anything; it is readable and fits a notebook."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from course_lib.sizing.units import cdiv
from course_lib.viz.hybrid_tables import (
    CACHED,
    FREE,
    FREE_CACHED,
    HELD,
    NULL,
    SEQ,
    GrowthRun,
    GrowthScenario,
    HybridTablesExplorer,
    draw_hybrid_tables,
    group_names,
    pool_states,
    table_states,
)
from course_lib.viz.readable import EXPLORER_DPI, MIN_FONT_PT, shown_font_pt

pytestmark = pytest.mark.ch14
NOTEBOOK_PX = 900


def test_every_step_shows_the_managers_tables():
    s = GrowthScenario()
    for k in range(s.num_steps + 1):
        run = GrowthRun(s, k)
        m = run.manager
        m.check_invariants()
        tables = table_states(m, SEQ)
        assert [[b for b, _ in t] for t in tables] == \
            ([list(t) for t in m.get_block_tables(SEQ)] if m.has_seq(SEQ) else [[], []])
        window, full = tables
        if not m.has_seq(SEQ):
            continue
        # the window group: nulls lead, then at most the blocks the window spans
        num_null = sum(state == NULL for _, state in window)
        assert [state for _, state in window[:num_null]] == [NULL] * num_null
        assert num_null * s.block_size <= max(0, run.num_computed - s.sliding_window)
        assert NULL not in [state for _, state in full]
        assert len(window) == len(full) == cdiv(run.num_computed, s.block_size)
        # full blocks are cached; only a partial last block is merely held
        for table in tables:
            for i, (_, state) in enumerate(table):
                full_block = (i + 1) * s.block_size <= run.num_computed
                assert state == NULL or state == (CACHED if full_block else HELD)
        pool = pool_states(m)
        assert pool[0] == NULL and pool.count(NULL) == 1
        held = {b for t in tables for b, st in t if st != NULL}
        assert {i for i, st in enumerate(pool) if st == HELD} == held


def test_the_window_frees_blocks_and_the_full_group_keeps_them():
    s = GrowthScenario()
    last = GrowthRun(s, s.num_steps)
    window, full = table_states(last.manager, SEQ)
    assert sum(st == NULL for _, st in window) >= 3
    assert len({b for b, _ in full}) == len(full)
    # blocks the window freed stay cached in the pool (free, cached): a later prompt may hit
    assert FREE_CACHED in pool_states(last.manager)
    # the earlier request's prefix was a hit: the prompt step computed only the rest
    assert "prefix hit of 12 tokens" in GrowthRun(s, 2).log[0]
    assert group_names(last.manager) == ["group 0: window 6", "group 1: full attention"]


def test_without_a_shared_prefix_the_prompt_is_step_1():
    s = GrowthScenario(shared_prefix=0, num_decode_steps=3)
    assert s.num_steps == 4
    run = GrowthRun(s, 1)
    assert "prefix hit of 0 tokens" in run.log[0]
    assert set(pool_states(run.manager)) <= {NULL, HELD, FREE}


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=3), "block_size"),
    (dict(block_size=0), "block_size"),
    (dict(sliding_window=0), "sliding_window must be an integer >= 1, got 0"),
    (dict(sliding_window=2.5), "sliding_window must be an integer >= 1, got 2.5"),
    (dict(prompt_len=0), "prompt_len must be an integer >= 1, got 0"),
    (dict(num_decode_steps=-1), "num_decode_steps must be an integer >= 0, got -1"),
    (dict(shared_prefix=15), r"shared_prefix must be in \[0, prompt_len=14\], got 15"),
    (dict(num_decode_steps=60), r"need 19 blocks of 4; the drawing holds tables of 1..16"),
    (dict(num_gpu_blocks=10), r"num_gpu_blocks must be in \[13, 48\].*got 10"),
    (dict(num_gpu_blocks=49), r"num_gpu_blocks must be in \[13, 48\].*got 49"),
    (dict(num_gpu_blocks=True), "num_gpu_blocks must be an integer >= 1, got True"),
])
def test_the_door_refuses_bad_sizes(kwargs, message):
    base = dict(num_decode_steps=10) | kwargs
    with pytest.raises(ValueError, match=message):
        GrowthScenario(**base)


def test_a_step_out_of_range_is_refused():
    s = GrowthScenario()
    with pytest.raises(ValueError, match=rf"step must be in \[0, {s.num_steps}\], got -1"):
        GrowthRun(s, -1)
    e = HybridTablesExplorer(GrowthScenario(num_decode_steps=2))
    with pytest.raises(ValueError, match=r"step must be in \[0, 4\], got 5"):
        e.set_step(5)


def test_the_explorer_redraws_on_each_step_and_its_buttons_move_it():
    e = HybridTablesExplorer(GrowthScenario(num_decode_steps=4))
    seen = {bytes(e.image.value)}
    e.next_button.click()
    assert e.step.value == 1
    for k in range(2, e.step.max + 1):
        e.set_step(k)
        seen.add(bytes(e.image.value))
        assert f"<b>step {k}</b>" in e.caption.value
    assert len(seen) == e.step.max
    e.prev_button.click()
    assert e.step.value == e.step.max - 1
    e.manager.check_invariants()


def test_the_drawing_is_readable_and_fits_at_every_step():
    e = HybridTablesExplorer(GrowthScenario(block_size=1, sliding_window=3, prompt_len=6,
                                            num_decode_steps=10, shared_prefix=4,
                                            num_gpu_blocks=48))
    for k in range(e.step.max + 1):
        e.set_step(k)
        fig = draw_hybrid_tables(e.manager, SEQ, title=f"step {k}")
        assert shown_font_pt(fig, EXPLORER_DPI, NOTEBOOK_PX) >= MIN_FONT_PT
        assert Image.open(io.BytesIO(bytes(e.image.value))).size[0] <= NOTEBOOK_PX
    # every pool block is drawn, one cell each, besides the tables' cells and the legend
    cells = [p for p in fig.axes[0].patches]
    tables = table_states(e.manager, SEQ)
    assert len(cells) == e.manager.num_gpu_blocks + sum(len(t) for t in tables)
    assert FREE in pool_states(e.manager)
