"""The smallest Triton kernel, vector add: proof that Triton runs here, on this backend.

Chapter 00 runs it once; later kernels (paged attention) follow the same shape: a torch
reference, a Triton kernel, a wrapper that picks one by :data:`course_lib.device.BACKEND`,
and a check of one against the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib.device import BACKEND
from course_lib.sizing.units import cdiv

if BACKEND.uses_triton:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
        # Each program instance adds one block of BLOCK_SIZE elements; the mask covers the tail.
        pid = tl.program_id(axis=0)
        offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offsets < n_elements
        x = tl.load(x_ptr + offsets, mask=mask)
        y = tl.load(y_ptr + offsets, mask=mask)
        tl.store(out_ptr + offsets, x + y, mask=mask)


def num_programs(n: int, block_size: int) -> int:
    """How many programs of ``block_size`` lanes cover ``n`` elements (``triton.cdiv``)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return cdiv(n, block_size)


def add_reference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The spec: what :func:`add` must return."""
    return x + y


def add(x: torch.Tensor, y: torch.Tensor, block_size: int = 256) -> torch.Tensor:
    """``x + y`` computed by the Triton kernel (or the reference when Triton is missing)."""
    if x.shape != y.shape:
        raise ValueError(
            f"x and y must have the same shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.device != y.device:
        raise ValueError(f"x and y must be on the same device, got {x.device} and {y.device}")
    if not BACKEND.uses_triton:
        return add_reference(x, y)
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    grid = (num_programs(n, block_size),)
    _add_kernel[grid](x, y, out, n, BLOCK_SIZE=block_size)
    return out


@dataclass(frozen=True)
class SmokeResult:
    backend: str
    n: int
    max_abs_err: float
    matched: bool

    def __str__(self) -> str:
        verdict = "matches torch" if self.matched else "DOES NOT match torch"
        return (f"vector add of {self.n} floats on {self.backend}: {verdict} "
                f"(max abs error {self.max_abs_err:g})")


def check_add(n: int = 1000, seed: int = 0) -> SmokeResult:
    """Run :func:`add` on random input of ``n`` floats and compare it with torch."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen).to(BACKEND.device)
    y = torch.randn(n, generator=gen).to(BACKEND.device)
    got, want = add(x, y), add_reference(x, y)
    err = (got - want).abs().max().item() if n else 0.0
    return SmokeResult(BACKEND.name, n, err, bool(torch.allclose(got, want)))
