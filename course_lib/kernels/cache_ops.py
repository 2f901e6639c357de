"""Cache operations: write new K/V into the paged cache, copy blocks (CoW), swap blocks.

* ``reshape_and_cache`` — after the model computes K and V for the new tokens
  (``[num_tokens, num_kv_heads, head_dim]``), token ``t`` is written to slot
  ``slot_mapping[t]`` = ``block * block_size + offset``. A negative slot is padding: skipped.
  Triton kernel, grid ``(num_tokens,)``: one program moves one token's ``num_kv_heads x head_dim``
  values for K and V.
* ``copy_blocks`` — the copies the block manager asks for on copy-on-write (``(src, dst)``
  pairs). Triton kernel, grid ``(num_pairs, cdiv(block_size * num_kv_heads * head_dim, TILE))``.
* ``swap_blocks`` — between a GPU cache and a CPU cache (preemption by swapping). A Triton
  program cannot address host memory, so this is a device-to-host (or host-to-device) copy of
  whole blocks, as vLLM does with ``cudaMemcpyAsync``: gather, one transfer, scatter.

Strides are explicit kernel arguments; block numbers are cast to int64 before multiplying.
"""

from __future__ import annotations

import torch

from course_lib.device import BACKEND
from course_lib.kernels.launch import Launch
from course_lib.sizing.units import cdiv, next_power_of_two

if BACKEND.uses_triton:
    import triton
    import triton.language as tl

    @triton.jit
    def _reshape_and_cache_kernel(
        key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
        stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd,
        stride_kcb, stride_kcs, stride_kch, stride_kcd,
        stride_vcb, stride_vcs, stride_vch, stride_vcd,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,                   # >= NUM_KV_HEADS * HEAD_DIM, power of two
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        i = tl.arange(0, TILE)
        h = i // HEAD_DIM
        d = i % HEAD_DIM
        mask = (i < NUM_KV_HEADS * HEAD_DIM) & (slot >= 0)
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
        tl.store(key_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch
                 + d * stride_kcd, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch
                 + d * stride_vcd, v.to(value_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _copy_blocks_kernel(
        key_cache_ptr, value_cache_ptr, mapping_ptr,  # mapping [num_pairs, 2] (src, dst)
        stride_kcb, stride_kcs, stride_kch, stride_kcd,
        stride_vcb, stride_vcs, stride_vch, stride_vcd,
        stride_mp, stride_mc,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,
    ):
        pair = tl.program_id(0).to(tl.int64)
        src = tl.load(mapping_ptr + pair * stride_mp).to(tl.int64)
        dst = tl.load(mapping_ptr + pair * stride_mp + stride_mc).to(tl.int64)
        i = tl.program_id(1) * TILE + tl.arange(0, TILE)      # flat (slot, head, dim) index
        per_slot = NUM_KV_HEADS * HEAD_DIM
        s = i // per_slot
        h = (i % per_slot) // HEAD_DIM
        d = i % HEAD_DIM
        mask = i < BLOCK_SIZE * per_slot
        k_off = s * stride_kcs + h * stride_kch + d * stride_kcd
        v_off = s * stride_vcs + h * stride_vch + d * stride_vcd
        k = tl.load(key_cache_ptr + src * stride_kcb + k_off, mask=mask)
        tl.store(key_cache_ptr + dst * stride_kcb + k_off, k, mask=mask)
        v = tl.load(value_cache_ptr + src * stride_vcb + v_off, mask=mask)
        tl.store(value_cache_ptr + dst * stride_vcb + v_off, v, mask=mask)


def _check_index_tensor(name: str, t: object) -> None:
    """Block numbers and slots are integers: a float tensor would be truncated silently."""
    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex \
            or t.dtype == torch.bool:
        what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be an integer torch.Tensor, got {what}")


def _check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(key_cache.shape)} and "
                         f"{tuple(value_cache.shape)}")


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                      validate: bool = True) -> None:
    """Write ``key, value [num_tokens, num_kv_heads, head_dim]`` to their slots, in place.
    ``validate=False`` skips the slot bound check, the one device read (the model's layers:
    ``make_attention_metadata`` checked the batch once)."""
    _check_cache_pair(key_cache, value_cache)
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
                         f"[num_tokens, {key_cache.shape[2]}, {key_cache.shape[3]}]")
    _check_index_tensor("slot_mapping", slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must be "
                         f"[num_tokens, {key_cache.shape[2]}, {key_cache.shape[3]}]")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if validate and num_tokens and int(slot_mapping.max()) >= num_slots:
        raise ValueError(f"slot {int(slot_mapping.max())} is past the cache's {num_slots} "
                         f"slots (valid: 0..{num_slots - 1}, or -1 for padding)")
    if not BACKEND.triton_runs_on(key, value, key_cache, value_cache, slot_mapping):
        from course_lib.kernels.reference import reshape_and_cache_ref

        reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping)
        return
    if num_tokens == 0:
        return
    reshape_and_cache_launch(key, value, key_cache, value_cache, slot_mapping).run()


def reshape_and_cache_launch(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> Launch:
    """The kernel launch of :func:`reshape_and_cache` (no checks; ``num_tokens >= 1``)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    return Launch(_reshape_and_cache_kernel, (num_tokens,), (
        key, value, key_cache, value_cache, slot_mapping.contiguous(), *key.stride(),
        *value.stride(), *key_cache.stride(), *value_cache.stride()), dict(
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=key_cache.shape[1],
        TILE=next_power_of_two(num_kv_heads * head_dim), num_warps=4, num_stages=1))


def copy_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_mapping: torch.Tensor, tile: int = 1024) -> None:
    """For each row ``(src, dst)`` of ``block_mapping [n, 2]``: block ``dst`` := block ``src``."""
    _check_cache_pair(key_cache, value_cache)
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [n, 2] (src, dst), got "
                         f"{tuple(block_mapping.shape)}")
    _check_index_tensor("block_mapping", block_mapping)
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 1, got {tile!r}")
    num_blocks = key_cache.shape[0]
    if block_mapping.numel() and not (0 <= int(block_mapping.min())
                                      and int(block_mapping.max()) < num_blocks):
        raise ValueError(f"block numbers must be in 0..{num_blocks - 1}, got "
                         f"{block_mapping.tolist()}")
    if not BACKEND.triton_runs_on(key_cache, value_cache, block_mapping):
        from course_lib.kernels.reference import copy_blocks_ref

        copy_blocks_ref(key_cache, value_cache, block_mapping)
        return
    if block_mapping.shape[0] == 0:
        return
    copy_blocks_launch(key_cache, value_cache, block_mapping, tile).run()


def copy_blocks_launch(key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_mapping: torch.Tensor, tile: int = 1024) -> Launch:
    """The kernel launch of :func:`copy_blocks` (no checks; at least one pair)."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    per_block = block_size * num_kv_heads * head_dim
    tile = min(tile, next_power_of_two(per_block))
    return Launch(_copy_blocks_kernel, (block_mapping.shape[0], cdiv(per_block, tile)), (
        key_cache, value_cache, block_mapping, *key_cache.stride(), *value_cache.stride(),
        *block_mapping.stride()), dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                                       BLOCK_SIZE=block_size, TILE=tile, num_warps=4,
                                       num_stages=1))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy ``src[s]`` to ``dst[d]`` for each row ``(s, d)`` of ``block_mapping``; the two caches
    may be on different devices (GPU -> CPU to swap out, CPU -> GPU to swap in)."""
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(f"src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} "
                         f"{dst.dtype} must hold blocks of the same shape and dtype")
    _check_index_tensor("block_mapping", block_mapping)
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [n, 2] (src, dst), got "
                         f"{tuple(block_mapping.shape)}")
    if block_mapping.numel() == 0:
        return
    pairs = block_mapping.to("cpu").long()
    for col, cache in ((0, src), (1, dst)):
        if int(pairs[:, col].min()) < 0 or int(pairs[:, col].max()) >= cache.shape[0]:
            name = "src" if col == 0 else "dst"
            raise ValueError(f"{name} block numbers must be in 0..{cache.shape[0] - 1}, got "
                             f"{pairs[:, col].tolist()}")
    blocks = src.index_select(0, pairs[:, 0].to(src.device))      # one gather on src's device
    dst.index_copy_(0, pairs[:, 1].to(dst.device), blocks.to(dst.device))
