"""The import rules that keep the layout's arrows one-way, checked on every .py file's syntax tree.

services -> taskgate (core) -> taskgate_api; taskgate_client -> taskgate_api; taskgate_api -> neither (the stubs
taskgate_api.v1, Status, reason codes, webhook signing, the CLI contract: what both sides share); the core and the
services never import taskgate_client; taskgate_local -> anything; no production code imports taskgate_local; services
never import each other; a test module imports no other test
module (shared helpers live in tests/support, fixtures in a conftest.py); no service's modules import each other
in a cycle; a service's modules import its own settings group (or the common one), never another service's nor the
whole `Settings`, and no core module takes the whole `Settings` (each takes the narrowest group it reads); no module of
services/ or taskgate_client/ is past 500 lines but the listed ones; production code imports neither the tests nor the
bench, and no production setting is a test hook.
"""

from __future__ import annotations

import ast
import graphlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from taskgate.config import GROUPS, ModelSpec
from taskgate.states import Status as ServerStatus
from taskgate_api.v1 import task_pb2
from taskgate_client import Status
from tests.support.harness import ROOT

SKIPPED = {".venv", ".git", "build", "__pycache__", ".taskgate"}
PRODUCTION = ("taskgate", "services", "taskgate_client", "taskgate_api")
HEAVY = ("torch", "diffusers", "asyncpg", "nats")
# The settings group each service reads (taskgate.config); CommonSettings is every service's too.
SETTINGS_GROUPS = {
    "submit": "GatewaySettings", "scheduler": "SchedulerSettings", "worker": "WorkerSettings",
    "notifier": "NotifierSettings", "http": "HttpSettings",
}


@dataclass(frozen=True, slots=True)
class Import:
    """One imported module name (`from a import b` also yields `a.b`, which may be a submodule)."""

    module: str
    target: str
    line: int


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _python_files() -> Iterator[Path]:
    for folder, dirs, files in os.walk(ROOT):  # pruned as it goes: never a walk through .venv
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED and not d.endswith(".egg-info"))
        for name in sorted(files):
            if name.endswith(".py"):
                yield Path(folder) / name


def _imports(path: Path, root: Path = ROOT) -> Iterator[Import]:
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):  # every import, also those inside functions
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            yield Import(module, base, node.lineno)
            for alias in node.names:
                if alias.name != "*":
                    yield Import(module, f"{base}.{alias.name}", node.lineno)


def _service(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "services" else None


def broken_rule(imp: Import) -> str | None:
    """The rule `imp` breaks, or None."""
    module, target = imp.module, imp.target
    here, there = _service(module), _service(target)
    if here is not None and there is not None and here != there:
        return "a service imports another service"
    if _within(module, "taskgate") and (_within(target, "services") or _within(target, "taskgate_local")):
        return "the core imports a service or the local tooling"
    if (_within(module, "taskgate") or _within(module, "services")) and _within(target, "taskgate_client"):
        return "the server imports the client (what both share is in taskgate_api)"
    if _within(module, "taskgate_api") and any(_within(target, p) for p in ("taskgate", "taskgate_client", "services")):
        return "the API package imports the server or the client (both import it, it imports neither)"
    if _within(module, "taskgate_client"):
        if _within(target, "taskgate"):
            return "the client imports the server core (what both share is in taskgate_api)"
        if _within(target, "services") or _within(target, "taskgate_local"):
            return "the client imports server or local code"
    if any(_within(module, p) for p in PRODUCTION) and _within(target, "taskgate_local"):
        return "production code imports the local tooling"
    if any(_within(module, p) for p in PRODUCTION) and (_within(target, "tests") or _within(target, "bench")):
        return (
            "production code imports the tests or the bench (a test's model is a 'python' ModelSpec naming its factory)"
        )
    setting = target.removeprefix("taskgate.config.") if _within(target, "taskgate.config") else ""
    if (
        here is not None
        and setting.endswith("Settings")
        and setting not in {"CommonSettings", SETTINGS_GROUPS.get(here)}
    ):
        return f"a service takes settings beyond its own group ({SETTINGS_GROUPS.get(here)} and CommonSettings)"
    if _within(module, "taskgate") and module != "taskgate.config" and setting == "Settings":
        return "the core takes every setting (each core module takes the narrowest group it reads)"
    if (
        _within(module, "tests")
        and _within(target, "tests")
        and target != "tests"
        and not _within(target, "tests.support")
    ):
        return (
            "a test module imports another test module (shared helpers go in tests/support, fixtures in a conftest.py)"
        )
    return None


def test_every_module_keeps_the_import_rules() -> None:
    found: dict[str, int] = {}
    offending = []
    for path in _python_files():
        for imp in _imports(path):
            found[imp.module.split(".")[0]] = found.get(imp.module.split(".")[0], 0) + 1
            rule = broken_rule(imp)
            if rule is not None:
                offending.append(f"{path.relative_to(ROOT)}:{imp.line}  {imp.module} imports {imp.target}  ({rule})")
    # the scan must actually see each package, or a moved folder would make this test vacuous
    assert {"taskgate", "services", "taskgate_client", "taskgate_api", "taskgate_local", "tests"} <= found.keys(), found
    assert offending == [], "import rules broken:\n" + "\n".join(offending)


def test_the_rules_catch_each_kind_of_arrow() -> None:
    bad = [
        Import("services.scheduler.admin", "services.worker.engine", 1),
        Import("taskgate.store.tasks", "services.submit", 1),
        Import("taskgate.runtime", "taskgate_local.embedded", 1),
        Import("taskgate_client.cli", "taskgate.states", 1),
        Import("taskgate_client.cli", "taskgate", 1),
        Import("taskgate_client.aio", "services.scheduler", 1),
        Import("services.worker.runner", "taskgate_local.tinymodel", 1),
        Import("taskgate.states", "taskgate_client.types", 1),
        Import("taskgate.keys", "taskgate_client.cli", 1),
        Import("services.notifier.webhooks", "taskgate_client", 1),
        Import("taskgate_api.status", "taskgate.states", 1),
        Import("taskgate_api.cli", "taskgate_client.cli.output", 1),
        Import("taskgate_api.v1.task_pb2", "taskgate_local.protogen", 1),
        Import("taskgate_client.aio", "taskgate.v1.task_pb2", 1),
        Import("tests.integration.worker.test_backlog", "tests.integration.worker.test_worker", 1),
        Import("tests.integration.worker.test_backlog", "tests.integration.worker.test_worker.submit", 1),
        Import("tests.system.test_packaging", "tests.conftest", 1),
        Import("tests.support.stacks", "tests.integration.client.conftest", 1),
        Import("services.worker.engine", "taskgate.config.Settings", 1),
        Import("services.worker.engine", "taskgate.config.SchedulerSettings", 1),
        Import("services.http.api", "taskgate.config.GatewaySettings", 1),
        Import("taskgate.results", "taskgate.config.Settings", 1),
        Import("services.worker.runner", "tests.support.sleepy", 1),
        Import("taskgate.config", "bench.stack", 1),
    ]
    good = [
        Import("services.worker.engine", "services.worker.inference", 1),
        Import("services.worker.engine", "taskgate.store", 1),
        Import("taskgate_client.aio", "taskgate_api.v1.task_pb2", 1),
        Import("services.notifier.webhooks", "taskgate_api.webhook_signing", 1),
        Import("taskgate.keys", "taskgate_api.cli", 1),
        Import("taskgate_api.status", "taskgate_api.v1.task_pb2", 1),
        Import("taskgate_local.dev", "taskgate_client", 1),
        Import("tests.integration.client.test_cli", "taskgate_local.embedded", 1),
        Import("tests.integration.worker.test_backlog", "tests.support.factories", 1),
        Import("tests.conftest", "tests.support.harness.WorkerFactory", 1),
        Import("bench.stack", "tests.support.harness", 1),
        Import("services.worker.engine", "taskgate.config.WorkerSettings", 1),
        Import("services.submit.validation", "taskgate.config.GatewaySettings", 1),
        Import("services.http.api", "taskgate.config.CommonSettings", 1),
        Import("services.http.api", "taskgate.config.ModelSpec", 1),
        Import("taskgate.results", "taskgate.config.CommonSettings", 1),
        Import("taskgate_local.dev", "taskgate.config.Settings", 1),
        Import("tests.support.sleepy", "services.worker.runner", 1),
        Import("bench.device_busy", "tests.support.sleepy", 1),
    ]
    assert [imp for imp in bad if broken_rule(imp) is None] == []
    assert [(imp, broken_rule(imp)) for imp in good if broken_rule(imp) is not None] == []


def test_importing_the_client_loads_no_server_or_model_code() -> None:
    probe = (
        "import json, sys\n"
        "import taskgate_client, taskgate_client.cli\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    loaded: list[str] = json.loads(done.stdout)
    heavy = [name for name in loaded if any(_within(name, h) for h in HEAVY)]
    server = [name for name in loaded if _within(name, "taskgate") or _within(name, "services")]
    assert heavy == [] and server == [], f"`import taskgate_client` loaded {heavy + server}"


def test_importing_the_api_loads_neither_side() -> None:
    probe = (
        "import json, sys\n"
        "import taskgate_api, taskgate_api.cli, taskgate_api.reasons, taskgate_api.status, "
        "taskgate_api.webhook_signing\nfrom taskgate_api.v1 import admin_pb2_grpc, events_pb2_grpc, gateway_pb2_grpc, "
        "task_pb2_grpc, worker_pb2_grpc\nprint(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    loaded: list[str] = json.loads(done.stdout)
    assert "taskgate_api.v1.worker_pb2" in loaded
    sides = [n for n in loaded if any(_within(n, p) for p in ("taskgate", "taskgate_client", "services", *HEAVY))]
    assert sides == [], f"`import taskgate_api` loaded {sides}"


def test_the_clients_own_status_is_the_wire_enum() -> None:
    # 0: UNSPECIFIED
    wire = [v.name.removeprefix("TASK_STATUS_") for v in task_pb2.TaskStatus.DESCRIPTOR.values if v.number]
    assert [s.value for s in Status] == wire == [s.value for s in ServerStatus]
    assert all(Status.from_proto(s.to_proto()) is s and s.terminal == ServerStatus(s.value).terminal for s in Status)


# The store is the only author of SQL; migrate applies the schema files (its own ledger statements included).
SQL_AUTHORS = ("taskgate.store", "taskgate.sql", "taskgate.migrate")
DRIVER_CALLS = frozenset(
    {"execute", "executemany", "fetch", "fetchrow", "fetchval", "copy_records_to_table", "copy_to_table", "cursor"}
)


def _sql_uses(path: Path, root: Path = ROOT) -> Iterator[str]:
    module = _module_name(path, root)
    tree = ast.parse(path.read_text(), str(path))
    for imp in _imports(path, root):
        if _within(imp.target, "taskgate.sql"):
            yield f"{path.relative_to(root)}:{imp.line}  {module} imports {imp.target}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in DRIVER_CALLS:
            yield f"{path.relative_to(root)}:{node.lineno}  {module} calls .{node.func.attr}()"


def test_only_the_store_runs_sql() -> None:
    offending: list[str] = []
    checked = 0
    for path in _python_files():
        module = _module_name(path)
        if not any(_within(module, p) for p in PRODUCTION) or any(_within(module, a) for a in SQL_AUTHORS):
            continue
        checked += 1
        offending.extend(_sql_uses(path))
    assert checked > 30, checked  # the walk saw the services and the core
    assert offending == [], "SQL outside taskgate/store/:\n" + "\n".join(offending)


def test_the_sql_rule_catches_a_service_query(tmp_path: Path) -> None:
    sample = tmp_path / "services" / "submit" / "_probe_sql_rule.py"  # a service module, outside the checkout
    sample.parent.mkdir(parents=True)
    sample.write_text(
        "from taskgate import sql\n\nasync def f(pool):\n    return await pool.fetchval(sql.query('x'))\n"
    )
    found = list(_sql_uses(sample, root=tmp_path))
    assert [line.split("  ", 1)[1] for line in found] == [
        "services.submit._probe_sql_rule imports taskgate.sql",
        "services.submit._probe_sql_rule calls .fetchval()",
    ]


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """Each service's import cycles among its own modules (lazy imports inside functions count: a cycle is one
    whichever import runs first), one cycle per service at most (the first graphlib finds)."""
    modules = {_module_name(path, root): path for path in sorted((root / "services").rglob("*.py"))}

    def owner(target: str) -> str:  # `services.worker.runner.RunAborted` -> `services.worker.runner`
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target

    cycles = []
    for service in sorted({s for m in modules if (s := _service(m)) is not None}):
        graph = {
            module: {
                found
                for imp in _imports(path, root)
                if (found := owner(imp.target)) != module
                and _service(found) == service
                and found != f"services.{service}"
            }
            for module, path in modules.items()
            if _service(module) == service
        }
        try:
            tuple(graphlib.TopologicalSorter(graph).static_order())
        except graphlib.CycleError as cycle:
            cycles.append(list(cycle.args[1]))
    return cycles


def test_no_service_has_an_import_cycle() -> None:
    assert import_cycles() == [], "a service's modules import each other (move what both need to a module of its own)"


def test_the_cycle_rule_catches_two_modules_importing_each_other(tmp_path: Path) -> None:
    folder = tmp_path / "services" / "probe"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / "a.py").write_text("from .b import B\n\nA = 1\n")
    (folder / "b.py").write_text("B = 1\n\n\ndef f():\n    from services.probe.a import A\n\n    return A\n")
    (folder / "c.py").write_text("from . import a\n")
    cycles = import_cycles(tmp_path)
    assert len(cycles) == 1 and set(cycles[0]) == {"services.probe.a", "services.probe.b"}, cycles


# A module past this many lines is split by what it does (one concern per file, as ARCHITECTURE.md lists them).
MAX_MODULE_LINES = 500
SIZED = ("services", "taskgate_client")
# Still over, to be split in a later pass: each names its length when it was listed. Take a file off when it is split;
# never add one. (Empty since issue #40 split the last four.)
OVER_MAX_LINES: dict[str, int] = {}


def long_modules(root: Path = ROOT) -> dict[str, int]:
    """Each module of services/ and taskgate_client/ past MAX_MODULE_LINES, by its path from `root`: its line count."""
    found = {}
    for package in SIZED:
        for path in sorted((root / package).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > MAX_MODULE_LINES:
                found[path.relative_to(root).as_posix()] = lines
    return found


def test_no_module_is_past_500_lines_but_the_listed_ones() -> None:
    over = long_modules()
    assert over.keys() - OVER_MAX_LINES.keys() == set(), f"split these by what they do: {over}"
    # a listed file split since (or shortened below the bound) comes off the list
    assert OVER_MAX_LINES.keys() - over.keys() == set(), "no longer over the bound: take them off OVER_MAX_LINES"


def test_the_length_rule_catches_a_long_module(tmp_path: Path) -> None:
    (tmp_path / "services" / "probe").mkdir(parents=True)
    (tmp_path / "taskgate_client").mkdir()
    (tmp_path / "services" / "probe" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "services" / "probe" / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    assert long_modules(tmp_path) == {"services/probe/long.py": MAX_MODULE_LINES + 1}


TEST_HOOK = re.compile(r"\btest(s|ing)?\b|\bbench(mark)?s?\b|\bfault", re.IGNORECASE)


def test_no_production_setting_is_a_test_hook() -> None:
    """A test's or the bench's needs are met from their side (TestSignals, a 'python' model of tests/support): no field
    of a settings group or of ModelSpec exists for them (what says so in its description is one)."""
    classes: list[type[BaseModel]] = [*(group for group, _ in GROUPS), ModelSpec]
    fields = {
        f"{cls.__name__}.{name}": field.description or "" for cls in classes for name, field in cls.model_fields.items()
    }
    assert len(fields) > 200, len(fields)  # the walk saw every group and the model registry's fields
    hooks = {name: text for name, text in fields.items() if TEST_HOOK.search(text)}
    assert hooks == {}, "settings that exist for tests or the bench (meet the need from the test side):\n" + "\n".join(
        f"{name}: {text}" for name, text in hooks.items()
    )
