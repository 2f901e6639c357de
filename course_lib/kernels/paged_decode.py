"""Paged decode attention in Triton: split-K ("flash-decoding") plus a log-sum-exp reduce.

Decode has one new query token per sequence, so the work per sequence is a long, thin
dot product over its whole context. One program per (sequence, KV head) would leave most of a
GPU idle for small batches, so the context is cut into ``num_splits`` ranges:

1. ``_paged_decode_kernel`` — grid ``(num_seqs, num_kv_heads, num_splits)``. A program loads the
   query rows of every query head that shares its KV head (GQA: they form the M dimension of one
   ``tl.dot``), walks its range of the context ``TILE_N`` tokens at a time, looks up each
   token's physical block in the block table, and keeps an online softmax (running max ``m``,
   running sum ``l``, accumulator ``acc``). It writes its normalised partial output and its
   log-sum-exp ``lse = m + log2(l)`` (base 2: the kernel uses ``exp2``). With one split
   (``SPLIT`` false) it writes the output itself and step 2 is not launched.
2. ``_lse_reduce_kernel`` — grid ``(num_seqs, num_heads)``: weights each split's partial output
   by ``2^(lse_split - lse_max)``, normalised, and stores the result in the query's dtype.

What makes it fast on a GPU (``python -m course_lib.kernels.aot`` checks each point in the
compiled code): ``BLOCK_SIZE`` and ``HEAD_DIM`` are compile-time constants (shifts, not integer
divisions; no head-dim mask when it is a power of two); the block-table entries of the next tile
are loaded one iteration ahead, so the K/V loads of a tile wait on nothing loaded in the same
iteration and the pipeliner keeps two K/V tiles in flight (``num_stages=3``); 16-bit K/V move
as 16-byte asynchronous copies; the split count is sized from the GPU's SM count
(:func:`~course_lib.kernels.tiles.decode_tiles`). The wrapper plans its launches on the host
(:func:`decode_launches`) and never reads a device value.

Every stride is a kernel argument (no layout is assumed), page numbers are cast to int64 before
they multiply a stride (a 2^31-byte cache is small), and the K/V loads themselves are masked, so
slots past ``seq_len`` and blocks the table does not reach are never read: they may hold NaN.

Sliding window (``SLIDING_WINDOW = W``, a compile-time constant, 0 for full attention, as in
vLLM 0.33.0's ``vllm/v1/attention/ops/triton_unified_attention.py``): the query at position
``seq_len - 1`` sees the ``W`` keys from ``first_key = seq_len - W`` on. The splits share the
range that starts at the tile holding ``first_key`` (aligned to the smaller of a tile and a
block, so it starts inside ``first_key``'s block), so a block wholly before the window is never
loaded: in a hybrid model its table slot holds the null block (block 0, whose contents are
garbage; ``SlidingWindowManager.remove_skipped_blocks`` in
``vllm/v1/core/single_type_kv_cache_manager.py`` put it there). The slots of that first tile
before ``first_key`` are masked out of the loads and their scores are ``-inf``. The planner
sizes the splits for that range (at most ``W + BLOCK_SIZE - 1`` tokens), not for the context.
"""

from __future__ import annotations

import torch

from course_lib.device import BACKEND
from course_lib.kernels.launch import Launch
from course_lib.kernels.tiles import DecodeTiles, decode_tiles, dot_precision

if BACKEND.uses_triton:
    import triton
    import triton.language as tl

    from course_lib.kernels.paged_load import load_kv_tile, load_pages

    @triton.jit
    def _paged_decode_kernel(
        out_ptr, lse_ptr,                     # SPLIT: [num_seqs, num_heads, num_splits,
                                              # HEAD_PAD] f32 + lse; else the output itself
        q_ptr, k_cache_ptr, v_cache_ptr,      # q [num_seqs, num_heads, head_dim]
        block_tables_ptr, seq_lens_ptr,       # [num_seqs, max_blocks], [num_seqs] contiguous
        qk_scale,                             # softmax scale * log2(e)
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_bts, stride_btb,
        stride_os, stride_oh, stride_osp, stride_od,
        stride_ls, stride_lh,                 # lse: last dim contiguous
        group, tokens_per_split,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        TILE_N: tl.constexpr, HEAD_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
        SPLIT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
        SLIDING_WINDOW: tl.constexpr,         # W >= 1, or 0: full attention
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + seq)
        start = split * tokens_per_split
        if SLIDING_WINDOW > 0:                # the query (at seq_len - 1) sees W keys:
            first_key = tl.maximum(seq_len - SLIDING_WINDOW, 0)
            # the splits cut the range from the tile that holds first_key, aligned to the
            # smaller of a tile and a block (both powers of two): it starts in first_key's
            # block, so no block wholly before the window (the null block in a hybrid model)
            # is ever loaded, and every tile holds a key (its running max stays finite)
            ALIGN: tl.constexpr = TILE_N if TILE_N < BLOCK_SIZE else BLOCK_SIZE
            start += first_key // ALIGN * ALIGN
        end = tl.minimum(start + tokens_per_split, seq_len)

        g = tl.arange(0, GROUP_PAD)           # query head within the group
        d = tl.arange(0, HEAD_PAD)
        head = kv_head * group + g
        g_mask = g < group
        d_mask = d < HEAD_DIM
        q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh
                    + d[None, :] * stride_qd, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bts
        pos = start + tl.arange(0, TILE_N)
        page = load_pages(table, pos, pos < end, stride_btb, BLOCK_SIZE)
        for tile_start in range(start, end, TILE_N):
            pos = tile_start + tl.arange(0, TILE_N)               # token positions [TILE_N]
            valid = pos < end
            if SLIDING_WINDOW > 0:                                # not the slots before it
                valid = valid & (pos >= first_key)
            k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, page, pos, valid, d, kv_head,
                                stride_kb, stride_ks, stride_kh, stride_kd,
                                stride_vb, stride_vs, stride_vh, stride_vd,
                                BLOCK_SIZE, HEAD_DIM, UPCAST)
            # the next tile's pages, one tile ahead: the K/V loads above never wait for a
            # block-table load of their own iteration, so two tiles can be in flight
            page = load_pages(table, pos + TILE_N, pos + TILE_N < end, stride_btb, BLOCK_SIZE)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(valid[None, :], s, float("-inf"))        # [GROUP_PAD, TILE_N]
            m_new = tl.maximum(m_i, tl.max(s, 1))                 # finite: a tile has a token
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        has = l_i > 0                                             # False: split past seq_len
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        o_ptrs = (out_ptr + seq.to(tl.int64) * stride_os + split * stride_osp
                  + head[:, None] * stride_oh + d[None, :] * stride_od)
        o_mask = g_mask[:, None] & d_mask[None, :]
        if SPLIT:                             # a partial output and its log-sum-exp, reduced
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(o_ptrs, out, mask=o_mask)
            tl.store(lse_ptr + seq.to(tl.int64) * stride_ls + head * stride_lh + split, lse,
                     mask=g_mask)
        else:                                 # one split: the output itself, no reduce launch
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)

    @triton.jit
    def _lse_reduce_kernel(
        out_ptr, part_ptr, lse_ptr,
        stride_ot, stride_oh, stride_od,
        stride_ps, stride_ph, stride_psp,
        stride_ls, stride_lh,
        num_splits,
        SPLITS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        sp = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, HEAD_PAD)
        sp_mask = sp < num_splits
        d_mask = d < HEAD_DIM
        lse = tl.load(lse_ptr + seq * stride_ls + head * stride_lh + sp, mask=sp_mask,
                      other=float("-inf"))
        w = tl.exp2(lse - tl.max(lse, 0))                         # empty splits weigh 0
        w = w / tl.sum(w, 0)
        part = tl.load(part_ptr + seq * stride_ps + head * stride_ph + sp[:, None] * stride_psp
                       + d[None, :], mask=sp_mask[:, None] & d_mask[None, :], other=0.0)
        out = tl.sum(part * w[:, None], 0)
        tl.store(out_ptr + seq * stride_ot + head * stride_oh + d * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=d_mask)


LOG2_E = 1.4426950408889634


def positions_read(max_seq_len: int, block_size: int, sliding_window: int | None) -> int:
    """How many positions of a sequence the decode programs walk together: its context, or
    with a window ``W`` the range from the start of the block holding the first key in the
    window (``W + block_size - 1`` at most). The splits are sized for it."""
    if sliding_window is None:
        return max_seq_len
    return min(max_seq_len, sliding_window + block_size - 1)


def decode_launches(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    max_seq_len: int, tiles: DecodeTiles | None = None,
                    out: torch.Tensor | None = None, *,
                    sliding_window: int | None = None) -> tuple[torch.Tensor, list[Launch]]:
    """Plan the decode launches (see ``paged_decode``): returns the output tensor they fill and
    the launches, the split kernel then, with more than one split, the reduce kernel."""
    assert sliding_window is None or sliding_window >= 1, sliding_window
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads = key_cache.shape[:3]
    group = num_heads // num_kv_heads
    if tiles is None:
        num_sms = (torch.cuda.get_device_properties(query.device).multi_processor_count
                   if query.is_cuda else 1)
        tiles = decode_tiles(head_dim=head_dim, group=group,
                             max_seq_len=positions_read(max_seq_len, block_size, sliding_window),
                             num_seqs=num_seqs, num_kv_heads=num_kv_heads,
                             interpreted=BACKEND.interpreted or not query.is_cuda,
                             num_sms=num_sms)
    if out is None:
        out = torch.empty_like(query)
    seq_lens = seq_lens.contiguous()          # the kernel reads seq_lens[seq] at seq_lens + seq
    split = tiles.num_splits > 1
    if split:
        part = torch.empty(num_seqs, num_heads, tiles.num_splits, tiles.head_pad,
                           dtype=torch.float32, device=query.device)
        lse = torch.empty(num_seqs, num_heads, tiles.num_splits, dtype=torch.float32,
                          device=query.device)
        target, out_strides, lse_strides = part, (*part.stride()[:3], 1), lse.stride()[:2]
    else:                                     # the kernel writes the output; lse unused
        lse, target = out, out
        out_strides, lse_strides = (out.stride(0), out.stride(1), 0, out.stride(2)), (0, 0)
    launches = [Launch(_paged_decode_kernel, (num_seqs, num_kv_heads, tiles.num_splits), (
        target, lse, query, key_cache, value_cache, block_tables, seq_lens, scale * LOG2_E,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(),
        *out_strides, *lse_strides, group, tiles.tokens_per_split), dict(
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, TILE_N=tiles.tile_n, HEAD_PAD=tiles.head_pad,
        GROUP_PAD=tiles.group_pad, SPLIT=split, UPCAST=tiles.upcast,
        DOT_PRECISION=dot_precision(query.dtype), SLIDING_WINDOW=sliding_window or 0,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages))]
    if split:
        launches.append(Launch(_lse_reduce_kernel, (num_seqs, num_heads), (
            out, part, lse, *out.stride(), *part.stride()[:3], *lse.stride()[:2],
            tiles.num_splits), dict(SPLITS_PAD=tiles.splits_pad, HEAD_PAD=tiles.head_pad,
                                    HEAD_DIM=head_dim, num_warps=4, num_stages=1)))
    return out, launches


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 max_seq_len: int, tiles: DecodeTiles | None = None,
                 out: torch.Tensor | None = None, *,
                 sliding_window: int | None = None) -> torch.Tensor:
    """Decode attention with the Triton kernels; no validation (see ``kernels.paged_attention``).

    ``query [num_seqs, num_heads, head_dim]`` (one token per sequence). ``max_seq_len`` is a
    host-side upper bound of ``seq_lens`` (passed in to avoid a device sync). Returns
    ``[num_seqs, num_heads, head_dim]`` in ``query.dtype``. One launch when the context is not
    split (``tiles.num_splits == 1``), else the split kernel and the reduce kernel.
    ``sliding_window``: ``None`` (full attention) or ``W >= 1``: the query sees its last ``W``
    keys, itself included. ``tiles`` given by the caller must cover :func:`positions_read`.
    """
    out, launches = decode_launches(query, key_cache, value_cache, block_tables, seq_lens,
                                    scale, max_seq_len, tiles, out,
                                    sliding_window=sliding_window)
    for launch in launches:
        launch.run()
    return out
