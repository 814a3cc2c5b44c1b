"""What an organisation depending on a taskgate release relies on: a licence, one version everywhere it is shown, and the
taskgate.v1 API's compatibility promise, checked by buf against the previous release's protos."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import grpc
import pytest

from taskgate_client import TaskgateError, __version__, connect_async
from taskgate_local import buf
from tests.support.harness import ROOT


def test_both_distributions_are_apache_2_licensed_with_the_text() -> None:
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License\n")
    for name in ("taskgate", "taskgate-client"):
        meta = metadata.metadata(name)
        assert meta["License-Expression"] == "Apache-2.0", name


def test_one_version_for_both_distributions_and_the_cli() -> None:
    assert metadata.version("taskgate") == metadata.version("taskgate-client") == __version__
    assert f"taskgate-client=={__version__}" in (metadata.requires("taskgate") or []), "the server pins its own client"
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
