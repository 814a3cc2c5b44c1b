"""What an organisation depending on a taskgate release relies on: a licence, one version everywhere it is shown, and
the taskgate.v1 API's compatibility promise, checked by buf against the previous release's protos."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import grpc
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from taskgate_client import TaskgateError, __version__, connect_async
from taskgate_local import buf
from tests.support.harness import ROOT


def test_the_three_distributions_are_apache_2_licensed_with_the_text() -> None:
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License\n")
    for name in ("taskgate", "taskgate-client", "taskgate-api"):
        meta = metadata.metadata(name)
        assert meta["License-Expression"] == "Apache-2.0", name


def test_one_version_for_the_three_distributions_and_the_cli() -> None:
    assert (
        metadata.version("taskgate")
        == metadata.version("taskgate-client")
        == metadata.version("taskgate-api")
        == __version__
    )
    server, client = metadata.requires("taskgate") or [], metadata.requires("taskgate-client") or []
    pin = f"taskgate-api=={__version__}"
    assert pin in server and pin in client, "the server and the client both pin the API at their own version"
    assert f'taskgate-client=={__version__}; extra == "local"' in server, "only `make run`'s tooling needs the client"
    assert not any(r.startswith("taskgate-client") and "extra" not in r for r in server), (
        "the server itself needs no client"
    )
    assert not any(r.startswith("taskgate") for r in metadata.requires("taskgate-api") or []), (
        "the API depends on neither side"
    )
    shown = subprocess.run([str(Path(sys.executable).parent / "taskgate"), "--version"], capture_output=True, text=True,
                           check=True, timeout=60)
    assert shown.stdout.strip() == f"taskgate {__version__}"


def test_the_changelog_has_an_entry_for_this_release() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    assert f"## [{__version__}] - " in changelog


async def test_the_sdk_names_itself_and_its_version_in_the_user_agent() -> None:
    seen: list[str] = []

    class Recorder(grpc.GenericRpcHandler):
        def service(self, details: grpc.HandlerCallDetails) -> Any:
            seen.extend(str(value) for key, value in details.invocation_metadata or () if key == "user-agent")
            return None  # UNIMPLEMENTED: only the call's metadata matters here

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([Recorder()])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with connect_async(f"127.0.0.1:{port}", "tg_unused") as client:
            with pytest.raises(TaskgateError):
                await client.get("1")
    finally:
        await server.stop(0)
    assert seen and seen[0].startswith(f"taskgate-sdk/{__version__} "), seen


@pytest.fixture(scope="module")
def buf_binary() -> Path:
    found = buf.binary()
    if found is None:
        pytest.skip("no buf binary: `make venv` installs it with npm into .venv/buf (npm was missing or offline)")
    return found


def test_the_api_keeps_its_promise_against_the_previous_release(buf_binary: Path, tmp_path: Path) -> None:
    released = buf.released_protos(tmp_path)
    if released is None:
        pytest.skip(f"the previous release's tag {buf.PREVIOUS_RELEASE} is not in this clone (git fetch --tags)")
    assert buf.lint(buf_binary) == ""
    assert buf.breaking(buf_binary, released) == ""


def test_buf_breaking_catches_a_removed_field_and_lint_a_misnamed_enum(buf_binary: Path, tmp_path: Path) -> None:
    changed = tmp_path / "protos"
    shutil.copytree(buf.PROTOS, changed)
    task = changed / "taskgate" / "v1" / "task.proto"
    source = task.read_text()
    assert "  string prompt = 5;\n" in source
    task.write_text(source.replace("  string prompt = 5;\n", "") + "\nenum Shade {\n  DARK = 0;\n}\n")
    assert "prompt" in buf.breaking(buf_binary, released=buf.PROTOS, protos=changed)
    assert "_UNSPECIFIED" in buf.lint(buf_binary, changed) and buf.lint(buf_binary) == ""


# --- the hash-locked requirements the images install (requirements/, `make lock`) ---------------------------------

REQUIREMENTS = ROOT / "requirements"
LOCKS = ("build.txt", "api.txt", "worker.txt", "torch-cpu.txt", "torch-cuda.txt")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_entries(name: str) -> dict[str, tuple[Requirement, list[str]]]:
    """A lock file's entries: canonical name -> (the requirement, its --hash values)."""
    found: dict[str, tuple[Requirement, list[str]]] = {}
    for entry in re.split(r"\n(?=\S)", (REQUIREMENTS / name).read_text()):
        lines = [line.strip().rstrip("\\").strip() for line in entry.splitlines() if not line.startswith("#")]
        if not lines:
            continue
        requirement = Requirement(lines[0])
        found[canonical(requirement.name)] = (requirement, [h.removeprefix("--hash=") for h in lines[1:]])
    return found


def pinned(requirement: Requirement) -> Version:
    (spec,) = requirement.specifier
    assert spec.operator == "==", f"{requirement}: a lock pins exactly"
    return Version(spec.version)


def constraints() -> dict[str, Version]:
    found = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            requirement = Requirement(line)
            found[canonical(requirement.name)] = pinned(requirement)
    return found


def pyprojects() -> list[dict[str, Any]]:
    """The project's distributions: the root's and every client's."""
    files = [ROOT / "pyproject.toml", *sorted(ROOT.glob("clients/*/pyproject.toml"))]
    return [tomllib.loads(path.read_text()) for path in files]


def closure(roots: list[Requirement]) -> set[str]:
    """The distributions `roots` pull in, transitively, as the installed environment's metadata says (markers for this
    Python; extras followed). Distributions this environment does not hold (the CUDA wheels) end the walk there."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(r, frozenset(r.extras)) for r in roots]
    while todo:
        requirement, extras = todo.pop()
        key = (canonical(requirement.name), extras)
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = metadata.requires(requirement.name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            child = Requirement(text)
            if child.marker is None or any(child.marker.evaluate({"extra": e}) for e in extras or {""}):
                todo.append((child, frozenset(child.extras)))
    return {name for name, _ in seen}


def test_every_lock_entry_is_an_exact_pin_with_sha256_hashes() -> None:
    for name in LOCKS:
        entries = lock_entries(name)
        assert entries, f"requirements/{name} is empty"
        for dist, (requirement, hashes) in entries.items():
            pinned(requirement)
            assert hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), (
                f"{name}: {dist} has no hash"
            )


def test_locked_versions_are_the_constraints_pins() -> None:
    pins = constraints()
    for name in ("api.txt", "worker.txt", "torch-cpu.txt"):
        for dist, (requirement, _) in lock_entries(name).items():
            assert dist in pins, (
                f"requirements/{name}: {dist} is not in constraints.txt (run make constraints, make lock)"
            )
            assert Version(pinned(requirement).public) == pins[dist], (
                f"requirements/{name}: {requirement} != {pins[dist]}"
            )
    cuda = lock_entries("torch-cuda.txt")
    worker = lock_entries("worker.txt")
    assert (
        pinned(cuda["torch"][0]) == pins["torch"] and pinned(lock_entries("torch-cpu.txt")["torch"][0]).local == "cpu"
    )
    assert not set(cuda) - {"torch"} & set(worker), "torch-cuda.txt adds only what worker.txt lacks"
    assert "torch" not in worker and not [d for d in worker if d.startswith("nvidia-")], (
        "the CPU worker has no CUDA wheel"
    )


def test_every_runtime_dependency_is_locked_and_nothing_of_the_project() -> None:
    own = {canonical(p["project"]["name"]) for p in pyprojects()}
    api, worker = lock_entries("api.txt"), lock_entries("worker.txt")
    runtime = [Requirement(r) for p in pyprojects() for r in p["project"]["dependencies"]]
    extra = [
        Requirement(r) for p in pyprojects() for r in p["project"].get("optional-dependencies", {}).get("worker", [])
    ]
    for lock, wanted in ((api, runtime), (worker, runtime + extra)):
        for requirement in wanted:
            dist = canonical(requirement.name)
            if dist in own or (dist == "torch" and lock is worker):
                continue
            assert dist in lock, f"{requirement} is not locked (make lock)"
            assert requirement.specifier.contains(pinned(lock[dist][0])), f"{lock[dist][0]} is outside {requirement}"
    for lock, roots in ((api, runtime), (worker, runtime + extra)):
        wanted_closure = closure([r for r in roots if canonical(r.name) not in own]) - {"torch"}
        missing = wanted_closure - set(lock) - own
        assert not missing, f"locked without their dependencies: {sorted(missing)} (make lock)"
    assert set(api) <= set(worker) and all(api[d][0] == worker[d][0] for d in api), "worker.txt extends api.txt"
    for name in LOCKS:
        assert not own & set(lock_entries(name)), f"requirements/{name} locks the project's own distributions"
    build = lock_entries("build.txt")
    for requires in {r for p in pyprojects() for r in p["build-system"]["requires"]}:
        requirement = Requirement(requires)
        assert requirement.specifier.contains(pinned(build[canonical(requirement.name)][0])), requires
