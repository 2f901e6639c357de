"""MLA: the latent cache's size, and absorbed attention == expanded MHA."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course_lib import capacity as cap
from course_lib.parallel import mla
from course_lib.parallel.merge import merge_partials, split_ranges
from course_lib.sizing.models import get_preset

pytestmark = pytest.mark.ch09

V3 = get_preset("deepseek-v3")


def test_deepseek_v3_latent_is_61_x_1152_bytes_per_token():
    assert mla.latent_bytes_per_token(V3) == 61 * 1152 == 70_272
    assert mla.latent_bytes_per_token(V3) == cap.kv_bytes_per_token(V3)


def test_tp_does_not_shrink_mla_but_shrinks_gqa():
    by_tp = mla.cache_bytes_by_tp(V3, [1, 2, 4, 8, 16])
    assert set(by_tp.values()) == {70_272}
    gqa = mla.cache_bytes_by_tp(get_preset("llama-3-70b"), [1, 2, 4, 8])
    assert gqa == {1: 327_680, 2: 163_840, 4: 81_920, 8: 40_960}
    with pytest.raises(ValueError, match="not MLA"):
        mla.latent_bytes_per_token(get_preset("llama-3-8b"))
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        mla.latent_bytes_per_token(V3, 3)


def test_expanded_cache_would_be_71x_bigger():
    assert mla.expanded_mha_bytes_per_token(V3) == 61 * 128 * (192 + 128) * 2
    assert mla.expanded_mha_bytes_per_token(V3) // mla.latent_bytes_per_token(V3) == 71


@given(st.integers(1, 4), st.integers(1, 24), st.sampled_from([2, 4, 8]),
       st.integers(0, 1000), st.integers(1, 30))
def test_absorbed_equals_expanded(heads, d_c, d_rope, seed, n):
    cfg = mla.MLAConfig(hidden_size=24, num_heads=heads, kv_lora_rank=d_c,
                        qk_rope_head_dim=d_rope, qk_nope_head_dim=6, v_head_dim=5)
    d = mla.demo(cfg, num_tokens=n, seed=seed)
    assert d.expanded.shape == d.absorbed.shape == (24,)
    torch.testing.assert_close(d.absorbed, d.expanded, rtol=0, atol=1e-12)


def test_absorbed_equals_expanded_in_fp32():
    d = mla.demo(mla.MLAConfig(), num_tokens=50, seed=4, dtype=torch.float32)
    assert d.absorbed.dtype == torch.float32
    torch.testing.assert_close(d.absorbed, d.expanded, rtol=1e-4, atol=1e-5)
    assert (d.cached_values_per_token, d.expanded_values_per_token) == (20, 80)


def test_rope_is_why_the_rope_key_is_cached_apart():
    """Rotating by positions changes scores with position: it cannot live in a fixed weight."""
    x = torch.randn(1, 8, dtype=torch.float64)
    a, b = mla.rope(x, torch.tensor([0])), mla.rope(x, torch.tensor([5]))
    torch.testing.assert_close(a, x)
    assert not torch.allclose(a, b)
    torch.testing.assert_close(a.norm(), b.norm())     # a rotation keeps the length


def test_context_parallel_mla_merges_latent_partials():
    """Split the latent cache by tokens over 3 'ranks': merged o_lat gives the same output."""
    cfg = mla.MLAConfig()
    w = mla.MLAWeights.random(cfg, seed=2)
    hidden = torch.randn(17, cfg.hidden_size, dtype=torch.float64)
    c_kv, k_rope = mla.latent_cache(w, hidden, torch.arange(17))
    q_nope, q_rope = mla.query(cfg, w, hidden[-1], 16)
    full, _, _ = mla.attend_absorbed(cfg, w, q_nope, q_rope, c_kv, k_rope)
    parts = [mla.attend_absorbed(cfg, w, q_nope, q_rope, c_kv[a:b], k_rope[a:b])
             for a, b in split_ranges(17, 3)]
    o_lat, _ = merge_partials([p[1] for p in parts], [p[2] for p in parts])
    torch.testing.assert_close(mla.output_from_latent(w, o_lat), full, rtol=0, atol=1e-12)


def test_mla_config_and_demo_reject_bad_sizes():
    with pytest.raises(ValueError, match="num_heads must be an integer >= 1, got 0"):
        mla.MLAConfig(num_heads=0)
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        mla.MLAConfig(qk_rope_head_dim=3)
    with pytest.raises(ValueError, match="num_tokens must be an integer >= 0, got -1"):
        mla.demo(num_tokens=-1)
