"""Plausible wrong answers to chapter 04's exercises, which its checkers must fail (see
``Exercise.wrong`` and tests/test_exercises.py): Triton kernels with one mistake each, and the
right numbers computed without a kernel of one's own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from course_lib.device import BACKEND

if BACKEND.uses_triton:
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_wrong(k_cache, v_cache, table, k_out, v_out, BLOCK_SIZE: tl.constexpr,
                      ROW: tl.constexpr, ROW_PAD: tl.constexpr, MODE: tl.constexpr):
        pos = tl.program_id(0)
        if MODE == 0:                  # the logical block taken for the physical one
            slot = pos
        elif MODE == 1:                # the table entry taken for a slot, not a block
            slot = tl.load(table + pos // BLOCK_SIZE).to(tl.int64) + pos % BLOCK_SIZE
        else:                          # the right slot (modes 2 and 3 mask wrongly)
            page = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
            slot = page * BLOCK_SIZE + pos % BLOCK_SIZE
        cols = tl.arange(0, ROW_PAD)
        keep = cols < ROW
        if MODE == 2:                  # the loads not masked: padding lanes read past the row
            tl.store(k_out + pos * ROW + cols, tl.load(k_cache + slot * ROW + cols),
                     mask=keep)
            tl.store(v_out + pos * ROW + cols, tl.load(v_cache + slot * ROW + cols),
                     mask=keep)
        elif MODE == 3:                # the stores not masked: the last row writes past k, v
            tl.store(k_out + pos * ROW + cols, tl.load(k_cache + slot * ROW + cols,
                                                       mask=keep, other=0.0))
            tl.store(v_out + pos * ROW + cols, tl.load(v_cache + slot * ROW + cols,
                                                       mask=keep, other=0.0))
        else:
            tl.store(k_out + pos * ROW + cols, tl.load(k_cache + slot * ROW + cols, mask=keep),
                     mask=keep)
            tl.store(v_out + pos * ROW + cols, tl.load(v_cache + slot * ROW + cols, mask=keep),
                     mask=keep)

    @triton.jit
    def _decode_wrong(q_ptr, k_cache, v_cache, table, out_ptr, seq_len, scale,
                      BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, RESCALE: tl.constexpr):
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + d)
        m = tl.full([], float("-inf"), tl.float32)
        total = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([HEAD_DIM], tl.float32)
        for logical in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
            page = tl.load(table + logical).to(tl.int64)
            offs = tl.arange(0, BLOCK_SIZE)
            valid = logical * BLOCK_SIZE + offs < seq_len
            rows = (page * BLOCK_SIZE + offs)[:, None] * HEAD_DIM + d[None, :]
            k = tl.load(k_cache + rows, mask=valid[:, None], other=0.0)
            if RESCALE:
                v = tl.load(v_cache + rows)            # only the scores are masked
            else:
                v = tl.load(v_cache + rows, mask=valid[:, None], other=0.0)
            s = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            p = tl.exp(s - m_new)
            if RESCALE:
                total = total * tl.exp(m - m_new) + tl.sum(p, axis=0)
                acc = acc * tl.exp(m - m_new) + tl.sum(p[:, None] * v, axis=0)
            else:                                      # forgets exp(m - m_new)
                total = total + tl.sum(p, axis=0)
                acc = acc + tl.sum(p[:, None] * v, axis=0)
            m = m_new
        tl.store(out_ptr + d, acc / total)

    @triton.jit
    def _merge_wrong(out_a, lse_a, out_b, lse_b, out, lse_out, HEAD_DIM: tl.constexpr,
                     MODE: tl.constexpr):
        h = tl.program_id(0)
        a = tl.load(lse_a + h)
        b = tl.load(lse_b + h)
        d = tl.arange(0, HEAD_DIM)
        oa = tl.load(out_a + h * HEAD_DIM + d)
        ob = tl.load(out_b + h * HEAD_DIM + d)
        if MODE == 0:                  # the average, and the larger lse
            tl.store(out + h * HEAD_DIM + d, (oa + ob) / 2)
            tl.store(lse_out + h, tl.maximum(a, b))
        else:                          # right, but -inf - -inf = NaN when both are empty
            m = tl.maximum(a, b)
            lse = m + tl.log(tl.exp(a - m) + tl.exp(b - m))
            tl.store(out + h * HEAD_DIM + d, tl.exp(a - lse) * oa + tl.exp(b - lse) * ob)
            tl.store(lse_out + h, lse)


def _gather_with(mode: int) -> Callable:
    def gather_kv(key_cache, value_cache, block_table, seq_len):
        _, bs, heads, head_dim = key_cache.shape
        k = torch.empty(seq_len, heads, head_dim, device=key_cache.device)
        v = torch.empty_like(k)
        _gather_wrong[(seq_len,)](key_cache, value_cache, block_table, k, v, BLOCK_SIZE=bs,
                                  ROW=heads * head_dim,
                                  ROW_PAD=triton.next_power_of_2(heads * head_dim), MODE=mode)
        return k, v
    return gather_kv


def _decode_with(rescale: bool) -> Callable:
    def decode_one_head(q, key_cache, value_cache, block_table, seq_len):
        out = torch.empty(q.shape[0], device=q.device)
        _decode_wrong[(1,)](q, key_cache, value_cache, block_table, out, seq_len,
                            q.shape[0] ** -0.5, BLOCK_SIZE=key_cache.shape[1],
                            HEAD_DIM=q.shape[0], RESCALE=rescale)
        return out
    return decode_one_head


def _gather_in_torch(key_cache, value_cache, block_table, seq_len):
    """Wrong for this exercise: the right gather, in torch (indexing), with no kernel."""
    pos = torch.arange(seq_len, device=key_cache.device)
    page = block_table.long()[pos // key_cache.shape[1]]
    return key_cache[page, pos % key_cache.shape[1]], value_cache[page, pos % key_cache.shape[1]]


def _decode_with_course_kernel(q, key_cache, value_cache, block_table, seq_len):
    """Wrong for this exercise: the course's paged-attention kernel does the work."""
    from course_lib.kernels import paged_attention

    out = paged_attention(q.view(1, 1, -1), key_cache, value_cache, block_table[None],
                          torch.tensor([seq_len], dtype=torch.int32, device=q.device),
                          impl="triton")
    return out.view(-1).float()


def _merge_with(mode: int) -> Callable:
    def merge_attn_states(out_a, lse_a, out_b, lse_b):
        out, lse = torch.empty_like(out_a), torch.empty_like(lse_a)
        _merge_wrong[(out_a.shape[0],)](out_a, lse_a, out_b, lse_b, out, lse,
                                        HEAD_DIM=out_a.shape[1], MODE=mode)
        return out, lse
    return merge_attn_states


_merge_average, _merge_nan_when_both_empty = _merge_with(0), _merge_with(1)


def _merge_in_torch(out_a, lse_a, out_b, lse_b):
    """Wrong for this exercise: the right merge, in torch."""
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return (torch.exp(lse_a - ref).unsqueeze(-1) * out_a
            + torch.exp(lse_b - ref).unsqueeze(-1) * out_b, lse)


if BACKEND.uses_triton:
    @triton.jit
    def _gather_int32(k_cache, v_cache, table, k_out, v_out, BLOCK_SIZE: tl.constexpr,
                      ROW: tl.constexpr, ROW_PAD: tl.constexpr):
        pos = tl.program_id(0)
        page = tl.load(table + pos // BLOCK_SIZE)      # int32: page * BLOCK_SIZE * ROW overflows
        slot = page * BLOCK_SIZE + pos % BLOCK_SIZE
        cols = tl.arange(0, ROW_PAD)
        keep = cols < ROW
        tl.store(k_out + pos * ROW + cols, tl.load(k_cache + slot * ROW + cols, mask=keep),
                 mask=keep)
        tl.store(v_out + pos * ROW + cols, tl.load(v_cache + slot * ROW + cols, mask=keep),
                 mask=keep)

    @triton.jit
    def _merge_no_max(out_a, lse_a, out_b, lse_b, out, lse_out, HEAD_DIM: tl.constexpr):
        h = tl.program_id(0)
        a = tl.load(lse_a + h)
        b = tl.load(lse_b + h)
        lse = tl.log(tl.exp(a) + tl.exp(b))            # exp(300) overflows float32
        ref = tl.where(lse == float("-inf"), 0.0, lse)
        d = tl.arange(0, HEAD_DIM)
        merged = (tl.exp(a - ref) * tl.load(out_a + h * HEAD_DIM + d)
                  + tl.exp(b - ref) * tl.load(out_b + h * HEAD_DIM + d))
        tl.store(out + h * HEAD_DIM + d, merged)
        tl.store(lse_out + h, lse)

    @triton.jit
    def _noop(x):
        pass


def _gather_int32_page(key_cache, value_cache, block_table, seq_len):
    """Wrong: the page index stays int32, so its offset overflows past 2**31 elements."""
    _, bs, heads, head_dim = key_cache.shape
    k = torch.empty(seq_len, heads, head_dim, device=key_cache.device)
    v = torch.empty_like(k)
    _gather_int32[(seq_len,)](key_cache, value_cache, block_table, k, v, BLOCK_SIZE=bs,
                              ROW=heads * head_dim,
                              ROW_PAD=triton.next_power_of_2(heads * head_dim))
    return k, v


def _gather_noop_then_torch(key_cache, value_cache, block_table, seq_len):
    """Wrong for this exercise: a kernel that does nothing is handed k and v, then torch
    writes the gathered rows into them."""
    _, bs, heads, head_dim = key_cache.shape
    k = torch.empty(seq_len, heads, head_dim, device=key_cache.device)
    v = torch.empty_like(k)
    _noop[(1,)](k)
    _noop[(1,)](v)
    got = _gather_in_torch(key_cache, value_cache, block_table, seq_len)
    k.copy_(got[0])
    v.copy_(got[1])
    return k, v


def _decode_noop_then_torch(q, key_cache, value_cache, block_table, seq_len):
    """Wrong for this exercise: a kernel that does nothing, then the answer from torch (a
    tensor the kernel was never handed)."""
    _noop[(1,)](q)
    bs = key_cache.shape[1]
    pos = torch.arange(seq_len, device=q.device)
    page = block_table.long()[pos // bs]
    k, v = key_cache[page, pos % bs, 0], value_cache[page, pos % bs, 0]
    return torch.softmax(k @ q * q.shape[0] ** -0.5, 0) @ v


def _decode_unscaled(q, key_cache, value_cache, block_table, seq_len):
    """Wrong: the scores are not scaled by 1/sqrt(head_dim)."""
    from course_lib.exercises.solutions.ch04 import decode_kernel

    out = torch.empty(q.shape[0], device=q.device)
    decode_kernel[(1,)](q, key_cache, value_cache, block_table, out, seq_len, 1.0,
                        BLOCK_SIZE=key_cache.shape[1], HEAD_DIM=q.shape[0])
    return out


def _merge_without_max(out_a, lse_a, out_b, lse_b):
    """Wrong: lse = log(exp(lse_a) + exp(lse_b)), which overflows in the hundreds."""
    out, lse = torch.empty_like(out_a), torch.empty_like(lse_a)
    _merge_no_max[(out_a.shape[0],)](out_a, lse_a, out_b, lse_b, out, lse,
                                     HEAD_DIM=out_a.shape[1])
    return out, lse


def _merge_noop_then_torch(out_a, lse_a, out_b, lse_b):
    """Wrong for this exercise: a kernel that does nothing, then the merge in torch."""
    _noop[(1,)](out_a)
    return _merge_in_torch(out_a, lse_a, out_b, lse_b)


def _merge_torch_into_kernel_output(out_a, lse_a, out_b, lse_b):
    """Wrong for this exercise: a kernel that does nothing is handed out and lse, then torch
    writes the merge into them after the launch."""
    out, lse = torch.empty_like(out_a), torch.empty_like(lse_a)
    _noop[(1,)](out)
    _noop[(1,)](lse)
    want = _merge_in_torch(out_a, lse_a, out_b, lse_b)
    out.copy_(want[0])
    lse.copy_(want[1])
    return out, lse
