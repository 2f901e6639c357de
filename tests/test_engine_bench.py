"""bench/engine.py keeps running (its figures are printed, never asserted)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ch10
ROOT = Path(__file__).resolve().parents[1]


def test_engine_bench_runs_quick() -> None:
    out = subprocess.run([sys.executable, "bench/engine.py", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "paged (engine)" in out and "static (4/batch)" in out
    assert "n = 2" in out and "beam = 2" in out
    assert len(re.findall(r"\d\.\d\dx$", out, re.M)) == 3, out     # one ratio per system
