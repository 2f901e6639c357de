"""The benchmarks keep running (their figures are printed, never asserted)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_block_manager_bench_runs_quick():
    out = subprocess.run([sys.executable, "bench/block_manager.py", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900, check=True).stdout
    for row in ("  v0    caching on ", "  v0    caching off", "  v1    caching on ",
                "  radix caching on "):
        assert out.count(row) == 1, out             # V0 on and off, V1 and radix on
    assert out.count("twin / plain BlockManager x") == 2, out   # V0's plain beside its twin
    for peer in ("nano-vllm BlockManager", "vLLM 0.33.0 KVCacheManager",
                 "SGLang 0.5.23 RadixCache"):                  # each peer, or why not
        assert f"this tree / {peer} x" in out or "skipped:" in out, out
    assert out.count("(8192 / 128: x") == 3, out     # decode cost by length, per manager
    assert out.count("100,000:") == 3, out           # the pool sweep, per manager


def test_block_manager_bench_compares_a_revision_and_checks_the_same_work():
    """--baseline HEAD: the committed code against the working tree, interleaved, after the
    step-by-step check that both leave the same tables (which must trip on different work)."""
    out = subprocess.run([sys.executable, "bench/block_manager.py", "--quick", "--baseline",
                          "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         check=True).stdout
    assert out.count("this tree / HEAD x") == 2, out
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import block_manager as bench
    finally:
        sys.path.remove(str(ROOT / "bench"))
    same = bench.record("v0", 20, 256, True)["digests"]
    bench.check_same({"a": same, "b": list(same)})
    other = bench.record("v0", 20, 64, True)["digests"]        # a smaller pool: other tables
    with pytest.raises(AssertionError, match="differ after step"):
        bench.check_same({"a": same, "b": other})


def test_chaos_bench_runs_quick_and_breaks_nothing():
    """Per design, a site sweep, second faults and a soak: no mismatch with the clean run, no
    run broken by any check (recoveries, invariants, leaks, wedged runs), the recovery metric
    equal to the harness's own count of recomputed tokens."""
    out = subprocess.run([sys.executable, "bench/chaos.py", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=True).stdout
    for design in ("v0 recompute", "v0 swap", "v1 hash", "v1 radix", "v1 cpu tier",
                   "p/d pair"):
        assert out.count(f"== {design} ==") == 1, out
    assert out.count("site sweep (one site of each kind, first call):") == 6, out
    assert out.count("second faults (after a forward fault:") == 6, out
    assert out.count("broken runs: 0 (none)") == 12, out
    assert out.count("mismatches: 0; broken: no") == 6, out
    assert out.count("bad inputs refused:") == 6 and "failing: 0" in out, out
    counts = re.findall(r"recomputed tokens: (\d+) \(counted(?: by the harness)?: (\d+)\)", out)
    assert len(counts) == 18 and all(a == b for a, b in counts), counts
    assert sum(int(a) for a, _ in counts) > 0, counts


def test_metrics_server_bench_runs_quick():
    """Both bursts (idle, and while a model-free replay steps) run and every scrape is
    answered (the latencies are printed, never asserted)."""
    out = subprocess.run([sys.executable, "bench/metrics_server.py", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=True).stdout
    assert out.count("/metrics burst, idle:") == 1, out
    assert out.count("/metrics burst while a replay steps:") == 1, out
    assert out.count(" ok, 0 failed,") == 2, out


def test_prefix_caches_bench_runs_quick():
    out = subprocess.run([sys.executable, "bench/prefix_caches.py", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.count("SGLang radix, page 16") == 4 and out.count("vLLM V1 (sha256 chain)") == 4


def test_offload_bench_runs_quick():
    """Both workloads, three configurations each, the sweep; the tier's and V0's tokens are
    the no-offload run's (greedy and seeded) at every size."""
    out = subprocess.run([sys.executable, "bench/offload.py", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "== multi-turn chat:" in out and "== RAG-like:" in out, out
    for config in ("V1, no offload", "V1 + CPU tier", "V0 + swap"):
        assert out.count(f"  {config} ") == 2, out
    assert out.count("yes, yes") == 4 and out.count("(holds everything)") == 2, out
    assert " NO" not in out, out


def test_disagg_bench_runs_quick():
    """Both workloads, the four deployments each, DistServe's goodput, the capacity table and
    the capped decode nodes."""
    out = subprocess.run([sys.executable, "bench/disagg.py", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=True).stdout
    assert out.count(", 6.0 req/s:") == 1 and out.count(", 30.0 req/s:") == 1, out
    for row in ("colocated x4 ", "1P3D ", "2P2D ", "3P1D "):
        assert out.count(f"  {row}") >= 2, out
    assert out.count("/GPU)") == 4, out                  # two deployments per workload
    assert out.count("  Llama-2-7B ") == 2 and out.count("  Llama-3-8B ") == 2, out
    assert "1P3D static" in out, out
    # the real processes: tokens identical to one engine's
    assert out.count("  1P1D ") == 1 and out.count("  2P1D ") == 1, out
    assert " NO " not in out and out.count(" yes ") == 2, out


def test_hybrid_bench_runs_quick():
    """Capacity for every hybrid preset at 4K / 32K / 128K, and the trace through one group,
    gpt-oss's two and Gemma 3's seven: the windowed groups hold fewer blocks at their peak
    than the same groups all full attention (a count, not a timing); then vLLM's own manager
    on the same trace where the fidelity cache holds its sources (else a line says so)."""
    out = subprocess.run([sys.executable, "bench/hybrid.py", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=True).stdout
    for model in ("gpt-oss-20b", "gpt-oss-120b", "Gemma-3-27B", "Qwen3-Next-80B-A3B"):
        assert out.count(f"  {model} ") == 3, out
    section2, section3 = out.split("\n2. ")[1].split("\n3. ")
    assert section3.startswith("vLLM 0.33.0's own KVCacheManager"), out    # run, or skipped
    rows = {line.split("  ")[1].strip(): line.split() for line in section2.splitlines()
            if line.startswith(("  one group", "  gpt-oss (", "  gemma-3 ("))}
    assert set(rows) == {"one group", "gpt-oss (2 groups)", "gemma-3 (7 groups)"}, out
    assert rows["one group"][-1] == rows["one group"][-2], out       # nothing to free
    for kind in ("gpt-oss (2 groups)", "gemma-3 (7 groups)"):
        peak, all_full = (int(x.replace(",", "")) for x in rows[kind][-2:])
        assert peak < all_full, out
