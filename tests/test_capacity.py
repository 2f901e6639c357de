"""course_lib.capacity against arithmetic written out independently here.

Expected values come from the models' published configs (layers, heads, head_dim), multiplied
out in each test, never from the library itself.
"""

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from course_lib import capacity as cap
from course_lib.sizing.blocks import (
    expected_internal_waste_tokens,
    max_internal_waste_tokens,
    num_blocks_for_tokens,
    num_cpu_blocks,
    num_full_blocks,
    num_gpu_blocks,
    paged_utilization,
    static_utilization,
    tokens_that_fit,
)
from course_lib.sizing.models import PRESETS, ModelSpec, get_preset
from course_lib.sizing.units import GiB, KiB, MiB, format_bytes

# name -> (num_layers, num_attention_heads, num_kv_heads, head_dim), from the model configs.
GQA_GEOMETRY = {
    "llama-2-7b": (32, 32, 32, 128),
    "llama-2-70b": (80, 64, 8, 128),
    "llama-3-8b": (32, 32, 8, 128),
    "llama-3-70b": (80, 64, 8, 128),
    "qwen2.5-7b": (28, 28, 4, 128),
}
# DeepSeek-V3: 61 layers; MLA caches kv_lora_rank 512 + qk_rope_head_dim 64 values per layer.
V3_LAYERS, V3_LATENT = 61, 512 + 64


def test_presets_are_the_ones_tested():
    assert set(PRESETS) == set(GQA_GEOMETRY) | {"deepseek-v3"}


@pytest.mark.parametrize("name", sorted(GQA_GEOMETRY))
def test_kv_bytes_per_token_gqa_presets(name):
    layers, q_heads, kv_heads, head_dim = GQA_GEOMETRY[name]
    spec = get_preset(name)
    assert (spec.num_layers, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == (
        layers, q_heads, kv_heads, head_dim)
    per_layer = 2 * kv_heads * head_dim * 2  # K and V, FP16
    assert cap.kv_bytes_per_token_per_layer(spec) == per_layer
    assert cap.kv_bytes_per_token(spec) == layers * per_layer


def test_kv_bytes_per_token_known_values():
    # 80 x 2 x 8 x 128 x 2 = 327,680 (70B); 32 x 2 x 8 x 128 x 2 = 131,072 (Llama-3-8B);
    # 32 x 2 x 32 x 128 x 2 = 524,288 (Llama-2-7B, MHA); 28 x 2 x 4 x 128 x 2 = 57,344 (Qwen).
    assert cap.kv_bytes_per_token(get_preset("Llama-3-70B")) == 327_680
    assert cap.kv_bytes_per_token(get_preset("llama-3-8b")) == 131_072
    assert cap.kv_bytes_per_token(get_preset("llama-2-7b")) == 524_288
    assert cap.kv_bytes_per_token(get_preset("qwen2.5-7b")) == 57_344


def test_kv_bytes_per_token_mla():
    v3 = get_preset("deepseek-v3")
    assert v3.is_mla and v3.attention_type == "MLA"
    assert cap.kv_bytes_per_token_per_layer(v3) == V3_LATENT * 2 == 1152
    assert cap.kv_bytes_per_token(v3) == V3_LAYERS * 1152 == 70_272


def test_attention_types():
    assert get_preset("llama-2-7b").attention_type == "MHA"
    assert get_preset("llama-3-8b").attention_type == "GQA"
    mqa = ModelSpec("mqa", 2, 8, 1, 64, num_params=1000)
    assert mqa.attention_type == "MQA"


def test_weight_bytes():
    l8 = get_preset("llama-3-8b")
    assert l8.weight_bytes == 8_030_261_248 * 2
    v3 = get_preset("deepseek-v3")
    assert v3.weight_bytes == 671_000_000_000  # FP8: one byte per weight


# --- tensor parallelism -------------------------------------------------------------------

def test_tp_divides_gqa_heads():
    m = get_preset("llama-3-70b")  # 8 KV heads
    for tp, heads in [(1, 8), (2, 4), (4, 2), (8, 1)]:
        assert cap.kv_heads_per_rank(m, tp) == heads
        assert cap.kv_bytes_per_token(m, tp) == 80 * 2 * heads * 128 * 2


def test_tp_replicates_kv_heads_beyond_their_count():
    m = get_preset("llama-3-8b")  # 32 query heads, 8 KV heads
    assert cap.kv_heads_per_rank(m, 16) == 1
    assert cap.kv_heads_per_rank(m, 32) == 1
    # Past 8 ranks each rank still stores one whole head: the per-rank cache stops shrinking.
    assert cap.kv_bytes_per_token(m, 32) == cap.kv_bytes_per_token(m, 8) == 32 * 2 * 128 * 2


def test_tp_does_not_split_mla():
    v3 = get_preset("deepseek-v3")
    assert {cap.kv_heads_per_rank(v3, tp) for tp in (1, 2, 8, 128)} == {1}
    sizes = {cap.kv_bytes_per_token(v3, tp) for tp in (1, 2, 4, 8, 16)}
    assert sizes == {70_272}
    assert cap.block_bytes(v3, 16, 8) == 16 * 61 * 1152 == 1_124_352


@pytest.mark.parametrize("name, tp", [("qwen2.5-7b", 8), ("llama-3-8b", 3), ("llama-3-70b", 6)])
def test_tp_that_does_not_divide_heads_is_rejected(name, tp):
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={tp} .*valid sizes: \[1, 2, 4"):
        cap.kv_bytes_per_token(get_preset(name), tp)


def test_tp_error_lists_valid_sizes():
    # Qwen2.5-7B: 28 query heads -> divisors 1 2 4 7 14 28; 4 KV heads: tp<=4 must divide 4,
    # tp>4 must be a multiple of 4 -> only 28 of 7, 14, 28.
    with pytest.raises(ValueError, match=re.escape("valid sizes: [1, 2, 4, 28]")):
        cap.kv_heads_per_rank(get_preset("qwen2.5-7b"), 7)


@pytest.mark.parametrize("tp", [0, -2, 1.5, True])
def test_tp_must_be_a_positive_int(tp):
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        cap.kv_heads_per_rank(get_preset("llama-3-8b"), tp)


# --- blocks ----------------------------------------------------------------------------------

def test_block_bytes():
    m = get_preset("llama-3-70b")
    assert cap.k_block_bytes_per_layer(m, 16) == 16 * 8 * 128 * 2 == 32 * KiB
    assert cap.block_bytes_per_layer(m, 16) == 2 * 16 * 8 * 128 * 2 == 64 * KiB
    assert cap.block_bytes(m, 16) == 80 * 64 * KiB == 5 * MiB
    assert cap.block_bytes(m, 16, tensor_parallel_size=8) == 16 * 80 * 2 * 1 * 128 * 2
    assert cap.block_bytes(get_preset("llama-3-8b"), 32) == 32 * 131_072


def test_k_block_is_half_the_layer_block_but_mla_has_none():
    for name in GQA_GEOMETRY:
        spec = get_preset(name)
        assert 2 * cap.k_block_bytes_per_layer(spec, 8) == cap.block_bytes_per_layer(spec, 8)
    with pytest.raises(ValueError, match="MLA"):
        cap.k_block_bytes_per_layer(get_preset("deepseek-v3"))


@pytest.mark.parametrize("bad", [12, 0, 512, -16, 3, 16.0, True])
def test_block_size_must_be_power_of_two_up_to_256(bad):
    expected = f"block_size must be a power of two in [1, 256], got {bad!r}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        cap.block_bytes(get_preset("llama-3-8b"), bad)


@pytest.mark.parametrize("good", [1, 2, 8, 16, 32, 64, 128, 256])
def test_block_size_accepted(good):
    assert cap.block_bytes(get_preset("llama-3-8b"), good) == good * 131_072


def test_blocks_for_tokens():
    assert [num_blocks_for_tokens(n, 16) for n in (0, 1, 15, 16, 17, 50)] == [0, 1, 1, 1, 2, 4]
    assert [num_full_blocks(n, 16) for n in (0, 15, 16, 17, 500)] == [0, 0, 1, 1, 31]


def test_request_bytes_paged_vs_contiguous():
    m = get_preset("llama-3-8b")
    assert cap.contiguous_kv_bytes(m, 50) == 50 * 131_072
    assert cap.paged_kv_bytes(m, 50, 16) == 4 * 16 * 131_072  # ceil(50/16) = 4 blocks
    assert cap.paged_kv_bytes(m, 64, 16) == cap.contiguous_kv_bytes(m, 64)
    # "PagedAttention explained" intro: 2 x 80 x 4096 x 8 x 128 x 2 = 1,342,177,280 B = 1.25 GiB.
    assert cap.contiguous_kv_bytes(get_preset("llama-2-70b"), 4096) == 1_342_177_280


@pytest.mark.parametrize("call", [
    lambda m: cap.contiguous_kv_bytes(m, -1),
    lambda m: cap.paged_kv_bytes(m, -1),
    lambda m: num_blocks_for_tokens(-1),
])
def test_negative_tokens_rejected(call):
    with pytest.raises(ValueError, match=re.escape("num_tokens must be an integer >= 0, got -1")):
        call(get_preset("llama-3-8b"))


def test_blocks_with_shared_prefix():
    # 64 requests x 1000 tokens: 63 blocks each. Sharing a 500-token prefix shares its
    # 31 full blocks once: 31 + 64 x (63 - 31) = 2,079.
    assert cap.blocks_with_shared_prefix(64, 1000, 0, 16) == 64 * 63
    assert cap.blocks_with_shared_prefix(64, 1000, 500, 16) == 31 + 64 * 32
    assert cap.blocks_with_shared_prefix(1, 1000, 1000, 16) == 63
    assert cap.blocks_with_shared_prefix(0, 1000, 500, 16) == 0
    with pytest.raises(ValueError, match=r"shared_prefix_len must be in \[0, num_tokens=10\]"):
        cap.blocks_with_shared_prefix(2, 10, 11)


def test_utilization_and_internal_waste():
    assert static_utilization([256, 512, 128], 1024) == pytest.approx(896 / 3072)
    assert paged_utilization([50], 16) == pytest.approx(50 / 64)
    assert paged_utilization([256, 512, 128], 16) == 1.0
    assert max_internal_waste_tokens(32) == 31
    assert expected_internal_waste_tokens(16) == 7.5
    with pytest.raises(ValueError, match=r"each in \[0, 1024\]"):
        static_utilization([2000], 1024)


# --- the memory budget -----------------------------------------------------------------------

def test_available_kv_bytes():
    # Block Manager tutorial §4.3: 80 x 0.9 - 17.5 - 2 - 1.5 = 51 (GiB).
    got = cap.available_kv_bytes(80 * GiB, 0.9, int(17.5 * GiB), 2 * GiB, int(1.5 * GiB))
    assert got == 51 * GiB


@pytest.mark.parametrize("util", [0, 1.3, -0.1, 1.0000001])
def test_gpu_memory_utilization_range(util):
    with pytest.raises(ValueError, match=re.escape(
            f"gpu_memory_utilization must be in (0, 1], got {util}")):
        cap.available_kv_bytes(80 * GiB, util, 0)


def test_negative_budget_names_the_biggest_term():
    with pytest.raises(ValueError, match=r"negative.*largest term is weight_bytes=78\.11 GiB"):
        cap.available_kv_bytes(80 * GiB, 0.92, 671 * 10**9 // 8, 2 * GiB)
    with pytest.raises(ValueError, match="largest term is activation_bytes"):
        cap.available_kv_bytes(10 * GiB, 0.5, 1 * GiB, 6 * GiB)


def test_zero_budget_gives_zero_blocks():
    assert cap.available_kv_bytes(10 * GiB, 0.5, 5 * GiB) == 0
    assert num_gpu_blocks(0, 2 * MiB) == 0


def test_num_gpu_blocks_floors():
    bb = cap.block_bytes(get_preset("llama-3-8b"))  # 2 MiB
    assert num_gpu_blocks(10 * bb, bb) == 10
    assert num_gpu_blocks(11 * bb - 1, bb) == 10
    assert num_gpu_blocks(56 * GiB, bb) == 56 * 1024 // 2  # 28,672
    with pytest.raises(ValueError, match="available_kv_bytes must be an integer >= 0, got -1"):
        num_gpu_blocks(-1, bb)


def test_tokens_and_max_concurrency():
    assert tokens_that_fit(3258, 16) == 52_128
    assert cap.max_concurrency(3258, 16, 32768) == pytest.approx(52_128 / 32_768)
    assert cap.max_concurrency(28_672, 16, 4096) == 112.0  # PagedAttention explained §4.2
    with pytest.raises(ValueError, match="max_model_len must be an integer >= 1, got 0"):
        cap.max_concurrency(10, 16, 0)


def test_context_parallel_capacity():
    assert cap.context_parallel_capacity(3258, 16, 4) == 3258 * 16 * 4 == 208_512
    assert cap.context_parallel_capacity(3258, 16, 1) == 52_128
    with pytest.raises(ValueError, match="context_parallel_size must be an integer >= 1"):
        cap.context_parallel_capacity(3258, 16, 0)


def test_num_cpu_blocks():
    bb = cap.block_bytes(get_preset("llama-3-8b"))  # 2 MiB
    assert num_cpu_blocks(4, bb) == 4 * 1024 // 2 == 2048
    assert num_cpu_blocks(0, bb) == 0
    assert num_cpu_blocks(4, 655_360) == 4 * GiB // 655_360 == 6553
    with pytest.raises(ValueError, match="swap_space must be a finite number >= 0, got -1"):
        num_cpu_blocks(-1, bb)


def test_plan_kv_cache_matches_the_steps():
    m = get_preset("llama-3-70b")
    b = cap.plan_kv_cache(m, 80, gpu_memory_utilization=0.9, tensor_parallel_size=4,
                          weight_gib=35, activation_gib=1, overhead_gib=0.5, swap_space=4,
                          context_parallel_size=2)
    block = 16 * 80 * 2 * 2 * 128 * 2  # 2 KV heads per rank: 1.25 MiB
    avail = 72 * GiB - 35 * GiB - GiB - GiB // 2
    assert b.block_bytes == block == 1_310_720
    assert b.available_kv_bytes == avail
    assert b.num_gpu_blocks == avail // block
    assert b.num_cpu_blocks == 4 * GiB // block
    assert b.num_gpu_tokens == 16 * (avail // block)
    assert b.context_capacity_tokens == 2 * b.num_gpu_tokens
    text = b.summary(max_model_len=32768)
    assert f"GPU KV cache size: {16 * (avail // block):,} tokens" in text
    conc = 16 * (avail // block) / 32768
    assert f"Maximum concurrency for 32,768 tokens per request: {conc:.2f}x" in text


def test_plan_kv_cache_default_weights_split_over_tp():
    m = get_preset("llama-3-8b")
    b = cap.plan_kv_cache(m, 80, tensor_parallel_size=2)
    assert b.weight_bytes == 8_030_261_248 * 2 // 2
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        cap.plan_kv_cache(m, 80, tensor_parallel_size=3)


def test_plan_kv_cache_too_small_gpu():
    with pytest.raises(ValueError, match="largest term is weight_bytes"):
        cap.plan_kv_cache(get_preset("llama-3-70b"), 80)  # 141 GB of weights on one GPU


# --- decode communication under context parallelism --------------------------------------------

def test_decode_comm_bytes_gqa():
    m = get_preset("llama-3-8b")
    c = cap.decode_comm_bytes(m, 1000, 4)
    assert c.query_bytes == 32 * 128 * 2
    assert c.partial_output_bytes == 32 * (128 * 2 + 4)
    assert c.move_kv_bytes == (1000 - 250) * 2 * 8 * 128 * 2  # 750 remote tokens, one layer
    assert cap.decode_comm_bytes(m, 1000, 1).move_kv_bytes == 0
    assert cap.decode_comm_bytes(m, 10, 4).move_kv_bytes == (10 - 3) * 4096  # rank 0 holds 3


def test_decode_comm_bytes_mla():
    c = cap.decode_comm_bytes(get_preset("deepseek-v3"), 208_512, 4)
    assert c.query_bytes == 128 * 576 * 2
    assert c.partial_output_bytes == 128 * (512 * 2 + 4)
    assert c.move_kv_bytes == 208_512 * 3 // 4 * 1152
    assert c.kv_to_query_ratio == pytest.approx(c.move_kv_bytes / c.query_bytes)


# --- presets and validation ------------------------------------------------------------------

def test_unknown_preset_lists_names():
    with pytest.raises(ValueError, match=r"unknown model preset 'gpt-2'; known presets: .*"
                                         r"Llama-3-8B.*DeepSeek-V3"):
        get_preset("gpt-2")


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_layers=0), "num_layers must be an integer >= 1, got 0"),
    (dict(head_dim=-4), "head_dim must be an integer >= 1, got -4"),
    (dict(num_kv_heads=3), "num_attention_heads=32 must be a multiple of num_kv_heads=3"),
    (dict(qk_rope_head_dim=64), "qk_rope_head_dim is an MLA field"),
    (dict(kv_lora_rank=512), "num_kv_heads must be 1, got 8"),
    (dict(param_bytes=0), "param_bytes must be > 0, got 0"),
])
def test_model_spec_validation(kwargs, message):
    base = dict(name="x", num_layers=32, num_attention_heads=32, num_kv_heads=8, head_dim=128,
                num_params=1000)
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelSpec(**{**base, **kwargs})


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(655_360) == "640.0 KiB"
    assert format_bytes(1_342_177_280) == "1.25 GiB"
    assert format_bytes(5 * MiB) == "5.0 MiB"
    assert format_bytes(1_124_352) == "1.07 MiB"
    assert format_bytes(-int(1.5 * GiB)) == "-1.5 GiB"
    assert format_bytes(3 * 1024 * GiB) == "3.0 TiB"


# --- properties -------------------------------------------------------------------------------

specs = st.sampled_from(sorted(PRESETS))
block_sizes = st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256])


@given(specs, block_sizes, st.floats(0.05, 1.0), st.floats(0.05, 1.0),
       st.integers(40, 200), st.integers(0, 30))
def test_num_gpu_blocks_monotone_in_utilization(name, bs, u1, u2, total_gib, weight_gib):
    spec = get_preset(name)
    lo, hi = sorted((u1, u2))
    blk = cap.block_bytes(spec, bs)

    def blocks(util: float) -> int:  # -1: the weights do not fit at all
        try:
            avail = cap.available_kv_bytes(total_gib * GiB, util, weight_gib * GiB)
        except ValueError:
            return -1
        return num_gpu_blocks(avail, blk)

    assert blocks(lo) <= blocks(hi)


@given(st.integers(0, 10**12), st.integers(1, 10**8), st.integers(1, 10**8))
def test_num_gpu_blocks_non_increasing_in_block_bytes(avail, b1, b2):
    small, big = sorted((b1, b2))
    assert num_gpu_blocks(avail, big) <= num_gpu_blocks(avail, small)


@given(specs, block_sizes, st.integers(0, 200 * GiB))
def test_tokens_that_fit_within_budget(name, bs, avail):
    spec = get_preset(name)
    blocks = num_gpu_blocks(avail, cap.block_bytes(spec, bs))
    tokens = tokens_that_fit(blocks, bs)
    per_token = cap.kv_bytes_per_token(spec)
    assert tokens == blocks * bs
    assert tokens <= avail / per_token
    assert avail / per_token - tokens < bs  # less than one block is left over


@given(specs, block_sizes, st.integers(0, 100_000))
def test_paged_holds_at_most_one_block_more(name, bs, n):
    spec = get_preset(name)
    paged, exact = cap.paged_kv_bytes(spec, n, bs), cap.contiguous_kv_bytes(spec, n)
    assert exact <= paged < exact + cap.block_bytes(spec, bs)
    assert math.ceil(n / bs) * bs * cap.kv_bytes_per_token(spec) == paged


@pytest.mark.parametrize("call, match", [
    (lambda: num_cpu_blocks(math.inf, 1024), r"swap_space must be a finite number >= 0, got inf"),
    (lambda: cap.plan_kv_cache(get_preset("llama-2-7b"), math.inf),
     r"total_gpu_memory_gib must be a finite number >= 0, got inf"),
    (lambda: cap.available_kv_bytes(80 * GiB, "0.9", 0),
     r"gpu_memory_utilization must be in \(0, 1\], got 0.9"),
    (lambda: get_preset(None), r"the preset name must be a str, one of Llama-2-7B"),
    (lambda: get_preset(7), r"the preset name must be a str"),
    (lambda: ModelSpec("x", 2, 2, 2, 8, 100, param_bytes=True), r"param_bytes .* got True"),
    (lambda: ModelSpec("x", 2, 2, 2, 8, 100, param_bytes=math.inf), r"param_bytes .* got inf"),
    (lambda: ModelSpec("x", 2, 2, 2, 8, 100, param_bytes="2"), r"param_bytes .* got '2'"),
    (lambda: static_utilization(["8"], 10), r"used_tokens must be integers >= 0; item 0 is '8'"),
    (lambda: static_utilization([8.7], 10), r"item 0 is 8.7"),
    (lambda: paged_utilization([math.inf]), r"item 0 is inf"),
    (lambda: paged_utilization([None]), r"item 0 is None"),
    (lambda: paged_utilization(5), r"used_tokens must be a list of token counts, got int")])
def test_sizing_refuses_nonsense_with_a_value_error_naming_it(call, match):
    """Each was a ``TypeError``/``AttributeError``/``OverflowError`` deep inside, or (a
    string, a float of tokens, an infinite budget) silently read as a number."""
    with pytest.raises(ValueError, match=match):
        call()
