"""Hybrid models' KV cache (sizing/hybrid.py, the hybrid presets) against arithmetic written out
here from the models' config.json fields, never from the library itself.

The configs (cited in course_lib/sizing/models.py): gpt-oss-20b/120b, Gemma 3 27B's text
config, Qwen3-Next-80B-A3B. Each expected value is derived below from those fields: the layer
types as transformers builds them, bytes per token as K and V of every KV head in BF16, blocks
as the block indices a token range touches.
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib.patches import Rectangle
from property_budget import examples

from course_lib import capacity as cap
from course_lib.sizing import hybrid
from course_lib.sizing.blocks import num_gpu_blocks
from course_lib.sizing.models import (
    HYBRID_PRESETS,
    LAYER_TYPES,
    PRESETS,
    ModelSpec,
    gated_delta_net_state_bytes,
    get_preset,
    repeat_layer_pattern,
)
from course_lib.sizing.units import GiB, MiB
from course_lib.viz.hybrid_capacity import draw_hybrid_capacity, draw_layer_kv_bytes

pytestmark = [pytest.mark.ch01, pytest.mark.ch08]

# config.json fields, as published (see the presets' comments for where each comes from)
GPT_OSS = {"gpt-oss-20b": 24, "gpt-oss-120b": 36}     # num_hidden_layers; the rest is shared
GPT_OSS_ATTENTION = dict(num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                         sliding_window=128)
GEMMA_3_27B = dict(num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
                   head_dim=128, sliding_window=1024, sliding_window_pattern=6)
QWEN3_NEXT = dict(num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
                  head_dim=256, full_attention_interval=4, linear_num_key_heads=16,
                  linear_num_value_heads=32, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4)
BF16 = 2
CONTEXTS = (1, 100, 4096, 32_768, 131_072)


def gpt_oss_types(layers):
    # transformers' GptOssConfig: "sliding_attention" if (i + 1) % 2 else "full_attention"
    return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers))


def gemma_types():
    c = GEMMA_3_27B
    return tuple("sliding_attention" if (i + 1) % c["sliding_window_pattern"] else
                 "full_attention" for i in range(c["num_hidden_layers"]))


def qwen_types():
    c = QWEN3_NEXT
    return tuple("linear_attention" if (i + 1) % c["full_attention_interval"] else
                 "full_attention" for i in range(c["num_hidden_layers"]))


def kv_token_bytes(kv_heads, head_dim):
    return 2 * kv_heads * head_dim * BF16          # K and V


def qwen_state_bytes():
    c = QWEN3_NEXT
    channels = (c["linear_num_key_heads"] * c["linear_key_head_dim"] * 2
                + c["linear_num_value_heads"] * c["linear_value_head_dim"])   # q, k, v
    conv = channels * (c["linear_conv_kernel_dim"] - 1)
    delta = c["linear_num_value_heads"] * c["linear_value_head_dim"] * c["linear_key_head_dim"]
    return (conv + delta) * BF16


def blocks_touched(first_token, end_token, block_size):
    """Blocks that tokens [first_token, end_token) lie in: first to last block index."""
    if end_token <= first_token:
        return 0
    return (end_token - 1) // block_size - first_token // block_size + 1


# ---------------------------------------------------------------- the presets

def test_hybrid_presets_are_the_configs():
    assert set(HYBRID_PRESETS) == {*GPT_OSS, "gemma-3-27b", "qwen3-next-80b-a3b"}
    for name, layers in GPT_OSS.items():
        spec = get_preset(name)
        c = GPT_OSS_ATTENTION
        assert (spec.num_layers, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim,
                spec.sliding_window) == (layers, c["num_attention_heads"],
                                         c["num_key_value_heads"], c["head_dim"],
                                         c["sliding_window"])
        assert spec.layer_types == gpt_oss_types(layers)
    gemma, c = get_preset("Gemma-3-27B"), GEMMA_3_27B
    assert (gemma.num_layers, gemma.num_attention_heads, gemma.num_kv_heads, gemma.head_dim,
            gemma.sliding_window) == (c["num_hidden_layers"], c["num_attention_heads"],
                                      c["num_key_value_heads"], c["head_dim"],
                                      c["sliding_window"])
    assert gemma.layer_types == gemma_types()
    assert gemma.layer_types.count("full_attention") == 10      # layers 5, 11, ..., 59
    qwen, c = get_preset("qwen3-next-80b-a3b"), QWEN3_NEXT
    assert (qwen.num_layers, qwen.num_attention_heads, qwen.num_kv_heads, qwen.head_dim) == (
        c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
        c["head_dim"])
    assert qwen.layer_types == qwen_types()
    assert qwen.linear_state_bytes == qwen_state_bytes() == 1_097_728
    assert all(s.is_hybrid for s in HYBRID_PRESETS.values())
    assert not any(s.is_hybrid or s.layer_types for s in PRESETS.values())


def test_every_preset_has_the_same_token_bytes_as_capacity():
    for spec in (*PRESETS.values(), *HYBRID_PRESETS.values()):
        assert hybrid.token_bytes_per_layer(spec) == cap.kv_bytes_per_token_per_layer(spec)


def test_get_preset_finds_hybrids_and_names_them_when_lost():
    assert get_preset("GPT-OSS-120B").name == "gpt-oss-120b"
    with pytest.raises(ValueError, match=r"known presets: .*DeepSeek-V3.*gpt-oss-20b.*"
                                         r"Qwen3-Next-80B-A3B"):
        get_preset("gpt-oss-30b")


# ---------------------------------------------------------------- exact bytes per layer

@pytest.mark.parametrize("n", CONTEXTS)
def test_gpt_oss_bytes_for_context(n):
    c = GPT_OSS_ATTENTION
    per_token = kv_token_bytes(c["num_key_value_heads"], c["head_dim"])     # 2,048 B
    for name, layers in GPT_OSS.items():
        spec = get_preset(name)
        full_layers = sliding_layers = layers // 2
        expected = full_layers * n * per_token + sliding_layers * min(n, 128) * per_token
        assert sum(hybrid.layer_kv_bytes(spec, n)) == expected
        assert hybrid.all_full_kv_bytes(spec, n) == layers * n * per_token \
            == cap.contiguous_kv_bytes(spec, n)


@pytest.mark.parametrize("n", CONTEXTS)
def test_gemma_3_bytes_for_context(n):
    c = GEMMA_3_27B
    per_token = kv_token_bytes(c["num_key_value_heads"], c["head_dim"])     # 8,192 B
    layers = hybrid.layer_kv_bytes(get_preset("gemma-3-27b"), n)
    for i, kind in enumerate(gemma_types()):
        kept = n if kind == "full_attention" else min(n, c["sliding_window"])
        assert layers[i] == kept * per_token
    assert sum(layers) == (10 * n + 52 * min(n, 1024)) * per_token


@pytest.mark.parametrize("n", CONTEXTS)
def test_qwen3_next_bytes_for_context(n):
    c = QWEN3_NEXT
    per_token = kv_token_bytes(c["num_key_value_heads"], c["head_dim"])     # 2,048 B
    expected = 12 * n * per_token + 36 * qwen_state_bytes()
    assert sum(hybrid.layer_kv_bytes(get_preset("qwen3-next-80b-a3b"), n)) == expected
    assert sum(hybrid.layer_kv_bytes(get_preset("qwen3-next-80b-a3b"), 0)) == 0


def test_hybrids_keep_less_than_all_full_at_long_context():
    # at 128K: gpt-oss about half, Gemma 3 about a sixth, Qwen3-Next about a quarter
    ratios = {name: sum(hybrid.layer_kv_bytes(s, 131_072)) / hybrid.all_full_kv_bytes(s, 131_072)
              for name, s in HYBRID_PRESETS.items()}
    assert ratios["gpt-oss-20b"] == pytest.approx((12 * 131_072 + 12 * 128) / (24 * 131_072))
    assert ratios["gemma-3-27b"] == pytest.approx((10 * 131_072 + 52 * 1024) / (62 * 131_072))
    assert 0.25 < ratios["qwen3-next-80b-a3b"] < 0.26


# ---------------------------------------------------------------- groups and page size

def test_gpt_oss_groups_two_of_equal_pages():
    for name, layers in GPT_OSS.items():
        g = hybrid.kv_cache_groups(get_preset(name), 16)
        assert [x.layer_type for x in g.groups] == ["sliding_attention", "full_attention"]
        assert g.groups[0].layer_indices == tuple(range(0, layers, 2))
        assert g.groups[1].layer_indices == tuple(range(1, layers, 2))
        assert g.block_size == 16 and g.layers_per_group == layers // 2
        assert g.page_size_bytes == 16 * 2048
        assert g.bytes_per_block == layers // 2 * 16 * 2048


def test_gemma_3_groups_of_ten_with_padding():
    g = hybrid.kv_cache_groups(get_preset("gemma-3-27b"), 16)
    # 52 sliding and 10 full layers: groups of 10 (52 >= 1.5 x 10), so 6 sliding groups
    sliding = [x for x in g.groups if x.layer_type == "sliding_attention"]
    full = [x for x in g.groups if x.layer_type == "full_attention"]
    assert len(sliding) == math.ceil(52 / 10) and len(full) == 1
    sliding_layers = [i for i, t in enumerate(gemma_types()) if t == "sliding_attention"]
    assert [x.layer_indices for x in sliding] == [tuple(sliding_layers[i::6]) for i in range(6)]
    assert [len(x.layer_indices) for x in sliding] == [9, 9, 9, 9, 8, 8]
    assert full[0].layer_indices == tuple(range(5, 62, 6))
    assert g.layers_per_group == 10
    assert g.bytes_per_block == 10 * 16 * kv_token_bytes(16, 128)           # 1.25 MiB
    assert "6 group(s) of 9, 9, 9, 9, 8, 8 layers" in g.describe()


def test_qwen3_next_block_size_grows_to_hold_the_state_and_the_state_is_padded():
    g = hybrid.kv_cache_groups(get_preset("qwen3-next-80b-a3b"), 16)
    per_token, state = kv_token_bytes(2, 256), qwen_state_bytes()
    block_size = 16 * math.ceil(state / (16 * per_token))                    # 16 x 34
    assert g.block_size == block_size == 544
    assert g.page_size_bytes == block_size * per_token == 1_114_112
    linear = [x for x in g.groups if x.layer_type == "linear_attention"]
    assert len(linear) == 3 and len(g.groups) == 4 and g.layers_per_group == 12
    assert {x.real_page_size_bytes for x in linear} == {state}
    assert {x.page_size_bytes for x in g.groups} == {g.page_size_bytes}
    text = g.describe()
    assert "block_size raised to 16 x cdiv(1,097,728, 32,768) = 544 tokens" in text
    assert f"padded by {1_114_112 - state:,} B ({(1_114_112 - state) / state:.2%})" in text


def test_group_size_pads_up_when_counts_are_close():
    # 12 sliding + 13 full (gpt-oss-20b with an extra full layer, vLLM's own example): 13 < 1.5
    # x 12, so both buckets form one group of up to 13 layers, not 12 + 12 + 1
    types = gpt_oss_types(24) + ("full_attention",)
    spec = ModelSpec("x", 25, 64, 8, 64, num_params=1, layer_types=types, sliding_window=128)
    g = hybrid.kv_cache_groups(spec)
    assert [len(x.layer_indices) for x in g.groups] == [12, 13] and g.layers_per_group == 13


def test_an_all_full_model_is_one_group_and_the_same_pool_as_capacity():
    spec = get_preset("llama-3-8b")
    g = hybrid.kv_cache_groups(spec, 16)
    assert len(g.groups) == 1 and g.groups[0].layer_indices == tuple(range(32))
    assert g.bytes_per_block == cap.block_bytes(spec, 16)
    c = hybrid.hybrid_capacity(spec, 40 * GiB, 32_768)
    assert c.num_blocks == c.all_full_num_blocks == num_gpu_blocks(40 * GiB, cap.block_bytes(spec))
    assert c.max_concurrency == cap.max_concurrency(c.num_blocks, 16, 32_768) == 10.0
    assert c.gain == 1.0


# ---------------------------------------------------------------- blocks by context length

@pytest.mark.parametrize("n", CONTEXTS)
def test_blocks_held_are_the_blocks_the_attended_tokens_touch(n):
    for spec in HYBRID_PRESETS.values():
        g = hybrid.kv_cache_groups(spec, 16)
        bs = g.block_size
        for group in g.groups:
            if group.layer_type == "full_attention":
                expected = blocks_touched(0, n, bs)
            elif group.layer_type == "sliding_attention":
                expected = blocks_touched(max(0, n - spec.sliding_window), n, bs)
            else:
                expected = 1                                              # one state
            assert hybrid.blocks_held(group, n) == expected, (spec.name, group.layer_type)


def test_gpt_oss_blocks_and_bytes_at_1000_tokens():
    g = hybrid.kv_cache_groups(get_preset("gpt-oss-20b"), 16)
    sliding, full = g.groups
    # tokens 872..999 are the window of token 999: blocks 54..62
    assert hybrid.blocks_held(sliding, 1000) == 62 - 54 + 1 == 9
    assert hybrid.blocks_held(full, 1000) == math.ceil(1000 / 16) == 63
    assert hybrid.paged_kv_bytes_for_context(g, 1000) == (9 + 63) * 12 * 16 * 2048


@pytest.mark.parametrize("name", sorted(HYBRID_PRESETS))
@pytest.mark.parametrize("max_model_len", [4096, 32_768, 131_072])
def test_capacity_against_all_full(name, max_model_len):
    spec, budget, bs, in_flight = get_preset(name), 40 * GiB, 16, 8192
    per_token = kv_token_bytes(spec.num_kv_heads, spec.head_dim)
    c = hybrid.hybrid_capacity(spec, budget, max_model_len, max_in_flight_tokens=in_flight)
    g = c.grouping
    per_request = 0
    for group in g.groups:
        if group.layer_type == "full_attention":
            per_request += math.ceil(max_model_len / g.block_size)
        elif group.layer_type == "sliding_attention":  # the window, the tokens in flight, +1
            tokens = min(spec.sliding_window - 1 + in_flight, max_model_len)
            per_request += math.ceil(tokens / g.block_size) + 1
        else:
            per_request += 1
    assert c.blocks_per_request == per_request
    assert c.num_blocks == budget // (g.layers_per_group * g.block_size * per_token)
    assert c.max_concurrency == c.num_blocks / per_request
    assert c.kv_cache_size_tokens == int(c.num_blocks / per_request * max_model_len)
    full_blocks = budget // (spec.num_layers * bs * per_token)
    assert c.all_full_num_blocks == full_blocks
    assert c.all_full_max_concurrency == full_blocks / math.ceil(max_model_len / bs)


def test_long_contexts_favour_the_hybrid_and_short_ones_may_not():
    at = {n: hybrid.hybrid_capacity(get_preset("gemma-3-27b"), 40 * GiB, n)
          for n in (4096, 131_072)}
    # 4K: each sliding group reserves the whole request (window + 8,192 in flight > 4K) in
    # blocks padded to 10 layers: the hybrid holds fewer requests than all-full
    assert at[4096].gain < 1 < at[131_072].gain
    assert at[131_072].gain > 4


# ---------------------------------------------------------------- a window as long as the context

@settings(max_examples=examples(50), deadline=None)
@given(st.integers(1, 8), st.sampled_from([1, 2, 4, 8, 16, 32]), st.integers(1, 600),
       st.integers(0, 600), st.sampled_from(["sliding_attention", "chunked_attention"]))
def test_a_window_at_least_the_context_is_full_attention(num_pairs, bs, window, n, kind):
    n = min(n, window)
    field = "sliding_window" if kind == "sliding_attention" else "attention_chunk_size"
    spec = ModelSpec("w", 2 * num_pairs, 4, 2, 8, num_params=1,
                     layer_types=repeat_layer_pattern((kind, "full_attention"), 2 * num_pairs),
                     **{field: window})
    assert hybrid.layer_kv_bytes(spec, n) == [n * 2 * 2 * 8 * 2] * spec.num_layers
    windowed, full = hybrid.kv_cache_groups(spec, bs).groups
    assert hybrid.blocks_held(windowed, n) == hybrid.blocks_held(full, n) == math.ceil(n / bs)


@settings(max_examples=examples(50), deadline=None)
@given(st.sampled_from([1, 4, 16, 64]), st.integers(1, 300), st.integers(0, 2000),
       st.sampled_from(["sliding_attention", "chunked_attention"]))
def test_held_blocks_cover_what_is_attended_and_little_more(bs, window, n, kind):
    field = "sliding_window" if kind == "sliding_attention" else "attention_chunk_size"
    spec = ModelSpec("w", 2, 4, 2, 8, num_params=1, layer_types=(kind, "full_attention"),
                     **{field: window})
    windowed, full = hybrid.kv_cache_groups(spec, bs).groups
    kept = hybrid.tokens_kept(kind, window, n)
    held = hybrid.blocks_held(windowed, n)
    assert kept <= held * bs < kept + 2 * bs         # covers it, wastes under two blocks
    assert held <= hybrid.blocks_held(full, n)
    assert held <= math.ceil(window / bs) + 1        # a window never holds more
    if kind == "sliding_attention":                  # vLLM reserves enough for it
        assert hybrid.max_blocks_per_request(windowed, max(n, 1), 0) >= held


# ---------------------------------------------------------------- refused at the door

@pytest.mark.parametrize("kwargs, message", [
    (dict(layer_types=("full_attention",) * 3), "layer_types has 3 entries; it must have one "
                                                "per layer, num_layers=4"),
    (dict(layer_types=("full_attention",) * 3 + ("local",)), "layer_types[3]='local' is not a "
                                                             "layer type"),
    (dict(layer_types="full_attention"), "layer_types must be a sequence of"),
    (dict(layer_types=("sliding_attention",) * 4), "sliding_window must be an integer >= 1 "
                                                   "(tokens) when a layer is "
                                                   "'sliding_attention', got 0"),
    (dict(layer_types=("sliding_attention",) * 4, sliding_window=-1),
     "sliding_window must be an integer >= 0, got -1"),
    (dict(sliding_window=128), "sliding_window=128 is set but no layer is 'sliding_attention'"),
    (dict(layer_types=("chunked_attention",) * 4), "attention_chunk_size must be an integer >= 1"),
    (dict(layer_types=("linear_attention", "full_attention") * 2),
     "linear_state_bytes must be an integer >= 1 (bytes)"),
    (dict(linear_state_bytes=10), "linear_state_bytes=10 is set but no layer is "
                                  "'linear_attention'"),
])
def test_model_spec_refuses_bad_layer_types(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelSpec("x", 4, 8, 2, 16, num_params=1, **kwargs)


def test_a_list_of_layer_types_is_kept_as_a_tuple():
    spec = ModelSpec("x", 2, 8, 2, 16, num_params=1,
                     layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    assert spec.layer_types == ("sliding_attention", "full_attention")
    assert isinstance(hash(spec), int)                # a frozen spec stays hashable
    assert set(spec.per_layer_types) <= set(LAYER_TYPES)


@pytest.mark.parametrize("call, message", [
    (lambda: repeat_layer_pattern((), 4), "pattern must be a non-empty sequence"),
    (lambda: repeat_layer_pattern("full_attention", 4), "pattern must be a non-empty sequence"),
    (lambda: repeat_layer_pattern(("full_attention",), 0), "num_layers must be an integer >= 1"),
    (lambda: gated_delta_net_state_bytes(0, 32, 128, 128, 4), "num_k_heads must be an integer"),
    (lambda: hybrid.layer_kv_bytes(get_preset("gpt-oss-20b"), -1),
     "num_tokens must be an integer >= 0, got -1"),
    (lambda: hybrid.kv_cache_groups(get_preset("gpt-oss-20b"), 12),
     "block_size must be a power of two in [1, 256], got 12"),
    (lambda: hybrid.hybrid_capacity(get_preset("gpt-oss-20b"), GiB, 0),
     "max_model_len must be an integer >= 1, got 0"),
    (lambda: hybrid.hybrid_capacity(get_preset("gpt-oss-20b"), -1, 4096),
     "available_kv_bytes must be an integer >= 0, got -1"),
    (lambda: hybrid.hybrid_capacity(get_preset("gpt-oss-20b"), GiB, 4096,
                                    max_in_flight_tokens=1.5),
     "max_in_flight_tokens must be an integer >= 0, got 1.5"),
    (lambda: draw_hybrid_capacity([]), "capacities must hold at least one"),
])
def test_hybrid_sizing_refuses_nonsense(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


# ---------------------------------------------------------------- figures

def test_layer_figure_has_one_bar_per_layer_at_its_bytes():
    spec = get_preset("gemma-3-27b")
    ax = draw_layer_kv_bytes(spec, 32_768).axes[0]
    bars = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(bars) == 62
    heights = [b.get_height() for b in bars]
    assert heights[5] == 32_768 * 8192 / MiB and heights[0] == 1024 * 8192 / MiB
    (line,) = ax.get_lines()
    assert list(line.get_ydata()) == [32_768 * 8192 / MiB] * 2


def test_capacity_figure_draws_hybrid_against_all_full():
    spec = get_preset("gpt-oss-120b")
    caps = [hybrid.hybrid_capacity(spec, 60 * GiB, n) for n in (4096, 32_768, 131_072)]
    left, right = draw_hybrid_capacity(caps).axes
    hybrid_line, full_line = right.get_lines()
    assert list(hybrid_line.get_ydata()) == [c.max_concurrency for c in caps]
    assert list(full_line.get_ydata()) == [c.all_full_max_concurrency for c in caps]
    assert [t.get_text() for t in right.get_xticklabels()] == ["4K", "32K", "128K"]
    with pytest.raises(ValueError, match="one model"):
        draw_hybrid_capacity([caps[0], hybrid.hybrid_capacity(get_preset("gpt-oss-20b"),
                                                              GiB, 4096)])


def test_the_planner_for_all_full_models_refuses_a_hybrid():
    """plan_kv_cache counts every layer as full attention: a hybrid is sent to hybrid_capacity
    (an all-full preset still plans as before)."""
    with pytest.raises(ValueError, match="gpt-oss-20b is a hybrid model.*hybrid_capacity"):
        cap.plan_kv_cache(get_preset("gpt-oss-20b"), 80)
    assert cap.plan_kv_cache(get_preset("llama-3-8b"), 80).num_gpu_blocks > 0
