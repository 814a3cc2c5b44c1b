"""`python -m taskgate_local.wheelhouse`: every wheel the packaging tests install into their clean environments, fetched
once by `make venv` into the virtual environment's `wheelhouse/`, so that `make test` needs no package index afterwards.

It holds the dependencies of the three distributions (taskgate, taskgate-client, taskgate-api) for this Python, and the
client's and the API's for the oldest Python the client supports when this machine has one (the client's test runs
there), all at the versions of constraints.txt. The three themselves are not in it: the tests build them from the
checkout they test."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints.txt"
CLIENT_PYTHON = "3.10"


def location() -> Path:
    """The wheelhouse of the virtual environment running this."""
    return Path(sys.prefix) / "wheelhouse"


def complete_marker() -> Path:
    """Written last: a wheelhouse without it was interrupted and is rebuilt."""
    return location() / ".complete"


def python_for_client() -> str:
    """The oldest Python the client supports when this machine has it (on PATH or under pyenv), else this one."""
    candidates = [shutil.which(f"python{CLIENT_PYTHON}"),
                  *sorted(map(str, Path.home().glob(f".pyenv/versions/{CLIENT_PYTHON}.*/bin/python{CLIENT_PYTHON}")))]
    for found in filter(None, candidates):
        if subprocess.run([found, "-c", "pass"], capture_output=True, check=False).returncode == 0:
            return found
    return sys.executable


DISTRIBUTIONS = (ROOT / "clients" / "api", ROOT / "clients" / "python", ROOT)  # taskgate-api first: the others pin it


def _client_requirements() -> list[str]:
    """The client's and the API's own dependencies (not each other)."""
    found: list[str] = []
    for folder in DISTRIBUTIONS[:2]:
        project = tomllib.loads((folder / "pyproject.toml").read_text())
        found += [r for r in project["project"]["dependencies"] if not r.startswith("taskgate")]
    return list(dict.fromkeys(found))


def build() -> Path:
    """Fills the wheelhouse (needs the package index or pip's cache); the three distributions themselves are left
    out."""
    where = location()
    shutil.rmtree(where, ignore_errors=True)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "-q", "--no-build-isolation", "-c", str(CONSTRAINTS), "-w", str(where),
                    *map(str, DISTRIBUTIONS)], check=True, cwd=ROOT)
    client_python = python_for_client()
    if client_python != sys.executable:
        version = subprocess.run(
            [client_python, "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        subprocess.run(
            [
                *pip,
                "download",
                "-q",
                "--only-binary",
                ":all:",
                "--python-version",
                version,
                "-c",
                str(CONSTRAINTS),
                "-d",
                str(where),
                *_client_requirements(),
            ],
            check=True,
            cwd=ROOT,
        )
    for own in where.glob("taskgate*.whl"):
        own.unlink()  # the tests build these from the checkout they test
    complete_marker().touch()
    return where


if __name__ == "__main__":
    print(build())
