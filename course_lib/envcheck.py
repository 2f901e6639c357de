"""Is this Python ready for the course? Versions for people, a missing-list for checks.

Chapter 00 calls :func:`report` (versions vary from machine to machine, so its output is not
compared) and :func:`missing` (empty on every ready machine, so its output is compared).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform

# import name -> distribution name. Triton is not here: without it the course still runs (on the
# torch reference), and course_lib.device says which backend was chosen.
REQUIRED = {
    "torch": "torch",
    "numpy": "numpy",
    "matplotlib": "matplotlib",
    "ipywidgets": "ipywidgets",
    "prometheus_client": "prometheus_client",
    "tqdm": "tqdm",
}
SHOWN = {**REQUIRED, "triton": "triton"}


def missing() -> list[str]:
    """Required packages that cannot be imported here (empty when the environment is ready)."""
    return [name for name in REQUIRED if importlib.util.find_spec(name) is None]


def versions() -> dict[str, str | None]:
    """Python's and each package's installed version; None when a package is not installed."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name, dist in SHOWN.items():
        try:
            found[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def report() -> str:
    """Versions, torch's thread count and the backend, one per line."""
    import torch

    from course_lib import device

    lines = [f"{name:<18}{version or 'not installed'}" for name, version in versions().items()]
    lines.append(f"{'torch threads':<18}{torch.get_num_threads()}")
    lines.append(device.describe())
    return "\n".join(lines)
