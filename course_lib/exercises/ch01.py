"""Exercises of chapter 01 (KV-cache cost): bytes per token for GQA and MLA, tokens that fit.

Each reference_* function is the library's answer, built from course_lib.capacity; each check_*
runs a learner's function and the reference on the same cases (the presets' geometries plus
edge cases) and returns a Verdict that names the first case that differs.
"""

from __future__ import annotations

from collections.abc import Callable

from course_lib import capacity as cap
from course_lib.exercises import Verdict, check

# (num_layers, num_kv_heads, head_dim, dtype_bytes): every GQA/MHA preset, then edge cases.
GQA_CASES = [
    *((s.num_layers, s.num_kv_heads, s.head_dim, s.dtype_bytes)
      for s in cap.PRESETS.values() if not s.is_mla),
    (1, 1, 1, 1),        # the smallest model there is
    (32, 8, 128, 1),     # FP8 cache
    (32, 8, 128, 4),     # FP32 cache
    (61, 1, 64, 2),      # MQA: one KV head
    (126, 8, 128, 2),    # Llama-3.1-405B's geometry
    (2, 3, 7, 2),        # odd numbers, so no factor hides in a power of two
]

# (num_layers, kv_lora_rank, qk_rope_head_dim, dtype_bytes, tensor_parallel_size)
MLA_CASES = [
    (61, 512, 64, 2, 1),   # DeepSeek-V3
    (61, 512, 64, 2, 8),   # ... at TP=8: the latent is not split
    (60, 512, 64, 2, 2),   # DeepSeek-V2's 60 layers
    (27, 512, 64, 2, 4),   # DeepSeek-V2-Lite's 27 layers
    (61, 512, 64, 1, 1),   # FP8 latent
    (1, 1, 0, 1, 1),       # smallest: one latent value, no RoPE key
    (3, 100, 10, 4, 16),
]

# (memory_gib, bytes_per_token): tokens whose cache fits in memory_gib GiB.
FIT_CASES = [
    (80, 327_680),         # 80 GiB / 70B's 320 KiB per token: exactly 262,144
    (51, 655_360),         # not a whole number of tokens: floor, not round
    (0.5, 131_072),
    (0, 131_072),          # no memory, no tokens
    (1, 2 * 1024 ** 3),    # a token bigger than the memory
    (1, 1024 ** 3 - 1),    # 1.000000001 tokens: still one
    (3.5, 70_272),         # DeepSeek-V3
    (61.04, 57_344),
    (24, 393_216),         # 24 GiB / 384 KiB: exactly 65,536
    (2, 3),                # 715,827,882.67 tokens: rounding would give one too many
    (0.75, 4096),
]


def reference_kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                                 dtype_bytes: int) -> int:
    """MHA/GQA cache bytes per token: num_layers x 2 (K and V) x kv heads x head_dim x dtype."""
    spec = cap.ModelSpec("exercise", num_layers, num_kv_heads, num_kv_heads, head_dim,
                         num_params=1, dtype_bytes=dtype_bytes)
    return cap.kv_bytes_per_token(spec)


def reference_mla_kv_bytes_per_token(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int,
                                     dtype_bytes: int, tensor_parallel_size: int) -> int:
    """MLA cache bytes per token on one TP rank: the whole latent, whatever the TP size."""
    spec = cap.ModelSpec("exercise", num_layers, 128, 1, 128, num_params=1,
                         dtype_bytes=dtype_bytes, kv_lora_rank=kv_lora_rank,
                         qk_rope_head_dim=qk_rope_head_dim)
    return cap.kv_bytes_per_token(spec, tensor_parallel_size)


def reference_tokens_that_fit(memory_gib: float, bytes_per_token: int) -> int:
    """Whole tokens whose cache fits in memory_gib GiB: floor(memory / bytes_per_token)."""
    return round(memory_gib * cap.GiB) // bytes_per_token


def check_kv_bytes_per_token(fn: Callable[[int, int, int, int], int]) -> Verdict:
    return check("1.1 kv_bytes_per_token", fn, reference_kv_bytes_per_token, GQA_CASES)


def check_mla_kv_bytes_per_token(fn: Callable[[int, int, int, int, int], int]) -> Verdict:
    return check("1.2 mla_kv_bytes_per_token", fn, reference_mla_kv_bytes_per_token, MLA_CASES)


def check_tokens_that_fit(fn: Callable[[float, int], int]) -> Verdict:
    return check("1.3 tokens_that_fit", fn, reference_tokens_that_fit, FIT_CASES)
