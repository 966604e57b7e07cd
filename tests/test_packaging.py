"""The install is reproducible: every dependency the project declares is pinned in constraints.txt,
which the README's commands and CI install with (`pip install -e ".[test]" -c constraints.txt`)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_every_declared_dependency_is_pinned_and_within_its_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins()
    declared = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    for text in declared:
        req = Requirement(text)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in pins, f"{req.name} is declared in pyproject.toml but not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"constraints.txt pins {req.name}=={pins[name]}, outside pyproject.toml's {req.specifier}"


def test_the_readme_and_ci_install_with_the_constraints():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]" -c constraints.txt' in readme
    assert 'pip install -e . -c constraints.txt' in readme
    assert '-e ".[test]" -c constraints.txt' in ci
