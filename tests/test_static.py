"""Static reservation baselines and paging: first-fit, the memory breakdown, FCFS admission."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from course_lib.sim import static as ss
from course_lib.sim.traces import TraceRequest, sharegpt_like
from course_lib.sizing.units import next_power_of_two

pytestmark = pytest.mark.ch02


def reqs(*pairs: tuple[int, int], times: list[float] | None = None) -> list[TraceRequest]:
    times = times or [0.0] * len(pairs)
    return [TraceRequest(i, t, tuple(range(1, p + 1)), o)
            for i, ((p, o), t) in enumerate(zip(pairs, times, strict=True))]


def test_first_fit_on_a_hand_example():
    a = ss.ContiguousAllocator(10)
    assert [a.allocate(3), a.allocate(4), a.allocate(2)] == [0, 3, 7]
    a.free(3)
    assert a.holes == [(3, 4), (9, 1)]
    assert a.free_slots == 5 and a.largest_hole == 4
    assert a.allocate(5) is None            # 5 slots free, but not in one piece
    assert a.allocate(1) == 3               # first fit (best fit would take slot 9)
    a.free(0)
    assert a.holes == [(0, 3), (4, 3), (9, 1)]
    a.free(3)
    assert a.holes == [(0, 7), (9, 1)]      # merged with both neighbours
    assert a.regions() == [(0, 7, True), (7, 2, False), (9, 1, True)]
    a.check_invariants()
    a.free(7)
    assert a.holes == [(0, 10)] and a.allocated == {}
    with pytest.raises(ValueError, match="no allocation starts at slot 7"):
        a.free(7)


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12)), max_size=60))
def test_first_fit_random_ops_keep_invariants(ops):
    a, live = ss.ContiguousAllocator(64), []
    for do_free, size in ops:
        if do_free and live:
            a.free(live.pop(size % len(live)))
        else:
            want = next((s for s, n in a.holes if n >= size), None)
            got = a.allocate(size)
            assert got == want
            if got is not None:
                live.append(got)
        a.check_invariants()
        assert a.free_slots == 64 - sum(a.allocated.values())


def test_reservation_policies():
    assert [next_power_of_two(n) for n in (1, 2, 3, 4, 5, 1000, 1024, 1025)] == \
        [1, 2, 4, 4, 8, 1024, 1024, 2048]
    assert next_power_of_two(np.int64(300)) == 512               # a trace's numpy lengths
    for bad in (0, -4, 2.0, True):
        with pytest.raises(ValueError, match="n must be an int >= 1"):
            next_power_of_two(bad)
    assert ss.reservation("max", 300) == 2048
    assert ss.reservation("pow2", 300) == 512
    assert ss.reservation("pow2", 1500, max_model_len=1800) == 1800
    assert ss.reservation("oracle", 300) == 300
    with pytest.raises(ValueError, match="policy must be one of"):
        ss.reservation("best", 10)
    with pytest.raises(ValueError, match="final_len must be in"):
        ss.reservation("max", 3000)


def test_static_breakdown_on_a_hand_example():
    # 10 slots, max_model_len 4: A (2+2) at 0, B (1+1) at 4; C (3+1) waits for a 4-slot hole
    tl = ss.simulate_static(reqs((2, 2), (1, 1), (3, 1)), 10, "max", max_model_len=4)
    rows = np.stack([tl.token_states, tl.reserved, tl.internal, tl.external, tl.free,
                     tl.batch_size, tl.waiting], axis=1).tolist()
    assert rows == [[3, 3, 2, 2, 0, 2, 1],    # C blocked: the 2 free slots are external
                    [5, 1, 2, 2, 0, 2, 1],    # B done at the end of this step
                    [7, 1, 0, 0, 2, 2, 0],    # C takes B's slots merged with the tail
                    [4, 0, 0, 0, 6, 1, 0]]
    assert tl.admitted == [0, 1, 2]
    tl.check_invariants()


def test_every_system_conserves_memory_and_admits_fcfs():
    trace = sharegpt_like(150, seed=3, rate=20.0)
    total = 4096
    for policy in ss.POLICIES:
        tl = ss.simulate_static(trace, total, policy, step_time_s=0.05)
        tl.check_invariants()
        assert tl.admitted == [r.request_id for r in trace]
        assert (tl.batch_size > 0).any()
        if policy == "max":
            assert tl.batch_size.max() <= total // 2048
        if policy == "oracle":
            assert (tl.internal == 0).all()
        else:
            assert tl.internal.max() > 0
    paged = ss.simulate_paged(trace, total // 16, 16, step_time_s=0.05)
    paged.check_invariants()
    assert paged.admitted == [r.request_id for r in trace]
    assert (paged.external == 0).all()


def test_paging_wastes_less_than_a_block_per_request():
    trace = sharegpt_like(200, seed=5)
    for bs in (1, 8, 16, 64):
        tl = ss.simulate_paged(trace, 16384 // bs, bs)
        tl.check_invariants()
        waste = tl.reserved + tl.internal          # empty slots of held blocks
        assert (waste <= tl.batch_size * (bs - 1)).all()
        if bs == 1:
            assert (waste == 0).all()


def test_paging_holds_more_requests_than_orca_max():
    trace = sharegpt_like(300, seed=0)
    orca = ss.simulate_static(trace, 8192, "max")
    paged = ss.simulate_paged(trace, 8192 // 16, 16)
    assert orca.mean_batch_size() == pytest.approx(4.0)      # 8192 // 2048, always full
    assert paged.mean_batch_size() > 3 * orca.mean_batch_size()
    assert paged.fractions()["token_states"] > 2 * orca.fractions()["token_states"]
    assert sum(orca.fractions().values()) == pytest.approx(1.0)


def test_tiny_paged_pool_preempts_and_still_finishes_everything():
    trace = reqs((30, 40), (20, 50), (10, 60), (5, 70), (40, 20))
    tl = ss.simulate_paged(trace, 10, 16, watermark=0.0, check_every_step=True)  # 160 slots
    tl.check_invariants()
    assert tl.preemptions > 0 and tl.rejected == 0
    assert sorted(tl.admitted) == list(range(5))
    assert tl.batch_size[-1] == 1 and (tl.waiting[-1] == 0)


def test_requests_that_never_fit_are_rejected_not_looped():
    trace = reqs((100, 100), (10, 10))
    tl = ss.simulate_static(trace, 150, "oracle")
    assert tl.rejected == 1 and tl.admitted == [1]
    tl = ss.simulate_paged(trace, 10, 16, watermark=0.0)
    assert tl.rejected == 1 and tl.admitted == [1]


@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 60), st.floats(0, 5)),
                min_size=1, max_size=25),
       st.integers(130, 600), st.sampled_from(ss.POLICIES + ("paged",)))
def test_random_traces_conserve_and_finish(spec, total, system):
    times = sorted(t for _, _, t in spec)
    trace = reqs(*[(p, o) for p, o, _ in spec], times=times)
    if system == "paged":
        tl = ss.simulate_paged(trace, total // 8, 8, step_time_s=0.1, check_every_step=True)
    else:
        tl = ss.simulate_static(trace, total, system, max_model_len=128, step_time_s=0.1)
    tl.check_invariants()
    assert sorted(tl.admitted) == list(range(len(trace)))
    assert tl.batch_size[-1] >= 1 and tl.waiting[-1] == 0


def test_paper_budget_is_about_12_gib():
    from course_lib.claims import paper as claims

    b = claims.paper_kv_budget()
    assert 11 < b.available_kv_bytes / 2**30 < 13
    assert b.num_gpu_tokens == b.num_gpu_blocks * 16
    assert claims.OPT_13B.attention_type == "MHA"


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_slots must be"):
        ss.ContiguousAllocator(0)
    with pytest.raises(ValueError, match="policy must be one of"):
        ss.simulate_static(reqs((1, 1)), 10, "fifo")
    with pytest.raises(ValueError, match="step_time_s must be"):
        ss.simulate_static(reqs((1, 1)), 10, "max", step_time_s=0.0)


def test_reservation_larger_than_memory_is_rejected():
    tl = ss.simulate_static(reqs((10, 10), (5, 5)), 1000, "max", max_model_len=2048)
    assert tl.rejected == 2 and tl.admitted == []


def test_claim_rows_report_the_simulated_values():
    from course_lib.claims import paper as claims

    runs = claims.run_systems(sharegpt_like(200, seed=2), 8192)
    assert [t.system for t in runs] == ["Orca-Max", "Orca-Pow2", "Orca-Oracle", "paged (vLLM)"]
    rows = claims.comparison_rows(runs)
    paged_pct = f"{100 * runs[3].fractions()['token_states']:.1f}%"
    assert rows[1].ours == paged_pct and rows[1].published == "96.3%"
    lo = min(t.fractions()["token_states"] for t in runs[:3])
    assert rows[0].ours.startswith(f"{100 * lo:.1f}%-")
    assert f"{runs[0].mean_batch_size():.1f} vs {runs[3].mean_batch_size():.1f}" == rows[2].ours
    text = claims.format_rows(rows)
    assert text.splitlines()[0].startswith("source") and len(text.splitlines()) == len(rows) + 2


def test_an_empty_trace_has_no_steps_to_average():
    tl = ss.simulate_static([], 10, "max")
    tl.check_invariants()
    assert len(tl.batch_size) == 0
    with pytest.raises(ValueError, match="the trace was empty"):
        tl.fractions()
