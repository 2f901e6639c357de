"""Paged prefill / chunked prefill attention in Triton: packed queries, causal, over the cache.

A batch packs the new tokens of every sequence into ``query [num_tokens, num_heads, head_dim]``;
``query_start_loc [num_seqs + 1]`` says where each sequence's rows start. The new tokens' K/V
are already in the paged cache (``reshape_and_cache`` ran first, as in vLLM), so one loop over
the cache covers both the cached context (``context_len = seq_len - query_len`` tokens from
earlier steps or a prefix-cache hit) and the new tokens, with the causal rule
``key position <= context_len + query index``.

Sliding window (``SLIDING_WINDOW = W``, a compile-time constant, 0 for full attention, as in
vLLM 0.33.0's ``vllm/v1/attention/ops/triton_unified_attention.py``): the query at position
``p`` sees only the keys ``p - W < j <= p``. A program's loop starts at the tile that holds the
first key in the window of its earliest query, cut inside that key's block (vLLM prunes its
tiles the same way, ``compute_tile_loop_bounds`` in ``ops/triton_attention_helpers.py``), so a
block wholly before every window of the tile is never loaded: in a hybrid model its table slot
holds the null block (block 0, garbage). Slots of that first tile before the window are masked
out of the loads; keys inside the tile's windows but outside one row's window get ``-inf`` for
that row.

Grid ``(cdiv(max_query_len, BLOCK_Q), num_seqs, num_kv_heads)``. A program owns ``BLOCK_Q``
query tokens of one sequence times the ``GROUP_PAD`` query heads that share one KV head: row
``r`` of its ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows is token ``r // GROUP_PAD``, head
``r % GROUP_PAD`` (GQA packing, as in vLLM's Triton unified attention). Programs past a short
sequence's last query run no loop iteration and store nothing.
"""

from __future__ import annotations

import torch

from course_lib.device import BACKEND
from course_lib.kernels.launch import Launch
from course_lib.kernels.tiles import PrefillTiles, dot_precision, prefill_tiles
from course_lib.sizing.units import cdiv

if BACKEND.uses_triton:
    import triton
    import triton.language as tl

    from course_lib.kernels.paged_load import load_kv_tile, load_pages

    @triton.jit
    def _paged_prefill_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        qk_scale,                             # softmax scale * log2(e)
        stride_ot, stride_oh, stride_od,
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_bts, stride_btb,
        group,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, GROUP_PAD: tl.constexpr, TILE_N: tl.constexpr,
        HEAD_PAD: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
        SLIDING_WINDOW: tl.constexpr,         # W >= 1, or 0: full attention
    ):
        q_tile = tl.program_id(0)
        seq = tl.program_id(1)
        kv_head = tl.program_id(2)
        BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - q_len

        r = tl.arange(0, BLOCK_M)
        qi = q_tile * BLOCK_Q + r // GROUP_PAD               # query index within the sequence
        g = r % GROUP_PAD
        head = kv_head * group + g
        d = tl.arange(0, HEAD_PAD)
        d_mask = d < HEAD_DIM
        row_mask = (qi < q_len) & (g < group)
        q_row = (q_start + qi).to(tl.int64)
        q = tl.load(q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh
                    + d[None, :] * stride_qd, mask=row_mask[:, None] & d_mask[None, :],
                    other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        q_pos = context_len + qi                               # absolute position of each row

        # Keys up to the last query of this tile; none when the tile is past the sequence.
        last_q = tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
        kv_end = tl.where(q_tile * BLOCK_Q < q_len, context_len + last_q, 0)
        # With a window: keys from the first one in the window of the tile's earliest query.
        # The loop starts at the tile that holds it, aligned to the smaller of a tile and a
        # block (both powers of two), so inside its block: no block wholly before it (the
        # null block in a hybrid model) is loaded.
        loop_start = 0
        if SLIDING_WINDOW > 0:
            first_key = tl.maximum(context_len + q_tile * BLOCK_Q - SLIDING_WINDOW + 1, 0)
            ALIGN: tl.constexpr = TILE_N if TILE_N < BLOCK_SIZE else BLOCK_SIZE
            loop_start = first_key // ALIGN * ALIGN

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bts
        for tile_start in range(loop_start, kv_end, TILE_N):
            pos = tile_start + tl.arange(0, TILE_N)
            valid = pos < kv_end
            if SLIDING_WINDOW > 0:                                    # not the slots before it
                valid = valid & (pos >= first_key)
            page = load_pages(table, pos, valid, stride_btb, BLOCK_SIZE)
            k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, page, pos, valid, d, kv_head,
                                stride_kb, stride_ks, stride_kh, stride_kd,
                                stride_vb, stride_vs, stride_vh, stride_vd,
                                BLOCK_SIZE, HEAD_DIM, UPCAST)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            see = valid[None, :] & (pos[None, :] <= q_pos[:, None])   # causal [BLOCK_M, TILE_N]
            if SLIDING_WINDOW > 0:                                    # and p - W < j
                see = see & (pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
            s = tl.where(see, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # row that saw nothing yet
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh
                 + d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & d_mask[None, :])


LOG2_E = 1.4426950408889634


def prefill_launches(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                     max_seq_len: int, tiles: PrefillTiles | None = None,
                     out: torch.Tensor | None = None, *,
                     sliding_window: int | None = None) -> tuple[torch.Tensor, list[Launch]]:
    """Plan the prefill launch (see ``paged_prefill``): the output it fills and the launch."""
    assert sliding_window is None or sliding_window >= 1, sliding_window
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_seqs = block_tables.shape[0]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    if tiles is None:
        tiles = prefill_tiles(head_dim=head_dim, group=group, max_query_len=max_query_len,
                              max_seq_len=max_seq_len,
                              interpreted=BACKEND.interpreted or not query.is_cuda,
                              dtype_bytes=query.element_size())
    if out is None:
        out = torch.empty_like(query)
    # the kernel reads element i at ptr + i: strided views are copied here (a few ints)
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    grid = (cdiv(max_query_len, tiles.block_q), num_seqs, num_kv_heads)
    return out, [Launch(_paged_prefill_kernel, grid, (
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale * LOG2_E, *out.stride(), *query.stride(), *key_cache.stride(),
        *value_cache.stride(), *block_tables.stride(), group), dict(
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_M=tiles.block_m,
        GROUP_PAD=tiles.group_pad, TILE_N=tiles.tile_n, HEAD_PAD=tiles.head_pad,
        UPCAST=tiles.upcast, DOT_PRECISION=dot_precision(query.dtype),
        SLIDING_WINDOW=sliding_window or 0, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages))]


def paged_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                  max_seq_len: int, tiles: PrefillTiles | None = None,
                  out: torch.Tensor | None = None, *,
                  sliding_window: int | None = None) -> torch.Tensor:
    """Prefill / chunked-prefill / mixed-batch attention with the Triton kernel; no validation.

    ``max_query_len`` and ``max_seq_len`` are host-side bounds (no device sync). Returns
    ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``. ``sliding_window``: ``None``
    (full attention) or ``W >= 1``: the query at position ``p`` sees keys ``p - W < j <= p``.
    """
    out, launches = prefill_launches(query, key_cache, value_cache, block_tables, seq_lens,
                                     query_start_loc, scale, max_query_len, max_seq_len, tiles,
                                     out, sliding_window=sliding_window)
    for launch in launches:
        launch.run()
    return out
