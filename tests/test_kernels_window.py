"""Sliding-window attention in every backend: the query at position ``p`` sees the keys
``p - W < j <= p`` (vLLM's ``sliding_window = W``), and nothing before the window is ever read.

Each batch is laid out as a hybrid model's sliding-window layer holds it: the table slots of
blocks wholly before the window of a sequence's first new token point at the null block (block
0, all NaN, as vLLM's ``SlidingWindowManager.remove_skipped_blocks`` leaves them), every other
slot before that window holds NaN, and so do the blocks no table reaches and the tails past each
sequence. A kernel that starts its loop at block 0, or forgets the window, reads NaN: the
last tests show it does (the check can fail). Windows smaller than, equal to and larger than
the contexts; every block size the course allows (powers of two up to 256); decode, prefill
from scratch, chunked prefill starting mid-sequence; GQA 1/4/8; fp32/fp16/bf16.

pytest only (no hypothesis): this module runs on a GPU machine with plain ``python3 -m pytest``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from course_lib.device import BACKEND
from course_lib.kernels import (
    batch,
    check_sliding_window,
    interpreter_incompatibility,
    paged_attention,
    reference,
    tiles,
)
from course_lib.kernels.backends import get_attn_backend
from course_lib.kernels.batched import paged_attention_batched
from course_lib.sizing.units import cdiv

pytestmark = pytest.mark.ch04
torch.set_num_threads(1)
TRITON_RUNS = BACKEND.uses_triton and interpreter_incompatibility() is None
needs_triton = pytest.mark.skipif(not TRITON_RUNS,
                                  reason=interpreter_incompatibility() or "needs Triton")

if BACKEND.uses_triton:
    from course_lib.kernels.paged_decode import paged_decode
    from course_lib.kernels.paged_prefill import paged_prefill

DEV = BACKEND.device
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]     # sizing.blocks.check_block_size's range


def windowed(b: batch.PagedBatch, window: int) -> batch.PagedBatch:
    """``b`` as a sliding-window layer of a hybrid model holds it (see the module docstring):
    a NaN null block is prepended as block 0 (the other blocks shift by one), the table slots
    of blocks wholly before the window of each sequence's first new token point at it, and
    every other slot outside the sequence or before that window holds NaN."""
    block_size = b.key_cache.shape[1]
    nan_block = torch.full_like(b.key_cache[:1], float("nan"))
    key_cache = torch.cat([nan_block, b.key_cache])
    value_cache = torch.cat([nan_block, b.value_cache])
    tables = torch.where(b.block_tables >= 0, b.block_tables + 1, -1)
    starts = b.query_start_loc.tolist()
    for s, seq_len in enumerate(b.seq_lens.tolist()):
        context_len = seq_len - (starts[s + 1] - starts[s])
        first_key = max(0, context_len - window + 1)
        for pos in range(first_key):                  # every key before the window
            block = int(tables[s, pos // block_size])
            key_cache[block, pos % block_size] = float("nan")
            value_cache[block, pos % block_size] = float("nan")
        tables[s, :first_key // block_size] = 0       # blocks wholly before it: null block
    return b._replace(key_cache=key_cache, value_cache=value_cache, block_tables=tables)


def make_batch(block_size: int, window: int, decode: bool, *, group: int = 1,
               dtype: torch.dtype = torch.float32, seed: int = 0) -> batch.PagedBatch:
    """Contexts shorter than, equal to and longer than ``window`` (by less than a block and by
    several, the window's first key at the start or past the middle of its block), so one
    launch holds all three cases; prefill packs a prefill from scratch (up to 24 tokens: the
    interpreter's time grows with the queries), a decode token and chunks that start
    mid-sequence."""
    w, bs = window, block_size
    seq_lens = [max(1, w - 1), w, w + 1, w + bs + bs // 2 + 1, w + 3 * bs + 2]
    query_lens = None if decode else [min(seq_lens[0], 24), 1, min(3, w + 1), min(bs + 1, 24),
                                      min(5, w)]
    b = batch.make_paged_batch(seq_lens, query_lens, num_heads=2 * group, num_kv_heads=2,
                               head_dim=16, block_size=bs, dtype=dtype, seed=seed, device=DEV)
    return windowed(b, window)


def qsl(b: batch.PagedBatch, decode: bool) -> torch.Tensor | None:
    return None if decode else b.query_start_loc


def run_kernel(b: batch.PagedBatch, decode: bool, window: int | None,
               cfg: tiles.DecodeTiles | tiles.PrefillTiles | None = None) -> torch.Tensor:
    scale = b.query.shape[-1] ** -0.5
    if decode:
        return paged_decode(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                            scale, b.max_seq_len, cfg, sliding_window=window)
    return paged_prefill(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                         b.query_start_loc, scale, b.max_query_len, b.max_seq_len, cfg,
                         sliding_window=window)


def run_reference(b: batch.PagedBatch, decode: bool, window: int | None) -> torch.Tensor:
    return reference.paged_attention_ref(b.query, b.key_cache, b.value_cache, b.block_tables,
                                         b.seq_lens, qsl(b, decode), sliding_window=window)


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert not want.isnan().any(), "the reference read a slot outside the window"
    assert not got.isnan().any(), "the kernel read a slot outside the window"
    torch.testing.assert_close(got.float(), want.float(), **TOL[want.dtype])


def windows(block_size: int) -> list[int]:
    """One key; less than a block; a few blocks and a bit (a partial first block)."""
    return sorted({1, block_size // 2 + 1, 2 * block_size + 3})


# --- the spec ------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [1, 5, 8, 13, 40])
def test_reference_window_equals_sdpa_with_the_window_mask(window):
    """The reference (gathering from the window's first key only) equals torch's SDPA over the
    whole contiguous K/V with the mask ``p - W < j <= p``."""
    b = batch.make_paged_batch([3, 8, 13, 30], [3, 1, 4, 7], num_heads=8, num_kv_heads=2,
                               head_dim=16, block_size=4, seed=window)
    got = run_reference(windowed(b, window), False, window)
    starts = b.query_start_loc.tolist()
    for s, n in enumerate(b.seq_lens.tolist()):
        q = b.query[starts[s]:starts[s + 1]]
        k = b.keys[s].repeat_interleave(4, dim=1)
        v = b.values[s].repeat_interleave(4, dim=1)
        p = n - q.shape[0] + torch.arange(q.shape[0])[:, None]
        j = torch.arange(n)[None, :]
        mask = (j <= p) & (j > p - window)
        want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                              v.transpose(0, 1), attn_mask=mask)
        torch.testing.assert_close(got[starts[s]:starts[s + 1]], want.transpose(0, 1))


def test_gather_kv_from_a_start_reads_no_block_before_it():
    b = batch.make_paged_batch([21], block_size=4, seed=2)
    table = b.block_tables[0].clone()
    table[:2] = 10 ** 6                       # blocks 0 and 1: not even a valid block number
    k, v = reference.gather_kv(b.key_cache, b.value_cache, table, 21, start=9)
    assert torch.equal(k, b.keys[0][9:]) and torch.equal(v, b.values[0][9:])
    with pytest.raises(ValueError, match="block table entries"):
        reference.gather_kv(b.key_cache, b.value_cache, table, 21, start=7)
    with pytest.raises(ValueError, match="start must be an integer in 0..21"):
        reference.gather_kv(b.key_cache, b.value_cache, table, 21, start=22)


# --- the Triton kernels against the spec ----------------------------------------------------

@needs_triton
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_triton_window_equals_reference_with_nan_outside(block_size, decode):
    for i, window in enumerate(windows(block_size)):
        group = (1, 4, 8)[(BLOCK_SIZES.index(block_size) + i) % 3]
        b = make_batch(block_size, window, decode, group=group, seed=block_size + i)
        assert_matches(run_kernel(b, decode, window), run_reference(b, decode, window))



@needs_triton
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_window_in_16_bits(dtype, group, decode):
    b = make_batch(16, 21, decode, group=group, dtype=dtype, seed=group)
    assert_matches(run_kernel(b, decode, 21), run_reference(b, decode, 21))


@needs_triton
@pytest.mark.parametrize("block_size,num_splits", [(8, 2), (8, 3), (64, 3)])
def test_split_k_decode_splits_the_window_not_the_context(block_size, num_splits):
    """GPU-style decode launch (several splits, 16-token tiles, smaller or bigger than a
    block): the splits cut the range from the tile holding the window's first key, which the
    planner sizes (W + block_size - 1 at most); no tile lies wholly before the window."""
    window = 80
    b = make_batch(block_size, window, True, group=4, seed=num_splits)
    span = window + block_size - 1
    per_split = cdiv(cdiv(span, 16), num_splits) * 16
    cfg = tiles.DecodeTiles(tile_n=16, head_pad=16, group_pad=16,
                            num_splits=cdiv(span, per_split), tokens_per_split=per_split,
                            upcast=BACKEND.interpreted)
    assert cfg.num_splits == num_splits and cfg.num_splits * per_split < b.max_seq_len
    assert_matches(run_kernel(b, True, window, cfg), run_reference(b, True, window))


@needs_triton
@pytest.mark.parametrize("block_size", [8, 64])
def test_gpu_tiles_on_any_backend_for_windowed_prefill(block_size):
    """The GPU's prefill tile shape (64 rows, padded groups) with 16-token K/V tiles, bigger or
    smaller than a block: the loop starts at the tile holding the window's first key."""
    window = 37
    b = make_batch(block_size, window, False, group=4, seed=block_size)
    cfg = tiles.PrefillTiles(block_m=64, group_pad=4, tile_n=16, head_pad=16,
                             upcast=BACKEND.interpreted)
    assert_matches(run_kernel(b, False, window, cfg), run_reference(b, False, window))


@needs_triton
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_window_of_none_or_past_the_context_is_full_attention_exactly(decode):
    """On an ordinary batch (NaN only outside the sequences), a window that reaches back to
    position 0 for every query changes nothing: the same bits as full attention."""
    b = batch.make_paged_batch([3, 16, 21], None if decode else [3, 5, 2], num_heads=8,
                               num_kv_heads=2, head_dim=16, block_size=8, seed=4, device=DEV)
    full = run_kernel(b, decode, None)
    assert not full.isnan().any()
    for window in (b.max_seq_len, b.max_seq_len + 1, 10 ** 6):
        assert torch.equal(run_kernel(b, decode, window), full)
        assert torch.equal(run_reference(b, decode, window), run_reference(b, decode, None))



# --- every backend --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["reference", "torch", "triton"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_every_backend_applies_the_window(name, decode):
    """What the model calls: each backend's ``paged_attention`` with ``sliding_window``,
    ``validate=False`` and host maxima, as the layers call it."""
    if name == "triton" and not TRITON_RUNS:
        pytest.skip("needs Triton")
    window = 11
    b = make_batch(4, window, decode, group=4, seed=7)
    attn = get_attn_backend(name, DEV)
    got = attn.paged_attention(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                               b.query_start_loc, b.query.shape[-1] ** -0.5,
                               max_query_len=b.max_query_len, max_seq_len=b.max_seq_len,
                               validate=False, sliding_window=window)
    assert_matches(got, run_reference(b, decode, window))


def test_batched_path_keeps_decodes_and_prefills_apart_with_a_window():
    """A mixed batch goes through the batched path in two parts: both get the window."""
    window = 6
    b = make_batch(4, window, False, group=2, seed=8)
    got = paged_attention_batched(b.query, b.key_cache, b.value_cache, b.block_tables,
                                  b.seq_lens, b.query_start_loc, 0.25, sliding_window=window)
    want = reference.paged_attention_ref(b.query, b.key_cache, b.value_cache, b.block_tables,
                                         b.seq_lens, b.query_start_loc, 0.25,
                                         sliding_window=window)
    assert_matches(got, want)


# --- the doors ------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "8", [4]])
def test_a_bad_window_is_refused_at_every_door(bad):
    b = batch.make_paged_batch([5, 9], block_size=4, seed=1, device=DEV)
    args = (b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens)
    with pytest.raises(ValueError, match=r"sliding_window must be None .* integer >= 1"):
        check_sliding_window(bad)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(*args, impl="reference", sliding_window=bad)
    if TRITON_RUNS:
        with pytest.raises(ValueError, match="sliding_window"):
            paged_attention(*args, impl="triton", sliding_window=bad)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention_batched(*args, b.query_start_loc, 0.5, sliding_window=bad)


def test_a_numpy_window_is_taken_by_value():
    assert check_sliding_window(np.int64(7)) == 7 and type(check_sliding_window(7)) is int
    assert check_sliding_window(None) is None
    b = make_batch(4, 7, True, seed=3)
    got = paged_attention(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                          impl="reference", sliding_window=np.int64(7))
    assert_matches(got, run_reference(b, True, 7))


# --- the checks can fail --------------------------------------------------------------------

@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_forgetting_the_window_reads_the_null_block(decode):
    """The same NaN-filled batches without the window (a kernel that starts at block 0 and
    masks nothing) read NaN: the tests above would fail on such a kernel. And a window of
    one less key is another result: the tests compare the right window."""
    window = 9
    b = make_batch(4, window, decode, group=4, seed=5)
    if TRITON_RUNS:
        assert run_kernel(b, decode, None).isnan().any()
        off_by_one = run_kernel(b, decode, window - 1)
        assert not off_by_one.isnan().any()
        assert not torch.allclose(off_by_one, run_reference(b, decode, window), atol=1e-3)
    assert run_reference(b, decode, None).isnan().any()
    for name in ("torch", "reference"):
        attn = get_attn_backend(name)
        assert attn.paged_attention(b.query, b.key_cache, b.value_cache, b.block_tables,
                                    b.seq_lens, b.query_start_loc, 0.25).isnan().any()
