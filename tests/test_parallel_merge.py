"""The log-sum-exp merge of partial attention (course_lib.parallel.merge), single process."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course_lib.kernels.reference import dense_attention, merge_attn_states
from course_lib.parallel.merge import merge_partials, partial_attention, split_ranges

pytestmark = pytest.mark.ch09


def problem(n: int, heads: int = 4, kv_heads: int = 2, d: int = 8, dv: int = 8,
            dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, d, generator=g, dtype=torch.float64).to(dtype)
    k = (3 * torch.randn(n, kv_heads, d, generator=g, dtype=torch.float64)).to(dtype)
    v = torch.randn(n, kv_heads, dv, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


@st.composite
def splits(draw):
    """A token count and 1-4 contiguous ranges covering it; ranges may be empty."""
    n = draw(st.integers(1, 40))
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=0, max_size=3)))
    bounds = [0, *cuts, n]
    return n, list(zip(bounds, bounds[1:], strict=False)), draw(st.integers(0, 10_000))


@given(splits())
def test_any_split_merges_to_full_attention_fp64(case):
    n, ranges, seed = case
    q, k, v = problem(n, seed=seed)
    full, full_lse = partial_attention(q, k, v)
    parts = [partial_attention(q, k[a:b], v[a:b]) for a, b in ranges]
    out, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    torch.testing.assert_close(out, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, full_lse, rtol=0, atol=1e-12)


@given(splits())
def test_any_split_merges_to_full_attention_fp32(case):
    n, ranges, seed = case
    q, k, v = problem(n, seed=seed, dtype=torch.float32)
    parts = [partial_attention(q, k[a:b], v[a:b]) for a, b in ranges]
    out, _ = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    # the kernels' own reference (GQA, float32) is the independent ground truth
    want = dense_attention(q[None], k, v, q.shape[1] ** -0.5, context_len=n - 1)[0]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@given(splits(), st.randoms(use_true_random=False))
def test_merge_is_order_independent_and_associative(case, rnd):
    n, ranges, seed = case
    q, k, v = problem(n, seed=seed)
    parts = [partial_attention(q, k[a:b], v[a:b]) for a, b in ranges]
    want, want_lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    shuffled = parts[:]
    rnd.shuffle(shuffled)
    acc_out, acc_lse = shuffled[0]
    for o, lse in shuffled[1:]:                 # a left fold of pairwise merges, any order
        acc_out, acc_lse = merge_attn_states(acc_out, acc_lse, o, lse)
    torch.testing.assert_close(acc_out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(acc_lse, want_lse, rtol=0, atol=1e-12)


def test_empty_pieces_weigh_nothing_and_all_empty_is_not_nan():
    q, k, v = problem(5)
    empty = partial_attention(q, k[:0], v[:0])
    assert torch.equal(empty[0], torch.zeros(4, 8, dtype=torch.float64))
    assert torch.isinf(empty[1]).all() and (empty[1] < 0).all()
    full = partial_attention(q, k, v)
    out, lse = merge_partials([empty[0], full[0], empty[0]], [empty[1], full[1], empty[1]])
    torch.testing.assert_close(out, full[0], rtol=0, atol=0)
    out, lse = merge_partials([empty[0]] * 3, [empty[1]] * 3)
    assert not out.isnan().any() and torch.equal(out, torch.zeros_like(out))
    assert torch.isinf(lse).all()


def test_value_width_may_differ_from_key_width():
    q, k, v = problem(7, heads=3, kv_heads=1, d=10, dv=6)
    a = partial_attention(q, k[:3], v[:3])
    b = partial_attention(q, k[3:], v[3:])
    out, _ = merge_partials([a[0], b[0]], [a[1], b[1]])
    assert out.shape == (3, 6)
    torch.testing.assert_close(out, partial_attention(q, k, v)[0], rtol=0, atol=1e-12)


def test_a_naive_average_would_be_wrong():
    """The LSE weights matter: averaging the pieces' outputs is not attention."""
    q, k, v = problem(12)
    a, b = partial_attention(q, k[:3], v[:3]), partial_attention(q, k[3:], v[3:])
    assert not torch.allclose((a[0] + b[0]) / 2, partial_attention(q, k, v)[0], atol=1e-3)


def test_bad_shapes_raise_value_error():
    q, k, v = problem(4)
    with pytest.raises(ValueError, match="shapes"):
        partial_attention(q, k[:, :1].expand(4, 3, 8), v)
    with pytest.raises(ValueError, match="outs must be"):
        merge_partials(torch.zeros(2, 4, 8), torch.zeros(3, 4))


def test_split_ranges_matches_the_seed_layout():
    assert split_ranges(16, 4) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert split_ranges(2, 4) == [(0, 0), (0, 1), (1, 1), (1, 2)]
    r = split_ranges(1001, 3)
    assert r[0][0] == 0 and r[-1][1] == 1001 and all(b - a in (333, 334) for a, b in r)
    with pytest.raises(ValueError, match="cp_size"):
        split_ranges(10, 0)
    with pytest.raises(ValueError, match="num_tokens"):
        split_ranges(-1, 2)


def test_merge_and_partial_attention_reject_bad_input():
    q, k, v = torch.randn(2, 4), torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    with pytest.raises(ValueError, match="at least one partial result"):
        merge_partials([], [])
    for scale in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            partial_attention(q, k, v, scale)
    with pytest.raises(ValueError, match="heads must be a multiple of KV heads"):
        partial_attention(q, k[:, :0], v[:, :0])
