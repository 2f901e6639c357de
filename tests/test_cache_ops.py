"""reshape_and_cache, copy_blocks and swap_blocks equal their torch references, write nothing
else, and reject bad input before touching the cache.

pytest only (no hypothesis): this module runs on a GPU machine with plain ``python3 -m pytest``.
"""

from __future__ import annotations

import pytest
import torch

from course_lib.device import BACKEND
from course_lib.kernels import cache_ops, reference

pytestmark = pytest.mark.ch04
DEV = BACKEND.device
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def caches(num_blocks=6, block_size=8, kv_heads=2, head_dim=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype).to(DEV)
    v = torch.randn(shape, generator=gen).to(dtype).to(DEV)
    return k, v


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_equals_reference(dtype):
    kc, vc = caches(dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    # key/value as column slices of one fused qkv tensor: non-contiguous rows
    qkv = torch.randn(5, 3, 2, 16, generator=gen).to(dtype).to(DEV)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([0, 9, -1, 47, 20], dtype=torch.int64, device=DEV)  # -1: padding
    want_k, want_v = kc.clone(), vc.clone()
    reference.reshape_and_cache_ref(key, value, want_k, want_v, slots)
    cache_ops.reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert torch.equal(kc[47 // 8, 47 % 8], key[3])        # the last slot of the last block
    assert torch.equal(vc[20 // 8, 20 % 8], value[4])


def test_reshape_and_cache_writes_only_its_slots():
    kc, vc = caches()
    before_k, before_v = kc.clone(), vc.clone()
    key = torch.full((2, 2, 16), 7.0, device=DEV)
    cache_ops.reshape_and_cache(key, key, kc, vc, torch.tensor([3, -1], device=DEV))
    changed = (kc != before_k).any(dim=(2, 3)).nonzero().tolist()
    assert changed == [[0, 3]] and torch.equal(vc != before_v, kc != before_k)


def test_reshape_and_cache_rejects_a_slot_past_the_cache():
    kc, vc = caches()
    before = kc.clone()
    with pytest.raises(ValueError, match="past the cache's 48 slots"):
        cache_ops.reshape_and_cache(torch.zeros(1, 2, 16, device=DEV),
                                    torch.zeros(1, 2, 16, device=DEV), kc, vc,
                                    torch.tensor([48], device=DEV))
    assert torch.equal(kc, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_equals_reference(dtype):
    kc, vc = caches(num_blocks=8, dtype=dtype, seed=3)
    mapping = torch.tensor([[0, 5], [2, 7], [2, 6]], dtype=torch.int64, device=DEV)
    want_k, want_v = kc.clone(), vc.clone()
    reference.copy_blocks_ref(want_k, want_v, mapping)
    cache_ops.copy_blocks(kc, vc, mapping, tile=64)           # several tiles per block
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert torch.equal(kc[6], kc[2]) and not torch.equal(kc[6], kc[1])


def test_copy_blocks_on_a_strided_cache():
    # K and V as the two halves of one [num_blocks, 2, block_size, heads, d] allocation
    gen = torch.Generator().manual_seed(4)
    kv = torch.randn(5, 2, 8, 2, 16, generator=gen).to(DEV)
    kc, vc = kv[:, 0], kv[:, 1]
    want = kv.clone()
    reference.copy_blocks_ref(want[:, 0], want[:, 1], torch.tensor([[1, 3]]))
    cache_ops.copy_blocks(kc, vc, torch.tensor([[1, 3]], device=DEV))
    assert torch.equal(kv, want)


def test_copy_blocks_rejects_a_bad_block():
    kc, vc = caches()
    with pytest.raises(ValueError, match="0..5"):
        cache_ops.copy_blocks(kc, vc, torch.tensor([[0, 6]], device=DEV))
    with pytest.raises(ValueError, match=r"\[n, 2\]"):
        cache_ops.copy_blocks(kc, vc, torch.tensor([0, 1], device=DEV))


def test_swap_blocks_out_and_back_in():
    gpu_k, _ = caches(num_blocks=6, seed=5)                   # on the backend's device
    cpu_k = torch.zeros(4, *gpu_k.shape[1:])
    out_map = torch.tensor([[5, 0], [1, 3]])
    want = cpu_k.clone()
    reference.swap_blocks_ref(gpu_k.cpu(), want, out_map)
    cache_ops.swap_blocks(gpu_k, cpu_k, out_map)               # swap out
    assert torch.equal(cpu_k, want) and torch.equal(cpu_k[1], torch.zeros_like(cpu_k[1]))
    fresh = torch.zeros_like(gpu_k)
    cache_ops.swap_blocks(cpu_k, fresh, torch.tensor([[0, 2], [3, 4]]))   # swap in elsewhere
    assert torch.equal(fresh[2], gpu_k[5]) and torch.equal(fresh[4], gpu_k[1])


def test_swap_blocks_rejects_mismatched_caches():
    with pytest.raises(ValueError, match="same shape and dtype"):
        cache_ops.swap_blocks(torch.zeros(2, 8, 2, 16), torch.zeros(2, 8, 2, 8),
                              torch.tensor([[0, 0]]))
    with pytest.raises(ValueError, match="dst block numbers must be in 0..1"):
        cache_ops.swap_blocks(torch.zeros(3, 8), torch.zeros(2, 8), torch.tensor([[0, 2]]))


@pytest.mark.parametrize("call, message", [
    (lambda kc, vc: cache_ops.reshape_and_cache(kc[0, 0], kc[0, 0], kc, vc,
                                                torch.tensor([0], device=DEV)),
     "must both be \\[num_tokens, 2, 16\\]"),
    (lambda kc, vc: cache_ops.reshape_and_cache(kc[0], vc[0], kc, vc,
                                                torch.arange(8.0, device=DEV)),
     "slot_mapping must be an integer"),
    (lambda kc, vc: cache_ops.copy_blocks(kc, vc, torch.tensor([[0.5, 1.7]], device=DEV)),
     "block_mapping must be an integer"),
    (lambda kc, vc: cache_ops.copy_blocks(kc, vc, torch.tensor([[0, 1]], device=DEV), tile=0),
     "tile must be a power of two"),
    (lambda kc, vc: cache_ops.copy_blocks(kc, vc, torch.tensor([[0, 1]], device=DEV), tile=3),
     "tile must be a power of two"),
    (lambda kc, vc: cache_ops.swap_blocks(kc, vc, torch.tensor([0, 1])), "must be \\[n, 2\\]"),
    (lambda kc, vc: cache_ops.swap_blocks(kc, vc, torch.tensor([[0, 1, 2]])),
     "must be \\[n, 2\\]"),
    (lambda kc, vc: cache_ops.swap_blocks(kc, vc, torch.tensor([[0.9, 1.9]])),
     "block_mapping must be an integer"),
])
def test_cache_ops_reject_bad_index_tensors_and_leave_the_cache(call, message):
    kc, vc = caches()
    before = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match=message):
        call(kc, vc)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
