"""Measuring the paged kernels: timers, bytes moved, peak bandwidth, stored GPU results.

Used by ``bench/kernels.py`` (GPU figures) and chapter 04 (the block_size trade-off on whatever
backend runs). Decode attention is memory-bound: each step reads every cached K and V once
and does ~2 FLOPs per byte, so the figure of merit is achieved bandwidth = bytes of K/V read /
time, as a fraction of the GPU's peak HBM bandwidth.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..sizing.units import cdiv

RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"

# Peak HBM bandwidth in GB/s (1e9 bytes/s) from the vendors' data sheets, by a substring of
# torch.cuda.get_device_name(). First match wins, so longer names come first.
PEAK_GBPS = [
    ("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0),
    ("GH200", 4000.0), ("B200", 8000.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0), ("L40S", 864.0), ("L4", 300.0), ("A10G", 600.0), ("A10", 600.0),
    ("RTX 4090", 1008.0), ("RTX 3090", 936.0), ("T4", 320.0), ("V100", 900.0),
]


def peak_bandwidth_gbps(device_name: str) -> float | None:
    """The data-sheet peak for a GPU name, or None when the name is not in the table."""
    for key, gbps in PEAK_GBPS:
        if key in device_name:
            return gbps
    return None


def kv_bytes_read(seq_lens: list[int], num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> int:
    """Bytes of K and V one decode step reads: every cached token, K and V, every KV head."""
    return 2 * sum(seq_lens) * num_kv_heads * head_dim * dtype.itemsize


def block_waste(seq_lens: list[int], block_size: int) -> float:
    """Fraction of allocated slots left empty in the sequences' last blocks."""
    allocated = sum(cdiv(n, block_size) * block_size for n in seq_lens)
    return 1 - sum(seq_lens) / allocated


def time_fn(fn: Callable[[], object], device: str, repeats: int = 5, warmup: int = 1,
            inner: int = 1) -> float:
    """Median seconds per call over ``repeats`` samples of ``inner`` back-to-back calls, after
    ``warmup`` calls (compilation, caches). CUDA: timed with events; CPU: ``perf_counter``."""
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def stored_results(directory: Path = RESULTS_DIR) -> list[dict]:
    """GPU results saved by ``bench/kernels.py`` (``kernels_*.json``), newest first; [] if none."""
    files = sorted(directory.glob("kernels_*.json"), key=lambda p: p.stat().st_mtime,
                   reverse=True)
    return [json.loads(p.read_text()) for p in files]
