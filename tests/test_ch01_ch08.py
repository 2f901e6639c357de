"""Chapters 01 and 08: exercise checkers, figures, the source-claims table, the capacity
explorer.

Checkers must pass the library's own solution and fail the typical wrong ones; figures must
show one bar or line per input; the explorer must react to its widgets. Expected numbers are
multiplied out here from the models' configs, never read back from the library.
"""

import math

import pytest
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from course_lib import capacity as cap
from course_lib.claims import sources
from course_lib.exercises import ch01, ch08
from course_lib.exercises.ch01_batch import (
    DTYPE_BYTES,
    WRONG_IDEAS,
    batch_cases,
    check_max_batch_size,
    reference_kv_bytes_from_config,
    reference_max_batch_size,
    reference_num_params,
)
from course_lib.exercises.ch08_requests import (
    _mix_tokens_not_blocks,
    _reserve_final_size,
    check_max_num_requests,
    reference_max_num_requests,
)
from course_lib.sizing.models import PRESETS, get_preset
from course_lib.sizing.units import GiB, KiB, MiB
from course_lib.viz import capacity as viz
from course_lib.viz.capacity_explorer import CapacityExplorer, ExplorerState, draw_explorer_state
from course_lib.viz.capacity_planning import (
    BUDGET_PARTS,
    block_size_tradeoff,
    budget_parts,
    draw_block_size_tradeoff,
    draw_memory_budget,
    draw_tp_sweep,
)
from course_lib.viz.claims_table import claims_table

pytestmark = [pytest.mark.ch01, pytest.mark.ch08]


def not_attempted(*args):
    raise NotImplementedError


# ---------------------------------------------------------------- chapter 01 exercises

def test_ch01_references_on_known_models():
    p = PRESETS
    assert reference_kv_bytes_from_config(ch01.config_of(p["llama-3-70b"]), 1) == 327_680
    assert reference_kv_bytes_from_config(ch01.config_of(p["llama-3-70b"]), 16) == \
        80 * 2 * 1 * 128 * 2                                               # one head per rank
    mha = ch01.config_of(p["llama-2-7b"], drop=("num_key_value_heads", "head_dim"))
    assert reference_kv_bytes_from_config(mha, 1) == 524_288          # Llama-2-7B
    v3 = ch01.config_of(p["deepseek-v3"])
    assert reference_kv_bytes_from_config(v3, 8) == 61 * 576 * 2
    llama3_8b = batch_cases()[0][0]
    assert reference_num_params(llama3_8b) == 8_030_261_248
    # (80 GiB - 16,060,522,496 B of weights) // (131,072 B x 2,000 tokens) = 266.4
    assert reference_max_batch_size(llama3_8b, 80, 1000, 1000) == 266


def test_ch01_checkers_pass_the_library_solution():
    for check, ref in ((ch01.check_kv_bytes_from_config, reference_kv_bytes_from_config),
                       (check_max_batch_size, reference_max_batch_size)):
        verdict = check(ref)
        assert verdict.ok and verdict.total >= 7, verdict


def test_ch01_checkers_accept_a_plain_correct_solution():
    def by_matrices(config, gib, prompt_len, output_len):
        h, v, i = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
        q = config["num_attention_heads"] * (config.get("head_dim") or
                                             h // config["num_attention_heads"])
        kv = q // config["num_attention_heads"] * (config.get("num_key_value_heads")
                                                   or config["num_attention_heads"])
        layer = [h * q, h * kv, h * kv, q * h, h * i, h * i, i * h, h, h]
        params = v * h * (1 if config.get("tie_word_embeddings") else 2) + h + \
            config["num_hidden_layers"] * sum(layer)
        free = math.floor(gib * 2**30 + 0.5) - params * DTYPE_BYTES[config["torch_dtype"]]
        per_request = reference_kv_bytes_from_config(config, 1) * (prompt_len + output_len)
        return max(0, free // per_request)

    assert check_max_batch_size(by_matrices).ok


def no_defaults(config, tp):
    """Wrong: reads every key, as if configs were complete."""
    return (config["num_hidden_layers"] * 2 * max(1, config["num_key_value_heads"] // tp)
            * config["head_dim"] * 2)


@pytest.mark.parametrize("check, wrong, why", [
    (ch01.check_kv_bytes_from_config, no_defaults, "MLA read as GQA, keys assumed present"),
    (ch01.check_kv_bytes_from_config, lambda c, tp: 0, "a constant"),
    (check_max_batch_size, WRONG_IDEAS[0][0], "an MLP of two matrices"),
    (check_max_batch_size, WRONG_IDEAS[3][0], "decimal GB"),
    (check_max_batch_size, lambda c, g, p, o: math.ceil(
        reference_max_batch_size(c, g + 1 / 2**30, p, o)), "one byte more"),
])
def test_ch01_checkers_fail_wrong_solutions(check, wrong, why):
    verdict = check(wrong)
    assert verdict.attempted and not verdict.ok, why
    assert "the library returns" in str(verdict)


def test_ch01_missing_keys_are_named():
    def reads_every_key(config, tp):
        if config.get("kv_lora_rank"):
            return reference_kv_bytes_from_config(config, tp)
        heads = max(1, config["num_key_value_heads"] // tp)
        return config["num_hidden_layers"] * 2 * heads * config["head_dim"] * \
            DTYPE_BYTES[config["torch_dtype"]]

    verdict = ch01.check_kv_bytes_from_config(reads_every_key)
    assert "KeyError" in verdict.first_problem and "means MHA" in verdict.first_problem


def test_ch01_not_attempted_and_crashing_solutions():
    assert not ch01.check_kv_bytes_from_config(not_attempted).attempted
    assert "not attempted" in str(check_max_batch_size(not_attempted))
    verdict = check_max_batch_size(lambda *a: 1 // 0)
    assert verdict.passed == 0 and "ZeroDivisionError" in str(verdict)


# ---------------------------------------------------------------- chapter 08 exercises

def test_ch08_references_on_article_cases():
    assert ch08.reference_num_gpu_blocks(80, 0.9, 17.5, 3.5, 655_360) == 83_558
    assert ch08.reference_num_gpu_blocks(80, 0.9, 16, 0, 2 * MiB) == 28_672
    assert ch08.reference_num_gpu_blocks(24, 0.5, 6, 6, MiB) == 0
    with pytest.raises(ValueError):
        ch08.reference_num_gpu_blocks(24, 0.5, 6, 7, MiB)
    assert [ch08.reference_kv_heads_per_rank(8, tp) for tp in (1, 2, 8, 16)] == [8, 4, 1, 1]
    with pytest.raises(ValueError):
        ch08.reference_kv_heads_per_rank(8, 3)
    assert reference_max_num_requests(100, 16, [(20, 1)] * 60) == 50   # 2 blocks each
    # two long requests peak at 3 + 3 blocks in steps 6..9, after the 12-token one has left
    assert reference_max_num_requests(6, 4, [(3, 10), (3, 10), (12, 1)]) == 3
    llama70 = (80, 64, 8, 128, 70_553_706_496)          # 141 GB of 16-bit weights
    assert ch08.reference_smallest_tp(*llama70, 80, 8192, 1) == 2
    with pytest.raises(ValueError):
        ch08.reference_smallest_tp(*llama70, 80, 32_768, 10_000)


def right_kv_heads_per_rank(heads, tp):
    if tp < 1 or (heads % tp if tp <= heads else tp % heads):
        raise ValueError(f"bad tp {tp}")
    return max(1, heads // tp)


def test_ch08_checkers_pass_the_library_and_plain_solutions():
    assert ch08.check_smallest_tp(ch08.reference_smallest_tp).ok
    assert ch08.check_kv_heads_per_rank(ch08.reference_kv_heads_per_rank).ok
    assert ch08.check_kv_heads_per_rank(right_kv_heads_per_rank).ok
    assert check_max_num_requests(reference_max_num_requests).ok


def always_raises(*args):
    raise ValueError("never fits")


@pytest.mark.parametrize("check, wrong, why", [
    (ch08.check_smallest_tp, always_raises, "raises everywhere"),
    (ch08.check_smallest_tp, lambda *a: 1, "always one GPU"),
    (ch08.check_kv_heads_per_rank, lambda h, tp: h // tp, "0 heads beyond num_kv_heads"),
    (ch08.check_kv_heads_per_rank, lambda h, tp: max(1, h // tp), "accepts TP that cannot split"),
    (check_max_num_requests, _mix_tokens_not_blocks, "counts tokens, not blocks"),
    (check_max_num_requests, _reserve_final_size, "reserves the final size"),
])
def test_ch08_checkers_fail_wrong_solutions(check, wrong, why):
    verdict = check(wrong)
    assert verdict.attempted and not verdict.ok, why


def test_ch08_not_attempted():
    for check in (ch08.check_smallest_tp, ch08.check_kv_heads_per_rank,
                  check_max_num_requests):
        assert not check(not_attempted).attempted


# ---------------------------------------------------------------- figures

def bars(ax) -> list[Rectangle]:
    return [p for p in ax.patches if isinstance(p, Rectangle)]


def test_bytes_per_token_chart_has_one_bar_per_model():
    specs = list(PRESETS.values())
    fig = viz.draw_kv_bytes_per_token(specs)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert len(bars(ax)) == len(specs)
    assert [t.get_text() for t in ax.get_xticklabels()] == [s.name for s in specs]
    heights = {s.name: b.get_height() for s, b in zip(specs, bars(ax), strict=True)}
    assert heights["Llama-2-7B"] == 32 * 2 * 32 * 128 * 2 / KiB
    assert heights["DeepSeek-V3"] == 61 * 576 * 2 / KiB
    with pytest.raises(ValueError):
        viz.draw_kv_bytes_per_token([])


def test_projection_chart_counts_quadratic_vs_linear():
    fig = viz.draw_kv_projections(5)
    left, right = fig.axes
    assert len(bars(left)) == 10
    no_cache, cache = right.get_lines()
    assert list(no_cache.get_ydata()) == [1, 3, 6, 10, 15]
    assert list(cache.get_ydata()) == [1, 2, 3, 4, 5]


def test_crossing_point_is_the_first_token_count_above_the_weights():
    for spec in PRESETS.values():
        n = viz.weights_kv_crossing_tokens(spec)
        per_token = spec.num_layers * (
            (spec.kv_lora_rank + spec.qk_rope_head_dim) * spec.dtype_bytes if spec.is_mla
            else 2 * spec.num_kv_heads * spec.head_dim * spec.dtype_bytes)
        assert (n - 1) * per_token <= spec.weight_bytes < n * per_token
    assert viz.weights_kv_crossing_tokens(get_preset("llama-2-7b")) == 25_706
    # 13,476,831,232 B of weights / 524,288 B per token = 25,705.0006: the audit says the same
    ratio = next(c for c in sources.audit() if c.key == "001-ratio")
    assert "From 25,706 tokens on" in ratio.explanation


def test_kv_vs_weights_draws_a_line_and_a_weight_level_per_model():
    specs = [get_preset("llama-2-7b"), get_preset("llama-3-8b")]
    ax = viz.draw_kv_vs_weights(specs, 200_000).axes[0]
    kv_lines = [ln for ln in ax.get_lines() if ln.get_label().endswith("KV cache")]
    assert len(kv_lines) == 2
    texts = [t.get_text() for t in ax.texts]
    assert "25,706 tokens" in texts and "122,533 tokens" in texts  # both cross below 200K


def test_budget_parts_add_up_and_the_chart_stacks_them():
    b = cap.plan_kv_cache(get_preset("llama-3-70b"), 80, gpu_memory_utilization=0.9,
                          tensor_parallel_size=8, weight_gib=17.5, activation_gib=2,
                          overhead_gib=1.5)
    parts = budget_parts(b)
    assert sum(parts.values()) == 80 * GiB
    assert parts["KV blocks"] == 83_558 * 655_360
    assert parts["not used (1 - utilization)"] == 8 * GiB
    assert 0 <= parts["left over"] < 655_360
    ax = draw_memory_budget([("a", b), ("b", b), ("c", b)]).axes[0]
    assert len(bars(ax)) == 3 * len(BUDGET_PARTS)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "c"]


def test_tp_sweep_shrinks_gqa_until_one_head_and_never_mla():
    specs = [get_preset("llama-3-70b"), get_preset("deepseek-v3")]
    gqa, mla = draw_tp_sweep(specs, [1, 2, 4, 8, 16]).axes[0].get_lines()
    assert list(gqa.get_ydata()) == [320, 160, 80, 40, 40]
    assert list(mla.get_ydata()) == [61 * 576 * 2 / KiB] * 5


def test_block_size_tradeoff_measures_waste_and_table_length():
    rows = block_size_tradeoff([1, 16, 17], [8, 16])
    r8, r16 = rows
    # block_size 8: 1 -> 1 block (7 empty), 16 -> 2 (0), 17 -> 3 (7)
    assert (r8.mean_waste_tokens, r8.max_waste_tokens, r8.mean_blocks_per_seq) == (14 / 3, 7, 2)
    assert r8.wasted_fraction == 14 / 48
    # block_size 16: 1 -> 1 (15), 16 -> 1 (0), 17 -> 2 (15)
    assert (r16.mean_waste_tokens, r16.expected_waste_tokens) == (10, 7.5)
    assert r16.mean_blocks_per_seq == 4 / 3
    fig = draw_block_size_tradeoff(rows)
    assert len(bars(fig.axes[0])) == 3 * 2 and len(bars(fig.axes[1])) == 2
    with pytest.raises(ValueError):
        block_size_tradeoff([], [16])


# ------------------------------------------------------- the source articles' claims table

def test_claims_table_keeps_order_and_shows_both_values():
    table = claims_table(["003-4.2-block", "000-1.2-per-token"])
    assert [c.key for c in table.rows] == ["003-4.2-block", "000-1.2-per-token"]
    text = str(table)
    assert text.index("003-4.2-block") < text.index("000-1.2-per-token")
    assert "the article says 0.125 MiB, the course computes 2 MiB" in text
    assert '"PagedAttention explained" §4.2' in text
    html = table._repr_html_()
    assert html.count("<tr>") == 3 and "WRONG" not in html and ">wrong<" in html


def test_claims_table_rejects_unknown_keys():
    with pytest.raises(ValueError, match="no-such-claim"):
        claims_table(["000-1.2-per-token", "no-such-claim"])


# ---------------------------------------------------------------- the capacity explorer

def test_explorer_default_is_llama_3_8b_on_80_gib():
    explorer = CapacityExplorer()
    weights = 8_030_261_248 * 2
    blocks = (round(80 * GiB * 0.9) - weights) // (16 * 32 * 2 * 8 * 128 * 2)
    assert explorer.state.plan().num_gpu_blocks == blocks
    assert f"# GPU blocks: {blocks}" in explorer.summary.value
    assert bytes(explorer.image.value).startswith(b"\x89PNG")


def test_explorer_reacts_to_each_widget():
    explorer = CapacityExplorer()
    drawings = [bytes(explorer.image.value)]
    explorer.utilization.value = 0.95
    assert explorer.state.gpu_memory_utilization == 0.95
    assert "x 0.95" in explorer.summary.value
    drawings.append(bytes(explorer.image.value))
    explorer.memory.value = 40
    assert explorer.state.total_gpu_memory_gib == 40.0
    drawings.append(bytes(explorer.image.value))
    explorer.block_size.value = 32
    assert explorer.state.block_size == 32 and "block 4.0 MiB" in explorer.summary.value
    drawings.append(bytes(explorer.image.value))  # the block count printed on the bar changes
    assert len(set(drawings)) == 4
    explorer.max_model_len.value = 2048
    assert explorer.state.max_model_len == 2048
    assert "Maximum concurrency for 2,048 tokens" in explorer.summary.value


def test_explorer_tp_options_follow_the_model():
    explorer = CapacityExplorer()
    explorer.preset.value = "llama-3-70b"
    assert explorer.tp.options == (1, 2, 4, 8, 16)
    assert "does not start" in explorer.summary.value  # 131 GiB of weights on one GPU
    before = bytes(explorer.image.value)
    explorer.tp.value = 4
    assert explorer.state.tensor_parallel_size == 4
    assert "TP=4" in explorer.summary.value and "does not start" not in explorer.summary.value
    assert bytes(explorer.image.value) != before
    explorer.preset.value = "qwen2.5-7b"  # 28 query heads, 4 KV heads: TP 4 still valid
    assert explorer.tp.options == (1, 2, 4) and explorer.state.tensor_parallel_size == 4
    explorer.preset.value = "llama-2-7b"  # 32 heads: TP 4 is kept
    explorer.tp.value = 16
    explorer.preset.value = "qwen2.5-7b"  # 16 does not split 28 heads: back to 1
    assert explorer.tp.value == 1 and explorer.state.tensor_parallel_size == 1


def test_explorer_state_summary_reports_a_model_that_does_not_fit():
    state = ExplorerState(preset="deepseek-v3", tensor_parallel_size=8)
    assert state.summary().startswith("does not start: KV cache budget is negative")
    fig = draw_explorer_state(state)
    assert "does not fit" in fig.axes[0].get_title()
    ok = ExplorerState(preset="deepseek-v3", tensor_parallel_size=16)
    assert "DeepSeek-V3 (MLA), TP=16" in ok.summary()


@pytest.mark.parametrize("change, message", [
    (dict(preset="nope"), "unknown model preset 'nope'"),
    (dict(block_size=64), r"block_size must be one of \[8, 16, 32\]"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size must be one of"),
    (dict(max_model_len=1000), "max_model_len must be one of"),
    # sliders clamp out-of-range values without a word: the state would not be what is shown
    (dict(total_gpu_memory_gib=-1.0), r"total_gpu_memory_gib must be in \[16, 192\]"),
    (dict(gpu_memory_utilization=2.0), r"gpu_memory_utilization must be in \[0.5, 1.0\]"),
])
def test_capacity_explorer_refuses_a_state_its_widgets_cannot_show(change, message):
    with pytest.raises(ValueError, match=message):
        CapacityExplorer(ExplorerState(**change))
