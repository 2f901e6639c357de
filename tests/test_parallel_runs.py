"""How `make test` shares the work out (tests/conftest.py) and how many examples a property
test draws (tests/property_budget.py): a notebook's cells stay on one worker (they share one
kernel), a module that builds a fixture once stays on one worker, every other test is a unit of
its own; `-n auto` counts the CPUs this process may use; the deep profile scales every count."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from hypothesis import settings
from property_budget import examples

pytestmark = pytest.mark.ch00
ROOT = Path(__file__).resolve().parents[1]


def _load_conftest():
    """tests/conftest.py as a module of its own (pytest imports every rootless conftest.py
    under the one name ``conftest``, so that name may be another folder's)."""
    spec = importlib.util.spec_from_file_location("course_tests_conftest",
                                                  ROOT / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


conftest = _load_conftest()


def test_a_notebook_is_one_unit_of_work():
    cells = [f"notebooks/07_scheduling_and_preemption.ipynb::Cell {i}" for i in range(30)]
    assert {conftest.work_unit(ROOT, c) for c in cells} == \
        {"notebooks/07_scheduling_and_preemption.ipynb"}
    assert conftest.work_unit(ROOT, "notebooks/00_setup.ipynb::Cell 0") != \
        conftest.work_unit(ROOT, "notebooks/01_kv_cache_cost.ipynb::Cell 0")


def test_a_module_that_builds_a_fixture_once_is_one_unit_and_others_are_split():
    # test_aot_hopper.py compiles its probe once (scope="module"); test_bench.py shares nothing
    probe = ["tests/test_aot_hopper.py::test_aot_compiles_what_the_jit_compiles",
             "tests/test_aot_hopper.py::test_each_check_trips_on_a_launch_that_breaks_it"]
    assert {conftest.work_unit(ROOT, n) for n in probe} == {"tests/test_aot_hopper.py"}
    alone = ["tests/test_bench.py::test_chaos_bench_runs_quick_and_breaks_nothing",
             "tests/test_bench.py::test_disagg_bench_runs_quick"]
    assert [conftest.work_unit(ROOT, n) for n in alone] == alone


@pytest.mark.parametrize("source, once", [
    ('@pytest.fixture(scope="module")\ndef m():\n    return 1\n', True),
    ('@fixture(scope="session")\ndef s():\n    return 1\n', True),
    ('@pytest.fixture(scope="package", autouse=True)\ndef p():\n    return 1\n', True),
    ('@pytest.fixture\ndef f():\n    return 1\n', False),
    ('@pytest.fixture()\ndef f():\n    return 1\n', False),
    ('@pytest.fixture(scope="function")\ndef f():\n    return 1\n', False),
    ('@functools.cache\ndef helper(scope="module"):\n    return 1\n', False),
])
def test_a_fixture_built_once_is_told_from_one_built_per_test(tmp_path, source, once):
    path = tmp_path / "test_x.py"
    path.write_text("import functools\n\nimport pytest\nfrom pytest import fixture\n\n\n"
                    + source, encoding="utf-8")
    assert conftest._builds_a_fixture_once(path) is once
    assert conftest.work_unit(tmp_path, "test_x.py::test_y") == \
        ("test_x.py" if once else "test_x.py::test_y")


def test_auto_counts_the_cpus_this_process_may_use(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    n = conftest.pytest_xdist_auto_num_workers(None)
    assert 1 <= n <= len(os.sched_getaffinity(0))
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert conftest.pytest_xdist_auto_num_workers(None) == 3


def test_the_deep_profile_scales_each_tests_own_count():
    current = settings.default
    assert examples(150) == 150 * current.max_examples // 100
    try:
        settings.load_profile("deep")
        assert settings.default.max_examples == 1000 and examples(150) == 1500
        assert examples(1) == 10
    finally:
        settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
    assert settings.default.max_examples == current.max_examples
