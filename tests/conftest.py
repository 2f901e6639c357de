"""Shared test setup: one torch thread, a hypothesis profile, chapter markers on notebooks.

torch is never imported here: pure-Python tests (course_lib.memory) must not pay for it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest

# Torch reads OMP_NUM_THREADS when it is first imported; a test or notebook kernel that imports
# it later then starts with one thread too. The fixture below covers a torch imported earlier.
os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    from hypothesis import settings
except ImportError:  # hypothesis is a dev extra; plain `pip install -e .` can still run tests
    settings = None

if settings is not None:
    # "ci": same examples every run (a failure reproduces), no deadline (2 slow cores).
    settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
    # "dev": random examples, more of them, to hunt for new failures locally.
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


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()
