"""Shared test setup: one torch thread, the hypothesis profiles, chapter markers on notebooks,
and how pytest-xdist shares the work out (``make test``: ``-n auto --dist loadgroup``).

torch is never imported here: pure-Python tests (course_lib.memory) must not pay for it.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import math
import os
import re
import sys
from pathlib import Path

import pytest

# Torch reads OMP_NUM_THREADS when it is first imported; a test or notebook kernel that imports
# it later then starts with one thread too. The fixture below covers a torch imported earlier.
os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    from hypothesis import settings
except ImportError:  # hypothesis is a dev extra; plain `pip install -e .` can still run tests
    settings = None

if settings is not None:
    # A property test names its own example count with tests/property_budget.py's
    # examples(n): n under the default of 100 examples (make test), scaled by the profile's.
    # "ci": same examples every run (a failure reproduces), no deadline (2 slow cores).
    settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
    # "deep": ten times the examples, still derandomized (.ci/run runs it on the property
    # tests alone: `-m hypothesis`).
    settings.register_profile("deep", deadline=None, derandomize=True, print_blob=True,
                              max_examples=1000)
    # "dev": random examples, five times as many, to hunt for new failures locally.
    settings.register_profile("dev", deadline=None, max_examples=500, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """torch.set_num_threads(1) once torch is loaded, without loading it for tests that don't."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    yield


_CHAPTER = re.compile(r"^(\d\d)_")


def pytest_collection_modifyitems(config, items):
    """Mark notebook cells `notebook` and `chNN` (from NN_topic.ipynb) for `-m ch00`; skip `gpu`
    tests when CUDA is absent."""
    cuda = None
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker("notebook")
            match = _CHAPTER.match(item.path.name)
            if match:
                item.add_marker(f"ch{match.group(1)}")
        if item.get_closest_marker("gpu") is not None:
            if cuda is None:
                cuda = _cuda_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))


# ---------------------------------------------------------------- pytest-xdist (make test)
# optionalhook: pytest-xdist is a dev extra, without it pytest never calls these; tryfirst: before
# xdist's own answers when this file is loaded as a plugin (`-p tests.conftest`, NBVAL_AGAIN).
@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per CPU this process may use (its affinity, capped by a cgroup's
    CPU quota), not the physical cores xdist counts by default (psutil sees the host's, not
    the container's); PYTEST_XDIST_AUTO_NUM_WORKERS overrides it."""
    given = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if given:
        return int(given)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cpus or 1)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`: a notebook runs whole on one worker (its cells share one kernel), and
    so does a test module that builds a fixture once (``scope="module"``: a process cluster, a
    compiled probe, a built book), so that it is built once; every other test goes to the next
    free worker. The groups are read from the node ids here, in the controller: xdist 3.8's own
    loadgroup reads ``xdist_group`` marks through a suffix it appends to ``item._nodeid``,
    which pytest 9.2 no longer reads (an item's nodeid comes from ``item._id``)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class NotebookAndModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(config.rootpath, nodeid)

    return NotebookAndModuleGroups(config, log)


def work_unit(rootpath: Path, nodeid: str) -> str:
    """What one worker runs together: the notebook's or module's path, else the test alone."""
    path = nodeid.split("::", 1)[0]
    if path.endswith(".ipynb") or _builds_a_fixture_once(rootpath / path):
        return path
    return nodeid


@functools.cache
def _builds_a_fixture_once(path: Path) -> bool:
    """Whether the test module at ``path`` defines a ``@pytest.fixture(scope=...)`` wider than a
    test (module, package or session)."""
    if path.suffix != ".py" or not path.is_file():
        return False
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef):
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and ast.unparse(deco.func).endswith("fixture"):
                    scope = next((k.value for k in deco.keywords if k.arg == "scope"), None)
                    if isinstance(scope, ast.Constant) and scope.value != "function":
                        return True
    return False


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()
