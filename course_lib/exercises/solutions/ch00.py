"""Solutions of chapter 00's exercises: two small Triton kernels and their launches.

The kernels exist only where Triton runs (``BACKEND.uses_triton``), as in the notebook's cells.
"""

from __future__ import annotations

from course_lib.device import BACKEND

if BACKEND.uses_triton:
    import triton
    import triton.language as tl

    @triton.jit
    def leaky_relu_kernel(x_ptr, out_ptr, n, alpha, BLOCK_SIZE: tl.constexpr):
        pid = tl.program_id(0)
        offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offsets < n
        x = tl.load(x_ptr + offsets, mask=mask)
        tl.store(out_ptr + offsets, tl.where(x > 0, x, alpha * x), mask=mask)

    @triton.jit
    def block_max_kernel(x_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr):
        pid = tl.program_id(0)
        offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        x = tl.load(x_ptr + offsets, mask=offsets < n, other=float("-inf"))
        tl.store(out_ptr + pid, tl.max(x, axis=0))


def leaky_relu(x, out, alpha, block_size):
    n = x.numel()
    grid = ((n + block_size - 1) // block_size,)
    leaky_relu_kernel[grid](x, out, n, alpha, BLOCK_SIZE=block_size)


def block_max(x, out, block_size):
    n = x.numel()
    grid = ((n + block_size - 1) // block_size,)
    block_max_kernel[grid](x, out, n, BLOCK_SIZE=block_size)
