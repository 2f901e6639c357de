"""The torch reference is itself right (checked against torch's SDPA on contiguous K/V), the
dispatch API validates and routes, the tile heuristics keep their promises, and the chapter's
three loops (the article's, two-pass, online) behave as the chapter says.

pytest only (no hypothesis): this module runs on a GPU machine with plain ``python3 -m pytest``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course_lib import kernels
from course_lib.device import BACKEND
from course_lib.kernels import batch, reference, tiles, walkthrough

pytestmark = pytest.mark.ch04


def sdpa(q, k, v, context_len):
    """torch's SDPA on one sequence: q [q_len, H, d], k/v [kv_len, KVH, d], causal offset."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    q_pos = context_len + torch.arange(q.shape[0])[:, None]
    mask = torch.arange(k.shape[0])[None, :] <= q_pos
    out = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                         v.transpose(0, 1).float(), attn_mask=mask)
    return out.transpose(0, 1)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_reference_equals_sdpa_on_contiguous_kv(block_size, group):
    b = batch.make_paged_batch([1, 7, 16, 29], [1, 3, 16, 9], num_heads=2 * group,
                               num_kv_heads=2, head_dim=16, block_size=block_size, seed=group)
    got = reference.paged_attention_ref(b.query, b.key_cache, b.value_cache, b.block_tables,
                                        b.seq_lens, b.query_start_loc)
    starts = b.query_start_loc.tolist()
    for s, n in enumerate(b.seq_lens.tolist()):
        q = b.query[starts[s]:starts[s + 1]]
        want = sdpa(q, b.keys[s], b.values[s], n - q.shape[0])
        torch.testing.assert_close(got[starts[s]:starts[s + 1]], want)


def test_gather_kv_returns_the_contiguous_tokens():
    b = batch.make_paged_batch([5, 17], block_size=8, seed=1)
    for s, n in enumerate(b.seq_lens.tolist()):
        k, v = reference.gather_kv(b.key_cache, b.value_cache, b.block_tables[s], n)
        assert torch.equal(k, b.keys[s]) and torch.equal(v, b.values[s])


def test_slot_mapping_follows_the_block_table():
    # the article's example: logical blocks 0, 1, 2 -> physical 7, 3, 12 with 16-token blocks
    assert reference.slot_mapping([7, 3, 12], [0, 15, 16, 33], 16) == [112, 127, 48, 193]
    with pytest.raises(ValueError, match="outside the 3 blocks"):
        reference.slot_mapping([7, 3, 12], [48], 16)


def test_merge_attn_states_equals_attention_over_the_union():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 10, generator=gen)
    values = torch.randn(10, 4, generator=gen)

    def attend(cols):
        s = scores[:, cols]
        return torch.softmax(s, -1) @ values[cols], torch.logsumexp(s, -1)

    out, lse = reference.merge_attn_states(*attend(slice(0, 4)), *attend(slice(4, 10)))
    want_out, want_lse = attend(slice(0, 10))
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    empty = torch.full((3,), float("-inf"))
    out2, _ = reference.merge_attn_states(want_out, want_lse, torch.zeros(3, 4), empty)
    torch.testing.assert_close(out2, want_out)


def test_seed_loop_is_wrong_and_both_fixes_are_right():
    b = batch.make_paged_batch([37], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                               seed=5)
    args = (b.query[0], b.key_cache, b.value_cache, b.block_tables[0].tolist(), 37)
    want = reference.paged_attention_ref(b.query, b.key_cache, b.value_cache, b.block_tables,
                                         b.seq_lens)[0]
    torch.testing.assert_close(walkthrough.two_pass_paged_attention(*args), want)
    torch.testing.assert_close(walkthrough.online_paged_attention(*args), want)
    article = walkthrough.article_paged_attention(*args)
    # softmax of a single score is 1: the article's loop sums the values
    torch.testing.assert_close(article, b.values[0].repeat_interleave(2, dim=1).sum(0))
    assert (article - want).abs().max() > 1.0


def test_paged_attention_dispatch_matches_reference_and_routes():
    b = batch.make_paged_batch([3, 20], [3, 4], block_size=8, seed=2, device=BACKEND.device)
    args = (b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.query_start_loc)
    want = reference.paged_attention_ref(*args)
    torch.testing.assert_close(kernels.paged_attention(*args), want, atol=1e-5, rtol=1e-5)
    small = kernels.choose_impl(b.query, b.key_cache, b.seq_lens)
    huge = kernels.choose_impl(b.query, b.key_cache, torch.tensor([1 << 20]))
    if BACKEND.uses_triton and not kernels.interpreter_incompatibility():
        assert small == kernels.TRITON
        assert huge == (kernels.REFERENCE if BACKEND.interpreted else kernels.TRITON)
    else:
        assert small == huge == kernels.REFERENCE


@pytest.mark.parametrize("change, message", [
    (dict(seq_lens=torch.tensor([3, 99], dtype=torch.int32)), "seq_len <= 24"),
    (dict(seq_lens=torch.tensor([2, 20], dtype=torch.int32)), "query_len 3, seq_len 2"),
    (dict(query_start_loc=torch.tensor([0, 3, 6], dtype=torch.int32)), "from 0 to 7"),
    (dict(key_cache=torch.zeros(9, 8, 3, 32)), "must both be"),
    (dict(query=torch.zeros(7, 3, 32)), "multiple"),
    (dict(block_tables=torch.tensor([[0, 1, 2], [3, 77, 5]], dtype=torch.int32)), "0..6"),
    (dict(block_tables=torch.zeros(2, 3)), "int32/int64"),
    (dict(block_tables=torch.tensor([[0, 1, 2], [3, -1, 5]], dtype=torch.int32)), "0..6"),
    (dict(query=torch.zeros(7, 4, 32, dtype=torch.int32),
          key_cache=torch.zeros(7, 8, 2, 32, dtype=torch.int32),
          value_cache=torch.zeros(7, 8, 2, 32, dtype=torch.int32)), "float16, bfloat16 or"),
    (dict(seq_lens=torch.tensor([3.0, 20.0])), "seq_lens must be an int32/int64"),
    (dict(query_start_loc=torch.tensor([0.0, 3.0, 7.0])), "query_start_loc must be an int32"),
    (dict(query=torch.zeros(0, 4, 32), block_tables=torch.zeros(0, 3, dtype=torch.int32),
          seq_lens=torch.zeros(0, dtype=torch.int32),
          query_start_loc=torch.zeros(1, dtype=torch.int32)), "empty batch"),
    # a host bound below the true maximum makes the kernels skip tokens: a wrong answer
    (dict(max_seq_len=3), "max_seq_len must be >= the batch's longest \\(20\\)"),
    (dict(max_query_len=1), "max_query_len must be >= the batch's longest \\(4\\)"),
    (dict(max_seq_len=0), "max_seq_len must be an integer >= 1"),
    (dict(max_query_len=2.5), "max_query_len must be an integer >= 1"),
    (dict(scale=float("nan")), "scale must be a finite number > 0"),
    (dict(scale="0.1"), "scale must be a finite number > 0"),
    (dict(key_cache=torch.zeros(7, 8, 2, 32, device="meta"),
          value_cache=torch.zeros(7, 8, 2, 32, device="meta")), "one device"),
    (dict(query=[[0.0]]), "query must be a torch.Tensor"),
])
def test_paged_attention_rejects_bad_input(change, message):
    b = batch.make_paged_batch([3, 20], [3, 4], block_size=8, seed=2)
    args = dict(query=b.query, key_cache=b.key_cache, value_cache=b.value_cache,
                block_tables=b.block_tables, seq_lens=b.seq_lens,
                query_start_loc=b.query_start_loc)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        kernels.paged_attention(**args)


def test_decode_tiles_split_long_contexts_for_small_batches():
    one = tiles.decode_tiles(head_dim=128, group=4, max_seq_len=32768, num_seqs=1,
                             num_kv_heads=8, interpreted=False)
    assert one.num_splits > 1 and one.tokens_per_split % one.tile_n == 0
    assert one.num_splits * one.tokens_per_split >= 32768
    assert one.group_pad >= 16 and one.head_pad == 128
    big = tiles.decode_tiles(head_dim=128, group=4, max_seq_len=4096, num_seqs=256,
                             num_kv_heads=8, interpreted=False)
    assert big.num_splits == 1
    # one sequence of 4096 tokens, 8 KV heads: more programs than a 132-SM GPU has SMs (8
    # programs would leave 124 idle), each split still two tiles or more
    short = tiles.decode_tiles(head_dim=128, group=4, max_seq_len=4096, num_seqs=1,
                               num_kv_heads=8, interpreted=False, num_sms=132)
    assert 8 * short.num_splits > 132
    assert short.tokens_per_split >= 2 * short.tile_n
    interp = tiles.decode_tiles(head_dim=24, group=3, max_seq_len=40, num_seqs=2,
                                num_kv_heads=1, interpreted=True)
    assert (interp.num_splits, interp.tile_n, interp.head_pad, interp.group_pad,
            interp.upcast) == (1, 64, 32, 4, True)


def test_prefill_tiles_pack_whole_groups():
    for group in (1, 3, 4, 8, 32):
        t = tiles.prefill_tiles(head_dim=128, group=group, max_query_len=100, max_seq_len=500,
                                interpreted=False)
        assert t.block_m % t.group_pad == 0 and t.block_q >= 1 and t.block_m >= 16
        assert t.group_pad >= group


def test_gather_kv_and_slot_mapping_reject_out_of_range_blocks():
    b = batch.make_paged_batch([5], block_size=4, seed=0)
    table = b.block_tables[0]
    with pytest.raises(ValueError, match="seq_len must be an integer in 0..8"):
        reference.gather_kv(b.key_cache, b.value_cache, table, 9)
    with pytest.raises(ValueError, match="seq_len must be an integer in 0..8"):
        reference.gather_kv(b.key_cache, b.value_cache, table, -1)
    with pytest.raises(ValueError, match="block table entries must be in 0..4"):
        reference.gather_kv(b.key_cache, b.value_cache, torch.tensor([0, 99]), 5)
    # a negative block would give a negative slot, which the cache ops skip as padding
    with pytest.raises(ValueError, match="must be a block number >= 0, got -3"):
        reference.slot_mapping([-3, 2], [0], 4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(seq_lens=[]), "at least one sequence"),
    (dict(seq_lens=[3], num_kv_heads=0), "num_kv_heads must be an integer >= 1"),
    (dict(seq_lens=[3], num_heads=3, num_kv_heads=2), "multiple of num_kv_heads"),
    (dict(seq_lens=[3], block_size=0), "block_size must be an integer >= 1"),
    (dict(seq_lens=[3], spare_blocks=-5), "spare_blocks must be an integer >= 0"),
])
def test_make_paged_batch_rejects_bad_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        batch.make_paged_batch(**kwargs)
