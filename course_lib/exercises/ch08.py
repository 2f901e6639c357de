"""Exercises of chapter 08 (capacity planning): the block pool, KV heads per rank, requests.

As in ch01, reference_* is the library's answer (course_lib.capacity) and check_* compares a
learner's function with it on many cases. Some cases have no answer: the library raises
ValueError (the model does not fit; a TP size that cannot split the heads). There the
learner's function must raise ValueError too; the checkers compare "raises ValueError" like
a value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from course_lib import capacity as cap
from course_lib.capacity import GiB
from course_lib.exercises import Verdict, check

RAISES = "raises ValueError"

# (total_gpu_memory_gib, gpu_memory_utilization, weight_gib, other_gib, block_bytes)
BLOCK_CASES = [
    (80, 0.9, 17.5, 3.5, 655_360),       # Block Manager tutorial §4.3: 70B, TP=8: 83,558
    (80, 0.9, 16, 0, 2 * 1024 ** 2),     # PagedAttention explained §4.2: 8B, A100: 28,672
    (80, 0.9, 35, 0, 1_310_720),         # 70B at TP=4, one rank
    (80, 1.0, 78.125, 0, 1_179_648),     # DeepSeek-V3 FP8 weights over 8 ranks
    (24, 0.5, 6, 2, 1024 ** 2),          # the budget is exactly 4 GiB: 4,096 blocks
    (24, 0.5, 6, 6, 1024 ** 2),          # a budget of exactly zero: no blocks, no error
    (24, 0.5, 6, 7, 1024 ** 2),          # negative budget: the model does not fit
    (16, 0.75, 15, 0, 1024 ** 2),        # weights exceed usable memory
    (80, 0.9, 16, 0, 3 * 1024 ** 3),     # a block bigger than the budget: zero blocks
    # H200 (nvidia-smi's 140.4 GiB) at vLLM 0.33.0's 0.92: Llama-3-70B over 2 ranks, 2.5 MiB
    # blocks: 25,173
    (cap.H200_MEMORY_GIB, 0.92, 65.71, 2, 2_621_440),
]

# (num_kv_heads, tensor_parallel_size)
HEAD_CASES = [
    (8, 1), (8, 2), (8, 8),      # GQA: heads split evenly
    (8, 16), (8, 64),            # more ranks than KV heads: each rank keeps (a copy of) one
    (32, 4), (4, 2), (4, 8),
    (1, 1), (1, 8),              # MQA
    (8, 3),                      # does not divide: ValueError
    (8, 12), (6, 4), (8, 0),
]

# (num_gpu_blocks, block_size, max_model_len)
REQUEST_CASES = [
    (29_205, 16, 8192),        # Llama-3-8B on 80 GiB
    (3_258, 16, 32_768),       # the DeepSeek-V3 pool of "Block Manager tutorial" §9
    (100, 16, 20),             # each request takes 2 blocks = 32 slots, not 20: 50, not 80
    (100, 16, 16), (100, 16, 17),
    (100, 32, 1),              # one token still takes a whole block
    (0, 16, 4096),             # empty pool
    (10, 16, 4096),            # the pool holds less than one request
    (83_558, 16, 131_072),
    (1, 8, 8),
]


def raises_as_value(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn, with ValueError turned into the result RAISES (NotImplementedError passes through)."""
    def wrapped(*args: Any) -> Any:
        try:
            return fn(*args)
        except ValueError:
            return RAISES
    return wrapped


def reference_num_gpu_blocks(total_gpu_memory_gib: float, gpu_memory_utilization: float,
                             weight_gib: float, other_gib: float, block_bytes: int) -> int:
    """floor((total x utilization - weights - other) / block_bytes); ValueError if negative.

    GiB arguments become bytes first (x 2**30, rounded), as vLLM counts in bytes.
    """
    avail = cap.available_kv_bytes(round(total_gpu_memory_gib * GiB), gpu_memory_utilization,
                                   round(weight_gib * GiB), round(other_gib * GiB))
    return cap.num_gpu_blocks(avail, block_bytes)


def reference_kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads one rank stores: split while tp <= heads, then one (replicated) head per rank.

    tp and num_kv_heads must divide one another, otherwise ValueError.
    """
    spec = cap.ModelSpec("exercise", 1, num_kv_heads * 64, num_kv_heads, 128, num_params=1)
    return cap.kv_heads_per_rank(spec, tensor_parallel_size)


def reference_max_num_requests(num_gpu_blocks: int, block_size: int, max_model_len: int) -> int:
    """Requests of max_model_len tokens that fit at once: each holds whole blocks."""
    return num_gpu_blocks // cap.num_blocks_for_tokens(max_model_len, block_size)


def check_num_gpu_blocks(fn: Callable[..., int]) -> Verdict:
    return check("8.1 num_gpu_blocks", raises_as_value(fn),
                 raises_as_value(reference_num_gpu_blocks), BLOCK_CASES)


def check_kv_heads_per_rank(fn: Callable[[int, int], int]) -> Verdict:
    return check("8.2 kv_heads_per_rank", raises_as_value(fn),
                 raises_as_value(reference_kv_heads_per_rank), HEAD_CASES)


def check_max_num_requests(fn: Callable[[int, int, int], int]) -> Verdict:
    return check("8.3 max_num_requests", raises_as_value(fn),
                 raises_as_value(reference_max_num_requests), REQUEST_CASES)
