"""course_lib.device: one backend per process; Triton's interpreter is on before triton loads;
COURSE_BACKEND forces a backend, refuses one this machine cannot run, and torch-reference never
loads Triton."""

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


# Makes torch report a GPU (without touching one): the choice is made, no kernel may run.
FAKE_CUDA = """
import torch
torch.cuda.is_available = lambda: True
"""


def start_child(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh python with CUDA hidden and neither TRITON_INTERPRET nor
    COURSE_BACKEND inherited (unless given in `env`)."""
    child_env = {k: v for k, v in os.environ.items()
                 if k not in ("TRITON_INTERPRET", "COURSE_BACKEND")}
    child_env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
    return subprocess.run(
        [sys.executable, "-c", WATCH + textwrap.dedent(code)],
        env=child_env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )


def run_child(code: str, **env: str) -> dict:
    """Run `code` (see start_child); it prints one JSON object, returned here."""
    proc = start_child(code, **env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_error(code: str, **env: str) -> str:
    """Run `code` (see start_child), which must fail; the last line of its traceback."""
    proc = start_child(code, **env)
    assert proc.returncode != 0, proc.stdout
    return proc.stderr.strip().splitlines()[-1]


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
    assert b.forced == bool(os.environ.get("COURSE_BACKEND", "").strip())
    forced = os.environ.get("TRITON_INTERPRET") == "1"
    if b.forced:
        assert b.name == os.environ["COURSE_BACKEND"].strip()
    elif not HAS_TRITON:
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


# --- COURSE_BACKEND -------------------------------------------------------------------------

REPORT = """
print(json.dumps(dict(name=d.BACKEND.name, device=d.BACKEND.device, forced=d.BACKEND.forced,
                      interpreted=d.BACKEND.interpreted, env=os.environ.get("TRITON_INTERPRET"),
                      triton_loaded="triton" in sys.modules,
                      # describe() asks a GPU its name: not under FAKE_CUDA
                      describe=d.describe() if d.BACKEND.device == "cpu" else None)))
"""


def test_unset_or_empty_course_backend_is_the_automatic_choice():
    for env in ({}, {"COURSE_BACKEND": ""}):
        out = run_child("import course_lib.device as d" + REPORT, **env)
        assert out["name"] == ("triton-interpreter" if HAS_TRITON else "torch-reference")
        assert out["forced"] is False and "COURSE_BACKEND" not in out["describe"]


def test_torch_reference_is_chosen_and_never_loads_triton():
    out = run_child("""
        import importlib, pkgutil
        import torch
        import course_lib
        import course_lib.device as d
        for m in pkgutil.walk_packages(course_lib.__path__, "course_lib."):   # every module
            if not m.name.endswith("__main__"):
                importlib.import_module(m.name)
        from course_lib import kernels
        from course_lib.kernels import cache_ops, smoke
        from course_lib.kernels.batch import make_paged_batch
        from course_lib.kernels.reference import paged_attention_ref
        b = make_paged_batch([5, 17], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                             seed=0)
        args = (b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens)
        same = torch.equal(kernels.paged_attention(*args), paged_attention_ref(*args))
        k = torch.randn(2, 2, 16)
        cache_ops.reshape_and_cache(k, k, b.key_cache, b.value_cache, torch.tensor([0, 1]))
        added = smoke.check_add(100).matched
        try:
            kernels.paged_attention(*args, impl="triton")
            refused = ""
        except ValueError as e:
            refused = str(e)
        print(json.dumps(dict(same=same, added=added, refused=refused,
                              chosen=kernels.choose_impl(b.query, b.key_cache, b.seq_lens),
                              name=d.BACKEND.name, forced=d.BACKEND.forced,
                              env=os.environ.get("TRITON_INTERPRET"), describe=d.describe(),
                              triton_loaded="triton" in sys.modules)))
    """, COURSE_BACKEND="torch-reference")
    assert (out["name"], out["forced"]) == ("torch-reference", True)
    assert out["triton_loaded"] is False, "no course_lib module may import triton here"
    assert out["env"] is None
    assert out["same"] and out["added"] and out["chosen"] == "reference"
    assert "needs Triton" in out["refused"]
    assert "chosen by COURSE_BACKEND" in out["describe"]
    if HAS_TRITON:
        assert f"triton {device.BACKEND.triton_version} not used" in out["describe"]


def test_the_detector_of_a_triton_import_can_fail():
    # The same check as above, on a run that does import triton: it must see it.
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    out = run_child("import course_lib.device as d\nfrom course_lib.kernels import smoke"
                    + REPORT, COURSE_BACKEND="triton-interpreter")
    assert out["triton_loaded"] is True


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_interpreter_can_be_forced_even_where_cuda_is():
    out = run_child(FAKE_CUDA + "import course_lib.device as d" + REPORT,
                    COURSE_BACKEND="triton-interpreter")
    assert (out["name"], out["interpreted"], out["forced"]) == ("triton-interpreter", True, True)
    assert out["env"] == "1" and out["triton_loaded"] is False


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_cuda_is_chosen_where_cuda_is():
    out = run_child(FAKE_CUDA + "import course_lib.device as d" + REPORT,
                    COURSE_BACKEND="triton-cuda")
    assert (out["name"], out["device"], out["interpreted"]) == ("triton-cuda", "cuda", False)
    assert out["env"] is None and out["forced"] is True


@pytest.mark.parametrize("value, fake_cuda, interpret, reason", [
    ("triton_cuda", False, None, "is not a backend"),
    ("cuda", True, None, "is not a backend"),
    ("triton-cuda", False, None, "torch sees no CUDA device"),
    ("triton-cuda", True, "1", "TRITON_INTERPRET=1"),
])
def test_impossible_or_unknown_choices_fail_at_import(value, fake_cuda, interpret, reason):
    if "no CUDA" not in reason and "not a backend" not in reason and not HAS_TRITON:
        pytest.skip("triton is not installed")
    env = {"COURSE_BACKEND": value}
    if interpret:
        env["TRITON_INTERPRET"] = interpret
    last = child_error((FAKE_CUDA if fake_cuda else "") + "import course_lib.device", **env)
    assert last.startswith("ValueError: ") and reason in last
    assert repr(value) in last
    assert "triton-cuda, triton-interpreter, torch-reference" in last


@pytest.mark.parametrize("value", ["triton-cuda", "triton-interpreter"])
def test_a_triton_backend_without_triton_fails_at_import(value):
    last = child_error(FAKE_CUDA + 'sys.modules["triton"] = None\nimport course_lib.device',
                       COURSE_BACKEND=value)
    assert last.startswith("ValueError: ") and "Triton is not installed" in last
    assert repr(value) in last and "possible on this machine: torch-reference " in last


def test_torch_reference_without_triton_is_forced_too():
    out = run_child('sys.modules["triton"] = None\nimport course_lib.device as d' + REPORT,
                    COURSE_BACKEND=" torch-reference ")
    assert (out["name"], out["forced"]) == ("torch-reference", True)
    assert "no triton" in out["describe"]
