"""environment.yml (for conda users) stays in step with pyproject.toml (what `make` installs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

pytestmark = pytest.mark.ch00

ROOT = Path(__file__).resolve().parents[1]


def pins(lines: list[str]) -> dict[str, tuple[str, str]]:
    """name -> (specifier, marker), so "torch==2.13.0" and "Torch == 2.13.0" compare equal."""
    out = {}
    for line in lines:
        req = Requirement(line)
        out[canonicalize_name(req.name)] = (str(req.specifier), str(req.marker or ""))
    return out


def mismatches(project: list[str], conda_pip: list[str]) -> list[str]:
    """What differs between pyproject's requirements and environment.yml's pip entries."""
    want, have = pins(project), pins(conda_pip)
    problems = [f"{name}: missing from environment.yml" for name in want.keys() - have.keys()]
    problems += [f"{name}: in environment.yml but not in pyproject.toml"
                 for name in have.keys() - want.keys()]
    problems += [f"{name}: pyproject has {want[name]}, environment.yml has {have[name]}"
                 for name in want.keys() & have.keys() if want[name] != have[name]]
    return sorted(problems)


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


@pytest.fixture(scope="module")
def env() -> dict:
    return yaml.safe_load((ROOT / "environment.yml").read_text(encoding="utf-8"))


def conda_pip_entries(env: dict) -> list[str]:
    (pip_section,) = [d["pip"] for d in env["dependencies"] if isinstance(d, dict)]
    return pip_section


def editable_extras(entries: list[str]) -> set[str]:
    """The extras of the one "-e .[a,b]" entry: {"a", "b"} (empty set without brackets)."""
    (line,) = [e for e in entries if e.startswith("-e ")]
    target = line.removeprefix("-e ").strip()
    if "[" not in target:
        return set()
    return {x.strip() for x in target.split("[", 1)[1].rstrip("]").split(",") if x.strip()}


def test_environment_yml_is_a_conda_spec(env, project):
    assert env["name"] == "paged-kv-course"
    assert env["channels"] == ["conda-forge"]
    conda_deps = [d for d in env["dependencies"] if isinstance(d, str)]
    assert "python=3.11" in conda_deps and "pip" in conda_deps
    # the conda environment installs the project with every extra (dev, book, ...)
    assert editable_extras(conda_pip_entries(env)) == set(project["optional-dependencies"])


def test_pins_match_pyproject(project, env):
    wanted = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted += extra
    entries = [e for e in conda_pip_entries(env) if not e.startswith("-e ")]
    assert mismatches(wanted, entries) == []


def test_editable_extras_reads_the_e_line():
    assert editable_extras(["torch==2.13.0", "-e .[dev, book]"]) == {"dev", "book"}
    assert editable_extras(["-e .[dev]"]) == {"dev"}
    assert editable_extras(["-e ."]) == set()


def test_mismatches_catches_drift():
    project = ["torch==2.13.0", "triton==3.7.1; platform_system == 'Linux'", "tqdm"]
    conda = ["torch==2.12.0", "triton==3.7.1", "ruff"]
    assert mismatches(project, conda) == [
        "ruff: in environment.yml but not in pyproject.toml",
        "torch: pyproject has ('==2.13.0', ''), environment.yml has ('==2.12.0', '')",
        "tqdm: missing from environment.yml",
        "triton: pyproject has ('==3.7.1', 'platform_system == \"Linux\"'), "
        "environment.yml has ('==3.7.1', '')",
    ]
    assert mismatches(project, project) == []
