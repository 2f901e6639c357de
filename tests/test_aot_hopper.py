"""Every GPU launch of the course's kernels compiles for Hopper (sm_90), here, without a GPU,
exactly as Triton's JIT would compile it, and passes the resource checks of
``course_lib.kernels.aot`` (no spills, 16-byte async K/V copies, two K/V tiles in flight, shared
memory within an SM); each check is first shown to trip on a launch built to break it.

The compile runs in a subprocess because Triton must be in JIT mode (not the interpreter that
``course_lib.device`` switches on for a CPU machine). pytest only: runs on a GPU machine too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ch04, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]


def _aot_unsupported() -> str | None:
    """Why AOT cannot run with this Triton, or None."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    # Reading the API without importing triton here (that would happen before course_lib.device
    # could set TRITON_INTERPRET in this process): ask a subprocess.
    probe = ("import inspect, triton, triton.compiler as c\n"
             "from triton.backends.compiler import GPUTarget\n"
             "p = inspect.signature(c.ASTSource).parameters\n"
             "assert 'constexprs' in p and 'attrs' in p, list(p)\n"
             "from triton.backends.nvidia.compiler import get_ptxas\n"
             "print(get_ptxas(90).path)\n")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            cwd=ROOT, env=env, timeout=120)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["?"])[-1]
        return f"this Triton's AOT API differs from the one course_lib.kernels.aot uses: {last}"
    return None


def run_aot(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "course_lib.kernels.aot", *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)


@pytest.fixture(scope="module")
def aot_ready():
    reason = _aot_unsupported()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def probe(aot_ready):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.pop("COURSE_BACKEND", None)
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "aot_probe.py")],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_aot_compiles_what_the_jit_compiles(probe):
    assert probe["same_as_jit"] == {name: True for name in probe["same_as_jit"]}
    # the comparison can tell: without the integers' hints it is another kernel
    assert probe["without_integer_hints_same_as_jit"] is False


def test_each_check_trips_on_a_launch_that_breaks_it(probe):
    assert probe["good"] == {name: [] for name in probe["good"]}
    bad = {name: " | ".join(found) for name, found in probe["bad"].items()}
    assert "register spills" in bad["spills"]
    assert "scalar 2-byte global loads" in bad["unaligned_kv"]
    assert "fewer than two tiles in flight" in bad["one_buffer"]
    assert "shared memory" in bad["shared_memory"]


def test_variants_cover_every_kernel_and_dtype(aot_ready):
    out = run_aot("--list")
    assert out.returncode == 0, out.stderr
    for kernel in ("decode", "lse reduce", "prefill", "reshape_and_cache", "copy_blocks"):
        for dtype in ("fp16", "bf16", "fp32"):
            assert f"  {kernel} {dtype}" in out.stdout, (kernel, dtype)
    assert "splits=1" in out.stdout            # a decode launch without the reduce kernel


def test_every_gpu_variant_compiles_for_sm90_and_passes(aot_ready):
    out = run_aot("--no-save")
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    done, total = summary.split()[0].split("/")
    assert done == total and int(total) >= 60, summary
    assert "FAIL" not in out.stdout
