"""Chapter 02: the exercise checkers and the fragmentation drawings."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.figure import Figure

from course_lib.exercises import ch02
from course_lib.sim import static as ss
from course_lib.sim.traces import sharegpt_like
from course_lib.viz import fragmentation as vf

pytestmark = pytest.mark.ch02


def not_attempted(*_):
    raise NotImplementedError


def test_checkers_pass_the_library_and_fail_wrong_answers():
    assert ch02.check_split_memory(ch02.split_memory).ok
    assert ch02.check_failing_events(lambda n: [("alloc", 1), ("alloc", n - 1), ("free", 0),
                                                ("free", 1), ("alloc", n)]).ok

    def counts_free_as_external_whenever_someone_waits(residents, holes, head_need):
        out = ch02.split_memory(residents, holes, None)
        if head_need is not None:
            out["external"], out["free"] = sum(holes), 0
        return out

    verdict = ch02.check_split_memory(counts_free_as_external_whenever_someone_waits)
    assert not verdict.ok and "external = " in verdict.first_problem
    assert "fits in no single hole" in verdict.first_problem


def test_split_memory_edge_cases_are_tried():
    cases = ch02.split_cases()
    assert ([], [], 1) in cases                               # no memory, someone waits
    assert any(h is not None and h == max(holes, default=0) for _, holes, h in cases)
    assert any(h is None for _, _, h in cases)
    assert ch02.split_memory([], [], 1)["external"] == 0
    assert ch02.split_memory([(8, 2, 5)], [3, 4], 4) == {
        "token_states": 2, "reserved": 3, "internal": 3, "external": 0, "free": 7}
    with pytest.raises(ValueError, match="tokens_now <= final_len <= held"):
        ch02.split_memory([(4, 2, 5)], [], None)


def test_2_2_the_broken_allocator_breaks_only_where_a_left_merge_is_missing():
    """The shown allocator agrees with the library's first fit until a freed range should
    have merged with the hole before it; the checker says why an invalid sequence is one."""
    from course_lib.sim.static import ContiguousAllocator

    broken, right = ch02.RightMergeFirstFit(8), ContiguousAllocator(8)
    for size in (2, 2, 2):
        assert broken.allocate(size) == right.allocate(size)
    broken.free(4, 2)               # the hole after it: merged
    right.free(4)
    broken.free(2, 2)               # the hole after it again: merged
    right.free(2)
    assert broken.holes == right.holes == [(2, 6)]
    broken.free(0, 2)
    right.free(0)
    assert broken.holes == right.holes == [(0, 8)]
    assert ch02.failing_break(8, [("alloc", 2), ("alloc", 2), ("free", 0), ("free", 1),
                                  ("alloc", 4)]) == (4, 2, 0)
    verdict = ch02.check_failing_events(lambda n: [("alloc", 1), ("free", 0), ("free", 0)])
    assert "was freed already" in verdict.first_problem
    verdict = ch02.check_failing_events(lambda n: [("alloc", 0)])
    assert "size >= 1" in verdict.first_problem


def test_not_attempted_exercises_say_so():
    for checker in (ch02.check_split_memory, ch02.check_failing_events):
        verdict = checker(not_attempted)
        assert not verdict.attempted and "not attempted yet" in str(verdict)


def test_request_segments_split_a_reservation():
    segs = vf.request_segments(100, 1024, 300, 256, "A")
    assert segs == [vf.Segment(100, 256, "token_states", "A"),
                    vf.Segment(356, 44, "reserved"), vf.Segment(400, 724, "internal")]
    assert vf.request_segments(0, 8, 8, 8) == [vf.Segment(0, 8, "token_states")]
    with pytest.raises(ValueError, match="states <= final_len <= reserved"):
        vf.request_segments(0, 8, 9, 1)


def test_allocator_segments_mark_holes_external_only_when_blocked():
    alloc = ss.ContiguousAllocator(10)
    a, b, c = alloc.allocate(3), alloc.allocate(4), alloc.allocate(2)
    alloc.free(b)
    info = {a: ("A", 3, 2), c: ("C", 2, 2)}
    blocked = vf.allocator_segments(alloc, info, next_request_size=5)
    assert [(s.category, s.length) for s in blocked if s.category in ("external", "free")] == \
        [("external", 4), ("external", 1)]
    fits = vf.allocator_segments(alloc, info, next_request_size=4)
    assert {s.category for s in fits} == {"token_states", "reserved", "free"}
    assert sum(s.length for s in fits) == 10


def test_drawings_draw_what_they_are_given():
    alloc = ss.ContiguousAllocator(10)
    alloc.allocate(3)
    fig = vf.draw_strip(vf.allocator_segments(alloc, {0: ("A", 3, 1)}, 8), 10, "toy",
                        block_size=2)
    ax = fig.axes[0]
    patches = [p for p in ax.patches if p.get_width() > 0]
    assert sorted(p.get_width() for p in patches) == [1, 2, 7]   # states, reserved, hole
    assert ax.get_title() == "toy" and ax.get_xlim() == (0, 10)
    with pytest.raises(ValueError, match="segments cover"):
        vf.draw_strip([vf.Segment(0, 11, "free")], 10)

    trace = sharegpt_like(40, seed=1)
    tls = [ss.simulate_static(trace, 4096, "max"), ss.simulate_paged(trace, 256, 16)]
    area = vf.draw_breakdown_area(tls[0])
    stacks = area.axes[0].collections
    assert len(stacks) == 5
    bars = vf.draw_breakdown_bars(tls, paper_token_states={"Orca-Max": 20.4})
    labels = [t.get_text() for t in bars.axes[0].get_yticklabels()]
    assert labels == ["Orca-Max", "paged (vLLM)"]
    widths = [p.get_width() for p in bars.axes[0].patches]
    assert sum(widths) == pytest.approx(200.0)                      # two bars of 100%
    sizes = vf.draw_batch_sizes(tls)
    lines = sizes.axes[0].get_lines()
    assert [len(line.get_ydata()) for line in lines] == [len(t.batch_size) for t in tls]
    assert np.array_equal(lines[1].get_ydata(), tls[1].batch_size)
    assert all(isinstance(f, Figure) for f in (fig, area, bars, sizes))


def test_paged_segments_follow_the_block_tables():
    from course_lib.memory.v0.manager import BlockManager

    bm = BlockManager(4, 6, watermark=0.0)
    bm.allocate(0, [1] * 6)            # 2 blocks: 4 + 2 filled
    bm.allocate(1, [2] * 3)            # 1 block: 3 filled
    segs = vf.paged_segments(bm, {0: "A", 1: "B"})
    assert sum(s.length for s in segs) == 24
    filled = sum(s.length for s in segs if s.category == "token_states")
    empty = sum(s.length for s in segs if s.category == "internal")
    assert (filled, empty) == (9, 3)
    assert sorted(s.label for s in segs if s.label) == ["A", "B"]   # once per sequence
    assert sum(s.length for s in segs if s.category == "free") == 12
