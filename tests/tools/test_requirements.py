"""requirements-cpu.txt is what `make test` installs on a fresh machine (CI), so it must name
every package pyproject's dependencies and test extra name: a package installed by hand in a
working venv and missing here fails only on CI's clean clone."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _names(specs):
    # "uvicorn[standard]>=1" -> "uvicorn"; names compare case- and dash/underscore-blind (PEP 503)
    return {re.split(r"[\[<>=!~ ;]", s.strip(), maxsplit=1)[0].lower().replace("_", "-") for s in specs}


def test_requirements_cpu_names_every_dependency_and_test_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = _names(project["dependencies"]) | _names(project["optional-dependencies"]["test"])
    lines = [line.split("#", 1)[0] for line in (ROOT / "requirements-cpu.txt").read_text().splitlines()]
    pinned = _names(line for line in lines if line.strip())
    missing = sorted(wanted - pinned)
    assert not missing, f"requirements-cpu.txt lacks {missing} (pyproject names them)"
