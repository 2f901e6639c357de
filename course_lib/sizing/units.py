"""Byte units and the argument checks every sizing function shares.

Units are binary, as in vLLM: GiB = 1024**3 bytes. ``format_bytes`` prints a byte count in
them; ``_check_int`` and ``_check_nonneg`` reject a bad count with a ValueError naming it.
"""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# Total memory of one GPU as nvidia-smi reports it, in GiB: what vLLM's gpu_memory_utilization
# multiplies (torch.cuda.mem_get_info's total). A datasheet's "141 GB" is near this GiB figure;
# read as decimal GB it would be 131.3 GiB, 9 GiB short.
H200_MEMORY_GIB = 143_771 / 1024          # H200 SXM: 143,771 MiB = 140.4 GiB


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_nonneg(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")


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
