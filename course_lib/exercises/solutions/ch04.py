"""Solutions of chapter 04's exercises: the paged gather and the one-head decode loop as Triton
kernels, and the split-K merge of two partial attentions, one program per head.

The kernels exist only where Triton runs (``BACKEND.uses_triton``), as in the notebook's cells.
The caches are contiguous ``[num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import torch

from course_lib.device import BACKEND

if BACKEND.uses_triton:
    import triton
    import triton.language as tl

    @triton.jit
    def gather_kernel(k_cache, v_cache, table, k_out, v_out, BLOCK_SIZE: tl.constexpr,
                      ROW: tl.constexpr, ROW_PAD: tl.constexpr):
        pos = tl.program_id(0)                         # one program per token
        page = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
        slot = page * BLOCK_SIZE + pos % BLOCK_SIZE    # the token's row in the flat cache
        cols = tl.arange(0, ROW_PAD)                   # kv heads x head_dim, padded to 2^k
        keep = cols < ROW
        tl.store(k_out + pos * ROW + cols, tl.load(k_cache + slot * ROW + cols, mask=keep),
                 mask=keep)
        tl.store(v_out + pos * ROW + cols, tl.load(v_cache + slot * ROW + cols, mask=keep),
                 mask=keep)

    @triton.jit
    def decode_kernel(q_ptr, k_cache, v_cache, table, out_ptr, seq_len, scale,
                      BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + d)
        m = tl.full([], float("-inf"), tl.float32)     # running maximum of the scores
        total = tl.full([], 0.0, tl.float32)           # running sum of exp(score - m)
        acc = tl.zeros([HEAD_DIM], tl.float32)         # running sum of exp(score - m) * v
        for logical in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
            page = tl.load(table + logical).to(tl.int64)
            offs = tl.arange(0, BLOCK_SIZE)
            valid = logical * BLOCK_SIZE + offs < seq_len
            rows = (page * BLOCK_SIZE + offs)[:, None] * HEAD_DIM + d[None, :]
            k = tl.load(k_cache + rows, mask=valid[:, None], other=0.0)
            v = tl.load(v_cache + rows, mask=valid[:, None], other=0.0)
            s = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            rescale = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            total = total * rescale + tl.sum(p, axis=0)
            acc = acc * rescale + tl.sum(p[:, None] * v, axis=0)
            m = m_new
        tl.store(out_ptr + d, acc / total)

    @triton.jit
    def merge_kernel(out_a, lse_a, out_b, lse_b, out, lse_out, HEAD_DIM: tl.constexpr):
        h = tl.program_id(0)                           # one program per head
        a = tl.load(lse_a + h)
        b = tl.load(lse_b + h)
        m = tl.maximum(a, b)
        m = tl.where(m == float("-inf"), 0.0, m)       # both empty: keep -inf - -inf away
        lse = m + tl.log(tl.exp(a - m) + tl.exp(b - m))
        ref = tl.where(lse == float("-inf"), 0.0, lse)
        d = tl.arange(0, HEAD_DIM)
        merged = (tl.exp(a - ref) * tl.load(out_a + h * HEAD_DIM + d)
                  + tl.exp(b - ref) * tl.load(out_b + h * HEAD_DIM + d))
        tl.store(out + h * HEAD_DIM + d, merged)
        tl.store(lse_out + h, lse)


def gather_kv(key_cache, value_cache, block_table, seq_len):
    _, block_size, heads, head_dim = key_cache.shape
    k = torch.empty(seq_len, heads, head_dim, dtype=key_cache.dtype, device=key_cache.device)
    v = torch.empty_like(k)
    row = heads * head_dim
    gather_kernel[(seq_len,)](key_cache, value_cache, block_table, k, v,
                              BLOCK_SIZE=block_size, ROW=row,
                              ROW_PAD=triton.next_power_of_2(row))
    return k, v


def decode_one_head(q, key_cache, value_cache, block_table, seq_len):
    head_dim = q.shape[0]
    out = torch.empty(head_dim, dtype=torch.float32, device=q.device)
    decode_kernel[(1,)](q, key_cache, value_cache, block_table, out, seq_len,
                        head_dim ** -0.5, BLOCK_SIZE=key_cache.shape[1], HEAD_DIM=head_dim)
    return out


def merge_attn_states(out_a, lse_a, out_b, lse_b):
    heads, head_dim = out_a.shape
    out = torch.empty_like(out_a)
    lse = torch.empty_like(lse_a)
    merge_kernel[(heads,)](out_a, lse_a, out_b, lse_b, out, lse, HEAD_DIM=head_dim)
    return out, lse
