"""The block-manager drawings: what pool_view reports, and that drawings follow the state."""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from course_lib.memory.v0.manager import BlockManager
from course_lib.viz.block_views import CACHED, FREE, HELD, SHARED, pool_view, view_from_tables
from course_lib.viz.blocks import draw_pool_and_tables, draw_static_vs_paged
from course_lib.viz.readable import figure_png

pytestmark = pytest.mark.ch03


def cow_manager() -> BlockManager:
    """The Block Manager tutorial's §11.2 after the write: A [0,1,2,3,5], B [0,1,2,3,4]."""
    m = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    m.allocate(0, list(range(18)))
    m.fork(0, 1)
    m.append_slots(0, [99])
    return m


def test_pool_view_reports_states_ref_counts_owners_and_fill():
    view = pool_view(cow_manager(), labels={0: "A", 1: "B"})
    assert view.tables == {"A": [0, 1, 2, 3, 5], "B": [0, 1, 2, 3, 4]}
    assert view.num_tokens == {"A": 19, "B": 18}
    states = [b.state for b in view.blocks]
    assert states == [SHARED] * 4 + [HELD, HELD, FREE, FREE]
    assert [b.ref_count for b in view.blocks] == [2, 2, 2, 2, 1, 1, 0, 0]
    assert view.blocks[0].owners == ("A", "B")
    assert view.blocks[5].owners == ("A",) and view.blocks[5].tokens == (16, 17, 99)
    assert view.blocks[4].num_filled == 2 and view.blocks[5].num_filled == 3
    assert view.color_of("A") != view.color_of("B")


def test_pool_view_shows_cached_blocks_with_their_lru_rank():
    m = BlockManager(block_size=4, num_gpu_blocks=6, watermark=0.0, enable_prefix_caching=True)
    m.allocate(0, list(range(9)))
    m.mark_blocks_as_computed(0, 9)
    m.free(0)                                   # blocks 0, 1 cached (tail first), 2 free
    view = pool_view(m)
    assert view.tables == {}
    assert [b.state for b in view.blocks[:3]] == [CACHED, CACHED, FREE]
    assert view.blocks[1].lru_rank == 0 and view.blocks[0].lru_rank == 1
    assert view.blocks[0].tokens == (0, 1, 2, 3)


def test_view_from_tables_counts_entries_and_rejects_bad_ids():
    view = view_from_tables(12, {"A": [0, 4, 8], "B": [1, 3, 9], "C": [2, 7]}, block_size=16,
                            num_tokens={"A": 40})
    assert [b.state for b in view.blocks].count(FREE) == 4
    assert view.blocks[8].num_filled == 8 and view.blocks[9].num_filled == 16
    shared = view_from_tables(4, {"x": [0, 1], "y": [0]})
    assert shared.blocks[0].state == SHARED and shared.blocks[0].ref_count == 2
    with pytest.raises(ValueError, match="block 12"):
        view_from_tables(12, {"A": [12]})


def _face_colors(fig: Figure) -> list:
    return [p.get_facecolor() for ax in fig.axes for p in ax.patches if isinstance(p, Rectangle)]


def test_drawing_has_a_cell_per_block_and_entry_and_follows_state():
    m = cow_manager()
    fig = draw_pool_and_tables(m, arrows=True, show_tokens=True)
    table_ax, pool_ax = fig.axes
    assert len(pool_ax.patches) == m.num_gpu_blocks
    assert len(table_ax.patches) == 10                    # 5 entries in each of 2 tables
    before = figure_png(fig, 80)
    m.free(0)
    after = figure_png(draw_pool_and_tables(m, arrows=True, show_tokens=True), 80)
    assert before[:8] == b"\x89PNG\r\n\x1a\n" and before != after
    assert figure_png(draw_pool_and_tables(m, arrows=True, show_tokens=True), 80) == after


def test_static_vs_paged_draws_the_seed_picture_and_checks_input():
    view = view_from_tables(12, {"A": [0, 4, 8], "B": [1, 3, 9], "C": [2, 7]})
    fig = draw_static_vs_paged([256, 512, 128], 1024, view)
    assert "896 of 3072 used (29.2%)" in fig.axes[0].get_title()
    assert "L2→#9" in fig.axes[1].get_title()
    with pytest.raises(ValueError, match="more than the 1024 reserved"):
        draw_static_vs_paged([2000], 1024, view)
    with pytest.raises(ValueError, match="label per request"):
        draw_static_vs_paged([1, 2], 1024, view, labels=("A",))


def test_empty_manager_draws():
    fig = draw_pool_and_tables(BlockManager(block_size=4, num_gpu_blocks=3))
    assert len(fig.axes[1].patches) == 3
    assert _face_colors(fig)


def _three_level(**change):
    from course_lib.viz.attention import draw_three_level_mapping

    args = dict(block_table=[3, 1], seq_len=6, block_size=4, num_blocks=8)
    return draw_three_level_mapping(**(args | change))


def _tradeoff(**change):
    from course_lib.viz.attention import plot_block_size_tradeoff

    args = dict(block_sizes=[8, 16], waste_fraction=[0.1, 0.2], time_per_step=[1.0, 2.0],
                backend="cpu")
    return plot_block_size_tradeoff(**(args | change))


def _programs(**change):
    from course_lib.viz.programs import draw_programs

    return draw_programs(**(dict(n=10, block_size=4) | change))


def _tradeoff_rows(**change):
    from course_lib.viz.capacity_planning import block_size_tradeoff

    return block_size_tradeoff(**(dict(lengths=[10], block_sizes=[16]) | change))


def _table_growth(**change):
    from course_lib.viz.serving import TableHistory, draw_table_growth

    return draw_table_growth(TableHistory(), **(dict(block_size=4) | change))


@pytest.mark.parametrize("call, message", [
    (lambda: _three_level(seq_len=0), "seq_len must be an integer >= 1"),
    (lambda: _three_level(block_size=0), "block_size must be an integer >= 1"),
    (lambda: _three_level(ncols=0), "ncols must be an integer >= 1"),
    (lambda: _tradeoff(waste_fraction=[0.1]), "of one length, got 2, 1, 2"),
    (lambda: _tradeoff(block_sizes=[], waste_fraction=[], time_per_step=[]), "non-empty"),
    (lambda: view_from_tables(8, {"A": [0]}, 0), "block_size must be an integer >= 1"),
    (lambda: view_from_tables(8, {"A": [0]}, 4, {"A": 9}), r"num_tokens\['A'\] must be in 0..4"),
    (lambda: view_from_tables(8, {"A": [0]}, 4, {"A": -1}), r"must be in 0..4"),
    (lambda: view_from_tables(8, {"A": [0]}, 4, {"B": 2}), "names 'B', which has no table"),
    (lambda: draw_pool_and_tables(view_from_tables(8, {"A": [0]}, 4), ncols=0),
     "ncols must be an integer >= 1"),
    (lambda: draw_static_vs_paged([-1], 5, view_from_tables(8, {"A": [0]}, 4)),
     "must be in 0..5"),
    (lambda: _programs(n=1000), r"n must be an integer in \[1, 256\]"),
    (lambda: _programs(n=2.5), r"n must be an integer in \[1, 256\]"),
    (lambda: _tradeoff_rows(block_sizes=[]), "at least one block size"),
    (lambda: _tradeoff_rows(lengths=[0]), "at least one length >= 1"),
    (lambda: _table_growth(block_size=0), "block_size must be an integer >= 1"),
])
def test_drawings_reject_bad_arguments_with_a_named_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()
