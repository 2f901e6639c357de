"""The paged-attention Triton kernels equal the torch reference (interpreted on CPU, compiled on
CUDA): lengths 1, block_size - 1, block_size, block_size + 1 and longer; permuted block tables;
GQA 1/4/8; block sizes 8/16/32; fp32/fp16/bf16; NaN in every slot the kernel must not read.

pytest only (no hypothesis): this module runs on a GPU machine with plain ``python3 -m pytest``.
"""

from __future__ import annotations

import pytest
import torch

from course_lib.device import BACKEND
from course_lib.kernels import batch, interpreter_incompatibility, reference, tiles
from course_lib.sizing.units import cdiv

pytestmark = [pytest.mark.ch04,
              pytest.mark.skipif(not BACKEND.uses_triton, reason="needs Triton"),
              pytest.mark.skipif(interpreter_incompatibility() is not None,
                                 reason=str(interpreter_incompatibility()))]

if BACKEND.uses_triton:
    from course_lib.kernels.paged_decode import paged_decode
    from course_lib.kernels.paged_prefill import paged_prefill

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DEV = BACKEND.device


def lengths(block_size: int) -> list[int]:
    return [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]


def run_reference(b: batch.PagedBatch, decode: bool) -> torch.Tensor:
    return reference.paged_attention_ref(b.query, b.key_cache, b.value_cache, b.block_tables,
                                         b.seq_lens, None if decode else b.query_start_loc)


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert not got.isnan().any(), "the kernel read a NaN slot"
    torch.testing.assert_close(got.float(), want.float(), **TOL[want.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_equals_reference(block_size, group, dtype):
    b = batch.make_paged_batch(lengths(block_size), num_heads=2 * group, num_kv_heads=2,
                               head_dim=32, block_size=block_size, dtype=dtype,
                               seed=block_size * group, device=DEV)
    got = paged_decode(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                       32 ** -0.5, b.max_seq_len)
    assert_matches(got, run_reference(b, decode=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefill_equals_reference(block_size, group, dtype):
    # prefill from scratch (query_len == seq_len), chunked prefill over a cached context,
    # and decode tokens, packed in one batch
    seqs = lengths(block_size)
    queries = [1, block_size - 1, 3, block_size + 1, block_size + 2]
    b = batch.make_paged_batch(seqs, queries, num_heads=2 * group, num_kv_heads=2,
                               head_dim=32, block_size=block_size, dtype=dtype,
                               seed=100 + block_size * group, device=DEV)
    got = paged_prefill(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                        b.query_start_loc, 32 ** -0.5, b.max_query_len, b.max_seq_len)
    assert_matches(got, run_reference(b, decode=False))


@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_split_k_decode_merges_splits_exactly(num_splits):
    """GPU-style launch (several splits per sequence, small tiles) checked on any backend."""
    b = batch.make_paged_batch([1, 15, 16, 17, 150], num_heads=8, num_kv_heads=2,
                               head_dim=32, block_size=16, seed=num_splits, device=DEV)
    tile_n = 16                                                # tl.dot's minimum on a GPU
    per_split = cdiv(cdiv(150, tile_n), num_splits) * tile_n
    cfg = tiles.DecodeTiles(tile_n=tile_n, head_pad=32, group_pad=16,
                            num_splits=cdiv(150, per_split), tokens_per_split=per_split,
                            upcast=BACKEND.interpreted)
    assert cfg.num_splits == num_splits
    got = paged_decode(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                       32 ** -0.5, b.max_seq_len, tiles=cfg)
    assert_matches(got, run_reference(b, decode=True))


def test_gpu_tiles_on_any_backend_for_prefill():
    """The GPU's prefill tile shape (64 rows, padded groups), small KV tiles, any backend."""
    b = batch.make_paged_batch([9, 40, 33], [9, 20, 1], num_heads=4, num_kv_heads=1,
                               head_dim=24, block_size=8, seed=7, device=DEV)
    cfg = tiles.PrefillTiles(block_m=64, group_pad=4, tile_n=16, head_pad=32,
                             upcast=BACKEND.interpreted)
    got = paged_prefill(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                        b.query_start_loc, 24 ** -0.5, b.max_query_len, b.max_seq_len, tiles=cfg)
    assert_matches(got, run_reference(b, decode=False))


@pytest.mark.parametrize("decode", [True, False])
def test_garbage_outside_the_sequence_does_not_change_the_output(decode):
    """Free blocks, spare blocks and the tail of each last block hold NaN in one cache and
    large random values in the other: the outputs must be identical."""
    kwargs = dict(seq_lens=[3, 16, 21], query_lens=None if decode else [3, 5, 2],
                  num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, spare_blocks=4,
                  seed=3, device=DEV)
    nan_batch = batch.make_paged_batch(**kwargs)
    big_batch = batch.make_paged_batch(**kwargs, fill=1e4)
    out = []
    for b in (nan_batch, big_batch):
        if decode:
            out.append(paged_decode(b.query, b.key_cache, b.value_cache, b.block_tables,
                                    b.seq_lens, 0.25, b.max_seq_len))
        else:
            out.append(paged_prefill(b.query, b.key_cache, b.value_cache, b.block_tables,
                                     b.seq_lens, b.query_start_loc, 0.25, b.max_query_len,
                                     b.max_seq_len))
    assert not out[0].isnan().any()
    assert torch.equal(out[0], out[1])
    assert_matches(out[0], run_reference(nan_batch, decode))


def test_non_power_of_two_head_dim_and_strided_query():
    b = batch.make_paged_batch([5, 12], num_heads=6, num_kv_heads=3, head_dim=24,
                               block_size=8, seed=11, device=DEV)
    wide = torch.zeros(2, 6, 48, device=DEV)
    wide[:, :, ::2] = b.query                                  # stride 2 along head_dim
    query = wide[:, :, ::2]
    got = paged_decode(query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                       24 ** -0.5, b.max_seq_len)
    assert_matches(got, run_reference(b, decode=True))


@pytest.mark.parametrize("decode", [True, False])
def test_strided_seq_lens_and_query_start_loc(decode):
    """Metadata as views of a bigger tensor (a column, every other element) give the output of
    contiguous metadata: paged_attention copies them at the boundary."""
    from course_lib.kernels import paged_attention

    b = batch.make_paged_batch([5, 40, 17], None if decode else [5, 3, 17], block_size=8,
                               seed=12, device=DEV)
    lens = torch.stack([b.seq_lens, b.seq_lens * 7], 1)[:, 0]            # stride 2
    assert lens.stride(0) == 2
    qsl = None
    if not decode:
        qsl = torch.stack([b.query_start_loc, b.query_start_loc + 100], 1)[:, 0]
        assert qsl.stride(0) == 2
    got = paged_attention(b.query, b.key_cache, b.value_cache, b.block_tables, lens, qsl,
                          impl="triton")
    assert_matches(got, run_reference(b, decode))


def test_decode_without_split_is_one_launch_and_with_splits_two():
    """One split: the kernel writes the output itself, no reduce launch."""
    from course_lib.kernels.paged_decode import decode_launches

    b = batch.make_paged_batch([5, 40], block_size=8, seed=13, device=DEV)
    one = tiles.DecodeTiles(tile_n=16, head_pad=32, group_pad=2, num_splits=1,
                            tokens_per_split=48, upcast=True)
    two = tiles.DecodeTiles(tile_n=16, head_pad=32, group_pad=2, num_splits=2,
                            tokens_per_split=32, upcast=True)
    for cfg, launches in ((one, 1), (two, 2)):
        out, planned = decode_launches(b.query, b.key_cache, b.value_cache, b.block_tables,
                                       b.seq_lens, 32 ** -0.5, b.max_seq_len, cfg)
        assert len(planned) == launches
        for launch in planned:
            launch.run()
        assert_matches(out, run_reference(b, decode=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_realistic_shapes_on_gpu(dtype):
    """head_dim 128, GQA 4, long and ragged contexts: the heuristics pick several splits."""
    b = batch.make_paged_batch([1, 15, 16, 17, 700, 3001], [1] * 6, num_heads=32,
                               num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype,
                               seed=9, device="cuda")
    cfg = tiles.decode_tiles(head_dim=128, group=4, max_seq_len=3001, num_seqs=6,
                             num_kv_heads=8, interpreted=False)
    assert cfg.num_splits > 1
    got = paged_decode(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                       128 ** -0.5, 3001)
    assert_matches(got, run_reference(b, decode=True))
    p = batch.make_paged_batch([300, 1000, 77], [300, 129, 1], num_heads=32, num_kv_heads=8,
                               head_dim=128, block_size=16, dtype=dtype, seed=10,
                               device="cuda")
    got = paged_prefill(p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens,
                        p.query_start_loc, 128 ** -0.5, p.max_query_len, p.max_seq_len)
    assert_matches(got, run_reference(p, decode=False))
