"""The one step every paged kernel shares: load a tile of keys and values through a block table.

Token position ``pos`` of a sequence lives in physical block ``table[pos // BLOCK_SIZE]`` at
offset ``pos % BLOCK_SIZE``. Two helpers, because a kernel wants them at different times:

* :func:`load_pages` reads the tile's block-table entries. The decode kernel calls it one tile
  ahead (the pages of tile ``i + 1`` are loaded while tile ``i`` computes), so that the K/V
  loads of a tile depend on nothing loaded in the same loop iteration and Triton's pipeliner
  can keep two K/V tiles in flight.
* :func:`load_kv_tile` reads the keys and values of those pages.

``BLOCK_SIZE`` and ``HEAD_DIM`` are compile-time constants: ``pos // BLOCK_SIZE`` becomes a shift
and the head-dim mask disappears when ``HEAD_DIM`` is a power of two. Page numbers are cast to
int64 before they multiply a stride (a 2^31-byte cache is small), and the loads are masked with
``valid``: slots past the sequence, and blocks its table does not reach, are never read (they
may hold NaN).
"""

from __future__ import annotations

from course_lib.device import BACKEND

if BACKEND.uses_triton:
    import triton
    import triton.language as tl

    @triton.jit
    def load_pages(table, pos, valid, stride_btb, BLOCK_SIZE: tl.constexpr):
        """Physical block of each position ``pos [TILE_N]``, int64 (0 where not ``valid``)."""
        page = tl.load(table + (pos // BLOCK_SIZE) * stride_btb, mask=valid, other=0)
        return page.to(tl.int64)                              # before any stride product

    @triton.jit
    def load_kv_tile(k_cache_ptr, v_cache_ptr, page, pos, valid, d, kv_head,
                     stride_kb, stride_ks, stride_kh, stride_kd,
                     stride_vb, stride_vs, stride_vh, stride_vd,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
        """Keys and values ``[TILE_N, HEAD_PAD]`` of positions ``pos`` in blocks ``page`` (from
        :func:`load_pages`), one KV head; float32 when ``UPCAST`` (the interpreter's bf16
        dots are wrong)."""
        slot = (pos % BLOCK_SIZE).to(tl.int64)
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks
                    + kv_head * stride_kh + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs
                    + kv_head * stride_vh + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        return k, v
