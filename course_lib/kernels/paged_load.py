"""The one step every paged kernel shares: load a tile of keys and values through a block table.

Token position ``pos`` of a sequence lives in physical block ``table[pos // block_size]`` at
offset ``pos % block_size``. The page number is cast to int64 before it multiplies a stride
(a 2^31-byte cache is small), and the K/V loads themselves are masked with ``valid``: slots
past the sequence, and blocks its table does not reach, are never read (they may hold NaN).
"""

from __future__ import annotations

from course_lib.device import BACKEND

if BACKEND.uses_triton:
    import triton
    import triton.language as tl

    @triton.jit
    def load_kv_tile(k_cache_ptr, v_cache_ptr, table, pos, valid, d, d_mask, kv_head,
                     block_size, stride_btb,
                     stride_kb, stride_ks, stride_kh, stride_kd,
                     stride_vb, stride_vs, stride_vh, stride_vd,
                     UPCAST: tl.constexpr):
        """Keys and values ``[TILE_N, HEAD_PAD]`` of positions ``pos`` (``valid`` masks the
        tile's tail), one KV head; float32 when ``UPCAST`` (the interpreter's bf16 dots)."""
        page = tl.load(table + (pos // block_size) * stride_btb, mask=valid, other=0)
        page = page.to(tl.int64)                              # before any stride product
        slot = (pos % block_size).to(tl.int64)
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks
                    + kv_head * stride_kh + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs
                    + kv_head * stride_vh + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        return k, v
