"""Byte units and the argument checks every sizing function shares.

Units are binary, as in vLLM: GiB = 1024**3 bytes. ``format_bytes`` prints a byte count in
them; ``check_int`` and ``check_nonneg`` reject a bad count with a ValueError naming it.
The two integer helpers every layer above uses live here, once: ``cdiv`` (how many blocks of
``b`` tokens hold ``a`` tokens) and ``next_power_of_two``.
"""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# Total memory of one GPU as nvidia-smi reports it, in GiB: what vLLM's gpu_memory_utilization
# multiplies (torch.cuda.mem_get_info's total). A datasheet's "141 GB" is near this GiB figure;
# read as decimal GB it would be 131.3 GiB, 9 GiB short.
H200_MEMORY_GIB = 143_771 / 1024          # H200 SXM: 143,771 MiB = 140.4 GiB


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` tokens hold ``a`` tokens (``b >= 1``)."""
    return -(-a // b)


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= ``n`` (``n >= 1``): Triton's ``tl.arange`` needs one, and
    Orca-Pow2 reserves one. ``ValueError`` for anything but an integer >= 1."""
    if isinstance(n, bool) or not hasattr(n, "__index__") or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    return 1 << (int(n) - 1).bit_length()


def check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_nonneg(name: str, value: float) -> None:
    """A finite number >= 0: an amount of memory or time (inf bytes has no block count)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 <= value < float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def format_bytes(num_bytes: float) -> str:
    """Binary units, at most two decimals: 512 B, 640.0 KiB, 1.25 GiB, 5.0 MiB."""
    sign, value = ("-" if num_bytes < 0 else ""), abs(num_bytes)
    if value < KiB:
        return f"{sign}{value:g} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    text = f"{value:.2f}".rstrip("0")
    return f"{sign}{text}0 {unit}" if text.endswith(".") else f"{sign}{text} {unit}"
