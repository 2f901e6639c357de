"""Chapter 04's exercise checkers, drawings, timing helpers and benchmark script.

pytest only (no hypothesis): this module runs on a GPU machine with plain ``python3 -m pytest``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from interpreter_only import INTERPRETER_ONLY

from course_lib.device import BACKEND
from course_lib.exercises import ch04
from course_lib.kernels import reference, timing
from course_lib.sizing.units import cdiv

pytestmark = pytest.mark.ch04
ROOT = Path(__file__).resolve().parents[1]


def not_attempted(*args):
    raise NotImplementedError


@INTERPRETER_ONLY
@pytest.mark.skipif(not BACKEND.uses_triton, reason="4.1 is a Triton exercise")
def test_gather_kv_checker_takes_any_correct_answer_and_names_the_token():
    """4.1's checker compares results and asks for a kernel: torch's own gather, right on
    every case, fails for launching none; one that ignores the table also fails at a named
    token. (The Triton answers: tests/test_exercises_ch04.py.)"""
    verdict = ch04.check_gather_kv(reference.gather_kv)
    assert verdict.passed == 0 and verdict.first_problem.startswith("your function launched no")
    assert "; and" not in verdict.first_problem        # ... and no case differs
    assert not ch04.check_gather_kv(not_attempted).attempted

    def ignores_table(key_cache, value_cache, block_table, seq_len):
        k = key_cache.reshape(-1, *key_cache.shape[2:])[:seq_len]
        v = value_cache.reshape(-1, *value_cache.shape[2:])[:seq_len]
        return k, v

    def reads_whole_blocks(key_cache, value_cache, block_table, seq_len):
        n = cdiv(seq_len, key_cache.shape[1])
        idx = block_table[:n].long()
        return (key_cache[idx].flatten(0, 1), value_cache[idx].flatten(0, 1))

    verdict = ch04.check_gather_kv(ignores_table)
    assert not verdict.ok and "logical block" in verdict.first_problem
    assert not ch04.check_gather_kv(reads_whole_blocks).ok


@pytest.mark.skipif(not BACKEND.uses_triton, reason="4.3 is a Triton exercise")
def test_merge_checker():
    """4.3 asks for a kernel: torch's right merge fails for launching none; the wrong kernels
    fail on the cases that show their mistake."""
    verdict = ch04.check_merge_attn_states(reference.merge_attn_states)
    assert verdict.passed == 0 and "launched no Triton kernel" in verdict.first_problem
    average = ch04.EXERCISES["4.3"].rule("share of the union").wrong
    nan_on_empty = ch04.EXERCISES["4.3"].rule("both ranges empty").wrong
    assert ch04.check_merge_attn_states(average).passed <= 2
    verdict = ch04.check_merge_attn_states(nan_on_empty)     # NaN when both are empty
    assert verdict.passed == verdict.total - 1 and "-inf - -inf" in verdict.first_problem


def test_three_level_mapping_drawing_labels_the_article_example():
    from course_lib.viz.attention import draw_three_level_mapping

    fig = draw_three_level_mapping([7, 3, 12], 40, 16, 16, {1: "Req-B"})
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "logical 0 -> Phys#7" in texts and "logical 2 -> Phys#12" in texts
    assert "Phys#1\nReq-B" in texts and "Phys#7\nlogical 0" in texts
    assert "Phys#0\nfree" in texts
    with pytest.raises(ValueError, match="needs 3 blocks"):
        draw_three_level_mapping([7, 3], 40, 16, 16)


def test_block_waste_and_bytes():
    assert timing.block_waste([16, 32], 16) == 0
    assert timing.block_waste([1], 32) == pytest.approx(31 / 32)
    assert timing.kv_bytes_read([4096] * 64, 8, 128, torch.bfloat16) == 2 * 64 * 4096 * 8 * 256
    assert timing.peak_bandwidth_gbps("NVIDIA H100 80GB HBM3") == 3350.0
    assert timing.peak_bandwidth_gbps("NVIDIA H200") == 4800.0
    assert timing.peak_bandwidth_gbps("Some Future GPU") is None


def test_stored_results_reads_json(tmp_path):
    assert timing.stored_results(tmp_path) == []
    (tmp_path / "kernels_x.json").write_text(json.dumps({"device": "X"}))
    assert timing.stored_results(tmp_path) == [{"device": "X"}]


def test_kernel_bench_runs_quick():
    out = subprocess.run([sys.executable, "bench/kernels.py", "--quick", "--no-save"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=True).stdout
    assert out.startswith("backend ")
    if torch.cuda.is_available():
        assert "large case" in out and "not saved" in out
    else:
        assert "no GPU on this machine" in out
        assert out.count("e-0") >= 3, out            # one max-difference per block size


def test_kernel_bench_gpu_code_path_runs_on_small_cpu_shapes():
    """measure() and the GPU report's row() on a tiny problem: the GPU path minus CUDA."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "bench" / "kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    r = bench.measure(2, 64, 4, 1, 32, 16, dtype=torch.float32, peak=100.0, device=device)
    assert r["max_abs_diff"] < 1e-4 and r["num_splits"] >= 1
    assert r["gbps"] > 0 and r["peak_fraction"] == pytest.approx(r["gbps"] / 100.0)
    line = bench.row(r)
    assert len(line.split()) == len(bench.HEADER.split()) - 2     # "paged ms", "sdpa ms"
    json.dumps(r)                                                 # what run_gpu saves
