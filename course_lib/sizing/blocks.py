"""Model-free block counting: tokens to blocks, the slots a layout wastes, blocks in a budget.

Whatever the model, a sequence of n tokens holds ceil(n / block_size) blocks, and only its full
blocks can be shared by prefix caching. Static reservation and paging waste slots differently
(``static_utilization``, ``paged_utilization``, the internal-waste bounds). A byte budget buys
``num_gpu_blocks`` blocks on the GPU and ``num_cpu_blocks`` swap blocks; ``tokens_that_fit``
counts their slots. Names follow vLLM (block_size, num_gpu_blocks, swap_space).
"""

from __future__ import annotations

from collections.abc import Iterable

from course_lib.sizing.units import GiB, cdiv, check_int, check_nonneg


def check_block_size(block_size: int) -> None:
    """Raise unless block_size is a power of two in [1, 256]: block tables and kernels assume it."""
    if (isinstance(block_size, bool) or not isinstance(block_size, int)
            or not 1 <= block_size <= 256 or block_size & (block_size - 1)):
        raise ValueError(f"block_size must be a power of two in [1, 256], got {block_size!r}")


def num_blocks_for_tokens(num_tokens: int, block_size: int = 16) -> int:
    """Blocks a sequence of num_tokens occupies: ceil(num_tokens / block_size)."""
    check_int("num_tokens", num_tokens, 0)
    check_block_size(block_size)
    return cdiv(num_tokens, block_size)


def num_full_blocks(num_tokens: int, block_size: int = 16) -> int:
    """Full blocks in num_tokens: only these can be shared by prefix caching (hash per block)."""
    check_int("num_tokens", num_tokens, 0)
    check_block_size(block_size)
    return num_tokens // block_size


def _token_counts(used_tokens: Iterable[int]) -> list[int]:
    """Each request's token count, an integer >= 0 (numpy's included), or ``ValueError``:
    never converted, so ``"8"`` or ``8.7`` is refused rather than read as 8."""
    if isinstance(used_tokens, (str, bytes)) or not isinstance(used_tokens, Iterable):
        raise ValueError(f"used_tokens must be a list of token counts, got "
                         f"{type(used_tokens).__name__} {used_tokens!r:.60}")
    used = list(used_tokens)
    for i, n in enumerate(used):
        if isinstance(n, bool) or not hasattr(n, "__index__") or n < 0:
            raise ValueError(f"used_tokens must be integers >= 0; item {i} is {n!r}")
    return [int(n) for n in used]


def static_utilization(used_tokens: Iterable[int], max_seq_len: int) -> float:
    """Used / reserved slots when every request reserves max_seq_len contiguous slots."""
    used = _token_counts(used_tokens)
    check_int("max_seq_len", max_seq_len, 1)
    if not used or any(not 0 <= n <= max_seq_len for n in used):
        raise ValueError(f"used_tokens must be non-empty, each in [0, {max_seq_len}], got {used}")
    return sum(used) / (len(used) * max_seq_len)


def paged_utilization(used_tokens: Iterable[int], block_size: int = 16) -> float:
    """Used / reserved slots when every request holds ceil(used / block_size) blocks."""
    used = _token_counts(used_tokens)
    slots = sum(num_blocks_for_tokens(n, block_size) * block_size for n in used)
    if slots == 0:
        raise ValueError(f"used_tokens must hold at least one token, got {used}")
    return sum(used) / slots


def max_internal_waste_tokens(block_size: int) -> int:
    """Worst-case empty slots in a sequence's last block: block_size - 1."""
    check_block_size(block_size)
    return block_size - 1


def expected_internal_waste_tokens(block_size: int) -> float:
    """Mean empty slots in the last block when lengths mod block_size are uniform."""
    check_block_size(block_size)
    return (block_size - 1) / 2


def num_gpu_blocks(available_kv_bytes: int, block_bytes: int) -> int:
    """Blocks in the pool: floor(available_kv_bytes / block_bytes); the remainder is unused."""
    check_int("available_kv_bytes", available_kv_bytes, 0)
    check_int("block_bytes", block_bytes, 1)
    return available_kv_bytes // block_bytes


def tokens_that_fit(num_blocks: int, block_size: int = 16) -> int:
    """Token slots in num_blocks blocks (vLLM logs this as 'GPU KV cache size: N tokens')."""
    check_int("num_blocks", num_blocks, 0)
    check_block_size(block_size)
    return num_blocks * block_size


def num_cpu_blocks(swap_space: float, block_bytes: int) -> int:
    """CPU swap blocks per GPU: swap_space (GiB per GPU, vLLM's unit) // block_bytes."""
    check_nonneg("swap_space", swap_space)
    check_int("block_bytes", block_bytes, 1)
    return round(swap_space * GiB) // block_bytes
