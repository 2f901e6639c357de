"""The helpers chapters 04-06 use to set the source articles' claims beside vLLM's then and now:
kernel grids, block-table costs, sharing savings per width, what triggers copy-on-write, and
prefix caching's effect on time to first token; plus the three prefix-cache behaviours chapter
06 states (the last block is recomputed, a filled block is not merged, counters survive a reset).
"""

from __future__ import annotations

import math

import pytest

from course_lib.engine.workloads import (
    PAPER_SHARING_SAVINGS,
    SharingResult,
    simulated_sharing_savings,
)
from course_lib.exercises import ch05, ch06
from course_lib.kernels import tiles, walkthrough
from course_lib.memory.v0.manager import BlockManager
from course_lib.sequence import SamplingParams
from course_lib.sim.traces import alpaca_like, few_shot, multi_turn_chat


# ------------------------------------------------------------------------------ chapter 04
@pytest.mark.ch04
def test_v0_decode_grid_follows_vllm_063_heuristic():
    v1 = walkthrough.v0_decode_grid(64, 32, 4096)          # 2048 (seq, head) pairs > 512
    assert v1.kernel.endswith("v1") and v1.grid == (32, 64, 1) and v1.programs == 2048
    assert v1.tokens_per_program == 4096
    v2 = walkthrough.v0_decode_grid(1, 32, 32768)          # longer than 8192: always v2
    assert v2.kernel.endswith("v2") and v2.grid == (32, 1, 64) and v2.tokens_per_program == 512
    few = walkthrough.v0_decode_grid(4, 32, 1024)          # 128 pairs, 2 partitions: v2
    assert few.kernel.endswith("v2") and few.grid == (32, 4, 2)
    one = walkthrough.v0_decode_grid(4, 32, 512)           # one partition: v1
    assert one.kernel.endswith("v1") and one.grid == (32, 4, 1)
    assert walkthrough.v0_decode_grid(1000, 32, 8193).kernel.endswith("v2")


@pytest.mark.ch04
def test_course_decode_grid_is_the_kernels_launch():
    for num_seqs, ctx in ((64, 4096), (1, 32768), (3, 100)):
        g = walkthrough.course_decode_grid(num_seqs, 32, 8, 128, ctx)
        t = tiles.decode_tiles(head_dim=128, group=4, max_seq_len=ctx, num_seqs=num_seqs,
                               num_kv_heads=8, interpreted=False)
        assert g.grid == (num_seqs, 8, t.num_splits)
        assert g.query_heads_per_program == 4
        assert g.tokens_per_program * t.num_splits >= ctx
    assert walkthrough.course_decode_grid(1, 32, 8, 128, 32768).programs < \
        walkthrough.v0_decode_grid(1, 32, 32768).programs


@pytest.mark.ch04
def test_block_table_costs_counts_entries_bytes_and_waste():
    rows = walkthrough.block_table_costs([1, 16, 17, 100], [1, 16, 64], kv_bytes_per_token=1000,
                                         max_model_len=128)
    by = {r.block_size: r for r in rows}
    assert by[1].entries == 134 and by[1].waste_fraction == 0
    assert by[16].entries == 1 + 1 + 2 + 7
    assert by[16].table_bytes == 4 * 4 * 8                 # 4 rows x ceil(128 / 16) int32
    assert by[64].entries == 5 and by[64].table_bytes == 4 * 4 * 2
    assert all(r.kv_bytes == 134_000 for r in rows)
    assert by[16].waste_fraction == pytest.approx(1 - 134 / (11 * 16))
    assert by[1].table_to_kv > by[16].table_to_kv > by[64].table_to_kv
    for bad in ([], [0, 3]):
        with pytest.raises(ValueError):
            walkthrough.block_table_costs(bad, [16], 1000, 128)
    with pytest.raises(ValueError, match="max_model_len"):
        walkthrough.block_table_costs([200], [16], 1000, 128)
    with pytest.raises(ValueError, match="block sizes"):
        walkthrough.block_table_costs([20], [0], 1000, 128)


# ------------------------------------------------------------------------------ chapter 05
@pytest.mark.ch05
def test_simulated_sharing_savings_per_width():
    trace = alpaca_like(30, seed=1)
    alone = simulated_sharing_savings(trace, SamplingParams())
    assert alone.saving == 0 and alone.held_block_steps > 0
    samples = [simulated_sharing_savings(trace, SamplingParams(n=w)).saving for w in (2, 4, 6)]
    beams = [simulated_sharing_savings(trace, SamplingParams(beam_width=w)).saving
             for w in (2, 4, 6)]
    assert 0 < samples[0] < samples[1] < samples[2] < 0.5
    assert all(b > s for b, s in zip(beams, samples, strict=True))
    assert sorted(PAPER_SHARING_SAVINGS) == ["beam search", "parallel sampling"]
    assert all(sorted(v) == [2, 4, 6] for v in PAPER_SHARING_SAVINGS.values())
    assert math.isnan(SharingResult(0, 0).saving)
    assert simulated_sharing_savings([], SamplingParams(n=2)).unshared_block_steps == 0


@pytest.mark.ch05
def test_only_forks_copy_on_write():
    short = alpaca_like(12, seed=2)
    fork = ch05.count_cow_copies("fork", short, n=2)
    assert fork.copies > 0 and fork.preemptions == 0
    cached = ch05.count_cow_copies("prefix", few_shot(12, seed=2), enable_prefix_caching=True)
    assert cached.copies == 0 and cached.prefix_hits > 0
    recompute = ch05.count_cow_copies("recompute", short, num_gpu_blocks=12)
    assert recompute.copies == 0 and recompute.preemptions > 0
    rows = ch05.cow_scenarios()
    assert [r.copies > 0 for r in rows] == [True, False, False]
    assert rows[2].preemptions > 0 and rows[1].prefix_hits > 0


# ------------------------------------------------------------------------------ chapter 06
@pytest.mark.ch06
def test_ttft_with_and_without_cache():
    chat = multi_turn_chat(4, 3, seed=0, system_prompt_len=256, user_len=16, output_len=16)
    r = ch06.ttft_with_and_without_cache(chat)
    assert 0.5 < r.hit_rate < 1 and r.ttft_on_s < r.ttft_off_s
    assert r.ttft_cut == pytest.approx(1 - r.ttft_on_s / r.ttft_off_s)
    unshared = ch06.ttft_with_and_without_cache(alpaca_like(5, seed=0))
    assert unshared.hit_rate == 0 and unshared.ttft_cut == pytest.approx(0)


@pytest.mark.ch06
def test_prefix_cache_behaviours_chapter_06_states():
    m = BlockManager(block_size=4, num_gpu_blocks=16, watermark=0.0, enable_prefix_caching=True)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    m.allocate(0, a)
    m.mark_blocks_as_computed(0, 8)
    # a prompt of full blocks only reuses all but its last block
    assert m.allocate(1, a) == 4 and m.get_block_table(1)[0] == m.get_block_table(0)[0]
    # a block that fills up with a cached block's tokens keeps its own id
    m.allocate(2, [1, 2, 3])
    m.mark_blocks_as_computed(2, 3)
    assert m.append_slots(2, [4]) == []
    m.append_slots(2, [5])
    assert m.get_block_table(2)[0] != m.get_block_table(0)[0]
    # the counters are cumulative and survive reset_prefix_cache
    before = m.prefix_cache_stats
    for sid in (0, 1, 2):
        m.free(sid)
    assert m.reset_prefix_cache()
    assert m.prefix_cache_stats == before
    assert m.allocate(3, a) == 0
    assert m.prefix_cache_stats.queries == before.queries + len(a)
