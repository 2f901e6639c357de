"""The vector-add smoke kernel equals torch on this machine's backend."""

from __future__ import annotations

import pytest
import torch

from course_lib.device import BACKEND
from course_lib.kernels import smoke

pytestmark = pytest.mark.ch00


@pytest.mark.parametrize("n", [1, 255, 256, 257, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_equals_torch(n, dtype):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen).to(device=BACKEND.device, dtype=dtype)
    y = torch.randn(n, generator=gen).to(device=BACKEND.device, dtype=dtype)
    torch.testing.assert_close(smoke.add(x, y, block_size=128), x + y)


def test_add_keeps_shape_of_non_contiguous_input():
    x = torch.arange(12.0, device=BACKEND.device).reshape(3, 4).t()
    out = smoke.add(x, x)
    assert out.shape == (4, 3)
    torch.testing.assert_close(out, 2 * x)


def test_add_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="same shape"):
        smoke.add(torch.zeros(3), torch.zeros(4))


def test_check_add_reports_a_match():
    result = smoke.check_add(n=500)
    assert result.matched and result.max_abs_err == 0.0
    assert result.backend == BACKEND.name
    assert str(result).startswith(f"vector add of 500 floats on {BACKEND.name}: matches torch")
