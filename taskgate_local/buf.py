"""`python -m taskgate_local.buf`: buf's lint of protos/ and its breaking-change check against the previous release's
protos (the git tag PREVIOUS_RELEASE), with the buf binary `make venv` installs from npm into .venv/buf.

buf resolves imports only inside its workspace, and gateway.proto imports google/rpc/status.proto (installed with
grpcio-status, not vendored here): each check runs on a copy of protos/ with that file beside it."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from taskgate_local.protopath import include_dir

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
PREVIOUS_RELEASE = "v0.1.0"
# the commit that tag names: a clone made without tags (CI's) still has it in main's history
PREVIOUS_RELEASE_COMMIT = "f65780ba22956f5894600b89bcfce6f999b50f0a"
STATUS_PROTO = Path("google") / "rpc" / "status.proto"


def binary() -> Path | None:
    """The buf executable: the one npm put into this virtual environment's buf/ folder, else one on PATH."""
    for found in sorted((Path(sys.prefix) / "buf" / "node_modules" / "@bufbuild").glob("buf-*/bin/buf")):
        return found
    on_path = shutil.which("buf")
    return Path(on_path) if on_path else None


def released_protos(into: Path, ref: str = PREVIOUS_RELEASE) -> Path | None:
    """protos/ as `ref` had them (the previous release: its tag, else its commit), written under `into`; None when
    this clone has neither."""
    candidates = [ref, PREVIOUS_RELEASE_COMMIT] if ref == PREVIOUS_RELEASE else [ref]
    found = [r for r in candidates if subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{r}^{{commit}}"],
                                                     cwd=ROOT, capture_output=True, check=False).returncode == 0]
    if not found:
        return None
    ref = found[0]
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref, "protos"], cwd=ROOT, capture_output=True, check=True
    )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into / "protos"


def workspace(protos: Path, into: Path) -> Path:
    """A copy of `protos` (taskgate/ only) with this checkout's buf.yaml and google/rpc/status.proto beside it."""
    shutil.copytree(protos / "taskgate", into / "taskgate")
    shutil.copy(PROTOS / "buf.yaml", into / "buf.yaml")
    (into / STATUS_PROTO).parent.mkdir(parents=True)
    shutil.copy(include_dir() / STATUS_PROTO, into / STATUS_PROTO)
    return into


def run(buf: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """buf with `args`, offline (no module cache or registry is needed for these inputs)."""
    return subprocess.run([str(buf), *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=120)


def lint(buf: Path, protos: Path = PROTOS) -> str:
    """What buf lint reports about `protos`; empty when it passes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = run(buf, "lint", cwd=workspace(protos, Path(tmp)))
    return "" if out.returncode == 0 else out.stdout + out.stderr


def breaking(buf: Path, released: Path, protos: Path = PROTOS) -> str:
    """What buf breaking reports about `protos` against `released`; empty when nothing released breaks."""
    with tempfile.TemporaryDirectory() as tmp:
        current, against = workspace(protos, Path(tmp) / "current"), workspace(released, Path(tmp) / "against")
        out = run(buf, "breaking", str(current), "--against", str(against), cwd=Path(tmp))
    return "" if out.returncode == 0 else out.stdout + out.stderr


def check(buf: Path, ref: str = PREVIOUS_RELEASE) -> list[str]:
    """What buf lint and buf breaking against `ref` report about protos/: empty when the API keeps its promise."""
    problems = [f"buf lint:\n{found}" for found in [lint(buf)] if found]
    with tempfile.TemporaryDirectory() as tmp:
        released = released_protos(Path(tmp), ref)
        if released is None:
            return [*problems, f"the previous release {ref} is not in this clone (git fetch --tags)"]
        problems += [f"buf breaking against {ref}:\n{found}" for found in [breaking(buf, released)] if found]
    return problems


def main() -> int:
    buf = binary()
    if buf is None:
        print(
            "no buf binary: `make venv` installs it with npm (npm install @bufbuild/buf into .venv/buf)",
            file=sys.stderr,
        )
        return 2
    problems = check(buf)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"buf lint and buf breaking against {PREVIOUS_RELEASE}: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
