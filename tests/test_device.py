"""course_lib.device: one backend per process; Triton's interpreter is on before triton loads."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from course_lib import device

pytestmark = pytest.mark.ch00

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = device.BACKEND.triton_version is not None

# Runs first in each child: record TRITON_INTERPRET every time `triton` is looked up on import.
WATCH = """
import json, os, sys
lookups = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "triton":
            lookups.append(os.environ.get("TRITON_INTERPRET"))
        return None
sys.meta_path.insert(0, Watch())
"""


def run_child(code: str, **env: str) -> dict:
    """Run `code` in a fresh python with CUDA hidden; it prints one JSON object, returned here."""
    child_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child_env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), **env)
    proc = subprocess.run(
        [sys.executable, "-c", WATCH + textwrap.dedent(code)],
        env=child_env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_without_cuda_the_interpreter_is_on_before_triton_is_imported():
    out = run_child("""
        import course_lib.device as d
        loaded_by_device = "triton" in sys.modules
        from course_lib.kernels import smoke   # imports triton
        print(json.dumps(dict(
            name=d.BACKEND.name, device=d.BACKEND.device, interpreted=d.BACKEND.interpreted,
            in_time=d.BACKEND.interpret_set_in_time, loaded_by_device=loaded_by_device,
            env_at_import=lookups[-1], kernel=type(smoke._add_kernel).__name__,
            matched=smoke.check_add(300).matched)))
    """)
    assert out["loaded_by_device"] is False, "device must decide without importing triton"
    assert out["env_at_import"] == "1", "TRITON_INTERPRET must be 1 when triton is first imported"
    assert out["kernel"] == "InterpretedFunction"
    assert (out["name"], out["device"]) == ("triton-interpreter", "cpu")
    assert out["interpreted"] and out["in_time"]
    assert out["matched"]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_imported_first_is_reported_not_hidden():
    out = run_child("""
        import warnings
        import triton
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import course_lib.device as d
        print(json.dumps(dict(
            name=d.BACKEND.name, in_time=d.BACKEND.interpret_set_in_time,
            env=os.environ.get("TRITON_INTERPRET"), describe=d.describe(),
            warnings=[str(w.message) for w in caught if w.category is RuntimeWarning])))
    """)
    assert out["name"] == "triton-interpreter"
    assert out["in_time"] is False
    assert out["env"] == "1"  # kernels defined from now on are still interpreted
    assert len(out["warnings"]) == 1 and "imported before" in out["warnings"][0]
    assert "after triton was imported" in out["describe"]


def test_without_triton_the_torch_reference_runs():
    out = run_child("""
        sys.modules["triton"] = None   # as if triton were not installed
        import course_lib.device as d
        from course_lib.kernels import smoke
        print(json.dumps(dict(
            name=d.BACKEND.name, triton=d.BACKEND.triton_version,
            interpreted=d.BACKEND.interpreted, env=os.environ.get("TRITON_INTERPRET"),
            describe=d.describe(), matched=smoke.check_add(300).matched)))
    """)
    assert out["name"] == "torch-reference"
    assert out["triton"] is None and out["interpreted"] is False
    assert out["env"] is None
    assert "no triton" in out["describe"]
    assert out["matched"]


def test_backend_matches_this_machine():
    import torch

    b = device.backend()
    assert b is device.BACKEND
    forced = os.environ.get("TRITON_INTERPRET") == "1"
    if not HAS_TRITON:
        assert b.name == "torch-reference"
    elif torch.cuda.is_available() and not forced:
        assert (b.name, b.device, b.interpreted) == ("triton-cuda", "cuda", False)
        assert b.gpu_name
    else:
        assert b.name == "triton-interpreter" and b.interpreted
        assert os.environ["TRITON_INTERPRET"] == "1"
    if b.device == "cpu":
        assert b.gpu_name is None


def test_describe_is_one_line_naming_backend_and_versions():
    line = device.describe()
    assert "\n" not in line
    assert line.startswith(f"backend {device.BACKEND.name} on ")
    assert f"torch {device.BACKEND.torch_version}" in line
    if HAS_TRITON:
        assert f"triton {device.BACKEND.triton_version}" in line


def test_backend_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        device.BACKEND.name = "something-else"
