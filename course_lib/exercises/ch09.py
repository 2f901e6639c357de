"""Exercises of chapter 09 (context parallelism, MLA): the merge, the layout, the capacity.

reference_* is the library's answer; check_* runs a learner's function on many cases,
edge cases included (empty pieces of attention, fewer tokens than ranks, TP that must not
shrink an MLA cache), and reports the first difference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from course_lib import capacity as cap
from course_lib.exercises import Verdict, check
from course_lib.parallel.merge import merge_attn_states, partial_attention, split_ranges


def _merge_cases() -> list[tuple[torch.Tensor, ...]]:
    """(out_a, lse_a, out_b, lse_b): real pieces of one attention, and empty ones (-inf)."""
    cases = []
    for seed, n, cut in ((0, 10, 4), (1, 7, 1), (2, 33, 16), (3, 5, 0), (4, 5, 5), (5, 2, 1)):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(3, 4, generator=g, dtype=torch.float64)
        k = 4 * torch.randn(n, 1, 4, generator=g, dtype=torch.float64)
        v = torch.randn(n, 1, 4, generator=g, dtype=torch.float64)
        a, b = partial_attention(q, k[:cut], v[:cut]), partial_attention(q, k[cut:], v[cut:])
        cases.append((a[0], a[1], b[0], b[1]))
    empty = partial_attention(torch.ones(3, 4, dtype=torch.float64),
                              torch.zeros(0, 1, 4, dtype=torch.float64),
                              torch.zeros(0, 1, 4, dtype=torch.float64))
    cases.append((empty[0], empty[1], empty[0], empty[1]))           # both empty: no NaN
    big = torch.tensor([800.0, -800.0, 0.0], dtype=torch.float64)    # exp() would overflow
    cases.append((torch.ones(3, 4, dtype=torch.float64), big,
                  torch.zeros(3, 4, dtype=torch.float64), big - 1.0))
    return cases


def _same_pair(got: Any, want: Any) -> bool:
    return (isinstance(got, tuple) and len(got) == 2
            and all(isinstance(g, torch.Tensor) and g.shape == w.shape
                    and torch.allclose(g.to(w.dtype), w, rtol=1e-9, atol=1e-12, equal_nan=False)
                    for g, w in zip(got, want, strict=True)))


def reference_merge_two(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                        lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets: ``(out [H, d], lse [H])``."""
    return merge_attn_states(out_a, lse_a, out_b, lse_b)


def check_merge_two(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Verdict:
    return check("9.1 merge_two", fn, reference_merge_two, _merge_cases(), compare=_same_pair)


# (position, num_tokens, cp_size)
RANK_CASES = [(0, 16, 4), (3, 16, 4), (4, 16, 4), (15, 16, 4), (9, 10, 4), (0, 10, 4),
              (2, 10, 4), (5, 10, 3), (0, 1, 4), (1, 2, 4), (0, 2, 4), (999, 1000, 8),
              (0, 7, 1), (6, 7, 1)]


def reference_rank_of_token(position: int, num_tokens: int, cp_size: int) -> int:
    """The contiguous layout of the "Block Manager tutorial" (§5.3): the rank whose range
    [r*N//cp, (r+1)*N//cp) holds ``position``."""
    return next(r for r, (a, b) in enumerate(split_ranges(num_tokens, cp_size))
                if a <= position < b)


def check_rank_of_token(fn: Callable[[int, int, int], int]) -> Verdict:
    return check("9.2 rank_of_token", fn, reference_rank_of_token, RANK_CASES)


# (num_gpu_blocks, block_size, cp_size)
CP_CASES = [(3258, 16, 4), (3258, 16, 1), (83_558, 16, 8), (0, 16, 4), (1, 1, 2), (100, 32, 3)]


def reference_cp_max_tokens(num_gpu_blocks: int, block_size: int, cp_size: int) -> int:
    """Longest single request: blocks x block_size x CP size ("Block Manager tutorial" §10)."""
    return cap.context_parallel_capacity(num_gpu_blocks, block_size, cp_size)


def check_cp_max_tokens(fn: Callable[[int, int, int], int]) -> Verdict:
    return check("9.3 cp_max_tokens", fn, reference_cp_max_tokens, CP_CASES)


# (num_layers, kv_lora_rank, qk_rope_head_dim, dtype_bytes, tensor_parallel_size)
MLA_CASES = [(61, 512, 64, 2, 1), (61, 512, 64, 2, 8), (61, 512, 64, 1, 2), (27, 512, 64, 2, 4),
             (60, 512, 64, 2, 16), (1, 16, 4, 4, 2)]


def reference_mla_bytes_per_token(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int,
                                  dtype_bytes: int, tensor_parallel_size: int) -> int:
    """Per-rank MLA cache per token: layers x (d_c + d_rope) x bytes, whatever the TP size."""
    spec = cap.ModelSpec("exercise", num_layers, 16, 1, 128, 1, dtype_bytes,
                         kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim)
    return cap.kv_bytes_per_token(spec, tensor_parallel_size)


def check_mla_bytes_per_token(fn: Callable[..., int]) -> Verdict:
    return check("9.4 mla_bytes_per_token", fn, reference_mla_bytes_per_token, MLA_CASES)
