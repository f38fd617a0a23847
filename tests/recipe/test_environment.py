"""environment.yml (conda, for HPC centres) lists every dependency of pyproject.toml, with the same
bounds, from conda-forge only (the `pytorch` channel has no builds after PyTorch 2.5)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the package supports 3.10, where this test skips

REPO = Path(__file__).resolve().parents[2]
# PyPI name -> the conda-forge package that provides it (the same name where absent).
CONDA_NAME = {"torch": "pytorch", "matplotlib": "matplotlib-base"}
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(.*?)\s*(?:;.*)?$")


def split(requirement: str) -> tuple[str, str]:
    """('name', 'specifier') of a PEP 508 or conda match spec, name lower-cased, spaces dropped."""
    match = _REQUIREMENT.match(requirement)
    assert match, requirement
    return match.group(1).lower(), match.group(2).replace(" ", "")


def pyproject_requirements() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["test"]
    return dict(split(r) for r in requirements)


def conda_dependencies() -> tuple[dict, dict[str, str]]:
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    packages = dict(split(d) for d in env["dependencies"] if isinstance(d, str))
    return env, packages


def test_every_pyproject_dependency_is_in_environment_yml() -> None:
    _, packages = conda_dependencies()
    for name, spec in pyproject_requirements().items():
        conda = CONDA_NAME.get(name, name)
        assert conda in packages, f"environment.yml lacks {conda} (pyproject.toml: {name}{spec})"
        assert packages[conda] == spec, f"{conda}: environment.yml says {packages[conda]!r}, pyproject {spec!r}"


def test_conda_forge_only_and_the_package_itself() -> None:
    env, packages = conda_dependencies()
    assert env["channels"][0] == "conda-forge" and "pytorch" not in env["channels"]
    assert "python" in packages and "pip" in packages
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert "-e ." in pip
