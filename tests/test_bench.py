"""The benchmarks keep running (their figures are printed, never asserted)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_block_manager_bench_runs_quick():
    out = subprocess.run([sys.executable, "bench/block_manager.py", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "prefix caching on" in out and "ops/CPU-s" in out
    assert out.count("x\n") == 4, out    # one row per pool size in the sweep


def test_chaos_bench_runs_quick_and_leaks_nothing():
    out = subprocess.run([sys.executable, "bench/chaos.py", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "faults injected:" in out and "bad inputs refused:" in out
    assert "blocks leaked: 0 (clean run: 0)" in out


def test_prefix_caches_bench_runs_quick():
    out = subprocess.run([sys.executable, "bench/prefix_caches.py", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.count("SGLang radix, page 16") == 4 and out.count("vLLM V1 (sha256 chain)") == 4
