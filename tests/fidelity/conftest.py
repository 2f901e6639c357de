"""The fidelity harness (`make test-fidelity`): the course's V1 and radix managers run beside
vLLM 0.33.0's and SGLang 0.5.23's own code.

Skipped unless COURSE_FIDELITY=1 (`make test-fidelity` sets it, after tests/fidelity/fetch.py
filled the cache folder, COURSE_FIDELITY_CACHE, ``.fidelity-cache`` by default): plain
`make test` collects these files and skips them, needing no download.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ENABLED = os.environ.get("COURSE_FIDELITY") == "1"
CACHE = Path(os.environ.get("COURSE_FIDELITY_CACHE", ROOT / ".fidelity-cache"))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


def pytest_collection_modifyitems(config, items):
    if ENABLED:
        return
    skip = pytest.mark.skip(reason="fidelity harness: run `make test-fidelity`")
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(skip)


def _source(name: str) -> Path:
    root = CACHE / name
    if not root.is_dir():
        pytest.fail(f"{root} is missing: run `python tests/fidelity/fetch.py {CACHE}` "
                    "(make test-fidelity does)")
    return root


@pytest.fixture(scope="session")
def vllm():
    """vLLM 0.33.0's KV-cache modules (``vllm.block_pool``, ``vllm.kv_cache_utils``, ...)."""
    import upstream

    return upstream.load_vllm(_source("vllm-0.33.0"))


@pytest.fixture(scope="session")
def sglang():
    """SGLang 0.5.23's radix-cache modules (``sglang.radix_cache``, ...)."""
    import upstream

    return upstream.load_sglang(_source("sglang-0.5.23"))


@pytest.fixture(scope="session")
def sglang_allocators():
    """SGLang 0.5.23's slot allocators (``sglang_allocators.token``, ``.paged``)."""
    import upstream

    return upstream.load_sglang_allocators(_source("sglang-0.5.23"))


@pytest.fixture(scope="session")
def vllm_scheduler():
    """vLLM 0.33.0's V1 scheduler and the modules under it (``vllm_scheduler.scheduler``,
    ``.request``, ``.outputs``, ``.base``, ``.kv_cache_manager``, ...)."""
    import upstream

    return upstream.load_vllm_scheduler(_source("vllm-0.33.0"))


@pytest.fixture(scope="session")
def vllm_offloading():
    """vLLM 0.33.0's V1 scheduler with its offloading connector's scheduler side and CPU
    manager (``vllm_offloading.offloading_scheduler``, ``.manager``, ``.scheduler``, ...)."""
    import upstream

    return upstream.load_vllm_offloading(_source("vllm-0.33.0"))
