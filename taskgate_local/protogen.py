"""`python -m taskgate_local.protogen` (`make proto`): the gRPC code and its typed stubs, generated from protos/ into
taskgate_api/v1 (the taskgate-api distribution).

The protos keep their package `taskgate.v1` (the names on the wire, and what buf checks), so protoc writes modules that
import each other as `taskgate.v1.x_pb2` and register their classes under that module name. Here they live in
`taskgate_api.v1`, where no other distribution's `taskgate` package can shadow or share them; so after protoc ran, each
generated module's own references to `taskgate.v1.<module>` become `taskgate_api.v1.<module>`: its imports, the module
name its classes report (`__module__`, which pickling and reprs use) and its file path in messages. Proto file names
(`taskgate/v1/task.proto`) and full names (`taskgate.v1.TaskGateway`) are the wire's and stay. protoletariat would only
make the imports relative and leave the registered module name behind, hence these few rules.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from taskgate_local.protopath import include_dir

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
PROTO_PACKAGE = Path("taskgate") / "v1"
TARGET = ROOT / "taskgate_api" / "v1"
GENERATED = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py", "*_pb2_grpc.pyi")

# (pattern, replacement): only references to generated Python modules, never proto file names or full names
REWRITES = [
    (re.compile(r"^from taskgate\.v1 import ", re.M), "from taskgate_api.v1 import "),
    (re.compile(r"'taskgate\.v1\.(\w+_pb2)'"), r"'taskgate_api.v1.\1'"),
    (re.compile(r"\btaskgate/v1/(\w+_pb2(?:_grpc)?\.py)\b"), r"taskgate_api/v1/\1"),
]


def rewrite(source: str) -> str:
    """One generated module's text with its references to `taskgate.v1` modules pointing at `taskgate_api.v1`."""
    for pattern, replacement in REWRITES:
        source = pattern.sub(replacement, source)
    return source


def generate(into: Path) -> list[Path]:
    """Runs protoc (with mypy-protobuf's plugins from this environment) on protos/ and writes the rewritten modules
    into `into`; returns the files written."""
    protos = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / PROTO_PACKAGE).glob("*.proto"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", "-I.", f"-I{include_dir()}", f"--python_out={tmp}",
             f"--grpc_python_out={tmp}", f"--mypy_out={tmp}", f"--mypy_grpc_out={tmp}", *protos],
            cwd=PROTOS, env=env, capture_output=True, text=True, check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"protoc failed:\n{done.stdout}{done.stderr}")
        made = sorted(p for pattern in GENERATED for p in (Path(tmp) / PROTO_PACKAGE).glob(pattern))
        if not made:
            raise RuntimeError("protoc produced nothing")
        into.mkdir(parents=True, exist_ok=True)
        written = []
        for path in made:
            target = into / path.name
            target.write_text(rewrite(path.read_text()))
            written.append(target)
    return written


def main() -> None:
    written = generate(TARGET)
    for stale in sorted(p for pattern in GENERATED for p in TARGET.glob(pattern)):
        if stale not in written:
            stale.unlink()  # a module of a proto file that is gone
    print(f"{len(written)} files in {TARGET.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
