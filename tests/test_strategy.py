"""DP / DP-attention / CP in numbers, the decision tree, and the strategy explorer widget."""

from __future__ import annotations

import pytest

from course_lib import capacity as cap
from course_lib.parallel import dcp, strategy
from course_lib.parallel.cp_decode import CPCase
from course_lib.parallel.decision_tree import ADVICE, recommend
from course_lib.parallel.deployment import article_case, plan
from course_lib.sizing.models import get_preset
from course_lib.sizing.units import H200_MEMORY_GIB, format_bytes

pytestmark = pytest.mark.ch09

V3 = get_preset("deepseek-v3")
L70 = get_preset("llama-3-70b")
H200 = H200_MEMORY_GIB


def test_article_case_52k_per_gpu_208k_with_cp4():
    p = article_case()
    assert (p.num_gpus, p.data_parallel_size) == (8, 1)
    assert p.block_bytes == 16 * 61 * 1152
    assert p.tokens_per_gpu == 3258 * 16 == 52_128
    assert p.max_request_tokens == 4 * 52_128 == 208_512
    # one layer: the query is 128 heads x 576 x 2 B; the KV of 3/4 of the tokens is 1152 B each
    assert p.comm.query_bytes == 128 * 576 * 2
    assert p.comm.move_kv_bytes == (208_512 - 52_128) * 1152
    assert p.move_kv_bytes_per_step == 61 * p.comm.move_kv_bytes
    assert p.move_kv_bytes_per_step > 500 * p.query_bytes_per_step
    assert "208,512 tokens" in p.summary()


def test_article_case_pool_is_labelled_as_given_and_memory_refuses_it():
    p = article_case()
    assert p.blocks_given and p.available_kv_bytes == 3258 * p.block_bytes
    # 80 GiB x 0.9 = 72 GiB minus 671e9 B / 8 of FP8 weights: -6.11 GiB
    assert p.memory_budget_bytes == round(80 * 2**30 * 0.9) - round(671e9 / 8)
    assert format_bytes(p.memory_budget_bytes) == "-6.11 GiB"
    assert "negative" in p.memory_error
    with pytest.raises(ValueError, match="negative"):        # chapter 08's arithmetic
        cap.plan_kv_cache(V3, 80, weight_gib=p.weight_bytes_per_gpu / 2**30)
    text = p.summary()
    assert "the article's count, not derived from memory" in text and "-6.11 GiB" in text
    assert "refuses this setup" in text
    computed = plan(V3, H200, 2, 4)
    assert not computed.blocks_given and computed.memory_error is None
    assert "KV budget" in computed.summary() and "memory check" not in computed.summary()
    # 208,512 tokens for one request exceed DeepSeek-V3's 163,840-token context
    assert "163,840" in text and "163,840" not in plan(L70, 80, 2, 1).summary()


def test_dcp_splits_the_latent_over_the_tp_ranks():
    d = dcp.dcp_plan(V3, H200, 8, 8)
    base = plan(V3, H200, 8, 1)                        # same GPUs, no DCP
    assert d.tokens_per_rank == base.tokens_per_gpu
    assert d.latent_bytes_per_token_per_rank == 61 * 576 * 2 / 8 == 8784
    assert d.max_request_tokens == 8 * base.max_request_tokens == d.total_tokens
    cp = plan(V3, H200, 2, 4)                          # the article's layout
    assert cp.tokens_per_gpu == d.tokens_per_rank               # MLA: same pool per GPU
    assert d.total_tokens == 2 * cp.total_tokens
    assert d.max_request_tokens == 2 * cp.max_request_tokens
    assert dcp.dcp_plan(V3, H200, 8, 2).max_request_tokens == 2 * d.tokens_per_rank
    assert "8,784 B per rank" in d.summary() and "163,840" in d.summary()
    assert "163,840" not in dcp.dcp_plan(V3, H200, 8, 1).summary()
    with pytest.raises(ValueError, match="tp_size=1 must be divisible by dcp_size=4"):
        dcp.dcp_plan(V3, H200, 1, 4)                       # the chapter's TP=1, CP=4
    with pytest.raises(ValueError, match="MLA"):
        dcp.dcp_plan(L70, 80, 8, 8)


def test_compare_strategies_cp_lengthens_a_request_dp_does_not():
    c = strategy.compare_strategies(L70, 80, num_gpus=8, tensor_parallel_size=2,
                                    context_parallel_size=4)
    dp, cp = c["DP"], c["CP"]
    assert dp.data_parallel_size == 4 and cp.data_parallel_size == 1
    assert dp.tokens_per_gpu == cp.tokens_per_gpu              # same pool per GPU
    assert dp.total_tokens == cp.total_tokens == 4 * dp.tokens_per_gpu
    assert dp.max_request_tokens == dp.tokens_per_gpu          # DP: a request stays on a group
    assert cp.max_request_tokens == 4 * dp.tokens_per_gpu      # CP: x CP size
    assert dp.query_bytes_per_step == 0 < cp.query_bytes_per_step
    assert [s.name for s in strategy.STRATEGIES] == ["DP", "DP attention", "CP"]
    assert strategy.STRATEGIES[2].single_request_limit == "x CP size"


def test_plan_matches_capacity_and_validates():
    p = plan(L70, 80, 4, 2)
    b = cap.plan_kv_cache(L70, 80, tensor_parallel_size=4)
    assert (p.num_gpu_blocks, p.block_bytes) == (b.num_gpu_blocks, b.block_bytes)
    mla = plan(V3, H200, 1, 8)
    assert mla.weight_bytes_per_gpu == round(V3.weight_bytes / 8)
    assert plan(V3, H200, 2, 4).block_bytes == mla.block_bytes  # TP cannot shrink MLA
    with pytest.raises(ValueError, match="negative"):
        plan(V3, 80, 1, 1)                              # 671 GB of weights on one GPU
    with pytest.raises(ValueError, match="multiple of TP x CP"):
        plan(L70, 80, 2, 2, num_gpus=6)
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        plan(L70, 80, 3, 1)


def test_decision_tree_mla_goes_to_dp_attention_plus_cp():
    r = recommend(V3, 2_000_000, H200)
    assert r.path[0].endswith("yes") and r.path[1].endswith("no")
    assert r.advice == ADVICE["mla+cp"]
    assert r.plan.tensor_parallel_size == 1 and r.plan.context_parallel_size == 4
    assert r.plan.max_request_tokens >= 2_000_000
    assert r.beyond_model_context and "recommended plan:" in str(r)   # 2M > 163,840
    smaller = plan(V3, H200, 1, 2, num_gpus=8, gpu_memory_utilization=0.95)
    assert smaller.max_request_tokens < 2_000_000               # CP=2 really was too small


def test_decision_tree_gqa_tp_first_then_cp():
    short = recommend(L70, 200_000, 80)
    assert short.advice == ADVICE["util"] and short.plan.context_parallel_size == 1
    assert short.plan.tensor_parallel_size == 4                  # TP=2 holds only ~41K
    assert plan(L70, 80, 2, 1, gpu_memory_utilization=0.95).max_request_tokens \
        < 200_000
    long = recommend(L70, 2_000_000, 80, max_gpus=16)
    assert long.path[1].endswith("no") and long.advice == ADVICE["gqa+cp"]
    assert (long.plan.tensor_parallel_size, long.plan.context_parallel_size) == (8, 2)
    assert long.plan.max_request_tokens >= 2_000_000
    assert recommend(L70, 2_000_000, 80, max_gpus=8).plan is None
    assert recommend(L70, 100_000_000, 80).plan is None
    with pytest.raises(ValueError, match="power of two"):
        recommend(L70, 1000, 80, max_gpus=6)


def test_requests_longer_than_the_models_context_are_flagged():
    l7 = get_preset("llama-2-7b")
    far = recommend(l7, 2_000_000, H200)
    assert far.model_context == 4096 and far.beyond_model_context
    assert "longer than the model's context (4,096" in str(far)
    assert "vLLM refuses it" in str(far)
    within = recommend(l7, 4096, 24)
    assert not within.beyond_model_context and "!" not in str(within)
    assert not recommend(V3, 163_840, H200).beyond_model_context
    assert recommend(V3, 163_841, H200).beyond_model_context


def test_explorer_reacts_to_values():
    from course_lib.viz.parallel import StrategyExplorer

    ex = StrategyExplorer()
    assert ex.plan.model is V3 and ex.plan.context_parallel_size == 4
    assert ex.memory.value == H200 and ex.memory.label == "140.4"
    assert "your plan:" in ex.text and "recommended by the decision tree" in ex.text
    first_png, first_tokens = ex.png, ex.plan.max_request_tokens
    assert ex.image.value == first_png and first_png.startswith(b"\x89PNG")
    ex.cp.value = 8
    assert ex.plan.max_request_tokens == 2 * first_tokens and ex.png != first_png
    ex.model.value = "llama-3-8b"
    assert ex.tp.options == (1, 2, 4, 8) and ex.plan.model.name == "Llama-3-8B"
    ex.memory.value = 24
    ex.tp.value = 1
    ex.cp.value = 1
    assert "does not fit" not in ex.text and ex.plan.weight_bytes_per_gpu > 14 * 2**30
    ex.model.value = "deepseek-v3"
    ex.cp.value = 1
    assert ex.plan is None and "negative" in ex.error and "does not fit" in ex.text
    assert "decision tree" in ex.html.value
    ex.tp.value = 8
    ex.model.value = "qwen2.5-7b"                  # 28 query heads: TP=8 does not divide them
    assert ex.tp.options == (1, 2, 4) and ex.tp.value == 1 and ex.plan.tensor_parallel_size == 1
    before = ex.plan.num_gpu_blocks
    ex.util.value = 0.95
    assert ex.plan.num_gpu_blocks > before


def test_explorer_flags_requests_beyond_the_models_context():
    from course_lib.viz.parallel import StrategyExplorer, draw_plan

    ex = StrategyExplorer(model="llama-2-7b", tp=1, cp=1, context_len=2_000_000)
    assert ex.recommendation.beyond_model_context
    assert "longer than the model's context (4,096" in ex.text
    ex.context.value = 4096
    assert not ex.recommendation.beyond_model_context and "!" not in ex.text
    assert "refuses" in draw_plan(ex.plan, 2_000_000).axes[0].get_title()
    assert draw_plan(ex.plan, 4096, "your plan: ").axes[0].get_title().startswith("your plan")
    assert "refuses" not in draw_plan(ex.plan, 4096).axes[0].get_title()


def test_figures_draw():
    from course_lib.viz import parallel as viz

    fig = viz.draw_cp_layout(CPCase(prompt_len=10, num_steps=2), 4)
    assert len(fig.axes[0].patches) == 12
    fig = viz.draw_move_q_vs_kv(V3, [32_768, 208_512], 4)
    assert len(fig.axes[0].patches) == 4
    fig = viz.draw_decode_flow(4)
    assert len(fig.axes[0].patches) == 8 and len(fig.axes[0].texts) == 4 + 2 + 3
    with pytest.raises(ValueError, match="cp_size"):
        viz.draw_decode_flow(0)
    fig = viz.draw_plan(article_case(), 200_000)
    assert "fits" in fig.axes[0].get_title() and "refuses" in fig.axes[0].get_title()
    assert viz.draw_plan(article_case(), 100_000).axes[0].get_title().endswith("fits")


@pytest.mark.parametrize("value", [-80, float("nan"), "80"])
def test_plan_and_recommend_reject_bad_gpu_memory(value):
    spec = get_preset("llama-2-7b")
    with pytest.raises(ValueError, match="gpu_memory_gib must be a finite number >= 0"):
        plan(spec, value)
    # recommend catches "does not fit" for every size: a bad memory must not read as "no"
    with pytest.raises(ValueError, match="gpu_memory_gib must be a finite number >= 0"):
        recommend(spec, 1000, value)
    with pytest.raises(ValueError, match="weight_gib must be a finite number >= 0"):
        plan(spec, 80, weight_gib=float("nan"))
    with pytest.raises(ValueError, match="overhead_gib must be a finite number >= 0"):
        plan(spec, 80, overhead_gib=-5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(gpu_memory_gib=-1), "gpu_memory_gib must be one of"),
    (dict(tp=0), "tp must be one of"),
    (dict(cp=3), "cp must be one of"),
    (dict(num_gpus=3), "num_gpus must be one of"),
    (dict(context_len=0), "context_len must be one of"),
    # a slider would clamp 2.0 to 0.95 without a word
    (dict(gpu_memory_utilization=2.0), r"gpu_memory_utilization must be in \[0.8, 0.95\]"),
])
def test_explorer_refuses_start_values_its_widgets_cannot_show(kwargs, message):
    from course_lib.viz.parallel import StrategyExplorer

    with pytest.raises(ValueError, match=message):
        StrategyExplorer(**kwargs)


def test_drawings_of_plans_reject_bad_lengths():
    from course_lib.viz.parallel import draw_move_q_vs_kv, draw_plan

    spec = get_preset("llama-2-7b")
    with pytest.raises(ValueError, match="context_len must be an integer >= 1, got 0"):
        draw_plan(plan(spec, 80), 0)
    with pytest.raises(ValueError, match="at least one context length"):
        draw_move_q_vs_kv(spec, [], 2)
